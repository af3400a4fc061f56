"""bench/search_strategies.py: the comparison of budgeted strategies on replayed sweeps."""

import pathlib
import sys

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
