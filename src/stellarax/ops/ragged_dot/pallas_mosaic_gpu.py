"""Pallas Mosaic GPU kernels for ragged_dot on Hopper (wgmma, TMA, warp-specialized pipelines).

Three products, each a plain function with keyword-only tunables:

  ragged_dot_pallas_mosaic_gpu       out[m] = lhs[m] @ rhs[g(m)]            (M, N)
  ragged_dot_dlhs_pallas_mosaic_gpu  dlhs[m] = dout[m] @ rhs[g(m)].T        (M, K)
  ragged_dot_drhs_pallas_mosaic_gpu  drhs[g] = lhs[rows g].T @ dout[rows g] (G, K, N)

Semantics are those of `jax.lax.ragged_dot` (see `reference.py`): groups are
consecutive row ranges whose sizes are runtime values; rows past the last group give
zeros; a group that runs past row M is cut there; empty groups are allowed.

Kernel shape
------------
Every kernel is a persistent `plgpu.kernel`: one CTA per SM loops over output tiles
(`plgpu.nd_loop`). A CTA runs three warpgroups: two compute warpgroups that each own
half of the block_m x block_n output tile (split along M or N, `wg_split`) and issue
wgmma on 128-byte-swizzled shared-memory tiles, and one memory warpgroup that issues
the TMA loads of `max_concurrent_steps` pipelined block_k steps ahead
(`plgpu.emit_pipeline_warp_specialized`). The accumulator is float32 in registers;
the epilogue casts it, writes it to shared memory and stores it with TMA. In all
three products block_m x block_n is the output tile and block_k the contraction step.

Scheduling of the forward (and lhs-gradient) kernel
---------------------------------------------------
The rows are cut into work items in jnp before the kernel: each group, and then the
rows past the last group (which get zeros), is split into tiles of at most block_m
rows that start at the group's first row. The items partition [0, M) and their
number is bounded statically by cdiv(M, block_m) + G; the items past the real count
have an empty row range and do nothing. A CTA loop step computes one (item, n-tile):
a K loop over a block_m-row tile that starts at the item's first row (moved up to end
at row M at most, so TMA never reads past the array; rows of the tile outside the
item belong to a neighbouring group and are computed but not stored), then TMA
stores of exactly the item's rows. A TMA box has a static size, so a ragged row
count is stored as a ladder of power-of-two boxes (at most log2(block_m) + 1 stores).

Why this is race-free on a GPU, where CTAs run in parallel in any order: the
persistent loop hands every linear tile index to exactly one CTA (`nd_loop` strides
by the grid size) and `planar_snake` is a bijection from linear indices to (item,
n-tile), so every (item, n-tile) is computed once; items partition the rows and the
stores write only the item's rows, so no output element is written twice and none
is read back. Within a CTA the two compute warpgroups store disjoint halves of the
tile from their own shared-memory buffers, and each waits for its previous TMA
stores to finish reading its buffer before overwriting it. Interpret mode runs the
CTAs one after another and cannot show a race between them; the partition and the
bijection are what make the kernel correct, and the tests check them directly.

Scheduling of the rhs-gradient kernel
-------------------------------------
One loop step computes one (group, K tile, N tile) of drhs: a loop of dynamic length
over the group's rows in steps of block_k, starting at the group's first row (the
last step moved up to end at row M at most). Rows of a step outside the group (only
in the last step) are zeroed in shared memory before the wgmma; each compute
warpgroup zeroes only the operand slice that it alone reads (its lhs columns with
wg_split="m", its dout columns with wg_split="n"), so the two never write the same
shared memory. An empty group runs no step and stores zeros. Output tiles are
disjoint, so CTAs never write the same element.

Limits: bfloat16 and float16 operands only (wgmma's 16-bit path; float32 operands are
refused so that dispatch falls back); the output columns and the contraction size of
the forward and lhs-gradient kernels must be multiples of the tiles (K and N
multiples of 64 at least), so TMA never reads or writes out of bounds.
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
from jax.experimental.pallas import mosaic_gpu as plgpu

from stellarax.core.config import check_choice, check_power_of_two
from stellarax.ops.ragged_dot.reference import (
    check_group_sizes,
    check_ragged_dot_shapes,
    group_bounds,
)

# Tile sides are multiples of 64: a wgmma instruction covers 64 rows, and a 128-byte
# swizzled bfloat16 tile is sliced between warpgroups in 64-element granules.
BLOCK_CHOICES = (64, 128, 192, 256)
BLOCK_K_CHOICES = (64, 128)
WG_SPLITS = ("m", "n")
GRID_MINOR_DIMS = ("m", "n")
MAX_CONCURRENT_STEPS = 8
MAX_GRID_TILE_WIDTH = 64
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# Two compute warpgroups per CTA (each holds half of the accumulator) and one memory
# warpgroup that issues the TMA loads; it keeps few registers (40, as for Hopper
# matmuls), so each compute warpgroup may use up to 232.
_NUM_COMPUTE_WGS = 2
_MEMORY_REGISTERS = 40
# A compute warpgroup's float32 accumulator of at most 128 x 128 takes 128 registers
# per thread, which leaves room for addresses and the epilogue.
_MAX_WG_ACC = 128 * 128
# Shared memory one H200 CTA may use (227 KiB), less a little for barriers.
_SMEM_BYTES = 227 * 1024 - 1024
# SMs of the H200, the target; used when no GPU (and no abstract device) tells.
_DEFAULT_NUM_SMS = 132
# Row offsets of TMA copies into swizzled shared memory must be multiples of 8.
_ROW_ALIGN = 8
_TUNABLE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "wg_split",
                  "grid_minor_dim", "grid_tile_width")


# --------------------------------------------------------------------------- configs


def _check_int(name: str, value: Any) -> None:
  if not isinstance(value, int) or isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be an int.")


def wg_tile(block_m: int, block_n: int, wg_split: str) -> tuple[int, int]:
  """Returns the (rows, cols) of the output tile one compute warpgroup owns."""
  if wg_split == "m":
    return block_m // _NUM_COMPUTE_WGS, block_n
  return block_m, block_n // _NUM_COMPUTE_WGS


def validate_tunables(*, block_m: int, block_n: int, block_k: int, max_concurrent_steps: int,
                      wg_split: str, grid_minor_dim: str, grid_tile_width: int) -> None:
  """Checks the tunables of the three ragged_dot Mosaic GPU kernels.

  Args:
    block_m, block_n: the output tile of a CTA (forward and lhs gradient: rows x
      columns of the output; rhs gradient: K x N of drhs[g]).
    block_k: contraction step (K, N or rows) of one pipeline stage.
    max_concurrent_steps: pipeline stages in flight (shared-memory buffers per operand).
    wg_split: "m" or "n": how the two compute warpgroups split the output tile.
    grid_minor_dim: "m" or "n": the tile-grid dimension that varies fastest within
      a band of `grid_tile_width` tiles (L2 locality; see `plgpu.planar_snake`).
    grid_tile_width: width of those bands, a power of two in [1, 64].

  Raises:
    ValueError: naming the first tunable the kernels cannot use, what was given and
      what is expected.
  """
  for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k),
                      ("max_concurrent_steps", max_concurrent_steps),
                      ("grid_tile_width", grid_tile_width)):
    _check_int(name, value)
  for name, value in (("block_m", block_m), ("block_n", block_n)):
    if value not in BLOCK_CHOICES:
      raise ValueError(f"{name}={value!r} must be one of {BLOCK_CHOICES} (a multiple of 64, "
                       "the wgmma and swizzle granule, of at most 256).")
  if block_k not in BLOCK_K_CHOICES:
    raise ValueError(f"block_k={block_k!r} must be one of {BLOCK_K_CHOICES} (whole 128-byte "
                     "swizzle rows of 16-bit elements).")
  if not 2 <= max_concurrent_steps <= MAX_CONCURRENT_STEPS:
    raise ValueError(f"max_concurrent_steps={max_concurrent_steps!r} must be in [2, "
                     f"{MAX_CONCURRENT_STEPS}] so that TMA loads overlap the wgmma.")
  check_choice("wg_split", wg_split, WG_SPLITS)
  check_choice("grid_minor_dim", grid_minor_dim, GRID_MINOR_DIMS)
  check_power_of_two("grid_tile_width", grid_tile_width, maximum=MAX_GRID_TILE_WIDTH)
  wm, wn = wg_tile(block_m, block_n, wg_split)
  if wm % 64 or wn % 64:
    raise ValueError(
        f"block_m={block_m}, block_n={block_n} with wg_split={wg_split!r} gives each of the "
        f"{_NUM_COMPUTE_WGS} compute warpgroups a {wm}x{wn} tile; both sides must be multiples "
        f"of 64. Split the other dimension or double the block being split.")
  if wm * wn > _MAX_WG_ACC:
    raise ValueError(
        f"block_m={block_m}, block_n={block_n} with wg_split={wg_split!r} gives each compute "
        f"warpgroup a {wm}x{wn} float32 accumulator; at most {_MAX_WG_ACC} elements "
        "(128 x 128) fit in registers. Use smaller blocks.")


def smem_bytes(*, block_m: int, block_n: int, block_k: int, max_concurrent_steps: int,
               itemsize: int = 2, out_itemsize: int = 2) -> int:
  """Shared memory of a CTA: the pipelined operand tiles and the epilogue tile."""
  stages = max_concurrent_steps * (block_m + block_n) * block_k * itemsize
  return stages + block_m * block_n * out_itemsize


def check_fits(*, rows_out: int, cols_out: int, contract: int | None, block_m: int,
               block_n: int, block_k: int, max_concurrent_steps: int, out_itemsize: int,
               what: str, **_) -> None:
  """Checks that tiles divide a product's output and contraction and fit in shared memory.

  Args:
    rows_out: the output rows tiled by block_m (None-free; ragged rows pass 0).
    cols_out: the output columns tiled by block_n.
    contract: the contraction size stepped by block_k, or None when it is ragged.
    what: the product's name for the message.

  Raises:
    ValueError: when a block does not divide its dimension or the tiles overflow
      the H200's shared memory.
  """
  checks = [("block_n", block_n, "output columns", cols_out)]
  if rows_out:
    checks.append(("block_m", block_m, "output rows", rows_out))
  if contract is not None:
    checks.append(("block_k", block_k, "contraction size", contract))
  for name, block, label, dim in checks:
    if dim % block:
      raise ValueError(
          f"{name}={block} must divide the {label} {dim} of the {what} (TMA tiles must not "
          f"run past the array). Pick a {name} that divides {dim}.")
  used = smem_bytes(block_m=block_m, block_n=block_n, block_k=block_k,
                    max_concurrent_steps=max_concurrent_steps, out_itemsize=out_itemsize)
  if used > _SMEM_BYTES:
    raise ValueError(
        f"block_m={block_m}, block_n={block_n}, block_k={block_k} with "
        f"max_concurrent_steps={max_concurrent_steps} need {used} bytes of shared memory for "
        f"the {what}; an H200 CTA has {_SMEM_BYTES}. Use fewer stages or smaller blocks.")


# --------------------------------------------------------------------------- metadata


def group_offsets(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """Returns (G + 1,) int32 offsets: group g owns rows [offsets[g], offsets[g + 1]), cut at M."""
  _, ends = group_bounds(group_sizes, num_rows)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def padded_rows(num_rows: int, block: int) -> int:
  """The rows the kernels work on: M rounded up to a multiple of 8, and at least one tile.

  TMA copies into 128-byte-swizzled shared memory move whole 8-row tiles, so Mosaic
  needs every row offset to be a multiple of 8; with this padding (a copy only when M
  is not a multiple of 8 or below one tile) the last tile can end exactly at the
  last row and no copy reads past the array.
  """
  return max(-(-num_rows // _ROW_ALIGN) * _ROW_ALIGN, block)


def num_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
  """A static bound on the work items: tiles of the G groups plus the zero tail.

  Args:
    num_rows: the padded rows (`padded_rows`).
    num_groups: G.
    block_m: rows per tile.
  """
  # The G + 1 parts (groups and the tail) span num_rows rows; each starts up to 7
  # rows early (aligned down to 8) and rounds up by less than one tile.
  return pl.cdiv(num_rows + (_ROW_ALIGN - 1) * (num_groups + 1), block_m) + num_groups + 1


def work_items(offsets: jax.Array, num_rows: int, block_m: int) -> jax.Array:
  """Splits the rows into work items, in jnp outside the kernel.

  Every group, and then the rows past the last group (part G, which gets zeros), is
  cut into tiles of block_m rows, the first starting at the part's first row aligned
  down to a multiple of 8 (TMA row offsets must be). An item is the part's rows
  within one tile, so the items partition [0, num_rows) and each output row belongs
  to exactly one item.

  Args:
    offsets: (G + 1,) int32 group offsets (`group_offsets`), cut at the real M.
    num_rows: the padded rows (`padded_rows`), a multiple of 8 and >= block_m.
    block_m: rows per tile.

  Returns:
    (4, num_work_items) int32: per item the part (group id, or G for the zero tail),
    its rows [row_start, row_end), and tile_start, the first row of the block_m-row
    tile the kernel loads (a multiple of 8, moved up so that the tile ends at row
    num_rows at most; it still covers the item's rows). Items past the real count
    have part G and an empty range.
  """
  num_groups = offsets.shape[0] - 1
  part_ends = jnp.concatenate([offsets[1:], jnp.full((1,), num_rows, jnp.int32)])
  part_aligned = offsets - offsets % _ROW_ALIGN
  part_tiles = jnp.where(part_ends > offsets, pl.cdiv(part_ends - part_aligned, block_m), 0)
  tiles_end = jnp.cumsum(part_tiles)
  items = jnp.arange(num_work_items(num_rows, num_groups, block_m), dtype=jnp.int32)
  # Parts whose tiles all come before an item are counted, so this is the item's
  # part; empty parts have no tiles and are skipped.
  part = jnp.searchsorted(tiles_end, items, side="right").astype(jnp.int32)
  active = part <= num_groups
  part = jnp.minimum(part, num_groups)
  tile = part_aligned[part] + (items - (tiles_end[part] - part_tiles[part])) * block_m
  row_start = jnp.where(active, jnp.maximum(offsets[part], tile), 0)
  row_end = jnp.where(active, jnp.minimum(part_ends[part], tile + block_m), 0)
  tile_start = jnp.where(active, jnp.minimum(tile, num_rows - block_m), 0)
  return jnp.stack([part, row_start, row_end, tile_start]).astype(jnp.int32)


def num_sms() -> int:
  """The SMs the persistent grid fills: the abstract device's (when lowering for a
  simulated GPU), else the default GPU's, else the H200's 132."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None and getattr(abstract, "num_cores", None):
    return int(abstract.num_cores)
  device = jax.devices()[0]
  if device.platform == "gpu" and getattr(device, "core_count", None):
    return int(device.core_count)
  return _DEFAULT_NUM_SMS


# --------------------------------------------------------------------------- kernel parts


@dataclasses.dataclass(frozen=True)
class _Tiles:
  """The static tiling of one kernel launch (a validated config)."""
  block_m: int
  block_n: int
  block_k: int
  max_concurrent_steps: int
  wg_split: str
  grid_minor_dim: str
  grid_tile_width: int

  @property
  def wg_shape(self) -> tuple[int, int]:
    return wg_tile(self.block_m, self.block_n, self.wg_split)

  def tile_order(self, linear: jax.Array, grid_m: int, grid_n: int) -> tuple[jax.Array, jax.Array]:
    """Maps a linear tile index to (m-tile, n-tile), bijectively, in L2-friendly order."""
    minor = 0 if self.grid_minor_dim == "m" else 1
    return plgpu.planar_snake(linear, (grid_m, grid_n), minor, self.grid_tile_width)

  def wg_offsets(self, wg: jax.Array) -> tuple[jax.Array | int, jax.Array | int]:
    """The (row, col) of a compute warpgroup's part within the CTA tile."""
    wm, wn = self.wg_shape
    # `multiple_of` lets Mosaic prove that the slices keep the 128-byte swizzle tiling.
    if self.wg_split == "m":
      return pl.multiple_of(wg * wm, wm), 0
    return 0, pl.multiple_of(wg * wn, wn)


def _swizzled(block_minor: int, dtype: Any) -> tuple[Any, ...]:
  """Transforms of a shared-memory operand tile: 128-byte swizzle (wgmma's fastest)."""
  swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _store_rows(tile: jax.Array, o_smem: Any, out_gmem: Any, *, first: jax.Array,
                count: jax.Array) -> None:
  """Stores rows [first, first + count) of a register tile to the same rows of out_gmem.

  The tile goes to this warpgroup's shared-memory buffer and then to GMEM with TMA.
  A TMA box has a static size, so `count` (a runtime value in [0, rows]) is stored
  as a ladder of power-of-two boxes, largest first: its binary digits.

  Args:
    tile: (rows, cols) values in registers.
    o_smem: (rows, cols) shared-memory buffer of this warpgroup, unswizzled so that
      a box may start at any row.
    out_gmem: (rows, cols) GMEM window of the output, aligned with the tile.
    first, count: the rows to store.
  """
  # The previous tile's stores must have finished reading the buffer.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  o_smem[...] = tile.astype(o_smem.dtype)
  plgpu.commit_smem()
  rows = o_smem.shape[0]
  box = 1 << (rows.bit_length() - 1)
  start = first
  while box:
    # Boxes are bound in a closure per size, so each `pl.when` sees its own.
    def store(box=box, start=start):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, box)], out_gmem.at[pl.ds(start, box)])

    pl.when((count & box) != 0)(store)
    start = start + (count & box)
    box //= 2


def _wgmma_step(acc_ref: Any, a: Any, b: Any) -> Any:
  """One pipeline step: acc += a @ b on the tensor cores, completed before the stage is
  released (the memory warpgroup may then overwrite its buffers)."""
  plgpu.wgmma(acc_ref, a, b)
  plgpu.wgmma_wait(0)
  return acc_ref


def _warp_specialized(body, *, tiles: _Tiles, num_steps, in_specs, compute_context):
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(num_steps,),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=in_specs,
      wg_axis="wg",
      num_compute_wgs=_NUM_COMPUTE_WGS,
      max_concurrent_steps=tiles.max_concurrent_steps,
      compute_context=compute_context,
  )


def _ignore(*args, **kwargs):
  del args, kwargs


def _launch(body, out_shape: jax.ShapeDtypeStruct, operands, *, num_tiles: int,
            num_programs: int | None, interpret: Any, name: str):
  """Runs `body` as a persistent kernel of min(SMs, tiles) CTAs of 3 warpgroups."""
  grid = max(1, min(num_programs or num_sms(), num_tiles))
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  kernel = plgpu.kernel(
      body,
      out_type=out_shape,
      grid=(grid,),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret or None,
      kernel_name=name,
  )
  return kernel(*operands)


# --------------------------------------------------------------------------- forward


def _forward_kernel(items_gmem, lhs_gmem, rhs_gmem, out_gmem, *, tiles: _Tiles,
                    transpose_rhs: bool):
  """Persistent loop over (work item, n-tile); see the module docstring.

  lhs is (M, C); rhs is (G, C, D), or (G, D, C) with transpose_rhs; out is (M, D).
  """
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  wm, wn = tiles.wg_shape
  num_groups = rhs_gmem.shape[0]
  contract = lhs_gmem.shape[1]
  num_items, grid_n = items_gmem.shape[1], out_gmem.shape[1] // bn
  dtype = lhs_gmem.dtype
  lhs_spec = plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=_swizzled(bk, dtype))
  if transpose_rhs:
    rhs_spec = plgpu.BlockSpec((bn, bk), lambda k: (0, k), transforms=_swizzled(bk, dtype))
  else:
    rhs_spec = plgpu.BlockSpec((bk, bn), lambda k: (k, 0), transforms=_swizzled(bn, dtype))

  def pipeline(body, compute_context):
    return _warp_specialized(body, tiles=tiles, num_steps=contract // bk,
                             in_specs=[lhs_spec, rhs_spec], compute_context=compute_context)

  def rhs_window(group, n0):
    cols = pl.ds(n0, bn)
    return rhs_gmem.at[group, cols, :] if transpose_rhs else rhs_gmem.at[group, :, cols]

  def mma(_, lhs_smem, rhs_smem, acc_ref):
    wg_row, wg_col = tiles.wg_offsets(lax.axis_index("wg"))
    a = lhs_smem.at[pl.ds(wg_row, wm)] if tiles.wg_split == "m" else lhs_smem
    if transpose_rhs:
      b = rhs_smem.at[pl.ds(wg_col, wn)] if tiles.wg_split == "n" else rhs_smem
      b = b.transpose((1, 0))
    else:
      b = rhs_smem.at[:, pl.ds(wg_col, wn)] if tiles.wg_split == "n" else rhs_smem
    return _wgmma_step(acc_ref, a, b)

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(_ignore, _ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
      o_smem=plgpu.SMEM((_NUM_COMPUTE_WGS * wm, wn), out_gmem.dtype),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem):
    wg = lax.axis_index("wg")
    wg_row, wg_col = tiles.wg_offsets(wg)

    def store(tile, row_start, row_end, tile_start, n0):
      # This warpgroup's rows of the tile, cut to the item's rows.
      top = tile_start + wg_row
      first = jnp.clip(row_start - top, 0, wm)
      last = jnp.clip(row_end - top, 0, wm)
      window = out_gmem.at[pl.ds(top, wm), pl.ds(n0 + wg_col, wn)]
      _store_rows(tile, o_smem.at[pl.ds(wg * wm, wm)], window, first=first, count=last - first)

    @plgpu.nd_loop((num_items * grid_n,), collective_axes="sm")
    def _tile_loop(info):
      item_idx, n_tile = tiles.tile_order(info.index[0], num_items, grid_n)
      group, row_start, row_end, tile_start = (items_gmem[i, item_idx] for i in range(4))
      n0 = pl.multiple_of(n_tile * bn, bn)
      item = (row_start, row_end, tile_start, n0)
      has_rows = row_end > row_start

      def compute_context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
        def _acc_scope(acc_ref):
          run(acc_ref)
          store(acc_ref[...], *item)

      @pl.when(has_rows & (group < num_groups))
      def _matmul():
        rows = pl.ds(pl.multiple_of(tile_start, _ROW_ALIGN), bm)
        pipeline(mma, compute_context)(
            lhs_gmem.at[rows], rhs_window(group, n0), allocations=allocs)

      # The rows past the last group: zeros, from the compute warpgroups only.
      @pl.when(has_rows & (group >= num_groups) & (wg < _NUM_COMPUTE_WGS))
      def _zeros():
        store(jnp.zeros((wm, wn), jnp.float32), *item)

    plgpu.wait_smem_to_gmem(0)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """Pads x with zero rows up to `rows` (small inputs only: M below one tile)."""
  return x if x.shape[0] >= rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _forward_call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiles: _Tiles,
                  num_programs, interpret, name):
  """Launches the forward kernel; out is (M, D) with D = rhs.shape[1 if transpose_rhs else 2]."""
  num_rows = lhs.shape[0]
  cols_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  # Groups are cut at the real M; rows added to reach one tile get zeros and are dropped.
  padded = _pad_rows(lhs, padded_rows(num_rows, tiles.block_m))
  items = work_items(group_offsets(group_sizes, num_rows), padded.shape[0], tiles.block_m)
  kernel = functools.partial(_forward_kernel, tiles=tiles, transpose_rhs=transpose_rhs)
  out = _launch(kernel, jax.ShapeDtypeStruct((padded.shape[0], cols_out), out_dtype),
                (items, padded, rhs), num_tiles=items.shape[1] * (cols_out // tiles.block_n),
                num_programs=num_programs, interpret=interpret, name=name)
  return out[:num_rows]


# --------------------------------------------------------------------------- rhs gradient


def _zero_rows_outside(operand: Any, *, first_row: jax.Array, lo: jax.Array,
                       hi: jax.Array) -> None:
  """Zeroes, in shared memory, the rows of a (block_k, cols) tile outside [lo, hi).

  Row r of the tile is row first_row + r of the array. The values go through
  registers in the wgmma layout; the fence makes them visible to the next wgmma.
  """
  values = operand[...]
  rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, values.shape, 0), plgpu.Layout.WGMMA)
  rows = rows + first_row
  keep = (rows >= lo) & (rows < hi)
  operand[...] = jnp.where(keep, values, jnp.zeros_like(values))
  plgpu.commit_smem()


def _drhs_kernel(offsets_gmem, lhs_gmem, dout_gmem, out_gmem, *, tiles: _Tiles):
  """Persistent loop over (group, K tile, N tile) of drhs; see the module docstring.

  lhs is (M, K) and dout (M, N), M padded to a multiple of 8 and at least block_k;
  out is (G, K, N).
  """
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  wm, wn = tiles.wg_shape
  num_rows = lhs_gmem.shape[0]
  num_groups, contract_k, cols_n = out_gmem.shape
  grid_m, grid_n = contract_k // bm, cols_n // bn
  dtype = lhs_gmem.dtype

  def pipeline(body, compute_context, num_steps, index_map):
    # Rows are addressed by element (pl.Element): steps start at any multiple of 8.
    specs = [plgpu.BlockSpec((pl.Element(bk), bm), index_map, transforms=_swizzled(bm, dtype)),
             plgpu.BlockSpec((pl.Element(bk), bn), index_map, transforms=_swizzled(bn, dtype))]
    return _warp_specialized(body, tiles=tiles, num_steps=num_steps, in_specs=specs,
                             compute_context=compute_context)

  @functools.partial(
      pl.run_scoped,
      # The real grid is dynamic (a group's row steps); this static one has as many
      # steps as stages, so that the allocations keep every stage.
      allocs=pipeline(_ignore, _ignore, tiles.max_concurrent_steps,
                      lambda s: (s, 0)).get_allocations(lhs_gmem, dout_gmem),
      o_smem=plgpu.SMEM((_NUM_COMPUTE_WGS * wm, wn), out_gmem.dtype),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem):
    wg = lax.axis_index("wg")
    wg_row, wg_col = tiles.wg_offsets(wg)

    @plgpu.nd_loop((num_groups, grid_m * grid_n), collective_axes="sm")
    def _tile_loop(info):
      group, linear = info.index
      m_tile, n_tile = tiles.tile_order(linear, grid_m, grid_n)
      m0, n0 = pl.multiple_of(m_tile * bm, bm), pl.multiple_of(n_tile * bn, bn)
      lo, hi = offsets_gmem[group], offsets_gmem[group + 1]
      aligned = lo - lax.rem(lo, _ROW_ALIGN)
      num_steps = jnp.where(hi > lo, pl.cdiv(hi - aligned, bk), 0)

      def step_rows(step):
        # Steps start at the group's first row aligned down to 8; the last may move
        # up to end at the last row (its rows before the unmoved start are masked).
        return jnp.minimum(aligned + step * bk, num_rows - bk)

      def index_map(step):
        return pl.multiple_of(step_rows(step), _ROW_ALIGN), 0

      def mma(idx, lhs_smem, dout_smem, acc_ref):
        (step,) = idx
        a = lhs_smem.at[:, pl.ds(wg_row, wm)] if tiles.wg_split == "m" else lhs_smem
        b = dout_smem.at[:, pl.ds(wg_col, wn)] if tiles.wg_split == "n" else dout_smem
        edge = (step == 0) | (step == num_steps - 1)

        # Only the first and the last step can hold rows of other groups; each
        # warpgroup zeroes only the slice that it alone reads.
        @pl.when(edge)
        def _mask():
          _zero_rows_outside(a if tiles.wg_split == "m" else b, first_row=step_rows(step),
                             lo=jnp.maximum(lo, aligned + step * bk), hi=hi)

        return _wgmma_step(acc_ref, a.transpose((1, 0)), b)

      def compute_context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
        def _acc_scope(acc_ref):
          run(acc_ref)
          window = out_gmem.at[group, pl.ds(m0 + wg_row, wm), pl.ds(n0 + wg_col, wn)]
          _store_rows(acc_ref[...], o_smem.at[pl.ds(wg * wm, wm)], window, first=0, count=wm)

      pipeline(mma, compute_context, num_steps, index_map)(
          lhs_gmem.at[:, pl.ds(m0, bm)], dout_gmem.at[:, pl.ds(n0, bn)], allocations=allocs)

    plgpu.wait_smem_to_gmem(0)


def _drhs_call(lhs, dout, group_sizes, num_groups, *, out_dtype, tiles: _Tiles, num_programs,
               interpret):
  """Launches the rhs-gradient kernel; out is (G, K, N)."""
  num_rows, contract_k = lhs.shape
  cols_n = dout.shape[1]
  rows = padded_rows(num_rows, tiles.block_k)
  offsets = group_offsets(group_sizes, num_rows)
  kernel = functools.partial(_drhs_kernel, tiles=tiles)
  num_tiles = num_groups * (contract_k // tiles.block_m) * (cols_n // tiles.block_n)
  return _launch(kernel, jax.ShapeDtypeStruct((num_groups, contract_k, cols_n), out_dtype),
                 (offsets, _pad_rows(lhs, rows), _pad_rows(dout, rows)), num_tiles=num_tiles,
                 num_programs=num_programs, interpret=interpret, name="ragged_dot_drhs")
