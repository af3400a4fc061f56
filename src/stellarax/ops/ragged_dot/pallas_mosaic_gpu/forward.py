"""The forward kernel of ragged_dot (Mosaic GPU), which also computes the lhs gradient
(rhs read transposed), and their public functions.

Scheduling of the forward (and lhs-gradient) kernel
---------------------------------------------------
The rows are cut into work items in jnp before the kernel: each group, and then the
rows past the last group (which get zeros), is split into tiles of block_m rows, the
first starting at the group's first row aligned down to a multiple of 8 (Mosaic
moves 128-byte-swizzled tiles in 8-row units, so TMA row offsets must be multiples
of 8; M is padded to a multiple of 8 when it is not). An item is one group's rows
within one tile, so the items partition [0, M); their number is bounded statically
by cdiv(M + 7 (G + 1), block_m) + G + 1, and the items past the real count have an
empty row range and do nothing. A CTA loop step computes one (item, n-tile): a K
loop over its block_m-row tile (moved up to end at row M at most, so TMA never reads
past the array; tile rows outside the item belong to a neighbouring group and are
computed but not stored), then TMA stores of exactly the item's rows. A TMA box has
a static size, so a ragged row count is stored as a ladder of power-of-two boxes
(its binary digits: at most log2(block_m) + 1 stores, one for a full tile).

A group's last tile is short (half a tile on average; at the G=64 target, whose groups
average 256 rows, about 2 tiles in 5 are a group's last). With `half_tiles`, a compute
warpgroup of 128 rows whose item rows end in its first half multiplies only that half
(64-row wgmma slices): the kernel holds the tile's pipeline twice, with a 128-row and a
64-row accumulator, and each warpgroup takes one per tile (the memory warpgroup's loads
are the same in both).

Why this is race-free on a GPU, where CTAs run in parallel in any order: the
persistent loop hands every linear tile index to exactly one CTA (`nd_loop` strides
by the grid size) and `planar_snake` is a bijection from linear indices to (item,
n-tile), so every (item, n-tile) is computed once; items partition the rows and the
stores write only the item's rows, so no output element is written twice and none
is read back. Within a CTA the two compute warpgroups store disjoint halves of the
tile from their own shared-memory buffers, and each waits for its previous TMA
stores to finish reading its buffer before overwriting it; the memory warpgroup
refills a pipeline stage only after both compute warpgroups released it (their
wgmma on it completed; with `delay_release` the interpreter's race detector checks
this too, from reads of the stage where its wgmma completes, since the interpreter
runs wgmma at once). Interpret mode runs the CTAs one after another, which hides
races between them, so the tests check the partition and the bijection directly
and also run the interpreter's race detector (which gives each CTA fresh clocks,
so conflicting writes of two CTAs are reported). With `multicast` the loop hands out
pairs of column tiles instead, each exactly once, and the two CTAs of a cluster split
a pair between them, so the argument is unchanged; the interpreter copies a multicast
tile into each CTA on its own, so the tests check the pairing and the cluster
barriers' flow, not the multicast itself.

Split-K (forward and lhs gradient). With split_k > 1 the loop runs over (share,
item, n-tile), share-major, and each step sums only its share of the contraction
(K / split_k, whole block_k steps) into a float32 partial (split_k, M, N) output; XLA
sums the partials. Every (share, item, n-tile) is still computed once and the
partials are disjoint, so the argument above holds. It pays where the output has
fewer tiles than the GPU has SMs (decode-sized M with narrow outputs); the rule is
shared with the Triton kernels (ops/ragged_dot/split_k.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.ops import index_math
from stellarax.ops import pallas_backends
from stellarax.ops import pallas_common
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.kernel_parts import (
    _column_tile, _ignore, _launch, _out_dtype, _prepare, _row_operand, _StageRelease, _STATIC,
    _StepMma, _store_rows, _swizzled, _Tiles, _tunables_in, _warp_specialized)
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.tunables import _NUM_COMPUTE_WGS, _ROW_ALIGN
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.work_items import (
    _pad_rows, group_offsets, padded_rows, work_items)
from stellarax.ops.ragged_dot.reference import check_group_sizes, check_ragged_dot_shapes

plgpu = pallas_backends.mosaic_gpu


def _forward_specs(tiles: _Tiles, dtype: Any, transpose_rhs: bool) -> list[Any]:
  """BlockSpecs of the forward's pipelined lhs and rhs tiles (128-byte swizzled)."""
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  lhs_spec = plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=_swizzled(bk, dtype),
                             **_row_operand(tiles))
  if transpose_rhs:
    rhs_spec = plgpu.BlockSpec((bn, bk), lambda k: (0, k), transforms=_swizzled(bk, dtype))
  else:
    rhs_spec = plgpu.BlockSpec((bk, bn), lambda k: (k, 0), transforms=_swizzled(bn, dtype))
  return [lhs_spec, rhs_spec]


def _forward_mma(tiles: _Tiles, transpose_rhs: bool, rows: int) -> _StepMma:
  """A forward step's wgmma: this warpgroup's slice of lhs (M split) or rhs (N split),
  of its first `rows` rows (all of them, or the first half with half_tiles)."""
  _, wn = tiles.wg_shape

  def operands(lhs_smem, rhs_smem):
    wg_row, wg_col = tiles.wg_offsets(lax.axis_index("wg"))
    a = lhs_smem if rows == tiles.block_m else lhs_smem.at[pl.ds(wg_row, rows)]
    if transpose_rhs:  # rhs tiles are (cols, contraction): wgmma reads them transposed.
      b = rhs_smem.at[pl.ds(wg_col, wn)] if tiles.wg_split == "n" else rhs_smem
      return a, b.transpose((1, 0))
    return a, rhs_smem.at[:, pl.ds(wg_col, wn)] if tiles.wg_split == "n" else rhs_smem

  return _StepMma(operands)


def _forward_kernel(items_gmem, lhs_gmem, rhs_gmem, out_gmem, *, tiles: _Tiles,
                    transpose_rhs: bool, check_reads: bool):
  """Persistent loop over (split, work item, n-tile); see the module docstring.

  lhs is (M, C); rhs is (G, C, D), or (G, D, C) with transpose_rhs; out is (M, D), or
  (split_k, M, D) float32 partial sums over the split_k shares of C.
  """
  bm, bn = tiles.block_m, tiles.block_n
  wm, wn = tiles.wg_shape
  num_groups = rhs_gmem.shape[0]
  num_items = items_gmem.shape[1]
  grid_n = out_gmem.shape[-1] // bn // tiles.cluster_n  # column tiles of clusters
  share = lhs_gmem.shape[1] // tiles.split_k  # contraction of one split
  num_steps = share // tiles.block_k

  def pipeline(body, compute_context):
    return _warp_specialized(body, tiles=tiles, num_steps=num_steps,
                             in_specs=_forward_specs(tiles, lhs_gmem.dtype, transpose_rhs),
                             compute_context=compute_context)

  def rhs_window(group, n0, k0):
    cols, contraction = pl.ds(n0, bn), pl.ds(k0, share)
    if transpose_rhs:
      return rhs_gmem.at[group, cols, contraction]
    return rhs_gmem.at[group, contraction, cols]

  @functools.partial(
      pl.run_scoped,
      # One set of pipeline buffers and barriers serves every tile of the loop.
      allocs=pipeline(_ignore, _ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
      o_smem=tiles.epilogue_buffer(out_gmem.dtype),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem):
    wg = lax.axis_index("wg")
    wg_row, wg_col = tiles.wg_offsets(wg)
    release = _StageRelease(tiles.delay_release, allocs, check_reads)

    def store(tile, row_start, row_end, tile_start, n0, split):
      # This warpgroup's rows of the tile (all, or the first half), cut to the item's.
      rows = tile.shape[0]
      top = tile_start + wg_row
      first = jnp.clip(row_start - top, 0, rows)
      last = jnp.clip(row_end - top, 0, rows)
      out = out_gmem if tiles.split_k == 1 else out_gmem.at[split]
      window = out.at[pl.ds(top, rows), pl.ds(n0 + wg_col, wn)]
      _store_rows(tile, o_smem.at[:, pl.ds(wg * wm, rows)], window, first=first,
                  count=last - first)

    @plgpu.nd_loop((tiles.split_k * num_items * grid_n,), collective_axes="sm")
    def _tile_loop(info):
      linear, split = info.index[0], 0
      if tiles.split_k > 1:
        # Split-major: the shares of one tile run far apart, on different SMs.
        split, linear = index_math.div(linear, num_items * grid_n), index_math.rem(linear, num_items * grid_n)
      item_idx, n_tile = tiles.tile_order(linear, num_items, grid_n)
      n_tile = _column_tile(tiles, n_tile)
      group, row_start, row_end, tile_start = (items_gmem[i, item_idx] for i in range(4))
      n0 = pl.multiple_of(n_tile * bn, bn)
      k0 = pl.multiple_of(split * share, tiles.block_k) if tiles.split_k > 1 else 0
      item = (row_start, row_end, tile_start, n0, split)
      has_rows = row_end > row_start

      def multiply(rows):
        """The tile's pipeline, this warpgroup multiplying its first `rows` rows."""
        mma = _forward_mma(tiles, transpose_rhs, rows)

        def compute_context(run):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((rows, wn), jnp.float32))
          def _acc_scope(acc_ref):
            run(acc_ref)
            release.finish(mma, num_steps)
            store(acc_ref[...], *item)

        tile_rows = pl.ds(pl.multiple_of(tile_start, _ROW_ALIGN), bm)
        pipeline(release.body(mma), compute_context)(
            lhs_gmem.at[tile_rows, pl.ds(k0, share)], rhs_window(group, n0, k0),
            allocations=allocs)

      # All three warpgroups take the same branch: they read the same item.
      @pl.when(has_rows & (group < num_groups))
      def _matmul():
        if not tiles.half_tiles:
          multiply(wm)
          return
        # The item's rows end in the first half of this warpgroup's rows (a group's
        # last, short tile): multiply that half. Both variants load the same tiles, so
        # the memory warpgroup may take either (it takes the short one).
        short = row_end - (tile_start + wg_row) <= wm // 2
        pl.when(short)(lambda: multiply(wm // 2))
        pl.when(~short)(lambda: multiply(wm))

      # The rows past the last group: zeros, from the compute warpgroups only.
      @pl.when(has_rows & (group >= num_groups) & (wg < _NUM_COMPUTE_WGS))
      def _zeros():
        store(jnp.zeros((wm, wn), jnp.float32), *item)

    plgpu.wait_smem_to_gmem(0)


def _forward_call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiles: _Tiles,
                  num_programs, interpret, name):
  """Launches the forward kernel; out is (M, D) with D = rhs.shape[1 if transpose_rhs else 2]."""
  num_rows = lhs.shape[0]
  cols_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  # Groups are cut at the real M; the padding rows fall in the zero tail and are dropped.
  padded = _pad_rows(lhs, padded_rows(num_rows, tiles.block_m))
  items = work_items(group_offsets(group_sizes, num_rows), padded.shape[0], tiles.block_m)
  kernel = functools.partial(_forward_kernel, tiles=tiles, transpose_rhs=transpose_rhs,
                             check_reads=pallas_common.detects_races(interpret))
  split = tiles.split_k
  out_shape = ((padded.shape[0], cols_out), out_dtype) if split == 1 else (
      (split, padded.shape[0], cols_out), jnp.float32)
  out = _launch(kernel, jax.ShapeDtypeStruct(*out_shape), (items, padded, rhs),
                num_tiles=split * items.shape[1] * (cols_out // tiles.block_n),
                cluster_n=tiles.cluster_n, num_programs=num_programs, interpret=interpret,
                name=name)
  if split > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out[:num_rows]


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_dot_pallas_mosaic_gpu(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    max_concurrent_steps: int,
    wg_split: str,
    grid_minor_dim: str,
    grid_tile_width: int,
    split_k: int = 1,
    epilogue_slabs: int = 1,
    delay_release: bool = False,
    multicast: bool = False,
    half_tiles: bool = False,
    preferred_element_type: Any = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    num_programs: int | None = None,
) -> jax.Array:
  """Computes `jax.lax.ragged_dot(lhs, rhs, group_sizes)` with a Mosaic GPU kernel (Hopper).

  Args:
    lhs: (M, K) bfloat16 or float16; K a multiple of block_k * split_k.
    rhs: (G, K, N), the same dtype; N a multiple of block_n.
    group_sizes: (G,) integer array (a runtime value); group g is the next
      group_sizes[g] rows of lhs.
    block_m, block_n, block_k, max_concurrent_steps, wg_split, grid_minor_dim,
      grid_tile_width, split_k, epilogue_slabs, delay_release, multicast, half_tiles:
      the tunables (see `validate_tunables`).
    preferred_element_type: output dtype (bfloat16, float16 or float32); defaults
      to lhs.dtype. Accumulation is always float32.
    interpret: run in Mosaic GPU interpret mode on any backend (True, or
      `plgpu.InterpretGPUParams` for its options such as race detection).
    num_programs: CTAs of the persistent grid (default: one per SM, at most one
      per output tile).

  Returns:
    (M, N) array: row m of group g is lhs[m] @ rhs[g]; rows in no group are zero.

  Raises:
    ValueError: for mismatched shapes or dtypes, invalid tunables, or tiles that do
      not divide K and N or overflow shared memory.
  """
  tunables = _tunables_in(locals())
  check_ragged_dot_shapes(lhs, rhs, group_sizes)
  tiles, out_dtype = _prepare(tunables, k=lhs.shape[1], n=rhs.shape[2], product="forward",
                              operands=(("lhs", lhs), ("rhs", rhs)),
                              out_dtype=_out_dtype(preferred_element_type, lhs))
  return _forward_call(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=out_dtype,
                       tiles=tiles, num_programs=num_programs, interpret=interpret,
                       name="ragged_dot_fwd")


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_dot_dlhs_pallas_mosaic_gpu(
    dout: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    max_concurrent_steps: int,
    wg_split: str,
    grid_minor_dim: str,
    grid_tile_width: int,
    split_k: int = 1,
    epilogue_slabs: int = 1,
    delay_release: bool = False,
    multicast: bool = False,
    half_tiles: bool = False,
    preferred_element_type: Any = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    num_programs: int | None = None,
) -> jax.Array:
  """Computes the lhs gradient of ragged_dot: dlhs[m] = dout[m] @ rhs[g(m)].T.

  The forward kernel runs with rhs tiles read transposed by wgmma, so no transposed
  copy of rhs is made. The output columns are K (tiled by block_n) and the
  contraction is over N (stepped by block_k).

  Args:
    dout: (M, N) cotangent of the forward output, the same dtype as rhs.
    rhs: (G, K, N) forward rhs; K a multiple of block_n, N of block_k * split_k.
    group_sizes: (G,) integer array, as in the forward call.
    block_m, block_n, block_k, max_concurrent_steps, wg_split, grid_minor_dim,
      grid_tile_width, split_k, epilogue_slabs, delay_release, multicast, half_tiles,
      interpret, num_programs: as in the forward call.
    preferred_element_type: output dtype; defaults to dout.dtype.

  Returns:
    (M, K) array; rows in no group are zero.

  Raises:
    ValueError: for mismatched shapes or dtypes, or tunables that do not fit.
  """
  tunables = _tunables_in(locals())
  if dout.ndim != 2 or rhs.ndim != 3 or dout.shape[1] != rhs.shape[2]:
    raise ValueError(
        f"The lhs gradient needs dout (M, N) and rhs (G, K, N) with the same N; got "
        f"dout.shape={dout.shape} and rhs.shape={rhs.shape}.")
  check_group_sizes(group_sizes, rhs.shape[0])
  tiles, out_dtype = _prepare(tunables, k=rhs.shape[1], n=rhs.shape[2], product="dlhs",
                              operands=(("dout", dout), ("rhs", rhs)),
                              out_dtype=_out_dtype(preferred_element_type, dout))
  return _forward_call(dout, rhs, group_sizes, transpose_rhs=True, out_dtype=out_dtype,
                       tiles=tiles, num_programs=num_programs, interpret=interpret,
                       name="ragged_dot_dlhs")
