"""Pallas Triton kernels for ragged_dot (the grouped matmul of mixture-of-experts layers).

Three products, each a plain function with keyword-only tunables:

  ragged_dot_pallas_triton       out[m] = lhs[m] @ rhs[g(m)]            (M, N)
  ragged_dot_dlhs_pallas_triton  dlhs[m] = dout[m] @ rhs[g(m)].T        (M, K)
  ragged_dot_drhs_pallas_triton  drhs[g] = lhs[rows g].T @ dout[rows g] (G, K, N)

Semantics are those of `jax.lax.ragged_dot` (see `reference.py`): groups are
consecutive row ranges whose sizes are runtime values; rows past the last group give
zeros; a group that runs past row M is cut there; empty groups are allowed.

Shapes need not be multiples of the blocks. K and N edges are masked only when K or
N is not a multiple of its block (decided statically), so the common K loop runs
without masks.

Scheduling of the forward (and lhs-gradient) kernel
---------------------------------------------------
The rows are cut into work items in jnp before the kernel: each group, and then the
rows past the last group (which get zeros), is split into tiles of at most block_m
rows that start at the group's first row. The items partition [0, M); their number
is bounded statically by cdiv(M, block_m) + G, and the items past the real count
have an empty row range. One program computes one (item, n-tile): a plain K loop
over a block_m-row tile that starts at the item's first row (moved up to end at
row M at most, so the loads need no row masks; rows past the item's end belong to
the next group and are computed but not stored), and then a store masked to the
item's rows.

Why this is race-free on a GPU, where grid steps run in parallel in any order: two
programs with the same n-tile write disjoint row ranges, and a masked Triton store
writes only the enabled elements, so no output element is written twice and none
is read back. Every row lies in exactly one item, so every output element is
written once, and rows in no group get the zeros of the tail items.

Compared with fixed m-tiles that loop over the groups they straddle (also
race-free, each program owning its tile), aligning tiles to group starts wastes on
average half a tile per group instead of a whole tile per group boundary, and the K
loop needs no row masks.

Split-K. The forward can share each output tile's K blocks among `split_k`
programs, and the weight gradient (one program per (group, k-tile, n-tile), looping
over the group's rows) its rows among `split_rows` programs; each writes a float32
partial that XLA sums. The op classes offer splits where the output has fewer tiles
than an H200 has cores (`split_k_choices`, `split_rows_choices`).

Programs are numbered in the grouped ("swizzled") order of Triton's matmul
tutorial: `tm.L2_GROUP_M` consecutive items sweep the n-tiles together, so the rhs
columns and lhs rows they share stay in L2; consecutive items mostly share a group.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.core.config import check_power_of_two
from stellarax.ops import common
from stellarax.ops import index_math
from stellarax.ops import pallas_backends
from stellarax.ops import triton_matmul as tm
from stellarax.ops.ragged_dot import split_k as _splits
from stellarax.ops.ragged_dot.reference import (
    check_group_sizes,
    check_ragged_dot_shapes,
    group_bounds,
)

pltriton = pallas_backends.triton

# Limits and checks shared with the other Triton matmul kernels (`triton_matmul`).
MIN_BLOCK = tm.MIN_BLOCK
MAX_BLOCK = tm.MAX_BLOCK
NUM_WARPS_CHOICES = tm.NUM_WARPS_CHOICES
MAX_NUM_STAGES = tm.MAX_NUM_STAGES
SUPPORTED_DTYPES = tm.SUPPORTED_DTYPES
validate_tunables = tm.validate_tunables
# Programs that may share one output tile's contraction (split-K; over rows for the
# weight gradient).
MAX_SPLIT = _splits.MAX_SPLIT
_KERNEL = "ragged_dot"


# --------------------------------------------------------------------------- configs


def _check_sizes(m: int, k: int, n: int, g: int) -> None:
  for name, value in (("m", m), ("k", k), ("n", n), ("g", g)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int (a problem size).")


def _out_dtype(preferred_element_type: Any, like: jax.Array) -> jnp.dtype:
  return jnp.dtype(like.dtype if preferred_element_type is None else preferred_element_type)


def _drhs_fits(t: dict[str, int], itemsize: int) -> bool:
  """Whether a tiling also fits the rhs-gradient kernel, which pipelines block_m rows of
  lhs and dout into a block_k x block_n accumulator: a matmul whose output tile is
  block_k x block_n, stepped by block_m."""
  bm, bn, bk = t["block_m"], t["block_n"], t["block_k"]
  return (tm.smem_bytes(bk, bn, bm, t["num_stages"], itemsize) <= tm.SMEM_BYTES
          and tm.acc_fits(bk, bn, t["num_warps"]))


def heuristic_tunables(m: int, k: int, n: int, g: int, dtype: Any) -> dict[str, int]:
  """Returns tunables that are a reasonable guess on an H200, without measuring.

  16-bit inputs use 128x128x64 tiles, 4 warps (one warpgroup) and 3 stages, the
  shape of a good Hopper Triton matmul; float32 (twice the bytes, and an IEEE dot on
  CUDA cores under HIGHEST precision) uses
  64x64x32. block_m shrinks to the average group size (rounded down to a power of
  two, at least 16), since each group wastes about half a tile. Blocks never exceed
  the problem size rounded up to a power of two.

  Args:
    m: lhs rows M.
    k: contracted size K.
    n: output columns N.
    g: number of groups G.
    dtype: the operands' dtype.

  Returns:
    A dict with block_m, block_n, block_k, num_warps and num_stages; valid for
    `validate_tunables`.

  Raises:
    ValueError: for an unsupported dtype or non-positive sizes.
  """
  _check_sizes(m, k, n, g)
  if tm.check_dtype("dtype", dtype, _KERNEL).itemsize == 2:
    block_m, block_n, block_k = 128, 128, 64
  else:
    block_m, block_n, block_k = 64, 64, 32
  block_m = max(MIN_BLOCK, min(block_m, tm.pow2_at_most(m // g)))
  return dict(block_m=tm.cap(block_m, m), block_n=tm.cap(block_n, n), block_k=tm.cap(block_k, k),
              num_warps=4, num_stages=3)


def _candidate_tiles(m: int, g: int, itemsize: int) -> list[tuple[int, int, int]]:
  """Uncapped (block_m, block_n, block_k) candidates for the search space."""
  # The three largest block_m up to twice the average group (at least 64): larger
  # tiles only add padding rows.
  upper = max(64, 2 * tm.pow2_at_most(m // g))
  block_ms = [b for b in (16, 32, 64, 128, 256) if b <= upper][-3:]
  block_ks = (32, 64, 128) if itemsize == 2 else (16, 32, 64)
  # A float32 accumulator of more than 128x256 (128x128 for float32 inputs, whose
  # CUDA-core dot needs more registers) does not fit in registers.
  max_acc = 128 * 256 if itemsize == 2 else 128 * 128
  return [(bm, bn, bk) for bm in block_ms for bn in (64, 128, 256) for bk in block_ks
          if bm * bn <= max_acc]


def tunable_space(m: int, k: int, n: int, g: int, dtype: Any) -> list[dict[str, int]]:
  """Returns the autotuning search space for one ragged_dot shape (at most about 60 configs).

  Tiles: block_m among the three largest of 16..256 up to twice the average group
  size (at least 64), block_n of 64 to 256, block_k of 32 to 128 (16 to 64 for
  float32), accumulators up to 128x256 (128x128 for float32); 4 warps, or 8 for
  accumulators of at least 128x128 (only 8 above 128 floats a thread, which spill on
  4); 3 or 4 stages (3 for block_k = 128). Blocks are
  capped at the problem size, duplicates dropped, and configs whose pipelined tiles
  overflow the H200's shared memory left out. The heuristic config comes first.

  Args:
    m: lhs rows M.
    k: contracted size K.
    n: output columns N.
    g: number of groups G.
    dtype: the operands' dtype.

  Returns:
    A list of distinct dicts with block_m, block_n, block_k, num_warps, num_stages,
    each valid for `validate_tunables`, the heuristic config first.

  Raises:
    ValueError: for an unsupported dtype or non-positive sizes.
  """
  heuristic = heuristic_tunables(m, k, n, g, dtype)
  itemsize = jnp.dtype(dtype).itemsize
  keys = [tuple(heuristic[name] for name in tm.TUNABLE_NAMES)]
  for bm, bn, bk in _candidate_tiles(m, g, itemsize):
    bm, bn, bk = tm.cap(bm, m), tm.cap(bn, n), tm.cap(bk, k)
    warps = [w for w in ((4, 8) if bm * bn >= 128 * 128 else (4,)) if tm.acc_fits(bm, bn, w)]
    for num_warps in warps:
      for num_stages in (3, 4) if bk <= 64 else (3,):
        if tm.smem_bytes(bm, bn, bk, num_stages, itemsize) <= tm.SMEM_BYTES:
          keys.append((bm, bn, bk, num_warps, num_stages))
  return [dict(zip(tm.TUNABLE_NAMES, key)) for key in dict.fromkeys(keys)]


def split_k_choices(m: int, k: int, n: int, g: int, *, block_m: int, block_n: int,
                    block_k: int) -> list[int]:
  """The forward's `split_k` worth trying for one tiling, the guess first (see
  `_splits.split_choices`): its tiles are the work items (at most M/block_m + G) times
  the n-tiles, its contraction K/block_k blocks.

  Args:
    m, k, n, g: the problem (lhs rows, contraction, output columns, groups).
    block_m, block_n, block_k: the forward's tiling.

  Returns:
    Distinct powers of two, each <= MAX_SPLIT, the guess first.
  """
  return _splits.split_choices((pl.cdiv(m, block_m) + g) * pl.cdiv(n, block_n), pl.cdiv(k, block_k))


def split_rows_choices(m: int, k: int, n: int, g: int, *, block_m: int, block_n: int,
                       block_k: int) -> list[int]:
  """The weight gradient's `split_rows` worth trying for one tiling, the guess first
  (see `_splits.split_choices`): its tiles are G x K/block_k x N/block_n, its contraction
  an average group's M/G rows in blocks of block_m.

  Args:
    m, k, n, g: the problem (lhs rows, contraction, output columns, groups).
    block_m, block_n, block_k: the weight gradient's tiling.

  Returns:
    Distinct powers of two, each <= MAX_SPLIT, the guess first.
  """
  return _splits.split_choices(g * pl.cdiv(k, block_k) * pl.cdiv(n, block_n), max(1, m // g) // block_m)


# --------------------------------------------------------------------------- metadata


def _group_offsets(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """Returns (G + 1,) int32 offsets: group g owns rows [offsets[g], offsets[g + 1]), cut at M."""
  _, ends = group_bounds(group_sizes, num_rows)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def _num_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
  """A static bound on the work items: tiles of the G groups plus the zero tail."""
  # The G + 1 parts (groups and the tail) sum to M rows and each rounds up by less
  # than one tile, so they need fewer than M / block_m + G + 1 tiles.
  return pl.cdiv(num_rows, block_m) + num_groups


def _work_items(offsets: jax.Array, num_rows: int, block_m: int) -> jax.Array:
  """Splits the rows into work items, computed in jnp outside the kernel.

  Every group, and then the rows past the last group (part G, which gets zeros), is
  cut into tiles of at most block_m rows starting at the part's first row. The
  items partition [0, M), so each output row belongs to exactly one item.

  Returns:
    (3, num_items) int32: the part (group id, or G for the zero tail) and the
    [row_start, row_end) range of each item; items past the real count have part G
    and an empty range, so they do nothing.
  """
  num_groups = offsets.shape[0] - 1
  part_starts = offsets
  part_ends = jnp.concatenate([offsets[1:], jnp.full((1,), num_rows, jnp.int32)])
  part_tiles = (part_ends - part_starts + block_m - 1) // block_m
  tiles_end = jnp.cumsum(part_tiles)
  items = jnp.arange(_num_work_items(num_rows, num_groups, block_m), dtype=jnp.int32)
  # Parts whose tiles all come before an item are counted, so this is the item's
  # part; empty parts have no tiles and are skipped.
  part = jnp.searchsorted(tiles_end, items, side="right").astype(jnp.int32)
  active = part <= num_groups
  part = jnp.minimum(part, num_groups)
  local = items - (tiles_end[part] - part_tiles[part])
  row_start = jnp.where(active, part_starts[part] + local * block_m, 0)
  row_end = jnp.where(active, jnp.minimum(row_start + block_m, part_ends[part]), 0)
  return jnp.stack([part, row_start, row_end]).astype(jnp.int32)


def _share_of_blocks(split: jax.Array, num_full: Any, per_split: Any) -> tuple[Any, Any, jax.Array]:
  """Split-K: the blocks of a contraction that share `split` sums, `per_split` (>= 1)
  blocks a share. Returns [first, last) of the `num_full` whole blocks, and whether
  the partial block after them (index num_full), if any, is this share's."""
  first = jnp.minimum(split * per_split, num_full)
  last = jnp.minimum(first + per_split, num_full)
  return first, last, split == index_math.div(num_full, per_split)


# --------------------------------------------------------------------------- forward


def _ragged_dot_kernel(items_ref, lhs_ref, rhs_ref, out_ref, *, block_m: int, block_n: int,
                       block_k: int, transpose_rhs: bool, split_k: int, precision: str | None):
  """One program: work item x n-tile (x one of `split_k` shares of the contraction);
  writes only the item's rows of the output (of its partial sum, with split_k > 1).

  lhs is (M, C); rhs is (G, C, D), or (G, D, C) with transpose_rhs; out is (M, D), or
  (split_k, M, D) float32 partial sums.
  """
  num_rows, contract = lhs_ref.shape
  num_groups, cols_out = rhs_ref.shape[0], out_ref.shape[-1]
  num_items, num_n_tiles = items_ref.shape[1], pl.cdiv(cols_out, block_n)
  per_split = num_items * num_n_tiles
  split = index_math.div(pl.program_id(0), per_split)
  item, tile_n = tm.swizzle(index_math.rem(pl.program_id(0), per_split), num_items, num_n_tiles)
  group, row_start, row_end = items_ref[0, item], items_ref[1, item], items_ref[2, item]
  # The tile is moved up to end at row M at most, so that its loads stay in bounds
  # without masks; rows outside [row_start, row_end) are computed but not stored. A
  # tile taller than M starts at its item's first row and masks the rows past M: a
  # traced start, since jax 0.12 rejects a static slice that runs past the array even
  # when every access past it is masked.
  tile_start = jnp.minimum(row_start, num_rows - block_m) if num_rows >= block_m else row_start
  rows = tm.span(tile_start, block_m)[:, None]
  row_mask = rows < num_rows if num_rows < block_m else None
  n0 = tile_n * block_n
  col_mask = (tm.span(n0, block_n) < cols_out)[None, :] if cols_out % block_n else None
  num_full_k = contract // block_k
  k_first, k_last, owns_ragged_k = _share_of_blocks(
      split, num_full_k, pl.cdiv(pl.cdiv(contract, block_k), split_k))
  owns_ragged_k = owns_ragged_k.astype(jnp.int32)
  # The zero tail and empty items run no K step (rhs[G] does not exist).
  is_group = (group < num_groups).astype(jnp.int32)

  def k_step(k0, k_mask, acc):
    lhs = tm.load(lhs_ref.at[pl.ds(tile_start, block_m), pl.ds(k0, block_k)],
                tm.all_of(row_mask, k_mask))
    if transpose_rhs:
      rhs = tm.load(rhs_ref.at[group, pl.ds(n0, block_n), pl.ds(k0, block_k)],
                  tm.all_of(None if col_mask is None else col_mask.T, k_mask))
      return acc + tm.dot(lhs, rhs, 1, 1, precision)
    rhs = tm.load(rhs_ref.at[group, pl.ds(k0, block_k), pl.ds(n0, block_n)],
                tm.all_of(None if k_mask is None else k_mask.T, col_mask))
    return acc + tm.dot(lhs, rhs, 1, 0, precision)

  def full_k(i, acc):
    return k_step(pl.multiple_of(i * block_k, block_k), None, acc)

  def ragged_k(i, acc):
    k0 = i * block_k
    return k_step(k0, (tm.span(k0, block_k) < contract)[None, :], acc)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  # Static guards: a loop body is traced even when it never runs, and interpret
  # mode cannot trace an unmasked block larger than the array.
  if num_full_k:
    acc = lax.fori_loop(k_first, k_first + is_group * (k_last - k_first), full_k, acc)
  if contract % block_k:  # static: only a ragged K pays for the K mask, in one step.
    # A loop of at most one trip, so that the slice start is a traced value (a
    # static start past K would be rejected at trace time even though it is masked).
    acc = lax.fori_loop(num_full_k, num_full_k + is_group * owns_ragged_k, ragged_k, acc)
  out = acc.astype(out_ref.dtype)
  # Items partition the rows, so the masked stores of different programs never
  # touch the same element: no race even though programs run in parallel.
  out_mask = tm.all_of((rows >= row_start) & (rows < row_end), col_mask)
  index = () if len(out_ref.shape) == 2 else (split,)
  pltriton.store(out_ref.at[(*index, pl.ds(tile_start, block_m), pl.ds(n0, block_n))], out,
                 mask=jnp.broadcast_to(out_mask, out.shape))


def _ragged_dot_call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, block_m, block_n,
                     block_k, num_warps, num_stages, interpret, name, precision, split_k=1):
  """Launches the forward kernel; out is (M, D) with D = rhs.shape[1 if transpose_rhs else 2].

  With split_k > 1 each (item, n-tile) gets split_k programs, each over a share of
  the contraction's blocks, writing float32 partials that XLA sums.
  """
  num_rows = lhs.shape[0]
  cols_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  items = _work_items(_group_offsets(group_sizes, num_rows), num_rows, block_m)
  num_programs = split_k * items.shape[1] * pl.cdiv(cols_out, block_n)
  kernel = functools.partial(_ragged_dot_kernel, block_m=block_m, block_n=block_n,
                             block_k=block_k, transpose_rhs=transpose_rhs, split_k=split_k,
                             precision=precision)
  out = pl.pallas_call(
      kernel,
      out_shape=(pallas_common.out_struct((num_rows, cols_out), out_dtype, like=lhs) if split_k == 1
                 else pallas_common.out_struct((split_k, num_rows, cols_out), jnp.float32, like=lhs)),
      grid=(num_programs,),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(items, lhs, rhs)
  return out if split_k == 1 else out.sum(axis=0).astype(out_dtype)


@functools.partial(
    jax.jit,
    static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k",
                     "preferred_element_type", "precision", "interpret"))
def ragged_dot_pallas_triton(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    split_k: int = 1,
    preferred_element_type: Any = None,
    precision: Any = None,
    interpret: bool = False,
) -> jax.Array:
  """Computes `jax.lax.ragged_dot(lhs, rhs, group_sizes)` with a Pallas Triton kernel.

  Args:
    lhs: (M, K) bfloat16, float16 or float32.
    rhs: (G, K, N), the same dtype as lhs.
    group_sizes: (G,) integer array (a runtime value); group g is the next
      group_sizes[g] rows of lhs.
    block_m, block_n: output tile; block_k: contracted columns per pipelined step.
    num_warps, num_stages: Triton launch parameters.
    split_k: programs sharing one output tile's K blocks (split-K, a power of two, 1
      to 16), each writing a float32 partial that XLA sums; for outputs with fewer
      tiles than the GPU has cores.
    preferred_element_type: output dtype; defaults to lhs.dtype. Accumulation is
      always float32.
    precision: None, a `jax.lax.Precision` or its name: float32 operands multiply as
      TF32 unless it is HIGHEST (as XLA does on the GPU); 16-bit ones are exact.
    interpret: run in Pallas interpret mode (CPU, for tests).

  Returns:
    (M, N) array: row m of group g is lhs[m] @ rhs[g]; rows in no group are zero.

  Raises:
    ValueError: for mismatched shapes or dtypes, or invalid tunables.
  """
  validate_tunables(block_m=block_m, block_n=block_n, block_k=block_k,
                    num_warps=num_warps, num_stages=num_stages)
  check_power_of_two("split_k", split_k, minimum=1, maximum=MAX_SPLIT)
  check_ragged_dot_shapes(lhs, rhs, group_sizes)
  tm.check_same_dtype("lhs", lhs, "rhs", rhs, _KERNEL)
  tm.check_int32_addressing(lhs=lhs.shape, rhs=rhs.shape, out=(lhs.shape[0], rhs.shape[2]))
  return _ragged_dot_call(
      lhs, rhs, group_sizes, transpose_rhs=False,
      out_dtype=_out_dtype(preferred_element_type, lhs), block_m=block_m,
      block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
      interpret=interpret, name="ragged_dot_fwd", precision=common.canonical_precision(precision),
      split_k=split_k)


@functools.partial(
    jax.jit,
    static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                     "preferred_element_type", "precision", "interpret"))
def ragged_dot_dlhs_pallas_triton(
    dout: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    preferred_element_type: Any = None,
    precision: Any = None,
    interpret: bool = False,
) -> jax.Array:
  """Computes the lhs gradient of ragged_dot: dlhs[m] = dout[m] @ rhs[g(m)].T.

  The forward kernel runs with rhs read transposed in its tiles, so no transposed
  copy of rhs is made. Here the output columns are K and the contraction is over N:
  block_n tiles K and block_k steps over N.

  Args:
    dout: (M, N) cotangent of the forward output, the same dtype as rhs.
    rhs: (G, K, N) forward rhs.
    group_sizes: (G,) integer array, as in the forward call.
    block_m, block_n, block_k, num_warps, num_stages: as in the forward call.
    preferred_element_type: output dtype; defaults to dout.dtype.
    precision: None, a `jax.lax.Precision` or its name: float32 operands multiply as
      TF32 unless it is HIGHEST (as XLA does on the GPU); 16-bit ones are exact.
    interpret: run in Pallas interpret mode (CPU, for tests).

  Returns:
    (M, K) array; rows in no group are zero.

  Raises:
    ValueError: for mismatched shapes or dtypes, or invalid tunables.
  """
  validate_tunables(block_m=block_m, block_n=block_n, block_k=block_k,
                    num_warps=num_warps, num_stages=num_stages)
  if dout.ndim != 2 or rhs.ndim != 3 or dout.shape[1] != rhs.shape[2]:
    raise ValueError(
        f"The lhs gradient needs dout (M, N) and rhs (G, K, N) with the same N; got "
        f"dout.shape={dout.shape} and rhs.shape={rhs.shape}.")
  check_group_sizes(group_sizes, rhs.shape[0])
  tm.check_same_dtype("dout", dout, "rhs", rhs, _KERNEL)
  tm.check_int32_addressing(dout=dout.shape, rhs=rhs.shape, dlhs=(dout.shape[0], rhs.shape[1]))
  return _ragged_dot_call(
      dout, rhs, group_sizes, transpose_rhs=True,
      out_dtype=_out_dtype(preferred_element_type, dout), block_m=block_m,
      block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
      interpret=interpret, name="ragged_dot_dlhs", precision=common.canonical_precision(precision))


# --------------------------------------------------------------------------- rhs gradient


def _drhs_kernel(offsets_ref, lhs_ref, dout_ref, out_ref, *, block_m: int, block_n: int,
                 block_k: int, split_rows: int, precision: str | None):
  """One program: tile (k-tile, n-tile) of drhs[group] (of its partial sum over one
  of `split_rows` shares of the group's row blocks), looping over those rows."""
  contract_k, cols_n = out_ref.shape[-2:]
  num_rows = lhs_ref.shape[0]
  num_k_tiles, num_n_tiles = pl.cdiv(contract_k, block_k), pl.cdiv(cols_n, block_n)
  pid = pl.program_id(0)
  per_group = num_k_tiles * num_n_tiles
  num_groups = out_ref.shape[-3]
  group = index_math.rem(index_math.div(pid, per_group), num_groups)
  split = index_math.div(pid, per_group * num_groups)
  # Group-major order keeps the programs in flight on one group's rows (L2 reuse).
  tile_k, tile_n = tm.swizzle(index_math.rem(pid, per_group), num_k_tiles, num_n_tiles)
  k0, n0 = tile_k * block_k, tile_n * block_n
  k_mask = (tm.span(k0, block_k) < contract_k)[None, :] if contract_k % block_k else None
  n_mask = (tm.span(n0, block_n) < cols_n)[None, :] if cols_n % block_n else None
  row_lo, row_hi = offsets_ref[group], offsets_ref[group + 1]
  size = row_hi - row_lo
  num_full = index_math.div(size, block_m)
  per_split = jnp.maximum(index_math.div(size + split_rows * block_m - 1, split_rows * block_m), 1)
  first, last, owns_tail = _share_of_blocks(split, num_full, per_split)
  has_tail = (index_math.rem(size, block_m) > 0) & owns_tail

  def step(r0, row_mask, acc):
    lhs = tm.load(lhs_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)], tm.all_of(row_mask, k_mask))
    dout = tm.load(dout_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)], tm.all_of(row_mask, n_mask))
    return acc + tm.dot(lhs, dout, 0, 0, precision)

  def full_rows(i, acc):
    return step(row_lo + i * block_m, None, acc)

  def tail_rows(_, acc):
    r0 = row_lo + num_full * block_m
    return step(r0, (tm.span(r0, block_m) < row_hi)[:, None], acc)

  acc = jnp.zeros((block_k, block_n), jnp.float32)
  # Whole row blocks need no row mask; the partial last block (if any) runs as a
  # loop of zero or one trips so that the common path stays mask-free. With
  # M < block_m there is no whole block, and its loop is not even traced (interpret
  # mode cannot trace an unmasked block larger than the array).
  if num_rows >= block_m:
    acc = lax.fori_loop(first, last, full_rows, acc)
  # Bounds of one integer type: Triton's scf.for rejects a loop whose bounds differ (an
  # i32 literal and a `where` of Python ints), which only the GPU compile checks.
  acc = lax.fori_loop(0, has_tail.astype(jnp.int32), tail_rows, acc)
  out = acc.astype(out_ref.dtype)
  index = (group,) if len(out_ref.shape) == 3 else (split, group)
  out_tile = out_ref.at[(*index, pl.ds(k0, block_k), pl.ds(n0, block_n))]
  out_mask = tm.all_of(None if k_mask is None else k_mask.T, n_mask)
  if out_mask is None:
    out_tile[...] = out
  else:
    pltriton.store(out_tile, out, mask=jnp.broadcast_to(out_mask, out.shape))


@functools.partial(
    jax.jit,
    static_argnames=("num_groups", "block_m", "block_n", "block_k", "num_warps",
                     "num_stages", "split_rows", "preferred_element_type", "precision", "interpret"))
def ragged_dot_drhs_pallas_triton(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    num_groups: int,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    split_rows: int = 1,
    preferred_element_type: Any = None,
    precision: Any = None,
    interpret: bool = False,
) -> jax.Array:
  """Computes the rhs gradient of ragged_dot: drhs[g] = lhs[rows of g].T @ dout[rows of g].

  One program per (group, K tile, N tile) loops over the group's rows in steps of
  block_m; an empty group's programs store zeros. With `split_rows` = s > 1 (split-K:
  the contraction here runs over rows), s programs per tile each sum an s-th of the
  group's row blocks into a float32 partial, and the partials are added in XLA: s
  times the programs, for outputs with fewer tiles than the GPU has cores.

  Args:
    lhs: (M, K) forward lhs.
    dout: (M, N) cotangent of the forward output, the same dtype as lhs.
    group_sizes: (num_groups,) integer array, as in the forward call.
    num_groups: G (static).
    block_m: rows per step; block_k x block_n: output tile of drhs[g].
    num_warps, num_stages: Triton launch parameters.
    split_rows: programs sharing one output tile's rows (a power of two, 1 to 16).
    preferred_element_type: output dtype; defaults to lhs.dtype.
    precision: None, a `jax.lax.Precision` or its name: float32 operands multiply as
      TF32 unless it is HIGHEST (as XLA does on the GPU); 16-bit ones are exact.
    interpret: run in Pallas interpret mode (CPU, for tests).

  Returns:
    (G, K, N) array.

  Raises:
    ValueError: for mismatched shapes or dtypes, or invalid tunables.
  """
  validate_tunables(block_m=block_m, block_n=block_n, block_k=block_k,
                    num_warps=num_warps, num_stages=num_stages)
  check_power_of_two("split_rows", split_rows, minimum=1, maximum=MAX_SPLIT)
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(
        f"The rhs gradient needs lhs (M, K) and dout (M, N) with the same M; got "
        f"lhs.shape={lhs.shape} and dout.shape={dout.shape}.")
  check_group_sizes(group_sizes, num_groups)
  tm.check_same_dtype("lhs", lhs, "dout", dout, _KERNEL)
  tm.check_int32_addressing(lhs=lhs.shape, dout=dout.shape,
                          drhs=(num_groups, lhs.shape[1], dout.shape[1]))
  (num_rows, contract_k), cols_n = lhs.shape, dout.shape[1]
  out_dtype = _out_dtype(preferred_element_type, lhs)
  offsets = _group_offsets(group_sizes, num_rows)
  num_programs = split_rows * num_groups * pl.cdiv(contract_k, block_k) * pl.cdiv(cols_n, block_n)
  kernel = functools.partial(_drhs_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                             split_rows=split_rows, precision=common.canonical_precision(precision))
  shape = (num_groups, contract_k, cols_n)
  out = pl.pallas_call(
      kernel,
      out_shape=(pallas_common.out_struct(shape, out_dtype, like=lhs) if split_rows == 1
                 else pallas_common.out_struct((split_rows, *shape), jnp.float32, like=lhs)),
      grid=(num_programs,),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="ragged_dot_drhs",
  )(offsets, lhs, dout)
  return out if split_rows == 1 else out.sum(axis=0).astype(out_dtype)


# ---------------------------------------------------------------------------
# Op classes: ragged_dot.pallas_triton and its VJP.

from stellarax.core.config import config_dataclass  # noqa: E402
from stellarax.ops import pallas_common  # noqa: E402
from stellarax.ops.ragged_dot import base as _base  # noqa: E402


def _validate_split_config(config: Any, split_name: str) -> None:
  tunables = pallas_common.tunables_of(config)
  check_power_of_two(split_name, tunables.pop(split_name), minimum=1, maximum=MAX_SPLIT)
  validate_tunables(**tunables)


@config_dataclass
class PallasTritonRaggedDotConfig:
  """Tiles and pipelining of the Pallas Triton ragged_dot forward (see
  `validate_tunables`) and `split_k`: programs sharing one output tile's K blocks."""

  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int
  split_k: int = 1

  def __post_init__(self):
    _validate_split_config(self, "split_k")


@config_dataclass
class PallasTritonRaggedDotVjpConfig:
  """The backward's tiles and pipelining (as the forward's, for both products) and
  `split_rows`: programs sharing one weight-gradient tile's rows (split-K)."""

  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int
  split_rows: int = 1

  def __post_init__(self):
    _validate_split_config(self, "split_rows")


def _split_configs(config_cls: type, split_name: str, choices: Any, m: int, k: int, n: int, g: int,
                   dtype: Any, fits: Any = None) -> list[Any]:
  """The tilings of `tunable_space` that pass `fits` (if given), each with its splits
  from `choices`; the heuristic first."""
  return [config_cls(**t, **{split_name: split})
          for t in tunable_space(m, k, n, g, dtype) if fits is None or fits(t)
          for split in choices(m, k, n, g, block_m=t["block_m"], block_n=t["block_n"],
                               block_k=t["block_k"])]


def _fwd_configs(*problem: Any) -> list[PallasTritonRaggedDotConfig]:
  return _split_configs(PallasTritonRaggedDotConfig, "split_k", split_k_choices, *problem)


def _vjp_configs(*problem: Any) -> list[PallasTritonRaggedDotVjpConfig]:
  # One tiling serves both gradients: it must fit the rhs gradient's kernel too (the
  # forward's space alone let 128x256 tiles past, which asked 240-384 KiB of shared
  # memory there and failed to compile).
  itemsize = jnp.dtype(problem[-1]).itemsize
  return _split_configs(PallasTritonRaggedDotVjpConfig, "split_rows", split_rows_choices, *problem,
                        fits=lambda t: _drhs_fits(t, itemsize))


def _mkng(ba) -> tuple[int, int, int, int, str]:
  lhs, rhs = ba.arguments["lhs"], ba.arguments["rhs"]
  return lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], lhs.dtype


def _check_kernel_takes(arguments):
  lhs, rhs = arguments["lhs"], arguments["rhs"]
  (m, k), n = lhs.shape, rhs.shape[2]
  tm.refuse_unsupported("lhs", lhs, "rhs", rhs, lhs=(m, k), rhs=tuple(rhs.shape), out=(m, n))


class PallasTritonRaggedDotVjp(pallas_common.PallasTritonOp, _base.RaggedDotVjp, name="ragged_dot.pallas_triton_vjp"):
  """ragged_dot backward in Pallas Triton: d lhs with the forward kernel
  reading rhs transposed, d rhs with a per-group lhs^T @ dout kernel (split over
  rows where it has few tiles)."""

  config_cls = PallasTritonRaggedDotVjpConfig

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments)

  def _fwd(self, residuals, out, dout, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None,
           config):
    del residuals, out, preferred_element_type
    kw = dict(interpret=self.interpret, precision=precision, **pallas_common.tunables_of(config))
    split_rows = kw.pop("split_rows")
    dout = dout.astype(rhs.dtype)  # one operand dtype for Triton's dot
    dlhs = ragged_dot_dlhs_pallas_triton(dout, rhs, group_sizes, preferred_element_type=lhs.dtype, **kw)
    drhs = ragged_dot_drhs_pallas_triton(lhs, dout, group_sizes, rhs.shape[0], split_rows=split_rows,
                                         preferred_element_type=rhs.dtype, **kw)
    return {"lhs": dlhs, "rhs": drhs}

  def _get_heuristics_config(self, ba):
    return _vjp_configs(*_mkng(ba))[0]

  def _get_autotuning_configs(self, ba):
    return set(_vjp_configs(*_mkng(ba)))


class PallasTritonRaggedDot(pallas_common.PallasTritonOp, _base.RaggedDot, name="ragged_dot.pallas_triton"):
  """ragged_dot in Pallas Triton: group-aligned row tiles, one masked store
  per (tile, n-tile), fp32 accumulation. `precision` reaches the dots: f32 inputs
  multiply as TF32 unless it is HIGHEST (exact fp32), as in XLA on the GPU."""

  config_cls = PallasTritonRaggedDotConfig
  vjp_cls = PallasTritonRaggedDotVjp

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments)

  def _fwd(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, config):
    out = ragged_dot_pallas_triton(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                                   precision=precision, interpret=self.interpret,
                                   **pallas_common.tunables_of(config))
    return out, None

  def _get_heuristics_config(self, ba):
    return _fwd_configs(*_mkng(ba))[0]

  def _get_autotuning_configs(self, ba):
    return set(_fwd_configs(*_mkng(ba)))
