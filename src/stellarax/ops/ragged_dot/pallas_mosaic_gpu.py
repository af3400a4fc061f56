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
the epilogue casts it, writes it to shared memory and stores it with TMA, one column
slab at a time with `epilogue_slabs` (the buffer holds one slab, which leaves shared
memory for more stages). A step waits for its wgmma before its stage is freed; with
`delay_release` it waits only for the previous step's (one wgmma group stays in
flight) and frees that step's stage itself, the last one after the loop (see
_StageRelease). In all three products block_m x block_n is the output tile and block_k
the contraction step.

With `multicast` the CTAs run in clusters of two, and the persistent loop walks pairs
of adjacent output column tiles: both CTAs of a cluster take the same pair, each one
of its column tiles (`_column_tile`). Both then need the same tiles of the operand
along the rows (lhs; dout in the lhs gradient; lhs in the rhs gradient), so that
operand's BlockSpec is collective over the cluster: each CTA's memory warpgroup loads
half of each such tile with TMA multicast, which writes it into both CTAs' shared
memory, and the pipeline's consumed barriers become cluster barriers, so a stage is
refilled only when the compute warpgroups of both CTAs have released it. The
other operand and the epilogue stay each CTA's own.

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
shared with the Triton kernels (split_k.py).

Scheduling of the rhs-gradient kernel
-------------------------------------
One loop step computes one (group, K tile, N tile) of drhs: a loop of dynamic length
over the group's rows in steps of block_k, starting at the group's first row aligned
down to 8 (the last step moved up to end at row M at most). Rows of a step outside
the group, or already counted by the previous step, exist only in a group's first
and last steps; there they are zeroed in shared memory before the wgmma. Each
compute warpgroup zeroes only the operand slice that it alone reads (its lhs columns
with wg_split="m", its dout columns with wg_split="n"), so the two never write the
same shared memory. (Zeroing is exact for finite values. With wg_split="m" the
zeroed operand is lhs, as in the reference, which masks lhs; with wg_split="n" it is
dout, so an inf in a neighbouring group's lhs row gives NaN where the reference
stays finite, and an inf in such a dout row does not give the reference's NaN.)
An empty group runs no step and stores zeros. Output tiles are disjoint, so CTAs
never write the same element.

Limits: bfloat16 and float16 operands only (wgmma's 16-bit path; the op refuses
float32 so that dispatch falls back); the output columns and the contraction size of
the forward and lhs-gradient kernels must be multiples of the tiles (K and N
multiples of 64 at least, K of 128 for the backward), so TMA never reads or writes
out of bounds. Interpret mode (any backend, for tests) runs two CTAs by default (two
clusters of two with `multicast`): CTAs (clusters) run one after another there, so
more only cost time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stellarax.core.config import check_choice, check_power_of_two
from stellarax.ops import pallas_common
from stellarax.ops.ragged_dot import split_k as _splits
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
# CTAs per cluster with `multicast`: a pair on adjacent output column tiles.
_MULTICAST_CTAS = 2
# The warpgroup tile rows `half_tiles` halves (to one 64-row wgmma slice).
_HALF_TILE_ROWS = 128
# Tunables of the row products only (forward and lhs gradient): the rhs-gradient kernel
# neither splits nor halves its contraction, the rows.
_ROW_PRODUCT_TUNABLES = ("split_k", "half_tiles")
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
_INTERPRET_PROGRAMS = 2
# Row offsets of TMA copies into swizzled shared memory must be multiples of 8.
_ROW_ALIGN = 8
_MAX_SPACE = 60
_TUNABLE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "wg_split",
                  "grid_minor_dim", "grid_tile_width", "split_k", "epilogue_slabs",
                  "delay_release", "multicast", "half_tiles")
# The narrowest column slab of the epilogue: a wgmma-layout register tile is sliced
# and stored in whole 64-column granules.
_MIN_SLAB = 64


# --------------------------------------------------------------------------- configs


def _check_int(name: str, value: Any) -> None:
  if not isinstance(value, int) or isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be an int.")


def _wg_tile(block_m: int, block_n: int, wg_split: str) -> tuple[int, int]:
  """Returns the (rows, cols) of the output tile one compute warpgroup owns."""
  if wg_split == "m":
    return block_m // _NUM_COMPUTE_WGS, block_n
  return block_m, block_n // _NUM_COMPUTE_WGS


def _can_halve(block_m: int, block_n: int, wg_split: str) -> bool:
  """Whether the compute warpgroups own 128 rows each, the tiles `half_tiles` halves."""
  return _wg_tile(block_m, block_n, wg_split)[0] == _HALF_TILE_ROWS


def validate_tunables(*, block_m: int, block_n: int, block_k: int, max_concurrent_steps: int,
                      wg_split: str, grid_minor_dim: str, grid_tile_width: int,
                      split_k: int = 1, epilogue_slabs: int = 1,
                      delay_release: bool = False, multicast: bool = False,
                      half_tiles: bool = False) -> None:
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
    split_k: CTAs that share one output tile's contraction in the forward and
      lhs-gradient kernels (split-K: each writes a float32 partial, XLA sums them), a
      power of two in [1, 16]; the rhs-gradient kernel does not split.
    epilogue_slabs: column slabs in which a compute warpgroup stores its output tile
      (a power of two; slabs at least 64 columns wide). Its shared-memory buffer
      holds one slab, so more slabs leave room for more pipeline stages; each slab
      waits until the previous one's store has read the buffer.
    delay_release: keep one wgmma in flight: a step waits only for the previous
      step's wgmma and frees that step's stage, so a stage is refilled a step later
      (the loads run one step less far ahead).
    multicast: run the CTAs in clusters of two on adjacent output column tiles of
      the same rows, which need the same tiles of the operand along those rows (lhs;
      dout in the lhs gradient; lhs in the rhs gradient): each CTA loads half of such
      a tile with TMA multicast, which writes it into both CTAs' shared memory (half
      the L2 reads of that operand). The output column tiles must come in pairs.
    half_tiles: in the forward and lhs-gradient kernels, a compute warpgroup whose rows
      of a tile that belong to the item all lie in its first half (a group's last,
      short tile) multiplies only that half: half the wgmma work of the tile (the
      loads stay whole). Needs warpgroup tiles of 128 rows (wgmma multiplies 64-row
      slices); the rhs-gradient kernel, whose rows are its contraction, ignores it.

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
  check_power_of_two("split_k", split_k, minimum=1, maximum=_splits.MAX_SPLIT)
  wm, wn = _wg_tile(block_m, block_n, wg_split)
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
  if not isinstance(delay_release, bool):
    raise ValueError(f"delay_release={delay_release!r} must be a bool.")
  if not isinstance(multicast, bool):
    raise ValueError(f"multicast={multicast!r} must be a bool.")
  if not isinstance(half_tiles, bool):
    raise ValueError(f"half_tiles={half_tiles!r} must be a bool.")
  if half_tiles and not _can_halve(block_m, block_n, wg_split):
    raise ValueError(
        f"half_tiles=True needs compute warpgroup tiles of {_HALF_TILE_ROWS} rows (two "
        f"64-row wgmma slices); block_m={block_m} with wg_split={wg_split!r} gives {wm}. "
        "Use half_tiles=False.")
  _check_int("epilogue_slabs", epilogue_slabs)
  if epilogue_slabs < 1 or epilogue_slabs & (epilogue_slabs - 1) or (
      wn // epilogue_slabs < _MIN_SLAB):
    raise ValueError(
        f"epilogue_slabs={epilogue_slabs!r} must be a power of two of at most "
        f"{wn // _MIN_SLAB}: each compute warpgroup stores its {wm}x{wn} tile in slabs of at "
        f"least {_MIN_SLAB} columns.")


def _smem_bytes(*, block_m: int, block_n: int, block_k: int, max_concurrent_steps: int,
                epilogue_slabs: int = 1, out_itemsize: int = 2) -> int:
  """Shared memory of a CTA: the pipelined 16-bit operand tiles and the epilogue
  buffers (one column slab of each compute warpgroup's output tile)."""
  stages = max_concurrent_steps * (block_m + block_n) * block_k * 2
  return stages + block_m * block_n * out_itemsize // epilogue_slabs


# The dimensions each product's blocks tile: (name, size index in (k, n)). Rows of the
# forward and lhs-gradient outputs and of the rhs-gradient contraction are ragged and
# need not divide.
_TILED_DIMS = {
    "forward": (("block_n", "output columns N", 1), ("block_k", "contraction K", 0)),
    "dlhs": (("block_n", "output columns K", 0), ("block_k", "contraction N", 1)),
    "drhs": (("block_m", "rows K of drhs[g]", 0), ("block_n", "columns N of drhs[g]", 1)),
}
PRODUCTS = ("forward", "backward")


def check_tunables_fit(tunables: dict[str, Any], *, k: int, n: int, product: str,
                       out_itemsize: int = 2) -> None:
  """Checks that valid tunables also fit one problem's shapes and shared memory.

  Args:
    tunables: the keyword tunables (valid for `validate_tunables`).
    k, n: the problem's K and N (lhs (M, K), rhs (G, K, N)).
    product: "forward", "dlhs", "drhs", or "backward" (both gradients).
    out_itemsize: bytes per output element (the epilogue's shared-memory tile).

  Raises:
    ValueError: for an unknown product, when a block does not divide the dimension
      it tiles (TMA tiles must not run past the arrays), or when the tiles overflow
      an H200 CTA's shared memory.
  """
  check_choice("product", product, (*_TILED_DIMS, "backward"))
  products = ("dlhs", "drhs") if product == "backward" else (product,)
  split = tunables.get("split_k", 1)
  multicast = tunables.get("multicast", False)
  for name in products:
    for block_name, label, axis in _TILED_DIMS[name]:
      block, dim = tunables[block_name], (k, n)[axis]
      if dim % block:
        raise ValueError(
            f"{block_name}={block} must divide the {label}={dim} of the {name} product (TMA "
            f"tiles must not run past the arrays). Pick a {block_name} that divides {dim}.")
      if block_name == "block_n" and multicast and (dim // block) % _MULTICAST_CTAS:
        raise ValueError(
            f"multicast=True runs CTAs in pairs on adjacent column tiles, so the "
            f"{dim // block} column tiles of block_n={block} over the {label}={dim} of the "
            f"{name} product must be even. Use multicast=False or a block_n that gives an "
            "even count.")
      if block_name == "block_k" and split > 1 and dim % (block * split):
        raise ValueError(
            f"split_k={split} shares of block_k={block} steps must divide the {label}={dim}"
            f" of the {name} product. Pick a split_k whose shares divide {dim // block}"
            f" steps.")
  if product != "drhs":
    out_itemsize = _epilogue_itemsize(split, out_itemsize)
  slabs = tunables.get("epilogue_slabs", 1)
  used = _smem_bytes(**{key: tunables[key] for key in ("block_m", "block_n", "block_k",
                                                      "max_concurrent_steps")},
                    epilogue_slabs=slabs, out_itemsize=out_itemsize)
  if used > _SMEM_BYTES:
    raise ValueError(
        f"block_m={tunables['block_m']}, block_n={tunables['block_n']}, "
        f"block_k={tunables['block_k']} with max_concurrent_steps="
        f"{tunables['max_concurrent_steps']} and epilogue_slabs={slabs} need {used} bytes of "
        f"shared memory; an H200 CTA has {_SMEM_BYTES}. Use fewer stages, more epilogue "
        "slabs or smaller blocks.")


def _check_sizes(m: int, k: int, n: int, g: int) -> None:
  for name, value in (("m", m), ("k", k), ("n", n), ("g", g)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int (a problem size).")


def _check_dtype(what: str, dtype: Any,
                 allowed: tuple[jnp.dtype, ...] = SUPPORTED_DTYPES) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in allowed:
    raise ValueError(
        f"{what}={dtype} is not supported by the Mosaic GPU ragged_dot kernels; expected one "
        f"of {[str(d) for d in allowed]}. Cast the operands first (wgmma takes 16-bit "
        "floating-point operands).")
  return dtype


def _largest_dividing(dim: int, choices: tuple[int, ...]) -> int | None:
  return max((c for c in choices if dim % c == 0), default=None)


def _deepest_pipeline(tiles: dict[str, Any], out_itemsize: int, cap: int,
                      max_slabs: int | None = None) -> dict[str, int] | None:
  """The most stages (<= cap, >= 2) whose shared memory fits, with the fewest epilogue
  slabs (<= max_slabs, default: the most the tile allows) that make them fit, as
  {"max_concurrent_steps", "epilogue_slabs"}; None if nothing fits."""
  _, wn = _wg_tile(tiles["block_m"], tiles["block_n"], tiles["wg_split"])
  slab_choices = [1 << i for i in range((wn // _MIN_SLAB).bit_length())]
  if max_slabs is not None:
    slab_choices = [x for x in slab_choices if x <= max_slabs]
  for stages in range(cap, 1, -1):
    for slabs in slab_choices:
      if _smem_bytes(block_m=tiles["block_m"], block_n=tiles["block_n"],
                     block_k=tiles["block_k"], max_concurrent_steps=stages,
                     epilogue_slabs=slabs, out_itemsize=out_itemsize) <= _SMEM_BYTES:
        return dict(max_concurrent_steps=stages, epilogue_slabs=slabs)
  return None


def _row_block_cap(m: int, g: int) -> int:
  """The largest useful block over ragged rows: twice the average group (>= 128)."""
  average = max(1, m // g)
  return max(128, 2 * (1 << (average.bit_length() - 1)))


def heuristic_tunables(m: int, k: int, n: int, g: int, dtype: Any, *, product: str = "forward",
                       out_dtype: Any = None) -> dict[str, Any]:
  """Returns tunables that are a reasonable guess on an H200, without measuring.

  The CTA tile is 128 x 256 (two compute warpgroups of 128 x 128, the shape of fast
  Hopper matmuls) with block_k = 64, one CTA per cluster (`multicast` pairs, as
  CUTLASS often runs, are offered in the space next to the heuristic until an H200
  has timed them); block_m drops to 64 when groups average fewer than 128 rows (each
  group wastes part of a tile), and block_n to the largest of 256, 128, 64 that
  divides the output columns. Pipelines are as deep as shared memory holds, up to 4
  stages for 128-row tiles (3 for 64-row ones), the epilogue stored in as few column
  slabs as make them fit. Warpgroups of 128 rows halve the short tiles (`half_tiles`:
  less work, the same loads). Tiles run in bands of 8 m-tiles (L2 reuse of lhs rows and
  rhs columns). Outputs with fewer tiles than an H200 has SMs (decode-sized M) split
  the contraction (split_k, see split_k.split_choices).

  Args:
    m, k, n, g: the problem (lhs (M, K), rhs (G, K, N)).
    dtype: the operands' dtype (bfloat16 or float16).
    product: "forward", or "backward" (one config for both gradients).
    out_dtype: the forward's output dtype (default: dtype); sizes the epilogue.

  Returns:
    A dict of the tunables, valid for `validate_tunables` and `check_tunables_fit`.

  Raises:
    ValueError: for an unsupported dtype, non-positive sizes, an unknown product, or
      shapes no tile fits (K or N not a multiple of 64; the backward also needs K a
      multiple of 128).
  """
  _check_sizes(m, k, n, g)
  _check_dtype("dtype", dtype)
  check_choice("product", product, PRODUCTS)
  out_itemsize = _out_itemsize(product, dtype, out_dtype)
  cols = n if product == "forward" else math.gcd(k, n)
  block_n = _largest_dividing(cols, (256, 128, 64))
  if block_n is None or k % 64:
    raise ValueError(f"k={k} and n={n} must be multiples of 64 for the Mosaic GPU ragged_dot "
                     "kernels (whole TMA tiles).")
  if product == "backward" and k % 128:
    # drhs[g] is tiled by block_m x block_n over (K, N), and the two compute
    # warpgroups need one side of at least 128 that divides it.
    raise ValueError(f"k={k} must be a multiple of 128 for the Mosaic GPU ragged_dot backward "
                     "(the two compute warpgroups need a 128-wide tile side).")
  # A 64-wide block_n leaves only M to split between the warpgroups.
  block_m = 128 if m // g >= 128 or block_n == 64 else 64
  tiles = dict(block_m=block_m, block_n=block_n, block_k=64,
               wg_split="n" if block_n >= 128 else "m", grid_minor_dim="m", grid_tile_width=8,
               delay_release=False, multicast=False, half_tiles=False)
  tiles["split_k"] = _split_choices(m, k, n, g, tiles, product)[0]
  # Stages: CUTLASS's Hopper kernels run this tile 4 deep; its 64 KiB epilogue buffer
  # left room for 3, so the epilogue is stored in as few column slabs as make room for
  # 4 (2 for a 16-bit output: 224 KiB in all). Compiled for an H200
  # (bench/compile_h200.py, 2026-11-30), 128 x 256 with 4 stages and 2 slabs spills
  # nothing, but the 64 x 256 tile of decode-sized M spills inside its loop with 4
  # (and with 2) stages and not with 3. The space keeps other depths for the tuner.
  cap = 4 if block_m == 128 else 3
  tiles |= _deepest_pipeline(tiles, _epilogue_itemsize(tiles["split_k"], out_itemsize), cap=cap)
  # A group's last tile is short (half a tile on average): where warpgroups own 128
  # rows, one whose rows end in its first half multiplies only that half.
  tiles["half_tiles"] = _can_halve(block_m, block_n, tiles["wg_split"])
  return {name: tiles[name] for name in _TUNABLE_NAMES}


def _epilogue_itemsize(split_k: int, out_itemsize: int) -> int:
  """Bytes per element of the epilogue's shared-memory tile: float32 partials when
  the contraction is split, else the output dtype's."""
  return 4 if split_k > 1 else out_itemsize


def _split_choices(m: int, k: int, n: int, g: int, tiles: dict[str, Any],
                   product: str) -> list[int]:
  """split_k worth trying for a tiling, the guess first (see split_k.split_choices):
  only splits whose shares divide the contraction. The backward's split applies to
  its lhs gradient (output columns K, contraction N)."""
  cols, contraction = (n, k) if product == "forward" else (k, n)
  num_tiles = (-(-m // tiles["block_m"]) + g) * (cols // tiles["block_n"])
  steps = contraction // tiles["block_k"]
  return [s for s in _splits.split_choices(num_tiles, steps) if steps % s == 0] or [1]


def _out_itemsize(product: str, dtype: Any, out_dtype: Any) -> int:
  if product == "forward" and out_dtype is not None:
    return _check_dtype("out_dtype", out_dtype, OUT_DTYPES).itemsize
  return jnp.dtype(dtype).itemsize


def _fits(tunables: dict[str, Any], k: int, n: int, product: str, out_itemsize: int) -> bool:
  """Whether tunables fit the problem (`check_tunables_fit`)."""
  try:
    check_tunables_fit(tunables, k=k, n=n, product=product, out_itemsize=out_itemsize)
  except ValueError:
    return False
  return True


def _tile_candidates(m: int, k: int, n: int, g: int, product: str) -> list[dict[str, Any]]:
  """Every valid (block_m, block_n, block_k, wg_split) for the shape, before stages."""
  row_cap = _row_block_cap(m, g)
  found = []
  for bm in BLOCK_CHOICES:
    for bn in BLOCK_CHOICES:
      for bk in BLOCK_K_CHOICES:
        for split in WG_SPLITS:
          tiles = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=2,
                       wg_split=split, grid_minor_dim="m", grid_tile_width=8,
                       delay_release=False, multicast=False, half_tiles=False)
          try:
            validate_tunables(**tiles)
            check_tunables_fit(tiles, k=k, n=n, product=product)
          except ValueError:
            continue
          if bm <= row_cap:
            found.append(tiles)
  return found


def tunable_space(m: int, k: int, n: int, g: int, dtype: Any, *, product: str = "forward",
                  out_dtype: Any = None) -> list[dict[str, Any]]:
  """Returns the autotuning search space for one ragged_dot shape (at most 60 configs).

  Tiles: block_m and block_n of 64 to 256 (block_m, over ragged rows, at most twice
  the average group and at least 128), block_k of 64 or 128, both warpgroup splits;
  every one that divides the shape and fits the registers, with the deepest pipeline
  (up to 6 stages) that fits shared memory (with the fewest epilogue slabs that make
  it fit), and for 64-wide block_k also one stage less. The heuristic tile also runs
  with its stages released a step later (`delay_release`), with every tile multiplied
  whole (where the heuristic halves short ones: `half_tiles`; the other tiles halve
  them wherever their warpgroups own 128 rows), in CTA pairs that share the
  row operand's tiles (`multicast`, where the column tiles pair up), with its
  epilogue whole (and the stages that then fit), with other split-K factors (only
  where the output has fewer tiles than an H200 has SMs) and other tile orders
  (bands of 4 or 16 m-tiles, or n-minor bands); the other tiles take the heuristic's
  split where their shares still divide the contraction. The heuristic config comes
  first, then the tiles by CTA tile size, largest first (the list is cut there when it
  grows past 60).

  Args:
    m, k, n, g: the problem (lhs (M, K), rhs (G, K, N)).
    dtype: the operands' dtype.
    product: "forward" or "backward".
    out_dtype: the forward's output dtype (default: dtype).

  Returns:
    A list of distinct dicts of tunables, each valid for `validate_tunables` and
    `check_tunables_fit`, the heuristic's first.

  Raises:
    ValueError: as `heuristic_tunables`.
  """
  heuristic = heuristic_tunables(m, k, n, g, dtype, product=product, out_dtype=out_dtype)
  out_itemsize = _out_itemsize(product, dtype, out_dtype)
  # The heuristic with one wgmma kept in flight (jax's own ragged_dot kernel delays its
  # releases; its Hopper matmul, like the heuristic, does not).
  space = [heuristic, heuristic | dict(delay_release=True)]
  if heuristic["half_tiles"]:  # Every tile multiplied whole: what half_tiles saves.
    space.append(heuristic | dict(half_tiles=False))
  # The heuristic in CTA pairs sharing the row operand's tiles (TMA multicast; CUTLASS's
  # Hopper GEMMs run clusters of 2), where the column tiles pair up.
  paired = heuristic | dict(multicast=True)
  if _fits(paired, k, n, product, out_itemsize):
    space.append(paired)
  # The heuristic tile with its epilogue whole and the stages that then fit.
  itemsize = _epilogue_itemsize(heuristic["split_k"], out_itemsize)
  whole = _deepest_pipeline(heuristic, itemsize, cap=heuristic["max_concurrent_steps"],
                            max_slabs=1)
  if whole is not None:
    space.append(heuristic | whole)
  # The heuristic tile with the other splits (where the output has few tiles).
  for split in _split_choices(m, k, n, g, heuristic, product)[1:]:
    pipeline = _deepest_pipeline(heuristic, _epilogue_itemsize(split, out_itemsize), cap=4)
    if pipeline is not None:
      space.append(heuristic | dict(split_k=split) | pipeline)
  for order in (("m", 4), ("m", 16), ("n", 4), ("n", 8)):
    space.append(heuristic | dict(grid_minor_dim=order[0], grid_tile_width=order[1]))
  candidates = sorted(_tile_candidates(m, k, n, g, product),
                      key=lambda t: -t["block_m"] * t["block_n"])
  for tiles in candidates:
    # The heuristic's split where this tiling's shares divide the contraction, else
    # this tiling's own guess.
    choices = _split_choices(m, k, n, g, tiles, product)
    split = heuristic["split_k"] if heuristic["split_k"] in choices else choices[0]
    half = _can_halve(tiles["block_m"], tiles["block_n"], tiles["wg_split"])
    tiles = tiles | dict(split_k=split, half_tiles=half)
    itemsize = _epilogue_itemsize(split, out_itemsize)
    deepest = _deepest_pipeline(tiles, itemsize, cap=6)
    if deepest is None:
      continue
    space.append(tiles | deepest)
    stages = deepest["max_concurrent_steps"]
    if tiles["block_k"] == 64 and stages > 2:
      space.append(tiles | _deepest_pipeline(tiles, itemsize, cap=stages - 1))
  keys = dict.fromkeys(tuple(t[name] for name in _TUNABLE_NAMES) for t in space)
  return [dict(zip(_TUNABLE_NAMES, key)) for key in list(keys)[:_MAX_SPACE]]


# --------------------------------------------------------------------------- metadata


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
  split_k: int = 1
  epilogue_slabs: int = 1
  delay_release: bool = False
  multicast: bool = False
  half_tiles: bool = False

  @property
  def cluster_n(self) -> int:
    """CTAs per cluster (along the output columns)."""
    return _MULTICAST_CTAS if self.multicast else 1

  @property
  def wg_shape(self) -> tuple[int, int]:
    return _wg_tile(self.block_m, self.block_n, self.wg_split)

  def epilogue_buffer(self, dtype: Any) -> Any:
    """The compute warpgroups' epilogue buffers: one column slab of each one's tile, as
    (pieces, rows, columns) with pieces of at most _PIECE_COLS columns."""
    wm, wn = self.wg_shape
    slab = wn // self.epilogue_slabs
    piece = min(slab, _PIECE_COLS)
    return plgpu.SMEM((slab // piece, _NUM_COMPUTE_WGS * wm, piece), dtype)

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


# The widest piece of an epilogue buffer. jax 0.12's Mosaic GPU cannot infer layouts
# for a 256-column wgmma accumulator stored whole to an unswizzled buffer (128 columns
# it can; jax 0.11.2 takes both), so a wider slab is held as pieces of 128 columns,
# each stored by its own TMA copies.
_PIECE_COLS = 128


def _store_rows(tile: jax.Array, o_smem: Any, out_gmem: Any, *, first: jax.Array,
                count: jax.Array) -> None:
  """Stores rows [first, first + count) of a register tile to the same rows of out_gmem.

  The tile goes to this warpgroup's shared-memory buffer and then to GMEM with TMA,
  one column slab of the buffer's width at a time. A TMA box has a static size, so
  `count` (a runtime value in [0, rows]) is stored as a ladder of power-of-two boxes,
  largest first: its binary digits.

  Args:
    tile: (rows, cols) values in registers.
    o_smem: (pieces, rows, piece) shared-memory buffer of this warpgroup (one slab of
      pieces * piece columns, dividing cols; `_Tiles.epilogue_buffer`), unswizzled so
      that a box may start at any row.
    out_gmem: (rows, cols) GMEM window of the output, aligned with the tile.
    first, count: the rows to store.
  """
  pieces, rows, piece = o_smem.shape
  slab = pieces * piece
  for col in range(0, tile.shape[1], slab):
    # The previous slab's (or tile's) stores must have finished reading the buffer.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for p in range(pieces):
      cols = col + p * piece
      part = tile if piece == tile.shape[1] else tile[:, cols:cols + piece]
      o_smem.at[p][...] = part.astype(o_smem.dtype)
    plgpu.commit_smem()
    start = first
    for bit in reversed(range(rows.bit_length())):
      box = 1 << bit

      @pl.when((count & box) != 0)
      def _store():
        for p in range(pieces):
          plgpu.copy_smem_to_gmem(o_smem.at[p, pl.ds(start, box)],
                                  out_gmem.at[pl.ds(start, box), pl.ds(col + p * piece, piece)])

      start = start + (count & box)


@dataclasses.dataclass(frozen=True)
class _StepMma:
  """A pipeline step's wgmma.

  Attributes:
    operands: (*stage tiles) -> (a, b), the shared-memory views this warpgroup
      multiplies (pure: also used to name what a finished wgmma read).
    prepare: (step, *stage tiles) -> None, run before the wgmma (e.g. zeroes rows).
  """

  operands: Callable[..., tuple[Any, Any]]
  prepare: Callable[..., None] | None = None


@dataclasses.dataclass(frozen=True)
class _StageRelease:
  """When a compute warpgroup frees a pipeline stage for the memory warpgroup to refill.

  Plain: each step waits for its wgmma and the pipeline frees the stage at once. With
  `delay_release`, a step issues its wgmma, waits only for the previous step's
  (`wgmma.wait_group 1`: one group stays in flight, so the tensor cores have the next
  step's work while this warpgroup waits for a stage) and frees the previous step's
  stage on the pipeline's consumed barriers (manual: jax's own delayed release leaves
  the last stage of every pipeline run unreleased, which a persistent kernel's next
  tile would refill under a running wgmma); `finish` frees the last one.

  Attributes:
    delayed: the tiles' `delay_release`.
    allocations: the pipeline's buffers and barriers (`get_allocations`).
    check_reads: under the interpreter's race detector: read each stage's tiles again
      with ordinary loads where its wgmma completes (the interpreter runs wgmma at
      once and does not check its reads), so that a stage freed earlier is a race.
  """

  delayed: bool
  allocations: dict[str, Any]
  check_reads: bool = False

  @property
  def _stages(self) -> int:
    return self.allocations["flat_in_smem_refs"][0].shape[0]

  def body(self, mma: _StepMma) -> Callable[..., Any]:
    """The pipeline body of the step's wgmma `mma`."""
    def issue(step, tiles, acc_ref):
      if mma.prepare is not None:
        mma.prepare(step, *tiles)
      plgpu.wgmma(acc_ref, *mma.operands(*tiles))

    if not self.delayed:
      def plain(idx, *refs):
        issue(idx[0], refs[:-1], refs[-1])
        plgpu.wgmma_wait(0)  # Done before the pipeline frees the stage.
        return refs[-1]
      return plain

    def delayed(idx, *refs):
      (step,), acc_ref = idx, refs[-1]
      issue(step, refs[:-3], acc_ref)  # (the tiles, their 2 consumed barriers, the acc)
      self._await(mma, step - 1, in_flight=1)
      self._free(step - 1)
      return acc_ref

    return delayed

  def finish(self, mma: _StepMma, num_steps: Any) -> None:
    """After the pipeline's steps: waits for the last wgmma and frees its stage."""
    if self.delayed:
      self._await(mma, num_steps - 1, in_flight=0)
      self._free(num_steps - 1)

  def _slot(self, step: Any) -> Any:
    return lax.rem(jnp.maximum(step, 0), self._stages)

  def _await(self, mma: _StepMma, step: Any, in_flight: int) -> None:
    """Waits until at most `in_flight` wgmma groups run, so that the one of `step` (if
    >= 0) is done; under the race detector its operands are read here again."""
    plgpu.wgmma_wait(in_flight)
    if not self.check_reads:
      return

    @pl.when(step >= 0)
    def _read_again():
      tiles = [ring.at[self._slot(step)] for ring in self.allocations["flat_in_smem_refs"]]
      pallas_common.read_again_for_race_detector(mma.operands(*tiles))

  def _free(self, step: Any) -> None:
    """Frees the stage of `step` (if >= 0) for the memory warpgroup to refill."""
    @pl.when(step >= 0)
    def _arrive():
      for barrier in self.allocations["flat_consumed_barrier_refs"]:
        plgpu.barrier_arrive(barrier.at[self._slot(step)])


def _warp_specialized(body, *, tiles: _Tiles, num_steps, in_specs, compute_context):
  """A TMA -> wgmma pipeline: the last warpgroup loads, the other two compute."""
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(num_steps,),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=in_specs,
      wg_axis="wg",
      num_compute_wgs=_NUM_COMPUTE_WGS,
      max_concurrent_steps=tiles.max_concurrent_steps,
      manual_consumed_barriers=tiles.delay_release,
      compute_context=compute_context,
  )


def _ignore(*args, **kwargs):
  """A pipeline body for `get_allocations`, which only needs the specs."""
  del args, kwargs


def _launch(body, out_shape: jax.ShapeDtypeStruct, operands, *, num_tiles: int,
            cluster_n: int, num_programs: int | None, interpret: Any, name: str):
  """Runs `body` as a persistent kernel of min(SMs, tiles) CTAs of 3 warpgroups, in
  clusters of `cluster_n` CTAs (grid axis "sm" counts clusters, "cluster" the CTAs
  within one)."""
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  if num_programs is None:
    # Interpret mode runs CTAs one after another, so extra CTAs only cost time (about
    # 0.2 s each on a CPU); two clusters still exercise the persistent loop's striding.
    num_programs = _INTERPRET_PROGRAMS * cluster_n if interpret else _num_sms()
  grid = max(1, min(num_programs, num_tiles) // cluster_n)
  clusters = dict(cluster=(cluster_n,), cluster_names=("cluster",)) if cluster_n > 1 else {}
  kernel = plgpu.kernel(
      body,
      out_type=out_shape,
      grid=(grid,),
      grid_names=("sm",),
      **clusters,
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret or None,
      kernel_name=name,
  )
  return kernel(*operands)


def _row_operand(tiles: _Tiles) -> dict[str, Any]:
  """BlockSpec arguments of the operand a cluster's CTAs share (TMA multicast)."""
  return dict(collective_axes=("cluster",)) if tiles.multicast else {}


def _column_tile(tiles: _Tiles, pair_tile: jax.Array) -> jax.Array:
  """The output column tile of this CTA: its place within the cluster's `cluster_n`
  adjacent column tiles."""
  if not tiles.multicast:
    return pair_tile
  return pair_tile * tiles.cluster_n + lax.axis_index("cluster")


# --------------------------------------------------------------------------- forward


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
        split, linear = lax.div(linear, num_items * grid_n), lax.rem(linear, num_items * grid_n)
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


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """Pads x with zero rows up to `rows` (see `padded_rows`: a copy only when M is not a
  multiple of 8 or is below one tile)."""
  return x if x.shape[0] >= rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


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
    aligned = lo - lax.rem(lo, _ROW_ALIGN)
    num_steps = jnp.where(hi > lo, pl.cdiv(hi - aligned, block_k), 0)
    return cls(lo, hi, aligned, num_steps, num_rows, block_k)

  def first_row(self, step: jax.Array) -> jax.Array:
    """The array row of the step's first tile row (a multiple of 8)."""
    return jnp.minimum(self.aligned + step * self.block_k, self.num_rows - self.block_k)

  def first_valid(self, step: jax.Array) -> jax.Array:
    """The first row the step contributes: rows before it belong to another group or
    to the previous step (when the step was moved up)."""
    return jnp.maximum(self.lo, self.aligned + step * self.block_k)


def _drhs_mma(tiles: _Tiles, rows: _GroupSteps) -> _StepMma:
  """An rhs-gradient step's wgmma: acc (K x N part) += lhs_tile.T @ dout_tile, rows
  outside the group zeroed first (only a group's edge steps have any)."""
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

    # Each warpgroup zeroes only the slice that it alone reads (its lhs columns, or
    # its dout columns), so the two never write the same shared memory.
    @pl.when((first < valid) | (first + tiles.block_k > rows.hi))
    def _mask():
      _zero_rows_outside(a if tiles.wg_split == "m" else b, first_row=first, lo=valid,
                         hi=rows.hi)

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
      collective_axes="wg",
  )
  def _scope(allocs, o_smem):
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
      mma = _drhs_mma(tiles, rows)
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


# --------------------------------------------------------------------------- public functions

_STATIC = (*_TUNABLE_NAMES, "preferred_element_type", "interpret", "num_programs")
_DRHS_STATIC = tuple(name for name in _STATIC if name not in _ROW_PRODUCT_TUNABLES)


def _tunables_in(arguments: dict[str, Any]) -> dict[str, Any]:
  """The tunables among a public function's arguments (its `locals()` on entry)."""
  return {name: arguments[name] for name in _TUNABLE_NAMES if name in arguments}


def _prepare(tunables: dict[str, Any], *, k: int, n: int, product: str, operands, out_dtype):
  """Validates tunables and operands; returns the static tiling of the launch."""
  validate_tunables(**tunables)
  (a_name, a), (b_name, b) = operands
  _check_dtype(f"{a_name}.dtype", a.dtype)
  if a.dtype != b.dtype:
    raise ValueError(
        f"{a_name}.dtype={a.dtype} and {b_name}.dtype={b.dtype} differ; wgmma needs one "
        f"element type. Cast {b_name} to {a.dtype}.")
  out_dtype = _check_dtype("preferred_element_type", out_dtype, OUT_DTYPES)
  check_tunables_fit(tunables, k=k, n=n, product=product, out_itemsize=out_dtype.itemsize)
  return _Tiles(**tunables), out_dtype


def _out_dtype(preferred_element_type: Any, like: jax.Array) -> Any:
  return like.dtype if preferred_element_type is None else preferred_element_type


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


# ---------------------------------------------------------------------------
# Op classes: ragged_dot.pallas_mosaic_gpu and its VJP.

from stellarax.core.config import config_dataclass  # noqa: E402
from stellarax.ops.ragged_dot import base as _base  # noqa: E402


@config_dataclass
class PallasMosaicGpuRaggedDotConfig:
  """Tiles, pipelining (stages, delayed release), tile order, split-K, epilogue slabs, CTA
  pairs (multicast) and half tiles of the Mosaic GPU ragged_dot kernels (see
  `validate_tunables`). The backward uses one config for both products (split_k and
  half_tiles apply to the lhs gradient; the rhs gradient, whose rows are its
  contraction, does neither)."""

  block_m: int
  block_n: int
  block_k: int
  max_concurrent_steps: int
  wg_split: str
  grid_minor_dim: str
  grid_tile_width: int
  split_k: int = 1
  epilogue_slabs: int = 1
  delay_release: bool = False
  multicast: bool = False
  half_tiles: bool = False

  def __post_init__(self):
    validate_tunables(**pallas_common.tunables_of(self))


def _problem(ba) -> tuple[int, int, int, int, Any]:
  lhs, rhs = ba.arguments["lhs"], ba.arguments["rhs"]
  return lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], lhs.dtype


def _check_supported(arguments, *, backward: bool) -> None:
  """Raises NotImplementedError for input the kernels do not take, so dispatch falls back."""
  lhs, rhs = arguments["lhs"], arguments["rhs"]
  dtypes = {jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)}
  if len(dtypes) != 1 or not dtypes <= set(SUPPORTED_DTYPES):
    raise NotImplementedError(
        f"lhs and rhs dtypes {sorted(map(str, dtypes))}: the Mosaic GPU kernel needs both "
        "bfloat16 or both float16 (wgmma's 16-bit path; float32 is not supported).")
  out = arguments["preferred_element_type"]
  if out is not None and jnp.dtype(out) not in OUT_DTYPES:
    raise NotImplementedError(f"preferred_element_type={out}: the Mosaic GPU kernel writes "
                              f"one of {[str(d) for d in OUT_DTYPES]}.")
  k, n = lhs.shape[1], rhs.shape[2]
  if k % 64 or n % 64 or backward and k % 128:
    need = "K a multiple of 128 and N of 64" if backward else "K and N multiples of 64"
    raise NotImplementedError(
        f"K={k}, N={n}: the Mosaic GPU kernel needs {need} (whole TMA tiles).")


class PallasMosaicGpuRaggedDotVjp(pallas_common.PallasMosaicGpuOp, _base.RaggedDotVjp,
                                  name="ragged_dot.pallas_mosaic_gpu_vjp"):
  """ragged_dot backward in Mosaic GPU: d lhs with the forward kernel reading rhs
  transposed, d rhs with a per-group lhs^T @ dout kernel."""

  config_cls = PallasMosaicGpuRaggedDotConfig

  def _canonicalize(self, arguments):
    arguments = _base.RaggedDotVjp._canonicalize(self, arguments)
    _check_supported(arguments, backward=True)
    return arguments

  def _fwd(self, residuals, out, dout, lhs, rhs, group_sizes, *, precision=None,
           preferred_element_type=None, config):
    del residuals, out, precision, preferred_element_type
    kw = dict(interpret=self.interpret, **pallas_common.tunables_of(config))
    dout = dout.astype(rhs.dtype)  # one 16-bit operand dtype for wgmma
    dlhs = ragged_dot_dlhs_pallas_mosaic_gpu(dout, rhs, group_sizes,
                                             preferred_element_type=lhs.dtype, **kw)
    for name in _ROW_PRODUCT_TUNABLES:  # (not the rhs gradient's)
      del kw[name]
    drhs = ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, group_sizes, rhs.shape[0],
                                             preferred_element_type=rhs.dtype, **kw)
    return {"lhs": dlhs, "rhs": drhs}

  def _get_heuristics_config(self, ba):
    return PallasMosaicGpuRaggedDotConfig(**heuristic_tunables(*_problem(ba), product="backward"))

  def _get_autotuning_configs(self, ba):
    space = tunable_space(*_problem(ba), product="backward")
    return pallas_common.configs_from_tunables(PallasMosaicGpuRaggedDotConfig, space)


class PallasMosaicGpuRaggedDot(pallas_common.PallasMosaicGpuOp, _base.RaggedDot,
                               name="ragged_dot.pallas_mosaic_gpu"):
  """ragged_dot in Mosaic GPU for Hopper: group-aligned row tiles, warp-specialized
  TMA/wgmma pipeline, float32 accumulation. bfloat16 and float16 inputs only
  (float32 falls back); bfloat16 products are exact, so every `precision` is met."""

  config_cls = PallasMosaicGpuRaggedDotConfig
  vjp_cls = PallasMosaicGpuRaggedDotVjp

  def _canonicalize(self, arguments):
    arguments = _base.RaggedDot._canonicalize(self, arguments)
    _check_supported(arguments, backward=False)
    return arguments

  def _fwd(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, config):
    del precision
    out = ragged_dot_pallas_mosaic_gpu(lhs, rhs, group_sizes,
                                       preferred_element_type=preferred_element_type,
                                       interpret=self.interpret,
                                       **pallas_common.tunables_of(config))
    return out, None

  def _get_heuristics_config(self, ba):
    return PallasMosaicGpuRaggedDotConfig(**heuristic_tunables(
        *_problem(ba), out_dtype=ba.arguments["preferred_element_type"]))

  def _get_autotuning_configs(self, ba):
    space = tunable_space(*_problem(ba), out_dtype=ba.arguments["preferred_element_type"])
    return pallas_common.configs_from_tunables(PallasMosaicGpuRaggedDotConfig, space)
