"""Tests of the Pallas Mosaic GPU ragged_dot kernels (Hopper: wgmma, TMA, warp specialization).

Numerics run in Mosaic GPU interpret mode on the CPU against float32 HIGHEST references
on upcast inputs (`reference.py`, and `jax.lax.ragged_dot` with its VJP through the op
classes). The kernel-level runs switch on the interpreter's happens-before race
detector, which models the warpgroups, the TMA engine and (with fresh clocks per
CTA) the CTAs as concurrent; interpret mode still runs CTAs one after another, so the
invariants that make the persistent schedule race-free (work items partition the
rows; the tile order is a bijection) are also tested directly. Lowering (Pallas to
Mosaic GPU, layout inference, shared-memory budget) is checked for a simulated H200.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
# Interpret mode imports this module lazily, which adds an entry to JAX's tracing
# context and so makes every jitted function retrace once; importing it first keeps
# the compiled kernels shared between tests.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
# The race detector's findings are not exported by jax.experimental yet.
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from race_check import RACE_CHECK  # tests/ is on sys.path
from h200 import lower_for_h200  # tests/ is on sys.path

import stellarax
from stellarax.ops.ragged_dot import pallas_mosaic_gpu as pm
from stellarax.ops.ragged_dot.pallas_mosaic_gpu import kernel_parts
from stellarax.ops.ragged_dot.reference import ragged_dot_reference, ragged_dot_rhs_grad_reference

# Relative to the largest reference value (inputs are O(1)): 16-bit outputs round to
# 8 (bfloat16) or 11 (float16) significant bits after float32 accumulation; float32
# outputs of 16-bit products differ only by summation order.
TOLERANCES = {
    jnp.dtype(jnp.bfloat16): 1e-2,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.float32): 1e-5,
}
# The custom-call target of Mosaic GPU kernels (jax.experimental.mosaic.gpu.core).
MOSAIC_GPU_TARGET = "mosaic_gpu_v2"


@dataclasses.dataclass(frozen=True)
class Workload:
  """A ragged_dot problem (few tiles, so interpret mode stays fast)."""
  m: int
  k: int
  n: int
  group_sizes: tuple[int, ...]

  @property
  def g(self) -> int:
    return len(self.group_sizes)


# Group sizes are runtime values, so workloads that differ only in them share one
# compiled kernel (compiling dominates the run time of these tests).
_A = Workload(150, 128, 192, (37, 0, 50, 40))
WORKLOADS = {
    # Sizes not multiples of the tile or of 8, an empty group, rows past the last group.
    "ragged": _A,
    # The groups ask for more rows than M: group 1 is cut at row M, group 3 vanishes.
    "overflowing": dataclasses.replace(_A, group_sizes=(60, 100, 0, 5)),
    "all_empty": dataclasses.replace(_A, group_sizes=(0, 0, 0, 0)),
    # M below one tile and not a multiple of 8 (padded); the first group is empty.
    "small": Workload(45, 128, 256, (0, 21, 17)),
}
# Two compute warpgroups splitting M (A) or N (B); two CTAs each run several tiles.
CONFIG_A = dict(block_m=128, block_n=64, block_k=64, max_concurrent_steps=2, wg_split="m",
                grid_minor_dim="m", grid_tile_width=2)
CONFIG_B = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=3, wg_split="n",
                grid_minor_dim="n", grid_tile_width=1)
# 64 x 128 warpgroup tiles stored in two 64-column slabs.
CONFIG_SLABS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=2, wg_split="m",
                    grid_minor_dim="m", grid_tile_width=2, epilogue_slabs=2)


def _inputs(w: Workload, dtype, seed: int = 0):
  """Fresh random lhs (M, K), rhs (G, K, N), dout (M, N), O(1) products, and the sizes."""
  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(keys[0], (w.m, w.k), jnp.float32)
  rhs = jax.random.normal(keys[1], (w.g, w.k, w.n), jnp.float32) / np.sqrt(w.k)
  dout = jax.random.normal(keys[2], (w.m, w.n), jnp.float32) / np.sqrt(w.m / w.g)
  sizes = jnp.asarray(w.group_sizes, jnp.int32)
  return lhs.astype(dtype), rhs.astype(dtype), dout.astype(dtype), sizes


def _f32(x):
  return x.astype(jnp.float32)


def _assert_close(actual, expected, dtype):
  expected = np.asarray(expected, np.float32)
  tol = TOLERANCES[jnp.dtype(dtype)]
  np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=tol,
                             atol=tol * max(1.0, float(np.abs(expected).max())))


def _total_rows(w: Workload) -> int:
  return min(sum(w.group_sizes), w.m)


def _no_races():
  return not get_races().races_found


# ------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("name", ["ragged", "overflowing", "all_empty"])
@pytest.mark.mosaic_interpret
def test_forward_matches_reference(name):
  w = WORKLOADS[name]
  lhs, rhs, _, sizes = _inputs(w, jnp.bfloat16)
  out = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=RACE_CHECK, **CONFIG_A)
  assert out.shape == (w.m, w.n) and out.dtype == jnp.bfloat16
  assert _no_races()
  _assert_close(out, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.bfloat16)
  # Rows in no group are exactly zero; rows in a group are not.
  total = _total_rows(w)
  assert np.all(np.asarray(out[total:], np.float32) == 0.0)
  assert np.all(np.abs(np.asarray(out[:total], np.float32)).max(axis=1) > 0.0)


@pytest.mark.mosaic_interpret
def test_forward_float16_to_float32_with_split_n():
  w = WORKLOADS["small"]
  lhs, rhs, _, sizes = _inputs(w, jnp.float16, seed=1)
  out = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                        interpret=RACE_CHECK, **CONFIG_B)
  assert out.dtype == jnp.float32 and _no_races()
  # Products of float16 values are exact in float32: only summation order differs.
  _assert_close(out, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.float32)


@pytest.mark.parametrize("name", ["ragged", "overflowing"])
@pytest.mark.mosaic_interpret
def test_dlhs_matches_reference(name):
  w = WORKLOADS[name]
  lhs, rhs, dout, sizes = _inputs(w, jnp.bfloat16, seed=2)
  dlhs = pm.ragged_dot_dlhs_pallas_mosaic_gpu(dout, rhs, sizes, preferred_element_type=lhs.dtype,
                                              interpret=RACE_CHECK, **CONFIG_A)
  assert dlhs.shape == (w.m, w.k) and dlhs.dtype == jnp.bfloat16 and _no_races()
  expected = ragged_dot_reference(_f32(dout), jnp.swapaxes(_f32(rhs), 1, 2), sizes)
  _assert_close(dlhs, expected, jnp.bfloat16)
  assert np.all(np.asarray(dlhs[_total_rows(w):], np.float32) == 0.0)


@pytest.mark.parametrize("name, config, dtype", [
    ("ragged", CONFIG_A, jnp.bfloat16),       # wg_split="m": each warpgroup masks its lhs columns
    ("overflowing", CONFIG_A, jnp.bfloat16),
    ("all_empty", CONFIG_A, jnp.bfloat16),
    ("small", CONFIG_B, jnp.float16),         # wg_split="n": each masks its dout columns
])
@pytest.mark.mosaic_interpret
def test_drhs_matches_reference(name, config, dtype):
  w = WORKLOADS[name]
  lhs, _, dout, sizes = _inputs(w, dtype, seed=3)
  drhs = pm.ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, sizes, w.g,
                                              preferred_element_type=lhs.dtype,
                                              interpret=RACE_CHECK, **config)
  assert drhs.shape == (w.g, w.k, w.n) and drhs.dtype == jnp.dtype(dtype) and _no_races()
  _assert_close(drhs, ragged_dot_rhs_grad_reference(_f32(lhs), _f32(dout), sizes, w.g), dtype)
  # Empty groups (and those cut away at row M) get exact zeros.
  start = 0
  for group, size in enumerate(w.group_sizes):
    end = min(start + size, w.m)
    assert (np.abs(np.asarray(drhs[group], np.float32)).max() == 0.0) == (start == end)
    start = end


def _per_group_drhs(lhs, dout, group_sizes):
  """drhs[g] = lhs[rows of g].T @ dout[rows of g] in float32 NumPy: a non-finite value
  reaches only its own group's gradient."""
  lhs, dout = np.asarray(lhs, np.float32), np.asarray(dout, np.float32)
  out, start = [], 0
  for size in group_sizes:
    end = min(start + size, lhs.shape[0])
    with np.errstate(invalid="ignore", over="ignore"):
      out.append(lhs[start:end].T @ dout[start:end])
    start = end
  return np.stack(out)


@pytest.mark.parametrize("config", [CONFIG_A, CONFIG_B], ids=["split m", "split n"])
@pytest.mark.mosaic_interpret
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_drhs_keeps_non_finite_rows_in_their_own_group(config):
  # A step crossing a group's edge zeroed one operand's rows outside the group (lhs
  # with "m", dout with "n"), and 0 x NaN is NaN: a NaN in the other operand's row
  # there, or in a row of no group, made a neighbouring group's gradient NaN.
  w = Workload(150, 128, 256, (37, 0, 50, 40))  # Rows 127-149 are in no group.
  lhs, _, dout, sizes = _inputs(w, jnp.bfloat16, seed=12)
  lhs = lhs.at[40, 5].set(jnp.nan).at[130, 7].set(jnp.inf)    # Group 2; no group.
  dout = dout.at[90, 3].set(jnp.inf).at[140, 9].set(jnp.nan)  # Group 3; no group.
  drhs = pm.ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, sizes, w.g,
                                              preferred_element_type=jnp.float32,
                                              interpret=RACE_CHECK, **config)
  assert _no_races()
  expected = _per_group_drhs(lhs, dout, w.group_sizes)
  assert np.isfinite(expected[[0, 1]]).all() and not np.isfinite(expected[[2, 3]]).all()
  # NaN where the group's own rows give it (inf x 0 included), the rest as float32.
  finite = np.abs(expected[np.isfinite(expected)]).max()
  np.testing.assert_allclose(np.asarray(drhs), expected, rtol=1e-5, atol=1e-5 * finite)


@pytest.mark.mosaic_interpret
def test_split_k_forward_and_dlhs_match_reference():
  """Split-K: float32 partials of 2 contraction shares summed, awkward groups."""
  w = WORKLOADS["ragged"]  # K = 128: two shares of one 64-wide step
  lhs, rhs, dout, sizes = _inputs(w, jnp.bfloat16, seed=6)
  config = CONFIG_A | dict(split_k=2)
  out = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=RACE_CHECK, **config)
  assert out.shape == (w.m, w.n) and out.dtype == jnp.bfloat16 and _no_races()
  _assert_close(out, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.bfloat16)
  assert np.all(np.asarray(out[_total_rows(w):], np.float32) == 0.0)
  small = WORKLOADS["small"]  # the lhs gradient's contraction N = 256: two shares of two steps
  _, rhs, dout, sizes = _inputs(small, jnp.float16, seed=7)
  dlhs = pm.ragged_dot_dlhs_pallas_mosaic_gpu(dout, rhs, sizes, interpret=RACE_CHECK,
                                              preferred_element_type=jnp.float32,
                                              **(CONFIG_B | dict(split_k=2)))
  assert dlhs.shape == (small.m, small.k) and dlhs.dtype == jnp.float32 and _no_races()
  expected = ragged_dot_reference(_f32(dout), jnp.swapaxes(_f32(rhs), 1, 2), sizes)
  _assert_close(dlhs, expected, jnp.float32)


def _check_row_products(w: Workload, config: dict, seed: int):
  """The forward and lhs-gradient kernels (the ragged rows are their output rows) with
  `config` on `w` (bfloat16) against the references, under the race detector; returns
  (lhs, rhs, dout, sizes)."""
  lhs, rhs, dout, sizes = _inputs(w, jnp.bfloat16, seed=seed)
  out = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=RACE_CHECK, **config)
  assert _no_races()
  _assert_close(out, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.bfloat16)
  assert np.all(np.asarray(out[_total_rows(w):], np.float32) == 0.0)
  dlhs = pm.ragged_dot_dlhs_pallas_mosaic_gpu(dout, rhs, sizes, interpret=RACE_CHECK, **config)
  assert _no_races()
  expected = ragged_dot_reference(_f32(dout), jnp.swapaxes(_f32(rhs), 1, 2), sizes)
  _assert_close(dlhs, expected, jnp.bfloat16)
  return lhs, rhs, dout, sizes


def _check_three_products(w: Workload, config: dict, seed: int):
  """`_check_row_products`, and the rhs-gradient kernel; returns (lhs, rhs, sizes)."""
  lhs, rhs, dout, sizes = _check_row_products(w, config, seed)
  drhs = pm.ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, sizes, w.g, interpret=RACE_CHECK,
                                              **config)
  assert _no_races()
  _assert_close(drhs, ragged_dot_rhs_grad_reference(_f32(lhs), _f32(dout), sizes, w.g),
                jnp.bfloat16)
  return lhs, rhs, sizes


@pytest.mark.slow  # CI's slow stage (`make test` within 10 minutes on two cores)
@pytest.mark.mosaic_interpret
def test_epilogue_slabs_match_reference():
  """Output tiles stored one 64-column slab at a time (ragged rows: each slab's own
  ladder of boxes), in the three kernels and in float32 split-K partials."""
  # K = 128, N = 256; M below one tile, an empty first group.
  lhs, rhs, sizes = _check_three_products(WORKLOADS["small"], CONFIG_SLABS, seed=8)
  split = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                          interpret=RACE_CHECK, **(CONFIG_SLABS | dict(split_k=2)))
  assert split.dtype == jnp.float32 and _no_races()
  _assert_close(split, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.float32)


# 64 x 256 warpgroup tiles stored whole: a slab wider than 128 columns is two pieces.
CONFIG_PIECES = dict(block_m=128, block_n=256, block_k=64, max_concurrent_steps=2, wg_split="m",
                     grid_minor_dim="m", grid_tile_width=2)


@pytest.mark.mosaic_interpret
def test_wide_slabs_are_stored_in_pieces():
  """A 256-column slab, held as two 128-column pieces with TMA boxes each (jax 0.12
  cannot store it whole), in the forward and the rhs gradient (the lhs gradient's
  output, K = 128 columns, takes no 256-column tile)."""
  w = WORKLOADS["small"]  # N = 256; M below one tile, an empty first group
  lhs, rhs, dout, sizes = _inputs(w, jnp.bfloat16, seed=11)
  out = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=RACE_CHECK, **CONFIG_PIECES)
  assert _no_races()
  _assert_close(out, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.bfloat16)
  assert np.all(np.asarray(out[_total_rows(w):], np.float32) == 0.0)
  drhs = pm.ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, sizes, w.g, interpret=RACE_CHECK,
                                              **CONFIG_PIECES)
  assert _no_races()
  _assert_close(drhs, ragged_dot_rhs_grad_reference(_f32(lhs), _f32(dout), sizes, w.g),
                jnp.bfloat16)


# 64 x 192 warpgroup tiles: a 192-column slab is three pieces of 64 (it was one of 128,
# which left 64 columns no store fitted: the space offered it, no kernel traced it).
CONFIG_192 = dict(block_m=128, block_n=192, block_k=64, max_concurrent_steps=2, wg_split="m",
                  grid_minor_dim="m", grid_tile_width=8)


@pytest.mark.mosaic_interpret
def test_192_column_tiles_are_stored_in_granule_pieces():
  w = WORKLOADS["ragged"]  # N = 192
  lhs, rhs, dout, sizes = _inputs(w, jnp.bfloat16, seed=12)
  out = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=RACE_CHECK, **CONFIG_192)
  assert _no_races()
  _assert_close(out, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.bfloat16)
  drhs = pm.ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, sizes, w.g, interpret=RACE_CHECK,
                                              **CONFIG_192)
  assert _no_races()
  _assert_close(drhs, ragged_dot_rhs_grad_reference(_f32(lhs), _f32(dout), sizes, w.g),
                jnp.bfloat16)
  # Two slabs of 96 columns would split a 64-column granule: refused, naming the choices.
  with pytest.raises(ValueError, match=r"epilogue_slabs=2 must be one of \[1\]"):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=True, **CONFIG_192, epilogue_slabs=2)
  assert pm.slab_counts(256) == [1, 2, 4] and pm.slab_counts(192) == [1] and pm.slab_counts(64) == [1]


# K = 256: 4 contraction steps of 64 in 3 stages, so stages are refilled within a tile;
# group 0 spans 4 row steps of the rhs gradient.
_LONG = Workload(300, 256, 192, (200, 0, 90))
CONFIG_DELAYED = CONFIG_A | dict(max_concurrent_steps=3, delay_release=True)


@pytest.mark.mosaic_interpret
def test_delayed_release_matches_reference():
  """One wgmma kept in flight, each stage freed a step later (manual consumed barriers),
  in all three kernels; the race detector (which, with check_reads, sees when a
  stage's wgmma is done) finds nothing."""
  _check_three_products(_LONG, CONFIG_DELAYED, seed=9)


@pytest.mark.mosaic_interpret
def test_a_stage_freed_before_its_wgmma_is_done_is_a_race(monkeypatch):
  """The bug delay_release must not have, planted: each stage freed before its wgmma is
  awaited. The interpreter runs wgmma at once, so only the reads `check_reads` adds
  where the wgmma completes show the refill racing with it."""
  free, wait = kernel_parts._StageRelease._free, kernel_parts._StageRelease._await

  def free_then_wait(self, mma, step, in_flight):
    free(self, step)
    wait(self, mma, step, in_flight)

  monkeypatch.setattr(kernel_parts._StageRelease, "_await", free_then_wait)
  monkeypatch.setattr(kernel_parts._StageRelease, "_free", lambda self, step: None)
  lhs, rhs, _, sizes = _inputs(_LONG, jnp.bfloat16, seed=9)
  run = lambda: pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=RACE_CHECK,
                                                **CONFIG_DELAYED)
  try:
    pm.ragged_dot_pallas_mosaic_gpu.clear_cache()  # (trace the planted bug)
    run()
    assert not _no_races()
    monkeypatch.setattr(pm.pallas_common, "detects_races", lambda interpret: False)
    pm.ragged_dot_pallas_mosaic_gpu.clear_cache()
    run()
    assert _no_races()  # What the interpreter alone sees.
  finally:
    pm.ragged_dot_pallas_mosaic_gpu.clear_cache()  # (no test may reuse these kernels)


# Four 64-wide column tiles in every product (two CTA pairs), four contraction steps.
_PAIRED = dataclasses.replace(_LONG, n=256)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("delayed", [
    False,
    # (Both code paths are in the fast set on their own; together, in CI's slow set.)
    pytest.param(True, marks=pytest.mark.slow),
], ids=["plain", "delayed_release"])
def test_multicast_pairs_match_reference(delayed):
  """CTAs in clusters of two on adjacent column tiles, the row operand multicast, in all
  three kernels and in split-K partials (with delay_release, each CTA frees its stages
  on the cluster's consumed barriers itself). The interpreter copies the multicast
  operand into each CTA on its own, so this checks the pairing (which CTA takes which
  column tile), the cluster barriers and the persistent loop over pairs; the multicast
  itself is the GPU's."""
  config = (CONFIG_DELAYED if delayed else CONFIG_A) | dict(multicast=True)
  lhs, rhs, sizes = _check_three_products(_PAIRED, config, seed=10)
  if not delayed:  # Pairs of split-K shares: both CTAs of a pair sum the same share.
    split = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                            interpret=RACE_CHECK, **(config | dict(split_k=2)))
    assert _no_races()
    _assert_close(split, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.float32)


# A group's last tile of exactly half a tile (rows 128-191), tiles just over half (68
# rows: 192-259 and 260-327), an empty group and rows past the last group.
_SHORT_TILES = Workload(400, 128, 256, (192, 68, 0, 64))
CONFIG_HALF = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=2, wg_split="n",
                   grid_minor_dim="m", grid_tile_width=2, half_tiles=True)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("delayed", [
    False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "delayed_release"])
def test_half_tiles_match_reference(delayed):
  """A warpgroup whose item rows end in the first half of its 128 rows multiplies only
  that half, in the forward and lhs-gradient kernels. Taking the half path for tiles
  a few rows over half leaves their last rows unwritten (NaN here): caught."""
  config = CONFIG_HALF | dict(delay_release=delayed, max_concurrent_steps=3 if delayed else 2)
  lhs, rhs, _, sizes = _check_row_products(_SHORT_TILES, config, seed=11)
  if not delayed:  # Half tiles of split-K shares (float32 partials).
    split = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                            interpret=RACE_CHECK, **(config | dict(split_k=2)))
    assert _no_races()
    _assert_close(split, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.float32)


@pytest.mark.mosaic_interpret
def test_group_sizes_are_runtime_values():
  """One compiled kernel serves different group sizes (they are traced, not static)."""
  w = WORKLOADS["ragged"]
  lhs, rhs, _, _ = _inputs(w, jnp.bfloat16)
  pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, jnp.zeros((w.g,), jnp.int32), interpret=RACE_CHECK,
                                  **CONFIG_A)
  compiled = pm.ragged_dot_pallas_mosaic_gpu._cache_size()
  sizes = jnp.asarray((3, 140, 0, 7), jnp.int32)
  out = pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, interpret=RACE_CHECK, **CONFIG_A)
  assert pm.ragged_dot_pallas_mosaic_gpu._cache_size() == compiled
  _assert_close(out, ragged_dot_reference(_f32(lhs), _f32(rhs), sizes), jnp.bfloat16)


@pytest.mark.mosaic_interpret
def test_op_forward_and_gradients_match_lax_ragged_dot():
  """Through `stellarax.ragged_dot` and `jax.grad`, against jax.lax.ragged_dot and its VJP."""
  w = WORKLOADS["ragged"]
  lhs, rhs, _, sizes = _inputs(w, jnp.bfloat16, seed=4)
  weights = _inputs(w, jnp.bfloat16, seed=5)[2].astype(jnp.float32)  # exact in bfloat16
  config = pm.PallasMosaicGpuRaggedDotConfig(**CONFIG_A)
  op = pm.PallasMosaicGpuRaggedDot(interpret=True, config=config)
  ours = lambda l, r: stellarax.ragged_dot(l, r, sizes, implementation=op)
  lax_dot = lambda l, r: jax.lax.ragged_dot(_f32(l), _f32(r), sizes,
                                            precision=jax.lax.Precision.HIGHEST)
  loss = lambda f: lambda l, r: (_f32(f(l, r)) * weights).sum()

  out = ours(lhs, rhs)
  assert out.dtype == jnp.bfloat16
  _assert_close(out, lax_dot(lhs, rhs), jnp.bfloat16)
  dlhs, drhs = jax.grad(loss(ours), argnums=(0, 1))(lhs, rhs)
  expected_dlhs, expected_drhs = jax.grad(loss(lax_dot), argnums=(0, 1))(lhs, rhs)
  assert dlhs.dtype == drhs.dtype == jnp.bfloat16
  _assert_close(dlhs, expected_dlhs, jnp.bfloat16)
  _assert_close(drhs, expected_drhs, jnp.bfloat16)


@pytest.mark.slow  # CI's slow stage (`make test` within 10 minutes on two cores)
def test_a_backward_the_kernel_does_not_take_comes_from_xla_with_a_warning():
  # K=64: the forward kernel takes it, the backward's (K a multiple of 128) does not.
  keys = jax.random.split(jax.random.key(3), 3)
  lhs = jax.random.normal(keys[0], (96, 64), jnp.bfloat16)
  rhs = jax.random.normal(keys[1], (3, 64, 64), jnp.bfloat16)
  sizes = jnp.array([40, 0, 50], jnp.int32)
  dout = jax.random.normal(keys[2], (96, 64), jnp.bfloat16)
  op = pm.PallasMosaicGpuRaggedDot(interpret=True)
  with pytest.warns(stellarax.BackwardFallbackWarning, match="K a multiple of 128.*ragged_dot.xla_vjp"):
    _, pullback = jax.vjp(lambda l, r: stellarax.ragged_dot(l, r, sizes, implementation=op), lhs, rhs)
    dlhs, drhs = pullback(dout)
  _, expected = jax.vjp(lambda l, r: stellarax.ragged_dot(l, r, sizes, implementation="xla"), lhs, rhs)
  expected_dlhs, expected_drhs = expected(dout)
  _assert_close(dlhs, expected_dlhs, jnp.bfloat16)
  _assert_close(drhs, expected_drhs, jnp.bfloat16)


# ---------------------------------------------------------- race-freedom invariants


@pytest.mark.parametrize("m, block_m", [(200, 64), (203, 128), (40, 64)])
def test_work_items_partition_the_rows(m, block_m):
  """Each output row lies in exactly one item, within one group (or the tail), and the
  item's rows lie in its tile, which starts at a multiple of 8 inside the array."""
  g = 7
  rows = pm.padded_rows(m, block_m)
  rng = np.random.default_rng(5)
  items_fn = jax.jit(lambda sizes: pm.work_items(pm.group_offsets(sizes, m), rows, block_m))
  for trial in range(20):
    sizes = rng.integers(0, 2 * m // g + 2, size=g)
    sizes[rng.integers(0, g)] = 0  # always at least one empty group
    part, start, end, tile = np.asarray(items_fn(jnp.asarray(sizes, jnp.int32)))
    assert part.shape == (pm.num_work_items(rows, g, block_m),)
    bounds = np.minimum(np.concatenate([[0], np.cumsum(sizes), [rows]]), m)
    bounds[-1] = rows
    owner = np.full(rows, -1)
    for p, s, e, t in zip(part, start, end, tile):
      if e == s:
        continue
      assert bounds[p] <= s < e <= bounds[p + 1], (trial, p, s, e)
      assert t % 8 == 0 and 0 <= t <= rows - block_m, (trial, t)
      assert t <= s and e <= t + block_m, (trial, t, s, e)
      assert np.all(owner[s:e] == -1), f"rows {s}:{e} written twice"
      owner[s:e] = p
    assert np.all(owner >= 0), "some rows belong to no work item"


@pytest.mark.parametrize("minor, width", [("m", 1), ("m", 4), ("n", 8)])
@pytest.mark.parametrize("grid_m, grid_n", [(1, 1), (5, 3), (9, 56), (74, 2)])
def test_tile_order_covers_every_tile_once(minor, width, grid_m, grid_n):
  """The persistent loop's tile order is a bijection, so no tile runs twice or never."""
  tiles = kernel_parts._Tiles(**(CONFIG_A | dict(grid_minor_dim=minor, grid_tile_width=width)))
  linear = jnp.arange(grid_m * grid_n, dtype=jnp.int32)
  m_tile, n_tile = (np.asarray(x) for x in jax.vmap(
      lambda i: tiles.tile_order(i, grid_m, grid_n))(linear))
  assert np.all((0 <= m_tile) & (m_tile < grid_m) & (0 <= n_tile) & (n_tile < grid_n))
  assert len(set(zip(m_tile.tolist(), n_tile.tolist()))) == grid_m * grid_n


# ------------------------------------------------------------------------- errors


@pytest.mark.parametrize("changes, message", [
    (dict(block_m=96), r"block_m=96 must be one of \(64, 128, 192, 256\)"),
    (dict(block_n=512), r"block_n=512 must be one of"),
    (dict(block_k=32), r"block_k=32 must be one of \(64, 128\)"),
    (dict(block_k=True), r"block_k=True must be an int"),
    (dict(max_concurrent_steps=1), r"max_concurrent_steps=1 must be in \[2, 8\]"),
    (dict(wg_split="k"), r"wg_split='k' must be one of \('m', 'n'\)"),
    (dict(grid_minor_dim="x"), r"grid_minor_dim='x' must be one of"),
    (dict(grid_tile_width=3), r"grid_tile_width=3 must be a power of two >= 1 and <= 64"),
    (dict(block_m=64), r"gives each of the 2 compute warpgroups a 32x64 tile"),
    (dict(block_m=192), r"gives each of the 2 compute warpgroups a 96x64 tile"),
    (dict(block_m=256, block_n=256), r"a 128x256 float32 accumulator"),
    (dict(split_k=3), r"split_k=3 must be a power of two >= 1 and <= 16"),
    (dict(epilogue_slabs=2), r"epilogue_slabs=2 must be one of \[1\]: each compute warpgroup "
                             r"stores its 64x64 tile in column slabs of a whole number of 64-column"),
    (dict(epilogue_slabs=0), r"epilogue_slabs=0 must be one of \[1\]"),
    (dict(delay_release=1), r"delay_release=1 must be a bool"),
    (dict(multicast=2), r"multicast=2 must be a bool"),
    (dict(half_tiles=1), r"half_tiles=1 must be a bool"),
    (dict(half_tiles=True), r"half_tiles=True needs compute warpgroup tiles of 128 rows .*"
                            r"block_m=128 with wg_split='m' gives 64"),
])
def test_invalid_tunables_are_rejected(changes, message):
  pm.validate_tunables(**CONFIG_A)
  with pytest.raises(ValueError, match=message):
    pm.validate_tunables(**(CONFIG_A | changes))
  with pytest.raises(ValueError, match=message):
    pm.PallasMosaicGpuRaggedDotConfig(**(CONFIG_A | changes))
  lhs, rhs, _, sizes = _inputs(WORKLOADS["ragged"], jnp.bfloat16)
  with pytest.raises(ValueError, match=message):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, **(CONFIG_A | changes))


def test_configs_are_keyword_only_frozen_and_hashable():
  config = pm.PallasMosaicGpuRaggedDotConfig(**CONFIG_A)
  assert config == pm.PallasMosaicGpuRaggedDotConfig(**CONFIG_A) and hash(config)
  with pytest.raises(TypeError):
    pm.PallasMosaicGpuRaggedDotConfig(*CONFIG_A.values())
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.block_m = 64


def test_saved_configs_without_the_newer_tunables_keep_their_meaning():
  """A config saved before epilogue_slabs, delay_release, multicast and half_tiles
  existed loads as the kernel it named: a whole epilogue, each step's wgmma awaited,
  one CTA a cluster, every tile multiplied whole."""
  from stellarax.core.config import config_from_json, config_to_json
  saved = dict(block_m=128, block_n=256, block_k=64, max_concurrent_steps=3, wg_split="n",
               grid_minor_dim="m", grid_tile_width=8, split_k=1)
  config = config_from_json(pm.PallasMosaicGpuRaggedDotConfig, saved)
  assert (config.epilogue_slabs, config.delay_release, config.multicast,
          config.half_tiles) == (1, False, False, False)
  assert config_to_json(config) == saved | dict(epilogue_slabs=1, delay_release=False,
                                                multicast=False, half_tiles=False)
  pm.check_tunables_fit(pm.pallas_common.tunables_of(config), k=4096, n=14336,
                        product="forward")


def test_tunables_that_do_not_fit_the_shape_are_rejected():
  w = WORKLOADS["ragged"]  # K=128, N=192
  lhs, rhs, dout, sizes = _inputs(w, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"block_n=128 must divide the output columns N=192"):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, **(CONFIG_A | dict(block_n=128)))
  with pytest.raises(ValueError, match=r"block_k=128 must divide the contraction N=192 of the dl"):
    pm.ragged_dot_dlhs_pallas_mosaic_gpu(dout, rhs, sizes, **(CONFIG_A | dict(block_k=128)))
  with pytest.raises(ValueError, match=r"block_m=256 must divide the rows K of drhs\[g\]=128"):
    pm.ragged_dot_drhs_pallas_mosaic_gpu(lhs, dout, sizes, w.g, **(CONFIG_A | dict(block_m=256)))
  with pytest.raises(ValueError, match=r"split_k=4 shares of block_k=64 steps must divide the"
                                       r" contraction K=128"):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, **(CONFIG_A | dict(split_k=4)))
  # Three column tiles (N=192, block_n=64) do not pair up.
  with pytest.raises(ValueError, match=r"multicast=True runs CTAs in pairs on adjacent column "
                                       r"tiles, so the 3 column tiles of block_n=64 over the "
                                       r"output columns N=192 of the forward product must be "
                                       r"even"):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, **(CONFIG_A | dict(multicast=True)))
  # The backward: K=128 gives the lhs gradient two column tiles (a pair), K=192 three.
  pm.check_tunables_fit(CONFIG_A | dict(multicast=True), k=128, n=256, product="backward")
  with pytest.raises(ValueError, match=r"output columns K=192 of the dlhs product"):
    pm.check_tunables_fit(CONFIG_A | dict(multicast=True), k=192, n=256, product="backward")
  big = dict(block_m=256, block_n=128, block_k=128, max_concurrent_steps=5, wg_split="m",
             grid_minor_dim="m", grid_tile_width=8)
  with pytest.raises(ValueError, match=r"need 557056 bytes of shared memory; an H200 CTA has"):
    pm.check_tunables_fit(big, k=1024, n=1024, product="forward")


def test_invalid_operands_are_rejected():
  w = WORKLOADS["ragged"]
  lhs, rhs, dout, sizes = _inputs(w, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"lhs.dtype=bfloat16 and rhs.dtype=float16 differ"):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs.astype(jnp.float16), sizes, **CONFIG_A)
  with pytest.raises(ValueError, match=r"lhs.dtype=float32 is not supported"):
    pm.ragged_dot_pallas_mosaic_gpu(_f32(lhs), _f32(rhs), sizes, **CONFIG_A)
  with pytest.raises(ValueError, match=r"preferred_element_type=int32 is not supported"):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes, preferred_element_type=jnp.int32, **CONFIG_A)
  with pytest.raises(ValueError, match=r"group_sizes.shape=\(3,\) must be \(4,\)"):
    pm.ragged_dot_pallas_mosaic_gpu(lhs, rhs, sizes[:3], **CONFIG_A)
  with pytest.raises(ValueError, match=r"dout \(M, N\) and rhs \(G, K, N\) with the same N"):
    pm.ragged_dot_dlhs_pallas_mosaic_gpu(dout[:, :64], rhs, sizes, **CONFIG_A)
  with pytest.raises(ValueError, match=r"lhs \(M, K\) and dout \(M, N\) with the same M"):
    pm.ragged_dot_drhs_pallas_mosaic_gpu(lhs[:100], dout, sizes, w.g, **CONFIG_A)


def test_unsupported_inputs_fall_back_through_dispatch():
  w = WORKLOADS["ragged"]
  lhs, rhs, _, sizes = _inputs(w, jnp.float32)
  op = pm.PallasMosaicGpuRaggedDot(interpret=True)
  with pytest.raises(NotImplementedError, match=r"float32 is not supported"):
    op.bind(lhs, rhs, sizes)
  with pytest.raises(NotImplementedError, match=r"K and N multiples of 64"):
    op.bind(lhs[:, :100].astype(jnp.bfloat16), rhs[:, :100].astype(jnp.bfloat16), sizes)
  with pytest.raises(NotImplementedError, match=r"K a multiple of 128"):
    pm.PallasMosaicGpuRaggedDotVjp.bind(None, None, jnp.ones((w.m, w.n), jnp.bfloat16),
                                        lhs[:, :64].astype(jnp.bfloat16),
                                        rhs[:, :64].astype(jnp.bfloat16), sizes)
  out = stellarax.ragged_dot(lhs, rhs, sizes, implementation=[op, "xla"])
  _assert_close(out, ragged_dot_reference(lhs, rhs, sizes), jnp.float32)


# ---------------------------------------------------------------------- tunables

SHAPES = [
    (8192, 4096, 14336, 8),   # the H200 speed target, G=8
    (16384, 2048, 1536, 64),  # the H200 speed target, G=64
    (4096, 1024, 2048, 512),  # groups of 8 rows
    (150, 128, 192, 4),
    (45, 128, 256, 3),
    (64, 768, 64, 1),         # few tiles: split-K, 6 steps of 128 or 12 of 64 to share
]


@pytest.mark.parametrize("product", ["forward", "backward"])
@pytest.mark.parametrize("shape", SHAPES)
def test_tunable_space_is_valid_for_the_shape(shape, product):
  m, k, n, g = shape
  space = pm.tunable_space(m, k, n, g, jnp.bfloat16, product=product)
  assert space[0] == pm.heuristic_tunables(m, k, n, g, jnp.bfloat16, product=product)
  assert 1 <= len(space) <= 60
  keys = [tuple(sorted(config.items())) for config in space]
  assert len(set(keys)) == len(keys)
  for config in space:
    pm.validate_tunables(**config)
    pm.check_tunables_fit(config, k=k, n=n, product=product)
  if min(m, k, n) >= 1024:
    assert len(space) >= 20
  # Every config fits an H200 CTA's shared memory with its epilogue slabs, and the
  # heuristic tile is also offered with its epilogue whole.
  heuristic = space[0]
  whole = [c for c in space[1:] if c | dict(max_concurrent_steps=0, epilogue_slabs=0)
           == heuristic | dict(max_concurrent_steps=0, epilogue_slabs=0)]
  assert heuristic["epilogue_slabs"] == 1 or any(c["epilogue_slabs"] == 1 for c in whole)
  # Right after the heuristic: its delayed-release variant, its tiles multiplied whole
  # (where it halves short ones), and its multicast pairs (where the column tiles pair).
  variants = [dict(delay_release=True)]
  if heuristic["half_tiles"]:
    variants.append(dict(half_tiles=False))
  paired = heuristic | dict(multicast=True)
  try:
    pm.check_tunables_fit(paired, k=k, n=n, product=product)
    variants.append(dict(multicast=True))
  except ValueError:
    assert paired not in space
  assert space[1:1 + len(variants)] == [heuristic | v for v in variants]
  # Every tile with 128-row warpgroup tiles halves the short ones.
  for config in space[1 + len(variants):]:
    wm = config["block_m"] // (2 if config["wg_split"] == "m" else 1)
    assert config["half_tiles"] == (wm == 128), config


def test_heuristic_tunables():
  # The G=8 target: 128 x 256 CTA tiles (two 128 x 128 warpgroup tiles), 4 stages, the
  # epilogue in two slabs (224 KiB of shared memory).
  assert pm.heuristic_tunables(8192, 4096, 14336, 8, jnp.bfloat16) == dict(
      block_m=128, block_n=256, block_k=64, max_concurrent_steps=4, wg_split="n",
      grid_minor_dim="m", grid_tile_width=8, split_k=1, epilogue_slabs=2, delay_release=False,
      multicast=False, half_tiles=True)
  # A float32 output tile takes more shared memory: fewer stages.
  wide = pm.heuristic_tunables(8192, 4096, 14336, 8, jnp.bfloat16, out_dtype=jnp.float32)
  assert (wide["max_concurrent_steps"], wide["epilogue_slabs"]) == (3, 2)
  # Decode-sized M: 64 x 256 tiles, 3 stages (4 spilled in ptxas), the epilogue whole.
  decode = pm.heuristic_tunables(128, 4096, 14336, 8, jnp.bfloat16)
  assert (decode["block_m"], decode["max_concurrent_steps"], decode["epilogue_slabs"]) == (64, 3, 1)
  # Groups of 8 rows: 64-row tiles waste less.
  assert pm.heuristic_tunables(4096, 1024, 2048, 512, jnp.bfloat16)["block_m"] == 64
  with pytest.raises(ValueError, match=r"dtype=float32 is not supported"):
    pm.heuristic_tunables(64, 64, 64, 2, jnp.float32)
  with pytest.raises(ValueError, match=r"k=96 and n=64 must be multiples of 64"):
    pm.heuristic_tunables(64, 96, 64, 2, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"k=64 must be a multiple of 128 .* backward"):
    pm.heuristic_tunables(64, 64, 64, 2, jnp.bfloat16, product="backward")
  with pytest.raises(ValueError, match=r"g=0 must be a positive int"):
    pm.tunable_space(64, 64, 64, 0, jnp.bfloat16)


def test_split_k_where_the_output_has_few_tiles():
  """Outputs of fewer tiles than an H200 has SMs share the contraction; the targets and
  wide decode outputs (N=14336 gives hundreds of tiles) do not."""
  few = pm.heuristic_tunables(512, 1024, 512, 4, jnp.bfloat16)  # 8 tiles, 16 steps
  assert few["split_k"] == 8 and few["max_concurrent_steps"] >= 2
  pm.check_tunables_fit(few, k=1024, n=512, product="forward")
  space = pm.tunable_space(512, 1024, 512, 4, jnp.bfloat16)
  assert {c["split_k"] for c in space} >= {1, 4, 8}
  # The backward's split is the lhs gradient's: its contraction is N.
  back = pm.heuristic_tunables(512, 1024, 512, 4, jnp.bfloat16, product="backward")
  assert back["split_k"] > 1 and 512 % (back["block_k"] * back["split_k"]) == 0
  for shape in [(8192, 4096, 14336, 8), (16384, 2048, 1536, 64), (128, 4096, 14336, 8)]:
    assert pm.heuristic_tunables(*shape, jnp.bfloat16)["split_k"] == 1, shape


# ---------------------------------------------------------------------- lowering


@pytest.mark.parametrize("kernel", ["fwd", "dlhs", "drhs"])
@pytest.mark.parametrize("m, k, n, g, multicast", [
    (8192, 4096, 14336, 8, False),
    (16384, 2048, 1536, 64, False),
    (16384, 2048, 1536, 64, True),  # CTA pairs: cluster launch, multicast BlockSpec
])
def test_kernels_lower_for_h200(kernel, m, k, n, g, multicast):
  product = "forward" if kernel == "fwd" else "backward"
  tunables = pm.heuristic_tunables(m, k, n, g, jnp.bfloat16, product=product)
  tunables["multicast"] = multicast
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
  dout = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  fn, args = {
      "fwd": (pm.ragged_dot_pallas_mosaic_gpu, (lhs, rhs, sizes)),
      "dlhs": (pm.ragged_dot_dlhs_pallas_mosaic_gpu, (dout, rhs, sizes)),
      "drhs": (functools.partial(pm.ragged_dot_drhs_pallas_mosaic_gpu, num_groups=g),
               (lhs, dout, sizes)),
  }[kernel]
  if kernel == "drhs":
    del tunables["split_k"], tunables["half_tiles"]  # The lhs gradient's only.
  text = lower_for_h200(functools.partial(fn, **tunables), *args)
  assert text.count(f"stablehlo.custom_call @{MOSAIC_GPU_TARGET}") == 1
  assert f"ragged_dot_{kernel}" in text


def test_split_k_lowers_for_h200():
  """A decode-sized problem's split forward: 4 shares of float32 partials, one kernel."""
  m, k, n, g = 256, 2048, 512, 4
  tunables = pm.heuristic_tunables(m, k, n, g, jnp.bfloat16)
  assert tunables["split_k"] > 1
  text = lower_for_h200(functools.partial(pm.ragged_dot_pallas_mosaic_gpu, **tunables),
                         jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                         jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
                         jax.ShapeDtypeStruct((g,), jnp.int32))
  assert text.count(f"stablehlo.custom_call @{MOSAIC_GPU_TARGET}") == 1
  assert f"tensor<{tunables['split_k']}x256x512xf32>" in text


def test_op_forward_and_backward_lower_for_h200():
  """jax.grad through the op classes (heuristic configs) lowers to three Mosaic GPU kernels."""
  m, k, n, g = 4096, 1024, 2048, 16
  op = pm.PallasMosaicGpuRaggedDot()
  # The loss needs the forward's values (jax 0.12 drops a forward kernel whose output
  # the gradient of a plain sum never reads).
  loss = lambda l, r, s: jnp.sin(_f32(stellarax.ragged_dot(l, r, s, implementation=op))).sum()
  text = lower_for_h200(jax.grad(loss, argnums=(0, 1)), jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                         jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
                         jax.ShapeDtypeStruct((g,), jnp.int32))
  assert text.count(f"stablehlo.custom_call @{MOSAIC_GPU_TARGET}") == 3
  for kernel in ("fwd", "dlhs", "drhs"):
    assert f"ragged_dot_{kernel}" in text
