"""layer_norm and rms_norm, forward and backward, as Pallas Triton kernels.

Layout. The wrappers move the normalised axis last and flatten every other axis
into rows, so each kernel sees a (rows, cols) array and normalises each row.
A program handles `block_rows` rows at a time; a row is read in chunks of
`block_cols` columns (a power of two). When `block_cols` is the padded row length
(the next power of two >= cols) a row is one chunk and is read once; otherwise
(rows longer than `MAX_BLOCK_COLS`, or a smaller chunk by choice) the kernels
loop over chunks and read a row once per pass. Columns and rows past the array
are masked.

Statistics, normalisation and gradients are computed in float32; the outputs
take the dtype of the input they belong to.

Reductions over rows (dscale, doffset). Each backward program walks
`blocks_per_program` consecutive row tiles, keeps running column sums in
registers and writes one float32 row of partial sums; the wrapper adds the
(programs, cols) partials with `jnp.sum`. We chose this over atomics because the
result is then deterministic (atomic float adds are not, and tuned results must
not change numerics between runs), and over a second Pallas kernel because the
partials are small (a few hundred rows) and an XLA reduction of them is already
at memory speed. `blocks_per_program` trades the partials' size against
parallelism. With chunked rows a column's running sum cannot stay in registers
across chunks, so it lives in the program's own row of the partials (read, add,
store per tile, with a CTA barrier between tiles); still deterministic.

Tunables (keyword-only in every wrapper; None picks the heuristic value):
  block_rows: rows per tile, a power of two.
  block_cols: columns per chunk, a power of two from MIN_BLOCK_COLS to
    max(MIN_BLOCK_COLS, next_power_of_2(cols)), and <= MAX_BLOCK_COLS.
  num_warps, num_stages: Triton compiler parameters.
  blocks_per_program (backward only): row tiles per program.
  prefetch (backward only, rows read in one chunk): load a program's next row tile
    before reducing the current one, so two tiles' loads are in flight. The H200
    compile (bench/compile_h200.py) shows why this matters: the backward's tile of
    (1, 8192) on 16 warps takes 108 registers a thread, so one program fits an SM,
    and without it that SM waits on one row's loads at a time.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.core.config import check_choice, check_positive_int
from stellarax.ops import pallas_backends
from stellarax.ops.normalization.reference import normalize_axes

plgpu = pallas_backends.triton

MAX_BLOCK_COLS = 16384
"""The longest chunk of a row; longer rows are read in several chunks."""

MIN_BLOCK_COLS = 16
"""The shortest chunk (the configs' floor); shorter rows are masked within one."""

MAX_TILE_ELEMENTS = 32768
"""The largest tile (block_rows * block_cols); larger tiles exhaust registers."""

NUM_WARPS_CHOICES = (1, 2, 4, 8, 16, 32)
MAX_NUM_STAGES = 8

# The heuristics and the search space are sized for the H200 (132 SMs), the
# project's target GPU; they stay valid, only less apt, on other GPUs.
_NUM_SMS = 132
# Backward programs the heuristic aims for: two per SM, so that few rows of
# partial sums are written yet every SM has a second program to switch to where
# registers let two share it. Where they do not (a (1, 8192) tile takes 108-128
# registers on 16 warps), the two run in turn: two waves of half the rows, as long
# as one wave of one program per SM (which the search space also holds).
_HEURISTIC_BWD_PROGRAMS = 2 * _NUM_SMS
# Bytes of input a tile should hold: enough in flight per program to hide memory
# latency, small enough to stay in registers.
_TILE_BYTES = 16384
# float32 elements per thread the heuristic aims for: 16 keeps two 16-byte
# vector loads per thread for 16-bit inputs without spilling.
_ELEMENTS_PER_THREAD = 16


def _next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _is_power_of_2_at_most(value: Any, maximum: int) -> bool:
  return (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum
          and value & (value - 1) == 0)


# ---------------------------------------------------------------------------
# Config validation.
# ---------------------------------------------------------------------------


def check_tunables(
    rows: int,
    cols: int,
    *,
    block_rows: int,
    block_cols: int,
    num_warps: int,
    num_stages: int,
    blocks_per_program: int | None = None,
    prefetch: bool | None = None,
) -> None:
  """Checks a config against a (rows, cols) problem.

  Args:
    rows: number of rows (product of the non-normalised dimensions), >= 1.
    cols: row length (size of the normalised dimension), >= 1.
    block_rows, block_cols, num_warps, num_stages: the tunables (module doc).
    blocks_per_program: the backward's row tiles per program; None for a
      forward config.
    prefetch: the backward's prefetch switch; None for a forward config.

  Raises:
    ValueError: naming the first tunable that is invalid for the shape, what
      was expected and what to pass instead.
  """
  max_rows = _next_power_of_2(rows)
  if not _is_power_of_2_at_most(block_rows, max_rows):
    raise ValueError(
        f"block_rows={block_rows!r} must be a power of two <= {max_rows} "
        f"(next_power_of_2({rows=})); a larger tile would only hold padding.")
  max_cols = min(_padded_cols(cols), MAX_BLOCK_COLS)
  if not _is_power_of_2_at_most(block_cols, max_cols):
    raise ValueError(
        f"block_cols={block_cols!r} must be a power of two <= {max_cols} "
        f"(min(max({MIN_BLOCK_COLS}, next_power_of_2({cols=})), {MAX_BLOCK_COLS})); pass "
        f"{max_cols} to read a row in as few chunks as possible.")
  if block_rows * block_cols > MAX_TILE_ELEMENTS:
    raise ValueError(
        f"block_rows * block_cols = {block_rows} * {block_cols} exceeds "
        f"{MAX_TILE_ELEMENTS} elements; lower block_rows to at most "
        f"{max(1, MAX_TILE_ELEMENTS // block_cols)}.")
  check_choice("num_warps", num_warps, NUM_WARPS_CHOICES)
  if not (isinstance(num_stages, int) and 1 <= num_stages <= MAX_NUM_STAGES):
    raise ValueError(f"num_stages={num_stages!r} must be an int in [1, {MAX_NUM_STAGES}].")
  if blocks_per_program is not None:
    check_positive_int("blocks_per_program", blocks_per_program)
    num_tiles = _cdiv(rows, block_rows)
    if blocks_per_program > num_tiles:
      raise ValueError(
          f"blocks_per_program={blocks_per_program} exceeds the {num_tiles} row "
          f"tiles of {rows=} with {block_rows=}; pass at most {num_tiles}.")
  if prefetch is not None:
    if not isinstance(prefetch, bool):
      raise ValueError(f"prefetch={prefetch!r} must be True or False.")
    if prefetch and block_cols < cols:
      raise ValueError(
          f"prefetch=True needs each row read in one chunk, but {block_cols=} < {cols=}; "
          f"pass prefetch=False, or block_cols={_padded_cols(cols)} if "
          f"{_padded_cols(cols)} <= {MAX_BLOCK_COLS}.")


# ---------------------------------------------------------------------------
# Heuristics and search space.
# ---------------------------------------------------------------------------


def _padded_cols(cols: int) -> int:
  """A row's length in lanes as one chunk: a power of two, at least MIN_BLOCK_COLS."""
  return max(MIN_BLOCK_COLS, _next_power_of_2(cols))


def _heuristic_block_cols(cols: int, itemsize: int) -> int:
  cols_p2 = _padded_cols(cols)
  if cols_p2 <= MAX_BLOCK_COLS:
    return cols_p2
  return _TILE_BYTES // itemsize


def _warps_for(tile: int) -> int:
  warps = tile // (32 * _ELEMENTS_PER_THREAD)
  return min(max(_next_power_of_2(warps), 1), 16)


def _blocks_per_program(rows: int, block_rows: int, programs: int) -> int:
  tiles = _cdiv(rows, block_rows)
  return max(1, _cdiv(tiles, programs))


def heuristic_tunables(
    rows: int, cols: int, dtype: Any, *, backward: bool = False
) -> dict[str, int]:
  """Returns a good config for a (rows, cols) problem without measuring.

  Aims for tiles of about 16 KiB of input, 16 float32 elements per thread, and
  (backward) about two programs per SM of an H200.

  Args:
    rows: number of rows, >= 1.
    cols: row length, >= 1.
    dtype: dtype of x.
    backward: config for the backward kernels (adds blocks_per_program and
      prefetch).

  Returns:
    Keyword arguments for the matching wrapper; they pass `check_tunables`.

  Raises:
    ValueError: if rows or cols is not a positive int.
  """
  check_positive_int("rows", rows)
  check_positive_int("cols", cols)
  itemsize = jnp.dtype(dtype).itemsize
  block_cols = _heuristic_block_cols(cols, itemsize)
  target_tile = max(block_cols, _TILE_BYTES // itemsize)
  block_rows = min(target_tile // block_cols, _next_power_of_2(rows))
  chunked = block_cols < cols
  config = dict(
      block_rows=block_rows,
      block_cols=block_cols,
      num_warps=_warps_for(block_rows * block_cols),
      # Pipelining only matters where the kernel loops over chunks. (Triton pipelines
      # none of these loads, the H200 compile shows, so the backward's loop over row
      # tiles prefetches by hand.)
      num_stages=2 if chunked else 1,
  )
  if backward:
    config["blocks_per_program"] = _blocks_per_program(rows, block_rows, _HEURISTIC_BWD_PROGRAMS)
    config["prefetch"] = _heuristic_prefetch(block_cols, cols)
  return config


def _heuristic_prefetch(block_cols: int, cols: int) -> bool:
  """Prefetch wherever it applies (rows in one chunk): the backward's tiles hold one
  program per SM (module doc), whose loads nothing else hides."""
  return block_cols >= cols


def _warp_options(tile: int, *, backward: bool) -> list[int]:
  """Warp counts that give each thread a sensible share of a tile.

  The backward keeps more float32 tiles live (x, dy, xhat, g), so it allows
  fewer elements per thread than the forward. When no count fits (tiny or huge
  tiles) the nearest one is kept.
  """
  low, high = (8, 32) if backward else (4, 64)
  options = (4, 8, 16, 32)
  kept = [w for w in options if low <= tile // (32 * w) <= high]
  if kept:
    return kept
  return [options[0]] if tile // (32 * options[0]) < low else [options[-1]]


def _space_axes(rows: int, cols: int, *, backward: bool):
  """(block_cols, block_rows, num_stages, programs, prefetch) options of the search
  space.

  programs is the number of backward programs aimed at (None for the forward),
  turned into blocks_per_program per block_rows; prefetch is None for the forward.
  """
  cols_p2 = _padded_cols(cols)
  if cols_p2 <= MAX_BLOCK_COLS:
    # A row is one chunk: vary the rows per tile. num_stages does not matter: the
    # forward has no loop, and Triton pipelines no load of the backward's loop over
    # row tiles (the H200 compile gives the same kernel for 1 and 3), which the
    # prefetch switch replaces.
    tiles = (4096, 8192) if backward else (2048, 4096, 8192, 16384)
    block_rows = sorted({max(1, min(t // cols_p2, _next_power_of_2(rows))) for t in tiles})
    # One program an SM is one wave where a program's registers leave room for no
    # second one (the (1, 8192) tile); two and eight let smaller tiles share SMs.
    programs = (_NUM_SMS, 2 * _NUM_SMS, 8 * _NUM_SMS) if backward else (None,)
    prefetch = (False, True) if backward else (None,)
    return [cols_p2], block_rows, (1,), programs, prefetch
  # Chunked rows: vary the chunk. One row per tile keeps the few rows a program
  # reads repeatedly (one pass for each statistic, one for the output) in L2.
  programs = (_NUM_SMS, 2 * _NUM_SMS, 8 * _NUM_SMS) if backward else (None,)
  return [2048, 4096, 8192, 16384], [1], (1, 3), programs, ((False,) if backward else (None,))


def tunable_space(
    rows: int, cols: int, dtype: Any, *, backward: bool = False
) -> list[dict[str, int]]:
  """Returns the configs worth measuring for a (rows, cols) problem.

  Every config passes `check_tunables`; the heuristic config is always included.
  Single-chunk rows vary the rows per tile and the warps; chunked rows vary the
  chunk length, warps and pipelining; the backward also varies the row tiles per
  program (about one, two and eight programs per SM), and with single-chunk rows
  the prefetch.

  Args:
    rows: number of rows, >= 1.
    cols: row length, >= 1.
    dtype: dtype of x.
    backward: configs for the backward kernels.

  Returns:
    A list of distinct configs (dicts of keyword arguments), 1 to about 40.

  Raises:
    ValueError: if rows or cols is not a positive int.
  """
  heuristic = heuristic_tunables(rows, cols, dtype, backward=backward)
  configs = {tuple(heuristic.items())}
  cols_options, rows_options, stage_options, program_options, prefetch_options = _space_axes(
      rows, cols, backward=backward)
  for block_cols, block_rows in itertools.product(cols_options, rows_options):
    warp_options = _warp_options(block_rows * block_cols, backward=backward)
    for num_warps, num_stages, programs, prefetch in itertools.product(
        warp_options, stage_options, program_options, prefetch_options):
      config = dict(block_rows=block_rows, block_cols=block_cols,
                    num_warps=num_warps, num_stages=num_stages)
      if programs is not None:
        config["blocks_per_program"] = _blocks_per_program(rows, block_rows, programs)
        config["prefetch"] = prefetch
      configs.add(tuple(config.items()))
  return [dict(c) for c in sorted(configs)]


def _resolve_tunables(rows: int, cols: int, dtype: Any, given: dict[str, Any], *,
                      backward: bool) -> dict[str, int]:
  """Fills the None tunables in `given` from the heuristic and validates."""
  heuristic = heuristic_tunables(rows, cols, dtype, backward=backward)
  config = {k: heuristic[k] if v is None else v for k, v in given.items()}
  if backward and given["blocks_per_program"] is None and isinstance(config["block_rows"], int):
    # Keep the heuristic's number of programs for a block_rows chosen by the caller.
    config["blocks_per_program"] = _blocks_per_program(
        rows, max(config["block_rows"], 1), _HEURISTIC_BWD_PROGRAMS)
  if backward and given["prefetch"] is None and isinstance(config["block_cols"], int):
    # A block_cols chosen by the caller may read rows in chunks, where there is no prefetch.
    config["prefetch"] = _heuristic_prefetch(config["block_cols"], cols)
  check_tunables(rows, cols, **config)
  return config


# ---------------------------------------------------------------------------
# Kernel helpers. `r` are row indices (block_rows,), `c` column indices
# (block_cols,); a mask is None when it is statically all true, which lets
# Triton drop it and keep loads fully vectorised.
# ---------------------------------------------------------------------------


def _tile_mask(row_mask, col_mask, shape):
  if row_mask is None and col_mask is None:
    return None
  if row_mask is None:
    return jnp.broadcast_to(col_mask[None, :], shape)
  if col_mask is None:
    return jnp.broadcast_to(row_mask[:, None], shape)
  return row_mask[:, None] & col_mask[None, :]


def _load_tile(ref, r, c, mask, eviction_policy=None, dtype=jnp.float32):
  """Loads ref[r, c] as `dtype` (None: ref's own), reading 0 where masked."""
  other = None if mask is None else 0.0
  tile = plgpu.load(ref.at[r[:, None], c[None, :]], mask=mask, other=other,
                    eviction_policy=eviction_policy)
  return tile if dtype is None else tile.astype(dtype)


def _store_tile(ref, r, c, mask, value):
  plgpu.store(ref.at[r[:, None], c[None, :]], value.astype(ref.dtype), mask=mask)


def _load_vec(ref, idx, mask):
  """Loads ref[idx] as float32, reading 0 where masked."""
  other = None if mask is None else 0.0
  return plgpu.load(ref.at[idx], mask=mask, other=other).astype(jnp.float32)


def _store_vec(ref, idx, mask, value):
  plgpu.store(ref.at[idx], value.astype(ref.dtype), mask=mask)


# ---------------------------------------------------------------------------
# Forward kernel.
# ---------------------------------------------------------------------------


def _fwd_kernel(*refs, rows, cols, block_rows, block_cols, epsilon, subtract_mean,
                has_scale, has_offset):
  """Normalises block_rows rows: y = (x - mean) * rstd * scale + offset."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref = refs.pop(0)
  mean_ref = refs.pop(0) if subtract_mean else None
  (rstd_ref,) = refs

  num_chunks = _cdiv(cols, block_cols)
  shape = (block_rows, block_cols)
  r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  row_mask = None if rows % block_rows == 0 else r < rows
  cols_exact = cols % block_cols == 0

  def chunk(k):
    c = k * block_cols + jnp.arange(block_cols)
    col_mask = None if cols_exact else c < cols
    return c, col_mask, _tile_mask(row_mask, col_mask, shape)

  def centred(x, mean, col_mask):
    # Padding columns read as 0 must not count towards the variance.
    xc = x - mean[:, None] if subtract_mean else x
    return xc if col_mask is None or not subtract_mean else jnp.where(col_mask[None, :], xc, 0.0)

  def normalise_and_store(x, c, col_mask, mask, mean, rstd):
    y = centred(x, mean, col_mask) * rstd[:, None]
    if has_scale:
      y = y * _load_vec(scale_ref, c, col_mask)[None, :]
    if has_offset:
      y = y + _load_vec(offset_ref, c, col_mask)[None, :]
    _store_tile(y_ref, r, c, mask, y)

  if num_chunks == 1:
    c, col_mask, mask = chunk(0)
    x = _load_tile(x_ref, r, c, mask)
    mean = jnp.sum(x, axis=1) / cols if subtract_mean else jnp.zeros((block_rows,), jnp.float32)
    var = jnp.sum(jnp.square(centred(x, mean, col_mask)), axis=1) / cols
    rstd = lax.rsqrt(var + epsilon)
    normalise_and_store(x, c, col_mask, mask, mean, rstd)
  else:
    def row_sum(fn):
      def body(k, acc):
        c, col_mask, mask = chunk(k)
        return acc + fn(_load_tile(x_ref, r, c, mask, "evict_last"), col_mask)
      acc = lax.fori_loop(0, num_chunks, body, jnp.zeros(shape, jnp.float32))
      return jnp.sum(acc, axis=1)

    mean = (row_sum(lambda x, _: x) / cols if subtract_mean
            else jnp.zeros((block_rows,), jnp.float32))
    var = row_sum(lambda x, col_mask: jnp.square(centred(x, mean, col_mask))) / cols
    rstd = lax.rsqrt(var + epsilon)

    def out_body(k, carry):
      c, col_mask, mask = chunk(k)
      x = _load_tile(x_ref, r, c, mask, "evict_first")
      normalise_and_store(x, c, col_mask, mask, mean, rstd)
      return carry

    lax.fori_loop(0, num_chunks, out_body, 0)

  if subtract_mean:
    _store_vec(mean_ref, r, row_mask, mean)
  _store_vec(rstd_ref, r, row_mask, rstd)


# ---------------------------------------------------------------------------
# Backward kernel.
# ---------------------------------------------------------------------------


def _bwd_kernel(*refs, rows, cols, block_rows, block_cols, blocks_per_program,
                subtract_mean, has_scale, want_doffset, prefetch, sync):
  """dx for blocks_per_program row tiles, plus partial column sums for dscale/doffset.

  With `prefetch` (rows read in one chunk only), each step loads the next tile before
  it reduces the current one, so that a program has two tiles' loads in flight.

  With xhat = (x - mean) * rstd and g = dy * scale (per row, n = cols):
    dx = rstd * (g - xhat * sum(g * xhat) / n - sum(g) / n)   (layer_norm)
    dx = rstd * (g - xhat * sum(g * xhat) / n)                (rms_norm)
    dscale = sum over rows of dy * xhat,  doffset = sum over rows of dy.
  Masked rows read mean = rstd = 0 and dy = 0 and masked columns read dy = 0,
  so they add nothing to any sum.
  """
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  dy_ref = refs.pop(0)
  dx_ref = refs.pop(0)
  dscale_ref = refs.pop(0) if has_scale else None
  doffset_ref = refs.pop(0) if want_doffset else None
  assert not refs

  num_chunks = _cdiv(cols, block_cols)
  shape = (block_rows, block_cols)
  program = pl.program_id(0)
  num_tiles = _cdiv(rows, block_rows)
  rows_exact = rows % block_rows == 0 and num_tiles % blocks_per_program == 0
  cols_exact = cols % block_cols == 0
  sums = [ref for ref in (dscale_ref, doffset_ref) if ref is not None]

  def rows_of(t):
    """The rows of this program's row tile t and their mask."""
    r = (program * blocks_per_program + t) * block_rows + jnp.arange(block_rows)
    return r, None if rows_exact else r < rows

  def stats_of(r, row_mask):
    """The rows' mean (None for rms_norm) and rstd."""
    mean = _load_vec(mean_ref, r, row_mask) if subtract_mean else None
    return mean, _load_vec(rstd_ref, r, row_mask)

  def chunk(k, row_mask):
    c = k * block_cols + jnp.arange(block_cols)
    col_mask = None if cols_exact else c < cols
    return c, col_mask, _tile_mask(row_mask, col_mask, shape)

  def load(r, c, mask):
    """x and dy of one tile, in their own dtypes."""
    return _load_tile(x_ref, r, c, mask, dtype=None), _load_tile(dy_ref, r, c, mask, dtype=None)

  def grads(x, dy, c, col_mask, mean, rstd):
    """(dy, xhat, g) of one tile (as `load` gave it), float32."""
    x, dy = x.astype(jnp.float32), dy.astype(jnp.float32)
    xhat = (x - mean[:, None] if subtract_mean else x) * rstd[:, None]
    g = dy * _load_vec(scale_ref, c, col_mask)[None, :] if has_scale else dy
    return dy, xhat, g

  def column_sums(dy, xhat):
    out = []
    if has_scale:
      out.append(jnp.sum(dy * xhat, axis=0))
    if want_doffset:
      out.append(jnp.sum(dy, axis=0))
    return out

  def dx_of(g, xhat, c1, c2, rstd):
    d = g - xhat * c1[:, None]
    if subtract_mean:
      d = d - c2[:, None]
    return d * rstd[:, None]

  if num_chunks == 1:
    c, col_mask, _ = chunk(0, None)

    def tile_inputs(t):
      """Tile t's x, dy (as loaded), mean and rstd."""
      r, row_mask = rows_of(t)
      return (*load(r, c, _tile_mask(row_mask, col_mask, shape)), *stats_of(r, row_mask))

    def tile_step(t, acc, inputs):
      """Stores tile t's dx and returns the column sums with its own added."""
      x, dy, mean, rstd = inputs
      r, row_mask = rows_of(t)
      mask = _tile_mask(row_mask, col_mask, shape)
      dy, xhat, g = grads(x, dy, c, col_mask, mean, rstd)
      c1 = jnp.sum(g * xhat, axis=1) / cols
      c2 = jnp.sum(g, axis=1) / cols
      _store_tile(dx_ref, r, c, mask, dx_of(g, xhat, c1, c2, rstd))
      return [a + s for a, s in zip(acc, column_sums(dy, xhat))]

    init = [jnp.zeros((block_cols,), jnp.float32) for _ in sums]
    if prefetch:
      # Two tiles a step, in turn: tile t+1's loads are issued before tile t is
      # reduced, and tile t+2's once tile t's inputs are dead, into their registers
      # (a loop carrying the next tile alone copies it into place every step, and
      # each copy waits for its load).
      def pair_body(i, carry):
        acc, current = carry
        t = 2 * i
        following = tile_inputs(t + 1)
        acc = tile_step(t, acc, current)
        # The last step of an even count reloads its own tile (from L2); that of an
        # odd count loads the tile left for after the loop.
        after = tile_inputs(jnp.minimum(t + 2, blocks_per_program - 1))
        return tile_step(t + 1, acc, following), after

      acc, last = lax.fori_loop(0, blocks_per_program // 2, pair_body, (init, tile_inputs(0)))
      if blocks_per_program % 2:
        acc = tile_step(blocks_per_program - 1, acc, last)
    else:
      acc = lax.fori_loop(0, blocks_per_program,
                          lambda t, acc: tile_step(t, acc, tile_inputs(t)), init)
    for ref, total in zip(sums, acc):
      _store_vec(ref, (program, c), col_mask, total)
    return

  # Chunked rows: the per-column sums cannot stay in registers across chunks, so
  # each program accumulates them in its own row of the partials, in place.
  def tile_body(t, carry):
    r, row_mask = rows_of(t)
    mean, rstd = stats_of(r, row_mask)

    def stats_body(k, acc):
      c, col_mask, mask = chunk(k, row_mask)
      _, xhat, g = grads(*load(r, c, mask), c, col_mask, mean, rstd)
      return acc[0] + g * xhat, acc[1] + g

    zeros = jnp.zeros(shape, jnp.float32)
    acc1, acc2 = lax.fori_loop(0, num_chunks, stats_body, (zeros, zeros))
    c1 = jnp.sum(acc1, axis=1) / cols
    c2 = jnp.sum(acc2, axis=1) / cols

    def dx_body(k, carry):
      c, col_mask, mask = chunk(k, row_mask)
      dy, xhat, g = grads(*load(r, c, mask), c, col_mask, mean, rstd)
      _store_tile(dx_ref, r, c, mask, dx_of(g, xhat, c1, c2, rstd))
      for ref, s in zip(sums, column_sums(dy, xhat)):
        # The first tile starts the sums; later tiles add to what it stored.
        previous = jnp.where(t > 0, _load_vec(ref, (program, c), col_mask), 0.0)
        _store_vec(ref, (program, c), col_mask, previous + s)
      return carry

    lax.fori_loop(0, num_chunks, dx_body, 0)
    if sync and sums:
      # The next tile re-reads partials that other threads of this program
      # stored; the barrier makes those stores visible.
      plgpu.debug_barrier()
    return carry

  lax.fori_loop(0, blocks_per_program, tile_body, 0)


# ---------------------------------------------------------------------------
# Wrappers.
# ---------------------------------------------------------------------------


def _normalised_axes(axis: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
  """Returns `axis` (an int or a tuple of ints) as sorted non-negative axes."""
  if ndim == 0:
    raise ValueError("x must have at least one dimension to normalise, got a scalar.")
  return normalize_axes(axis, ndim)


def _to_rows(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, tuple[int, ...]]:
  """Moves the normalised `axes` last and flattens both parts into (rows, cols).

  Returns (rows array, batch shape): the batch shape is x's shape less `axes`.
  """
  last = tuple(range(x.ndim - len(axes), x.ndim))
  moved = jnp.moveaxis(x, axes, last)
  batch, norm_shape = moved.shape[:x.ndim - len(axes)], moved.shape[x.ndim - len(axes):]
  if math.prod(norm_shape) == 0:
    raise ValueError(f"x (shape {x.shape}) is empty along the normalised axes {axes}; "
                     "a norm needs at least one element per row.")
  return moved.reshape(math.prod(batch), math.prod(norm_shape)), batch


def _from_rows(y2d: jax.Array, x_shape: tuple[int, ...], axes: tuple[int, ...]) -> jax.Array:
  """Inverts `_to_rows` for an output of x's shape."""
  kept = [a for a in range(len(x_shape)) if a not in axes]
  moved_shape = tuple(x_shape[a] for a in kept) + tuple(x_shape[a] for a in axes)
  last = tuple(range(len(kept), len(x_shape)))
  return jnp.moveaxis(y2d.reshape(moved_shape), last, axes)


def _param_as_row(name: str, value: jax.Array | None, x_shape: tuple[int, ...],
                  axes: tuple[int, ...]) -> jax.Array | None:
  """Checks a scale or offset (x's sizes along `axes`) and flattens it to one row."""
  if value is None:
    return None
  expected = tuple(x_shape[a] for a in axes)
  if value.shape != expected:
    raise ValueError(f"{name} must have shape {expected} (x's sizes along the normalised "
                     f"axes {axes}), got {value.shape}.")
  return value.reshape(-1)


def _check_residual(name: str, value: jax.Array, batch: tuple[int, ...]) -> None:
  if value.shape != batch:
    raise ValueError(f"{name} must have shape {batch} (x's shape without the normalised "
                     f"axis, as the forward returned it), got {value.shape}.")


def _compiler_params(config: dict[str, int]) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=config["num_warps"], num_stages=config["num_stages"])


def _norm_fwd(x, scale, offset, *, axis, epsilon, subtract_mean, given, interpret, name):
  """Shared forward: returns (y, mean or None, rstd)."""
  axes = _normalised_axes(axis, x.ndim)
  x2d, batch = _to_rows(x, axes)
  rows, cols = x2d.shape
  scale = _param_as_row("scale", scale, x.shape, axes)
  offset = _param_as_row("offset", offset, x.shape, axes)
  if rows == 0:
    empty = jnp.zeros(batch, jnp.float32)
    return x, (empty if subtract_mean else None), empty
  config = _resolve_tunables(rows, cols, x.dtype, given, backward=False)
  kernel = functools.partial(
      _fwd_kernel, rows=rows, cols=cols, block_rows=config["block_rows"],
      block_cols=config["block_cols"], epsilon=float(epsilon),
      subtract_mean=subtract_mean, has_scale=scale is not None,
      has_offset=offset is not None)
  stats = pallas_common.out_struct((rows,), jnp.float32, like=x)
  out_shape = [pallas_common.out_struct((rows, cols), x.dtype, like=x)] + [stats] * (2 if subtract_mean else 1)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(_cdiv(rows, config["block_rows"]),),
      compiler_params=_compiler_params(config), interpret=interpret, name=name,
  )(*[a for a in (x2d, scale, offset) if a is not None])
  y = _from_rows(outs[0], x.shape, axes)
  stats_out = [s.reshape(batch) for s in outs[1:]]
  return y, (stats_out[0] if subtract_mean else None), stats_out[-1]


def _norm_bwd(x, scale, mean, rstd, dy, *, axis, offset_dtype, given, interpret, name):
  """Shared backward: returns (dx, dscale or None, doffset or None).

  dscale has scale's dtype, doffset offset_dtype (None: the forward had no offset).
  """
  if dy.shape != x.shape:
    raise ValueError(f"dy must have x's shape {x.shape}, got {dy.shape}.")
  axes = _normalised_axes(axis, x.ndim)
  x2d, batch = _to_rows(x, axes)
  dy2d, _ = _to_rows(dy, axes)
  rows, cols = x2d.shape
  scale = _param_as_row("scale", scale, x.shape, axes)
  for label, residual in (("mean", mean), ("rstd", rstd)):
    if residual is not None:
      _check_residual(label, residual, batch)
  has_scale, want_doffset = scale is not None, offset_dtype is not None

  def finish(dx, partials):
    # Each (programs, cols) float32 partial sum becomes one total in its parameter's shape.
    totals = iter(jnp.sum(p, axis=0).reshape(tuple(x.shape[a] for a in axes))
              for p in partials)
    dscale = next(totals).astype(scale.dtype) if has_scale else None
    doffset = next(totals).astype(offset_dtype) if want_doffset else None
    return dx, dscale, doffset

  if rows == 0:
    return finish(jnp.zeros_like(x), [jnp.zeros((1, cols), jnp.float32)] * (has_scale + want_doffset))
  config = _resolve_tunables(rows, cols, x.dtype, given, backward=True)
  programs = _cdiv(_cdiv(rows, config["block_rows"]), config["blocks_per_program"])
  kernel = functools.partial(
      _bwd_kernel, rows=rows, cols=cols, block_rows=config["block_rows"],
      block_cols=config["block_cols"], blocks_per_program=config["blocks_per_program"],
      subtract_mean=mean is not None, has_scale=has_scale, want_doffset=want_doffset,
      prefetch=config["prefetch"], sync=not interpret)
  partial_sums = pallas_common.out_struct((programs, cols), jnp.float32, like=x)
  out_shape = [pallas_common.out_struct((rows, cols), x.dtype, like=x)]
  out_shape += [partial_sums] * (int(has_scale) + int(want_doffset))
  inputs = [x2d, scale, None if mean is None else mean.reshape(rows),
            rstd.reshape(rows), dy2d]
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(programs,),
      compiler_params=_compiler_params(config), interpret=interpret, name=name,
  )(*[a for a in inputs if a is not None])
  return finish(_from_rows(outs[0], x.shape, axes), outs[1:])


def layer_norm_fwd_pallas_triton(
    x: jax.Array,
    scale: jax.Array | None,
    offset: jax.Array | None,
    *,
    axis: int | tuple[int, ...] = -1,
    epsilon: float = 1e-6,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """layer_norm forward: (x - mean) * rsqrt(var + epsilon) * scale + offset.

  Args:
    x: input of any shape with at least one dimension.
    scale: multiplier of x's sizes along `axis`, or None for none.
    offset: addend of x's sizes along `axis`, or None for none.
    axis: the dimension, or dimensions, to normalise over.
    epsilon: added to the variance before the reciprocal square root.
    block_rows, block_cols, num_warps, num_stages: tunables (module doc); None
      takes the value of `heuristic_tunables`.
    interpret: run the kernel in Pallas interpret mode (on any backend).

  Returns:
    (y, mean, rstd): y with x's shape and dtype; mean and rstd float32 with x's
    shape less `axis`, the residuals `layer_norm_bwd_pallas_triton` takes.

  Raises:
    ValueError: for an empty normalised axis, an out-of-range axis, a scale or
      offset of the wrong shape, or an invalid tunable (`check_tunables`).
  """
  given = dict(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps,
               num_stages=num_stages)
  return _norm_fwd(x, scale, offset, axis=axis, epsilon=epsilon, subtract_mean=True,
                   given=given, interpret=interpret, name="layer_norm_fwd")


def rms_norm_fwd_pallas_triton(
    x: jax.Array,
    scale: jax.Array | None,
    offset: jax.Array | None = None,
    *,
    axis: int | tuple[int, ...] = -1,
    epsilon: float = 1e-6,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """rms_norm forward: x * rsqrt(mean(x^2) + epsilon) * scale + offset.

  Args:
    x: input of any shape with at least one dimension.
    scale: multiplier of x's sizes along `axis`, or None for none.
    offset: addend of x's sizes along `axis`, or None for none (the usual
      rms_norm has none; with one, pass its dtype as `offset_dtype` to
      `rms_norm_bwd_pallas_triton` for doffset).
    axis: the dimension, or dimensions, to normalise over.
    epsilon: added to the mean square before the reciprocal square root.
    block_rows, block_cols, num_warps, num_stages: tunables (module doc); None
      takes the value of `heuristic_tunables`.
    interpret: run the kernel in Pallas interpret mode (on any backend).

  Returns:
    (y, rstd): y with x's shape and dtype; rstd float32 with x's shape less
    `axis`, the residual `rms_norm_bwd_pallas_triton` takes.

  Raises:
    ValueError: for an empty normalised axis, an out-of-range axis, a scale or
      offset of the wrong shape, or an invalid tunable (`check_tunables`).
  """
  given = dict(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps,
               num_stages=num_stages)
  y, _, rstd = _norm_fwd(x, scale, offset, axis=axis, epsilon=epsilon, subtract_mean=False,
                         given=given, interpret=interpret, name="rms_norm_fwd")
  return y, rstd


def layer_norm_bwd_pallas_triton(
    x: jax.Array,
    scale: jax.Array | None,
    mean: jax.Array,
    rstd: jax.Array,
    dy: jax.Array,
    *,
    offset_dtype: Any | None,
    axis: int | tuple[int, ...] = -1,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    blocks_per_program: int | None = None,
    prefetch: bool | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """layer_norm backward from the forward's residuals.

  Args:
    x: the forward's input.
    scale: the forward's scale, or None.
    mean, rstd: the residuals `layer_norm_fwd_pallas_triton` returned.
    dy: cotangent of y, x's shape.
    offset_dtype: dtype of the forward's offset, or None if it had none (then
      doffset is None). The kernel never reads the offset itself.
    axis: the forward's axis.
    block_rows, block_cols, num_warps, num_stages, blocks_per_program, prefetch:
      tunables (module doc); None takes the value of
      `heuristic_tunables(backward=True)`.
    interpret: run the kernel in Pallas interpret mode (on any backend).

  Returns:
    (dx, dscale, doffset): dx with x's shape and dtype; dscale in scale's dtype
    (None without scale); doffset in offset_dtype (None without offset).

  Raises:
    ValueError: for a None mean, shapes that do not match x, or an invalid
      tunable.
  """
  if mean is None:
    raise ValueError("layer_norm backward needs the forward's mean residual, got None; "
                     "for a norm without mean subtraction use rms_norm_bwd_pallas_triton.")
  given = dict(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps,
               num_stages=num_stages, blocks_per_program=blocks_per_program,
               prefetch=prefetch)
  return _norm_bwd(x, scale, mean, rstd, dy, axis=axis, offset_dtype=offset_dtype, given=given,
                   interpret=interpret, name="layer_norm_bwd")


def rms_norm_bwd_pallas_triton(
    x: jax.Array,
    scale: jax.Array | None,
    rstd: jax.Array,
    dy: jax.Array,
    *,
    offset_dtype: Any | None = None,
    axis: int | tuple[int, ...] = -1,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    blocks_per_program: int | None = None,
    prefetch: bool | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """rms_norm backward from the forward's residual.

  Args:
    x: the forward's input.
    scale: the forward's scale, or None.
    rstd: the residual `rms_norm_fwd_pallas_triton` returned.
    dy: cotangent of y, x's shape.
    offset_dtype: dtype of the forward's offset, or None if it had none (the
      usual rms_norm; then doffset is None).
    axis: the forward's axis.
    block_rows, block_cols, num_warps, num_stages, blocks_per_program, prefetch:
      tunables (module doc); None takes the value of
      `heuristic_tunables(backward=True)`.
    interpret: run the kernel in Pallas interpret mode (on any backend).

  Returns:
    (dx, dscale, doffset): dx with x's shape and dtype; dscale in scale's dtype
    (None without scale); doffset in offset_dtype (None without offset).

  Raises:
    ValueError: for shapes that do not match x or an invalid tunable.
  """
  given = dict(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps,
               num_stages=num_stages, blocks_per_program=blocks_per_program,
               prefetch=prefetch)
  return _norm_bwd(x, scale, None, rstd, dy, axis=axis, offset_dtype=offset_dtype, given=given,
                   interpret=interpret, name="rms_norm_bwd")


# ---------------------------------------------------------------------------
# Op classes: layer_norm.pallas_triton and its VJP.

from stellarax.core.config import config_dataclass  # noqa: E402
from stellarax.core.config import check_power_of_two  # noqa: E402
from stellarax.ops.normalization import base as _base  # noqa: E402
from stellarax.ops import pallas_common  # noqa: E402


@config_dataclass
class PallasTritonLayerNormConfig:
  """Tunables of the Pallas Triton layer_norm forward (see `check_tunables`)."""

  block_rows: int
  block_cols: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_power_of_two("block_rows", self.block_rows)
    check_power_of_two("block_cols", self.block_cols, minimum=MIN_BLOCK_COLS)
    check_power_of_two("num_warps", self.num_warps, maximum=32)
    if not 1 <= self.num_stages <= MAX_NUM_STAGES:
      raise ValueError(f"num_stages={self.num_stages!r} must be in [1, {MAX_NUM_STAGES}].")


@config_dataclass
class PallasTritonLayerNormVjpConfig:
  """Tunables of the Pallas Triton layer_norm backward."""

  block_rows: int
  block_cols: int
  num_warps: int
  num_stages: int
  blocks_per_program: int
  # A default, so that entries cached before the switch existed load as what they ran.
  prefetch: bool = False

  def __post_init__(self):
    PallasTritonLayerNormConfig.__post_init__(self)
    if not isinstance(self.blocks_per_program, int) or self.blocks_per_program < 1:
      raise ValueError(f"blocks_per_program={self.blocks_per_program!r} must be a positive int.")
    if not isinstance(self.prefetch, bool):
      raise ValueError(f"prefetch={self.prefetch!r} must be True or False.")


def _rows_cols(ba) -> tuple[int, int, str]:
  """The (rows, cols) problem the kernels see (`_to_rows`), and x's dtype."""
  x = ba.arguments["x"]
  axes = _normalised_axes(ba.arguments["axis"], len(x.shape))
  cols = math.prod(x.shape[a] for a in axes)
  return max(1, math.prod(x.shape) // max(cols, 1)), cols, x.dtype


class PallasTritonLayerNormVjp(pallas_common.PallasTritonOp, _base.LayerNormVjp,
                               name="layer_norm.pallas_triton_vjp"):
  """layer_norm / rms_norm backward in Pallas Triton, from the forward's
  float32 mean and rstd residuals."""

  config_cls = PallasTritonLayerNormVjpConfig

  def _fwd(self, residuals, out, dout, x, scale=None, offset=None, *, axis, epsilon, subtract_mean, config):
    del out, epsilon
    mean, rstd = residuals if subtract_mean else (None, *residuals)
    dx, dscale, doffset = _norm_bwd(
        x, scale, mean, rstd, dout.astype(x.dtype), axis=axis,
        offset_dtype=None if offset is None else offset.dtype,
        given=pallas_common.tunables_of(config), interpret=self.interpret,
        name="layer_norm_bwd" if subtract_mean else "rms_norm_bwd")
    grads = {"x": dx, "scale": dscale, "offset": doffset}
    return {name: g for name, g in grads.items() if g is not None}  # as the reference's

  def _get_heuristics_config(self, ba):
    rows, cols, dtype = _rows_cols(ba)
    return PallasTritonLayerNormVjpConfig(**heuristic_tunables(rows, cols, dtype, backward=True))

  def _get_autotuning_configs(self, ba):
    rows, cols, dtype = _rows_cols(ba)
    return pallas_common.configs_from_tunables(PallasTritonLayerNormVjpConfig,
                                               tunable_space(rows, cols, dtype, backward=True))


class PallasTritonLayerNorm(pallas_common.PallasTritonOp, _base.LayerNorm, name="layer_norm.pallas_triton"):
  """layer_norm / rms_norm forward in Pallas Triton, over any axes (moved last)."""

  config_cls = PallasTritonLayerNormConfig
  vjp_cls = PallasTritonLayerNormVjp

  def _fwd(self, x, scale=None, offset=None, *, axis, epsilon, subtract_mean, config):
    y, mean, rstd = _norm_fwd(
        x, scale, offset, axis=axis, epsilon=epsilon, subtract_mean=subtract_mean,
        given=pallas_common.tunables_of(config), interpret=self.interpret,
        name="layer_norm_fwd" if subtract_mean else "rms_norm_fwd")
    return y, ((mean, rstd) if subtract_mean else (rstd,))

  def _get_heuristics_config(self, ba):
    return PallasTritonLayerNormConfig(**heuristic_tunables(*_rows_cols(ba)))

  def _get_autotuning_configs(self, ba):
    return pallas_common.configs_from_tunables(PallasTritonLayerNormConfig, tunable_space(*_rows_cols(ba)))
