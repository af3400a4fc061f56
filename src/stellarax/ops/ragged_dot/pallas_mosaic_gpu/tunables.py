"""Tunables of the Mosaic GPU ragged_dot kernels: the limits of an H200 they are
checked against, their checks, the heuristic configs and the search spaces.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from stellarax.core.config import check_choice, check_power_of_two, config_dataclass
from stellarax.ops import pallas_common
from stellarax.ops.ragged_dot import split_k as _splits


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
# The narrowest column slab of the epilogue: a wgmma-layout register tile is sliced
# and stored in whole 64-column granules.
_MIN_SLAB = 64


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
  if epilogue_slabs not in slab_counts(wn):
    raise ValueError(
        f"epilogue_slabs={epilogue_slabs!r} must be one of {slab_counts(wn)}: each compute "
        f"warpgroup stores its {wm}x{wn} tile in column slabs of a whole number of "
        f"{_MIN_SLAB}-column granules, and the count is a power of two.")


def slab_counts(wn: int) -> list[int]:
  """The epilogue slab counts a warpgroup tile of wn columns takes: powers of two that cut
  it into slabs of a whole number of _MIN_SLAB-column granules (192 columns: only 1, as
  two slabs of 96 would split a granule)."""
  return [s for s in (1 << i for i in range((wn // _MIN_SLAB).bit_length()))
          if wn % (s * _MIN_SLAB) == 0]


@config_dataclass
class PallasMosaicGpuRaggedDotConfig:
  """Tiles, pipelining (stages, delayed release), tile order, split-K, epilogue slabs, CTA
  pairs (multicast) and half tiles of the Mosaic GPU ragged_dot kernels (see
  `validate_tunables`). The backward uses one config for both products (split_k and
  half_tiles apply to the lhs gradient; the rhs gradient, whose rows are its
  contraction, does neither).

  Raises:
    ValueError: from `validate_tunables`, for a tunable the kernels cannot use.
  """

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


# The kernels' keyword tunables: the config's fields, in order.
_TUNABLE_NAMES = tuple(f.name for f in dataclasses.fields(PallasMosaicGpuRaggedDotConfig))


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
  slab_choices = slab_counts(wn)
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
