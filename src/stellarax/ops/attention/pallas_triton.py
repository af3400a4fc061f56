"""Flash attention, forward and backward, as Pallas Triton kernels.

Semantics follow `jax.nn.dot_product_attention` (layout BTNH):

- query (B, T, N, H); key and value (B, S, K, H), N a multiple of K (GQA/MQA). A query
  head n reads kv head n // (N // K), as in jax's reshape to (B, T, K, G, H).
- logits = scale * q.k + bias; positions removed by the bool `mask` (True = keep),
  `is_causal` (key j <= query i), `local_window_size` (i - left <= j <= i + right) and the
  sequence lengths take the value -0.7 * float32 max, exactly as in jax. A row whose every
  logit is removed therefore attends uniformly to all S keys; its output is mean(V) and its
  logsumexp is that large negative value. Rows at or past `query_seq_lengths` are zero.

The forward is FlashAttention-2: one program per (query block, head, batch) keeps the query
tile resident, streams key/value tiles with an online softmax accumulated in float32, and
visits only key blocks that causality, the window and the key length leave unmasked (blocks
wholly inside the kept region skip the positional mask). K/V are indexed per kv head in the
BlockSpec index map, never repeated in memory. Sequence tails are handled with masked loads
and stores, so no input is padded or copied.

The backward uses three kernels, no atomics, so results are deterministic:
1. a preprocess computing delta = rowsum(dout * out) and the base-2 logsumexp, set to +inf
   on rows that must not contribute (past the query length or fully masked);
2. a dK/dV kernel: one program per (key block, kv head, batch) loops over every query head
   of its GQA group and the query blocks that can see it, so dK/dV are summed over the group
   in registers;
3. a dQ kernel: one program per (query block, head, batch) loops over key blocks.
Two kernels instead of one fused kernel with atomic dQ accumulation cost one more
recomputation of the logits but keep the result bit-reproducible, which autotuning needs.

`bias` is treated as non-differentiable: no dbias is computed (callers must stop its
gradient). The gradient of fully masked rows matches jax: they add mean-weighted dout to
every dV row and nothing to dQ/dK.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.ops import index_math
from stellarax.ops import pallas_backends
from stellarax.ops import pallas_common
from stellarax.ops.attention import flash_blocks
from stellarax.ops.attention.flash_blocks import MASK_VALUE
from stellarax.ops.pallas_common import unpack_refs

plgpu = pallas_backends.triton

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# Largest dynamic shared memory one block may use on sm_90 (H100/H200): 227 KiB.
_SMEM_LIMIT_BYTES = 232448
# Float32 tile elements a thread (accumulators and logits) above which a kernel spills
# registers; used only to prune search spaces. Compiled for an H200
# (bench/compile_h200.py): backward configs at 192 used up to 255 registers without
# spilling; the forward spilled 16 to 100 bytes at 192 (128 x 64 blocks of head dim 128
# on 4 warps) and none at 160 (about 230 registers).
_REGISTER_BUDGET = 192
_FWD_REGISTER_BUDGET = 160

_BLOCK_CHOICES = (16, 32, 64, 128, 256)
_NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)
_MAX_NUM_STAGES = 8


# --------------------------------------------------------------------------------------
# Static problem description
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Spec(flash_blocks.BlockMasking):
  """Everything static about one attention call except the tunables."""

  t: int
  s: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  scale: float
  causal: bool
  window: tuple[int, int] | None
  bias_shape: tuple[int, int, int, int] | None
  mask_shape: tuple[int, int, int, int] | None
  has_q_len: bool
  has_kv_len: bool

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def has_mask(self) -> bool:
    return self.mask_shape is not None


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def _check_block(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value not in _BLOCK_CHOICES:
    raise ValueError(
        f"{name}={value!r} must be one of {_BLOCK_CHOICES} (a power of two: Triton tiles"
        " need power-of-two sizes and dot operands of at least 16); pick one of those.")


def _check_warps_stages(num_warps: Any, num_stages: Any) -> None:
  if (isinstance(num_warps, bool) or not isinstance(num_warps, int)
      or num_warps not in _NUM_WARPS_CHOICES):
    raise ValueError(f"{num_warps=} must be one of {_NUM_WARPS_CHOICES}.")
  if (isinstance(num_stages, bool) or not isinstance(num_stages, int)
      or not 1 <= num_stages <= _MAX_NUM_STAGES):
    raise ValueError(
        f"{num_stages=} must be an int in [1, {_MAX_NUM_STAGES}] (software pipeline"
        " depth of the inner loop).")


def check_fwd_tunables(*, block_q: int, block_k: int, num_warps: int,
                          num_stages: int) -> None:
  """Checks forward tunables, independent of the input shape.

  Args:
    block_q: query rows per program.
    block_k: key rows per inner-loop step.
    num_warps: warps per program.
    num_stages: software pipelining depth of the key loop.

  Raises:
    ValueError: naming the bad value and the accepted ones.
  """
  _check_block("block_q", block_q)
  _check_block("block_k", block_k)
  _check_warps_stages(num_warps, num_stages)


def check_bwd_tunables(*, block_q: int, block_k: int, block_q_dq: int,
                          block_k_dq: int, num_warps: int, num_stages: int) -> None:
  """Checks backward tunables, independent of the input shape.

  Args:
    block_q: query rows per inner-loop step of the dK/dV kernel.
    block_k: key rows per program of the dK/dV kernel.
    block_q_dq: query rows per program of the dQ kernel.
    block_k_dq: key rows per inner-loop step of the dQ kernel.
    num_warps: warps per program (all backward kernels).
    num_stages: software pipelining depth of the inner loops.

  Raises:
    ValueError: naming the bad value and the accepted ones.
  """
  for name, value in (("block_q", block_q), ("block_k", block_k),
                      ("block_q_dq", block_q_dq), ("block_k_dq", block_k_dq)):
    _check_block(name, value)
  _check_warps_stages(num_warps, num_stages)


def _padded_4d_shape(name: str, x: Any, full: tuple[int, ...]) -> tuple[int, ...]:
  """Returns x's shape left-padded to 4D after checking it broadcasts to `full`."""
  shape = tuple(x.shape)
  if len(shape) > 4:
    raise ValueError(f"{name} has shape {shape}; expected at most 4 dims broadcastable"
                     f" to (B, N, T, S) = {full}.")
  shape = (1,) * (4 - len(shape)) + shape
  if any(d not in (1, f) for d, f in zip(shape, full)):
    raise ValueError(f"{name} has shape {tuple(x.shape)}, not broadcastable to (B, N, T, S)"
                     f" = {full}: every dim must be 1 or the full size.")
  return shape


def _make_spec(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
               scale, is_causal, local_window_size) -> _Spec:
  """Validates the inputs and static options and describes the call."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"{name} has shape {x.shape}; expected 4 dims (BTNH / BSKH).")
  b, t, n, h = query.shape
  _, s, k, _ = key.shape
  if key.shape[0] != b or key.shape[3] != h or value.shape != key.shape:
    raise ValueError(f"Incompatible shapes query={query.shape}, key={key.shape},"
                     f" value={value.shape}: expected (B, T, N, H), (B, S, K, H), (B, S, K, H).")
  if not (query.dtype == key.dtype == value.dtype) or query.dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype} must"
                     f" be equal and one of {[str(d) for d in SUPPORTED_DTYPES]}.")
  if h not in SUPPORTED_HEAD_DIMS:
    raise ValueError(f"head dim H={h} is not supported; expected one of"
                     f" {SUPPORTED_HEAD_DIMS}. Pad the head dim or use the XLA path.")
  if n % k != 0:
    raise ValueError(f"The number of query heads N={n} must be a multiple of the number of"
                     f" kv heads K={k}.")
  if t < 1 or s < 1:
    raise ValueError(f"Empty sequences are not supported: T={t}, S={s}.")
  full = (b, n, t, s)
  bias_shape = None if bias is None else _padded_4d_shape("bias", bias, full)
  if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
    raise ValueError(f"bias dtype {bias.dtype} must be floating point.")
  mask_shape = None if mask is None else _padded_4d_shape("mask", mask, full)
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"mask dtype {mask.dtype} must be bool (True = keep); pass additive"
                     " masks as bias.")
  flash_blocks.check_seq_lengths("query_seq_lengths", query_seq_lengths, b)
  flash_blocks.check_seq_lengths("key_value_seq_lengths", key_value_seq_lengths, b)
  scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
  return _Spec(t=t, s=s, num_heads=n, num_kv_heads=k, head_dim=h, scale=scale,
               causal=bool(is_causal), window=flash_blocks.normalize_window(local_window_size),
               bias_shape=bias_shape, mask_shape=mask_shape,
               has_q_len=query_seq_lengths is not None,
               has_kv_len=key_value_seq_lengths is not None)


# --------------------------------------------------------------------------------------
# Kernel helpers (traced inside kernels)
# --------------------------------------------------------------------------------------


def _load(view: Any, valid: jax.Array | None, other: Any) -> jax.Array:
  """Loads a ref view; masked (filled with `other`) only where `valid` is given."""
  if valid is None:
    return plgpu.load(view)
  return plgpu.load(view, mask=valid, other=other)


def _store(view: Any, value: jax.Array, valid: jax.Array | None) -> None:
  if valid is None:
    plgpu.store(view, value)
  else:
    plgpu.store(view, value, mask=valid)


def _in_bounds(start: Any, size: int, length: int) -> jax.Array | None:
  """Which of `size` positions from `start` lie below `length`; None if all, statically."""
  if length % size == 0:
    return None  # Blocks start at multiples of `size`, so the whole block is in bounds.
  return start + lax.iota(jnp.int32, size) < length


def _index(i: Any) -> jax.Array:
  """A scalar ref index as an int32 array (the interpreter rejects Python ints here)."""
  return jnp.asarray(i, jnp.int32)


def _dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
  """a @ b (or a @ b.T) accumulated in float32."""
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _effective_lengths(spec: _Spec, q_len_ref: Any, kv_len_ref: Any) -> tuple[Any, Any]:
  """Query and key lengths after this program's sequence lengths, clipped to T and S."""
  read = lambda ref: None if ref is None else ref[...]
  return flash_blocks.effective_lengths(spec, read(q_len_ref), read(kv_len_ref))


def _load_pair_tile(ref: Any, head: Any, q0: Any, bq: int, k0: Any, bk: int, *,
                    spec: _Spec, other: Any) -> jax.Array:
  """Loads the (bq, bk) bias or mask tile of a (heads, T or 1, S or 1) ref, broadcast."""
  rows_full, cols_full = ref.shape[1] != 1, ref.shape[2] != 1
  row_ok = _in_bounds(q0, bq, spec.t) if rows_full else None
  col_ok = _in_bounds(k0, bk, spec.s) if cols_full else None
  valid = None
  if row_ok is not None or col_ok is not None:
    valid = jnp.ones((bq if rows_full else 1, bk if cols_full else 1), jnp.bool_)
    valid = valid if row_ok is None else valid & row_ok[:, None]
    valid = valid if col_ok is None else valid & col_ok[None, :]
  view = ref.at[_index(head), pl.ds(q0, bq) if rows_full else pl.ds(0, 1),
                pl.ds(k0, bk) if cols_full else pl.ds(0, 1)]
  return jnp.broadcast_to(_load(view, valid, other), (bq, bk))


def _scaled_logits(spec, q, k, bias_ref, mask_ref, heads, q0, bq, k0, bk, s_eff,
                   positional: bool, transposed: bool) -> jax.Array:
  """Base-2 logits of a tile with masked entries set to MASK_VALUE.

  Shape (bq, bk), or (bk, bq) when `transposed` (the dK/dV kernel keeps keys as rows so
  that every matmul there has the key block as its M dimension). `heads` is the
  (bias, mask) head index inside their refs.
  """
  s = _dot(k, q, trans_b=True) if transposed else _dot(q, k, trans_b=True)
  s = s * (spec.scale * _LOG2E)
  orient = (lambda x: x.T) if transposed else (lambda x: x)
  if bias_ref is not None:
    bias = _load_pair_tile(bias_ref, heads[0], q0, bq, k0, bk, spec=spec, other=0.0)
    bias = jnp.minimum(bias.astype(jnp.float32), flash_blocks.BIAS_CEILING)
    s = jnp.maximum(s + orient(bias) * _LOG2E, flash_blocks.BIASED_LOGIT_FLOOR)
  ok = None
  if mask_ref is not None:
    ok = orient(_load_pair_tile(mask_ref, heads[1], q0, bq, k0, bk, spec=spec, other=False))
  if positional:
    q_pos = q0 + lax.iota(jnp.int32, bq)
    k_pos = k0 + lax.iota(jnp.int32, bk)
    ok_at = functools.partial(flash_blocks.positional_ok, spec, s_eff=s_eff)
    pos = (ok_at(q_pos[None, :], k_pos[:, None]) if transposed
           else ok_at(q_pos[:, None], k_pos[None, :]))
    ok = pos if ok is None else ok & pos
  return s if ok is None else jnp.where(ok, s, MASK_VALUE)


def _run_blocks(lo, full_lo, full_hi, hi, loop, carry, *, masked_head: bool):
  """Runs loop(start, stop, carry, positional) over the blocks [lo, hi): the unmasked
  ones [full_lo, full_hi) first, then the masked head [lo, full_lo) (if any) and tail.

  Unmasked blocks come first because a masked loop ahead of the unmasked one made
  ptxas serialize the dK/dV kernel's wgmma (remark C7515, found by
  bench/compile_h200.py); every kernel here sums over blocks in any order.
  """
  carry = loop(full_lo, full_hi, carry, False)
  if masked_head:
    carry = loop(lo, full_lo, carry, True)
  return loop(full_hi, hi, carry, True)


def _block_loop(body):
  """`loop` for `_run_blocks`: a fori_loop of body(block, carry, positional=...)."""
  return lambda lo, hi, carry, positional: lax.fori_loop(
      lo, hi, functools.partial(body, positional=positional), carry)


def _query_block_index(spec: _Spec, bq: int) -> Any:
  """Query block of this program; causal runs the longest (last) blocks first."""
  i = pl.program_id(1)
  return pl.cdiv(spec.t, bq) - 1 - i if spec.causal else i


# --------------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------------


def _fwd_kernel(*refs, spec: _Spec, bq: int, bk: int):
  (q_ref, k_ref, v_ref, bias_ref, mask_ref, q_len_ref, kv_len_ref, v_mean_ref, o_ref,
   lse_ref) = unpack_refs(refs, (True, True, True, spec.bias_shape is not None,
                                 spec.mask_shape is not None, spec.has_q_len,
                                 spec.has_kv_len, spec.may_fully_mask, True, True))
  q0 = _query_block_index(spec, bq) * bq
  t_eff, s_eff = _effective_lengths(spec, q_len_ref, kv_len_ref)
  row_ok = _in_bounds(q0, bq, spec.t)
  q = _load(q_ref.at[pl.ds(q0, bq), _index(0), :], None if row_ok is None else row_ok[:, None], 0.0)

  def body(kb, carry, positional):
    acc, m, l = carry
    k0 = kb * bk
    col_ok = _in_bounds(k0, bk, spec.s) if positional else None  # Tails are never full.
    col_ok = None if col_ok is None else col_ok[:, None]
    k = _load(k_ref.at[pl.ds(k0, bk), :], col_ok, 0.0)
    v = _load(v_ref.at[pl.ds(k0, bk), :], col_ok, 0.0)
    s = _scaled_logits(spec, q, k, bias_ref, mask_ref, (0, 0), q0, bq, k0, bk, s_eff,
                       positional, transposed=False)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  # m starts at MASK_VALUE, not -inf: then a block whose entries are all masked gives
  # exp2(0) = 1 instead of NaN, and any real logit later rescales those terms to zero.
  carry = (jnp.zeros((bq, spec.head_dim), jnp.float32),
           jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
  ranges = flash_blocks.key_block_range(spec, q0, bq, bk, t_eff, s_eff)
  acc, m, l = _run_blocks(*ranges, _block_loop(body), carry,
                          masked_head=spec.left_reach is not None)

  l_safe = jnp.where(l == 0.0, 1.0, l)
  out = acc / l_safe[:, None]
  lse = (m + jnp.log2(l_safe)) * _LN2
  if spec.may_fully_mask:
    # m stays MASK_VALUE only if no kept logit was seen: jax gives mean(V) there.
    empty = m == MASK_VALUE
    out = jnp.where(empty[:, None], v_mean_ref[...][None, :], out)
    lse = jnp.where(empty, MASK_VALUE, lse)
  if spec.has_q_len:
    rows_live = q0 + lax.iota(jnp.int32, bq) < t_eff
    out = jnp.where(rows_live[:, None], out, 0.0)
    lse = jnp.where(rows_live, lse, MASK_VALUE)
  _store(o_ref.at[pl.ds(q0, bq), _index(0), :], out.astype(o_ref.dtype),
         None if row_ok is None else row_ok[:, None])
  _store(lse_ref.at[_index(0), pl.ds(q0, bq)], lse, row_ok)


# --------------------------------------------------------------------------------------
# BlockSpecs. Sequence dims are whole (kernels slice them with absolute offsets and mask
# the tails); batch is squeezed; heads are picked in the index map.
# --------------------------------------------------------------------------------------


def _pick(size: int, index: Any) -> Any:
  """Index along a dim that may be broadcast (size 1)."""
  return 0 if size == 1 else index


def _seq_spec(length: int, heads: int, h: int, head_of) -> pl.BlockSpec:
  """(length, heads, H) view of a (B, L, N, H) array at block head_of(grid)."""
  return pl.BlockSpec((None, length, heads, h),
                      lambda x, y, b: (b, 0, head_of(x), 0))


def _kv_spec(spec: _Spec, kv_head_of) -> pl.BlockSpec:
  return pl.BlockSpec((None, spec.s, None, spec.head_dim),
                      lambda x, y, b: (b, 0, kv_head_of(x), 0))


def _rows_spec(spec: _Spec, heads: int) -> pl.BlockSpec:
  """(heads, T) view of a (B, N, T) float32 array (lse, delta)."""
  return pl.BlockSpec((None, heads, spec.t), lambda x, y, b: (b, x, 0))


def _pair_spec(shape: tuple[int, ...], heads: int) -> pl.BlockSpec:
  """(heads or 1, T or 1, S or 1) view of a bias/mask broadcastable to (B, N, T, S)."""
  bb, nb, tb, sb = shape
  nblk = 1 if nb == 1 else heads
  return pl.BlockSpec((None, nblk, tb, sb),
                      lambda x, y, b: (_pick(bb, b), _pick(nb, x), 0, 0))


def _len_spec() -> pl.BlockSpec:
  return pl.BlockSpec((None,), lambda x, y, b: (b,))


def _vec_spec(spec: _Spec, kv_head_of) -> pl.BlockSpec:
  """(H,) view of a (B, K, H) float32 array."""
  return pl.BlockSpec((None, None, spec.head_dim), lambda x, y, b: (b, kv_head_of(x), 0))


def _as_4d(x: jax.Array | None, shape: tuple[int, ...] | None) -> jax.Array | None:
  return None if x is None else x.reshape(shape)


def _optional_inputs(spec: _Spec, bias, mask, q_len, kv_len, heads: int):
  """BlockSpecs and arrays of the optional bias, mask and sequence-length inputs."""
  specs, args = [], []
  for x, shape in ((bias, spec.bias_shape), (mask, spec.mask_shape)):
    if x is not None:
      specs.append(_pair_spec(shape, heads))
      args.append(_as_4d(x, shape))
  for x in (q_len, kv_len):
    if x is not None:
      specs.append(_len_spec())
      args.append(x)
  return specs, args


def _compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# --------------------------------------------------------------------------------------
# Forward wrapper
# --------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("spec", "block_q", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def _fwd(query, key, value, bias, mask, q_len, kv_len, *, spec: _Spec, block_q: int,
         block_k: int, num_warps: int, num_stages: int, interpret: bool):
  b, t, n, h = query.shape
  g = spec.group
  kv_head = lambda x: index_math.div(x, g)
  opt_specs, opt_args = _optional_inputs(spec, bias, mask, q_len, kv_len, heads=1)
  in_specs = [_seq_spec(t, 1, h, lambda x: x), _kv_spec(spec, kv_head),
              _kv_spec(spec, kv_head), *opt_specs]
  args = [query, key, value, *opt_args]
  if spec.may_fully_mask:
    in_specs.append(_vec_spec(spec, kv_head))
    args.append(jnp.mean(value.astype(jnp.float32), axis=1))
  out, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, spec=spec, bq=block_q, bk=block_k),
      grid=(n, pl.cdiv(t, block_q), b),
      in_specs=in_specs,
      out_specs=[_seq_spec(t, 1, h, lambda x: x), _rows_spec(spec, 1)],
      out_shape=[pallas_common.out_struct(query.shape, query.dtype, like=query),
                 pallas_common.out_struct((b, n, t), jnp.float32, like=query)],
      compiler_params=_compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="stellarax_attention_fwd",
  )(*args)
  return out, lse


def attention_fwd_pallas_triton(query, key, value, bias=None, mask=None, *, scale=None,
                                is_causal=False, query_seq_lengths=None,
                                key_value_seq_lengths=None, local_window_size=None,
                                block_q: int, block_k: int, num_warps: int,
                                num_stages: int, interpret: bool = False):
  """Flash attention forward with the semantics of jax.nn.dot_product_attention.

  Args:
    query: (B, T, N, H) bfloat16, float16 or float32; H in (64, 128, 256).
    key: (B, S, K, H), same dtype; N must be a multiple of K.
    value: (B, S, K, H), same dtype.
    bias: optional float array broadcastable to (B, N, T, S), added to the scaled logits.
    mask: optional bool array broadcastable to (B, N, T, S); True keeps a logit.
    scale: logit scale; default 1 / sqrt(H).
    is_causal: keep only keys j <= query position i.
    query_seq_lengths: optional (B,) int32; rows at or past it are zero.
    key_value_seq_lengths: optional (B,) int32; keys at or past it are masked.
    local_window_size: None, an int w (= (w, w)) or (left, right): keep keys with
      i - left <= j <= i + right.
    block_q: query rows per program (power of two in 16..256).
    block_k: key rows per step of the inner loop (power of two in 16..256).
    num_warps: warps per program.
    num_stages: software pipelining depth of the key loop.
    interpret: run the kernel in the Pallas interpreter (CPU testing).

  Returns:
    (out, lse): out (B, T, N, H) in query's dtype; lse (B, N, T) float32, the natural-log
    logsumexp of each row's masked, scaled logits (MASK_VALUE for fully masked rows and
    rows past query_seq_lengths).

  Raises:
    ValueError: for unsupported shapes, dtypes, options or tunables.
  """
  check_fwd_tunables(block_q=block_q, block_k=block_k, num_warps=num_warps,
                        num_stages=num_stages)
  spec = _make_spec(query, key, value, bias, mask, query_seq_lengths,
                    key_value_seq_lengths, scale, is_causal, local_window_size)
  return _fwd(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
              spec=spec, block_q=block_q, block_k=block_k, num_warps=num_warps,
              num_stages=num_stages, interpret=bool(interpret))


# --------------------------------------------------------------------------------------
# Backward kernels
# --------------------------------------------------------------------------------------


def _bwd_preprocess_kernel(*refs, spec: _Spec, bq: int):
  o_ref, do_ref, lse_ref, q_len_ref, delta_ref, lse2_ref = unpack_refs(
      refs, (True, True, True, spec.has_q_len, True, True))
  q0 = pl.program_id(1) * bq
  row_ok = _in_bounds(q0, bq, spec.t)
  tile_ok = None if row_ok is None else row_ok[:, None]
  o = _load(o_ref.at[pl.ds(q0, bq), _index(0), :], tile_ok, 0.0).astype(jnp.float32)
  do = _load(do_ref.at[pl.ds(q0, bq), _index(0), :], tile_ok, 0.0).astype(jnp.float32)
  lse = _load(lse_ref.at[_index(0), pl.ds(q0, bq)], row_ok, 0.0)
  # +inf makes every probability of a row zero: rows past the query length contribute
  # nothing, and fully masked rows only feed dV, which the wrapper adds separately.
  live = lse > 0.5 * MASK_VALUE
  if spec.has_q_len:
    t_eff, _ = _effective_lengths(spec, q_len_ref, None)
    live = live & (q0 + lax.iota(jnp.int32, bq) < t_eff)
  _store(delta_ref.at[_index(0), pl.ds(q0, bq)], jnp.sum(o * do, axis=1), row_ok)
  _store(lse2_ref.at[_index(0), pl.ds(q0, bq)], jnp.where(live, lse * _LOG2E, jnp.inf), row_ok)


def _dkdv_kernel(*refs, spec: _Spec, bq: int, bk: int):
  (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, bias_ref, mask_ref, q_len_ref,
   kv_len_ref, dv0_ref, dk_ref, dv_ref) = unpack_refs(
       refs, (True,) * 6 + (spec.bias_shape is not None, spec.mask_shape is not None,
                            spec.has_q_len, spec.has_kv_len, spec.may_fully_mask, True, True))
  k0 = pl.program_id(1) * bk
  t_eff, s_eff = _effective_lengths(spec, q_len_ref, kv_len_ref)
  key_ok = _in_bounds(k0, bk, spec.s)
  key_tile_ok = None if key_ok is None else key_ok[:, None]
  k = _load(k_ref.at[pl.ds(k0, bk), :], key_tile_ok, 0.0)
  v = _load(v_ref.at[pl.ds(k0, bk), :], key_tile_ok, 0.0)
  group = spec.group
  per_head = [shape is not None and shape[1] != 1
              for shape in (spec.bias_shape, spec.mask_shape)]
  heads = lambda g: tuple(g if full else 0 for full in per_head)

  def step(g, qb, carry, positional):
    dk, dv = carry
    g = _index(g)
    q0 = qb * bq
    row_ok = _in_bounds(q0, bq, spec.t)
    tile_ok = None if row_ok is None else row_ok[:, None]
    q = _load(q_ref.at[pl.ds(q0, bq), g, :], tile_ok, 0.0)
    do = _load(do_ref.at[pl.ds(q0, bq), g, :], tile_ok, 0.0)
    lse2 = _load(lse2_ref.at[g, pl.ds(q0, bq)], row_ok, jnp.inf)
    delta = _load(delta_ref.at[g, pl.ds(q0, bq)], row_ok, 0.0)
    s_t = _scaled_logits(spec, q, k, bias_ref, mask_ref, heads(g), q0, bq, k0, bk, s_eff,
                         positional, transposed=True)
    p_t = jnp.exp2(s_t - lse2[None, :])
    dv = dv + _dot(p_t.astype(do.dtype), do)
    ds_t = p_t * (_dot(v, do, trans_b=True) - delta[None, :])
    dk = dk + _dot(ds_t.astype(q.dtype), q)
    return dk, dv

  def masked_flat(i, carry, lo, n):
    g = index_math.div(i, n)
    return step(g, lo + (i - g * n), carry, True)

  def run(lo, hi, carry, positional):
    if group == 1:
      return lax.fori_loop(lo, hi, lambda qb, c: step(0, qb, c, positional), carry)
    if positional:
      # Masked runs are short (the causal diagonal: a few blocks a head): one flat loop
      # over (group head, query block) keeps the pipeline full across head boundaries.
      n = hi - lo
      return lax.fori_loop(0, group * n, functools.partial(masked_flat, lo=lo, n=n), carry)
    # Unmasked runs are long: head by head. The flat loop here made ptxas serialize the
    # wgmma (C7515) on jax 0.12 whenever a masked loop followed (any causal, windowed or
    # length-limited GQA call), and so did the flat loop with nested masked ones.
    return lax.fori_loop(0, group, lambda g, c: lax.fori_loop(
        lo, hi, lambda qb, c2: step(g, qb, c2, False), c), carry)

  dk = jnp.zeros((bk, spec.head_dim), jnp.float32)
  dv = (jnp.broadcast_to(dv0_ref[...][None, :], (bk, spec.head_dim))
        if spec.may_fully_mask else jnp.zeros((bk, spec.head_dim), jnp.float32))
  ranges = flash_blocks.query_block_range(spec, k0, bq, bk, t_eff, s_eff)
  dk, dv = _run_blocks(*ranges, run, (dk, dv), masked_head=spec.right_reach is not None)
  _store(dk_ref.at[pl.ds(k0, bk), :], (dk * spec.scale).astype(dk_ref.dtype), key_tile_ok)
  _store(dv_ref.at[pl.ds(k0, bk), :], dv.astype(dv_ref.dtype), key_tile_ok)


def _dq_kernel(*refs, spec: _Spec, bq: int, bk: int):
  (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, bias_ref, mask_ref, q_len_ref,
   kv_len_ref, dq_ref) = unpack_refs(
       refs, (True,) * 6 + (spec.bias_shape is not None, spec.mask_shape is not None,
                            spec.has_q_len, spec.has_kv_len, True))
  q0 = _query_block_index(spec, bq) * bq
  t_eff, s_eff = _effective_lengths(spec, q_len_ref, kv_len_ref)
  row_ok = _in_bounds(q0, bq, spec.t)
  tile_ok = None if row_ok is None else row_ok[:, None]
  q = _load(q_ref.at[pl.ds(q0, bq), _index(0), :], tile_ok, 0.0)
  do = _load(do_ref.at[pl.ds(q0, bq), _index(0), :], tile_ok, 0.0)
  lse2 = _load(lse2_ref.at[_index(0), pl.ds(q0, bq)], row_ok, jnp.inf)
  delta = _load(delta_ref.at[_index(0), pl.ds(q0, bq)], row_ok, 0.0)

  def body(kb, dq, positional):
    k0 = kb * bk
    col_ok = _in_bounds(k0, bk, spec.s) if positional else None  # Tails are never full.
    col_ok = None if col_ok is None else col_ok[:, None]
    k = _load(k_ref.at[pl.ds(k0, bk), :], col_ok, 0.0)
    v = _load(v_ref.at[pl.ds(k0, bk), :], col_ok, 0.0)
    s = _scaled_logits(spec, q, k, bias_ref, mask_ref, (0, 0), q0, bq, k0, bk, s_eff,
                       positional, transposed=False)
    p = jnp.exp2(s - lse2[:, None])
    ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  ranges = flash_blocks.key_block_range(spec, q0, bq, bk, t_eff, s_eff)
  dq = _run_blocks(*ranges, _block_loop(body), jnp.zeros((bq, spec.head_dim), jnp.float32),
                   masked_head=spec.left_reach is not None)
  _store(dq_ref.at[pl.ds(q0, bq), _index(0), :], (dq * spec.scale).astype(dq_ref.dtype), tile_ok)


# --------------------------------------------------------------------------------------
# Backward wrapper
# --------------------------------------------------------------------------------------


def _bwd_preprocess(spec, out, dout, lse, q_len, *, block_q, interpret):
  """delta = rowsum(out * dout) and the base-2 lse (+inf on dead rows), both (B, N, T)."""
  b, t, n, h = out.shape
  row_spec = _rows_spec(spec, 1)
  seq = _seq_spec(t, 1, h, lambda x: x)
  return pl.pallas_call(
      functools.partial(_bwd_preprocess_kernel, spec=spec, bq=block_q),
      grid=(n, pl.cdiv(t, block_q), b),
      in_specs=[seq, seq, row_spec] + ([_len_spec()] if q_len is not None else []),
      out_specs=[row_spec, row_spec],
      out_shape=[pallas_common.out_struct((b, n, t), jnp.float32, like=out)] * 2,
      compiler_params=_compiler_params(4, 1),
      interpret=interpret,
      name="stellarax_attention_bwd_preprocess",
  )(out, dout, lse, *([q_len] if q_len is not None else []))


@functools.partial(jax.jit, static_argnames=(
    "spec", "block_q", "block_k", "block_q_dq", "block_k_dq", "num_warps", "num_stages",
    "interpret"))
def _bwd(query, key, value, bias, mask, out, lse, dout, q_len, kv_len, *, spec: _Spec,
         block_q: int, block_k: int, block_q_dq: int, block_k_dq: int, num_warps: int,
         num_stages: int, interpret: bool):
  b, t, n, h = query.shape
  g = spec.group
  delta, lse2 = _bwd_preprocess(spec, out, dout, lse, q_len, block_q=block_q_dq,
                                interpret=interpret)
  same = lambda x: x
  params = _compiler_params(num_warps, num_stages)

  # dK/dV: grid over kv heads; each program sees its G query heads as one block.
  opt_specs, opt_args = _optional_inputs(spec, bias, mask, q_len, kv_len, heads=g)
  group_seq = _seq_spec(t, g, h, same)
  in_specs = [group_seq, _kv_spec(spec, same), _kv_spec(spec, same), group_seq,
              _rows_spec(spec, g), _rows_spec(spec, g), *opt_specs]
  args = [query, key, value, dout, lse2, delta, *opt_args]
  if spec.may_fully_mask:
    in_specs.append(_vec_spec(spec, same))
    args.append(flash_blocks.fully_masked_dv(lse, dout, q_len, num_kv_heads=spec.num_kv_heads,
                                              s=spec.s))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, spec=spec, bq=block_q, bk=block_k),
      grid=(spec.num_kv_heads, pl.cdiv(spec.s, block_k), b),
      in_specs=in_specs,
      out_specs=[_kv_spec(spec, same), _kv_spec(spec, same)],
      out_shape=[pallas_common.out_struct(key.shape, key.dtype, like=key),
                 pallas_common.out_struct(value.shape, value.dtype, like=value)],
      compiler_params=params,
      interpret=interpret,
      name="stellarax_attention_bwd_dkdv",
  )(*args)

  # dQ: grid over query heads, K/V picked per kv head in the index map.
  kv_head = lambda x: index_math.div(x, g)
  opt_specs, opt_args = _optional_inputs(spec, bias, mask, q_len, kv_len, heads=1)
  seq = _seq_spec(t, 1, h, same)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, spec=spec, bq=block_q_dq, bk=block_k_dq),
      grid=(n, pl.cdiv(t, block_q_dq), b),
      in_specs=[seq, _kv_spec(spec, kv_head), _kv_spec(spec, kv_head), seq,
                _rows_spec(spec, 1), _rows_spec(spec, 1), *opt_specs],
      out_specs=seq,
      out_shape=pallas_common.out_struct(query.shape, query.dtype, like=query),
      compiler_params=params,
      interpret=interpret,
      name="stellarax_attention_bwd_dq",
  )(query, key, value, dout, lse2, delta, *opt_args)
  return dq, dk, dv


def _check_residuals(query, out, lse, dout) -> None:
  b, t, n, _ = query.shape
  for name, x in (("out", out), ("dout", dout)):
    if x.shape != query.shape or x.dtype != query.dtype:
      raise ValueError(f"{name} has shape {x.shape} and dtype {x.dtype}; expected query's"
                       f" {query.shape} {query.dtype}.")
  if lse.shape != (b, n, t) or lse.dtype != jnp.float32:
    raise ValueError(f"lse has shape {lse.shape} and dtype {lse.dtype}; expected ({b}, {n},"
                     f" {t}) float32 as returned by attention_fwd_pallas_triton.")


def attention_bwd_pallas_triton(query, key, value, bias, mask, out, lse, dout, *,
                                scale=None, is_causal=False, query_seq_lengths=None,
                                key_value_seq_lengths=None, local_window_size=None,
                                block_q: int, block_k: int, block_q_dq: int | None = None,
                                block_k_dq: int | None = None, num_warps: int,
                                num_stages: int, interpret: bool = False):
  """Flash attention backward for attention_fwd_pallas_triton.

  bias is non-differentiable: no dbias is returned, and the gradient is that of the
  attention with bias held constant. Gradients match jax.vjp of
  jax.nn.dot_product_attention, including fully masked rows.

  Args:
    query, key, value, bias, mask: the forward's inputs.
    out, lse: the forward's outputs.
    dout: cotangent of out, (B, T, N, H) in query's dtype.
    scale, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size: the
      forward's options.
    block_q: query rows per inner-loop step of the dK/dV kernel.
    block_k: key rows per program of the dK/dV kernel.
    block_q_dq: query rows per program of the dQ kernel; None means block_k (the dQ
      kernel then uses the dK/dV tile transposed).
    block_k_dq: key rows per inner-loop step of the dQ kernel; None means block_q.
    num_warps: warps per program of the dK/dV and dQ kernels.
    num_stages: software pipelining depth of their inner loops.
    interpret: run the kernels in the Pallas interpreter (CPU testing).

  Returns:
    (dquery, dkey, dvalue) in the dtypes of query, key and value.

  Raises:
    ValueError: for unsupported shapes, dtypes, options or tunables.
  """
  block_q_dq = block_k if block_q_dq is None else block_q_dq
  block_k_dq = block_q if block_k_dq is None else block_k_dq
  check_bwd_tunables(block_q=block_q, block_k=block_k, block_q_dq=block_q_dq,
                        block_k_dq=block_k_dq, num_warps=num_warps, num_stages=num_stages)
  spec = _make_spec(query, key, value, bias, mask, query_seq_lengths,
                    key_value_seq_lengths, scale, is_causal, local_window_size)
  _check_residuals(query, out, lse, dout)
  return _bwd(query, key, value, bias, mask, out, lse, dout, query_seq_lengths,
              key_value_seq_lengths, spec=spec, block_q=block_q, block_k=block_k,
              block_q_dq=block_q_dq, block_k_dq=block_k_dq, num_warps=num_warps,
              num_stages=num_stages, interpret=bool(interpret))


# --------------------------------------------------------------------------------------
# Heuristics and search spaces (sized for sm_90, H100/H200)
# --------------------------------------------------------------------------------------


def _seq_cap(length: int) -> int:
  """Largest useful block for a sequence: its length rounded up to a power of two."""
  return max(16, pl.next_power_of_2(length))


def _problem(query: Any, key: Any) -> tuple[int, int, int, int]:
  """(T, S, H, bytes per element) of query/key arrays or ShapeDtypeStructs."""
  _, t, _, h = query.shape
  if h not in SUPPORTED_HEAD_DIMS or jnp.dtype(query.dtype) not in SUPPORTED_DTYPES:
    raise ValueError(f"head dim {h} / dtype {query.dtype} unsupported; expected H in"
                     f" {SUPPORTED_HEAD_DIMS} and dtype in"
                     f" {[str(d) for d in SUPPORTED_DTYPES]}.")
  return t, key.shape[1], h, jnp.dtype(query.dtype).itemsize


def _fits(smem_bytes: int, accum_floats: int, num_warps: int,
          budget: int = _REGISTER_BUDGET) -> bool:
  return smem_bytes <= _SMEM_LIMIT_BYTES and accum_floats / (32 * num_warps) <= budget


def _fwd_fits(h: int, e: int, c: dict[str, int]) -> bool:
  bq, bk = c["block_q"], c["block_k"]
  # Resident Q tile plus num_stages K and V tiles; accumulator and logits in registers.
  smem = e * (bq * h + c["num_stages"] * 2 * bk * h)
  return _fits(smem, bq * h + bq * bk, c["num_warps"], _FWD_REGISTER_BUDGET)


def _bwd_fits(h: int, e: int, c: dict[str, int]) -> bool:
  bq, bk, w, st = c["block_q"], c["block_k"], c["num_warps"], c["num_stages"]
  dkdv_smem = e * 2 * bk * h + st * (e * 2 * bq * h + 8 * bq)
  bq2, bk2 = c["block_q_dq"], c["block_k_dq"]
  dq_smem = e * 2 * bq2 * h + st * e * 2 * bk2 * h
  return (_fits(dkdv_smem, 2 * bk * h + 2 * bq * bk, w)
          and _fits(dq_smem, bq2 * h + 2 * bq2 * bk2, w))


def _clamp_fwd(c: dict[str, int], t: int, s: int) -> dict[str, int]:
  return {**c, "block_q": min(c["block_q"], _seq_cap(t)),
          "block_k": min(c["block_k"], _seq_cap(s))}


def _clamp_bwd(c: dict[str, int], t: int, s: int) -> dict[str, int]:
  return {**c, "block_q": min(c["block_q"], _seq_cap(t)),
          "block_k": min(c["block_k"], _seq_cap(s)),
          "block_q_dq": min(c["block_q_dq"], _seq_cap(t)),
          "block_k_dq": min(c["block_k_dq"], _seq_cap(s))}


def _fwd_heuristic(t: int, s: int, h: int, e: int) -> dict[str, int]:
  bq, bk, w, st = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 8, 2)}[h]
  if e == 4:
    bk //= 2  # float32 tiles take twice the shared memory.
  return _clamp_fwd(dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st), t, s)


def _bwd_heuristic(t: int, s: int, h: int, e: int) -> dict[str, int]:
  # The dQ tile is the dK/dV tile transposed, so in both kernels the resident block (whose
  # accumulators stay in registers) is the large one, the streamed block the small one.
  bq, bk, w, st = {64: (64, 128, 8, 3), 128: (32, 128, 8, 3), 256: (32, 64, 8, 2)}[h]
  if e == 4:
    bk, st = max(32, bk // 2), 2
  c = dict(block_q=bq, block_k=bk, block_q_dq=bk, block_k_dq=bq, num_warps=w,
           num_stages=st)
  return _clamp_bwd(c, t, s)


def heuristic_tunables(query: Any, key: Any, *, backward: bool = False) -> dict[str, int]:
  """Returns a good config for attention_{fwd,bwd}_pallas_triton without measuring.

  Args:
    query: (B, T, N, H) array or jax.ShapeDtypeStruct.
    key: (B, S, K, H) array or jax.ShapeDtypeStruct.
    backward: config for the backward (adds block_q_dq and block_k_dq).

  Returns:
    Keyword arguments for the matching wrapper: block_q, block_k, num_warps, num_stages
    (and block_q_dq, block_k_dq for the backward). They pass check_{fwd,bwd}_tunables.

  Raises:
    ValueError: if the head dim or dtype is unsupported.
  """
  problem = _problem(query, key)
  return _bwd_heuristic(*problem) if backward else _fwd_heuristic(*problem)


def _unique(configs: list[dict[str, int]]) -> list[dict[str, int]]:
  seen, out = set(), []
  for c in configs:
    key = tuple(sorted(c.items()))
    if key not in seen:
      seen.add(key)
      out.append(c)
  return out


def _menu_divisor(h: int, e: int) -> int:
  """Halves the block menus when a row (H elements) takes more than 256 bytes."""
  return 2 if h * e > 256 else 1


def _fwd_space(t: int, s: int, h: int, e: int) -> list[dict[str, int]]:
  div = _menu_divisor(h, e)
  configs = [_fwd_heuristic(t, s, h, e)]
  for bq, bk, w, st in itertools.product((64 // div, 128 // div),
                                         (32 // div, 64 // div, 128 // div), (4, 8), (2, 3, 4)):
    c = _clamp_fwd(dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st), t, s)
    if _fwd_fits(h, e, c):
      configs.append(c)
  return _unique(configs)


def _bwd_space(t: int, s: int, h: int, e: int) -> list[dict[str, int]]:
  div = _menu_divisor(h, e)
  configs = [_bwd_heuristic(t, s, h, e)]
  pairs = ((32, 32), (32, 64), (32, 128), (64, 64), (64, 128), (128, 128))
  for (bq, bk), w, st in itertools.product(pairs, (4, 8), (2, 3, 4)):
    bq, bk = bq // div, bk // div
    c = _clamp_bwd(dict(block_q=bq, block_k=bk, block_q_dq=bk, block_k_dq=bq, num_warps=w,
                        num_stages=st), t, s)
    if _bwd_fits(h, e, c):
      configs.append(c)
  return _unique(configs)


def tunable_space(query: Any, key: Any, *,
                  backward: bool = False) -> list[dict[str, int]]:
  """Returns the configs worth measuring for this shape, the heuristic one first.

  Blocks are capped at the sequence lengths (rounded up to a power of two); menus halve
  for rows over 256 bytes; configs whose estimated shared memory or accumulator registers
  exceed an sm_90 (H100/H200) SM are left out. The backward ties the dQ tile to the dK/dV
  tile transposed (block_q_dq = block_k, block_k_dq = block_q).

  Args:
    query: (B, T, N, H) array or jax.ShapeDtypeStruct.
    key: (B, S, K, H) array or jax.ShapeDtypeStruct.
    backward: configs for the backward.

  Returns:
    A list of distinct configs (dicts of keyword arguments), about 10 to 40 for long
    sequences; each passes check_{fwd,bwd}_tunables.

  Raises:
    ValueError: if the head dim or dtype is unsupported.
  """
  problem = _problem(query, key)
  return _bwd_space(*problem) if backward else _fwd_space(*problem)


# ---------------------------------------------------------------------------
# Op classes: attention.pallas_triton and its VJP.

from stellarax.core.config import config_dataclass  # noqa: E402
from stellarax.ops.attention import base as _base  # noqa: E402


@config_dataclass
class PallasTritonAttentionConfig:
  """Tunables of the Pallas Triton flash attention forward."""

  block_q: int
  block_k: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    # The kernel's own checks: a config it would refuse is refused when it is made.
    check_fwd_tunables(block_q=self.block_q, block_k=self.block_k, num_warps=self.num_warps,
                       num_stages=self.num_stages)


@config_dataclass
class PallasTritonAttentionVjpConfig:
  """Tunables of the Pallas Triton flash attention backward: the dK/dV
  kernel's (block_q, block_k) and the dQ kernel's (block_q_dq, block_k_dq)."""

  block_q: int
  block_k: int
  block_q_dq: int
  block_k_dq: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_bwd_tunables(block_q=self.block_q, block_k=self.block_k, block_q_dq=self.block_q_dq,
                       block_k_dq=self.block_k_dq, num_warps=self.num_warps,
                       num_stages=self.num_stages)


def _check_kernel_takes(arguments, interpret: bool):
  if interpret and jax.config.jax_enable_x64:
    # jax's Triton-style interpreter mixes int32 and int64 starts in these kernels'
    # stores and fails (jax 0.11.2); compiled for a GPU they run (tests/ops/test_x64.py).
    raise NotImplementedError(
        "interpret mode with jax_enable_x64 on: jax's interpreter cannot run this kernel's "
        "stores with 64-bit types (on a GPU it runs); interpret it with x64 off, or use "
        "implementation='xla' here.")
  flash_blocks.require_window_the_kernels_take(arguments.get("local_window_size"))
  flash_blocks.require_keys_the_kernels_take(arguments)
  q = arguments["query"]
  if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"head dim {q.shape[-1]} is not one of the kernel's {SUPPORTED_HEAD_DIMS}.")
  if jnp.dtype(q.dtype) not in tuple(jnp.dtype(d) for d in SUPPORTED_DTYPES):
    raise NotImplementedError(f"dtype {q.dtype} is not one of the kernel's {SUPPORTED_DTYPES}.")


def _structs(ba):
  return ba.arguments["query"].to_shape_dtype_struct(), ba.arguments["key"].to_shape_dtype_struct()


class PallasTritonAttentionVjp(pallas_common.PallasTritonOp, _base.AttentionVjp,
                               name="attention.pallas_triton_vjp"):
  """Flash attention backward in Pallas Triton (dQ, dK, dV) from the
  forward's log-sum-exp. A bias gradient, when a bias is given, comes from
  XLA's derivative (dead code that XLA drops when the bias is a constant)."""

  config_cls = PallasTritonAttentionVjpConfig

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments, self.interpret)

  def _fwd(self, residuals, out, dout, query, key, value, bias=None, mask=None, *, config, **static):
    (lse,) = residuals
    dq, dk, dv = attention_bwd_pallas_triton(
        query, key, value, bias, mask, out, lse, dout.astype(query.dtype),
        **flash_blocks.kernel_options(static),
        interpret=self.interpret, **pallas_common.tunables_of(config))
    primals = dict(query=query, key=key, value=value, bias=bias, mask=mask, **static)
    return {"query": dq, "key": dk, "value": dv, **_base.bias_gradient_by_xla(primals, dout)}

  def _get_heuristics_config(self, ba):
    return PallasTritonAttentionVjpConfig(**heuristic_tunables(*_structs(ba), backward=True))

  def _get_autotuning_configs(self, ba):
    return pallas_common.configs_from_tunables(PallasTritonAttentionVjpConfig,
                                               tunable_space(*_structs(ba), backward=True))


class PallasTritonAttention(pallas_common.PallasTritonOp, _base.Attention, name="attention.pallas_triton"):
  """Flash attention forward in Pallas Triton (online softmax, causal block
  skipping, GQA through the index map)."""

  config_cls = PallasTritonAttentionConfig
  vjp_cls = PallasTritonAttentionVjp

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments, self.interpret)

  def _fwd(self, query, key, value, bias=None, mask=None, *, config, **static):
    out, lse = attention_fwd_pallas_triton(query, key, value, bias, mask,
                                           **flash_blocks.kernel_options(static),
                                           interpret=self.interpret,
                                           **pallas_common.tunables_of(config))
    return out, (lse,)

  def _get_heuristics_config(self, ba):
    return PallasTritonAttentionConfig(**heuristic_tunables(*_structs(ba)))

  def _get_autotuning_configs(self, ba):
    return pallas_common.configs_from_tunables(PallasTritonAttentionConfig, tunable_space(*_structs(ba)))
