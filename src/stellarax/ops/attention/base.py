"""The attention family: `jax.nn.dot_product_attention` semantics (BTNH).

query (B, T, N, H); key, value (B, S, K, H) with N a multiple of K (GQA/MQA);
optional bias and boolean mask broadcastable to (B, N, T, S); causal masking,
sequence lengths and local windows. This file holds the family's base
classes and its XLA implementations (full and chunked online-softmax).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from stellarax.core.config import NoConfig, check_positive_int, config_dataclass
from stellarax.core import partitioning
from stellarax.core.op import Op
from stellarax.ops import common
from stellarax.ops.attention import reference as ref
from stellarax.ops.attention import xla

_STATIC = ("scale", "is_causal", "local_window_size")
_DIFFERENTIABLE = ("query", "key", "value", "bias")

# Keyword-only parameters of the attention ops that take arrays.
_SEQ_LENGTHS = frozenset({"query_seq_lengths", "key_value_seq_lengths"})


class Attention(Op):
  """Base of the attention implementations (forward)."""

  array_options = _SEQ_LENGTHS

  def _fwd(self, query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
           query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None, config):
    raise NotImplementedError

  def _canonicalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
    a = arguments
    for name in ("query", "key", "value"):
      common.check_floating(name, a[name])
    for name in ("bias", "mask", "query_seq_lengths", "key_value_seq_lengths"):
      if a[name] is not None:
        common.check_array(name, a[name])
    ref.check_attention_inputs(_view(a["query"]), _view(a["key"]), _view(a["value"]), _view(a["bias"]),
                               _view(a["mask"]), _view(a["query_seq_lengths"]),
                               _view(a["key_value_seq_lengths"]))
    a["scale"] = float(ref.default_scale(a["query"].shape[-1], a["scale"]))
    a["is_causal"] = ref.static_flag("is_causal", a["is_causal"])
    window = ref.normalize_local_window(a["local_window_size"])
    a["local_window_size"] = None if window is None else tuple(window)
    return a

  def _is_trivial(self, arguments):
    # No query row (B, T, N or H of zero): the output is empty. No key (S of zero):
    # zeros, as jax.nn.dot_product_attention gives (the reference says so too).
    return math.prod(arguments["query"].shape) == 0 or arguments["key"].shape[1] == 0

  def _example_value(self, name, spec, key, arguments):
    if name in ("query_seq_lengths", "key_value_seq_lengths"):
      length = arguments["query" if name == "query_seq_lengths" else "key"].shape[1]
      return jax.random.randint(key, spec.shape, max(1, length // 2), length + 1, jnp.dtype(spec.dtype))
    return Op._example_value(self, name, spec, key, arguments)

  def _reference(self, query, key, value, bias=None, mask=None, **static):
    return ref.attention_reference(query, key, value, bias, mask, **static)

  def _array_layout(self, arguments):
    labels, h, sizes = _primal_labels(arguments)
    # out, and the residuals of the flash kernels: the log-sum-exp (B, N, T).
    return partitioning.ShardingLayout(labels, (f"b t {h} e", (f"b {h} t",)), _FREE, sizes)


def _primal_labels(a: dict[str, Any]) -> tuple[dict[str, str], str, dict[str, int]]:
  """The factors of the forward's arrays, those of the query heads, and the sizes of
  the factors that only make up others. The batch and the heads may be split; with
  GQA the query heads are the key heads times the group each one serves (query head
  n uses key head n // group), so splitting the key heads splits both alike."""
  query_heads, key_heads = a["query"].shape[2], a["key"].shape[2]
  h, sizes = "h", {}
  if query_heads != key_heads:
    h, sizes = "(h group)", {"group": query_heads // key_heads}
  labels = {"query": f"b t {h} d", "key": "b s h d", "value": "b s h e",
            "query_seq_lengths": "b", "key_value_seq_lengths": "b"}
  for name in ("bias", "mask"):
    if a[name] is not None:
      labels[name] = partitioning.broadcast_labels(a[name].shape, f"b {h} t s", name)
  return labels, h, sizes


_FREE = frozenset({"b", "h"})


class _ShapeView:
  """Gives ArraySpecs the `.ndim`/`.dtype` the shared checks read."""

  def __init__(self, x):
    self.shape, self.dtype, self.ndim = tuple(x.shape), jnp.dtype(x.dtype), len(x.shape)


def _view(x):
  return None if x is None else _ShapeView(x)


class AttentionVjp(Op):
  """Base of the attention backward implementations."""

  array_options = _SEQ_LENGTHS

  def _fwd(self, residuals, out, dout, query, key, value, bias=None, mask=None, *, scale=None,
           is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
           local_window_size=None, config):
    raise NotImplementedError

  def _canonicalize(self, arguments):
    fwd = {k: arguments[k] for k in Attention._signature().parameters}
    arguments.update(Attention._canonicalize(self, fwd))
    return arguments

  _example_value = Attention._example_value

  def _array_layout(self, arguments):
    labels, h, sizes = _primal_labels(arguments)
    labels.update(residuals=(f"b {h} t",), out=f"b t {h} e", dout=f"b t {h} e")
    grads = {name: labels[name] for name in _DIFFERENTIABLE if arguments[name] is not None}
    return partitioning.ShardingLayout(labels, grads, _FREE, sizes)

  def _reference(self, residuals, out, dout, **primals):
    f = lambda **kw: ref.attention_reference(**kw)
    return common.vjp_by_autodiff(f, primals, dout, _DIFFERENTIABLE)


def bias_gradient_by_xla(primals: dict[str, Any], dout: Any) -> dict[str, Any]:
  """The bias gradient for a flash-attention backward that holds the bias constant.

  Args:
    primals: the forward's arguments by name (query, key, value, bias, mask and the
      static options).
    dout: the output cotangent.

  Returns:
    {"bias": dbias} from XLA's derivative of the attention, or {} without a bias. When
    the bias is a constant of the program, XLA drops this computation as dead code.
  """
  if primals.get("bias") is None:
    return {}
  f = lambda **kw: xla.attention_xla(**kw)[0]
  return common.vjp_by_autodiff(f, primals, dout, ("bias",))


# ---------------------------------------------------------------------------
# XLA implementations.


@config_dataclass
class XlaChunkedAttentionConfig:
  """Tunables of the chunked (online-softmax) XLA attention.

  Attributes:
    chunk_q: query rows per chunk (None: all).
    chunk_k: keys per chunk (None: all).
  """

  chunk_q: int | None = None
  chunk_k: int | None = 512

  def __post_init__(self):
    check_positive_int("chunk_q", self.chunk_q, allow_none=True)
    check_positive_int("chunk_k", self.chunk_k, allow_none=True)


def _chunk_space(t: int, s: int) -> set[XlaChunkedAttentionConfig]:
  qs = [None] + [c for c in (64, 128, 256, 512, 1024) if c < t]
  ks = [None] + [c for c in (64, 128, 256, 512, 1024, 2048) if c < s]
  return {XlaChunkedAttentionConfig(chunk_q=q, chunk_k=k) for q in qs for k in ks}


def _heuristic_chunks(t: int, s: int) -> XlaChunkedAttentionConfig:
  """Small problems materialise the (T, S) logits; larger ones use 256 x 256
  chunks, which measured fastest on CPU (T=S=2048: 2-3x faster than full)."""
  if t * s <= 256 * 256:
    return XlaChunkedAttentionConfig(chunk_q=None, chunk_k=None)
  return XlaChunkedAttentionConfig(chunk_q=256 if t > 256 else None, chunk_k=256 if s > 256 else None)


class XlaAttentionVjp(AttentionVjp, name="attention.xla_vjp"):
  """XLA backward: JAX's derivative of the chunked forward with this op's
  chunk sizes (recomputing the forward; chunking bounds its memory)."""

  config_cls = XlaChunkedAttentionConfig

  def _fwd(self, residuals, out, dout, query, key, value, bias=None, mask=None, *, config, **static):
    del residuals, out
    def f(**kw):
      return xla.attention_xla(**kw, chunk_q=config.chunk_q, chunk_k=config.chunk_k)[0]
    primals = dict(query=query, key=key, value=value, bias=bias, mask=mask, **static)
    return common.vjp_by_autodiff(f, primals, dout, _DIFFERENTIABLE)

  def _get_heuristics_config(self, ba):
    return _heuristic_chunks(ba.arguments["query"].shape[1], ba.arguments["key"].shape[1])

  def _get_autotuning_configs(self, ba):
    return _chunk_space(ba.arguments["query"].shape[1], ba.arguments["key"].shape[1])


class XlaAttention(Attention, name="attention.xla"):
  """Attention in XLA, materialising the logits (no tunables)."""

  config_cls = NoConfig
  vjp_cls = XlaAttentionVjp

  def _fwd(self, query, key, value, bias=None, mask=None, *, config, **static):
    out, _ = xla.attention_xla(query, key, value, bias, mask, **static)
    return out, None

  def _array_layout(self, arguments):
    return super()._array_layout(arguments).without_residuals()  # `_fwd` returns (out, None)

  def _get_heuristics_config(self, ba):
    return NoConfig()


class XlaChunkedAttention(Attention, name="attention.xla_chunked"):
  """Attention in XLA with an online softmax over query and key chunks."""

  config_cls = XlaChunkedAttentionConfig
  vjp_cls = XlaAttentionVjp

  def _fwd(self, query, key, value, bias=None, mask=None, *, config, **static):
    out, _ = xla.attention_xla(query, key, value, bias, mask, chunk_q=config.chunk_q,
                               chunk_k=config.chunk_k, **static)
    return out, None

  def _array_layout(self, arguments):
    return super()._array_layout(arguments).without_residuals()  # `_fwd` returns (out, None)

  def _get_heuristics_config(self, ba):
    return _heuristic_chunks(ba.arguments["query"].shape[1], ba.arguments["key"].shape[1])

  def _get_autotuning_configs(self, ba):
    return _chunk_space(ba.arguments["query"].shape[1], ba.arguments["key"].shape[1])


