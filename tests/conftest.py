"""Test settings: cheap XLA:CPU compiles, one persistent compilation cache per run, strict
rank promotion, and a private user cache per process."""

import atexit
import os
import shutil
import tempfile


def _cheap_cpu_compiles(flags: str) -> str:
  """XLA_FLAGS with XLA:CPU's optimisation level 1 and LLVM's expensive passes off,
  unless `flags` already set a level.

  The tests compile thousands of small CPU programs (each simulated warpgroup of a
  Mosaic GPU interpret run is its own program; autotuning compiles every config) and
  run each on tiny inputs, so compiling dominates: measured on 2 cores (jax 0.11.2,
  2026-12-01), the fast tests took 7 min 5 s instead of 10 min 37 s (CPU time 13.5
  instead of 20.4 min). Level 0 is no faster and miscompiled an attention gradient
  (tests/ops/test_public_ops.py::test_attention_bias_mask_and_gradients got infs
  where eager and level 1 are finite), so it is not used.
  """
  if "xla_backend_optimization_level" in flags:
    return flags
  return (f"{flags} --xla_backend_optimization_level=1 "
          "--xla_llvm_disable_expensive_passes=true").strip()


# Before jax creates its CPU client, which reads XLA_FLAGS once; subprocesses inherit it.
os.environ["XLA_FLAGS"] = _cheap_cpu_compiles(os.environ.get("XLA_FLAGS", ""))


def _share_compiled_programs() -> None:
  """Gives the test run one JAX persistent compilation cache of its own, in a new
  temporary folder that the pytest-xdist workers and every subprocess share (they
  inherit the environment of the process that started them, where it is made).

  Many tests compile the same programs (the same reference, kernel or candidate at the
  same shapes), in other workers or processes too: measured on 2 cores (jax 0.11.2,
  2026-12-02), the fast tests took 8 min 9 s instead of 9 min 50 s. A program loaded
  from the cache keeps, in XLA:CPU's profile events, the program_id of the process
  that compiled it, so a test that tells programs of one module name apart by their ids
  compiles them under names of their own (tests/autotuning/test_profile.py).
  """
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return  # the controller made it
  folder = tempfile.mkdtemp(prefix="stellarax-test-jax-cache-")
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


_share_compiled_programs()  # before jax reads its configuration, at import

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Never read or write the real user cache from tests.
os.environ["STELLARAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="stellarax-test-cache-")


@pytest.fixture
def user_cache_dir(tmp_path, monkeypatch):
  """A fresh, empty user cache folder for one test."""
  monkeypatch.setenv("STELLARAX_CACHE_DIR", str(tmp_path / "cache"))
  return tmp_path / "cache"


# Mosaic GPU interpret mode runs each simulated warpgroup as its own XLA:CPU program,
# and those programs block in barrier callbacks on XLA:CPU's intra-op thread pool
# until the other warpgroups arrive. That pool has one thread per core, so on a 2-core
# machine the warpgroups of one kernel (3, plus the program that launched them) could
# exhaust it and deadlock (about 1 run in 5 of the Mosaic GPU tests). PJRT_NPROC sets
# the pool's size when the CPU client is created, which is after this file is read:
# 8 threads leave room for every kernel here (4 in 4 runs of the Mosaic GPU tests
# passed under full CPU load; without it one in 5-6 hung).
if (os.cpu_count() or 1) < 8:
  os.environ.setdefault("PJRT_NPROC", "8")


# Pallas builds each Triton kernel as an MLIR module and serialises it without running
# MLIR's verifier; on a GPU, XLA parses (and so verifies) it, and an invalid kernel fails
# there only. Verifying every module built here makes the simulated-H200 lowering tests
# catch what the GPU would reject (a loop whose bounds have different integer types
# passed them all and failed on XLA's GPU compile). tests/test_triton_verification.py
# checks this hook is in place.
try:
  from jax._src.pallas.triton import pallas_call_registration as _triton_registration
except ImportError:  # a jax that moved it: test_triton_verification.py says so
  _triton_registration = None

if _triton_registration is not None:
  _build_triton_module = _triton_registration.lowering.lower_jaxpr_to_triton_module

  def _verified_triton_module(*args, **kwargs):
    result = _build_triton_module(*args, **kwargs)
    result.module.operation.verify()  # raises MLIRError naming the invalid operation
    return result

  _verified_triton_module.verifies = True
  _triton_registration.lowering.lower_jaxpr_to_triton_module = _verified_triton_module


# Interpret mode clamps or pads a kernel's out-of-bounds reads and writes where the GPU
# would read or write past the buffer (interpret_bounds.py). Every access of every
# kernel run here is checked as the GPU makes it, and a test that leaves an
# out-of-bounds access behind fails, naming the kernel line.
import interpret_bounds  # noqa: E402  (tests/ is on sys.path: no __init__.py)

interpret_bounds.install()


@pytest.fixture(autouse=True)
def _no_out_of_bounds_access():
  # Accesses of kernels run outside a test (a module's fixtures) fail the next test.
  interpret_bounds.fail_on_violations()
  yield
  interpret_bounds.fail_on_violations()
