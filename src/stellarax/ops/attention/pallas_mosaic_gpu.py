"""Flash attention, forward and backward, as Pallas Mosaic GPU kernels for Hopper (sm_90).

Semantics are those of `jax.nn.dot_product_attention` in the BTNH layout (see
reference.py) for the inputs these kernels take: query (B, T, N, H), key and value
(B, S, K, H) in bfloat16 or float16, H in (64, 128, 256), N a multiple of K (GQA/MQA:
query head n reads kv head n // (N // K)), a scale and `is_causal` (key j <= query i,
aligned at the top left as in jax), local windows (key j kept for i - left <= j <=
i + right), per-batch sequence lengths (keys past the key length dropped, rows past
the query length zero; a row that keeps no key is mean(V), as in jax), and a bias and a
boolean mask broadcastable to (B, N, T, S). The bias and mask reach the kernels as one
operand (bias where kept, -inf where masked; batch and head broadcasts kept) that
rides with the K tiles: a float32 vector over keys when all query rows see the same
values (key padding masks), else (query, key) tiles in the input dtype with T and S
materialised. The backward kernels hold the bias constant (the op class gets dbias
from XLA).

Forward (FlashAttention-3 layout). One CTA per (query tile, head, batch). Each of its
`num_compute_wgs` compute warpgroups owns `block_q` query rows; one more warpgroup (the
memory warpgroup) streams the K and V tiles of the kv head through a ring of
`num_stages` shared-memory slots with TMA, guarded by "ready" and "free" mbarriers, so
copies overlap the math. K/V are addressed per kv head, never repeated for GQA. A
compute warpgroup computes S = Q K^T with wgmma (both operands in shared memory), keeps
an online softmax in base 2 in float32 registers and accumulates O += P V with P taken
from registers. With two compute warpgroups a shared "schedule" barrier makes them take
turns (ping-pong), so one's softmax overlaps the other's matmuls. With
`overlap_softmax` a warpgroup's turn issues S of key block j and P V of block j - 1
together, and block j's softmax runs while P V does (intra-warpgroup pipelining; see
_FwdWalker, and `_Mma.products_then_accumulate`). Causal masking visits only the key
blocks up to the diagonal, and only the blocks that cross it are masked; the grid runs
the longest query tiles first so the short ones fill the tail of the launch. Windows
and key lengths skip blocks the same way (flash_blocks.py: the same block arithmetic as
the Triton kernels); the memory warpgroup streams the union of its compute warpgroups'
key blocks, and each warpgroup passes over the blocks it does not need.

Backward. delta = rowsum(O * dO) and the base-2 log-sum-exp are computed in XLA (they
are cheap and memory bound); then two kernels, no atomics, so gradients are bit
reproducible (unless `fuse_dq`):
- dK/dV: one CTA per (key tile, kv head, batch). Each compute warpgroup owns
  `block_kv_dkv` keys and loops over every query head of its GQA group and every query
  tile that sees those keys; the memory warpgroup streams Q, dO, lse and delta tiles.
  dK and dV are summed over the group in registers. With `split_dkdv` two launches
  compute dV and dK apart (one accumulator each), for head dim 256, whose two
  accumulators do not fit in registers together. With `head_split` as well, the dK
  launch and the dQ kernel run two compute warpgroups on the same rows, each holding
  half the head dim of the accumulator: one computes S and dS, the other dP, and they
  trade dP and dS through shared memory (see _HeadSplit); at head dim 256 a whole
  64 x 256 accumulator with S and dP spilled 0.6 KB a thread.
- dQ: one CTA per (query tile, head, batch), streaming K and V like the forward.
  It recomputes S and dP: 7 matmuls per (query block, key block) in all, where 5
  would do. With `overlap_softmax` it pipelines like the forward: S and dP of key
  block j are issued with dQ += dS K of block j - 1, and block j's dS is computed
  while that runs (K of block j - 1 is freed a step later). With `fuse_dq` the dK
  launch instead adds dS K to a float32 dQ in global memory with TMA reduce-adds (see
  _FusedDq): 5 matmuls (6 with `split_dkdv`) and one launch fewer, but floating-point
  sums in no fixed order (not bit reproducible).

Sequence lengths that are not multiples of the blocks are padded in the wrapper (only
then): padded keys are masked like keys past the key length; padded query rows, rows
past the query length and rows that keep no key get lse = +inf in the backward, so they
give probability 0 everywhere; the dV term of rows that keep no key (dout / S on every
key) is the dK/dV kernel's initial dV.

Interpret mode. With `interpret=True` the kernels run in the Mosaic GPU interpreter
(`plgpu.InterpretGPUParams`) on any backend, with simulated warpgroups, TMA copies and
mbarriers: the barrier protocol, indexing and masking are the GPU code. The interpreter
runs wgmma only with both operands in shared memory and only into a fresh accumulator
(it cannot interpret `pl.run_state` nor a register left-hand operand). In interpret mode
register operands (P, dS) are therefore first stored to a shared-memory tile and each
product is added to the accumulator in registers (`_Mma(staged=True)`); on the GPU they
go to wgmma directly and accumulate in place. The interpreter also runs each wgmma at
once and its race detector does not see wgmma's reads; under the race detector the
staged products therefore read their shared-memory operands again with ordinary loads
where the GPU's wgmma may still be reading them (the wait that completes it), so a tile
freed before its product is done is a race the detector reports.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stellarax.core.config import config_dataclass
from stellarax.ops import pallas_common
from stellarax.ops.attention import base as _base
from stellarax.ops.attention import flash_blocks
from stellarax.ops.attention import reference as _reference
from stellarax.ops.pallas_common import unpack_refs

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# wgmma works on 64-row tiles per warpgroup; K/V tiles are TMA boxes of 64-row multiples.
_BLOCK_Q_CHOICES = (64, 128)
_BLOCK_KV_CHOICES = (64, 128, 192, 256)
_BLOCK_KV_DKV_CHOICES = (64, 128)
# Key blocks the forward's search space tries: wider ones spilled registers on an H200
# (bench/compile_h200.py: 64 x 192 spilled 24-112 bytes at head dim 64 and 0.3-1.2 KB
# at 128) although the register estimate below let them pass.
_FWD_SPACE_BLOCK_KV = (64, 128)
_NUM_COMPUTE_WGS_CHOICES = (1, 2)
_NUM_STAGES_RANGE = (2, 4)

# Largest dynamic shared memory one block may use on sm_90 (H100/H200): 227 KiB, less
# what Mosaic GPU keeps for itself (cross-warp reduction scratch, barriers, alignment).
_SMEM_LIMIT_BYTES = 232448 - 4096
# Registers per thread given to the memory warpgroup and, out of the 64 Ki register
# file, to each compute warpgroup (setmaxnreg takes multiples of 8, at most 240).
_MEMORY_REGISTERS = 40
_COMPUTE_REGISTERS = {1: 240, 2: 232}
# Registers a compute thread needs besides its tiles (addresses, counters, row stats);
# used only to prune search spaces.
_REGISTER_OVERHEAD = 24


# --------------------------------------------------------------------------------------
# Tunables
# --------------------------------------------------------------------------------------


def _check_choice(name: str, value: Any, choices: Sequence[int], why: str) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value not in choices:
    raise ValueError(f"{name}={value!r} must be one of {tuple(choices)} ({why}).")


def _check_common(num_compute_wgs: Any, num_stages: Any) -> None:
  _check_choice("num_compute_wgs", num_compute_wgs, _NUM_COMPUTE_WGS_CHOICES,
                "compute warpgroups per CTA besides the memory warpgroup")
  lo, hi = _NUM_STAGES_RANGE
  _check_choice("num_stages", num_stages, range(lo, hi + 1),
                "shared-memory ring slots of the TMA pipeline; 2 or more overlap copies"
                " with math")


def _check_bool(name: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be a bool.")


def check_fwd_tunables(*, block_q: int, block_kv: int, num_compute_wgs: int, num_stages: int,
                       schedule_barrier: bool, overlap_softmax: bool = False) -> None:
  """Checks forward tunables, independent of the input shape.

  Args:
    block_q: query rows per compute warpgroup (64 or 128).
    block_kv: keys per pipeline step (a multiple of 64 up to 256).
    num_compute_wgs: compute warpgroups per CTA (1 or 2).
    num_stages: shared-memory slots of the K/V ring (2 to 4).
    schedule_barrier: make two compute warpgroups alternate (ping-pong).
    overlap_softmax: issue S of the next key block and P V of the current one
      together and run the next softmax while P V runs (FlashAttention-3's
      intra-warpgroup overlap); holds a second 16-bit probability tile in registers.

  Raises:
    ValueError: naming the bad value and the accepted ones.
  """
  _check_choice("block_q", block_q, _BLOCK_Q_CHOICES,
                "query rows per compute warpgroup, whole 64-row wgmma tiles")
  _check_choice("block_kv", block_kv, _BLOCK_KV_CHOICES,
                "keys per step, whole 64-row swizzled tiles, at most the 256 wgmma columns")
  _check_common(num_compute_wgs, num_stages)
  _check_bool("schedule_barrier", schedule_barrier)
  _check_bool("overlap_softmax", overlap_softmax)
  if schedule_barrier and num_compute_wgs != 2:
    raise ValueError(
        f"schedule_barrier=True makes two compute warpgroups take turns, so it needs"
        f" num_compute_wgs=2, got {num_compute_wgs=}; pass schedule_barrier=False.")


def check_bwd_tunables(*, block_q_dkv: int, block_kv_dkv: int, block_q_dq: int,
                       block_kv_dq: int, num_compute_wgs: int, num_stages: int,
                       split_dkdv: bool, fuse_dq: bool = False,
                       head_split: bool = False, overlap_softmax: bool = False) -> None:
  """Checks backward tunables, independent of the input shape.

  Args:
    block_q_dkv: query rows per step of the dK/dV kernel (64 or 128).
    block_kv_dkv: keys per compute warpgroup of the dK/dV kernel (64 or 128).
    block_q_dq: query rows per compute warpgroup of the dQ kernel (64 or 128).
    block_kv_dq: keys per step of the dQ kernel (a multiple of 64 up to 256).
    num_compute_wgs: compute warpgroups per CTA of both kernels (1 or 2).
    num_stages: shared-memory ring slots of both kernels (2 to 4).
    split_dkdv: compute dV and dK in two launches with one accumulator each.
    fuse_dq: the dK kernel also sums dQ into float32 global memory (TMA reduce-add),
      instead of a separate dQ kernel recomputing S and dP: 5 matmuls a block pair
      instead of 7, but dQ's float32 sums then run in no fixed order (not bitwise
      reproducible). The dQ kernel's blocks are then unused.
    head_split: in the dQ kernel and the dK launch the two compute warpgroups own the
      same rows and half the head dim each: one computes S and dS, the other dP, and
      they trade dP and dS through shared memory (see _HeadSplit). Halves the
      accumulator a warpgroup holds, for head dim 256, whose 64 x 256 float32
      accumulator spills otherwise. Needs num_compute_wgs=2 and split_dkdv=True, not
      fuse_dq; the dV launch is unchanged.
    overlap_softmax: in the dQ kernel, issue S and dP of the next key block with
      dQ += dS K of the current one and compute the next dS while that runs (as the
      forward's). It holds two K tiles a warpgroup, so it wants 3 stages or more. Not
      with fuse_dq or head_split (no such dQ kernel).

  Raises:
    ValueError: naming the bad value and the accepted ones.
  """
  _check_choice("block_q_dkv", block_q_dkv, _BLOCK_Q_CHOICES,
                "query rows per step, whole 64-row swizzled tiles")
  _check_choice("block_kv_dkv", block_kv_dkv, _BLOCK_KV_DKV_CHOICES,
                "keys per compute warpgroup, whole 64-row wgmma tiles")
  _check_choice("block_q_dq", block_q_dq, _BLOCK_Q_CHOICES,
                "query rows per compute warpgroup, whole 64-row wgmma tiles")
  _check_choice("block_kv_dq", block_kv_dq, _BLOCK_KV_CHOICES,
                "keys per step, whole 64-row swizzled tiles, at most the 256 wgmma columns")
  _check_common(num_compute_wgs, num_stages)
  _check_bool("split_dkdv", split_dkdv)
  _check_bool("fuse_dq", fuse_dq)
  _check_bool("head_split", head_split)
  _check_bool("overlap_softmax", overlap_softmax)
  if overlap_softmax and (fuse_dq or head_split):
    raise ValueError(
        f"overlap_softmax=True pipelines the separate dQ kernel, which {fuse_dq=} and"
        f" {head_split=} replace; pass overlap_softmax=False or neither of them.")
  if head_split and (num_compute_wgs != 2 or not split_dkdv or fuse_dq):
    raise ValueError(
        f"head_split=True splits the head dim of the dQ and dK accumulators between two"
        f" compute warpgroups of a dK launch apart from dV, so it needs"
        f" num_compute_wgs=2, split_dkdv=True and fuse_dq=False; got {num_compute_wgs=},"
        f" {split_dkdv=}, {fuse_dq=}.")


@config_dataclass
class PallasMosaicGpuAttentionConfig:
  """Tunables of the Mosaic GPU flash attention forward (see check_fwd_tunables)."""

  block_q: int
  block_kv: int
  num_compute_wgs: int
  num_stages: int
  schedule_barrier: bool
  # Defaults to the plain loop, so that configs saved before this tunable still load.
  overlap_softmax: bool = False

  def __post_init__(self):
    check_fwd_tunables(**pallas_common.tunables_of(self))


@config_dataclass
class PallasMosaicGpuAttentionVjpConfig:
  """Tunables of the Mosaic GPU flash attention backward (see check_bwd_tunables)."""

  block_q_dkv: int
  block_kv_dkv: int
  block_q_dq: int
  block_kv_dq: int
  num_compute_wgs: int
  num_stages: int
  split_dkdv: bool
  # Defaults to the separate, bitwise-reproducible dQ kernel, so that configs saved
  # before this tunable existed still load.
  fuse_dq: bool = False
  head_split: bool = False
  overlap_softmax: bool = False

  def __post_init__(self):
    check_bwd_tunables(**pallas_common.tunables_of(self))


# --------------------------------------------------------------------------------------
# Static problem description and input checks
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Problem(flash_blocks.BlockMasking):
  """Everything static about one call except the tunables (T and S unpadded)."""

  t: int
  s: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  scale: float
  causal: bool
  window: tuple[int, int] | None = None
  has_q_len: bool = False
  has_kv_len: bool = False
  has_mask: bool = False
  # (batch, heads) of the bias/mask operand (each 1 or B, N), None without bias and mask.
  pair_shape: tuple[int, int] | None = None
  # The bias and mask are the same for every query row (e.g. a key padding mask): the
  # kernels read one float32 vector over the keys instead of (query, key) tiles.
  pair_per_key: bool = False

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def has_pair(self) -> bool:
    return self.pair_shape is not None

  def pair_index(self, b: Any, head: Any) -> tuple[Any, Any]:
    """Index of batch b and query head `head` in the bias/mask tiles (broadcast dims: 0)."""
    pb, ph = self.pair_shape
    return (b if pb > 1 else 0), (head if ph > 1 else 0)


def _make_problem(query: Any, key: Any, value: Any, scale: float | None, is_causal: bool,
                  local_window_size: Any = None, query_seq_lengths: Any = None,
                  key_value_seq_lengths: Any = None, bias: Any = None,
                  mask: Any = None) -> _Problem:
  """Validates the operands (arrays or ShapeDtypeStructs) and describes the call."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if len(x.shape) != 4:
      raise ValueError(f"{name} has shape {tuple(x.shape)}; expected 4 dims (BTNH / BSKH).")
  b, t, n, h = query.shape
  _, s, k, _ = key.shape
  if key.shape[0] != b or key.shape[3] != h or tuple(value.shape) != tuple(key.shape):
    raise ValueError(f"Incompatible shapes query={tuple(query.shape)}, key={tuple(key.shape)},"
                     f" value={tuple(value.shape)}: expected (B, T, N, H), (B, S, K, H),"
                     f" (B, S, K, H).")
  dtype = jnp.dtype(query.dtype)
  if not dtype == jnp.dtype(key.dtype) == jnp.dtype(value.dtype) or dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype} must be"
                     f" equal and one of {[str(d) for d in SUPPORTED_DTYPES]} (wgmma"
                     f" operands); cast them first.")
  if h not in SUPPORTED_HEAD_DIMS:
    raise ValueError(f"head dim H={h} is not supported; expected one of {SUPPORTED_HEAD_DIMS}."
                     f" Pad the head dim or use another implementation.")
  if n % k:
    raise ValueError(f"The number of query heads N={n} must be a multiple of the number of"
                     f" kv heads K={k}.")
  if t < 1 or s < 1:
    raise ValueError(f"Empty sequences are not supported: T={t}, S={s}.")
  flash_blocks.check_seq_lengths("query_seq_lengths", query_seq_lengths, b)
  flash_blocks.check_seq_lengths("key_value_seq_lengths", key_value_seq_lengths, b)
  _reference.check_attention_inputs(query, key, value, bias, mask)
  if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
    raise ValueError(f"bias dtype {bias.dtype} must be floating.")
  pairs = [x.shape for x in (bias, mask) if x is not None]
  pair_shape = tuple(max(dims) for dims in zip(*pairs))[:2] if pairs else None
  pair_per_key = bool(pairs) and all(shape[2] == 1 for shape in pairs)
  scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
  return _Problem(t=t, s=s, num_heads=n, num_kv_heads=k, head_dim=h, dtype=dtype,
                  scale=scale, causal=bool(is_causal),
                  window=flash_blocks.normalize_window(local_window_size),
                  has_q_len=query_seq_lengths is not None,
                  has_kv_len=key_value_seq_lengths is not None,
                  has_mask=mask is not None, pair_shape=pair_shape, pair_per_key=pair_per_key)


def _pair_operand(bias: Any, mask: Any, p: _Problem, t_pad: int, s_pad: int, *,
                  transposed: bool = False) -> jax.Array | None:
  """Bias and mask as one operand the kernels stream with the K (or Q) tiles.

  Kept positions hold the bias (0 without one), masked ones -inf, which the kernels
  treat like positions their positional masks remove. Broadcast batch and head dims
  stay of size 1. When every query row sees the same values (`pair_per_key`) the
  operand is a float32 vector over the keys; otherwise T and S are materialised (TMA
  copies whole tiles), padded, and rounded to the input dtype.

  Returns:
    None without bias and mask; (B', N', S_pad) float32 per key; else
    (B', N', T_pad, S_pad), or (B', N', S_pad, T_pad) when `transposed` (the dK/dV
    kernel's tiles have keys as rows), in the input dtype.
  """
  if not p.has_pair:
    return None
  x = jnp.zeros((1, 1, 1, 1), jnp.float32) if bias is None else bias.astype(jnp.float32)
  if mask is not None:
    x = jnp.where(mask, x, -jnp.inf)
  if p.pair_per_key:
    x = jnp.broadcast_to(x, (*p.pair_shape, 1, p.s))[:, :, 0]
    return _pad_seq(x, s_pad, axis=2)
  x = jnp.broadcast_to(x, (*p.pair_shape, p.t, p.s)).astype(p.dtype)
  x = _pad_seq(_pad_seq(x, t_pad, axis=2), s_pad, axis=3)
  return x.transpose(0, 1, 3, 2) if transposed else x


# --------------------------------------------------------------------------------------
# Kernel building blocks (traced inside kernels)
# --------------------------------------------------------------------------------------


def _tiled(dtype: Any, cols: int) -> tuple[Any, ...]:
  """SMEM transforms of a (rows, cols) wgmma/TMA tile: 8-row tiles, widest swizzle."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _cdiv(x: Any, d: int) -> Any:
  """Ceiling division of a non-negative traced or static int."""
  return lax.div(x + (d - 1), d) if isinstance(x, jax.Array) else -(-x // d)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _rows(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """Broadcasts a per-row vector over the columns of a tile."""
  return lax.broadcast_in_dim(x, shape, [0])


def _cols(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """Broadcasts a per-column vector over the rows of a tile."""
  return lax.broadcast_in_dim(x, shape, [1])


def _if_blocks(lo: Any, hi: Any, run: Callable[[Any], Any], carry: Any,
               otherwise: Callable[[Any], Any] | None = None) -> Any:
  """run(carry) when the block range [lo, hi) is not empty, else otherwise(carry)
  (default: the carry unchanged): the first and last steps of pipelined walks."""
  return lax.cond(lo < hi, run, otherwise or (lambda carry: carry), carry)


def _zeros(shape: tuple[int, ...]) -> jax.Array:
  layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)


@dataclasses.dataclass(frozen=True)
class _Mma:
  """How tiles reach wgmma (see "Interpret mode" in the module docstring).

  Attributes:
    staged: store register left operands to shared memory and add every product to
      the accumulator in registers (what the interpreter supports); otherwise feed
      registers to wgmma directly and accumulate in place (the GPU path).
    check_reads: staged only, under the interpreter's race detector: read every
      shared-memory operand again with ordinary loads where the GPU's wgmma may still
      be reading it (at the wait that completes it). The interpreter runs wgmma at
      once and its race detector does not see wgmma's reads, so without these loads a
      tile freed before an asynchronous product is done with it passes unnoticed.
  """

  staged: bool
  check_reads: bool = False

  def product(self, a: Any, b: Any, shape: tuple[int, int],
              while_running: Callable[[], None] | None = None) -> jax.Array:
    """a @ b in float32 for shared-memory operands; `while_running` runs between
    issuing the wgmma and waiting for it."""
    return self.product_sum([(a, b)], shape, while_running)

  def product_sum(self, pairs: Sequence[tuple[Any, Any]], shape: tuple[int, int],
                  while_running: Callable[[], None] | None = None) -> jax.Array:
    """sum(a @ b for a, b in pairs) in float32 for shared-memory operands: one
    accumulator on the GPU, one product each when staged."""
    if self.staged:
      total = functools.reduce(jnp.add, [self._staged_product(a, b, shape)
                                         for a, b in pairs])
      if while_running is not None:
        while_running()
      self._completed(*itertools.chain.from_iterable(pairs))
      return total

    def body(acc_ref):
      for a, b in pairs:
        plgpu.wgmma(acc_ref, a, b)
      if while_running is not None:
        while_running()
      return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

  def accumulate(self, acc: jax.Array, a: Any, b: Any, stage: Any = None,
                 while_running: Callable[[], None] | None = None) -> jax.Array:
    """acc + a @ b for a register or shared-memory tile `a`, a shared-memory `b` and a
    float32 `acc`; `while_running` runs between issuing the wgmma and waiting for it.

    `stage` is a shared-memory tile of a's shape and dtype, used only when staged and
    `a` is in registers.
    """
    if self.staged:
      return acc + self.product(self._in_smem(a, stage), b, acc.shape, while_running)

    def body(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
      if while_running is not None:
        while_running()

    return pl.run_state(body)(plgpu.ACC.init(acc))

  @staticmethod
  def _staged_product(a: Any, b: Any, shape: tuple[int, int]) -> jax.Array:
    """a @ b for shared-memory operands, one wgmma into a fresh accumulator (what the
    interpreter runs), awaited at once."""
    def body(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
      return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

  @staticmethod
  def _in_smem(a: Any, stage: Any) -> Any:
    """A register tile stored to shared-memory `stage` (a shared-memory tile as is)."""
    if not isinstance(a, jax.Array):
      return a
    stage[...] = a
    plgpu.commit_smem()  # Make the stores visible to wgmma (the async proxy).
    return stage

  def _completed(self, *operands: Any) -> None:
    """Staged: the wgmma reading `operands` is done (see `check_reads`)."""
    if self.check_reads:
      pallas_common.read_again_for_race_detector(operands)

  def products_then_accumulate(self, products: Sequence[tuple[Any, Any]],
                               shape: tuple[int, int], acc: jax.Array, c: Any, d: Any, *,
                               stage: Any, after_issue: Callable[[], None],
                               on_products: Callable[..., Any], like: Any
                               ) -> tuple[Any, jax.Array]:
    """Issues each a @ b of `products` and then acc + c @ d, and works on the products
    while the sum runs.

    FlashAttention-3's intra-warpgroup overlap: on the GPU all wgmma are issued (so
    they run back to back on the tensor cores), `after_issue()` runs, then the
    warpgroup waits for the products alone (wgmma groups complete in issue order: at
    most one in flight means all but the sum are done) and runs `on_products(*them)`
    while c @ d may still run; the sum is awaited last.

    on_products must not compute the next operand of a wgmma (c's successor): the
    registers LLVM gives it may be c's own, which the running wgmma still reads (ptxas
    then serializes every wgmma of the kernel, C7513). Its results pass an
    optimization barrier after the wait, so such work done on them afterwards (the
    16-bit cast of probabilities) stays there.

    Args:
      products: [(a, b)] shared-memory operands; each product is float32 of `shape`.
      acc, c, d, stage: as for `accumulate` (c may be in registers).
      after_issue: runs once all products and the sum are issued.
      on_products: (*products) -> a pytree of arrays.
      like: a pytree of arrays with on_products' result's structure, shapes, dtypes
        and layouts (only its values' types are used).

    Returns:
      (on_products(*products), acc + c @ d).
    """
    if self.staged:  # As the GPU completes them: the products, then the sum.
      values = [self._staged_product(a, b, shape) for a, b in products]
      c = self._in_smem(c, stage)
      acc = acc + self._staged_product(c, d, acc.shape)
      after_issue()
      self._completed(*itertools.chain.from_iterable(products))
      out = on_products(*values)
      self._completed(c, d)
      return out, acc
    leaves, tree = jax.tree.flatten(like)
    n = len(products)

    def body(refs):
      acc_ref, prod_refs, out_refs = refs[0], refs[1:n + 1], refs[n + 1:]
      for ref, (a, b) in zip(prod_refs, products):
        plgpu.wgmma(ref, a, b)
      plgpu.wgmma(acc_ref, c, d)
      after_issue()
      # The first load waits until only the sum may be in flight; the others need not.
      values = [plgpu.wgmma_accumulator_load(ref, wait_n=1 if i == 0 else None)
                for i, ref in enumerate(prod_refs)]
      for ref, value in zip(out_refs, jax.tree.leaves(on_products(*values)), strict=True):
        ref[...] = value

    acc, *rest = pl.run_state(body)(
        (plgpu.ACC.init(acc), *(plgpu.ACC.init(_zeros(shape)) for _ in products), *leaves))
    outs = rest[n:]
    acc, outs = lax.optimization_barrier((acc, outs))  # Ordered after the wait.
    return jax.tree.unflatten(tree, outs), acc


class _PingPong:
  """The schedule barrier of two compute warpgroups; a no-op without one.

  Each `sync` (or `arrive` + `wait`) waits until both warpgroups reach it, so the two
  alternate between matmuls and softmax. Both must pass the same number of phases.
  """

  def __init__(self, barrier: Any):
    self._barrier = barrier

  def arrive(self) -> None:
    if self._barrier is not None:
      plgpu.barrier_arrive(self._barrier)

  def wait(self) -> None:
    if self._barrier is not None:
      plgpu.barrier_wait(self._barrier)

  def sync(self) -> None:
    self.arrive()
    self.wait()


@dataclasses.dataclass(frozen=True)
class _Stream:
  """Tiles the memory warpgroup copies together into one slot of their rings.

  Attributes:
    sources: step -> [(GMEM ref view, SMEM ring)] for the tiles of that step.
    ready: (stages,) barriers, one arrival per copy: the slot's tiles landed.
    free: (stages,) barriers, one arrival per compute warpgroup: the slot is reusable.
  """

  sources: Callable[[Any], list[tuple[Any, Any]]]
  ready: Any
  free: Any

  def fill(self, step: Any, slot: Any) -> None:
    for src, ring in self.sources(step):
      plgpu.copy_gmem_to_smem(src, ring.at[slot], self.ready.at[slot])

  def acquire(self, slot: Any) -> None:
    plgpu.barrier_wait(self.ready.at[slot])

  def release(self, slot: Any, *, after_loads: bool = False) -> None:
    """Frees a slot for refilling.

    Args:
      after_loads: this warpgroup read the slot with ordinary loads, not only with
        wgmma. Those reads are then fenced (fence.proxy.async) against the TMA writes
        that refill the slot: the PTX memory model orders generic-proxy accesses
        before async-proxy ones only through such a fence, and the interpreter's race
        detector checks it.
    """
    if after_loads:
      plgpu.commit_smem()
    plgpu.barrier_arrive(self.free.at[slot])


def _produce(streams: Sequence[_Stream], num_steps: Any, stages: int) -> None:
  """The memory warpgroup: fills slot step % stages for every step of every stream."""

  static = isinstance(num_steps, int)
  minimum = min if static else jnp.minimum
  maximum = max if static else jnp.maximum

  @pl.loop(0, minimum(num_steps, stages))
  def _prologue(step):
    for stream in streams:
      stream.fill(step, step)

  @pl.loop(stages, num_steps)
  def _steady(step):
    slot = lax.rem(step, stages)
    for stream in streams:
      plgpu.barrier_wait(stream.free.at[slot])
      stream.fill(step, slot)

  # Wait for the last frees as well: every thread that waits on a barrier must observe
  # all its phases (the interpreter checks this; on the GPU it only delays the exit).
  @pl.loop(maximum(num_steps - stages, 0), num_steps)
  def _drain(step):
    for stream in streams:
      plgpu.barrier_wait(stream.free.at[lax.rem(step, stages)])


def _lengths(p: _Problem, q_len_ref: Any, kv_len_ref: Any, b: Any) -> tuple[Any, Any]:
  """Batch b's query and key lengths after its sequence lengths, clipped to T and S."""
  read = lambda ref: None if ref is None else ref[b]
  return flash_blocks.effective_lengths(p, read(q_len_ref), read(kv_len_ref))


@dataclasses.dataclass(frozen=True)
class _Cta:
  """Where a CTA works, and the blocks its memory warpgroup streams.

  Attributes:
    b, head, wg: batch, head (query head, or kv head in the dK/dV kernel) and
      warpgroup indices.
    start: the CTA's first query row (forward, dQ) or key (dK/dV).
    lo, hi: the blocks [lo, hi) the CTA streams, the union of its warpgroups' ranges.
    t_eff, s_eff: the batch's query and key lengths.
  """

  b: Any
  head: Any
  wg: Any
  start: Any
  lo: Any
  hi: Any
  t_eff: Any
  s_eff: Any

  def slot(self, block: Any, stages: int) -> Any:
    """The ring slot holding `block` (the memory warpgroup's step block - lo)."""
    return lax.rem(block - self.lo, stages)


def _walk(ranges: tuple[Any, Any, Any, Any], cta_lo: Any, cta_hi: Any, step, skip, carry, *,
          masked_head: bool, first=None, last=None):
  """Runs a warpgroup over its CTA's blocks [cta_lo, cta_hi).

  step(block, carry, masked) runs on the warpgroup's blocks [lo, hi) of `ranges` =
  (lo, full_lo, full_hi, hi), with masked=False on [full_lo, full_hi); skip(block, None)
  runs on the CTA's other blocks, so every warpgroup passes every slot of the rings (and
  the same number of ping-pong turns).

  A software-pipelined walk passes `first` and `last`, each (lo, hi, carry) -> carry:
  first takes block lo (masked) before the steps, which then run on [lo + 1, hi), and
  last finishes after them; both run even when the range is empty (lo == hi), to keep
  the turns.
  """
  # A warpgroup's kept blocks lie in its CTA's, but an empty range may start past them.
  lo, full_lo, full_hi, hi = (flash_blocks.clip(r, cta_lo, cta_hi) for r in ranges)
  lax.fori_loop(cta_lo, lo, skip, None)
  start = lo
  if first is not None:
    carry = first(lo, hi, carry)
    start = jnp.minimum(lo + 1, hi)
  at = lambda block: jnp.maximum(block, start)
  if masked_head:
    carry = lax.fori_loop(start, at(full_lo), functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(at(full_lo), at(full_hi), functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(at(full_hi), hi, functools.partial(step, masked=True), carry)
  if last is not None:
    carry = last(lo, hi, carry)
  lax.fori_loop(hi, cta_hi, skip, None)
  return carry


def _whole(ref: Any, index: tuple[Any, ...], tile: Any) -> list[tuple[Any, Any]]:
  """The TMA copy of ref[index] into `tile` (of a ring: the slot is picked at fill time)."""
  return [(ref.at[index], tile)]


def _halves(ref: Any, index: tuple[Any, ...], tile: Any) -> list[tuple[Any, Any]]:
  """TMA copies of the two head-dim halves of ref[index] into tile.at[0] and tile.at[1].

  Head-split kernels keep (query or key, head dim) tiles as (2, rows, H / 2) (rings as
  (2, stages, rows, H / 2)): each half is contiguous, so a warpgroup's half of the
  result leaves by TMA from its own tile, and a product over the whole head dim is two
  wgmma on the halves."""
  half = tile.shape[-1]
  return [(ref.at[(*index, pl.ds(j * half, half))], tile.at[j]) for j in range(2)]


def _query_block_stream(p: _Problem, tiles: dict[str, tuple[Any, Any]], ready: Any, free: Any,
                        *, b: Any, kv_head: Any, lo: Any, per_head: Any, bq: int, keys: Any,
                        copies: Callable[..., list[tuple[Any, Any]]] = _whole) -> _Stream:
  """The stream of a dK kernel's CTA: step s brings query block lo + s mod per_head of
  query head kv_head * group + s // per_head.

  Args:
    tiles: {name: (GMEM ref, SMEM ring)} for "q", "do" (copied by `copies`), "lse",
      and where present "delta" and "pair" (the transposed bias/mask tile of the CTA's
      `keys` and these query rows, or the CTA's keys of the per-key vector).
  """

  def sources(step):
    g = lax.div(step, per_head)
    q0 = (lo + step - g * per_head) * bq
    head = kv_head * p.group + g
    rows, vec = (b, pl.ds(q0, bq), head), (b, head, pl.ds(q0, bq))
    out = [copy for name in ("q", "do") for copy in copies(tiles[name][0], rows, tiles[name][1])]
    out += [(tiles[name][0].at[vec], tiles[name][1]) for name in ("lse", "delta")
            if name in tiles]
    if "pair" in tiles:
      pair_ref, pair_ring = tiles["pair"]
      at = (keys,) if p.pair_per_key else (keys, pl.ds(q0, bq))
      out.append((pair_ref.at[(*p.pair_index(b, head), *at)], pair_ring))
    return out

  return _Stream(sources, ready, free)


def _query_tile_cta(p: _Problem, q_ref, k_ref, v_ref, pair_ref, lengths: tuple[Any, Any], *,
                    num_wgs: int, bq: int, bk: int, k_ring, v_ring, pair_ring, k_ready,
                    v_ready, k_free, v_free,
                    copies: Callable[..., list[tuple[Any, Any]]] = _whole
                    ) -> tuple[_Cta, _Stream, _Stream]:
  """Where a CTA of the forward or dQ kernel (one query tile of one head) works.

  `copies` (_whole or _halves) says how K and V tiles land in their rings.

  Returns:
    (cta, k_stream, v_stream): the CTA (its key blocks) and the K and V streams of its
    kv head, which start at block cta.lo. The K stream also brings the CTA's rows of
    the bias/mask tiles (`pair_ref`, when given) into `pair_ring`.
  """
  b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  t_eff, s_eff = _lengths(p, *lengths, b)
  rows = num_wgs * bq
  num_q_tiles = q_ref.shape[1] // rows
  tile = lax.axis_index("q_tiles")
  # Causal rows further down see more keys: run those first.
  cta_q0 = ((num_q_tiles - 1 - tile) if p.causal else tile) * rows
  lo, _, _, hi = flash_blocks.key_block_range(p, cta_q0, rows, bk, t_eff, s_eff)
  cta = _Cta(b=b, head=h, wg=wg, start=cta_q0, lo=lo, hi=hi, t_eff=t_eff, s_eff=s_eff)
  kv_head = lax.div(h, p.group)
  kv_rows = lambda step: (b, pl.ds((lo + step) * bk, bk), kv_head)

  def k_sources(step):
    tiles = copies(k_ref, kv_rows(step), k_ring)
    if pair_ref is not None:
      keys = pl.ds((lo + step) * bk, bk)
      at = (keys,) if p.pair_per_key else (pl.ds(cta_q0, rows), keys)
      tiles.append((pair_ref.at[(*p.pair_index(b, h), *at)], pair_ring))
    return tiles

  k_stream = _Stream(k_sources, k_ready, k_free)
  v_stream = _Stream(lambda step: copies(v_ref, kv_rows(step), v_ring), v_ready, v_free)
  return cta, k_stream, v_stream


def _kept(p: _Problem, shape: tuple[int, int], row0: Any, col0: Any, s_eff: Any, *,
          rows_are_queries: bool) -> jax.Array:
  """Kept (query, key) pairs of a tile whose rows start at row0 and columns at col0.

  Args:
    rows_are_queries: whether rows index queries (else keys, for transposed tiles).

  Returns:
    A bool tile in the wgmma accumulator layout: causality, the local window and the
    key length (s_eff, which also drops padded keys) applied.
  """
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + col0
  q_pos, k_pos = (rows, cols) if rows_are_queries else (cols, rows)
  return flash_blocks.positional_ok(p, q_pos, k_pos, s_eff)


def _add_pair(p: _Problem, s: jax.Array, pair_ring: Any, slot: Any, offset: int | Any, *,
              rows_are_queries: bool = True) -> jax.Array:
  """Base-2 logits s plus the bias/mask in one slot of `pair_ring`.

  A slot holds the CTA's tile (this warpgroup's rows start at `offset`), or with
  `pair_per_key` a vector over keys: a step's keys when they are s's columns, or the
  CTA's keys (this warpgroup's from `offset`) when they are its rows.
  """
  if pair_ring is None:
    return s
  if not p.pair_per_key:
    tile = pair_ring.at[slot, pl.ds(offset, s.shape[0])]
    pair = plgpu.load(tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  elif rows_are_queries:
    pair = _cols(plgpu.load(pair_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)), s.shape)
  else:
    vector = pair_ring.at[slot, pl.ds(offset, s.shape[0])]
    pair = _rows(plgpu.load(vector, layout=plgpu.Layout.WGMMA.reduce(1)), s.shape)
  return s + pair * _LOG2E


def _live_rows(shape: tuple[int, int], row0: Any, t_eff: Any) -> jax.Array:
  """Rows of a tile (rows from row0) before the query length, as a bool tile."""
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
  return rows < t_eff


def _store_tiles(copies: Sequence[tuple[Any, jax.Array, Any]]) -> None:
  """Writes register tiles to GMEM through their SMEM tiles: [(smem, value, gmem)]."""
  for smem, value, _ in copies:
    smem[...] = value
  plgpu.commit_smem()
  for smem, _, gmem in copies:
    plgpu.copy_smem_to_gmem(smem, gmem)
  plgpu.wait_smem_to_gmem(0)


def _pad_seq(x: jax.Array, length: int, value: float = 0.0, axis: int = 1) -> jax.Array:
  """Pads axis `axis` of x to `length` with `value` (no copy when already there)."""
  if x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _stage(stage: Any, wg: Any) -> Any:
  """Warpgroup wg's staging tile for register operands (None on the GPU path)."""
  return None if stage is None else stage.at[wg]


def _barrier(num_barriers: int, num_arrivals: int = 1) -> Any:
  return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=num_barriers)


Interpret = bool | plgpu.InterpretGPUParams


def _interpret_params(interpret: Interpret) -> Any:
  """The interpreter's parameters (None: compile for the GPU)."""
  if isinstance(interpret, plgpu.InterpretGPUParams):
    return interpret
  return plgpu.InterpretGPUParams() if interpret else None


def _as_interpret(interpret: Any) -> Interpret:
  """A hashable interpret option for the jitted wrappers: a bool or the params."""
  return interpret if isinstance(interpret, plgpu.InterpretGPUParams) else bool(interpret)


def _kernel(body: Callable[..., None], *, p: _Problem, c: Any, out_type: Any,
            scratch: dict[str, Any], grid: tuple[int, int, int], tiles: str,
            num_compute_wgs: int, name: str, interpret: Interpret,
            **options: Any) -> Callable[..., Any]:
  """The launcher of one of this file's kernels: grid (heads, batch, `tiles`), the
  compute warpgroups and one memory warpgroup (thread axis "wg"). The body gets the
  problem `p`, the config `c`, how tiles reach wgmma (`mma`: staged when interpreting)
  and `options`."""
  params = _interpret_params(interpret)
  mma = _Mma(staged=params is not None, check_reads=pallas_common.detects_races(params))
  body = functools.partial(body, p=p, c=c, mma=mma, **options)
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=grid,
      grid_names=("heads", "batch", tiles), num_threads=num_compute_wgs + 1,
      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params, kernel_name="stellarax_attention_" + name)


# --------------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _FwdWalker:
  """One forward compute warpgroup's pass over its CTA's key blocks.

  Every block the CTA streams is one turn at the tensor cores (two phases of the
  ping-pong barrier: `sync` before issuing, `arrive` after, `wait` once the turn's
  other work is done), whether the warpgroup computes on it or skips it.

  Plain (`overlap_softmax` off), a turn is P V of one block and S of the next; the
  warpgroup waits for each product.

  Pipelined (FlashAttention-3's intra-warpgroup overlap), a turn issues S of block j and
  then P V of block j - 1 back to back, and the softmax of block j runs while P V runs.
  A first turn computes S of the first block alone, a last one P V of the last block; a
  warpgroup with no block keeps one idle turn instead, so both pass the same number.
  """

  p: _Problem
  c: PallasMosaicGpuAttentionConfig
  mma: _Mma
  pingpong: _PingPong
  cta: _Cta
  q0: Any
  q_tile: Any
  k_stream: _Stream
  v_stream: _Stream
  k_ring: Any
  v_ring: Any
  pair_ring: Any
  stage: Any

  def walk(self, ranges: tuple[Any, Any, Any, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(acc, m, l): the unnormalised output, base-2 row maxima and row sums."""
    bq, bk = self.c.block_q, self.c.block_kv
    m0 = plgpu.layout_cast(jnp.full((bq,), flash_blocks.MASK_VALUE, jnp.float32),
                           plgpu.Layout.WGMMA.reduce(1))
    acc0, l0 = _zeros((bq, self.p.head_dim)), _zeros((bq,))
    masked_head = self.p.left_reach is not None
    if not self.c.overlap_softmax:
      return _walk(ranges, self.cta.lo, self.cta.hi, self._step, self._skip, (acc0, m0, l0),
                   masked_head=masked_head)
    probs0 = plgpu.layout_cast(jnp.zeros((bq, bk), self.p.dtype), plgpu.Layout.WGMMA)
    acc, _, m, l = _walk(ranges, self.cta.lo, self.cta.hi, self._pipelined_step, self._skip,
                         (acc0, probs0, m0, l0), masked_head=masked_head,
                         first=self._pipelined_first, last=self._pipelined_last)
    return acc, m, l

  def _slot(self, kb: Any) -> Any:
    return self.cta.slot(kb, self.c.num_stages)

  def _scores(self, while_running: Callable[[], None], kb: Any) -> jax.Array:
    """Raw S = Q K^T of key block kb (its K slot acquired first)."""
    slot = self._slot(kb)
    self.k_stream.acquire(slot)
    return self.mma.product(self.q_tile, self.k_ring.at[slot].T,
                            (self.c.block_q, self.c.block_kv), while_running=while_running)

  @property
  def _late_scale(self) -> float | None:
    """The factor from raw S to base-2 logits when the softmax may apply it late (no
    bias, a positive scale, so max(c S) = c max(S)): the row maximum is then taken of S
    and each probability is one FFMA, exp2(S c - m), instead of a multiply for the
    maximum and another for the exponent. None: the logits are scaled first."""
    return None if self.p.has_pair or self.p.scale <= 0 else self.p.scale * _LOG2E

  def _logits(self, s: jax.Array, kb: Any, masked: bool) -> jax.Array:
    """Base-2 logits of key block kb from its raw S (still to be multiplied by
    `_late_scale` when that is set), masked; frees the block's K slot."""
    p, slot = self.p, self._slot(kb)
    if self._late_scale is None:
      s = s * (p.scale * _LOG2E)  # base-2 logits: exp2 is the native instruction.
      s = _add_pair(p, s, self.pair_ring, slot, self.cta.wg * self.c.block_q)
    self.k_stream.release(slot, after_loads=p.has_pair)
    if masked:
      keep = _kept(p, s.shape, self.q0, kb * self.c.block_kv, self.cta.s_eff,
                   rows_are_queries=True)
      s = jnp.where(keep, s, -jnp.inf)
    return s

  def _softmax(self, s: jax.Array, m: jax.Array, l: jax.Array):
    """Online softmax of `_logits`: (float32 probabilities, m, l, alpha), m the base-2
    row maxima, alpha rescaling what was summed before."""
    # m starts at MASK_VALUE, finite: a block with every key of a row masked then
    # gives that row probabilities exp2(-inf) = 0 and alpha = 1, not NaN.
    c = self._late_scale
    if c is None:
      m_new = jnp.maximum(m, s.max(axis=1))
      probs = jnp.exp2(s - _rows(m_new, s.shape))
    else:
      m_new = jnp.maximum(m, s.max(axis=1) * c)
      probs = jnp.exp2(s * c - _rows(m_new, s.shape))
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + probs.sum(axis=1)
    return probs, m_new, l, alpha

  def _step(self, kb, carry, masked):
    acc, m, l = carry
    slot = self._slot(kb)
    s = self._scores(self.pingpong.sync, kb)
    probs, m, l, alpha = self._softmax(self._logits(s, kb, masked), m, l)
    probs = probs.astype(self.p.dtype)
    acc = acc * _rows(alpha, acc.shape)
    if self.p.head_dim <= 128:
      # Keep the softmax, the rescale and the cast before the barrier: otherwise they
      # may sink past it into this warpgroup's matmul turn (jax's attention_mgpu found
      # the order matters for speed at these head dims).
      acc, m, l, probs = lax.optimization_barrier((acc, m, l, probs))
    self.pingpong.arrive()  # Softmax done: the other warpgroup may use the tensor cores.
    self.v_stream.acquire(slot)
    self.pingpong.wait()
    acc = self.mma.accumulate(acc, probs, self.v_ring.at[slot], self.stage)
    self.v_stream.release(slot)
    return acc, m, l

  def _skip(self, kb, _):
    # Blocks the CTA loads for its other warpgroup: free them, keep the turns.
    slot = self._slot(kb)
    self.k_stream.acquire(slot)
    self.k_stream.release(slot)
    self.pingpong.sync()
    self.pingpong.arrive()
    self.v_stream.acquire(slot)
    self.pingpong.wait()
    self.v_stream.release(slot)

  def _pipelined_first(self, lo, hi, carry):
    def first(carry):
      acc, _, m, l = carry
      self.pingpong.sync()
      s = self._scores(self.pingpong.arrive, lo)
      probs, m, l, _ = self._softmax(self._logits(s, lo, masked=True), m, l)  # acc is 0.
      self.pingpong.wait()
      return acc, probs.astype(self.p.dtype), m, l

    def idle(carry):
      self.pingpong.sync()
      self.pingpong.arrive()
      self.pingpong.wait()
      return carry

    return _if_blocks(lo, hi, first, carry, otherwise=idle)

  def _pipelined_step(self, kb, carry, masked):
    acc, probs, m, l = carry
    slot, prev = self._slot(kb), self._slot(kb - 1)
    self.k_stream.acquire(slot)
    self.v_stream.acquire(prev)
    self.pingpong.sync()
    shape = (self.c.block_q, self.c.block_kv)
    softmax = lambda s: self._softmax(self._logits(s, kb, masked), m, l)
    (probs, m, l, alpha), acc = self.mma.products_then_accumulate(
        [(self.q_tile, self.k_ring.at[slot].T)], shape, acc, probs, self.v_ring.at[prev],
        stage=self.stage, after_issue=self.pingpong.arrive, on_products=softmax,
        like=(_zeros(shape), m, l, m))
    self.v_stream.release(prev)
    self.pingpong.wait()
    # Cast only now: the P V just awaited read the previous probabilities' registers.
    return acc * _rows(alpha, acc.shape), probs.astype(self.p.dtype), m, l

  def _pipelined_last(self, lo, hi, carry):
    def last(carry):
      acc, probs, m, l = carry
      prev = self._slot(hi - 1)
      self.v_stream.acquire(prev)
      self.pingpong.sync()
      acc = self.mma.accumulate(acc, probs, self.v_ring.at[prev], self.stage,
                                while_running=self.pingpong.arrive)
      self.v_stream.release(prev)
      self.pingpong.wait()
      return acc, probs, m, l

    return _if_blocks(lo, hi, last, carry)


def _fwd_kernel(*refs, q_smem, k_ring, v_ring, pair_ring, stage, lse_smem, v_mean_smem,
                q_ready, k_ready, v_ready, k_free, v_free, sched, p: _Problem,
                c: PallasMosaicGpuAttentionConfig, mma: _Mma):
  """Output rows and lse of one query tile of one head (see the module docstring)."""
  q_ref, k_ref, v_ref, pair_ref, q_len_ref, kv_len_ref, v_mean_ref, o_ref, lse_ref = unpack_refs(
      refs, (True, True, True, p.has_pair, p.has_q_len, p.has_kv_len, p.may_fully_mask,
             True, True))
  num_wgs, bq, bk, stages = c.num_compute_wgs, c.block_q, c.block_kv, c.num_stages
  cta, k_stream, v_stream = _query_tile_cta(
      p, q_ref, k_ref, v_ref, pair_ref, (q_len_ref, kv_len_ref), num_wgs=num_wgs, bq=bq,
      bk=bk, k_ring=k_ring, v_ring=v_ring, pair_ring=pair_ring, k_ready=k_ready,
      v_ready=v_ready, k_free=k_free, v_free=v_free)
  b, h, wg = cta.b, cta.head, cta.wg
  pingpong = _PingPong(sched)

  @pl.when(wg < num_wgs)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS[num_wgs], action="increase")
    q0 = cta.start + wg * bq
    q_tile = q_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_tile, q_ready.at[wg])
    if v_mean_ref is not None:
      plgpu.copy_gmem_to_smem(v_mean_ref.at[b, lax.div(h, p.group)], v_mean_smem.at[wg],
                              q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])

    ranges = flash_blocks.key_block_range(p, q0, bq, bk, cta.t_eff, cta.s_eff)
    walker = _FwdWalker(p=p, c=c, mma=mma, pingpong=pingpong, cta=cta, q0=q0, q_tile=q_tile,
                        k_stream=k_stream, v_stream=v_stream, k_ring=k_ring, v_ring=v_ring,
                        pair_ring=pair_ring, stage=_stage(stage, wg))
    pl.when(wg == 1)(pingpong.sync)  # Warpgroup 1 starts one turn behind.
    acc, m, l = walker.walk(ranges)
    pl.when(wg == 0)(pingpong.sync)

    # A row that kept a key has l >= 1 (its largest logit adds exp2(0)); one that kept
    # none has l = 0, acc = 0 and m = MASK_VALUE, so it gets out = 0 and an lse of
    # MASK_VALUE * ln 2, which the backward pass recognises.
    l_safe = jnp.maximum(l, 1.0)
    out = acc / _rows(l_safe, acc.shape)
    lse = (m + jnp.log2(l_safe)) * _LN2
    if v_mean_ref is not None:
      # jax gives a row with no kept key a uniform softmax over all S keys: mean(V).
      empty = 1.0 - jnp.minimum(l, 1.0)
      v_mean = plgpu.load(v_mean_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
      out = out + _rows(empty, out.shape) * _cols(v_mean, out.shape)
    if q_len_ref is not None:
      out = jnp.where(_live_rows(out.shape, q0, cta.t_eff), out, 0.0)
    _store_tiles([(q_tile, out.astype(p.dtype), o_ref.at[b, pl.ds(q0, bq), h]),
                  (lse_smem.at[wg], lse, lse_ref.at[b, h, pl.ds(q0, bq)])])

  @pl.when(wg == num_wgs)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
    _produce([k_stream, v_stream], cta.hi - cta.lo, stages)


def _lengths_args(p: _Problem, q_len: Any, kv_len: Any) -> list[jax.Array]:
  """The sequence-length operands the kernels take (only those given)."""
  return ([q_len] if p.has_q_len else []) + ([kv_len] if p.has_kv_len else [])


def _pair_ring(p: _Problem, stages: int, rows: int, cols: int, keys: int) -> Any:
  """SMEM ring of (rows, cols) bias/mask tiles, or of float32 vectors over `keys`
  keys with `pair_per_key` (None without bias and mask)."""
  if not p.has_pair:
    return None
  if p.pair_per_key:
    return plgpu.SMEM((stages, keys), jnp.float32)
  return plgpu.SMEM((stages, rows, cols), p.dtype, transforms=_tiled(p.dtype, cols))


@functools.partial(jax.jit, static_argnames=("p", "c", "interpret"))
def _fwd(query, key, value, bias, mask, q_len, kv_len, *, p: _Problem,
         c: PallasMosaicGpuAttentionConfig, interpret: Interpret):
  b, _, n, h = query.shape
  num_wgs, bq, bk, stages = c.num_compute_wgs, c.block_q, c.block_kv, c.num_stages
  t_pad, s_pad = _round_up(p.t, num_wgs * bq), _round_up(p.s, bk)
  q, k, v = _pad_seq(query, t_pad), _pad_seq(key, s_pad), _pad_seq(value, s_pad)
  pair = _pair_operand(bias, mask, p, t_pad, s_pad)
  args = [q, k, v, *([pair] if p.has_pair else []), *_lengths_args(p, q_len, kv_len)]
  if p.may_fully_mask:
    args.append(jnp.mean(value.astype(jnp.float32), axis=1))  # (B, K, H)
  scratch = dict(
      q_smem=plgpu.SMEM((num_wgs, bq, h), p.dtype, transforms=_tiled(p.dtype, h)),
      k_ring=plgpu.SMEM((stages, bk, h), p.dtype, transforms=_tiled(p.dtype, h)),
      v_ring=plgpu.SMEM((stages, bk, h), p.dtype, transforms=_tiled(p.dtype, h)),
      pair_ring=_pair_ring(p, stages, num_wgs * bq, bk, keys=bk),
      stage=(plgpu.SMEM((num_wgs, bq, bk), p.dtype, transforms=_tiled(p.dtype, bk))
             if interpret else None),
      lse_smem=plgpu.SMEM((num_wgs, bq), jnp.float32),
      v_mean_smem=plgpu.SMEM((num_wgs, h), jnp.float32) if p.may_fully_mask else None,
      q_ready=_barrier(num_wgs, 2 if p.may_fully_mask else 1),
      k_ready=_barrier(stages, 1 + p.has_pair), v_ready=_barrier(stages),
      k_free=_barrier(stages, num_wgs), v_free=_barrier(stages, num_wgs),
      sched=_barrier(1, 2) if c.schedule_barrier else None,
  )
  out, lse = _kernel(
      _fwd_kernel, p=p, c=c, out_type=(jax.ShapeDtypeStruct(q.shape, p.dtype),
                        jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)),
      scratch=scratch, grid=(n, b, t_pad // (num_wgs * bq)), tiles="q_tiles",
      num_compute_wgs=num_wgs, name="fwd", interpret=interpret)(*args)
  return out[:, :p.t], lse[:, :, :p.t]


def attention_fwd_pallas_mosaic_gpu(query, key, value, bias=None, mask=None, *,
                                    scale: float | None = None,
                                    is_causal: bool = False, query_seq_lengths=None,
                                    key_value_seq_lengths=None, local_window_size=None,
                                    block_q: int, block_kv: int, num_compute_wgs: int,
                                    num_stages: int, schedule_barrier: bool,
                                    overlap_softmax: bool = False,
                                    interpret: Interpret = False):
  """Flash attention forward with the semantics of jax.nn.dot_product_attention.

  Args:
    query: (B, T, N, H) bfloat16 or float16; H in (64, 128, 256).
    key: (B, S, K, H), same dtype; N must be a multiple of K.
    value: (B, S, K, H), same dtype.
    bias: optional float array broadcastable to (B, N, T, S), 4-D, added to the scaled
      logits (rounded to query's dtype in the kernel).
    mask: optional bool array broadcastable to (B, N, T, S), 4-D; True keeps a position.
    scale: logit scale; default 1 / sqrt(H).
    is_causal: keep only keys j <= query position i.
    query_seq_lengths: optional (B,) int32; output rows at or past it are zero.
    key_value_seq_lengths: optional (B,) int32; keys at or past it are dropped.
    local_window_size: None, an int w (= (w, w)) or (left, right) of ints >= 0: keep
      keys i - left ... i + right.
    block_q, block_kv, num_compute_wgs, num_stages, schedule_barrier, overlap_softmax:
      tunables, see check_fwd_tunables.
    interpret: run in the Mosaic GPU interpreter (any backend; for tests): True, or
      `plgpu.InterpretGPUParams` for its options (e.g. race detection).

  Returns:
    (out, lse): out (B, T, N, H) in query's dtype (mean(V) on a row that keeps no key,
    as in jax); lse (B, N, T) float32, the natural-log log-sum-exp of each row's scaled,
    masked logits, MASK_VALUE * ln 2 on rows that keep no key (on rows past the query
    length it is not specified: the backward pass reads the lengths).

  Raises:
    ValueError: for unsupported shapes, dtypes, options or tunables.
  """
  c = PallasMosaicGpuAttentionConfig(block_q=block_q, block_kv=block_kv,
                                     num_compute_wgs=num_compute_wgs, num_stages=num_stages,
                                     schedule_barrier=schedule_barrier,
                                     overlap_softmax=overlap_softmax)
  p = _make_problem(query, key, value, scale, is_causal, local_window_size,
                    query_seq_lengths, key_value_seq_lengths, bias, mask)
  return _fwd(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths, p=p,
              c=c, interpret=_as_interpret(interpret))


# --------------------------------------------------------------------------------------
# Backward kernels
# --------------------------------------------------------------------------------------


def _dq_kernel(*refs, q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, pair_ring,
               stage, rows_ready, k_ready, v_ready, k_free, v_free, p: _Problem,
               c: PallasMosaicGpuAttentionVjpConfig, mma: _Mma):
  """dQ of one query tile of one head: the forward's loop with dS = P (dP - delta)."""
  (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, pair_ref, q_len_ref, kv_len_ref,
   dq_ref) = unpack_refs(refs, (True,) * 6 + (p.has_pair, p.has_q_len, p.has_kv_len, True))
  num_wgs, bq, bk, stages = c.num_compute_wgs, c.block_q_dq, c.block_kv_dq, c.num_stages
  cta, k_stream, v_stream = _query_tile_cta(
      p, q_ref, k_ref, v_ref, pair_ref, (q_len_ref, kv_len_ref), num_wgs=num_wgs, bq=bq,
      bk=bk, k_ring=k_ring, v_ring=v_ring, pair_ring=pair_ring, k_ready=k_ready,
      v_ready=v_ready, k_free=k_free, v_free=v_free)
  b, h, wg = cta.b, cta.head, cta.wg

  @pl.when(wg < num_wgs)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS[num_wgs], action="increase")
    q0 = cta.start + wg * bq
    q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
    row_slice = (b, pl.ds(q0, bq), h)
    for src, dst in ((q_ref.at[row_slice], q_tile), (do_ref.at[row_slice], do_tile),
                     (lse2_ref.at[b, h, pl.ds(q0, bq)], lse_smem.at[wg]),
                     (delta_ref.at[b, h, pl.ds(q0, bq)], delta_smem.at[wg])):
      plgpu.copy_gmem_to_smem(src, dst, rows_ready.at[wg])
    plgpu.barrier_wait(rows_ready.at[wg])
    lse2 = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

    def d_scores(s, dp, kb, masked):
      """dS = P (dP - delta) in float32 from the raw S and dP of key block kb."""
      s = _add_pair(p, s * (p.scale * _LOG2E), pair_ring, cta.slot(kb, stages), wg * bq)
      # lse2 is +inf on rows that feed no gradient: probabilities 0 there.
      probs = jnp.exp2(s - _rows(lse2, s.shape))
      if masked:
        keep = _kept(p, (bq, bk), q0, kb * bk, cta.s_eff, rows_are_queries=True)
        probs = jnp.where(keep, probs, 0.0)
      return probs * (dp - _rows(delta, dp.shape))

    def products(slot):
      return [(q_tile, k_ring.at[slot].T), (do_tile, v_ring.at[slot].T)]

    def step(kb, dq, masked):
      slot = cta.slot(kb, stages)
      (q_k, do_v) = products(slot)
      k_stream.acquire(slot)
      s = mma.product(*q_k, (bq, bk))
      v_stream.acquire(slot)
      dp = mma.product(*do_v, (bq, bk))
      v_stream.release(slot)
      ds = d_scores(s, dp, kb, masked)
      dq = mma.accumulate(dq, ds.astype(p.dtype), k_ring.at[slot], _stage(stage, wg))
      k_stream.release(slot, after_loads=p.has_pair)
      return dq

    # With overlap_softmax a step issues S and dP of block j and dQ += dS K of block j - 1
    # together and computes block j's dS while that runs; K of block j - 1 is freed once
    # its product is done.
    def first(lo, hi, carry):
      def run(carry):
        dq, _ = carry
        slot = cta.slot(lo, stages)
        k_stream.acquire(slot)
        v_stream.acquire(slot)
        s, dp = (mma.product(a, b, (bq, bk)) for a, b in products(slot))
        v_stream.release(slot)
        return dq, d_scores(s, dp, lo, masked=True).astype(p.dtype)

      return _if_blocks(lo, hi, run, carry)

    def pipelined_step(kb, carry, masked):
      dq, ds = carry
      slot, prev = cta.slot(kb, stages), cta.slot(kb - 1, stages)
      k_stream.acquire(slot)
      v_stream.acquire(slot)

      def on_products(s, dp):
        v_stream.release(slot)
        return d_scores(s, dp, kb, masked)

      ds_next, dq = mma.products_then_accumulate(
          products(slot), (bq, bk), dq, ds, k_ring.at[prev], stage=_stage(stage, wg),
          after_issue=lambda: None, on_products=on_products, like=_zeros((bq, bk)))
      k_stream.release(prev, after_loads=p.has_pair)
      # Cast only now: the product just awaited read the previous dS's registers.
      return dq, ds_next.astype(p.dtype)

    def last(lo, hi, carry):
      def run(carry):
        dq, ds = carry
        prev = cta.slot(hi - 1, stages)
        dq = mma.accumulate(dq, ds, k_ring.at[prev], _stage(stage, wg))
        k_stream.release(prev, after_loads=p.has_pair)
        return dq, ds

      return _if_blocks(lo, hi, run, carry)

    def skip(kb, _):
      slot = cta.slot(kb, stages)
      for stream in (k_stream, v_stream):
        stream.acquire(slot)
        stream.release(slot)

    ranges = flash_blocks.key_block_range(p, q0, bq, bk, cta.t_eff, cta.s_eff)
    dq0, masked_head = _zeros((bq, p.head_dim)), p.left_reach is not None
    if c.overlap_softmax:
      ds0 = plgpu.layout_cast(jnp.zeros((bq, bk), p.dtype), plgpu.Layout.WGMMA)
      dq, _ = _walk(ranges, cta.lo, cta.hi, pipelined_step, skip, (dq0, ds0),
                    masked_head=masked_head, first=first, last=last)
    else:
      dq = _walk(ranges, cta.lo, cta.hi, step, skip, dq0, masked_head=masked_head)
    _store_tiles([(q_tile, (dq * p.scale).astype(p.dtype), dq_ref.at[row_slice])])

  @pl.when(wg == num_wgs)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
    _produce([k_stream, v_stream], cta.hi - cta.lo, stages)


# dQ columns one fused-dQ product and TMA reduce-add covers (a 128-byte swizzle
# unit of the 16-bit K tile, so column slices of it are whole swizzle tiles).
_DQ_CHUNK = 64


def _dq_staging_slots(head_dim: int, num_wgs: int) -> int:
  """Float32 staging tiles per warpgroup of the fused dQ: two alternate when it sends
  several 64-column chunks a step (one is filled while TMA still reads the other),
  else one (its reduce-add had a whole step to finish reading it)."""
  return 2 if head_dim > num_wgs * _DQ_CHUNK else 1


@dataclasses.dataclass(frozen=True)
class _FusedDq:
  """dQ summed into float32 global memory by the dK kernel (`fuse_dq=True`).

  At every step of the CTA (one query block of one head) each compute warpgroup
  writes its 16-bit dS^T tile (zeros on steps it skips) to shared memory, the
  warpgroups meet at a barrier, and each sums dS K over all the CTA's keys for its
  64-column chunks of dQ: sum over warpgroups w of dS_w (block_q x block_kv) @
  K_w[:, chunk]. A chunk goes from a float32 staging tile to global memory with a
  TMA reduce-add (`cp.reduce.async.bulk.tensor ... add.f32`), which adds atomically in
  L2, so CTAs of different key tiles may add to one dQ row in any order. One
  reduce-add per (query block, chunk) per CTA, not per warpgroup, halves that traffic
  with two warpgroups. dS^T tiles are double-buffered by step parity: a warpgroup
  rewrites a buffer two steps later, after the other passed the next step's barrier,
  so after it finished reading. The interpreter has no TMA reductions: there each
  CTA stores its sums into its own slice of a float32 buffer (one slice per key tile
  of CTAs), summed after the kernel; every (slice, query block, head, chunk) is
  written once, so that is race-free too.

  Attributes:
    acc_ref: float32 (B, T_pad, N, H) accumulator in global memory, zeros at launch;
      interpret mode (num_kv_ctas, B, T_pad, N, H).
    ds_smem: (2, num_wgs, block_kv, block_q) 16-bit dS^T tiles.
    staging: (num_wgs, slots, block_q, 64) float32 tiles for the reduce-adds.
    ds_ready: barrier with one arrival per compute warpgroup (None with one).
    k_smem: (num_wgs, block_kv, H) the CTA's K tiles.
    mma: how tiles reach wgmma; staged (interpret mode) means no TMA reductions.
    b, cta, wg: batch, key tile of CTAs and warpgroup indices.
  """

  acc_ref: Any
  ds_smem: Any
  staging: Any
  ds_ready: Any
  k_smem: Any
  mma: _Mma
  b: Any
  cta: Any
  wg: Any

  def share(self, step: Any, ds_t: jax.Array | None) -> Any:
    """Stores this warpgroup's (block_kv, block_q) 16-bit dS^T of step `step` (zeros for
    None: a step whose rows see none of its keys) and waits for the others'.

    Returns:
      The shared-memory tile holding it.
    """
    ds_tile = self.ds_smem.at[lax.rem(step, 2), self.wg]
    if ds_t is None:
      ds_t = plgpu.layout_cast(jnp.zeros(ds_tile.shape, ds_tile.dtype), plgpu.Layout.WGMMA)
    ds_tile[...] = ds_t
    plgpu.commit_smem()  # Make the stores visible to wgmma (the async proxy).
    if self.ds_ready is not None:
      plgpu.barrier_arrive(self.ds_ready)
      plgpu.barrier_wait(self.ds_ready)
    return ds_tile

  def send(self, step: Any, head: Any, q0: Any) -> None:
    """Adds step `step`'s dS K (after `share`) to dQ rows [q0, q0 + block_q) of `head`:
    this warpgroup's chunks of columns, over the keys of every warpgroup."""
    buffer = lax.rem(step, 2)
    _, num_wgs, _, bq = self.ds_smem.shape
    head_dim = self.k_smem.shape[-1]
    slots = self.staging.shape[1]
    wg, b = self.wg, self.b
    # Chunk n of warpgroup wg starts at column (n * num_wgs + wg) * 64. The offset is
    # traced (a multiple of the swizzle unit): one code path for all warpgroups, where a
    # branch per warpgroup spilled registers on an H200 (bench/compile_h200.py).
    for n in range(-(-head_dim // (num_wgs * _DQ_CHUNK))):
      col = pl.multiple_of((n * num_wgs + wg) * _DQ_CHUNK, _DQ_CHUNK)

      def _chunk(n=n, col=col):
        pairs = [(self.ds_smem.at[buffer, src].T,
                  self.k_smem.at[src, :, pl.ds(col, _DQ_CHUNK)]) for src in range(num_wgs)]
        part = self.mma.product_sum(pairs, (bq, _DQ_CHUNK))
        tile = self.staging.at[wg, n % slots]
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)  # Tile's last send read.
        tile[...] = part
        plgpu.commit_smem()
        cols = pl.ds(col, _DQ_CHUNK)
        if self.mma.staged:  # The interpreter: no reductions, the CTA's own slice.
          plgpu.copy_smem_to_gmem(tile, self.acc_ref.at[self.cta, b, pl.ds(q0, bq), head, cols])
        else:
          plgpu.copy_smem_to_gmem(tile, self.acc_ref.at[b, pl.ds(q0, bq), head, cols],
                                  reduction_op="add")

      if head_dim % (num_wgs * _DQ_CHUNK):
        pl.when(col < head_dim)(_chunk)  # Fewer chunks than warpgroups (head dim 64).
      else:
        _chunk()

  def finish(self) -> None:
    """Waits until every warpgroup is past its last step: the others read this one's K
    tile for their dQ chunks, and the epilogue overwrites it with dK."""
    if self.ds_ready is not None:
      plgpu.barrier_arrive(self.ds_ready)
      plgpu.barrier_wait(self.ds_ready)


def _dkdv_kernel(*refs, k_smem, v_smem, dv0_smem, q_ring, do_ring, lse_ring, delta_ring,
                 pair_ring, stage, kv_ready, ready, free, ds_smem, dq_staging, ds_ready,
                 p: _Problem, c: PallasMosaicGpuAttentionVjpConfig, mma: _Mma,
                 grads: tuple[str, ...], fused_dq: bool):
  """dK and/or dV (`grads`) of one key tile per compute warpgroup, summed over the group;
  with `fused_dq` (and dK) also the CTA's dQ sums (see _FusedDq)."""
  want_dk, want_dv = "dk" in grads, "dv" in grads
  with_dv0 = want_dv and p.may_fully_mask
  (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, pair_t_ref, q_len_ref, kv_len_ref,
   dv0_ref, dq_acc_ref, *out_refs) = unpack_refs(
       refs, (True,) * 6 + (p.has_pair, p.has_q_len, p.has_kv_len, with_dv0, fused_dq)
       + (True,) * len(grads))
  num_wgs, bq, bk, stages = c.num_compute_wgs, c.block_q_dkv, c.block_kv_dkv, c.num_stages
  b, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  dq = None
  if fused_dq:
    dq = _FusedDq(dq_acc_ref, ds_smem, dq_staging, ds_ready, k_smem, mma, b=b,
                  cta=lax.axis_index("kv_tiles"), wg=wg)
  t_eff, s_eff = _lengths(p, q_len_ref, kv_len_ref, b)
  cta_k0 = lax.axis_index("kv_tiles") * (num_wgs * bk)
  cta_lo, _, _, cta_hi = flash_blocks.query_block_range(p, cta_k0, bq, num_wgs * bk,
                                                        t_eff, s_eff)
  # The CTA's steps run over (query head g of the group, query block in [lo, hi)).
  per_head = cta_hi - cta_lo

  tiles = dict(q=(q_ref, q_ring), do=(do_ref, do_ring), lse=(lse2_ref, lse_ring))
  if want_dk:
    tiles["delta"] = (delta_ref, delta_ring)
  if pair_t_ref is not None:
    tiles["pair"] = (pair_t_ref, pair_ring)
  stream = _query_block_stream(p, tiles, ready, free, b=b, kv_head=kv_head, lo=cta_lo,
                               per_head=per_head, bq=bq, keys=pl.ds(cta_k0, num_wgs * bk))

  @pl.when(wg < num_wgs)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS[num_wgs], action="increase")
    k0 = cta_k0 + wg * bk
    k_tile, v_tile = k_smem.at[wg], None if v_smem is None else v_smem.at[wg]
    keys = (b, pl.ds(k0, bk), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[keys], k_tile, kv_ready.at[wg])
    if want_dk:
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_tile, kv_ready.at[wg])
    if with_dv0:
      plgpu.copy_gmem_to_smem(dv0_ref.at[b, kv_head], dv0_smem.at[wg], kv_ready.at[wg])
    plgpu.barrier_wait(kv_ready.at[wg])

    def step(i, carry, base, head, masked):
      dk, dv = carry
      slot = lax.rem(i, stages)
      stream.acquire(slot)
      s_t = mma.product(k_tile, q_ring.at[slot].T, (bk, bq))
      s_t = _add_pair(p, s_t * (p.scale * _LOG2E), pair_ring, slot, wg * bk,
                      rows_are_queries=False)
      lse2 = plgpu.load(lse_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      p_t = jnp.exp2(s_t - _cols(lse2, s_t.shape))
      if masked:
        keep = _kept(p, (bk, bq), k0, (i - base) * bq, s_eff, rows_are_queries=False)
        p_t = jnp.where(keep, p_t, 0.0)
      if dv is not None:
        dv = mma.accumulate(dv, p_t.astype(p.dtype), do_ring.at[slot], _stage(stage, wg))
      if dk is not None:
        dp_t = mma.product(v_tile, do_ring.at[slot].T, (bk, bq))
        delta = plgpu.load(delta_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        ds_t = (p_t * (dp_t - _cols(delta, dp_t.shape))).astype(p.dtype)
        if dq is None:
          dk = mma.accumulate(dk, ds_t, q_ring.at[slot], _stage(stage, wg))
        else:
          # dS^T goes to shared memory for the dQ sums anyway: dK's wgmma reads it
          # there too, so its registers are free before the dQ products.
          dk = mma.accumulate(dk, dq.share(i, ds_t), q_ring.at[slot])
          dq.send(i, head, (i - base) * bq)
      stream.release(slot, after_loads=True)  # lse, delta (and bias/mask) were loaded
      return dk, dv

    def skip(i, _, base, head):
      slot = lax.rem(i, stages)
      stream.acquire(slot)
      stream.release(slot)
      if dq is not None and num_wgs > 1:
        # The other warpgroups' dQ sums of this step still add dS K over these keys.
        dq.share(i, None)
        dq.send(i, head, (i - base) * bq)

    ranges = flash_blocks.query_block_range(p, k0, bq, bk, t_eff, s_eff)

    def head(g, carry):
      base = g * per_head - cta_lo  # Step of query block j of this head: base + j.
      shifted = tuple(base + r for r in ranges)
      at = dict(base=base, head=kv_head * p.group + g)
      return _walk(shifted, base + cta_lo, base + cta_hi, functools.partial(step, **at),
                   functools.partial(skip, **at), carry, masked_head=p.right_reach is not None)

    zeros = _zeros((bk, p.head_dim))
    dv = zeros
    if with_dv0:
      # Rows that keep no key add dout / S to every dV row (see flash_blocks).
      dv0 = plgpu.load(dv0_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
      dv = _cols(dv0, zeros.shape)
    dk, dv = lax.fori_loop(0, p.group, head,
                           (zeros if want_dk else None, dv if want_dv else None))
    if dq is not None:
      dq.finish()
    # dK and dV reuse the K and V tiles' shared memory (dV-only runs keep V out of it).
    finals = {"dk": lambda: (k_tile, (dk * p.scale).astype(p.dtype)),
              "dv": lambda: (k_tile if v_tile is None else v_tile, dv.astype(p.dtype))}
    _store_tiles([(*finals[g](), ref.at[keys]) for g, ref in zip(grads, out_refs)])

  @pl.when(wg == num_wgs)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
    _produce([stream], p.group * per_head, stages)


@dataclasses.dataclass(frozen=True)
class _HeadSplit:
  """What the two compute warpgroups of a head-split kernel trade each step.

  Both own the same rows (query rows in the dQ kernel, keys in the dK launch) and half
  the head dim of the accumulator each. Warpgroup 0 ("scores") computes S and P,
  warpgroup 1 ("grads") dP - delta; warpgroup 1 hands dP - delta over in float32,
  warpgroup 0 forms dS = P (dP - delta) and hands it back in the input dtype, and each
  adds dS times its half of K (dQ) or of Q (dK) to its accumulator. One tile of each
  is enough: a warpgroup writes its tile of step i + 1 only after waiting for the
  other's tile of step i + 1, which the other sends after it is done with step i.

  Attributes:
    dp_smem: float32 tile of dP - delta (rows, keys or queries).
    ds_smem: input-dtype tile of dS, the wgmma left operand of both warpgroups.
    dp_ready, ds_ready: barriers of one arrival: the tile is written.
  """

  dp_smem: Any
  ds_smem: Any
  dp_ready: Any
  ds_ready: Any

  def send_dp(self, dp_minus_delta: jax.Array) -> None:
    self.dp_smem[...] = dp_minus_delta
    # The other warpgroup reads dP with ordinary loads, which need no proxy fence; the
    # fence is there because this warpgroup's next wgmma reads shared memory through
    # the async proxy, and with a fence after every ordinary store that precedes one,
    # `make compile-h200` can check the PTX (a warpgroup barrier and a fence a step).
    plgpu.commit_smem()
    plgpu.barrier_arrive(self.dp_ready)

  def receive_dp(self) -> jax.Array:
    plgpu.barrier_wait(self.dp_ready)
    return plgpu.load(self.dp_smem, layout=plgpu.Layout.WGMMA)

  def send_ds(self, ds: jax.Array) -> Any:
    self.ds_smem[...] = ds
    plgpu.commit_smem()  # Both warpgroups' wgmma (the async proxy) read it.
    plgpu.barrier_arrive(self.ds_ready)
    return self.ds_smem

  def receive_ds(self) -> Any:
    plgpu.barrier_wait(self.ds_ready)
    return self.ds_smem


def _head_split_scratch(p: _Problem, rows: int, cols: int) -> dict[str, Any]:
  """Shared memory and barriers of _HeadSplit for (rows, cols) tiles."""
  return dict(dp_smem=plgpu.SMEM((rows, cols), jnp.float32, transforms=_tiled(jnp.float32, cols)),
              ds_smem=plgpu.SMEM((rows, cols), p.dtype, transforms=_tiled(p.dtype, cols)),
              dp_ready=_barrier(1), ds_ready=_barrier(1))


def _dq_head_split_kernel(*refs, q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring,
                          pair_ring, rows_ready, k_ready, v_ready, k_free, v_free, dp_smem,
                          ds_smem, dp_ready, ds_ready, p: _Problem,
                          c: PallasMosaicGpuAttentionVjpConfig, mma: _Mma):
  """dQ of one query tile of one head, its head dim split between two warpgroups."""
  (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, pair_ref, q_len_ref, kv_len_ref,
   dq_ref) = unpack_refs(refs, (True,) * 6 + (p.has_pair, p.has_q_len, p.has_kv_len, True))
  bq, bk, stages = c.block_q_dq, c.block_kv_dq, c.num_stages
  half = p.head_dim // 2
  # Both compute warpgroups own the CTA's rows: its blocks are theirs, none is skipped.
  cta, k_stream, v_stream = _query_tile_cta(
      p, q_ref, k_ref, v_ref, pair_ref, (q_len_ref, kv_len_ref), num_wgs=1, bq=bq, bk=bk,
      k_ring=k_ring, v_ring=v_ring, pair_ring=pair_ring, k_ready=k_ready, v_ready=v_ready,
      k_free=k_free, v_free=v_free, copies=_halves)
  b, h, wg, q0 = cta.b, cta.head, cta.wg, cta.start
  trade = _HeadSplit(dp_smem, ds_smem, dp_ready, ds_ready)
  rows = (b, pl.ds(q0, bq), h)
  ranges = flash_blocks.key_block_range(p, q0, bq, bk, cta.t_eff, cta.s_eff)

  def skip(kb, _):
    slot = cta.slot(kb, stages)
    for stream in (k_stream, v_stream):
      stream.acquire(slot)
      stream.release(slot)

  def run(tile_ref, tile, vec_ref, vec, step):
    plgpu.set_max_registers(_COMPUTE_REGISTERS[2], action="increase")
    for src, dst in (*_halves(tile_ref, rows, tile),
                     (vec_ref.at[b, h, pl.ds(q0, bq)], vec)):
      plgpu.copy_gmem_to_smem(src, dst, rows_ready.at[wg])
    plgpu.barrier_wait(rows_ready.at[wg])
    vector = plgpu.load(vec, layout=plgpu.Layout.WGMMA.reduce(1))
    dq = _walk(ranges, cta.lo, cta.hi, functools.partial(step, vector=vector), skip,
               _zeros((bq, half)), masked_head=p.left_reach is not None)
    # Out through this warpgroup's own half tile (the other never reads it).
    cols = pl.ds(wg * half, half)
    _store_tiles([(tile.at[wg], (dq * p.scale).astype(p.dtype), dq_ref.at[(*rows, cols)])])

  def scores(kb, dq, masked, vector):
    slot = cta.slot(kb, stages)
    k_stream.acquire(slot)
    s = mma.product_sum([(q_smem.at[j], k_ring.at[j, slot].T) for j in range(2)], (bq, bk))
    s = _add_pair(p, s * (p.scale * _LOG2E), pair_ring, slot, 0)
    probs = jnp.exp2(s - _rows(vector, s.shape))  # vector: lse2 (+inf: no gradient)
    if masked:
      probs = jnp.where(_kept(p, (bq, bk), q0, kb * bk, cta.s_eff, rows_are_queries=True),
                        probs, 0.0)
    ds_tile = trade.send_ds((probs * trade.receive_dp()).astype(p.dtype))
    v_stream.acquire(slot)  # Not read here; freed for the memory warpgroup's count.
    v_stream.release(slot)
    dq = mma.accumulate(dq, ds_tile, k_ring.at[wg, slot])  # wg: this one's half
    k_stream.release(slot, after_loads=p.has_pair)
    return dq

  def grads(kb, dq, masked, vector):
    del masked  # dS is zero where P is.
    slot = cta.slot(kb, stages)
    v_stream.acquire(slot)
    dp = mma.product_sum([(do_smem.at[j], v_ring.at[j, slot].T) for j in range(2)], (bq, bk))
    v_stream.release(slot)
    trade.send_dp(dp - _rows(vector, dp.shape))  # vector: delta
    ds_tile = trade.receive_ds()
    k_stream.acquire(slot)
    dq = mma.accumulate(dq, ds_tile, k_ring.at[wg, slot])
    k_stream.release(slot)
    return dq

  pl.when(wg == 0)(lambda: run(q_ref, q_smem, lse2_ref, lse_smem, scores))
  pl.when(wg == 1)(lambda: run(do_ref, do_smem, delta_ref, delta_smem, grads))

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
    _produce([k_stream, v_stream], cta.hi - cta.lo, stages)


def _dk_head_split_kernel(*refs, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring,
                          pair_ring, kv_ready, ready, free, dp_smem, ds_smem, dp_ready,
                          ds_ready, p: _Problem, c: PallasMosaicGpuAttentionVjpConfig,
                          mma: _Mma):
  """dK of one key tile, summed over the group, its head dim split between two
  warpgroups (the dK launch of a split backward)."""
  (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, pair_t_ref, q_len_ref, kv_len_ref,
   dk_ref) = unpack_refs(refs, (True,) * 6 + (p.has_pair, p.has_q_len, p.has_kv_len, True))
  bq, bk, stages = c.block_q_dkv, c.block_kv_dkv, c.num_stages
  half = p.head_dim // 2
  b, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  t_eff, s_eff = _lengths(p, q_len_ref, kv_len_ref, b)
  k0 = lax.axis_index("kv_tiles") * bk
  lo, full_lo, full_hi, hi = flash_blocks.query_block_range(p, k0, bq, bk, t_eff, s_eff)
  per_head = hi - lo
  trade = _HeadSplit(dp_smem, ds_smem, dp_ready, ds_ready)
  keys = (b, pl.ds(k0, bk), kv_head)

  tiles = dict(q=(q_ref, q_ring), do=(do_ref, do_ring), lse=(lse2_ref, lse_ring),
               delta=(delta_ref, delta_ring))
  if pair_t_ref is not None:
    tiles["pair"] = (pair_t_ref, pair_ring)
  stream = _query_block_stream(p, tiles, ready, free, b=b, kv_head=kv_head, lo=lo,
                               per_head=per_head, bq=bq, keys=pl.ds(k0, bk), copies=_halves)

  def skip(i, _):  # Not reached: both warpgroups own the CTA's keys and blocks.
    stream.acquire(lax.rem(i, stages))
    stream.release(lax.rem(i, stages))

  def run(tile_ref, tile, step):
    plgpu.set_max_registers(_COMPUTE_REGISTERS[2], action="increase")
    for src, dst in _halves(tile_ref, keys, tile):
      plgpu.copy_gmem_to_smem(src, dst, kv_ready.at[wg])
    plgpu.barrier_wait(kv_ready.at[wg])

    def head(g, dk):
      base = g * per_head - lo  # Step of query block j of this head: base + j.
      shifted = tuple(base + r for r in (lo, full_lo, full_hi, hi))
      return _walk(shifted, base + lo, base + hi, functools.partial(step, base=base), skip,
                   dk, masked_head=p.right_reach is not None)

    dk = lax.fori_loop(0, p.group, head, _zeros((bk, half)))
    # Out through this warpgroup's own half tile of K or V (the other never reads it).
    cols = pl.ds(wg * half, half)
    _store_tiles([(tile.at[wg], (dk * p.scale).astype(p.dtype), dk_ref.at[(*keys, cols)])])

  def scores(i, dk, base, masked):
    slot = lax.rem(i, stages)
    stream.acquire(slot)
    s_t = mma.product_sum([(k_smem.at[j], q_ring.at[j, slot].T) for j in range(2)], (bk, bq))
    s_t = _add_pair(p, s_t * (p.scale * _LOG2E), pair_ring, slot, 0, rows_are_queries=False)
    lse2 = plgpu.load(lse_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    p_t = jnp.exp2(s_t - _cols(lse2, s_t.shape))
    if masked:
      keep = _kept(p, (bk, bq), k0, (i - base) * bq, s_eff, rows_are_queries=False)
      p_t = jnp.where(keep, p_t, 0.0)
    ds_tile = trade.send_ds((p_t * trade.receive_dp()).astype(p.dtype))
    dk = mma.accumulate(dk, ds_tile, q_ring.at[wg, slot])  # wg: this one's half
    stream.release(slot, after_loads=True)  # lse (and bias/mask) were loaded
    return dk

  def grads(i, dk, base, masked):
    del base, masked  # dS is zero where P is.
    slot = lax.rem(i, stages)
    stream.acquire(slot)
    dp_t = mma.product_sum([(v_smem.at[j], do_ring.at[j, slot].T) for j in range(2)], (bk, bq))
    delta = plgpu.load(delta_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    trade.send_dp(dp_t - _cols(delta, dp_t.shape))
    dk = mma.accumulate(dk, trade.receive_ds(), q_ring.at[wg, slot])
    stream.release(slot, after_loads=True)  # delta was loaded
    return dk

  pl.when(wg == 0)(lambda: run(k_ref, k_smem, scores))
  pl.when(wg == 1)(lambda: run(v_ref, v_smem, grads))

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
    _produce([stream], p.group * per_head, stages)


def _dq_head_split_call(q, k, v, do, lse2, delta, pair, lengths, *, p: _Problem,
                        c: PallasMosaicGpuAttentionVjpConfig, interpret: Interpret):
  b, t_pad, n, h = q.shape
  bq, bk, stages = c.block_q_dq, c.block_kv_dq, c.num_stages
  rows_tile = plgpu.SMEM((2, bq, h // 2), p.dtype, transforms=_tiled(p.dtype, h // 2))
  ring = plgpu.SMEM((2, stages, bk, h // 2), p.dtype, transforms=_tiled(p.dtype, h // 2))
  scratch = dict(
      q_smem=rows_tile, do_smem=rows_tile, lse_smem=plgpu.SMEM((bq,), jnp.float32),
      delta_smem=plgpu.SMEM((bq,), jnp.float32), k_ring=ring, v_ring=ring,
      pair_ring=_pair_ring(p, stages, bq, bk, keys=bk),
      rows_ready=_barrier(2, 3),  # two halves and a vector each
      k_ready=_barrier(stages, 2 + p.has_pair), v_ready=_barrier(stages, 2),
      k_free=_barrier(stages, 2), v_free=_barrier(stages, 2),
      **_head_split_scratch(p, bq, bk),
  )
  return _kernel(_dq_head_split_kernel, p=p, c=c, out_type=jax.ShapeDtypeStruct(q.shape, p.dtype),
                 scratch=scratch, grid=(n, b, t_pad // bq), tiles="q_tiles", num_compute_wgs=2,
                 name="bwd_dq_split", interpret=interpret,
                 )(q, k, v, do, lse2, delta, *([pair] if p.has_pair else []), *lengths)


def _dk_head_split_call(q, k, v, do, lse2, delta, pair_t, lengths, *, p: _Problem,
                        c: PallasMosaicGpuAttentionVjpConfig, interpret: Interpret):
  b, t_pad, _, h = q.shape
  s_pad, kh = k.shape[1], k.shape[2]
  bq, bk, stages = c.block_q_dkv, c.block_kv_dkv, c.num_stages
  keys_tile = plgpu.SMEM((2, bk, h // 2), p.dtype, transforms=_tiled(p.dtype, h // 2))
  ring = plgpu.SMEM((2, stages, bq, h // 2), p.dtype, transforms=_tiled(p.dtype, h // 2))
  vec_ring = plgpu.SMEM((stages, bq), jnp.float32)
  scratch = dict(
      k_smem=keys_tile, v_smem=keys_tile, q_ring=ring, do_ring=ring, lse_ring=vec_ring,
      delta_ring=vec_ring, pair_ring=_pair_ring(p, stages, bk, bq, keys=bk),
      kv_ready=_barrier(2, 2),  # two halves of K (warpgroup 0) or V (warpgroup 1)
      ready=_barrier(stages, 6 + p.has_pair), free=_barrier(stages, 2),
      **_head_split_scratch(p, bk, bq),
  )
  return _kernel(_dk_head_split_kernel, p=p, c=c, out_type=jax.ShapeDtypeStruct(k.shape, p.dtype),
                 scratch=scratch, grid=(kh, b, s_pad // bk), tiles="kv_tiles", num_compute_wgs=2,
                 name="bwd_dk_split", interpret=interpret,
                 )(q, k, v, do, lse2, delta, *([pair_t] if p.has_pair else []), *lengths)


def _dq_call(q, k, v, do, lse2, delta, pair, lengths, *, p: _Problem,
             c: PallasMosaicGpuAttentionVjpConfig, interpret: Interpret):
  b, t_pad, n, h = q.shape
  num_wgs, bq, bk, stages = c.num_compute_wgs, c.block_q_dq, c.block_kv_dq, c.num_stages
  rows_tile = plgpu.SMEM((num_wgs, bq, h), p.dtype, transforms=_tiled(p.dtype, h))
  ring = plgpu.SMEM((stages, bk, h), p.dtype, transforms=_tiled(p.dtype, h))
  scratch = dict(
      q_smem=rows_tile, do_smem=rows_tile,
      lse_smem=plgpu.SMEM((num_wgs, bq), jnp.float32),
      delta_smem=plgpu.SMEM((num_wgs, bq), jnp.float32),
      k_ring=ring, v_ring=ring, pair_ring=_pair_ring(p, stages, num_wgs * bq, bk, keys=bk),
      stage=(plgpu.SMEM((num_wgs, bq, bk), p.dtype, transforms=_tiled(p.dtype, bk))
             if interpret else None),
      rows_ready=_barrier(num_wgs, 4),
      k_ready=_barrier(stages, 1 + p.has_pair), v_ready=_barrier(stages),
      k_free=_barrier(stages, num_wgs), v_free=_barrier(stages, num_wgs),
  )
  return _kernel(_dq_kernel, p=p, c=c, out_type=jax.ShapeDtypeStruct(q.shape, p.dtype),
                 scratch=scratch, grid=(n, b, t_pad // (num_wgs * bq)), tiles="q_tiles",
                 num_compute_wgs=num_wgs, name="bwd_dq", interpret=interpret,
                 )(q, k, v, do, lse2, delta, *([pair] if p.has_pair else []), *lengths)


def _dkdv_call(q, k, v, do, lse2, delta, pair_t, lengths, dv0, dq_acc=None, *,
               grads: tuple[str, ...], p: _Problem, c: PallasMosaicGpuAttentionVjpConfig,
               interpret: Interpret):
  """dK and/or dV (`grads`); with `dq_acc` (a float32 Ref, see _FusedDq) also dQ's sums.

  Returns:
    {"dk": ..., "dv": ...} for `grads`, padded like k and v.
  """
  b, t_pad, _, h = q.shape
  s_pad, kh = k.shape[1], k.shape[2]
  num_wgs, bq, bk, stages = c.num_compute_wgs, c.block_q_dkv, c.block_kv_dkv, c.num_stages
  keys_tile = plgpu.SMEM((num_wgs, bk, h), p.dtype, transforms=_tiled(p.dtype, h))
  ring = plgpu.SMEM((stages, bq, h), p.dtype, transforms=_tiled(p.dtype, h))
  vec_ring = plgpu.SMEM((stages, bq), jnp.float32)
  want_dk = "dk" in grads
  with_dv0 = "dv" in grads and dv0 is not None
  fused_dq = dq_acc is not None
  if fused_dq and not want_dk:
    raise ValueError("dQ sums are fused into the launch that computes dK (it has dS).")
  scratch = dict(
      k_smem=keys_tile, v_smem=keys_tile if want_dk else None,
      dv0_smem=plgpu.SMEM((num_wgs, h), jnp.float32) if with_dv0 else None,
      q_ring=ring, do_ring=ring, lse_ring=vec_ring, delta_ring=vec_ring if want_dk else None,
      pair_ring=_pair_ring(p, stages, num_wgs * bk, bq, keys=num_wgs * bk),
      stage=(plgpu.SMEM((num_wgs, bk, bq), p.dtype, transforms=_tiled(p.dtype, bq))
             if interpret else None),
      kv_ready=_barrier(num_wgs, 1 + want_dk + with_dv0),
      ready=_barrier(stages, 3 + want_dk + p.has_pair),
      free=_barrier(stages, num_wgs),
      ds_smem=(plgpu.SMEM((2, num_wgs, bk, bq), p.dtype, transforms=_tiled(p.dtype, bq))
               if fused_dq else None),
      dq_staging=(plgpu.SMEM((num_wgs, _dq_staging_slots(h, num_wgs), bq, _DQ_CHUNK),
                             jnp.float32, transforms=_tiled(jnp.float32, _DQ_CHUNK))
                  if fused_dq else None),
      ds_ready=_barrier(1, num_wgs) if fused_dq and num_wgs > 1 else None,
  )
  out_type = {"dk": jax.ShapeDtypeStruct(k.shape, p.dtype),
              "dv": jax.ShapeDtypeStruct(v.shape, p.dtype)}
  outs = _kernel(
      _dkdv_kernel, p=p, c=c, out_type=[out_type[g] for g in grads], scratch=scratch,
      grid=(kh, b, s_pad // (num_wgs * bk)), tiles="kv_tiles", num_compute_wgs=num_wgs,
      name="bwd_" + "".join(grads), interpret=interpret, grads=grads, fused_dq=fused_dq,
  )(q, k, v, do, lse2, delta, *([pair_t] if p.has_pair else []), *lengths,
    *([dv0] if with_dv0 else []), *([dq_acc] if fused_dq else []))
  return dict(zip(grads, outs))


@functools.partial(jax.jit, static_argnames=("p", "c", "interpret"))
def _bwd(query, key, value, bias, mask, out, lse, dout, q_len, kv_len, *, p: _Problem,
         c: PallasMosaicGpuAttentionVjpConfig, interpret: Interpret):
  # An elementwise product and sum, not a dot: exact float32 (no TF32) on every backend.
  delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  delta = delta.transpose(0, 2, 1)
  # Rows and keys are padded to whole CTA tiles of each kernel that runs.
  dq_kernel_rows, dq_kernel_keys = (
      (1, 1) if c.fuse_dq
      else (c.block_q_dq if c.head_split else c.num_compute_wgs * c.block_q_dq,
            c.block_kv_dq))
  t_pad = _round_up(p.t, math.lcm(dq_kernel_rows, c.block_q_dkv))
  s_pad = _round_up(p.s, math.lcm(c.num_compute_wgs * c.block_kv_dkv, dq_kernel_keys))
  # lse = +inf gives probability 0 for every key: rows past the query length and rows
  # that keep no key add nothing to dQ/dK/dV through the kernels (the latter add their
  # dV term through dv0), nor do padded rows.
  lse2 = jnp.where(flash_blocks.dead_rows(lse, q_len), jnp.inf, lse * _LOG2E)
  lse2 = _pad_seq(lse2, t_pad, jnp.inf, axis=2)
  delta = _pad_seq(delta, t_pad, axis=2)
  q, do = _pad_seq(query, t_pad), _pad_seq(dout, t_pad)
  k, v = _pad_seq(key, s_pad), _pad_seq(value, s_pad)
  args = (q, k, v, do, lse2, delta)
  lengths = _lengths_args(p, q_len, kv_len)
  dv0 = None
  if p.may_fully_mask:
    dv0 = flash_blocks.fully_masked_dv(lse, dout, q_len, num_kv_heads=p.num_kv_heads, s=p.s)
  pair = _pair_operand(bias, mask, p, t_pad, s_pad)
  pair_t = pair if p.pair_per_key else _pair_operand(bias, mask, p, t_pad, s_pad,
                                                     transposed=True)
  parts = (("dv",), ("dk",)) if c.split_dkdv else (("dk", "dv"),)
  if c.fuse_dq:
    dq_sums, grads = _launch_fused_dq(args, pair_t, lengths, dv0, parts, p=p, c=c,
                                      interpret=interpret)
    dq = (dq_sums * p.scale).astype(p.dtype)
  elif c.head_split:
    dq = _dq_head_split_call(*args, pair, lengths, p=p, c=c, interpret=interpret)
    grads = _dkdv_call(*args, pair_t, lengths, dv0, grads=("dv",), p=p, c=c,
                       interpret=interpret)
    grads["dk"] = _dk_head_split_call(*args, pair_t, lengths, p=p, c=c, interpret=interpret)
  else:
    dq = _dq_call(*args, pair, lengths, p=p, c=c, interpret=interpret)
    grads = {}
    for part in parts:
      grads.update(_dkdv_call(*args, pair_t, lengths, dv0, grads=part, p=p, c=c,
                              interpret=interpret))
  return dq[:, :p.t], grads["dk"][:, :p.s], grads["dv"][:, :p.s]


def _launch_fused_dq(args, pair_t, lengths, dv0, parts, *, p: _Problem,
                     c: PallasMosaicGpuAttentionVjpConfig, interpret: Interpret):
  """The dK/dV launches (`parts`), the dK one also summing dQ (see _FusedDq).

  Returns:
    (dQ's float32 sums (B, T_pad, N, H), unscaled; {"dk": ..., "dv": ...}).
  """
  q, k, v = args[:3]
  # Zeros the dK launch adds dQ's float32 sums to: one buffer on the GPU (TMA
  # reduce-add), one slice per key tile of CTAs in the interpreter.
  num_kv_ctas = k.shape[1] // (c.num_compute_wgs * c.block_kv_dkv)
  slices = (num_kv_ctas,) if interpret else ()

  def launches(refs):
    # The kernel adds to the buffer as a Ref (an aliased operand). run_state keeps that
    # effect inside this function, away from the transformations around the op (which
    # have no rule for it); dK and dV leave it as Refs too (their initial values, k and
    # v, are never read).
    dq_acc, out_refs = refs
    for part in parts:
      outs = _dkdv_call(*args, pair_t, lengths, dv0, dq_acc if "dk" in part else None,
                        grads=part, p=p, c=c, interpret=interpret)
      for name, value in outs.items():
        out_refs[name][...] = value

  sums, grads = pl.run_state(launches)(
      (jnp.zeros((*slices, *q.shape), jnp.float32), {"dk": k, "dv": v}))
  return (jnp.sum(sums, axis=0) if interpret else sums), grads


def _check_residuals(query, out, lse, dout) -> None:
  b, t, n, _ = query.shape
  for name, x in (("out", out), ("dout", dout)):
    if tuple(x.shape) != tuple(query.shape) or x.dtype != query.dtype:
      raise ValueError(f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}; expected"
                       f" query's {tuple(query.shape)} {query.dtype}.")
  if tuple(lse.shape) != (b, n, t) or lse.dtype != jnp.float32:
    raise ValueError(f"lse has shape {tuple(lse.shape)} and dtype {lse.dtype}; expected"
                     f" ({b}, {n}, {t}) float32 as returned by"
                     f" attention_fwd_pallas_mosaic_gpu.")


def attention_bwd_pallas_mosaic_gpu(query, key, value, bias, mask, out, lse, dout, *,
                                    scale: float | None = None, is_causal: bool = False,
                                    query_seq_lengths=None, key_value_seq_lengths=None,
                                    local_window_size=None, block_q_dkv: int,
                                    block_kv_dkv: int, block_q_dq: int, block_kv_dq: int,
                                    num_compute_wgs: int, num_stages: int, split_dkdv: bool,
                                    fuse_dq: bool = False, head_split: bool = False,
                                    overlap_softmax: bool = False,
                                    interpret: Interpret = False):
  """Flash attention backward for attention_fwd_pallas_mosaic_gpu.

  Gradients match jax.vjp of jax.nn.dot_product_attention, rows that keep no key
  (mean(V) in the forward: dout / S to every dV row) and rows past the query length
  (no gradient) included. bias is held constant: no bias gradient is returned (the op
  class gets it from XLA's derivative).

  Args:
    query, key, value, bias, mask: the forward's inputs (bias and mask may be None).
    out, lse: the forward's outputs.
    dout: cotangent of out, (B, T, N, H) in query's dtype.
    scale, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size: the
      forward's options.
    block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq, num_compute_wgs, num_stages,
      split_dkdv, fuse_dq, head_split, overlap_softmax: tunables, see
      check_bwd_tunables.
    interpret: as in the forward.

  Returns:
    (dquery, dkey, dvalue) in the dtypes and shapes of query, key and value.

  Raises:
    ValueError: for unsupported shapes, dtypes, options or tunables.
  """
  c = PallasMosaicGpuAttentionVjpConfig(
      block_q_dkv=block_q_dkv, block_kv_dkv=block_kv_dkv, block_q_dq=block_q_dq,
      block_kv_dq=block_kv_dq, num_compute_wgs=num_compute_wgs, num_stages=num_stages,
      split_dkdv=split_dkdv, fuse_dq=fuse_dq, head_split=head_split,
      overlap_softmax=overlap_softmax)
  p = _make_problem(query, key, value, scale, is_causal, local_window_size,
                    query_seq_lengths, key_value_seq_lengths, bias, mask)
  _check_residuals(query, out, lse, dout)
  args = (query, key, value, bias, mask, out, lse, dout, query_seq_lengths,
          key_value_seq_lengths)
  return _bwd_batchable(args, p=p, c=c, interpret=_as_interpret(interpret))


def _bwd_batchable(args: tuple[Any, ...], *, p: _Problem, c: PallasMosaicGpuAttentionVjpConfig,
                   interpret: Interpret):
  """_bwd(*args); under jax.vmap a fused-dQ config runs as the separate dQ kernel: the
  fused launch adds to a Ref inside run_state, which has no batching rule, while the
  separate kernels batch as one more grid dimension (same gradients, other rounding)."""
  if not c.fuse_dq:
    return _bwd(*args, p=p, c=c, interpret=interpret)

  @jax.custom_batching.custom_vmap
  def fused(*args):
    return _bwd(*args, p=p, c=c, interpret=interpret)

  @fused.def_vmap
  def _separate_when_batched(axis_size, in_batched, *args):
    del axis_size
    separate = functools.partial(_bwd, p=p, c=dataclasses.replace(c, fuse_dq=False),
                                 interpret=interpret)
    in_axes = tuple(jax.tree.map(lambda batched: 0 if batched else None, in_batched))
    grads = jax.vmap(separate, in_axes=in_axes)(*args)
    return grads, (True, True, True)

  return fused(*args)


# --------------------------------------------------------------------------------------
# Resource estimates, heuristics and search spaces (sm_90: H100/H200)
# --------------------------------------------------------------------------------------


def _tile_regs(rows: int, cols: int, itemsize: int = 4) -> int:
  """Registers per thread of a (rows, cols) tile spread over one warpgroup."""
  return rows * cols * itemsize // (4 * 128)


def _fits(smem: int, regs: int, num_wgs: int) -> bool:
  return smem <= _SMEM_LIMIT_BYTES and regs + _REGISTER_OVERHEAD <= _COMPUTE_REGISTERS[num_wgs]


def _fwd_fits(h: int, e: int, c: dict[str, Any], pe: int = 0) -> bool:
  """Whether a forward config fits an sm_90 SM; pe: bytes per bias/mask element (0: none)."""
  bq, bk, wgs = c["block_q"], c["block_kv"], c["num_compute_wgs"]
  smem = wgs * bq * (h * e + 4) + c["num_stages"] * bk * (2 * h * e + wgs * bq * pe)
  # Accumulator, logits and the 16-bit probabilities are live together; overlapping the
  # softmax with P V keeps the previous block's probabilities too.
  probs = 2 if c.get("overlap_softmax", False) else 1
  regs = _tile_regs(bq, h) + _tile_regs(bq, bk) + probs * _tile_regs(bq, bk, e)
  return _fits(smem, regs, wgs)


def _bwd_fits(h: int, e: int, c: dict[str, Any], pe: int = 0) -> bool:
  """Whether a backward config fits an sm_90 SM; pe: bytes per bias/mask element (0: none)."""
  if c.get("head_split", False):
    return _head_split_fits(h, e, c, pe)
  wgs, stages = c["num_compute_wgs"], c["num_stages"]
  bq, bk = c["block_q_dkv"], c["block_kv_dkv"]
  dkdv_smem = wgs * 2 * bk * h * e + stages * bq * (2 * h * e + 8 + wgs * bk * pe)
  accumulators = 1 if c["split_dkdv"] else 2
  # Peak live tiles: the accumulators with P^T and dP^T (dS^T and the 16-bit operands
  # replace them), in the dQ kernel the accumulator with P and dP.
  dkdv_regs = accumulators * _tile_regs(bk, h) + 2 * _tile_regs(bk, bq)
  if c.get("fuse_dq", False):
    # Double-buffered dS^T tiles and the float32 staging of the reduce-adds; a dQ
    # chunk's accumulator on top. Checked against ptxas (bench/compile_h200.py): head
    # dim 128 with both dK and dV accumulators spills 0.2-0.7 KB, which this rejects;
    # split (dK alone) or head dim 64 spill at most 16 B.
    dkdv_smem += 2 * wgs * bk * bq * e + wgs * _dq_staging_slots(h, wgs) * bq * _DQ_CHUNK * 4
    dkdv_regs += _tile_regs(bq, _DQ_CHUNK)
    return _fits(dkdv_smem, dkdv_regs, wgs)  # The dQ kernel does not run.
  bq2, bk2 = c["block_q_dq"], c["block_kv_dq"]
  dq_smem = wgs * bq2 * (2 * h * e + 8) + stages * bk2 * (2 * h * e + wgs * bq2 * pe)
  dq_regs = _tile_regs(bq2, h) + 2 * _tile_regs(bq2, bk2)
  if c.get("overlap_softmax", False):
    # The previous block's 16-bit dS (the running wgmma reads it) and the next one's in
    # float32. Checked against ptxas: head dim 64 with 128-key blocks and two
    # warpgroups spilled 24 B (inside the loop) without the float32 tile counted.
    dq_regs += _tile_regs(bq2, bk2, e) + _tile_regs(bq2, bk2)
  return _fits(dkdv_smem, dkdv_regs, wgs) and _fits(dq_smem, dq_regs, wgs)


def _head_split_fits(h: int, e: int, c: dict[str, Any], pe: int) -> bool:
  """Whether a head-split backward fits: the dV launch (the dK/dV kernel keeping no V
  tiles), and the dK and dQ kernels, whose two warpgroups share the rows, hold half the
  head dim each and trade a float32 dP and a dS tile."""
  stages = c["num_stages"]
  bq, bk, bq2, bk2 = c["block_q_dkv"], c["block_kv_dkv"], c["block_q_dq"], c["block_kv_dq"]
  if (bq, bk, bq2, bk2) != (64, 64, 64, 64):
    # Checked against ptxas (bench/compile_h200.py): 64-row and -column blocks do not
    # spill at head dims 128 and 256; 128-row dQ blocks spilled 212 B, though this
    # estimate lets them through.
    return False
  trade = lambda rows, cols: rows * cols * (4 + e)
  dv = (2 * bk * h * e + stages * bq * (2 * h * e + 8 + 2 * bk * pe),
        _tile_regs(bk, h) + 2 * _tile_regs(bk, bq))
  dk = (2 * bk * h * e + stages * bq * (2 * h * e + 8 + bk * pe) + trade(bk, bq),
        _tile_regs(bk, h // 2) + 2 * _tile_regs(bk, bq))
  dq = (bq2 * (2 * h * e + 8) + stages * bk2 * (2 * h * e + bq2 * pe) + trade(bq2, bk2),
        _tile_regs(bq2, h // 2) + 2 * _tile_regs(bq2, bk2))
  return all(_fits(smem, regs, 2) for smem, regs in (dv, dk, dq))


def _problem_of(query: Any, key: Any) -> tuple[int, int, int, int]:
  """(T, S, H, bytes per element) of query/key arrays or ShapeDtypeStructs."""
  _, t, _, h = query.shape
  if h not in SUPPORTED_HEAD_DIMS or jnp.dtype(query.dtype) not in SUPPORTED_DTYPES:
    raise ValueError(f"head dim {h} / dtype {query.dtype} unsupported; expected H in"
                     f" {SUPPORTED_HEAD_DIMS} and dtype in {[str(d) for d in SUPPORTED_DTYPES]}.")
  return t, key.shape[1], h, jnp.dtype(query.dtype).itemsize


def _fit_rows(block: int, wgs: int, length: int) -> tuple[int, int]:
  """Shrinks (rows per warpgroup, warpgroups) so a CTA is not much longer than `length`."""
  cap = _round_up(length, 64)
  block = min(block, cap)
  return (block, wgs) if block * wgs <= cap else (block, 1)


def _clamp_fwd(c: dict[str, Any], t: int, s: int) -> dict[str, Any]:
  bq, wgs = _fit_rows(c["block_q"], c["num_compute_wgs"], t)
  return {**c, "block_q": bq, "num_compute_wgs": wgs,
          "schedule_barrier": c["schedule_barrier"] and wgs == 2,
          "block_kv": min(c["block_kv"], _round_up(s, 64))}


def _clamp_bwd(c: dict[str, Any], t: int, s: int) -> dict[str, Any]:
  # Head-split warpgroups share their rows: a CTA is one block long whatever their number.
  wgs = 1 if c.get("head_split", False) else c["num_compute_wgs"]
  bq_dq, wgs_q = _fit_rows(c["block_q_dq"], wgs, t)
  bk_dkv, wgs_k = _fit_rows(c["block_kv_dkv"], wgs, s)
  return {**c, "block_q_dq": bq_dq, "block_kv_dkv": bk_dkv,
          "num_compute_wgs": c["num_compute_wgs"] if c.get("head_split") else min(wgs_q, wgs_k),
          "block_q_dkv": min(c["block_q_dkv"], _round_up(t, 64)),
          "block_kv_dq": min(c["block_kv_dq"], _round_up(s, 64))}


def _first_fitting(candidates: Sequence[dict[str, Any]], fits: Callable[[dict], bool]):
  """The first candidate config that fits (the last is small enough for any problem)."""
  return next((c for c in candidates if fits(c)), candidates[-1])


def _fwd_heuristic(t: int, s: int, h: int, e: int = 2, pe: int = 0) -> dict[str, Any]:
  # Two ping-ponging warpgroups of 64 rows; the key block is the largest whose
  # logits, probabilities and accumulator stay in registers, with K/V double-buffered.
  # Bias/mask tiles take shared memory: then smaller key blocks, or one warpgroup.
  # The softmax overlaps P V (FlashAttention-3's ablation on an H100, head dim 128:
  # 661 TFLOP/s with it, 582 without; the H200 has not timed ours yet). ptxas compiles
  # these configs without serialized wgmma and without spills inside loops
  # (bench/compile_h200.py: head dim 256 with a window and key lengths spills 8 B, all
  # outside the loops).
  bk, stages = {64: (128, 3), 128: (128, 2), 256: (64, 2)}[h]
  c = dict(block_q=64, block_kv=bk, num_compute_wgs=2, num_stages=stages,
           schedule_barrier=True, overlap_softmax=True)
  small = dict(block_q=64, block_kv=64, num_compute_wgs=1, num_stages=2,
               schedule_barrier=False, overlap_softmax=True)
  c = _first_fitting([c, {**c, "block_kv": 64, "num_stages": 2}, small],
                     lambda c: _fwd_fits(h, e, c, pe))
  return _clamp_fwd(c, t, s)


def _bwd_heuristic(t: int, s: int, h: int, e: int = 2, pe: int = 0) -> dict[str, Any]:
  if h == 256:
    # A 64 x 256 float32 accumulator and the S and dP tiles spilled 0.6 KB a thread in
    # one warpgroup (bench/compile_h200.py): split dK from dV, and split the dQ and dK
    # accumulators' head dim between two warpgroups (none spills).
    c = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
             num_compute_wgs=2, num_stages=2, split_dkdv=True, fuse_dq=False,
             head_split=True, overlap_softmax=False)
  else:
    # The separate dQ kernel (bitwise reproducible) until the H200 has measured the
    # fused one, which the search space offers (see check_bwd_tunables).
    c = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
             block_kv_dq=128 if h == 64 else 64, num_compute_wgs=2, num_stages=2,
             split_dkdv=False, fuse_dq=False, head_split=False, overlap_softmax=False)
  small = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
               num_compute_wgs=1, num_stages=2, split_dkdv=True, fuse_dq=False,
               head_split=False, overlap_softmax=False)
  c = _first_fitting([c, small], lambda c: _bwd_fits(h, e, c, pe))
  return _clamp_bwd(c, t, s)


def heuristic_tunables(query: Any, key: Any, *, backward: bool = False,
                       with_pair: bool = False) -> dict[str, Any]:
  """Returns a good config for attention_{fwd,bwd}_pallas_mosaic_gpu without measuring.

  Args:
    query: (B, T, N, H) array or jax.ShapeDtypeStruct.
    key: (B, S, K, H) array or jax.ShapeDtypeStruct.
    backward: config for the backward.
    with_pair: the call has a bias or mask that varies over query rows (their
      (query, key) tiles take shared memory).

  Returns:
    Keyword arguments for the matching wrapper; they pass check_{fwd,bwd}_tunables.

  Raises:
    ValueError: if the head dim or dtype is unsupported.
  """
  t, s, h, e = _problem_of(query, key)
  pe = e if with_pair else 0
  return _bwd_heuristic(t, s, h, e, pe) if backward else _fwd_heuristic(t, s, h, e, pe)


def _unique(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  seen, out = set(), []
  for c in configs:
    key = tuple(sorted(c.items()))
    if key not in seen:
      seen.add(key)
      out.append(c)
  return out


def _fwd_space(t: int, s: int, h: int, e: int, pe: int) -> list[dict[str, Any]]:
  configs = [_fwd_heuristic(t, s, h, e, pe)]
  for bq, bk, wgs, stages in itertools.product(_BLOCK_Q_CHOICES, _FWD_SPACE_BLOCK_KV,
                                               _NUM_COMPUTE_WGS_CHOICES, (2, 3, 4)):
    for sched, overlap in itertools.product((False, True) if wgs == 2 else (False,),
                                            (False, True)):
      c = dict(block_q=bq, block_kv=bk, num_compute_wgs=wgs, num_stages=stages,
               schedule_barrier=sched, overlap_softmax=overlap)
      if _fwd_fits(h, e, c, pe):
        configs.append(_clamp_fwd(c, t, s))
  return _unique(configs)


def _bwd_space(t: int, s: int, h: int, e: int, pe: int) -> list[dict[str, Any]]:
  configs = [_bwd_heuristic(t, s, h, e, pe)]
  dkdv_tiles = ((64, 64), (128, 64), (64, 128))  # (block_q_dkv, block_kv_dkv)
  dq_tiles = ((64, 64), (64, 128), (128, 64))  # (block_q_dq, block_kv_dq)
  for (bq, bk), dq_tile, wgs, stages in itertools.product(
      dkdv_tiles, (*dq_tiles, "fused"), _NUM_COMPUTE_WGS_CHOICES, (2, 3)):
    # A fused dQ has no dQ kernel: its blocks stay at the smallest, not varied.
    bq2, bk2 = (64, 64) if dq_tile == "fused" else dq_tile
    c = dict(block_q_dkv=bq, block_kv_dkv=bk, block_q_dq=bq2, block_kv_dq=bk2,
             num_compute_wgs=wgs, num_stages=stages, split_dkdv=False,
             fuse_dq=dq_tile == "fused", head_split=False, overlap_softmax=False)
    # Splitting dK from dV recomputes S^T, and splitting the head dim recomputes it
    # once more for dV; each pays only where the config does not fit without it.
    candidates = [c, {**c, "split_dkdv": True}]
    if wgs == 2 and dq_tile != "fused":
      candidates.append({**c, "split_dkdv": True, "head_split": True})
    for c in candidates:
      if _bwd_fits(h, e, c, pe):
        configs.append(_clamp_bwd(c, t, s))
        # The pipelined dQ kernel holds two K tiles a warpgroup: with two stages the
        # next K could not land before it is needed.
        overlapped = {**c, "overlap_softmax": True}
        if stages >= 3 and not (c["fuse_dq"] or c["head_split"]) and _bwd_fits(
            h, e, overlapped, pe):
          configs.append(_clamp_bwd(overlapped, t, s))
        break
  return _unique(configs)


def tunable_space(query: Any, key: Any, *, backward: bool = False,
                  with_pair: bool = False) -> list[dict[str, Any]]:
  """Returns the configs worth measuring for this shape, the heuristic one first.

  Configs whose estimated shared memory or registers exceed an sm_90 SM are left out;
  blocks and warpgroups are shrunk for sequences shorter than a CTA.

  Args:
    query: (B, T, N, H) array or jax.ShapeDtypeStruct.
    key: (B, S, K, H) array or jax.ShapeDtypeStruct.
    backward: configs for the backward.
    with_pair: the call has a bias or mask that varies over query rows (their
      (query, key) tiles take shared memory).

  Returns:
    A list of distinct configs (dicts of keyword arguments), about 10 to 40 for long
    sequences; each passes check_{fwd,bwd}_tunables.

  Raises:
    ValueError: if the head dim or dtype is unsupported.
  """
  t, s, h, e = _problem_of(query, key)
  pe = e if with_pair else 0
  return _bwd_space(t, s, h, e, pe) if backward else _fwd_space(t, s, h, e, pe)


# --------------------------------------------------------------------------------------
# Op classes: attention.pallas_mosaic_gpu and its VJP.
# --------------------------------------------------------------------------------------


def _check_supported(arguments: dict[str, Any]) -> None:
  """Raises NotImplementedError for inputs the kernels do not handle (dispatch falls back)."""
  flash_blocks.require_window_the_kernels_take(arguments.get("local_window_size"))
  q, k = arguments["query"], arguments["key"]
  if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"head dim {q.shape[-1]} is not one of the kernel's"
                              f" {SUPPORTED_HEAD_DIMS}.")
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(f"dtype {q.dtype} is not one of the kernel's"
                              f" {[str(d) for d in SUPPORTED_DTYPES]}.")
  if q.shape[1] == 0 or k.shape[1] == 0:
    raise NotImplementedError(f"empty sequences (T={q.shape[1]}, S={k.shape[1]}) are not"
                              f" supported.")


def _shape_of(ba: Any) -> tuple[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct], dict]:
  """(query, key) structs and the keyword arguments of the tunables functions."""
  a = ba.arguments
  # Per-key bias/mask vectors take little shared memory; (query, key) tiles count.
  with_pair = any(x is not None and x.shape[2] > 1 for x in (a["bias"], a["mask"]))
  structs = a["query"].to_shape_dtype_struct(), a["key"].to_shape_dtype_struct()
  return structs, dict(with_pair=with_pair)


def _static_options(static: dict[str, Any]) -> dict[str, Any]:
  """The options as the kernels take them: sequence lengths as int32."""
  options = dict(static)
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if options[name] is not None:
      options[name] = options[name].astype(jnp.int32)
  return options


class PallasMosaicGpuAttentionVjp(pallas_common.PallasMosaicGpuOp, _base.AttentionVjp,
                                  name="attention.pallas_mosaic_gpu_vjp"):
  """Flash attention backward in Pallas Mosaic GPU (dQ, dK, dV) from the forward's
  log-sum-exp. A bias gradient, when a bias is given, comes from XLA's derivative (dead
  code that XLA drops when the bias is a constant)."""

  config_cls = PallasMosaicGpuAttentionVjpConfig

  def _canonicalize(self, arguments):
    arguments = _base.AttentionVjp._canonicalize(self, arguments)
    _check_supported(arguments)
    return arguments

  def _fwd(self, residuals, out, dout, query, key, value, bias=None, mask=None, *, config,
           **static):
    (lse,) = residuals
    dq, dk, dv = attention_bwd_pallas_mosaic_gpu(
        query, key, value, bias, mask, out, lse, dout.astype(query.dtype),
        **_static_options(static), interpret=self.interpret,
        **pallas_common.tunables_of(config))
    primals = dict(query=query, key=key, value=value, bias=bias, mask=mask, **static)
    return {"query": dq, "key": dk, "value": dv, **_base.bias_gradient_by_xla(primals, dout)}

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

  def _canonicalize(self, arguments):
    arguments = _base.Attention._canonicalize(self, arguments)
    _check_supported(arguments)
    return arguments

  def _fwd(self, query, key, value, bias=None, mask=None, *, config, **static):
    out, lse = attention_fwd_pallas_mosaic_gpu(
        query, key, value, bias, mask, **_static_options(static), interpret=self.interpret,
        **pallas_common.tunables_of(config))
    return out, (lse,)

  def _get_heuristics_config(self, ba):
    structs, kw = _shape_of(ba)
    return PallasMosaicGpuAttentionConfig(**heuristic_tunables(*structs, **kw))

  def _get_autotuning_configs(self, ba):
    structs, kw = _shape_of(ba)
    return pallas_common.configs_from_tunables(PallasMosaicGpuAttentionConfig,
                                               tunable_space(*structs, **kw))
