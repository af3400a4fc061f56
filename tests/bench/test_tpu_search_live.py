"""bench/tpu_search_live.py: a Pallas TPU matmul's tiles swept and searched (interpret mode)."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import tpu_search_live  # noqa: E402


@pytest.mark.slow
def test_smoke_run_sweeps_every_config_and_searches_with_a_logged_budget(tmp_path):
  assert tpu_search_live.main(["--smoke", "--out", str(tmp_path),
                               "--strategies", "racing,random_search"]) == 0
  record = json.loads((tmp_path / "search.json").read_text())
  assert len(record["times_ms"]) + len(record["failed"]) == 12 and not record["failed"]
  assert len(record["compile_s"]) == 12 and all(t > 0 for t in record["compile_s"].values())
  assert min(record["times_ms"].values()) == record["times_ms"][str(tuple(record["best"]))]
  assert [run["strategy"] for run in record["runs"]] == ["racing", "random_search"]
  for run in record["runs"]:
    assert run["budget_s"] == pytest.approx(0.25 * record["sweep_s"])
    assert run["chosen_over_best"] >= 1.0 and 1 <= run["measured"] <= 12
    # Its first call measures the heuristic alone, new, at full effort.
    assert run["calls"][0][:3] == [1, 1, 1.0]
    assert sum(call[3] for call in run["calls"]) <= run["spent_s"]


def test_an_unknown_strategy_is_refused_with_the_names_there_are(capsys):
  with pytest.raises(SystemExit):
    tpu_search_live.main(["--smoke", "--strategies", "racing,annealing"])
  assert "annealing: expected some of racing, random_search" in capsys.readouterr().err


def test_the_kernel_multiplies_in_interpret_mode():
  import jax
  import jax.numpy as jnp
  x = jax.random.normal(jax.random.key(1), (128, 256))
  y = jax.random.normal(jax.random.key(2), (256, 64))
  got = tpu_search_live.matmul((64, 64, 128), x, y, interpret=True)
  assert jnp.allclose(got, x @ y, rtol=1e-4, atol=1e-4)
