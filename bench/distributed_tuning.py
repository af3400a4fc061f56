"""Wall time of tuning the demo model's ops with 1, 2 and 4 JAX processes.

    python bench/distributed_tuning.py [--processes 1 2 4] [--rounds 5]

The op calls of the demo's training step (`stellarax.tools.demo`: `jax.value_and_grad`
of its `loss`) are found once and written as bound-argument JSON. Then, for each process
count N, N processes start on this machine (for N > 1 each calls
`jax.distributed.initialize` on localhost with its CPU device; N = 1 is the plain
single-process path) and run `Autotuner.autotune` on that JSON. Every share is measured
the same way whatever N is: the exhaustive strategy (every config of every call) and
pinned `MeasureOptions` (fixed rounds, no leader rounds, no budget cut), so only the
split changes between rows.

Per row: `tune` is the longest `autotune` call among the processes (from its start, after
JAX and jax.distributed are up, to the identical result in hand), `end to end` the time
from starting the processes to the last result, JAX start-up included. Every process's
result JSON is checked to be identical. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

import stellarax
from stellarax.autotuning.measure import MeasureOptions
from stellarax.tools import demo


def _pinned_options(rounds: int) -> MeasureOptions:
  """The same measurement for every share: `rounds` samples per config, nothing adaptive
  beyond the batch size (a sample lasts at least 1 ms)."""
  return MeasureOptions(rounds=rounds, leader_rounds=0, warmup_s=0.0, warmup_runs=2,
                        min_batch_s=1e-3, max_total_s=60.0)


def _demo_calls() -> list[stellarax.BoundArguments]:
  params = demo.init_params(jax.random.key(0), **demo.CONFIG)
  c = demo.CONFIG
  x = jax.random.normal(jax.random.key(1), (c["batch"], c["seq"], c["heads"] * c["head_dim"]))
  return stellarax.Autotuner(progress=False).collect(jax.value_and_grad(demo.loss), params, x)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run(num_processes: int, calls_file: Path, workdir: Path, rounds: int) -> dict:
  """Runs one row: starts the processes, waits for all, returns their timings."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "STELLARAX_CACHE_DIR": str(workdir / "cache")}
  env.pop("XLA_FLAGS", None)  # One CPU device per process.
  port = _free_port()
  start = time.monotonic()
  procs = []
  for i in range(num_processes):
    spec = {"process_id": i, "num_processes": num_processes, "port": port, "rounds": rounds,
            "calls": str(calls_file), "out": str(workdir / f"n{num_processes}-p{i}.json")}
    procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env))
  codes = [p.wait() for p in procs]
  end_to_end = time.monotonic() - start
  if any(codes):
    raise RuntimeError(f"{num_processes} processes: exit codes {codes}; see their output above.")
  outs = [json.loads((workdir / f"n{num_processes}-p{i}.json").read_text()) for i in range(num_processes)]
  if len({o["result"] for o in outs}) != 1:
    raise RuntimeError(f"{num_processes} processes ended with different results.")
  result = stellarax.AutotuningResult.loads(outs[0]["result"])
  return {"processes": num_processes, "calls": len(result),
          "configs": sum(len(e.measurements) for e in result),
          "tune_s": max(o["tune_s"] for o in outs), "end_to_end_s": end_to_end}


def _worker(spec: dict) -> None:
  if spec["num_processes"] > 1:
    jax.distributed.initialize(coordinator_address=f"localhost:{spec['port']}",
                               num_processes=spec["num_processes"], process_id=spec["process_id"])
  tuner = stellarax.Autotuner(strategy="exhaustive", progress=False, ignore_cache=True,
                              measure_options=_pinned_options(spec["rounds"]),
                              distributed_timeout_s=1800.0)
  start = time.monotonic()
  result = tuner.autotune(spec["calls"])
  tune_s = time.monotonic() - start
  Path(spec["out"]).write_text(json.dumps({"tune_s": tune_s, "result": result.dumps()}))


def _table(rows: list[dict], command: str) -> str:
  base = rows[0]["tune_s"]
  lines = [
      f"date: {datetime.date.today().isoformat()}; machine: {platform.machine()} CPU, "
      f"{os.cpu_count()} cores ({platform.node()}), shared with other jobs; "
      f"jax {jax.__version__}, stellarax {stellarax.__version__}",
      f"command: {command}",
      "",
      "| processes | calls | configs measured | tune (s) | end to end (s) | tune speed-up |",
      "|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['processes']} | {r['calls']} | {r['configs']} | {r['tune_s']:.1f} | "
                 f"{r['end_to_end_s']:.1f} | {base / r['tune_s']:.2f}x |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--rounds", type=int, default=5, help="samples per config (pinned)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    _worker(json.loads(args.worker))
    return 0
  with tempfile.TemporaryDirectory(prefix="stellarax-bench-") as tmp:
    workdir = Path(tmp)
    calls_file = workdir / "calls.json"
    calls_file.write_text(stellarax.autotuning.bound_args_to_json(_demo_calls()))
    rows = [_run(n, calls_file, workdir, args.rounds) for n in args.processes]
  print(_table(rows, "python bench/distributed_tuning.py " + " ".join(argv or sys.argv[1:])))
  return 0


if __name__ == "__main__":
  sys.exit(main())
