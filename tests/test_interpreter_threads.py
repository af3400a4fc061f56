"""The CPU client has the threads the Mosaic GPU interpreter needs (tests/conftest.py)."""

import pathlib

import jax
import jax.numpy as jnp


def _threads_named(name: str) -> int:
  tasks = pathlib.Path("/proc/self/task").iterdir()
  return sum((task / "comm").read_text().strip() == name for task in tasks)


def test_xla_cpu_pool_fits_a_kernels_warpgroups():
  # A Mosaic GPU kernel here has up to 3 warpgroups, each an XLA:CPU program blocked in
  # barrier callbacks on this pool, plus the program that launched them.
  jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
  assert _threads_named("tf_XLAEigen") >= 4, (
      "XLA:CPU's intra-op pool is too small for the Mosaic GPU interpreter; conftest.py"
      " sets PJRT_NPROC, which this jaxlib may no longer read")
