"""Record full sweeps of the XLA ops' config spaces on a grid of shapes.

    python bench/record_sweeps.py                  # record every op, then print the regrets
    python bench/record_sweeps.py --ops ragged_dot.xla
    python bench/record_sweeps.py --report-only    # the regrets of the data already recorded

Every config of each call's space is measured (`Autotuner(strategy="exhaustive")`) with
short measurements, so that a whole recording takes a few minutes on a 2-core CPU. The
results are written as result JSON, one file per op, to
`tests/data/sweeps/<device kind>/<op>.json` (`cpu` here); they are test data for the
transfer step (`stellarax.autotuning.transfer`) and for `fit_heuristics`, and are replayed
there without measuring anything. The report is a markdown table of the three regrets of
`fit_heuristics` on held-out keys (leave-one-out), for BENCHMARKS.md.

CPU timings are noisy (samples include dispatch, and the machine may be shared): a slowdown
of a few percent between two configs is within that noise.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

import stellarax
from stellarax import autotuning
from stellarax.autotuning.cache import current_device_kind, device_kind_slug
from stellarax.core.bound_args import BoundArguments

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "sweeps"

# (M, G, K, N): rows, groups, contraction, output columns. The "lax" and "masked"
# strategies cost G * M * K * N on the CPU, so large G goes with small K * N.
RAGGED_DOT_SHAPES = (
    (64, 4, 256, 256), (64, 16, 128, 128), (128, 8, 256, 128), (256, 4, 128, 128),
    (256, 16, 128, 128), (256, 64, 128, 128), (512, 8, 256, 256), (1024, 4, 256, 256),
    (1024, 16, 256, 256), (1024, 64, 128, 128), (2048, 8, 128, 256), (2048, 32, 128, 128),
    (4096, 4, 256, 256), (4096, 16, 128, 128), (4096, 64, 64, 64),
)

# (B, T, S, N, H): batch, query length, key length, heads, head size. The space has
# one chunk_q per size below T and one chunk_k per size below S (up to 25 configs).
ATTENTION_SHAPES = (
    (1, 128, 128, 4, 64), (2, 128, 512, 4, 64), (1, 256, 256, 4, 64), (4, 256, 256, 2, 32),
    (1, 256, 1024, 2, 64), (1, 512, 128, 4, 64), (1, 512, 256, 4, 128), (1, 512, 512, 2, 64),
    (2, 512, 512, 2, 32), (1, 384, 768, 2, 64), (1, 1024, 256, 2, 64), (1, 1024, 512, 1, 64),
    (1, 128, 1024, 8, 64), (1, 768, 384, 2, 64),
)

# Short measurements: three interleaved rounds, two more among the leaders.
MEASURE = autotuning.MeasureOptions(rounds=3, leader_rounds=2, warmup_s=0.0, warmup_runs=1,
                                    max_total_s=0.3, min_batch_s=2e-3)


def _spec(shape: tuple[int, ...], dtype=jnp.float32) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype)


def ragged_dot_calls() -> list[BoundArguments]:
  """The ragged_dot.xla calls of the grid (float32)."""
  return [stellarax.XlaRaggedDot.bind(_spec((m, k)), _spec((g, k, n)), _spec((g,), jnp.int32))
          for m, g, k, n in RAGGED_DOT_SHAPES]


def attention_calls() -> list[BoundArguments]:
  """The attention.xla_chunked calls of the grid (float32, not causal)."""
  from stellarax.ops.attention.base import XlaChunkedAttention
  return [XlaChunkedAttention.bind(_spec((b, t, n, h)), _spec((b, s, n, h)), _spec((b, s, n, h)))
          for b, t, s, n, h in ATTENTION_SHAPES]


OPS: dict[str, Callable[[], list[BoundArguments]]] = {
    "ragged_dot.xla": ragged_dot_calls,
    "attention.xla_chunked": attention_calls,
}


def record(op_name: str, out_dir: Path) -> autotuning.AutotuningResult:
  """Sweeps every call of one op and writes `<out_dir>/<op_name>.json`.

  The file is rewritten after every call, so an interrupted run keeps what it measured.

  Args:
    op_name: a key of `OPS`.
    out_dir: the folder of the result files.

  Returns:
    The result holding one entry per call.
  """
  tuner = stellarax.Autotuner(strategy="exhaustive", progress=False, ignore_cache=True,
                              measure_options=MEASURE)
  result = autotuning.AutotuningResult(current_device_kind())
  path = out_dir / f"{op_name}.json"
  out_dir.mkdir(parents=True, exist_ok=True)
  for ba in OPS[op_name]():
    start = time.perf_counter()
    entry = tuner.tune_one(ba)
    result = result.with_entry(entry)
    result.dump(path)
    slowdown = entry.heuristic_time / min(m.median_s for _, m in entry.measurements if m.ok)
    print(f"{op_name} {ba}: {len(entry.measurements)} configs in {time.perf_counter() - start:.1f} s,"
          f" heuristic {slowdown:.2f}x the best", flush=True)
  return result


def report(out_dir: Path, op_names: Sequence[str]) -> str:
  """A markdown table of the three regrets of each op's recorded sweeps.

  Args:
    out_dir: the folder of the result files.
    op_names: the ops to report.

  Returns:
    Markdown text (a heading line, the table, the fitted rules).
  """
  shown = out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir
  lines = [
      f"Regret on held-out keys (leave-one-out) of the recorded CPU sweeps in "
      f"`{shown}` ({datetime.date.today()}, jax {jax.__version__}, "
      "`python bench/record_sweeps.py`): slowdown against the measured best config, "
      "geometric mean / worst.",
      "",
      "| op | keys | fixed heuristic | nearest-key transfer | fitted rule |",
      "|---|---|---|---|---|",
  ]
  rules = []
  for name in op_names:
    fit = autotuning.fit_heuristics(autotuning.AutotuningResult.load(out_dir / f"{name}.json"), name)
    cells = [f"failed at {r.failed} of {r.num_keys} keys" if r.failed
             else f"{r.geomean:.3f}x / {r.worst:.2f}x"
             for r in (fit.heuristic_regret, fit.transfer_regret, fit.rule_regret)]
    lines.append(f"| {name} | {fit.num_keys} | " + " | ".join(cells) + " |")
    rules.append(f"\n`{name}` rule fitted on all keys:\n\n```\n{fit.rule.text()}\n```")
  return "\n".join(lines + rules)


def main(argv: Sequence[str] | None = None) -> int:
  """Records the sweeps (unless --report-only) and prints the report."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ops", nargs="+", choices=sorted(OPS), default=list(OPS))
  parser.add_argument("--out", type=Path, default=None,
                      help="folder of the result files (default tests/data/sweeps/<device kind>)")
  parser.add_argument("--report-only", action="store_true", help="print the regrets, measure nothing")
  args = parser.parse_args(argv)
  out_dir = args.out or DATA / device_kind_slug(current_device_kind())
  if not args.report_only:
    start = time.perf_counter()
    for name in args.ops:
      record(name, out_dir)
    print(f"recorded in {time.perf_counter() - start:.0f} s\n", flush=True)
  print(report(out_dir, args.ops))
  return 0


if __name__ == "__main__":
  sys.exit(main())
