"""Where a measure call's seconds go, beside the timed runs themselves.

    cd /tmp && python3 <repo>/bench/measure_call_cost.py --out $OUT     (the TPU machine)
    python bench/measure_call_cost.py --smoke                            (CPU, interpret mode)

A search makes tens of `measure_candidates` calls on the same inputs, and what a call
costs beyond its candidates' compiles and timed rounds is paid by every one of them. On
a TPU v5e a call of one compiled 4096^3 bf16 matmul config at the lowest effort took
0.6 s (bench/tpu_search_live.py, 2026-12-07), which no search can make cheaper. This
times, for the Pallas TPU matmul of tpu_search_live.py (loaded as it does): one config
compiled, then calls of it at effort 1 and 0.012, of three other configs at 1, of it
again at 1 and of all four at 1, each three times; then it times the parts of one call
at the lowest effort (the measure module's steps, wrapped in timers: the measuring
thread's work too, which a profiler of the calling thread would not see). It writes call_cost.json under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing_probe import load_measure  # noqa: E402
from tpu_search_live import matmul, matmul_problem  # noqa: E402


_PARTS = ("_compile_all", "_InputGuard.__init__", "_InputGuard.intact", "_check_output",
          "_Expected.of", "_surely_close", "check_close", "input_digest", "_time_all",
          "_input_sets", "_warm_up",
          "_dispatch_floor_s", "_loop_host_bound", "_take_rounds", "_run_batch",
          "_to_measurement", "jax.device_get")


@contextlib.contextmanager
def timed_parts(measure, parts: dict):
  """Within it, each of `_PARTS` (measure's functions, and jax.device_get) adds its
  seconds and calls to parts[name], from whichever thread calls it."""
  import jax
  undo = []
  for name in _PARTS:
    owner, attr = (jax, "device_get") if name == "jax.device_get" else (
        (getattr(measure, name.split(".")[0]), name.split(".")[1]) if "." in name
        else (measure, name))
    original = getattr(owner, attr)  # (a class method comes bound: timed calls it so)
    raw = vars(owner)[attr] if isinstance(owner, type) else original

    def timed(*a, _original=original, _name=name, **k):
      start = time.perf_counter()
      try:
        return _original(*a, **k)
      finally:
        s, n = parts.get(_name, (0.0, 0))
        parts[_name] = (s + time.perf_counter() - start, n + 1)

    setattr(owner, attr, timed)
    undo.append((owner, attr, raw))
  try:
    yield
  finally:
    for owner, attr, original in undo:
      setattr(owner, attr, original)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="folder for call_cost.json")
  parser.add_argument("--smoke", action="store_true",
                      help="small float32 products in interpret mode (a CPU)")
  args = parser.parse_args(argv)
  import jax
  import jax.numpy as jnp
  measure = load_measure()
  if args.smoke:
    size, dtype, configs = 256, jnp.float32, [(128, 128, 128), (64, 128, 128),
                                              (128, 64, 128), (128, 128, 64)]
  else:
    size, dtype, configs = 4096, jnp.bfloat16, [(512, 512, 512), (1024, 1024, 512),
                                                (512, 1024, 1024), (256, 512, 512)]
  x, y, reference = matmul_problem(size, dtype)
  fns = {c: functools.partial(matmul, c, interpret=args.smoke) for c in configs}
  compiled: dict = {}
  options = measure.MeasureOptions()

  def call(keys, effort):
    start = time.perf_counter()
    got = measure.measure_candidates({c: fns[c] for c in keys}, (x, y), reference=reference,
                                     options=options, effort=effort, compile_cache=compiled)
    return time.perf_counter() - start, got

  rows = []
  for keys, effort in (([configs[0]], 1.0), ([configs[0]], 0.012), (configs[1:], 1.0),
                       ([configs[0]], 1.0), (configs, 1.0)):
    for _ in range(3):
      seconds, got = call(keys, effort)
      rows.append({"configs": len(keys), "effort": effort, "s": seconds,
                   "compile_s": sum(m.compile_time_s or 0.0 for m in got.values()),
                   "methods": sorted({m.method for m in got.values()})})
      print(json.dumps(rows[-1]), flush=True)
  parts = {}
  with timed_parts(measure, parts):
    whole, _ = call([configs[0]], 0.012)
  report = f"one call at effort 0.012: {whole:.4f} s; its parts (inclusive, s, calls):\n" + (
      "\n".join(f"  {name}: {s:.4f} ({n})" for name, (s, n) in
                sorted(parts.items(), key=lambda kv: -kv[1][0])))
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "call_cost.json").write_text(json.dumps(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows,
         "profile": report}, indent=1))
  print(report)
  print("configs | effort | s (three calls) | of which compiling")
  for i in range(0, len(rows), 3):
    group = rows[i:i + 3]
    print(f"{group[0]['configs']} | {group[0]['effort']} | "
          + ", ".join(f"{r['s']:.3f}" for r in group) + " | "
          + ", ".join(f"{r['compile_s']:.3f}" for r in group))
  return 0


if __name__ == "__main__":
  sys.exit(main())
