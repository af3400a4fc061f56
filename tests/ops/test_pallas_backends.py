"""A JAX without a Pallas backend (JAX deprecated Pallas Triton in 0.11 and says it
will remove it): stellarax still imports, runs every op through what it can, loads
data naming the missing backend's kernels, and says what to do where a call names one.

JAX has both backends here, so a subprocess hides one (None in `sys.modules` makes its
import fail as a removed module's would) before anything imports it; this file, run as
a script, is that subprocess and writes its observations as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _error_of(fn) -> dict | None:
  try:
    fn()
  except Exception as e:  # noqa: BLE001 (the test reads what was raised)
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
  return None


def _observe(missing: str) -> dict:
  """Runs in the subprocess, with `jax.experimental.pallas.<missing>` hidden."""
  sys.modules[f"jax.experimental.pallas.{missing}"] = None
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np

  import stellarax
  from stellarax import autotuning
  from stellarax.autotuning.measure import Measurement
  from stellarax.core import registry
  from stellarax.ops import pallas_backends

  h200 = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA H200", "compute_capability": "9.0"})()
  key = jax.random.key(0)
  x = jax.random.normal(key, (48, 96), jnp.float32)
  scale = jax.random.normal(jax.random.fold_in(key, 1), (96,), jnp.float32)
  # bfloat16 and these sizes: a call both ragged_dot kernels take.
  lhs = jax.random.normal(key, (40, 64), jnp.bfloat16)
  rhs = jax.random.normal(jax.random.fold_in(key, 2), (3, 64, 128), jnp.bfloat16)
  sizes = jnp.asarray([16, 0, 20], jnp.int32)
  kernel = {"triton": stellarax.PallasTritonRaggedDot, "mosaic_gpu": stellarax.PallasMosaicGpuRaggedDot}[missing]
  other = {"triton": stellarax.PallasMosaicGpuRaggedDot, "mosaic_gpu": stellarax.PallasTritonRaggedDot}[missing]
  name = kernel.name.partition(".")[2]

  def result_naming_the_kernel():
    """A result with an entry of the missing backend's kernel, written and read back."""
    ba = kernel(interpret=True).bind(lhs, rhs, sizes)
    config = ba.heuristics_config
    m = Measurement(status="ok", median_s=1e-3, ci_low_s=9e-4, ci_high_s=1.1e-3, num_samples=5,
                    compile_time_s=0.1, error=None, method="test")
    entry = autotuning.Entry(bound_args=ba, best_config=config, heuristic_config=config,
                             measurements=((config, m),))
    return autotuning.AutotuningResult.loads(autotuning.AutotuningResult("cpu", {entry.key: entry}).dumps())

  xla = np.asarray(stellarax.ragged_dot(lhs, rhs, sizes, implementation="xla"), np.float32)
  loaded = result_naming_the_kernel()
  with loaded:
    under_result = np.asarray(stellarax.ragged_dot(lhs, rhs, sizes), np.float32)
  fallback = stellarax.ragged_dot(lhs, rhs, sizes, implementation=[name, "xla"])
  return {
      "reasons": {b: pallas_backends.missing_reason(b) for b in ("triton", "mosaic_gpu")},
      "registered": kernel.name in registry.names("ragged_dot"),
      "supported_on_h200": {"kernel": kernel.supported_on(h200), "other": other.supported_on(h200)},
      "default_call": float(np.max(np.abs(np.asarray(stellarax.ragged_dot(lhs, rhs, sizes), np.float32) - xla))),
      "named": _error_of(lambda: stellarax.ragged_dot(lhs, rhs, sizes, implementation=name)),
      "instance": _error_of(lambda: kernel(interpret=True)(lhs, rhs, sizes)),
      "gradient": _error_of(lambda: jax.grad(lambda a: kernel(interpret=True)(a, rhs, sizes).astype(jnp.float32).sum())(lhs)),
      "fallback": float(np.max(np.abs(np.asarray(fallback, np.float32) - xla))),
      "loaded_entries": len(loaded),
      "under_result": float(np.max(np.abs(under_result - xla))),
      "norm": float(np.max(np.abs(np.asarray(stellarax.rms_norm(x, scale, implementation=[stellarax.PallasTritonLayerNorm(interpret=True), "xla"]))
                                  - np.asarray(stellarax.rms_norm(x, scale, implementation="xla"))))),
      "backend_attribute": _error_of(lambda: getattr(getattr(pallas_backends, missing), "CompilerParams")),
      "dataclass_ok": dataclasses.is_dataclass(kernel),
      "autotune": _error_of(lambda: autotuning.autotune([kernel(interpret=True).bind(lhs, rhs, sizes)])),
  }


@pytest.fixture(scope="module", params=["triton", "mosaic_gpu"])
def without(request, tmp_path_factory):
  """What the subprocess saw with one backend hidden: (backend, observations)."""
  out = tmp_path_factory.mktemp("backends") / "seen.json"
  proc = subprocess.run([sys.executable, __file__, request.param, str(out)],
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return request.param, json.loads(out.read_text())


_WORDS = {"triton": "Pallas Triton", "mosaic_gpu": "Pallas Mosaic GPU"}


def test_only_the_hidden_backend_is_missing(without):
  backend, seen = without
  assert seen["reasons"][backend].startswith(f"{_WORDS[backend]} is not in this JAX")
  assert f"jax.experimental.pallas.{backend}" in seen["reasons"][backend]
  assert [b for b, reason in seen["reasons"].items() if reason] == [backend]
  assert seen["registered"] and seen["dataclass_ok"]


def test_dispatch_passes_the_missing_backend_by(without):
  _, seen = without
  assert seen["supported_on_h200"] == {"kernel": False, "other": True}
  assert seen["default_call"] < 1e-5
  assert seen["fallback"] < 1e-5
  assert seen["norm"] < 1e-5


def test_calls_naming_the_missing_backend_say_what_to_do(without):
  backend, seen = without
  for how in ("named", "instance", "gradient"):
    error = seen[how]
    assert error is not None, how
    assert "NotImplementedError" in error["mro"], error
    assert "cannot run" in error["message"] and _WORDS[backend] in error["message"], error
    assert "implementation=None" in error["message"] and "'xla'" in error["message"], error
  assert seen["instance"]["type"] == "ImplementationUnavailableError"
  # Tuning says so once for the call, instead of failing every config of its space.
  assert seen["autotune"]["type"] == "IncompleteTuningError"
  assert "ImplementationUnavailableError" in seen["autotune"]["message"]
  assert "compile_error" not in seen["autotune"]["message"]
  assert seen["backend_attribute"]["type"] == "ImplementationUnavailableError"
  assert "CompilerParams" in seen["backend_attribute"]["message"]


def test_results_naming_the_missing_backend_still_load_and_apply(without):
  _, seen = without
  assert seen["loaded_entries"] == 1
  assert seen["under_result"] < 1e-5


def test_require_available_is_quiet_where_jax_has_the_backend():
  import stellarax
  from stellarax.ops import pallas_backends
  assert pallas_backends.missing_reason("triton") is None
  assert pallas_backends.missing_reason("mosaic_gpu") is None
  assert stellarax.ImplementationUnavailableError.__mro__[1] is NotImplementedError
  stellarax.PallasTritonRaggedDot.require_available()
  stellarax.PallasMosaicGpuAttention.require_available()
  with pytest.raises(ValueError, match="Unknown Pallas backend 'tpu'"):
    pallas_backends.missing_reason("tpu")



@pytest.mark.parametrize("kind,capability,mosaic,triton", [
    ("NVIDIA H200", "9.0", True, True),
    ("NVIDIA H100 80GB HBM3", "9.0", True, True),
    # Blackwell has no wgmma: the Mosaic GPU kernels would not compile (they took it as
    # ">= 9.0"); its 227 KiB a block hold the Triton kernels' configs.
    ("NVIDIA B200", "10.0", False, True),
    # 163 KiB (A100) and 99 KiB (L40S, consumer Blackwell) a block: the Triton kernels'
    # heuristic configs need more (attention's head dim 128: about 128 KiB).
    ("NVIDIA A100-SXM4-80GB", "8.0", False, False),
    ("NVIDIA L40S", "8.9", False, False),
    ("NVIDIA GeForce RTX 5090", "12.0", False, False),
    # An abstract device (lowering from a CPU host) states none: its kind tells.
    ("NVIDIA H200", None, True, True),
    ("NVIDIA GH200 480GB", None, True, True),
    ("NVIDIA B200", None, False, True),
    ("NVIDIA A100-SXM4-80GB", None, False, False),
    ("NVIDIA Future GPU", None, False, False),  # not known: nothing picked
    ("NVIDIA H200", "", True, True),
    ("TPU v5 lite", "9.0", False, False),
])
def test_kernels_are_picked_only_on_gpus_they_compile_for(kind, capability, mosaic, triton):
  import jax
  import stellarax
  platform = "tpu" if "TPU" in kind else "gpu"
  if capability is None:
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=132, platform=platform)
  else:
    device = type("Device", (), {"platform": platform, "device_kind": kind,
                                 "compute_capability": capability})()
  for cls in (stellarax.PallasMosaicGpuRaggedDot, stellarax.PallasMosaicGpuAttention):
    assert cls.supported_on(device) is mosaic
  for cls in (stellarax.PallasTritonRaggedDot, stellarax.PallasTritonAttention,
              stellarax.PallasTritonLayerNorm, stellarax.PallasTritonGatedLinearUnit):
    assert cls.supported_on(device) is triton


if __name__ == "__main__":
  with open(sys.argv[2], "w") as f:
    json.dump(_observe(sys.argv[1]), f)
