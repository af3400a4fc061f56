"""Lands a `bench/gpu_check.sh` run in the repository: the one command to run here
after the GPU machine has answered.

    python bench/land_gpu_check.py RESULTS [--command "bash bench/gpu_check.sh"] [--dry-run]

RESULTS is the folder gpu_check wrote (`$OUT/gpu_check`, found under the device
tool's `files_at`): results.json, tuned.json, profile/, h200_target_config.pbtxt.
In order, it

1. refuses a run not worth keeping: one that is not from a GPU (a smoke run in
   interpret mode on the CPU; `--any-device` lets tests through) or timed nothing;
2. ships the tuned configs into the library cache (as `stellarax cache ship`), except
   those the run did not confirm: a best config with no successful measurement, or
   one that the same run's end-to-end check found WRONG or could not run;
3. adds a section to BENCHMARKS.md under "## <device>" (date, device, jax version,
   the command, the table, the code paths and the targets) and drops that heading's
   "Not measured yet" paragraph;
4. keeps the profile as test data, `tests/data/profiles/<device slug>/`
   (`profile.xplane.pb.gz` and `calls.json`, what `read_op_calls` found in it), which
   tests/autotuning/test_profile_fixtures.py reads back; where an earlier run's profile
   is kept there, in `<device slug>_<date>/` beside it (tests read old ones for what
   they showed);
5. keeps the card's XLA target config as bench/h200_target_config.txtpb (what
   `make compile-h200` compiles for), under a header saying where it came from, if the
   run wrote one.

It prints each file it wrote, then what is left for a person to decide. With
`--dry-run` it prints what it would write and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import gpu_check  # bench/, this script's folder

ROOT = Path(__file__).resolve().parents[1]

# Rows of a run that count as confirmed; anything else ("WRONG ...", "error: ...",
# "not run here: ...", "skipped ...") leaves the row's configs out of the library cache.
_CONFIRMED = "ok"


class LandError(Exception):
  """A results folder that cannot be landed; the message says why and what to do."""


@dataclasses.dataclass
class Run:
  """What one gpu_check run wrote.

  Attributes:
    folder: the results folder.
    env: results.json's environment (device, jax, stellarax, date, argv).
    rows: the table's rows (`gpu_check.Row`).
    tuned: tuned.json as an `AutotuningResult`, or None if nothing was tuned.
    dispatch: results.json's dispatch calibration (`gpu_check.dispatch_calibration`;
      empty for runs older than it).
    batching: results.json's batch-size check (`gpu_check.batch_size_check`; empty
      where the run left it out).
  """

  folder: Path
  env: dict[str, Any]
  rows: list[Any]
  tuned: Any
  dispatch: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  batching: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_run(folder: str | Path, *, any_device: bool = False) -> Run:
  """Reads a gpu_check results folder.

  Args:
    folder: the folder holding results.json (and tuned.json if anything was tuned).
    any_device: accept a run on a CPU (smoke runs; for tests).

  Returns:
    The run.

  Raises:
    LandError: no results.json; a run on a CPU without `any_device`; no row timed.
  """
  from stellarax.autotuning.result import AutotuningResult
  folder = Path(folder)
  results = folder / "results.json"
  if not results.is_file():
    raise LandError(f"{results}: no such file. Pass the folder bench/gpu_check.sh wrote "
                    "($OUT/gpu_check, under the device tool's files_at).")
  try:
    data = json.loads(results.read_text())
    env, raw_rows = data["env"], data["rows"]
    rows = [gpu_check.Row(**row) for row in raw_rows]
  except (ValueError, KeyError, TypeError) as e:  # cut short, or not gpu_check's
    raise LandError(f"{results}: not a results file of bench/gpu_check.py ({type(e).__name__}: "
                    f"{e}). Was the call cut off while writing it? gpu_check.log beside it "
                    "says how far it got.") from None
  device = str(env.get("device", ""))
  if not any_device and device.lower() in ("", "cpu"):
    raise LandError(f"{results}: ran on {device or 'an unknown device'!r}, not a GPU; a smoke "
                    "run's numbers are interpret-mode times. Land a run from the GPU machine.")
  if not any(row.median_ms for row in rows):
    raise LandError(f"{results}: no row was timed ({len(rows)} rows); nothing to land. "
                    "Read gpu_check.log beside it for why.")
  tuned_path = folder / "tuned.json"
  try:
    tuned = AutotuningResult.load(tuned_path) if tuned_path.is_file() else None
  except ValueError as e:  # FormatError: it names the file
    raise LandError(f"{str(e).splitlines()[0]} Land without it by moving it aside: no "
                    "config is shipped then, the table is still recorded.") from None
  return Run(folder, env, rows, tuned, data.get("dispatch", []), data.get("batching") or {})


def _unconfirmed_configs(rows) -> list[str]:
  """The "op: config" texts of tuned rows whose end-to-end check or timing failed."""
  bad = []
  for row in rows:
    if row.impl.endswith(" tuned") and row.status != _CONFIRMED and row.config:
      bad += [part.strip() for part in row.config.split("; ")]
  return bad


def _measured_only_heuristic(entry) -> bool:
  """Whether no config but the entry's heuristic has a successful measurement."""
  return all(config == entry.heuristic_config for config, m in entry.measurements if m.ok)


def confirmed_entries(run: Run) -> tuple[Any, list[str]]:
  """The tuned entries worth shipping, and why each other one is left out.

  An entry ships when its best config has a successful measurement, some other config
  was measured too (a tuning that measured only the heuristic, under too small a budget
  or in a space of one config, found nothing), and no tuned row of the run that used it
  ("op: config" in the row's config) failed its reference check or its timing.

  Returns:
    (an `AutotuningResult` of the entries to ship, or None if there are none;
     one line per entry left out).
  """
  from stellarax.autotuning.result import AutotuningResult
  if run.tuned is None:
    return None, []
  unconfirmed = set(_unconfirmed_configs(run.rows))
  keep, left_out = {}, []
  for entry in run.tuned:
    name = entry.bound_args.op.name
    shapes = " ".join(str(tuple(a.shape)) for a in entry.bound_args.array_specs())
    if entry.time_of(entry.best_config) is None:
      left_out.append(f"{name} {shapes}: its best config has no successful measurement")
    elif _measured_only_heuristic(entry):
      # Starved (a budget spent before a second config) or a space of one config: the
      # heuristic answers the call already, and an entry would make calls of other
      # shapes take this shape's heuristic by transfer, with nothing measured for them.
      left_out.append(f"{name} {shapes}: its tuning measured no config but the heuristic")
    elif gpu_check.config_label(entry) in unconfirmed:
      left_out.append(f"{name} {shapes}: a tuned row with its best config failed the run's check")
    else:
      keep[entry.key] = entry
  if not keep:
    return None, left_out
  return AutotuningResult(run.tuned.device_kind, keep, run.tuned.versions), left_out


def benchmarks_section(run: Run, command: str) -> str:
  """The BENCHMARKS.md section of a run: header lines, table, code paths, targets."""
  env = run.env
  argv = " ".join(str(a) for a in env.get("argv", [])[1:])
  lines = [f"### bench/gpu_check.sh, {_run_date(run)}", "",
           f"    command: {command}   (gpu_check.py {argv})",
           f"    device: {env.get('device')}; jax {env.get('jax')}; stellarax {env.get('stellarax')};"
           f" finished {env.get('date')}", ""]
  lines += ["    " + line for line in gpu_check.table_lines(run.rows)]
  if any(row.profiled_ms for row in run.rows):
    lines += ["", "Timing against the profiler's device time (one more batch of each row):", ""]
    lines += ["    " + line for line in gpu_check.profile_lines(run.rows)]
  if run.tuned is not None:
    lines += ["", "Code paths (tuning measurements of one op call: the heuristic, each "
              "code-path variant, the best):", ""]
    lines += ["    " + line for line in gpu_check.code_path_lines(run.tuned)]
    faster = gpu_check.faster_code_paths(run.tuned)
    lines += ["", "Faster than the heuristic beyond both confidence intervals:", ""]
    lines += ["    " + line for line in faster] or ["    none"]
  if run.dispatch:
    lines += ["", "Dispatch (small calls timed in batches and in a loop; what sets "
              "`MeasureOptions.host_bound_factor`):", ""]
    lines += ["    " + line for line in gpu_check.dispatch_lines(run.dispatch)]
  if run.batching:
    lines += ["", "Batch size (a long call timed per batch of 1 to 16 calls, and where a "
              "profiled batch's time goes):", ""]
    lines += ["    " + line for line in gpu_check.batch_size_lines(run.batching)]
  lines += ["", "Targets:", ""]
  lines += ["    " + line for line in gpu_check.target_lines(run.rows)]
  return "\n".join(lines) + "\n"


_NOT_MEASURED = "Not measured yet:"


def add_section(benchmarks: str, device: str, section: str) -> str:
  """BENCHMARKS.md's text with `section` first under "## <device>" (the heading is
  added before the first "## " heading if missing), without that heading's
  "Not measured yet" paragraph.

  Raises:
    LandError: the text has no "## " heading to put a new one before.
  """
  heading = f"## {device}\n"
  lines = benchmarks.splitlines(keepends=True)
  if heading not in lines:
    first = next((i for i, line in enumerate(lines) if line.startswith("## ")), None)
    if first is None:
      raise LandError("BENCHMARKS.md has no '## ' heading; add one per device first.")
    lines[first:first] = [heading, "\n"]
  start = lines.index(heading) + 1
  while start < len(lines) and not lines[start].strip():
    start += 1
  if lines[start].startswith(_NOT_MEASURED):
    end = start
    while end < len(lines) and lines[end].strip():
      end += 1
    del lines[start:end + 1]
  lines[start:start] = [section, "\n"]
  return "".join(lines)


# A recorded profile kept in the repository: gpu_check's small model gives well under this.
_MAX_FIXTURE_BYTES = 4 * 2**20


def profile_fixture(run: Run) -> tuple[bytes, str] | None:
  """The run's profile as test data: (gzipped xplane bytes, calls.json text), or None if
  the run wrote no profile or `read_op_calls` cannot read it (then it is no fixture)."""
  from stellarax.autotuning import profile
  files = sorted((run.folder / "profile").rglob("*.xplane.pb"))
  if not files:
    return None
  newest = max(files, key=lambda f: f.stat().st_mtime_ns)
  try:
    calls = profile.read_op_calls(newest)
  except profile.ProfileError as e:
    print(f"profile not kept: {e}")
    return None
  text = json.dumps({"device": run.env.get("device"), "jax": run.env.get("jax"),
                     "calls": [dataclasses.asdict(c) for c in calls]}, indent=1) + "\n"
  packed = gzip.compress(newest.read_bytes(), mtime=0)
  if len(packed) > _MAX_FIXTURE_BYTES:
    print(f"profile not kept: {newest} is {len(packed) / 2**20:.1f} MiB gzipped, over the "
          f"{_MAX_FIXTURE_BYTES / 2**20:.0f} MiB a test fixture may take; record a smaller model")
    return None
  return packed, text


def land(run: Run, *, command: str, root: Path = ROOT, dry_run: bool = False) -> list[Path]:
  """Writes what a run gives the repository under `root` (module doc, 2-5).

  Returns:
    The files written (or that would be, with `dry_run`).
  """
  from stellarax.autotuning import cache
  device = str(run.env.get("device"))
  written: list[Path] = []

  def write(path: Path, data: bytes | str) -> None:
    written.append(path)
    if dry_run:
      return
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
      path.write_bytes(data)
    else:
      path.write_text(data)

  ship, left_out = confirmed_entries(run)
  for line in left_out:
    print(f"not shipped: {line}")
  # Everything is made before anything is written: a failure writes nothing. Landing a
  # run again adds neither its section nor its profile twice (the cache merges as is).
  benchmarks = root / "BENCHMARKS.md"
  text = benchmarks.read_text()
  finished = f" finished {run.env.get('date')}"
  landed = bool(run.env.get("date")) and any(
      line.startswith("    device: ") and line.endswith(finished) for line in text.splitlines())
  if landed:
    print(f"BENCHMARKS.md has this run's section already (finished {run.env.get('date')})")
  else:
    text = add_section(text, device, benchmarks_section(run, command))
  fixture = profile_fixture(run)
  profiles = root / "tests" / "data" / "profiles"
  slug = cache.device_kind_slug(device)
  if fixture is not None and any(
      (folder / "profile.xplane.pb.gz").is_file()
      and (folder / "profile.xplane.pb.gz").read_bytes() == fixture[0]
      for folder in profiles.glob(f"{slug}*")):
    print("tests/data/profiles holds this run's profile already")
    fixture = None
  if ship is not None:
    library_root = root / "src" / "stellarax" / "data" / "autotuning"
    library = cache.FileCache(library_root, "library_cache", writable=True)
    if dry_run:
      written += [library.path_for(ship.device_kind, e.bound_args.op.name) for e in ship]
    else:
      written += library.write(ship)
      for lock in library_root.rglob("*.lock"):
        lock.unlink()
  if not landed:
    write(benchmarks, text)
  if fixture is not None:
    folder = _new_fixture_folder(profiles, slug, _run_date(run) or "undated")
    write(folder / "profile.xplane.pb.gz", fixture[0])
    write(folder / "calls.json", fixture[1])
  target = run.folder / "h200_target_config.pbtxt"
  if target.is_file():
    write(root / "bench" / "h200_target_config.txtpb", _target_header(run) + target.read_text())
  return sorted(set(written))


def _run_date(run: Run) -> str:
  """The day the run finished (YYYY-MM-DD), or "" where it did not say."""
  return str(run.env.get("date", "")).split(" ")[0]


def _new_fixture_folder(profiles: Path, slug: str, date: str) -> Path:
  """`profiles/<slug>`, or where that holds an earlier run's profile (which tests read
  for what it showed, e.g. command buffers), `<slug>_<date>` (then `_2`, `_3`...): a new
  run adds a fixture and replaces none."""
  names = itertools.chain([slug, f"{slug}_{date}"],
                          (f"{slug}_{date}_{n}" for n in itertools.count(2)))
  return next(profiles / name for name in names if not (profiles / name).exists())


def _target_header(run: Run) -> str:
  return (f"# An {run.env.get('device')} as XLA's GPU compiler sees it (stream_executor."
          "GpuTargetConfigProto, text\n"
          f"# format), written by XLA on the card itself (bench/gpu_check.sh, "
          f"{_run_date(run) or 'undated'}, "
          f"jax {run.env.get('jax')}):\n"
          "# what bench/compile_h200.py hands XLA to compile for an H200 with no GPU attached\n"
          "# (landed by bench/land_gpu_check.py).\n")


_LEFT_FOR_A_PERSON = """\
Left for a person:
- for each "faster than the heuristic" line above (a code-path variant faster beyond
  both confidence intervals), consider changing the op's heuristic (and its tests);
- reconsider PREFERENCE in src/stellarax/ops/*/api.py from the table;
- make compile-h200 with the new bench/h200_target_config.txtpb, then make test;
- write what the numbers say into BENCHMARKS.md's new section and the issue's note."""


def main(argv=None) -> int:
  """Runs the command line; returns the exit status: 0 landed (or would, with
  --dry-run), 2 refused (the reason on stderr)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", help="the folder bench/gpu_check.sh wrote ($OUT/gpu_check)")
  parser.add_argument("--command", default="bash bench/gpu_check.sh",
                      help="the command that ran on the GPU machine, as BENCHMARKS.md should name it")
  parser.add_argument("--dry-run", action="store_true", help="print what would be written; write nothing")
  parser.add_argument("--any-device", action="store_true", help="accept a CPU (smoke) run; for tests")
  parser.add_argument("--root", default=str(ROOT), help="the repository to write into")
  args = parser.parse_args(argv)
  try:
    run = load_run(args.results, any_device=args.any_device)
    written = land(run, command=args.command, root=Path(args.root), dry_run=args.dry_run)
  except LandError as e:
    print(f"land_gpu_check: {e}", file=sys.stderr)
    return 2
  for path in written:
    print(f"{'would write' if args.dry_run else 'wrote'} {path}")
  if run.tuned is not None:
    for line in gpu_check.faster_code_paths(run.tuned):
      print(f"faster than the heuristic: {line}")
  print(_LEFT_FOR_A_PERSON)
  return 0


if __name__ == "__main__":
  sys.exit(main())
