"""Each measured config of a call, kept as it is measured, so that an interrupted tuning
of the call resumes where it stopped instead of measuring its configs again.

With `Autotuner(cache=True)`, the user cache keeps whole calls as they are tuned; a call
of a large space can take minutes, and a run stopped inside it (Ctrl-C, a lost machine,
a job's time limit) would measure all of it again. So each measurement also goes, as it
is taken, into a journal next to the op's file in the user cache:

    <cache>/<device kind>/<op name>.<16 hex digits of the call>.journal

Its first line says what the measurements are valid for: the call (op and key), the
stellarax, jax and jaxlib versions, the op's code fingerprint, the inputs' seed and the
measure options. Then one JSON line per measured config: the config, its
`Measurement` and the effort it was taken at. A rerun of the same tuning (all of the
first line equal) takes a config's journaled measurement instead of measuring it,
where it was taken at the effort asked or more; a journal for anything else is started
anew. A line cut short (a process killed while writing it) is passed over. The journal
of a call is removed once its entry is in the cache.

Measurements recalled from a journal were taken in another run, not interleaved with
this run's, so they do not decide a close choice alone: where the best config and the
ones within noise of it include a recalled measurement, `Autotuner.tune_one` measures
them again, together, and chooses among those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
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

  def __init__(self, path: Path, header: dict[str, Any], config_cls: type, *, anew: bool = False):
    self.path, self._header, self._config_cls = path, header, config_cls
    self.recalled: dict[Any, Recalled] = {}
    self._started = False  # whether this run's header is in the file
    if not anew:
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
      anew: recall nothing (measure again); the first record starts the file over.

    Returns:
      The journal; nothing is written until `record`.
    """
    header = {"journal": 1, "op": json.loads(bound_args.op_json()),
              "key": json.loads(bound_args.key_json()),
              "versions": dict(file_format.current_versions()),
              "code": code_fingerprint(type(bound_args.op)), "seed": seed,
              "options": dataclasses.asdict(options), "isolate": isolate}
    return cls(journal_path(bound_args, folder), json.loads(canonical_json(header)),
               type(bound_args.op).config_cls, anew=anew)

  def _read(self) -> None:
    try:
      lines = self.path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):  # none yet, or unreadable: start anew
      return
    if not lines or _parsed(lines[0]) != self._header:
      return  # another tuning's (other versions, code or options): not this one's
    self._started = True
    for line in lines[1:]:
      item = _parsed(line)
      try:
        config = config_from_json(self._config_cls, item["config"])
        recalled = Recalled(Measurement.from_json(item["measurement"]), float(item["effort"]))
      except (TypeError, KeyError, ValueError):  # a line cut short, or not ours
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
    lines = [] if self._started else [canonical_json(self._header)]
    lines += [canonical_json({"config": config_to_json(c), "effort": effort,
                              "measurement": m.to_json()}) for c, m in measurements.items()]
    if not lines:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if self._started else os.O_TRUNC)
    fd = os.open(self.path, flags, 0o644)
    try:
      os.write(fd, ("\n".join(lines) + "\n").encode())  # one write: whole lines or none
    finally:
      os.close(fd)
    self._started = True

  def is_recalled(self, config: Any, measurement: Measurement) -> bool:
    """Whether `measurement` of `config` is the one recalled from the journal."""
    known = self.recalled.get(config)
    return known is not None and known.measurement is measurement


def journal_path(bound_args: BoundArguments, folder: Path) -> Path:
  """Where the journal of tuning `bound_args` is, in a device kind's folder of the cache."""
  digest = hashlib.sha256(f"{bound_args.op_json()}\0{bound_args.key_json()}".encode())
  return folder / f"{bound_args.op.name}.{digest.hexdigest()[:16]}{SUFFIX}"


def remove(bound_args: BoundArguments, folder: Path) -> None:
  """Removes the journal of tuning `bound_args`, if any (its entry is in the cache)."""
  try:
    journal_path(bound_args, folder).unlink()
  except FileNotFoundError:
    pass


def _parsed(line: str) -> Any:
  try:
    return json.loads(line)
  except ValueError:
    return None
