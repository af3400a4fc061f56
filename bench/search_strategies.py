"""How close the budgeted search strategies land to the best config, on replayed sweeps.

    python bench/search_strategies.py [--seeds 40] [--against OLD_SEARCH_PY] [--whole-rounds]

No device: each sweep is a synthetic landscape over a 192-config tile space (block_m,
block_n, block_k, warps, stages) with a known optimum, replayed by
`search.ReplayMeasure` with 1% measurement noise on a fake clock. A landscape is a
random coupled quadratic bowl in the log2 tile sizes plus effects of warps and stages,
a per-config roughness (lognormal, standard deviation `rough`: 0 is smooth, 0.1 leaves
little structure) and 10% of configs that fail to compile. Measuring the whole space at
full effort costs 192 fake seconds, of which `compile` is paid once per config (as
compiling is on a GPU) and the rest per full-effort measurement. `--whole-rounds` charges
each measurement its whole samples, at least one of 10 (as measure_candidates takes them;
`ReplayMeasure(whole_rounds=True)`), so efforts below a tenth cost a tenth.

For each (roughness, compile share, budget as a fraction of that exhaustive cost) it
prints, per strategy, on how many seeds the chosen config is within 2% of the optimum,
the geometric mean of chosen / optimum, the worst, and the most of the budget any seed's
search spent (above 1: it overran). `--against` adds the strategies
of another search.py (e.g. `git show REV:src/stellarax/autotuning/search.py >
/tmp/old.py`), to compare a change with what it replaces.

    python bench/search_strategies.py --kernel-tuner-cache FILE [--seeds 40] [--against ...]

instead replays a real sweep: a cache file that kernel_tuner wrote while it measured a
whole search space on a GPU (JSON: "tune_params_keys", and "cache", one record per config
with "time" in milliseconds, or a failure's name such as "CompilationFailedConfig", and
"compile_time" and "benchmark_time"). Its times are replayed with 1% noise; compiling
costs its share of the records' compile and benchmark time. Each seed starts from
another heuristic config, a random one of the space's 25% fastest, as an op's heuristic
would usually be good and seldom the best. Such a file is not part of stellarax: e.g.
kernel_tuner's repository kept `SampleCacheFiles/convolution_MI50.json` (a 2D convolution
on an AMD MI50, 2,442 configs) at commit 30eb17329f09, and the AutoTuningAssociation's
benchmark_hub repository keeps whole sweeps gzipped under `cachefiles/` (a GEMM's 17,956
configs on four NVIDIA GPUs under `currently_unused/cachefiles/KernelTuner data/gemm/`,
convolutions and dedispersion on NVIDIA and AMD GPUs; BENCHMARKS.md names the commit).

    python bench/search_strategies.py --live [--against OLD_SEARCH_PY]

instead tunes one real op call on this machine (XLA chunked attention, 16 configs) with
racing under budgets of 3 and 8 s, and prints per budget how many configs each racing
measured and how long its search took: whether the budget is spent, and not overrun.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

from stellarax.autotuning import search
from stellarax.autotuning.measure import Measurement

_FIELDS = ("block_m", "block_n", "block_k", "warps", "stages")
_GRID = list(itertools.product((32, 64, 128, 256), (32, 64, 128, 256), (32, 64, 128), (4, 8), (2, 3)))


def _tile_class():
  import dataclasses
  return dataclasses.make_dataclass("Tile", [(f, int) for f in _FIELDS], frozen=True, kw_only=True)


Tile = _tile_class()
HEURISTIC = Tile(block_m=64, block_n=64, block_k=32, warps=4, stages=2)


def landscape(seed: int, rough: float) -> dict:
  """config -> seconds (or a compile_error Measurement); see the module docstring."""
  rng = np.random.default_rng(seed)
  center = rng.uniform([-1, -1, -1], [1.5, 1.5, 1.0])
  a = rng.normal(size=(3, 3))
  coupling = a @ a.T / 3 * 0.08
  w_warps, w_stages, w_cross = rng.normal(0, 0.04), rng.normal(0, 0.03), rng.normal(0, 0.03)
  sweep = {}
  for bm, bn, bk, warps, stages in _GRID:
    tile = Tile(block_m=bm, block_n=bn, block_k=bk, warps=warps, stages=stages)
    x = np.log2([bm / 64, bn / 64, bk / 32]) - center
    value = (x @ coupling @ x + w_warps * (warps == 8) + w_stages * (stages == 3)
             + w_cross * (warps == 8) * x[0] + rough * rng.standard_normal())
    failed = rng.random() < 0.1 and tile != HEURISTIC
    sweep[tile] = (Measurement(status="compile_error", error="out of shared memory") if failed
                   else 1e-3 * math.exp(value))
  return sweep


def _strategies(module: ModuleType, tag: str) -> dict:
  return {
      f"racing{tag}": lambda space, m, h, b, seed, clock: module.racing(
          space, m, heuristic=h, budget_s=b, rng_seed=seed, clock=clock),
      f"random{tag}": lambda space, m, h, b, seed, clock: module.random_search(
          space, m, heuristic=h, budget_s=b, rng_seed=seed, clock=clock),
  }


def _load(path: str) -> ModuleType:
  spec = importlib.util.spec_from_file_location("search_against", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["search_against"] = module  # dataclasses look their module up while it loads
  spec.loader.exec_module(module)
  return module


def _compared(against: str | None) -> dict:
  """This search.py's strategies, and `against`'s under names of their own."""
  strategies = _strategies(search, "")
  if against:
    strategies |= _strategies(_load(against), f" ({Path(against).name})")
  return strategies


_CELL = "within 2%, geo mean, worst, most budget spent"


def _cell(strategy, seeds: int, case) -> str:
  """One strategy's cell over `seeds` replays: `case(seed)` gives (sweep, heuristic,
  replay, budget); how many seeds chose a config within 2% of the sweep's best, the
  geometric mean and worst of chosen / best, and the most of the budget a seed spent."""
  ratios, spent = [], []
  for seed in range(seeds):
    sweep, heuristic, replay, budget = case(seed)
    best = min(v for v in sweep.values() if isinstance(v, float))
    outcome = strategy(sweep, replay, heuristic, budget, seed, replay.clock)
    ratios.append(sweep[outcome.best] / best)
    spent.append(replay.clock() / budget)
  within = sum(r <= 1.02 for r in ratios)
  return (f"{within}/{seeds}, {math.exp(np.mean(np.log(ratios))):.3f}, {max(ratios):.3f},"
          f" {max(spent):.2f}")


def run(seeds: int, against: str | None, whole_rounds: bool = False) -> list[str]:
  """The report's lines."""
  strategies = _compared(against)
  lines = []
  for rough, compile_share, fraction in itertools.product((0.0, 0.03, 0.1), (0.0, 0.5, 0.9),
                                                          (0.05, 0.1, 0.2)):
    def case(seed, rough=rough, compile_share=compile_share, fraction=fraction):
      sweep = landscape(seed, rough)
      replay = search.ReplayMeasure(sweep, noise=0.01, seed=seed, compile_cost_s=compile_share,
                                    cost_s_per_config=1 - compile_share, whole_rounds=whole_rounds)
      return sweep, HEURISTIC, replay, fraction * len(sweep)

    parts = [_cell(strategy, seeds, case) for strategy in strategies.values()]
    lines.append(f"| {rough} | {compile_share} | {fraction} | " + " | ".join(parts) + " |")
  header = "| roughness | compile share | budget | " + " | ".join(
      f"{n}: {_CELL}" for n in strategies) + " |"
  return [header, "|" + "---|" * (3 + len(strategies))] + lines


def kernel_tuner_sweep(path: str) -> tuple[dict, float]:
  """A kernel_tuner cache file (see the module docstring) as a sweep, config -> seconds or
  a failed Measurement, and the share of compiling in its records' measuring time.

  Raises:
    ValueError: when the file has no "tune_params_keys" or "cache", or no config ran.
  """
  import dataclasses
  import json

  data = json.loads(Path(path).read_text())
  if not isinstance(data, dict) or "tune_params_keys" not in data or "cache" not in data:
    raise ValueError(f"{path}: not a kernel_tuner cache file (it needs 'tune_params_keys' and"
                     " 'cache'); pass one that kernel_tuner wrote with cache=FILE.")
  keys = list(data["tune_params_keys"])
  config = dataclasses.make_dataclass("KernelTunerConfig", keys, frozen=True, kw_only=True)
  sweep, compile_s, bench_s = {}, 0.0, 0.0
  for record in data["cache"].values():
    c = config(**{k: record[k] for k in keys})
    time_ms = record.get("time")
    if isinstance(time_ms, (int, float)) and time_ms > 0:
      sweep[c] = time_ms * 1e-3
      compile_s += record.get("compile_time", 0.0)
      bench_s += record.get("benchmark_time", 0.0)
    else:
      sweep[c] = Measurement(status="compile_error", error=str(time_ms))
  if not any(isinstance(v, float) for v in sweep.values()):
    raise ValueError(f"{path}: no config of its cache ran; nothing to replay.")
  return sweep, compile_s / (compile_s + bench_s) if compile_s + bench_s else 0.5


def run_real(path: str, seeds: int, against: str | None) -> list[str]:
  """The report's lines for `--kernel-tuner-cache` (see the module docstring)."""
  sweep, compile_share = kernel_tuner_sweep(path)
  strategies = _compared(against)
  ran = sorted((t, i) for i, t in enumerate(sweep.values()) if isinstance(t, float))
  configs = list(sweep)
  good = [configs[i] for _, i in ran[:max(1, len(ran) // 4)]]
  lines = [f"{Path(path).name}: {len(sweep)} configs, {len(ran)} ran, best {ran[0][0] * 1e3:.3f} ms,"
           f" compiling {compile_share:.0%} of the measuring time", "",
           "| budget | " + " | ".join(f"{n}: {_CELL}" for n in strategies) + " |",
           "|" + "---|" * (1 + len(strategies))]
  for fraction in (0.02, 0.05, 0.1, 0.2):
    def case(seed, fraction=fraction):
      heuristic = good[np.random.default_rng(seed).integers(len(good))]
      replay = search.ReplayMeasure(sweep, noise=0.01, seed=seed, compile_cost_s=compile_share,
                                    cost_s_per_config=1 - compile_share, whole_rounds=True)
      return sweep, heuristic, replay, fraction * len(sweep)

    parts = [_cell(strategy, seeds, case) for strategy in strategies.values()]
    lines.append(f"| {fraction} | " + " | ".join(parts) + " |")
  return lines


def live(against: str | None, budgets=(3.0, 8.0), repeats: int = 2) -> list[str]:
  """The report's lines for `--live` (see the module docstring)."""
  import time

  import jax

  import stellarax
  modules = {"racing": search} | ({f"racing ({Path(against).name})": _load(against)}
                                   if against else {})
  q = jax.random.normal(jax.random.key(0), (2, 512, 4, 64))
  call = stellarax.XlaChunkedAttention.bind(q, q, q, is_causal=True)
  lines = ["| budget (s) | strategy | configs measured | search time (s) |", "|---|---|---|---|"]
  for budget in budgets:
    for name, module in modules.items():
      for _ in range(repeats):
        spent = []

        def timed(space, measure, *, heuristic, budget_s, module=module, spent=spent):
          start = time.perf_counter()
          outcome = module.racing(space, measure, heuristic=heuristic, budget_s=budget_s)
          spent.append(time.perf_counter() - start)
          return outcome

        tuner = stellarax.Autotuner(strategy=timed, budget_s=budget, progress=False)
        entry = tuner.tune_one(call)
        lines.append(f"| {budget:g} | {name} | {len(entry.measurements)} of "
                     f"{len(call.autotuning_configs)} | {spent[0]:.2f} |")
  return lines


def main(argv=None) -> int:
  """Prints the comparison table (markdown) and returns 0."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=40)
  parser.add_argument("--against", help="another search.py whose strategies to compare")
  parser.add_argument("--whole-rounds", action="store_true",
                      help="charge whole samples, at least one round (as real measurements)")
  parser.add_argument("--live", action="store_true",
                      help="tune a real op call on this machine instead (budget use)")
  parser.add_argument("--kernel-tuner-cache", metavar="FILE",
                      help="replay this real sweep (a kernel_tuner cache file) instead")
  args = parser.parse_args(argv)
  if args.live:
    lines = live(args.against)
  elif args.kernel_tuner_cache:
    lines = run_real(args.kernel_tuner_cache, args.seeds, args.against)
  else:
    lines = run(args.seeds, args.against, args.whole_rounds)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
