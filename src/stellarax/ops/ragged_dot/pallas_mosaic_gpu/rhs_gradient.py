"""The rhs-gradient kernel of ragged_dot (Mosaic GPU) and its public function.

Scheduling of the rhs-gradient kernel
-------------------------------------
One loop step computes one (group, K tile, N tile) of drhs: a loop of dynamic length
over the group's rows in steps of block_k, starting at the group's first row aligned
down to 8 (the last step moved up to end at row M at most). Rows of a step outside
the group, or already counted by the previous step, exist only in a group's first
and last steps; there they are zeroed in shared memory, in both operands, before the
wgmma: 0 x NaN is NaN, so a non-finite value in a neighbouring group's row (or a row
in no group) of either operand would reach drhs (jax.lax.ragged_dot's gradient
ignores such rows). Each compute warpgroup zeroes the slice of the split operand that
it alone reads (its lhs columns with wg_split="m", its dout columns with "n") and
every other 64-column granule of the operand both read, so the two never write the
same shared memory, and then waits for the other at a barrier. A group's inner steps
pay nothing. An empty group runs no step and stores zeros. Output tiles are disjoint, so CTAs
never write the same element.
"""

from __future__ import annotations

import dataclasses
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
    _column_tile, _DRHS_STATIC, _ignore, _launch, _out_dtype, _prepare, _row_operand, _StageRelease,
    _StepMma, _store_rows, _swizzled, _Tiles, _tunables_in, _warp_specialized)
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.tunables import _NUM_COMPUTE_WGS, _ROW_ALIGN
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.work_items import (
    _pad_rows, group_offsets, padded_rows)
from stellarax.ops.ragged_dot.reference import check_group_sizes

plgpu = pallas_backends.mosaic_gpu

# Columns of one 128-byte swizzle row of 16-bit elements: the narrowest slice of a
# swizzled tile that keeps its tiling.
_GRANULE = 64


def _zero_rows_outside(operand: Any, *, first_row: jax.Array, lo: jax.Array,
                       hi: jax.Array) -> None:
  """Zeroes, in shared memory, the rows of a (block_k, cols) tile outside [lo, hi).

  Row r of the tile is row first_row + r of the array. The values go through
  registers in the wgmma layout; the caller's `commit_smem` makes the stores visible
  to the next wgmma.
  """
  values = operand[...]
  rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, values.shape, 0), plgpu.Layout.WGMMA)
  rows = rows + first_row
  keep = (rows >= lo) & (rows < hi)
  operand[...] = jnp.where(keep, values, jnp.zeros_like(values))


def _zero_share_of_rows_outside(operand: Any, wg: jax.Array, **rows: jax.Array) -> None:
  """This warpgroup's share of `_zero_rows_outside` on a tile that every compute
  warpgroup reads: the 64-column granules n with n % _NUM_COMPUTE_WGS == wg (a traced
  offset: one code path for every warpgroup)."""
  cols = operand.shape[1]
  for n in range(-(-cols // (_NUM_COMPUTE_WGS * _GRANULE))):
    col = pl.multiple_of((n * _NUM_COMPUTE_WGS + wg) * _GRANULE, _GRANULE)

    def _granule(col=col):
      _zero_rows_outside(operand.at[:, pl.ds(col, _GRANULE)], **rows)

    if cols % (_NUM_COMPUTE_WGS * _GRANULE):
      pl.when(col < cols)(_granule)  # Fewer granules left than warpgroups.
    else:
      _granule()


def _drhs_specs(tiles: _Tiles, dtype: Any, index_map) -> list[Any]:
  """BlockSpecs of the rhs gradient's (block_k rows) x K and x N tiles. Rows are
  addressed by element (`pl.Element`), so a step may start at any multiple of 8."""
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  return [plgpu.BlockSpec((pl.Element(bk), bm), index_map, transforms=_swizzled(bm, dtype),
                          **_row_operand(tiles)),
          plgpu.BlockSpec((pl.Element(bk), bn), index_map, transforms=_swizzled(bn, dtype))]


@dataclasses.dataclass(frozen=True)
class _GroupSteps:
  """The row steps of one group in the rhs-gradient kernel (traced values).

  Steps start at the group's first row aligned down to 8 and advance by block_k; the
  last may be moved up to end at the last row of the (padded) array.
  """
  lo: jax.Array
  hi: jax.Array
  aligned: jax.Array
  num_steps: jax.Array
  num_rows: int
  block_k: int

  @classmethod
  def create(cls, lo, hi, *, num_rows: int, block_k: int) -> _GroupSteps:
    aligned = lo - index_math.rem(lo, _ROW_ALIGN)
    num_steps = jnp.where(hi > lo, index_math.cdiv(hi - aligned, block_k), 0)
    return cls(lo, hi, aligned, num_steps, num_rows, block_k)

  def first_row(self, step: jax.Array) -> jax.Array:
    """The array row of the step's first tile row (a multiple of 8)."""
    return jnp.minimum(self.aligned + step * self.block_k, self.num_rows - self.block_k)

  def first_valid(self, step: jax.Array) -> jax.Array:
    """The first row the step contributes: rows before it belong to another group or
    to the previous step (when the step was moved up)."""
    return jnp.maximum(self.lo, self.aligned + step * self.block_k)


def _drhs_mma(tiles: _Tiles, rows: _GroupSteps, edge_ready: Any) -> _StepMma:
  """An rhs-gradient step's wgmma: acc (K x N part) += lhs_tile.T @ dout_tile, rows
  outside the group zeroed first in both tiles (only a group's edge steps have any);
  the compute warpgroups meet at `edge_ready` after zeroing."""
  wm, wn = tiles.wg_shape

  def slices(lhs_smem, dout_smem):
    wg_row, wg_col = tiles.wg_offsets(lax.axis_index("wg"))
    a = lhs_smem.at[:, pl.ds(wg_row, wm)] if tiles.wg_split == "m" else lhs_smem
    b = dout_smem.at[:, pl.ds(wg_col, wn)] if tiles.wg_split == "n" else dout_smem
    return a, b

  def operands(lhs_smem, dout_smem):
    a, b = slices(lhs_smem, dout_smem)
    return a.transpose((1, 0)), b

  def prepare(step, lhs_smem, dout_smem):
    a, b = slices(lhs_smem, dout_smem)
    first, valid = rows.first_row(step), rows.first_valid(step)
    outside = dict(first_row=first, lo=valid, hi=rows.hi)

    @pl.when((first < valid) | (first + tiles.block_k > rows.hi))
    def _mask():
      # The split operand's slice only this warpgroup reads, then its share of the
      # operand both read; the other warpgroup's share must be zeroed before the wgmma.
      own, both_read = (a, dout_smem) if tiles.wg_split == "m" else (b, lhs_smem)
      _zero_rows_outside(own, **outside)
      _zero_share_of_rows_outside(both_read, lax.axis_index("wg"), **outside)
      plgpu.commit_smem()
      plgpu.barrier_arrive(edge_ready)
      plgpu.barrier_wait(edge_ready)

  return _StepMma(operands, prepare)


def _drhs_kernel(offsets_gmem, lhs_gmem, dout_gmem, out_gmem, *, tiles: _Tiles,
                 check_reads: bool):
  """Persistent loop over (group, K tile, N tile) of drhs; see the module docstring.

  lhs is (M, K) and dout (M, N), M padded to a multiple of 8 and at least block_k;
  out is (G, K, N).
  """
  bm, bn = tiles.block_m, tiles.block_n
  wm, wn = tiles.wg_shape
  num_groups, contract_k, cols_n = out_gmem.shape
  grid_m, grid_n = contract_k // bm, cols_n // bn // tiles.cluster_n

  def pipeline(body, compute_context, num_steps, index_map):
    return _warp_specialized(body, tiles=tiles, num_steps=num_steps,
                             in_specs=_drhs_specs(tiles, lhs_gmem.dtype, index_map),
                             compute_context=compute_context)

  @functools.partial(
      pl.run_scoped,
      # The real grid is dynamic (a group's row steps); this static one has as many
      # steps as stages, so that the allocations keep every stage.
      allocs=pipeline(_ignore, _ignore, tiles.max_concurrent_steps,
                      lambda s: (s, 0)).get_allocations(lhs_gmem, dout_gmem),
      o_smem=tiles.epilogue_buffer(out_gmem.dtype),
      edge_ready=plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem, edge_ready):
    wg = lax.axis_index("wg")
    wg_row, wg_col = tiles.wg_offsets(wg)
    release = _StageRelease(tiles.delay_release, allocs, check_reads)

    @plgpu.nd_loop((num_groups, grid_m * grid_n), collective_axes="sm")
    def _tile_loop(info):
      group, linear = info.index
      m_tile, n_tile = tiles.tile_order(linear, grid_m, grid_n)
      n_tile = _column_tile(tiles, n_tile)
      m0, n0 = pl.multiple_of(m_tile * bm, bm), pl.multiple_of(n_tile * bn, bn)
      rows = _GroupSteps.create(offsets_gmem[group], offsets_gmem[group + 1],
                                num_rows=lhs_gmem.shape[0], block_k=tiles.block_k)

      def compute_context(run):
        # An empty group runs no step and stores the zero-initialized accumulator.
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
        def _acc_scope(acc_ref):
          run(acc_ref)
          release.finish(mma, rows.num_steps)
          window = out_gmem.at[group, pl.ds(m0 + wg_row, wm), pl.ds(n0 + wg_col, wn)]
          _store_rows(acc_ref[...], o_smem.at[:, pl.ds(wg * wm, wm)], window, first=0,
                      count=wm)

      index_map = lambda step: (pl.multiple_of(rows.first_row(step), _ROW_ALIGN), 0)
      mma = _drhs_mma(tiles, rows, edge_ready)
      pipeline(release.body(mma), compute_context, rows.num_steps, index_map)(
          lhs_gmem.at[:, pl.ds(m0, bm)], dout_gmem.at[:, pl.ds(n0, bn)], allocations=allocs)

    plgpu.wait_smem_to_gmem(0)


def _drhs_call(lhs, dout, group_sizes, num_groups, *, out_dtype, tiles: _Tiles, num_programs,
               interpret):
  """Launches the rhs-gradient kernel; out is (G, K, N)."""
  num_rows, contract_k = lhs.shape
  cols_n = dout.shape[1]
  rows = padded_rows(num_rows, tiles.block_k)
  offsets = group_offsets(group_sizes, num_rows)
  kernel = functools.partial(_drhs_kernel, tiles=tiles,
                             check_reads=pallas_common.detects_races(interpret))
  num_tiles = num_groups * (contract_k // tiles.block_m) * (cols_n // tiles.block_n)
  return _launch(kernel, jax.ShapeDtypeStruct((num_groups, contract_k, cols_n), out_dtype),
                 (offsets, _pad_rows(lhs, rows), _pad_rows(dout, rows)), num_tiles=num_tiles,
                 cluster_n=tiles.cluster_n, num_programs=num_programs, interpret=interpret,
                 name="ragged_dot_drhs")


@functools.partial(jax.jit, static_argnames=("num_groups", *_DRHS_STATIC))
def ragged_dot_drhs_pallas_mosaic_gpu(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    num_groups: int,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    max_concurrent_steps: int,
    wg_split: str,
    grid_minor_dim: str,
    grid_tile_width: int,
    epilogue_slabs: int = 1,
    delay_release: bool = False,
    multicast: bool = False,
    preferred_element_type: Any = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    num_programs: int | None = None,
) -> jax.Array:
  """Computes the rhs gradient of ragged_dot: drhs[g] = lhs[rows of g].T @ dout[rows of g].

  One loop step per (group, K tile, N tile) runs over the group's rows in steps of
  block_k; an empty group stores zeros.

  Args:
    lhs: (M, K) forward lhs; K a multiple of block_m.
    dout: (M, N) cotangent of the forward output, the same dtype as lhs; N a
      multiple of block_n.
    group_sizes: (num_groups,) integer array, as in the forward call.
    num_groups: G (static).
    block_m, block_n: the drhs[g] tile (K x N); block_k: rows per pipelined step;
      max_concurrent_steps, wg_split, grid_minor_dim, grid_tile_width, epilogue_slabs,
      delay_release, multicast, interpret, num_programs: as in the forward call.
    preferred_element_type: output dtype; defaults to lhs.dtype.

  Returns:
    (G, K, N) array.

  Raises:
    ValueError: for mismatched shapes or dtypes, or tunables that do not fit.
  """
  tunables = _tunables_in(locals())
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(
        f"The rhs gradient needs lhs (M, K) and dout (M, N) with the same M; got "
        f"lhs.shape={lhs.shape} and dout.shape={dout.shape}.")
  check_group_sizes(group_sizes, num_groups)
  tiles, out_dtype = _prepare(tunables, k=lhs.shape[1], n=dout.shape[1], product="drhs",
                              operands=(("lhs", lhs), ("dout", dout)),
                              out_dtype=_out_dtype(preferred_element_type, lhs))
  return _drhs_call(lhs, dout, group_sizes, num_groups, out_dtype=out_dtype, tiles=tiles,
                    num_programs=num_programs, interpret=interpret)
