"""The JSON format shared by results, the user cache and the library cache.

    {
      "schema": 1,
      "device_kind": "NVIDIA H200",
      "versions": {"stellarax": "0.1.0", "jax": "0.11.2", "jaxlib": "0.11.2", "timing": "2"},
      "entries": [
        {
          "bound_args": {"op": {"name": "ragged_dot.xla", "fields": {}},
                         "arguments": {...}, "vmap_axes": [...]},
          "best_config": {...}, "heuristic_config": {...},
          "measured_at": "2026-11-29T23:00:00Z", "method": "racing/cpu-batched",
          "versions": {"stellarax": "0.1.0", "jax": "0.11.2", "jaxlib": "0.11.2",
                       "timing": "2"},
          "code": "3f1c9a0e5b7d2c41",
          "measurements": [{"config": {...}, "status": "ok", "median_s": ...,
                            "ci_low_s": ..., "ci_high_s": ..., "num_samples": ...,
                            "compile_time_s": ..., "error": null, "method": ...}]
        }
      ]
    }

Ops are named by their registered names, configs by their fields: no Python
import paths. The top-level `versions` are those of the writer; each entry
keeps the versions it was measured under (an entry without them, written
before they were kept, takes the file's; a file that records none, as one written by
hand, has its entries stale: "stellarax unrecorded"), so a file that merges old and new
measurements says which is which, and `code`, the fingerprint of the op's
source it was measured on (`core/fingerprint.py`; absent or "" if unknown).

Policy for data from other versions: a file with a newer `schema` is refused
with a clear error (it may mean anything); entries recorded under another
stellarax/jax/jaxlib version or timing revision (`measure.TIMING_REVISION`: how times
were taken; an entry written before it was kept has none) are used, with one warning
per file, because configs are validated when read and a config that no longer
validates (or an op that no longer exists) drops just that entry, with a warning. They are
stale all the same (`result.Entry.stale_reason`), as are entries measured on
other code of their op (used silently): `autotune` measures their calls again,
and the new entry wins the merge. An entry measured on other code of its op (its
`code` is not the op's current fingerprint, as when an op of an editable install
renamed a config field) that no longer validates is dropped alone too, with the
same warning, under the running versions as well. The shipped library cache
reads its own files without these warnings (`cache.FileCache.warn_other_versions`).
A file that is not valid JSON, lacks a required field, or holds an invalid entry
recorded under the running versions on the running code of its op (or on unknown
code) raises `FormatError` naming the file and the problem, whatever the op's
checks raised (the caches read the rest of such a file: `result_from_json`'s
`skipped`). Files are written atomically, with the permissions `open` would
give them (the umask's).

Hand edits. Schema 1 has always written each field with one JSON type (an object,
a list, a string, a number), so a field of another type (`"versions": "0.1"`,
`"median_s": "0.001"`) raises `FormatError` naming the entry, the field, what it
holds and what it should, whatever versions the entry names. Stellarax writes each
call once; a file that holds one call in two entries (e.g. entries pasted from two
files) is read as merging them would (`AutotuningResult.__or__`: a current entry
over a stale one, else one that searched over one that measured only its heuristic
config, else the faster best config), with a `FormatWarning` naming both
entries where they differ. A config field absent from the file takes its default:
that is how a field added to a config class later (e.g. `prefetch` of the Triton
normalization backward, `overlap_softmax` of the Mosaic GPU attention) reads files
written before it, silently, as such entries are stale anyway. Only an entry
measured on the running code of its op (its `code` is the current fingerprint),
which this code wrote with every field, warns (`FormatWarning`) when it lacks one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jaxlib

from stellarax.core import registry
from stellarax.core.fingerprint import code_fingerprint
from stellarax.core.warn import warn

SCHEMA_VERSION = 1


class FormatError(ValueError):
  """A result or cache file is corrupt or not in the expected format."""


class NewerSchemaError(FormatError):
  """A results file written by a newer stellarax, in a schema this one cannot read."""


class VersionWarning(UserWarning):
  """Data recorded under other versions is being used, or an entry recorded under other
  versions or on other code of its op no longer validates and is dropped."""


class FormatWarning(UserWarning):
  """A results file holds what stellarax never writes, edited by hand or by another
  tool: one call twice with different data, or an entry measured on the running code
  whose configs lack fields. It is read by the rule the warning names."""


def current_versions() -> dict[str, str]:
  """The versions recorded in files written now: stellarax's, jax's, jaxlib's, and the
  revision of how times are taken (`measure.TIMING_REVISION`)."""
  from stellarax import __version__
  from stellarax.autotuning.measure import TIMING_REVISION
  return {"stellarax": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "timing": TIMING_REVISION}


def same_versions(versions: Mapping[str, str]) -> bool:
  """Whether `versions` name the running stellarax, jax, jaxlib and timing revision."""
  return not other_versions(versions)


def other_versions(versions: Mapping[str, str]) -> str:
  """How `versions` differ from the running ones, in words ("" where they do not), e.g.
  "jax 0.11.1 (running 0.11.2), timing unrecorded (running 2)"."""
  return ", ".join(f"{name} {versions.get(name, 'unrecorded')} (running {now})"
                   for name, now in current_versions().items() if versions.get(name) != now)


def dumps(data: Any) -> str:
  """Stable, readable JSON (sorted keys, 1-space indent)."""
  return json.dumps(data, sort_keys=True, indent=1, allow_nan=False) + "\n"


def parse(text: str, *, source: str) -> dict[str, Any]:
  """Parses and checks the envelope of a results file.

  Raises:
    FormatError: naming `source` and what is wrong.
  """
  try:
    data = json.loads(text)
  except (json.JSONDecodeError, RecursionError) as e:  # (nested too deep to read)
    raise FormatError(f"{source}: not valid JSON ({type(e).__name__}: {e}): not a "
                      "stellarax results file, or one cut short.") from None
  calls = data.get("calls") if isinstance(data, dict) else data
  hint = ""
  if isinstance(calls, list) and calls and all(
      isinstance(d, dict) and ("op" in d or "bound_args" in d) for d in calls):
    hint = (" It holds op calls (bound arguments, as bound_args_to_json and "
            "xplane_to_bound_args write them): tune them with `stellarax autotune FILE "
            "--output RESULT.json` or stellarax.autotune(FILE), which gives a results file.")
  if not isinstance(data, dict):
    raise FormatError(f"{source}: expected a JSON object with 'schema', 'device_kind' and"
                      f" 'entries'.{hint}")
  for field in ("schema", "device_kind", "entries"):
    if field not in data:
      raise FormatError(f"{source}: missing field {field!r}; this is not a stellarax results "
                        f"file.{hint}")
  schema = data["schema"]
  if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
    raise FormatError(f"{source}: schema {schema!r} is not a schema version (a positive "
                      "int); this is not a stellarax results file.")
  if schema > SCHEMA_VERSION:
    raise NewerSchemaError(
        f"{source}: schema {schema!r} is newer than this stellarax reads ({SCHEMA_VERSION}). "
        "Upgrade stellarax or re-tune.")
  if not isinstance(data["device_kind"], str) or not data["device_kind"]:
    raise FormatError(f"{source}: 'device_kind' must name a device kind (e.g. \"NVIDIA H200\"), "
                      f"got {data['device_kind']!r}.")
  if not isinstance(data["entries"], list):
    raise FormatError(f"{source}: 'entries' must be a list.")
  return data


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
  """The process's umask (reading it means setting it: done under a lock)."""
  with _UMASK_LOCK:
    mask = os.umask(0o022)
    os.umask(mask)
  return mask


# The temporary file of an atomic write: `<folder>/.tmp-<random>.json`. A writer killed
# before its rename (SIGKILL, power loss) leaves it behind; readers of a folder of
# results pass such files over (`FileCache.files`), and `cache clear` removes old ones.
TEMPORARY_PREFIX = ".tmp-"


def atomic_write(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` atomically (a temporary file in the same folder, named
  `TEMPORARY_PREFIX...json`, then renamed over `path`).

  As `open(path, "w")` would: a symbolic link is written through (its target is
  replaced, the link stays), an existing file keeps its permissions, and a new one
  gets the umask's.

  Args:
    path: the file to write; its folder is made if missing.
    text: what to write, as UTF-8.

  Raises:
    OSError: when the folder or the file cannot be written (naming `path`).
  """
  asked = os.fspath(path)
  path = os.path.realpath(asked)
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  try:
    mode = stat.S_IMODE(os.stat(path).st_mode)
  except FileNotFoundError:
    mode = 0o666 & ~_umask()  # as open() would make it (mkstemp makes 0600)
  try:
    fd, tmp = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, suffix=".json", dir=folder)
  except OSError as exc:  # name the file asked for, not the temporary one
    raise OSError(exc.errno, exc.strerror, asked) from None
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:  # closes fd whatever fails next
      os.fchmod(f.fileno(), mode)
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def entry_to_json(entry) -> dict[str, Any]:
  from stellarax.core.config import config_to_json
  ba = entry.bound_args
  return {
      "bound_args": ba.with_config(None).to_json(),
      "best_config": config_to_json(entry.best_config),
      "heuristic_config": config_to_json(entry.heuristic_config),
      "measured_at": entry.measured_at,
      "method": entry.method,
      "versions": dict(entry.versions),
      "code": entry.code,
      "measurements": [{"config": config_to_json(c), **m.to_json()} for c, m in entry.measurements],
  }


def _entry_versions(data: Any, file_versions: Mapping[str, str]) -> dict[str, str]:
  """The versions an entry's raw data was measured under (the file's if it names none)."""
  versions = data.get("versions") if isinstance(data, dict) else None
  return dict(versions) if isinstance(versions, dict) and versions else dict(file_versions)


def entry_from_json(data: dict[str, Any], *, source: str, versions: Mapping[str, str]):
  """An `Entry` from its JSON data; `versions`: those it was measured under (its own,
  or its file's for data that names none: `_entry_versions`)."""
  from stellarax.autotuning.measure import Measurement
  from stellarax.autotuning.result import Entry
  from stellarax.core.bound_args import BoundArguments
  from stellarax.core.config import config_from_json
  ba = BoundArguments.from_json(data["bound_args"])
  cls = type(ba.op).config_cls
  measurements = []
  for j, m in enumerate(data.get("measurements", [])):
    m = dict(m)
    try:
      config = config_from_json(cls, m.pop("config"))
      measurements.append((config, Measurement.from_json(m)))
    except (KeyError, ValueError) as e:
      raise ValueError(f"measurement {j}: {e}") from None
  return Entry(
      bound_args=ba,
      best_config=config_from_json(cls, data["best_config"]),
      heuristic_config=config_from_json(cls, data["heuristic_config"]),
      measurements=tuple(measurements),
      measured_at=str(data.get("measured_at", "")),
      method=str(data.get("method", "")),
      versions=dict(versions),
      code=str(data.get("code") or ""))


def result_to_json(result) -> dict[str, Any]:
  return {
      "schema": SCHEMA_VERSION,
      "device_kind": result.device_kind,
      "versions": result.versions,
      "entries": [entry_to_json(e) for e in result],
  }


@dataclasses.dataclass(frozen=True)
class SkippedEntry:
  """An entry of a file that was not read (`result_from_json`'s `skipped`).

  Attributes:
    index: its place in the file's entries.
    raw: its JSON data, as in the file, with the versions it was measured under (the
      file's where it named none), so that it can be written back unchanged elsewhere.
    reason: why it was not read, in words.
    broken: True for an entry invalid under the running versions on the running (or
      unknown) code of its op (the file was broken, by hand or by a bug); False for one
      that no longer validates because it was recorded by other versions or on other
      code of its op (a newer stellarax may read it).
  """

  index: int
  raw: dict[str, Any]
  reason: str
  broken: bool


def result_from_json(cls, data: dict[str, Any], *, source: str, warn_other_versions: bool = True,
                     skipped: list[SkippedEntry] | None = None):
  """Builds an AutotuningResult from parsed data (see the module policy).

  Args:
    cls: the result class.
    data: `parse`'s output.
    source: what to name in errors and warnings.
    warn_other_versions: warn for data from other versions; without it, that data is
      used (or dropped) silently.
    skipped: a list to append the entries not read to (`SkippedEntry`); given, an
      invalid entry recorded under the running versions is skipped there too instead of
      raising (a cache reads the rest of a file so; its caller warns).

  Returns:
    The result.

  Raises:
    FormatError: for a field of the wrong JSON type, or (without `skipped`) an invalid
      entry recorded under the running versions on the running (or unknown) code of its
      op, naming `source` and the entry.

  Warns:
    VersionWarning: for entries from other versions, and for each entry dropped
      because it no longer validates (see the module policy).
    FormatWarning: for one call in two entries with different data, or a current
      entry whose configs lack fields.
  """
  # A file that records no versions (written by hand, or cut down) says nothing of what
  # its times were taken under: its entries are stale, "unrecorded", as one without the
  # timing revision is.
  file_versions = data.get("versions")
  file_versions = {} if file_versions is None else file_versions
  if not _is_versions(file_versions):
    raise FormatError(f"{source}: 'versions' must be an object naming the writer's stellarax, "
                      f"jax and jaxlib versions as strings, got {file_versions!r}.")
  for i, raw in enumerate(data["entries"]):
    _check_entry_types(raw, where=f"{source}: entry {i}{_op_named(raw)}")
  recorded = [_entry_versions(raw, file_versions) for raw in data["entries"]]
  others = [v for v in recorded if not same_versions(v)]
  if warn_other_versions and others:
    warn(f"{source}: {len(others)} of {len(recorded)} entries were recorded with other "
         f"versions ({other_versions(others[0])}); using them. `autotune` "
         "measures their calls again.", VersionWarning)
  entries, places = {}, {}
  for i, raw in enumerate(data["entries"]):
    entry = _read_entry(raw, i, recorded[i], source=source,
                        warn_other_versions=warn_other_versions, skipped=skipped)
    if entry is None:
      continue
    _warn_missing_fields(raw, entry, where=f"{source}: entry {i}{_op_named(raw)}")
    if entry.key in entries:
      entry = _one_of_two(entries[entry.key], places[entry.key], entry, i, source=source)
    if entries.get(entry.key) is not entry:
      entries[entry.key], places[entry.key] = entry, i
  return cls(str(data["device_kind"]), entries, file_versions)


def _read_entry(raw: dict[str, Any], i: int, versions: Mapping[str, str], *, source: str,
                warn_other_versions: bool, skipped: list[SkippedEntry] | None):
  """Entry `i` of a file, or None where it no longer validates under other versions or
  on other code of its op (and, with `skipped`, where it is invalid), appended to
  `skipped` then.

  Raises:
    FormatError: without `skipped`, for an invalid entry recorded under the running
      versions on the running (or unknown) code of its op.
  """
  try:
    return entry_from_json(raw, source=source, versions=versions)
  except Exception as e:  # noqa: BLE001 (whatever an op's checks raise, the entry is bad)
    # Same versions and code: the file was broken (by hand or by a bug), say so.
    # Other versions, or other code of the op (edited in an editable install, where the
    # versions stay): the op or its config changed since, drop just this entry.
    why = f"{type(e).__name__}: {e}" if not isinstance(e, (KeyError, ValueError)) else str(e)
    other_code = _other_code(raw)
    broken = same_versions(versions) and other_code is None
    if skipped is not None:
      skipped.append(SkippedEntry(i, {**raw, "versions": dict(versions)}, why, broken))
    if broken:
      if skipped is not None:
        return None
      raise FormatError(f"{source}: entry {i} is invalid: {why}") from None
    if warn_other_versions:
      made = "recorded by other versions" if not same_versions(versions) else other_code
      warn(f"{source}: entry {i} skipped ({made}): {why}", VersionWarning)
    return None


def _other_code(raw: dict[str, Any]) -> str | None:
  """That entry `raw` was measured on other code of its op, in words, or None where it
  names the running code or none (the test of `result.Entry.stale_reason`)."""
  recorded = raw.get("code") or ""
  if not recorded:
    return None
  try:
    name = raw["bound_args"]["op"]["name"]
    now = code_fingerprint(registry.lookup(name))
  except (KeyError, TypeError):  # no op of that name: no code to compare with
    return None
  if recorded == now or not now:  # the running code unknown: never stale (fingerprint.py)
    return None
  return f"measured on other code of {name}: fingerprint {recorded}, now {now}"


def _one_of_two(first, i: int, second, j: int, *, source: str):
  """Of entries `i` and `j` of one call, the one `a | b` would keep (`result.merge_entries`),
  with a warning where they differ: a file holding them both was put together by hand."""
  from stellarax.autotuning import result
  kept = result.merge_entries(first, second)
  # Entries of other versions are one call measured by two stellarax versions sharing a
  # cache (`cache._with_unread_entries`), not a hand edit.
  if first != second and first.versions == second.versions:
    dropped, kept_at, dropped_at = (second, i, j) if kept is first else (first, j, i)
    warn(f"{source}: entries {i} and {j} both tune {first.bound_args.op.name} for "
         f"{result.short_args(first.bound_args)}, with different data; using entry {kept_at} "
         f"and ignoring entry {dropped_at}, as merging results does, because "
         f"{result.why_kept(kept, dropped)}. Delete one of them (`AutotuningResult.dump` "
         "writes each call once).", FormatWarning)
  return kept


def _warn_missing_fields(raw: dict[str, Any], entry, *, where: str) -> None:
  """Warns when an entry measured on the running code of its op lacks config fields.

  A field added to a config class later has a default, so that older files stay
  readable: their configs load with it. An entry with the op's current fingerprint was
  written by this code, which writes every field, so a field missing there was deleted
  by hand and its default is a guess. Older entries (other code or versions, or no
  fingerprint) load silently: they are stale, and `autotune` measures them again.
  """
  if not entry.code or not entry.is_current:
    return
  from stellarax.core.config import field_defaults
  fields = field_defaults(type(entry.best_config))  # an entry's configs have its op's class
  configs = [("best_config", raw["best_config"]), ("heuristic_config", raw["heuristic_config"])]
  configs += [(f"measurements[{j}].config", m.get("config", {}))
              for j, m in enumerate(raw.get("measurements", []))]
  missing = [f"{place}.{name}" for place, config in configs for name in fields
             if name not in config]
  if missing:
    # Only a field with a default can be missing here (the config was built without it).
    defaults = ", ".join(f"{name}={default!r}" for name, default in fields.items()
                         if any(m.endswith("." + name) for m in missing)
                         and default is not dataclasses.MISSING)
    warn(f"{where} was measured on the running code of its op, yet lacks config "
         f"field(s) {missing}; using their defaults ({defaults}). Restore the fields, or "
         "delete the entry to tune its call again.", FormatWarning)


# The JSON type of each field of an entry (schema 1: `entry_to_json`), and what to
# write instead. Absent fields are left to `entry_from_json`, which knows which are
# optional; a measurement's own fields, to `Measurement.from_json`.
_ENTRY_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "bound_args": ((dict,), "an object with the op and its arguments"),
    "best_config": ((dict,), "an object of config fields"),
    "heuristic_config": ((dict,), "an object of config fields"),
    "measurements": ((list,), "a list of measurement objects"),
    "measured_at": ((str,), "a string (an ISO-8601 UTC time)"),
    "method": ((str,), "a string (how it was measured)"),
    "versions": ((dict,), 'an object such as {"stellarax": "0.1.0", "jax": "0.11.2", '
                 '"jaxlib": "0.11.2"}'),
    "code": ((str, type(None)), "a string (the op's code fingerprint) or null"),
}


def _check_entry_types(raw: Any, *, where: str) -> None:
  """Checks the JSON types of an entry's fields, whatever versions it names.

  Schema 1 has always written these types, so another one is a broken file, not data
  from another version: unlike an entry that no longer validates, it is never
  dropped quietly (and a wrong `versions` leaves no versions to judge it by).

  Args:
    raw: the entry's parsed JSON.
    where: names the file and the entry in the error.

  Raises:
    FormatError: naming the entry, the field, what it holds and what it should.
  """
  if not isinstance(raw, dict):
    raise FormatError(f"{where} is {_json_type(raw)}; expected an object with 'bound_args', "
                      "'best_config', 'heuristic_config' and 'measurements'. Fix or delete it.")
  for field, (types, expected) in _ENTRY_TYPES.items():
    if field in raw and not _of_type(raw[field], types):
      _wrong_type(where, field, raw[field], expected)
  if "versions" in raw and not _is_versions(raw["versions"]):
    _wrong_type(where, "versions", raw["versions"], _ENTRY_TYPES["versions"][1])
  for j, m in enumerate(raw.get("measurements", [])):
    if not isinstance(m, dict):
      _wrong_type(where, f"measurements[{j}]", m, "an object with 'config', 'status', ...")
    if "config" in m and not isinstance(m["config"], dict):
      _wrong_type(where, f"measurements[{j}].config", m["config"], "an object of config fields")


def _wrong_type(where: str, field: str, value: Any, expected: str) -> None:
  raise FormatError(f"{where}: field {field!r} is {_json_type(value)} ({value!r:.60}); expected "
                    f"{expected}. Fix the field, or delete the entry to tune its call again.")


def _of_type(value: Any, types: tuple[type, ...]) -> bool:
  return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _is_versions(value: Any) -> bool:
  return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _json_type(value: Any) -> str:
  """`value`'s JSON type, in words."""
  if value is None:
    return "null"
  for t, name in ((bool, "true/false"), (dict, "an object"), (list, "a list"),
                  (str, "a string"), ((int, float), "a number")):
    if isinstance(value, t):
      return name
  return type(value).__name__


def _op_named(raw: Any) -> str:
  """" (op name)" where a raw entry names its op, for messages; else ""."""
  try:
    return f" ({raw['bound_args']['op']['name']})"
  except (TypeError, KeyError):
    return ""
