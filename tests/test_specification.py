"""The specification's snippets, run as written with `tokamax` -> `stellarax`
(class names follow our `<Backend><Op>` naming; Mosaic TPU -> XLA here)."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import stellarax
from stellarax.autotuning.measure import MeasureOptions
from profiling import drop_live_programs  # tests/ is on sys.path

FAST = MeasureOptions(rounds=2, leader_rounds=0, warmup_s=0.0, max_total_s=0.3, min_batch_s=2e-4)


@pytest.fixture(autouse=True)
def quick_default_autotuner(monkeypatch):
  """`stellarax.autotune` with defaults, but measuring briefly (tests only)."""
  original = stellarax.Autotuner
  monkeypatch.setattr(stellarax.autotuning.autotuner, "Autotuner",
                      functools.partial(original, measure_options=FAST, progress=False))


def _args():
  k = jax.random.split(jax.random.key(0), 3)
  return {"x": jax.random.normal(k[0], (64, 32)), "w": jax.random.normal(k[1], (4, 32, 16)),
          "q": jax.random.normal(k[2], (1, 16, 2, 8))}


def f(x, w, q):
  group = jnp.array([16, 0, 40, 8], jnp.int32)
  y = stellarax.ragged_dot(x, w, group)
  return jnp.sum(jnp.sin(y)) + jnp.sum(stellarax.dot_product_attention(q, q, q, is_causal=True))


def test_callable_with_keyword_arguments():
  args = _args()
  autotune_result: stellarax.AutotuningResult = stellarax.autotune(f, **args)
  with autotune_result:
    out_autotuned = f(**args)
  assert jnp.isfinite(out_autotuned) and len(autotune_result) == 2


def test_grad_closure_with_no_arguments():
  args = _args()
  f_grad = functools.partial(jax.grad(f, argnums=(0, 2)), args["x"], args["w"], args["q"])  # takes no arguments
  autotune_result = stellarax.autotune(f_grad)
  with autotune_result:
    out = f_grad()
  assert out[0].shape == args["x"].shape
  assert {"ragged_dot.xla_vjp", "attention.xla_vjp"} <= {e.bound_args.op.name for e in autotune_result}


def test_sequence_of_bound_arguments():
  a = _args()
  group = jnp.array([16, 0, 40, 8], jnp.int32)
  ragged_dot_ba = stellarax.XlaRaggedDot.bind(a["x"], a["w"], group)
  attention_ba = stellarax.XlaChunkedAttention.bind(a["q"], a["q"], a["q"])
  autotune_result: stellarax.AutotuningResult = stellarax.autotune([ragged_dot_ba, attention_ba])
  with autotune_result:
    stellarax.ragged_dot(a["x"], a["w"], group)
  assert len(autotune_result) == 2


@pytest.mark.slow  # ~11 s; a profile's calls are read and tuned fast in tests/tools/test_xplane_to_bound_args.py
def test_serialised_bound_arguments_from_a_profile(tmp_path):
  drop_live_programs()
  args = _args()
  step = jax.jit(f)
  with jax.profiler.trace(str(tmp_path / "prof")):
    jax.block_until_ready(step(**args))
  out = tmp_path / "bound_args.json"
  proc = subprocess.run([sys.executable, "-m", "stellarax.tools.xplane_to_bound_args",
                         f"--xplane_file={tmp_path / 'prof'}", f"--output_file={out}"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  bound_args = stellarax.autotuning.bound_args_from_json(str(out))
  autotune_result = stellarax.autotune(bound_args)
  assert len(autotune_result) == len(bound_args) == 2


def test_serialise_load_and_merge(tmp_path):
  args = _args()
  autotune_result: stellarax.AutotuningResult = stellarax.autotune(f, **args)
  autotune_result_json: str = autotune_result.dumps()
  autotune_result = stellarax.AutotuningResult.loads(autotune_result_json)
  with autotune_result:
    f(**args)
  path_to_file_1, path_to_file_2 = tmp_path / "1.json", tmp_path / "2.json"
  autotune_result.dump(path_to_file_1)
  stellarax.autotune(jax.grad(f, argnums=(0, 2)), args["x"], args["w"], args["q"]).dump(path_to_file_2)
  autotune_result_1 = stellarax.AutotuningResult.load(path_to_file_1)
  autotune_result_2 = stellarax.AutotuningResult.load(path_to_file_2)
  merged_results = autotune_result_1 | autotune_result_2
  with merged_results:
    jax.grad(f, argnums=(0, 2))(args["x"], args["w"], args["q"])
  assert len(merged_results) == 4
