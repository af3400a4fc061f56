"""The flash attention forward kernel (Mosaic GPU) and its wrapper.

Forward (FlashAttention-3 layout). One CTA per (query tile, head, batch). Each of its
`num_compute_wgs` compute warpgroups owns `block_q` query rows; one more warpgroup (the
memory warpgroup) streams the K and V tiles of the kv head through a ring of
`num_stages` shared-memory slots with TMA, guarded by "ready" and "free" mbarriers, so
copies overlap the math. K/V are addressed per kv head, never repeated for GQA. A
compute warpgroup computes S = Q K^T with wgmma (both operands in shared memory), keeps
an online softmax in base 2 in float32 registers and accumulates O += P V with P taken
from registers. With two compute warpgroups a shared "schedule" barrier makes them take
turns (ping-pong), so one's softmax overlaps the other's matmuls. With `overlap_softmax`
a warpgroup's turn issues S of key block j and P V of block j - 1 together, and block
j's softmax runs while P V does (intra-warpgroup pipelining; see _FwdWalker, and
`_Mma.products_then_accumulate`). Causal masking visits only the key blocks up to the
diagonal, and only the blocks that cross it are masked; the grid runs the longest query
tiles first so the short ones fill the tail of the launch. Windows and key lengths skip
blocks the same way (ops/attention/flash_blocks.py: the same block arithmetic as the
Triton kernels); the memory warpgroup streams the union of its compute warpgroups' key
blocks, and each warpgroup passes over the blocks it does not need.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.ops import index_math
from stellarax.ops import pallas_backends
from stellarax.ops.attention import flash_blocks
from stellarax.ops.attention.pallas_mosaic_gpu.kernel_parts import (
    _LN2, _LOG2E, Interpret, _add_pair, _as_interpret, _barrier, _cols, _Cta, _if_blocks, _kept,
    _kernel, _lengths_args, _live_rows, _make_problem, _Mma, _pad_seq, _pair_operand, _pair_ring,
    _PingPong, _Problem, _produce, _query_tile_cta, _rows, _stage, _store_tiles, _Stream, _tiled,
    _walk, _zeros)
from stellarax.ops.attention.pallas_mosaic_gpu.tunables import (
    _COMPUTE_REGISTERS, _MEMORY_REGISTERS, PallasMosaicGpuAttentionConfig, _round_up)
from stellarax.ops.pallas_common import unpack_refs

plgpu = pallas_backends.mosaic_gpu


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
      plgpu.copy_gmem_to_smem(v_mean_ref.at[b, index_math.div(h, p.group)], v_mean_smem.at[wg],
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

