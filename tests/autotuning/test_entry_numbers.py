"""What an entry's numbers say (times, failures, the summary's columns), and which config
`BoundArguments.default_config` and `benchmark` run: each with values known in advance,
so that a number read from the wrong measurement or a config ignored fails."""

import contextlib
import dataclasses
import warnings

import jax
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import Measurement
from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig


@stellarax.config_dataclass
class _Config:
  scale: float = 1.0  # 1.0 is the op; anything else gives a wrong output


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Scaled(stellarax.Op, name="test_entry_numbers.scaled"):
  """2 * x, times the config's scale: a config other than the heuristic's is wrong."""

  config_cls = _Config

  def _fwd(self, x, *, config):
    return 2.0 * x * config.scale, None

  def _reference(self, x):
    return 2.0 * x

  def _get_heuristics_config(self, ba):
    return _Config()

  def _get_autotuning_configs(self, ba):
    return {_Config(scale=1.0), _Config(scale=3.0)}


def _ok(median_s: float) -> Measurement:
  return Measurement(status="ok", median_s=median_s, ci_low_s=median_s * 0.9,
                     ci_high_s=median_s * 1.1, num_samples=5)


def _failed() -> Measurement:
  return Measurement(status="compile_error", error="too much shared memory")


@pytest.fixture
def ba():
  return _Scaled.bind(jax.random.normal(jax.random.key(0), (8, 16)))


def _entry(ba) -> autotuning.Entry:
  fast, heuristic, broken = _Config(scale=3.0), _Config(), _Config(scale=5.0)
  return autotuning.Entry(
      bound_args=ba, best_config=fast, heuristic_config=heuristic,
      measurements=((broken, _failed()), (heuristic, _ok(3e-3)), (fast, _ok(2e-3)),
                    (fast, _ok(9e-3)), (broken, _failed())))


def test_times_are_the_first_ok_measurement_of_each_config(ba):
  entry = _entry(ba)
  assert entry.time_of(_Config(scale=3.0)) == entry.best_time == 2e-3  # not the 9 ms
  assert entry.time_of(_Config()) == entry.heuristic_time == 3e-3
  assert entry.time_of(_Config(scale=5.0)) is None  # measured, never ok
  assert entry.time_of(_Config(scale=7.0)) is None  # never measured
  assert entry.num_failed == 2


def test_the_summary_shows_the_entry_s_times_and_speed_up(ba):
  result = autotuning.AutotuningResult("cpu", {_entry(ba).key: _entry(ba)})
  row = result.summary().splitlines()[2].split()
  assert row[0] == "test_entry_numbers.scaled" and "scale=3.0" in row
  assert row[-5:] == ["3.000", "ms", "1.50x", "5", "2"]  # heuristic, speed-up, measured, failed
  assert row[-7:-5] == ["2.000", "ms"]  # best


def test_default_config_and_benchmark_run_the_resolved_config_or_the_one_given(ba):
  wrong = _Config(scale=3.0)
  assert ba.default_config == _Config()
  assert ba.benchmark(rounds=1, leader_rounds=0, max_total_s=0.2).status == "ok"
  assert ba.benchmark(wrong, rounds=1, leader_rounds=0).status == "wrong_result"
  entry = autotuning.Entry(ba, wrong, _Config(), ((wrong, _ok(1e-3)),))
  pinned = autotuning.AutotuningResult(jax.devices()[0].device_kind, {entry.key: entry})
  with pinned:
    assert ba.default_config == wrong
    assert ba.benchmark(rounds=1, leader_rounds=0).status == "wrong_result"
  assert ba.default_config == _Config()


def _ragged(m):
  """An XLA ragged_dot call of m rows (20: tiles of 512 rows, `_GONE`, are not offered)."""
  return stellarax.XlaRaggedDot.bind(jax.ShapeDtypeStruct((m, 16), "float32"),
                                     jax.ShapeDtypeStruct((2, 16, 8), "float32"),
                                     jax.ShapeDtypeStruct((2,), "int32"))


_OFFERED = XlaRaggedDotConfig(strategy="masked")
_GONE = XlaRaggedDotConfig(strategy="tiled", tile_m=512)


def test_a_stale_entry_whose_config_the_op_no_longer_offers_is_passed_over(user_cache_dir):
  # Its config (tiles of 512 rows for 20 rows: not in the space) was run, and failed
  # where newer code checks it; a cache only saves time.
  from stellarax.autotuning import cache
  from stellarax.autotuning.file_format import VersionWarning
  ba, offered, gone = _ragged(20), _OFFERED, _GONE
  assert offered in ba.autotuning_configs and gone not in ba.autotuning_configs
  kind = jax.devices()[0].device_kind
  for config, stale in [(gone, True), (offered, True), (gone, False)]:
    entry = autotuning.Entry(ba, config, ba.heuristics_config, ((config, _ok(1e-3)),),
                             code="0000000000000000" if stale else "")
    result = autotuning.AutotuningResult(kind, {entry.key: entry})
    passed_over = stale and config == gone
    for source in ("result", "user_cache"):  # warned once, passed over in both
      warns = passed_over and source == "result"
      with pytest.warns(VersionWarning, match="no longer offers") if warns else _no_warning():
        if source == "result":
          with result:
            explained = autotuning.explain(ba)
        else:
          cache.USER_CACHE.clear()
          cache.USER_CACHE.write(result)
          explained = autotuning.explain(ba)
      assert explained.source == ("heuristics" if passed_over else source), (config, stale)
      assert explained.config == (ba.heuristics_config if passed_over else config)
      # explain says why (it showed the entry as a "nearest call" differing in nothing),
      # and a config that will not run gives no time to choose its implementation by.
      assert (explained.passed_over is not None) == passed_over
      if passed_over:
        assert "stale (measured on other code" in str(explained)
        assert "which the op no longer offers for it: passed over" in str(explained)
        assert "differs in: \n" not in str(explained) + "\n"
      lookup = result if source == "result" else cache.USER_CACHE
      assert (lookup.lookup_time(ba) is None) == passed_over


def test_explain_names_the_entry_that_answered_and_the_one_passed_over(user_cache_dir):
  # The inner result's stale entry holds a config no longer offered, so the outer
  # result's current entry answers: explain called the answer stale (it read the first
  # entry of the call, not the one resolution took), and with a cache answering it did
  # not say that the inner entry was passed over.
  from stellarax.autotuning import cache
  ba, offered, gone = _ragged(20), _OFFERED, _GONE
  kind = jax.devices()[0].device_kind

  def result_of(config, stale):
    entry = autotuning.Entry(ba, config, ba.heuristics_config, ((config, _ok(1e-3)),),
                             code="0000000000000000" if stale else "")
    return autotuning.AutotuningResult(kind, {entry.key: entry})

  inner, outer = result_of(gone, stale=True), result_of(offered, stale=False)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", autotuning.VersionWarning)
    with outer, inner:
      explained = autotuning.explain(ba)
    assert (explained.source, explained.config, explained.stale) == ("result", offered, None)
    assert "passed over" in explained.passed_over and "again" not in str(explained)
    cache.USER_CACHE.write(outer)
    with inner:
      explained = autotuning.explain(ba)
    assert (explained.source, explained.config) == ("user_cache", offered)
    assert explained.stale is None and "the result's entry" in explained.passed_over
    # The entry that answers first hides those behind it.
    with inner, outer:
      assert autotuning.explain(ba).passed_over is None


def test_explain_names_a_passed_over_entry_where_transfer_answers():
  ba, near, offered, gone = _ragged(20), _ragged(40), _OFFERED, _GONE
  own = autotuning.Entry(ba, gone, ba.heuristics_config, ((gone, _ok(1e-3)),),
                         code="0000000000000000")
  searched = autotuning.Entry(near, offered, near.heuristics_config,
                              ((offered, _ok(1e-3)), (near.heuristics_config, _ok(2e-3))))
  result = autotuning.AutotuningResult(jax.devices()[0].device_kind,
                                       {own.key: own, searched.key: searched})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", autotuning.VersionWarning)
    with result:
      explained = autotuning.explain(ba)
  assert explained.source.startswith("transfer") and explained.config == offered
  assert "passed over; autotune measures the call again" in str(explained)


@contextlib.contextmanager
def _no_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error", autotuning.VersionWarning)
    yield
