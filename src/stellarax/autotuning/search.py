"""Search strategies: which configs to measure, how thoroughly, and which one wins.

A strategy is a function over a search space and a measure,

    strategy(space, measure, *, heuristic=..., budget_s=..., ...) -> SearchOutcome

and knows nothing of ops, kernels or devices. `exhaustive`, `racing` and `random_search`
all accept `heuristic` and `budget_s` by keyword, so a caller can hold any of them (see
`default_strategy`).

The measure. A `Measure` measures a batch of configs in one call, so that it can
interleave them (see measure.py), and returns one `Measurement` per config:

    measure(configs, *, effort=1.0) -> Mapping[config, Measurement]

`effort` in (0, 1] is the fraction of a full measurement to spend on each config of the
call; `measure_candidates(..., effort=e)` turns it into `e` times the rounds, leader rounds,
warm-up and per-candidate budget, keeping at least one round. Compilation and the output
check do not shrink with effort, so a measure should compile each config once across calls
(`measure_candidates(..., compile_cache=...)`); the strategies do not rely on it, they learn
what calls cost (see `racing`). Because of that one round, efforts below 1/rounds all cost
about a round: a measure may say so through an attribute `effective_effort(effort) ->
float`, the fraction of a full measurement's timed work an effort really buys
(`MeasureOptions.effective_effort`); the strategies' cost model then counts that instead
of the effort asked for. Without it, effort counts as asked. A measure that answers some
configs from a record instead of measuring them (a journal of an interrupted tuning) may
say which through an attribute `recalled(configs, effort) -> set of configs`: the cost
model learns from the others only, since a recalled config costs nothing and would make
the configs yet to measure look free (so the heuristic, whose measurements are the
first calls a strategy times, should not be recalled). Failed configs come back as
data, are never chosen and, but for runtime errors, not measured again in the search.
Where the budget is spent before any config ran ok (a heuristic that timed out), the
configs not measured yet are measured one at a time until one runs, for up to the
budget again, or the time taken so far where that is longer (`_Session.until_one_runs`);
when every measured config failed, the strategy raises `AllCandidatesFailedError`,
listing why each failed.

Budget. A budgeted strategy plans each call on a cost model fitted to the calls before
it (`_CostModel`; where a call compiled one new config and its Measurement reports
`compile_time_s`, as `measure_candidates`' do, the compile is told apart from the rest of
the call) and grows its calls of new configs gradually (`_most_new`: at most
`_GROWTH` times as many as measured so far), since new configs cost what their compiles
do, which vary with the config, and a call's cost is learnt only after it.

Time. Strategies read an injectable `clock` (default `time.perf_counter`); `ReplayMeasure`
replays a recorded sweep and advances a fake clock, so strategies are tested and compared
on any machine, deterministically.

Order. Every strategy measures the heuristic first and then its code-path variants
(`code_path_variants`: one config per value of each bool or str tunable that the
heuristic does not take), so that a small budget still compares the kernels' different
code paths.

Where to look. With a budget too small to screen the whole space, `racing` walks from the
heuristic to the configs nearest the fastest one so far (`_walk`, over `_Geometry`'s steps
between tunable values), and from a local optimum tries each tunable alone across all its
values, then hops at random to another basin, instead of sampling the space at random: on
synthetic sweeps where compiling a config costs as much as measuring it or more, that
lands within 2% of the best config in a tenth of the exhaustive search's time on every
seed of the tests (random sampling did on 3 to 7 of 20), and on eight real GPU sweeps
recorded by kernel_tuner (GEMM, convolutions, dedispersion; 2,442 to 17,956 configs on
NVIDIA and AMD GPUs) it lands nearer the best than random sampling in geometric mean at
every budget tried (BENCHMARKS.md has the comparisons).

The choice. Every strategy ends with `measure.pick_best` over its finalists with
`prefer=heuristic` and the space's order: a config replaces the heuristic one only when it
is faster beyond noise. The finalists are timed side by side where the budget allows:
racing and the walk measure them with the heuristic in a last round; a sweep (exhaustive,
random) that took several calls measures its fastest and their rivals again with the
heuristic in one call (`_side_by_side`), as times of two calls can differ by more than
the configs do.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import random
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Generic, Protocol, TypeVar

import numpy as np

from stellarax.autotuning.measure import Measurement, median_interval, pick_best, within_noise

C = TypeVar("C", bound=Hashable)

# The walk sizes a step for the most over its prediction that one of this many latest
# calls took (`_CostModel.surprise`): a first call that paid a process's warm-up would
# otherwise shrink every step after it.
_SURPRISE_CALLS: Final = 3

# A budgeted call measures at most this many times as many new configs as the calls
# before it did (see `_most_new`).
_GROWTH: Final = 4

# Spaces up to this size are measured exhaustively by default_strategy.
MAX_EXHAUSTIVE: Final = 16
# Configs per measure call when a budgeted sweep or racing's screening goes in chunks.
_CHUNK: Final = 16
# A cost fit whose residual exceeds this fraction of the calls' seconds (root of sums of
# squares) leaves them unexplained: _CostModel then also fits a cost per call.
_UNEXPLAINED: Final = 1e-3
# Cost fits whose squared residuals differ by less than this fraction of the calls'
# squared seconds explain them equally well (rounding apart): _CostModel keeps them all.
_TIED_RESIDUAL: Final = 1e-12
# Fraction of racing's budget that extra effort (boost) may not plan to use.
_BOOST_MARGIN: Final = 0.05
# How far (in `_Geometry` steps) the walk looks around an incumbent before it takes it for
# a local optimum and explores at random. 1 did better on the real sweep of BENCHMARKS.md
# but worse on the synthetic ones with per-config roughness; 2 kept those as they were.
_LOCAL_STEPS: Final = 2
# The walk keeps budget for a last round at full effort when that costs at most this
# fraction of the budget (else at the effort given, 1/eta): with 10%, the smallest
# synthetic budgets left a config's compile unspent; 2% left them as they were
# (BENCHMARKS.md).
_FINAL_SHARE: Final = 0.02


class Measure(Protocol[C]):
  """Measures a batch of configs; see the module docstring for the contract."""

  def __call__(self, configs: Sequence[C], /, *, effort: float = 1.0
               ) -> Mapping[C, Measurement]:
    ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchOutcome(Generic[C]):
  """What a search found.

  Attributes:
    strategy: the strategy's name ("exhaustive", "racing", "random").
    best: the chosen config; its measurement is ok.
    measurements: config -> its most thorough measurement (the latest among equally
      thorough ones), for every config measured, failures included.
    wall_time_s: seconds the search took, by its clock.
    num_configs: configs in the space (the heuristic counted once).
  """

  strategy: str
  best: C
  measurements: Mapping[C, Measurement]
  wall_time_s: float
  num_configs: int

  @property
  def num_measured(self) -> int:
    """Distinct configs measured."""
    return len(self.measurements)

  @property
  def best_measurement(self) -> Measurement:
    """The measurement of the chosen config."""
    return self.measurements[self.best]


class Strategy(Protocol):
  """The signature shared by the strategies, as a caller holding any of them uses it."""

  def __call__(self, space: Iterable[Any], measure: Measure[Any], *, heuristic: Any,
               budget_s: float | None = None) -> SearchOutcome[Any]:
    ...


# --- bookkeeping ------------------------------------------------------------------------


# Failures a search does not measure again: what the config is (it does not compile, it
# computes something else) or what costs its limit again (a timeout).
_NOT_MEASURED_AGAIN: Final = frozenset({"compile_error", "wrong_result", "timeout"})


class _Session(Generic[C]):
  """The clock, the cost of every measure call, and the best measurement of each config."""

  def __init__(self, measure: Measure[C], clock: Callable[[], float], budget_s: float | None):
    if budget_s is not None and not (math.isfinite(budget_s) and budget_s > 0):
      raise ValueError(f"{budget_s=} must be None (no limit) or a positive number of seconds.")
    self.budget_s = budget_s
    self._measure, self._clock = measure, clock
    self._start = clock()
    # config -> (effort, measurement, the number of the measure call it was taken in)
    self._best: dict[C, tuple[float, Measurement, int]] = {}
    self._num_calls = 0
    self._paid: set[C] = set()  # configs a timed call measured (compiled) in this session
    # The cost model's rows: (new configs that ran ok, the effective effort summed over
    # the configs that ran ok, seconds, new configs that failed, 1) per call (see
    # Measure.effective_effort), or two rows where the call's compile is known
    # (`_split_compile`): (1, 0, its seconds, 0, 0) and the rest of the call.
    self.calls: list[tuple[int, float, float, int, int]] = []
    self.effective: Callable[[float], float] = (
        getattr(measure, "effective_effort", None) or (lambda effort: effort))
    self.recalled: Callable[[Sequence[C], float], Iterable[C]] = (
        getattr(measure, "recalled", None) or (lambda configs, effort: ()))

  @property
  def call_seconds(self) -> list[float]:
    """Each timed measure call's seconds."""
    return [sum(row[2] for row in call) for call in _by_call(self.calls)]

  def cost_model(self) -> _CostModel:
    """The cost model fitted to the calls so far."""
    return _CostModel.fit(self.calls, self.effective)

  def remaining(self) -> float:
    if self.budget_s is None:
      return math.inf
    return self.budget_s - (self._clock() - self._start)

  def measured(self) -> list[C]:
    return list(self._best)

  def new_configs(self) -> int:
    """How many configs the calls so far measured for the first time, failed or not."""
    return int(sum(call[0] + call[3] for call in self.calls))

  def calls_with_new(self) -> int:
    """How many measure calls measured some config for the first time."""
    return sum(call[0] + call[3] > 0 for call in self.calls)

  def has(self, config: C) -> bool:
    """Whether `config` was measured (ok or not) at any effort."""
    return config in self._best

  def to_pay(self, configs: Sequence[C], effort: float) -> tuple[list[C], int]:
    """What a measure call of `configs` at `effort` pays for, as the cost log counts it:
    (the configs it measures, those of them new), where a journal's answers cost nothing
    and new means not measured (so not compiled) by this session yet. A config the
    journal answered at a low effort is new when measured at a higher one: planning
    took it as measured and under-predicted such calls by a compile each (a resumed
    racing run overran a 6 s budget by 67% on a replayed sweep, 2026-12-06)."""
    recalled = set(self.recalled(configs, effort))
    measured = [c for c in configs if c not in recalled]
    return measured, sum(c not in self._paid for c in dict.fromkeys(measured))

  def measure(self, configs: Sequence[C], effort: float) -> dict[C, Measurement]:
    """Measures `configs` at `effort` (the measure's answers, kept), but for those that
    failed already in this session for what they are (`_NOT_MEASURED_AGAIN`): their
    failure is returned as it was. Measured again, a timed-out heuristic in racing's
    second and last calls took 4 s of an 8 s budget, measured nothing new, and taught
    the cost model that a call costs a timeout, so the search stopped with every config
    but the heuristic unmeasured (2026-12-07). A runtime error (the device's memory
    held by another process) is measured again: it may pass, and it costs little."""
    failed = {c: self.kept(c) for c in configs
              if c in self._best and self.kept(c).status in _NOT_MEASURED_AGAIN}
    configs = [c for c in dict.fromkeys(configs) if c not in failed]
    if not configs:
      return failed
    measured, _ = self.to_pay(configs, effort)
    start = self._clock()
    got = self._measure(configs, effort=effort)
    seconds = self._clock() - start
    missing = [c for c in configs if c not in got]
    if missing:
      raise ValueError(f"The measure returned nothing for {missing[:5]!r}: a measure must return"
                       " one Measurement per config it is given.")
    for c in configs:
      if not isinstance(got[c], Measurement):
        raise TypeError(f"The measure returned {got[c]!r} for {c!r}; expected a Measurement.")
      if c not in self._best or effort >= self._best[c][0]:
        self._best[c] = (effort, got[c], self._num_calls)
    self._num_calls += 1
    if measured:
      # New configs that failed (a compile error, a wrong result) are counted apart:
      # they cost anything from nothing to a whole compile, never a timing, and counted
      # with the others cheap ones taught the model that configs cost little, so the
      # next chunks overran the budget (up to 13x on fuzzed sweeps, 2026-12-07).
      fresh = [c for c in dict.fromkeys(measured) if c not in self._paid]
      new_ok = sum(got[c].ok for c in fresh)
      timed = sum(got[c].ok for c in measured)
      work = self.effective(effort) * timed
      compile_s = _split_compile(fresh, got, seconds)
      if compile_s is None:
        self.calls.append((new_ok, work, seconds, len(fresh) - new_ok, 1))
      else:
        self.calls += [(1, 0.0, compile_s, 0, 0), (0, work, seconds - compile_s, 0, 1)]
      self._paid.update(measured)
    return {**failed, **{c: got[c] for c in configs}}

  def timed_together(self, configs: Iterable[C]) -> bool:
    """Whether the kept measurements of `configs` all come from one measure call."""
    return len({self._best[c][2] for c in configs}) <= 1

  def kept(self, config: C) -> Measurement:
    """The measurement of `config` that the choice reads (its latest among its most
    thorough); `config` must have been measured."""
    return self._best[config][1]

  def choose(self, finalists: Iterable[C], heuristic: C | None, order: Sequence[C]) -> C:
    """The best of `finalists` (`pick_best`, `heuristic` preferred on ties); where none
    of them ran ok, the best of every config measured (`until_one_runs` found one), and
    where none of those did either, `pick_best`'s error lists each one's failure."""
    finalists = [c for c in dict.fromkeys(finalists) if self.has(c)]
    if not any(self.kept(c).ok for c in finalists):
      finalists = self.measured()
    measurements = {c: self.kept(c) for c in finalists}
    prefer = heuristic if heuristic in measurements else None
    return pick_best(measurements, prefer=prefer, order=order)

  def until_one_runs(self, candidates: Sequence[C]) -> None:
    """Where the budget ended the search before any config ran ok (a heuristic that
    timed out took it: every strategy raised "None of the 1 candidates succeeded" with
    the space unmeasured), measures the `candidates` not measured yet one at a time at
    full effort until one runs, for at most as long again as the budget or as the search
    took, whichever is longer: a search has nothing to return until one does, and past
    that a space whose configs keep failing raises as before (with 10,000 configs that
    all fail, the whole space was measured past a 5 s budget)."""
    if self.budget_s is None or any(m.ok for _, m, _ in self._best.values()):
      return
    now = self._clock()
    deadline = now + max(self.budget_s, now - self._start)
    for config in candidates:
      if self._clock() >= deadline:
        return
      if config not in self._best and self.measure([config], 1.0)[config].ok:
        return

  def outcome(self, strategy: str, best: C, num_configs: int) -> SearchOutcome[C]:
    return SearchOutcome(
        strategy=strategy, best=best,
        measurements={c: m for c, (_, m, _) in self._best.items()},
        wall_time_s=self._clock() - self._start, num_configs=num_configs)


def _split_compile(fresh: Sequence[C], got: Mapping[C, Measurement], seconds: float
                   ) -> float | None:
  """The seconds of a call's one new config's compile, where the measure reported them
  (`Measurement.compile_time_s`) and the call could have paid them; else None.

  A call's seconds are what it cost, not how: the heuristic's first call (its compile,
  0.2-0.5 s, and a full measurement, 0.3 s, of a TPU matmul) and the walk's first
  steps (a compile each, 0.15-0.8 s) left the fit free to charge the compiles that
  varied to effort, at 2-4 times its cost, and the walk stopped with a third of its
  budget left to keep for a last round priced at that (v5e, 2026-12-07). One new config
  compiles alone, so its compile is a part of the call; several compile at once, and
  their compile times overlap, so such calls are fitted whole. A measure whose compile
  cache outlives a search reports compile times that the next search did not pay: give
  each search its own (the autotuner does; its worker processes start one per search)."""
  if len(fresh) != 1 or not got[fresh[0]].ok:
    return None
  compile_s = got[fresh[0]].compile_time_s
  return compile_s if compile_s is not None and 0 <= compile_s <= seconds else None


@dataclasses.dataclass(frozen=True)
class _CostModel:
  """Seconds per measure call: call_s for the call itself (a measure's own set-up: its
  warm-up runs, a worker's round trip), fixed_s per config never measured before
  (compilation), per_effort_s per unit of effort summed over the call's configs that
  ran, and failed_s per new config that failed (from nothing to a whole compile, or a
  timeout), all times `scale`. A planned config may fail or not: predictions charge a
  new one fixed_s, and where failures cost more, the excess at the rate they happened
  (`failure_rate`), so that one timeout does not price every later config as one.

  The coefficients are fitted by least squares to the calls so far, all kept >= 0 (the
  best fit over the subsets of them that are non-negative). Where a call compiled one
  new config and the measure reported how long that took, the compile is a row of its
  own (`_split_compile`): what was seen, not left to the fit. Where the calls do not pin
  the coefficients down, several fits explain them equally well: one call; calls whose
  new configs and effort keep one ratio (the heuristic alone at full effort, then a
  walk's first step of two configs at half); two calls and a call cost. Each prices a
  call unlike them differently, and a prediction is the most costly of them
  (`alternatives`); calls like the past ones cost about what they did by each. One
  fit alone priced what the calls did not say at nothing: as all compile, a last round
  of measured configs was free, and a budget of two measurements ran to four. Costs
  can drift (a loaded machine, larger configs later in the space), and a fit over all
  the history lags behind: `scale` is how much longer than fitted the latest call took
  (at least 1), so one surprise makes the next predictions cautious at once.
  """

  fixed_s: float
  per_effort_s: float
  scale: float = 1.0
  call_s: float = 0.0
  failed_s: float = 0.0
  failure_rate: float = 0.0
  # The measure's effective effort (`Measure.effective_effort`); the calls' efforts are
  # already effective ones, and `work` maps a planned effort to one.
  effective: Callable[[float], float] = dataclasses.field(default=lambda e: e, compare=False)
  # The other fits that explain the calls as well (see the class doc).
  alternatives: tuple[_CostModel, ...] = dataclasses.field(default=(), compare=False)
  # The most one of the `_SURPRISE_CALLS` latest calls took over its fit (at least 1):
  # how far a call may still surprise.
  surprise: float = 1.0

  @classmethod
  def fit(cls, calls: Sequence[Sequence[float]],
          effective: Callable[[float], float] | None = None) -> _CostModel:
    """The model of `calls`: (new configs that ran ok, total effective effort, seconds,
    new configs that failed (optional, default 0), 1 for a call or 0 for a compile
    split from one (optional, default 1)) each."""
    if not calls:
      return cls(0.0, 0.0, effective=effective or (lambda e: e))
    x = np.array([_columns(call) for call in calls], dtype=np.float64)
    y = np.array([call[2] for call in calls], dtype=np.float64)
    best, *others = cls._least_squares(x, y)
    new = float(np.sum(x[:, 0] + x[:, 2]))
    failure_rate = float(np.sum(x[:, 2])) / new if new else 0.0
    per_call = [(sum(row[2] for row in call), sum(_columns(row) @ best for row in call))
                for call in _by_call(calls)]  # (seconds, fitted seconds)
    ratios = [seconds / f for seconds, f in per_call if f > 0]
    scale = max(1.0, per_call[-1][0] / per_call[-1][1]) if per_call[-1][1] > 0 else 1.0
    surprise = max([1.0, *ratios[-_SURPRISE_CALLS:]])
    # A failure's excess over a compile is the best fit's in every one (a failure costs
    # what it did, whichever fit explains the ok configs).
    excess = max(0.0, best[2] - best[0])
    model = lambda c, alternatives=(): cls(
        float(c[0]), float(c[1]), scale=scale, call_s=float(c[3]), failed_s=float(c[2]),
        failure_rate=failure_rate, effective=effective or (lambda e: e),
        alternatives=alternatives, surprise=surprise)
    return model(best, tuple(model([c[0], c[1], c[0] + excess, c[3]]) for c in others))

  @classmethod
  def _least_squares(cls, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The non-negative fits of smallest residual over the subsets of the coefficients
    (the others 0): the best first, then any that fit as well (an underdetermined fit
    has several). call_s enters only where fixed_s and per_effort_s alone leave the
    calls unexplained: a call term that the calls do not pin down would make new
    configs look cheaper than they have been."""
    def fits(subsets):
      found = []
      for columns in subsets:
        solution, *_ = np.linalg.lstsq(x[:, columns], y, rcond=None)
        if np.any(solution < 0):
          continue
        coefficients = np.zeros(4)
        coefficients[list(columns)] = solution
        residual = float(np.sum((x @ coefficients - y) ** 2))
        if math.isfinite(residual):  # a call timed at inf or NaN seconds explains nothing
          found.append((residual, coefficients))
      found.sort(key=lambda f: f[0])
      return found

    subsets = [(0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)]
    found = fits(subsets)
    if not found or found[0][0] > _UNEXPLAINED ** 2 * float(y @ y):
      with_call = fits([(*s, 3) for s in subsets] + [(3,)])
      if with_call and (not found or with_call[0][0] < found[0][0]):
        found = with_call
    if not found:
      return [np.zeros(4)]
    as_good = found[0][0] + _TIED_RESIDUAL * float(y @ y)
    kept: list[np.ndarray] = []
    for residual, c in found:  # one of each (a zero column gives a subset's fit twice)
      if residual <= as_good and not any(np.allclose(c, k, rtol=1e-9, atol=1e-12) for k in kept):
        kept.append(c)
    return kept

  def predict(self, new: int, effort_total: float) -> float:
    """Seconds of one call that measures `new` configs for the first time and
    `effort_total` effective effort summed over its configs (see `work`)."""
    return self.cost([(new, effort_total)])

  def cost(self, calls: Iterable[tuple[int, float]]) -> float:
    """Seconds of these calls, (new configs, effort total) each, all priced by one fit:
    the most costly fit's total (each fit's worst call may be another's cheapest)."""
    calls = list(calls)
    return max(sum(m.scale * (m.call_s + m._new_config_s() * new + m.per_effort_s * work)
                   for new, work in calls)
               for m in (self, *self.alternatives))

  def work(self, count: int, effort: float) -> float:
    """The effective effort of measuring `count` configs at `effort`, for `predict`."""
    return count * self.effective(effort)

  def new_configs_that_fit(self, room_s: float, effort: float, most: int,
                           later: Sequence[tuple[int, float]] = ()) -> int:
    """The most new configs, up to `most`, that one call at `effort` is predicted to
    measure within `room_s` seconds with the `later` calls (as for `cost`) after it
    (0 if none fits)."""
    # Rounding apart: fits that tie can differ in the last bits.
    fits = lambda k: (self.cost([(k, self.work(k, effort)), *later])
                      <= room_s + 1e-9 * abs(room_s))
    if fits(most):
      return most
    low, high = 0, most  # fits(high) is false; the cost grows with the count
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if fits(middle) else (low, middle)
    return low

  def _new_config_s(self) -> float:
    """What a new config costs beside its effort: its compile, and the excess of a
    failure's cost over it at the rate failures happened."""
    return self.fixed_s + self.failure_rate * max(0.0, self.failed_s - self.fixed_s)


def _by_call(rows: Sequence[Sequence[float]]) -> Iterator[list[Sequence[float]]]:
  """The cost log's rows (`_CostModel.fit`'s `calls`) grouped by measure call: a compile
  split from a call (`_split_compile`) is the row before the rest of it."""
  call = []
  for row in rows:
    call.append(row)
    if _columns(row)[3]:
      yield call
      call = []
  if call:
    yield call


def _columns(call: Sequence[float]) -> np.ndarray:
  """A logged call's regressors: new ok configs, effort, new failed configs, and 1 for
  the call (0 for a compile split from its call, `_split_compile`)."""
  return np.array([call[0], call[1], call[3] if len(call) > 3 else 0,
                   call[4] if len(call) > 4 else 1.0], dtype=np.float64)


def _tunables(config: Any) -> tuple[Any, ...]:
  """The names of a config's tunables: a dataclass's fields, a named tuple's fields, or a
  plain tuple's positions (0, 1, ...); () for any other config, whose tunables the
  strategies cannot tell apart (such configs are one step from each other)."""
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    return tuple(f.name for f in dataclasses.fields(config))
  if isinstance(config, tuple):
    return tuple(getattr(config, "_fields", None) or range(len(config)))
  return ()


def _is_number(value: Any) -> bool:
  """Whether a tunable's value is a number (NumPy's too: a space built from np.arange),
  whose values lie in order, not a bool or another category."""
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _is_switch(value: Any) -> bool:
  """Whether a tunable's value selects a code path: a bool or a str (NumPy's too)."""
  return isinstance(value, (bool, np.bool_, str))


def _value(config: Any, tunable: Any) -> Any:
  """The value of one of `_tunables(config)`."""
  return config[tunable] if isinstance(tunable, int) else getattr(config, tunable)


def _replaced(config: Any, changes: Mapping[Any, Any]) -> Any:
  """`config` with the tunables named in `changes` set to their values there (by
  position: a plain tuple, equal to the space's config of any tuple class)."""
  if dataclasses.is_dataclass(config):
    return dataclasses.replace(config, **changes)
  if all(isinstance(k, int) for k in changes):
    return tuple(changes.get(i, v) for i, v in enumerate(config))
  return config._replace(**changes)  # a named tuple's fields


def _shared_tunables(configs: Sequence[Any]) -> tuple[Any, ...]:
  """The tunables of `configs` where all are of one class with the same tunables; the
  positions where all are tuples of one length of several classes (a plain tuple
  heuristic over a space of named tuples, which compare equal); else ()."""
  if not configs:
    return ()
  first = configs[0]
  names = _tunables(first)
  if all(type(c) is type(first) and _tunables(c) == names for c in configs):
    return names
  if all(isinstance(c, tuple) and len(c) == len(first) for c in configs):
    return tuple(range(len(first)))
  return ()


def code_path_variants(heuristic: Any, space: Iterable[Any]) -> list[Any]:
  """For each categorical tunable of a config (a bool or str: a switch between
  code paths, e.g. a fused dQ, a split dK/dV, which warpgroup split a tile) and each value
  of it in `space` other than the heuristic's, the config of `space` with that value
  that differs from the heuristic in the fewest other tunables (the first such in the
  space's order): the heuristic with the switch flipped where the space has that.
  Tunables are a dataclass's fields, a named tuple's, or a plain tuple's positions.

  Strategies measure these right after the heuristic: under a tight budget a config
  that runs other kernel code says more than one that only changes a tile, and the
  fewer other changes, the more the difference in time is the code path's.

  Args:
    heuristic: a config; one that is neither a dataclass nor a tuple has no switches.
    space: configs of the heuristic's class with its tunables, in the space's order;
      others are passed over. Tuples of the heuristic's length but of several classes
      (a plain-tuple heuristic over a space of named tuples) are taken by positions, as
      the walk takes them (`_shared_tunables`).

  Returns:
    Distinct configs of `space`, none equal to `heuristic`, in the order of the fields
    and, per field, of the values' first appearance in the space.
  """
  space = [c for c in space if _shared_tunables([heuristic, c])]
  fields = _shared_tunables([heuristic, *space])
  distance = lambda c: sum(_value(c, f) != _value(heuristic, f) for f in fields)
  out: list[Any] = []
  for name in fields:
    value = _value(heuristic, name)
    if not _is_switch(value):
      continue
    others = dict.fromkeys(_value(c, name) for c in space if _value(c, name) != value)
    for other in others:
      nearest = min((c for c in space if _value(c, name) == other), key=distance)
      if nearest not in out:
        out.append(nearest)
  return out


def _configs(space: Iterable[C], heuristic: C | None) -> list[C]:
  """The space without duplicates with the heuristic first, then its code-path
  variants (see `code_path_variants`), then the rest in the space's order."""
  try:
    configs = list(dict.fromkeys(space))
  except TypeError as exc:
    raise TypeError(f"Configs must be hashable (frozen dataclasses, tuples): {exc}") from exc
  if heuristic is not None:
    variants = code_path_variants(heuristic, configs)
    configs = [heuristic, *variants] + [c for c in configs
                                        if c != heuristic and c not in variants]
  if not configs:
    raise ValueError("The search space is empty and there is no heuristic config: nothing to"
                     " measure. Give the op at least one config.")
  return configs


def _pool(configs: Sequence[C], heuristic: C, rng_seed: int) -> list[C]:
  """The configs after the heuristic (`_configs` order) for sampling: the heuristic's
  code-path variants first, then the rest in an order shuffled by `rng_seed`."""
  variants = code_path_variants(heuristic, configs)
  rest = [c for c in configs[1:] if c not in variants]
  random.Random(rng_seed).shuffle(rest)
  return variants + rest


def _check_chunk_size(chunk_size: int):
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"{chunk_size=} must be an int >= 1.")


def _sweep(session: _Session[C], configs: Sequence[C], chunk_size: int):
  """Measures configs in chunks at full effort, starting no chunk that would not fit
  beside a last call of two configs measured before (`_side_by_side`), where that call
  is predicted to cost at most `_SIDE_BY_SIDE_SHARE` of the budget.

  Before any call has been timed nothing predicts a cost, so the first chunk of a
  budgeted sweep is a single config, measured whatever the budget (the heuristic, which
  the outcome needs: a budget spent before the sweep began, on a loaded machine, must
  not leave it with nothing measured).
  """
  i = 0
  while i < len(configs):
    k = min(chunk_size, len(configs) - i)
    if session.budget_s is not None:
      if not session.calls:
        k = 1
      else:
        model = session.cost_model()
        later = [(0, model.work(2, 1.0))]
        if model.cost(later) > _SIDE_BY_SIDE_SHARE * session.budget_s:
          later = []
        k = model.new_configs_that_fit(session.remaining(), 1.0,
                                       min(k, _most_new(session)), later)
      if session.calls and (k == 0 or session.remaining() <= 0):
        return
    session.measure(configs[i:i + k], 1.0)
    i += k


# The most configs besides the heuristic that `_side_by_side` measures again, and in
# how many calls at most.
_SIDE_BY_SIDE: Final = 3
_SIDE_BY_SIDE_ROUNDS: Final = 2
# A budgeted sweep keeps room for `_side_by_side`'s call of two configs where that costs
# at most this fraction of the budget: where the budget holds a few configs, measuring
# one more (a code path the heuristic did not take) says more than timing two again.
_SIDE_BY_SIDE_SHARE: Final = 0.1


def _side_by_side(session: _Session[C], heuristic: C | None) -> None:
  """Where the sweep's fastest config, its rivals (the configs whose intervals reach
  the fastest's: `within_noise`, at most `_SIDE_BY_SIDE` of them) and the heuristic
  (where it ran ok) were timed in more than one measure call, measures them again
  together in one call at full effort, if that fits the budget (`_final_round`), so
  that the choice compares times taken side by side, in shuffled rounds, not times of
  calls that the machine's state may set apart. Then again, at most
  `_SIDE_BY_SIDE_ROUNDS` calls in all, where that call left another config fastest
  that was not in it (one whose own call read fast too).

  A budgeted sweep measures the heuristic alone first. On the 2-core CPU here one
  config read 33-48 ms from one process to the next, and three sweeps of one attention
  backward read its heuristic at 37-55 ms in that first call, its best at 33-35 ms
  later: 1.07-1.60x from drift alone (2026-12-07, BENCHMARKS.md).

  Not where a journal would answer some of them with another run's times (the call
  would not be side by side): the autotuner measures those together after the search
  (`autotuner._confirm_recalled`)."""
  for _ in range(_SIDE_BY_SIDE_ROUNDS):
    together = _not_yet_side_by_side(session, heuristic)
    if not together or not _final_round(session, together[:-1], together[-1], 1.0):
      return


def _not_yet_side_by_side(session: _Session[C], heuristic: C | None) -> list[C]:
  """The configs `_side_by_side` would measure together, the one to compare with last
  (the heuristic, or without one that ran ok the second fastest: `_final_round`
  falls back to the first and last); [] where they were timed together already, are
  fewer than two, or a journal would answer some."""
  close = within_noise({c: session.kept(c) for c in session.measured()})
  rivals = [c for c in close if c != heuristic][:_SIDE_BY_SIDE]
  if heuristic is not None and session.has(heuristic) and session.kept(heuristic).ok:
    together = rivals + [heuristic]
  else:  # A failed heuristic is not measured again (a timeout would cost its limit).
    together = rivals[:1] + rivals[2:] + rivals[1:2]
  if len(together) < 2 or session.timed_together(together):
    return []
  if len(session.to_pay(together, 1.0)[0]) < len(together):
    return []  # A journal would answer some: the autotuner confirms those (`_confirm_recalled`).
  return together


# --- exhaustive and random --------------------------------------------------------------


def exhaustive(space: Iterable[C], measure: Measure[C], *, heuristic: C | None = None,
               budget_s: float | None = None, chunk_size: int | None = None,
               clock: Callable[[], float] = time.perf_counter) -> SearchOutcome[C]:
  """Measures every config of the space at full effort and keeps the fastest. A sweep
  of several calls then times its fastest configs and the heuristic again in one call
  (`_side_by_side`; one or two more calls).

  Args:
    space: the configs (hashable; duplicates are measured once).
    measure: see `Measure`.
    heuristic: the untuned config; it is measured first (also when not in the space) and
      wins ties. None for no preference.
    budget_s: None measures everything; otherwise the sweep goes in chunks and stops before
      a chunk predicted to overrun (then it is not exhaustive: num_measured < num_configs),
      keeping room for the side-by-side call where it is cheap (`_SIDE_BY_SIDE_SHARE`).
    chunk_size: configs per measure call; None means one call for the whole space without
      a budget (then no side-by-side call is needed), 16 with one.
    clock: the time source.

  Returns:
    The outcome, strategy "exhaustive".

  Raises:
    AllCandidatesFailedError: if every measured config failed (with a budget, also
      those measured past it, one at a time, for a config that runs: `until_one_runs`).
    ValueError: for an empty space or bad arguments.
  """
  configs = _configs(space, heuristic)
  if chunk_size is None:
    chunk_size = len(configs) if budget_s is None else _CHUNK
  _check_chunk_size(chunk_size)
  session = _Session(measure, clock, budget_s)
  _sweep(session, configs, chunk_size)
  _side_by_side(session, heuristic)
  session.until_one_runs(configs)
  best = session.choose(session.measured(), heuristic, configs)
  return session.outcome("exhaustive", best, len(configs))


def random_search(space: Iterable[C], measure: Measure[C], *, heuristic: C,
                  num_samples: int | None = None, budget_s: float | None = None,
                  rng_seed: int = 0, chunk_size: int = _CHUNK,
                  clock: Callable[[], float] = time.perf_counter) -> SearchOutcome[C]:
  """Measures the heuristic, its code-path variants, then configs drawn at random
  without replacement; then times the fastest and the heuristic again in one call
  (`_side_by_side`), as `exhaustive` does.

  Args:
    space: the configs.
    measure: see `Measure`.
    heuristic: the untuned config, measured first so the result is never worse than it
      beyond noise; it wins ties.
    num_samples: how many configs besides the heuristic to draw at most.
    budget_s: seconds by `clock`; no chunk predicted to overrun is started. The
      heuristic's measurement is always made.
    rng_seed: seed of the draw.
    chunk_size: the most configs per measure call (with a budget, also at most
      `_GROWTH` times as many new ones as measured before: `_most_new`).
    clock: the time source.

  Returns:
    The outcome, strategy "random".

  Raises:
    ValueError: if neither num_samples nor budget_s is given, or for bad arguments.
    AllCandidatesFailedError: if every measured config failed (with a budget, also
      those measured past it, one at a time, for a config that runs: `until_one_runs`).
  """
  if num_samples is None and budget_s is None:
    raise ValueError("random_search needs num_samples, budget_s or both; it got neither.")
  if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 0):
    raise ValueError(f"{num_samples=} must be None or an int >= 0.")
  _check_chunk_size(chunk_size)
  configs = _configs(space, heuristic)
  pool = _pool(configs, heuristic, rng_seed)[:num_samples]
  session = _Session(measure, clock, budget_s)
  session.measure([heuristic], 1.0)
  _sweep(session, pool, chunk_size)
  _side_by_side(session, heuristic)
  session.until_one_runs(pool)
  best = session.choose(session.measured(), heuristic, configs)
  return session.outcome("random", best, len(configs))


# --- racing -----------------------------------------------------------------------------


def _schedule(n: int, eta: int, min_effort: float, boost: float = 1.0
              ) -> list[tuple[int, float]]:
  """(configs, effort) per round of successive halving over n configs.

  Sizes n, ceil(n / eta), ... down to at most eta; the last round has effort 1 and each
  earlier one 1/eta of the next, but at least min_effort; `boost` >= 1 multiplies the
  earlier rounds' efforts (at most 1).
  """
  sizes = [n] if n else []
  while sizes and sizes[-1] > eta:
    sizes.append(math.ceil(sizes[-1] / eta))
  last = len(sizes) - 1
  return [(size, min(1.0, boost * max(min_effort, float(eta) ** (i - last))))
          for i, size in enumerate(sizes)]


def _schedule_calls(model: _CostModel, schedule: Sequence[tuple[int, float]],
                    first_is_new: bool) -> list[tuple[int, float]]:
  """A schedule's calls, as `_CostModel.cost` prices them; its last round also
  re-measures the heuristic."""
  return [(size if (i == 0 and first_is_new) else 0,
           model.work(size + (i == len(schedule) - 1), effort))
          for i, (size, effort) in enumerate(schedule)]


def _plan(session: _Session[C], available: int, eta: int, min_effort: float
          ) -> list[tuple[int, float]]:
  """The largest race predicted to fit the remaining budget.

  First the most configs (cost is not monotone in the count: one more config can add a
  cheap round, so all counts are tried); when all of them fit, the spare budget raises
  the effort of the rounds before the last (bisection on `boost`), keeping
  _BOOST_MARGIN of the budget unplanned against prediction errors.
  """
  if not session.calls:  # nothing timed (all recalled from a journal): no race is planned
    return _schedule(0, eta, min_effort)  # blind; the walk learns the costs as it goes
  model, room = session.cost_model(), session.remaining()
  cost = lambda n, boost=1.0: model.cost(
      _schedule_calls(model, _schedule(n, eta, min_effort, boost), True))
  n = next((n for n in range(available, 0, -1) if cost(n) <= room), 0)
  spare = room * (1 - _BOOST_MARGIN)
  if n < available or cost(n) > spare:
    return _schedule(n, eta, min_effort)
  boost = _largest_fitting(lambda b: cost(n, b) <= spare, 1.0, 1.0 / min_effort)
  return _schedule(n, eta, min_effort, boost)


def _largest_fitting(fits: Callable[[float], bool], low: float, high: float) -> float:
  """The largest x in [low, high] with fits(x), to bisection's precision; fits(low) holds
  and fits is monotone (true up to some point, false after it)."""
  if fits(high):
    return high
  for _ in range(40):
    mid = (low + high) / 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low


def _affordable_effort(session: _Session[C], batch: Sequence[C], effort: float,
                       min_effort: float, later: Sequence[tuple[int, float]]) -> float | None:
  """The planned effort if the call fits the budget, else the largest that fits, else None.

  The predicted cost of the `later` rounds is kept aside.
  """
  model = session.cost_model()
  room, after = session.remaining(), _schedule_calls(model, later, False)
  # What recalling at the planned effort leaves; at a lower one the journal may answer
  # more, which this over-predicts (on the safe side).
  measured, new = session.to_pay(batch, effort)
  fits = lambda e: model.cost([(new, model.work(len(measured), e)), *after]) <= room
  if fits(effort):
    return effort
  if not fits(min_effort):  # also where effort costs nothing: then no effort fits
    return None
  return _largest_fitting(fits, min_effort, effort)  # cost grows with effort


def _screen(session: _Session[C], pool: Sequence[C], schedule: Sequence[tuple[int, float]],
            chunk_size: int) -> dict[C, Measurement]:
  """The first round: new configs in chunks, keeping budget for the rounds after it."""
  effort = schedule[0][1]
  results: dict[C, Measurement] = {}
  i = 0
  while i < len(pool):
    chunk = pool[i:i + chunk_size]
    if session.budget_s is not None:
      model = session.cost_model()
      room = session.remaining()
      chunk = chunk[:model.new_configs_that_fit(
          room, effort, min(len(chunk), _most_new(session)),
          later=_schedule_calls(model, schedule[1:], False))]
      if not chunk or room <= 0:
        break
    results |= session.measure(chunk, effort)
    i += len(chunk)
  return results


def _most_new(session: _Session[Any]) -> int:
  """The most configs a budgeted call may measure for the first time: `_GROWTH` times
  those measured so far (at least 2). A config's compile is what its new configs cost,
  and compiles vary with the config (0.2-0.8 s for a TPU matmul's tiles); priced on the
  one or two compiled so far, a chunk of 32 was a guess, and where those were cheap it
  overran the budget by up to 4x (replays with compile costs that vary, 2026-12-07)."""
  return max(2, _GROWTH * session.new_configs())


def _fastest(results: Mapping[C, Measurement], k: int, order: Sequence[C]) -> list[C]:
  """The k ok configs with the smallest medians (ties by order)."""
  rank = {c: i for i, c in enumerate(order)}
  ok = sorted((c for c, m in results.items() if m.ok), key=lambda c: (results[c].median_s, rank[c]))
  return ok[:k]


def _race(session: _Session[C], pool: list[C], heuristic: C,
          schedule: Sequence[tuple[int, float]], min_effort: float, chunk_size: int,
          order: Sequence[C]) -> list[C]:
  """Successive halving over pool; returns the configs of the last round completed."""
  finalists: list[C] = []
  results: dict[C, Measurement] = {}
  contenders = pool
  for i, (size, effort) in enumerate(schedule):
    final = i == len(schedule) - 1
    if i > 0:
      # When the round before was cut short, keep the planned fraction of what it measured.
      keep = math.ceil(size * len(results) / schedule[i - 1][0])
      contenders = _fastest(results, keep, order)
    if not contenders:
      break
    if i == 0 and not final:
      results = _screen(session, contenders, schedule, chunk_size)
    else:
      later = [(math.ceil(n * len(contenders) / size), e) for n, e in schedule[i + 1:]]
      batch = contenders + [heuristic] if final else contenders
      affordable = _affordable_effort(session, batch, effort, min_effort, later)
      if affordable is None and not final:
        # No budget for this round and the ones after it: hold the last round now.
        final, batch = True, contenders[:schedule[-1][0]] + [heuristic]
        affordable = _affordable_effort(session, batch, 1.0, min_effort, [])
      if affordable is None:
        break
      results = session.measure(batch, affordable)
    finalists = [c for c in results if c != heuristic]
    if final:
      break
  return finalists


# --- walk -------------------------------------------------------------------------------


class _Geometry:
  """How far apart two configs of a space are: for configs with tunables (`_tunables`:
  dataclasses of one class, named tuples of one class, plain tuples of one length), the
  sum over tunables of the steps between their values in that tunable's sorted values in
  the space (numbers), or 1 where other values (bool, str, ...) differ; any other configs
  are 1 apart when unequal. (Tuples had no geometry at first, and a walk over a TPU
  matmul's (block_m, block_n, block_k) tiles went at random, 2026-12-07.)

  `distances` gives a config's distance to every config of the space at once, from a
  table of each config's value ranks (numbers) or value codes (other fields): the walk
  asks it at every step, and a config at a time in Python took 45 s of a search over
  the 17,956 configs of a real GEMM sweep (BENCHMARKS.md)."""

  def __init__(self, configs: Sequence[Any]):
    self._configs = list(configs)
    self._index = {c: i for i, c in enumerate(self._configs)}
    self._fields: list[Any] = list(_shared_tunables(self._configs))
    self._ranks: dict[Any, dict[Any, int]] = {}
    for name in self._fields:
      values = {_value(c, name) for c in configs}
      if all(_is_number(v) for v in values):
        self._ranks[name] = {v: i for i, v in enumerate(sorted(values))}
    # One column per field: the value's rank (a number field) or a code of its own (any
    # other field, whose values are only equal or not).
    columns = [self._ranks.get(name) or {v: i for i, v in enumerate(
        dict.fromkeys(_value(c, name) for c in configs))} for name in self._fields]
    self._table = np.array([[column[_value(c, name)] for name, column in zip(self._fields, columns)]
                            for c in self._configs], dtype=np.int64)
    self._table = self._table.reshape(len(self._configs), len(self._fields))
    self._numeric = np.array([name in self._ranks for name in self._fields], dtype=bool)

  def distance(self, a: Any, b: Any) -> int:
    if not self._fields:
      return int(a != b)
    total = 0
    for name in self._fields:
      x, y = _value(a, name), _value(b, name)
      ranks = self._ranks.get(name)
      total += abs(ranks[x] - ranks[y]) if ranks is not None else int(x != y)
    return total

  def distances(self, a: Any) -> np.ndarray:
    """The distance from `a`, a config of the space, to each config of the space, in the
    order the geometry was given them."""
    if not self._fields:
      return (np.arange(len(self._configs)) != self._index[a]).astype(np.int64)
    row = self._table[self._index[a]]
    steps = np.where(self._numeric, np.abs(self._table - row), self._table != row)
    return steps.sum(axis=1)

  def fields_changed(self, a: Any) -> np.ndarray:
    """In how many fields each config of the space differs from `a`, a config of the
    space (configs without shared tunables: 1 for each other config)."""
    if not self._fields:
      return self.distances(a)
    return (self._table != self._table[self._index[a]]).sum(axis=1)

  def index(self, config: Any) -> int:
    """The position of `config` in the configs the geometry was given."""
    return self._index[config]

  def changed_field(self, a: Any, b: Any) -> Any:
    """The one tunable in which `b` differs from `a`, or None."""
    changed = [f for f in self._fields if _value(a, f) != _value(b, f)]
    return changed[0] if len(changed) == 1 else None


def _walk(session: _Session[C], configs: Sequence[C], heuristic: C, first: Sequence[C], *,
          effort: float, finalists: int, final_effort: float, chunk_size: int,
          rng_seed: int) -> list[C]:
  """Neighbourhood search from the heuristic, for a budget too small to screen the
  space; returns the `finalists` fastest configs it screened.

  Where compiling a config costs more than measuring it, screening even a cheap first
  round of the whole space does not fit a small budget, and a random part of it seldom
  holds the best config. The walk measures where the best is likely instead: near the
  fastest config so far. Each step screens, at `effort`, the configs not yet measured
  that lie nearest the incumbent (`_Geometry`; `first`, e.g. the heuristic's code-path
  variants, in the first step), at most `chunk_size`, ties in an order shuffled by
  `rng_seed`, together with the incumbent, so each comparison is within one interleaved
  call. Where neighbours one step away improved on the incumbent in several fields, the
  config combining those changes is screened next with the best of them (a pattern move:
  fields that act apart are all moved at once). The fastest of a step becomes the
  incumbent. Once no config within `_LOCAL_STEPS` steps of the incumbent is left
  unmeasured (it is a local optimum), the steps screen the unmeasured configs that differ
  from it in one tunable only, whatever the value, then unmeasured configs in the shuffled
  order, until one beats the incumbent (basin hopping: on real sweeps whose best config
  stands far from the next good ones, rings farther out in the first basin found nothing
  better; BENCHMARKS.md). The first step measures one new config, so that the cost model tells
  compiling from measuring before it plans a batch (where the calls before it cannot
  tell them apart, it is made if it fits the budget alone, see `step`). The walk ends
  when every config was measured or the next step does not fit the budget less the
  predicted cost of measuring the finalists and the heuristic at `final_effort`, or at
  full effort where that costs at most `_FINAL_SHARE` of the budget (the last round then
  takes what is left, up to full effort). On a large space the walk used to spend the
  budget down to a last round of a third of the samples, which could not tell a config
  2-3% faster than the heuristic from it beyond noise (1% a sample; BENCHMARKS.md's
  dedispersion sweep).
  """
  geometry, space = _Geometry(configs), set(configs)
  rng = random.Random(rng_seed)
  tie_order = {c: i for i, c in enumerate(rng.sample(list(configs), len(configs)))}
  ties = np.array([tie_order[c] for c in configs])
  unmeasured = np.array([not session.has(c) for c in configs], dtype=bool)
  screened: dict[C, float] = {}  # config -> its screening median
  incumbent, batch = heuristic, [c for c in first if c != heuristic]

  def step(candidates: list[C], probe: bool) -> dict[C, Measurement] | None:
    model = session.cost_model()
    final_call = lambda e: (0, model.work(finalists + 1, e))
    cap = _FINAL_SHARE * session.budget_s
    last = (_largest_fitting(lambda e: model.cost([final_call(e)]) <= cap, final_effort, 1.0)
            if model.cost([final_call(final_effort)]) <= cap else final_effort)
    # A probe's calls before it cannot tell compiling from measuring when several fits
    # explain them, and no reserve planned on them holds (one prices the probe dear and
    # the last round cheap, another the other way round). The probe is made where it
    # fits alone; the last round is planned on what it tells (`_final_round`).
    reserve = [] if probe and model.alternatives else [final_call(last)]
    room = session.remaining()
    # A step is sized as if it took the most over its prediction that a call has taken
    # (`surprise`): new configs cost what their compiles do, which vary (0.2-0.8 s a
    # config for a TPU matmul's tiles), and the model learns a chunk's cost only after
    # the call (two chunks of 20 new configs in one run took 2.2 and 3.5 s: 16% over).
    spare = room - model.cost(reserve)
    call = lambda k: (k, model.work(k + 1, effort))  # k new configs and the incumbent
    surprise = model.surprise / model.scale  # (the cost has the last call's in it)
    candidates = candidates[:_most_new(session)]
    while candidates and (
        model.cost([call(len(candidates)), *reserve]) > room
        or (len(candidates) > 1 and surprise * model.cost([call(len(candidates))]) > spare)):
      candidates = candidates[:-1]
    if not candidates:
      return None
    got = session.measure([*candidates, incumbent], effort)
    unmeasured[[geometry.index(c) for c in got]] = False
    screened.update({c: m.median_s for c, m in got.items() if m.ok})
    return got

  def in_tie_order(candidates: np.ndarray) -> list[C]:
    chosen = candidates[np.argsort(ties[candidates], kind="stable")[:chunk_size]]
    return [configs[i] for i in chosen]

  while True:
    if not batch:
      if not unmeasured.any():
        break
      distances = geometry.distances(incumbent)
      nearest = distances[unmeasured].min()
      if nearest > _LOCAL_STEPS:
        # The incumbent beat every config up to _LOCAL_STEPS steps away: a local optimum.
        # Rings farther out in its basin seldom hold a better config than the rest of the
        # space does (a real sweep's best can stand alone, far from the next good ones).
        # First each tunable alone across all its values (the lines through the
        # incumbent: on real sweeps one tunable's good values are often far apart, as a
        # block size that divides the problem), then at random, until some config beats
        # the incumbent; the walk goes on from there.
        lines = unmeasured & (geometry.fields_changed(incumbent) == 1)
        batch = in_tie_order(np.flatnonzero(lines if lines.any() else unmeasured))
      else:
        batch = in_tie_order(np.flatnonzero(unmeasured & (distances == nearest)))
    # The first step compiles one config: the heuristic's calls alone cannot tell the
    # cost of compiling from that of measuring, so a batch planned on them may overrun.
    probe = session.calls_with_new() <= 1
    got = step(batch[:1] if probe else batch, probe)
    if got is None:
      break
    base = got[incumbent].median_s if got[incumbent].ok else math.inf
    better = {c: m.median_s for c, m in got.items() if m.ok and m.median_s < base}
    batch = [c for c in batch if not session.has(c)]  # what a cut step left
    if better:
      batch = []
      best = min(better, key=better.get)
      moves: dict[Any, tuple[float, Any]] = {}
      for c, t in better.items():
        field = geometry.changed_field(incumbent, c)
        if field is not None and (field not in moves or t < moves[field][0]):
          moves[field] = (t, _value(c, field))
      combined = (_replaced(incumbent, {f: v for f, (_, v) in moves.items()})
                  if len(moves) > 1 else None)
      incumbent = best
      if combined in space and not session.has(combined):
        batch = [configs[geometry.index(combined)]]  # the space's own (a tuple subclass's)
  ranked = sorted(screened, key=lambda c: (screened[c], tie_order[c]))
  return [c for c in ranked if c != heuristic][:finalists]


def racing(space: Iterable[C], measure: Measure[C], *, heuristic: C,
           budget_s: float | None = None, rng_seed: int = 0, eta: int = 3,
           min_effort: float = 1 / 81, chunk_size: int = 32,
           clock: Callable[[], float] = time.perf_counter) -> SearchOutcome[C]:
  """Budgeted successive halving: many configs measured cheaply, few thoroughly.

  1. The heuristic is measured at full effort: the baseline, so the result is never
     worse than untuned beyond noise, and the first data point of the cost model.
     With a budget it is measured again at `min_effort`, which tells apart the cost of a
     config's first measurement (compilation) from the cost per unit of effort.
  2. The pool: the heuristic's code-path variants (`code_path_variants`), then the
     other configs in an order shuffled by `rng_seed`. When the cost model (see
     `_CostModel`) predicts that the whole pool's race fits the budget, it is raced; with
     time to spare, the rounds before the last are measured more thoroughly (their
     efforts multiplied by one factor, up to 1) to use it. When it does not fit (a large
     space, or compiling a config costs more than measuring it), a random part of the
     space seldom holds the best config: a walk from the heuristic (`_walk`) screens the
     configs nearest the fastest one so far at effort 1/eta^3, keeping enough budget
     for its eta fastest to go to a last round with the heuristic at effort 1/eta (full
     effort where that is a small part of the budget, `_FINAL_SHARE`), which then takes
     what is left, up to full effort; steps 3 and 4 are skipped. (Its first step, one
     new config, keeps nothing back where the calls before it cannot tell compiling from
     measuring: the last round may then not fit, and the screening measurements decide.)
  3. Rounds of successive halving: sizes n, ceil(n / eta), ... down to at most eta
     configs; the last round has effort 1 and each earlier one 1/eta of the next (at least
     `min_effort`). Each round keeps the fastest configs of the one before (failed ones
     never go on); the last round measures them together with the heuristic.
  4. Budget: before every call the cost model is refitted, and a call is made only when
     its predicted cost fits what is left after the predicted cost of the rounds after it
     (as planned, scaled to the configs actually left). The first round goes in chunks and
     stops when the next chunk does not fit; a later round that does not fit runs at the
     largest effort that does (at least `min_effort`), and when none does, the last round
     is held at once with the fastest configs so far. So the search ends within the budget
     as far as a call's cost can be predicted from the calls before it; the heuristic's
     first measurement is always made; where it failed and nothing has run ok, configs
     are measured past the budget until one does (`_Session.until_one_runs`).
  5. The choice: `pick_best` over the last completed round and the heuristic, with the
     heuristic preferred on ties.

  Args:
    space: the configs.
    measure: see `Measure`.
    heuristic: the untuned config (measured even when not in the space).
    budget_s: seconds by `clock`, or None to race the whole space.
    rng_seed: seed of the pool's order.
    eta: each round keeps 1/eta of the configs at eta times the effort; an int >= 2.
    min_effort: the smallest effort of a round, in (0, 1].
    chunk_size: the most configs per measure call in the first round (with a budget,
      also at most `_GROWTH` times as many new ones as measured before: `_most_new`).
    clock: the time source.

  Returns:
    The outcome, strategy "racing".

  Raises:
    AllCandidatesFailedError: if every measured config failed (with a budget, also
      those measured past it, one at a time, for a config that runs: `until_one_runs`).
    ValueError: for an empty space or bad arguments.
  """
  if not isinstance(eta, int) or eta < 2:
    raise ValueError(f"{eta=} must be an int >= 2 (the fraction 1/eta survives each round).")
  if not 0 < min_effort <= 1:
    raise ValueError(f"{min_effort=} must be in (0, 1].")
  _check_chunk_size(chunk_size)
  configs = _configs(space, heuristic)
  session = _Session(measure, clock, budget_s)
  session.measure([heuristic], 1.0)
  pool = _pool(configs, heuristic, rng_seed)  # Variants lead: a cut pool keeps them.
  if budget_s is None:
    schedule = _schedule(len(pool), eta, min_effort)
  else:
    # The heuristic again at the least effort, so that the cost model tells effort from
    # compilation; made only where the budget left could pay for a call like the first
    # (its fixed cost, a worker's round trip or a warm-up, is not known yet), or where the
    # first was recalled from a journal and nothing was timed.
    first = next(iter(session.call_seconds), None)
    if pool and (first is None or session.remaining() > first):
      session.measure([heuristic], min_effort)
    schedule = _plan(session, len(pool), eta, min_effort)
  if budget_s is not None and (not schedule or schedule[0][0] < len(pool)):
    variants = code_path_variants(heuristic, configs)
    walked = _walk(session, configs, heuristic, variants, effort=max(min_effort, eta ** -3.0),
                   finalists=eta, final_effort=max(min_effort, 1.0 / eta),
                   chunk_size=chunk_size, rng_seed=rng_seed)
    # Where only the fastest was measured again, the others keep one-sample screenings
    # and are not chosen on them.
    finalists = _final_round(session, walked, heuristic, min_effort) or walked
  else:
    raced = pool[:schedule[0][0]] if schedule else []
    finalists = _race(session, raced, heuristic, schedule, min_effort, chunk_size, configs)
  session.until_one_runs(pool)
  best = session.choose([heuristic, *finalists], heuristic, configs)
  return session.outcome("racing", best, len(configs))


def _final_round(session: _Session[C], finalists: list[C], heuristic: C,
                 min_effort: float) -> list[C]:
  """Measures the finalists (fastest first) with the heuristic at full effort, or the
  most effort that fits (at least min_effort); without room for all of them, the
  fastest alone with the heuristic at the most effort that fits; without room for
  that, they keep the measurements they have.

  The fastest alone: a walk that ran out of room for the whole round chose on its
  fastest finalist's one-sample measurement, taken once, and one sample can be 10%
  off on a TPU: it took a config 6% slower than the heuristic (a v5e matmul at 10% of
  its sweep's time, 2026-12-07). Measured again, a lucky sample is not kept as its
  time (a config keeps its latest measurement among its most thorough ones).

  Returns:
    The finalists measured again ([] where none was).
  """
  for batch in ([*finalists, heuristic], finalists[:1] + [heuristic]):
    if len(batch) < 2:
      return []
    effort = _affordable_effort(session, batch, 1.0, min_effort, [])
    if effort is not None:
      session.measure(batch, effort)
      return batch[:-1]
  return []


def default_strategy(space_size: int, *, max_exhaustive: int = MAX_EXHAUSTIVE) -> Strategy:
  """The strategy for a space of this size: exhaustive when small, racing when large.

  Args:
    space_size: number of configs in the space.
    max_exhaustive: the largest space measured exhaustively.

  Returns:
    `exhaustive` or `racing`.

  Raises:
    ValueError: if space_size is negative.
  """
  if not isinstance(space_size, int) or space_size < 0:
    raise ValueError(f"{space_size=} must be an int >= 0.")
  return exhaustive if space_size <= max_exhaustive else racing


# --- replay -----------------------------------------------------------------------------


class ReplayMeasure(Generic[C]):
  """A `Measure` that replays a recorded sweep and advances a fake clock.

  Each call returns, for every config, its recorded failure as recorded, or a fresh
  measurement of its recorded time: k = ceil(rounds * effort) samples, each the recorded
  time times exp(noise * z), z standard normal (so the noise is multiplicative and its
  median is the recorded time), summarised by `median_interval`. The clock advances by
  call_cost_s per call, compile_cost_s the first time a config is measured, plus
  cost_s_per_config * effort per config per call: measuring the sweep at full effort in
  one call costs call_cost_s + len(recorded) * (compile_cost_s + cost_s_per_config)
  (with a compile_cost_s per config, their sum instead of len(recorded) times one).
  With `whole_rounds`, a config costs its samples instead, cost_s_per_config * k / rounds,
  as measure_candidates' do (at least one round), and `effective_effort` says so. An ok
  measurement reports its config's compile_cost_s as its `compile_time_s`, as
  measure_candidates does (also for a config compiled in an earlier call).

  Args:
    recorded: config -> seconds per call, or a Measurement (a failure, or an ok one whose
      median is used).
    noise: relative standard deviation of one sample; 0 replays exactly.
    seed: seed of the noise.
    cost_s_per_config: fake seconds of a full-effort measurement of one config.
    compile_cost_s: fake seconds added the first time a config is measured; or a
      mapping config -> those seconds, each config its own (real compiles vary with the
      config: 0.2-0.8 s for a TPU matmul's tiles).
    call_cost_s: fake seconds of every call, whatever it measures (a measure's own
      set-up).
    rounds: samples of a full-effort measurement.
    whole_rounds: charge whole samples (k / rounds) instead of effort; see above.

  Raises:
    ValueError: for an empty sweep, a time that is not positive, or bad arguments.
  """

  def __init__(self, recorded: Mapping[C, float | Measurement], *, noise: float = 0.0,
               seed: int = 0, cost_s_per_config: float = 1.0,
               compile_cost_s: float | Mapping[C, float] = 0.0,
               call_cost_s: float = 0.0, rounds: int = 10, whole_rounds: bool = False):
    if not recorded:
      raise ValueError("The recorded sweep is empty: give config -> seconds or Measurement.")
    compiles = (dict(compile_cost_s) if isinstance(compile_cost_s, Mapping)
                else dict.fromkeys(recorded, compile_cost_s))
    missing = [c for c in recorded if c not in compiles]
    if missing:
      raise ValueError(f"compile_cost_s has no seconds for {missing[:5]!r}: give every config"
                       " of the sweep its own, or one number for all.")
    for name, value in (("noise", noise), ("cost_s_per_config", cost_s_per_config),
                        ("call_cost_s", call_cost_s),
                        *((f"compile_cost_s[{c!r}]", compiles[c]) for c in recorded)):
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value} must be a finite number >= 0.")
    if not isinstance(rounds, int) or rounds < 1:
      raise ValueError(f"{rounds=} must be an int >= 1.")
    self._recorded = {c: self._entry(c, v) for c, v in recorded.items()}
    self._noise, self._rounds = noise, rounds
    self._cost_s, self._compile_cost_s = cost_s_per_config, compiles
    self._call_cost_s, self._whole_rounds = call_cost_s, whole_rounds
    self._rng = np.random.default_rng(seed)
    self._now = 0.0
    self._seen: set[C] = set()
    self.num_calls = 0

  @staticmethod
  def _entry(config: C, value: float | Measurement) -> float | Measurement:
    if isinstance(value, Measurement):
      return value.median_s if value.ok else value
    if not (math.isfinite(value) and value > 0):
      raise ValueError(f"Recorded time {value!r} of {config!r} must be a positive number of"
                       " seconds; record failures as Measurement(status=..., error=...).")
    return float(value)

  def clock(self) -> float:
    """The fake time: seconds of measuring so far."""
    return self._now

  def _samples(self, effort: float) -> int:
    return math.ceil(self._rounds * effort)

  def effective_effort(self, effort: float) -> float:
    """The fraction of a full measurement's cost that `effort` costs a config (see the
    class docstring); the Measure attribute of the same name (module docstring)."""
    return self._samples(effort) / self._rounds if self._whole_rounds else effort

  def __call__(self, configs: Sequence[C], /, *, effort: float = 1.0) -> dict[C, Measurement]:
    """Replays the measurement of configs; see the class docstring.

    Args:
      configs: configs of the recorded sweep.
      effort: fraction of a full measurement, in (0, 1].

    Returns:
      config -> Measurement.

    Raises:
      ValueError: for a config not in the sweep or an effort outside (0, 1].
    """
    if not 0 < effort <= 1:
      raise ValueError(f"{effort=} must be in (0, 1].")
    unknown = [c for c in configs if c not in self._recorded]
    if unknown:
      raise ValueError(f"{unknown[:5]!r} are not in the recorded sweep; measure only its configs.")
    self.num_calls += 1
    self._now += self._call_cost_s
    out = {}
    for config in configs:
      self._now += (self._cost_s * self.effective_effort(effort)
                    + (0.0 if config in self._seen else self._compile_cost_s[config]))
      self._seen.add(config)
      out[config] = self._replay(self._recorded[config], effort, self._compile_cost_s[config])
    return out

  def _replay(self, value: float | Measurement, effort: float, compile_s: float) -> Measurement:
    if isinstance(value, Measurement):
      return value
    n = self._samples(effort)
    samples = value * np.exp(self._noise * self._rng.standard_normal(n))
    median, low, high = median_interval(samples)
    return Measurement(status="ok", median_s=median, ci_low_s=low, ci_high_s=high,
                       num_samples=n, compile_time_s=compile_s, method="replay")
