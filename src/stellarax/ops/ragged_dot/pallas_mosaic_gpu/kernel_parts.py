"""What the three ragged_dot kernels share: the static tiling (`_Tiles`), the epilogue's
stores, wgmma steps, stage release, the warp-specialized pipeline and the persistent
launch, and the checks of the public functions.

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.core.config import config_dataclass
from stellarax.core import partitioning
from stellarax.ops import index_math
from stellarax.ops import pallas_backends
from stellarax.ops import pallas_common
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.tunables import (
    _check_dtype, check_tunables_fit, _INTERPRET_PROGRAMS, _MEMORY_REGISTERS, _MIN_SLAB, _MULTICAST_CTAS,
    _NUM_COMPUTE_WGS, OUT_DTYPES, PallasMosaicGpuRaggedDotConfig, _ROW_PRODUCT_TUNABLES,
    _TUNABLE_NAMES, _wg_tile)
from stellarax.ops.ragged_dot.pallas_mosaic_gpu.work_items import _num_sms

plgpu = pallas_backends.mosaic_gpu


@config_dataclass
class _Tiles(PallasMosaicGpuRaggedDotConfig):
  """The static tiling of one kernel launch: a validated config, with what the kernels
  derive from it."""

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
    slab = wn // self.epilogue_slabs  # whole _MIN_SLAB granules (check_tunables)
    # 128-column pieces where they divide the slab; 192 columns take three of 64 (one
    # piece of 128 left a 64-column remainder that no store fitted).
    piece = _PIECE_COLS if slab % _PIECE_COLS == 0 else _MIN_SLAB
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
    return index_math.rem(jnp.maximum(step, 0), self._stages)

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
  # The body is traced with 64-bit types off: jax's warp-specialized pipeline divides
  # its int32 step by Python ints with lax.rem, which fails under jax_enable_x64 (the
  # ints become int64; jax 0.11.2). Every operand here is already 32-bit or narrower.
  with jax.enable_x64(False):
    out = kernel(*operands)
  return partitioning.vary_like(out, operands)


def _row_operand(tiles: _Tiles) -> dict[str, Any]:
  """BlockSpec arguments of the operand a cluster's CTAs share (TMA multicast)."""
  return dict(collective_axes=("cluster",)) if tiles.multicast else {}


def _column_tile(tiles: _Tiles, pair_tile: jax.Array) -> jax.Array:
  """The output column tile of this CTA: its place within the cluster's `cluster_n`
  adjacent column tiles."""
  if not tiles.multicast:
    return pair_tile
  return pair_tile * tiles.cluster_n + lax.axis_index("cluster")


_STATIC = (*_TUNABLE_NAMES, "preferred_element_type", "interpret", "num_programs")
_DRHS_STATIC = tuple(name for name in _STATIC if name not in _ROW_PRODUCT_TUNABLES)


def _tunables_in(arguments: dict[str, Any]) -> dict[str, Any]:
  """The tunables among a public function's arguments (its `locals()` on entry)."""
  return {name: arguments[name] for name in _TUNABLE_NAMES if name in arguments}


def _prepare(tunables: dict[str, Any], *, k: int, n: int, product: str, operands, out_dtype):
  """Validates tunables and operands; returns the static tiling of the launch."""
  tiles = _Tiles(**tunables)  # validates them
  (a_name, a), (b_name, b) = operands
  _check_dtype(f"{a_name}.dtype", a.dtype)
  if a.dtype != b.dtype:
    raise ValueError(
        f"{a_name}.dtype={a.dtype} and {b_name}.dtype={b.dtype} differ; wgmma needs one "
        f"element type. Cast {b_name} to {a.dtype}.")
  out_dtype = _check_dtype("preferred_element_type", out_dtype, OUT_DTYPES)
  check_tunables_fit(tunables, k=k, n=n, product=product, out_itemsize=out_dtype.itemsize)
  return tiles, out_dtype


def _out_dtype(preferred_element_type: Any, like: jax.Array) -> Any:
  return like.dtype if preferred_element_type is None else preferred_element_type
