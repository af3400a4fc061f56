"""The GPU benchmark script runs end to end on the CPU (tiny shapes)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_smoke_run(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path),
                         "--tune-budget-s", "2"], capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  impls = {r["impl"] for r in rows}
  assert {"ragged_dot.xla heuristic", "ragged_dot.pallas_triton heuristic", "xla jax.lax.ragged_dot"} <= impls
  checked = [r for r in rows if r["max_rel_err"] is not None]
  assert checked and all(r["max_rel_err"] < 1e-3 for r in checked), [r for r in checked if r["max_rel_err"] >= 1e-3]
  assert (tmp_path / "tuned.json").exists()
  assert proc.stdout.strip().splitlines()[-1].startswith("layer_norm")  # the table is printed last


def _gpu_check():
  import importlib.util
  spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_check"] = module  # dataclasses look their module up while it loads
  spec.loader.exec_module(module)
  return module


def _rows(out):
  return json.loads((out / "results.json").read_text())["rows"]


def test_deadline_stops_tuning_then_skips_workloads(tmp_path):
  gpu_check = _gpu_check()
  args = ["--smoke", "--no-profile", "--only", "rms_norm", "--tune-budget-s", "2"]
  gpu_check.main([*args, "--out", str(tmp_path / "late"), "--deadline-s", "0"])
  late = _rows(tmp_path / "late")
  assert {r["workload"] for r in late} == {"rms_norm (64, 256) fwd", "rms_norm (64, 256) fwd+bwd"}
  assert not any("tuned" in r["impl"] for r in late)  # past the deadline: untuned
  assert all(r["median_ms"] for r in late if r["status"] == "ok")
  gpu_check.main([*args, "--out", str(tmp_path / "over"), "--deadline-s", "-61"])
  assert {r["status"] for r in _rows(tmp_path / "over")} == {"skipped: past the -61 s deadline"}


def test_profile_step_finds_every_op_family(tmp_path, capsys):
  calls = _gpu_check().record_profile(tmp_path / "profile", smoke=True)
  names = {json.loads(c.marker)["op"]["name"].split(".")[0] for c in calls}
  assert names == {"ragged_dot", "attention", "layer_norm"}
  assert all(c.count >= 3 and c.device_time_s > 0 for c in calls)
  assert list((tmp_path / "profile").rglob("*.xplane.pb"))
  assert "profile: ragged_dot." in capsys.readouterr().out
