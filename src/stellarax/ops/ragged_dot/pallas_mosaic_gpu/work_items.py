"""What the kernels know of the rows before they start, computed in jnp: the groups'
offsets, the padded row count, the forward's work items (see forward.py), and the
number of SMs the persistent grid fills.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from stellarax.ops import index_math
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.tunables import _DEFAULT_NUM_SMS, _ROW_ALIGN
from stellarax.ops.ragged_dot.reference import group_bounds


def group_offsets(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """Returns the row offsets of the groups.

  Args:
    group_sizes: (G,) integer array; negative sizes count as 0.
    num_rows: M; groups are cut at row M.

  Returns:
    (G + 1,) int32: group g owns rows [offsets[g], offsets[g + 1]).
  """
  _, ends = group_bounds(group_sizes, num_rows)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def padded_rows(num_rows: int, block: int) -> int:
  """The rows the kernels work on: M rounded up to a multiple of 8, and at least one tile.

  TMA copies into 128-byte-swizzled shared memory move whole 8-row tiles, so Mosaic
  needs every row offset to be a multiple of 8; with this padding (a copy only when M
  is not a multiple of 8 or below one tile) the last tile can end exactly at the
  last row and no copy reads past the array.

  Args:
    num_rows: M.
    block: the rows of one tile (block_m, or block_k for the rhs gradient).

  Returns:
    The padded row count.
  """
  return max(-(-num_rows // _ROW_ALIGN) * _ROW_ALIGN, block)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """Pads x with zero rows up to `rows` (see `padded_rows`: a copy only when M is not a
  multiple of 8 or is below one tile)."""
  return x if x.shape[0] >= rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def num_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
  """A static bound on the work items: tiles of the G groups plus the zero tail.

  Args:
    num_rows: the padded rows (`padded_rows`).
    num_groups: G.
    block_m: rows per tile.

  Returns:
    The number of columns of `work_items`' table.
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
  part_tiles = jnp.where(part_ends > offsets, index_math.cdiv(part_ends - part_aligned, block_m), 0)
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


def _num_sms() -> int:
  """The SMs the persistent grid fills: the abstract device's (when lowering for a
  simulated GPU), else the default GPU's, else the H200's 132."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None and getattr(abstract, "num_cores", None):
    return int(abstract.num_cores)
  device = jax.devices()[0]
  if device.platform == "gpu" and getattr(device, "core_count", None):
    return int(device.core_count)
  return _DEFAULT_NUM_SMS
