"""The user cache and the shipped library cache.

Both are folders of result files, one per device kind and op:
`<root>/<device_kind_slug>/<op name>.json` in the format of `file_format.py`.

- The user cache lives in `$STELLARAX_CACHE_DIR`, else
  `$XDG_CACHE_HOME/stellarax/autotuning`, else `~/.cache/stellarax/autotuning`
  (on macOS `~/Library/Caches/stellarax/autotuning`). It is written only when
  asked (`autotune(..., cache=True)`, `Autotuner(cache=True)` or the CLI).
  Writers take an exclusive `fcntl` lock on `<file>.lock`, re-read the file,
  merge (`AutotuningResult.__or__`), and replace it atomically, so several
  processes writing at once lose nothing and readers never see a torn file.
  The lock files stay (`clear` removes each while holding it, so that writers
  racing a clear still exclude each other); `write_library_cache` removes its
  own, so that a folder to ship holds its JSON files only. A writer killed mid-write
  leaves its temporary file (`.tmp-*.json`): no reader takes it for a result file,
  and `clear` removes it once it is `LEFTOVER_AGE_S` old.
- The library cache ships in `stellarax/data/autotuning/` and is read-only. A package
  that defines ops of its own ships their configs the same way (`write_library_cache`)
  and adds its folder when imported (`add_library_cache`), after stellarax's.

Files are read lazily, once per (device kind, op), and re-read when their
modification time changes. A cache only saves time: a file that cannot be read is
passed over with a `CacheWarning` (once per version of it), a corrupt file that a
writer finds is moved aside to `<file>.json.unreadable`, and `Autotuner` turns a
cache it cannot write into a warning, keeping its result. Nothing readable is lost
on the way: an invalid entry in a good file is passed over alone (a writer copies the
file as it was aside and keeps the other entries), and entries this stellarax cannot
read because another one wrote them (other versions sharing the cache, e.g. a config
field added later) are written back unchanged by a writer, until `prune`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from stellarax.autotuning import file_format
from stellarax.autotuning import journal as journal_lib
from stellarax.autotuning.result import AutotuningResult
from stellarax.core import partitioning
from stellarax.core import registry
from stellarax.core import resolution
from stellarax.core import specs
from stellarax.core import warn as warn_lib
from stellarax.core.warn import warn

LIBRARY_ROOT = Path(__file__).resolve().parent.parent / "data" / "autotuning"

# How old (by mtime) the temporary file of an atomic write must be before it is taken
# for a leftover of a killed writer. Its age alone tells: a live writer's temporary
# exists only while it writes and fsyncs one file (milliseconds), and deleting it
# would make that writer's rename fail and lose its entries. Which writer a temporary
# belongs to is not in its name, so its op's lock cannot tell; the margin covers a
# slow disk or a writer stopped for a while (Ctrl-Z).
LEFTOVER_AGE_S = 600.0


class CacheWarning(UserWarning):
  """A cache file could not be read or written; resolution or tuning went on without it."""


# A file of a newer stellarax is that stellarax's data: the fix is never to clear it.
_LEAVE_NEWER = ("it is a newer stellarax's data, left as it is; give each stellarax a cache "
                "of its own with STELLARAX_CACHE_DIR")


class CacheWriteWarning(CacheWarning):
  """The user cache could not be written, or not all of it; the result still holds
  every measurement.

  Attributes:
    error: the OSError that kept it from being written (None if not told).
    reason: why, in a few words, where no OSError says it (None otherwise).
  """

  def __init__(self, message: str, error: OSError | None = None, reason: str | None = None):
    super().__init__(message)
    self.error = error
    self.reason = reason


def device_kind_slug(device_kind: str) -> str:
  """A folder name for a device kind: "NVIDIA H200" -> "NVIDIA_H200"."""
  return re.sub(r"[^A-Za-z0-9.-]+", "_", device_kind).strip("_") or "unknown"


def current_device_kind() -> str:
  """The device kind of the default backend's first device: where tuning measures."""
  return jax.devices()[0].device_kind


def target_device_kind() -> str:
  """The device kind a call traced now is for: the abstract mesh's device where one is
  set (lowering for another machine, e.g. `jax.sharding.use_abstract_mesh` of an H200's
  from a CPU host, as `jax.export` and deviceless compiles do), else
  `current_device_kind()`. Configs are looked up under it: a program lowered for an
  H200 takes the H200's tuned entries, not those of the host it is lowered on."""
  return partitioning.target_device().device_kind


def user_cache_root() -> Path:
  """The user cache folder (see the module docstring).

  Returns:
    $STELLARAX_CACHE_DIR where it is set (with ~ expanded); else under the platform's
    cache folder (~/Library/Caches on macOS, $XDG_CACHE_HOME or ~/.cache elsewhere),
    `stellarax/autotuning`. The folder need not exist yet.
  """
  env = os.environ.get("STELLARAX_CACHE_DIR")
  if env:
    return Path(env).expanduser()
  if sys.platform == "darwin":
    return Path.home() / "Library" / "Caches" / "stellarax" / "autotuning"
  base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return Path(base) / "stellarax" / "autotuning"


class FileCache:
  """A folder of per-(device kind, op) result files.

  Attributes:
    source_name: "user_cache" or "library_cache" (reported by explain()).
    writable: whether `write` may add to it.
    warn_other_versions: whether reading a file recorded under other versions warns
      (`AutotuningResult.loads`). The library cache does not: its configs are the
      library's own data, recorded with the jax of the GPU run that measured them, and
      they still apply under another jax (each is validated as it is read, and one
      that no longer validates is dropped); a warning would reach users who cannot act
      on it, and fail programs that turn warnings into errors.
  """

  def __init__(self, root: Path | None, source_name: str, *, writable: bool,
               warn_other_versions: bool = True):
    self._root = root
    self.source_name = source_name
    self.writable = writable
    self.warn_other_versions = warn_other_versions
    # path -> (the file's version, what was read, the problem found, its fix)
    self._loaded: dict[Path, tuple[tuple[int, int, int], AutotuningResult | None,
                                   str | None, str | None]] = {}
    self._warned: dict[Path, tuple[int, int, int] | None] = {}  # the version warned about
    self._lock = threading.Lock()

  @property
  def root(self) -> Path:
    """The cache's folder: the one it was made with, else `user_cache_root()` (read
    each time, so that STELLARAX_CACHE_DIR set later is followed)."""
    return self._root if self._root is not None else user_cache_root()

  def path_for(self, device_kind: str, op_name: str) -> Path:
    """The file holding `op_name`'s entries for `device_kind`."""
    return self.root / device_kind_slug(device_kind) / f"{op_name}.json"

  def result_for(self, device_kind: str, op_name: str) -> AutotuningResult | None:
    """The cached result of one op on one device kind, or None.

    Args:
      device_kind: a device kind as JAX names it (e.g. "NVIDIA H200").
      op_name: a registered op name (e.g. "ragged_dot.pallas_triton").

    A cache only saves time, so a file that cannot be read (corrupt, not in the format,
    or a cache folder that is not one) is passed over with a `CacheWarning` naming it,
    once per version of the file, and the calls it held resolve further down the
    order (`AutotuningResult.load` of the same file raises instead). An invalid entry
    in a file that is otherwise good is passed over alone, with the same warning.
    """
    path = self.path_for(device_kind, op_name)
    try:
      st = path.stat()
    except FileNotFoundError:
      return None
    except OSError as exc:  # e.g. the cache root is a file
      self._warn_once(path, None, f"{path}: cannot be read ({exc.strerror}).",
                      fix=self._file_in_the_way(path.parent))
      return None
    # Which version of the file: every write makes a new file (`atomic_write`), so its
    # inode tells two writes apart where a coarse clock gives both one mtime.
    version = (st.st_ino, st.st_size, st.st_mtime_ns)
    with self._lock:
      cached = self._loaded.get(path)
      if cached is None or cached[0] != version:
        held_before = warn_lib.held_count()
        problem, fix, skipped = None, None, []
        try:
          result = AutotuningResult.load(path, warn_other_versions=self.warn_other_versions,
                                         skipped=skipped)
          _check_device_kind(result, device_kind, path)
          problem = _broken_entries(path, skipped)
        except FileNotFoundError:  # removed since its stat (`clear`): absent, no problem
          return None
        except (OSError, file_format.FormatError) as exc:
          problem, result = str(exc).splitlines()[0], None  # it names the file
          if isinstance(exc, file_format.NewerSchemaError):
            fix = _LEAVE_NEWER  # clearing the cache would destroy the other's data
        cached = (version, result, problem, fix)
        # A read whose warnings were held back (`warn.held_back`) is not kept: the next
        # read outside emits them.
        if held_before is None or warn_lib.held_count() == held_before:
          self._loaded[path] = cached
    _, result, problem, fix = cached
    if problem is not None:
      self._warn_once(path, version, problem, fix, whole_file=result is None)
    return result

  def _warn_once(self, path: Path, version: tuple[int, int, int] | None, problem: str,
                 fix: str | None = None, *, whole_file: bool = True) -> None:
    """Warns that `path` (or, without `whole_file`, the entries `problem` names) is
    passed over, once per version of it (None: one that cannot be read); `fix` says
    what to do (default: clear the user cache, or reinstall for the library's)."""
    if path in self._warned and self._warned[path] == version:
      return
    if whole_file:
      fix = fix or ("`stellarax cache clear` empties the user cache" if self.writable
                    else "reinstalling stellarax restores the library cache")
      what = "it: its calls resolve as if it were absent"
    else:
      fix = fix or ("fix or delete them; the next write to the file keeps the other entries, "
                    "and the file as it was aside" if self.writable
                    else "reinstalling stellarax restores the library cache")
      what = "the rest of it: the calls of invalid entries resolve as if they were absent"
    verb = "passes over" if whole_file else "reads"
    if warn(f"{problem} The {self._name} {verb} {what} ({fix}).",
            CacheWarning):  # held back, it is owed (`warn.held_back`)
      self._warned[path] = version

  def root_problem(self, *, writing: bool = False) -> str | None:
    """What keeps the cache's folder from being read (or, with `writing`, written),
    with the fix, in words; None when nothing does. A folder not made yet is none.

    Args:
      writing: also check that the folder (or the nearest one above it that exists,
        where it would be made) is writable.

    Returns:
      The problem and its fix, or None.
    """
    fix = self._file_in_the_way(self.root)
    if fix is not None:
      return fix
    existing = _nearest_existing(self.root)
    if writing and not os.access(existing, os.W_OK | os.X_OK):
      return (f"the folder {existing} is not writable, so the {self._name} at {self.root} "
              "cannot be written; " + self._elsewhere())
    return None

  def _file_in_the_way(self, folder: Path) -> str | None:
    """When a file stands where `folder` (a folder of the cache, its root or one above)
    should be, what to do about it; else None. Nothing inside the cache (`cache clear`
    included) can then help: every path under the file fails (Not a directory)."""
    blocker = _nearest_existing(folder)
    if blocker.is_dir():
      return None
    env = os.environ.get("STELLARAX_CACHE_DIR")
    if self._root is None and env and blocker in (self.root, *self.root.parents):
      what = ("is a file, not a folder" if blocker == self.root
              else f"cannot be a folder: {blocker} is a file")
      return (f"STELLARAX_CACHE_DIR={env} {what}; point STELLARAX_CACHE_DIR to a folder "
              "(one is made if missing), or unset it to use the default one")
    return (f"{blocker} is a file where the {self._name} needs a folder: move or remove "
            "it" + (", or " + self._elsewhere() if self._root is None else ""))

  def _elsewhere(self) -> str:
    """The fix for a cache folder that cannot be used where it is."""
    if self._root is None:
      return "set STELLARAX_CACHE_DIR to a writable folder"
    return "name a writable folder"

  @property
  def _name(self) -> str:
    return self.source_name.replace("_", " ")

  def _entry(self, bound_args) -> Any:
    result = self.result_for(target_device_kind(), bound_args.op.name)
    return None if result is None else result.entry(bound_args)

  def lookup_config(self, bound_args, accept=None) -> Any | None:
    """The cached config of a call on the device kind it is traced for (a `ConfigSource`,
    as `AutotuningResult.lookup_config`): the entry's `config_to_run(accept)`, or None
    where the cache has no entry for it (a stale entry applies until `prune` removes it,
    unless its config is no longer in the call's space)."""
    entry = self._entry(bound_args)
    return None if entry is None else entry.config_to_run(accept,
                                                          warn_passed_over=self.writable)

  def lookup_time(self, bound_args) -> float | None:
    """The cached median time in seconds of a call's best config on the device kind it is
    traced for, or None where the cache has no entry for it or that config was not timed
    ok."""
    entry = self._entry(bound_args)
    return None if entry is None else entry.time_to_run(warn_passed_over=self.writable)

  def results(self, device_kind: str | None = None) -> list[AutotuningResult]:
    """Every result file of a device kind (default: the current one)."""
    folder = self.root / device_kind_slug(device_kind or current_device_kind())
    if not folder.is_dir():
      return []
    out = []
    for path in sorted(p for p in folder.glob("*.json")
                       if not _is_temporary(p) and is_cache_file(p)):  # not a user's JSON
      r = self.result_for(device_kind or current_device_kind(), path.stem)
      if r is not None:
        out.append(r)
    return out

  def write(self, result: AutotuningResult, *, replace: bool = False,
            combine: Callable[[Any, Any], Any] | None = None,
            remove_locks: bool = False) -> list[Path]:
    """Merges `result` into the cache files, safely under concurrent writers.

    Args:
      result: the entries to write.
      replace: each entry replaces the file's entry of its call; without it, the two
        merge (`AutotuningResult.__or__`: a current entry wins over a stale one, then
        one that searched over a starved one, then the faster).
      combine: instead, `combine(file's entry or None, entry)` is written for each
        entry, read under the file's lock (so nothing a concurrent writer merged in is
        lost).
      remove_locks: remove each `<file>.json.lock` once the file is written (a folder
        to ship holds its JSON files only); writers that remove their lock files and
        writers that keep them still exclude each other (`_exclusive_lock`).

    Returns:
      The files written.

    Raises:
      PermissionError: for the read-only library cache.
      OSError: when a file cannot be written (the caller decides what that costs).

    Warns:
      CacheWarning: when an existing file is unreadable or holds another device kind's
        results; it is moved aside to `<file>.json.unreadable` (or
        `<file>.<n>.json.unreadable`, never over an earlier one) and the file written
        anew. When it was written by a newer stellarax (a newer schema), it is left as
        it is and that op's entries are not written. When it holds invalid entries,
        a copy of it is kept aside so, and its other entries are kept in the file.
      VersionWarning: for entries of other versions in an existing file; those this
        stellarax cannot read are written back unchanged.
    """
    if not self.writable:
      raise PermissionError(f"The {self.source_name} at {self.root} is read-only.")
    by_op: dict[str, list[Any]] = {}
    for entry in result:
      by_op.setdefault(entry.bound_args.op.name, []).append(entry)
    written = []
    for op_name, entries in sorted(by_op.items()):
      path = self.path_for(result.device_kind, op_name)
      _make_folder(path.parent)
      with _exclusive_lock(path.with_suffix(".json.lock"), remove=remove_locks):
        merged, skipped = AutotuningResult(result.device_kind), []
        if path.exists():
          try:
            found = AutotuningResult.load(path, skipped=skipped)
            _check_device_kind(found, result.device_kind, path)
            merged = found
            problem = _broken_entries(path, skipped)
            if problem is not None:
              # Keep the file as it was for inspection; the good entries stay live.
              aside = _aside(path)
              shutil.copy2(path, aside)
              warn(f"{problem} The file as it was is kept at {aside}; its other "
                   f"{len(found)} entries are kept in {path}.", CacheWarning)
          except file_format.NewerSchemaError as exc:
            # A newer stellarax's file (two environments share the cache): leave it be.
            warn(f"{str(exc).splitlines()[0]} It is left as it is, and this "
                 f"result's {len(entries)} entries of {op_name} are not cached "
                 "(set STELLARAX_CACHE_DIR to give this stellarax a cache of its "
                 "own).", CacheWarning)
            continue
          except file_format.FormatError as exc:
            # Nothing in it can be read: keep it aside for inspection, write afresh.
            aside = _aside(path)
            os.replace(path, aside)
            warn(f"{str(exc).splitlines()[0]} It was moved to {aside}, and the new "
                 f"entries were written to {path} without it.", CacheWarning)
        for entry in entries:
          if combine is not None:
            merged = merged.with_entry(combine(merged.entry(entry.bound_args), entry))
          elif replace:
            merged = merged.with_entry(entry)
          else:
            merged = merged | AutotuningResult(result.device_kind, {entry.key: entry})
        file_format.atomic_write(path, file_format.dumps(_with_unread_entries(merged, skipped)))
      written.append(path)
    return written

  def clear(self) -> int:
    """Removes every file of the cache (results, their locks, files moved aside as
    unreadable, tuning journals, temporary files of writes that did not finish) and the
    folders it left empty; other files and folders in the cache folder stay (it may be a
    folder of the user's: only files named as the cache names its own are removed, and
    results files only in their device kind's folder: one in another folder, which the
    cache passes over, is the user's), and so do temporary files younger than
    `LEFTOVER_AGE_S` (a write may still be under way).

    Writers may go on meanwhile: each result file is removed under its lock, so a
    write lands whole either before the clear (and is removed) or after it (and
    stays), and a file gone meanwhile is no error.

    Returns:
      How many files were removed.

    Raises:
      PermissionError: for the read-only library cache.
      OSError: when a file cannot be removed (the message names it).
    """
    if not self.writable:
      raise PermissionError(f"The {self.source_name} at {self.root} is read-only.")
    if not self.root.is_dir():
      return 0
    cleared = collections.Counter()  # folder -> the cache's files removed from it
    for path in self.temporaries(min_age_s=LEFTOVER_AGE_S):
      cleared[path.parent] += _unlink(path)
    for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
      cleared[folder] += _clear_folder(folder)
      if cleared[folder]:  # a folder that held none of the cache's files is none of its own
        with contextlib.suppress(OSError):  # not empty: something else lives there
          folder.rmdir()
    with self._lock:
      self._loaded.clear()
    return sum(cleared.values())

  def files(self) -> list[Path]:
    """Every result file of the cache, of every device kind, sorted (not the temporary
    files of atomic writes, nor other JSON files: `is_cache_file`)."""
    if not self.root.is_dir():
      return []
    return sorted(p for p in self.root.glob("*/*.json")
                  if not _is_temporary(p) and is_cache_file(p))

  def temporaries(self, *, min_age_s: float = 0.0) -> list[Path]:
    """The temporary files of atomic writes in the cache's folders, sorted.

    Args:
      min_age_s: only those whose last change is at least this many seconds old
        (`LEFTOVER_AGE_S`: those left by writers that were killed).

    Returns:
      Their paths; one that vanishes while they are looked at (its write finished) is
      left out.
    """
    if not self.root.is_dir():
      return []
    now, found = time.time(), []
    for path in sorted(self.root.glob(f"*/{file_format.TEMPORARY_PREFIX}*.json")):
      try:
        age = now - path.stat().st_mtime
      except FileNotFoundError:  # renamed over its result file meanwhile
        continue
      if age >= min_age_s:
        found.append(path)
    return found

  def prune(self) -> list[Pruned]:
    """Removes the stale entries (`Entry.stale_reason`: measured under other versions
    or on other code of their op, those this stellarax cannot read included) from every
    file, safely under concurrent writers; a file left empty is deleted, an unreadable
    one (or one with invalid entries) is left as it is and reported. A results file in
    another device kind's folder (`misplaced`: a result of the user's, which the cache
    passes over) is not touched.

    A stale entry's config still applies until it is pruned (and `autotune` measures
    its call again); pruning is for a cache whose old measurements should no longer
    decide anything.

    Returns:
      A `Pruned` for each file that had stale entries or could not be read.

    Raises:
      PermissionError: for the read-only library cache.
    """
    if not self.writable:
      raise PermissionError(f"The {self.source_name} at {self.root} is read-only.")
    pruned = []
    for path in self.files():
      if not _in_its_folder(path):  # the user's, passed over by the cache: not touched
        continue
      with _exclusive_lock(path.with_suffix(".json.lock")):
        unread = []
        try:
          result = AutotuningResult.load(path, warn_other_versions=False, skipped=unread)
        except FileNotFoundError:  # removed since listed (`clear`): nothing to prune
          continue
        except ValueError as exc:  # file_format.FormatError: it names the file
          pruned.append(Pruned(path, 0, 0, error=str(exc).splitlines()[0],
                               newer=isinstance(exc, file_format.NewerSchemaError)))
          continue
        problem = _broken_entries(path, unread)
        if problem is not None:  # left for the user to look at, as an unreadable file
          pruned.append(Pruned(path, 0, 0, error=problem))
          continue
        # Entries this stellarax cannot read (other versions or code: `write` keeps them)
        # are stale here too.
        current = {e.key: e for e in result if e.is_current}
        if len(current) == len(result) and not unread:
          continue
        if current:
          AutotuningResult(result.device_kind, current, result.versions).dump(path)
        else:
          path.unlink()
      pruned.append(Pruned(path, len(result) + len(unread) - len(current), len(current)))
    return pruned


def _broken_entries(path: Path, skipped: list[file_format.SkippedEntry]) -> str | None:
  """The invalid entries of a file that was read otherwise, in words; None if none."""
  broken = [s for s in skipped if s.broken]
  if not broken:
    return None
  which = (f"entry {broken[0].index} is" if len(broken) == 1 else
           f"{len(broken)} entries ({', '.join(str(s.index) for s in broken)}) are")
  return f"{path}: {which} invalid ({broken[0].reason})."


def _with_unread_entries(result: AutotuningResult,
                         skipped: list[file_format.SkippedEntry]) -> dict[str, Any]:
  """`result`'s file data with the entries of the file it was merged into that this
  stellarax could not read but another may (`SkippedEntry.broken` False: recorded by
  other versions or on other code of their op, e.g. a config field a newer stellarax
  added) written back unchanged, where no entry of `result` tunes the same call: two
  environments may share a cache, and neither may delete the other's measurements.
  `prune` removes them (they are stale here)."""
  data = result.to_json()
  written = {specs.canonical_json(e["bound_args"]) for e in data["entries"]}
  for unread in skipped:
    if not unread.broken and specs.canonical_json(unread.raw.get("bound_args")) not in written:
      data["entries"].append(unread.raw)
  return data


# How a results file begins (file_format.dumps sorts the keys): enough to tell one cut
# short by a killed writer from a JSON file of the user's.
_RESULTS_FILE_START = re.compile(rb'\A\s*\{\s*"device_kind"\s*:')
_ENVELOPE = {"schema", "device_kind", "entries"}


def is_cache_file(path: Path) -> bool:
  """Whether `path` is a stellarax results file (or one cut short), not another JSON
  file that shares a folder with the cache (a cache root set to a user's folder).

  Args:
    path: a `.json` file.

  Returns:
    True where it begins as `file_format.dumps` writes one, or parses as an object with
    the results file's envelope (`schema`, `device_kind`, `entries`), or cannot be parsed
    and is named for an op family (`<family>.<...>.json`: a broken cache file); False
    otherwise, and for a file that cannot be read.
  """
  try:
    with open(path, "rb") as f:
      if _RESULTS_FILE_START.match(f.read(256)):
        return True
      f.seek(0)
      data = json.loads(f.read())
  except ValueError:
    family, dot, _ = path.stem.partition(".")
    return bool(dot) and family in {n.partition(".")[0] for n in registry.names()}
  except OSError:
    return False
  return isinstance(data, dict) and _ENVELOPE <= data.keys()


def _clear_folder(folder: Path) -> int:
  """Removes the cache's files from one device kind's folder (not the temporary files
  of atomic writes: `FileCache.clear` sees to those); returns how many it removed."""
  try:
    names = {p.name for p in folder.iterdir()}
  except FileNotFoundError:  # another clear removed the folder meanwhile
    return 0
  removed = 0
  # Under each result file's lock, as writers and `prune` take it: a writer holding it
  # finishes first, and one waiting on it finds the lock file gone once it gets it and
  # starts again on a new one (`_locked_file`), so its entries land after the clear.
  # Removing the lock file while holding it (as `write(remove_locks=True)` does)
  # never leaves a writer holding a lock file that another writer cannot find.
  # Only the cache's own files: a JSON file of the user's stays (`is_cache_file`).
  results = {n for n in names if n.endswith(".json") and not _is_temporary(Path(n))
             and is_cache_file(folder / n) and _in_its_folder(folder / n)}
  results |= {n.removesuffix(".lock") for n in names if n.endswith(".json.lock")
              and (n.removesuffix(".lock") not in names or n.removesuffix(".lock") in results)}
  for name in sorted(results):
    with _exclusive_lock(folder / f"{name}.lock", remove=True):
      removed += _unlink(folder / name)
    removed += int(f"{name}.lock" in names)  # the lock file, if it was there before
  # Files moved aside as unreadable need no lock: writers only ever add them; nor do
  # tuning journals (autotuning/journal.py), which a tuning under way starts again.
  for name in sorted(n for n in names
                     if _ASIDE_NAME.fullmatch(n) or journal_lib.is_journal_name(n)):
    removed += _unlink(folder / name)
  return removed


def _in_its_folder(path: Path) -> bool:
  """Whether a results file lies in the folder of the device kind it holds, as the cache
  writes them; one in another folder (a result of the user's, kept in a folder of the
  cache root, which the cache passes over: `misplaced`) is not the cache's to remove. A
  file that cannot be read (cut short, named for an op) counts as the cache's."""
  try:
    device_kind = json.loads(path.read_bytes()).get("device_kind")
  except (OSError, ValueError, AttributeError):
    return True
  return not isinstance(device_kind, str) or device_kind_slug(device_kind) == path.parent.name


def _unlink(path: Path) -> int:
  """Removes `path`: 1 if it did, 0 if it was gone already (renamed or removed by a
  writer or another clear since it was listed)."""
  try:
    path.unlink()
  except FileNotFoundError:
    return 0
  return 1


def _is_temporary(path: Path) -> bool:
  """Whether `path` is the temporary file of an atomic write (`file_format.atomic_write`)."""
  return path.name.startswith(file_format.TEMPORARY_PREFIX)


def _nearest_existing(path: Path) -> Path:
  """`path` if it exists, else the nearest path above it that does (for a path under a
  file, that file)."""
  for candidate in (path, *path.parents):
    if os.path.exists(candidate):
      return candidate
  return Path(path.anchor or ".")


def _check_device_kind(result: AutotuningResult, device_kind: str, path: Path) -> None:
  """Raises FormatError when a cache file holds another device kind's results than its
  folder is for (a file copied into the wrong folder)."""
  if result.device_kind != device_kind:
    raise file_format.FormatError(
        f"{path}: holds results of {result.device_kind!r}, but its folder is for "
        f"{device_kind!r} ({device_kind_slug(device_kind)}). Move it to the folder "
        f"{device_kind_slug(result.device_kind)}, or apply it with "
        "`with stellarax.AutotuningResult.load(path):`.")


def misplaced(path: Path, result: AutotuningResult) -> str | None:
  """Why a cache file is passed over for lying in another device kind's folder, and what
  to do; None where its folder is its results' device kind's.

  Args:
    path: the file, in a device kind's folder of a cache.
    result: what it holds.
  """
  folder, own = path.parent.name, device_kind_slug(result.device_kind)
  if folder == own:
    return None
  return (f"it holds results of {result.device_kind!r} in the folder {folder!r}, so the cache "
          f"passes it over: move it to the folder {own!r}")


# What `_aside` names a file: `<file>.json.unreadable` or `<file>.<n>.json.unreadable`.
_ASIDE_NAME = re.compile(r".+?(\.\d+)?\.json\.unreadable")


def _aside(path: Path) -> Path:
  """A free name to move an unreadable cache file to: `<file>.json.unreadable`, else
  `<file>.<n>.json.unreadable`, so that an earlier one is never overwritten."""
  aside, n = path.with_suffix(".json.unreadable"), 1
  while aside.exists():
    aside, n = path.with_suffix(f".{n}.json.unreadable"), n + 1
  return aside


@dataclasses.dataclass(frozen=True)
class Pruned:
  """What `FileCache.prune` did to one file.

  Attributes:
    path: the file.
    removed: stale entries removed.
    kept: current entries kept (0: the file was deleted).
    error: why the file could not be read (nothing was removed), else None.
    newer: whether that is because a newer stellarax wrote it (its data, which this one
      must leave alone).
  """

  path: Path
  removed: int
  kept: int
  error: str | None = None
  newer: bool = False


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, *, remove: bool = False):
  """Holds an exclusive `flock` on the file `lock_path` (made if missing).

  Args:
    lock_path: the lock file.
    remove: delete the lock file before letting go of it.

  A writer that waited on a lock file someone removed meanwhile (`remove`, or `clear`)
  would hold a lock nobody else can find, while the next writer locks a new file at
  the same path: so each writer, once it holds its lock, checks that its file is
  still the one at `lock_path`, and starts again on the new one if not.
  """
  f = _locked_file(lock_path)
  try:
    yield
  finally:
    if remove:  # while still held: a writer waiting on this file then starts again
      lock_path.unlink(missing_ok=True)
    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    f.close()


def _locked_file(lock_path: Path):
  """The lock file, open and exclusively locked, once it is the file at `lock_path`
  (its folder is made again if `clear` removed it)."""
  while True:
    try:
      f = open(lock_path, "a+")
    except FileNotFoundError:  # `clear` removed the folder, empty, after it was made
      _make_folder(lock_path.parent)
      continue
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX)
      if _same_file(f.fileno(), lock_path):
        return f
    except BaseException:
      f.close()
      raise
    f.close()  # removed while we waited: lock the file that is there now


def _make_folder(folder: Path) -> None:
  """Makes `folder` and those above it where missing, though `clear` may remove it
  (empty) at any moment: `mkdir(exist_ok=True)` then fails if it sees the folder
  exist and then no longer a folder, and tries again here.

  Raises:
    FileExistsError: when a file (not a folder) stands at `folder` or above it.
    OSError: when it cannot be made (e.g. PermissionError).
  """
  while True:
    try:
      folder.mkdir(parents=True, exist_ok=True)
      return
    except FileExistsError as exc:
      blocker = exc.filename or folder  # `folder`, or one above it
      if os.path.lexists(blocker) and not os.path.isdir(blocker):
        raise  # a file (or a broken link) in the way, not a folder removed meanwhile


def _same_file(fd: int, path: Path) -> bool:
  """Whether the open file `fd` is the file at `path` (not one removed since)."""
  try:
    at_path = os.stat(path)
  except FileNotFoundError:
    return False
  held = os.fstat(fd)
  return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


def cached_results(op_name: str, device_kind: str | None = None):
  """The cached results of one op, in resolution order.

  Args:
    op_name: the op's registered name.
    device_kind: default: the kind calls are traced for (`target_device_kind`).

  Yields:
    (source name, AutotuningResult) for every registered cache holding the op.
  """
  kind = device_kind or target_device_kind()
  for cache in resolution.cache_sources():
    result_for = getattr(cache, "result_for", None)
    result = result_for(kind, op_name) if result_for is not None else None
    if result is not None:
      yield cache.source_name, result


def other_device_kinds(op_name: str) -> tuple[str, ...]:
  """The device kinds other than the current one that a registered cache holds a file of
  `op_name` for, as their folders name them ("NVIDIA_H100_80GB_HBM3"), sorted.

  Args:
    op_name: the op's registered name.

  Returns:
    The folder names; empty where none (or a cache cannot be listed).
  """
  found = set()
  for cache in resolution.cache_sources():
    files = getattr(cache, "files", None)
    if files is None:
      continue
    try:
      found.update(p.parent.name for p in files() if p.stem == op_name)
    except OSError:  # a cache that cannot be listed says nothing here
      continue
  found.discard(device_kind_slug(target_device_kind()))
  return tuple(sorted(found))


def write_library_cache(result: AutotuningResult, root: str | Path) -> list[Path]:
  """Merges `result` into a library cache folder, for a package to ship.

  The folder takes the shipped library cache's layout (`<device kind>/<op name>.json`,
  one file per op); a package built on stellarax ships it as package data and hands it
  to `add_library_cache` when imported (`stellarax cache ship RESULT --root FOLDER`
  does the same from the command line). Entries already in the folder stay; per call,
  the faster current measurement wins (`AutotuningResult.__or__`).

  Args:
    result: the measured result to ship.
    root: the folder (created if missing).

  Returns:
    The files written (and nothing else is left in the folder: no lock files).

  Raises:
    OSError: when a file cannot be written.
  """
  return FileCache(Path(root), "library_cache", writable=True).write(result, remove_locks=True)


def add_library_cache(root: str | Path) -> FileCache:
  """Makes a folder of shipped configs part of config resolution, read-only.

  For a package that defines its own ops and ships their tuned configs (written by
  `write_library_cache`): its calls then resolve from the folder after the active
  results, the user cache and stellarax's own library cache, and before transfer and
  heuristics; `explain()` names the source "library_cache". As with stellarax's own,
  entries recorded under other versions apply without a warning. Adding a folder
  twice adds it once.

  Args:
    root: the folder, e.g. `Path(mylib.__file__).parent / "data" / "autotuning"`.

  Returns:
    The cache (read-only), e.g. for `fit_heuristics`.

  Raises:
    NotADirectoryError: when `root` is not an existing folder.
  """
  path = Path(root).resolve()
  if not path.is_dir():
    raise NotADirectoryError(
        f"add_library_cache({str(root)!r}): no such folder. Pass the folder that "
        "write_library_cache (or `stellarax cache ship RESULT --root FOLDER`) wrote, as "
        "installed with your package.")
  for source in resolution.cache_sources():
    if isinstance(source, FileCache) and not source.writable and source.root == path:
      return source
  added = FileCache(path, "library_cache", writable=False, warn_other_versions=False)
  resolution.register_cache_source(added)
  return added


USER_CACHE = FileCache(None, "user_cache", writable=True)
LIBRARY_CACHE = FileCache(LIBRARY_ROOT, "library_cache", writable=False, warn_other_versions=False)

resolution.register_cache_source(USER_CACHE)
resolution.register_cache_source(LIBRARY_CACHE)
