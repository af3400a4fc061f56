"""Checking tuned configs in the program they were tuned for.

The autotuner measures each op call on its own: its inputs are fresh arrays and nothing
runs around it. Inside a program the same call can cost otherwise: an XLA
implementation fuses with its neighbours and its inputs arrive in the layouts the
program chose, and a VJP op may share work with the forward. So a config that won on
its own may gain less in the program, or nothing (the demo's attention VJP: 1.6x on its
own, a few percent of the training step on the CPU). Pallas kernels are opaque to XLA
and keep their isolated ranking far better, but the program is what the user runs.

`check_in_program(result, f, *args)` times the whole program three ways, in the same
interleaved rounds (`measure_candidates`): every op call at its heuristic config, every
call at the result's config, and, for each call whose tuned config is not its
heuristic, the result with that one call put back to its heuristic (leave one out). A
call helps when the tuned program is faster than the one without it beyond noise
(`measure.pick_best` with the leave-one-out program preferred). Leaving one out misses a
gain spread over several calls: two calls that each gain a few percent of the program
can each stay within noise while together they are beyond it (the demo's attention
forward and backward on a CPU: each "not faster", the program 1.08x). So where two or
more calls do not help alone (and none of them slows the program beyond noise: such a
call is put back whatever the others gain), the program with all of them at their
heuristics is timed
against the tuned one too (in more rounds of its own, or read from the heuristic
program where they are every changed call): where the tuned program is faster beyond
noise, they help together and are kept. Every program's output
is checked against the heuristic program's, so a config that is wrong only in context
shows too. `ProgramCheck.kept()` is the result with the calls that did not help put
back to their heuristics: a result for this program, not a better measurement of the
call (the next program may differ), so it is returned, never written to a cache.

With `profile=True` it also says where the difference lies: the heuristic and the tuned
program each run `_PROFILED_RUNS` times inside `jax.profiler.trace`, and `read_op_calls`
gives every op call's own device time per run of the program (`CallTime`), beside its
speed-up on its own. Whole-program times mix the call's kernels with everything around
them; these do not, and one profile decides what many noisy rounds of leave-one-out may
not. A trace embeds the HLO of every program alive in the process, which is slow in a
process that holds thousands, hence opt-in. On a GPU the times are the kernels' own
(CUPTI); on a CPU every XLA:CPU thunk's event carries the tracer's cost, so a call made
of many small thunks looks slower than it runs (2026-12-02, a 96-row XLA ragged_dot:
0.070 ms profiled in a program that takes 0.017 ms): there the numbers show what the
profile holds, not what the calls cost.

It compiles the program 2 + (changed calls) times, plus once for the reference, once
more for the calls that do not help alone (where some others do), and twice more to
profile.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from stellarax.autotuning import capture
from stellarax.autotuning import measure as measure_lib
from stellarax.autotuning import profile as profile_lib
from stellarax.autotuning.result import AutotuningResult, Entry, format_time
from stellarax.core.bound_args import BoundArguments

_HEURISTICS = "heuristics"
_TUNED = "tuned"
_WITHOUT = "without"
_TOGETHER = "together"  # the calls that do not help alone, all left out
# Runs of each program in its profile: per-run times are averages over them.
_PROFILED_RUNS = 3


@dataclasses.dataclass(frozen=True)
class CallCheck:
  """One tuned call's part in the program.

  Attributes:
    entry: the call's entry in the result checked (its heuristic where the result
      tuned only other implementations of it).
    without: the program with this call at its heuristic config and in its own
      implementation, the others tuned.
    helps: whether kept() keeps the call's tuned config: the tuned program is faster
      than `without` beyond noise (or ran where `without` failed), or, where it is not,
      faster than `together` beyond noise.
    alternatives: the result's entries for the same call in other implementations of
      its family (`Autotuner(implementations=...)`), which dispatch may run instead.
    heuristic_config: the call's heuristic config today, which `without` ran (the
      entry records the heuristic of when it was measured, which a newer stellarax may
      have changed); None means the entry's.
    culprits_out: where the tuned program fails for other calls' configs (the culprits:
      the program runs without them), this call was judged in the programs with those
      calls at their heuristic configs: `without` and `helps` are from those.
    together: where two or more calls do not help alone, the program with all of them
      at their heuristic configs (the heuristic program where they are all the changed
      calls), timed against the tuned one; else None.
    tuned_together: the tuned program as timed beside `together` (in rounds of their
      own, or the first ones where `together` is the heuristic program).
    others_together: how many other calls `together` put back with this one.
  """

  entry: Entry
  without: measure_lib.Measurement
  helps: bool
  alternatives: tuple[Entry, ...] = ()
  heuristic_config: Any = None
  culprits_out: bool = False
  together: measure_lib.Measurement | None = None
  tuned_together: measure_lib.Measurement | None = None
  others_together: int = 0

  def at_heuristic(self) -> Entry:
    """The entry pinned to the heuristic config that `without` ran."""
    heuristic = self.entry.heuristic_config if self.heuristic_config is None else self.heuristic_config
    return dataclasses.replace(self.entry, best_config=heuristic)


@dataclasses.dataclass(frozen=True)
class CallTime:
  """One op call's own device time per run of the program, from its profiles.

  Attributes:
    op: the op's registered name ("a -> b" where the tuned program ran the call in
      another implementation, b).
    key: the call's key (`Entry.key`).
    heuristic_s: seconds per run in the program at heuristic configs (None if the
      profile did not show the call).
    tuned_s: the same in the tuned program.
    alone: the call's tuned speed-up measured on its own (heuristic time over the best
      time of the implementation the tuned program ran, from the result), None where
      the result has no timed entry for it.
    changed: whether the tuned program runs the call otherwise (another config or
      implementation); where it does not, the two times differ only by noise.
  """

  op: str
  key: tuple[str, str]
  heuristic_s: float | None
  tuned_s: float | None
  alone: float | None
  changed: bool = True

  @property
  def speedup(self) -> float | None:
    """heuristic_s / tuned_s, None where either is missing or zero."""
    if not self.heuristic_s or not self.tuned_s:
      return None
    return self.heuristic_s / self.tuned_s


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
  """What `check_in_program` measured.

  Attributes:
    result: the result checked.
    heuristics: the program with every op call at its heuristic config.
    tuned: the program with the result's configs (the calls it does not cover at their
      heuristic configs, as in `heuristics`).
    calls: one `CallCheck` per call of the program whose tuned config is not its
      heuristic, in program order.
    num_calls: op calls found in the program (tuned or not).
    call_times: with `profile=True`, one `CallTime` per op call that a profile showed,
      longest in the heuristic program first; else empty.
  """

  result: AutotuningResult
  heuristics: measure_lib.Measurement
  tuned: measure_lib.Measurement
  calls: tuple[CallCheck, ...]
  num_calls: int
  call_times: tuple[CallTime, ...] = ()

  @property
  def speedup(self) -> float | None:
    """Heuristic program time over tuned program time; None if either failed."""
    if not (self.heuristics.ok and self.tuned.ok):
      return None
    return self.heuristics.median_s / self.tuned.median_s

  @property
  def faster_beyond_noise(self) -> bool:
    """Whether the tuned program is faster than the heuristic one beyond noise (the
    rule that picks configs, `measure.pick_best`, with the heuristic program preferred)."""
    if not (self.heuristics.ok and self.tuned.ok):
      return False
    both = {_HEURISTICS: self.heuristics, _TUNED: self.tuned}
    return measure_lib.pick_best(both, prefer=_HEURISTICS, order=[_HEURISTICS, _TUNED]) == _TUNED

  @property
  def _slower_beyond_noise(self) -> bool:
    """Whether the heuristic program is faster than the tuned one beyond noise."""
    return self.tuned.ok and _helps(self.heuristics, self.tuned)

  def kept(self) -> AutotuningResult:
    """The result with each call that did not help put back to its heuristic config
    (its measurements kept, its method saying why); calls that helped, and entries of
    calls not in the program, as they were."""
    return _put_back(self.result, [call for call in self.calls if not call.helps],
                     "heuristic kept: not faster in the program checked")

  def lines(self) -> list[str]:
    """A short report: the program both ways, then each tuned call left out."""
    ms = lambda m: format_time(m.median_s) if m.ok else f"{m.status} ({m.error})"
    if not self.calls:  # both programs ran the same configs: any ratio is noise
      speedup = " (the same configs: no call's tuned config differs from its heuristic)"
    elif self.speedup:
      noise = ("" if self.faster_beyond_noise
               else ", slower beyond noise" if self._slower_beyond_noise else ", within noise")
      speedup = f" ({self.speedup:.2f}x{noise})"
    else:
      speedup = ""
    out = [f"program: {ms(self.heuristics)} with heuristics -> {ms(self.tuned)} tuned{speedup};"
           f" {len(self.calls)} of {self.num_calls} op calls run a tuned config other than"
           " their heuristic's"]
    for call in self.calls:
      gain = ""
      if call.without.ok and self.tuned.ok:
        gain = call.without.median_s - self.tuned.median_s
        # Called a gain only where it helps: a difference within noise is not one.
        gain = (f", {'its gain' if call.helps else 'a difference of'} "
                f"{'-' if gain < 0 else '+'}{format_time(abs(gain))}")
      if call.culprits_out:
        verdict = ("helps" if call.helps else "not faster beyond noise: kept() keeps the "
                   "heuristic") + " (judged with the culprits at their heuristic configs)"
      elif call.together is not None:
        beside = ("" if call.tuned_together is self.tuned
                  else f" (tuned {ms(call.tuned_together)} in the same rounds)")
        verdict = (f"not faster beyond noise alone; without it and the {call.others_together}"
                   f" other such call{'s' if call.others_together > 1 else ''}"
                   f" {ms(call.together)}{beside}: "
                   + ("they help together" if call.helps else "kept() keeps the heuristic"))
      elif call.helps:
        verdict = "helps"
      elif not self.tuned.ok and call.without.ok:
        verdict = "the tuned program fails and without it it does not: its config is the culprit"
      elif not call.without.ok:
        verdict = ("the program fails without it too (another call's config fails): "
                   "kept() keeps the heuristic")
      else:
        verdict = "not faster beyond noise: kept() keeps the heuristic"
      others = "".join(f" or {o.bound_args.op.name}" for o in call.alternatives)
      out.append(f"  {call.entry.bound_args.op.name}{others}: without it {ms(call.without)}{gain};"
                 f" {verdict}")
    if self.call_times:
      failed = "" if self.tuned.ok else "; the tuned program fails, so only the other was"
      out.append(f"each call's own device time per run of the program (profiled,"
                 f" {_PROFILED_RUNS} runs{failed}):")
    at = format_time
    for t in self.call_times:
      if not t.changed:
        out.append(f"  {t.op}: {at(t.heuristic_s)} with heuristics, {at(t.tuned_s)} tuned"
                   " (the same config in both)")
        continue
      ratios = [f"{t.speedup:.2f}x"] if t.speedup else []
      ratios.append(f"on its own {t.alone:.2f}x" if t.alone else "not timed on its own")
      out.append(f"  {t.op}: {at(t.heuristic_s)} with heuristics -> {at(t.tuned_s)} tuned"
                 f" ({'; '.join(ratios)})")
    return out


def _put_back(result: AutotuningResult, calls: Sequence[CallCheck],
              method: str | None = None) -> AutotuningResult:
  """`result` with each of `calls` at its heuristic config (where the result has an
  entry for it; its measurements kept, `method` added to its method) and the entries of
  its other implementations left out, so that dispatch keeps the call's own."""
  entries = {e.key: e for e in result}
  for call in calls:
    for other in call.alternatives:
      entries.pop(other.key, None)
    if call.entry.key in entries:
      back = call.at_heuristic()
      entries[call.entry.key] = (back if method is None else
                                 dataclasses.replace(back, method=f"{call.entry.method}; {method}"))
  return AutotuningResult(result.device_kind, entries, result.versions)


def _left_out(calls: Sequence[tuple[Entry, tuple[Entry, ...]]], heuristic: dict, tuned: dict
              ) -> dict:
  """The entries that pin a program with `calls` (each an entry and the other
  implementations dispatch would run instead) at today's heuristic configs in their own
  implementations, and every other call as tuned."""
  dropped = {o.key for _, others in calls for o in others}
  entries = {k: v for k, v in (heuristic | tuned).items() if k not in dropped}
  for e, _ in calls:
    entries[e.key] = dataclasses.replace(e, best_config=heuristic[e.key].best_config)
  return entries


def _helps(with_it: measure_lib.Measurement, without: measure_lib.Measurement) -> bool:
  """Whether the program `with_it` (some calls tuned) beats `without` (those calls at
  their heuristics): it runs, and is faster beyond noise or runs where `without` fails."""
  return with_it.ok and (not without.ok or measure_lib.pick_best(
      {_WITHOUT: without, _TUNED: with_it}, prefer=_WITHOUT, order=[_WITHOUT, _TUNED]) == _TUNED)


def _alternatives_in(result: AutotuningResult, ba: BoundArguments) -> tuple[Entry, ...]:
  """The result's entries for the call `ba` in other implementations of its family (the
  same arguments and vmap levels, forward or backward alike)."""
  family, vjp = ba.op.name.partition(".")[0], ba.op.name.endswith("_vjp")
  return tuple(e for e in result
               if e.bound_args.op.name != ba.op.name
               and e.bound_args.op.name.partition(".")[0] == family
               and e.bound_args.op.name.endswith("_vjp") == vjp
               and e.bound_args.arguments == ba.arguments
               and e.bound_args.vmap_axes == ba.vmap_axes)


def _faster_alternatives(result: AutotuningResult, ba: BoundArguments,
                         own: Entry | None) -> tuple[Entry, ...]:
  """`_alternatives_in`, where one of them is timed faster than the call's own entry
  (or the call has none timed): then dispatch runs that one instead (`core/dispatch`),
  else none (the call keeps its own implementation)."""
  others = _alternatives_in(result, ba)
  own_s = None if own is None else own.best_time
  times = [e.best_time for e in others if e.best_time is not None]
  return others if times and (own_s is None or min(times) < own_s) else ()


def _heuristic_entry(ba) -> Entry:
  """An entry that pins a call to its heuristic config (nothing measured)."""
  ba = ba.with_config(None)
  heuristic = ba.heuristics_config
  return Entry(bound_args=ba, best_config=heuristic, heuristic_config=heuristic, measurements=())


def _under(result: AutotuningResult, program: Callable[[list], Any]) -> Callable[[list], Any]:
  """`program(arrays)` traced inside `with result:`."""
  def run(arrays):
    with result:
      return program(arrays)
  return run


def _call_times(found: list[BoundArguments], result: AutotuningResult,
                programs: dict[Any, Callable[..., Any]], args: tuple,
                changed: set[tuple[str, str]], *, tuned_ran: bool = True
                ) -> tuple[CallTime, ...]:
  """A `CallTime` per op call that the heuristic or the tuned program's profile shows;
  where the tuned program failed (`tuned_ran` False: a culprit's config), it is not
  profiled, and its times are None."""
  before = profile_lib.device_time_per_call(programs[_HEURISTICS], *args, runs=_PROFILED_RUNS)
  after = (profile_lib.device_time_per_call(programs[_TUNED], *args, runs=_PROFILED_RUNS)
           if tuned_ran else {})
  tuned = {e.key: e for e in result}
  out = []
  for ba in found:
    ba = ba.with_config(None)
    key = (ba.op_json(), ba.key_json())
    # Where dispatch ran another implementation of the call, the tuned program's time
    # is that one's.
    ran = [key] + [o.key for o in _alternatives_in(result, ba)]
    tuned_key = next((k for k in ran if k in after), key)
    if key not in before and tuned_key not in after:
      continue
    e, ran_entry = tuned.get(key), tuned.get(tuned_key)
    alone = (e.heuristic_time / ran_entry.best_time
             if e is not None and ran_entry is not None and e.heuristic_time and ran_entry.best_time
             else None)
    name = ba.op.name if tuned_key == key else f"{ba.op.name} -> {ran_entry.bound_args.op.name}"
    out.append(CallTime(name, key, before.get(key), after.get(tuned_key), alone, key in changed))
  return tuple(sorted(out, key=lambda t: -(t.heuristic_s or 0.0)))


def _reference_run(program: Callable[[list], Any], arrays: list) -> Any:
  """The heuristic program's output, which every variant is checked against; where it
  fails, the error says that nothing can be checked."""
  try:
    return jax.jit(program)(arrays)
  except Exception as exc:
    exc.add_note("stellarax.check_in_program: this is the program with every op call at its "
                 "heuristic config, the reference each variant is checked against; the "
                 "check needs a program that runs.")
    raise


def check_in_program(result: AutotuningResult, f: Callable[..., Any], /, *args,
                     options: measure_lib.MeasureOptions | None = None,
                     profile: bool = False, **kwargs) -> ProgramCheck:
  """Times the program `f(*args, **kwargs)` with heuristic and tuned configs, and with
  each tuned call left out (see the module docstring).

  Args:
    result: the tuning result to check, e.g. `autotune(f, *args)`'s.
    f: the program, as `autotune` takes it (jittable; it is traced once per variant).
    *args, **kwargs: its arguments (arrays, and static values as `autotune` takes them).
    options: how to measure; default `MeasureOptions()`.
    profile: also profile the heuristic and the tuned program for each call's own
      device time (`ProgramCheck.call_times`; the module docstring says what it costs).

  Every variant pins each op call of the program: calls the result does not cover run
  their heuristic config in all of them (not a cache's or a transferred one, as under a
  plain `with result:`), so the differences measured are the result's alone. A call's
  heuristic is today's, which may differ from the one its entry recorded.

  Returns:
    The `ProgramCheck`.

  Raises:
    TypeError: for a `jax.stages.Traced`, `Lowered` or `Compiled` (its configs were
      fixed when it was traced; pass the function and its arguments).
    ValueError: if the program has no stellarax op call.
    stellarax.autotuning.profile.ProfileError: with `profile`, if a profile cannot be
      read; RuntimeError if a trace is already running (one at a time).
  """
  if isinstance(f, (jax.stages.Traced, jax.stages.Lowered, jax.stages.Compiled)):
    raise TypeError(
        f"check_in_program got a {type(f).__module__}.{type(f).__name__}, whose op configs "
        "were chosen when it was traced; it traces the program once per variant, so it "
        "needs the function: pass f and its arguments (check_in_program(result, f, *args)), "
        "not f.lower(*args).")
  found = capture.get_bound_args(f, *args, **kwargs)
  if not found:
    raise ValueError(f"{getattr(f, '__name__', f)!r} calls no stellarax op with these arguments:"
                     " nothing to check. Pass the program that was tuned, with its arguments.")
  device_kind = result.device_kind
  heuristic = {e.key: e for e in map(_heuristic_entry, found)}
  tuned = {e.key: e for e in result}
  # A call changes where its tuned config is not its heuristic, or where the result
  # times another implementation of it faster, which dispatch then runs instead.
  alternatives = {key: _faster_alternatives(result, h.bound_args, tuned.get(key))
                  for key, h in heuristic.items()}
  # Today's heuristic is the yardstick: the heuristic program runs it.
  changed = [(tuned.get(key, heuristic[key]), alternatives[key]) for key in heuristic
             if (key in tuned and tuned[key].best_config != heuristic[key].best_config)
             or alternatives[key]]
  pinned = lambda entries: AutotuningResult(device_kind, entries)
  # Static arguments (a mode string, a Python number) stay constants of the programs.
  program, arrays = capture.program_of_arrays(f, args, kwargs)
  programs = {_HEURISTICS: _under(pinned(heuristic), program),
              _TUNED: _under(pinned(heuristic | tuned), program)}
  without = lambda some: _under(pinned(_left_out(some, heuristic, tuned)), program)
  for i, call in enumerate(changed):
    programs[i] = without([call])
  options = options or measure_lib.MeasureOptions()
  reference = functools.cache(lambda: _reference_run(programs[_HEURISTICS], arrays))
  compiled: dict[Any, Any] = {}  # the tuned program is timed again with the weak calls
  measure = lambda variants: measure_lib.measure_candidates(
      variants, (arrays,), reference=reference, options=options, compile_cache=compiled)
  got = measure(programs)
  calls = [CallCheck(e, got[i], _helps(got[_TUNED], got[i]), others, heuristic[e.key].best_config)
           for i, (e, others) in enumerate(changed)]
  # Not a call that slows the program beyond noise: kept() puts it back, and a gain of
  # the others together must not keep it.
  weak = [i for i, c in enumerate(calls) if not c.helps and not _helps(c.without, got[_TUNED])]
  if got[_TUNED].ok and len(weak) >= 2:  # (a failing tuned program helps nowhere)
    if len(weak) == len(calls):  # all of them left out: the heuristic program
      together, with_them = got[_HEURISTICS], got[_TUNED]
    else:
      rerun = measure({_TOGETHER: without([changed[i] for i in weak]), _TUNED: programs[_TUNED]})
      together, with_them = rerun[_TOGETHER], rerun[_TUNED]
    helps = _helps(with_them, together)
    for i in weak:
      calls[i] = dataclasses.replace(calls[i], helps=helps, together=together,
                                     tuned_together=with_them, others_together=len(weak) - 1)
  culprits = [c for c in calls if not got[_TUNED].ok and c.without.ok]
  if culprits and len(culprits) < len(calls):
    # Every other call's program still holds a culprit and fails as the tuned one does:
    # they are judged again with the culprits at their heuristic configs.
    again = {c.entry.key: c for c in check_in_program(_put_back(result, culprits), f, *args,
                                                      options=options, **kwargs).calls}
    calls = [c if c in culprits or c.entry.key not in again
             else dataclasses.replace(again[c.entry.key], culprits_out=True) for c in calls]
  times = (_call_times(found, result, programs, (arrays,), {e.key for e, _ in changed},
                       tuned_ran=got[_TUNED].ok) if profile else ())
  return ProgramCheck(result, got[_HEURISTICS], got[_TUNED], tuple(calls), len(found), times)
