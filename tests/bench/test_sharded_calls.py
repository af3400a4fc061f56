"""bench/sharded_calls.py: per shard beats the whole call on every device, and agrees."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sharded_calls  # noqa: E402


@pytest.mark.slow
def test_per_shard_rows_gather_nothing_and_agree_with_xla(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert sharded_calls.main(["--devices", "2", "--out", str(out)]) == 0
  import json
  rows = json.loads(out.read_text())
  assert [(r["workload"], r["way"]) for r in rows] == [
      (w, way) for w in sharded_calls.WORKLOADS for way in ("whole call", "per shard")]
  for r in rows:
    assert r["devices"] == 2 and r["max_abs_error"] < 1e-3, r
    if r["way"] == "per shard":
      assert r["all_gathers"] == 0, r
  assert "per shard" in capsys.readouterr().out
