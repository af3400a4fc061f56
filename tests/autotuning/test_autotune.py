"""autotune(), AutotuningResult, the file format, caches and explain()."""

import dataclasses
import functools
import json
import multiprocessing
import os
import re
import threading
import time
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning import autotuner as autotuner_lib
from stellarax.autotuning import cache as cache_lib
from stellarax.autotuning import file_format
from stellarax.autotuning import measure as measure_lib
from stellarax.autotuning import search as search_lib
from stellarax.autotuning.measure import MeasureOptions
from stellarax.core import resolution

FAST = MeasureOptions(rounds=2, leader_rounds=1, warmup_s=0.0, max_total_s=0.5, min_batch_s=2e-4)


def tuner(**kw):
  return stellarax.Autotuner(progress=False, measure_options=FAST, **kw)


def _inputs():
  k = jax.random.split(jax.random.key(3), 3)
  lhs = jax.random.normal(k[0], (64, 32), jnp.float32)
  rhs = jax.random.normal(k[1], (4, 32, 16), jnp.float32)
  return lhs, rhs, jnp.array([20, 0, 30, 14], jnp.int32)


def model(lhs, rhs, gs):
  return (stellarax.ragged_dot(lhs, rhs, gs) ** 2).sum()


@pytest.fixture(scope="module")
def grad_result():
  lhs, rhs, gs = _inputs()
  return tuner().autotune(jax.grad(model, argnums=(0, 1)), lhs, rhs, gs)


def test_autotune_grad_tunes_forward_and_vjp_ops(grad_result):
  names = {e.bound_args.op.name for e in grad_result}
  assert names == {"ragged_dot.xla", "ragged_dot.xla_vjp"}
  for entry in grad_result:
    assert entry.best_time is not None and entry.best_time > 0
    assert entry.best_config in entry.bound_args.autotuning_configs
    assert any(c == entry.heuristic_config for c, _ in entry.measurements)
  assert len(grad_result) == 2 and "ragged_dot.xla_vjp" in grad_result.summary()


def test_result_as_context_gives_the_same_numbers(grad_result):
  lhs, rhs, gs = _inputs()
  g = jax.grad(model, argnums=(0, 1))
  plain = g(lhs, rhs, gs)
  with grad_result:
    tuned = jax.jit(g)(lhs, rhs, gs)
    (ba,) = [b for b in autotuning.get_bound_args(model, lhs, rhs, gs)]
    assert autotuning.explain(ba).source == "result"
  for a, b in zip(plain, tuned):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


def test_dumps_loads_round_trip_and_file(grad_result, tmp_path):
  text = grad_result.dumps()
  data = json.loads(text)
  assert data["schema"] == file_format.SCHEMA_VERSION and data["device_kind"] == grad_result.device_kind
  assert set(data["versions"]) == {"stellarax", "jax", "jaxlib", "timing"}
  assert "stellarax.ops" not in text
  assert stellarax.AutotuningResult.loads(text) == grad_result
  path = tmp_path / "r.json"
  grad_result.dump(path)
  assert stellarax.AutotuningResult.load(path) == grad_result
  with open(path) as f:
    assert stellarax.AutotuningResult.load(f) == grad_result


def test_corrupt_files_name_themselves(tmp_path, grad_result):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(file_format.FormatError, match="bad.json.*not valid JSON"):
    stellarax.AutotuningResult.load(bad)
  data = json.loads(grad_result.dumps())
  data["entries"][0]["best_config"]["tile_m"] = 12
  bad.write_text(json.dumps(data))
  with pytest.raises(file_format.FormatError, match="bad.json: entry 0 is invalid.*tile_m=12"):
    stellarax.AutotuningResult.load(bad)
  data["schema"] = 99
  bad.write_text(json.dumps(data))
  with pytest.raises(file_format.FormatError, match="schema 99"):
    stellarax.AutotuningResult.load(bad)


def _named_mosaic_gpu(data):
  """An edit naming the Mosaic GPU op in entry 0, a kernel that refuses its call, with no
  code fingerprint: the XLA op's, recorded there, would make the entry read as measured
  on other code of the Mosaic GPU op, and be dropped rather than refused."""
  data["entries"][0]["bound_args"]["op"]["name"] = "ragged_dot.pallas_mosaic_gpu"
  data["entries"][0]["code"] = ""


@pytest.mark.parametrize("edit, complaint", [
    (lambda d: d["entries"][0]["bound_args"]["op"].update(fields=[]),
     "entry 0 is invalid: AttributeError"),
    (_named_mosaic_gpu, "entry 0 is invalid: NotImplementedError: .*Mosaic GPU"),
    (lambda d: d.update(schema=True), "schema True is not a schema version"),
    (lambda d: d.update(schema=0), "schema 0 is not a schema version"),
    (lambda d: d.update(device_kind=None), "'device_kind' must name a device kind"),
    (None, "not valid JSON.*RecursionError")])  # nested deeper than json reads
def test_whatever_is_wrong_in_a_file_is_a_format_error_naming_it(tmp_path, grad_result, edit,
                                                                complaint):
  bad = tmp_path / "bad.json"
  if edit is None:
    bad.write_text("[" * 100_000 + "]" * 100_000)
  else:
    data = json.loads(grad_result.dumps())
    edit(data)
    bad.write_text(json.dumps(data))
  with pytest.raises(file_format.FormatError, match="bad.json.*" + complaint):
    stellarax.AutotuningResult.load(bad)


def _edited(grad_result, edit):
  """grad_result's file data after `edit(data)`."""
  data = json.loads(grad_result.dumps())
  edit(data)
  return json.dumps(data)


def _slower(raw_entry, factor=10.0):
  """A copy of an entry's JSON with every ok measurement `factor` times slower."""
  raw_entry = json.loads(json.dumps(raw_entry))
  for m in raw_entry["measurements"]:
    if m["status"] == "ok":
      for name in ("median_s", "ci_low_s", "ci_high_s"):
        m[name] *= factor
  return raw_entry


@pytest.mark.parametrize("slower_first", [True, False])
def test_a_call_in_two_entries_is_read_as_a_merge_with_a_warning(grad_result, slower_first):
  data = json.loads(grad_result.dumps())
  fast = data["entries"][0]
  pair = [_slower(fast), fast] if slower_first else [fast, _slower(fast)]
  data["entries"] = pair + data["entries"][1:]
  kept, op = (1 if slower_first else 0), fast["bound_args"]["op"]["name"]
  with pytest.warns(file_format.FormatWarning,
                    match=rf"bad.json: entries 0 and 1 both tune {op} for .*lhs=float32\[64,32\]"
                          rf".*using entry {kept} and ignoring entry {1 - kept}, as merging "
                          "results does, because its best config is faster"):
    loaded = stellarax.AutotuningResult.loads(json.dumps(data), source="bad.json")
  # Whatever the order, the faster one, as `a | b` keeps it.
  assert loaded == grad_result


def test_a_call_in_two_equal_entries_is_read_silently(grad_result):
  text = _edited(grad_result, lambda d: d["entries"].append(d["entries"][0]))
  assert stellarax.AutotuningResult.loads(text) == grad_result  # warnings are errors here


def _measurement(field, value):
  def edit(data):
    data["entries"][0]["measurements"][0][field] = value
  return edit


@pytest.mark.parametrize("edit, complaint", [
    (lambda d: d["entries"][0].update(versions="0.1"),
     r"entry 0 \(ragged_dot.xla\w*\): field 'versions' is a string \('0.1'\); expected an "
     "object such as"),
    (lambda d: d["entries"][0]["versions"].update(jax=11),
     "field 'versions' is an object .*; expected an object such as"),
    (lambda d: d["entries"][0].update(measurements={}),
     "field 'measurements' is an object .*; expected a list of measurement objects"),
    (lambda d: d["entries"][0].update(measured_at=5), "field 'measured_at' is a number"),
    (lambda d: d["entries"][0].update(method=["x"]), "field 'method' is a list"),
    (lambda d: d["entries"][0].update(code=7), "field 'code' is a number .* or null"),
    (lambda d: d["entries"][0].update(best_config=[]), "field 'best_config' is a list"),
    (lambda d: d["entries"][0]["measurements"].append(3), r"field 'measurements\[\d+\]' is a number"),
    (lambda d: d["entries"].append("entry"), "entry 2 is a string; expected an object"),
    (_measurement("median_s", "0.001"), "measurement 0: Measurement.median_s='0.001' is a str; "
                                        "the field takes float or None"),
    (_measurement("num_samples", True), "Measurement.num_samples=True is a bool; the field takes int"),
    (lambda d: d.update(versions={"jax": 0.11}), "'versions' must be an object naming"),
])
def test_a_field_of_the_wrong_json_type_is_a_format_error(grad_result, edit, complaint):
  with pytest.raises(file_format.FormatError, match="bad.json: (entry 0 .*)?" + complaint):
    stellarax.AutotuningResult.loads(_edited(grad_result, edit), source="bad.json")


def test_a_field_of_the_wrong_json_type_is_an_error_in_a_stale_entry_too(grad_result):
  # An entry that no longer validates under other versions is dropped, but schema 1
  # never wrote another type: that is a broken file.
  data = _recorded_with(json.loads(grad_result.dumps()), jax="0.0.1")
  data["entries"][0]["method"] = 5
  with pytest.raises(file_format.FormatError, match="entry 0 .*field 'method' is a number"):
    stellarax.AutotuningResult.loads(json.dumps(data), warn_other_versions=False)


def _without_field(code=None):
  """An edit deleting tile_m from the best config of the ragged_dot.xla entry (and
  setting its code fingerprint to `code`, unless None)."""
  def edit(data):
    (entry,) = [e for e in data["entries"] if e["bound_args"]["op"]["name"] == "ragged_dot.xla"]
    del entry["best_config"]["tile_m"]
    if code is not None:
      entry["code"] = code
  return edit


def test_a_config_field_deleted_from_a_current_entry_takes_its_default_with_a_warning(grad_result):
  with pytest.warns(file_format.FormatWarning,
                    match=r"bad.json: entry \d \(ragged_dot.xla\) was measured on the running code "
                          r"of its op, yet lacks config field\(s\) \['best_config.tile_m'\]; using "
                          r"their defaults \(tile_m=128\)"):
    loaded = stellarax.AutotuningResult.loads(_edited(grad_result, _without_field()),
                                              source="bad.json")
  (entry,) = [e for e in loaded if e.bound_args.op.name == "ragged_dot.xla"]
  assert entry.best_config.tile_m == 128


@pytest.mark.parametrize("code", ["0123456789abcdef", ""])  # older code, or unknown
def test_a_config_field_an_older_file_lacks_takes_its_default_silently(grad_result, code):
  # A field added to a config class later must not make older files fail or warn
  # (e.g. prefetch of the Triton normalization backward); such entries are stale.
  loaded = stellarax.AutotuningResult.loads(_edited(grad_result, _without_field(code)))
  (entry,) = [e for e in loaded if e.bound_args.op.name == "ragged_dot.xla"]
  assert entry.best_config.tile_m == 128


def _renamed_field(code=None):
  """An edit renaming tile_m to tile_rows in the ragged_dot.xla entry's configs, as data
  an op would hold whose config field was renamed since (and setting the entry's code
  fingerprint to `code`, unless None)."""
  def edit(data):
    (entry,) = [e for e in data["entries"] if e["bound_args"]["op"]["name"] == "ragged_dot.xla"]
    for config in [entry["best_config"], *(m["config"] for m in entry["measurements"])]:
      config["tile_rows"] = config.pop("tile_m")
    if code is not None:
      entry["code"] = code
  return edit


def test_an_entry_from_other_code_that_no_longer_validates_is_dropped_alone(grad_result):
  # The same versions, but its op's code changed (an editable install renamed a config
  # field): that entry is stale data, not a broken file, and the others still load.
  text = _edited(grad_result, _renamed_field(code="0123456789abcdef"))
  with pytest.warns(file_format.VersionWarning) as record:
    loaded = stellarax.AutotuningResult.loads(text, source="cache.json")
  (message,) = [str(w.message) for w in record]
  assert re.match(r"cache.json: entry \d skipped \(measured on other code of ragged_dot.xla: "
                  r"fingerprint 0123456789abcdef, now [0-9a-f]{16}\):.*tile_rows", message)
  assert "other versions" not in message
  assert [e.bound_args.op.name for e in loaded] == ["ragged_dot.xla_vjp"]
  # The library cache reads its files without these warnings (warnings are errors here).
  assert len(stellarax.AutotuningResult.loads(text, warn_other_versions=False)) == 1


@pytest.mark.parametrize("code", [None, ""])  # the running code (as written), or unknown
def test_an_entry_from_the_running_code_that_does_not_validate_is_a_format_error(grad_result,
                                                                                 code):
  with pytest.raises(file_format.FormatError, match=r"bad.json: entry \d is invalid: .*tile_rows"):
    stellarax.AutotuningResult.loads(_edited(grad_result, _renamed_field(code)), source="bad.json")


def test_a_user_cache_file_with_an_entry_from_other_code_stays_readable(user_cache_dir,
                                                                        grad_result):
  # Before, the entry made the whole file unreadable, and the next write moved it aside.
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), ba.op.name)
  path.parent.mkdir(parents=True)
  path.write_text(_edited(grad_result, _renamed_field(code="0123456789abcdef")))
  with pytest.warns(file_format.VersionWarning, match="measured on other code"):
    result = tuner(cache=True).autotune([ba])  # a CacheWarning would fail here
  assert not path.with_suffix(".json.unreadable").exists()
  assert stellarax.AutotuningResult.load(path).entry(ba) == result.entry(ba)


def test_files_are_written_with_the_umask_s_permissions(tmp_path, grad_result):
  old = os.umask(0o022)
  try:
    grad_result.dump(tmp_path / "result.json")
    written = autotuning.write_library_cache(grad_result, tmp_path / "library")
  finally:
    os.umask(old)
  for path in [tmp_path / "result.json", *written]:
    assert path.stat().st_mode & 0o777 == 0o644, path


def test_a_file_written_again_keeps_its_permissions_and_its_link(tmp_path, grad_result):
  # Dumped over a private result, the file became world-readable; dumped through a link,
  # the link became a plain file and its target kept the old result.
  private = tmp_path / "private.json"
  private.write_text("{}")
  private.chmod(0o600)
  grad_result.dump(private)
  assert private.stat().st_mode & 0o777 == 0o600
  target, link = tmp_path / "results" / "target.json", tmp_path / "link.json"
  target.parent.mkdir()
  target.write_text("{}")
  link.symlink_to(target)
  grad_result.dump(link)
  assert link.is_symlink() and stellarax.AutotuningResult.load(target) == grad_result


def test_an_unreadable_user_cache_costs_a_warning_not_the_program(user_cache_dir):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), ba.op.name)
  path.parent.mkdir(parents=True)
  path.write_text("{not json")
  expected = (jax.lax.ragged_dot(lhs, rhs, gs) ** 2).sum()
  # A new function, so traced now (an eager call reuses its jit if another test of this
  # process made the same call, and reads no cache).
  with pytest.warns(autotuning.CacheWarning, match="not valid JSON.*passes over it"):
    np.testing.assert_allclose(jax.jit(lambda *a: model(*a))(lhs, rhs, gs), expected, rtol=1e-5)
  with warnings.catch_warnings():  # once per version of the file
    warnings.simplefilter("error")
    assert autotuning.explain(ba).source == "heuristics"
  # Tuning into the cache keeps the unreadable file aside and writes a good one.
  with pytest.warns(autotuning.CacheWarning, match="moved to .*json.unreadable"):
    result = tuner(cache=True).autotune([ba])
  assert path.with_suffix(".json.unreadable").read_text() == "{not json"
  assert stellarax.AutotuningResult.load(path) == result


def test_a_cache_read_inside_jaxs_cache_lookup_keeps_its_warning_for_the_user(user_cache_dir):
  # A jitted function's trace key re-asks its questions (transfer reads the caches) when
  # JAX compares keys. A warning there reached no user line, and under -W error it was
  # swallowed by the comparison with the file's once-only warning spent: a later trace
  # read the file without a word (the test above failed so in CI when an earlier test of
  # the process had left such a key).
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), ba.op.name)
  f = jax.jit(lambda *a: model(*a))
  f(lhs, rhs, gs)  # its key records what the trace asked, the caches' transfer included
  path.parent.mkdir(parents=True)
  path.write_text("{not json")
  with warnings.catch_warnings(), autotuning.AutotuningResult(cache_lib.current_device_kind()):
    warnings.simplefilter("error")
    # Under a new stack of results (empty: it changes no answer), JAX compares f's key
    # with the current one, asking its questions again: the file is read there, and
    # nothing warns.
    f(lhs, rhs, gs)
  with pytest.warns(autotuning.CacheWarning, match="not valid JSON.*passes over it"):
    jax.jit(lambda *a: model(*a))(lhs, rhs, gs)  # a new trace: the user is told
  with warnings.catch_warnings():  # once per version of the file
    warnings.simplefilter("error")
    assert autotuning.explain(ba).source == "heuristics"


def test_warnings_held_back_are_collected_not_emitted():
  from stellarax.core import warn as warn_lib
  assert warn_lib.held_count() is None
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with warn_lib.held_back() as held:
      assert warn_lib.warn("not now", autotuning.CacheWarning) is False
      with warn_lib.held_back() as inner:
        warn_lib.warn("inner", UserWarning)
      assert warn_lib.held_count() == 1 and inner == [("inner", UserWarning)]
  assert held == [("not now", autotuning.CacheWarning)] and warn_lib.held_count() is None
  with pytest.warns(autotuning.CacheWarning, match="now"):
    assert warn_lib.warn("now", autotuning.CacheWarning) is True


def test_a_user_cache_that_cannot_be_written_keeps_the_result(tmp_path, monkeypatch):
  not_a_folder = tmp_path / "file"
  not_a_folder.write_text("")
  monkeypatch.setenv("STELLARAX_CACHE_DIR", str(not_a_folder))
  lhs, rhs, gs = _inputs()
  with pytest.warns(autotuning.CacheWarning) as caught:
    result = tuner(cache=True).autotune(model, lhs, rhs, gs)
  assert len(result) == 1
  messages = [str(w.message) for w in caught]
  assert any("cannot be read (Not a directory)" in m for m in messages), messages
  assert any("cannot be written" in m and "result.dump" in m for m in messages), messages


def _recorded_with(data, *, entries=None, **versions):
  """Result-file data as if `entries` (indexes; default all) were measured, and the file
  written, under `versions` (e.g. jax="0.0.1") instead of the running ones."""
  data = json.loads(json.dumps(data))
  data["versions"].update(versions)
  for i in range(len(data["entries"])) if entries is None else entries:
    data["entries"][i]["versions"].update(versions)
  return data


@pytest.mark.parametrize("layout", ["per_entry", "file_only"])
def test_other_versions_are_used_with_a_warning(grad_result, layout):
  data = _recorded_with(json.loads(grad_result.dumps()), jax="0.0.1")
  if layout == "file_only":  # written before entries kept their own versions
    for entry in data["entries"]:
      del entry["versions"]
  data["entries"][0]["bound_args"]["op"]["name"] = "ragged_dot.removed_backend"
  with pytest.warns(file_format.VersionWarning) as record:
    loaded = stellarax.AutotuningResult.loads(json.dumps(data))
  assert len(loaded) == len(grad_result) - 1
  assert any("skipped" in str(w.message) for w in record)
  assert "2 of 2 entries were recorded with other versions" in str(record[0].message)
  (entry,) = loaded
  assert entry.versions["jax"] == "0.0.1" and not entry.is_current
  assert "jax 0.0.1 (running " in entry.stale_reason


def test_entries_timed_another_way_are_stale(grad_result):
  # Times taken before measure.TIMING_REVISION was kept (single batches off the CPU read
  # up to twice an H200's device time) are not comparable with today's: their calls are
  # measured again, though stellarax, jax and jaxlib are the same.
  data = json.loads(grad_result.dumps())
  for versions in [data["versions"], *(e["versions"] for e in data["entries"])]:
    del versions["timing"]
  with pytest.warns(file_format.VersionWarning, match="recorded with other versions"):
    old = stellarax.AutotuningResult.loads(json.dumps(data))
  assert all(not e.is_current for e in old)
  assert [e.stale_reason for e in old] == [
      f"measured under other versions: timing unrecorded (running {measure_lib.TIMING_REVISION})"] * len(old)
  again = _recorded_with(json.loads(grad_result.dumps()), timing="1")
  assert not any(e.is_current for e in stellarax.AutotuningResult.loads(
      json.dumps(again), warn_other_versions=False))
  # A current entry of the same call wins the merge, whichever ran faster.
  assert all(e.is_current for e in old | grad_result)
  # Data that records no versions at all (a file written by hand) was read as measured
  # under the running ones: current.
  data = json.loads(grad_result.dumps())
  for holder in [data, *data["entries"]]:
    del holder["versions"]
  with pytest.warns(file_format.VersionWarning, match="stellarax unrecorded"):
    bare = stellarax.AutotuningResult.loads(json.dumps(data))
  assert len(bare) == len(grad_result) and not any(e.is_current for e in bare)


def test_each_entry_keeps_the_versions_it_was_measured_under(grad_result):
  old = stellarax.AutotuningResult.loads(
      json.dumps(_recorded_with(json.loads(grad_result.dumps()), entries=[0], jax="0.0.1")),
      warn_other_versions=False)
  stale, fresh = list(old)
  assert not stale.is_current and fresh.is_current
  # The writer's versions head the file; each entry keeps its own through a round trip,
  # so one file holds old and new measurements apart.
  again = json.loads(old.dumps())
  assert again["versions"]["jax"] == "0.0.1"  # as read: the file's writer
  assert [e["versions"]["jax"] for e in again["entries"]] == ["0.0.1", jax.__version__]
  merged = old | grad_result
  assert merged.versions == file_format.current_versions()  # written by this process
  with pytest.raises(file_format.FormatError, match="'versions' must be an object"):
    stellarax.AutotuningResult.loads(json.dumps(json.loads(grad_result.dumps()) | {"versions": [1]}))


def test_a_current_measurement_wins_a_merge_with_a_faster_stale_one(grad_result):
  entry = next(iter(grad_result))
  faster_m = [(c, m.__class__(**{**m.to_json(), "median_s": m.median_s / 10, "ci_low_s": m.median_s / 11,
                                    "ci_high_s": m.median_s / 9}) if m.status == "ok" else m)
              for c, m in entry.measurements]
  stale = dataclasses.replace(entry, measurements=tuple(faster_m),
                              versions={**entry.versions, "jax": "0.0.1"})
  assert stale.best_time < entry.best_time
  old = autotuning.AutotuningResult(grad_result.device_kind, {stale.key: stale})
  assert (old | grad_result).entry(entry.bound_args) == entry
  assert (grad_result | old).entry(entry.bound_args) == entry
  # Between two stale ones, the faster still wins.
  slower_stale = dataclasses.replace(entry, versions=stale.versions)
  slower = autotuning.AutotuningResult(grad_result.device_kind, {stale.key: slower_stale})
  assert (slower | old).entry(entry.bound_args) == stale


def test_autotune_measures_stale_cached_calls_again(user_cache_dir, grad_result):
  lhs, rhs, gs = _inputs()
  calls = autotuning.get_bound_args(jax.grad(model, argnums=(0, 1)), lhs, rhs, gs)
  old = stellarax.AutotuningResult.loads(
      json.dumps(_recorded_with(json.loads(grad_result.dumps()), entries=[0], jax="0.0.1")),
      warn_other_versions=False)
  stale, fresh = list(old)
  cache_lib.USER_CACHE.write(old)
  with pytest.warns(file_format.VersionWarning):
    text = str(autotuning.explain(stale.bound_args))
  assert "from user_cache" in text and "jax 0.0.1 (running " in text and "stale" in text
  assert autotuning.explain(fresh.bound_args).stale is None
  with pytest.warns(file_format.VersionWarning):
    result = tuner(cache=True).autotune(calls)
  assert result.entry(fresh.bound_args) == fresh  # current: reused as it is
  remeasured = result.entry(stale.bound_args)
  assert remeasured.is_current and remeasured.measurements != stale.measurements  # new samples
  # The new measurement replaced the stale one in the user cache, slower or not.
  assert autotuning.explain(stale.bound_args).stale is None


def test_a_result_of_another_device_applies_with_a_warning(grad_result):
  entry = next(iter(grad_result))
  h200 = autotuning.AutotuningResult("NVIDIA H200", {entry.key: entry})
  with pytest.warns(autotuning.OtherDeviceWarning, match="measured on 'NVIDIA H200' and is applied"):
    with h200:
      assert autotuning.explain(entry.bound_args).source == "result"
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with autotuning.AutotuningResult("NVIDIA H200"), grad_result:  # empty, or this device's
      pass


def test_merge_keeps_the_faster_and_refuses_other_devices(grad_result):
  entry = next(iter(grad_result))
  slower_m = [(c, m.__class__(**{**m.to_json(), "median_s": m.median_s * 10, "ci_low_s": m.median_s * 9,
                                    "ci_high_s": m.median_s * 11}) if m.status == "ok" else m)
              for c, m in entry.measurements]
  slower = autotuning.Entry(entry.bound_args, entry.best_config, entry.heuristic_config, tuple(slower_m))
  other = autotuning.AutotuningResult(grad_result.device_kind, {slower.key: slower})
  assert (other | grad_result).entry(entry.bound_args) == entry
  assert (grad_result | other).entry(entry.bound_args) == entry
  assert entry.bound_args in other and entry.bound_args.with_config(entry.best_config) in other
  assert slower in other and entry not in other and entry in grad_result
  assert stellarax.XlaRaggedDot.bind(jnp.ones((7, 16)), jnp.ones((2, 16, 8)),
                                     jnp.array([3, 4], jnp.int32)) not in other
  assert "not an entry" not in other
  with pytest.raises(ValueError, match="different devices"):
    grad_result | autotuning.AutotuningResult("NVIDIA H200")


def test_autotune_accepts_bound_args_sequences_json_and_lowered(tmp_path):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  t = tuner(strategy="exhaustive")
  assert {e.bound_args for e in t.autotune([ba])} == {ba}
  assert {e.bound_args for e in t.autotune(ba)} == {ba}
  path = tmp_path / "ba.json"
  autotuning.bound_args_to_json([ba], path)
  assert {e.bound_args for e in t.autotune(str(path))} == {ba}
  assert {e.bound_args for e in t.autotune(jax.jit(model).lower(lhs, rhs, gs))} == {ba}
  # A Traced too (it raised an AssertionError), with a total budget (shared equally: it
  # holds no arrays to profile); a Compiled says what to pass instead.
  traced = jax.jit(model).trace(lhs, rhs, gs)
  assert {e.bound_args for e in tuner(total_budget_s=1.0).autotune(traced)} == {ba}
  with pytest.raises(TypeError, match=r"Compiled is past the StableHLO.*\.trace\(\.\.\.\)"):
    t.autotune(jax.jit(model).lower(lhs, rhs, gs).compile())
  with pytest.raises(TypeError, match="Traced takes no arguments") as e:
    t.autotune(traced, lhs)
  with pytest.raises(TypeError) as e:
    t.autotune(jax.jit(model).lower(lhs, rhs, gs).compile())
  assert not getattr(e.value, "__notes__", None)  # not "autotune called f with no arguments"
  # What f returns besides arrays does not matter to capture (lowering refused a string).
  tagged = lambda *a: (model(*a), "tag")
  assert autotuning.get_bound_args(tagged, lhs, rhs, gs) == [ba]
  assert len(tuner(total_budget_s=1.0).autotune(tagged, lhs, rhs, gs)) == 1  # profiled too
  with pytest.raises(TypeError, match="Autotuner"):
    t.autotune([ba], 1)
  with pytest.raises(TypeError, match=r"got one: pass \[ba\]"):
    autotuning.bound_args_to_json(ba)
  with pytest.raises(TypeError, match="item 1 is a str"):
    autotuning.bound_args_to_json([ba, "ragged_dot"])
  with pytest.raises(TypeError, match="explain takes a BoundArguments"):
    autotuning.explain("ragged_dot.xla")


def test_autotune_passes_keyword_arguments_to_f():
  lhs, rhs, gs = _inputs()
  f = lambda *, a, b, g: stellarax.ragged_dot(a, b, g)
  result = tuner(strategy="exhaustive").autotune(f, a=lhs, b=rhs, g=gs)
  assert [e.bound_args.op.name for e in result] == ["ragged_dot.xla"]


def test_an_input_without_op_calls_warns_and_gives_an_empty_result(tmp_path):
  x = jnp.ones((8, 4))

  def plain(x):
    return jax.lax.ragged_dot(x, jnp.ones((2, 4, 3)), jnp.array([3, 5], jnp.int32))

  t = tuner()
  with pytest.warns(autotuning.NothingToTuneWarning, match="no stellarax op call in plain"):
    assert len(t.autotune(plain, x)) == 0
  path = tmp_path / "none.json"
  autotuning.bound_args_to_json([], path)
  with pytest.warns(autotuning.NothingToTuneWarning, match="JSON holds no op calls"):
    assert len(t.autotune(str(path))) == 0
  # It said "holds no op calls" of a JSON that holds one, with no rows.
  empty_rows = stellarax.XlaRaggedDot.bind(jax.ShapeDtypeStruct((0, 4), jnp.float32),
                                           jnp.ones((2, 4, 3)), jnp.array([0, 0], jnp.int32))
  autotuning.bound_args_to_json([empty_rows], path)
  with pytest.warns(autotuning.NothingToTuneWarning, match="the 1 stellarax op calls found run "
                    "no kernel: each has an empty dimension"):
    assert len(t.autotune(str(path))) == 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert len(t.autotune([])) == 0  # an empty list was asked for: nothing to say


def test_autotune_inside_a_transformation_says_to_call_it_outside():
  f = lambda y: stellarax.rms_norm(y, None)
  with pytest.raises(TypeError, match=r"traced values \(float32\[4,8\]\).*outside the transformation"):
    jax.jit(lambda x: len(tuner().autotune(f, x)))(jnp.ones((4, 8)))


def test_every_config_failing_says_why():
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)

  def broken(space, measure, *, heuristic, budget_s):
    from stellarax.autotuning import search
    return search.exhaustive(space, lambda cs, effort=1.0: {
        c: autotuning.Measurement(status="compile_error", error="boom") for c in cs}, heuristic=heuristic)

  with pytest.raises(ValueError, match="boom"):
    tuner(strategy=broken).autotune([ba])


def _grad_calls():
  """The forward and the VJP call of `model`'s gradient, in that order."""
  lhs, rhs, gs = _inputs()
  calls = autotuning.get_bound_args(jax.grad(model, argnums=(0, 1)), lhs, rhs, gs)
  return sorted((ba.with_config(None) for ba in calls), key=lambda ba: ba.op.name)


def _all_configs_fail(space, measure, *, heuristic, budget_s):
  from stellarax.autotuning import search
  return search.exhaustive(list(space), lambda cs, effort=1.0: {
      c: autotuning.Measurement(status="runtime_error", error="boom in the backward") for c in cs},
      heuristic=heuristic)


def _tune_one_with(monkeypatch, strategies):
  """Makes `Autotuner.tune_one` use strategies[op name] (the tuner's own for other ops;
  the mapping is read at each call) and returns the op names it is called for, in order."""
  real, called = stellarax.Autotuner.tune_one, []

  def tune_one(self, ba, **kwargs):
    called.append(ba.op.name)
    strategy = strategies.get(ba.op.name, self.strategy)
    return real(dataclasses.replace(self, strategy=strategy), ba, **kwargs)

  monkeypatch.setattr(stellarax.Autotuner, "tune_one", tune_one)
  return called


def test_a_call_that_cannot_be_tuned_does_not_stop_the_others(user_cache_dir, monkeypatch):
  fwd, vjp = _grad_calls()
  strategies = {vjp.op.name: _all_configs_fail}
  called = _tune_one_with(monkeypatch, strategies)
  with pytest.raises(autotuning.IncompleteTuningError) as info:
    tuner(cache=True).autotune([vjp, fwd])  # the failing call first
  exc = info.value
  assert isinstance(exc, ValueError)  # what "every config failed" always raised
  assert called == [vjp.op.name, fwd.op.name]
  assert exc.not_tuned == (vjp,) and list(exc.errors) == [vjp]
  assert "boom in the backward" in exc.errors[vjp] and "boom in the backward" in str(exc)
  assert "tuned 1 of 2 calls" in str(exc) and str(vjp) in str(exc)
  assert isinstance(exc.__cause__, ValueError)  # the tuning's own error, for its traceback
  assert [e.bound_args for e in exc.partial_result] == [fwd]
  # The tuned call went into the user cache; a second run tunes only the missing one.
  assert autotuning.explain(fwd).source == "user_cache"
  called.clear()
  del strategies[vjp.op.name]  # the backward's configs run now
  result = tuner(cache=True).autotune([vjp, fwd])
  assert called == [vjp.op.name] and len(result) == 2
  assert result.entry(fwd) == exc.partial_result.entry(fwd)
  assert autotuning.explain(vjp).source == "user_cache"


def test_an_interrupted_tuning_keeps_the_calls_it_finished(user_cache_dir, monkeypatch):
  fwd, vjp = _grad_calls()

  def interrupted(space, measure, *, heuristic, budget_s):
    raise KeyboardInterrupt  # Ctrl-C, say, while the second call is tuned

  _tune_one_with(monkeypatch, {vjp.op.name: interrupted})
  with pytest.raises(KeyboardInterrupt):
    tuner(ignore_cache=True).autotune([fwd, vjp])
  assert not user_cache_dir.exists()  # without cache=True nothing is written
  with pytest.raises(KeyboardInterrupt):
    tuner(cache=True).autotune([fwd, vjp])
  assert autotuning.explain(fwd).source == "user_cache"
  assert autotuning.explain(vjp).source == "heuristics"


def test_an_entry_measured_on_other_code_of_its_op_is_stale(user_cache_dir, grad_result,
                                                           monkeypatch):
  # The same versions, but the kernel's source changed since (an editable install):
  # its config still applies, silently, and autotune measures the call again.
  from stellarax.core.fingerprint import code_fingerprint
  entry = next(iter(grad_result))
  assert entry.code == code_fingerprint(type(entry.bound_args.op)) and entry.is_current
  edited = dataclasses.replace(entry, code="0123456789abcdef")
  assert "other code of ragged_dot.xla" in edited.stale_reason
  assert dataclasses.replace(entry, code="").is_current  # unknown code: versions judge
  with monkeypatch.context() as m:  # the running code unknown (imported from a zip): the same
    for module in (autotuning.result, file_format):
      m.setattr(module, "code_fingerprint", lambda cls: "")
    assert edited.is_current and file_format._other_code(file_format.entry_to_json(edited)) is None
  cache_lib.USER_CACHE.write(autotuning.AutotuningResult(grad_result.device_kind,
                                                         {edited.key: edited}))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # same versions: no VersionWarning
    explanation = autotuning.explain(entry.bound_args)
  assert explanation.source == "user_cache" and "0123456789abcdef" in explanation.stale
  assert "stale (measured on other code" in str(explanation)
  result = tuner(cache=True).autotune([entry.bound_args])
  assert result.entry(entry.bound_args).is_current
  assert autotuning.explain(entry.bound_args).stale is None


def test_user_cache_is_written_read_and_explained(user_cache_dir, grad_result):
  lhs, rhs, gs = _inputs()
  (ba,) = autotuning.get_bound_args(model, lhs, rhs, gs)
  assert autotuning.explain(ba).source == "heuristics"
  cache_lib.USER_CACHE.write(grad_result)
  assert (user_cache_dir / cache_lib.device_kind_slug(grad_result.device_kind) / "ragged_dot.xla.json").exists()
  explanation = autotuning.explain(ba)
  assert explanation.source == "user_cache"
  assert explanation.config == grad_result.best_config(ba)
  other = stellarax.XlaRaggedDot.bind(lhs[:32], rhs, gs)
  text = str(autotuning.explain(other))
  assert "lhs: float32[32, 32] != float32[64, 32]" in text


def _write_entry(args):
  cache_dir, text = args
  os.environ["STELLARAX_CACHE_DIR"] = cache_dir
  from stellarax.autotuning import cache as c
  from stellarax.autotuning.result import AutotuningResult
  for _ in range(5):
    c.USER_CACHE.write(AutotuningResult.loads(text))
  return True


def test_concurrent_cache_writers_lose_nothing(user_cache_dir, grad_result):
  entries = list(grad_result)
  texts = [autotuning.AutotuningResult(grad_result.device_kind, {e.key: e}).dumps() for e in entries]
  ctx = multiprocessing.get_context("spawn")
  with ctx.Pool(2) as pool:
    assert all(pool.map(_write_entry, [(str(user_cache_dir), t) for t in texts * 2]))
  files = sorted(user_cache_dir.glob("*/*.json"))
  assert {f.name for f in files} == {"ragged_dot.xla.json", "ragged_dot.xla_vjp.json"}
  for f in files:
    assert len(autotuning.AutotuningResult.load(f)) == 1


def test_writers_that_remove_their_lock_files_still_exclude_each_other(tmp_path):
  # A writer that waited on a lock file removed meanwhile must not go on beside the
  # writer that locked the new file at the same path: no increment may be lost. One
  # writer keeps its lock file, as the user cache's do.
  lock, count = tmp_path / "op.json.lock", tmp_path / "count"
  count.write_text("0")

  def add(n: int, remove: bool) -> None:
    for _ in range(n):
      with cache_lib._exclusive_lock(lock, remove=remove):
        seen = int(count.read_text())
        time.sleep(0.0005)  # widen the window a second writer would slip into
        count.write_text(str(seen + 1))

  threads = [threading.Thread(target=add, args=(25, i != 0)) for i in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert int(count.read_text()) == 150


def test_a_killed_writer_s_temporary_file_is_no_cache_file(user_cache_dir, grad_result):
  # A writer killed between writing its temporary file and renaming it over the cache
  # file leaves the temporary behind, holding a whole result: no reader may take it
  # for a cache file of its own (an op named ".tmp-ii8p5y7m").
  written = cache_lib.USER_CACHE.write(grad_result)
  left = written[0].with_name(".tmp-ii8p5y7m.json")
  left.write_text(written[0].read_text())
  assert cache_lib.USER_CACHE.files() == written
  assert len(cache_lib.USER_CACHE.results(grad_result.device_kind)) == len(written)
  assert cache_lib.USER_CACHE.temporaries() == [left]
  assert cache_lib.USER_CACHE.temporaries(min_age_s=cache_lib.LEFTOVER_AGE_S) == []
  # A young one may be a write under way, so clear keeps it; an old one it removes.
  cache_lib.USER_CACHE.clear()
  assert left.exists() and not any(path.exists() for path in written)
  old = time.time() - cache_lib.LEFTOVER_AGE_S - 1
  os.utime(left, (old, old))
  assert cache_lib.USER_CACHE.temporaries(min_age_s=cache_lib.LEFTOVER_AGE_S) == [left]
  assert cache_lib.USER_CACHE.clear() == 1
  assert list(user_cache_dir.iterdir()) == []


def test_clear_racing_writers_and_readers_fails_none_of_them(user_cache_dir, grad_result):
  # `cache clear` while tuning writes the cache: each write lands before a clear or
  # after it, whole, and no side raises (a file gone meanwhile is no error for clear,
  # nor for prune or a reader, nor for a writer whose folder clear removed).
  kind, cache = grad_result.device_kind, cache_lib.USER_CACHE
  singles = [autotuning.AutotuningResult(kind, {e.key: e}) for e in grad_result]
  stop, errors = threading.Event(), []

  def repeat(action) -> None:
    try:
      while not stop.is_set():
        action()
    except BaseException as exc:  # noqa: BLE001 (the test reads what was raised)
      errors.append(exc)

  actions = [functools.partial(cache.write, single) for single in singles * 2]
  actions += [cache.clear, cache.prune, functools.partial(cache.results, kind)]
  threads = [threading.Thread(target=repeat, args=(action,)) for action in actions]
  for t in threads:
    t.start()
  time.sleep(1.5)
  stop.set()
  for t in threads:
    t.join()
  assert not errors, errors
  for path in cache.files():  # what the last clear left: whole files, of their op
    assert [e.bound_args.op.name for e in autotuning.AutotuningResult.load(path)] == [path.stem]
  assert cache.write(grad_result) and len(cache.results(kind)) == len(singles)


def test_clear_waits_for_a_writer_holding_a_file_s_lock(user_cache_dir, grad_result):
  # Removing a lock file a writer holds would let the next writer lock a new file at
  # the same path and write beside it: clear takes each file's lock, as writers do.
  (path, *_) = cache_lib.USER_CACHE.write(grad_result)
  lock = path.with_suffix(".json.lock")
  with cache_lib._exclusive_lock(lock):
    clearing = threading.Thread(target=cache_lib.USER_CACHE.clear)
    clearing.start()
    clearing.join(0.3)
    assert clearing.is_alive() and lock.exists() and path.exists()
  clearing.join()
  assert not lock.exists() and not path.exists()


@pytest.mark.parametrize("folder_stays", [False, True])
def test_writers_still_exclude_each_other_while_the_cache_is_cleared(tmp_path, folder_stays):
  # Clear removes lock files (and, unless a file of the user's keeps it, their emptied
  # folder) while writers lock them: no two writers may hold the lock at once (no
  # increment lost), and none may fail.
  cache = cache_lib.FileCache(tmp_path / "cache", "user_cache", writable=True)
  lock, count = tmp_path / "cache" / "cpu" / "op.json.lock", tmp_path / "count"
  count.write_text("0")
  if folder_stays:
    lock.parent.mkdir(parents=True)
    (lock.parent / "notes.txt").write_text("the user's own")
  done, errors = threading.Event(), []

  def add(n: int) -> None:
    try:
      for _ in range(n):
        with cache_lib._exclusive_lock(lock):
          seen = int(count.read_text())
          time.sleep(0.0005)  # widen the window a second writer would slip into
          count.write_text(str(seen + 1))
    except BaseException as exc:  # noqa: BLE001 (the test reads what was raised)
      errors.append(exc)

  def clear() -> None:
    while not done.is_set():
      cache.clear()

  clearing = threading.Thread(target=clear)
  clearing.start()
  writers = [threading.Thread(target=add, args=(25,)) for _ in range(4)]
  for t in writers:
    t.start()
  for t in writers:
    t.join()
  done.set()
  clearing.join()
  assert not errors, errors
  assert int(count.read_text()) == 100


def test_library_cache_is_consulted_after_the_user_cache(tmp_path, monkeypatch, grad_result):
  lib = cache_lib.FileCache(tmp_path / "lib", "library_cache", writable=True)
  lib.write(grad_result)
  lib.writable = False
  monkeypatch.setattr(cache_lib.LIBRARY_CACHE, "_root", tmp_path / "lib")
  lhs, rhs, gs = _inputs()
  (ba,) = autotuning.get_bound_args(model, lhs, rhs, gs)
  assert resolution.resolve_config(ba).source == "library_cache"
  with pytest.raises(PermissionError, match="read-only"):
    lib.write(grad_result)


def test_a_package_ships_its_own_library_cache_and_adds_it(tmp_path, monkeypatch, user_cache_dir,
                                                           grad_result):
  # Registrations are process-wide: this test's stay in copies it drops.
  monkeypatch.setattr(resolution, "_cache_sources", list(resolution.cache_sources()))
  monkeypatch.setattr(cache_lib.LIBRARY_CACHE, "_root", tmp_path / "stellarax_library")
  lhs, rhs, gs = _inputs()
  (ba,) = autotuning.get_bound_args(model, lhs, rhs, gs)
  folder = tmp_path / "mylib" / "data" / "autotuning"
  written = autotuning.write_library_cache(grad_result, folder)
  slug = cache_lib.device_kind_slug(grad_result.device_kind)
  assert sorted(written) == [folder / slug / "ragged_dot.xla.json", folder / slug / "ragged_dot.xla_vjp.json"]
  # A folder to install with the package: the JSON files, and no lock files beside them.
  assert sorted(p for p in folder.rglob("*") if p.is_file()) == sorted(written)
  assert resolution.resolve_config(ba).source != "library_cache"  # not added yet
  added = autotuning.add_library_cache(folder)
  assert autotuning.add_library_cache(str(folder)) is added  # once, however often added
  monkeypatch.chdir(tmp_path)
  assert autotuning.add_library_cache("mylib/data/autotuning") is added  # relative paths too
  assert resolution.cache_sources().count(added) == 1 and resolution.cache_sources()[-1] is added
  assert resolution.resolve_config(ba) == resolution.Resolution(grad_result.best_config(ba),
                                                                "library_cache")
  # The user cache still comes first, and the added folder is read-only.
  mine = next(c for c in ba.autotuning_configs if c != grad_result.best_config(ba))
  entry = dataclasses.replace(grad_result.entry(ba), best_config=mine)
  cache_lib.USER_CACHE.write(autotuning.AutotuningResult(grad_result.device_kind, {entry.key: entry}))
  assert resolution.resolve_config(ba) == resolution.Resolution(mine, "user_cache")
  with pytest.raises(PermissionError, match="read-only"):
    added.write(grad_result)
  with pytest.raises(NotADirectoryError, match="no such folder.*write_library_cache"):
    autotuning.add_library_cache(tmp_path / "not_installed")


def test_library_cache_from_other_versions_applies_without_warnings(tmp_path, monkeypatch, grad_result):
  # Shipped configs recorded with an older jax: still used (and one that no longer
  # validates dropped), silently; the same file in the user cache warns.
  lhs, rhs, gs = _inputs()
  (ba,) = autotuning.get_bound_args(model, lhs, rhs, gs)
  data = _recorded_with(json.loads(grad_result.dumps()), jax="0.0.1")
  gone = next(e for e in data["entries"] if e["bound_args"]["op"]["name"] != ba.op.name)
  gone["bound_args"]["op"]["name"] = "ragged_dot.removed_backend"
  for root in (tmp_path / "lib", tmp_path / "user"):
    for entry in data["entries"]:
      path = root / cache_lib.device_kind_slug(grad_result.device_kind) / f"{entry['bound_args']['op']['name']}.json"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(data | {"entries": [entry]}))
  monkeypatch.setattr(cache_lib.LIBRARY_CACHE, "_root", tmp_path / "lib")
  monkeypatch.setattr(cache_lib.LIBRARY_CACHE, "_loaded", {})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert resolution.resolve_config(ba).source == "library_cache"
    assert sum(len(r) for r in cache_lib.LIBRARY_CACHE.results(grad_result.device_kind)) == len(grad_result) - 1
  user = cache_lib.FileCache(tmp_path / "user", "user_cache", writable=True)
  with pytest.warns(file_format.VersionWarning):
    user.results(grad_result.device_kind)


def test_a_tuning_option_among_the_functions_arguments_says_where_it_goes(user_cache_dir):
  lhs, rhs, gs = _inputs()
  with pytest.raises(TypeError, match=r"f takes no 'budget_s'; budget_s=1 is a tuning option: "
                     r"give it to the tuner, stellarax.Autotuner\(budget_s=1\)"):
    stellarax.autotune(jax.jit(model), lhs, rhs, gs, budget_s=1)
  # A function whose own argument has an option's name gets it.
  seen = []

  def takes_it(lhs, rhs, gs, budget_s):
    seen.append(budget_s)
    return model(lhs, rhs, gs)

  assert len(tuner().autotune(takes_it, lhs, rhs, gs, budget_s=7)) == 1
  assert seen and set(seen) == {7}


def test_the_functions_arguments_may_be_named_f_or_self(user_cache_dir):
  # The spec's autotune(f, **args): every keyword is f's, even one named like the
  # tuner's own parameters.
  lhs, rhs, gs = _inputs()

  def named_f(lhs, f, gs):
    return model(lhs, f, gs)

  args = {"lhs": lhs, "f": rhs, "gs": gs}
  (ba,) = autotuning.get_bound_args(named_f, **args)
  assert ba.op.name == "ragged_dot.xla"
  assert len(stellarax.autotune(lambda lhs, self, gs: model(lhs, self, gs),
                                lhs=lhs, self=rhs, gs=gs)) == 1
  assert len(tuner().autotune(named_f, **args)) == 1
  assert tuner().collect(named_f, **args) == [ba.with_config(None)]
  import inspect
  for entry in (stellarax.autotune, stellarax.Autotuner.autotune, stellarax.Autotuner.collect,
                autotuning.get_bound_args, autotuning.check_in_program):
    kind = inspect.signature(entry).parameters["f"].kind
    assert kind is inspect.Parameter.POSITIONAL_ONLY, entry


def test_a_function_called_without_its_arguments_gets_a_hint(user_cache_dir):
  # The spec writes autotune(jax.grad(f)): jax's own error gets a note on what to pass.
  with pytest.raises(TypeError) as info:
    stellarax.autotune(jax.grad(model))
  notes = "\n".join(getattr(info.value, "__notes__", []))
  assert "autotune called f with no arguments" in notes and "functools.partial" in notes
  lhs, rhs, gs = _inputs()
  with pytest.raises(TypeError) as info:  # with arguments, jax's error stands alone
    stellarax.autotune(model, lhs, rhs)
  assert "autotune called f" not in "\n".join(getattr(info.value, "__notes__", []))


def test_miss_policy_autotune_tunes_on_the_spot(user_cache_dir):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs[:16], rhs, gs)
  with resolution.miss_policy_scope("autotune"):
    r = resolution.resolve_config(ba)
  assert r.source == "autotuned" and r.config in ba.autotuning_configs
  # Where calls resolve for real: while their program is traced.
  seen = []
  original = stellarax.XlaRaggedDot._fwd

  def spy(self, *args, config, **kwargs):
    seen.append(config)
    return original(self, *args, config=config, **kwargs)

  other = stellarax.XlaRaggedDot.bind(lhs[:24], rhs, gs)
  with pytest.MonkeyPatch.context() as mp, resolution.miss_policy_scope("autotune"):
    mp.setattr(stellarax.XlaRaggedDot, "_fwd", spy)
    out = jax.jit(lambda l: stellarax.ragged_dot(l, rhs, gs))(lhs[:24])
  np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs[:24], rhs, gs), rtol=1e-5, atol=1e-5)
  assert seen[-1] == autotuner_lib._TUNED_ON_MISS[autotuner_lib._miss_key(other)]
  # explain tells what a call traced now gets: the config tuned on the miss, not the
  # heuristic (a user study found it saying the heuristic).
  with resolution.miss_policy_scope("autotune"):
    explained = autotuning.explain(other)
  assert (explained.source, explained.config) == ("autotuned", seen[-1])
  assert "tuned when first traced, under the 'autotune' miss policy" in str(explained)
  untuned = stellarax.XlaRaggedDot.bind(lhs[:8], rhs, gs)
  with resolution.miss_policy_scope("autotune"):
    assert autotuning.explain(untuned).source == "miss:autotune"
  assert autotuning.explain(other).source == "heuristics"  # the policy is gone


def test_ctrl_c_while_the_miss_policy_tunes_stops_at_once(monkeypatch):
  # The tuning runs on a thread of its own; an interrupt of the waiting thread must
  # not wait for it to end (a thread pool's shutdown did). A retry then waits on that
  # tuning: it started a second one beside it, which skewed both's times.
  import _thread
  import types
  release, started, ended = threading.Event(), [], []
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs[:40], rhs, gs)
  tuned = next(c for c in ba.autotuning_configs if c != ba.heuristics_config)

  def long_tuning(self, ba, **kwargs):
    started.append(ba)
    release.wait(60)
    ended.append(ba)
    return types.SimpleNamespace(best_config=tuned)

  monkeypatch.setattr(autotuner_lib.Autotuner, "tune_one", long_tuning)
  threading.Timer(0.2, _thread.interrupt_main).start()
  try:
    with pytest.raises(KeyboardInterrupt), resolution.miss_policy_scope("autotune"):
      resolution.resolve_config(ba)
    assert not ended  # interrupted while the tuning still ran
    assert autotuning.explain(ba).source == "heuristics"  # nothing kept yet
    threading.Timer(0.2, release.set).start()
    with resolution.miss_policy_scope("autotune"):
      assert resolution.resolve_config(ba).config == tuned
  finally:
    release.set()
  assert len(started) == 1 and autotuner_lib.config_tuned_on_miss(ba) == tuned
  autotuner_lib._TUNED_ON_MISS.pop(autotuner_lib._miss_key(ba))


def test_results_are_per_thread_context():
  import threading
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  seen = []
  result = autotuning.AutotuningResult("cpu")
  with result:
    t = threading.Thread(target=lambda: seen.append(resolution.active_results()))
    t.start(); t.join()
    assert resolution.active_results() == (result,)
  assert seen == [()]
  del ba


def test_bound_args_autotune_and_benchmark():
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  result = ba.autotune(progress=False, measure_options=FAST, strategy="exhaustive")
  assert len(result) == 1 and result.best_config(ba) in ba.autotuning_configs
  m = ba.benchmark(rounds=2, leader_rounds=0, max_total_s=0.3)
  assert m.status == "ok" and m.ci_low_s <= m.median_s <= m.ci_high_s
  from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig
  assert ba.benchmark(XlaRaggedDotConfig(strategy="masked"), rounds=2, leader_rounds=0).status == "ok"


def test_profiled_device_times_are_kept_and_shown():
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  options = dataclasses.replace(FAST, profile=True)
  def two(space, measure, *, heuristic, budget_s=None):  # the heuristic and one more
    other = next(c for c in sorted(space, key=repr) if c != heuristic)
    return search_lib.exhaustive([heuristic, other], measure, heuristic=heuristic)
  result = ba.autotune(progress=False, measure_options=options, strategy=two)
  (entry,) = result
  assert entry.profiled_time_of(entry.best_config) > 0
  assert all(m.profiled_s > 0 for _, m in entry.measurements if m.ok)
  header = result.summary().splitlines()[0]
  assert header.endswith("best profiled")
  again = stellarax.AutotuningResult.loads(result.dumps())
  assert again.entry(ba).profiled_time_of(entry.best_config) == entry.profiled_time_of(entry.best_config)
  # Without the option: no column, and nothing in the file.
  plain = ba.autotune(progress=False, measure_options=FAST, strategy=two)
  assert "profiled" not in plain.summary() and "profiled_s" not in plain.dumps()


def test_times_are_shown_in_a_unit_that_keeps_their_digits():
  from stellarax.autotuning.result import format_time
  assert [format_time(t) for t in (None, 2.5e-3, 1e-3, 12.34e-6, 1e-7, 2.3e-8)] == [
      "-", "2.500 ms", "1.000 ms", "12.3 us", "0.1 us", "23 ns"]


def _budget_spy(monkeypatch=None, spends=0.0):
  """A strategy that records each call's budget and measures its heuristic only; with
  monkeypatch, the tuner's clock says each call took `spends` of its budget."""
  seen, now = [], [0.0]
  if monkeypatch is not None:
    from stellarax.autotuning import autotuner as autotuner_lib
    monkeypatch.setattr(autotuner_lib, "_clock", lambda: now[0])
  def spy(space, measure, *, heuristic, budget_s=None):
    seen.append(budget_s)
    now[0] += spends * budget_s
    return search_lib.exhaustive([heuristic], measure, heuristic=heuristic)
  return spy, seen


def test_a_budget_pool_passes_what_a_call_leaves_to_the_next():
  a, b, c = _ragged_calls(3)
  pool = autotuning.autotuner.BudgetPool({a: 2.0, b: 1.0, c: 1.0}, 8.0)
  assert pool.take(a) == 4.0
  pool.spend(1.0)  # 3 s of its 4 left: 7 s for b and c
  assert pool.take(b) == 3.5
  pool.spend(5.0)  # overran: 2 s left
  assert pool.take(c) == 2.0
  pool.spend(3.0)
  assert pool.left_s == -1.0
  with pytest.raises(KeyError):  # a drew already
    pool.take(a)
  # An exhausted pool still gives a thousandth of the total: the heuristic gets measured.
  late = autotuning.autotuner.BudgetPool({a: 1.0}, 10.0)
  late.spend(20.0)
  assert late.take(a) == 0.01


def _profile_records(calls_and_times):
  """JSON as xplane_to_bound_args writes it."""
  return json.dumps({"calls": [{"bound_args": ba.to_json(), "count": 1, "device_time_s": t}
                               for ba, t in calls_and_times]})


def _ragged_calls(n):
  lhs, rhs, _ = _inputs()
  return [stellarax.XlaRaggedDot.bind(lhs[:16 * (i + 1)], rhs, jnp.array([16 * (i + 1), 0, 0, 0], jnp.int32))
          for i in range(n)]


def test_a_total_budget_is_shared_by_device_time_heaviest_first(monkeypatch):
  light, heavy, idle = _ragged_calls(3)
  records = _profile_records([(light, 1.0), (heavy, 3.0), (idle, 0.0)])
  spy, seen = _budget_spy(monkeypatch, spends=0.5)  # each call takes half its budget
  result = tuner(strategy=spy, total_budget_s=8.06).autotune(records)
  assert len(result) == 3
  # Weights 3, 1 and (no time in the profile) a hundredth of the heaviest, 0.03. Each
  # call, heaviest first, takes its weight's share of what is left.
  left = 8.06 - 0.5 * 6.0
  light_s = left / 1.03
  assert seen == pytest.approx([6.0, light_s, left - 0.5 * light_s])
  assert autotuning.call_weights_from_json(records) == {light: 1.0, heavy: 3.0, idle: 0.0}
  # One call recorded twice (e.g. under two names of its program): its times add up,
  # with or without a config in the record.
  twice = _profile_records([(light, 1.0), (light.with_config(light.heuristics_config), 0.5)])
  assert autotuning.call_weights_from_json(twice) == {light: 1.5}
  # Without device times (a plain list, a callable) the calls share it equally.
  spy, seen = _budget_spy(monkeypatch, spends=1.0)  # each call spends its share
  tuner(strategy=spy, total_budget_s=9.0).autotune([light, heavy, idle])
  assert seen == pytest.approx([3.0, 3.0, 3.0])
  assert autotuning.call_weights_from_json(autotuning.bound_args_to_json([light])) == {}


def test_a_profile_file_is_read_once_for_its_calls_and_their_weights(tmp_path, monkeypatch):
  light, heavy = _ragged_calls(2)
  path = tmp_path / "calls.json"
  path.write_text(_profile_records([(light, 1.0), (heavy, 3.0)]))
  reads = []
  read_text = autotuning.capture._read_text
  monkeypatch.setattr(autotuning.capture, "_read_text", lambda p: reads.append(p) or read_text(p))
  spy, seen = _budget_spy(monkeypatch, spends=1.0)  # each call spends its share
  result = tuner(strategy=spy, total_budget_s=4.0).autotune(path)
  assert len(result) == 2 and seen == pytest.approx([3.0, 1.0])
  assert reads == [path]  # the calls and their weights describe the same contents


def test_a_total_budget_counts_only_the_calls_still_to_tune(user_cache_dir, monkeypatch):
  light, heavy = _ragged_calls(2)
  tuner(cache=True).autotune([heavy])
  spy, seen = _budget_spy(monkeypatch, spends=1.0)  # each call spends its share
  tuner(strategy=spy, total_budget_s=4.0).autotune(_profile_records([(light, 1.0), (heavy, 3.0)]))
  assert seen == [4.0]  # the heavy call came from the cache


def test_other_implementations_share_their_calls_weight(monkeypatch):
  q = jax.random.normal(jax.random.key(9), (1, 16, 2, 8))
  small, big = (stellarax.XlaAttention.bind(x, x, x, is_causal=True) for x in (q[:, :8], q))
  spy, seen = _budget_spy(monkeypatch, spends=1.0)  # each call spends its share
  tuner(strategy=spy, total_budget_s=10.0, implementations="all").autotune(
      _profile_records([(small, 1.0), (big, 4.0)]))
  # big and its chunked twin weigh 4 each, small and its twin 1 each.
  assert sorted(seen) == pytest.approx([1.0, 1.0, 4.0, 4.0])


def two_sizes(lhs, rhs, gs):
  small = stellarax.ragged_dot(lhs[:16], rhs, jnp.array([16, 0, 0, 0], jnp.int32))
  return jnp.sum(stellarax.ragged_dot(lhs, rhs, gs)) + jnp.sum(small)


def test_a_callables_calls_are_weighed_by_a_profile_of_one_run(monkeypatch):
  lhs, rhs, gs = _inputs()
  calls = tuner().collect(two_sizes, lhs, rhs, gs)
  rows = lambda ba: max(spec.shape[0] for spec in ba.array_specs() if len(spec.shape) == 2)
  big, small = sorted(calls, key=rows, reverse=True)
  assert (rows(big), rows(small)) == (64, 16)
  # The profile's real times: both calls ran, each with some device time.
  from stellarax.autotuning import profile
  real = profile.device_time_per_call(lambda a, k: two_sizes(*a, **k), (lhs, rhs, gs), {})
  assert set(real) == {(ba.op_json(), ba.key_json()) for ba in (big, small)}
  assert all(t > 0 for t in real.values())
  # Its times set the shares (here fixed, so the test does not rest on timing).
  fixed = {(big.op_json(), big.key_json()): 3e-3, (small.op_json(), small.key_json()): 1e-3}
  monkeypatch.setattr(profile, "device_time_per_call", lambda fn, *a, **k: fixed)
  spy, seen = _budget_spy(monkeypatch, spends=1.0)  # each call spends its share
  tuner(strategy=spy, total_budget_s=4.0).autotune(two_sizes, lhs, rhs, gs)
  assert seen == pytest.approx([3.0, 1.0])
  # No profile to take (abstract arguments): equal shares.
  spy, seen = _budget_spy(monkeypatch, spends=1.0)  # each call spends its share
  specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (lhs, rhs, gs)]
  tuner(strategy=spy, total_budget_s=4.0).autotune(two_sizes, *specs)
  assert seen == pytest.approx([2.0, 2.0])


@pytest.mark.slow  # ~6 s
def test_a_failed_profile_leaves_equal_shares_with_a_warning(tmp_path, monkeypatch):
  lhs, rhs, gs = _inputs()
  spy, seen = _budget_spy(monkeypatch, spends=1.0)  # each call spends its share
  with jax.profiler.trace(str(tmp_path)):  # one trace at a time: the tuner's cannot start
    with pytest.warns(RuntimeWarning, match="share it equally, since profiling the program"):
      tuner(strategy=spy, total_budget_s=4.0).autotune(two_sizes, lhs, rhs, gs)
  assert seen == pytest.approx([2.0, 2.0])


def test_total_budget_errors_say_what_to_pass():
  with pytest.raises(ValueError, match="exclude each other; pass one of them"):
    stellarax.Autotuner(budget_s=1.0, total_budget_s=10.0)
  with pytest.raises(ValueError, match="total_budget_s=0 must be a positive number"):
    stellarax.Autotuner(total_budget_s=0)
  # Random sampling with no budget failed every call when it was tuned, naming an
  # argument (num_samples) an Autotuner does not take.
  with pytest.raises(ValueError, match="strategy='random' draws configs until its budget"):
    stellarax.Autotuner(strategy="random")
  stellarax.Autotuner(strategy="random", total_budget_s=10.0)
  for bad in (-1, float("inf"), float("nan")):
    with pytest.raises(ValueError, match=f"device_time_s={bad!r} must be a finite number"):
      autotuning.call_weights_from_json(_profile_records([(_ragged_calls(1)[0], bad)]))


def test_the_strategy_learns_what_an_effort_costs_from_the_measure_options():
  lhs, rhs, gs = _inputs()
  seen = []
  def spy(space, measure, *, heuristic, budget_s=None):
    seen.append(measure.effective_effort)
    return search_lib.exhaustive(space, measure, heuristic=heuristic, budget_s=budget_s)
  options = dataclasses.replace(FAST, rounds=10)
  stellarax.Autotuner(progress=False, measure_options=options, strategy=spy).autotune(
      [stellarax.XlaRaggedDot.bind(lhs, rhs, gs)])
  (effective,) = seen
  assert effective(1 / 81) == options.effective_effort(1 / 81) == 0.1


def test_all_implementations_and_cache_reuse(user_cache_dir):
  q = jax.random.normal(jax.random.key(9), (1, 16, 2, 8))
  f = lambda q: stellarax.dot_product_attention(q, q, q, is_causal=True)
  result = tuner(implementations="all", cache=True).autotune(f, q)
  assert {e.bound_args.op.name for e in result} == {"attention.xla_chunked", "attention.xla"}
  assert len(list(user_cache_dir.glob("*/*.json"))) == 2
  again = tuner(implementations="all").autotune(f, q)
  assert again == result  # reused from the user cache, nothing re-measured
  fresh = tuner(implementations="all", ignore_cache=True).autotune(f, q)
  # Re-measured: new samples give new medians.
  assert all(fresh.entry(e.bound_args).measurements != e.measurements for e in result)


def test_progress_counts_configs_once_and_ends_full():
  import io
  from stellarax.autotuning.progress import Progress
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  stream = io.StringIO()
  progress = Progress(len(ba.autotuning_configs), stream=stream)
  entry = tuner(strategy="racing", budget_s=2).tune_one(ba, progress=progress)
  assert progress.done == progress.total == len(ba.autotuning_configs)
  # It ended at "5/5 configs" where one was measured: those passed over are said.
  passed_over = progress.total - len(entry.measurements)
  assert progress.skipped == passed_over
  assert stream.getvalue().rstrip().split("\r")[-1].startswith(
      f"autotune [{'#' * 24}] {progress.total}/{progress.total} configs"
      + (f" ({passed_over} passed over)" if passed_over else "") + ",")


@pytest.mark.parametrize("option, value, says", [
    ("cache", "no", r"Autotuner\(cache='no'\): pass True or False"),  # "no" is truthy
    ("progress", 1, r"Autotuner\(progress=1\): pass True or False"),
    ("isolate", None, r"Autotuner\(isolate=None\): pass True or False"),
    ("measure_options", {"rounds": 3}, r"pass a stellarax.autotuning.MeasureOptions"),
    ("seed", 1.5, r"Autotuner\(seed=1.5\): pass an int"),
])
def test_options_of_the_wrong_type_are_refused(option, value, says):
  with pytest.raises(TypeError, match=says):
    stellarax.Autotuner(**{option: value})


@pytest.mark.parametrize("option, value, says", [
    # Each was accepted, then failed every call with a KeyError or a bare comparison.
    ("strategy", None, r"strategy=None must be one of .* or a search function"),
    ("strategy", ["racing"], r"strategy=\['racing'\] must be one of"),
    ("distributed_timeout_s", "10", r"distributed_timeout_s='10' must be a positive number"),
    ("budget_s", True, r"budget_s=True must be a positive number of seconds or None"),
])
def test_options_of_the_wrong_value_are_refused_when_made(option, value, says):
  with pytest.raises(ValueError, match=says):
    stellarax.Autotuner(**{option: value})
  assert stellarax.Autotuner(budget_s=np.float32(1.5)).budget_s == 1.5  # NumPy's numbers too


def test_prune_returning_no_configs_says_what_to_return():
  (call,) = _ragged_calls(1)
  for junk in (None, 1, call.heuristics_config):
    with pytest.raises(autotuning.IncompleteTuningError) as caught:
      tuner(prune=lambda ba, configs, junk=junk: junk, budget_s=1).autotune([call])
    assert "it must return the configs to measure" in str(caught.value.errors[call])


def test_a_measured_entry_beats_an_unmeasured_one_in_a_merge(grad_result):
  """An entry with no successful time (every config failed, or a hand-written one) never
  replaces a measured one of the same call, on either side of `|`."""
  entry = next(iter(grad_result))
  failed = tuple((c, m.__class__(**{**m.to_json(), "status": "runtime_error", "median_s": None,
                                    "ci_low_s": None, "ci_high_s": None, "num_samples": 0,
                                    "error": "RuntimeError: out of memory"}))
                 for c, m in entry.measurements)
  unmeasured = autotuning.Entry(entry.bound_args, entry.best_config, entry.heuristic_config, failed)
  assert unmeasured.best_time is None
  other = autotuning.AutotuningResult(grad_result.device_kind, {unmeasured.key: unmeasured})
  assert (other | grad_result).entry(entry.bound_args) == entry
  assert (grad_result | other).entry(entry.bound_args) == entry


def test_the_content_digest_follows_the_best_configs(grad_result):
  """Transfer indexes results by their digest: one that ignored a changed best config
  would serve a stale index."""
  entry = next(e for e in grad_result if len(e.measurements) > 1)
  other_config = next(c for c, _ in entry.measurements if c != entry.best_config)
  changed = autotuning.Entry(entry.bound_args, other_config, entry.heuristic_config,
                             entry.measurements)
  assert grad_result.with_entry(changed).content_digest != grad_result.content_digest
  assert grad_result.with_entry(entry).content_digest == grad_result.content_digest


def test_files_of_a_newer_schema_or_no_device_kind_are_refused():
  from stellarax.autotuning import file_format
  good = dict(schema=file_format.SCHEMA_VERSION, device_kind="cpu", entries=[])
  assert file_format.parse(json.dumps(good), source="ok.json")["device_kind"] == "cpu"
  newer = good | dict(schema=file_format.SCHEMA_VERSION + 1)
  with pytest.raises(file_format.FormatError, match="newer.json: schema .* is newer"):
    file_format.parse(json.dumps(newer), source="newer.json")
  with pytest.raises(file_format.FormatError, match="must name a device kind"):
    file_format.parse(json.dumps(good | dict(device_kind="")), source="blank.json")


def test_the_heuristic_config_is_measured_first():
  """Measured first, the heuristic is timed before any budget runs out, and it is the
  reference every later candidate must beat beyond noise."""
  from stellarax.autotuning import autotuner as autotuner_module
  ba = stellarax.XlaRaggedDot.bind(*_inputs())
  space = autotuner_module._ordered_space(ba)
  assert space[0] == ba.heuristics_config and len(space) == len(set(space)) > 1


def test_a_budget_too_small_to_search_says_so():
  light, heavy = _ragged_calls(2)
  assert len(light.autotuning_configs) > 1
  # Far less than one measurement takes: each call measures its heuristic only.
  with pytest.warns(autotuning.SmallBudgetWarning, match=r"budget_s=0.001\) was too small for 2 of the 2"):
    result = stellarax.Autotuner(budget_s=0.001, progress=False).autotune([light, heavy])
  assert all(len(e.measurements) == 1 and e.best_config == e.heuristic_config for e in result)
  # Without a budget every config is measured: nothing to say.
  with warnings.catch_warnings():
    warnings.simplefilter("error", autotuning.SmallBudgetWarning)
    result = stellarax.Autotuner(progress=False).autotune([light])
  assert len(next(iter(result)).measurements) == len(light.autotuning_configs)


def test_tuning_spread_over_devices_warns_of_a_starved_budget_too(monkeypatch):
  # Only tuning on one device warned: over several (every sharded run) it was silent.
  from stellarax.autotuning import distributed
  (call,) = _ragged_calls(1)
  heuristic = call.heuristics_config
  ok = measure_lib.Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3,
                               num_samples=3)
  starved = autotuning.Entry(call, heuristic, heuristic, ((heuristic, ok),))
  monkeypatch.setattr(distributed, "should_distribute", lambda: True)
  monkeypatch.setattr(distributed, "tune_distributed", lambda tuner, calls, **k:
                      autotuning.AutotuningResult(cache_lib.current_device_kind(),
                                                  {starved.key: starved}))
  with pytest.warns(autotuning.SmallBudgetWarning, match="too small for 1 of the 1 calls"):
    stellarax.Autotuner(budget_s=0.01, progress=False).autotune([call])
  with warnings.catch_warnings():  # no budget: the whole space was the search
    warnings.simplefilter("error", autotuning.SmallBudgetWarning)
    stellarax.Autotuner(progress=False).autotune([call])


def test_a_cached_entry_the_budget_starved_is_tuned_again(user_cache_dir):
  # Following the warning's advice, a bigger budget must search, not reuse an entry
  # that measured only its heuristic config.
  (call,) = _ragged_calls(1)
  with pytest.warns(autotuning.SmallBudgetWarning, match="is tuned again, not reused"):
    stellarax.Autotuner(budget_s=0.001, progress=False, cache=True).autotune([call])
  (cached,) = stellarax.autotuning.USER_CACHE.results()[0]
  assert len(cached.measurements) == 1
  (entry,) = stellarax.Autotuner(progress=False, cache=True).autotune([call])
  assert len(entry.measurements) == len(call.autotuning_configs)
  (cached,) = stellarax.autotuning.USER_CACHE.results()[0]
  assert cached == entry
  # A searched entry is reused as it is.
  (again,) = stellarax.Autotuner(progress=False, cache=True).autotune([call])
  assert again == entry


def test_a_searched_entry_wins_a_merge_with_a_faster_starved_one(user_cache_dir):
  # The starved entry won on a time of another run (5% noise), so the cache kept it, and
  # every `autotune(cache=True)` tuned the call again without ever caching the search.
  (call,) = _ragged_calls(1)
  heuristic, space = call.heuristics_config, call.autotuning_configs
  ok = lambda t: measure_lib.Measurement(status="ok", median_s=t, ci_low_s=t, ci_high_s=t,
                                         num_samples=8)
  starved = autotuning.Entry(call, heuristic, heuristic, ((heuristic, ok(1.00e-3)),))
  searched = autotuning.Entry(call, heuristic, heuristic, tuple(
      (c, ok(1.05e-3 if c == heuristic else 2e-3)) for c in space))
  assert starved.starved() and not searched.starved() and len(space) > 1
  kind = cache_lib.current_device_kind()
  a, b = (autotuning.AutotuningResult(kind, {e.key: e}) for e in (starved, searched))
  assert (a | b).entry(call) == searched == (b | a).entry(call)
  from stellarax.autotuning.result import why_kept  # what a file holding both warns
  assert why_kept(searched, starved) == ("it searched its space, the other measured only its "
                                         "heuristic config")
  for entry in (starved, searched):  # the user cache merges the same way
    cache_lib.USER_CACHE.write(autotuning.AutotuningResult(kind, {entry.key: entry}))
  assert cache_lib.USER_CACHE.result_for(kind, call.op.name).entry(call) == searched


def test_a_space_pruned_to_its_heuristic_is_not_taken_for_a_starved_one(user_cache_dir):
  # It was: every run tuned the call again, and warned that the budget was too small.
  (call,) = _ragged_calls(1)
  tuner = lambda: stellarax.Autotuner(prune=lambda ba, configs: [], budget_s=100.0,
                                      progress=False, cache=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error", autotuning.SmallBudgetWarning)
    (entry,) = tuner().autotune([call])
    assert len(entry.measurements) == 1 and "/pruned 1/" in entry.method
    measured = []
    with mock.patch.object(stellarax.Autotuner, "tune_one",
                           side_effect=lambda *a, **k: measured.append(a)):
      (again,) = tuner().autotune([call])
  assert again == entry and not measured


def test_progress_reaches_its_total_when_prune_leaves_configs_out():
  # It counted every config of the space but advanced only for those prune kept.
  (call,) = _ragged_calls(1)
  ends = []
  real = autotuning.progress.Progress.close

  def close(self):
    ends.append((self.done, self.total))
    real(self)

  with mock.patch.object(autotuning.progress.Progress, "close", close):
    stellarax.Autotuner(prune=lambda ba, configs: configs[:2], progress=True).autotune([call])
  assert ends == [(len(call.autotuning_configs),) * 2]


def _with_times(entry, factor):
  """`entry` with every ok measurement's times multiplied by `factor`."""
  measurements = tuple(
      (c, m.__class__(**{**m.to_json(), "median_s": m.median_s * factor,
                         "ci_low_s": m.ci_low_s * factor, "ci_high_s": m.ci_high_s * factor})
       if m.status == "ok" else m) for c, m in entry.measurements)
  return dataclasses.replace(entry, measurements=measurements)


def test_a_tie_in_a_merge_does_not_depend_on_the_order(grad_result):
  entry = next(iter(grad_result))
  # As fast, with other measurements of the other configs: neither is faster, so the
  # order of the operands must not decide.
  rival = dataclasses.replace(entry, measurements=tuple(
      (c, m) if c == entry.best_config else _with_times(
          dataclasses.replace(entry, measurements=((c, m),)), 2.0).measurements[0]
      for c, m in entry.measurements))
  assert rival.best_time == entry.best_time and rival != entry
  a = autotuning.AutotuningResult(grad_result.device_kind, {entry.key: entry})
  b = autotuning.AutotuningResult(grad_result.device_kind, {entry.key: rival})
  assert a | b == b | a


def test_a_binary_file_is_a_format_error_and_the_cache_passes_it_over(tmp_path, user_cache_dir):
  binary = tmp_path / "result.json"
  binary.write_bytes(b"\xff\xfe\x00garbage")
  with pytest.raises(file_format.FormatError, match="result.json: not a text file"):
    stellarax.AutotuningResult.load(binary)
  with pytest.raises(ValueError, match="result.json: not a text file"):
    autotuning.bound_args_from_json(binary)
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), ba.op.name)
  path.parent.mkdir(parents=True)
  path.write_bytes(binary.read_bytes())
  with pytest.warns(autotuning.CacheWarning, match="not a text file.*passes over it") as caught:
    assert autotuning.explain(ba).source == "heuristics"
  # Named at the user's line, not at stellarax's or JAX's own.
  assert [w.filename for w in caught] == [__file__]


def test_a_newer_stellarax_s_cache_file_is_left_as_it_is(user_cache_dir, grad_result):
  entry = next(iter(grad_result))
  path = cache_lib.USER_CACHE.path_for(grad_result.device_kind, entry.bound_args.op.name)
  path.parent.mkdir(parents=True)
  newer = json.loads(grad_result.dumps()) | {"schema": file_format.SCHEMA_VERSION + 1}
  path.write_text(json.dumps(newer))
  with pytest.warns(autotuning.CacheWarning, match="newer than this stellarax.*left as it is"):
    cache_lib.USER_CACHE.write(grad_result)
  assert json.loads(path.read_text()) == newer
  assert not list(path.parent.glob("*.unreadable"))


def test_tuning_into_a_cache_a_newer_stellarax_wrote_keeps_its_journal_and_says_so(
    user_cache_dir):
  # Its file left alone, the entry was not cached, yet the tuning journal was deleted, with
  # no CacheWriteWarning (so `stellarax autotune --cache` exited 0 having kept nothing).
  (ba,) = _ragged_calls(1)
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), ba.op.name)
  path.parent.mkdir(parents=True)
  newer = {"schema": file_format.SCHEMA_VERSION + 1, "device_kind": "cpu", "entries": []}
  path.write_text(json.dumps(newer))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = tuner(cache=True, budget_s=0.5).autotune([ba])
  assert len(result) == 1 and json.loads(path.read_text()) == newer
  failed = [w.message for w in caught if isinstance(w.message, autotuning.CacheWriteWarning)]
  assert len(failed) == 1 and "ragged_dot.xla were written by a newer stellarax" in str(failed[0])
  assert failed[0].reason and failed[0].error is None
  assert list(path.parent.glob("*.journal"))  # kept: a rerun elsewhere resumes
  read = [str(w.message) for w in caught if "newer than this stellarax" in str(w.message)]
  assert read and not any("cache clear" in m for m in read), read  # its data: never clear it


def test_a_cache_file_rewritten_within_one_clock_tick_is_read_again(user_cache_dir,
                                                                   grad_result):
  # A coarse clock gives two writes one mtime; the new file's inode tells them apart.
  entry = next(iter(grad_result))
  kind, op = grad_result.device_kind, entry.bound_args.op.name
  path = cache_lib.USER_CACHE.path_for(kind, op)
  cache_lib.USER_CACHE.write(grad_result)
  assert cache_lib.USER_CACHE.result_for(kind, op).entry(entry.bound_args) == entry
  stamp = path.stat().st_mtime_ns
  other = dataclasses.replace(entry, measured_at="2001-02-03T04:05:06Z")
  cache_lib.USER_CACHE.write(autotuning.AutotuningResult(kind, {other.key: other}), replace=True)
  os.utime(path, ns=(stamp, stamp))
  assert cache_lib.USER_CACHE.result_for(kind, op).entry(entry.bound_args) == other


def test_unreadable_cache_files_moved_aside_never_overwrite_each_other(user_cache_dir,
                                                                       grad_result):
  entry = next(iter(grad_result))
  path = cache_lib.USER_CACHE.path_for(grad_result.device_kind, entry.bound_args.op.name)
  path.parent.mkdir(parents=True)
  for garbage in ("{first", "{second"):
    path.write_text(garbage)
    with pytest.warns(autotuning.CacheWarning, match="moved to"):
      cache_lib.USER_CACHE.write(grad_result)
  aside = sorted(p.read_text() for p in path.parent.glob("*.json.unreadable"))
  assert aside == ["{first", "{second"]
  assert cache_lib.USER_CACHE.clear() == 2 + 2 + 2  # results, locks, the two aside


def _two_calls_of_one_op(grad_result):
  """The forward entry of `grad_result`, and one like it for a call of other shapes."""
  entry = next(e for e in grad_result if e.bound_args.op.name == "ragged_dot.xla")
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs[:48], rhs, jnp.array([20, 0, 14, 14], jnp.int32))
  return entry, dataclasses.replace(entry, bound_args=ba)


def _result_of(*entries):
  return autotuning.AutotuningResult(cache_lib.current_device_kind(),
                                     {e.key: e for e in entries})


def test_an_invalid_entry_of_a_cache_file_costs_that_entry_alone(user_cache_dir, grad_result):
  entry, other = _two_calls_of_one_op(grad_result)
  cache_lib.USER_CACHE.write(_result_of(entry, other))
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), "ragged_dot.xla")
  data = json.loads(path.read_text())
  for raw in data["entries"]:
    if raw["bound_args"] == entry.bound_args.with_config(None).to_json():
      raw["best_config"]["tile_m"] = 100  # not a power of two: invalid under these versions
  path.write_text(json.dumps(data))
  # Read: the other entry still answers (the whole file was passed over before).
  with pytest.warns(autotuning.CacheWarning, match=r"entry \d is invalid \(tile_m=100.*reads the rest"):
    cached = cache_lib.USER_CACHE.result_for(cache_lib.current_device_kind(), "ragged_dot.xla")
  assert cached.entry(other.bound_args) == other and cached.entry(entry.bound_args) is None
  # Write: the good entries stay live (only the new ones were left before), the file as it
  # was is kept aside, and loading it by hand still says what is wrong.
  fresh = _with_times(entry, 0.5)
  with pytest.warns(autotuning.CacheWarning, match=r"kept at .*json\.unreadable; its other 1 entries"):
    cache_lib.USER_CACHE.write(_result_of(fresh))
  assert stellarax.AutotuningResult.load(path) == _result_of(fresh, other)
  aside = path.with_suffix(".json.unreadable")
  assert json.loads(aside.read_text()) == data
  with pytest.raises(file_format.FormatError, match="is invalid"):
    stellarax.AutotuningResult.load(aside)


def test_entries_another_stellarax_wrote_survive_this_one_s_writes_until_pruned(user_cache_dir,
                                                                               grad_result):
  # Two environments share a cache: a newer stellarax's entry, whose configs carry a field
  # this one does not know, cannot be read here, and was deleted by this one's next write.
  entry, other = _two_calls_of_one_op(grad_result)
  cache_lib.USER_CACHE.write(_result_of(other))
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), "ragged_dot.xla")
  data = json.loads(path.read_text())
  newer = data["entries"][0] | {"versions": {**file_format.current_versions(), "stellarax": "9.0"}}
  for config in [newer["best_config"], newer["heuristic_config"],
                 *(m["config"] for m in newer["measurements"])]:
    config["added_later"] = 1
  path.write_text(json.dumps(data | {"entries": [newer]}))
  with pytest.warns(file_format.VersionWarning, match="other versions"):
    cache_lib.USER_CACHE.write(_result_of(entry))
  on_disk = json.loads(path.read_text())["entries"]
  assert len(on_disk) == 2 and newer in on_disk
  with pytest.warns(file_format.VersionWarning, match="other versions"):
    assert stellarax.AutotuningResult.load(path) == _result_of(entry)
  # Stale here all the same: pruning removes it.
  assert [(p.removed, p.kept) for p in cache_lib.USER_CACHE.prune()] == [(1, 1)]
  assert json.loads(path.read_text())["entries"] == [file_format.entry_to_json(entry)]
  # And a new measurement of the same call takes its place.
  path.write_text(json.dumps(data | {"entries": [newer]}))
  with pytest.warns(file_format.VersionWarning, match="other versions"):
    cache_lib.USER_CACHE.write(_result_of(other))
  assert json.loads(path.read_text())["entries"] == [file_format.entry_to_json(other)]


def test_a_cache_file_of_another_device_kind_in_this_one_s_folder(user_cache_dir, grad_result):
  # An H200 result copied into this device's folder: not applied here, and moved aside
  # by the next write instead of failing it.
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  path = cache_lib.USER_CACHE.path_for(cache_lib.current_device_kind(), ba.op.name)
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps(json.loads(grad_result.dumps()) | {"device_kind": "NVIDIA H200"}))
  with pytest.warns(autotuning.CacheWarning, match="holds results of 'NVIDIA H200'.*NVIDIA_H200"):
    assert autotuning.explain(ba).source == "heuristics"
  with pytest.warns(autotuning.CacheWarning, match="moved to"):
    result = tuner(cache=True).autotune([ba])
  assert stellarax.AutotuningResult.load(path) == result


def test_re_measuring_with_ignore_cache_replaces_the_cached_entry(user_cache_dir, grad_result):
  entry = next(e for e in grad_result if e.bound_args.op.name == "ragged_dot.xla")
  lucky = _with_times(entry, 1e-3)  # an old time no new measurement would beat
  cache_lib.USER_CACHE.write(autotuning.AutotuningResult(grad_result.device_kind,
                                                         {lucky.key: lucky}))
  result = tuner(cache=True, ignore_cache=True).autotune([entry.bound_args])
  cached = cache_lib.USER_CACHE.result_for(grad_result.device_kind, entry.bound_args.op.name)
  assert cached.entry(entry.bound_args) == result.entry(entry.bound_args) != lucky
  # Without ignore_cache, the cached entry is reused, and a merge keeps the faster.
  cache_lib.USER_CACHE.write(autotuning.AutotuningResult(grad_result.device_kind,
                                                         {lucky.key: lucky}))
  cached = cache_lib.USER_CACHE.result_for(grad_result.device_kind, entry.bound_args.op.name)
  assert cached.entry(entry.bound_args) == lucky


def test_lookups_give_the_best_config_its_time_or_an_accepted_one(grad_result):
  entry = next(iter(grad_result))
  ok = [(c, m) for c, m in entry.measurements if m.ok]
  assert grad_result.lookup_config(entry.bound_args) == entry.best_config
  assert grad_result.lookup_time(entry.bound_args) == entry.time_of(entry.best_config) > 0
  other = next(c for c, _ in ok if c != entry.best_config)  # refused the best, one accepted
  assert grad_result.lookup_config(entry.bound_args, lambda c: c == other) == other
  assert grad_result.lookup_config(entry.bound_args, lambda c: False) is None
  empty = autotuning.AutotuningResult(grad_result.device_kind)
  assert empty.lookup_config(entry.bound_args) is None
  assert empty.lookup_time(entry.bound_args) is None


def test_the_user_cache_is_under_the_platform_s_cache_folder(monkeypatch, tmp_path):
  monkeypatch.delenv("STELLARAX_CACHE_DIR", raising=False)
  monkeypatch.setattr(cache_lib.sys, "platform", "linux")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cache_lib.user_cache_root() == tmp_path / "xdg" / "stellarax" / "autotuning"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path))
  assert cache_lib.user_cache_root() == tmp_path / ".cache" / "stellarax" / "autotuning"


def test_a_cache_folder_from_the_environment_may_start_with_a_tilde(monkeypatch, tmp_path):
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv("STELLARAX_CACHE_DIR", "~/tuned")
  assert cache_lib.user_cache_root() == tmp_path / "tuned"


def test_prune_narrows_each_calls_space_and_keeps_the_heuristic():
  (call,) = _ragged_calls(1)
  space, heuristic = call.autotuning_configs, call.heuristics_config
  given = []

  def only_lax(ba, configs):
    given.append((ba, configs))
    return [c for c in configs if c.strategy == "lax"]

  (entry,) = tuner(prune=only_lax).autotune([call])
  (ba, configs), = given
  assert ba == call and set(configs) == set(space) and configs[0] == heuristic
  kept = {c for c in space if c.strategy == "lax"} | {heuristic}
  assert {c for c, _ in entry.measurements} == kept and len(kept) < len(space)
  assert entry.method.endswith(f"/pruned {len(kept)}/{len(space)}")
  # It may drop configs, not add them; and it must be a function.
  stranger = dataclasses.replace(heuristic, tile_m=4096)
  assert stranger not in space
  with pytest.raises(autotuning.IncompleteTuningError, match="not in the space of ragged_dot.xla"):
    tuner(prune=lambda ba, configs: [stranger]).autotune([call])
  with pytest.raises(TypeError, match="pass a function"):
    stellarax.Autotuner(prune=["lax"])


@stellarax.config_dataclass
class _ShapeConfig:
  rows: str = "all"  # "all": the op's output; "drop_last": one row short; "bad": no trace
  k: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Rows(stellarax.Op, name="tests.rows_of_heuristic"):
  """sin(x), computed whole or (a config's defect) one row short, or not at all."""

  config_cls = _ShapeConfig
  heuristic: str = "all"

  def _fwd(self, x, *, config):
    if config.rows == "bad":
      raise ValueError("this config cannot be traced")
    y = jnp.sin(x)
    return (y[:-1] if config.rows == "drop_last" else y), None

  def _reference(self, x):
    return jnp.sin(x)

  def _get_heuristics_config(self, ba):
    return _ShapeConfig(rows=self.heuristic)

  def _get_autotuning_configs(self, ba):
    return {_ShapeConfig(rows=self.heuristic), _ShapeConfig(rows="all", k=1),
            _ShapeConfig(rows="drop_last", k=2)}


@pytest.mark.parametrize("heuristic", ["drop_last", "bad"])
def test_output_shapes_are_the_reference_s_where_the_heuristic_s_differ_or_fail(heuristic):
  # The heuristic's program set the output types every config was judged by: one a row
  # short made every correct config a wrong result ("differ from the expected"). One that
  # cannot be traced leaves the reference's shapes to judge by (the value check also
  # refuses a config a row short).
  x = jax.random.normal(jax.random.key(0), (8, 16))
  (entry,) = stellarax.Autotuner(progress=False, measure_options=FAST).autotune(
      [_Rows(heuristic=heuristic).bind(x)])
  measured = {c.k: m for c, m in entry.measurements}  # the heuristic's k is 0
  assert entry.best_config == _ShapeConfig(rows="all", k=1) and measured[1].ok
  assert measured[0].status == ("wrong_result" if heuristic == "drop_last" else "compile_error")
  assert measured[2].status == "wrong_result"
