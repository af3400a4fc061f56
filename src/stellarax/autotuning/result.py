"""`AutotuningResult`: the best config of every tuned op call, as data.

A result maps (op identity, autotuning key) to an `Entry`: every config that
was measured with its `Measurement` (failures included), the best one, and
the heuristic one. It is a context manager (`with result:` makes op calls
use it first; see `stellarax.core.resolution`), serialises to the versioned
JSON format of `file_format.py`, and merges with `|`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import io
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from stellarax.autotuning import file_format
from stellarax.autotuning.measure import Measurement, pick_best
from stellarax.core import partitioning
from stellarax.core import resolution
from stellarax.core import specs
from stellarax.core.bound_args import BoundArguments
from stellarax.core.config import config_to_json
from stellarax.core.fingerprint import code_fingerprint
from stellarax.core.warn import warn


@dataclasses.dataclass(frozen=True)
class Entry:
  """The tuning record of one op call.

  Attributes:
    bound_args: the call (op without config, abstract arguments).
    best_config: the config chosen.
    heuristic_config: the op's heuristic config for the call.
    measurements: (config, Measurement) pairs, in measuring order.
    measured_at: ISO-8601 UTC time of the measurement.
    method: how it was measured (strategy and timing method).
    versions: the stellarax, jax and jaxlib versions and the timing revision
      (`measure.TIMING_REVISION`) it was measured under (default: the running ones).
    code: the fingerprint of the op's code it was measured on
      (`core.fingerprint.code_fingerprint`); "" for unknown (entries written before
      fingerprints were kept), which only the versions judge.
  """

  bound_args: BoundArguments
  best_config: Any
  heuristic_config: Any
  measurements: tuple[tuple[Any, Measurement], ...]
  measured_at: str = ""
  method: str = ""
  versions: Mapping[str, str] = dataclasses.field(default_factory=file_format.current_versions,
                                                  hash=False)
  code: str = ""

  @property
  def stale_reason(self) -> str | None:
    """Why this entry is stale, or None when it is current: measured under the running
    stellarax, jax and jaxlib versions and timing revision, on the op's current code
    (when its fingerprint is known, then and now: code that has no Python source now, as
    an op defined interactively in __main__ or in a compiled extension, is unknown,
    never stale).

    Other versions may lower the same config to another program, times taken another
    way are not comparable, and changed kernel code may favour other configs, so a
    stale entry still applies, but `autotune` measures its call again, and a current
    entry of the same call wins any merge with it.
    """
    other = file_format.other_versions(self.versions)
    if other:
      return f"measured under other versions: {other}"
    now = code_fingerprint(type(self.bound_args.op))
    if self.code and now and self.code != now:  # "" on either side: unknown code
      return (f"measured on other code of {self.bound_args.op.name} (fingerprint {self.code}, "
              f"now {now}): the kernel or code it uses changed since")
    return None

  @property
  def is_current(self) -> bool:
    """Whether the entry is not stale (see `stale_reason`)."""
    return self.stale_reason is None

  @property
  def key(self) -> tuple[str, str]:
    """(op JSON, call-key JSON): what identifies the entry's call in results and caches
    (two entries of one call have equal keys, whatever their measurements)."""
    return (self.bound_args.op_json(), self.bound_args.key_json())

  def time_of(self, config: Any) -> float | None:
    """The median time of `config` in seconds.

    Args:
      config: a config of the entry's op.

    Returns:
      The median of its first measurement that ran ok, or None when it was not
      measured or every measurement of it failed.
    """
    m = self._first_ok(config)
    return None if m is None else m.median_s

  def profiled_time_of(self, config: Any) -> float | None:
    """The profiler's device time per call of `config` (`Measurement.profiled_s`, from
    the measurement `time_of` reads), or None if it was not profiled."""
    m = self._first_ok(config)
    return None if m is None else m.profiled_s

  def _first_ok(self, config: Any) -> Measurement | None:
    return next((m for c, m in self.measurements if c == config and m.status == "ok"), None)

  def config_for(self, accept: Callable[[Any], bool] | None = None) -> Any | None:
    """The config to run: `best_config`, or, when `accept` refuses it, the fastest
    config measured ok that `accept` takes (ties go to the heuristic config, as in the
    search); None when there is none.

    Args:
      accept: which configs may run (e.g. `Op._is_reproducible`); None: any.

    Returns:
      A config, or None.
    """
    if accept is None or accept(self.best_config):
      return self.best_config
    taken = {c: m for c, m in self.measurements if m.ok and accept(c)}
    if not taken:
      return None
    prefer = self.heuristic_config if self.heuristic_config in taken else None
    return pick_best(taken, prefer=prefer)

  def config_to_run(self, accept: Callable[[Any], bool] | None = None, *,
                    warn_passed_over: bool = True) -> Any | None:
    """`config_for(accept)`, unless the entry is stale and that config is no longer in
    its call's search space (the op's current code refuses it, e.g. a tile a newer
    version checks against the shape): then None, with a `VersionWarning` (once), so
    that the call resolves further down the order instead of failing when traced. A
    current entry is not checked: its space is the one it was measured in.

    Args:
      accept: as in `config_for`.
      warn_passed_over: False passes over silently (the library cache, whose shipped
        entries a user cannot prune, is silent about versions too).

    Returns:
      A config, or None.
    """
    config = self.config_for(accept)
    if config is None or self.is_current or config in self.bound_args.autotuning_configs:
      return config
    if warn_passed_over and (self.key, config) not in _PASSED_OVER:
      _PASSED_OVER.add((self.key, config))
      warn(f"The stale entry of {self.bound_args} ({self.stale_reason}) holds "
           f"{config}, which this version of {self.bound_args.op.name} no longer offers "
           "for the call: it is passed over (the next result, cache or the heuristic "
           "answers). autotune measures the call again (`stellarax cache prune` removes "
           "the user cache's stale entries).", file_format.VersionWarning)
    return None

  def time_to_run(self, *, warn_passed_over: bool = True) -> float | None:
    """The median time of `config_to_run()` in seconds; None where it is None or was not
    measured ok."""
    config = self.config_to_run(warn_passed_over=warn_passed_over)
    return None if config is None else self.time_of(config)

  def starved(self, accept: Callable[[Any], bool] | None = None) -> bool:
    """Whether the entry measured only its heuristic config of a larger space searched
    (a budget too small to search it): it chose nothing, and tuning it again can only
    find more.

    Args:
      accept: which configs the search could take (reproducible mode's filter); None:
        all. The space searched is what `accept` and `Autotuner(prune=...)` (whose count
        the entry's method records, "pruned k/n") left: where they left one config, the
        one measurement was the whole search.

    Returns:
      True where one config or none was measured of a space of several.
    """
    pruned = re.search(r"/pruned (\d+)/\d+", self.method)
    searched = (int(pruned[1]) if pruned else
                sum(accept is None or accept(c) for c in self.bound_args.autotuning_configs))
    return len(self.measurements) <= 1 < searched

  def joined(self, other: Entry) -> Entry:
    """This entry, with the measurements of `other` (of the same call) appended for
    the configs this one did not measure: a cache that keeps the fastest config of one
    run also keeps the reproducible configs another run measured (`config_for`).

    Args:
      other: an entry of the same call.

    Returns:
      The joined entry (its best config, heuristic, versions and code are this one's).

    Raises:
      ValueError: for an entry of another call.
    """
    if other.key != self.key:
      raise ValueError(f"joined: {other.bound_args} is another call than {self.bound_args}.")
    mine = {c for c, _ in self.measurements}
    extra = tuple((c, m) for c, m in other.measurements if c not in mine)
    return dataclasses.replace(self, measurements=self.measurements + extra)

  @property
  def best_time(self) -> float | None:
    """The median time of `best_config` in seconds, or None if it was not measured ok."""
    return self.time_of(self.best_config)

  @property
  def heuristic_time(self) -> float | None:
    """The median time of `heuristic_config` in seconds (the baseline of the entry's
    speed-up), or None if it was not measured ok."""
    return self.time_of(self.heuristic_config)

  @property
  def num_failed(self) -> int:
    """How many configs measured failed (wrong output, compile error, timeout, ...)."""
    return sum(m.status != "ok" for _, m in self.measurements)


# (entry key, config) of the stale entries' configs passed over, warned about once.
_PASSED_OVER: set[tuple[tuple[str, str], Any]] = set()


class OtherDeviceWarning(UserWarning):
  """A result measured on one device kind is applied on another."""


# The results entered in this context, innermost last, each with its resolution token.
_entered: contextvars.ContextVar[tuple[tuple[Any, Any], ...]] = contextvars.ContextVar(
    "stellarax_entered_results", default=())


class AutotuningResult:
  """Best configs per op call, for one device kind.

  Use it as a context manager (`with result: f(x)`), save it (`dump`,
  `dumps`), load it (`load`, `loads`), merge results (`a | b`), and read it
  (`len`, iteration over entries, `ba in result`, `entry(ba)`, `best_config(ba)`,
  `summary()`).
  """

  def __init__(self, device_kind: str, entries: Mapping[tuple[str, str], Entry] | None = None,
               versions: Mapping[str, str] | None = None):
    """Args:
      device_kind: the device kind every entry was measured on.
      entries: (op JSON, key JSON) -> Entry.
      versions: the versions the result was written under, for a result read from a
        file (default: the running ones). Each entry carries its own.
    """
    self.device_kind = device_kind
    self.versions = dict(versions or file_format.current_versions())
    self._entries: dict[tuple[str, str], Entry] = dict(entries or {})

  source_name = "result"

  @functools.cached_property
  def content_digest(self) -> str:
    """A digest of everything this result holds (transfer indexes its entries by it).

    Two results with one digest answer every question alike: the measurements are in
    it, since reproducible mode picks from them, and the versions and code fingerprint,
    which judge staleness.
    """
    h = hashlib.sha256(self.device_kind.encode())
    for key in sorted(self._entries):
      e = self._entries[key]
      h.update(repr((key, e.best_config, e.heuristic_config, e.measurements, e.measured_at,
                     e.method, sorted(e.versions.items()), e.code)).encode())
    return h.hexdigest()[:16]

  # ---- reading ----------------------------------------------------------

  def __len__(self) -> int:
    return len(self._entries)

  def __iter__(self) -> Iterator[Entry]:
    return iter(self._entries.values())

  def __contains__(self, item: object) -> bool:
    """`ba in result`: whether the call was tuned here (its config need not be pinned);
    `entry in result`: whether this very entry is here."""
    if isinstance(item, BoundArguments):
      return self.entry(item) is not None
    return isinstance(item, Entry) and self._entries.get(item.key) == item

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, AutotuningResult) and self.device_kind == other.device_kind
            and self._entries == other._entries)

  def __repr__(self) -> str:
    return f"AutotuningResult(device_kind={self.device_kind!r}, {len(self)} entries)"

  def entry(self, bound_args: BoundArguments) -> Entry | None:
    """The entry of a call.

    Args:
      bound_args: the call (its config, if pinned, is ignored).

    Returns:
      Its `Entry`, or None when the call was not tuned in this result.
    """
    return self._entries.get((bound_args.op_json(), bound_args.key_json()))

  def best_config(self, bound_args: BoundArguments) -> Any | None:
    """The best config found for `bound_args`, or None if it was not tuned."""
    entry = self.entry(bound_args)
    return None if entry is None else entry.best_config

  # The ConfigSource protocol of core.resolution.
  def lookup_config(self, bound_args: BoundArguments,
                    accept: Callable[[Any], bool] | None = None) -> Any | None:
    """The config this result holds for a call (a `ConfigSource` of core.resolution).

    Args:
      bound_args: the call.
      accept: which configs may run (e.g. `Op._is_reproducible`); None: any.

    Returns:
      The entry's `Entry.config_to_run(accept)`: its best config, or where `accept`
      refuses that, the fastest accepted one measured ok; None where the result has no
      entry for the call, none is accepted, or a stale entry's config is no longer in
      the call's space.
    """
    entry = self.entry(bound_args)
    return None if entry is None else entry.config_to_run(accept)

  def lookup_time(self, bound_args: BoundArguments) -> float | None:
    """The best measured time of a call, in seconds.

    Args:
      bound_args: the call.

    Returns:
      The median time of the config the entry runs (`Entry.config_to_run`: its best); None
      where the result has no entry for the call, none of its configs ran, or a stale
      entry's config is no longer offered (it would not run: its time must not choose an
      implementation either).
    """
    entry = self.entry(bound_args)
    return None if entry is None else entry.time_to_run()

  def summary(self) -> str:
    """A table: op, shapes, best config, its time, the heuristic's, speed-up (and the
    best config's profiled device time, where measured with `MeasureOptions.profile`)."""
    profiled = any(e.profiled_time_of(e.best_config) is not None for e in self)
    rows = [("op", "arguments", "best config", "best", "heuristic", "speed-up", "measured", "failed")
            + (("best profiled",) if profiled else ())]
    for e in self:
      best, heur = e.best_time, e.heuristic_time
      speedup = f"{heur / best:.2f}x" if best and heur else "-"
      rows.append((e.bound_args.op.name, short_args(e.bound_args), _short_config(e.best_config),
                   format_time(best), format_time(heur), speedup, str(len(e.measurements)), str(e.num_failed))
                  + ((format_time(e.profiled_time_of(e.best_config)),) if profiled else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

  # ---- context manager --------------------------------------------------

  def __enter__(self) -> AutotuningResult:
    """Applies this result's configs inside the block (innermost result first).

    Warns:
      OtherDeviceWarning: when the result was measured on another device kind than
        calls are traced for (the default device's, or under an abstract mesh its
        device's): its configs still apply but were not measured there.
    """
    running = partitioning.target_device().device_kind  # an abstract mesh's, lowering for
    # another machine (as `cache.target_device_kind`)
    if len(self) and self.device_kind != running:
      warn(f"This result was measured on {self.device_kind!r} and is applied on "
           f"{running!r}: its configs are valid here but were not measured here, and "
           "may not be the fastest. Tune on this device for configs of its own "
           "(stellarax.autotune); where applying these is intended, filter out "
           "OtherDeviceWarning.", OtherDeviceWarning)
    _entered.set(_entered.get() + ((self, resolution.push_result(self)),))
    return self

  def __exit__(self, *exc) -> None:
    # The tokens live in a context variable, not on the result: threads and async tasks
    # may enter one result at once, each in its own context.
    entered = _entered.get()
    if not entered or entered[-1][0] is not self:
      raise RuntimeError("An AutotuningResult is left that is not the innermost one "
                         "entered in this thread or task: nest `with result:` blocks.")
    _entered.set(entered[:-1])
    resolution.pop_result(entered[-1][1])

  # ---- merging ----------------------------------------------------------

  def __or__(self, other: AutotuningResult) -> AutotuningResult:
    """Merges two results of the same device kind. Per call, a current entry wins over
    a stale one (`Entry.stale_reason`: other versions or other code of its op; a stale
    measurement must not outlive a new one); else one that searched over one that
    measured only its heuristic config (`Entry.starved`); else the faster measured best
    config wins, with its measurements; of two as fast, or both unmeasured, the one
    whose JSON sorts first, so that `a | b == b | a`.

    Raises:
      ValueError: for results of different device kinds.
    """
    if not isinstance(other, AutotuningResult):
      return NotImplemented
    if other.device_kind != self.device_kind:
      raise ValueError(
          f"Cannot merge results of different devices: {self.device_kind!r} | {other.device_kind!r}. "
          "Keep one result per device kind (they are applied per device).")
    merged = dict(self._entries)
    for key, entry in other._entries.items():
      mine = merged.get(key)
      merged[key] = entry if mine is None else merge_entries(mine, entry)
    return AutotuningResult(self.device_kind, merged)

  def with_entry(self, entry: Entry) -> AutotuningResult:
    """A copy with `entry` added (replacing the same call's entry)."""
    entries = dict(self._entries)
    entries[entry.key] = entry
    return AutotuningResult(self.device_kind, entries)

  # ---- serialisation ----------------------------------------------------

  def to_json(self) -> dict[str, Any]:
    """The file-format data (see `file_format.py`)."""
    return file_format.result_to_json(self)

  def dumps(self) -> str:
    """This result as a JSON string."""
    return file_format.dumps(self.to_json())

  @classmethod
  def loads(cls, text: str, *, source: str = "<string>", warn_other_versions: bool = True,
            skipped: list[file_format.SkippedEntry] | None = None) -> AutotuningResult:
    """Reads a result from a JSON string.

    Args:
      text: the JSON (file_format.py).
      source: what to name in errors and warnings.
      warn_other_versions: warn (`VersionWarning`) when the data was recorded under
        other stellarax/jax/jaxlib versions, and for each entry dropped because it no
        longer validates; without it, the same happens silently.
      skipped: a list to collect the entries not read (`file_format.SkippedEntry`: those
        that no longer validate, and, instead of raising, invalid ones).

    Raises:
      file_format.FormatError: naming `source` and what is wrong (an invalid entry too,
        unless `skipped` is given).
    """
    return file_format.result_from_json(cls, file_format.parse(text, source=source), source=source,
                                        warn_other_versions=warn_other_versions, skipped=skipped)

  def dump(self, path_or_file: str | os.PathLike | io.TextIOBase) -> None:
    """Writes this result as JSON (`dumps`).

    Args:
      path_or_file: a path, written atomically (a reader sees the old file or the new,
        never part of one; the file keeps its permissions), or an open text file.

    Raises:
      OSError: when the path cannot be written (its folder missing or read-only).
    """
    if hasattr(path_or_file, "write"):
      path_or_file.write(self.dumps())
    else:
      file_format.atomic_write(path_or_file, self.dumps())

  @classmethod
  def load(cls, path_or_file: str | os.PathLike | io.TextIOBase, *,
           warn_other_versions: bool = True,
           skipped: list[file_format.SkippedEntry] | None = None) -> AutotuningResult:
    """Reads a result from a path or an open text file (`warn_other_versions`, `skipped`:
    as in `loads`).

    Raises:
      FileNotFoundError: for a missing path.
      file_format.FormatError: naming the file and what is wrong.
    """
    if hasattr(path_or_file, "read"):
      source = str(getattr(path_or_file, "name", "<file>"))
      text = _read_text(path_or_file.read, source)
    else:
      source = os.fspath(path_or_file)
      with open(path_or_file, encoding="utf-8") as f:
        text = _read_text(f.read, source)
    return cls.loads(text, source=source, warn_other_versions=warn_other_versions,
                     skipped=skipped)


def _read_text(read: Any, source: str) -> str:
  """`read()`, with a file that is not UTF-8 text said to be no results file."""
  try:
    return read()
  except UnicodeDecodeError as exc:
    raise file_format.FormatError(
        f"{source}: not a text file (byte {exc.start} is not UTF-8); this is not a "
        "stellarax results file.") from None


def merge_entries(a: Entry, b: Entry) -> Entry:
  """The entry a merge keeps of two of the same call (`a | b`, and a file that holds
  one call twice): see `_replaces`. The order of `a` and `b` does not matter."""
  return a if _replaces(a, b) else b


def why_kept(kept: Entry, dropped: Entry) -> str:
  """Why `merge_entries` kept `kept` over `dropped`, in words, for a warning."""
  if kept.is_current != dropped.is_current:
    return f"it is current, the other stale ({dropped.stale_reason})"
  if kept.starved() != dropped.starved():
    return "it searched its space, the other measured only its heuristic config"
  if _faster(kept, dropped):
    return (f"its best config is faster ({format_time(kept.best_time)} against "
            f"{format_time(dropped.best_time)})")
  return "they are as fast, and its JSON sorts first"


def _replaces(a: Entry, b: Entry) -> bool:
  """Whether `a` wins over `b`, an entry of the same call, in a merge: a current one
  over a stale one, else one that searched over one that measured its heuristic config
  alone (`Entry.starved`: it chose nothing, so its time, taken in another run, is no
  reason to keep it), else the faster; of two as fast (or both untimed), the one whose
  JSON sorts first, so that `x | y == y | x`."""
  if a.is_current != b.is_current:
    return a.is_current
  if a.starved() != b.starved():
    return b.starved()
  if _faster(a, b) or _faster(b, a):
    return _faster(a, b)
  return _order(a) < _order(b)


def _order(entry: Entry) -> str:
  return file_format.dumps(file_format.entry_to_json(entry))


def _faster(a: Entry, b: Entry) -> bool:
  ta, tb = a.best_time, b.best_time
  if ta is None:
    return False
  return tb is None or ta < tb


def format_time(t: float | None) -> str:
  """Seconds as "1.234 ms" (from a millisecond up), "12.3 us" (from 0.1 us up) or
  "23 ns" (a call timed in a loop can take less); None as "-"."""
  if t is None:
    return "-"
  if t >= 1e-3:
    return f"{t * 1e3:.3f} ms"
  if t >= 1e-7:
    return f"{t * 1e6:.1f} us"
  return f"{t * 1e9:.0f} ns"


def short_args(ba: BoundArguments) -> str:
  """The call's arrays as dtype[shape], and its other arguments but None where they
  differ from the op's defaults (so that calls differing only in an option, e.g.
  epsilon, differ)."""
  parts = []
  for k, v in ba.arguments.items():
    if isinstance(v, specs.ArraySpec) or (v is not None and v != _default_spec(ba.op, k)):
      parts.append(f"{k}={_short_value(v)}")
  if ba.vmap_axes:
    parts.append(f"vmap={[n for n, _ in ba.vmap_axes]}")
  return " ".join(parts)


def _default_spec(op: Any, name: str) -> Any:
  """The canonical default of argument `name` of `op`, or a marker that equals nothing
  when it has none (or none that bound arguments could record)."""
  parameter = op._signature().parameters.get(name)
  if parameter is None or parameter.default is parameter.empty:
    return _NO_DEFAULT
  try:
    return specs.to_spec(parameter.default, what=name)
  except TypeError:  # e.g. a callable default, recorded by name once canonicalised
    return _NO_DEFAULT


_NO_DEFAULT = object()


def _short_value(v: Any) -> str:
  if isinstance(v, specs.ArraySpec):
    return f"{v.dtype}{list(v.shape)}".replace(" ", "")
  if isinstance(v, tuple):
    return "(" + ",".join(_short_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
  if isinstance(v, specs.FrozenDict):
    return "{" + ",".join(f"{k}:{_short_value(x)}" for k, x in v.items()) + "}"
  return repr(v).replace(" ", "")


def _short_config(config: Any) -> str:
  return ",".join(f"{k}={v}" for k, v in config_to_json(config).items()) or "-"
