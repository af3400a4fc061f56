"""bench/timing_probe.py: its loop study times each product the three ways it names."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import timing_probe  # noqa: E402


@pytest.mark.timing  # "always looped" loops calls whose warm-up took under 1 ms
def test_loop_study_times_every_product_looped_in_batches_and_by_default():
  rows = timing_probe.loops_rows(smoke=True)
  assert [r["product"] for r in rows] == [
      f"{c}x128x{c}" for c in (16, 32, 48, 64, 88, 112, 128)]
  for row in rows:
    modes = {mode: row[mode] for mode in ("defaults", "never looped", "always looped")}
    assert all(m["status"] == "ok" and m["median_ms"] > 0 for m in modes.values()), row
    assert modes["always looped"]["method"] == "cpu-looped"  # every call is far under 1 ms
    assert modes["never looped"]["method"] == "cpu-batched"
    assert modes["defaults"]["method"] in ("cpu-looped", "cpu-batched")
  table = timing_probe.loops_table(rows)
  assert table.count("\n") == len(rows) and "(looped)" in table and "(batched)" in table
