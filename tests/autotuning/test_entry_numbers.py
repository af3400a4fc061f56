"""What an entry's numbers say (times, failures, the summary's columns), and which config
`BoundArguments.default_config` and `benchmark` run: each with values known in advance,
so that a number read from the wrong measurement or a config ignored fails."""

import dataclasses

import jax
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import Measurement


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
