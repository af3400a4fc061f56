"""What the forward and backward kernels share: the static description of a call and
its input checks, and the building blocks traced inside the kernels (wgmma through
`_Mma`, the memory warpgroup's streams, the walk over visited blocks, masking,
stores, the launcher).

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

from stellarax.core import partitioning
from stellarax.ops import index_math
from stellarax.ops import pallas_backends
from stellarax.ops import pallas_common
from stellarax.ops.attention import flash_blocks
from stellarax.ops.attention import reference as _reference
from stellarax.ops.attention.pallas_mosaic_gpu.tunables import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

plgpu = pallas_backends.mosaic_gpu

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


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
  has_bias: bool = False
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
                  has_mask=mask is not None, has_bias=bias is not None, pair_shape=pair_shape,
                  pair_per_key=pair_per_key)


def _pair_operand(bias: Any, mask: Any, p: _Problem, t_pad: int, s_pad: int, *,
                  transposed: bool = False) -> jax.Array | None:
  """Bias and mask as one operand the kernels stream with the K (or Q) tiles.

  Kept positions hold the bias (0 without one), masked ones -inf, which the kernels
  treat like positions their positional masks remove; a bias is raised to twice
  `flash_blocks.BIASED_LOGIT_FLOOR` (natural units, or float16's lowest), and lowered
  to the stored dtype's largest, so that it is finite and, where it is that low, the
  kernels' floor applies. Broadcast batch and
  head dims stay of size 1. When every query row sees the same values (`pair_per_key`)
  the operand is a float32 vector over the keys; otherwise T and S are materialised
  (TMA copies whole tiles), padded, and rounded to the input dtype.

  Returns:
    None without bias and mask; (B', N', S_pad) float32 per key; else
    (B', N', T_pad, S_pad), or (B', N', S_pad, T_pad) when `transposed` (the dK/dV
    kernel's tiles have keys as rows), in the input dtype.
  """
  if not p.has_pair:
    return None
  if bias is None:
    x = jnp.zeros((1, 1, 1, 1), jnp.float32)
  else:
    stored = jnp.float32 if p.pair_per_key else p.dtype
    lowest = max(2 * flash_blocks.BIASED_LOGIT_FLOOR / _LOG2E, float(jnp.finfo(stored).min))
    # And no higher than the stored dtype holds (float16's 65504: a bias of 7e4 became
    # +inf, and its query row NaN, where jax attends to that key), nor than
    # `flash_blocks.BIAS_CEILING` (finite once the kernels scale it by log2(e)).
    highest = min(float(jnp.finfo(stored).max), flash_blocks.BIAS_CEILING)
    x = jnp.clip(bias.astype(jnp.float32), lowest, highest)
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
  return index_math.div(x + (d - 1), d) if isinstance(x, jax.Array) else -(-x // d)


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
    slot = index_math.rem(step, stages)
    for stream in streams:
      plgpu.barrier_wait(stream.free.at[slot])
      stream.fill(step, slot)

  # Wait for the last frees as well: every thread that waits on a barrier must observe
  # all its phases (the interpreter checks this; on the GPU it only delays the exit).
  @pl.loop(maximum(num_steps - stages, 0), num_steps)
  def _drain(step):
    for stream in streams:
      plgpu.barrier_wait(stream.free.at[index_math.rem(step, stages)])


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
    return index_math.rem(block - self.lo, stages)


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
    g = index_math.div(step, per_head)
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
  kv_head = index_math.div(h, p.group)
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
  # A masked position's logit is -inf whatever the key holds: selected, not added, since
  # NaN + -inf is NaN (a NaN or infinite key under the mask gave a NaN row).
  masked = pair == -jnp.inf
  if not p.has_bias:
    # The pair is 0 or -inf: the select replaces the add, at the same cost.
    return jnp.where(masked, -jnp.inf, s)
  # The floor of biased logits (flash_blocks.BIASED_LOGIT_FLOOR).
  floored = jnp.maximum(s + pair * _LOG2E, flash_blocks.BIASED_LOGIT_FLOOR)
  return jnp.where(masked, -jnp.inf, floored) if p.has_mask else floored


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


# A kernel's `interpret` option: False, True or `plgpu.InterpretGPUParams`. Spelled as
# Any, not as that union, because building the union reads the backend at import time,
# and a JAX without Mosaic GPU must still import this module (`pallas_backends`).
Interpret = Any


def _interpret_params(interpret: Interpret) -> Any:
  """The interpreter's parameters (None: compile for the GPU)."""
  if isinstance(interpret, plgpu.InterpretGPUParams):
    return interpret
  return plgpu.InterpretGPUParams() if interpret else None


def _as_interpret(interpret: Any) -> Interpret:
  """A hashable interpret option for the jitted wrappers: a bool or the params."""
  return interpret if isinstance(interpret, plgpu.InterpretGPUParams) else bool(interpret)


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


def _kernel(body: Callable[..., None], *, p: _Problem, c: Any, out_type: Any,
            scratch: dict[str, Any], grid: tuple[int, int, int], tiles: str,
            num_compute_wgs: int, name: str, interpret: Interpret,
            **options: Any) -> Callable[..., Any]:
  """The launcher of one of the attention kernels: grid (heads, batch, `tiles`), the
  compute warpgroups and one memory warpgroup (thread axis "wg"). The body gets the
  problem `p`, the config `c`, how tiles reach wgmma (`mma`: staged when interpreting)
  and `options`."""
  params = _interpret_params(interpret)
  mma = _Mma(staged=params is not None, check_reads=pallas_common.detects_races(params))
  body = functools.partial(body, p=p, c=c, mma=mma, **options)

  def launch(*operands):
    outputs = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=grid,
        grid_names=("heads", "batch", tiles), num_threads=num_compute_wgs + 1,
        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=params, kernel_name="stellarax_attention_" + name)(*operands)
    return partitioning.vary_like(outputs, operands)

  return launch

