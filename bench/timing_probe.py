"""Where a batched median's extra time comes from, on whatever accelerator runs it.

    python bench/timing_probe.py [--out DIR] [--smoke] [--defaults-only] [--loops]
    (on the TPU machine: cd /tmp && python3 <repo>/bench/timing_probe.py --out $OUT, since
    the repository's .python-version selects a Python that the image's jax was not built for)

On the H200 (2026-12-04) the batched medians of calls of 0.25 ms or more were 1.2 to 2.4
times the profiler's device time, cuBLAS's too: a cost of about 0.35 to 0.8 ms a batch
(BENCHMARKS.md). This probe times plain matrix products of three sizes several ways on
the device it finds, beside the profiler's device time per call (the device planes'
events that name the program):

- n back-to-back calls and one sync, n = 1 to 16, per call (what a batch costs); the
  host's time to queue them and to wait; a do-nothing program the same way;
- n = 1 after the host idled 5 ms (clocks or power states that drop while the device
  waits for the host), and with every output kept alive (freeing memory);
- primed: n calls queued behind 1 (or 4) more and timed from the primer's end;
- differential: (T(2n) - T(n)) / n;
- `measure_candidates` with batches of at least 1 ms and of at least 20 ms, single and
  paired (`MeasureOptions.paired_batches`, what it does off the CPU since 2026-12-07);
- with --loops: products from about 10 us to 1 ms timed by `measure_candidates` with
  its defaults, never looped and always looped, each beside the profiler's time.

It needs only `stellarax.autotuning.measure` and `profile`, which it loads without the
package's `__init__`: that one refuses a jax older than the pin, and the TPU machine's
image has its own (0.10.2), under which these two modules run. It prints a table last
and writes probe.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import types

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "stellarax"


def load_measure():
  """stellarax.autotuning.measure, imported without the package's __init__."""
  import jax.experimental.xla_metadata as xm
  if not hasattr(xm, "xla_metadata_call2"):
    xm.xla_metadata_call2 = None  # used by op markers at call time, never by measure
  for name, sub in (("stellarax", ""), ("stellarax.autotuning", "autotuning"),
                    ("stellarax.core", "core")):
    if name not in sys.modules:
      module = types.ModuleType(name)
      module.__path__ = [str(SRC / sub) if sub else str(SRC)]
      sys.modules[name] = module
  from stellarax.autotuning import measure
  return measure


def operands(m: int, k: int, n: int, dtype, seed: int) -> tuple:
  """A (m, k) and a (k, n) matrix of normal random values in `dtype`, from `seed`."""
  import jax
  import jax.numpy as jnp
  ka, kb = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(ka, (m, k), jnp.float32).astype(dtype),
          jax.random.normal(kb, (k, n), jnp.float32).astype(dtype))


def summary(m) -> dict:
  """A Measurement as the probe's JSON records it: method, median and profiled ms, status."""
  return {"method": m.method, "median_ms": m.median_s * 1e3 if m.ok else None,
          "profiled_ms": None if m.profiled_s is None else m.profiled_s * 1e3,
          "status": m.status}


def _per_call_ms(fn, args, n, samples=7, idle_s=0.0, keep=False):
  import jax
  kept, times = [], []
  for _ in range(samples):
    if idle_s:
      time.sleep(idle_s)
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(n)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - start) / n)
    if keep:
      kept.append(outs)
  return statistics.median(times) * 1e3


def _split_ms(fn, args, n, samples=7):
  """(host ms to enqueue n calls, ms from then to the sync's return), medians."""
  import jax
  enqueue, wait = [], []
  for _ in range(samples):
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(n)]
    mid = time.perf_counter()
    jax.block_until_ready(outs)
    enqueue.append(mid - start)
    wait.append(time.perf_counter() - mid)
  return statistics.median(enqueue) * 1e3, statistics.median(wait) * 1e3


def _differential_ms(fn, args, n, samples=7):
  """Per call, as (T(2n) - T(n)) / n from two batches taken back to back: a cost per
  batch cancels whatever its cause, a cost per call does not."""
  import jax
  times = []
  for _ in range(samples):
    spans = []
    for calls in (n, 2 * n):
      start = time.perf_counter()
      jax.block_until_ready([fn(*args) for _ in range(calls)])
      spans.append(time.perf_counter() - start)
    times.append((spans[1] - spans[0]) / n)
  return statistics.median(times) * 1e3


def _device_ms(fn, args, calls=8) -> dict:
  """The profiler's view of `calls` back-to-back calls: per call, the summed length of
  the device planes' events of each line that names the program, and the planes and
  lines seen (to read a device whose layout is new)."""
  import collections
  import tempfile
  import jax
  from jax import profiler
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      jax.block_until_ready([fn(*args) for _ in range(calls)])
    lines, layout = collections.defaultdict(float), {}
    for path in pathlib.Path(folder).rglob("*.xplane.pb"):
      space = profiler.ProfileData.from_serialized_xspace(path.read_bytes())
      for plane in space.planes:
        if not plane.name.startswith("/device:"):
          continue
        for line in plane.lines:
          events = list(line.events)
          layout[f"{plane.name} | {line.name}"] = sorted({e.name for e in events})[:6]
          for e in events:
            if "timing_probe" in e.name:
              lines[f"{plane.name} | {line.name}"] += e.duration_ns / calls / 1e6
  return {"per_call_ms_by_line": dict(lines), "layout": layout}


def _primed_ms(fn, args, n, samples=7, primers=1):
  """Per call, by the interval between two completions with the queue kept full: one
  call (the primer), then n calls enqueued behind it before the primer is waited for;
  (end of the n) - (end of the primer), over n. Whatever a sync costs at the start of a
  batch (an idle device's launch) or at its end (noticing completion) cancels."""
  import jax
  times = []
  for _ in range(samples):
    primer = [fn(*args) for _ in range(primers)]
    outs = [fn(*args) for _ in range(n)]
    jax.block_until_ready(primer)
    t_primer = time.perf_counter()
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t_primer) / n)
  return statistics.median(times) * 1e3


def probe(smoke: bool) -> list[dict]:
  import jax
  import jax.numpy as jnp
  measure = load_measure()
  dtype = jnp.float32 if smoke else jnp.bfloat16
  shapes = [(64, 64, 64), (128, 128, 128), (256, 256, 256)] if smoke else [
      (2048, 4096, 4096), (4096, 4096, 4096), (8192, 8192, 8192)]
  rows = []
  for m, k, n in shapes:
    a, b = operands(m, k, n, dtype, seed=m + k + n)
    def timing_probe_matmul(a, b):
      return a @ b
    fn = jax.jit(timing_probe_matmul)
    jax.block_until_ready(fn(a, b))
    row = {"shape": f"{m}x{k}x{n}", "per_call_ms": {}}
    for calls in (1, 2, 4, 8, 16):
      row["per_call_ms"][calls] = _per_call_ms(fn, (a, b), calls)
    row["primed_ms"] = {calls: _primed_ms(fn, (a, b), calls) for calls in (1, 2, 4)}
    row["primed_4_ms"] = {calls: _primed_ms(fn, (a, b), calls, primers=4) for calls in (1, 4, 16)}
    row["differential_ms"] = {calls: _differential_ms(fn, (a, b), calls) for calls in (1, 4)}
    try:
      row["device"] = _device_ms(fn, (a, b))
    except Exception as e:  # noqa: BLE001 (information)
      row["device"] = {"error": f"{type(e).__name__}: {e}"}
    # (64 outputs of the largest product would not fit a 16 GiB device)
    row["split_ms"] = {calls: _split_ms(fn, (a, b), calls, samples=3)
                       for calls in ((1, 4, 64) if m * n <= 4096 * 4096 else (1, 4))}
    nothing = jax.jit(lambda a, b: a[:1, :1] + 1)
    jax.block_until_ready(nothing(a, b))
    row["nothing_ms"] = {calls: _per_call_ms(nothing, (a, b), calls) for calls in (1, 16)}
    row["nothing_split_ms"] = _split_ms(nothing, (a, b), 1)
    row["after_idle_ms"] = _per_call_ms(fn, (a, b), 1, idle_s=0.005)
    row["outputs_kept_ms"] = _per_call_ms(fn, (a, b), 1, keep=True)
    for key, min_batch_s in (("measure_1ms", 1e-3), ("measure_20ms", 2e-2)):
      for paired in (False, True):
        opts = measure.MeasureOptions(rounds=7, leader_rounds=0, max_total_s=3.0,
                                      min_batch_s=min_batch_s, loop_calls=0, profile=True,
                                      paired_batches=paired)
        got = measure.measure_candidates({"mm": lambda a, b: a @ b}, (a, b), options=opts)["mm"]
        name = key + ("_paired" if paired else "")
        row[name] = got.median_s * 1e3 if got.ok else f"{got.status}: {got.error}"
        if got.ok and got.profiled_s is not None:
          row["profiled_ms"] = got.profiled_s * 1e3
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def defaults_row(smoke: bool) -> dict:
  """`measure_candidates` with its default options (and a profile) over products of
  three sizes sliced from one pair of inputs: a small one that dispatch outruns (timed
  in a loop), two that keep the device busy; each beside the profiler's time."""
  import jax.numpy as jnp
  measure = load_measure()
  size, dtype = (256, jnp.float32) if smoke else (4096, jnp.bfloat16)
  a, b = operands(size, size, size, dtype, seed=9)
  cuts = {"small": size // 8, "half": size // 2, "whole": size}
  candidates = {name: (lambda a, b, c=c: a[:c] @ b[:, :c]) for name, c in cuts.items()}
  got = measure.measure_candidates(candidates, (a, b),
                                   options=measure.MeasureOptions(profile=True))
  return {name: summary(m) for name, m in got.items()}


def loops_rows(smoke: bool) -> list[dict]:
  """Whether a loop times a call as batches do: products of sizes from about 10 us to
  1 ms, all in one `measure_candidates` call three ways: its defaults, never looped
  (loop_calls=0), always looped (every call under 1 ms, in loops of loop_calls:
  host_bound_factor 1e6); each
  with the profiler's time per call beside."""
  import jax.numpy as jnp
  measure = load_measure()
  # Smoke: products far under 1 ms on a loaded CPU, so that "always looped" loops them all.
  size, dtype = (128, jnp.float32) if smoke else (4096, jnp.bfloat16)
  a, b = operands(size, size, size, dtype, seed=11)
  cuts = [size * k // 16 for k in (2, 4, 6, 8, 11, 14, 16)]
  candidates = {c: (lambda a, b, c=c: a[:c] @ b[:, :c]) for c in cuts}
  modes = {"defaults": {}, "never looped": {"loop_calls": 0},
           "always looped": {"host_bound_factor": 1e6}}
  rows = {c: {"product": f"{c}x{size}x{c}"} for c in cuts}
  for mode, extra in modes.items():
    got = measure.measure_candidates(
        candidates, (a, b), options=measure.MeasureOptions(profile=True, **extra))
    for c, m in got.items():
      rows[c][mode] = summary(m)
  return list(rows.values())


def loops_table(rows: list[dict]) -> str:
  fmt = lambda x: f"{x:.4f}" if isinstance(x, float) else str(x)
  modes = ("defaults", "never looped", "always looped")
  lines = ["product | " + " | ".join(f"{m} ms (method) / profiled" for m in modes)]
  for r in rows:
    lines.append(r["product"] + " | " + " | ".join(
        f"{fmt(r[m]['median_ms'])} ({r[m]['method'].split('-')[-1]}) / {fmt(r[m]['profiled_ms'])}"
        for m in modes))
  return "\n".join(lines)


def table(rows: list[dict]) -> str:
  fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)
  head = ["shape", "n=1", "n=2", "n=4", "n=16", "primed 1", "primed 2", "primed 4", "idle 5ms",
          "kept", "measure 1ms", "measure 20ms", "paired 1ms", "paired 20ms", "profiled"]
  lines = [" | ".join(head)]
  for r in rows:
    p, q = r["per_call_ms"], r["primed_ms"]
    lines.append(" | ".join([r["shape"], *(fmt(p[c]) for c in (1, 2, 4, 16)),
                             *(fmt(q[c]) for c in (1, 2, 4)),
                             fmt(r["after_idle_ms"]), fmt(r["outputs_kept_ms"]),
                             fmt(r.get("measure_1ms")), fmt(r.get("measure_20ms")),
                             fmt(r.get("measure_1ms_paired")), fmt(r.get("measure_20ms_paired")),
                             fmt(r.get("profiled_ms"))]))
  lines.append("\nprimed by 4 calls (n=1, 4, 16); differential (n=1, 4); the profiler's lines")
  for r in rows:
    q, d = r["primed_4_ms"], r["differential_ms"]
    device = r["device"].get("per_call_ms_by_line") or r["device"]
    lines.append(f"{r['shape']}: " + ", ".join(fmt(q[c]) for c in q) + "; "
                 + ", ".join(fmt(d[c]) for c in d) + f"; {device}")
  lines.append("\nenqueue / wait ms (n=1, n=4, n=64); a do-nothing program: n=1, n=16 per call, and "
               "its enqueue / wait")
  for r in rows:
    s, z = r["split_ms"], r["nothing_ms"]
    lines.append(f"{r['shape']}: " + ", ".join(f"n={c}: {fmt(s[c][0])} / {fmt(s[c][1])}" for c in s)
                 + f"; nothing {fmt(z[1])}, {fmt(z[16])}; "
                 + " / ".join(map(fmt, r["nothing_split_ms"])))
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="folder for probe.json")
  parser.add_argument("--smoke", action="store_true", help="tiny float32 products (a CPU)")
  parser.add_argument("--defaults-only", action="store_true",
                      help="only measure_candidates with its default options")
  parser.add_argument("--loops", action="store_true",
                      help="also time products looped, in batches and with the defaults")
  args = parser.parse_args(argv)
  import jax
  device = jax.devices()[0]
  print(f"device {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
  rows = [] if args.defaults_only else probe(args.smoke)
  defaults = defaults_row(args.smoke)
  loops = loops_rows(args.smoke) if args.loops else []
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(
        {"device": device.device_kind, "jax": jax.__version__, "rows": rows,
         "defaults": defaults, "loops": loops}, indent=1))
  if loops:
    print("\nlooped or not (measure_candidates, one call each way)")
    print(loops_table(loops))
  if rows:
    print("\nms per call (medians)")
    print(table(rows))
  print("\nmeasure_candidates with its defaults (a[:c] @ b[:, :c]):")
  for name, d in defaults.items():
    print(f"  {name}: {d['method']} {d['median_ms']} ms, profiled {d['profiled_ms']} ms"
          + ("" if d["status"] == "ok" else f" ({d['status']})"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
