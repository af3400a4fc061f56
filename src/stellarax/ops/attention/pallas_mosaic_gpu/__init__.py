"""Flash attention, forward and backward, as Pallas Mosaic GPU kernels for Hopper (sm_90).

Semantics are those of `jax.nn.dot_product_attention` in the BTNH layout (see
ops/attention/reference.py) for the inputs these kernels take: query (B, T, N, H), key
and value (B, S, K, H) in bfloat16 or float16, H in (64, 128, 256), N a multiple of K
(GQA/MQA: query head n reads kv head n // (N // K)), a scale and `is_causal` (key j <=
query i, aligned at the top left as in jax), local windows (key j kept for i - left <= j
<= i + right), per-batch sequence lengths (keys past the key length dropped, rows past
the query length zero; a row that keeps no key is mean(V), as in jax), and a bias and a
boolean mask broadcastable to (B, N, T, S). The bias and mask reach the kernels as one
operand (bias where kept, -inf where masked; batch and head broadcasts kept) that rides
with the K tiles: a float32 vector over keys when all query rows see the same values
(key padding masks), else (query, key) tiles in the input dtype with T and S
materialised. The backward kernels hold the bias constant (the op class gets dbias from
XLA).

Sequence lengths that are not multiples of the blocks are padded in the wrapper (only
then): padded keys are masked like keys past the key length; padded query rows, rows
past the query length and rows that keep no key get lse = +inf in the backward, so they
give probability 0 everywhere; the dV term of rows that keep no key (dout / S on every
key) is the dK/dV kernel's initial dV.

Layout: tunables.py (configs, their checks, resource estimates, heuristics and
search spaces), kernel_parts.py (the call's static description and what the
kernels share, including how interpret mode runs them), forward.py and
backward.py (the kernels and their wrappers); this file holds the op classes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from stellarax.ops import pallas_common
from stellarax.ops.attention import base as _base
from stellarax.ops.attention import flash_blocks
from stellarax.ops.attention.pallas_mosaic_gpu.backward import attention_bwd_pallas_mosaic_gpu
from stellarax.ops.attention.pallas_mosaic_gpu.forward import attention_fwd_pallas_mosaic_gpu
from stellarax.ops.attention.pallas_mosaic_gpu.tunables import (
    SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, PallasMosaicGpuAttentionConfig,
    PallasMosaicGpuAttentionVjpConfig, heuristic_tunables, tunable_space)


def _check_kernel_takes(arguments: dict[str, Any]) -> None:
  """Raises NotImplementedError for inputs the kernels do not handle (dispatch falls back)."""
  flash_blocks.require_window_the_kernels_take(arguments.get("local_window_size"))
  q = arguments["query"]
  if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"head dim {q.shape[-1]} is not one of the kernel's"
                              f" {SUPPORTED_HEAD_DIMS}.")
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(f"dtype {q.dtype} is not one of the kernel's"
                              f" {[str(d) for d in SUPPORTED_DTYPES]}.")
  flash_blocks.require_keys_the_kernels_take(arguments)


def _shape_of(ba: Any) -> tuple[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct], dict]:
  """(query, key) structs and the keyword arguments of the tunables functions."""
  a = ba.arguments
  # Per-key bias/mask vectors take little shared memory; (query, key) tiles count.
  with_pair = any(x is not None and x.shape[2] > 1 for x in (a["bias"], a["mask"]))
  structs = a["query"].to_shape_dtype_struct(), a["key"].to_shape_dtype_struct()
  return structs, dict(with_pair=with_pair)


class PallasMosaicGpuAttentionVjp(pallas_common.PallasMosaicGpuOp, _base.AttentionVjp,
                                  name="attention.pallas_mosaic_gpu_vjp"):
  """Flash attention backward in Pallas Mosaic GPU (dQ, dK, dV) from the forward's
  log-sum-exp. A bias gradient, when a bias is given, comes from XLA's derivative (dead
  code that XLA drops when the bias is a constant)."""

  config_cls = PallasMosaicGpuAttentionVjpConfig

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments)

  def _fwd(self, residuals, out, dout, query, key, value, bias=None, mask=None, *, config,
           **static):
    (lse,) = residuals
    dq, dk, dv = attention_bwd_pallas_mosaic_gpu(
        query, key, value, bias, mask, out, lse, dout.astype(query.dtype),
        **flash_blocks.kernel_options(static), interpret=self.interpret,
        **pallas_common.tunables_of(config))
    primals = dict(query=query, key=key, value=value, bias=bias, mask=mask, **static)
    return {"query": dq, "key": dk, "value": dv, **_base.bias_gradient_by_xla(primals, dout)}

  def _is_reproducible(self, config):
    # fuse_dq sums dQ with TMA reduce-adds, atomic in L2: in an order that varies.
    return not config.fuse_dq

  def _get_heuristics_config(self, ba):
    structs, kw = _shape_of(ba)
    return PallasMosaicGpuAttentionVjpConfig(**heuristic_tunables(*structs, backward=True, **kw))

  def _get_autotuning_configs(self, ba):
    structs, kw = _shape_of(ba)
    return pallas_common.configs_from_tunables(
        PallasMosaicGpuAttentionVjpConfig, tunable_space(*structs, backward=True, **kw))


class PallasMosaicGpuAttention(pallas_common.PallasMosaicGpuOp, _base.Attention,
                               name="attention.pallas_mosaic_gpu"):
  """Flash attention forward in Pallas Mosaic GPU for Hopper (TMA, wgmma, a memory
  warpgroup, ping-pong compute warpgroups, block skipping for causal masks, local
  windows and sequence lengths, GQA by index, bias and masks streamed as tiles)."""

  config_cls = PallasMosaicGpuAttentionConfig
  vjp_cls = PallasMosaicGpuAttentionVjp

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments)

  def _fwd(self, query, key, value, bias=None, mask=None, *, config, **static):
    out, lse = attention_fwd_pallas_mosaic_gpu(
        query, key, value, bias, mask, **flash_blocks.kernel_options(static), interpret=self.interpret,
        **pallas_common.tunables_of(config))
    return out, (lse,)

  def _get_heuristics_config(self, ba):
    structs, kw = _shape_of(ba)
    return PallasMosaicGpuAttentionConfig(**heuristic_tunables(*structs, **kw))

  def _get_autotuning_configs(self, ba):
    structs, kw = _shape_of(ba)
    return pallas_common.configs_from_tunables(PallasMosaicGpuAttentionConfig,
                                               tunable_space(*structs, **kw))

