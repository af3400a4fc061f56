"""The JSON format shared by results, the user cache and the library cache.

    {
      "schema": 1,
      "device_kind": "NVIDIA H200",
      "versions": {"stellarax": "0.1.0", "jax": "0.11.2", "jaxlib": "0.11.2"},
      "entries": [
        {
          "bound_args": {"op": {"name": "ragged_dot.xla", "fields": {}},
                         "arguments": {...}, "vmap_axes": [...]},
          "best_config": {...}, "heuristic_config": {...},
          "measured_at": "2026-11-29T23:00:00Z", "method": "racing/cpu-batched",
          "versions": {"stellarax": "0.1.0", "jax": "0.11.2", "jaxlib": "0.11.2"},
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
before they were kept, takes the file's), so a file that merges old and new
measurements says which is which, and `code`, the fingerprint of the op's
source it was measured on (`core/fingerprint.py`; absent or "" if unknown).

Policy for data from other versions: a file with a newer `schema` is refused
with a clear error (it may mean anything); entries recorded under another
stellarax/jax/jaxlib version are used, with one warning per file, because
configs are validated when read and a config that no longer validates (or an
op that no longer exists) drops just that entry, with a warning. They are
stale all the same (`result.Entry.stale_reason`), as are entries measured on
other code of their op (used silently): `autotune` measures their calls again,
and the new entry wins the merge. The shipped library cache reads its
own files without these warnings (`cache.FileCache.warn_other_versions`). A
file that is not valid JSON, lacks a required field, or holds an invalid entry
recorded under the running versions raises `FormatError` naming the file and
the problem, whatever the op's checks raised. Files are written atomically, with
the permissions `open` would give them (the umask's).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jaxlib

from stellarax.core.warn import warn

SCHEMA_VERSION = 1


class FormatError(ValueError):
  """A result or cache file is corrupt or not in the expected format."""


class NewerSchemaError(FormatError):
  """A results file written by a newer stellarax, in a schema this one cannot read."""


class VersionWarning(UserWarning):
  """Data recorded under other versions is being used."""


def current_versions() -> dict[str, str]:
  """The versions recorded in files written now."""
  from stellarax import __version__
  return {"stellarax": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def same_versions(versions: Mapping[str, str]) -> bool:
  """Whether `versions` name the running stellarax, jax and jaxlib."""
  return all(versions.get(k) == v for k, v in current_versions().items())


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
    raise FormatError(f"{source}: not valid JSON ({type(e).__name__}: {e}). Delete or fix "
                      "the file.") from None
  if not isinstance(data, dict):
    raise FormatError(f"{source}: expected a JSON object with 'schema', 'device_kind' and 'entries'.")
  for field in ("schema", "device_kind", "entries"):
    if field not in data:
      raise FormatError(f"{source}: missing field {field!r}; this is not a stellarax results file.")
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


def atomic_write(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` atomically (temp file in the same folder, rename)."""
  path = os.fspath(path)
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  try:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
  except OSError as exc:  # name the file asked for, not the temporary one
    raise OSError(exc.errno, exc.strerror, path) from None
  try:
    os.fchmod(fd, 0o666 & ~_umask())  # as open() would make it (mkstemp makes 0600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
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
  for m in data.get("measurements", []):
    m = dict(m)
    config = config_from_json(cls, m.pop("config"))
    measurements.append((config, Measurement.from_json(m)))
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


def result_from_json(cls, data: dict[str, Any], *, source: str, warn_other_versions: bool = True):
  """Builds an AutotuningResult from parsed data (see the module policy); without
  `warn_other_versions`, data from other versions is used (or dropped) silently."""
  file_versions = data.get("versions") or current_versions()
  if not isinstance(file_versions, dict):
    raise FormatError(f"{source}: 'versions' must be an object naming the writer's stellarax, "
                      f"jax and jaxlib versions, got {file_versions!r}.")
  current = current_versions()
  recorded = [_entry_versions(raw, file_versions) for raw in data["entries"]]
  others = [v for v in recorded if not same_versions(v)]
  if warn_other_versions and others:
    warn(f"{source}: {len(others)} of {len(recorded)} entries were recorded with other "
         f"versions ({others[0]}, running {current}); using them. `autotune` measures "
         "their calls again.", VersionWarning)
  entries = {}
  for i, raw in enumerate(data["entries"]):
    try:
      if not isinstance(raw, dict):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}.")
      entry = entry_from_json(raw, source=source, versions=recorded[i])
    except Exception as e:  # noqa: BLE001 (whatever an op's checks raise, the entry is bad)
      # Same versions: the file was broken (by hand or by a bug), say so.
      # Other versions: an op or config changed since, drop just this entry.
      why = f"{type(e).__name__}: {e}" if not isinstance(e, (KeyError, ValueError)) else str(e)
      if same_versions(recorded[i]):
        raise FormatError(f"{source}: entry {i} is invalid: {why}") from None
      if warn_other_versions:
        warn(f"{source}: entry {i} skipped (recorded by other versions): {why}",
             VersionWarning)
      continue
    entries[entry.key] = entry
  return cls(str(data["device_kind"]), entries, file_versions)
