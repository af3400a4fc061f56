"""Plain, high-precision reference for dot-product attention.

Semantics are those of `jax.nn.dot_product_attention` (its "xla" implementation)
in the BTNH layout:

- query (B, T, N, H); key and value (B, S, K, H) with N a multiple of K: query
  head n reads key/value head n // (N // K) (GQA; MQA when K == 1).
- logits = scale * q.k (scale defaults to 1/sqrt(H)), plus `bias` when given.
- A position (t, s) is kept when all of these hold: `mask` is True there; s <= t
  when causal; t - left <= s <= t + right for a local window (left, right);
  t < query_seq_lengths[b] and s < key_value_seq_lengths[b].
- Dropped positions get the logit `-0.7 * float32 max` (not -inf). A row with no
  kept position therefore has a uniform softmax over all S keys: its output is
  the mean of the values and its log-sum-exp is about that large negative number.
- Output rows t >= query_seq_lengths[b] are zero.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stellarax.ops import common

_HIGHEST = lax.Precision.HIGHEST

# The logit that dropped positions get, as in jax.nn.dot_product_attention: finite,
# so that a row with no kept position averages the values instead of giving NaN.
MASKED_LOGIT = float(-0.7 * np.finfo(np.float32).max)

LocalWindow = int | tuple[int, int] | None


def normalize_local_window(local_window_size: LocalWindow) -> tuple[int, int] | None:
  """Returns a local window as (left, right), or None for no window.

  Args:
    local_window_size: None, an int w (meaning (w, w)) or a (left, right) pair: query
      t attends to keys t - left ... t + right.

  Returns:
    None or a (left, right) tuple of ints.

  Raises:
    ValueError: for anything else, a traced value too.
  """
  if local_window_size is None:
    return None
  common.refuse_traced("local_window_size", local_window_size)
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    return int(local_window_size), int(local_window_size)
  if (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
      and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
              for w in local_window_size)):
    return int(local_window_size[0]), int(local_window_size[1])
  raise ValueError(
      f"local_window_size={local_window_size!r} must be None, an int or a (left, right) "
      f"pair of ints.")


def _check_broadcastable(name: str, x: jax.Array | None, full: tuple[int, ...]) -> None:
  if x is None:
    return
  if x.ndim != 4 or any(d not in (1, f) for d, f in zip(x.shape, full)):
    raise ValueError(
        f"{name}.shape={x.shape} must be 4-D and broadcastable to (B, N, T, S)={full}: "
        f"every dimension 1 or the full size. Add leading unit dimensions if it has fewer "
        f"(stellarax.dot_product_attention adds them itself).")


def check_attention_inputs(query, key, value, bias=None, mask=None, query_seq_lengths=None,
                           key_value_seq_lengths=None) -> None:
  """Checks the shapes and dtypes of attention operands (BTNH layout).

  Raises:
    ValueError: naming the operand that does not fit and what it should be.
  """
  if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
    raise ValueError(
        f"attention needs query (B, T, N, H) and key, value (B, S, K, H) of one shape; got "
        f"query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}.")
  (b, t, n, h), (bk, s, k, hk) = query.shape, key.shape
  if b != bk:
    raise ValueError(f"query.shape={query.shape} and key.shape={key.shape} must share the "
                     f"batch B; got {b} and {bk}.")
  if h != hk:
    raise ValueError(f"query.shape={query.shape} and key.shape={key.shape} must share the "
                     f"head dim H; got {h} and {hk}.")
  if (k == 0 and n > 0) or (k > 0 and n % k):
    raise ValueError(
        f"the query heads N={n} of query.shape={query.shape} must be a multiple of the "
        f"key/value heads K={k} of key.shape={key.shape} (each key/value head serves N/K "
        "query heads)" + ("; with no key/value head there is nothing to attend to." if k == 0
                          else "."))
  if not query.dtype == key.dtype == value.dtype:
    raise ValueError(
        f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, "
        f"{value.dtype}. Cast them first.")
  _check_broadcastable("bias", bias, (b, n, t, s))
  _check_broadcastable("mask", mask, (b, n, t, s))
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"mask.dtype={mask.dtype} must be bool (True keeps a position); pass an "
                     f"additive mask as bias instead.")
  for name, lengths in (("query_seq_lengths", query_seq_lengths),
                        ("key_value_seq_lengths", key_value_seq_lengths)):
    if lengths is not None and (lengths.shape != (b,) or
                                not jnp.issubdtype(lengths.dtype, jnp.integer)):
      raise ValueError(f"{name} (shape {lengths.shape}, dtype {lengths.dtype}) must be a "
                       f"({b},) integer array, one length per batch element.")


def default_scale(head_dim: int, scale: float | None) -> float:
  """Returns `scale`, or 1/sqrt(head_dim) when it is None.

  Raises:
    ValueError: for a scale that is not a finite real number (a traced scale included:
      the logit scale is a static option of the call).
  """
  if scale is None:  # (a head dim of 0 has no logits to scale)
    return 1.0 / float(np.sqrt(head_dim)) if head_dim else 1.0
  value = common.concrete_float(scale)
  if value is None or not np.isfinite(value):
    default = f"None (1/sqrt(H) = {1 / np.sqrt(head_dim):.4g}) or a finite Python number"
    raise common.static_option_error("scale", scale, default)
  return value


def static_flag(name: str, value: Any) -> bool:
  """Returns `value` as a bool.

  Raises:
    ValueError: for a traced value: the flag chooses what the kernels compute, so it
      must be known when the call is traced.
  """
  try:
    return bool(value)
  except jax.errors.ConcretizationTypeError:
    raise common.static_option_error(
        name, value, "a Python bool", other_way="choose between two calls with lax.cond") from None


def _keep_mask(b, n, t, s, mask, is_causal, window, q_lengths, kv_lengths) -> jax.Array:
  """Returns the (B, N, T, S) bool array of kept positions."""
  keep = jnp.ones((b, n, t, s), jnp.bool_)
  q_pos = jnp.arange(t)[:, None]
  k_pos = jnp.arange(s)[None, :]
  if mask is not None:
    keep = keep & mask
  if is_causal:
    keep = keep & (k_pos <= q_pos)[None, None]
  if window is not None:
    left, right = window
    keep = keep & ((q_pos - left <= k_pos) & (k_pos <= q_pos + right))[None, None]
  if q_lengths is not None:
    keep = keep & (jnp.arange(t)[None, :] < q_lengths[:, None])[:, None, :, None]
  if kv_lengths is not None:
    keep = keep & (jnp.arange(s)[None, :] < kv_lengths[:, None])[:, None, None, :]
  return keep


def attention_reference_with_lse(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: LocalWindow = None,
) -> tuple[jax.Array, jax.Array]:
  """Computes attention and its log-sum-exp in float32 at HIGHEST precision.

  Args: as `attention_reference`.

  Returns:
    (out, lse): out (B, T, N, H) in query.dtype; lse (B, N, T) float32, the
    log-sum-exp of every row of masked, scaled logits (the softmax residual).

  Raises:
    ValueError: when the operands do not fit together (see check_attention_inputs).
  """
  check_attention_inputs(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths)
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  if s == 0 or n == 0:  # no key: zeros, as jax.nn.dot_product_attention gives, and an
    # empty sum; no query head: an empty output
    return jnp.zeros(query.shape, query.dtype), jnp.full((b, n, t), -jnp.inf, jnp.float32)
  # Query head n reads key/value head n // (N // K).
  key32 = jnp.repeat(key.astype(jnp.float32), n // k, axis=2)
  value32 = jnp.repeat(value.astype(jnp.float32), n // k, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", query.astype(jnp.float32), key32, precision=_HIGHEST)
  logits = logits * default_scale(h, scale)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  keep = _keep_mask(b, n, t, s, mask, is_causal, normalize_local_window(local_window_size),
                    query_seq_lengths, key_value_seq_lengths)
  logits = jnp.where(keep, logits, MASKED_LOGIT)
  row_max = logits.max(axis=-1, keepdims=True)
  weights = jnp.exp(logits - row_max)
  total = weights.sum(axis=-1, keepdims=True)
  out = jnp.einsum("bnts,bsnh->btnh", weights / total, value32, precision=_HIGHEST)
  if query_seq_lengths is not None:
    out = jnp.where((jnp.arange(t)[None, :] < query_seq_lengths[:, None])[:, :, None, None],
                    out, 0.0)
  lse = (row_max + jnp.log(total))[..., 0]
  return out.astype(query.dtype), lse


def attention_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: LocalWindow = None,
) -> jax.Array:
  """Computes `jax.nn.dot_product_attention` in float32 at HIGHEST precision.

  Args:
    query: (B, T, N, H).
    key: (B, S, K, H), N a multiple of K.
    value: (B, S, K, H).
    bias: optional, 4-D, broadcastable to (B, N, T, S); added to the scaled logits.
    mask: optional bool, 4-D, broadcastable to (B, N, T, S); True keeps a position.
    scale: logit scale; defaults to 1/sqrt(H).
    is_causal: keep only keys s <= t.
    query_seq_lengths: optional (B,) int; query rows past it are dropped and zero.
    key_value_seq_lengths: optional (B,) int; keys past it are dropped.
    local_window_size: None, w or (left, right): keep keys t - left ... t + right.

  Returns:
    (B, T, N, H) array in query.dtype.

  Raises:
    ValueError: when the operands do not fit together (see check_attention_inputs).
  """
  out, _ = attention_reference_with_lse(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size)
  return out
