"""`fit_heuristics`: a small readable rule learned from measured sweeps, with its regret.

Input: the entries of one op in a result or cache whose measurements cover the call's
whole search space (full sweeps, e.g. from `Autotuner(strategy="exhaustive")`), of one
structure (`transfer.structure_of`: the arrays' dtypes and ranks, the vmap levels) and
one set of static options (`transfer.statics_of`, e.g. `is_causal`; those of float
value, such as a logit scale, are not told apart), which the features
do not see: a bfloat16 and a float32 sweep of one shape, or a causal and a non-causal
one, would look like two measurements of one call. `like=` picks the kind where the
entries hold several. Each such
key gives, for every config, its slowdown against the fastest measured there; a config
that failed there (or was not measured ok) is never a good answer there: in the fit it
costs more than any slowdown of the configs that ran, so a leaf ranks first a config
that ran at every one of its keys where one did, and in the regret it counts as an
infinite slowdown (`Regret.failed` counts those picks).

The rule is a decision tree over the shape features of `transfer.features_of` (log2 of the
array dimensions unless the op defines `_transfer_features`), grown greedily to
`max_depth`. Each node keeps the configs ranked by their total log slowdown over its keys
(the log of the geometric mean slowdown, the quantity reported), and a node is split at
the feature threshold that lowers that total most, if it lowers it by at least `min_gain`
(geometric mean over the node's keys) and leaves `min_leaf` keys on each side. A leaf
answers with the first config of its ranking that is in the call's search space; a leaf
lists only the configs its training keys needed. Thresholds are midpoints between the
values seen, so on a grid of powers of two they fall between grid points.

Regret is measured on held-out keys, leave-one-out: every key is left out once, the rule
and the transfer neighbours come from the other keys, and the config each picks for the
left-out key is looked up in that key's measurements. Three ways of choosing are compared:
the op's fixed heuristic (the config recorded as its heuristic), nearest-key transfer
(`transfer.nearest_config`; the heuristic where nothing transfers), and the fitted rule.
Each gets the geometric mean and the worst slowdown against the measured best. The
measured best is the smallest median of a noisy measurement, so a config that is as fast
within noise shows a slowdown of a few percent.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Container, Mapping, Sequence
from typing import Any

import numpy as np

from stellarax.autotuning import transfer
from stellarax.autotuning.cache import current_device_kind
from stellarax.autotuning.result import AutotuningResult, Entry
from stellarax.core.bound_args import BoundArguments
from stellarax.core.config import config_items, config_to_json
from stellarax.core.op import Op, op_to_json
from stellarax.core.specs import canonical_json

# Fewer full sweeps than this leave nothing to hold out and learn from.
MIN_KEYS = 3
# The log slowdown a config costs at a key where it failed: more than any sum of real
# ones over the keys of a fit (a slowdown of 2 at a million keys is 6.9e5).
_FAILED_COST = 1e9


@dataclasses.dataclass(frozen=True)
class Regret:
  """Slowdown of a way of choosing configs against the measured best, on held-out keys.

  Attributes:
    geomean: geometric mean of t(chosen config) / t(fastest config); 1.0 is always the best.
    worst: the largest such ratio.
    num_keys: the keys it was measured on.
    failed: of those, the keys where it chose a config that failed there (its slowdown is
      infinite: geomean and worst are then inf).
  """

  geomean: float
  worst: float
  num_keys: int
  failed: int = 0

  def __str__(self) -> str:
    if self.failed:
      return (f"chose a config that failed at {self.failed} of {self.num_keys} keys (no "
              "working kernel there)")
    return f"{self.geomean:.3f}x geometric mean, {self.worst:.2f}x worst ({self.num_keys} keys)"


@dataclasses.dataclass(frozen=True)
class Rule:
  """A decision tree over shape features that picks a config.

  A leaf (`feature` None) holds configs ranked best first; it answers with the first one in
  the call's search space. An inner node sends a call to `below` when its feature is <=
  `threshold`, else to `above`.

  Attributes:
    ranking: the configs, best first (at inner nodes: for the node's keys together).
    feature: the feature an inner node tests; None at a leaf.
    threshold: the value it is compared with.
    below: the subtree for feature <= threshold.
    above: the subtree for feature > threshold.
  """

  ranking: tuple[Any, ...]
  feature: str | None = None
  threshold: float = 0.0
  below: Rule | None = None
  above: Rule | None = None

  def choose(self, features: Mapping[str, float], space: Container[Any]) -> Any | None:
    """The config for a call with `features` and search space `space`, or None.

    Args:
      features: the call's features (`transfer.features_of`).
      space: its valid configs.

    Returns:
      The first config of the leaf's ranking in `space`; None when none is.

    Raises:
      KeyError: when `features` lacks a feature the rule tests.
    """
    node = self
    while node.feature is not None:
      node = node.below if features[node.feature] <= node.threshold else node.above
    return next((c for c in node.ranking if c in space), None)

  def predict(self, ba: BoundArguments) -> Any:
    """The config the rule picks for a call (its heuristic when no leaf config is valid).

    Args:
      ba: the call.

    Returns:
      A config in `ba.autotuning_configs`.

    Raises:
      KeyError: when the call lacks a feature the rule tests (another structure).
    """
    chosen = self.choose(transfer.features_of(ba), ba.autotuning_configs)
    return ba.heuristics_config if chosen is None else chosen

  @property
  def num_leaves(self) -> int:
    """How many leaves the tree has."""
    return 1 if self.feature is None else self.below.num_leaves + self.above.num_leaves

  def text(self, indent: str = "") -> str:
    """The rule as if/else text.

    Args:
      indent: prefix of every line (nested tests add two spaces).

    Returns:
      One test or config per line; thresholds are in the features' units (for
      "log2 X" features, in X itself).
    """
    if self.feature is None:
      configs = [_config_text(c) for c in self.ranking] or ["the call's heuristic"]
      alternatives = f"  (where not valid: {'; then '.join(configs[1:])})" if configs[1:] else ""
      return f"{indent}{configs[0]}{alternatives}"
    return "\n".join([f"{indent}if {_test_text(self.feature, self.threshold)}:",
                      self.below.text(indent + "  "), f"{indent}else:", self.above.text(indent + "  ")])

  def __str__(self) -> str:
    return self.text()


@dataclasses.dataclass(frozen=True)
class FittedHeuristics:
  """What `fit_heuristics` found.

  Attributes:
    op: the op's registered name.
    rule: the rule fitted on all keys.
    num_keys: the full sweeps it was fitted and evaluated on.
    rule_regret: the rule's regret on held-out keys.
    heuristic_regret: the op's fixed heuristic's regret on the same keys.
    transfer_regret: nearest-key transfer's regret on the same keys.
    structure: the keys' structure and static options in words (e.g. "lhs bfloat16
      rank 2, ...; is_causal=true"): the rule is for calls of that kind.
  """

  op: str
  rule: Rule
  num_keys: int
  rule_regret: Regret
  heuristic_regret: Regret
  transfer_regret: Regret
  structure: str = ""

  def __str__(self) -> str:
    return "\n".join([
        f"{self.op}: rule fitted on {self.num_keys} keys ({self.structure})", self.rule.text("  "),
        "regret on held-out keys (leave-one-out), slowdown against the measured best:",
        f"  fixed heuristic: {self.heuristic_regret}",
        f"  nearest-key transfer: {self.transfer_regret}",
        f"  fitted rule: {self.rule_regret}"])


def fit_heuristics(result_or_cache: Any, op: str | Op | type[Op], *, max_depth: int = 2,
                   min_leaf: int = 2, min_gain: float = 0.01,
                   device_kind: str | None = None,
                   like: BoundArguments | None = None) -> FittedHeuristics:
  """Fits a decision-tree rule to measured sweeps of `op` and reports regrets.

  Args:
    result_or_cache: an `AutotuningResult`, or a cache (`USER_CACHE`, `LIBRARY_CACHE`: its
      file for `device_kind` and the op is read).
    op: the op: its registered name, its class, or an instance (then only entries of
      that op identity, fields included, are used).
    max_depth: the deepest split (0: one config for every call).
    min_leaf: the fewest training keys on each side of a split.
    min_gain: the least relative lowering of the geometric mean slowdown over a node's
      keys that a split must bring.
    device_kind: the cache's device kind (default: the current one); ignored for results.
    like: a call of the op (e.g. `SomeOp.bind(...)` on `jax.ShapeDtypeStruct`s): only
      entries of its structure (dtypes, ranks, vmap levels) and static options are
      used. Needed where the entries hold several.

  Returns:
    A `FittedHeuristics`: the rule fitted on every key, and the three regrets on
    held-out keys (see the module docstring).

  Raises:
    TypeError: for a `result_or_cache` that is neither a result nor a cache, an `op`
      that is no name, op class or op, or a `like` that is no call.
    ValueError: for bad options, fewer than `MIN_KEYS` full sweeps, entries of several
      op identities under one name when `op` is a name or class, or of several
      structures or sets of static options without `like`.
  """
  _check_options(max_depth, min_leaf, min_gain)
  if like is not None and not isinstance(like, BoundArguments):
    raise TypeError(f"like={like!r} must be a call of the op (a BoundArguments, e.g. from "
                    "SomeOp.bind(...)) or None.")
  if not (isinstance(op, (str, Op)) or (isinstance(op, type) and issubclass(op, Op))):
    raise TypeError(f"op={op!r}: pass an op's registered name (e.g. 'ragged_dot.xla'), its "
                    "class or an instance.")
  name = op if isinstance(op, str) else op.name
  entries = _of_one_structure(_entries(result_or_cache, op, name, device_kind), name, like)
  sweeps = [s for s in map(_Sweep.of, entries) if s is not None]
  if len(sweeps) < MIN_KEYS:
    raise ValueError(
        f"fit_heuristics needs at least {MIN_KEYS} full sweeps of {name} (entries that measured"
        f" every config of their search space); found {len(sweeps)} among {len(entries)} "
        "entries. Record some with stellarax.Autotuner(strategy='exhaustive').")
  fitter = _Fitter(sweeps, max_depth, min_leaf, min_gain)
  chosen: dict[str, list[float]] = {"rule": [], "heuristic": [], "transfer": []}
  for i, held_out in enumerate(sweeps):
    train = [j for j in range(len(sweeps)) if j != i]
    rule = fitter.fit(train)
    ba = held_out.entry.bound_args
    heuristic = held_out.entry.heuristic_config
    picked = rule.choose(held_out.features, held_out.space)
    chosen["rule"].append(held_out.slowdown(heuristic if picked is None else picked))
    chosen["heuristic"].append(held_out.slowdown(heuristic))
    moved = transfer.nearest_config(ba, [("sweeps", sweeps[j].entry) for j in train])
    chosen["transfer"].append(held_out.slowdown(heuristic if moved is None else moved.config))
  return FittedHeuristics(
      op=name, rule=fitter.fit(list(range(len(sweeps)))), num_keys=len(sweeps),
      rule_regret=_regret(chosen["rule"]), heuristic_regret=_regret(chosen["heuristic"]),
      transfer_regret=_regret(chosen["transfer"]),
      structure=_describe_kind(sweeps[0].entry.bound_args))


def _kind(ba: BoundArguments) -> tuple[Any, ...]:
  """What a rule's features do not see: the structure and the static options that may
  change the work (a causal and a non-causal sweep of one shape may want different
  configs). Options of float value (a logit scale, an epsilon) scale numbers, not
  work, and often follow a shape (a scale of 1/sqrt(head dim)): they are left out."""
  return transfer.structure_of(ba), tuple(_work_statics(ba))


def _work_statics(ba: BoundArguments) -> list[tuple[str, str]]:
  return [(path, value) for path, value in transfer.statics_of(ba)
          if not isinstance(json.loads(value), float)]


def _describe_kind(ba: BoundArguments) -> str:
  """`_kind(ba)` in words: the structure, then the static options set (not null)."""
  statics = ", ".join(f"{path}={value}" for path, value in _work_statics(ba)
                      if value != "null")
  return transfer.describe_structure(ba) + (f"; {statics}" if statics else "")


def _of_one_structure(entries: list[Entry], name: str, like: BoundArguments | None) -> list[Entry]:
  """The entries of `like`'s structure and static options, or all of them where they
  share one."""
  groups: dict[Any, list[Entry]] = {}
  for e in entries:
    groups.setdefault(_kind(e.bound_args), []).append(e)
  if like is not None:
    if like.op.name != name:
      raise ValueError(f"like= is a call of {like.op.name}; pass a call of {name}.")
    return groups.get(_kind(like), [])
  if len(groups) > 1:
    kinds = "; ".join(f"{len(g)} of {_describe_kind(g[0].bound_args)}"
                      for g in sorted(groups.values(), key=len, reverse=True))
    raise ValueError(
        f"The entries of {name} hold {len(groups)} structures or sets of static options, "
        f"which one rule cannot tell apart (its features are shapes): {kinds}. Pass like= "
        "a call of the kind to fit, e.g. like=SomeOp.bind(*shape_dtype_structs, "
        "**static_options).")
  return entries


def _check_options(max_depth: int, min_leaf: int, min_gain: float) -> None:
  integer = lambda v: isinstance(v, int) and not isinstance(v, bool)
  if not integer(max_depth) or max_depth < 0:
    raise ValueError(f"{max_depth=} must be an int >= 0.")
  if not integer(min_leaf) or min_leaf < 1:
    raise ValueError(f"{min_leaf=} must be an int >= 1.")
  if (not isinstance(min_gain, (int, float)) or isinstance(min_gain, bool)
      or not (math.isfinite(min_gain) and min_gain >= 0)):
    raise ValueError(f"{min_gain=} must be a number >= 0 (0.01: a split must gain 1%).")


def _entries(result_or_cache: Any, op: Any, name: str, device_kind: str | None) -> list[Entry]:
  """The entries of `op` in a result or cache, of one op identity."""
  if isinstance(result_or_cache, AutotuningResult):
    result = result_or_cache
  elif callable(getattr(result_or_cache, "result_for", None)):
    result = result_or_cache.result_for(device_kind or current_device_kind(), name)
  else:
    raise TypeError(f"fit_heuristics takes an AutotuningResult or a cache (USER_CACHE, "
                    f"LIBRARY_CACHE), got {type(result_or_cache).__name__}.")
  entries = [e for e in result or () if e.bound_args.op.name == name]
  if isinstance(op, Op):
    wanted = canonical_json(op_to_json(op.replace(config=None)))
    entries = [e for e in entries if e.bound_args.op_json() == wanted]
  identities = {e.bound_args.op_json() for e in entries}
  if len(identities) > 1:
    raise ValueError(f"The entries of {name} belong to {len(identities)} op identities (fields "
                     f"differ: {sorted(identities)}); pass the op instance to pick one.")
  return entries


@dataclasses.dataclass(frozen=True)
class _Sweep:
  """One key's full sweep: features, valid configs, and times of the ok configs."""

  entry: Entry
  features: dict[str, float]
  space: frozenset[Any]
  times: dict[Any, float]
  best: float
  worst: float

  @classmethod
  def of(cls, entry: Entry) -> _Sweep | None:
    """The sweep of an entry, or None when it did not measure its whole space or no
    config of that space ran."""
    space = entry.bound_args.autotuning_configs
    if not space <= {c for c, _ in entry.measurements}:
      return None
    # Only the configs a call can get now: a stale entry's config that is no longer
    # offered is no answer, and must not be the best the regrets are measured against.
    times = {c: m.median_s for c, m in entry.measurements if m.ok and c in space}
    if not times or min(times.values()) <= 0:
      return None
    return cls(entry, transfer.features_of(entry.bound_args), space, times,
               min(times.values()), max(times.values()))

  def slowdown(self, config: Any) -> float:
    """t(config) / t(best); inf for a config that failed or was not measured ok."""
    return self.times[config] / self.best if config in self.times else math.inf


class _Fitter:
  """Grows trees over a fixed set of sweeps (a cost matrix keys x configs)."""

  def __init__(self, sweeps: Sequence[_Sweep], max_depth: int, min_leaf: int, min_gain: float):
    names = set.intersection(*(set(s.features) for s in sweeps))
    self.names = sorted(names)
    all_configs = {c for s in sweeps for c in s.space}
    self.configs = sorted(all_configs, key=lambda c: canonical_json(config_to_json(c)))
    self.x = np.array([[s.features[n] for n in self.names] for s in sweeps], dtype=np.float64)
    # Log slowdowns; a config that did not run ok at a key costs more there than any
    # sum of real slowdowns (finite, so that costs still add and subtract).
    slowdowns = np.array([[s.slowdown(c) for c in self.configs] for s in sweeps])
    self.cost = np.where(np.isfinite(slowdowns), np.log(np.where(np.isfinite(slowdowns),
                                                                 slowdowns, 1.0)), _FAILED_COST)
    self.valid = np.isfinite(slowdowns)  # ran ok there: covers the key
    self.max_depth, self.min_leaf = max_depth, min_leaf
    self.min_gain = math.log1p(min_gain)

  def fit(self, keys: Sequence[int]) -> Rule:
    """The tree fitted on the sweeps at positions `keys`."""
    return self._grow(np.asarray(keys), self.max_depth)

  def _grow(self, keys: np.ndarray, depth: int) -> Rule:
    leaf = Rule(self._ranking(keys))
    split = self._best_split(keys) if depth > 0 and len(keys) >= 2 * self.min_leaf else None
    if split is None:
      return leaf
    f, threshold = split
    below = keys[self.x[keys, f] <= threshold]
    above = keys[self.x[keys, f] > threshold]
    return Rule(leaf.ranking, self.names[f], threshold,
                self._grow(below, depth - 1), self._grow(above, depth - 1))

  def _ranking(self, keys: np.ndarray) -> tuple[Any, ...]:
    """Configs by total log slowdown, cut after the first one valid for every key."""
    order = np.argsort(self.cost[keys].sum(axis=0), kind="stable")
    ranking, covered = [], np.zeros(len(keys), dtype=bool)
    for j in order:
      if not (self.valid[keys, j] & ~covered).any():
        continue
      ranking.append(self.configs[j])
      covered |= self.valid[keys, j]
      if covered.all():
        break
    return tuple(ranking)

  def _best_split(self, keys: np.ndarray) -> tuple[int, float] | None:
    """(feature, threshold) lowering the node's total log slowdown most, or None."""
    cost = self.cost[keys]
    total = cost.sum(axis=0)
    best_loss = total.min() - self.min_gain * len(keys)
    best = None
    for f in range(len(self.names)):
      order = np.argsort(self.x[keys, f], kind="stable")
      values = self.x[keys, f][order]
      below = np.cumsum(cost[order], axis=0)
      for p in range(self.min_leaf, len(keys) - self.min_leaf + 1):
        if values[p - 1] == values[p]:
          continue
        loss = below[p - 1].min() + (total - below[p - 1]).min()
        if loss < best_loss - 1e-12:
          best_loss, best = loss, (f, float((values[p - 1] + values[p]) / 2))
    return best


def _regret(slowdowns: Sequence[float]) -> Regret:
  logs = np.log(np.asarray(slowdowns, dtype=np.float64))
  return Regret(float(np.exp(logs.mean())), float(max(slowdowns)), len(slowdowns),
                failed=sum(not math.isfinite(x) for x in slowdowns))


def _config_text(config: Any) -> str:
  return ", ".join(f"{name}={value}" for name, value in config_items(config).items()) or "-"


def _test_text(feature: str, threshold: float) -> str:
  # Features named "log2 X" hold math.log2 of an integer X: test X itself, against the
  # largest n whose math.log2 is <= threshold, as the rule compares (2 ** threshold
  # rounded down can be one off: a midpoint of log2(a) and log2(b) where a * b is a
  # square can round below log2(sqrt(a * b))).
  if feature.startswith("log2 "):
    return f"{feature[5:]} <= {_largest_below(threshold)}"
  return f"{feature} <= {threshold!r}"  # exact: the rule's own threshold


def _largest_below(threshold: float) -> int:
  """The largest integer n >= 0 with math.log2(max(n, 1)) <= threshold (0 if none)."""
  n = max(math.floor(2.0 ** threshold), 0)
  while math.log2(n + 1) <= threshold:
    n += 1
  while n > 1 and math.log2(n) > threshold:
    n -= 1
  return n
