"""Pallas Mosaic GPU kernels for ragged_dot on Hopper (wgmma, TMA, warp-specialized pipelines).

Three products, each a plain function with keyword-only tunables:

  ragged_dot_pallas_mosaic_gpu       out[m] = lhs[m] @ rhs[g(m)]            (M, N)
  ragged_dot_dlhs_pallas_mosaic_gpu  dlhs[m] = dout[m] @ rhs[g(m)].T        (M, K)
  ragged_dot_drhs_pallas_mosaic_gpu  drhs[g] = lhs[rows g].T @ dout[rows g] (G, K, N)

Semantics are those of `jax.lax.ragged_dot` (see `ops/ragged_dot/reference.py`): groups
are consecutive row ranges whose sizes are runtime values; rows past the last group give
zeros; a group that runs past row M is cut there; empty groups are allowed.

Limits: bfloat16 and float16 operands only (wgmma's 16-bit path; the op refuses
float32 so that dispatch falls back); the output columns and the contraction size of
the forward and lhs-gradient kernels must be multiples of the tiles (K and N
multiples of 64 at least, K of 128 for the backward), so TMA never reads or writes
out of bounds. Interpret mode (any backend, for tests) runs two CTAs by default (two
clusters of two with `multicast`): CTAs (clusters) run one after another there, so
more only cost time.

Layout: tunables.py (checks, heuristics, search spaces), work_items.py (the row metadata
computed before a launch), kernel_parts.py (what the kernels share), forward.py (forward
and lhs gradient), rhs_gradient.py; this file holds the op classes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from stellarax.ops import pallas_common
from stellarax.ops.ragged_dot import base as _base
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.forward import (
    ragged_dot_dlhs_pallas_mosaic_gpu, ragged_dot_pallas_mosaic_gpu)
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.rhs_gradient import (
    ragged_dot_drhs_pallas_mosaic_gpu)
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.tunables import (
    _ROW_PRODUCT_TUNABLES, OUT_DTYPES, SUPPORTED_DTYPES, PallasMosaicGpuRaggedDotConfig,
    heuristic_tunables, tunable_space)
# The rest of the kernels' public functions, for callers of this module.
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.tunables import (  # noqa: F401
    check_tunables_fit as check_tunables_fit, slab_counts as slab_counts,
    validate_tunables as validate_tunables)
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.work_items import (  # noqa: F401
    group_offsets as group_offsets, num_work_items as num_work_items,
    padded_rows as padded_rows, work_items as work_items)


def _problem(ba) -> tuple[int, int, int, int, Any]:
  lhs, rhs = ba.arguments["lhs"], ba.arguments["rhs"]
  return lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], lhs.dtype


def _check_kernel_takes(arguments, *, backward: bool) -> None:
  """Raises NotImplementedError for input the kernels do not take, so dispatch falls back."""
  lhs, rhs = arguments["lhs"], arguments["rhs"]
  dtypes = {jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)}
  if len(dtypes) != 1 or not dtypes <= set(SUPPORTED_DTYPES):
    raise NotImplementedError(
        f"lhs and rhs dtypes {sorted(map(str, dtypes))}: the Mosaic GPU kernel needs both "
        "bfloat16 or both float16 (wgmma's 16-bit path; float32 is not supported).")
  out = arguments["preferred_element_type"]
  if out is not None and jnp.dtype(out) not in OUT_DTYPES:
    raise NotImplementedError(f"preferred_element_type={out}: the Mosaic GPU kernel writes "
                              f"one of {[str(d) for d in OUT_DTYPES]}.")
  k, n = lhs.shape[1], rhs.shape[2]
  if k % 64 or n % 64 or backward and k % 128:
    need = "K a multiple of 128 and N of 64" if backward else "K and N multiples of 64"
    raise NotImplementedError(
        f"K={k}, N={n}: the Mosaic GPU kernel needs {need} (whole TMA tiles).")


class PallasMosaicGpuRaggedDotVjp(pallas_common.PallasMosaicGpuOp, _base.RaggedDotVjp,
                                  name="ragged_dot.pallas_mosaic_gpu_vjp"):
  """ragged_dot backward in Mosaic GPU: d lhs with the forward kernel reading rhs
  transposed, d rhs with a per-group lhs^T @ dout kernel."""

  config_cls = PallasMosaicGpuRaggedDotConfig

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments, backward=True)

  def _fwd(self, residuals, out, dout, lhs, rhs, group_sizes, *, precision=None,
           preferred_element_type=None, config):
    del residuals, out, precision, preferred_element_type
    kw = dict(interpret=self.interpret, **pallas_common.tunables_of(config))
    dout = dout.astype(rhs.dtype)  # one 16-bit operand dtype for wgmma
    dlhs = ragged_dot_dlhs_pallas_mosaic_gpu(dout, rhs, group_sizes,
                                             preferred_element_type=lhs.dtype, **kw)
    for name in _ROW_PRODUCT_TUNABLES:  # (not the rhs gradient's)
      del kw[name]
    drhs = ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, group_sizes, rhs.shape[0],
                                             preferred_element_type=rhs.dtype, **kw)
    return {"lhs": dlhs, "rhs": drhs}

  def _get_heuristics_config(self, ba):
    return PallasMosaicGpuRaggedDotConfig(**heuristic_tunables(*_problem(ba), product="backward"))

  def _get_autotuning_configs(self, ba):
    space = tunable_space(*_problem(ba), product="backward")
    return pallas_common.configs_from_tunables(PallasMosaicGpuRaggedDotConfig, space)


class PallasMosaicGpuRaggedDot(pallas_common.PallasMosaicGpuOp, _base.RaggedDot,
                               name="ragged_dot.pallas_mosaic_gpu"):
  """ragged_dot in Mosaic GPU for Hopper: group-aligned row tiles, warp-specialized
  TMA/wgmma pipeline, float32 accumulation. bfloat16 and float16 inputs only
  (float32 falls back); bfloat16 products are exact, so every `precision` is met."""

  config_cls = PallasMosaicGpuRaggedDotConfig
  vjp_cls = PallasMosaicGpuRaggedDotVjp

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments, backward=False)

  def _fwd(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, config):
    del precision
    out = ragged_dot_pallas_mosaic_gpu(lhs, rhs, group_sizes,
                                       preferred_element_type=preferred_element_type,
                                       interpret=self.interpret,
                                       **pallas_common.tunables_of(config))
    return out, None

  def _get_heuristics_config(self, ba):
    return PallasMosaicGpuRaggedDotConfig(**heuristic_tunables(
        *_problem(ba), out_dtype=ba.arguments["preferred_element_type"]))

  def _get_autotuning_configs(self, ba):
    space = tunable_space(*_problem(ba), out_dtype=ba.arguments["preferred_element_type"])
    return pallas_common.configs_from_tunables(PallasMosaicGpuRaggedDotConfig, space)
