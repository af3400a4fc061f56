"""The flash attention backward kernels (Mosaic GPU) and their wrapper.

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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.ops import index_math
from stellarax.ops import pallas_backends
from stellarax.ops.attention import flash_blocks
from stellarax.ops.attention.pallas_mosaic_gpu.kernel_parts import (
    _LOG2E, Interpret, _add_pair, _as_interpret, _barrier, _cols, _halves, _if_blocks, _kept,
    _kernel, _lengths, _lengths_args, _make_problem, _Mma, _pad_seq, _pair_operand, _pair_ring,
    _Problem, _produce, _query_block_stream, _query_tile_cta, _rows, _stage, _store_tiles, _tiled,
    _walk, _zeros)
from stellarax.ops.attention.pallas_mosaic_gpu.tunables import (
    _COMPUTE_REGISTERS, _DQ_CHUNK, _MEMORY_REGISTERS, PallasMosaicGpuAttentionVjpConfig,
    _dkdv_registers, _dq_staging_slots, _round_up)
from stellarax.ops.pallas_common import unpack_refs

plgpu = pallas_backends.mosaic_gpu


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
    ds_tile = self.ds_smem.at[index_math.rem(step, 2), self.wg]
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
    buffer = index_math.rem(step, 2)
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
  memory_registers, compute_registers = _dkdv_registers(p.group, num_wgs)
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
    plgpu.set_max_registers(compute_registers, action="increase")
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
      slot = index_math.rem(i, stages)
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
      slot = index_math.rem(i, stages)
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
    plgpu.set_max_registers(memory_registers, action="decrease")
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
    stream.acquire(index_math.rem(i, stages))
    stream.release(index_math.rem(i, stages))

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
    slot = index_math.rem(i, stages)
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
    slot = index_math.rem(i, stages)
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

