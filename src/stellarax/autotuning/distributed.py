"""Tuning spread over processes and devices, every process ending with one result.

`Autotuner.autotune` calls `tune_distributed` when the program runs several JAX
processes (`jax.distributed.initialize(...)`) or this process has several local devices
of its device kind (see `should_distribute`). The method:

1. Plans. Every process publishes the calls it wants tuned (bound-argument JSON), its
   device kind and how many local devices of that kind it has. The processes of one
   device kind form a group, which tunes the union of its members' calls (one call per
   autotuning key); processes of other kinds tune theirs apart.
2. Split. Each process computes the same split from the same plans (`split_calls`): the
   calls sorted by their (op, key) JSON go, largest config space first, to the least
   loaded worker, one worker per device of the group ordered by (process, local device).
   With `Autotuner.total_budget_s` the plans carry each call's weight too (its device
   time in a profile, `Autotuner._weights`; the largest any process gives a call
   counts): the workers run in parallel, so the calls share `total_budget_s` times
   the number of workers in proportion to their weights, and the split balances those
   budgets instead of config spaces; a share runs heaviest first, its calls drawing on
   the sum of their budgets (`Autotuner.BudgetPool`: what a call leaves, the next
   ones get, a call found in the cache included).
3. Tuning. A process runs one thread per local device. A thread takes the calls of its
   share in order, reuses the owner's cached entry (unless `ignore_cache`) or tunes the
   call on its device (`Autotuner.entry_for(..., device=...)`: the inputs are placed on
   that device, and compilation and runs follow them; with `cache=True` the entry goes
   into the owner's user cache at once), and publishes each finished call at once: a
   one-entry result in the file format, or the error that its tuning raised.
4. Gather. Every process reads every published call, its own included, back from the
   store and builds the result in the sorted call order: the same JSON in every process.

Transport. The key-value store of JAX's own distributed runtime (the coordination
service that `jax.distributed.initialize` starts), or an in-memory store when there is
one process. Keys live under `stellarax/autotune/<n>/`, n counting this process's
distributed tunings (the same in every process as long as all of them call `autotune`
alike); they stay in the coordination service until the job ends, about the size of the
result file per tuning.

Failures. Each process bumps a counter when one of its calls is published. A process of
the group whose counter does not move for `timeout_s` while calls of its share are
missing is taken to have failed (hung or dead; JAX's own heartbeat may end the job
first for a dead one), and so is one that does not publish its plan within `timeout_s`.
A call whose tuning raised is published as its error and its worker goes on. At the end
`DistributedTuningError` names each failed process (and device) and what it did not
tune; `exc.partial_result` holds every call that was tuned. So `timeout_s` must exceed
the longest tuning of a single call.

`check_consistent(result)` compares a digest of the configs that each process selects,
within each device kind, and names the first op call whose config differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax

from stellarax.autotuning import autotuner as autotuner_lib
from stellarax.autotuning import measure as measure_lib
from stellarax.autotuning.progress import Progress
from stellarax.autotuning.result import AutotuningResult, Entry
from stellarax.core.bound_args import BoundArguments
from stellarax.core.config import config_to_json
from stellarax.core.specs import canonical_json

# Seconds between two looks at the store while waiting for other workers.
_POLL_S = 0.1
# Calls listed per failed worker in an error message.
_SHOWN_CALLS = 5

_RUNS = itertools.count()
_CHECKS = itertools.count()

CallKey = tuple[str, str]


class DistributedTuningError(autotuner_lib.IncompleteTuningError, RuntimeError):
  """Some calls of a distributed tuning were not tuned.

  Attributes:
    partial_result: an `AutotuningResult` with every call that was tuned.
    not_tuned: the calls missing from `partial_result`, in sorted call order.
    failed_processes: the processes that stalled or whose tuning of a call raised.
    errors: call -> the error its tuning raised (calls that a stalled process never
      delivered are in `not_tuned` only).
  """

  def __init__(self, message: str, *, partial_result: AutotuningResult,
               not_tuned: Sequence[BoundArguments], failed_processes: Sequence[int],
               errors: Mapping[BoundArguments, str]):
    super().__init__(message, partial_result=partial_result, not_tuned=not_tuned, errors=errors)
    self.failed_processes = tuple(failed_processes)


class InconsistentConfigsError(ValueError):
  """Processes of one device kind select different configs for some op call."""


# --- where the work runs ------------------------------------------------------------------


def local_tuning_devices() -> list[jax.Device]:
  """This process's local devices of its device kind (that of its first local device)."""
  local = jax.local_devices()
  return [d for d in local if d.device_kind == local[0].device_kind]


def should_distribute() -> bool:
  """Whether `autotune` splits its calls: several processes, or several local devices."""
  return jax.process_count() > 1 or len(local_tuning_devices()) > 1


def split_calls(calls: Sequence[BoundArguments], num_workers: int, *,
                loads: Mapping[BoundArguments, float] | None = None
                ) -> list[list[BoundArguments]]:
  """Splits calls among workers: the same answer in every process, loads balanced.

  The calls are sorted by their (op, key) JSON; then, largest load first (ties in sorted
  order), each goes to the worker with the smallest total load so far (ties to the
  lower worker). A call's load is its config space's size, or `loads[call]`. A share
  keeps the sorted order.

  Args:
    calls: the calls to split (one per autotuning key).
    num_workers: how many workers share them, >= 1.
    loads: call -> its cost (e.g. its tuning budget); None counts configs.

  Returns:
    One list of calls per worker; every call is in exactly one list.

  Raises:
    ValueError: if num_workers < 1.
  """
  if num_workers < 1:
    raise ValueError(f"{num_workers=} must be >= 1: one worker per device that tunes.")
  ordered = sorted(calls, key=_call_key)
  sizes = [len(ba.with_config(None).autotuning_configs) if loads is None else loads[ba]
           for ba in ordered]
  loads = [0] * num_workers
  owner = [0] * len(ordered)
  for i in sorted(range(len(ordered)), key=lambda i: (-sizes[i], i)):
    owner[i] = min(range(num_workers), key=lambda w: (loads[w], w))
    loads[owner[i]] += sizes[i]
  return [[ba for ba, o in zip(ordered, owner) if o == w] for w in range(num_workers)]


# --- the store --------------------------------------------------------------------------


class _Store(Protocol):
  def set(self, key: str, value: str, *, overwrite: bool = False) -> None: ...
  def try_get(self, key: str) -> str | None: ...
  def get(self, key: str, timeout_s: float) -> str | None: ...


class _KvStore:
  """The coordination service's key-value store of `jax.distributed`."""

  def __init__(self, client: Any):
    self._client = client

  def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
    self._client.key_value_set(key, value, allow_overwrite=overwrite)

  def try_get(self, key: str) -> str | None:
    try:
      return self._client.key_value_try_get(key)
    except jax.errors.JaxRuntimeError as exc:
      if "NOT_FOUND" in str(exc):
        return None
      raise

  def get(self, key: str, timeout_s: float) -> str | None:
    try:
      return self._client.blocking_key_value_get(key, max(1, math.ceil(timeout_s * 1000)))
    except jax.errors.JaxRuntimeError as exc:
      if "DEADLINE_EXCEEDED" in str(exc):
        return None
      raise


class _MemoryStore:
  """The same interface within one process (several local devices, one process)."""

  def __init__(self):
    self._data: dict[str, str] = {}
    self._changed = threading.Condition()

  def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
    with self._changed:
      if key in self._data and not overwrite:
        raise KeyError(f"{key!r} is already set.")
      self._data[key] = value
      self._changed.notify_all()

  def try_get(self, key: str) -> str | None:
    with self._changed:
      return self._data.get(key)

  def get(self, key: str, timeout_s: float) -> str | None:
    with self._changed:
      self._changed.wait_for(lambda: key in self._data, timeout=timeout_s)
      return self._data.get(key)


def _store() -> _Store:
  """The store shared by all processes; raises when several run without jax.distributed."""
  if jax.process_count() == 1:
    return _MemoryStore()
  from jax._src import distributed as jax_distributed  # The client lives only here.
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError(
        f"jax.process_count()={jax.process_count()} but jax.distributed is not initialised, "
        "and distributed tuning exchanges results through its key-value store. Call "
        "jax.distributed.initialize(...) first, or tune in each process alone with "
        "stellarax.Autotuner(distribute=False).")
  return _KvStore(client)


# --- tuning -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class _Worker:
  """One device of the group: a process and the index among its local devices."""
  process: int
  device: int

  def __str__(self) -> str:
    return f"process {self.process} (local device {self.device})"


@dataclasses.dataclass(frozen=True)
class _Plan:
  process: int
  device_kind: str
  num_devices: int
  calls: tuple[BoundArguments, ...]
  weights: tuple[float, ...] = ()  # per call, with total_budget_s (else empty)


def tune_distributed(tuner: autotuner_lib.Autotuner, calls: Sequence[BoundArguments], *,
                     timeout_s: float,
                     weights: Mapping[BoundArguments, float] | None = None) -> AutotuningResult:
  """Tunes calls spread over every device of every process of this device kind.

  Every process of the job must call it (through `Autotuner.autotune`) at the same point
  of the program; see the module docstring for the method.

  Args:
    tuner: the tuning options; each call is tuned by `tuner.tune_one`.
    calls: the calls this process wants tuned.
    timeout_s: how long to wait for a process's plan, and for a process's next tuned call
      while some of its share is missing, before taking it to have failed.
    weights: with `tuner.total_budget_s`, what tuning each call is worth (a call not
      in it weighs 0.0); see step 2 of the module docstring.

  Returns:
    The result of the union of the calls of this device kind's processes, identical
    (to the byte in `dumps()`) in all of them.

  Raises:
    ValueError: if timeout_s is not a positive number.
    RuntimeError: if several processes run without `jax.distributed`.
    DistributedTuningError: when a process stalled or some call's tuning raised; it names
      them and carries what was tuned in `partial_result`.
  """
  if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
    raise ValueError(f"{timeout_s=} must be a positive number of seconds: how long to wait "
                     "for another process's next tuned call before giving up on it.")
  devices = local_tuning_devices()
  kind, me = devices[0].device_kind, jax.process_index()
  store, prefix = _store(), f"stellarax/autotune/{next(_RUNS)}/"
  # A process that weighed nothing (all its calls cached) sends zeros; the largest counts.
  weighed = (tuple((weights or {}).get(ba, 0.0) for ba in calls)
             if tuner.total_budget_s is not None else ())
  plans = _exchange_plans(store, prefix, _Plan(me, kind, len(devices), tuple(calls), weighed),
                          timeout_s)
  group = [p for p in plans if p.device_kind == kind]
  todo = _union(group)
  workers = [_Worker(p.process, d) for p in group for d in range(p.num_devices)]
  budgets = _budgets(tuner, group, todo, len(workers))
  shares = dict(zip(workers, split_calls(todo, len(workers), loads=budgets)))
  if budgets is not None:  # heaviest first; the same order in every process
    shares = {w: sorted(share, key=lambda ba: -budgets[ba]) for w, share in shares.items()}
  mine = {w: shares[w] for w in workers if w.process == me}
  progress = _LockedProgress(sum(len(ba.autotuning_configs) for s in mine.values() for ba in s),
                             enabled=tuner.progress)
  _start_workers(tuner, mine, devices, _Publisher(store, prefix, me, kind), progress, budgets or {})
  try:
    delivered, errors, stalled = _gather(store, prefix, shares, kind, timeout_s)
  finally:
    progress.close()
  result = AutotuningResult(kind, {_call_key(ba): delivered[_call_key(ba)] for ba in todo
                                   if _call_key(ba) in delivered})
  if errors or stalled:
    raise _incomplete(result, todo, shares, errors, stalled, timeout_s)
  if tuner.progress and me == group[0].process and len(result):  # One table per group.
    print(result.summary(), file=sys.stderr)
  return result


def _exchange_plans(store: _Store, prefix: str, plan: _Plan, timeout_s: float) -> list[_Plan]:
  """Publishes this process's plan and reads every process's, waiting at most timeout_s."""
  store.set(f"{prefix}plan/{plan.process}", json.dumps({
      "device_kind": plan.device_kind, "num_devices": plan.num_devices,
      "calls": [ba.with_config(None).to_json() for ba in plan.calls],
      "weights": list(plan.weights)}))
  deadline = time.monotonic() + timeout_s
  plans = []
  for process in range(jax.process_count()):
    raw = store.get(f"{prefix}plan/{process}", max(deadline - time.monotonic(), 0.001))
    if raw is None:
      raise DistributedTuningError(
          f"Distributed autotuning: process {process} did not say which calls it tunes "
          f"within timeout_s={timeout_s:g} s (hung, dead, or not calling autotune at this "
          "point of the program); nothing was tuned. Call autotune in every process (they "
          "split the work), or tune in one process alone with "
          "stellarax.Autotuner(distribute=False).",
          partial_result=AutotuningResult(plan.device_kind), not_tuned=sorted(plan.calls, key=_call_key),
          failed_processes=[process], errors={})
    data = json.loads(raw)
    same_kind = data["device_kind"] == plan.device_kind  # Other kinds' calls are theirs.
    plans.append(_Plan(process, data["device_kind"], int(data["num_devices"]),
                       tuple(BoundArguments.from_json(c) for c in data["calls"]) if same_kind else (),
                       tuple(float(w) for w in data.get("weights", ())) if same_kind else ()))
  return plans


def _budgets(tuner: autotuner_lib.Autotuner, group: Sequence[_Plan],
             todo: Sequence[BoundArguments], num_workers: int
             ) -> dict[BoundArguments, float] | None:
  """Each call's tuning budget under `total_budget_s` (step 2 of the module docstring),
  the same in every process; None without a total budget."""
  if tuner.total_budget_s is None:
    return None
  weights: dict[CallKey, float] = {}
  for plan in group:
    for ba, weight in zip(plan.calls, plan.weights):
      key = _call_key(ba)
      weights[key] = max(weights.get(key, 0.0), weight)
  by_call = {ba: weights.get(_call_key(ba), 0.0) for ba in todo}
  return autotuner_lib.budget_shares(todo, by_call, tuner.total_budget_s * num_workers)


def _union(group: Sequence[_Plan]) -> list[BoundArguments]:
  """The group's calls, one per autotuning key (the first by process), sorted."""
  calls: dict[CallKey, BoundArguments] = {}
  for plan in group:
    for ba in plan.calls:
      calls.setdefault(_call_key(ba), ba.with_config(None))
  return [calls[k] for k in sorted(calls)]


class _LockedProgress:
  """A `Progress` that the worker threads of one process share."""

  def __init__(self, total: int, *, enabled: bool):
    self._progress = Progress(total, enabled=enabled)
    self._lock = threading.Lock()

  def advance(self, n: int, label: str = "", *, skipped: bool = False) -> None:
    """`Progress.advance`, under the lock."""
    with self._lock:
      self._progress.advance(n, label, skipped=skipped)

  def close(self) -> None:
    self._progress.close()


class _Publisher:
  """Publishes finished calls: call key first, then this process's counter."""

  def __init__(self, store: _Store, prefix: str, process: int, device_kind: str):
    self._store, self._prefix, self._process, self._kind = store, prefix, process, device_kind
    self._count = 0
    self._lock = threading.Lock()

  def publish(self, worker: _Worker, index: int, entry: Entry | None, error: str | None) -> None:
    value = ({"entry": AutotuningResult(self._kind, {entry.key: entry}).dumps()}
             if entry is not None else {"error": error})
    self._store.set(_call_slot(self._prefix, worker, index), json.dumps(value))
    with self._lock:  # The counter only moves forward, so readers never see it go back.
      self._count += 1
      self._store.set(f"{self._prefix}count/{self._process}", str(self._count), overwrite=True)


def _start_workers(tuner: autotuner_lib.Autotuner, shares: Mapping[_Worker, list[BoundArguments]],
                   devices: Sequence[jax.Device], publisher: _Publisher,
                   progress: _LockedProgress, budgets: Mapping[BoundArguments, float]) -> None:
  """One daemon thread per local device (a hung one must not keep the process alive)."""
  for worker, share in shares.items():
    thread = threading.Thread(
        target=measure_lib.carried_settings(_tune_share),
        args=(tuner, worker, share, devices[worker.device], publisher, progress, budgets),
        name=f"stellarax-tune-{worker.device}", daemon=True)
    thread.start()


def _tune_share(tuner: autotuner_lib.Autotuner, worker: _Worker, share: Sequence[BoundArguments],
                device: jax.Device, publisher: _Publisher, progress: _LockedProgress,
                budgets: Mapping[BoundArguments, float]) -> None:
  # The share's calls draw on the sum of their budgets: what one leaves goes to the next.
  pool = (autotuner_lib.BudgetPool({ba: budgets[ba] for ba in share}, sum(budgets[ba] for ba in share))
          if budgets and share else None)
  lost = None  # once a call lost the device, nothing more can run in this process
  for index, ba in enumerate(share):
    entry, error = None, lost
    if lost is None:
      try:
        entry = tuner.entry_for(ba, progress=progress, device=device, pool=pool)
      except measure_lib.DeviceLostError as exc:
        error = f"{type(exc).__name__}: {exc}"
        lost = f"not tuned: tuning an earlier call of this process lost its device ({exc.key!r} of {ba})"
      except Exception as exc:  # Reported to every process as data; the share goes on.
        error = f"{type(exc).__name__}: {exc}"
    publisher.publish(worker, index, entry, error)


def _gather(store: _Store, prefix: str, shares: Mapping[_Worker, list[BoundArguments]],
            device_kind: str, timeout_s: float
            ) -> tuple[dict[CallKey, Entry], dict[BoundArguments, str], dict[_Worker, int]]:
  """Reads every worker's calls as they are published.

  Returns:
    (call key -> entry, call -> error, stalled worker -> how many of its calls arrived).
  """
  next_index = {w: 0 for w in shares}
  seen = {p: 0 for p in {w.process for w in shares}}
  last_progress = {p: time.monotonic() for p in seen}
  delivered: dict[CallKey, Entry] = {}
  errors: dict[BoundArguments, str] = {}
  stalled: dict[_Worker, int] = {}
  pending = {p for p in seen if any(shares[w] for w in shares if w.process == p)}
  while pending:
    for process in sorted(pending):
      count = int(store.try_get(f"{prefix}count/{process}") or 0)
      if count > seen[process]:
        seen[process], last_progress[process] = count, time.monotonic()
        for worker in (w for w in shares if w.process == process):
          _read_new(store, prefix, worker, shares[worker], next_index, device_kind, delivered, errors)
      missing = [w for w in shares if w.process == process and next_index[w] < len(shares[w])]
      if not missing:
        pending.discard(process)
      elif time.monotonic() - last_progress[process] > timeout_s:
        stalled.update({w: next_index[w] for w in missing})
        pending.discard(process)
    if pending:
      time.sleep(_POLL_S)
  return delivered, errors, stalled


def _read_new(store: _Store, prefix: str, worker: _Worker, share: Sequence[BoundArguments],
              next_index: dict[_Worker, int], device_kind: str,
              delivered: dict[CallKey, Entry], errors: dict[BoundArguments, str]) -> None:
  while next_index[worker] < len(share):
    raw = store.try_get(_call_slot(prefix, worker, next_index[worker]))
    if raw is None:
      return
    data, ba = json.loads(raw), share[next_index[worker]]
    if "entry" in data:
      source = f"the tuning of {ba} by {worker}"
      one = AutotuningResult.loads(data["entry"], source=source)
      (entry,) = one
      if entry.key != _call_key(ba) or one.device_kind != device_kind:
        raise RuntimeError(f"{source} delivered an entry for another call or device kind: "
                           f"{entry.bound_args} on {one.device_kind!r}. Do all processes run the "
                           "same stellarax version?")
      delivered[entry.key] = entry
    else:
      errors[ba] = data["error"]
    next_index[worker] += 1


def _incomplete(result: AutotuningResult, todo: Sequence[BoundArguments],
                shares: Mapping[_Worker, list[BoundArguments]], errors: Mapping[BoundArguments, str],
                stalled: Mapping[_Worker, int], timeout_s: float) -> DistributedTuningError:
  lines = []
  for worker, arrived in sorted(stalled.items()):
    missed = shares[worker][arrived:]
    lines.append(f"  {worker} delivered no tuned call for timeout_s={timeout_s:g} s (hung or "
                 f"dead?); it did not tune {len(missed)} of its {len(shares[worker])} calls: "
                 + _list_calls(missed))
  owner = {_call_key(ba): w for w, share in shares.items() for ba in share}
  for ba, error in errors.items():
    first_line = error.strip().splitlines()[0] if error.strip() else error
    lines.append(f"  {owner[_call_key(ba)]}: tuning {ba} raised {first_line} (full text in exc.errors)")
  not_tuned = [ba for ba in todo if result.entry(ba) is None]
  failed = sorted({w.process for w in stalled} | {owner[_call_key(ba)].process for ba in errors})
  message = (f"Distributed autotuning on {result.device_kind!r} tuned {len(result)} of {len(todo)} "
             f"calls; processes {failed} failed:\n" + "\n".join(lines) +
             f"\nThe {len(result)} tuned calls are in exc.partial_result. A slow (not hung) "
             "process needs a larger stellarax.Autotuner(distributed_timeout_s=...).")
  return DistributedTuningError(message, partial_result=result, not_tuned=not_tuned,
                                failed_processes=failed, errors=errors)


def _list_calls(calls: Sequence[BoundArguments]) -> str:
  shown = ", ".join(str(ba) for ba in calls[:_SHOWN_CALLS])
  return shown + (f", ... and {len(calls) - _SHOWN_CALLS} more" if len(calls) > _SHOWN_CALLS else "")


def _call_key(ba: BoundArguments) -> CallKey:
  return (ba.op_json(), ba.key_json())


def _call_slot(prefix: str, worker: _Worker, index: int) -> str:
  return f"{prefix}call/{worker.process}/{worker.device}/{index}"


# --- the consistency check ------------------------------------------------------------------


def config_digest(result: AutotuningResult) -> str:
  """A digest of the config that `result` selects for every op call (and its device kind).

  Args:
    result: the result to digest.

  Returns:
    A hex SHA-256 digest; equal for results that select the same configs.
  """
  return hashlib.sha256(canonical_json([result.device_kind, _selections(result)]).encode()).hexdigest()


def check_consistent(result: AutotuningResult, *, timeout_s: float = 300.0) -> str:
  """Checks that every process of `result`'s device kind selects the same configs.

  Every process must call it at the same point of the program. Each publishes a digest
  of its selections through `jax.distributed`'s key-value store and compares it with
  the other processes' of the same device kind. With one process there is nothing to
  compare.

  Args:
    result: the result this process runs with.
    timeout_s: how long to wait for the other processes' digests.

  Returns:
    The digest (`config_digest(result)`), the same in every process of the kind.

  Raises:
    InconsistentConfigsError: (a ValueError) naming the first op call, in sorted
      (op, key) order, whose config differs between this process and another.
    TimeoutError: naming the processes that did not publish their digest in time.
    RuntimeError: if several processes run without `jax.distributed`.
  """
  digest = config_digest(result)
  if jax.process_count() == 1:
    return digest
  store, me = _store(), jax.process_index()
  prefix = f"stellarax/consistency/{next(_CHECKS)}/"
  mine = _selections(result)
  store.set(f"{prefix}{me}", json.dumps({"device_kind": result.device_kind, "digest": digest,
                                         "selections": mine}))
  deadline = time.monotonic() + timeout_s
  late = []
  for process in range(jax.process_count()):
    raw = store.get(f"{prefix}{process}", max(deadline - time.monotonic(), 0.001))
    if raw is None:
      late.append(process)
      continue
    theirs = json.loads(raw)
    if theirs["device_kind"] == result.device_kind and theirs["digest"] != digest:
      raise InconsistentConfigsError(_first_difference(result, mine, theirs["selections"], me, process))
  if late:
    raise TimeoutError(f"check_consistent: processes {late} did not publish their configs within "
                       f"timeout_s={timeout_s:g} s; every process must call check_consistent.")
  return digest


def _selections(result: AutotuningResult) -> list[list[str]]:
  """[op JSON, key JSON, best config JSON] per entry, sorted."""
  return sorted([*e.key, canonical_json(config_to_json(e.best_config))] for e in result)


def _first_difference(result: AutotuningResult, mine: list[list[str]], theirs: list[list[str]],
                      me: int, other: int) -> str:
  selected = {me: {(op, key): c for op, key, c in mine}, other: {(op, key): c for op, key, c in theirs}}
  low, high = sorted(selected)  # The same message in both processes.
  for call in sorted(selected[low].keys() | selected[high].keys()):
    if selected[low].get(call) != selected[high].get(call):
      entry = next((e for e in result if e.key == call), None)
      name = str(entry.bound_args) if entry is not None else f"{json.loads(call[0])['name']} with key {call[1]}"
      config = lambda p: selected[p].get(call, "none (not in its result)")
      return (f"Processes {low} and {high} run {name} with different configs: {config(low)} in "
              f"process {low}, {config(high)} in process {high}. Tune once for all processes "
              "(stellarax.Autotuner().autotune in every process of a jax.distributed job gives "
              "them one result) or load the same result file everywhere.")
  return f"Processes {low} and {high} select different configs."  # Unreachable: digests differ.
