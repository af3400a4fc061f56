"""Block arithmetic of flash attention under positional masking, shared by the kernels.

The Pallas Triton and Mosaic GPU kernels both walk a query block's key blocks (forward,
dQ) or a key block's query blocks (dK/dV), and skip the blocks that causality, a local
window or the per-batch sequence lengths remove. Which blocks to visit, which of them
need a positional mask, and which pairs a mask keeps are the same questions for both;
they are answered here once, with scalar jnp arithmetic that lowers in either kernel
language (and runs in their interpreters).

Also here: the value jax gives removed logits, and the dV term of rows whose every key
is removed, which both backward passes add outside their inner loops.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stellarax.ops import index_math

# jax.nn.dot_product_attention replaces masked logits by this value (not -inf), which is
# what makes a fully masked row uniform over all keys instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# With a bias, the flash kernels raise every kept logit (base 2: the scaled q.k plus the
# bias, times log2 e) to at least this floor, in the forward pass and where the backward
# computes the logits again. Without it, a row that a huge negative bias masks whole
# went wrong: at -1e9 * log2 e float32 cannot add log2(row sum) to the row maximum, so
# the log-sum-exp residual lost it and the backward took each probability of the row as
# 1 instead of 1/S (dQ, dK, dV off by up to S times); finfo.min * log2 e overflowed to
# -inf and the row gave 0 where jax gives mean(V). Floored, such a row is uniform over
# its kept keys (as jax's rounding makes -1e9 rows), its residual keeps the row sum to
# 2^-7 in log2 (probabilities within 0.6%), and -inf biases give mean(V) (jax: NaN).
# A row with a logit 100 or more above the floor is unchanged to 2^-100. Rows wholly
# below it lose the q.k ranking jax still keeps for a bias of about -9.1e4 to -1e7,
# where the residual could not hold the row sum. float16's lowest, -65504, is above it.
BIASED_LOGIT_FLOOR = -2.0 ** 17
# The largest bias the kernels add (natural units): twice it, scaled to base 2, stays
# finite in float32. A bias of 3e38 (finite in float32 and bfloat16) became +inf once
# scaled by log2(e), and its row NaN, where jax attends to that key.
BIAS_CEILING = float(np.finfo(np.float32).max) / 2 / math.log2(math.e)


class BlockMasking:
  """Mixin: the positional masking of a static problem description.

  The class it is mixed into must have the attributes `t` (queries), `s` (keys),
  `causal` (bool),
  `window` ((left, right) or None), `has_kv_len` and `has_q_len` (bools: per-batch
  sequence lengths given) and `has_mask` (a boolean mask array given).
  """

  __slots__ = ()

  @property
  def left_reach(self) -> int | None:
    """How far left of its query a kept key may be, or None for unbounded."""
    return None if self.window is None else self.window[0]

  @property
  def right_reach(self) -> int | None:
    """How far right of its query a kept key may be, or None for unbounded."""
    reaches = ([0] if self.causal else []) + ([self.window[1]] if self.window else [])
    return min(reaches) if reaches else None

  @property
  def may_fully_mask(self) -> bool:
    """Whether some row may keep no key (causality alone always keeps key 0)."""
    return self.has_mask or self.has_kv_len or self.window is not None

  def positional(self, bk: int) -> bool:
    """Whether some key block of size `bk` needs a position-dependent mask."""
    return (self.causal or self.window is not None or self.has_kv_len
            or self.s % bk != 0)


def normalize_window(local_window_size: Any) -> tuple[int, int] | None:
  """A local window as (left, right), or None.

  Args:
    local_window_size: None, an int w >= 0 (meaning (w, w)) or a pair (left, right) of
      ints >= 0: query t keeps keys t - left ... t + right.

  Raises:
    ValueError: for anything else, negative sizes included.
  """
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    window = (local_window_size, local_window_size)
  elif isinstance(local_window_size, (tuple, list)):
    window = tuple(local_window_size)
  else:
    window = ()
  if (len(window) != 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in window)
      or min(window) < 0):
    raise ValueError(f"{local_window_size=} must be None, an int >= 0, or a pair (left,"
                     " right) of ints >= 0.")
  return window


def require_window_the_kernels_take(window: tuple[int, int] | None) -> None:
  """Raises NotImplementedError (so dispatch falls back) for a window with a negative side.

  jax accepts (left, right) windows with negative sides (a band that excludes the
  query's own position); the flash kernels' block arithmetic assumes sides >= 0.
  """
  if window is not None and min(window) < 0:
    raise NotImplementedError(f"local_window_size={window} has a negative side; the flash"
                              f" kernels take windows of sizes >= 0.")


def kernel_options(static: dict[str, Any]) -> dict[str, Any]:
  """The static options of an attention call as the flash kernels take them: the
  sequence lengths (any integer dtype in the op's signature) as int32.

  Args:
    static: the call's keyword options (`query_seq_lengths`, `key_value_seq_lengths`
      and the others, which pass unchanged).

  Returns:
    A new dict.
  """
  options = dict(static)
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if options.get(name) is not None:
      options[name] = options[name].astype(jnp.int32)
  return options


def require_keys_the_kernels_take(arguments: Any) -> None:
  """Raises NotImplementedError (so dispatch falls back) for queries with no key (S=0).

  A forward call with no query or no key is trivial (`Attention._is_trivial`: an empty
  output, or zeros) and runs no kernel, so only a backward call bound on its own
  (`...AttentionVjp.bind`) meets this.
  """
  q, k = arguments["query"].shape, arguments["key"].shape
  if k[1] == 0 and math.prod(q) > 0:
    raise NotImplementedError(f"no keys (S=0) for {q[1]} queries: the flash kernels need at "
                              "least one key.")


def check_seq_lengths(name: str, x: Any, batch: int) -> None:
  """Raises ValueError unless x is None or a (batch,) int32 array of sequence lengths."""
  if x is not None and (tuple(x.shape) != (batch,) or x.dtype != jnp.int32):
    raise ValueError(f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}; expected"
                     f" ({batch},) int32, one length per batch element.")


def effective_lengths(m: BlockMasking, q_len: Any, kv_len: Any) -> tuple[Any, Any]:
  """Query and key lengths after a batch element's sequence lengths.

  Args:
    m: the problem's masking (its T and S).
    q_len, kv_len: the element's lengths (scalars, traced), or None where not given.

  Returns:
    (t_eff, s_eff): the lengths clipped to [0, T] and [0, S]; T and S where not given.
  """
  t_eff = m.t if q_len is None else clip(q_len, 0, m.t)
  s_eff = m.s if kv_len is None else clip(kv_len, 0, m.s)
  return t_eff, s_eff


def select(cond: Any, a: Any, b: Any) -> jax.Array:
  """Scalar int32 where (Triton's select lowering mistypes weakly typed constants)."""
  return jnp.where(cond, jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def clip(x: Any, lo: Any, hi: Any) -> Any:
  """x limited to [lo, hi] (scalars, traced or static; hi >= lo)."""
  return jnp.minimum(jnp.maximum(x, lo), hi)


def key_block_range(m: BlockMasking, q0: Any, rows: int, bk: int, t_eff: Any, s_eff: Any):
  """Key blocks (of `bk` keys) that query rows [q0, q0 + rows) must visit.

  Args:
    m: the problem's masking.
    q0: first query row (traced or static int).
    rows: number of query rows.
    bk: keys per block.
    t_eff, s_eff: query and key lengths after the sequence lengths (<= T, S).

  Returns:
    (lo, full_lo, full_hi, hi), int32 scalars: blocks [lo, hi) hold every kept key of
    these rows; blocks [full_lo, full_hi) are kept for every row and need no positional
    mask. Rows at or past t_eff visit nothing (lo == hi) when all rows are.
  """
  left, right = m.left_reach, m.right_reach
  lo_key = 0 if left is None else jnp.maximum(q0 - left, 0)
  hi_key = s_eff if right is None else jnp.minimum(s_eff, q0 + rows + right)
  lo = index_math.div(jnp.int32(lo_key), bk)
  hi = jnp.maximum(index_math.cdiv(jnp.int32(hi_key), bk), lo)
  if m.has_q_len:
    hi = select(q0 < t_eff, hi, lo)  # Rows past the query length are written as zeros.
  if not m.positional(bk):
    return lo, lo, hi, hi
  full_lo = lo if left is None else index_math.cdiv(jnp.maximum(q0 + rows - 1 - left, 0), bk)
  full_hi_key = s_eff if right is None else jnp.minimum(s_eff, q0 + right + 1)
  full_lo = clip(full_lo, lo, hi)
  full_hi = clip(index_math.div(jnp.int32(full_hi_key), bk), full_lo, hi)
  return lo, full_lo, full_hi, hi


def query_block_range(m: BlockMasking, k0: Any, bq: int, keys: int, t_eff: Any, s_eff: Any):
  """Query blocks (of `bq` rows) that see some key of [k0, k0 + keys).

  Returns:
    (lo, full_lo, full_hi, hi) as in `key_block_range`: blocks [full_lo, full_hi) keep
    every pair with these keys (rows past t_eff aside, which callers drop by their
    log-sum-exp).
  """
  left, right = m.left_reach, m.right_reach
  lo_row = 0 if right is None else jnp.maximum(k0 - right, 0)
  hi_row = t_eff if left is None else jnp.minimum(t_eff, k0 + keys + left)
  hi_row = select(k0 < s_eff, hi_row, 0)  # The keys lie wholly past the key length.
  lo = index_math.div(jnp.int32(lo_row), bq)
  hi = jnp.maximum(index_math.cdiv(jnp.int32(hi_row), bq), lo)
  if not m.positional(keys):
    return lo, lo, hi, hi
  full_lo = lo if right is None else index_math.cdiv(jnp.maximum(k0 + keys - 1 - right, 0), bq)
  full_lo = clip(full_lo, lo, hi)
  full_hi = hi if left is None else index_math.div(jnp.int32(k0 + left + 1), bq)
  full_hi = select(k0 + keys <= s_eff, full_hi, full_lo)  # Tail keys are masked.
  full_hi = clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def positional_ok(m: BlockMasking, q_pos: jax.Array, k_pos: jax.Array, s_eff: Any) -> jax.Array:
  """Kept (query, key) pairs by position; q_pos and k_pos broadcast against each other."""
  ok = k_pos < s_eff
  if m.right_reach is not None:
    ok = ok & (k_pos <= q_pos + m.right_reach)
  if m.left_reach is not None:
    ok = ok & (k_pos >= q_pos - m.left_reach)
  return ok


def dead_rows(lse: jax.Array, q_len: jax.Array | None) -> jax.Array:
  """(B, N, T) bool: rows that feed no logit gradient, past q_len or with no kept key.

  Args:
    lse: (B, N, T) natural-log log-sum-exp from a forward kernel, at most
      0.5 * MASK_VALUE on rows that kept no key.
    q_len: optional (B,) query lengths.
  """
  dead = lse <= 0.5 * MASK_VALUE
  if q_len is not None:
    t = lse.shape[-1]
    dead = dead | (jnp.arange(t, dtype=jnp.int32)[None, None, :] >= q_len[:, None, None])
  return dead


def fully_masked_dv(lse: jax.Array, dout: jax.Array, q_len: jax.Array | None, *,
                    num_kv_heads: int, s: int) -> jax.Array:
  """dV term of fully masked rows, (B, K, H) float32, the same for every key row.

  jax gives such a row probability 1/S on every key (and zero logit gradient), so it adds
  dout / S to every dV row of its kv head.

  Args:
    lse: (B, N, T) forward log-sum-exp (at most 0.5 * MASK_VALUE where no key is kept).
    dout: (B, T, N, H) output cotangent.
    q_len: optional (B,) query lengths; rows past them have zero output, so no term.
    num_kv_heads: K.
    s: number of keys S.
  """
  b, t, n, h = dout.shape
  empty = lse <= 0.5 * MASK_VALUE
  if q_len is not None:
    empty = empty & (jnp.arange(t, dtype=jnp.int32)[None, None, :] < q_len[:, None, None])
  per_head = jnp.einsum("bnt,btnh->bnh", empty.astype(jnp.float32),
                        dout.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  return per_head.reshape(b, num_kv_heads, n // num_kv_heads, h).sum(axis=2) / s
