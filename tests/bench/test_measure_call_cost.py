"""bench/measure_call_cost.py: where a measure call's seconds go (interpret mode)."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import measure_call_cost  # noqa: E402


def test_timed_parts_sees_the_measuring_thread_and_puts_everything_back():
  import jax.numpy as jnp
  from stellarax.autotuning import measure
  original, of = measure._check_output, vars(measure._Expected)["of"]
  parts = {}
  x = jnp.arange(12.0).reshape(3, 4)
  with measure_call_cost.timed_parts(measure, parts):
    measure.measure_candidates({"a": lambda x: x * 2}, (x,), reference=x * 2,
                               options=measure.MeasureOptions(rounds=2, leader_rounds=0))
  assert measure._check_output is original and vars(measure._Expected)["of"] is of
  assert parts["_Expected.of"][1] == 1 and parts["_surely_close"][1] == 1
  assert parts["_check_output"][1] == 1 and parts["_take_rounds"][1] == 1
  assert parts["_run_batch"][1] >= 2  # the batches, which the measuring thread runs
  assert all(seconds >= 0 for seconds, _ in parts.values())


@pytest.mark.slow
def test_smoke_run_times_calls_and_their_parts(tmp_path):
  assert measure_call_cost.main(["--smoke", "--out", str(tmp_path)]) == 0
  record = json.loads((tmp_path / "call_cost.json").read_text())
  assert len(record["rows"]) == 15 and all(r["s"] > 0 for r in record["rows"])
  assert "_check_output" in record["profile"]
