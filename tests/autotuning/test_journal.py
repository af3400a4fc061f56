"""Tuning journals: an interrupted tuning of a call resumes from the configs it measured."""

import functools
import json

import jax
import jax.numpy as jnp
import pytest

import stellarax
from stellarax.autotuning import autotuner as autotuner_lib
from stellarax.autotuning import cache as cache_lib
from stellarax.autotuning import journal as journal_lib
from stellarax.autotuning import search
from stellarax.autotuning.measure import Measurement, MeasureOptions
from stellarax.tools import cli

FAST = MeasureOptions(rounds=2, leader_rounds=0, warmup_s=0.0, max_total_s=0.2, min_batch_s=2e-4)


def _call():
  lhs = jax.random.normal(jax.random.key(0), (48, 32))
  rhs = jax.random.normal(jax.random.key(1), (4, 32, 16))
  return stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([20, 0, 28, 0], jnp.int32))


def _tuner(options=FAST):
  # Chunks of two configs: one measure call each, so a run can stop between them.
  return stellarax.Autotuner(progress=False, measure_options=options, cache=True,
                             strategy=functools.partial(search.exhaustive, chunk_size=2))


@pytest.fixture
def measured(monkeypatch):
  """The configs of each measure call that reached the device; `stop_at` interrupts."""
  calls, real = [], autotuner_lib.Autotuner._local_measure
  state = {"stop_at": None}

  def local_measure(self, ba, device):
    measure = real(self, ba, device)

    def spy(configs, effort):
      if state["stop_at"] is not None and len(calls) == state["stop_at"]:
        raise KeyboardInterrupt
      calls.append(list(configs))
      return measure(configs, effort)
    return spy

  monkeypatch.setattr(autotuner_lib.Autotuner, "_local_measure", local_measure)
  return calls, state


def _journal_of(ba, root, options=FAST):
  (folder,) = [p for p in root.iterdir() if p.is_dir()]
  return journal_lib.Journal.for_call(ba, folder, seed=0, options=options, isolate=False).path


def test_an_interrupted_tuning_resumes_from_the_configs_it_measured(user_cache_dir, measured):
  calls, state = measured
  ba = _call()
  space = len(ba.autotuning_configs)
  assert space >= 5
  state["stop_at"] = 2
  with pytest.raises(KeyboardInterrupt):
    _tuner().autotune(ba)
  done = [c for call in calls for c in call]
  path = _journal_of(ba, user_cache_dir)
  lines = path.read_text().splitlines()
  assert len(lines) == 1 + len(done) == 5
  assert json.loads(lines[0])["code"]  # what the measurements are valid for
  # The rerun measures the heuristic (its first timed calls teach the search what a
  # config costs here) and the rest; the configs done before are measured again only in
  # the last call, where the best and those within its noise are confirmed together.
  calls.clear()
  state["stop_at"] = None
  (entry,) = _tuner().autotune(ba)
  heuristic = ba.heuristics_config
  assert heuristic in done and calls[0] == [heuristic]
  rest, *confirming = calls[1:]
  assert sorted(map(str, rest)) == sorted(str(c) for c in ba.autotuning_configs if c not in done)
  assert len(confirming) <= 1 and all(set(call) & set(done) for call in confirming)
  assert {c for c, _ in entry.measurements} == set(ba.autotuning_configs)
  assert not path.exists()  # the entry is in the cache: nothing to resume
  (cached,) = stellarax.autotuning.USER_CACHE.results()[0]
  assert cached == entry


def test_an_interrupted_measuring_again_resumes_when_measured_again(user_cache_dir, measured):
  # ignore_cache started its journal over on every run: Ctrl-C in a long call and the
  # rerun measured every config of it again.
  calls, state = measured
  ba = _call()
  (first,) = _tuner().autotune(ba)
  calls.clear()
  state["stop_at"] = 2
  again = lambda: stellarax.Autotuner(progress=False, measure_options=FAST, cache=True,
                                      ignore_cache=True, strategy=functools.partial(
                                          search.exhaustive, chunk_size=2)).autotune(ba)
  with pytest.raises(KeyboardInterrupt):
    again()
  done = {c for call in calls for c in call}
  assert len(done) >= 3
  calls.clear()
  state["stop_at"] = None
  (entry,) = again()
  # As for an interrupted tuning: the heuristic first, then the configs not measured
  # before; those that were, only to confirm the leaders together.
  assert calls[0] == [ba.heuristics_config]
  rest, *confirming = calls[1:]
  assert sorted(map(str, rest)) == sorted(str(c) for c in ba.autotuning_configs if c not in done)
  assert len(confirming) <= 1
  assert not list(user_cache_dir.rglob("*.journal"))  # the entry is in the cache
  (cached,) = stellarax.autotuning.USER_CACHE.results()[0]
  assert cached == entry and entry.measurements != first.measurements


def test_a_journal_of_other_settings_or_cut_short_is_not_recalled(user_cache_dir, measured):
  calls, state = measured
  ba = _call()
  state["stop_at"] = 1
  with pytest.raises(KeyboardInterrupt):
    _tuner().autotune(ba)
  path = _journal_of(ba, user_cache_dir)
  with open(path, "a") as f:
    f.write('{"config": {"tiles')  # a process killed while writing a line
  folder = path.parent
  journal = journal_lib.Journal.for_call(ba, folder, seed=0, options=FAST, isolate=False)
  assert len(journal.recalled) == 2
  first = calls[0][0]
  assert journal.recall(first, 1.0) is not None and journal.recall(first, 1.0).ok
  # Other measure options (or seed, versions, code): measured again, the journal restarted.
  other = MeasureOptions(rounds=3, leader_rounds=0, warmup_s=0.0, max_total_s=0.2, min_batch_s=2e-4)
  assert journal_lib.Journal.for_call(ba, folder, seed=0, options=other, isolate=False).recalled == {}
  assert journal_lib.Journal.for_call(ba, folder, seed=1, options=FAST, isolate=False).recalled == {}
  calls.clear()
  state["stop_at"] = 1
  with pytest.raises(KeyboardInterrupt):
    _tuner(other).autotune(ba)
  assert calls[0][0] == first  # measured again
  # In a journal of its own: the first one's measurements stay for a rerun of its settings.
  other_path = _journal_of(ba, user_cache_dir, other)
  assert other_path != path and len(other_path.read_text().splitlines()) == 1 + len(calls[0])
  assert len(journal_lib.Journal.for_call(ba, folder, seed=0, options=FAST, isolate=False).recalled) == 2
  # `stellarax cache clear` removes journals with the rest.
  assert cli.main(["cache", "clear"]) == 0
  assert not path.exists()


def _ok(ms):
  return Measurement(status="ok", median_s=ms * 1e-3, ci_low_s=ms * 0.9e-3,
                     ci_high_s=ms * 1.1e-3, num_samples=5)


class _FakeJournal:
  def __init__(self, recalled):
    self.recalled, self.records = recalled, []

  def is_recalled(self, config, measurement):
    return self.recalled.get(config) is measurement

  def record(self, measurements, effort):
    self.records.append((dict(measurements), effort))


def test_a_recalled_config_in_a_close_choice_is_measured_again_with_its_rivals():
  # "a" was recalled as best; "b" is within its noise; "c" is far slower.
  ms = {"a": _ok(1.0), "b": _ok(1.05), "c": _ok(3.0)}
  outcome = search.SearchOutcome(strategy="exhaustive", best="a", measurements=ms, wall_time_s=1.0, num_configs=3)
  asked = []

  def measure_here(configs, effort):
    asked.append((list(configs), effort))
    return {"a": _ok(1.2), "b": _ok(0.9)}

  journal = _FakeJournal({"a": ms["a"]})
  confirmed = autotuner_lib._confirm_recalled(outcome, measure_here, journal, heuristic="c")
  # The heuristic is measured beside them (here it stays slower).
  assert asked == [(["a", "b", "c"], 1.0)] and confirmed.best == "b"
  assert confirmed.measurements["a"].median_s == pytest.approx(1.2e-3)
  assert journal.records == [({"a": _ok(1.2), "b": _ok(0.9)}, 1.0)]
  # Nothing recalled among the close ones, or no close rival: the outcome stands.
  for recalled, rivals in (({"c": ms["c"]}, ms), ({"a": ms["a"]}, {"a": ms["a"], "c": ms["c"]})):
    same = search.SearchOutcome(strategy="exhaustive", best="a", measurements=rivals, wall_time_s=1.0,
                                num_configs=3)
    assert autotuner_lib._confirm_recalled(same, measure_here, _FakeJournal(recalled), "c") is same
  assert len(asked) == 1


def test_confirming_recalled_configs_never_picks_one_slower_than_the_heuristic():
  # "a" and "b" were recalled from another run at 1.0 ms, beside this run's heuristic at
  # 1.5; measured again here they take 2.0 and 2.1 (a slower machine now). Chosen among
  # those two alone, "a" won, slower than the heuristic by its own measurements.
  ms = {"h": _ok(1.5), "a": _ok(1.0), "b": _ok(1.01)}
  outcome = search.SearchOutcome(strategy="exhaustive", best="a", measurements=ms, wall_time_s=1.0,
                                 num_configs=3)
  now = {"h": _ok(1.9), "a": _ok(2.0), "b": _ok(2.1)}
  confirmed = autotuner_lib._confirm_recalled(
      outcome, lambda configs, effort: {c: now[c] for c in configs},
      _FakeJournal({"a": ms["a"], "b": ms["b"]}), heuristic="h")
  assert confirmed.best == "h" and confirmed.measurements == now


def test_without_cache_nothing_is_journaled(user_cache_dir, measured):
  calls, state = measured
  state["stop_at"] = 1
  with pytest.raises(KeyboardInterrupt):
    stellarax.Autotuner(progress=False, measure_options=FAST,
                        strategy=functools.partial(search.exhaustive, chunk_size=2)).autotune(_call())
  assert not user_cache_dir.exists() or not list(user_cache_dir.rglob("*.journal"))
  assert cache_lib.USER_CACHE.files() == []


def test_journals_of_concurrent_or_cut_short_runs_keep_every_whole_line(tmp_path):
  ba = _call()
  a, b, c = sorted(ba.autotuning_configs, key=str)[:3]
  journal = lambda **kw: journal_lib.Journal.for_call(ba, tmp_path, seed=0, options=FAST,
                                                      isolate=False, **kw)
  # Two runs of the same tuning, both started before either wrote: the second's first
  # write truncated the first's lines (it started "its" journal over).
  first, second = journal(), journal()
  first.record({a: _ok(1.0)}, 1.0)
  second.record({b: _ok(2.0)}, 1.0)
  assert set(journal().recalled) == {a, b}
  # A line cut short: the next run's first line was glued to it, and lost.
  with open(first.path, "a") as f:
    f.write('{"config": {"til')
  resumed = journal()
  resumed.record({c: _ok(3.0)}, 1.0)
  assert set(journal().recalled) == {a, b, c}
  # A byte that is no UTF-8 (a disk's damage): every line was lost with it, for good.
  with open(first.path, "ab") as f:
    f.write(b"\xff\n")
  assert set(journal().recalled) == {a, b, c}
  # Measuring again (ignore_cache) recalls none of it, in a journal of its own, which a
  # later measuring again resumes; the ordinary tuning's is left as it was.
  assert journal(anew=True).recalled == {}
  journal(anew=True).record({c: _ok(4.0)}, 1.0)
  assert journal(anew=True).recall(c, 1.0) == _ok(4.0) and set(journal(anew=True).recalled) == {c}
  assert set(journal().recalled) == {a, b, c} and journal().recall(c, 1.0) == _ok(3.0)
  journal_lib.remove(ba, tmp_path)
  assert not list(tmp_path.iterdir())


def test_measure_options_without_a_tolerance_are_journaled(tmp_path):
  # atol=inf (no output check) could not be written in the journal's first line (JSON has
  # no inf): tuning with cache=True failed before measuring anything.
  ba = _call()
  options = MeasureOptions(rounds=2, leader_rounds=0, warmup_s=0.0, max_total_s=0.2,
                           min_batch_s=2e-4, atol=float("inf"))
  journal = lambda: journal_lib.Journal.for_call(ba, tmp_path, seed=0, options=options, isolate=False)
  config = min(ba.autotuning_configs, key=str)
  journal().record({config: _ok(1.0)}, 1.0)
  assert journal().recall(config, 1.0) == _ok(1.0)
  assert journal_lib.Journal.for_call(ba, tmp_path, seed=0, options=FAST, isolate=False).recalled == {}


def test_failures_of_what_a_run_met_are_measured_again(tmp_path):
  # A timeout or runtime error (another process held the device's memory) was recalled:
  # a call whose configs all failed so failed again on every rerun, running nothing.
  ba = _call()
  a, b, c, d = sorted(ba.autotuning_configs, key=str)[:4]
  journal = lambda: journal_lib.Journal.for_call(ba, tmp_path, seed=0, options=FAST, isolate=False)
  journal().record({
      a: Measurement(status="runtime_error", error="RESOURCE_EXHAUSTED: out of memory"),
      b: Measurement(status="timeout", error="no result in 60 s"),
      c: Measurement(status="compile_error", error="out of shared memory"),
      d: _ok(1.0)}, 1.0)
  resumed = journal()
  assert resumed.recall(a, 1.0) is None and resumed.recall(b, 1.0) is None
  assert resumed.recall(c, 1.0).status == "compile_error" and resumed.recall(d, 1.0) == _ok(1.0)
