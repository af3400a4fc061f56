"""The `stellarax` command line."""

import dataclasses
import json
import os
import re
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning import cache
from stellarax.tools import cli


def _one_call_file(tmp_path):
  """A small ragged_dot call, and a bound-arguments file holding it (calls.json)."""
  ba = stellarax.XlaRaggedDot.bind(jnp.ones((32, 16)), jnp.ones((2, 16, 8)),
                                   jnp.array([10, 22], jnp.int32))
  calls = tmp_path / "calls.json"
  autotuning.bound_args_to_json([ba], calls)
  return ba, calls


@pytest.mark.slow  # ~8 s (it tunes); the other commands run fast below
def test_autotune_report_and_cache_commands(tmp_path, user_cache_dir, capsys):
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([10, 22], jnp.int32))
  calls = tmp_path / "calls.json"
  autotuning.bound_args_to_json([ba], calls)
  out = tmp_path / "result.json"
  assert cli.main(["autotune", str(calls), "--output", str(out), "--cache", "--budget-s", "5",
                   "--no-progress", "--isolate"]) == 0
  assert len(stellarax.AutotuningResult.load(out)) == 1
  assert cli.main(["report", str(out)]) == 0
  assert "ragged_dot.xla" in capsys.readouterr().out
  assert cli.main(["report", str(calls)]) == 2  # the file tuned, not its result
  assert ("It holds op calls (bound arguments, as bound_args_to_json and xplane_to_bound_args "
          "write them): tune them with `stellarax autotune FILE" in capsys.readouterr().err)
  assert cli.main(["cache", "list"]) == 0
  assert "ragged_dot.xla.json: 1 entries" in capsys.readouterr().out
  assert cli.main(["cache", "path"]) == 0
  assert str(user_cache_dir) in capsys.readouterr().out
  assert cli.main(["autotune", str(calls), "--total-budget-s", "3", "--no-progress",
                   "--cache"]) == 0
  # With --cache alone, nothing said where the result went.
  assert f"1 calls' entries are in the user cache at {user_cache_dir}" in capsys.readouterr().out
  assert cli.main(["autotune", str(calls), "--budget-s", "1", "--total-budget-s", "3"]) == 2
  assert "exclude each other" in capsys.readouterr().err
  library = tmp_path / "library"
  assert cli.main(["cache", "ship", str(out), "--root", str(library)]) == 0
  (shipped,) = library.glob("*/ragged_dot.xla.json")
  assert stellarax.AutotuningResult.load(shipped) == stellarax.AutotuningResult.load(out)
  # A folder to install with a package: its JSON files only, no lock files.
  assert [p for p in library.rglob("*") if p.is_file()] == [shipped]



def test_autotune_command_keeps_the_tuned_calls_when_one_fails(tmp_path, user_cache_dir, capsys,
                                                                monkeypatch):
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  good = stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([10, 22], jnp.int32))
  bad = stellarax.XlaRaggedDot.bind(lhs[:16], rhs, jnp.array([10, 6], jnp.int32))
  calls = tmp_path / "calls.json"
  autotuning.bound_args_to_json([bad, good], calls)
  real = stellarax.Autotuner.tune_one

  def tune_one(self, ba, **kwargs):
    if ba.key_json() == bad.key_json():
      raise ValueError("None of the 6 candidates succeeded (boom)")
    return real(self, ba, **kwargs)

  monkeypatch.setattr(stellarax.Autotuner, "tune_one", tune_one)
  out = tmp_path / "result.json"
  assert cli.main(["autotune", str(calls), "--output", str(out), "--cache", "--budget-s", "2",
                   "--no-progress"]) == 1
  (entry,) = stellarax.AutotuningResult.load(out)
  assert entry.bound_args.key_json() == good.key_json()
  captured = capsys.readouterr()
  assert "tuned 1 of 2 calls" in captured.err and "boom" in captured.err
  assert "result saved to" in captured.out
  # Where the tuned call went, in the command line's words (it said exc.partial_result).
  assert "exc." not in captured.err and "Autotuner(" not in captured.err
  assert (f"The 1 tuned calls are saved to {out} and in the user cache; a rerun with --cache "
          "tunes only what is missing.") in captured.err
  assert autotuning.explain(good).source == "user_cache"


def test_autotune_refuses_to_tune_when_the_result_would_have_nowhere_to_go(
    tmp_path, user_cache_dir, capsys, monkeypatch):
  ba, calls = _one_call_file(tmp_path)

  def autotune(*args, **kwargs):
    raise AssertionError("tuned, with nowhere to keep the result")

  monkeypatch.setattr(stellarax.Autotuner, "autotune", autotune)
  assert cli.main(["autotune", str(calls), "--budget-s", "5"]) == 2
  err = capsys.readouterr().err
  assert "nowhere to keep the result" in err and "--output FILE" in err and "--cache" in err, err
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  for cache_dir, problem in [(a_file, "is a file, not a folder"),
                             (a_file / "sub", f"cannot be a folder: {a_file} is a file")]:
    monkeypatch.setenv("STELLARAX_CACHE_DIR", str(cache_dir))
    assert cli.main(["autotune", str(calls), "--cache"]) == 2
    err = capsys.readouterr().err
    assert f"--cache: STELLARAX_CACHE_DIR={cache_dir} {problem}" in err, err
    assert "point STELLARAX_CACHE_DIR to a folder" in err and "--output FILE" in err, err
  assert a_file.read_text() == ""


def test_autotune_of_calls_that_run_no_kernel_saves_the_empty_result(tmp_path):
  # The --output file was not written, with exit 0: a script reading it next failed.
  ba = stellarax.XlaRaggedDot.bind(jax.ShapeDtypeStruct((0, 16), jnp.float32),
                                   jnp.ones((2, 16, 8)), jnp.array([0, 0], jnp.int32))
  calls, out = tmp_path / "calls.json", tmp_path / "result.json"
  autotuning.bound_args_to_json([ba], calls)
  with pytest.warns(autotuning.NothingToTuneWarning, match="run no kernel"):
    assert cli.main(["autotune", str(calls), "--output", str(out), "--no-progress"]) == 0
  assert len(stellarax.AutotuningResult.load(out)) == 0


def test_autotune_says_when_the_user_cache_could_not_be_written(tmp_path, user_cache_dir,
                                                                capsys):
  ba, calls = _one_call_file(tmp_path)
  # The cache folder is one, but a file stands where its device kind's folder goes:
  # found only when the tuner writes.
  user_cache_dir.mkdir()
  in_the_way = user_cache_dir / autotuning.cache.device_kind_slug(
      autotuning.cache.current_device_kind())
  in_the_way.write_text("")
  out = tmp_path / "result.json"
  with pytest.warns(autotuning.CacheWarning, match=f"{in_the_way} is a file.*move or remove it"):
    code = cli.main(["autotune", str(calls), "--cache", "--output", str(out), "--budget-s", "5",
                     "--no-progress"])
  assert code == 1
  assert len(stellarax.AutotuningResult.load(out)) == 1  # the measurements are kept
  captured = capsys.readouterr()
  assert "result saved to" in captured.out
  assert f"not written into the user cache at {user_cache_dir}" in captured.err, captured.err
  assert f"It is saved in {out}" in captured.err and "result.dump" not in captured.err
  assert cli.main(["autotune", str(calls), "--cache", "--budget-s", "5", "--no-progress"]) == 1
  err = capsys.readouterr().err
  assert "It is not saved anywhere: run again with --output FILE" in err, err
  assert "STELLARAX_CACHE_DIR set to a writable folder" in err and "result.dump" not in err


def test_autotune_exits_1_when_a_newer_stellarax_s_file_kept_its_entries_out(
    tmp_path, user_cache_dir, capsys):
  ba, calls = _one_call_file(tmp_path)
  newer = autotuning.cache.USER_CACHE.path_for(autotuning.cache.current_device_kind(),
                                               ba.op.name)
  newer.parent.mkdir(parents=True)
  newer.write_text('{"schema": 2, "device_kind": "cpu", "entries": []}')
  with pytest.warns(autotuning.CacheWarning, match="newer than this stellarax"):
    code = cli.main(["autotune", str(calls), "--cache", "--budget-s", "1", "--no-progress"])
  assert code == 1  # was 0, with nothing kept anywhere
  err = capsys.readouterr().err
  assert "not all of the result was written into the user cache" in err, err
  assert "ragged_dot.xla were written by a newer stellarax" in err, err
  assert "run again with --output FILE" in err and "result.dump" not in err, err


def test_cache_commands_say_when_the_cache_folder_is_a_file(tmp_path, monkeypatch, capsys):
  a_file = tmp_path / "a_file"
  a_file.write_text("not a cache")
  monkeypatch.setenv("STELLARAX_CACHE_DIR", str(a_file))
  for action in ("list", "prune", "clear"):
    assert cli.main(["cache", action]) == 2
    captured = capsys.readouterr()
    assert f"stellarax cache {action}: error:" in captured.err and not captured.out
    assert f"STELLARAX_CACHE_DIR={a_file} is a file, not a folder" in captured.err
    assert "point STELLARAX_CACHE_DIR to a folder" in captured.err and "unset it" in captured.err
  assert a_file.read_text() == "not a cache"
  # Reading through it warns with the same fix, not `cache clear` (which cannot help).
  with pytest.warns(autotuning.CacheWarning, match="Not a directory") as caught:
    assert autotuning.USER_CACHE.result_for("cpu", "ragged_dot.xla") is None
  (message,) = [str(w.message) for w in caught]
  assert f"STELLARAX_CACHE_DIR={a_file} is a file" in message and "cache clear" not in message


def test_cache_list_counts_stale_entries_and_prune_removes_them(tmp_path, user_cache_dir, capsys):
  rhs = jax.random.normal(jax.random.key(0), (2, 16, 8))
  calls = [stellarax.XlaRaggedDot.bind(jnp.ones((m, 16)), rhs, jnp.array([m // 2, m // 2], jnp.int32))
           for m in (32, 64)]
  result = stellarax.Autotuner(budget_s=2, progress=False).autotune(calls)
  current, old = list(result)
  old = dataclasses.replace(old, versions={**old.versions, "jax": "0.0.1"})
  autotuning.USER_CACHE.write(autotuning.AutotuningResult(result.device_kind, {current.key: current, old.key: old}))
  (cached,) = user_cache_dir.glob("*/ragged_dot.xla.json")
  # A file of stale entries only goes away; an unreadable one stays and is reported.
  only_stale = cached.with_name("ragged_dot.only_stale.json")
  autotuning.AutotuningResult(result.device_kind, {old.key: old}).dump(only_stale)
  corrupt = cached.with_name("ragged_dot.corrupt.json")
  corrupt.write_text("{not json")
  assert cli.main(["cache", "list"]) == 0
  out = capsys.readouterr().out
  assert "ragged_dot.xla.json: 2 entries, 1 stale (`stellarax cache prune` removes them)" in out
  assert "ragged_dot.corrupt.json: unreadable" in out
  assert cli.main(["cache", "prune"]) == 0
  out = capsys.readouterr().out
  assert "ragged_dot.xla.json: removed 1 stale entries, kept 1" in out
  assert "ragged_dot.only_stale.json: removed 1 stale entries, kept 0 (file deleted)" in out
  assert "ragged_dot.corrupt.json: not pruned, left as it is: " in out
  assert [e.key for e in stellarax.AutotuningResult.load(cached)] == [current.key]
  assert not only_stale.exists() and corrupt.exists()
  corrupt.unlink()
  assert cli.main(["cache", "prune"]) == 0
  assert "no stale entries" in capsys.readouterr().out
  with pytest.raises(PermissionError, match="read-only"):
    autotuning.LIBRARY_CACHE.prune()



def test_bad_input_files_are_error_messages_not_tracebacks(tmp_path, capsys):
  missing = tmp_path / "missing.json"
  assert cli.main(["autotune", str(missing)]) == 2
  assert f"stellarax autotune: error: {missing}" in capsys.readouterr().err
  garbage = tmp_path / "garbage.json"
  garbage.write_text("{not json")
  assert cli.main(["autotune", str(garbage)]) == 2
  assert "stellarax autotune: error:" in capsys.readouterr().err
  empty = tmp_path / "empty.json"
  autotuning.bound_args_to_json([], empty)
  assert cli.main(["autotune", str(empty)]) == 1
  assert "holds no op calls; nothing to tune" in capsys.readouterr().err
  not_a_result = tmp_path / "not_a_result.json"
  not_a_result.write_text("{}")
  assert cli.main(["report", str(not_a_result)]) == 2
  assert "stellarax report: error:" in capsys.readouterr().err
  assert cli.main(["report", str(missing)]) == 2
  assert cli.main(["cache", "ship", str(missing), "--root", str(tmp_path / "library")]) == 2
  assert "stellarax cache ship: error:" in capsys.readouterr().err


def test_demo_command_takes_the_demos_options(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["demo", "--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert "--total-budget-s" in out and "--budget-s" in out and "--no-progress" in out


def test_the_demo_refuses_two_budgets_and_an_output_that_is_a_file_before_tuning(tmp_path,
                                                                                 capsys,
                                                                                 monkeypatch):
  # --budget-s was dropped without a word beside --total-budget-s; an --output naming a
  # file failed with a traceback after the tuning (71 s).
  monkeypatch.setattr(stellarax, "Autotuner", lambda **kw: pytest.fail(f"tuned with {kw}"))
  with pytest.raises(SystemExit) as exit_:
    cli.main(["demo", "--budget-s", "5", "--total-budget-s", "60"])
  assert exit_.value.code == 2
  assert "not allowed with argument" in capsys.readouterr().err
  a_file = tmp_path / "out"
  a_file.write_text("")
  assert cli.main(["demo", "--output", str(a_file)]) == 2
  assert f"--output {a_file} is a file; name a folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--budget-s", "0"], ["demo", "--total-budget-s", "-1"],
                                  ["autotune", "calls.json", "--budget-s", "nan"],
                                  ["autotune", "calls.json", "--total-budget-s", "ten"]])
def test_a_budget_that_is_no_positive_number_is_refused_before_any_work(argv, capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(argv)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert f"argument {argv[-2]}: {argv[-1]!r} is not a number of seconds > 0" in err, err


_PLUGIN = '''
import contextlib
import dataclasses
import stellarax

@stellarax.config_dataclass
class TwiceConfig:
  unroll: int = 1

@dataclasses.dataclass(frozen=True, kw_only=True)
class Twice(stellarax.Op, name="cli_plugin.twice"):
  config_cls = TwiceConfig

  def _fwd(self, x, *, config):
    return x * 2, None

  def _get_heuristics_config(self, ba):
    return TwiceConfig()

  def _get_autotuning_configs(self, ba):
    return {TwiceConfig(unroll=u) for u in (1, 2)}

  def _reference(self, x):
    return x * 2
'''


def _cli(tmp_path, *args):
  """Runs the command line in a new process (whose registry knows only stellarax's ops,
  and the plug-in's once it is imported), with the plug-in's folder on the path."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
             STELLARAX_CACHE_DIR=str(tmp_path / "cache"))
  return subprocess.run([sys.executable, "-m", "stellarax.tools.cli", *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~14 s of command processes
def test_import_makes_a_package_s_own_ops_known_to_every_command(tmp_path):
  (tmp_path / "cli_plugin_ops.py").write_text(_PLUGIN)
  calls = tmp_path / "calls.json"
  script = ("import jax, stellarax, cli_plugin_ops as m; stellarax.autotuning.bound_args_to_json("
            f"[m.Twice.bind(jax.ShapeDtypeStruct((8, 4), 'float32'))], {str(calls)!r})")
  import subprocess
  import sys
  subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=300)
  without = _cli(tmp_path, "autotune", str(calls), "--no-progress")
  assert without.returncode == 2
  assert "'cli_plugin.twice'" in without.stderr and "--import MODULE" in without.stderr
  out = tmp_path / "result.json"
  tuned = _cli(tmp_path, "autotune", str(calls), "--import", "cli_plugin_ops", "--no-progress",
               "--budget-s", "1", "--output", str(out), "--cache")
  assert tuned.returncode == 0, tuned.stderr
  assert "cli_plugin.twice" in tuned.stdout
  report = _cli(tmp_path, "report", str(out), "--import", "cli_plugin_ops")
  assert report.returncode == 0 and "cli_plugin.twice" in report.stdout
  listed = _cli(tmp_path, "cache", "list", "--import", "cli_plugin_ops")
  assert listed.returncode == 0 and "cli_plugin.twice.json: 1 entries" in listed.stdout
  for action in ("list", "prune"):  # without the module: not called unreadable
    unknown = _cli(tmp_path, "cache", action)
    assert unknown.returncode == 0 and "unreadable" not in unknown.stdout, unknown.stdout
    assert "an op no imported module defines (`--import MODULE`" in unknown.stdout
  missing = _cli(tmp_path, "report", str(out), "--import", "no_such_plugin")
  assert missing.returncode == 2
  assert "--import no_such_plugin: cannot import it" in missing.stderr


def test_cache_clear_removes_the_cache_s_files_only(tmp_path, user_cache_dir, capsys):
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([10, 22], jnp.int32))
  tuned = stellarax.Autotuner(budget_s=0.5, progress=False, cache=True).autotune([ba])
  # Results of the user's kept in a folder of the cache root (which the cache passes
  # over, as `list` says), one of them stale: `prune` deleted the stale one, `clear` both.
  results = user_cache_dir / "results"
  results.mkdir()
  tuned.dump(results / "my_tuned.json")
  stale_text = re.sub(r'"code": "\w+"', '"code": "0000000000000000"', tuned.dumps())
  (results / "old_run.json").write_text(stale_text)
  assert cli.main(["cache", "prune"]) == 0
  assert "old_run" not in capsys.readouterr().out
  assert (results / "old_run.json").read_text() == stale_text
  notes = user_cache_dir / "notes.txt"
  notes.write_text("the user's own")
  # A file the cache set aside as unreadable is the cache's too.
  (next(p for p in user_cache_dir.iterdir() if p.is_dir()) / "x.json.unreadable").write_text("{")
  # JSON files of the user's one folder down (a cache root set to a project's folder)
  # were listed as an unknown op's entries, and removed by clear with their folders.
  own = {user_cache_dir / "config" / "train.json": '{"lr": 0.001, "steps": 1000}',
         user_cache_dir / "config" / "ragged_dot_sizes.json": '{"sizes": [1, 2]}',
         next(p for p in user_cache_dir.iterdir() if p.is_dir()) / "package.json": '{"v": 1}'}
  # Files of the user's whose names end as the cache's journals do, and an empty folder
  # of theirs, were removed too.
  own |= {user_cache_dir / "ledger" / "2024.journal": "paid",
          next(p for p in user_cache_dir.iterdir() if p.is_dir()) / "trip.journal": "day 1"}
  (user_cache_dir / "empty").mkdir()
  kind_folder = next(p for p in user_cache_dir.iterdir() if p.is_dir() and p.name != "empty")
  journal = kind_folder / "ragged_dot.xla.0123456789abcdef.89abcdef.journal"  # a tuning's
  journal.write_text("{}\n")
  for path, text in own.items():
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
  assert cli.main(["cache", "list"]) == 0
  listed = capsys.readouterr().out
  assert "results/old_run.json: 1 entries; it holds results of 'cpu' in the folder" in listed
  assert "prune" not in listed  # it would not touch them
  listed = re.sub(r"results/(my_tuned|old_run).json: .*\n", "", listed)
  assert "json" not in listed.replace("ragged_dot.xla.json", "")
  with warnings.catch_warnings():  # package.json was read as a broken cache file
    warnings.simplefilter("error")
    assert len(cache.FileCache(None, "user_cache", writable=True).results()) == 1
  assert cli.main(["cache", "clear"]) == 0
  assert "files removed" in capsys.readouterr().out
  assert sorted(p.name for p in user_cache_dir.rglob("*") if p.is_file()) == sorted(
      ["notes.txt", "my_tuned.json", "old_run.json"] + [p.name for p in own])
  assert all(path.read_text() == text for path, text in own.items())
  assert (user_cache_dir / "empty").is_dir() and not journal.exists()
  assert autotuning.explain(ba).source != "user_cache"


def test_cache_commands_pass_over_a_killed_writer_s_temporary_file(user_cache_dir, capsys):
  # A writer killed before renaming its temporary file over the cache file leaves it:
  # it is no cache file, and `cache clear` removes it once too old to be a live write's.
  folder = user_cache_dir / "cpu"
  folder.mkdir(parents=True)
  old, young = folder / ".tmp-ii8p5y7m.json", folder / ".tmp-k2j4h6x0.json"
  for path in (old, young):
    path.write_text('{"device_kind": "cpu"')  # cut short
  then = time.time() - cache.LEFTOVER_AGE_S - 1
  os.utime(old, (then, then))
  assert cli.main(["cache", "list"]) == 0
  out = capsys.readouterr().out
  assert out.splitlines() == [
      f"user cache at {user_cache_dir} is empty",
      "cpu/.tmp-ii8p5y7m.json: left by a cache write that did not finish, not a cache file "
      "(`stellarax cache clear` removes it)"]
  assert cli.main(["cache", "prune"]) == 0
  assert "no stale entries" in capsys.readouterr().out
  assert cli.main(["cache", "clear"]) == 0
  out = capsys.readouterr().out
  assert f"cleared the user cache at {user_cache_dir}: 1 files removed" in out
  assert "kept 1 temporary files of cache writes that may still be under way" in out
  assert sorted(folder.iterdir()) == [young]


def test_python_dash_m_runs_the_command_line():
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-m", "stellarax", "cache", "path"], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip()  # the user cache's folder


def test_mistakes_are_found_before_any_work_and_nothing_else_is_touched(tmp_path,
                                                                       user_cache_dir, capsys):
  ba, calls = _one_call_file(tmp_path)
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  for output, problem in [(tmp_path / "no" / "such" / "r.json", "no folder"),
                          (a_file / "r.json", "is not a folder"),
                          (tmp_path, "is a folder")]:
    # Checked before tuning, whose measurements would have nowhere to go.
    assert cli.main(["autotune", str(calls), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert f"--output={output}: " in err and problem in err, err
    assert not (tmp_path / "no").exists()
  binary = tmp_path / "binary.json"
  binary.write_bytes(b"\xff\x00")
  for command in (["autotune", str(binary)], ["report", str(binary)]):
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert f"{binary}: not a text file" in err and "Delete" not in err  # the user's input
  # Op calls given where a result belongs: what they are, and what to do with them.
  calls_json = tmp_path / "profiled_calls.json"
  calls_json.write_text(json.dumps({"stellarax": "0.1.0", "calls": [
      {"bound_args": ba.to_json(), "count": 3, "device_time_s": 1e-3}]}))
  for command in (["report", str(calls_json)], ["cache", "add", str(calls_json)]):
    assert cli.main(command) == 2
    assert "It holds op calls (bound arguments" in capsys.readouterr().err
  # `cache clear` and `list` work on the user cache only; --root is `ship`'s.
  (user_cache_dir / "cpu").mkdir(parents=True)
  (user_cache_dir / "cpu" / "ragged_dot.xla.json").write_text("{}")
  other = tmp_path / "other"
  assert cli.main(["cache", "clear", "--root", str(other)]) == 2
  assert "takes no '--root" in capsys.readouterr().err
  assert cli.main(["cache", "list", "extra"]) == 2
  assert (user_cache_dir / "cpu" / "ragged_dot.xla.json").exists()
  assert cli.main(["cache", "ship"]) == 2
  assert "needs a result file" in capsys.readouterr().err


def test_an_output_that_would_replace_the_input_or_is_no_file_is_refused(tmp_path,
                                                                           user_cache_dir, capsys):
  ba, calls = _one_call_file(tmp_path)
  before = calls.read_text()
  # The result replaced the calls (exit 0), and the same command run again failed; a
  # device such as /dev/null was replaced by a regular file (as root). A pipe stands in.
  pipe = tmp_path / "pipe"
  os.mkfifo(pipe)
  for output, problem in [(calls, f"is the input file {calls}"),
                          (pipe, "is not a regular file")]:
    assert cli.main(["autotune", str(calls), "--output", str(output)]) == 2
    assert problem in capsys.readouterr().err
  assert calls.read_text() == before and pipe.is_fifo()


def test_a_result_that_cannot_be_saved_after_tuning_goes_to_a_file_of_its_own(
    tmp_path, user_cache_dir, capsys, monkeypatch):
  # What was checked before tuning can change during it (here a file is where the
  # folder was): the error ended the command (exit 2, "bad input") and the measurements
  # were lost.
  ba, calls = _one_call_file(tmp_path)
  (tmp_path / "gone").write_text("")
  output = tmp_path / "gone" / "r.json"
  monkeypatch.setattr(cli, "output_problem", lambda *a, **k: None)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  assert cli.main(["autotune", str(calls), "--output", str(output), "--budget-s", "0.3",
                   "--no-progress"]) == 1
  err = capsys.readouterr().err
  (fallback,) = tmp_path.glob("stellarax-result-*.json")
  assert f"--output={output} could not be written" in err and str(fallback) in err
  assert len(stellarax.AutotuningResult.load(fallback)) == 1
  # The other messages name where it went (they named the --output that failed).
  fallback.unlink()
  user_cache_dir.mkdir()
  (user_cache_dir / cache.device_kind_slug(cache.current_device_kind())).write_text("")
  with pytest.warns(autotuning.CacheWarning):
    assert cli.main(["autotune", str(calls), "--output", str(output), "--cache",
                     "--budget-s", "0.3", "--no-progress"]) == 1
  (fallback,) = tmp_path.glob("stellarax-result-*.json")
  err = capsys.readouterr().err
  assert f"It is saved in {fallback}" in err and f"saved in {output}" not in err, err
  # An existing file is replaced, and the command says so.
  output = tmp_path / "r.json"
  output.write_text("{}")
  assert cli.main(["autotune", str(calls), "--output", str(output), "--budget-s", "0.3"]) == 0
  assert f"result saved to {output} (it replaced the file there)" in capsys.readouterr().out


def test_messages_speak_of_options_warnings_are_the_command_s_and_report_flags_stale(
    tmp_path, user_cache_dir, capsys):
  ba, calls = _one_call_file(tmp_path)
  out = tmp_path / "r.json"
  # They spoke of Python: budget_s=..., strategy=functools.partial(...).
  for extra, says in [(["--budget-s", "1", "--total-budget-s", "2"],
                       "--budget-s 1.0 (per call) and --total-budget-s 2.0"),
                      (["--strategy", "random"], "pass --budget-s (per call) or --total-budget")]:
    assert cli.main(["autotune", str(calls), "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and "budget_s=" not in err and "functools" not in err, err
  # A warning read "<frozen runpy>:88: SmallBudgetWarning: ..." (from python -m).
  with warnings.catch_warnings():  # shown as Python shows them outside pytest's record
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, filename, lineno, *_: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno))
    assert cli.main(["autotune", str(calls), "--output", str(out), "--budget-s", "0.001",
                     "--no-progress"]) == 0
  assert "stellarax autotune: warning (SmallBudgetWarning): " in capsys.readouterr().err
  # A stale entry's table read as any other.
  tuned = stellarax.AutotuningResult.load(out)
  out.write_text(re.sub(r'"code": "\w+"', '"code": "0000000000000000"', tuned.dumps()))
  assert cli.main(["report", str(out)]) == 0
  assert ("1 of 1 entries are stale (e.g. ragged_dot.xla: measured on other code of "
          "ragged_dot.xla") in capsys.readouterr().out


def test_autotune_says_which_calls_the_cache_answers_and_can_measure_them_again(
    tmp_path, user_cache_dir, capsys):
  # A rerun printed the table of the cached entries as if it had measured them.
  ba, calls = _one_call_file(tmp_path)
  ok = autotuning.Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3,
                              num_samples=3)
  cached = autotuning.Entry(ba, ba.heuristics_config, ba.heuristics_config,
                            tuple((c, ok) for c in ba.autotuning_configs))  # a whole search
  autotuning.USER_CACHE.write(autotuning.AutotuningResult(cache.current_device_kind(),
                                                          {cached.key: cached}))
  entry_now = lambda: autotuning.USER_CACHE.result_for(
      cache.current_device_kind(), "ragged_dot.xla").entry(ba)
  run = lambda *extra: cli.main(["autotune", str(calls), "--cache", "--no-progress", *extra])
  assert run() == 0
  assert "1 calls have current entries in the user or library cache" in capsys.readouterr().out
  assert entry_now() == cached
  assert run("--ignore-cache", "--budget-s", "0.3") == 0
  assert "have current entries" not in capsys.readouterr().out
  assert entry_now() != cached  # measured again, and replaced


def test_cache_add_merges_a_result_file_into_the_user_cache(tmp_path, user_cache_dir, capsys):
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([10, 22], jnp.int32))
  result = stellarax.Autotuner(progress=False, budget_s=2).autotune(ba)
  out = tmp_path / "tuned_elsewhere.json"
  result.dump(out)
  assert autotuning.explain(ba).source == "heuristics"
  assert cli.main(["cache", "add", str(out)]) == 0
  assert "added 1 entries" in capsys.readouterr().out
  assert autotuning.explain(ba).source == "user_cache"
  (written,) = user_cache_dir.glob("*/ragged_dot.xla.json")
  assert stellarax.AutotuningResult.load(written) == result
  # A slower result of the same call: the cache keeps its own, and says so (it said
  # "added 1 entries").
  (entry,) = result
  slower = dataclasses.replace(entry, measurements=tuple(
      (c, dataclasses.replace(m, median_s=m.median_s * 3, ci_low_s=m.median_s * 3,
                              ci_high_s=m.median_s * 3) if m.ok else m)
      for c, m in entry.measurements))
  stellarax.AutotuningResult(result.device_kind, {slower.key: slower}).dump(out)
  assert cli.main(["cache", "add", str(out)]) == 0
  said = capsys.readouterr().out
  assert "added 0 entries" in said and "the cache kept its own entry for 1 calls" in said, said
  assert stellarax.AutotuningResult.load(written) == result
  # It needs a file, takes no --root (ship's), and a missing file is bad input.
  assert cli.main(["cache", "add"]) == 2
  assert "needs a result file: stellarax cache add" in capsys.readouterr().err
  assert cli.main(["cache", "add", str(out), "--root", str(tmp_path)]) == 2
  assert "only `cache ship` takes --root" in capsys.readouterr().err
  assert cli.main(["cache", "add", str(tmp_path / "missing.json")]) == 2
  assert "stellarax cache add: error:" in capsys.readouterr().err


def test_cache_commands_say_what_they_could_not_do_and_advise_no_clear(tmp_path, user_cache_dir,
                                                                       capsys):
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, jnp.array([10, 22], jnp.int32))
  result = stellarax.Autotuner(progress=False, budget_s=2).autotune(ba)
  out = tmp_path / "tuned_elsewhere.json"
  result.dump(out)
  # A newer stellarax's file: add said "added 1 entries" (exit 0) having written none, and
  # list and prune advised `cache clear`, which deletes that stellarax's data.
  newer = user_cache_dir / cache.device_kind_slug(result.device_kind) / "ragged_dot.xla.json"
  newer.parent.mkdir(parents=True)
  newer.write_text(result.dumps().replace('"schema": 1', '"schema": 2'))
  with pytest.warns(autotuning.CacheWarning, match="newer than this stellarax"):
    assert cli.main(["cache", "add", str(out)]) == 1
  captured = capsys.readouterr()
  assert "added 0 entries" in captured.out and "ragged_dot.xla were not added" in captured.err
  for action in ("list", "prune"):
    assert cli.main(["cache", action]) == 0
    said = capsys.readouterr().out
    assert "a newer stellarax wrote it" in said and "cache clear" not in said, said
  # One broken entry: the rest is read, so the advice is about that file, not the cache.
  data = result.to_json()
  data["entries"].append(dict(data["entries"][0], best_config={"strategy": "nope"}))
  newer.write_text(cache.file_format.dumps(data))
  assert cli.main(["cache", "list"]) == 0
  said = capsys.readouterr().out
  assert "2 entries, 1 invalid" in said and "fix or delete that file" in said, said
  # Moved to another device kind's folder: the cache passes it over, and list says so.
  moved = user_cache_dir / "other_kind" / newer.name
  moved.parent.mkdir()
  result.dump(moved)
  newer.unlink()
  assert cli.main(["cache", "list"]) == 0
  assert "so the cache passes it over: move it to the folder" in capsys.readouterr().out


def test_ctrl_c_saves_what_autotune_had_tuned(tmp_path, user_cache_dir, capsys, monkeypatch):
  from stellarax.autotuning import autotuner as autotuner_lib
  lhs, rhs = jnp.ones((32, 16)), jax.random.normal(jax.random.key(0), (2, 16, 8))
  calls = [stellarax.XlaRaggedDot.bind(lhs[:n], rhs, jnp.array([n // 2, n - n // 2], jnp.int32))
           for n in (32, 24)]
  path = tmp_path / "calls.json"
  autotuning.bound_args_to_json(calls, path)
  real, tuned = autotuner_lib.Autotuner.tune_one, []

  def interrupted_on_the_second(self, ba, **kwargs):
    if tuned:
      raise KeyboardInterrupt
    tuned.append(ba)
    return real(self, ba, **kwargs)

  monkeypatch.setattr(autotuner_lib.Autotuner, "tune_one", interrupted_on_the_second)
  out = tmp_path / "result.json"
  assert cli.main(["autotune", str(path), "--output", str(out), "--no-progress",
                   "--budget-s", "2"]) == 130
  err = capsys.readouterr().err
  assert "interrupted after tuning 1 calls" in err and f"stellarax cache add {out}" in err
  (entry,) = stellarax.AutotuningResult.load(out)
  assert entry.bound_args == tuned[0]
  # In Python the interrupt carries the same: nothing tuned is lost.
  tuned.clear()
  with pytest.raises(KeyboardInterrupt) as info:
    stellarax.Autotuner(progress=False, budget_s=2).autotune(calls)
  assert [e.bound_args for e in info.value.partial_result] == tuned


def test_the_command_exits_at_once_after_an_interrupt(monkeypatch):
  # Interrupted, the interpreter's shutdown met compile threads inside XLA and aborted
  # (SIGABRT, SIGSEGV) where 130 was due: the command leaves with os._exit.
  exits = []
  monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code))
  for code in (130, 0, 1):
    monkeypatch.setattr(cli, "main", lambda argv=None, code=code: code)
    exits.clear()
    with pytest.raises(SystemExit):  # reached here only as os._exit is mocked
      cli.command([])
    assert exits == ([130] if code == 130 else [])
