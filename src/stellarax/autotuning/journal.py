"""Each measured config of a call, kept as it is measured, so that an interrupted tuning
of the call resumes where it stopped instead of measuring its configs again.

With `Autotuner(cache=True)`, the user cache keeps whole calls as they are tuned; a call
of a large space can take minutes, and a run stopped inside it (Ctrl-C, a lost machine,
a job's time limit) would measure all of it again. So each measurement also goes, as it
is taken, into a journal next to the op's file in the user cache:

    <cache>/<device kind>/<op name>.<16 hex digits of the call>.<8 of the settings>.journal

Its first line says what the measurements are valid for: the call (op and key), the
stellarax, jax and jaxlib versions and the timing revision (`measure.TIMING_REVISION`:
a journal from before a revision is started over, not resumed), the op's code
fingerprint, the inputs' seed and the measure options (the settings, whose digest is in
the name). Then one JSON line per measured config: the config, its `Measurement` and
the effort it was taken at. A rerun of the same tuning (all of the first line equal)
takes a config's journaled measurement instead of measuring it, where it was taken at
the effort asked or more. Measuring a call again (`Autotuner(ignore_cache=True)`)
recalls nothing an ordinary tuning measured: its journal's first line says so
(`"remeasure": true`), so it is a file of its own, and only a rerun that measures again
resumes it. Tunings of one
call with other settings (two environments sharing the cache, other measure options)
keep journals of their own, so neither truncates the other's or appends under its first
line; runs with the same settings append to one journal, a line per write (`O_APPEND`).
A line cut short (a process killed while writing it) is passed over, and the next run's
lines start on a line of their own. The journals of a call are removed once its entry
is in the cache.

A config that failed for what the run met rather than what it is (a timeout, a runtime
error: another process held the device's memory, a machine under load) is measured again
by a rerun; one that failed to compile or gave a wrong result is not. Else a tuning whose
every config failed once would fail again on every rerun without running anything.

Measurements recalled from a journal were taken in another run, not interleaved with
this run's, so they do not decide a close choice alone: where the best config and the
ones within noise of it include a recalled measurement, `Autotuner.tune_one` measures
them again, together, and chooses among those.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stellarax.autotuning import file_format
from stellarax.autotuning.measure import Measurement, MeasureOptions
from stellarax.core.bound_args import BoundArguments
from stellarax.core.config import config_from_json, config_to_json
from stellarax.core.fingerprint import code_fingerprint
from stellarax.core.specs import canonical_json

SUFFIX = ".journal"

# Failures of what a run met, not of what a config is: a rerun measures them again.
_MEASURED_AGAIN = frozenset({"timeout", "runtime_error"})


@dataclasses.dataclass(frozen=True)
class Recalled:
  """A config's measurement from a journal, and the effort it was taken at."""

  measurement: Measurement
  effort: float


class Journal:
  """The journal of one call's tuning (see the module docstring).

  Attributes:
    path: the journal file.
    recalled: config -> `Recalled`, what an earlier run of the same tuning measured.
  """

  def __init__(self, path: Path, header: dict[str, Any], config_cls: type):
    self.path, self._header, self._config_cls = path, header, config_cls
    self.recalled: dict[Any, Recalled] = {}
    self._started = False  # whether this run's header is in the file
    self._restart = False  # whether the first record starts the file over
    self._torn = False  # whether the file ends in a line cut short
    self._read()

  @classmethod
  def for_call(cls, bound_args: BoundArguments, folder: Path, *, seed: int,
               options: MeasureOptions, isolate: bool, anew: bool = False) -> Journal:
    """The journal of tuning `bound_args` with these settings, in the user cache's folder
    of the device kind (read at once: `recalled`).

    Args:
      bound_args: the call, without a config.
      folder: the user cache's folder of the device kind measured on.
      seed: the seed of the call's random inputs.
      options: how each config is measured.
      isolate: whether configs are measured in worker processes.
      anew: the call is measured again (`ignore_cache`): recall only what an earlier
        measuring again of it, interrupted, took (a journal of its own), not what an
        ordinary tuning did.

    Returns:
      The journal; nothing is written until `record`.
    """
    header = {"journal": 1, "op": json.loads(bound_args.op_json()),
              "key": json.loads(bound_args.key_json()),
              "versions": dict(file_format.current_versions()),
              "code": code_fingerprint(type(bound_args.op)), "seed": seed,
              "options": _json_safe(dataclasses.asdict(options)), "isolate": isolate}
    if anew:
      header["remeasure"] = True
    header = json.loads(canonical_json(header))
    return cls(journal_path(bound_args, folder, header), header, type(bound_args.op).config_cls)

  def _read(self) -> None:
    try:
      raw = self.path.read_bytes()
    except OSError:  # none yet, or unreadable: start anew
      return
    # Line by line: a damaged line (a byte that is no UTF-8) costs itself alone. Read
    # whole, it cost every line, and the file was never started over either.
    text = raw.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if not lines or _parsed(lines[0]) != self._header:
      self._restart = bool(text)  # not this tuning's (a damaged file): start it over
      return
    self._started, self._torn = True, not text.endswith("\n")
    for line in lines[1:]:
      item = _parsed(line)
      try:
        config = config_from_json(self._config_cls, item["config"])
        recalled = Recalled(Measurement.from_json(item["measurement"]), float(item["effort"]))
      except (TypeError, KeyError, ValueError):  # a line cut short, or not ours
        continue
      if recalled.measurement.status in _MEASURED_AGAIN:
        continue
      known = self.recalled.get(config)
      if known is None or recalled.effort >= known.effort:
        self.recalled[config] = recalled

  def recall(self, config: Any, effort: float) -> Measurement | None:
    """The journaled measurement of `config` taken at `effort` or more, else None."""
    known = self.recalled.get(config)
    return known.measurement if known is not None and known.effort >= effort else None

  def record(self, measurements: Mapping[Any, Measurement], effort: float) -> None:
    """Appends measurements just taken at `effort` (the header first, in a new journal).

    Raises:
      OSError: when the journal cannot be written (the caller decides what that costs).
    """
    lines = [canonical_json({"config": config_to_json(c), "effort": effort,
                             "measurement": m.to_json()}) for c, m in measurements.items()]
    if not lines:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if self._restart else 0)
    fd = os.open(self.path, flags, 0o644)
    try:
      if not self._started and os.fstat(fd).st_size == 0:
        # (Another run with these settings may have begun the file since it was read: its
        # first line is then this one's, and this run appends to it.)
        lines.insert(0, canonical_json(self._header))
      data = ("\n" if self._torn else "") + "\n".join(lines) + "\n"
      _write_all(fd, data.encode())  # one write where it can: whole lines or none
    finally:
      os.close(fd)
    self._started, self._restart, self._torn = True, False, False

  def is_recalled(self, config: Any, measurement: Measurement) -> bool:
    """Whether `measurement` of `config` is the one recalled from the journal."""
    known = self.recalled.get(config)
    return known is not None and known.measurement is measurement


def journal_path(bound_args: BoundArguments, folder: Path, header: Mapping[str, Any]) -> Path:
  """Where the journal of tuning `bound_args` with the settings of `header` (the first
  line `Journal.for_call` makes) is, in a device kind's folder of the cache."""
  settings = hashlib.sha256(canonical_json(header).encode()).hexdigest()[:8]
  return folder / f"{_call_prefix(bound_args)}.{settings}{SUFFIX}"


# `<op name>.<16 hex>.<8 hex>.journal` (`journal_path`); without the settings' 8, as
# releases before them named it.
_NAME = re.compile(r".+\.[0-9a-f]{16}(\.[0-9a-f]{8})?" + re.escape(SUFFIX))


def is_journal_name(name: str) -> bool:
  """Whether a file name is a tuning journal's (`journal_path`), not a file of the
  user's that also ends in `.journal` (the cache folder may be a folder of theirs).

  Args:
    name: a file name, without its folder.

  Returns:
    True for `<op name>.<16 hex digits>[.<8 hex digits>].journal`.
  """
  return _NAME.fullmatch(name) is not None


def _call_prefix(bound_args: BoundArguments) -> str:
  digest = hashlib.sha256(f"{bound_args.op_json()}\0{bound_args.key_json()}".encode())
  return f"{bound_args.op.name}.{digest.hexdigest()[:16]}"


def remove(bound_args: BoundArguments, folder: Path) -> None:
  """Removes the journals of tuning `bound_args` (with any settings), if any: its entry
  is in the cache."""
  # `<prefix>*.journal` also takes the journals of releases that named none of the settings.
  for path in glob.glob(glob.escape(str(folder / _call_prefix(bound_args))) + "*" + SUFFIX):
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass


def _write_all(fd: int, data: bytes) -> None:
  """Writes all of `data` (`os.write` may write less, e.g. on a full disk's last blocks)."""
  while data:
    written = os.write(fd, data)
    if written <= 0:
      raise OSError(f"wrote nothing of the last {len(data)} bytes")
    data = data[written:]


def _json_safe(value: Any) -> Any:
  """`value` with non-finite floats as strings (JSON has none; `MeasureOptions` takes
  `atol=inf` for "no tolerance"), so that the header can be written."""
  if isinstance(value, float) and not math.isfinite(value):
    return repr(value)
  if isinstance(value, dict):
    return {k: _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  return value


def _parsed(line: str) -> Any:
  try:
    return json.loads(line)
  except ValueError:
    return None
