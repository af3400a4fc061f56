"""Tests of the search strategies on replayed sweeps (fake clock: deterministic, no device)."""

import collections
import dataclasses
import itertools
import math

import numpy as np
import pytest

from stellarax.autotuning import search
from stellarax.autotuning.measure import AllCandidatesFailedError, Measurement


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tile:
  block_m: int
  block_n: int
  block_k: int
  warps: int
  stages: int


OPTIMUM = Tile(block_m=128, block_n=256, block_k=64, warps=8, stages=3)
HEURISTIC = Tile(block_m=64, block_n=64, block_k=32, warps=4, stages=2)


def _sweep() -> dict[Tile, float | Measurement]:
  """192 configs: a smooth bowl in log2 tile sizes around OPTIMUM, plus failed configs."""
  sweep = {}
  for bm, bn, bk, warps, stages in itertools.product(
      (32, 64, 128, 256), (32, 64, 128, 256), (32, 64, 128), (4, 8), (2, 3)):
    tile = Tile(block_m=bm, block_n=bn, block_k=bk, warps=warps, stages=stages)
    if bm == bn == 256 and bk == 128:
      sweep[tile] = Measurement(status="compile_error", error="out of shared memory")
    elif bm == 32 and warps == 8:
      sweep[tile] = Measurement(status="wrong_result", error="max abs error 7.1")
    else:
      dm, dn, dk = math.log2(bm / 128), math.log2(bn / 256), math.log2(bk / 64)
      sweep[tile] = 1e-3 * (1 + 0.08 * dm**2 + 0.06 * dn**2 + 0.05 * dk**2
                            + 0.02 * dm * dk + 0.04 * (warps == 4) + 0.015 * (stages == 2))
  return sweep


SWEEP = _sweep()
TRUE = {c: v for c, v in SWEEP.items() if isinstance(v, float)}
EXHAUSTIVE_COST = len(SWEEP) * 1.0  # ReplayMeasure's default: 1 fake second per config.


def test_the_synthetic_sweep_is_what_the_tests_assume():
  assert len(SWEEP) == 192 and len(TRUE) == 164
  assert min(TRUE, key=TRUE.get) == OPTIMUM
  assert TRUE[HEURISTIC] > 1.3 * TRUE[OPTIMUM]
  near = [c for c in TRUE if TRUE[c] <= 1.02 * TRUE[OPTIMUM]]
  assert len(near) == 2  # The optimum and its stages=2 twin: racing must be accurate.


def test_exhaustive_finds_the_optimum():
  replay = search.ReplayMeasure(SWEEP)
  outcome = search.exhaustive(SWEEP, replay, heuristic=HEURISTIC, clock=replay.clock)
  assert outcome.best == OPTIMUM and outcome.best_measurement.ok
  assert outcome.strategy == "exhaustive"
  assert outcome.num_measured == outcome.num_configs == len(SWEEP)
  assert outcome.wall_time_s == EXHAUSTIVE_COST and replay.num_calls == 1
  assert outcome.measurements[Tile(block_m=32, block_n=32, block_k=32, warps=8, stages=2)
                              ].status == "wrong_result"


def test_exhaustive_with_noise_lands_near_the_optimum_and_chunks_within_budget():
  replay = search.ReplayMeasure(SWEEP, noise=0.01, seed=3)
  outcome = search.exhaustive(SWEEP, replay, chunk_size=50, clock=replay.clock)
  assert TRUE[outcome.best] <= 1.02 * TRUE[OPTIMUM] and replay.num_calls == 4
  replay = search.ReplayMeasure(SWEEP)
  calls = []
  measure = lambda configs, effort: calls.append(list(configs)) or replay(configs, effort=effort)
  partial = search.exhaustive(SWEEP, measure, heuristic=HEURISTIC, budget_s=40.0,
                              clock=replay.clock)
  # 40 s measure 40 configs, or 38 and the fastest again beside the heuristic (the
  # heuristic was measured alone, first); a planned config is charged both its timing
  # and, at the rate failures happened (42% here), a failure's cost, so the last one may
  # not fit.
  assert replay.clock() <= 40.0 and partial.num_measured in (37, 38)
  assert calls[0] == [HEURISTIC] and calls[-1] == [partial.best, HEURISTIC]


@pytest.mark.parametrize("seed", range(5))
def test_racing_in_a_tenth_of_the_time_lands_within_2_percent(seed):
  replay = search.ReplayMeasure(SWEEP, noise=0.01, seed=seed)
  budget = 0.1 * EXHAUSTIVE_COST
  outcome = search.racing(SWEEP, replay, heuristic=HEURISTIC, budget_s=budget,
                          rng_seed=seed, clock=replay.clock)
  assert replay.clock() <= budget and outcome.wall_time_s == replay.clock()
  assert outcome.strategy == "racing"
  assert outcome.best_measurement.ok
  assert TRUE[outcome.best] <= 1.02 * TRUE[OPTIMUM]
  assert TRUE[outcome.best] < TRUE[HEURISTIC]
  # The budget was spent on screening most of the space, not on a few configs.
  assert outcome.num_measured > 0.8 * len(SWEEP)


@pytest.mark.parametrize("compile_share", [0.5, 0.9])
@pytest.mark.parametrize("seed", range(5))
def test_racing_in_a_tenth_of_the_time_lands_within_2_percent_when_compiling_dominates(
    compile_share, seed):
  # Most of a config's cost is paid once (compilation), as on a GPU, so not even a cheap
  # screening of the whole space fits: racing walks from the heuristic instead.
  replay = search.ReplayMeasure(SWEEP, noise=0.01, seed=seed, compile_cost_s=compile_share,
                                cost_s_per_config=1 - compile_share)
  budget = 0.1 * EXHAUSTIVE_COST
  outcome = search.racing(SWEEP, replay, heuristic=HEURISTIC, budget_s=budget, rng_seed=seed,
                          clock=replay.clock)
  assert replay.clock() <= budget
  assert outcome.num_measured < 0.2 * len(SWEEP)  # compiling more would not have fit
  assert outcome.best_measurement.ok and TRUE[outcome.best] <= 1.02 * TRUE[OPTIMUM]
  # The winner was measured again beside the heuristic, at effort 1/3 at least (of the
  # replay's 10 samples), more thoroughly than the screening's single sample.
  assert outcome.best_measurement.num_samples >= 4


def test_the_walk_steps_through_neighbours_and_moves_several_fields_at_once():
  replay = search.ReplayMeasure(SWEEP, compile_cost_s=0.9, cost_s_per_config=0.1)
  calls = []
  def recording(configs, *, effort=1.0):
    calls.append(list(configs))
    return replay(configs, effort=effort)
  outcome = search.racing(SWEEP, recording, heuristic=HEURISTIC, budget_s=30.0, clock=replay.clock)
  assert outcome.best == OPTIMUM and outcome.num_measured < 40
  geometry = search._Geometry(list(SWEEP))
  # The configs one step from `config`, in one tunable (e.g. block_m 64 -> 32 or 128).
  one_step = lambda config: {c for c in SWEEP if geometry.distance(config, c) == 1}
  # After the heuristic's two calibration measurements, each call of the walk measures
  # the incumbent last. The first compiles one config only (a neighbour; it is faster),
  # so the cost model learns what compiling costs before it plans a batch.
  (first, incumbent), walk = calls[2], calls[2:-1]
  assert incumbent == HEURISTIC and first in one_step(HEURISTIC)
  # Then every config one step from the new incumbent, in one tunable.
  assert calls[3][-1] == first and set(calls[3][:-1]) == one_step(first) - {HEURISTIC}
  # Then the pattern move: every improving change at once (here the optimum), beside the
  # best single change.
  assert calls[4][0] == OPTIMUM and len(calls[4]) == 2
  assert all(len(c) >= 2 for c in walk)
  # The last round: the walk's three fastest with the heuristic at full effort.
  assert calls[-1][-1] == HEURISTIC and OPTIMUM in calls[-1] and len(calls[-1]) == 4


def test_from_a_local_optimum_the_walk_hops_to_a_lone_faster_config_far_away():
  # The heuristic's basin is a bowl whose bottom is the heuristic; the best config stands
  # alone in the far corner (as a real sweep's best can), among slow ones. Walking out in
  # rings would reach it last; from the local optimum the walk explores at random instead.
  grid = [Tile(block_m=m, block_n=n, block_k=32, warps=4, stages=2)
          for m in (16, 32, 48, 64, 80, 96, 112, 128) for n in (16, 32, 48, 64, 80, 96, 112, 128)]
  corner = Tile(block_m=128, block_n=128, block_k=32, warps=4, stages=2)
  start = Tile(block_m=32, block_n=32, block_k=32, warps=4, stages=2)
  sweep = {c: 1e-3 * (1 + 0.01 * (abs(c.block_m - 32) + abs(c.block_n - 32)) / 16) for c in grid}
  sweep[corner] = 0.8e-3
  found = []
  for seed in range(5):
    replay = search.ReplayMeasure(sweep, noise=0.01, seed=seed, compile_cost_s=0.9,
                                  cost_s_per_config=0.1)
    outcome = search.racing(sweep, replay, heuristic=start, budget_s=0.8 * len(sweep),
                            rng_seed=seed, clock=replay.clock)
    assert replay.clock() <= 0.8 * len(sweep) * (1 + 1e-9)  # within the budget, to rounding
    found.append(outcome.best == corner)
  # Four fifths of the exhaustive search's time screen about three quarters of the space;
  # in rings out from the heuristic the corner, the farthest config, came last: never.
  assert sum(found) >= 4, found



def _cube_bowl(center: Tile, per_step: float) -> dict[Tile, float]:
  """512 tiles (block_m, block_n and block_k each 16 to 128 by 16) timed as a smooth bowl:
  1 ms at `center`, `per_step` more for each step of 16 away from it in each block size."""
  sizes = range(16, 129, 16)
  steps = lambda c: sum(abs(getattr(c, f) - getattr(center, f)) // 16
                        for f in ("block_m", "block_n", "block_k"))
  return {c: 1e-3 * (1 + per_step * steps(c))
          for c in (Tile(block_m=m, block_n=n, block_k=k, warps=4, stages=2)
                    for m in sizes for n in sizes for k in sizes)}

def test_from_a_local_optimum_the_walk_tries_each_tunable_alone_across_all_its_values():
  # As on real sweeps (BENCHMARKS.md: a convolution on an AMD MI250X), the best config
  # differs from the heuristic's basin in one tunable only, by a jump many values away:
  # block_m 16 -> 112 with the rest as the heuristic has them. Rings out from the local
  # optimum would come to it late, a random hop seldom; changing one tunable at a time
  # across all its values finds it.
  start = Tile(block_m=16, block_n=64, block_k=64, warps=4, stages=2)
  best = dataclasses.replace(start, block_m=112)
  sweep = _cube_bowl(start, per_step=0.01)
  sweep[best] = 0.8e-3
  found = []
  for seed in range(5):
    replay = search.ReplayMeasure(sweep, noise=0.01, seed=seed, compile_cost_s=0.9,
                                  cost_s_per_config=0.1)
    budget = 0.1 * len(sweep)
    outcome = search.racing(sweep, replay, heuristic=start, budget_s=budget, rng_seed=seed,
                            clock=replay.clock)
    assert replay.clock() <= budget * (1 + 1e-9)
    found.append(outcome.best == best)
  # A tenth of the exhaustive search's time screens about a tenth of the space; hopping at
  # random from the local optimum found the best on 1 seed of 5 (this walk: 4).
  assert sum(found) >= 4, found


def test_on_a_large_space_the_walk_keeps_budget_for_a_last_round_at_full_effort():
  # A smooth bowl of 512 configs, 3% a step, and a budget for 30% of the exhaustive time:
  # too little to race the space, so the walk screens configs at one sample each while
  # the budget lasts. It keeps enough for its finalists and the heuristic to be measured
  # at full effort at the end (1.8% of the budget here), where the last round used to get
  # what the walk left, 4-5 of the 10 samples: too few to tell 2-3% from noise.
  best = Tile(block_m=64, block_n=64, block_k=64, warps=4, stages=2)
  start = dataclasses.replace(best, block_k=80)
  sweep = _cube_bowl(best, per_step=0.03)
  budget = 0.3 * len(sweep)
  for seed in range(3):
    replay = search.ReplayMeasure(sweep, noise=0.01, seed=seed, compile_cost_s=0.3,
                                  cost_s_per_config=0.7, whole_rounds=True)
    outcome = search.racing(sweep, replay, heuristic=start, budget_s=budget, rng_seed=seed,
                            clock=replay.clock)
    assert replay.clock() <= budget * (1 + 1e-9)
    assert outcome.num_measured > 0.7 * len(sweep)  # the walk did spend the budget
    assert sweep[outcome.best] < sweep[start]
    assert outcome.best_measurement.num_samples == outcome.measurements[start].num_samples == 10


def test_geometry_counts_steps_between_tunable_values():
  geometry = search._Geometry(list(SWEEP))
  assert geometry.distance(HEURISTIC, HEURISTIC) == 0
  # block_m 64 -> 256 is two steps (64, 128, 256); warps and stages one each.
  assert geometry.distance(HEURISTIC, dataclasses.replace(HEURISTIC, block_m=256, warps=8,
                                                          stages=3)) == 4
  assert geometry.changed_field(HEURISTIC, dataclasses.replace(HEURISTIC, block_k=128)) == "block_k"
  assert geometry.changed_field(HEURISTIC, OPTIMUM) is None
  paths = search._Geometry([Paths(block=64, split=False, fused=False, order="m"),
                            Paths(block=128, split=True, fused=False, order="n")])
  assert paths.distance(Paths(block=64, split=False, fused=False, order="m"),
                        Paths(block=128, split=True, fused=False, order="n")) == 3
  # Plain tuples of one length: each position a tunable, as a dataclass's fields.
  tiles = search._Geometry([(1, 2, "a"), (3, 4, "b"), (5, 4, "a")])
  assert tiles.distance((1, 2, "a"), (5, 4, "b")) == 2 + 1 + 1
  assert tiles.changed_field((1, 2, "a"), (1, 2, "b")) == 2
  Tiles = collections.namedtuple("Tiles", "m n")
  named = search._Geometry([Tiles(1, 2), Tiles(3, 4), Tiles(5, 4)])
  assert named.distance(Tiles(1, 2), Tiles(5, 4)) == 3
  assert named.changed_field(Tiles(1, 2), Tiles(1, 4)) == "n"
  # Configs without shared tunables (tuples of two lengths, numbers): equal or one apart.
  for plain in ([(1, 2), (3, 4, 5)], [1, 3, 7]):
    g = search._Geometry(plain)
    assert g.distance(plain[0], plain[1]) == 1 and g.distance(plain[0], plain[0]) == 0
  # All distances from a config at once (what the walk asks at each step) agree with them.
  for configs in (list(SWEEP), [(1, 2), (3, 4)], [(1, 2), (3, 4, 5)], [1, 3, 7],
                  [Tiles(m, n) for m in (1, 5, 3) for n in (2, 4)],
                  [Paths(block=b, split=s, fused=f, order=o) for b in (64, 128, 32)
                   for s in (False, True) for f in (False, True) for o in "mn"]):
    g = search._Geometry(configs)
    for a in configs[::3]:
      assert g.distances(a).tolist() == [g.distance(a, b) for b in configs]
      values = lambda c: (tuple(getattr(c, f.name) for f in dataclasses.fields(c))
                          if dataclasses.is_dataclass(c) else c)
      shared = len({type(c) for c in configs}) == 1 and len(
          {len(c) if isinstance(c, tuple) else -1 for c in configs}) == 1
      changed = lambda b: (sum(x != y for x, y in zip(values(a), values(b)))
                           if shared and not isinstance(a, int) else int(a != b))
      assert g.fields_changed(a).tolist() == [changed(b) for b in configs]


def test_the_walk_goes_the_same_way_over_tuples_as_over_dataclasses():
  # A space of (block_m, block_n, ...) tuples is walked as the same space of dataclasses:
  # the same configs measured, in the same calls, and the same choice. Tuples had no
  # geometry before, and a walk over a TPU matmul's tiles went at random (2026-12-07).
  Named = collections.namedtuple("Named", [f.name for f in dataclasses.fields(Tile)])
  for seed in range(3):
    walks = []
    for convert in (lambda c: c, dataclasses.astuple, lambda c: Named(*dataclasses.astuple(c))):
      sweep = {convert(c): v for c, v in SWEEP.items()}
      replay = search.ReplayMeasure(sweep, noise=0.02, seed=seed, compile_cost_s=0.5,
                                    cost_s_per_config=0.2)
      calls = []
      logged = lambda configs, *, effort=1.0: calls.append(
          [tuple(dataclasses.astuple(c) if dataclasses.is_dataclass(c) else c)
           for c in configs]) or replay(configs, effort=effort)
      outcome = search.racing(sweep, logged, heuristic=convert(HEURISTIC),
                              budget_s=0.05 * len(sweep), rng_seed=seed, clock=replay.clock)
      best = outcome.best
      walks.append((calls, tuple(dataclasses.astuple(best)) if dataclasses.is_dataclass(best)
                    else tuple(best)))
    assert walks[0] == walks[1] == walks[2]
    assert len(walks[0][0]) > 4  # a walk of several steps, not the heuristic alone


def test_the_walk_never_returns_worse_than_the_heuristic_on_a_rough_sweep():
  # Times with no structure at all: nearness says nothing, the final round still holds.
  rng = np.random.default_rng(0)
  rough = {c: float(np.exp(rng.normal(0, 0.3))) * 1e-3 if isinstance(v, float) else v
           for c, v in SWEEP.items()}
  rough[HEURISTIC] = 1e-3
  for seed in range(5):
    replay = search.ReplayMeasure(rough, noise=0.01, seed=seed, compile_cost_s=0.9,
                                  cost_s_per_config=0.1)
    outcome = search.racing(rough, replay, heuristic=HEURISTIC, budget_s=19.2, rng_seed=seed,
                            clock=replay.clock)
    assert replay.clock() <= 19.2 and outcome.best_measurement.ok
    assert rough[outcome.best] <= 1.02 * rough[HEURISTIC]


def test_the_cost_model_learns_a_cost_per_call_only_where_calls_need_one():
  exact = [(1, 1.0, 2.55), (0, 1 / 81, 0.05 + 0.5 / 81), (1, 2 / 27, 0.05 + 2.0 + 1 / 27)]
  model = search._CostModel.fit(exact)  # 0.05 s a call, 2 s to compile, 0.5 s an effort
  assert (model.call_s, model.fixed_s, model.per_effort_s) == pytest.approx((0.05, 2.0, 0.5))
  assert model.scale == pytest.approx(1.0) and model.predict(3, 0.5) == pytest.approx(6.3)
  # Calls that compile and effort explain keep no call cost, even where one more
  # coefficient could fit them too (a call cost the calls do not pin down would make
  # new configs look cheaper than they were).
  plain = search._CostModel.fit([(1, 1.0, 1.5)])
  assert plain.call_s == 0.0 and plain.predict(1, 1.0) == pytest.approx(1.5)
  assert search._CostModel.fit([(2, 1.0, 2.5), (0, 0.5, 0.25)]).call_s == 0.0
  # Failed new configs (the 4th count) have a cost of their own. A cheap failure leaves a
  # new config's price at what ok ones cost; a dear one adds its excess at the rate
  # failures happened (here 2 of 3 new configs).
  failing = search._CostModel.fit([(1, 1.0, 2.0, 0), (0, 0.0, 0.2, 2)])
  assert failing.failed_s == pytest.approx(0.1) and failing.predict(1, 1.0) == pytest.approx(2.0)
  dear = search._CostModel.fit([(1, 1.0, 2.0, 0), (0, 0.0, 6.0, 2)])
  assert dear.failure_rate == pytest.approx(2 / 3) and dear.failed_s == pytest.approx(3.0)
  excess = 2 / 3 * (3.0 - dear.fixed_s)
  assert dear.predict(1, 1.0) == pytest.approx(2.0 + excess)
  assert dear.predict(2, 0.0) == pytest.approx(2 * (dear.fixed_s + excess))


def test_the_cost_model_prices_what_its_calls_cannot_tell_at_the_worst_fit():
  # One call of one new config at full effort: all compile, or all measuring, or any mix.
  single = search._CostModel.fit([(1, 1.0, 2.0)])
  assert single.predict(1, 1.0) == pytest.approx(2.0)  # a call like it: what it cost
  assert single.predict(0, 2.0) == pytest.approx(4.0)  # two measured configs: all effort
  assert single.predict(3, 0.0) == pytest.approx(6.0)  # compiles alone: all compile
  assert single.new_configs_that_fit(7.0, 1.0, 10) == 3
  assert single.new_configs_that_fit(1.0, 1.0, 10) == 0
  # Two calls in one ratio of new configs to effort tell no more.
  assert search._CostModel.fit([(1, 1.0, 2.0), (2, 2.0, 4.0)]).predict(0, 1.0) == (
      pytest.approx(2.0))
  # A plan's calls are priced by one fit at a time, the dearest total: 9 new configs at
  # effort 1/3, then 4 measured at full effort cost 18 s as all effort, 14 s as all
  # compile (the sum of each call's dearest fit, 26 s, is no fit's).
  plan = search._schedule_calls(single, [(9, 1 / 3), (3, 1.0)], True)
  assert plan == [(9, pytest.approx(3.0)), (0, 4.0)]
  assert single.cost(plan) == pytest.approx(18.0)
  assert single.new_configs_that_fit(10.0, 1.0, 10, later=[(0, 2.0)]) == 3
  # Calls that pin the costs down have one fit: 1.5 s a compile, 0.5 s an effort.
  pinned = search._CostModel.fit([(1, 1.0, 2.0), (0, 1.0, 0.5)])
  assert pinned.alternatives == () and pinned.predict(2, 1.0) == pytest.approx(3.5)
  # A call timed at no finite time (a broken clock) teaches nothing.
  assert search._CostModel.fit([(1, 1.0, math.nan)]).predict(1, 1.0) == 0.0


def test_racing_keeps_a_budget_its_first_calls_cannot_price():
  # A budget of two full measurements, min_effort 0.5: the heuristic at full effort, then
  # a walk's step of one config and the heuristic at half effort, which costs what the
  # first call did, so the calls cannot tell compiling from measuring. Priced as all
  # compile, a last round of those two at full effort looked free: it spent 4 s.
  recorded = {i: 1e-3 * (1 + (i * 7919 % 97) / 50) for i in range(200)}
  for budget in (2.0, 2.5, 3.0, 4.0):
    for min_effort in (0.5, 1 / 3, 1 / 81):
      replay = search.ReplayMeasure(recorded, noise=0.02, cost_s_per_config=1.0)
      search.racing(list(recorded), replay, heuristic=0, budget_s=budget,
                    min_effort=min_effort, clock=replay.clock)
      assert replay.clock() <= budget + 1e-9, (budget, min_effort)


class _FailingFake:
  """1 s to compile a config and 1 s * effort to time it; the configs in `failing` fail
  to compile after `fail_s` (a smem overflow found at once, or after a whole compile)."""

  def __init__(self, failing, fail_s):
    self.now, self.failing, self.fail_s, self.seen = 0.0, failing, fail_s, set()

  def clock(self):
    return self.now

  def __call__(self, configs, *, effort=1.0):
    out = {}
    for c in configs:
      if c in self.failing:
        self.now += self.fail_s
        out[c] = Measurement(status="compile_error", error="out of shared memory")
      else:
        self.now += (0.0 if c in self.seen else 1.0) + effort
        t = 1e-3 * (1 + c / 1000)
        out[c] = Measurement(status="ok", median_s=t, ci_low_s=t, ci_high_s=t, num_samples=10)
      self.seen.add(c)
    return out


@pytest.mark.parametrize("strategy", ["exhaustive", "random_search", "racing"])
@pytest.mark.parametrize("fail_s", [0.1, 1.0])
@pytest.mark.parametrize("failing", [{1, 2}, set(range(1, 100, 3))])
def test_configs_that_fail_do_not_make_the_others_look_free(strategy, fail_s, failing):
  # A failed config was logged as a measured one: cheap failures taught the cost model
  # that configs cost nothing (per_config 0), and the next chunk of 16 overran a 6 s
  # budget to 34 s. Now failures are a column of their own and plans charge a new
  # config the dearer of the two.
  for budget in (4.0, 6.0, 10.0, 25.0):
    fake = _FailingFake(failing, fail_s)
    kwargs = {} if strategy == "exhaustive" else {"rng_seed": 3}
    getattr(search, strategy)(list(range(100)), fake, heuristic=0, budget_s=budget,
                              clock=fake.clock, **kwargs)
    assert fake.now <= budget + 2.0, (budget, fake.now)  # at most one measurement over


def _fuzzed_race(seed):
  """racing over a random space, costs and options (a working heuristic); returns its
  budget (at least what the heuristic's first call costs, which is always made) and
  the seconds it spent."""
  rng = np.random.default_rng(seed)
  n = int(rng.choice([5, 20, 60, 200, 600]))
  fails = float(rng.choice([0.0, 0.1, 0.4]))
  recorded = {i: (Measurement(status="compile_error", error="x")
                  if i and rng.random() < fails else 1e-3 * math.exp(rng.normal(0, 0.3)))
              for i in range(n)}
  costs = dict(cost_s_per_config=float(rng.choice([0.1, 1.0, 5.0])),
               compile_cost_s=float(rng.choice([0.0, 0.5, 5.0])),
               call_cost_s=float(rng.choice([0.0, 0.2])))
  replay = search.ReplayMeasure(recorded, noise=0.02, seed=seed, **costs)
  sweep = n * (costs["compile_cost_s"] + costs["cost_s_per_config"])
  budget = max(float(rng.choice([0.02, 0.05, 0.1, 0.3, 1.0])) * sweep,
               sum(costs.values()))
  search.racing(list(recorded), replay, heuristic=0, budget_s=budget,
                min_effort=float(rng.choice([1 / 81, 1 / 27, 1 / 3, 0.5, 1.0])),
                eta=int(rng.choice([2, 3, 4])), clock=replay.clock)
  return budget, replay.clock()


def test_racing_keeps_fuzzed_budgets():
  # Before the cost model kept every fit that explains its calls, 11 of 600 such runs
  # overran, by up to 1.61x; one that cannot tell a call's cost from a compile's
  # still may, by a call's cost (1.08x).
  over = [spent / budget for budget, spent in map(_fuzzed_race, range(300))]
  assert max(over) <= 1.1 and sum(o > 1 + 1e-9 for o in over) <= 3, sorted(over)[-5:]


def test_racing_spends_a_budget_that_calls_cost_overhead_in():
  # GPU-like: 2 s to compile a config, 0.5 s to measure it, 0.05 s per measure call.
  # The heuristic's two calibration calls cannot separate the three costs; the model
  # must neither give up (it did: 6 s measured only the heuristic, in 2.6 s) nor overrun.
  for budget, at_least in ((6.0, 2), (12.0, 4)):
    replay = search.ReplayMeasure(SWEEP, noise=0.02, compile_cost_s=2.0, cost_s_per_config=0.5,
                                  call_cost_s=0.05)
    outcome = search.racing(SWEEP, replay, heuristic=HEURISTIC, budget_s=budget,
                            clock=replay.clock)
    assert replay.clock() <= budget and outcome.num_measured >= at_least, budget
    assert TRUE[outcome.best] <= TRUE[HEURISTIC]


class _Resumed:
  """A measure resuming an interrupted tuning: a journal answers some configs at no cost,
  and says which (`recalled`); the rest the replay measures."""

  def __init__(self, replay, journal):
    self.replay, self.journal = replay, journal

  def recalled(self, configs, effort):
    return {c for c in configs if c in self.journal}

  def answer(self, config):
    return self.journal[config]

  def __call__(self, configs, *, effort=1.0):
    known = self.recalled(configs, effort)
    todo = [c for c in configs if c not in known]
    out = self.replay(todo, effort=effort) if todo else {}
    return {c: self.answer(c) if c in known else out[c] for c in configs}


@pytest.mark.parametrize("strategy", [search.racing, search.exhaustive])
def test_configs_a_journal_answers_teach_the_cost_model_nothing(strategy):
  # Answered at no cost, they were taken as measured: new configs looked free and a
  # budgeted search resumed from a journal overran its budget (2 s: 8.7 s on the CPU).
  ok = lambda t: Measurement(status="ok", median_s=t, ci_low_s=t, ci_high_s=t, num_samples=10)
  for budget in (8.0, 16.0):
    replay = search.ReplayMeasure(SWEEP, compile_cost_s=2.0, cost_s_per_config=0.5,
                                  call_cost_s=0.05)
    journal = {c: ok(t) for c, t in list(TRUE.items())[::3] if c != HEURISTIC}
    outcome = strategy(SWEEP, _Resumed(replay, journal), heuristic=HEURISTIC, budget_s=budget,
                       clock=replay.clock)
    assert replay.clock() <= budget, (strategy.__name__, budget, replay.clock())
    assert TRUE[outcome.best] <= TRUE[HEURISTIC]


class _Journaled:
  """A measure that journals what it measured, as the autotuner's journal does: the
  highest effort each config was measured at (never the heuristic's)."""

  def __init__(self, measure):
    self.measure, self.journal = measure, {}

  def __call__(self, configs, *, effort=1.0):
    out = self.measure(configs, effort=effort)
    for c, m in out.items():
      if c != HEURISTIC and effort >= self.journal.get(c, (0.0,))[0]:
        self.journal[c] = (effort, m)
    return out


class _ResumedByEffort(_Resumed):
  """A journal answers a config at most at the effort it was measured at."""

  def recalled(self, configs, effort):
    return {c for c in configs if c in self.journal and self.journal[c][0] >= effort}

  def answer(self, config):
    return self.journal[config][1]


def test_a_resumed_race_counts_a_compile_for_configs_the_journal_knew_at_a_lower_effort():
  # The journal answered screening-effort measurements; racing them at a higher effort
  # compiles them in this run, which planning took as already paid: racing overran a 6 s
  # budget by 67% (10 s) until 2026-12-06.
  for first_budget, budget in ((30.0, 6.0), (60.0, 10.0), (60.0, 16.0)):
    costs = dict(compile_cost_s=2.0, cost_s_per_config=0.5, call_cost_s=0.05, noise=0.03)
    first = search.ReplayMeasure(SWEEP, **costs)
    journaled = _Journaled(first)
    search.racing(SWEEP, journaled, heuristic=HEURISTIC, budget_s=first_budget, clock=first.clock)
    assert {e for e, _ in journaled.journal.values()} != {1.0}  # some at a lower effort
    replay = search.ReplayMeasure(SWEEP, seed=1, **costs)
    outcome = search.racing(SWEEP, _ResumedByEffort(replay, journaled.journal),
                            heuristic=HEURISTIC, budget_s=budget, clock=replay.clock)
    assert replay.clock() <= budget * (1 + 1e-9), (first_budget, budget, replay.clock())
    assert TRUE[outcome.best] <= TRUE[HEURISTIC]


def test_racing_counts_the_round_that_every_cheap_measurement_keeps():
  # Measurements keep at least one of 10 rounds, so efforts 1/81 and 1/27 both cost a
  # tenth of a full one. Told so (effective_effort), the cost model plans within the
  # budget; counting effort as asked it overran by up to 3% on these seeds.
  overruns = {}
  for told in (True, False):
    for seed in range(6):
      replay = search.ReplayMeasure(SWEEP, noise=0.03, seed=seed, compile_cost_s=0.2,
                                    whole_rounds=True)
      measure = replay if told else (lambda configs, effort=1.0, r=replay: r(configs, effort=effort))
      budget = 0.05 * len(SWEEP) * 1.2
      outcome = search.racing(SWEEP, measure, heuristic=HEURISTIC, budget_s=budget,
                              clock=replay.clock)
      assert TRUE[outcome.best] <= TRUE[HEURISTIC]
      overruns[told, seed] = replay.clock() / budget - 1
  assert max(overruns[True, seed] for seed in range(6)) <= 1e-9, overruns
  assert max(overruns[False, seed] for seed in range(6)) > 0.01, overruns


def test_racing_adapts_when_calls_cost_more_than_predicted():
  # After the two calibration calls every call costs three times what the replay charges,
  # so the plan made from the calibration overruns unless racing re-predicts each call.
  replay = search.ReplayMeasure(SWEEP, noise=0.01)
  extra = [0.0]
  def pricier(configs, *, effort=1.0):
    before = replay.clock()
    out = replay(configs, effort=effort)
    if replay.num_calls > 2:
      extra[0] += 2 * (replay.clock() - before)
    return out
  clock = lambda: replay.clock() + extra[0]
  budget = 0.1 * EXHAUSTIVE_COST
  outcome = search.racing(SWEEP, pricier, heuristic=HEURISTIC, budget_s=budget, clock=clock)
  assert clock() <= budget
  assert outcome.best_measurement.ok and TRUE[outcome.best] < TRUE[HEURISTIC]


def test_racing_never_returns_worse_than_an_optimal_heuristic():
  for noise in (0.0, 0.01):
    replay = search.ReplayMeasure(SWEEP, noise=noise)
    outcome = search.racing(SWEEP, replay, heuristic=OPTIMUM, budget_s=20.0,
                            clock=replay.clock)
    assert outcome.best == OPTIMUM


def test_racing_without_budget_races_the_whole_space():
  replay = search.ReplayMeasure(SWEEP)
  outcome = search.racing(SWEEP, replay, heuristic=HEURISTIC, clock=replay.clock)
  assert outcome.best == OPTIMUM and outcome.num_measured == len(SWEEP)
  assert replay.clock() < 0.2 * EXHAUSTIVE_COST


def test_racing_with_a_tiny_budget_keeps_the_heuristic():
  replay = search.ReplayMeasure(SWEEP)
  outcome = search.racing(SWEEP, replay, heuristic=HEURISTIC, budget_s=1.0, clock=replay.clock)
  assert outcome.best == HEURISTIC and outcome.num_measured == 1
  replay = search.ReplayMeasure(SWEEP)
  alone = search.racing([HEURISTIC], replay, heuristic=HEURISTIC, budget_s=5.0,
                        clock=replay.clock)
  assert alone.best == HEURISTIC and alone.num_configs == 1


def test_racing_measures_the_heuristic_again_only_where_the_budget_left_pays_for_a_call():
  # The second (least effort) measurement was predicted at the first's cost times the
  # effort, which leaves out what any call costs: 2.5 s of budget took 4.15 s.
  for budget in (2.5, 4.0):
    replay = search.ReplayMeasure(SWEEP, call_cost_s=2.0, cost_s_per_config=0.15)
    outcome = search.racing(SWEEP, replay, heuristic=HEURISTIC, budget_s=budget,
                            clock=replay.clock)
    assert replay.num_calls == 1 and outcome.best == HEURISTIC, budget


@pytest.mark.parametrize("strategy", [search.exhaustive, search.random_search, search.racing])
def test_a_budget_spent_before_the_search_began_still_measures_the_heuristic(strategy):
  # On a loaded machine a tiny budget can run out between a search's start and its first
  # measurement (the autotuner's budget_s=0.001 test once left a call with nothing).
  replay = search.ReplayMeasure(SWEEP)
  readings = itertools.count()
  late = lambda: replay.clock() + (0.0 if next(readings) == 0 else 2.0)
  outcome = strategy(SWEEP, replay, heuristic=HEURISTIC, budget_s=1.0, clock=late)
  assert outcome.best == HEURISTIC and outcome.num_measured == 1


def test_random_search_respects_its_budget_and_sample_count():
  replay = search.ReplayMeasure(SWEEP)
  outcome = search.random_search(SWEEP, replay, heuristic=HEURISTIC, budget_s=15.5,
                                 rng_seed=1, clock=replay.clock)
  assert replay.clock() <= 15.5 and outcome.num_measured == 15
  assert outcome.strategy == "random" and HEURISTIC in outcome.measurements
  best_seen = min((c for c, m in outcome.measurements.items() if m.ok), key=TRUE.get)
  assert outcome.best == best_seen and outcome.best_measurement.ok
  replay = search.ReplayMeasure(SWEEP)
  outcome = search.random_search(SWEEP, replay, heuristic=HEURISTIC, num_samples=20,
                                 clock=replay.clock)
  assert outcome.num_measured == 21
  with pytest.raises(ValueError, match="needs num_samples, budget_s or both"):
    search.random_search(SWEEP, replay, heuristic=HEURISTIC)


def test_failed_configs_are_never_chosen():
  # The failed configs' neighbours are the fastest of this sweep: a strategy that ranked
  # failures as fast (as zero time, say) would pick one.
  sweep = {c: (v if not isinstance(v, float) else 1e-3 + abs(c.block_m - 256) * 1e-5)
           for c, v in SWEEP.items()}
  for strategy in (search.exhaustive, search.racing):
    replay = search.ReplayMeasure(sweep)
    outcome = strategy(sweep, replay, heuristic=HEURISTIC, budget_s=30.0, clock=replay.clock)
    assert outcome.best_measurement.ok


def test_every_config_failed_raises_a_clear_error():
  failed = {Tile(block_m=m, block_n=64, block_k=64, warps=4, stages=2):
            Measurement(status="compile_error", error=f"block_m={m} too large") for m in (64, 128)}
  for strategy in (search.exhaustive, search.racing, search.random_search):
    replay = search.ReplayMeasure(failed)
    with pytest.raises(AllCandidatesFailedError, match="block_m=128 too large") as info:
      strategy(failed, replay, heuristic=next(iter(failed)), budget_s=10.0, clock=replay.clock)
    assert len(info.value.measurements) == 2


def test_default_strategy_picks_by_space_size():
  assert search.default_strategy(16) is search.exhaustive
  assert search.default_strategy(17) is search.racing
  assert search.default_strategy(3, max_exhaustive=2) is search.racing
  with pytest.raises(ValueError, match="space_size=-1"):
    search.default_strategy(-1)


def test_replay_measure_advances_its_clock_and_scales_samples_with_effort():
  replay = search.ReplayMeasure(SWEEP, noise=0.05, cost_s_per_config=2.0, compile_cost_s=3.0)
  first = replay([OPTIMUM, HEURISTIC], effort=0.25)
  assert replay.clock() == 2 * (3.0 + 0.5)
  assert first[OPTIMUM].num_samples == 3 and first[OPTIMUM].method == "replay"
  again = replay([OPTIMUM])
  assert replay.clock() == 7.0 + 2.0 and again[OPTIMUM].num_samples == 10
  per_call = search.ReplayMeasure(SWEEP, call_cost_s=0.25)
  per_call([OPTIMUM, HEURISTIC], effort=0.5)
  assert per_call.clock() == 0.25 + 2 * 0.5
  # Whole rounds: effort 0.01 takes one of 10 samples and costs a tenth.
  whole = search.ReplayMeasure(SWEEP, whole_rounds=True)
  assert whole([OPTIMUM], effort=0.01)[OPTIMUM].num_samples == 1 and whole.clock() == 0.1
  assert (whole.effective_effort(0.01), replay.effective_effort(0.01)) == (0.1, 0.01)
  assert abs(again[OPTIMUM].median_s / TRUE[OPTIMUM] - 1) < 0.1
  with pytest.raises(ValueError, match="not in the recorded sweep"):
    replay([Tile(block_m=1, block_n=1, block_k=1, warps=1, stages=1)])
  with pytest.raises(ValueError, match="effort=0"):
    replay([OPTIMUM], effort=0)
  with pytest.raises(ValueError, match="must be a positive number"):
    search.ReplayMeasure({OPTIMUM: 0.0})


def test_a_measure_that_drops_configs_is_reported():
  def forgetful(configs, *, effort=1.0):
    return search.ReplayMeasure(SWEEP)(configs[:1], effort=effort)
  with pytest.raises(ValueError, match="returned nothing for"):
    search.exhaustive(list(SWEEP)[:3], forgetful)


def test_bad_strategy_arguments_are_rejected():
  replay = search.ReplayMeasure(SWEEP)
  with pytest.raises(ValueError, match="eta=1"):
    search.racing(SWEEP, replay, heuristic=HEURISTIC, eta=1)
  with pytest.raises(ValueError, match="budget_s=0"):
    search.racing(SWEEP, replay, heuristic=HEURISTIC, budget_s=0)
  with pytest.raises(ValueError, match="search space is empty"):
    search.exhaustive([], replay)
  with pytest.raises(TypeError, match="hashable"):
    search.exhaustive([[1, 2]], replay)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Paths:
  """A config with switches between code paths (a bool, a str) besides a tile."""
  block: int
  split: bool
  fused: bool
  order: str = "m"


def test_code_path_variants_take_each_other_value_of_each_switch_once():
  heuristic = Paths(block=64, split=False, fused=False)
  space = [heuristic, Paths(block=128, split=False, fused=False),
           Paths(block=64, split=True, fused=False), Paths(block=64, split=True, fused=True),
           Paths(block=128, split=False, fused=True), Paths(block=64, split=False, fused=False,
                                                              order="n"),
           Paths(block=64, split=False, fused=False, order="k"),
           Paths(block=128, split=False, fused=False, order="n")]
  # In field order, per other value in space order: the config with that value nearest
  # the heuristic (fewest other fields changed, then first in the space): `split`
  # flipped alone, `fused` flipped alone where the space has it (space[4] changes the
  # block too, space[3] the split too: a tie, the first wins), each other `order`.
  # Ints are not switches.
  assert search.code_path_variants(heuristic, space) == [space[2], space[3], space[5],
                                                          space[6]]
  fused_alone = Paths(block=64, split=False, fused=True)
  assert search.code_path_variants(heuristic, [*space, fused_alone]) == [
      space[2], fused_alone, space[5], space[6]]
  both = Paths(block=64, split=True, fused=True)
  assert search.code_path_variants(heuristic, [heuristic, both]) == [both]
  assert search.code_path_variants(heuristic, [heuristic]) == []
  assert search.code_path_variants(HEURISTIC, SWEEP) == []  # No switches.
  # Tuples' positions are tunables too; other configs have none.
  assert search.code_path_variants((1, True), [(1, True), (2, True), (2, False), (1, False)]
                                   ) == [(1, False)]
  assert search.code_path_variants((1, True), [(1, True, 0), (1, False, 0)]) == []
  # A plain-tuple heuristic over a space of named tuples: by positions, the space's own
  # instances (a named tuple equals the plain tuple of its values).
  named = collections.namedtuple("Named", "block fused")
  assert search.code_path_variants((1, True), [named(1, True), named(2, False),
                                               named(1, False)]) == [named(1, False)]
  assert type(search.code_path_variants((1, True), [named(1, False)])[0]) is named
  # A named-tuple heuristic over plain tuples and named tuples alike.
  assert search.code_path_variants(named(1, True), [(1, False), named(2, False)]) == [(1, False)]
  assert search.code_path_variants("a", ["a", "b"]) == []


def test_strategies_measure_code_path_variants_right_after_the_heuristic():
  """With budget for two configs, the second one measured is the variant that runs the
  other code path, though the space lists it last and a shuffle would rarely draw it."""
  heuristic = Paths(block=64, split=False, fused=False)
  tiles = [Paths(block=b, split=False, fused=False) for b in range(65, 125)]
  fused = Paths(block=64, split=False, fused=True)
  times = {heuristic: 2e-3, fused: 1e-3, **{c: 3e-3 for c in tiles}}
  space = [heuristic, *tiles, fused]
  for strategy in (search.exhaustive, search.random_search):
    replay = search.ReplayMeasure(times)
    outcome = strategy(space, replay, heuristic=heuristic, budget_s=2.5, clock=replay.clock)
    assert set(outcome.measurements) == {heuristic, fused}, strategy
    assert outcome.best == fused
  replay = search.ReplayMeasure(times)
  outcome = search.racing(space, replay, heuristic=heuristic, budget_s=6.0, clock=replay.clock)
  assert fused in outcome.measurements and outcome.best == fused


def _slow_first_call(replay, factor):
  """`replay`, with the times of its first call `factor` times as long (a machine that
  was busier, or its clocks lower, then than later)."""
  def measure(configs, effort):
    got = replay(configs, effort=effort)
    if replay.num_calls > 1:
      return got
    return {c: dataclasses.replace(m, median_s=m.median_s * factor, ci_low_s=m.ci_low_s * factor,
                                   ci_high_s=m.ci_high_s * factor) for c, m in got.items()}
  return measure


@pytest.mark.parametrize("strategy", [search.exhaustive, search.random_search])
def test_a_sweep_times_its_fastest_again_beside_the_heuristic_measured_alone(strategy):
  """A budgeted sweep measures the heuristic alone first. Where that call read 1.5x
  slow, a config 10% slower than the heuristic looked 1.36x faster and was chosen; timed
  again beside it, the heuristic is kept, and both keep the side-by-side times."""
  heuristic, slower = Paths(block=64, split=False, fused=False), Paths(block=96, split=False,
                                                                       fused=False)
  others = [Paths(block=b, split=False, fused=False) for b in range(100, 110)]
  times = {heuristic: 1e-3, slower: 1.1e-3, **{c: 2e-3 for c in others}}
  kw = dict(heuristic=heuristic, budget_s=30.0)
  replay = search.ReplayMeasure(times, noise=0.01)
  outcome = strategy([heuristic, slower, *others], _slow_first_call(replay, 1.5),
                     clock=replay.clock, **kw)
  assert outcome.best == heuristic and outcome.num_measured == len(times)
  assert outcome.measurements[slower].median_s == pytest.approx(1.1e-3, rel=0.05)
  assert outcome.measurements[heuristic].median_s == pytest.approx(1e-3, rel=0.05)
  assert replay.clock() <= 30.0
  # Measured in one call, there is nothing to time again: one call.
  replay = search.ReplayMeasure(times, noise=0.01)
  if strategy is search.exhaustive:
    outcome = strategy([heuristic, slower, *others], replay, heuristic=heuristic,
                       clock=replay.clock)
    assert outcome.best == heuristic and replay.num_calls == 1
  # Where a journal would answer a rival (another run's time), the call would not be
  # side by side: it is left to the autotuner's confirmation (`_confirm_recalled`).
  class Journaled:
    def __init__(self):
      self.replay, self.calls = search.ReplayMeasure(times, noise=0.01), []
    def __call__(self, configs, effort):
      self.calls.append(list(configs))
      return _slow_first_call(self.replay, 1.5)(configs, effort)
    def recalled(self, configs, effort):
      return [c for c in configs if c == slower]
  journaled = Journaled()
  strategy([heuristic, slower, *others], journaled, clock=journaled.replay.clock, **kw)
  assert sum(heuristic in call for call in journaled.calls) == 1
  # Without a heuristic, rivals timed in several calls are timed again together.
  if strategy is search.exhaustive:
    twin = Paths(block=97, split=False, fused=False)
    replay = search.ReplayMeasure({slower: 1.1e-3, twin: 1.1e-3, **times}, noise=0.01)
    calls = []
    measure = lambda configs, effort: calls.append(set(configs)) or replay(configs, effort=effort)
    outcome = strategy([slower, twin, *others], measure, heuristic=None, chunk_size=1,
                       clock=replay.clock)
    assert len(calls) == len(others) + 3 and calls[-1] == {slower, twin}
  # Without room for the call, the sweep's measurements decide (here, wrongly).
  replay = search.ReplayMeasure(times, noise=0.01)
  outcome = strategy([heuristic, slower], _slow_first_call(replay, 1.5), clock=replay.clock,
                     **kw | dict(budget_s=2.5))
  assert outcome.best == slower and replay.num_calls == 2


def _drifting(replay, factors):
  """`replay`, each call's times multiplied by factors[its number] (1 where absent),
  with the configs of each call logged."""
  calls = []
  def measure(configs, effort):
    calls.append(list(configs))
    f = factors.get(len(calls), 1.0)
    return {c: dataclasses.replace(m, median_s=m.median_s * f, ci_low_s=m.ci_low_s * f,
                                   ci_high_s=m.ci_high_s * f) if m.ok else m
            for c, m in replay(configs, effort=effort).items()}
  return measure, calls


def test_side_by_side_calls_go_on_while_another_config_read_fast_alone():
  # f's call read 0.75x, x's 0.85x. Timed beside the heuristic, f reads its 0.9 and x,
  # still at its lucky 0.81, would win on a time no other config was timed beside; so x
  # is timed beside the heuristic too, and f (truly faster) is chosen.
  times = {"h": 1.0e-3, "f": 0.9e-3, "x": 0.95e-3}
  replay = search.ReplayMeasure(times, noise=0.005)
  measure, calls = _drifting(replay, {2: 0.75, 3: 0.85})
  outcome = search.exhaustive(["h", "f", "x"], measure, heuristic="h", chunk_size=1,
                              clock=replay.clock)
  assert calls == [["h"], ["f"], ["x"], ["f", "h"], ["x", "h"]] and outcome.best == "f"
  # A heuristic that failed (a timeout costs its whole limit) is not measured again;
  # the two fastest are timed together instead.
  for status in ("timeout", "compile_error"):
    failed = {"h": Measurement(status=status, error="boom"), "a": 1e-3, "b": 1.001e-3,
              "c": 3e-3}
    replay = search.ReplayMeasure(failed, noise=0.01)
    measure, calls = _drifting(replay, {})
    outcome = search.exhaustive(list(failed), measure, heuristic="h", chunk_size=1,
                                clock=replay.clock)
    assert sum("h" in call for call in calls) == 1 and calls[-1] in (["a", "b"], ["b", "a"])


def test_a_last_round_without_room_for_all_measures_the_fastest_with_the_heuristic():
  """A walk that ran out of room for its last round chose on its fastest finalist's
  one-sample measurement, taken once: on a TPU that took a config 6% slower than the
  heuristic. Where the whole round does not fit, the fastest and the heuristic do."""
  fake, calls = _FailingFake(set(), 0.0), []
  logged = lambda configs, *, effort=1.0: calls.append((list(configs), effort)) or fake(
      configs, effort=effort)
  for room, expected in ((0.3, [1, 0]), (0.5, [1, 2, 3, 0]), (0.15, None)):
    fake.now, fake.seen, calls[:] = 0.0, set(), []
    session = search._Session(logged, fake.clock, budget_s=5.4 + room)
    session.measure([0], 1.0)  # 2 s: a compile and a full measurement
    session.measure([0], 0.1)  # 0.1 s: effort apart from compiling
    session.measure([1, 2, 3], 0.1)  # 3.3 s
    # What it returns is what racing chooses among (with the heuristic): the others'
    # screenings are one sample each, as lucky as the one that misled it.
    again = search._final_round(session, [1, 2, 3], 0, 0.1)
    assert again == (expected or [0])[:-1], room
    assert (calls[-1][0] if len(calls) == 4 else None) == expected, room
    assert fake.now <= 5.4 + room + 1e-9


def test_a_replay_charges_each_config_its_own_compile():
  replay = search.ReplayMeasure({"a": 1e-3, "b": 2e-3}, compile_cost_s={"a": 1.0, "b": 3.0},
                                cost_s_per_config=0.5)
  replay(["a", "b"])
  assert replay.clock() == pytest.approx(1.0 + 3.0 + 2 * 0.5)
  replay(["b"], effort=0.5)  # compiled already: its effort only
  assert replay.clock() == pytest.approx(5.25)
  with pytest.raises(ValueError, match="no seconds for \\['b'\\]"):
    search.ReplayMeasure({"a": 1e-3, "b": 2e-3}, compile_cost_s={"a": 1.0})
  with pytest.raises(ValueError, match="compile_cost_s\\['a'\\]=-1"):
    search.ReplayMeasure({"a": 1e-3}, compile_cost_s={"a": -1.0})


def _race_with_compiles_that_vary(seed):
  """racing where each config compiles in its own time (lognormal about a base, and in
  half the runs the faster configs compile slower, as larger tiles do); returns spent
  over budget. The budget is at least what the heuristic's first call costs."""
  rng = np.random.default_rng(seed)
  n = int(rng.choice([20, 60, 200, 600]))
  times = {i: 1e-3 * math.exp(rng.normal(0, 0.3)) for i in range(n)}
  sigma, gamma, base = (float(rng.choice(v)) for v in ([0.3, 0.6], [0.0, 2.0], [0.5, 2.0]))
  fastest = min(times.values())
  compiles = {i: base * math.exp(rng.normal(0, sigma)) * (fastest / t) ** gamma
              for i, t in times.items()}
  per_config, call = float(rng.choice([0.1, 1.0])), float(rng.choice([0.0, 0.05]))
  replay = search.ReplayMeasure(times, noise=0.02, seed=seed, compile_cost_s=compiles,
                                cost_s_per_config=per_config, call_cost_s=call)
  sweep = sum(compiles.values()) + n * per_config
  budget = max(float(rng.choice([0.05, 0.1, 0.25])) * sweep, compiles[0] + per_config + call)
  search.racing(list(times), replay, heuristic=0, budget_s=budget, rng_seed=seed,
                clock=replay.clock)
  return replay.clock() / budget


def test_racing_keeps_budgets_where_compiles_vary():
  # Priced on the one or two configs compiled so far, chunks of 32 new configs overran
  # by up to 4.03x (6 of 150 runs past 1.5x, 13 past 1.2x): calls now grow gradually.
  over = np.array([_race_with_compiles_that_vary(seed) for seed in range(150)])
  assert over.max() <= 1.5 and (over > 1.2).sum() <= 8, np.sort(over)[-8:]


def test_new_configs_grow_at_most_fourfold_and_surprises_are_recent_ones():
  fake = _FailingFake(set(), 0.0)
  session = search._Session(fake, fake.clock, budget_s=100.0)
  assert search._most_new(session) == 2  # nothing measured yet
  session.measure([0, 1, 2], 1.0)
  assert search._most_new(session) == 3 * search._GROWTH
  # Calls of 1 s a new config and 1 s an effort, then one 3 s over: it counts while it
  # is among the _SURPRISE_CALLS latest, and not after.
  calls = [(1, 1.0, 2.0, 0), (2, 0.5, 2.5, 0), (1, 0.5, 1.5, 0), (3, 0.5, 3.5, 0),
           (2, 1.0, 3.0, 0), (1, 0.5, 4.5, 0)]
  normal = (1, 0.5, 1.5, 0)
  assert search._CostModel.fit(calls).surprise > 1.5
  assert search._CostModel.fit(calls + [normal] * (search._SURPRISE_CALLS - 1)).surprise > 1.5
  assert search._CostModel.fit(calls + [normal] * search._SURPRISE_CALLS).surprise < 1.2


class _CompilesThatVary:
  """0.02 s a call, 0.3 s * effort to time a config, and each config's own compile the
  first time (0.5 s for config 0, 0.1 s for the others), reported as measure_candidates
  reports it (`compile_time_s`, also where an earlier call compiled the config)."""

  def __init__(self, reported_scale=1.0):
    self.now, self.seen, self.reported_scale = 0.0, set(), reported_scale

  def clock(self):
    return self.now

  def __call__(self, configs, *, effort=1.0):
    self.now += 0.02
    out = {}
    for c in configs:
      compile_s = 0.5 if c == 0 else 0.1
      self.now += (0.0 if c in self.seen else compile_s) + 0.3 * effort
      self.seen.add(c)
      out[c] = Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3,
                           num_samples=10, compile_time_s=compile_s * self.reported_scale)
    return out


def test_a_new_configs_reported_compile_is_split_from_its_call():
  # The heuristic's first call (0.5 s compile, 0.3 s timing) and the same at a tenth of
  # the effort: fitted whole, the first call's compile could be the timing's (a fit
  # charged an effort 2-4 times its cost on a TPU); split off, each cost is pinned.
  fake = _CompilesThatVary()
  session = search._Session(fake, fake.clock, budget_s=100.0)
  session.measure([0], 1.0)
  session.measure([0], 0.1)
  model = session.cost_model()
  assert model.fixed_s == pytest.approx(0.5) and model.per_effort_s == pytest.approx(0.3)
  assert model.call_s == pytest.approx(0.02) and not model.alternatives
  assert session.call_seconds == pytest.approx([0.82, 0.05])
  assert session.calls_with_new() == 1 and session.new_configs() == 1
  # A step of one new config (compile 0.1 s) then prices the next by all compiles seen;
  # several new configs compile at once, and their call is fitted whole.
  session.measure([1, 0], 0.1)
  session.measure([2, 3, 0], 0.1)
  assert session.calls[-1] == pytest.approx((2, 0.3, 0.02 + 0.2 + 0.09, 0, 1))
  assert session.calls_with_new() == 3 and session.new_configs() == 4
  # The surprise is per call (a call's compile and the rest of it count as one): the most
  # of the 3 latest calls' seconds over their fits.
  model = session.cost_model()
  fitted = [model.fixed_s * new + model.per_effort_s * work + model.call_s
            for new, work in ((1, 1.0), (0, 0.1), (1, 0.2), (2, 0.3))]
  ratios = [seconds / f for seconds, f in zip(session.call_seconds, fitted)]
  assert model.surprise == pytest.approx(max(ratios[-search._SURPRISE_CALLS:]))
  # A reported compile longer than the call (a compile cache's earlier compile, say)
  # was not paid by it: the call is fitted whole.
  stale = _CompilesThatVary(reported_scale=10.0)
  session = search._Session(stale, stale.clock, budget_s=100.0)
  session.measure([0], 1.0)
  assert session.calls == [pytest.approx((1, 1.0, 0.82, 0, 1))]


def test_the_walk_over_tuples_of_other_classes_and_numpy_numbers():
  # A tuple subclass keeps its class through the walk's pattern moves; a plain tuple
  # heuristic over named tuples (equal, of another class) still walks by positions;
  # NumPy numbers lie in order, as Python's do.
  class Tile3(tuple):
    @property
    def m(self):
      return self[0]

  Named = collections.namedtuple("Named", "m n k")
  sizes = np.array([16, 32, 64, 128])
  walks = {}
  for name, make, heuristic in (
      ("subclass", lambda t: Tile3(t), lambda t: Tile3(t)),
      ("named, plain heuristic", lambda t: Named(*t), tuple),
      ("numpy", lambda t: tuple(np.int64(v) for v in t), lambda t: tuple(np.int64(v) for v in t))):
    space = [make((m, n, k)) for m in sizes for n in sizes for k in sizes]
    sweep = {c: 1e-3 * (1 + 0.05 * sum(abs(int(np.log2(v)) - 5) for v in c)) for c in space}
    replay = search.ReplayMeasure(sweep, noise=0.01, seed=0, compile_cost_s=0.5,
                                  cost_s_per_config=0.2)
    seen = []
    logged = lambda configs, *, effort=1.0: seen.extend(configs) or replay(configs, effort=effort)
    start = heuristic((16, 16, 16))
    outcome = search.racing(space, logged, heuristic=start, budget_s=0.15 * len(space) * 0.7,
                            rng_seed=0, clock=replay.clock)
    assert all(type(c) is type(space[0]) for c in seen if c != start), name
    walks[name] = [tuple(int(v) for v in c) for c in seen]
    assert sweep[outcome.best] < sweep[space[0]], name
  assert len(set(map(tuple, walks.values()))) == 1  # the same walk, whatever the tuples
  geometry = search._Geometry([Named(*c) for c in itertools.product(sizes, sizes, sizes)])
  assert geometry.distance(Named(16, 16, 16), Named(128, 128, 128)) == 9
  assert search._CostModel.fit([(1, 0.0, 0.5, 0, 0)]).fixed_s == pytest.approx(0.5)


def _ok(seconds: float) -> Measurement:
  return Measurement(status="ok", median_s=seconds, ci_low_s=seconds, ci_high_s=seconds,
                     num_samples=3, compile_time_s=0.02)


class _FakeClockMeasure:
  """A measure on a fake clock that keeps the configs of each call; subclasses say what
  each config gives (`_one`) and advance `now`."""

  def __init__(self):
    self.now, self.calls = 0.0, []

  def clock(self) -> float:
    return self.now

  def __call__(self, configs, *, effort=1.0):
    self.calls.append(list(configs))
    return {c: self._one(c, effort) for c in configs}


class _TimedOutHeuristic(_FakeClockMeasure):
  """Config "h" times out (each measurement of it costs the 2 s limit), configs 0..19
  run ok in 0.07 s at full effort, 0 the fastest."""

  def __init__(self, limit_s: float = 2.0):
    super().__init__()
    self.limit_s = limit_s

  def _one(self, c, effort):
    if c == "h":
      self.now += self.limit_s
      return Measurement(status="timeout", error=f"did not finish within {self.limit_s} s")
    self.now += 0.05 * effort + 0.02
    return _ok(1e-3 * (1 + c / 100))


@pytest.mark.parametrize("strategy,budget_s", [
    (search.racing, 7.5), (search.racing, 8.0), (search.racing, 12.0),
    (search.exhaustive, 7.5), (search.random_search, 7.5)])
def test_a_failed_heuristic_is_measured_once_and_the_search_goes_on(strategy, budget_s):
  # Racing measured the timed-out heuristic again (its second call, its last round):
  # 4-6 s of the budget, a cost model that priced every call as a timeout, and at a
  # budget of 7.5 "None of the 1 candidates succeeded" with 20 configs unmeasured.
  measure = _TimedOutHeuristic()
  outcome = strategy(["h", *range(20)], measure, heuristic="h", budget_s=budget_s,
                     clock=measure.clock)
  assert outcome.best == 0 and sum("h" in call for call in measure.calls) == 1
  assert outcome.measurements["h"].status == "timeout"


@pytest.mark.parametrize("strategy", [search.racing, search.exhaustive, search.random_search])
def test_a_budget_spent_on_a_failed_heuristic_still_finds_a_config_that_runs(strategy):
  # The heuristic's failure took longer than the whole budget: every strategy raised
  # "None of the 1 candidates succeeded ... widen the search space".
  measure = _TimedOutHeuristic(limit_s=3.0)
  outcome = strategy(["h", *range(20)], measure, heuristic="h", budget_s=1.0, clock=measure.clock)
  assert outcome.best_measurement.ok and len(measure.calls) == 2


def test_a_space_whose_every_config_fails_names_each_failure_whatever_the_budget():
  failing = {c: Measurement(status="compile_error", error=f"no {c}") for c in "abcd"}
  replay = search.ReplayMeasure(failing, compile_cost_s=0.4, cost_s_per_config=0.0)
  with pytest.raises(AllCandidatesFailedError) as e:
    search.racing(list("abcd"), replay, heuristic="a", budget_s=1.0, clock=replay.clock)
  assert all(f"no {c}" in str(e.value) for c in "abcd")


class _EveryConfigFails(_FakeClockMeasure):
  """Every config fails (`status`), 1 s each; with `passes_after`, every config runs ok
  in the calls after that many, 0 the fastest."""

  def __init__(self, status="compile_error", passes_after=None):
    super().__init__()
    self.status, self.passes_after = status, passes_after

  def _one(self, c, effort):
    self.now += 1.0
    if self.passes_after is not None and len(self.calls) > self.passes_after:
      return _ok(1e-3 * (1 + 0.02 * (c != 0)))
    return Measurement(status=self.status, error=f"no {c}")


@pytest.mark.parametrize("strategy", [search.racing, search.exhaustive, search.random_search])
def test_looking_past_the_budget_for_a_config_that_runs_ends_at_twice_the_search(strategy):
  # It measured all of a 10,000-config space past a 5 s budget (10,000 s).
  measure = _EveryConfigFails()
  with pytest.raises(AllCandidatesFailedError):
    strategy(range(10_000), measure, heuristic=0, budget_s=5.0, clock=measure.clock)
  assert 5.0 < measure.now <= 2 * (5.0 + 1.0) + 1.0


def test_random_search_past_its_budget_draws_only_its_samples():
  measure = _EveryConfigFails()
  with pytest.raises(AllCandidatesFailedError):
    search.random_search(range(50), measure, heuristic=0, num_samples=2, budget_s=30.0,
                         clock=measure.clock)
  assert sum(map(len, measure.calls)) == 3  # the heuristic and its two samples


def test_a_runtime_error_is_measured_again_in_its_search():
  # The device's memory held by another process for a moment: the heuristic failed at
  # first, then ran; measured once only, a config 2% slower was chosen.
  measure = _EveryConfigFails(status="runtime_error", passes_after=1)
  outcome = search.racing(range(40), measure, heuristic=0, clock=measure.clock)
  assert outcome.best == 0 and outcome.best_measurement.ok
