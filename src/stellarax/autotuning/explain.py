"""`explain(bound_args)`: where the config of a call comes from, and why not."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from stellarax.autotuning.autotuner import config_tuned_on_miss
from stellarax.autotuning.cache import cached_results, other_device_kinds
from stellarax.autotuning.transfer import (MAX_DISTANCE, TransferResolution, nearest_distance,
                                          transfer_enabled, transfer_scope)
from stellarax.core import resolution
from stellarax.core.bound_args import BoundArguments
from stellarax.core.config import config_to_json


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What `explain` found.

  Attributes:
    op: the op's registered name.
    config: the config the call resolves to.
    source: where it comes from ("explicit", "result", "user_cache",
      "library_cache", "transfer:<distance>", "heuristics", "heuristics:only config" for a
      call whose space holds its heuristic config alone, ...); "miss:error" or
      "miss:autotune" where nothing was measured and the miss policy makes the call
      raise or tune (config: its heuristic); "autotuned" where that policy has tuned
      the call in this process (config: the one it found); or "trivial" (config None)
      for a call that runs no kernel (`Op._is_trivial`).
    nearest: on a miss, the nearest tuned key of the same op: where it is
      and the differences, as (where, ["path: ours != theirs", ...]); None
      when nothing of this op was tuned. For a transferred config, the key
      it was transferred from.
    confidence: for a transferred config, the transfer's confidence in
      (0, 1] (see `stellarax.autotuning.transfer`); else None.
    stale: for a config from a stale result or cache entry, why it is stale
      (`Entry.stale_reason`; `autotune` measures the call again); for a transferred
      config, why the entry it came from is; else None.
    passed_over: where the call's own entry was passed over (stale, its config no
      longer offered: `Entry.config_to_run`), which entry and why, in words; else None.
    too_far: on a miss where transfer is on, the distance to the nearest comparable
      tuned call when it lies beyond `transfer.MAX_DISTANCE`; else None.
    untransferred: on a miss where transfer is on, the distance to the nearest
      comparable tuned call when it lies within `transfer.MAX_DISTANCE` and still none
      gave a config (each measured only its heuristic, or holds none valid here); else
      None.
    other_device_kinds: on a miss with nothing of this op tuned for this device kind,
      the device kinds the caches hold tuned calls of the op for (configs tuned on one
      device are not used on another).
  """

  op: str
  config: Any
  source: str
  nearest: tuple[str, tuple[str, ...]] | None
  confidence: float | None = None
  stale: str | None = None
  other_device_kinds: tuple[str, ...] = ()
  too_far: float | None = None
  passed_over: str | None = None
  untransferred: float | None = None

  def __str__(self) -> str:
    if self.source == "trivial":
      return (f"{self.op}: no config: the call's output is zeros whatever its inputs (an empty "
              "dimension), so it runs no kernel")
    source = self.source
    if source.startswith("transfer:"):  # "transfer:<distance>" reads as a score otherwise
      source = f"transfer (key distance {source.partition(':')[2]})"
    lines = [f"{self.op}: {json.dumps(config_to_json(self.config))} from {source}"]
    if self.passed_over is not None:
      # Where no other entry answered, tuning measures the call again.
      again = source.startswith(("heuristics", "miss", "transfer"))
      lines.append(f"  {self.passed_over}" + ("; autotune measures the call again" if again
                                               else ""))
    if self.stale is not None and self.confidence is not None:
      lines.append(f"  transferred from a stale entry ({self.stale}): autotune(...) of this "
                   "call measures it")
    elif self.stale is not None:
      lines.append(f"  stale ({self.stale}): autotune measures this call again")
    if self.confidence is not None:
      where, diffs = self.nearest
      lines.append(f"  transferred with confidence {self.confidence:.2f} from the nearest tuned "
                   f"call ({where}), which differs in: " + "; ".join(diffs))
    elif self.nearest is not None:
      where, diffs = self.nearest
      lines.append(f"  nearest tuned call ({where}) differs in: " + "; ".join(diffs))
      if self.too_far is not None:
        lines.append(f"  no config transferred: the nearest comparable tuned call is at key "
                     f"distance {self.too_far:.2f}, beyond {MAX_DISTANCE:g} (transfer."
                     "MAX_DISTANCE), so the heuristic answers; tune this call for a measured "
                     "config")
      if self.untransferred is not None:
        lines.append(f"  no config transferred: the comparable tuned calls within key "
                     f"distance {MAX_DISTANCE:g} (the nearest at {self.untransferred:.2f}) "
                     "measured only their heuristic config (a budget too small to search) "
                     "or hold none valid for this call, so the heuristic answers; tune this "
                     "call for a measured config")
    elif self.source == resolution.ONLY_CONFIG:
      lines.append("  its only config for this call: nothing to tune, whatever the miss policy")
    elif self.source.startswith(("heuristics", "miss")) and self.passed_over is None:
      lines.append("  no call of this op was tuned in the active results or caches")
    if self.other_device_kinds:
      lines.append(f"  the caches hold calls of this op tuned on other devices "
                   f"({', '.join(self.other_device_kinds)}), which are not used here")
    if self.source == "miss:error":
      lines.append("  the miss policy is 'error': the call raises ConfigMissError (the config "
                   "above is its heuristic)")
    elif self.source == "autotuned":
      lines.append("  tuned when first traced, under the 'autotune' miss policy: kept for this"
                   " process only (autotune(...) gives a result to keep)")
    elif self.source == "miss:autotune":
      lines.append("  the miss policy is 'autotune': the call is tuned when it is traced (the "
                   "config above is its heuristic)")
    return "\n".join(lines)


def explain(bound_args: BoundArguments) -> Explanation:
  """Says where the config of `bound_args` comes from.

  Args:
    bound_args: a `BoundArguments` (e.g. from `SomeOp.bind(...)` or
      `get_bound_args`).

  Returns:
    An `Explanation` (printable); on a miss it names the nearest tuned call
    of the same op and how its key differs; for a transferred config, the
    call it came from and the confidence. It explains, whatever the miss policy:
    under "error" or "autotune" a miss is reported as such, neither raised nor tuned.
    It tells what a call traced now resolves to: code compiled before the caches
    changed keeps its configs (a result entered retraces it; see `with result:`).

  Raises:
    TypeError: if `bound_args` is not a BoundArguments.
  """
  if not isinstance(bound_args, BoundArguments):
    raise TypeError(f"explain takes a BoundArguments (from SomeOp.bind(...) or get_bound_args), "
                    f"got {type(bound_args).__name__}: {bound_args!r:.80}.")
  if bound_args.op.fwd_cls is None and bound_args.op._is_trivial(bound_args.arguments):
    return Explanation(bound_args.op.name, None, "trivial", None)
  policy = resolution.miss_policy()
  # Explaining neither raises nor tunes. Transfer answers only under the "heuristics"
  # policy (under the others a traced call raises or tunes), so it is off for them here.
  with (resolution.miss_policy_scope("heuristics"),
        transfer_scope(policy == "heuristics" and transfer_enabled())):
    resolved = resolution.resolve_config(bound_args)
  if resolved.source == "heuristics" and policy != "heuristics":
    tuned = config_tuned_on_miss(bound_args) if policy == "autotune" else None
    resolved = (resolution.Resolution(tuned, "autotuned") if tuned is not None
                else resolution.Resolution(resolved.config, f"miss:{policy}"))
  # An entry of the call passed over before the source that answered (a stale one in an
  # inner result, where an outer result, a cache or transfer answered) is said too.
  passed_over = _passed_over(bound_args) if resolved.source != "explicit" else None
  if isinstance(resolved, TransferResolution):
    diffs = _diff(bound_args.autotuning_cache_key, resolved.neighbour.autotuning_cache_key)
    where = "result" if resolved.where == "active result" else resolved.where
    return Explanation(bound_args.op.name, resolved.config, resolved.source,
                       (resolved.where, tuple(diffs)), resolved.confidence,
                       stale=_stale_reason(resolved.neighbour, where), passed_over=passed_over)
  nearest, elsewhere, too_far, untransferred = None, (), None, None
  if resolved.source not in ("explicit", "result") and not resolved.source.endswith("cache"):
    nearest = _nearest(bound_args)
    if nearest is None:
      elsewhere = other_device_kinds(bound_args.op.name)
    elif resolved.source == "heuristics" and transfer_enabled():  # (not "only config")
      distance = nearest_distance(bound_args)
      if distance is not None:
        too_far = distance if distance > MAX_DISTANCE else None
        untransferred = distance if distance <= MAX_DISTANCE else None
  return Explanation(bound_args.op.name, resolved.config, resolved.source, nearest,
                     stale=_stale_reason(bound_args, resolved.source),
                     other_device_kinds=elsewhere, too_far=too_far, passed_over=passed_over,
                     untransferred=untransferred)


def _passed_over(bound_args: BoundArguments) -> str | None:
  """Where resolution passed over the call's own entry, before an entry (if any) gave
  it a config: a stale entry holding a config no longer in the call's space
  (`Entry.config_to_run`), in words; None where none was passed over."""
  accept = resolution.reproducible_filter(bound_args.op)
  for where, entry in _own_entries(bound_args):
    if entry.config_to_run(accept, warn_passed_over=False) is not None:
      return None  # This entry answered: what follows was not reached.
    config = entry.config_for(accept)
    if config is not None and not entry.is_current:
      return (f"the {where}'s entry of this call is stale ({entry.stale_reason}) and holds "
              f"{json.dumps(config_to_json(config))}, which the op no longer offers for it: "
              "passed over")
  return None


def _stale_reason(bound_args: BoundArguments, source: str) -> str | None:
  """Why the entry of `bound_args` that answered from a result ("result": the active
  ones) or cache (its source name) is stale, or None. Entries that resolution passed
  over (no config to run: `Entry.config_to_run`) did not answer."""
  accept = resolution.reproducible_filter(bound_args.op)
  for where, entry in _own_entries(bound_args):
    if where == source and entry.config_to_run(accept, warn_passed_over=False) is not None:
      return entry.stale_reason
  return None


def _sources(bound_args: BoundArguments):
  """(where, result) that resolution looks in for the call, in its order: the active
  results ("result"), innermost first, then the caches (by their source names)."""
  for result in reversed(resolution.active_results()):
    yield "result", result
  yield from cached_results(bound_args.op.name)


def _own_entries(bound_args: BoundArguments):
  """(where, entry) of the call's own entries, in resolution order."""
  for where, result in _sources(bound_args):
    entry = result.entry(bound_args) if hasattr(result, "entry") else None
    if entry is not None:
      yield where, entry


def _candidates(bound_args: BoundArguments):
  for where, result in _sources(bound_args):
    for entry in result:
      yield "active result" if where == "result" else where, entry


def _nearest(bound_args: BoundArguments):
  ours = bound_args.autotuning_cache_key
  best = None
  for where, entry in _candidates(bound_args):
    if entry.bound_args.op.name != bound_args.op.name:
      continue
    diffs = tuple(_diff(ours, entry.bound_args.autotuning_cache_key))
    if entry.bound_args.op_json() != bound_args.op_json():
      diffs = ("op fields",) + diffs
    if not diffs:  # the call's own entry, passed over (`_passed_over` says why)
      continue
    if best is None or len(diffs) < len(best[1]):
      best = (where, diffs)
  return best


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
  if isinstance(a, dict) and isinstance(b, dict):
    if a.get("__array__") and b.get("__array__"):
      if a != b:
        return [f"{path}: {a['dtype']}{a['shape']} != {b['dtype']}{b['shape']}"]
      return []
    out = []
    for k in sorted(set(a) | set(b)):
      out += _diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    return out
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
  if a == b and type(a) is type(b):
    return []
  if a == b:  # 3 and 3.0, True and 1: two keys all the same (`specs.types_of`)
    return [f"{path}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"]
  return [f"{path}: {a!r} != {b!r}"]
