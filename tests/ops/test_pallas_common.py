"""Helpers every Pallas implementation shares."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
# The race detector's findings are not exported by jax.experimental yet.
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from race_check import RACE_CHECK  # tests/ is on sys.path

from stellarax.ops.pallas_common import (
    detects_races,
    read_again_for_race_detector,
    unpack_refs,
)


def test_unpack_refs_spreads_present_operands_and_fills_absent_ones():
  assert unpack_refs(["q", "k", "o"], [True, False, True, False, True]) == [
      "q", None, "k", None, "o"]
  assert unpack_refs([], [False, False]) == [None, None]
  with pytest.raises(ValueError, match="2 refs for 1 present operands"):
    unpack_refs(["q", "k"], [True, False])
  with pytest.raises(ValueError, match="1 refs for 2 present operands"):
    unpack_refs(["q"], [True, True])


def test_detects_races_only_for_interpret_params_that_ask():
  assert detects_races(RACE_CHECK)
  assert not detects_races(plgpu.InterpretGPUParams())
  assert not detects_races(True) and not detects_races(False)


def _tile_freed_then_refilled(x, *, read_after_free: bool):
  """Thread 0 reads a TMA-loaded tile again (read_again_for_race_detector), before or
  after freeing it; thread 1 then refills it by TMA."""

  def body(x_ref, out_ref, tile, loaded, free, refilled):
    @pl.when(lax.axis_index("wg") == 0)
    def _reader():
      plgpu.copy_gmem_to_smem(x_ref.at[0], tile, loaded.at[0])
      plgpu.barrier_wait(loaded.at[0])
      out_ref[...] = tile[...]
      plgpu.commit_smem()
      if not read_after_free:
        read_again_for_race_detector([tile])
      plgpu.barrier_arrive(free.at[0])
      if read_after_free:
        read_again_for_race_detector([tile])

    @pl.when(lax.axis_index("wg") == 1)
    def _refiller():
      plgpu.barrier_wait(free.at[0])
      plgpu.copy_gmem_to_smem(x_ref.at[1], tile, refilled.at[0])
      plgpu.barrier_wait(refilled.at[0])

  barrier = plgpu.Barrier(num_arrivals=1, num_barriers=1)
  call = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
      scratch_types=dict(tile=plgpu.SMEM(x.shape[1:], x.dtype), loaded=barrier, free=barrier,
                         refilled=barrier),
      num_threads=2, thread_name="wg", interpret=RACE_CHECK)
  return jax.jit(call)(x)


@pytest.mark.parametrize("read_after_free", [False, True])
@pytest.mark.mosaic_interpret
def test_reads_again_are_ordered_against_the_refill(read_after_free):
  """A read where a (simulated) wgmma completes is a race exactly when the tile was
  freed, and so refilled by TMA, before it."""
  x = jax.random.normal(jax.random.key(0), (2, 64, 64), jnp.float32)
  out = _tile_freed_then_refilled(x, read_after_free=read_after_free)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x[0]))
  assert get_races().races_found == read_after_free
