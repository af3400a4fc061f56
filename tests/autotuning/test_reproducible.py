"""Reproducible mode: configs that add in a varying order (atomics) are never chosen."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import Measurement, MeasureOptions
from stellarax.autotuning.result import AutotuningResult, Entry
from stellarax.core import resolution

FAST = MeasureOptions(rounds=2, leader_rounds=0, warmup_s=0.0, max_total_s=0.2, min_batch_s=2e-4)
RAN = []  # the configs traced calls ran with


@stellarax.config_dataclass
class SumConfig:
  atomic: bool = False
  block: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SumOp(stellarax.Op, name="test_reproducible.sum"):
  """2 * x; its `atomic` configs stand for kernels that add with atomics."""

  config_cls = SumConfig
  atomic_heuristic: bool = False

  def _fwd(self, x, *, config):
    RAN.append(config)
    return 2 * x, None

  def _reference(self, x):
    return 2 * x

  def _is_reproducible(self, config):
    return not config.atomic

  def _get_heuristics_config(self, ba):
    return SumConfig(atomic=self.atomic_heuristic)

  def _get_autotuning_configs(self, ba):
    return {SumConfig(atomic=a, block=b) for a in (False, True) for b in (1, 2)}


def _ok(ms):
  return Measurement(status="ok", median_s=ms * 1e-3, ci_low_s=ms * 1e-3, ci_high_s=ms * 1e-3,
                     num_samples=3)


X = jnp.arange(8.0)
BA = SumOp().bind(X)
ATOMIC, PLAIN, PLAIN_2 = SumConfig(atomic=True), SumConfig(), SumConfig(block=2)
# The atomic config was fastest; of the others block=2 was, then the heuristic.
ENTRY = Entry(bound_args=BA, best_config=ATOMIC, heuristic_config=PLAIN,
              measurements=((PLAIN, _ok(3.0)), (ATOMIC, _ok(1.0)), (PLAIN_2, _ok(2.0))))
RESULT = AutotuningResult(jax.devices()[0].device_kind, {ENTRY.key: ENTRY})


def test_an_entry_gives_its_fastest_config_that_is_accepted():
  assert ENTRY.config_for() == ENTRY.config_for(None) == ATOMIC
  assert ENTRY.config_for(lambda c: not c.atomic) == PLAIN_2
  # A tie within noise goes to the heuristic, as in the search.
  tied = dataclasses.replace(ENTRY, measurements=((PLAIN, _ok(2.0)), (ATOMIC, _ok(1.0)),
                                                  (PLAIN_2, _ok(2.0))))
  assert tied.config_for(lambda c: not c.atomic) == PLAIN
  assert ENTRY.config_for(lambda c: False) is None


def test_in_reproducible_mode_a_result_gives_its_best_reproducible_config():
  f = jax.jit(_call)
  with RESULT:
    assert resolution.resolve_config(BA).config == ATOMIC
    RAN.clear()
    f(X)
    assert RAN == [ATOMIC]
    with autotuning.reproducible_scope():
      assert resolution.reproducible()
      assert resolution.resolve_config(BA) == resolution.Resolution(PLAIN_2, "result")
      RAN.clear()
      f(X)  # traced outside the mode: the mode is part of the jit key, so traced again
      assert RAN == [PLAIN_2]
      assert autotuning.explain(BA).config == PLAIN_2
      with autotuning.reproducible_scope(False):
        assert resolution.resolve_config(BA).config == ATOMIC
  assert not resolution.reproducible()


def _call(x):
  from stellarax.core import calling
  return calling.call_op(SumOp(), {"x": x})


def test_a_heuristic_that_is_not_reproducible_gives_way_in_the_mode():
  ba = SumOp(atomic_heuristic=True).bind(X)
  assert resolution.resolve_config(ba).config == ATOMIC
  with autotuning.reproducible_scope():
    assert resolution.resolve_config(ba) == resolution.Resolution(PLAIN, "heuristics")


def test_tuning_in_the_mode_measures_only_reproducible_configs(user_cache_dir):
  tuner = stellarax.Autotuner(progress=False, measure_options=FAST, cache=True)
  with autotuning.reproducible_scope():
    (entry,) = tuner.autotune(SumOp(atomic_heuristic=True).bind(X))
  assert {c for c, _ in entry.measurements} == {PLAIN, PLAIN_2}
  assert entry.heuristic_config == PLAIN and not entry.best_config.atomic
  # The option says the same outside the mode; a cached entry with a reproducible
  # config is reused, one with none is tuned again.
  (again,) = stellarax.Autotuner(progress=False, measure_options=FAST, cache=True,
                                 reproducible=True).autotune(SumOp(atomic_heuristic=True).bind(X))
  assert again == entry
  only_atomic = dataclasses.replace(ENTRY, measurements=((ATOMIC, _ok(1.0)), (PLAIN, Measurement(
      status="compile_error", error="x"))), code=entry.code)
  autotuning.USER_CACHE.write(AutotuningResult(RESULT.device_kind, {ENTRY.key: only_atomic}),
                              replace=True)
  (tuned,) = stellarax.Autotuner(progress=False, measure_options=FAST,
                                 reproducible=True).autotune(BA)
  assert {c for c, _ in tuned.measurements} == {PLAIN, PLAIN_2}
  (reused,) = stellarax.Autotuner(progress=False, measure_options=FAST).autotune(BA)
  assert reused == only_atomic  # outside the mode any config will do


def test_a_reproducible_tuning_joins_a_cached_entry_that_measured_none(user_cache_dir):
  # The cached entry's faster atomic config won the merge, the reproducible configs just
  # measured were lost, and every run in the mode tuned the call again.
  atomic_2 = SumConfig(atomic=True, block=2)  # a budget that reached atomic configs only
  only_atomic = dataclasses.replace(ENTRY, measurements=((ATOMIC, _ok(1e-9)),
                                                         (atomic_2, _ok(2e-9))))
  kind = RESULT.device_kind
  autotuning.USER_CACHE.write(AutotuningResult(kind, {ENTRY.key: only_atomic}))
  tuner = lambda: stellarax.Autotuner(progress=False, measure_options=FAST, cache=True,
                                      reproducible=True)
  (tuned,) = tuner().autotune(BA)
  assert {c for c, _ in tuned.measurements} == {PLAIN, PLAIN_2}
  cached = autotuning.USER_CACHE.result_for(kind, BA.op.name).entry(BA)
  assert cached.best_config == ATOMIC  # outside the mode, still the fastest
  assert {c for c, _ in cached.measurements} == {ATOMIC, atomic_2, PLAIN, PLAIN_2}
  assert cached.config_for(SumOp()._is_reproducible) == tuned.best_config
  (again,) = tuner().autotune(BA)  # reused now, not tuned again
  assert again == cached
  with pytest.raises(ValueError, match="another call"):
    cached.joined(dataclasses.replace(ENTRY, bound_args=SumOp().bind(jnp.arange(4.0))))


def test_the_join_keeps_what_a_concurrent_writer_merged_in(user_cache_dir, monkeypatch):
  # The joined entry was built from a read without the file's lock, then written in
  # place of the file's: another process's entry merged in between was lost.
  from stellarax.autotuning import cache as cache_lib
  atomic_2 = SumConfig(atomic=True, block=2)
  kind = RESULT.device_kind
  autotuning.USER_CACHE.write(AutotuningResult(kind, {ENTRY.key: dataclasses.replace(
      ENTRY, measurements=((ATOMIC, _ok(1e-6)), (atomic_2, _ok(2e-6))))}))
  other = dataclasses.replace(ENTRY, measured_at="elsewhere", measurements=(
      (ATOMIC, _ok(5e-7)), (atomic_2, _ok(7e-7))))
  real_write = cache_lib.FileCache.write

  def write(self, result, **kwargs):
    if kwargs.get("combine") is not None and len(result):  # another process, just before
      real_write(self, AutotuningResult(kind, {other.key: other}))
    return real_write(self, result, **kwargs)

  monkeypatch.setattr(cache_lib.FileCache, "write", write)
  stellarax.Autotuner(progress=False, measure_options=FAST, cache=True,
                      reproducible=True).autotune(BA)
  cached = autotuning.USER_CACHE.result_for(kind, BA.op.name).entry(BA)
  assert cached.measured_at == "elsewhere"  # the faster entry won, and was kept
  assert {c for c, _ in cached.measurements} == {ATOMIC, atomic_2, PLAIN, PLAIN_2}


def test_the_mode_is_checked_and_follows_xla_s_determinism_flag():
  with pytest.raises(TypeError, match="pass True or False"):
    with autotuning.reproducible_scope("yes"):
      pass
  with pytest.raises(TypeError, match="pass True, False or None"):
    stellarax.Autotuner(reproducible="yes")
  asks = resolution._xla_asks_determinism
  assert asks("--xla_gpu_deterministic_ops") and asks("--a=1 --xla_gpu_deterministic_ops=true")
  assert asks("--xla_gpu_exclude_nondeterministic_ops=1")
  assert not asks("") and not asks("--xla_gpu_deterministic_ops=false")
  assert not asks("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false")
  code = "from stellarax.core import resolution; print(resolution.reproducible())"
  for env, expected in (({"XLA_FLAGS": "--xla_gpu_deterministic_ops=true"}, "True"),
                        ({"STELLARAX_REPRODUCIBLE": "1"}, "True"), ({}, "False")):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("XLA_FLAGS", "STELLARAX_REPRODUCIBLE")} | env
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == expected, out.stderr[-2000:]


def test_the_mosaic_attention_backward_s_fused_dq_is_not_reproducible():
  vjp = stellarax.PallasMosaicGpuAttention().vjp_cls()
  config = vjp.config_cls(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
                          num_compute_wgs=1, num_stages=2, split_dkdv=False)
  assert vjp._is_reproducible(config) and not vjp._is_reproducible(
      dataclasses.replace(config, fuse_dq=True))
  assert stellarax.XlaRaggedDot()._is_reproducible(None)  # the default


def test_transfer_in_reproducible_mode_reads_each_results_own_measurements():
  # Two results alike in keys and best configs but not in their measurements: transfer
  # indexed the second under the first's digest and answered the first's best
  # reproducible config for it.
  other = dataclasses.replace(ENTRY, measurements=((PLAIN, _ok(1.5)), (ATOMIC, _ok(1.0)),
                                                   (PLAIN_2, _ok(2.0))))
  other_result = AutotuningResult(RESULT.device_kind, {other.key: other})
  assert other_result.content_digest != RESULT.content_digest
  untuned = SumOp().bind(jnp.arange(16.0))
  with autotuning.reproducible_scope():
    with RESULT:
      first = resolution.resolve_config(untuned)
    with other_result:
      second = resolution.resolve_config(untuned)
  assert first.source.startswith("transfer:") and first.config == PLAIN_2
  assert second.source.startswith("transfer:") and second.config == PLAIN
