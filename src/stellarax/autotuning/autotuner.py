"""`autotune()` and `Autotuner`: find the fastest config of every op call.

`stellarax.autotune(f, *args, **kwargs)` is `Autotuner().autotune(f, *args,
**kwargs)`: every keyword argument goes to `f`, never to the tuner. Tuning
options live on an `Autotuner` instance:

    tuner = stellarax.Autotuner(strategy="racing", budget_s=30, progress=False)
    result = tuner.autotune(f, x, y)

What can be tuned: a callable with its arguments (a plain or jitted function,
or a closure taking none, e.g. `jax.grad` of a model), a `jax.stages.Traced` or `Lowered`,
a `BoundArguments` or a sequence of them, or bound-argument JSON (a path or a
string, e.g. from `xplane_to_bound_args`).

For each unique call: build fresh random inputs from its abstract arguments,
compute the op's reference output once, and let the search strategy measure
configs through `measure.measure_candidates` (compile in parallel, check
every output against the reference, time device work in interleaved rounds).
The best config, every measurement and the heuristic's go into the result.

A call that cannot be tuned (every config failed) does not stop the others: once
every call was tried, `IncompleteTuningError` names the ones that failed and
carries the rest in `partial_result`. With `cache=True` each call's entry goes
into the user cache as soon as it is tuned, so an interrupted run keeps what it
measured, and running it again tunes only the calls still missing; within a call,
its journal (journal.py) keeps each config as it is measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from stellarax.autotuning import capture
from stellarax.autotuning import isolation
from stellarax.autotuning import journal as journal_lib
from stellarax.autotuning import measure as measure_lib
from stellarax.autotuning import profile
from stellarax.autotuning import search
from stellarax.autotuning.cache import (USER_CACHE, CacheWriteWarning, cached_results,
                                       current_device_kind, device_kind_slug,
                                       target_device_kind)
from stellarax.autotuning.progress import Progress
from stellarax.autotuning.result import AutotuningResult, Entry, OtherDeviceWarning, merge_entries
from stellarax.core import registry
from stellarax.core import resolution
from stellarax.core.bound_args import BoundArguments
from stellarax.core.config import config_to_json
from stellarax.core.fingerprint import code_fingerprint
from stellarax.core.specs import canonical_json
from stellarax.core.warn import warn

STRATEGIES = ("auto", "exhaustive", "racing", "random")
# What a call's tuning took, spent from a total budget (`BudgetPool`); tests replace it.
_clock = time.monotonic
# Lines of each failed call's error shown in an IncompleteTuningError's message.
_SHOWN_ERROR_LINES = 40


class IncompleteTuningError(ValueError):
  """Some op calls could not be tuned; the others were.

  Attributes:
    partial_result: an `AutotuningResult` with every call that was tuned (with
      `cache=True` these are in the user cache too).
    not_tuned: the calls missing from `partial_result`, in the order they were tried.
    errors: call -> the text of the error its tuning raised.
  """

  def __init__(self, message: str, *, partial_result: AutotuningResult,
               not_tuned: Sequence[BoundArguments], errors: Mapping[BoundArguments, str]):
    super().__init__(message)
    self.partial_result = partial_result
    self.not_tuned = tuple(not_tuned)
    self.errors = dict(errors)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Autotuner:
  """Tuning options; `.autotune(...)` runs them.

  Attributes:
    strategy: "auto" (exhaustive for small spaces, racing for large),
      "exhaustive", "racing", "random", or a function
      `(space, measure, *, heuristic, budget_s) -> search.SearchOutcome`.
    budget_s: wall-time budget per op call for budgeted strategies (None:
      the strategy's default).
    total_budget_s: a wall-time budget for the whole run instead, shared by the
      calls to tune (those not reused from a cache) in proportion to what each is
      worth: its device time in the profile when `f` is `xplane_to_bound_args`
      output, or, for a callable with array arguments, in a profile of three runs
      of `f` at the configs it would use now (taken first, outside the budget;
      `profile.device_time_per_call`); equally where there is no profile: bound
      arguments or abstract arguments (silently), or a profile that failed (with a
      warning). A
      call's other implementations, with implementations="all", share its weight;
      a call a profile shows at no time weighs a hundredth of the heaviest. The
      calls are tuned heaviest first, so an interrupted run has tuned what
      mattered most, and each takes its weight's share of what is left
      (`BudgetPool`): what one leaves unspent (a small space searched whole)
      goes to the calls after it. Distributed over N devices, the calls share N times it,
      about `total_budget_s` of wall time (`distributed.py`, step 2). Not with
      `budget_s`.
    implementations: "resolved" tunes the implementation each call uses;
      "all" also tunes every other implementation of the op family that runs
      on this device (so `implementation=None` can pick the fastest).
    progress: print a progress bar (configs measured, time left).
    ignore_cache: re-measure calls already in the user or library cache
      (otherwise their cached entries are reused as they are, unless they are
      stale: measured under other stellarax/jax/jaxlib versions or timing
      revision, or on other code of their op, `Entry.stale_reason`; those are
      measured again). With `cache=True`, the new entries replace the user
      cache's (a merge would keep the faster of old and new, and a lucky old
      time would never be replaced), and a call whose measuring again was
      interrupted resumes from what it measured when run again with
      ignore_cache (not from an ordinary tuning's journal).
    cache: write each call's entry into the user cache as soon as it is tuned
      (an interrupted or failed run keeps what it measured; the next run reads
      those calls from the cache unless ignore_cache), and each measured config
      of a call into its journal (journal.py), so that a call interrupted while
      tuned resumes from the configs it measured; distributed tuning also writes
      the calls other processes tuned, when all are done.
    prune: `(bound_args, configs) -> the configs to measure`, called with each call's
      space before it is searched (as Triton's `prune_configs_by`): a way to search
      less, e.g. only num_stages <= 3, without changing the op. The heuristic config
      is measured whatever it returns (it is the baseline every other config must
      beat); the entry's method then ends with "pruned <kept>/<space>".
    reproducible: measure and choose only configs whose outputs are bit-identical
      run after run (`Op._is_reproducible`: no atomic adds); None follows the mode
      where `autotune` is called (`stellarax.autotuning.reproducible_scope`, on
      where XLA_FLAGS turn on --xla_gpu_deterministic_ops). A cached entry is then
      reused only where it measured such a config.
    measure_options: how each config is measured.
    seed: seed of the random inputs.
    distribute: when the program runs several JAX processes or this process
      has several local devices of its kind, split the calls among all those
      devices and give every process the same result (see
      `distributed.py`); False tunes every call here, on the default device.
    distributed_timeout_s: when distributing, how long to wait for another
      process's plan, or for its next tuned call while some of its share is
      missing, before reporting it as failed; it must exceed the longest
      tuning of one call.
    isolate: measure in worker processes, so that a config that hangs on the
      device is recorded as a timeout and tuning goes on in a fresh process
      (see `isolation.py`); costs a few seconds to start each worker, which
      `budget_s` does not count (nor the call's inputs and reference, as in
      this process).

  Raises:
    ValueError: when made with an unknown `strategy` or `implementations`, a budget
      or `distributed_timeout_s` that is not a positive finite number, both
      `budget_s` and `total_budget_s`, or `strategy="random"` with no budget.
    TypeError: when made with a flag that is not a bool, a `prune` that is not
      callable, `measure_options` that are not a `MeasureOptions`, or a `seed` that
      is not an int.
  """

  strategy: str | Callable[..., Any] = "auto"
  budget_s: float | None = None
  total_budget_s: float | None = None
  implementations: str = "resolved"
  progress: bool = True
  ignore_cache: bool = False
  cache: bool = False
  reproducible: bool | None = None
  prune: Callable[[BoundArguments, list[Any]], Any] | None = None
  measure_options: measure_lib.MeasureOptions = dataclasses.field(default_factory=measure_lib.MeasureOptions)
  seed: int = 0
  distribute: bool = True
  distributed_timeout_s: float = 1800.0
  isolate: bool = False

  def __post_init__(self):
    if not (callable(self.strategy)
            or (isinstance(self.strategy, str) and self.strategy in STRATEGIES)):
      raise ValueError(f"strategy={self.strategy!r} must be one of {STRATEGIES} or a search "
                       "function (see stellarax.autotuning.search).")
    if self.implementations not in ("resolved", "all"):
      raise ValueError(f"implementations={self.implementations!r} must be 'resolved' or 'all'.")
    for name in ("budget_s", "total_budget_s", "distributed_timeout_s"):
      value = getattr(self, name)
      if value is None and name != "distributed_timeout_s":
        continue
      if not (_is_real(value) and 0 < value < float("inf")):
        none = "" if name == "distributed_timeout_s" else " or None"
        raise ValueError(f"{name}={value!r} must be a positive number of seconds{none}.")
    if self.budget_s is not None and self.total_budget_s is not None:
      raise ValueError(f"budget_s={self.budget_s!r} (per call) and total_budget_s="
                       f"{self.total_budget_s!r} (shared by all calls) exclude each other;"
                       " pass one of them.")
    if self.strategy == "random" and self.budget_s is None and self.total_budget_s is None:
      raise ValueError(
          "strategy='random' draws configs until its budget is spent, and no budget was given: "
          "pass budget_s (per call) or total_budget_s, or draw a number of configs with "
          "strategy=functools.partial(stellarax.autotuning.search.random_search, num_samples=N).")
    for name in ("progress", "ignore_cache", "cache", "distribute", "isolate"):
      if not isinstance(getattr(self, name), bool):  # "no" would be true
        raise TypeError(f"Autotuner({name}={getattr(self, name)!r}): pass True or False.")
    if self.reproducible is not None and not isinstance(self.reproducible, bool):
      raise TypeError(f"Autotuner(reproducible={self.reproducible!r}): pass True, False or None.")
    if self.prune is not None and not callable(self.prune):
      raise TypeError(f"Autotuner(prune={self.prune!r}): pass a function (bound_args, configs) "
                      "-> the configs to measure, or None.")
    if not isinstance(self.measure_options, measure_lib.MeasureOptions):
      raise TypeError(f"Autotuner(measure_options={self.measure_options!r}): pass a "
                      "stellarax.autotuning.MeasureOptions(...), e.g. MeasureOptions(rounds=5).")
    if not isinstance(self.seed, int) or isinstance(self.seed, bool):
      raise TypeError(f"Autotuner(seed={self.seed!r}): pass an int.")

  # ---- inputs -----------------------------------------------------------

  def collect(self, f: Any, /, *args, **kwargs) -> list[BoundArguments]:
    """The calls `autotune` would tune, without tuning them.

    Args:
      f: what `autotune` takes: a callable, `jax.stages.Traced` or `Lowered`, `BoundArguments`,
        a sequence of them, or bound-argument JSON (path or string).
      *args, **kwargs: the arguments of `f` when it is a callable (it is traced,
        not run).

    Returns:
      A list of unique `BoundArguments` without configs: the op calls found (with
      every other implementation of each when `implementations="all"`), leaving
      out calls that run no kernel (an empty dimension).

    Raises:
      TypeError: when `f` is none of the accepted inputs, or a callable's arguments
        do not fit it (as tracing it raises).
      ValueError: for bound-argument JSON that is not valid.
      OSError: for a JSON path that cannot be read (FileNotFoundError, ...).
    """
    return self._to_tune(_found_calls(f, args, kwargs)[0])

  def _to_tune(self, found: Sequence[BoundArguments]) -> list[BoundArguments]:
    """The unique calls to tune among those found, without configs."""
    # A call whose output is zeros whatever its inputs runs no kernel: nothing to tune.
    found = [ba.with_config(None) for ba in found if not ba.op._is_trivial(ba.arguments)]
    if self.implementations == "all":
      found = found + [alt for ba in found for alt in _alternatives(ba)]
    return capture.unique(found)

  # ---- tuning -----------------------------------------------------------

  def autotune(self, f: Any, /, *args, **kwargs) -> AutotuningResult:
    """Tunes every op call found in `f` (see the module docstring).

    Args:
      f: a callable, `jax.stages.Traced` or `Lowered`, `BoundArguments`, a sequence of
        them, or bound-argument JSON (path or string).
      *args, **kwargs: the arguments of `f` when it is a callable.

    Returns:
      An `AutotuningResult` with one entry per unique op call.

    Raises:
      IncompleteTuningError: (a ValueError) when some call could not be tuned,
        e.g. every config of it failed; it names each such call with its error
        and carries the other calls in `partial_result`.
      distributed.DistributedTuningError: (an IncompleteTuningError) when
        distributing, if a process stalled or some call failed.
      TypeError: for traced arguments (autotune called inside jit, vmap, grad), or
        for a tuning option among f's keyword arguments that f does not take.
      KeyboardInterrupt: on Ctrl-C, as always; it carries the calls tuned so far in
        its `partial_result` attribute (when tuning in this process).
      measure.DeviceLostError: (a RuntimeError) when, measuring in this process, a
        config lost the device (an illegal memory access, a trap): nothing more can
        run here; it names the config, suggests `isolate=True`, and carries the calls
        tuned before in `partial_result`.

    Warns:
      NothingToTuneWarning: when a callable, Traced, Lowered or JSON holds no op call (the
        result is then empty); an empty sequence of BoundArguments does not warn.
    """
    _check_not_traced(args, kwargs)
    _check_no_tuning_options(f, kwargs)
    if self.reproducible is None:  # the caller's mode, for the threads that tune too
      tuner = dataclasses.replace(self, reproducible=resolution.reproducible())
      return tuner.autotune(f, *args, **kwargs)
    found, profiled = _found_calls(f, args, kwargs)
    calls = self._to_tune(found)
    if not calls and not _is_bound_args(f):
      warn(_nothing_found(f, len(found)), NothingToTuneWarning)
    from stellarax.autotuning import distributed  # It imports this module.
    todo = [ba for ba in calls if self._reusable_entry(ba) is None]
    # Weighing a callable's calls runs it: not when every call comes from a cache.
    weights = self._weights(f, calls, args, kwargs, profiled) if todo else {}
    if not (self.distribute and distributed.should_distribute()):
      return self._tune_here(calls, weights)
    try:
      result = distributed.tune_distributed(self, calls, timeout_s=self.distributed_timeout_s,
                                            weights=weights)
    except IncompleteTuningError as exc:
      self._keep(exc.partial_result)
      self._warn_if_starved(exc.partial_result, todo)
      raise
    self._keep(result)
    self._warn_if_starved(result, todo)  # as a run on one device does (`_tune_here`)
    return result

  def _warn_if_starved(self, result: AutotuningResult, tuned: Sequence[BoundArguments],
                       mean_s: float | None = None) -> None:
    """Warns (`SmallBudgetWarning`) where a budget let calls of `tuned` (those not
    reused from a cache) measure only their heuristic config."""
    if self.budget_s is None and self.total_budget_s is None:
      return  # with no budget a strategy measures its whole space
    entries = [result.entry(ba) for ba in tuned]
    starved = sum(e is not None and e.starved(self._accept(e.bound_args)) for e in entries)
    if starved:
      self._warn_budget_starved(starved, len(tuned), mean_s)

  def _keep(self, result: AutotuningResult) -> None:
    """With `cache=True`, merges `result` into the user cache; a cache that cannot be
    written, or an op's file a newer stellarax wrote (left as it is), costs a warning
    (a CacheWriteWarning, carrying the error if any), never the measurements (the
    result still holds them). The tuning journals of the calls written are removed."""
    if self.cache and len(result):
      merged, to_join = self._for_the_cache(result)
      try:
        written = set(USER_CACHE.write(merged, replace=self.ignore_cache))
        written |= set(USER_CACHE.write(to_join, combine=_joined))
      except OSError as exc:
        warn(CacheWriteWarning(
            f"Autotuner(cache=True): the user cache at {USER_CACHE.root} cannot be "
            f"written ({exc}); the result holds every measurement, but the cache does "
            "not. Set STELLARAX_CACHE_DIR to a writable folder, or save the result "
            "(result.dump(path)).", exc), CacheWriteWarning)
        return
      folder = USER_CACHE.root / device_kind_slug(result.device_kind)
      left = sorted({e.bound_args.op.name for e in result
                     if USER_CACHE.path_for(result.device_kind, e.bound_args.op.name)
                     not in written})
      for entry in result:  # in the cache now: nothing to resume
        if entry.bound_args.op.name not in left:
          journal_lib.remove(entry.bound_args, folder)
      if left:  # USER_CACHE.write warned why: a newer stellarax's files, left alone
        reason = (f"its files of {', '.join(left)} were written by a newer stellarax and "
                  "are left as they are")
        warn(CacheWriteWarning(
            f"Autotuner(cache=True): the user cache at {USER_CACHE.root} holds only part of "
            f"the result: {reason}, so this result's entries of them are not cached (their "
            "tuning journals are kept). Give this stellarax a cache of its own "
            "(STELLARAX_CACHE_DIR), or save the result (result.dump(path)).",
            reason=reason), CacheWriteWarning)

  def _for_the_cache(self, result: AutotuningResult) -> tuple[AutotuningResult, AutotuningResult]:
    """`result`, split into the entries to merge into the user cache and those to join
    with its own entry (`_joined`): a call tuned because its cached entry measured no
    config this tuner may choose (reproducible mode's). Merged, the faster cached entry
    won, the reproducible configs measured were lost, and every run in reproducible mode
    tuned the call again."""
    merged, to_join = AutotuningResult(result.device_kind), AutotuningResult(result.device_kind)
    for entry in result:
      accept = self._accept(entry.bound_args)
      cached = (None if accept is None or self.ignore_cache
                else USER_CACHE.result_for(result.device_kind, entry.bound_args.op.name))
      old = None if cached is None else cached.entry(entry.bound_args)
      refused = (old is not None and old.is_current and not old.starved()
                 and old.config_for(accept) is None)
      if refused:
        to_join = to_join.with_entry(entry)
      else:
        merged = merged.with_entry(entry)
    return merged, to_join

  def entry_for(self, ba: BoundArguments, *, progress: Progress | None = None,
                device: jax.Device | None = None, pool: BudgetPool | None = None) -> Entry:
    """The call's cached entry (unless ignore_cache), else `tune_one`'s, kept at once.

    Args: as `tune_one`; pool, if given, is where the call draws its budget from (its
      share of `total_budget_s`), replacing `self.budget_s`.

    Returns:
      The call's entry; a newly tuned one is in the user cache when `cache=True`.

    Raises:
      As `tune_one`.
    """
    cached = self._reusable_entry(ba)
    if cached is not None:
      if pool is not None:
        pool.take(ba)  # unspent: its share stays in the pool for the calls after it
      if progress is not None:  # done: its configs count as measured
        progress.advance(len(ba.autotuning_configs), ba.op.name)
      return cached
    return self._tune_and_keep_drawing(ba, progress, pool, device)

  def _reusable_entry(self, ba: BoundArguments) -> Entry | None:
    """The call's current cached entry, unless ignore_cache (in reproducible mode, one
    that measured a reproducible config)."""
    return None if self.ignore_cache else _cached_entry(ba, self._accept(ba))

  def _accept(self, ba: BoundArguments) -> Callable[[Any], bool] | None:
    """Which configs of the call may be chosen: reproducible ones in reproducible mode."""
    on = resolution.reproducible() if self.reproducible is None else self.reproducible
    return ba.op._is_reproducible if on else None

  def _weights(self, f: Any, calls: Sequence[BoundArguments], args: tuple,
               kwargs: Mapping[str, Any], in_file: Mapping[BoundArguments, float] | None
               ) -> dict[BoundArguments, float]:
    """What tuning each call is worth, for `total_budget_s` (see the class docstring):
    its device time in the profile `f` holds (`in_file`, for bound-argument JSON) or
    that a run of `f` gives, 0.0 where none says (`budget_shares` gives those a floor);
    {} without a total budget."""
    if self.total_budget_s is None:
      return {}
    if in_file is not None:
      profiled = dict(in_file)
    elif callable(f) and not isinstance(f, jax.stages.Traced) and _all_arrays((args, kwargs)):
      # (A Traced is callable, but holds no arrays to run on: its calls share equally.)
      profiled = _profiled_weights(f, args, kwargs, calls)
    else:
      profiled = {}
    if self.implementations == "all":
      for ba in list(profiled):
        for alt in _alternatives(ba):
          profiled.setdefault(alt, profiled[ba])
    return {ba: profiled.get(ba, 0.0) for ba in calls}  # all zero: equal shares

  def _tune_and_keep_drawing(self, ba: BoundArguments, progress: Progress | None,
                             pool: BudgetPool | None, device: jax.Device | None = None) -> Entry:
    """`_tune_and_keep` with the call's budget drawn from `pool` (if any), and the time
    it took spent from it."""
    if pool is None:
      return self._tune_and_keep(ba, progress, device)
    budget_s, start = pool.take(ba), _clock()
    try:
      return self._tune_and_keep(ba, progress, device, budget_s)
    finally:
      pool.spend(_clock() - start)

  def _tune_and_keep(self, ba: BoundArguments, progress: Progress | None,
                     device: jax.Device | None = None, budget_s: float | None = None) -> Entry:
    tuner = self if budget_s is None else dataclasses.replace(
        self, budget_s=budget_s, total_budget_s=None)
    entry = tuner.tune_one(ba, progress=progress, device=device)
    kind = device.device_kind if device is not None else current_device_kind()
    self._keep(AutotuningResult(kind, {entry.key: entry}))
    return entry

  def _tune_here(self, calls: Sequence[BoundArguments],
                 weights: Mapping[BoundArguments, float]) -> AutotuningResult:
    """Tunes every call in this process, on the default device; a call that fails
    does not stop the others (see `IncompleteTuningError`). With `total_budget_s`,
    the calls to tune share it by `weights`, heaviest first."""
    result = AutotuningResult(current_device_kind())
    todo = []
    for ba in calls:
      cached = self._reusable_entry(ba)
      if cached is not None:
        result = result.with_entry(cached)
      else:
        todo.append(ba)
    todo.sort(key=lambda ba: -weights.get(ba, 0.0))  # stable: equal weights keep their order
    pool = (BudgetPool({ba: weights[ba] for ba in todo}, self.total_budget_s)
            if todo and weights else None)
    progress = Progress(sum(len(ba.autotuning_configs) for ba in todo), enabled=self.progress)
    errors: dict[BoundArguments, Exception] = {}
    seconds = []
    try:
      for ba in todo:
        start = _clock()
        try:
          entry = self._tune_and_keep_drawing(ba, progress, pool)
          result = result.with_entry(entry)
        except measure_lib.DeviceLostError as exc:  # nothing more can run here
          exc.partial_result = result
          exc.add_note(f"It happened while tuning {ba}. The {len(result)} calls tuned before "
                       "it are in exc.partial_result"
                       + (", and in the user cache." if self.cache else "."))
          raise
        except Exception as exc:  # Data about this call; the others are still tuned.
          errors[ba] = exc
        seconds.append(_clock() - start)
    except KeyboardInterrupt as exc:  # the user stops the run: what it tuned is theirs
      exc.partial_result = result
      raise
    finally:
      progress.close()
    # Under a budget a strategy stops before a config it predicts would overrun it; with
    # none it measures its whole space. So a budget left only the heuristic measured.
    if seconds:
      self._warn_if_starved(result, todo, sum(seconds) / len(seconds))
    if self.progress and todo:
      print(result.summary(), file=sys.stderr)
    if errors:
      raise _incomplete(result, calls, errors) from next(iter(errors.values()))
    return result

  def _warn_budget_starved(self, starved: int, tuned: int, mean_s: float | None) -> None:
    budget = (f"total_budget_s={self.total_budget_s}" if self.total_budget_s is not None
              else f"budget_s={self.budget_s}")
    took = (f"A call took {mean_s:.1f} s here on average (compiling and timing its first "
            "configs); give each a few times that" if mean_s is not None else
            "Give each call a few times what compiling and timing its first configs takes")
    warn(
        f"The budget ({budget}) was too small for {starved} of the {tuned} calls tuned to have "
        f"any config measured but their heuristic one, so their entries keep it. {took} to "
        "search its space (a cached entry that measured only its heuristic config is tuned "
        "again, not reused).", SmallBudgetWarning)

  def tune_one(self, ba: BoundArguments, *, progress: Progress | None = None,
               device: jax.Device | None = None) -> Entry:
    """Measures the config space of one call and returns its entry.

    Args:
      ba: the call.
      progress: counts the configs measured.
      device: where to measure; the inputs are placed there, and compilation
        and runs follow committed inputs. None: the default device.

    Raises:
      ValueError: when every measured config failed.
      ImplementationUnavailableError: when the installed JAX cannot run the call's
        op (a Pallas backend it lacks), before measuring any config.
    """
    type(ba.op).require_available()  # one clear error, not one per config of the space
    ba = ba.with_config(None)
    accept = self._accept(ba)
    heuristic = resolution.reproducible_heuristic(ba, accept)
    space = [c for c in _ordered_space(ba, heuristic) if accept is None or accept(c)]
    whole = len(space)
    space = self._pruned(ba, space)
    label = ba.op.name
    measure_here = self._isolated_measure(ba, device) if self.isolate else self._local_measure(ba, device)
    journal = self._journal(ba, device)
    # Progress counts each config of the call's space once (its total counts them all),
    # however often measured: what prune or reproducible mode left out counts at the end.
    counted = set(ba.autotuning_configs)
    seen: set[Any] = set()

    def recalled(configs, effort):
      # Never the heuristic: its measurements are the search's first timed calls, which
      # teach its cost model what a config costs here (all recalled, none would).
      return {c: m for c in configs
              if c != heuristic and (m := journal.recall(c, effort)) is not None}

    def measure(configs, *, effort=1.0):
      configs = list(configs)
      known = recalled(configs, effort)
      todo = [c for c in configs if c not in known]
      out = measure_here(todo, effort) if todo else {}
      journal.record(out, effort)
      if progress is not None:
        progress.advance(len((set(configs) - seen) & counted), label)
      seen.update(configs)
      return {c: known[c] if c in known else out[c] for c in configs}

    # search.py, "The measure": what an effort buys, and what the journal answers (which
    # costs nothing, and would make the configs yet to measure look free).
    measure.effective_effort = self.measure_options.effective_effort
    measure.recalled = lambda configs, effort: set(recalled(configs, effort))
    strategy = _strategy(self.strategy, len(space))
    outcome = strategy(space, measure, heuristic=heuristic, budget_s=self.budget_s)
    outcome = _confirm_recalled(outcome, measure_here, journal, heuristic)
    if progress is not None:  # configs a budgeted strategy skipped or left out count as done
      progress.advance(len(counted - seen), label, skipped=True)
    measurements = tuple(outcome.measurements.items())
    return Entry(
        bound_args=ba, best_config=outcome.best, heuristic_config=heuristic,
        measurements=measurements,
        measured_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        method=f"{outcome.strategy}/{_method(measurements)}"
               + (f"/pruned {len(space)}/{whole}" if len(space) < whole else ""),
        code=code_fingerprint(type(ba.op)))

  def _pruned(self, ba: BoundArguments, space: list[Any]) -> list[Any]:
    """The space as `prune` leaves it (the heuristic config, first, always stays).

    Raises:
      ValueError: when `prune` returns a config that is not in the space.
    """
    if self.prune is None:
      return space
    returned = self.prune(ba, list(space))
    if isinstance(returned, (str, bytes)) or not isinstance(returned, Iterable):
      raise TypeError(f"Autotuner(prune=...) returned {returned!r} for {ba.op.name}: it must "
                      "return the configs to measure, an iterable of configs of the space it "
                      "was given (a list, a set).")
    kept = list(returned)
    strangers = [c for c in kept if c not in space]
    if strangers:
      raise ValueError(f"Autotuner(prune=...) returned {len(strangers)} configs that are not "
                       f"in the space of {ba.op.name}, e.g. {strangers[0]!r}: it may drop "
                       "configs, not add them (pin a config with the op's config= instead).")
    kept = set(kept)
    return [space[0]] + [c for c in space[1:] if c in kept]

  def _journal(self, ba: BoundArguments, device: jax.Device | None) -> Any:
    """The call's journal in the user cache with `cache=True` (see journal.py), else one
    that recalls and keeps nothing."""
    if not self.cache:
      return _NO_JOURNAL
    kind = device.device_kind if device is not None else current_device_kind()
    journal = journal_lib.Journal.for_call(
        ba, USER_CACHE.root / device_kind_slug(kind), seed=self.seed,
        options=self.measure_options, isolate=self.isolate, anew=self.ignore_cache)
    return _WarnOnce(journal)

  def _local_measure(self, ba: BoundArguments, device: jax.Device | None):
    """`(configs, effort) -> {config: Measurement}`, measuring in this process."""
    measurer = isolation.CallMeasurer(ba, self.seed, device)
    return lambda configs, effort: measurer(configs, effort, self.measure_options)

  def _isolated_measure(self, ba: BoundArguments, device: jax.Device | None):
    """`(configs, effort) -> {config: Measurement}`, measuring in a worker process."""
    # A worker is a JAX process of its own, not part of any distributed run: it
    # sees this host's devices, so the device is named by its local index.
    index = None if device is None else jax.local_devices().index(device)
    isolation.prepare(ba, seed=self.seed, options=self.measure_options, device_index=index)

    def measure(configs, effort):
      return isolation.measure_isolated(ba, configs, seed=self.seed, options=self.measure_options,
                                        effort=effort, device_index=index)

    return measure


class NothingToTuneWarning(UserWarning):
  """`autotune` found no stellarax op call in what it was given; its result is empty."""


class SmallBudgetWarning(UserWarning):
  """The tuning budget was too small for some calls to have any config measured but their
  heuristic one: their entries keep the heuristic config."""


# The Autotuner's fields, fixed when it is defined (tests may stand a partial in for it).
_TUNING_OPTIONS = frozenset(field.name for field in dataclasses.fields(Autotuner))


def _check_no_tuning_options(f: Any, kwargs: Mapping[str, Any]) -> None:
  """TypeError for a tuning option given among f's arguments (`autotune(f, x,
  budget_s=1)`), where f would fail on it, saying where it belongs; nothing when f
  takes an argument of that name, or its signature cannot be read."""
  misplaced = sorted(set(kwargs) & _TUNING_OPTIONS)
  if not misplaced or not callable(f):
    return
  try:
    inspect.signature(f).bind_partial(**{name: None for name in misplaced})
    return  # f takes them: they are its own
  except TypeError:
    pass
  except ValueError:  # no signature to read: f decides
    return
  given = ", ".join(f"{name}={kwargs[name]!r}" for name in misplaced)
  raise TypeError(f"autotune passes keyword arguments to f, and f takes no {misplaced[0]!r};"
                  f" {given} is a tuning option: give it to the tuner,"
                  f" stellarax.Autotuner({given}).autotune(f, ...).")


def _check_not_traced(args: tuple, kwargs: Mapping[str, Any]) -> None:
  """Tuning compiles and runs programs: it cannot happen inside a jax transformation."""
  traced = [x for x in jax.tree.leaves((args, kwargs)) if isinstance(x, jax.core.Tracer)]
  if traced:
    raise TypeError(f"autotune was given traced values ({traced[0].aval.str_short()}): it was "
                    "called inside jax.jit, vmap, grad or another transformation. Tuning compiles "
                    "and times programs of its own; call autotune outside the transformation, "
                    "with concrete arrays or jax.ShapeDtypeStruct.")


def _found_calls(f: Any, args: tuple, kwargs: Mapping[str, Any]
                 ) -> tuple[list[BoundArguments], dict[BoundArguments, float] | None]:
  """The op calls an autotune input holds, and for bound-argument JSON the device time
  of each in the profile it came from, from one read of the file (None for other inputs)."""
  if isinstance(f, BoundArguments):
    return [f], None
  if isinstance(f, (str, os.PathLike)):
    _no_args(args, kwargs, "bound-argument JSON")
    return capture.calls_and_weights_from_json(f)
  if _is_bound_args(f):
    _no_args(args, kwargs, "a sequence of BoundArguments")
    return list(f), None
  try:
    return capture.get_bound_args(f, *args, **kwargs), None
  except TypeError as exc:
    stage = isinstance(f, (jax.stages.Traced, jax.stages.Lowered, jax.stages.Compiled))
    if not args and not kwargs and not stage:  # `autotune(jax.grad(f))`, f's arguments left out
      exc.add_note("autotune called f with no arguments. If f takes some, pass them after it, "
                   "autotune(f, x, y) or autotune(jax.grad(loss), params, batch), or bind them "
                   "first: autotune(functools.partial(f, x, y)).")
    raise


def _is_bound_args(f: Any) -> bool:
  """Whether `f` is a BoundArguments or a sequence of them (given, not found)."""
  return isinstance(f, BoundArguments) or (
      isinstance(f, Sequence) and not isinstance(f, str) and all(isinstance(b, BoundArguments) for b in f))


def _nothing_found(f: Any, trivial: int) -> str:
  """Why an autotune input held no op call to tune (`trivial`: how many it held that run
  no kernel), and what to check."""
  if trivial:
    return (f"autotune: the {trivial} stellarax op calls found run no kernel: each has an "
            "empty dimension (its output is zeros whatever its inputs), so nothing was tuned "
            "and the result is empty.")
  if isinstance(f, (str, os.PathLike)):
    return ("autotune: the bound-argument JSON holds no op calls, so nothing was tuned and the "
            "result is empty. Was the profile it came from made of a run that called stellarax "
            "ops (stellarax.ragged_dot, ...)?")
  return (f"autotune: found no stellarax op call in {getattr(f, '__name__', type(f).__name__)}, "
          "so nothing was tuned and the result is empty. Only calls of stellarax's ops are tuned "
          "(stellarax.ragged_dot, stellarax.dot_product_attention, ...); jax.lax.ragged_dot or "
          "jax.nn.dot_product_attention called directly are XLA's, not stellarax's. A call "
          "whose output is zeros whatever its inputs (an empty dimension) runs no kernel and "
          "leaves nothing to tune.")


def autotune(f: Any, /, *args, **kwargs) -> AutotuningResult:
  """Tunes every stellarax op call in `f` with default options.

  `autotune(f, *args, **kwargs)` is `Autotuner().autotune(f, *args, **kwargs)`;
  use an `Autotuner` for options (strategy, budget, caching, progress).

  Args:
    f: a callable, `jax.stages.Traced` or `Lowered`, `BoundArguments`, a sequence of
      them, or bound-argument JSON (path or string).
    *args, **kwargs: the arguments of `f` when it is a callable.

  Returns:
    An `AutotuningResult`.

  Raises:
    IncompleteTuningError: (a ValueError) when some call could not be tuned, e.g.
      every config of it failed; it says why and carries the tuned calls in
      `partial_result`.
    distributed.DistributedTuningError: (an IncompleteTuningError) when tuning is
      spread over several devices or processes and one stalled or a call failed.
    TypeError: for traced arguments (autotune called inside jit, vmap or grad), or a
      tuning option among f's keyword arguments (pass it to an `Autotuner`).
    measure.DeviceLostError: (a RuntimeError) when a config lost the device (an
      illegal memory access); use `Autotuner(isolate=True)` to go on past such configs.
    KeyboardInterrupt: on Ctrl-C; it carries the calls tuned so far in `partial_result`.

  Warns:
    NothingToTuneWarning: when `f` holds no op call (see `Autotuner.autotune`).
  """
  return Autotuner().autotune(f, *args, **kwargs)


def _incomplete(result: AutotuningResult, calls: Sequence[BoundArguments],
                errors: Mapping[BoundArguments, Exception]) -> IncompleteTuningError:
  texts = {ba: f"{type(exc).__name__}: {exc}" for ba, exc in errors.items()}
  lines = []
  for ba, text in texts.items():
    shown = text.strip().splitlines() or [text]
    more = len(shown) - _SHOWN_ERROR_LINES
    lines.append(f"  {ba}:\n" + "\n".join(f"    {line}" for line in shown[:_SHOWN_ERROR_LINES])
                 + (f"\n    ... and {more} more lines (exc.errors has them all)" if more > 0 else ""))
  message = (f"Autotuning on {result.device_kind!r} tuned {len(result)} of {len(calls)} calls; "
             f"{len(errors)} could not be tuned:\n" + "\n".join(lines) +
             f"\nThe {len(result)} tuned calls are in exc.partial_result (and, with "
             "Autotuner(cache=True), in the user cache, so a rerun tunes only what is missing).")
  return IncompleteTuningError(message, partial_result=result, not_tuned=list(errors),
                               errors=texts)


def _no_args(args, kwargs, what):
  if args or kwargs:
    raise TypeError(f"Arguments were given for {what}, which takes none: pass tuning options "
                    "through stellarax.Autotuner(...).autotune(...).")


def _ordered_space(ba: BoundArguments, heuristic: Any = None) -> list[Any]:
  """The heuristic config (by default the op's) first, then the rest in a fixed order."""
  if heuristic is None:
    heuristic = ba.heuristics_config
  rest = sorted((c for c in ba.autotuning_configs if c != heuristic),
                key=lambda c: canonical_json(config_to_json(c)))
  return [heuristic, *rest]


def _all_arrays(tree: Any) -> bool:
  """Whether no leaf is an abstract array (`jax.ShapeDtypeStruct`): a program can run on
  them (the other leaves are arrays, or static values `capture.program_of_arrays` keeps)."""
  return not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _profiled_weights(f: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any],
                      calls: Sequence[BoundArguments]) -> dict[BoundArguments, float]:
  """Each call's device time per run of `f(*args, **kwargs)`, from a profile; {} (with a
  warning) where the profile cannot be taken or read."""
  try:
    with resolution.miss_policy_scope("heuristics"):  # a miss must not tune here, as in capture
      program, arrays = capture.program_of_arrays(f, args, kwargs)
      times = profile.device_time_per_call(program, arrays)
  except (profile.ProfileError, RuntimeError) as exc:
    warn(f"total_budget_s: the calls share it equally, since profiling the"
         f" program to weigh them failed: {exc}", RuntimeWarning)
    return {}
  by_key = {(ba.op_json(), ba.key_json()): ba for ba in calls}
  return {by_key[key]: t for key, t in times.items() if key in by_key}


class BudgetPool:
  """A total budget that calls draw on one after another: each takes its weight's
  share of what is left, and gives back what it did not spend, so the calls after it
  get it (a strategy that finishes a small space early leaves budget behind).

  Args:
    weights: call -> weight >= 0 of every call that will draw (`budget_shares` says
      how zero weights count).
    total_s: the budget, seconds (> 0).
  """

  # A call drawing on an exhausted pool still gets this fraction of the total: enough
  # to measure its heuristic config, whose time the strategy then cannot beat.
  _LEAST = 1e-3

  def __init__(self, weights: Mapping[BoundArguments, float], total_s: float):
    self.total_s = self.left_s = total_s
    self._waiting = budget_shares(list(weights), weights, 1.0)  # normalised weights

  def take(self, ba: BoundArguments) -> float:
    """The budget of `ba` (which must not have drawn yet), in seconds."""
    weight = self._waiting.pop(ba)
    share = max(self.left_s, 0.0) * weight / (weight + sum(self._waiting.values()))
    return max(share, self._LEAST * self.total_s)

  def spend(self, seconds: float) -> None:
    """Counts `seconds` as spent (a call's wall time, whatever its budget was)."""
    self.left_s -= seconds


def budget_shares(calls: Sequence[BoundArguments], weights: Mapping[BoundArguments, float],
                  total_s: float) -> dict[BoundArguments, float]:
  """Each call's part of a total budget, in proportion to its weight.

  Args:
    calls: the calls that share it.
    weights: call -> weight >= 0, for every call (a missing or zero weight counts a
      hundredth of the heaviest, so that every call gets some budget).
    total_s: the budget to share, seconds.

  Returns:
    call -> seconds; they add up to total_s ({} for no calls). Equal shares when no
    call weighs anything.
  """
  if not calls:
    return {}
  heaviest = max(weights.get(ba, 0.0) for ba in calls)
  if heaviest <= 0:
    return {ba: total_s / len(calls) for ba in calls}
  floor = {ba: max(weights.get(ba, 0.0), heaviest / 100) for ba in calls}
  total_weight = sum(floor.values())
  return {ba: total_s * w / total_weight for ba, w in floor.items()}


def _strategy(name_or_fn, space_size: int) -> Callable[..., Any]:
  if callable(name_or_fn):
    return name_or_fn
  if name_or_fn == "auto":
    return search.default_strategy(space_size)
  return {"exhaustive": search.exhaustive, "racing": search.racing, "random": search.random_search}[name_or_fn]


def _method(measurements) -> str:
  methods = {m.method for _, m in measurements if m.method}
  return ",".join(sorted(methods)) or "none"


def _cached_entry(ba: BoundArguments, accept: Callable[[Any], bool] | None = None
                  ) -> Entry | None:
  """The call's entry in the user or library cache, unless it is stale
  (`Entry.stale_reason`), a budget let it measure only its heuristic config
  (`Entry.starved`), or it measured no config that `accept` takes: those are measured again."""
  for _, result in cached_results(ba.op.name, current_device_kind()):  # where it measures
    entry = result.entry(ba)
    if (entry is not None and entry.is_current and not entry.starved(accept)
        and entry.config_for(accept) is not None):
      return entry
  return None


def _is_real(value: Any) -> bool:
  """Whether `value` is a real number of seconds: an int or float (NumPy's too), not a
  bool."""
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
      value, (bool, np.bool_))


def _joined(old: Entry | None, new: Entry) -> Entry:
  """What the user cache keeps of a call tuned again beside its entry `old` (read under
  the file's lock): the winner of the two as results merge, with the other's
  measurements of the configs it lacks (`Entry.joined`)."""
  if old is None:
    return new
  winner = merge_entries(old, new)
  if not old.is_current or old.starved():  # changed since it was judged: a plain merge
    return winner
  return winner.joined(new if winner is old else old)


def _alternatives(ba: BoundArguments) -> list[BoundArguments]:
  """The same call bound to the family's other implementations on this device."""
  family = ba.op.name.partition(".")[0]
  is_vjp = ba.op.name.endswith("_vjp")
  device = jax.devices()[0]
  out = []
  for name in registry.names(family):
    cls = registry.lookup(name)
    if name == ba.op.name or name.endswith("_vjp") != is_vjp or not cls.supported_on(device):
      continue
    try:
      out.append(BoundArguments.from_json({**ba.to_json(), "op": {"name": name, "fields": {}}}))
    except NotImplementedError:
      continue
  return out


_TUNED_ON_MISS: dict[tuple[str, str, bool, str], Any] = {}
# The misses of calls traced for another device kind than this host's, warned about.
_UNMEASURABLE_MISSES: set[tuple[str, str, bool, str]] = set()


def _autotune_on_miss(ba: BoundArguments) -> Any:
  """The "autotune" miss policy: tune the call once per process, keep it.

  A call resolves its config while its program is traced; tuning compiles and runs
  programs of its own, which inside that trace would be staged into it. JAX's trace
  state is per thread, so the tuning runs in a thread of its own.
  """
  key = _miss_key(ba)
  target, host = target_device_kind(), current_device_kind()
  if target != host:  # lowering for another machine: nothing to measure on
    if key not in _UNMEASURABLE_MISSES:
      _UNMEASURABLE_MISSES.add(key)  # warned once
      warn(f"The 'autotune' miss policy cannot measure {ba} for {target!r} on this "
           f"{host!r} host (the program is lowered for another device): it takes its "
           f"heuristic config. Tune the call on a {target!r} device (stellarax.autotune) "
           "and cache or ship the result.", OtherDeviceWarning)
    return resolution.reproducible_heuristic(ba, resolution.reproducible_filter(ba.op))
  with _IN_FLIGHT_LOCK:  # a retry after a Ctrl-C waits on the tuning it left running
    if key in _TUNED_ON_MISS:
      return _TUNED_ON_MISS[key]
    pending = _IN_FLIGHT.get(key)
    if pending is None:
      # The mode is this thread's: the tuning thread is told it.
      tuner = Autotuner(progress=False, reproducible=resolution.reproducible())
      pending = _IN_FLIGHT[key] = _OwnThread(tuner.tune_one, ba)
  try:
    config = pending.wait().best_config  # a Ctrl-C: the tuning goes on, for the retry
  except KeyboardInterrupt:
    raise
  except BaseException:
    _settle(key, pending, None)  # failed: a later trace tunes it again
    raise
  _settle(key, pending, config)
  return config


def _settle(key: tuple[str, str, bool, str], pending: _OwnThread, config: Any | None) -> None:
  """Ends `pending`'s time in flight (not a newer tuning's of the key) and keeps its
  config, if it found one."""
  with _IN_FLIGHT_LOCK:
    if _IN_FLIGHT.get(key) is pending:
      del _IN_FLIGHT[key]
    if config is not None:
      _TUNED_ON_MISS.setdefault(key, config)


_IN_FLIGHT: dict[tuple[str, str, bool, str], _OwnThread] = {}
_IN_FLIGHT_LOCK = threading.Lock()


class _OwnThread:
  """fn(*args) on a daemon thread of its own, waited for with `wait`: a Ctrl-C stops the
  waiting at once, and the tuning goes on (a daemon: it does not hold up the
  interpreter's exit), where a thread pool's shutdown would wait for it to end.
  (Tunings of other calls are not held back for it: a tuning can meet a miss of its own,
  an op called inside another op's implementation, and would wait for itself.)"""

  def __init__(self, fn: Callable[..., Any], *args):
    self._done = threading.Event()
    self._ok, self._value = False, None

    def run():
      try:
        self._value, self._ok = fn(*args), True
      except BaseException as exc:  # noqa: BLE001 (re-raised in the waiting threads)
        self._value = exc
      finally:
        self._done.set()

    threading.Thread(target=measure_lib.carried_settings(run), name="stellarax-tune",
                     daemon=True).start()

  @property
  def done(self) -> bool:
    return self._done.is_set()

  def wait(self) -> Any:
    """The result, or raises fn's exception; short waits, so that an interrupt is seen
    between them however it was raised."""
    while not self._done.wait(timeout=0.1):
      pass
    if not self._ok:
      raise self._value
    return self._value


def config_tuned_on_miss(ba: BoundArguments) -> Any | None:
  """The config that the "autotune" miss policy tuned for `ba` in this process, or None.

  Args:
    ba: the call's bound arguments.

  Returns:
    The best config found when the call was first traced under the policy; None when
    the policy has not tuned it.
  """
  key = _miss_key(ba)
  pending = _IN_FLIGHT.get(key)
  if key not in _TUNED_ON_MISS and pending is not None and pending.done:
    try:  # a tuning a Ctrl-C left running, finished since
      _settle(key, pending, pending.wait().best_config)
    except BaseException:  # noqa: BLE001 (it failed: nothing tuned)
      _settle(key, pending, None)
  return _TUNED_ON_MISS.get(key)


def _miss_key(ba: BoundArguments) -> tuple[str, str, bool, str]:
  """A call's key in _TUNED_ON_MISS: its op (with fields), its arguments, whether only
  reproducible configs were tuned, and the device kind it is traced for."""
  return ba.op_json(), ba.key_json(), resolution.reproducible(), target_device_kind()


class _TuningBackend:
  """What `BoundArguments.autotune()` and `.benchmark()` call."""

  @staticmethod
  def autotune_bound_args(ba: BoundArguments, **options) -> AutotuningResult:
    return Autotuner(**options).autotune([ba])

  @staticmethod
  def benchmark(ba: BoundArguments, config: Any, **measure_options) -> measure_lib.Measurement:
    measurer = isolation.CallMeasurer(ba.with_config(None), seed=0)
    return measurer([config], 1.0, measure_lib.MeasureOptions(**measure_options))[config]


resolution.set_autotune_on_miss(_autotune_on_miss)
resolution.set_tuning_backend(_TuningBackend())


class _NoJournal:
  """The journal of a tuning that keeps none (`cache=False`)."""

  def recall(self, config: Any, effort: float) -> None:
    return None

  def record(self, measurements: Mapping[Any, Any], effort: float) -> None:
    pass

  def is_recalled(self, config: Any, measurement: Any) -> bool:
    return False


_NO_JOURNAL = _NoJournal()


class _WarnOnce:
  """A journal whose write failures cost one warning, then no more journaling: the
  measurements go on, only resuming is lost."""

  def __init__(self, journal: journal_lib.Journal):
    self._journal = journal
    self.recall, self.is_recalled = journal.recall, journal.is_recalled
    self._failed = False

  def record(self, measurements: Mapping[Any, Any], effort: float) -> None:
    if self._failed:
      return
    try:
      self._journal.record(measurements, effort)
    except OSError as exc:
      self._failed = True
      warn(CacheWriteWarning(
          f"Autotuner(cache=True): the tuning journal {self._journal.path} cannot be written "
          f"({exc}); tuning goes on, but an interrupted run would measure this call again.",
          exc), CacheWriteWarning)


# At most this many configs, the best and those within its noise, are measured again
# together when one of them was recalled from a journal (and the heuristic beside them).
_MAX_CONFIRMED = 8


def _confirm_recalled(outcome: search.SearchOutcome, measure_here: Callable[..., Any],
                      journal: Any, heuristic: Any) -> search.SearchOutcome:
  """The outcome, with the best config and those within its noise measured again together,
  beside the heuristic, when one of them was recalled from a journal (another run's
  time: see journal.py)."""
  ms = dict(outcome.measurements)
  contenders = measure_lib.within_noise(ms, outcome.best)[:_MAX_CONFIRMED]
  if len(contenders) < 2 or not any(journal.is_recalled(c, ms[c]) for c in contenders):
    return outcome
  # The heuristic is measured again beside them: chosen among the fresh times alone, the
  # best could be one that this very measurement shows slower than the heuristic.
  if heuristic in ms and ms[heuristic].ok and heuristic not in contenders:
    contenders.append(heuristic)
  fresh = measure_here(contenders, 1.0)
  journal.record(fresh, 1.0)
  ms.update(fresh)
  ok = {c: m for c, m in fresh.items() if m.ok}
  if not ok:  # all failed now: the choice falls to every measurement there is
    ok = {c: m for c, m in ms.items() if m.ok}
  chosen = measure_lib.pick_best(ok, prefer=heuristic if heuristic in ok else None)
  return dataclasses.replace(outcome, best=chosen, measurements=ms)
