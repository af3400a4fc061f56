"""Transfer: a config for an untuned call, from the nearest tuned calls of the same op.

Exact keys miss on every new sequence length or batch size. On such a miss (no active
result and no cache holds the call's key), `resolve_config` asks the fallback registered
here before it falls back to the op's heuristic. The fallback looks through the active
results (innermost first), then the caches (user, then library), for entries

- of the same op: equal `op_json()` (registered name and identity fields);
- recorded on the current device kind;
- of the same structure: the same array arguments with the same ranks and dtypes, and the
  same vmap levels with the same batched arguments.

It orders them by a distance over shape features and returns the best config of the
nearest one, provided that config is in the new call's search space (`autotuning_configs`:
a tile larger than the new shape allows is never transferred); otherwise the next nearest,
and so on. When nothing qualifies, the heuristic answers as before.

Not from further than `MAX_DISTANCE` (4): what was fastest at a sequence length of 256
says little about 16384, where it may not even fit (attention's unchunked XLA config, the
fastest at T=256 on a CPU, needs 16 GiB of scores at T=16384, its heuristic's chunks
0.1 GiB). The heuristic, written for every shape, answers there. A size counts once for
every array dimension that has it, so the limit is one array dimension 16 times larger or
smaller (ragged_dot's M), but for self-attention's T and S, in the query, key and value,
about 5 times (about 3 with a bias and a mask over T and S too). In the recorded CPU
sweeps every key has a neighbour within 2.9, and their leave-one-out regret is the same
with the limit.

Features. An op class may define `_transfer_features(self, ba) -> dict[str, float]`; the
default, `default_features`, is log2 of every array dimension and of every vmap size.
Distance: the Euclidean norm of the feature differences (calls whose feature names differ
are not comparable), with one more unit squared for every non-array argument that differs
(`is_causal`, `precision`, ...). With the default features a distance of 1 is one
dimension doubled.

Confidence: 2 ** -distance, so 1 for a call that differs in nothing the features see, 0.5
for one dimension doubled. `explain()` reports it with the neighbour's key.

The switch: `STELLARAX_TRANSFER=0` turns transfer off, `with transfer_scope(False):` (or
True) overrides the variable inside a block. Transfer also steps aside unless the miss
policy is "heuristics": "error" asks for measured configs only, "autotune" for measuring.
Like the miss policy, these settings act when a call is traced: a function jitted earlier
whose calls they decide is traced again inside a scope that changes them; the
environment variable is read when a call is traced (set it before the program runs).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from stellarax.autotuning.cache import cached_results, target_device_kind
from stellarax.autotuning.result import AutotuningResult, Entry
from stellarax.core import resolution
from stellarax.core import specs
from stellarax.core import trace_keys
from stellarax.core.bound_args import BoundArguments

# The farthest a tuned call's config is transferred from (see the module docstring).
MAX_DISTANCE = 4.0

_ENV = "STELLARAX_TRANSFER"
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")

_scoped: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "stellarax_transfer", default=None)


@dataclasses.dataclass(frozen=True)
class TransferResolution(resolution.Resolution):
  """A config transferred from the nearest tuned call of the same op.

  Attributes:
    config: the neighbour's best config (valid for the new call).
    source: "transfer:<distance>", the distance with two decimals.
    distance: the distance to the neighbour (see the module docstring).
    confidence: 2 ** -distance, in (0, 1].
    where: where the neighbour was found ("active result", "user_cache", ...).
    neighbour: the neighbour's bound arguments.
  """

  distance: float = 0.0
  confidence: float = 1.0
  where: str = ""
  neighbour: BoundArguments | None = None


# ---- the switch ------------------------------------------------------------------------


def transfer_enabled() -> bool:
  """Whether transfer is on: `transfer_scope`, else `STELLARAX_TRANSFER`, else on.

  Raises:
    ValueError: when `STELLARAX_TRANSFER` is set to something other than 0/1 (or
      false/true, off/on, no/yes).
  """
  scoped = _scoped.get()
  if scoped is not None:
    return scoped
  value = os.environ.get(_ENV, "1").strip().lower()
  if value in _ON:
    return True
  if value in _OFF:
    return False
  raise ValueError(f"{_ENV}={os.environ[_ENV]!r} must be 1 (transfer on) or 0 (off); "
                   "unset it for the default (on).")


# A call resolved when XLA partitions the program sees the switch of when it was traced.
resolution.carry_setting(_scoped.get, functools.partial(trace_keys.settings_scope, _scoped))


@contextlib.contextmanager
def transfer_scope(enabled: bool) -> Iterator[None]:
  """Turns transfer on or off inside a `with` block (overrides `STELLARAX_TRANSFER`).

  Args:
    enabled: True to transfer configs to untuned calls, False to use the heuristic.

  Raises:
    TypeError: when `enabled` is not a bool.
  """
  if not isinstance(enabled, bool):
    raise TypeError(f"transfer_scope(enabled={enabled!r}) takes True or False.")
  with trace_keys.settings_scope(_scoped, enabled):
    yield


# ---- features and distance ---------------------------------------------------------------


def default_features(ba: BoundArguments) -> dict[str, float]:
  """The default shape features of a call: log2 of every array dimension and vmap size.

  Args:
    ba: the call.

  Returns:
    "log2 <argument path>.shape[i]" and "log2 vmap[level]" -> value (a zero-size
    dimension counts as 1).
  """
  features = {}
  for path, leaf in _leaves(ba.arguments):
    if isinstance(leaf, specs.ArraySpec):
      for i, dim in enumerate(leaf.shape):
        features[f"log2 {path}.shape[{i}]"] = math.log2(max(dim, 1))
  for level, (size, _) in enumerate(ba.vmap_axes):
    features[f"log2 vmap[{level}]"] = math.log2(max(size, 1))
  return features


def features_of(ba: BoundArguments) -> dict[str, float]:
  """The shape features transfer and `fit_heuristics` use for a call.

  Args:
    ba: the call.

  Returns:
    The op's `_transfer_features(ba)` when its class defines one, else
    `default_features(ba)`.

  Raises:
    TypeError: when the op's hook returns something other than str -> finite number.
  """
  return dict(_profile(ba).features)


def structure_of(ba: BoundArguments) -> tuple[Any, ...]:
  """What transfer never crosses (with the op identity): the array arguments with their
  dtypes and ranks, and the vmap levels with their batched arguments. Hashable; calls
  with equal structures are comparable when their features have the same names."""
  return _profile(ba).structure


def statics_of(ba: BoundArguments) -> tuple[tuple[str, str], ...]:
  """The call's non-array arguments (static options such as `is_causal`), as (path,
  canonical JSON) pairs: what transfer counts as a distance of 1 each where they
  differ. Hashable."""
  return _profile(ba).statics


def describe_structure(ba: BoundArguments) -> str:
  """`structure_of(ba)` in words, e.g. "lhs float32 rank 2, rhs float32 rank 3"."""
  arrays, levels = structure_of(ba)
  text = ", ".join(f"{path} {dtype} rank {ndim}" for path, dtype, ndim in arrays)
  if levels:
    text += f"; {len(levels)} vmap level{'s' if len(levels) > 1 else ''}"
  return text or "no arrays"


def transfer_distance(a: BoundArguments, b: BoundArguments) -> float | None:
  """The distance between two calls (see the module docstring).

  Args:
    a, b: two calls.

  Returns:
    The distance, or None when they are not comparable (another op identity, other
    arguments, ranks, dtypes, vmap levels or feature names).
  """
  return _distance(_profile(a), _profile(b))


@dataclasses.dataclass(frozen=True)
class _Profile:
  """What transfer compares of a call: identity, structure, features, other arguments."""

  op_json: str
  structure: tuple[Any, ...]
  features: tuple[tuple[str, float], ...]
  statics: tuple[tuple[str, str], ...]


@functools.lru_cache(maxsize=4096)
def _profile(ba: BoundArguments) -> _Profile:
  arrays, statics = [], []
  for path, leaf in _leaves(ba.arguments):
    if isinstance(leaf, specs.ArraySpec):
      arrays.append((path, leaf.dtype, leaf.ndim))
    else:
      statics.append((path, specs.canonical_json(specs.encode(leaf))))
  hook = getattr(ba.op, "_transfer_features", None)
  features = hook(ba) if callable(hook) else default_features(ba)
  _check_features(ba, features)
  structure = (tuple(arrays), tuple(batched for _, batched in ba.vmap_axes))
  return _Profile(ba.op_json(), structure, tuple(sorted(features.items())), tuple(statics))


def _check_features(ba: BoundArguments, features: Any) -> None:
  ok = isinstance(features, Mapping) and all(
      isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v)
      for k, v in features.items())
  if not ok:
    raise TypeError(f"{type(ba.op).__name__}._transfer_features returned {features!r}; it must "
                    "return a dict of feature name (str) -> finite number.")


def _distance(a: _Profile, b: _Profile) -> float | None:
  if a.op_json != b.op_json or a.structure != b.structure:
    return None
  fa, fb = dict(a.features), dict(b.features)
  if fa.keys() != fb.keys():
    return None
  squares = sum((fa[k] - fb[k]) ** 2 for k in fa)
  sa, sb = dict(a.statics), dict(b.statics)
  squares += sum(sa.get(k) != sb.get(k) for k in sa.keys() | sb.keys())
  return math.sqrt(squares)


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
  """(path, leaf) of nested argument values; arrays are ArraySpec leaves."""
  if isinstance(value, Mapping):
    for key in value:
      yield from _leaves(value[key], f"{path}.{key}" if path else str(key))
  elif isinstance(value, (tuple, list)):
    for i, item in enumerate(value):
      yield from _leaves(item, f"{path}[{i}]")
  else:
    yield path, value


# ---- choosing ------------------------------------------------------------------------------


def nearest_config(ba: BoundArguments, candidates: Iterable[tuple[str, Entry]]
                   ) -> TransferResolution | None:
  """The best config of the nearest comparable candidate that is valid for `ba`, within
  `MAX_DISTANCE`. A candidate that measured only its heuristic config (`Entry.starved`)
  is passed over.

  Candidates at equal distance are taken in the order given. The device kind is not
  checked here: give candidates of one device kind.

  Args:
    ba: the untuned call.
    candidates: (where, entry) pairs, e.g. ("user_cache", entry).

  Returns:
    A `TransferResolution`, or None when no comparable candidate within `MAX_DISTANCE`
    has a best config in `ba.autotuning_configs`.
  """
  ours = _profile(ba.with_config(None))
  ranked = []
  for order, (where, entry) in enumerate(candidates):
    distance = _distance(ours, _profile(entry.bound_args))
    if distance is not None and distance <= MAX_DISTANCE:
      ranked.append((distance, order, where, entry))
  ranked.sort(key=lambda r: r[:2])
  space = ba.autotuning_configs
  accept = resolution.reproducible_filter(ba.op)
  for distance, _, where, entry in ranked:
    config = entry.config_for(accept)
    # An entry that measured only its heuristic (a budget too small to search) chose
    # nothing: its config is its own shape's heuristic, which ba's own beats.
    if entry.starved(accept) and config == entry.heuristic_config:
      continue
    if config is not None and config in space:
      return TransferResolution(config, f"transfer:{distance:.2f}", distance=distance,
                                confidence=2.0 ** -distance, where=where, neighbour=entry.bound_args)
  return None


def transfer_config(ba: BoundArguments) -> TransferResolution | None:
  """What transfer gives a call now, whatever the switch and the miss policy.

  Args:
    ba: the call.

  Returns:
    A `TransferResolution` from the active results and caches (see the module
    docstring), or None when nothing comparable and valid was tuned, or when the call
    has only one config.
  """
  return _transfer_from(resolution.active_results(), ba)


def _transfer_from(active: tuple[Any, ...], ba: BoundArguments) -> TransferResolution | None:
  if len(ba.autotuning_configs) <= 1:
    return None
  return nearest_config(ba, _candidates(active, ba))


def _candidates(active: tuple[Any, ...], ba: BoundArguments) -> Iterator[tuple[str, Entry]]:
  """(where, entry) of the tuned calls of `ba`'s op that transfer looks at, in
  resolution order."""
  op_json = ba.op_json()
  return ((where, entry) for where, result in _sources(active, ba.op.name)
          for entry in _entries_of(result, op_json))


def nearest_distance(ba: BoundArguments) -> float | None:
  """The distance from `ba` to the nearest comparable tuned call that transfer could look
  at (of the active results and caches, of the device kind traced for), however far.

  Args:
    ba: the call.

  Returns:
    The distance, or None when no comparable call was tuned.
  """
  ours = _profile(ba.with_config(None))
  distances = (_distance(ours, _profile(entry.bound_args))
               for _, entry in _candidates(resolution.active_results(), ba))
  return min((d for d in distances if d is not None), default=None)


def _sources(active: tuple[Any, ...], op_name: str) -> Iterator[tuple[str, AutotuningResult]]:
  """The results to look in, in resolution order, of the current device kind."""
  kind = target_device_kind()
  for result in reversed(active):
    if isinstance(result, AutotuningResult) and result.device_kind == kind:
      yield "active result", result
  yield from cached_results(op_name, kind)


# Calls are resolved while tracing, once per op call, so the entries of one op in a
# result are indexed once, under the result's content digest: two results with one digest
# hold the same entries, measurements included.
_INDEX: dict[tuple[str, str], tuple[Entry, ...]] = {}
_INDEX_LIMIT = 256


def _entries_of(result: AutotuningResult, op_json: str) -> tuple[Entry, ...]:
  key = (result.content_digest, op_json)
  found = _INDEX.get(key)
  if found is None:
    found = tuple(e for e in result if _profile(e.bound_args).op_json == op_json)
    if len(_INDEX) >= _INDEX_LIMIT:
      _INDEX.clear()
    _INDEX[key] = found
  return found


def _fallback(ba: BoundArguments, heuristic_config: Any) -> TransferResolution | None:
  """The resolution step: transfer when on and the miss policy is "heuristics"."""
  del heuristic_config
  # Asked through the resolution so that JAX's caches learn the trace used it, the switch
  # and the policy included: a trace is reused only where transfer answers the same.
  return resolution.ask_active_results(_transfer_if_on, ba)


def _transfer_if_on(active: tuple[Any, ...], ba: BoundArguments) -> TransferResolution | None:
  """Transfer's answer where it is on and the miss policy is "heuristics", else None."""
  if not transfer_enabled() or resolution.miss_policy() != "heuristics":
    return None
  return _transfer_from(active, ba)


resolution.register_fallback(_fallback)
