"""Dot-product attention in plain JAX (XLA): full logits, or a chunked online softmax.

Both paths compute what `jax.nn.dot_product_attention` computes (see reference.py
for the semantics, including rows with no kept position) and also return the
log-sum-exp residual.

- `chunk_q = chunk_k = None`: the whole (T, S) logits matrix per head is
  materialised, like JAX's own XLA path.
- Otherwise a flash-style loop: `lax.map` over query chunks and, inside it,
  `lax.scan` over key chunks carrying the running row max, row sum and output.
  Memory is O(chunk_q * chunk_k) per head instead of O(T * S). T and S need not be
  multiples of the chunks: the tail is padded and the padding keys are dropped.
  Key chunks that no query of the chunk may see (causal, local window, sequence
  lengths) are skipped with `lax.cond`.

Rows with no kept key are handled apart in the chunked path: the loop drops
masked keys outright (weight 0), and a row that ends with no weight at all takes
the mean of all S values and the log-sum-exp of S masked logits, which is exactly
what the uniform softmax of JAX's large-negative fill gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stellarax.core.config import check_positive_int
from stellarax.ops.attention.reference import (
    MASKED_LOGIT, LocalWindow, check_attention_inputs, default_scale, normalize_local_window)


def _grouped(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
  """Reshapes a (b, n, t, s) bias or mask to (b, K, G, t, s) (n == 1: (b, 1, 1, t, s))."""
  if x is None:
    return None
  b, n, t, s = x.shape
  return x.reshape(b, 1, 1, t, s) if n == 1 else x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def _keep_mask(q_pos, k_pos, mask, is_causal, window, q_lengths, kv_lengths):
  """Returns kept positions as a bool array broadcastable to (B, K, G, tq, tk), or None.

  Args:
    q_pos: (tq,) int32 query positions; k_pos: (tk,) int32 key positions.
    mask: None or a bool (b, K|1, G|1, tq|1, tk|1) block of the user mask.
    is_causal, window, q_lengths, kv_lengths: as in attention_xla.
  """
  keep = None

  def both(a, c):
    return c if a is None else a & c

  if mask is not None:
    keep = mask
  if is_causal:
    keep = both(keep, (k_pos[None, :] <= q_pos[:, None])[None, None, None])
  if window is not None:
    left, right = window
    q_col, k_row = q_pos[:, None], k_pos[None, :]
    in_window = (q_col - left <= k_row) & (k_row <= q_col + right)
    keep = both(keep, in_window[None, None, None])
  if q_lengths is not None:
    keep = both(keep, (q_pos[None, :] < q_lengths[:, None])[:, None, None, :, None])
  if kv_lengths is not None:
    keep = both(keep, (k_pos[None, :] < kv_lengths[:, None])[:, None, None, None, :])
  return keep


def _scaled_logits(q, k, scale, bias):
  """(B, tq, K, G, H) x (B, tk, K, H) -> (B, K, G, tq, tk) float32 logits."""
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(scale)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  return logits


def _weighted_values(p, v):
  """(B, K, G, tq, tk) weights x (B, tk, K, H) values -> (B, K, G, tq, H) float32."""
  # Weights go to the value dtype for the matmul, as JAX does; accumulate in float32.
  return jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _zero_padded_queries(out, q_lengths):
  """Zeroes (B, T, N, H) output rows t >= q_lengths[b]."""
  if q_lengths is None:
    return out
  rows = jnp.arange(out.shape[1])[None, :] < q_lengths[:, None]
  return jnp.where(rows[:, :, None, None], out, jnp.zeros((), out.dtype))


def _attention_full(q, k, v, bias, mask, scale, is_causal, window, q_lengths, kv_lengths):
  """Materialised logits; q is (B, T, K, G, H). Returns (B, K, G, T, H) f32, (B, K, G, T)."""
  t, s = q.shape[1], k.shape[1]
  logits = _scaled_logits(q, k, scale, bias)
  keep = _keep_mask(jnp.arange(t), jnp.arange(s), mask, is_causal, window, q_lengths, kv_lengths)
  if keep is not None:
    logits = jnp.where(keep, logits, MASKED_LOGIT)
  row_max = logits.max(axis=-1, keepdims=True)
  weights = jnp.exp(logits - row_max)
  total = weights.sum(axis=-1, keepdims=True)
  out = _weighted_values(weights / total, v)
  return out, (row_max + jnp.log(total))[..., 0]


def _pad_axis(x, axis, size):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _block_slice(x, axis, start, size):
  """Slices [start, start + size) of `axis` unless that axis broadcasts (size 1)."""
  if x is None or x.shape[axis] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, start, size, axis)


def _block_may_keep(q_start, k_start, chunk_q, chunk_k, is_causal, window, q_lengths, kv_lengths):
  """Whether any (query, key) pair of the block may be kept; False lets us skip it."""
  q_last, k_last = q_start + chunk_q - 1, k_start + chunk_k - 1
  live = jnp.bool_(True)
  if is_causal:
    live &= k_start <= q_last
  if window is not None:
    left, right = window
    live &= (k_last >= q_start - left) & (k_start <= q_last + right)
  if q_lengths is not None:
    live &= q_start < q_lengths.max()
  if kv_lengths is not None:
    live &= k_start < kv_lengths.max()
  return live


def _online_softmax_step(carry, q_blk, k_blk, v_blk, scale, bias_blk, keep):
  """Folds one key chunk into the running (row max, row sum, output) of a query chunk.

  Dropped keys get weight 0 (logit -inf), not JAX's large negative logit: a row
  that never sees a kept key ends with row sum 0 and is finished by _finish_rows.
  """
  row_max, row_sum, acc = carry
  logits = jnp.where(keep, _scaled_logits(q_blk, k_blk, scale, bias_blk), -jnp.inf)
  new_max = jnp.maximum(row_max, logits.max(axis=-1))
  # A row with no kept key so far has max -inf; shift by 0 to avoid inf - inf.
  shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  weights = jnp.exp(logits - shift[..., None])
  rescale = jnp.exp(row_max - shift)
  row_sum = rescale * row_sum + weights.sum(axis=-1)
  acc = rescale[..., None] * acc + _weighted_values(weights, v_blk)
  return new_max, row_sum, acc


def _split_chunks(x, chunk, num_chunks):
  """(B, L, ...) -> (num_chunks, B, chunk, ...), zero-padding L to num_chunks * chunk."""
  x = _pad_axis(x, 1, num_chunks * chunk)
  return jnp.moveaxis(x.reshape(x.shape[0], num_chunks, chunk, *x.shape[2:]), 1, 0)


def _pad_pairwise(x, t_pad, s_pad):
  """Pads the (t, s) axes (3 and 4) of a grouped bias or mask, unless they broadcast."""
  if x is not None and x.shape[3] > 1:
    x = _pad_axis(x, 3, t_pad)
  if x is not None and x.shape[4] > 1:
    x = _pad_axis(x, 4, s_pad)
  return x


def _attention_chunked(q, k, v, bias, mask, scale, is_causal, window, q_lengths, kv_lengths,
                       chunk_q, chunk_k):
  """Online softmax over chunks; q is (B, T, K, G, H). Returns like _attention_full."""
  b, t, kh, g, h = q.shape
  s = k.shape[1]
  # A chunk larger than its axis is the whole axis (at least 1, so empty axes work).
  chunk_q, chunk_k = max(1, min(chunk_q, t)), max(1, min(chunk_k, s))
  num_q, num_k = -(-t // chunk_q), -(-s // chunk_k)
  bias = _pad_pairwise(bias, num_q * chunk_q, num_k * chunk_k)
  mask = _pad_pairwise(mask, num_q * chunk_q, num_k * chunk_k)
  k_chunks, v_chunks = _split_chunks(k, chunk_k, num_k), _split_chunks(v, chunk_k, num_k)

  def query_chunk(args):
    q_blk, q_start = args
    q_pos = q_start + jnp.arange(chunk_q)
    bias_q = _block_slice(bias, 3, q_start, chunk_q)
    mask_q = _block_slice(mask, 3, q_start, chunk_q)

    def key_chunk(carry, args):
      k_blk, v_blk, k_start = args

      def update(carry):
        k_pos = k_start + jnp.arange(chunk_k)
        keep = _keep_mask(q_pos, k_pos, _block_slice(mask_q, 4, k_start, chunk_k), is_causal,
                          window, q_lengths, kv_lengths)
        in_range = (k_pos < s)[None, None, None, None, :]  # padding keys never count
        keep = in_range if keep is None else keep & in_range
        return _online_softmax_step(carry, q_blk, k_blk, v_blk, scale,
                                    _block_slice(bias_q, 4, k_start, chunk_k), keep)

      live = _block_may_keep(q_start, k_start, chunk_q, chunk_k, is_causal, window,
                             q_lengths, kv_lengths)
      return lax.cond(live, update, lambda c: c, carry), None

    init = (jnp.full((b, kh, g, chunk_q), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, chunk_q), jnp.float32),
            jnp.zeros((b, kh, g, chunk_q, h), jnp.float32))
    return lax.scan(key_chunk, init, (k_chunks, v_chunks, jnp.arange(num_k) * chunk_k))[0]

  carry = lax.map(query_chunk, (_split_chunks(q, chunk_q, num_q), jnp.arange(num_q) * chunk_q))
  # (num_q, B, K, G, chunk_q, ...) -> (B, K, G, T, ...)
  row_max, row_sum, acc = (
      jnp.moveaxis(x, 0, 3).reshape(b, kh, g, num_q * chunk_q, *x.shape[5:])[:, :, :, :t]
      for x in carry)
  return _finish_rows(row_max, row_sum, acc, v)


def _finish_rows(row_max, row_sum, acc, v):
  """Normalises the running sums; rows with no kept key get JAX's uniform softmax."""
  s = v.shape[1]
  has_key = row_sum > 0
  out = acc / jnp.where(has_key, row_sum, 1.0)[..., None]
  value_mean = jnp.mean(v.astype(jnp.float32), axis=1)[:, :, None, None, :]  # (B, K, 1, 1, H)
  out = jnp.where(has_key[..., None], out, value_mean)
  lse = jnp.where(has_key, row_max + jnp.log(jnp.where(has_key, row_sum, 1.0)),
                  jnp.float32(MASKED_LOGIT) + jnp.float32(np.log(s)))
  return out, lse


def attention_xla(
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
    chunk_q: int | None = None,
    chunk_k: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Computes `jax.nn.dot_product_attention` (BTNH) and its log-sum-exp.

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
    chunk_q: query rows per chunk of the online softmax; None = all T rows.
    chunk_k: keys per chunk of the online softmax; None = all S keys. With both
      None the full logits matrix is materialised.

  Returns:
    (out, lse): out (B, T, N, H) in query.dtype; lse (B, N, T) float32, the
    log-sum-exp of every row of masked, scaled logits.

  Raises:
    ValueError: when the operands do not fit together or a chunk is not a positive int.
  """
  check_attention_inputs(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths)
  check_positive_int("chunk_q", chunk_q, allow_none=True)
  check_positive_int("chunk_k", chunk_k, allow_none=True)
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  args = (query.reshape(b, t, kh, n // kh, h), key, value, _grouped(bias, kh), _grouped(mask, kh),
          default_scale(h, scale), is_causal, normalize_local_window(local_window_size),
          query_seq_lengths, key_value_seq_lengths)
  if chunk_q is None and chunk_k is None:
    out, lse = _attention_full(*args)
  else:
    out, lse = _attention_chunked(*args, chunk_q or t, chunk_k or s)
  out = jnp.moveaxis(out, 3, 1).reshape(b, t, n, h).astype(query.dtype)
  return _zero_padded_queries(out, query_seq_lengths), lse.reshape(b, n, t)
