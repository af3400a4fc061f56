"""Extract the stellarax op calls of a profiled run as bound-argument JSON.

    python -m stellarax.tools.xplane_to_bound_args \\
        --xplane_file=my_model.xplane.pb --output_file=/tmp/bound_args.json \\
        [--import mylib.ops]

`--xplane_file` is a `*.xplane.pb` file or a folder as `jax.profiler.trace`
writes it; `--import` names a module defining ops of a package's own, so that
their calls can be read. The output lists the unique `BoundArguments` of every stellarax op
that ran, forward and VJP, with how many times each ran and its total device
time, most expensive first, so that the calls that cost most are tuned first:

    {"stellarax": "0.1.0", "source": "...", "calls": [
       {"bound_args": {...}, "count": 12, "device_time_s": 0.0421}, ...]}

Read it back with `stellarax.autotuning.bound_args_from_json(path)` and tune
with `stellarax.autotune(...)` (or `stellarax autotune PATH`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from stellarax.autotuning import file_format
from stellarax.autotuning.profile import ProfileError, profile_files, read_op_calls


class ExtractError(Exception):
  """A profile's op calls cannot be turned into bound arguments."""


def extract(xplane_file: str | os.PathLike) -> list[dict[str, Any]]:
  """The op calls of a profile as JSON-able records, most expensive first.

  Args:
    xplane_file: a `*.xplane.pb` file or a `jax.profiler.trace` folder.

  Returns:
    [{"bound_args": ..., "count": int, "device_time_s": float}, ...].

  Raises:
    ProfileError: for a missing, unreadable or op-less profile.
    ExtractError: for a marker this stellarax cannot read (e.g. from
      another version with other ops or configs).
  """
  from stellarax.core.bound_args import BoundArguments
  merged: dict[Any, list] = {}  # call -> [count, device time]
  for call in read_op_calls(xplane_file):
    try:
      ba = BoundArguments.from_json(json.loads(call.marker))
    except (KeyError, ValueError, TypeError) as e:
      raise ExtractError(
          f"{xplane_file}: an op call in the profile cannot be read by this stellarax "
          f"(was the profile made with another version?): {e}") from None
    # One call run under several pinned configs has a marker for each: it is one call.
    totals = merged.setdefault(ba.with_config(None), [0, 0.0])
    totals[0] += call.count
    totals[1] += call.device_time_s
  records = [{"bound_args": ba.to_json(), "count": count, "device_time_s": time_s}
             for ba, (count, time_s) in merged.items()]
  return sorted(records, key=lambda r: -r["device_time_s"])


_PROG = "stellarax xplane_to_bound_args"


def main(argv: list[str] | None = None) -> int:
  """Runs the tool; returns the exit status (0 ok, 2 for a bad profile, module or output
  file)."""
  from stellarax import __version__
  parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.splitlines()[0])
  parser.add_argument("--xplane_file", required=True, help="*.xplane.pb file or jax.profiler.trace folder")
  parser.add_argument("--output_file", required=True, help="where to write the bound-argument JSON")
  from stellarax.tools.cli import add_import_option
  add_import_option(parser)
  args = parser.parse_args(argv)
  from stellarax.core import registry
  from stellarax.tools.cli import output_problem
  try:  # the output may not replace the profile (nor, in a trace folder, its files)
    inputs = [args.xplane_file, *map(str, profile_files(args.xplane_file)[0])]
  except (ProfileError, OSError):  # said below, once the output is known to be fine
    inputs = [args.xplane_file]
  problem = output_problem(args.output_file, inputs)
  if problem:  # before the profile, which may take long to read
    print(f"{_PROG}: error: --output_file={args.output_file}: {problem}", file=sys.stderr)
    return 2
  try:
    registry.import_op_modules(args.imports)
    records = extract(args.xplane_file)
    files, older = profile_files(args.xplane_file)
  except (ImportError, ProfileError, ExtractError) as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 2
  out = {"stellarax": __version__, "source": os.fspath(args.xplane_file), "calls": records}
  try:
    # Atomically: a write that fails leaves an earlier file there whole.
    file_format.atomic_write(args.output_file, json.dumps(out, indent=1, sort_keys=True) + "\n")
  except OSError as e:
    print(f"{_PROG}: error: --output_file={args.output_file}: {e.strerror}", file=sys.stderr)
    return 2
  print(f"read {', '.join(map(str, files))}" + (
      f" (the newest trace; {older} file{'s' * (older != 1)} of older traces under "
      f"{args.xplane_file} left out: pass a trace's own folder to read another)"
      if older else ""))
  total = sum(r["device_time_s"] for r in records)
  print(f"{len(records)} stellarax op calls ({total * 1e3:.3f} ms of device time) -> {args.output_file}")
  for r in records:
    print(f"  {r['bound_args']['op']['name']:<28} x{r['count']:<5} {r['device_time_s'] * 1e3:9.3f} ms")
  return 0


if __name__ == "__main__":
  sys.exit(main())
