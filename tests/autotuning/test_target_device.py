"""A program lowered for another machine (an H200's abstract mesh on a CPU host, as
`jax.export` and deviceless compiles do) takes that machine's configs: its tuned entries
and heuristics, not those of the host it is lowered on."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning import cache
from stellarax.autotuning.measure import Measurement
from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig
from h200 import H200_MESH, lower_for_h200  # tests/ is on sys.path

_SPECS = (jax.ShapeDtypeStruct((256, 64), jnp.float32),
          jax.ShapeDtypeStruct((4, 64, 32), jnp.float32),
          jax.ShapeDtypeStruct((4,), jnp.int32))


def _cached(device_kind: str, config) -> None:
  ba = stellarax.XlaRaggedDot.bind(*_SPECS)
  ok = Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3, num_samples=3)
  entry = autotuning.Entry(ba, config, ba.heuristics_config, ((config, ok),))
  cache.USER_CACHE.write(autotuning.AutotuningResult(device_kind, {entry.key: entry}))


def test_lowering_for_an_h200_takes_the_h200_s_entries_and_heuristic(user_cache_dir):
  ba = lambda: stellarax.XlaRaggedDot.bind(*_SPECS)  # fresh: a call keeps its heuristic
  with jax.sharding.use_abstract_mesh(H200_MESH):
    # No entry: the GPU's heuristic (XLA's grouped matmul), not the CPU host's tiles.
    assert autotuning.explain(ba()).config == XlaRaggedDotConfig(strategy="lax")
  assert autotuning.explain(ba()).config.strategy == "tiled"
  masked, tiled = XlaRaggedDotConfig(strategy="masked"), XlaRaggedDotConfig(strategy="tiled",
                                                                            tile_m=32)
  _cached("NVIDIA H200", masked)
  _cached(cache.current_device_kind(), tiled)
  with jax.sharding.use_abstract_mesh(H200_MESH):
    explained = autotuning.explain(ba())
    assert (explained.source, explained.config) == ("user_cache", masked)
    # Its transfer looks at the H200's entries too.
    bigger = stellarax.XlaRaggedDot.bind(jax.ShapeDtypeStruct((512, 64), jnp.float32),
                                         *_SPECS[1:])
    assert autotuning.explain(bigger).config == masked
  assert autotuning.explain(ba()).config == tiled
  # The lowered program is the H200 entry's: masked products, no tiles' gathers.
  text = lower_for_h200(lambda l, r, g: stellarax.ragged_dot(l, r, g, implementation="xla"),
                        *_SPECS)
  host = jax.jit(lambda l, r, g: stellarax.ragged_dot(l, r, g, implementation="xla")).lower(
      *_SPECS).as_text()
  assert "gather" in host and "gather" not in text


def test_tiny_calls_get_a_heuristic_tile_their_space_offers():
  for m in (1, 5, 20, 31, 32, 100):
    ba = stellarax.XlaRaggedDot.bind(jax.ShapeDtypeStruct((m, 16), jnp.float32),
                                     jax.ShapeDtypeStruct((2, 16, 8), jnp.float32),
                                     jax.ShapeDtypeStruct((2,), jnp.int32))
    tile = ba.heuristics_config.tile_m
    assert tile <= max(16, 2 * m) and ba.op._get_autotuning_configs(ba) >= {
        ba.heuristics_config}, m


def test_under_another_device_s_mesh_nothing_is_tuned_and_its_results_apply_quietly(
    user_cache_dir):
  ba = lambda: stellarax.XlaRaggedDot.bind(*_SPECS)
  with jax.sharding.use_abstract_mesh(H200_MESH):
    # The "autotune" policy measured on the CPU host and put its config into the H200's
    # program.
    with autotuning.miss_policy_scope("autotune"):
      with pytest.warns(autotuning.OtherDeviceWarning, match="cannot measure .* 'NVIDIA H200'"):
        text = lower_for_h200(
            lambda l, r, g: stellarax.ragged_dot(l, r, g, implementation="xla"), *_SPECS)
    assert "gather" not in text  # the GPU's heuristic (lax), not a CPU-tuned tile
    # An H200 result entered there is not "applied on 'cpu'".
    ok = Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3, num_samples=3)
    masked = XlaRaggedDotConfig(strategy="masked")
    entry = autotuning.Entry(ba(), masked, ba().heuristics_config, ((masked, ok),))
    with warnings.catch_warnings():
      warnings.simplefilter("error", autotuning.OtherDeviceWarning)
      with autotuning.AutotuningResult("NVIDIA H200", {entry.key: entry}):
        assert autotuning.explain(ba()).config == masked


def test_xla_s_own_grouped_matmul_lowers_for_an_h200_with_its_gradients():
  # Under the H200's mesh (an Explicit axis) with arrays of no sharding, lax.ragged_dot
  # and ragged_dot_general raised: JAX infers no output sharding for them there.
  def loss(lhs, rhs, sizes):
    out = stellarax.ragged_dot(lhs, rhs, sizes, implementation=stellarax.XlaRaggedDot(
        config=XlaRaggedDotConfig(strategy="lax")))
    return (out.astype(jnp.float32) ** 2).sum()
  text = lower_for_h200(jax.grad(loss, argnums=(0, 1)), *_SPECS)
  assert text.count("chlo.ragged_dot") >= 3  # the forward and both products of the backward


_BF16_SPECS = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
               jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16),
               jax.ShapeDtypeStruct((4,), jnp.int32))


def _kernels(text: str) -> set[str]:
  """The custom calls a lowered program makes: Mosaic GPU's, Triton's."""
  return {name for name in ("mosaic_gpu", "xla.gpu.triton") if name in text}


def test_dispatch_picks_the_kernels_of_the_device_lowered_for(user_cache_dir):
  # The host (a CPU) runs no kernel: an H200's program lowered there took XLA's grouped
  # matmul and attention, not the kernels the same call gets on an H200.
  ragged = lambda l, r, g: stellarax.ragged_dot(l, r, g)
  assert _kernels(lower_for_h200(ragged, *_BF16_SPECS)) == {"mosaic_gpu"}
  assert not _kernels(jax.jit(ragged).lower(*_BF16_SPECS).as_text())
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  attend = lambda q, k, v: stellarax.dot_product_attention(q, k, v, is_causal=True)
  assert _kernels(lower_for_h200(attend, q, q, q)) == {"mosaic_gpu"}
  # The H200's measured times choose among them, as on an H200.
  ok = lambda s: Measurement(status="ok", median_s=s, ci_low_s=s, ci_high_s=s, num_samples=3)
  for op, seconds in ((stellarax.PallasMosaicGpuRaggedDot(), 2e-3),
                      (stellarax.PallasTritonRaggedDot(), 1e-3)):
    ba = op.bind(*_BF16_SPECS)
    config = ba.heuristics_config
    entry = autotuning.Entry(ba, config, config, ((config, ok(seconds)),))
    cache.USER_CACHE.write(autotuning.AutotuningResult("NVIDIA H200", {entry.key: entry}))
  assert _kernels(lower_for_h200(ragged, *_BF16_SPECS)) == {"xla.gpu.triton"}


def test_a_gpu_whose_capability_is_unknown_gets_xla_and_is_named(user_cache_dir):
  other = jax.sharding.AbstractDevice(device_kind="NVIDIA Future GPU", num_cores=100,
                                      platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=other)
  lower = lambda f: jax.jit(f).trace(*_BF16_SPECS).lower(lowering_platforms=("cuda",)).as_text()
  with jax.sharding.use_abstract_mesh(mesh):
    assert not _kernels(lower(lambda l, r, g: stellarax.ragged_dot(l, r, g)))
    with pytest.raises(NotImplementedError,
                       match=r"does not run on the abstract mesh's device \(NVIDIA Future GPU\)"):
      lower(lambda l, r, g: stellarax.ragged_dot(l, r, g, implementation=["pallas_triton"]))


def test_under_a_concrete_mesh_the_device_itself_is_the_target():
  # A concrete mesh has an abstract device too: dispatch read an H200's compute
  # capability from its kind under `jax.set_mesh`, not from the device.
  from stellarax.core import partitioning
  with jax.set_mesh(jax.make_mesh((1,), ("x",))):
    assert partitioning.target_device() is jax.devices()[0]
  with jax.sharding.use_abstract_mesh(H200_MESH):
    assert partitioning.target_device().device_kind == "NVIDIA H200"
