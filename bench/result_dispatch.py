"""What entering an AutotuningResult costs jitted functions: traces and dispatch.

    python bench/result_dispatch.py [--calls 20000]

Two jitted functions, one without stellarax ops and one with a ragged_dot, and
the ragged_dot called eagerly, are called outside a result, inside one that
tunes the ragged_dot, and after it. Prints, per phase, how many times each
jitted function was traced and the mean time per call (dispatch of a tiny
computation, so the time is mostly the jit fast path).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import stellarax
from stellarax import autotuning
from stellarax.autotuning.cache import current_device_kind
from stellarax.autotuning.measure import Measurement
from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig


def _result_for(ba, config) -> autotuning.AutotuningResult:
  m = Measurement(status="ok", median_s=1e-3, ci_low_s=9e-4, ci_high_s=1.1e-3, num_samples=5,
                  compile_time_s=0.1, error=None, method="bench")
  entry = autotuning.Entry(bound_args=ba, best_config=config, heuristic_config=ba.heuristics_config,
                           measurements=((config, m),))
  return autotuning.AutotuningResult(current_device_kind(), {entry.key: entry})


def _per_call_us(fn, args, calls: int) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=20000)
  args = parser.parse_args(argv)
  lhs, rhs = jnp.ones((48, 16)), jnp.ones((4, 16, 8))
  sizes = jnp.asarray([10, 0, 30, 5], jnp.int32)
  traces = {"no op": 0, "ragged_dot": 0}

  def plain(x):
    traces["no op"] += 1
    return x + 1

  def with_op(l, r):
    traces["ragged_dot"] += 1
    return stellarax.ragged_dot(l, r, sizes)

  functions = {"no op": (jax.jit(plain), (jnp.ones(3),)), "ragged_dot": (jax.jit(with_op), (lhs, rhs)),
               "ragged_dot, eager": (lambda l, r: stellarax.ragged_dot(l, r, sizes), (lhs, rhs))}
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, sizes)
  tuned = next(c for c in ba.autotuning_configs if c != ba.heuristics_config)
  result = _result_for(ba, tuned)
  rows = []
  for phase in ("before", "inside", "after"):
    seen = dict(traces)
    if phase == "inside":
      result.__enter__()
    times = {name: _per_call_us(fn, a, args.calls) for name, (fn, a) in functions.items()}
    if phase == "inside":
      result.__exit__(None, None, None)
    rows += [(phase, name, traces[name] - seen[name] if name in traces else "-", times[name])
             for name in functions]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.calls} calls per phase")
  print("| phase | function | traces | us per call |\n|---|---|---:|---:|")
  for phase, name, n, us in rows:
    print(f"| {phase} | {name} | {n} | {us:.2f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
