"""xplane_to_bound_args: profile a model on CPU, extract, tune, run."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import MeasureOptions
from stellarax.tools import xplane_to_bound_args
from profiling import drop_live_programs  # tests/ is on sys.path


def _model(lhs, rhs, gs, x):
  y = stellarax.ragged_dot(lhs, rhs, gs)
  return (stellarax.rms_norm(y, None) ** 2).sum() + stellarax.gated_linear_unit(x, rhs[:, :, :4].transpose(1, 0, 2)[:, :2]).sum()


def _args():
  k = jax.random.split(jax.random.key(5), 3)
  return (jax.random.normal(k[0], (64, 32)), jax.random.normal(k[1], (4, 32, 16)),
          jnp.array([10, 30, 0, 20], jnp.int32), jax.random.normal(k[2], (8, 32)))


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
  drop_live_programs()
  folder = tmp_path_factory.mktemp("trace")
  args = _args()
  step = jax.jit(jax.value_and_grad(_model, argnums=(0, 1, 3)))
  jax.block_until_ready(step(*args))
  with jax.profiler.trace(str(folder)):
    for _ in range(3):
      jax.block_until_ready(step(*args))
  return folder


def test_extracts_the_same_calls_as_get_bound_args(profile_dir, tmp_path):
  out = tmp_path / "ba.json"
  assert xplane_to_bound_args.main([f"--xplane_file={profile_dir}", f"--output_file={out}"]) == 0
  data = json.loads(out.read_text())
  times = [c["device_time_s"] for c in data["calls"]]
  assert times == sorted(times, reverse=True) and all(t > 0 for t in times)
  assert all(c["count"] == 3 for c in data["calls"])
  expected = autotuning.get_bound_args(jax.value_and_grad(_model, argnums=(0, 1, 3)), *_args())
  assert set(autotuning.bound_args_from_json(str(out))) == set(expected)


def test_tune_from_the_profile_and_run_inside_the_result(profile_dir, tmp_path):
  out = tmp_path / "ba.json"
  xplane_to_bound_args.main([f"--xplane_file={profile_dir}", f"--output_file={out}"])
  fast = MeasureOptions(rounds=2, leader_rounds=0, warmup_s=0.0, max_total_s=0.3, min_batch_s=2e-4)
  result = stellarax.Autotuner(progress=False, measure_options=fast).autotune(str(out))
  assert len(result) == len(json.loads(out.read_text())["calls"])
  args = _args()
  with result:
    tuned = jax.jit(_model)(*args)
  np.testing.assert_allclose(tuned, _model(*args), rtol=1e-4)


@pytest.mark.parametrize("content", [b"not a profile at all", b""])
def test_bad_files_exit_2_without_traceback(tmp_path, content):
  bad = tmp_path / "x.xplane.pb"
  bad.write_bytes(content)
  proc = subprocess.run([sys.executable, "-m", "stellarax.tools.xplane_to_bound_args",
                         f"--xplane_file={bad}", f"--output_file={tmp_path / 'o.json'}"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "x.xplane.pb" in proc.stderr and "Traceback" not in proc.stderr


def test_an_output_file_in_no_folder_is_refused_before_the_profile_is_read(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "stellarax.tools.xplane_to_bound_args",
                         f"--xplane_file={tmp_path / 'missing.xplane.pb'}",
                         f"--output_file={tmp_path / 'no' / 'o.json'}"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "--output_file=" in proc.stderr and "no folder" in proc.stderr


def test_an_output_file_that_is_the_profile_is_refused(profile_dir, tmp_path, capsys):
  # It was overwritten with the JSON: the profile, which may take long to record again,
  # was lost.
  (pb,) = profile_dir.rglob("*.xplane.pb")
  before = pb.read_bytes()
  for given in (profile_dir, pb):
    assert xplane_to_bound_args.main([f"--xplane_file={given}", f"--output_file={pb}"]) == 2
    assert "is the input file" in capsys.readouterr().err
  assert pb.read_bytes() == before


def test_profile_without_ops_is_a_clear_error(tmp_path):
  drop_live_programs()
  folder = tmp_path / "plain"
  f = jax.jit(lambda x: jnp.sin(x) * 2)
  with jax.profiler.trace(str(folder)):
    jax.block_until_ready(f(jnp.ones(8)))
  code = xplane_to_bound_args.main([f"--xplane_file={folder}", f"--output_file={tmp_path / 'o.json'}"])
  assert code == 2


def test_profile_from_another_version_is_a_clear_error(tmp_path, capsys):
  from jax.experimental.xla_metadata import xla_metadata_call2
  drop_live_programs()
  marker = json.dumps({"op": {"name": "ragged_dot.removed_backend", "fields": {}}, "arguments": {}})
  f = jax.jit(xla_metadata_call2(lambda x: jnp.tanh(x) * 3, {"stellarax_op": marker}))
  folder = tmp_path / "old"
  with jax.profiler.trace(str(folder)):
    jax.block_until_ready(f(jnp.ones(16)))
  code = xplane_to_bound_args.main([f"--xplane_file={folder}", f"--output_file={tmp_path / 'o.json'}"])
  assert code == 2
  err = capsys.readouterr().err
  assert "another version" in err and "ragged_dot.removed_backend" in err


def test_says_which_trace_it_read_when_a_folder_holds_several(profile_dir, tmp_path, capsys):
  import os
  import shutil
  (newest,) = profile_dir.rglob("*.xplane.pb")
  older = tmp_path / "traces" / "plugins" / "profile" / "older" / newest.name
  older.parent.mkdir(parents=True)
  shutil.copy(newest, older)
  os.utime(older, (1, 1))
  newer = tmp_path / "traces" / "plugins" / "profile" / "newer" / newest.name
  newer.parent.mkdir()
  shutil.copy(newest, newer)
  out = tmp_path / "ba.json"
  assert xplane_to_bound_args.main([f"--xplane_file={tmp_path / 'traces'}",
                                    f"--output_file={out}"]) == 0
  printed = capsys.readouterr().out
  assert f"read {newer} (the newest trace; 1 file of older traces" in printed, printed


def test_one_call_run_under_two_pinned_configs_is_one_record(tmp_path):
  # It came out as two records with the same bound arguments, each with half the time
  # (which --total-budget-s shares the budget by).
  from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig
  drop_live_programs()
  lhs, rhs, gs, _ = _args()
  pinned = [stellarax.XlaRaggedDot(config=XlaRaggedDotConfig(strategy=s, tile_m=64))
            for s in ("tiled", "lax")]
  f = jax.jit(lambda l, r, g: sum(stellarax.ragged_dot(l, r, g, implementation=op) for op in pinned))
  jax.block_until_ready(f(lhs, rhs, gs))
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(2):
      jax.block_until_ready(f(lhs, rhs, gs))
  (record,) = xplane_to_bound_args.extract(tmp_path)
  assert record["count"] == 4 and record["device_time_s"] > 0
