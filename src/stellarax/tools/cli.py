"""The `stellarax` command line.

    stellarax autotune BOUND_ARGS_JSON (--output result.json | --cache | both)
        [--budget-s S | --total-budget-s S] [--ignore-cache]
    stellarax xplane_to_bound_args --xplane_file=X --output_file=Y
    stellarax cache list | path | prune | clear
    stellarax cache add RESULT_JSON                 (a result tuned elsewhere, into the user cache)
    stellarax cache ship RESULT_JSON [--root DIR]   (developers: into the library cache)
    stellarax report RESULT_JSON
    stellarax demo [--output DIR] [--budget-s S | --total-budget-s S] [--no-progress]

Every command but demo takes `--import MODULE` (repeatable): a module to import first,
so that the ops a package defines of its own are known when data names them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from stellarax.tools import positive_seconds


def _autotune(args) -> int:
  """Tunes the calls of a bound-arguments file; exits 1 when some could not be tuned
  (after saving and caching the others, and saying why each failed), the file holds
  none, the user cache could not be written (after saving the --output file), or the
  --output file could not be written after tuning (the result goes to a temporary
  file, named); 2
  when the file cannot be read or the result would have nowhere to go; 130 on Ctrl-C,
  after saving and caching the calls tuned so far."""
  import stellarax
  if args.strategy == "random" and args.budget_s is None and args.total_budget_s is None:
    print("stellarax autotune: error: --strategy random draws configs until its budget is "
          "spent, and no budget was given: pass --budget-s (per call) or --total-budget-s.",
          file=sys.stderr)
    return 2
  try:
    tuner = stellarax.Autotuner(budget_s=args.budget_s, total_budget_s=args.total_budget_s,
                                cache=args.cache, progress=not args.no_progress,
                                strategy=args.strategy, isolate=args.isolate,
                                ignore_cache=args.ignore_cache)
  except ValueError as exc:  # e.g. both budgets: the message says which to drop
    print(f"stellarax autotune: error: {_as_options(str(exc))}", file=sys.stderr)
    return 2
  try:  # Read first, so that a bad file is an error message, not a traceback.
    calls = stellarax.autotuning.bound_args_from_json(args.bound_args)
  except ValueError as exc:
    print(f"stellarax autotune: error: {exc}", file=sys.stderr)
    return 2
  if not calls:
    print(f"stellarax autotune: {args.bound_args} holds no op calls; nothing to tune.",
          file=sys.stderr)
    return 1
  problem = _destination_problem(args)
  if problem:  # before tuning, whose measurements would have nowhere to go
    print(f"stellarax autotune: error: {problem}", file=sys.stderr)
    return 2
  reused = sum(tuner._reusable_entry(ba) is not None  # said, or a run looks like it measured
               for ba in tuner.collect(calls))
  if reused:
    print(f"{reused} calls have current entries in the user or library cache: they are "
          "reused as they are, not measured again (--ignore-cache measures them again)")
  failure, incomplete, interrupted = None, None, False
  with _cache_write_failures() as not_cached:
    try:
      result = tuner.autotune(args.bound_args)
    except stellarax.autotuning.IncompleteTuningError as exc:
      result, incomplete = exc.partial_result, exc
    except KeyboardInterrupt as exc:  # Ctrl-C: keep what was tuned, then stop
      result = getattr(exc, "partial_result", None)
      if result is None:
        raise
      interrupted = True
    except stellarax.autotuning.DeviceLostError as exc:  # its message says: --isolate
      from stellarax.autotuning.cache import current_device_kind
      result, failure = exc.partial_result, exc
      if result is None:  # raised outside a tuning run's loop: nothing was tuned
        result = stellarax.AutotuningResult(current_device_kind())
  if args.no_progress:  # with progress on, the tuner has printed the table already
    print(result.summary())
  # An empty result is saved too where tuning ended normally (every call found runs no
  # kernel): the file asked for exists. One cut short before tuning any call is not.
  saved_to = None  # where the result went: --output, or a file of its own if that failed
  stopped = failure is not None or incomplete is not None or interrupted
  if args.output and (len(result) or not stopped):
    saved_to = _save(result, args.output)
  if incomplete is not None:
    failure = _incomplete_text(incomplete, saved_to, args.cache)
  elif interrupted:
    failure = (f"stellarax autotune: interrupted after tuning {len(result)} calls; " + (
        "they are in the user cache, so a rerun with --cache tunes only the others"
        if args.cache else f"to tune only the others, `stellarax cache add {saved_to}` and "
        "rerun with --cache") if len(result) else
        "stellarax autotune: interrupted before any call was tuned")
  if failure is not None:
    print(failure, file=sys.stderr)
  if not_cached:
    print(f"stellarax autotune: error: {_not_cached(not_cached[0], saved_to)}",
          file=sys.stderr)
  elif args.cache and len(result):
    from stellarax.autotuning.cache import user_cache_root
    print(f"{len(result)} calls' entries are in the user cache at {user_cache_root()} "
          "(`stellarax cache list` shows them)")
  if interrupted:
    return 130  # what a shell reports for a program stopped by SIGINT
  not_saved = saved_to is not None and saved_to != args.output
  return 1 if failure is not None or not_cached or not_saved else 0


def _save(result, output: str) -> str:
  """Writes `result` to `output`, or where that fails after tuning (checked before, the
  folder may have changed since), to a file of its own in the temporary folder, so that
  no measurement is lost; says where it went. Returns that path."""
  replaced = os.path.exists(output)
  try:
    result.dump(output)
  except OSError as exc:
    fd, fallback = tempfile.mkstemp(prefix="stellarax-result-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      result.dump(f)
    print(f"stellarax autotune: error: --output={output} could not be written "
          f"({exc.strerror or exc}); the result is saved to {fallback} instead.",
          file=sys.stderr)
    return fallback
  print(f"result saved to {output}" + (" (it replaced the file there)" if replaced else ""))
  return output


def _as_options(text: str) -> str:
  """A message about the Autotuner's arguments, in the command line's option names."""
  text = re.sub(r"\btotal_budget_s=", "--total-budget-s ", text)
  return re.sub(r"\bbudget_s=", "--budget-s ", text)


def _cached(cache, device_kind: str, entry):
  """The user cache's entry of `entry`'s call now, or None."""
  found = cache.USER_CACHE.result_for(device_kind, entry.bound_args.op.name)
  return None if found is None else found.entry(entry.bound_args)


def _incomplete_text(exc, saved_to: str | None, cached: bool) -> str:
  """An IncompleteTuningError's message for the command line: its calls and why, then
  where the tuned ones went (its own words speak of Python: exc.partial_result)."""
  lines = [line.replace(" (exc.errors has them all)", "") for line in str(exc).splitlines()
           if "exc.partial_result" not in line]
  tuned = len(exc.partial_result)
  kept = [where for where, given in ((f"saved to {saved_to}", saved_to),
                                     ("in the user cache", cached)) if given]
  if tuned and kept:
    lines.append(f"The {tuned} tuned calls are {' and '.join(kept)}"
                 + ("; a rerun with --cache tunes only what is missing." if cached else "."))
  return "\n".join(lines)


def _destination_problem(args) -> str | None:
  """What keeps the result of `autotune` from being kept (--output, --cache), with the
  fix, in words; None when nothing does."""
  from stellarax.autotuning import cache
  if not (args.output or args.cache):
    return (f"nowhere to keep the result: pass --output FILE to save it to a file, --cache "
            f"to write it into the user cache (at {cache.user_cache_root()}), or both.")
  problem = args.output and output_problem(args.output, [args.bound_args])
  if problem:
    return f"--output={args.output}: {problem}"
  problem = args.cache and cache.USER_CACHE.root_problem(writing=True)
  if problem:
    return f"--cache: {problem}; or pass --output FILE instead, to save the result to a file."
  return None


@contextlib.contextmanager
def _cache_write_failures():
  """Collects the tuner's failures to write the user cache (CacheWriteWarning) instead
  of showing them, whatever the warning filters: their advice is for Python
  (`result.dump`), and the command says what to do instead. Other warnings show as
  they would.

  Yields:
    The list the failures (CacheWriteWarning instances) are added to.
  """
  from stellarax.autotuning.cache import CacheWriteWarning
  failures, show = [], warnings.showwarning

  def divert(message, category, *rest, **kwargs):
    if issubclass(category, CacheWriteWarning):
      failures.append(message)
    else:
      show(message, category, *rest, **kwargs)

  with warnings.catch_warnings():
    warnings.simplefilter("always", CacheWriteWarning)
    warnings.showwarning = divert
    yield failures


def _not_cached(failure, output: str | None) -> str:
  """What `autotune --cache` says when the user cache could not be written: that the
  result was not cached, why, and where else it can be kept."""
  from stellarax.autotuning import cache
  error, reason = failure.error, getattr(failure, "reason", None)
  why = (f"{error.filename}: {error.strerror}" if isinstance(error, OSError) and error.filename
         else str(error or reason or failure))
  what = "not all of the result was written" if reason else "the result was not written"
  message = f"{what} into the user cache at {cache.user_cache_root()} ({why})."
  folder = "a folder of this stellarax's own" if reason else "a writable folder"
  if output:
    return (message + f" It is saved in {output}; to cache it too, set STELLARAX_CACHE_DIR to "
            f"{folder} and run again with --cache.")
  return (message + " It is not saved anywhere: run again with --output FILE to save it to a "
          f"file, or with STELLARAX_CACHE_DIR set to {folder}.")


def output_problem(path: str, inputs: Sequence[str] = ()) -> str | None:
  """What keeps a command from writing its output file at `path`, checked before the
  work that makes it; None when nothing does.

  Args:
    path: the output file's path, as given.
    inputs: the command's input files: the output may not replace one of them.

  Returns:
    The problem and its fix, in words, or None.
  """
  target = Path(path)
  if target.is_dir():
    return "is a folder; name a file in it, e.g. " + str(target / "out.json")
  if target.exists() and not target.is_file():  # /dev/stdout, a pipe: written as a file
    return ("is not a regular file (a device, a pipe or a terminal); name a file to write "
            "the JSON to.")
  for given in inputs:
    if target.exists() and os.path.exists(given) and os.path.samefile(target, given):
      return (f"is the input file {given}; writing there would replace it: name another "
              "file.")
  folder = target.absolute().parent
  if not folder.exists():
    return f"no folder {folder}; create it or name a file in an existing one."
  if not folder.is_dir():
    return f"{folder} is not a folder; name a file in an existing folder."
  try:  # by writing, not os.access: that says yes to root on a read-only file system
    tempfile.TemporaryFile(dir=folder).close()
  except OSError as exc:
    return (f"the folder {folder} is not writable ({exc.strerror}); name a file in a "
            "writable folder.")
  return None


def _cache(args) -> int:
  from stellarax.autotuning import cache
  root = cache.user_cache_root()
  takes_result = args.action in ("ship", "add")
  if (args.result and not takes_result) or (args.root and args.action != "ship"):
    given = " ".join(filter(None, [args.result if not takes_result else None,
                                   args.root and f"--root {args.root}"]))
    print(f"stellarax cache {args.action}: error: takes no {given!r}: it works on the user "
          f"cache at {root} (set STELLARAX_CACHE_DIR for another); only `cache add` and "
          "`cache ship` take a result file, and only `cache ship` takes --root.", file=sys.stderr)
    return 2
  if takes_result and not args.result:
    print(f"stellarax cache {args.action}: error: needs a result file: stellarax cache "
          f"{args.action} tuned.json", file=sys.stderr)
    return 2
  problem = args.action in ("list", "prune", "clear", "add") and cache.USER_CACHE.root_problem()
  if problem:  # else a file in the way reads as an empty cache, and clearing does nothing
    print(f"stellarax cache {args.action}: error: the user cache at {root} cannot be used: "
          f"{problem}.", file=sys.stderr)
    return 2
  if args.action == "path":
    print(root.absolute())  # a relative STELLARAX_CACHE_DIR is relative to where one runs
  elif args.action == "list":
    _list(cache.USER_CACHE)
  elif args.action == "prune":
    pruned = cache.USER_CACHE.prune()
    for p in pruned:
      name = p.path.relative_to(root)
      if p.error and _of_an_op_not_imported(p.path):
        print(f"{name}: left as it is: {_NOT_IMPORTED.format(op=p.path.stem)}")
      elif p.newer:
        print(f"{name}: left as it is: {p.error} {_NEWER}")
      elif p.error:
        print(f"{name}: not pruned, left as it is: {p.error} {_FIX_OR_DELETE}")
      else:
        print(f"{name}: removed {p.removed} stale entries, kept {p.kept}"
              + ("" if p.kept else " (file deleted)"))
    if not pruned:
      print(f"user cache at {root}: no stale entries")
  elif args.action == "add":
    # A result tuned elsewhere (another run, a colleague's machine) joins the user cache:
    # per call, as results merge (`AutotuningResult.__or__`).
    from stellarax.autotuning.result import AutotuningResult
    result = AutotuningResult.load(args.result)
    written = set(cache.USER_CACHE.write(result))
    for path in sorted(written):
      print(f"wrote {path}")
    ops = sorted({e.bound_args.op.name for e in result})
    left = [op for op in ops if cache.USER_CACHE.path_for(result.device_kind, op) not in written]
    # Per call the merge keeps the cache's own entry where it wins: those were not added.
    added = sum(e.bound_args.op.name not in left and _cached(cache, result.device_kind, e) == e
                for e in result)
    written_entries = sum(e.bound_args.op.name not in left for e in result)
    kept = (f"; the cache kept its own entry for {written_entries - added} calls (a current "
            "one over a stale one, then one that searched over one that measured only its "
            "heuristic config, then the faster)" if added < written_entries else "")
    print(f"added {added} entries for {result.device_kind!r} to the user cache at {root}{kept}")
    if left:  # the warning above says why (a cache file of a newer stellarax)
      print(f"stellarax cache add: error: the entries of {', '.join(left)} were not added: "
            "their cache files are left as they are; give this stellarax a cache of its own "
            "(STELLARAX_CACHE_DIR) to keep them.", file=sys.stderr)
      return 1
  elif args.action == "ship":
    # For developers: merge a measured result into the shipped library cache
    # (src/stellarax/data/autotuning/<device kind>/<op>.json, one file per op), or with
    # --root into a package's own (stellarax.autotuning.add_library_cache reads it).
    from stellarax.autotuning.result import AutotuningResult
    root = Path(args.root) if args.root else cache.LIBRARY_ROOT
    for path in cache.write_library_cache(AutotuningResult.load(args.result), root):
      print(f"wrote {path}")
  elif args.action == "clear":
    removed = cache.USER_CACHE.clear()
    print(f"cleared the user cache at {root}: {removed} files removed (results, their "
          "locks, journals; files of yours stay)")
    if kept := cache.USER_CACHE.temporaries():
      print(f"kept {len(kept)} temporary files of cache writes that may still be under way "
            f"(`stellarax cache clear` removes them once {cache.LEFTOVER_AGE_S / 60:g} minutes "
            "old)")
  return 0


# What to do with a file that cannot be read: `cache clear` would remove the whole cache.
_FIX_OR_DELETE = "(fix or delete that file; the cache reads the rest)"
_NEWER = ("(a newer stellarax wrote it: its data, left alone; give each stellarax a cache "
          "of its own with STELLARAX_CACHE_DIR)")


def _list(user_cache) -> None:
  """Prints each file of the user cache with its entry count and how many are stale (the
  entries this stellarax cannot read, recorded by other versions, among them) or
  invalid; an unreadable file is listed with its error, and a temporary file left by a
  killed writer as such."""
  from stellarax.autotuning import cache
  from stellarax.autotuning import file_format
  from stellarax.autotuning.result import AutotuningResult
  files = user_cache.files()
  if not files:
    print(f"user cache at {user_cache.root} is empty")
  for path in files:
    name = path.relative_to(user_cache.root)
    skipped = []
    try:
      result = AutotuningResult.load(path, warn_other_versions=False, skipped=skipped)
    except FileNotFoundError:  # removed since listed (a `cache clear` meanwhile)
      continue
    except file_format.NewerSchemaError as exc:
      print(f"{name}: {str(exc).splitlines()[0]} {_NEWER}")
      continue
    except ValueError as exc:
      if _of_an_op_not_imported(path):
        print(f"{name}: {_NOT_IMPORTED.format(op=path.stem)}")
      else:
        print(f"{name}: unreadable: {str(exc).splitlines()[0]} {_FIX_OR_DELETE}")
      continue
    if skipped and not len(result) and _of_an_op_not_imported(path):
      print(f"{name}: {_NOT_IMPORTED.format(op=path.stem)}")
      continue
    invalid = [s for s in skipped if s.broken]
    stale = sum(not e.is_current for e in result) + len(skipped) - len(invalid)
    problem = cache.misplaced(path, result)
    print(f"{name}: {len(result) + len(skipped)} entries"
          + (f", {stale} stale (`stellarax cache prune` removes them)"
             if stale and not problem else "")
          + (f", {len(invalid)} invalid ({invalid[0].reason}) {_FIX_OR_DELETE}" if invalid else "")
          + (f"; {problem}" if problem else ""))
  # Only old temporaries: a younger one is most likely a write under way.
  for path in user_cache.temporaries(min_age_s=cache.LEFTOVER_AGE_S):
    print(f"{path.relative_to(user_cache.root)}: left by a cache write that did not finish, "
          "not a cache file (`stellarax cache clear` removes it)")


_NOT_IMPORTED = ("entries of {op}, an op no imported module defines (`--import MODULE` names "
                 "the module that does)")


def _of_an_op_not_imported(path: Path) -> bool:
  """Whether a cache file that failed to load is JSON of an op no imported module
  defines (each file holds one op's entries and is named after it), not a broken file."""
  import json
  from stellarax.core import registry
  if path.stem in registry.names():
    return False
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError):
    return False
  return isinstance(data, dict) and isinstance(data.get("entries"), list)


def _report(args) -> int:
  from stellarax.autotuning.result import AutotuningResult
  result = AutotuningResult.load(args.result)
  print(f"{args.result}: device {result.device_kind}, versions {result.versions}")
  print(result.summary())
  stale = [e for e in result if not e.is_current]
  if stale:
    print(f"{len(stale)} of {len(result)} entries are stale (e.g. {stale[0].bound_args.op.name}"
          f": {stale[0].stale_reason}): their configs still apply where the op offers them, "
          "and `stellarax autotune` of their calls measures them again.")
  return 0


def add_import_option(parser: argparse.ArgumentParser) -> None:
  """Adds `--import MODULE` (repeatable; `args.imports`) to a command that reads op names.

  Args:
    parser: the command's parser.
  """
  parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import this module first, so that the ops it defines register "
                           "(a package with ops of its own); may be repeated")


def main(argv=None) -> int:
  """Runs the command line.

  Args:
    argv: the arguments after the program name (None: sys.argv's).

  Returns:
    The exit status: 0 done, 1 something could not be done (`autotune`: some call
    could not be tuned, or none was given), 2 bad input (a file that cannot be read or
    is not in its format, conflicting options), 130 `autotune` stopped by Ctrl-C (what
    it had tuned is saved).
  """
  parser = argparse.ArgumentParser(prog="stellarax", description="stellarax kernels and autotuning")
  sub = parser.add_subparsers(dest="command", required=True)
  # Every command that reads op names from data (calls, results, caches, profiles).
  reads_ops = argparse.ArgumentParser(add_help=False)
  add_import_option(reads_ops)

  p = sub.add_parser("autotune", parents=[reads_ops],
                     help="tune the op calls in a bound-arguments JSON file")
  p.add_argument("bound_args", help="JSON from bound_args_to_json or xplane_to_bound_args")
  p.add_argument("--output", help="write the result JSON here (this, --cache or both: the "
                                  "command refuses to tune with neither)")
  p.add_argument("--cache", action="store_true",
                 help="write the result into the user cache (STELLARAX_CACHE_DIR moves it)")
  p.add_argument("--budget-s", type=positive_seconds, default=None,
                 help="tuning budget per op call, in seconds (default: none: every config "
                      "of a call's space is measured, all alike for small spaces, by "
                      "successive halving for large ones)")
  p.add_argument("--total-budget-s", type=positive_seconds, default=None,
                 help="one budget for the whole run, shared by the calls by their device time"
                      " in the profile (xplane_to_bound_args output), else equally")
  p.add_argument("--strategy", default="auto", choices=("auto", "exhaustive", "racing", "random"),
                 help="how to search each call's configs (auto: by the size of its space)")
  p.add_argument("--no-progress", action="store_true",
                 help="no progress bar; print the summary table at the end")
  p.add_argument("--ignore-cache", action="store_true",
                 help="measure again the calls the user or library cache holds (with --cache, "
                      "the new entries replace the cached ones)")
  p.add_argument("--isolate", action="store_true",
                 help="measure in worker processes, so that a hung or crashing config cannot stop the run")
  p.set_defaults(run=_autotune)

  p = sub.add_parser("xplane_to_bound_args", parents=[reads_ops],
                     help="extract stellarax op calls from an XProf profile")
  p.add_argument("--xplane_file", required=True,
                 help="*.xplane.pb file or jax.profiler.trace folder (its newest trace)")
  p.add_argument("--output_file", required=True, help="where to write the bound-argument JSON")
  p.set_defaults(run=lambda a: _xplane(a))

  p = sub.add_parser("cache", parents=[reads_ops],
                     help="inspect, fill, prune or clear the user cache")
  p.add_argument("action", choices=("list", "path", "add", "prune", "clear", "ship"),
                 help="list: its files and entries; path: where it is (STELLARAX_CACHE_DIR "
                      "moves it); add: merge a result file into it; prune: remove entries "
                      "measured under other versions or on other code; clear: remove the "
                      "cache's own files (results, locks, journals; other files stay); ship "
                      "(developers): merge a result into the library cache")
  p.add_argument("result", nargs="?",
                 help="with add or ship: the result JSON to merge into the user or library cache")
  p.add_argument("--root", help="with ship: the library cache folder (default: the package's)")
  p.set_defaults(run=_cache)

  p = sub.add_parser("report", parents=[reads_ops], help="print the summary table of a result file")
  p.add_argument("result", help="a result JSON (AutotuningResult.dump, autotune --output)")
  p.set_defaults(run=_report)

  from stellarax.tools import demo
  p = sub.add_parser("demo", help="autotune the demo model on this machine")
  demo.add_arguments(p)
  p.set_defaults(run=demo.run)

  args = parser.parse_args(argv)
  from stellarax.autotuning.file_format import FormatError
  from stellarax.core import registry
  try:
    registry.import_op_modules(getattr(args, "imports", []))
  except ImportError as exc:
    print(f"stellarax {args.command}: error: {exc}", file=sys.stderr)
    return 2
  name = f"stellarax {args.command}" + (f" {args.action}" if args.command == "cache" else "")
  # A warning printed as the command's own (the format only: filters and whatever
  # records warnings, such as pytest's, see them as before).
  formatwarning, warnings.formatwarning = warnings.formatwarning, functools.partial(
      _format_warning, name)
  try:
    return args.run(args)
  except (OSError, FormatError) as exc:  # a file to read or write: say which, no traceback
    what = (f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename
            else str(exc))
    print(f"{name}: error: {what}", file=sys.stderr)
    return 2
  finally:
    warnings.formatwarning = formatwarning


def _format_warning(name: str, message, category, filename, lineno, line=None) -> str:
  """`stellarax autotune: warning (Category): ...`, not Python's `<frozen runpy>:88:
  Category: ...` and the source line."""
  return f"{name}: warning ({category.__name__}): {message}\n"


def _xplane(args) -> int:
  from stellarax.tools import xplane_to_bound_args
  return xplane_to_bound_args.main([f"--xplane_file={args.xplane_file}", f"--output_file={args.output_file}"])


def command(argv: list[str] | None = None) -> None:
  """The `stellarax` command: `main`, then exits with its status.

  After an interrupt (status 130) it exits at once, once its output is flushed: the
  tuning it stopped may leave compilations running on daemon threads inside XLA, which
  the interpreter's shutdown aborted (SIGABRT or SIGSEGV where 130 was due, 5 times in
  8); what it saved is on disk already.
  """
  code = main(argv)
  if code == 130:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
  sys.exit(code)


if __name__ == "__main__":
  command()
