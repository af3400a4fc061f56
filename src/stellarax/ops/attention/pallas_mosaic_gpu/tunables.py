"""Tunables of the Mosaic GPU attention kernels: the config classes and their checks,
the sm_90 (H100/H200) resource estimates that prune configs, the heuristic configs
and the search spaces.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from stellarax.core.config import config_dataclass
from stellarax.ops import pallas_common

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
# The dK/dV kernel of a GQA/MQA call, whose steps also loop over the query heads of a
# group: FlashAttention-3's split, the most setmaxnreg allows two compute warpgroups
# (a CTA of 384 threads starts with 168 registers each; 24 + 2 x 240 = 3 x 168).
_GQA_DKDV_REGISTERS = (24, 240)  # (memory warpgroup, each compute warpgroup)
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



def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


# dQ columns one fused-dQ product and TMA reduce-add covers (a 128-byte swizzle
# unit of the 16-bit K tile, so column slices of it are whole swizzle tiles).
_DQ_CHUNK = 64


def _dq_staging_slots(head_dim: int, num_wgs: int) -> int:
  """Float32 staging tiles per warpgroup of the fused dQ: two alternate when it sends
  several 64-column chunks a step (one is filled while TMA still reads the other),
  else one (its reduce-add had a whole step to finish reading it)."""
  return 2 if head_dim > num_wgs * _DQ_CHUNK else 1


# --------------------------------------------------------------------------------------
# Resource estimates, heuristics and search spaces (sm_90: H100/H200)
# --------------------------------------------------------------------------------------


def _dkdv_registers(group: int, num_wgs: int) -> tuple[int, int]:
  """Registers a thread of the dK/dV kernel's (memory, each compute) warpgroups.

  Checked against ptxas (bench/compile_h200.py, head dim 128, every 2-warpgroup dK/dV
  tiling of the search space): with 24/240 instead of 40/232, GQA (32 query heads on 8,
  causal, T=8192) spills in 1 loop instruction instead of 15 at the heuristic config,
  and in fewer or as many at the others (so too with a 512-key window); multi-head
  calls gain at some tilings and lose at one (3 stages: 0 -> 3), so they keep 40/232.
  """
  if group > 1 and num_wgs == 2:
    return _GQA_DKDV_REGISTERS
  return _MEMORY_REGISTERS, _COMPUTE_REGISTERS[num_wgs]


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
