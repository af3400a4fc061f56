"""ragged_dot and its weight gradient in plain JAX (XLA), with three strategies.

Strategies (the tunable `strategy`):
  "lax":    `jax.lax.ragged_dot` / `jax.lax.ragged_dot_general`; what XLA does
            with it depends on the backend (on CPU it densifies to (G, M, K)).
  "masked": a scan over groups, one full (M, K) @ (K, N) matmul per group with
            the rows of other groups masked out. G times the FLOPs, no gathers:
            good when G is small.
  "tiled":  group-aware tiling. Every group is padded to a multiple of `tile_m`
            rows, its rows are gathered into tiles of `tile_m` rows that each
            belong to one group, and one batched matmul multiplies every tile by
            its group's rhs. FLOPs grow only by the padding (at most `tile_m` rows
            per group), at the cost of gathers and of a (tiles, K, N) copy of rhs.

The number of tiles must be static, so it is the bound ceil(M / tile_m) + G: the
padded groups never need more, and the unused tiles hold zeros.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from stellarax.core.config import check_choice, check_power_of_two
from stellarax.ops.ragged_dot.reference import (
    check_group_sizes, check_ragged_dot_shapes, group_bounds)

Strategy = Literal["lax", "masked", "tiled"]
STRATEGIES: tuple[str, ...] = ("lax", "masked", "tiled")
MIN_TILE_M = 8

# Dimension numbers of the weight gradient as a ragged_dot_general: lhs (M, K) and
# dout (M, N) contract over their ragged row dimension; the result gains a
# leading group dimension, (G, K, N).
_RHS_GRAD_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def _check_tunables(strategy: str, tile_m: int) -> None:
  check_choice("strategy", strategy, STRATEGIES)
  check_power_of_two("tile_m", tile_m, minimum=MIN_TILE_M)


class _TileLayout(NamedTuple):
  """Where every row goes when groups are padded to whole tiles.

  tile_group: (num_tiles,) int32 group of every tile (unused tiles: G - 1; they
    hold no rows, so their products are zeros).
  gather_rows: (num_tiles * tile_m,) int32 lhs row of every padded slot, or M
    (out of range, read as zero) for a padding slot.
  row_slots: (M,) int32 padded slot of every lhs row, or num_tiles * tile_m
    (out of range, read as zero) for a row in no group.
  """
  tile_group: jax.Array
  gather_rows: jax.Array
  row_slots: jax.Array


def _group_of_positions(ends: jax.Array, num_positions: int) -> jax.Array:
  """Returns, for positions 0..num_positions-1, how many of the sorted `ends` are <= it.

  With `ends` the cumulative ends of consecutive groups that is the group of every
  position (G for a position past the last group): `searchsorted(ends, positions,
  side="right")` in O(positions + G) work and without a sequential loop.
  """
  marks = jnp.zeros((num_positions + 1,), jnp.int32).at[ends].add(1, mode="drop")
  return jnp.cumsum(marks)[:num_positions]


def _tile_layout(group_sizes: jax.Array, num_rows: int, tile_m: int) -> _TileLayout:
  """Lays the groups out in tiles of `tile_m` rows, each tile within one group."""
  num_groups = group_sizes.shape[0]
  num_tiles = -(-num_rows // tile_m) + num_groups
  starts, ends = group_bounds(group_sizes, num_rows)
  sizes = ends - starts
  tiles_per_group = (sizes + tile_m - 1) // tile_m
  tile_ends = jnp.cumsum(tiles_per_group)
  tile_starts = tile_ends - tiles_per_group

  tiles = jnp.arange(num_tiles, dtype=jnp.int32)
  tile_group = jnp.minimum(_group_of_positions(tile_ends, num_tiles), num_groups - 1)
  # Offset of every padded slot inside its group; slots past the group's size pad.
  slot_offset = (tiles - tile_starts[tile_group])[:, None] * tile_m + jnp.arange(tile_m)[None, :]
  slot_is_row = (tiles < tile_ends[-1])[:, None] & (slot_offset < sizes[tile_group][:, None])
  gather_rows = jnp.where(slot_is_row, starts[tile_group][:, None] + slot_offset, num_rows)

  rows = jnp.arange(num_rows, dtype=jnp.int32)
  row_group = _group_of_positions(ends, num_rows)
  row_in_group = row_group < num_groups
  row_group = jnp.minimum(row_group, num_groups - 1)
  slots = tile_starts[row_group] * tile_m + rows - starts[row_group]
  row_slots = jnp.where(row_in_group, slots, num_tiles * tile_m)
  return _TileLayout(tile_group.astype(jnp.int32), gather_rows.reshape(-1).astype(jnp.int32),
                     row_slots.astype(jnp.int32))


def _gather_tiles(x: jax.Array, layout: _TileLayout, tile_m: int) -> jax.Array:
  """Gathers (M, D) rows into (num_tiles, tile_m, D) tiles, zeros in padding slots."""
  tiles = jnp.take(x, layout.gather_rows, axis=0, mode="fill", fill_value=0)
  return tiles.reshape(-1, tile_m, x.shape[1])


def _row_in_group(num_rows: int, start: jax.Array, end: jax.Array) -> jax.Array:
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  return (rows >= start) & (rows < end)


def _ragged_dot_masked(lhs, rhs, group_sizes, precision, out_dtype):
  starts, ends = group_bounds(group_sizes, lhs.shape[0])

  def add_group(out, group):
    rhs_g, start, end = group
    y = jnp.dot(lhs, rhs_g, precision=precision, preferred_element_type=out_dtype)
    return jnp.where(_row_in_group(lhs.shape[0], start, end)[:, None], y, out), None

  init = jnp.zeros((lhs.shape[0], rhs.shape[2]), out_dtype)
  return lax.scan(add_group, init, (rhs, starts, ends))[0]


def _ragged_dot_tiled(lhs, rhs, group_sizes, tile_m, precision, out_dtype):
  layout = _tile_layout(group_sizes, lhs.shape[0], tile_m)
  lhs_tiles = _gather_tiles(lhs, layout, tile_m)
  out_tiles = lax.dot_general(
      lhs_tiles, rhs[layout.tile_group], (((2,), (1,)), ((0,), (0,))),
      precision=precision, preferred_element_type=out_dtype)
  out_slots = out_tiles.reshape(-1, rhs.shape[2])
  return jnp.take(out_slots, layout.row_slots, axis=0, mode="fill", fill_value=0)


def ragged_dot_xla(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    strategy: Strategy,
    tile_m: int,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
  """Computes `jax.lax.ragged_dot(lhs, rhs, group_sizes)` with the chosen strategy.

  The lhs gradient of ragged_dot is itself a ragged_dot,
  `ragged_dot_xla(dout, rhs.transpose(0, 2, 1), group_sizes, ...)`.

  Args:
    lhs: (M, K) array.
    rhs: (G, K, N) array.
    group_sizes: (G,) integer array; groups are consecutive row ranges of lhs.
      Rows past their sum give zeros; a group past row M is cut at it.
    strategy: "lax", "masked" or "tiled" (see the module docstring).
    tile_m: rows per tile of the "tiled" strategy; a power of two >= 8. It is
      validated for every strategy (so that a config is valid or not regardless
      of the strategy) but only "tiled" uses it.
    precision: matmul precision, as for `jax.lax.dot`.
    preferred_element_type: output (and accumulation) dtype; defaults to lhs.dtype.

  Returns:
    (M, N) array of dtype `preferred_element_type or lhs.dtype`.

  Raises:
    ValueError: for operand shapes that do not fit, an unknown strategy or a bad tile_m.
  """
  check_ragged_dot_shapes(lhs, rhs, group_sizes)
  _check_tunables(strategy, tile_m)
  out_dtype = preferred_element_type or lhs.dtype
  if strategy == "lax":
    return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), precision=precision,
                          preferred_element_type=out_dtype, out_sharding=_out_sharding(lhs, rhs))
  if strategy == "masked":
    return _ragged_dot_masked(lhs, rhs, group_sizes, precision, out_dtype)
  return _ragged_dot_tiled(lhs, rhs, group_sizes, tile_m, precision, out_dtype)


def _out_sharding(lhs, rhs):
  """The (M, N) output's split where an Explicit mesh is in play, else None: rows as
  lhs's, columns as rhs's (`_explicit_sharding`)."""
  return _explicit_sharding(((lhs, 0), (rhs, 2)))


def _explicit_sharding(dims):
  """The output sharding to give `lax.ragged_dot(_general)` where an Explicit mesh is in
  play (JAX does not infer one for it there, and raises): on the operands' types (a call
  on such arrays that the partitioning left whole, as under vmap), or the context's
  (`jax.sharding.use_abstract_mesh`, lowering for another machine, with arrays of no
  sharding); else None.

  Args:
    dims: for each output dimension, (operand, its dimension the output's follows), or
      None for one left whole.
  """
  arrays = [x for x, _ in filter(None, dims)]
  meshes = [getattr(jax.typeof(x).sharding, "mesh", None) for x in arrays]
  mesh = next((m for m in meshes if m is not None and not m.empty), None)
  on_arrays = mesh is not None
  mesh = mesh if on_arrays else jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return None

  def part(dim):
    if dim is None:
      return None
    spec = jax.typeof(dim[0]).sharding.spec
    return spec[dim[1]] if len(spec) > dim[1] else None

  spec = jax.sharding.PartitionSpec(*(part(d) for d in dims))
  return jax.sharding.NamedSharding(mesh, spec) if on_arrays else spec


def _rhs_grad_masked(lhs, dout, group_sizes, precision, out_dtype):
  starts, ends = group_bounds(group_sizes, lhs.shape[0])

  def group_grad(bounds):
    rows = _row_in_group(lhs.shape[0], *bounds)
    masked = jnp.where(rows[:, None], lhs, jnp.zeros((), lhs.dtype))
    return lax.dot_general(masked, dout, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=out_dtype)

  return lax.map(group_grad, (starts, ends))


def _rhs_grad_tiled(lhs, dout, group_sizes, num_groups, tile_m, precision, out_dtype):
  layout = _tile_layout(group_sizes, lhs.shape[0], tile_m)
  # Per-tile partial products are summed per group, so keep them in float32.
  partials = lax.dot_general(
      _gather_tiles(lhs, layout, tile_m), _gather_tiles(dout, layout, tile_m),
      (((1,), (1,)), ((0,), (0,))), precision=precision, preferred_element_type=jnp.float32)
  grads = jax.ops.segment_sum(partials, layout.tile_group, num_segments=num_groups,
                              indices_are_sorted=True)
  return grads.astype(out_dtype)


def ragged_dot_rhs_grad_xla(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    num_groups: int,
    *,
    strategy: Strategy,
    tile_m: int,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
  """Computes the rhs (weight) gradient of ragged_dot with the chosen strategy.

  Args:
    lhs: (M, K) array, the forward lhs.
    dout: (M, N) array, the cotangent of the forward output.
    group_sizes: (num_groups,) integer array.
    num_groups: G, the number of groups (rhs.shape[0] in the forward pass).
    strategy: "lax" (`jax.lax.ragged_dot_general` with ragged contracting rows),
      "masked" (one masked matmul per group) or "tiled" (per-tile products
      summed per group).
    tile_m: rows per tile of the "tiled" strategy; a power of two >= 8.
    precision: matmul precision, as for `jax.lax.dot`.
    preferred_element_type: output dtype; defaults to lhs.dtype.

  Returns:
    (G, K, N) array whose slice g is lhs[rows of g].T @ dout[rows of g], zero for
    an empty group.

  Raises:
    ValueError: for operand shapes that do not fit, an unknown strategy or a bad tile_m.
  """
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(
        f"The weight gradient needs lhs (M, K) and dout (M, N) with the same M; got "
        f"lhs.shape={lhs.shape} and dout.shape={dout.shape}.")
  check_group_sizes(group_sizes, num_groups)
  _check_tunables(strategy, tile_m)
  out_dtype = preferred_element_type or lhs.dtype
  if strategy == "lax":
    return lax.ragged_dot_general(lhs, dout, group_sizes.astype(jnp.int32), _RHS_GRAD_DIMS,
                                  precision=precision, preferred_element_type=out_dtype,
                                  out_sharding=_explicit_sharding((None, (lhs, 1), (dout, 1))))
  if strategy == "masked":
    return _rhs_grad_masked(lhs, dout, group_sizes, precision, out_dtype)
  return _rhs_grad_tiled(lhs, dout, group_sizes, num_groups, tile_m, precision, out_dtype)
