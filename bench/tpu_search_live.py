"""The autotuner's measuring and search on a real accelerator: a Pallas TPU matmul's tiles.

    cd /tmp && python3 <repo>/bench/tpu_search_live.py --out $OUT     (the TPU machine)
    python bench/tpu_search_live.py --smoke                            (CPU, interpret mode)

(from /tmp on the TPU machine: the repository's .python-version selects a Python that
its image's jax was not built for). No GPU has been lent so far, and stellarax itself
does not import on the TPU machine (its image has jax 0.10.2, stellarax pins 0.11.2),
so this loads `measure` and `search` alone, as bench/timing_probe.py does, and tunes a
kernel of its own: a bf16 matmul in Pallas TPU with a (block_m, block_n, block_k)
config, 80 configs, some too large for the core's memory (they fail to compile, as
real spaces' configs do).

1. The whole space at full effort (`measure_candidates`, every config checked against
   XLA's product first): what each config takes, and what the sweep cost.
2. `search.racing` (and, with --strategies, others: `random_search` draws configs at
   random, the baseline a search must beat) from the heuristic (512, 512, 512) with
   budgets of 10% and 25% of that sweep's time, three seeds each (--seeds), each with a
   measure as the autotuner makes one
   (a compile cache of its own, `effective_effort`): the time it spent against its
   budget, how many configs it measured, how far its choice is from the sweep's best
   (by the sweep's times), and its measure calls.

It prints a table last and writes search.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing_probe import load_measure, operands  # noqa: E402


def matmul(config, x, y, interpret=False):
  """x @ y in Pallas TPU with blocks `config` = (block_m, block_n, block_k), f32 acc."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  bm, bn, bk = config
  (m, k), (_, n) = x.shape, y.shape

  def kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)

  params = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=(m // bm, n // bn, k // bk),
          in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                    pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
          out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
          scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
      compiler_params=params(dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret)(x, y)


def matmul_problem(size: int, dtype) -> tuple:
  """(x, y, reference): random size x size operands (seed 0) and their product,
  accumulated in float32 and cast to `dtype`, which every config is checked against."""
  import jax.numpy as jnp
  x, y = operands(size, size, size, dtype, seed=0)
  return x, y, jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype)


_STRATEGIES = ("racing", "random_search")  # the budgeted strategies of search.py


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="folder for search.json")
  parser.add_argument("--smoke", action="store_true",
                      help="small float32 products in interpret mode (a CPU)")
  parser.add_argument("--seeds", type=int, default=3,
                      help="searches per budget, seeds 0 to this less one (default 3)")
  parser.add_argument("--strategies", default="racing",
                      help="comma-separated names in stellarax.autotuning.search (racing, "
                      "random_search); each searches with every budget and seed")
  args = parser.parse_args(argv)
  import jax
  import jax.numpy as jnp
  measure = load_measure()
  from stellarax.autotuning import search

  names = args.strategies.split(",")
  unknown = [name for name in names if name not in _STRATEGIES]
  if unknown:
    parser.error(f"--strategies {','.join(unknown)}: expected some of {', '.join(_STRATEGIES)}")
  strategies = {name: getattr(search, name) for name in names}
  if args.smoke:
    size, dtype, sizes, ks = 256, jnp.float32, (64, 128), (64, 128, 256)
    heuristic, fractions, seeds = (128, 128, 128), (0.25,), (0,)
  else:
    size, dtype, sizes, ks = 4096, jnp.bfloat16, (128, 256, 512, 1024), (128, 256, 512, 1024, 2048)
    heuristic, fractions, seeds = (512, 512, 512), (0.1, 0.25), tuple(range(args.seeds))
  space = list(itertools.product(sizes, sizes, ks))
  x, y, reference = matmul_problem(size, dtype)
  device = jax.devices()[0]
  print(f"device {device.device_kind} ({device.platform}), jax {jax.__version__}; "
        f"{len(space)} configs of a {size}^3 {jnp.dtype(dtype).name} matmul", flush=True)

  fns = {c: functools.partial(matmul, c, interpret=args.smoke) for c in space}
  options = measure.MeasureOptions()

  def measure_for_one_search(log):
    """A measure as the autotuner makes one: each config compiled once across its calls
    (a compile cache of its own), and what an effort buys (`effective_effort`)."""
    compiled = {}

    def measure_fn(configs, *, effort=1.0):
      fresh = [c for c in configs if c not in compiled]
      new = len(fresh)
      start = time.perf_counter()
      got = measure.measure_candidates({c: fns[c] for c in configs}, (x, y),
                                       reference=reference, options=options, effort=effort,
                                       compile_cache=compiled)
      log.append([len(configs), new, effort, time.perf_counter() - start,
                  sum(got[c].compile_time_s or 0.0 for c in fresh),
                  {str(c): [m.median_s, m.method] if m.ok else m.status
                   for c, m in got.items()}])
      return got

    measure_fn.effective_effort = options.effective_effort
    return measure_fn

  start = time.perf_counter()
  sweep = measure_for_one_search([])(space)
  sweep_s = time.perf_counter() - start
  times = {c: m.median_s for c, m in sweep.items() if m.ok}
  best = min(times, key=times.get)
  failed = {str(c): m.status for c, m in sweep.items() if not m.ok}
  print(f"sweep: {len(times)} ok, {len(failed)} failed, {sweep_s:.1f} s; best {best} "
        f"{times[best] * 1e3:.4f} ms; heuristic {heuristic} {times[heuristic] * 1e3:.4f} ms",
        flush=True)
  runs = []
  for (name, strategy), fraction, seed in itertools.product(strategies.items(), fractions,
                                                          seeds):
    budget = fraction * sweep_s
    calls = []
    start = time.perf_counter()
    outcome = strategy(space, measure_for_one_search(calls), heuristic=heuristic,
                       budget_s=budget, rng_seed=seed)
    spent = time.perf_counter() - start
    runs.append({"strategy": name, "fraction": fraction, "seed": seed, "budget_s": budget,
                 "spent_s": spent,
                 "measured": outcome.num_measured, "chosen": list(outcome.best),
                 "chosen_over_best": times[outcome.best] / times[best],
                 # what the search saw: [median ms, samples] of the chosen and heuristic
                 "seen": {which: [outcome.measurements[c].median_s * 1e3,
                                  outcome.measurements[c].num_samples]
                          for which, c in (("chosen", outcome.best), ("heuristic", heuristic))
                          if c in outcome.measurements and outcome.measurements[c].ok},
                 # [configs, new ones, effort, seconds, compiling s, what each
                 # config measured: [median s, method] or its failure] each
                 "calls": calls})
    print(json.dumps({k: v for k, v in runs[-1].items() if k != "calls"}), flush=True)
    print("  calls (configs, new, effort, s, compiling s):",
          "; ".join(f"{n} {k} {e:.3f} {t:.2f} {c:.2f}" for n, k, e, t, c, _ in calls),
          flush=True)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "search.json").write_text(json.dumps({
        "device": device.device_kind, "jax": jax.__version__, "size": size,
        "sweep_s": sweep_s, "times_ms": {str(c): t * 1e3 for c, t in times.items()},
        # each config's own compile (compiled 13 at a time on the TPU machine's host):
        # what a replay with the real costs of new configs needs
        "compile_s": {str(c): m.compile_time_s for c, m in sweep.items()},
        "failed": failed, "best": list(best), "heuristic": list(heuristic), "runs": runs},
        indent=1))
  print("\nstrategy | budget | seed | spent s / budget s | configs measured | chosen | chosen / best")
  for r in runs:
    print(f"{r['strategy']} | {r['fraction']:.0%} | {r['seed']} | {r['spent_s']:.1f} / {r['budget_s']:.1f} | "
          f"{r['measured']} of {len(space)} | {tuple(r['chosen'])} | {r['chosen_over_best']:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
