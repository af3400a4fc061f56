"""`make demo`: autotune a small mixture-of-experts block on this machine.

Builds a small transformer block (attention, RMS norm, a gated MLP and a
mixture-of-experts layer through `ragged_dot`), finds its stellarax ops in
the training step (forward and backward), tunes them, prints the table,
saves the result, and times the step with heuristic configs, inside `with result:`,
and with each tuned call left out (`autotuning.check_in_program`): what tuning gained in
the program, not only in each op on its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import stellarax
from stellarax.autotuning import measure
from stellarax.tools import positive_seconds

CONFIG = dict(batch=2, seq=512, heads=4, kv_heads=2, head_dim=32, experts=16, hidden=256)


def init_params(key, *, heads, kv_heads, head_dim, experts, hidden, **_):
  """Random parameters of the demo block."""
  d = heads * head_dim
  k = jax.random.split(key, 6)
  init = lambda key, shape, fan_in: jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)
  return {
      "wq": init(k[0], (d, heads, head_dim), d),
      "wkv": init(k[1], (d, 2, kv_heads, head_dim), d),
      "norm": jnp.ones((d,), jnp.float32),
      "glu": init(k[2], (d, 2, hidden), d),
      "router": init(k[3], (hidden, experts), hidden),
      "experts": init(k[4], (experts, hidden, d), hidden),
  }


def block(params, x):
  """One block: attention -> RMS norm -> gated MLP -> top-1 mixture of experts."""
  b, t, d = x.shape
  q = jnp.einsum("btd,dnh->btnh", x, params["wq"])
  kv = jnp.einsum("btd,dcnh->cbtnh", x, params["wkv"])
  att = stellarax.dot_product_attention(q, kv[0], kv[1], is_causal=True).reshape(b, t, d)
  h = stellarax.rms_norm(x + att, params["norm"])
  h = stellarax.gated_linear_unit(h.reshape(b * t, d), params["glu"])
  expert = jnp.argmax(h @ params["router"], axis=-1)
  order = jnp.argsort(expert)
  group_sizes = jnp.bincount(expert, length=params["experts"].shape[0]).astype(jnp.int32)
  y = stellarax.ragged_dot(h[order], params["experts"], group_sizes)
  y = jnp.zeros_like(y).at[order].set(y)
  return x + y.reshape(b, t, d)


def loss(params, x):
  """Mean square of the block's output."""
  return jnp.mean(block(params, x) ** 2)


DEFAULT_BUDGET_S = 20.0  # tuning budget per op call, unless a total one is given


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The demo's options, on its own parser or on `stellarax demo`'s."""
  parser.add_argument("--output", default="demo_out", help="folder for the result JSON")
  budgets = parser.add_mutually_exclusive_group()
  budgets.add_argument("--budget-s", type=positive_seconds, default=None,
                       help=f"tuning budget per op call (default {DEFAULT_BUDGET_S:g})")
  budgets.add_argument("--total-budget-s", type=positive_seconds, default=None,
                       help="one budget for all calls instead, shared by their device time in"
                            " a profile of the step (Autotuner.total_budget_s)")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar while tuning; print the table when done")


def _output_problem(folder: str) -> str | None:
  """What keeps `folder` from holding the result, in words, or None."""
  path = Path(folder)
  if path.exists() and not path.is_dir():
    return f"--output {folder} is a file; name a folder (it is created if missing)"
  existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    return f"--output {folder}: {existing} is not a writable folder; name one in a writable place"
  return None


def main(argv=None) -> int:
  """Runs the demo (`python -m stellarax.tools.demo --help` lists its options).

  Args:
    argv: command-line arguments (None: sys.argv's).

  Returns:
    0 (the exit status).
  """
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_arguments(parser)
  return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
  """Runs the demo with parsed options (see `add_arguments`); returns 0, or 2 (with a
  message) for an --output that cannot hold the result, before anything is tuned."""
  problem = _output_problem(args.output)
  if problem:
    print(f"stellarax demo: error: {problem}", file=sys.stderr)
    return 2
  params = init_params(jax.random.key(0), **CONFIG)
  x = jax.random.normal(jax.random.key(1), (CONFIG["batch"], CONFIG["seq"], CONFIG["heads"] * CONFIG["head_dim"]))
  step = jax.value_and_grad(loss)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, stellarax {stellarax.__version__}")

  found = stellarax.autotuning.get_bound_args(step, params, x)
  print(f"found {len(found)} op calls in the training step:")
  for ba in found:
    print(f"  {ba}")

  start = time.monotonic()
  budgets = (dict(total_budget_s=args.total_budget_s) if args.total_budget_s is not None
             else dict(budget_s=args.budget_s or DEFAULT_BUDGET_S))
  tuner = stellarax.Autotuner(**budgets, progress=not args.no_progress)
  result = tuner.autotune(step, params, x)
  tuning_s = time.monotonic() - start
  if args.no_progress:  # with progress on, the tuner has printed the table already
    print()
    print(result.summary())
  out_dir = Path(args.output)
  out_dir.mkdir(parents=True, exist_ok=True)
  result.dump(out_dir / "result.json")
  print()
  print(f"tuned {len(result)} op calls in {tuning_s:.1f} s; result saved to {out_dir / 'result.json'}")
  # The whole step, measured in interleaved rounds so that drift hits every variant alike.
  check = stellarax.autotuning.check_in_program(result, step, params, x,
                                                options=measure.MeasureOptions(rounds=15))
  print("training step, " + "\n".join(check.lines()))
  kept = check.kept()
  kept.dump(out_dir / "kept.json")
  helped = sum(call.helps for call in check.calls)
  print(f"{out_dir / 'result.json'} holds every tuned config; {out_dir / 'kept.json'} only "
        f"those that made this step faster beyond noise ({helped} of {len(check.calls)}; the "
        "others at their heuristic configs): use it in this program, "
        "`with stellarax.AutotuningResult.load(path):`.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
