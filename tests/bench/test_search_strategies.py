"""bench/search_strategies.py: the comparison of budgeted strategies on replayed sweeps."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import search_strategies  # noqa: E402  (bench/ is not a package)


def test_landscapes_have_a_heuristic_that_runs_and_some_failures():
  sweep = search_strategies.landscape(0, rough=0.03)
  assert len(sweep) == 192 and isinstance(sweep[search_strategies.HEURISTIC], float)
  assert sum(not isinstance(v, float) for v in sweep.values()) > 5
  assert search_strategies.landscape(0, rough=0.03) == sweep  # seeded


def test_the_report_compares_every_strategy_in_every_setting(tmp_path):
  against = tmp_path / "other_search.py"
  against.write_text((ROOT / "src" / "stellarax" / "autotuning" / "search.py").read_text())
  lines = search_strategies.run(seeds=2, against=str(against))
  assert len(lines) == 2 + 27
  assert "racing (other_search.py): within 2%" in lines[0]
  cells = [line.strip("| ").split(" | ") for line in lines[2:]]
  assert all(len(row) == 3 + 4 for row in cells)
  # The same code under two names gives the same numbers.
  assert all(row[3] == row[5] and row[4] == row[6] for row in cells)


def test_the_live_report_tunes_a_real_call_within_each_budget():
  lines = search_strategies.live(None, budgets=(1.0,), repeats=1)
  assert lines[0].startswith("| budget (s) | strategy |") and len(lines) == 3
  budget, strategy, measured, seconds = lines[2].strip("| ").split(" | ")
  assert (budget, strategy) == ("1", "racing") and measured.endswith(" of 16")
  assert float(seconds) > 0  # budgets are held on replayed clocks (test_search), not here


def _kernel_tuner_file(tmp_path, records):
  import json
  path = tmp_path / "cache.json"
  path.write_text(json.dumps({
      "device_name": "a GPU", "tune_params_keys": ["block", "unroll"],
      "cache": {f"{b},{u}": {"block": b, "unroll": u, "time": t, "compile_time": 300.0,
                             "benchmark_time": 100.0}
                for (b, u), t in records.items()}}))
  return path


def test_a_kernel_tuner_cache_file_becomes_a_sweep_with_its_failures(tmp_path):
  path = _kernel_tuner_file(tmp_path, {(32, 1): 2.0, (64, 1): 1.5, (64, 2): "CompilationFailedConfig"})
  sweep, compile_share = search_strategies.kernel_tuner_sweep(str(path))
  by_fields = {(c.block, c.unroll): v for c, v in sweep.items()}
  assert by_fields[32, 1] == 2e-3 and by_fields[64, 1] == 1.5e-3  # milliseconds -> seconds
  assert by_fields[64, 2].status == "compile_error" and "CompilationFailed" in by_fields[64, 2].error
  assert compile_share == 0.75
  (tmp_path / "other.json").write_text('{"cache": {}}')
  with pytest.raises(ValueError, match="not a kernel_tuner cache file"):
    search_strategies.kernel_tuner_sweep(str(tmp_path / "other.json"))


def test_the_real_sweep_report_has_a_row_per_budget(tmp_path):
  records = {(b, u): 1.0 + abs(b - 64) / 64 + 0.1 * u for b in (16, 32, 64, 128) for u in (1, 2, 4)}
  lines = search_strategies.run_real(str(_kernel_tuner_file(tmp_path, records)), seeds=3, against=None)
  assert lines[0].startswith("cache.json: 12 configs, 12 ran, best 1.100 ms, compiling 75%")
  rows = [line.strip("| ").split(" | ") for line in lines[4:]]
  assert [r[0] for r in rows] == ["0.02", "0.05", "0.1", "0.2"]
  within, _, _, spent = rows[-1][1].split(", ")
  assert within.endswith("/3") and float(spent) <= 1.0 + 1e-9
