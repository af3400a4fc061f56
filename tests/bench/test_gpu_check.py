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
  assert proc.stdout.strip().splitlines()[-1].startswith("rms_norm")  # the table is printed last
