"""The `stellarax` command line."""

import jax
import jax.numpy as jnp

import stellarax
from stellarax import autotuning
from stellarax.tools import cli


def test_autotune_report_and_cache_commands(tmp_path, user_cache_dir, capsys):
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([10, 22], jnp.int32))
  calls = tmp_path / "calls.json"
  autotuning.bound_args_to_json([ba], calls)
  out = tmp_path / "result.json"
  assert cli.main(["autotune", str(calls), "--output", str(out), "--cache", "--budget-s", "5",
                   "--no-progress", "--isolate"]) == 0
  assert len(stellarax.AutotuningResult.load(out)) == 1
  assert cli.main(["report", str(out)]) == 0
  assert "ragged_dot.xla" in capsys.readouterr().out
  assert cli.main(["cache", "list"]) == 0
  assert "ragged_dot.xla.json: 1 entries" in capsys.readouterr().out
  assert cli.main(["cache", "path"]) == 0
  assert str(user_cache_dir) in capsys.readouterr().out
  library = tmp_path / "library"
  assert cli.main(["cache", "ship", str(out), "--root", str(library)]) == 0
  (shipped,) = library.glob("*/ragged_dot.xla.json")
  assert stellarax.AutotuningResult.load(shipped) == stellarax.AutotuningResult.load(out)



def test_autotune_command_keeps_the_tuned_calls_when_one_fails(tmp_path, user_cache_dir, capsys,
                                                                monkeypatch):
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  good = stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([10, 22], jnp.int32))
  bad = stellarax.XlaRaggedDot.bind(lhs[:16], rhs, jnp.array([10, 6], jnp.int32))
  calls = tmp_path / "calls.json"
  autotuning.bound_args_to_json([bad, good], calls)
  real = stellarax.Autotuner.tune_one

  def tune_one(self, ba, **kwargs):
    if ba.key_json() == bad.key_json():
      raise ValueError("None of the 6 candidates succeeded (boom)")
    return real(self, ba, **kwargs)

  monkeypatch.setattr(stellarax.Autotuner, "tune_one", tune_one)
  out = tmp_path / "result.json"
  assert cli.main(["autotune", str(calls), "--output", str(out), "--cache", "--budget-s", "2",
                   "--no-progress"]) == 1
  (entry,) = stellarax.AutotuningResult.load(out)
  assert entry.bound_args.key_json() == good.key_json()
  captured = capsys.readouterr()
  assert "tuned 1 of 2 calls" in captured.err and "boom" in captured.err
  assert "result saved to" in captured.out
  assert autotuning.explain(good).source == "user_cache"
