"""The GPU benchmark script runs end to end on the CPU (tiny shapes)."""

import collections
import json
import os
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from stellarax.autotuning.measure import Measurement
from profiling import drop_live_programs  # tests/ is on sys.path

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
  lines = proc.stdout.strip().splitlines()
  paths = lines.index("== code paths (tuning measurements of one op call) ==")
  profiled = lines.index("== timing vs the profiler's device time ==")
  table = lines[lines.index("== all workloads ==") + 1:profiled]
  # Every timed row was profiled too (XLA:CPU's thunks are the CPU's device events).
  timed = [r for r in rows if r["median_ms"]]
  assert timed and all(r["profiled_ms"] > 0 for r in timed), [r for r in timed if not r["profiled_ms"]]
  assert re.fullmatch(rf"\d+ of {len(timed)} profiled rows within 1.2x of their profiled device"
                      r" time; 0 timed rows without one", lines[paths - 2]), lines[profiled:paths]
  # The whole table (the gated linear unit last in smoke runs, after the sliding-window
  # attention), the code paths of every tuned op call, then the targets.
  assert any(line.startswith("attention") and "window=32" in line for line in table), table
  assert table[-2].startswith("gated_linear_unit"), table
  faster = lines.index("== code paths faster than the heuristic (beyond both confidence intervals) ==")
  code_paths = lines[paths + 1:faster - 1]
  assert lines[faster + 1:lines.index("== targets ==") - 1]  # the variants, or "none"
  assert any(line.startswith("ragged_dot.pallas_triton (") for line in code_paths), code_paths
  assert all("heuristic" in line and "best" in line for line in code_paths), code_paths
  glu = [r for r in checked if r["workload"].startswith("gated_linear_unit")]
  assert {"gated_linear_unit.pallas_triton heuristic", "gated_linear_unit.xla heuristic"} <= {
      r["impl"] for r in glu}, glu
  local = [r for r in checked if "window" in r["workload"]]
  assert any(r["impl"].startswith("attention.pallas_triton") for r in local), local
  # Interpret mode: no copy baseline row.
  assert lines[-2:] == ["rms_norm forward bandwidth: not measured",
                        "rms_norm fwd+bwd bandwidth: not measured"]


@pytest.mark.slow  # 8 s of a worker: CI's slow stage (make test within 10 minutes)
def test_the_shell_script_runs_and_leaves_its_results_under_out(tmp_path):
  # What the GPU machine runs (no nvidia-smi and no GPU target config here: it goes on).
  env = {**os.environ, "OUT": str(tmp_path), "SMOKE": "1", "TUNE_BUDGET_S": "0", "NO_DISPATCH": "1",
         "NO_PROFILE": "1", "ONLY": "=rms_norm (64, 256) fwd", "PYTHON": sys.executable}
  proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = _rows(tmp_path / "gpu_check")
  assert {r["workload"] for r in rows} == {"rms_norm (64, 256) fwd"}
  assert all(r["status"] == "ok" for r in rows), rows
  assert (tmp_path / "gpu_check.log").read_text().rstrip().endswith("rms_norm fwd+bwd bandwidth: not measured")


@pytest.mark.slow  # a process of its own: CI's slow stage
def test_a_hard_limit_ends_the_run_whatever_runs(tmp_path):
  # A kernel that never ran on a GPU may hang in its check run: the device call would
  # wait for it to its own end, spending the session's device time.
  proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path),
                         "--no-profile", "--no-dispatch", "--tune-budget-s", "0", "--hard-limit-s", "4"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 124, proc.stderr[-2000:]
  assert "gpu_check: past --hard-limit-s 4 s (a kernel may hang): stopping" in proc.stdout
  assert "== targets ==" not in proc.stdout  # cut short: the whole run takes longer


def _gpu_check():
  import importlib.util
  spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_check"] = module  # dataclasses look their module up while it loads
  spec.loader.exec_module(module)
  return module


def _rows(out):
  return json.loads((out / "results.json").read_text())["rows"]


@pytest.mark.slow  # tunes on the CPU for its workloads: CI's slow stage
def test_deadline_stops_tuning_then_skips_workloads(tmp_path):
  gpu_check = _gpu_check()
  args = ["--smoke", "--no-profile", "--only", "rms_norm", "--tune-budget-s", "2"]
  gpu_check.main([*args, "--out", str(tmp_path / "late"), "--deadline-s", "0"])
  late = _rows(tmp_path / "late")
  assert {r["workload"] for r in late} == {"rms_norm (64, 256) fwd", "rms_norm (64, 256) fwd+bwd"}
  assert not any("tuned" in r["impl"] for r in late)  # past the deadline: untuned
  assert all(r["median_ms"] for r in late if r["status"] == "ok")
  gpu_check.main([*args, "--out", str(tmp_path / "over"), "--deadline-s", "-61"])
  assert {r["status"] for r in _rows(tmp_path / "over")} == {"skipped: past -1 s"}


def test_skip_after_and_an_exact_workload_name(tmp_path):
  # A short device call: tune until --deadline-s, skip from --skip-after-s on; "=name"
  # asks for one workload where a plain part would match its fwd+bwd too.
  gpu_check = _gpu_check()
  args = ["--smoke", "--no-profile", "--no-dispatch", "--tune-budget-s", "0"]
  gpu_check.main([*args, "--out", str(tmp_path / "one"), "--only", "=rms_norm (64, 256) fwd"])
  assert {r["workload"] for r in _rows(tmp_path / "one")} == {"rms_norm (64, 256) fwd"}
  gpu_check.main([*args, "--out", str(tmp_path / "none"), "--only", "rms_norm",
                  "--deadline-s", "100", "--skip-after-s", "-1"])
  assert {r["status"] for r in _rows(tmp_path / "none")} == {"skipped: past -1 s"}


def test_an_only_part_that_names_no_workload_stops_before_anything_runs(tmp_path, capsys):
  # A typo (a missing space) ran nothing of that part and exited 0: a GPU call wasted.
  gpu_check = _gpu_check()
  code = gpu_check.main(["--smoke", "--no-profile", "--out", str(tmp_path), "--only",
                         "=rms_norm (64,256) fwd,attention"])
  assert code == 2 and not (tmp_path / "results.json").exists()
  err = capsys.readouterr().err
  assert "--only '=rms_norm (64,256) fwd' names no workload" in err
  assert "  rms_norm (64, 256) fwd\n" in err


def test_profile_step_finds_every_op_family(tmp_path, capsys):
  drop_live_programs()
  calls = _gpu_check().record_profile(tmp_path / "profile", smoke=True)
  names = {json.loads(c.marker)["op"]["name"].split(".")[0] for c in calls}
  assert names == {"ragged_dot", "attention", "layer_norm"}
  assert all(c.count >= 3 and c.device_time_s > 0 for c in calls)
  assert list((tmp_path / "profile").rglob("*.xplane.pb"))
  assert "profile: ragged_dot." in capsys.readouterr().out


def test_target_lines_say_met_missed_or_not_measured():
  gpu_check = _gpu_check()
  Row = gpu_check.Row
  ragged = "ragged_dot G=8 M=8192 K=4096 N=14336 fwd"
  attention = "attention B=2 T=8192 H=16 D=128 causal fwd"
  rows = [Row(ragged, "ragged_dot.pallas_triton tuned", 1.5, "642.0 TFLOP/s", status="ok"),
          Row(ragged, "xla jax.lax.ragged_dot", 9.9, "97.0 TFLOP/s", status="ok"),
          Row(attention, "attention.pallas_mosaic_gpu tuned", 1.1, "500.0 TFLOP/s", status="ok"),
          Row(attention, "cuDNN jax.nn.dot_product_attention", 0.935, "588.0 TFLOP/s", status="ok")]
  lines = gpu_check.target_lines(rows)
  assert lines[0].startswith("ragged_dot G=8 forward: MET (642 TFLOP/s, goal >= 600, by median;")
  assert lines[1] == "ragged_dot G=64 forward vs XLA: not measured"
  assert lines[2].startswith("attention forward vs cuDNN: missed (1.100 ms vs cuDNN")
  assert len(lines) == 6
  # The norm's fwd+bwd is judged against the forward workload's copy, by bytes moved.
  norm = "rms_norm (8192, 8192)"
  copy = Row(f"{norm} fwd", "copy x*2 (bandwidth)", 0.082, "3.27 TB/s", status="ok")
  fwd_bwd = Row(f"{norm} fwd+bwd", "layer_norm.pallas_triton heuristic", 0.25, "2.68 TB/s",
                status="ok")
  assert gpu_check.target_lines([copy, fwd_bwd])[-1].startswith(
      "rms_norm fwd+bwd bandwidth: missed (2.68 TB/s vs 85% of copy 2.78 TB/s, by median;")
  # Judged by the profiler's device time where the rows have it, as on the H200, where
  # the batched medians of long calls were 1.2-2.4x it; the medians' verdict follows.
  profiled = [Row(ragged, "ragged_dot.pallas_mosaic_gpu heuristic", 2.111, "455.8 TFLOP/s",
                  status="ok", profiled_ms=1.446)]
  line = gpu_check.target_lines(profiled + rows[1:])[0]
  assert line.startswith("ragged_dot G=8 forward: MET (665 TFLOP/s, goal >= 600, by profiled device time;")
  assert "by batched medians missed: 456 TFLOP/s" in line
  # A forward that failed is not measured, even where the fwd+bwd row (whose name the
  # forward's is a prefix of) ran.
  failed = [Row(attention, "attention.pallas_mosaic_gpu tuned", 1.1, "500.0 TFLOP/s", status="WRONG"),
            Row(attention + "+bwd", "attention.pallas_mosaic_gpu tuned", 3.0, "", status="ok")]
  assert gpu_check.target_lines(failed + rows[3:])[2] == "attention forward vs cuDNN: not measured"


def test_configs_that_failed_in_isolation_are_not_run_in_process():
  gpu_check = _gpu_check()
  ok = Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3, num_samples=5)
  hung = Measurement(status="timeout", error="no answer after 20 s")
  op = SimpleNamespace(bound_args=SimpleNamespace(op=SimpleNamespace(name="attention.pallas_mosaic_gpu")),
                       heuristic_config="h", best_config="b", measurements=(("h", hung), ("b", ok)))
  assert gpu_check._failed_in_isolation([op], "heuristic_config") == (
      "attention.pallas_mosaic_gpu timeout in tuning: no answer after 20 s")
  assert gpu_check._failed_in_isolation([op], "best_config") == ""


def test_target_workloads_give_their_input_specs_without_making_inputs():
  # bench/compile_h200.py compiles the target workloads from these specs alone (the
  # ragged_dot inputs draw group sizes with NumPy, so they cannot be traced).
  import jax
  gpu_check = _gpu_check()
  workloads = gpu_check._workloads(smoke=False)
  for w in workloads:
    specs = w.input_specs()
    assert specs and all(isinstance(s, jax.ShapeDtypeStruct) for s in specs), w.name
  ragged = next(w for w in workloads if w.name.startswith("ragged_dot G=8 M=8192"))
  assert [s.shape for s in ragged.input_specs()] == [(8192, 4096), (8, 4096, 14336), (8,)]
  gqa = [w for w in workloads if "KV=8" in w.name]
  assert [w.name.split(" causal ")[1] for w in gqa] == ["fwd", "fwd+bwd"]
  assert [s.shape for s in gqa[0].input_specs()] == [(1, 8192, 32, 128), (1, 8192, 8, 128),
                                                     (1, 8192, 8, 128)]
  # compile_h200 leaves GQA's known spills to the GPU run, not the targets' slow kernels.
  assert not any(w.compile_strict for w in gqa)
  assert all(w.compile_strict for w in workloads if w not in gqa)


def test_code_path_lines_compare_the_heuristic_with_its_other_code_paths():
  from stellarax.autotuning.result import Entry
  from stellarax.core.specs import ArraySpec
  from stellarax.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuAttentionVjpConfig as C
  gpu_check = _gpu_check()
  base = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
              num_compute_wgs=2, num_stages=2)
  heuristic = C(**base, split_dkdv=False, fuse_dq=False)
  fused = C(**base, split_dkdv=True, fuse_dq=True)
  tiles = C(**base | dict(num_stages=3), split_dkdv=False, fuse_dq=False)
  timed = lambda ms: Measurement(status="ok", median_s=ms * 1e-3, ci_low_s=ms * 1e-3,
                                 ci_high_s=ms * 1e-3, num_samples=5)
  call = SimpleNamespace(op=SimpleNamespace(name="attention.pallas_mosaic_gpu_vjp"),
                         array_specs=lambda: [ArraySpec((2, 8192, 16, 128), "bfloat16")])
  entry = Entry(bound_args=call, best_config=fused, heuristic_config=heuristic,
                measurements=((heuristic, timed(4.0)), (tiles, timed(4.5)), (fused, timed(3.0))))
  # The fused config flips both switches: it is the variant of each.
  assert gpu_check.code_path_lines([entry]) == [
      "attention.pallas_mosaic_gpu_vjp (2, 8192, 16, 128): heuristic 4.000 ms;"
      " split_dkdv=True, fuse_dq=True: 3.000 ms; best 3.000 ms"]
  wrong = Measurement(status="wrong_result", error="max abs error 3.2")
  entry = Entry(bound_args=call, best_config=heuristic, heuristic_config=heuristic,
                measurements=((heuristic, timed(4.0)), (fused, wrong)))
  assert gpu_check.code_path_lines([entry]) == [
      "attention.pallas_mosaic_gpu_vjp (2, 8192, 16, 128): heuristic 4.000 ms;"
      " split_dkdv=True, fuse_dq=True: wrong_result; best 4.000 ms"]


def test_faster_code_paths_need_disjoint_confidence_intervals():
  from stellarax.autotuning.result import Entry
  from stellarax.core.specs import ArraySpec
  from stellarax.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuAttentionVjpConfig as C
  gpu_check = _gpu_check()
  base = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
              num_compute_wgs=2, num_stages=2, split_dkdv=False)
  heuristic, fused = C(**base, fuse_dq=False), C(**base, fuse_dq=True)
  timed = lambda ms, low, high: Measurement(status="ok", median_s=ms * 1e-3, ci_low_s=low * 1e-3,
                                            ci_high_s=high * 1e-3, num_samples=5)
  call = SimpleNamespace(op=SimpleNamespace(name="attention.pallas_mosaic_gpu_vjp"),
                         array_specs=lambda: [ArraySpec((2, 8192, 16, 128), "bfloat16")])
  entry = lambda fused_m: Entry(bound_args=call, best_config=fused, heuristic_config=heuristic,
                                measurements=((heuristic, timed(4.0, 3.9, 4.1)), (fused, fused_m)))
  assert gpu_check.faster_code_paths([entry(timed(3.0, 2.9, 3.1))]) == [
      "attention.pallas_mosaic_gpu_vjp (2, 8192, 16, 128): fuse_dq=True takes 0.75x the heuristic's time"]
  assert gpu_check.faster_code_paths([entry(timed(3.8, 3.0, 3.95))]) == []  # intervals overlap
  wrong = Measurement(status="wrong_result", error="max abs error 3.2")
  assert gpu_check.faster_code_paths([entry(wrong)]) == []
  # Tuple configs name their tunables by field (named tuples) or position (plain ones).
  named = collections.namedtuple("Named", "block fused")
  for h, v, flipped in ((named(64, False), named(64, True), "fused=True"),
                        ((64, False), (64, True), "1=True"),
                        ((64, False), named(64, True), "1=True")):
    tuple_entry = Entry(bound_args=call, best_config=v, heuristic_config=h,
                        measurements=((h, timed(4.0, 3.9, 4.1)), (v, timed(3.0, 2.9, 3.1))))
    assert gpu_check.faster_code_paths([tuple_entry]) == [
        f"attention.pallas_mosaic_gpu_vjp (2, 8192, 16, 128): {flipped} takes 0.75x the"
        " heuristic's time"]


@pytest.mark.slow  # tunes on the CPU for its workloads: CI's slow stage
def test_a_tuned_row_keeps_the_calls_that_were_tuned_when_another_fails(tmp_path, monkeypatch):
  # Every config of the backward fails: the fwd+bwd row still runs with the tuned
  # forward (and the backward's heuristic), says so in its note, and tuned.json keeps
  # the forward for the library cache.
  import stellarax
  gpu_check = _gpu_check()
  real = stellarax.Autotuner.tune_one

  def tune_one(self, ba, **kwargs):
    if ba.op.name.endswith("_vjp"):
      raise ValueError("None of the 4 candidates succeeded (boom)")
    return real(self, ba, **kwargs)

  monkeypatch.setattr(stellarax.Autotuner, "tune_one", tune_one)
  gpu_check.main(["--smoke", "--no-profile", "--only", "rms_norm", "--tune-budget-s", "1",
                  "--out", str(tmp_path)])
  rows = {(r["workload"], r["impl"]): r for r in _rows(tmp_path)}
  row = rows[("rms_norm (64, 256) fwd+bwd", "layer_norm.pallas_triton tuned")]
  assert row["status"] == "ok" and row["median_ms"], row
  assert row["note"] == "partly tuned: layer_norm.pallas_triton_vjp ValueError: None of the 4 candidates succeeded (boom)"
  assert row["config"].startswith("layer_norm.pallas_triton: ")
  assert rows[("rms_norm (64, 256) fwd", "layer_norm.pallas_triton tuned")]["note"] == ""
  tuned = stellarax.AutotuningResult.load(tmp_path / "tuned.json")
  # The XLA norm has one config a call: not tuned (its tuned row would time the
  # heuristic twice, and land would ship an entry that measured nothing else).
  assert {e.bound_args.op.name for e in tuned} == {"layer_norm.pallas_triton"}
  assert ("rms_norm (64, 256) fwd", "layer_norm.xla tuned") not in rows
  assert rows[("rms_norm (64, 256) fwd", "layer_norm.xla heuristic")]["status"] == "ok"


def test_a_workload_that_fails_is_a_row_and_a_lost_device_skips_the_rest(tmp_path, monkeypatch, capsys):
  # Its inputs or reference failing stopped the whole run (and its table) before; after
  # a kernel lost the device, every later workload would fail in this process too.
  gpu_check = _gpu_check()
  from stellarax.autotuning import measure
  seen = []

  def run_workload(w, *args, **kwargs):
    seen.append(w.name)
    if len(seen) == 1:
      raise MemoryError("RESOURCE_EXHAUSTED: out of memory making the inputs")
    if len(seen) == 2:
      key = "layer_norm.pallas_triton heuristic"
      lost = measure.Measurement(status="runtime_error", error="an illegal memory access")
      raise measure.DeviceLostError(key, {key: lost})
    raise AssertionError("not reached: the device was lost")

  monkeypatch.setattr(gpu_check, "_run_workload", run_workload)
  gpu_check.main(["--smoke", "--no-profile", "--tune-budget-s", "0", "--only", "rms_norm,layer_norm",
                  "--out", str(tmp_path)])
  rows = _rows(tmp_path)
  assert rows[0]["workload"] == seen[0] and rows[0]["status"].startswith("error: RESOURCE_EXHAUSTED")
  assert rows[1]["workload"] == seen[1] and "an illegal memory access" in rows[1]["status"]
  assert len(rows) > 2 and all(r["status"] == f"skipped: {seen[1]} lost the device "
                               "(layer_norm.pallas_triton heuristic)" for r in rows[2:])
  # The dispatch and batch checks ran first, so the lost device spoiled none of them.
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["dispatch"] and data["batching"]
  out = capsys.readouterr().out
  assert "== dispatch (small calls" in out and "== targets ==" in out


def test_a_check_run_that_does_not_end_is_given_up():
  # A kernel that never ran on a GPU may never finish: in this process it cannot be
  # stopped, and its check run waited until the device call's own limit.
  import threading
  import jax
  import jax.numpy as jnp
  import numpy as np
  gpu_check = _gpu_check()
  release = threading.Event()

  def blocked(x):
    release.wait(60)
    return x

  x = jnp.arange(4.0)
  hangs = lambda x: jax.pure_callback(blocked, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  try:
    with pytest.raises(gpu_check._CheckHung):
      gpu_check._check_run(hangs, (x,), 0.5)
  finally:
    release.set()
  out = gpu_check._check_run(lambda x: x * 2, (x,), 60)
  assert np.array_equal(np.asarray(out), np.arange(4.0) * 2)
  with pytest.raises(ZeroDivisionError):
    gpu_check._check_run(lambda x: x + 1 // 0, (x,), 60)


def _smoke_workload(gpu_check, name="rms_norm (64, 256) fwd"):
  from stellarax.autotuning import measure
  w = next(w for w in gpu_check._workloads(True) if w.name == name)
  return w, measure.MeasureOptions(rounds=2, leader_rounds=0, max_total_s=0.2, warmup_s=0.0)


def test_a_hung_check_run_stops_the_workload_with_its_rows(monkeypatch):
  gpu_check = _gpu_check()
  w, opts = _smoke_workload(gpu_check)
  real, seen = gpu_check._check_run, []

  def check_run(fn, inputs, timeout_s):
    seen.append(timeout_s)
    if len(seen) == 2:
      raise gpu_check._CheckHung()
    return real(fn, inputs, timeout_s)

  monkeypatch.setattr(gpu_check, "_check_run", check_run)
  with pytest.raises(gpu_check.WorkloadStopped) as stopped:
    gpu_check._run_workload(w, True, 0.0, opts, isolate=False)
  first, hung, *later = stopped.value.rows
  why = f"{hung.impl} hung in its check run"
  assert first.max_rel_err is not None and first.median_ms is None
  assert first.status == f"not timed: {why}"
  assert hung.status == f"timeout: its check run did not end in {seen[1]:.0f} s"
  # The candidates after it are rows too (a tuned one with its configs, which land then
  # refuses to ship unchecked).
  assert later and all(r.status == f"not checked: {why}" for r in later)
  assert stopped.value.hung and stopped.value.why == f"{w.name}: {why}"


def test_a_compilation_past_its_timeout_does_not_stop_the_run(monkeypatch):
  # A compilation holds no device: the workload's other candidates are timed, and the
  # workloads after it run.
  gpu_check = _gpu_check()
  w, opts = _smoke_workload(gpu_check)

  def measure_candidates(candidates, args, options):
    first, *rest = list(candidates)
    ok = Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3, num_samples=2,
                     method="batched")
    slow = Measurement(status="timeout", error="compilation did not finish within timeout_s=20 s")
    return {first: slow} | {k: ok for k in rest}

  monkeypatch.setattr(gpu_check.measure, "measure_candidates", measure_candidates)
  rows, _ = gpu_check._run_workload(w, True, 0.0, opts, isolate=False)
  assert rows[0].status.startswith("timeout: compilation") and all(r.median_ms == 1.0 for r in rows[1:])


@pytest.mark.parametrize("failure, why", [
    (Measurement(status="timeout", error="no result within timeout_s=20"), "hung in its timed runs"),
    (Measurement(status="runtime_error", error="CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory "
                 "access was encountered"), "lost the device"),
])
def test_a_timed_run_that_hangs_or_loses_the_device_stops_the_workload(monkeypatch, failure, why):
  # The timing stops after it (stop_after_run_timeout): later candidates would queue
  # behind the hung kernel, or fail in a lost context.
  gpu_check = _gpu_check()
  w, opts = _smoke_workload(gpu_check)
  asked = []

  def measure_candidates(candidates, args, options):
    asked.append(options)
    first, second = list(candidates)[:2]
    return {first: Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=1e-3,
                               num_samples=2, method="batched"), second: failure}

  monkeypatch.setattr(gpu_check.measure, "measure_candidates", measure_candidates)
  with pytest.raises(gpu_check.WorkloadStopped) as stopped:
    gpu_check._run_workload(w, True, 0.0, opts, isolate=False)
  rows = stopped.value.rows
  assert asked[0].stop_after_run_timeout and len(rows) > 2
  assert rows[0].median_ms == 1.0 and rows[1].status.startswith(failure.status)
  assert all(r.status == f"not timed: {rows[1].impl} stopped the timing" for r in rows[2:])
  assert stopped.value.why == f"{w.name}: {rows[1].impl} {why}"
  assert stopped.value.hung is (failure.status == "timeout")


def test_a_stopped_workload_keeps_its_rows_and_skips_the_rest(tmp_path, monkeypatch, capsys):
  gpu_check = _gpu_check()
  seen = []

  def run_workload(w, *args, **kwargs):
    seen.append(w.name)
    if len(seen) > 1:
      raise AssertionError("not reached: a kernel still holds the device")
    row = gpu_check.Row(w.name, "layer_norm.pallas_triton heuristic", status="timeout: ...")
    raise gpu_check.WorkloadStopped([row], None, f"{w.name}: it hung", hung=True)

  monkeypatch.setattr(gpu_check, "_run_workload", run_workload)
  monkeypatch.setattr(gpu_check, "HUNG", [])
  gpu_check.main(["--smoke", "--no-profile", "--no-dispatch", "--tune-budget-s", "0",
                  "--only", "rms_norm", "--out", str(tmp_path)])
  rows = _rows(tmp_path)
  assert rows[0]["impl"] == "layer_norm.pallas_triton heuristic" and rows[0]["status"] == "timeout: ..."
  assert len(rows) > 1 and all(r["status"] == f"skipped: {seen[0]}: it hung" for r in rows[1:])
  assert gpu_check.HUNG == [f"{seen[0]}: it hung"]  # __main__ then leaves without waiting
  assert "== targets ==" in capsys.readouterr().out


def test_leave_out_drops_implementations_and_refuses_unknown_names(tmp_path, monkeypatch, capsys):
  # After a kernel hung, the next call runs the rest without that implementation.
  gpu_check = _gpu_check()
  names = lambda leave_out: [n for n, _ in gpu_check._impls("layer_norm", True, leave_out)]
  assert "layer_norm.pallas_triton" in names(frozenset())
  assert names(frozenset({"layer_norm.pallas_triton"})) == ["layer_norm.xla"]
  passed = []
  monkeypatch.setattr(gpu_check, "_run_workload",
                      lambda w, *a, **k: passed.append(k["leave_out"]) or ([], None))
  common = ["--smoke", "--no-profile", "--no-dispatch", "--tune-budget-s", "0", "--only",
            "=rms_norm (64, 256) fwd", "--out", str(tmp_path)]
  gpu_check.main(common + ["--leave-out", "layer_norm.pallas_triton, attention.pallas_mosaic_gpu"])
  assert passed == [frozenset({"layer_norm.pallas_triton", "attention.pallas_mosaic_gpu"})]
  with pytest.raises(SystemExit) as exit_:
    gpu_check.main(common + ["--leave-out", "attention.pallas_mosaic,layer_norm.xla"])
  assert exit_.value.code == 2 and len(passed) == 1
  assert "--leave-out names no implementation: attention.pallas_mosaic;" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # a backward op goes with its forward implementation
    gpu_check.main(common + ["--leave-out", "attention.pallas_mosaic_gpu_vjp"])
  assert "names backward ops: attention.pallas_mosaic_gpu_vjp;" in capsys.readouterr().err
  # The small model's profile runs the default implementations: skipped.
  gpu_check.main([a for a in common if a != "--no-profile"] + ["--leave-out", "layer_norm.xla"])
  assert "profile: skipped: --leave-out is given" in capsys.readouterr().out


@pytest.mark.slow  # tunes on the CPU: CI's slow stage
def test_a_tuned_config_that_failed_in_tuning_names_its_configs(tmp_path, monkeypatch):
  # Not run in this process (it hung or failed in a worker), its row said so without the
  # configs, and land shipped them.
  gpu_check = _gpu_check()
  monkeypatch.setattr(gpu_check, "_failed_in_isolation",
                      lambda result, which: "timeout in tuning" if which == "best_config" else "")
  gpu_check.main(["--smoke", "--no-profile", "--no-dispatch", "--only", "=rms_norm (64, 256) fwd",
                  "--tune-budget-s", "1", "--out", str(tmp_path)])
  row = {r["impl"]: r for r in _rows(tmp_path)}["layer_norm.pallas_triton tuned"]
  assert row["status"] == "not run here: timeout in tuning" and not row["median_ms"]
  assert row["config"].startswith("layer_norm.pallas_triton: PallasTritonLayerNormConfig(")


def test_a_heuristic_that_hung_in_tuning_is_not_run_here(tmp_path, monkeypatch):
  # Tuning failed, and the heuristic's check ran in this process all the same: on a GPU
  # a hung kernel cost the check's whole timeout and stopped the call's workloads.
  import stellarax
  from stellarax.autotuning.measure import AllCandidatesFailedError, Measurement
  gpu_check = _gpu_check()

  def tune_one(self, ba, **kwargs):
    raise AllCandidatesFailedError({ba.heuristics_config: Measurement(
        status="timeout", error="the worker sent nothing within 60 s")})

  monkeypatch.setattr(stellarax.Autotuner, "tune_one", tune_one)
  gpu_check.main(["--smoke", "--no-profile", "--no-dispatch", "--only", "=rms_norm (64, 256) fwd",
                  "--tune-budget-s", "1", "--out", str(tmp_path)])
  rows = {r["impl"]: r for r in _rows(tmp_path)}
  assert rows["layer_norm.pallas_triton heuristic"]["status"] == (
      "not run here: layer_norm.pallas_triton heuristic timeout in tuning")
  assert rows["layer_norm.pallas_triton tuned"]["status"].startswith("tuning failed: ")
  assert rows["layer_norm.xla heuristic"]["status"] == "ok"


def test_a_tuned_candidate_whose_check_raises_names_its_configs(tmp_path, monkeypatch):
  # Its "error" row named no config, so land shipped the configs the run never checked.
  gpu_check = _gpu_check()
  real = gpu_check._check_run

  def check_run(fn, inputs, timeout_s):
    if getattr(fn, "__name__", "") == "tuned":
      raise RuntimeError("the output's shape differs")
    return real(fn, inputs, timeout_s)

  monkeypatch.setattr(gpu_check, "_check_run", check_run)
  real_with = gpu_check._with_result

  def with_result(result, call):
    fn = real_with(result, call)
    fn.__name__ = "tuned"
    return fn

  monkeypatch.setattr(gpu_check, "_with_result", with_result)
  gpu_check.main(["--smoke", "--no-profile", "--no-dispatch", "--only", "=rms_norm (64, 256) fwd",
                  "--tune-budget-s", "1", "--out", str(tmp_path)])
  row = {r["impl"]: r for r in _rows(tmp_path)}["layer_norm.pallas_triton tuned"]
  assert row["status"].startswith("error: the output's shape differs"), row
  assert row["config"].startswith("layer_norm.pallas_triton: PallasTritonLayerNormConfig(")


def test_dispatch_calibration_times_small_calls_both_ways():
  gpu_check = _gpu_check()
  calibration = gpu_check.dispatch_calibration(smoke=True)
  assert [r["name"] for r in calibration] == ["rms_norm (64, 1024) xla", "matmul 256^3 (cuBLAS on a GPU)"]
  for row in calibration:
    assert "error" not in row, row
    assert all(row[k] > 0 for k in ("floor_us", "batched_us", "looped_us", "profiled_us")), row
  lines = gpu_check.dispatch_lines(calibration + [dict(calibration[0], looped_us=None, error="E: x")])
  assert lines[0].startswith("rms_norm (64, 1024) xla: floor ") and ", looped " in lines[0]
  assert ", profiled " in lines[0] and " us" in lines[0].split(", profiled ")[1]
  assert ", looped -, profiled " in lines[-1] and lines[-1].endswith(" (E: x)")


def test_batch_size_check_times_one_call_per_batch_size_and_both_batch_lengths():
  gpu_check = _gpu_check()
  check = gpu_check.batch_size_check(smoke=True)
  assert "error" not in check, check
  assert list(check["per_call_ms"]) == [1, 2, 4, 8, 16]
  assert all(v > 0 for v in check["per_call_ms"].values()) and check["new_thread_ms"] > 0
  assert check["min_batch_1ms_ms"] > 0 and check["min_batch_20ms_ms"] > 0 and check["profiled_ms"] > 0
  assert check["single_1ms_ms"] > 0  # single batches beside the paired ones (the same on a CPU)
  # Each profiled batch splits into lead + busy + gaps + tail, its two calls' kernels seen.
  assert len(check["timeline"]) == 3
  for batch in check["timeline"]:
    parts = [batch[k] for k in ("lead_us", "busy_us", "gap_us", "tail_us")]
    assert all(p >= 0 for p in parts) and batch["busy_us"] > 0 and batch["kernels"] >= 2, batch
    assert sum(parts) == pytest.approx(batch["total_us"]), batch
  lines = gpu_check.batch_size_lines(check)
  assert lines[0].startswith("matmul 256^3 float32: per call with n calls a sync: n=1: ")
  assert "; n=1 from a new thread: " in lines[0] and lines[0].endswith(" ms")
  for line in lines[1:4]:
    assert re.fullmatch(r"  batch of 2 calls, profiled: \d+ us = lead \d+ \+ busy \d+ \+ gaps \d+"
                        r" \+ tail \d+", line), line
  assert ">= 20 ms: " in lines[4] and "; profiled " in lines[4]
  failed = gpu_check.batch_size_lines({"name": "m", "per_call_ms": {}, "error": "E: x"})
  assert failed[0].endswith(": -; n=1 from a new thread: -") and failed[1].endswith("(E: x)")
  unseen = gpu_check.batch_size_lines({"name": "m", "per_call_ms": {}, "timeline": [{"calls": 2, "total_us": 12.0}]})
  assert unseen[1] == "  batch of 2 calls, profiled: 12 us = lead - + busy - + gaps - + tail -"


def test_profile_lines_list_the_rows_far_from_their_device_time():
  gpu_check = _gpu_check()
  Row = gpu_check.Row
  rows = [Row("w", "near", median_ms=1.1, profiled_ms=1.0, method="gpu-batched"),
          Row("w", "host-bound", median_ms=0.030, profiled_ms=0.004, method="gpu-batched"),
          Row("w", "faster than its kernels?", median_ms=0.5, profiled_ms=1.0, method="gpu-looped"),
          Row("w", "unprofiled", median_ms=2.0),
          Row("w", "failed", status="timeout: slow")]
  assert gpu_check.profile_lines(rows) == [
      "w | host-bound: median 0.030 ms is 7.50x the profiled 0.004 ms (gpu-batched)",
      "w | faster than its kernels?: median 0.500 ms is 0.50x the profiled 1.000 ms (gpu-looped)",
      "1 of 3 profiled rows within 1.2x of their profiled device time; 1 timed rows without one"]



def test_the_relative_error_is_computed_where_the_arrays_are():
  import jax.numpy as jnp
  import numpy as np
  gpu_check = _gpu_check()
  ref = {"a": jnp.asarray([1.0, -4.0, 2.0]), "b": jnp.zeros((0, 3)), "c": jnp.asarray([2.0, 0.5])}
  out = {"a": jnp.asarray([1.0, -4.0, 2.2], jnp.bfloat16), "b": jnp.zeros((0, 3)),
         "c": jnp.asarray([2.0, 0.5])}
  # 0.2 off, over the leaf's largest |ref|, 4 (bfloat16 keeps 2.2 as 2.203125)
  assert gpu_check._rel_err(out, ref) == pytest.approx(0.203125 / 4)
  out["c"] = jnp.asarray([2.0, float("nan")])
  assert np.isnan(gpu_check._rel_err(out, ref))  # and so, not within any tolerance
  assert gpu_check._rel_err({"b": jnp.zeros((0,))}, {"b": jnp.zeros((0,))}) == 0.0
  with pytest.raises(ValueError, match="output shape \\(1,\\) differs"):
    gpu_check._rel_err([jnp.ones(1)], [jnp.ones(4)])  # not broadcast against it
