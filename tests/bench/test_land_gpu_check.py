"""bench/land_gpu_check.py lands a GPU run: cache, BENCHMARKS.md, profile fixture, target."""

import dataclasses
import gzip
import json
import pathlib
import sys

import jax.numpy as jnp
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import Measurement
from stellarax.autotuning.profile import read_op_calls

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import land_gpu_check as land  # noqa: E402
CPU_PROFILE = ROOT / "tests" / "data" / "profiles" / "cpu" / "profile.xplane.pb.gz"

BENCHMARKS = """\
# Benchmarks

Intro.

## NVIDIA H200

Not measured yet: no session so far was lent the GPU machine. The anchors
will be compared against.

## NVIDIA H200, compiled without a GPU (ptxas's reports)

Older facts.
"""


def _ok(ms):
  return Measurement(status="ok", median_s=ms * 1e-3, ci_low_s=ms * 1e-3, ci_high_s=ms * 1e-3,
                     num_samples=5, compile_time_s=0.1, method="test")


def _entry(m, best_status="ok", only_heuristic=False):
  ba = stellarax.PallasTritonRaggedDot.bind(jnp.ones((m, 32), jnp.bfloat16), jnp.ones((4, 32, 48), jnp.bfloat16),
                                            jnp.full((4,), m // 4, jnp.int32))
  heuristic = ba.heuristics_config
  if only_heuristic:  # a tuning whose budget ran out after its first measurement
    return autotuning.Entry(bound_args=ba.with_config(None), best_config=heuristic,
                            heuristic_config=heuristic, measurements=((heuristic, _ok(2.0)),))
  best = dataclasses.replace(heuristic, num_warps=8)
  best_m = _ok(1.0) if best_status == "ok" else Measurement(status=best_status, error="stale")
  return autotuning.Entry(bound_args=ba.with_config(None), best_config=best, heuristic_config=heuristic,
                          measurements=((heuristic, _ok(2.0)), (best, best_m)))


def _results_folder(tmp_path, device="NVIDIA H200"):
  """A results folder as gpu_check.sh writes it: four tuned ragged_dot calls, of which
  the second's tuned row was WRONG, the third's best config has no good time and the
  fourth measured only its heuristic."""
  folder = tmp_path / "files" / "gpu_check"
  (folder / "profile" / "plugins" / "profile" / "t").mkdir(parents=True)
  good, wrong, unmeasured = _entry(64), _entry(128), _entry(256, best_status="timeout")
  starved = _entry(512, only_heuristic=True)
  result = autotuning.AutotuningResult(device, {e.key: e for e in (good, wrong, unmeasured, starved)})
  result.dump(folder / "tuned.json")
  config_of = lambda e: f"ragged_dot.pallas_triton: {e.best_config}"
  rows = [dict(workload="ragged_dot G=8 M=8192 K=4096 N=14336 fwd", impl="ragged_dot.pallas_triton tuned",
               median_ms=1.5, rate="642.0 TFLOP/s", max_rel_err=1e-3, status="ok", config=config_of(good),
               profiled_ms=1.45),
          dict(workload="ragged_dot G=8 M=8192 K=4096 N=14336 fwd", impl="xla jax.lax.ragged_dot",
               median_ms=9.9, rate="97.0 TFLOP/s", max_rel_err=1e-3, status="ok", config=""),
          dict(workload="ragged_dot G=64 M=16384 K=2048 N=1536 fwd", impl="ragged_dot.pallas_triton tuned",
               median_ms=0.4, rate="", max_rel_err=0.5, status="WRONG (tolerance 0.03); ok",
               config=config_of(wrong))]
  env = {"device": device, "jax": "0.11.2", "stellarax": "0.1.0", "date": "2026-12-01 10:00:00 UTC",
         "argv": ["bench/gpu_check.py", "--out", "/out/gpu_check", "--tune-budget-s", "6"]}
  dispatch = [{"name": "matmul 256^3 (cuBLAS on a GPU)", "floor_us": 9.5, "batched_us": 11.25,
               "looped_us": 3.5, "profiled_us": 3.25}]
  batching = {"name": "ragged_dot G=8 fwd", "per_call_ms": {"1": 1.6, "16": 1.45}, "new_thread_ms": 2.5,
              "timeline": [{"calls": 4, "total_us": 6200, "lead_us": 40, "busy_us": 5900, "gap_us": 60,
                            "tail_us": 200}],
              "min_batch_1ms_ms": 1.52, "min_batch_20ms_ms": 1.47, "profiled_ms": 1.45}
  (folder / "results.json").write_text(json.dumps({"env": env, "rows": rows, "dispatch": dispatch,
                                                   "batching": batching}))
  (folder / "profile" / "plugins" / "profile" / "t" / "host.xplane.pb").write_bytes(
      gzip.decompress(CPU_PROFILE.read_bytes()))
  (folder / "h200_target_config.pbtxt").write_text("gpu_device_info {\n  threads_per_block_limit: 1024\n}\n")
  return folder, good


def _repo(tmp_path):
  root = tmp_path / "repo"
  (root / "bench").mkdir(parents=True)
  (root / "BENCHMARKS.md").write_text(BENCHMARKS)
  return root


def test_land_ships_confirmed_configs_and_records_the_run(tmp_path, capsys):
  folder, good = _results_folder(tmp_path)
  root = _repo(tmp_path)
  assert land.main([str(folder), "--root", str(root)]) == 0
  out = capsys.readouterr().out
  # Only the confirmed call ships; the others say why not.
  shipped = root / "src" / "stellarax" / "data" / "autotuning" / "NVIDIA_H200" / "ragged_dot.pallas_triton.json"
  result = autotuning.AutotuningResult.load(shipped)
  assert [e.key for e in result] == [good.key]
  assert result.device_kind == "NVIDIA H200"
  assert not list(shipped.parent.glob("*.lock"))
  assert "(128, 32)" in out and "failed the run's check" in out
  assert "(256, 32)" in out and "no successful measurement" in out
  assert "(512, 32)" in out and "measured no config but the heuristic" in out
  # BENCHMARKS.md: the section first under the device's heading, the old paragraph gone.
  text = (root / "BENCHMARKS.md").read_text()
  assert "Not measured yet" not in text
  h200 = text.index("## NVIDIA H200\n")
  section = text.index("### bench/gpu_check.sh, 2026-12-01", h200)
  assert section < text.index("## NVIDIA H200, compiled without a GPU")
  assert "device: NVIDIA H200; jax 0.11.2" in text and "--tune-budget-s 6" in text
  assert any(line.startswith("    ragged_dot G=8 M=8192") and "pallas_triton tuned" in line and "1.500" in line
             for line in text.splitlines())
  assert "ragged_dot G=8 forward: MET (664 TFLOP/s, goal >= 600, by profiled device time" in text
  assert "ragged_dot.pallas_triton (4,) (64, 32) (4, 32, 48): heuristic 2.000 ms; best 1.000 ms" in text
  # num_warps is a tile, not a code path: no variant to report.
  assert "Faster than the heuristic beyond both confidence intervals:\n\n    none\n" in text
  assert ("    matmul 256^3 (cuBLAS on a GPU): floor 9.50 us, batched 11.25 us, looped 3.50 us,"
          " profiled 3.25 us\n" in text)
  # The batch-size check reached only results.json before.
  assert ("    ragged_dot G=8 fwd: per call with n calls a sync: n=1: 1.600 ms, n=16: 1.450 ms;"
          " n=1 from a new thread: 2.500 ms\n" in text)
  assert "    batch of 4 calls, profiled: 6200 us = lead 40 + busy 5900 + gaps 60 + tail 200\n" in text
  # Rows from a run before profiled times (the second row) load; the profiled one counts.
  assert ("    1 of 1 profiled rows within 1.2x of their profiled device time; 2 timed rows"
          " without one\n" in text)
  # The profile is test data that reads back as recorded; the target config is kept.
  fixture = root / "tests" / "data" / "profiles" / "NVIDIA_H200"
  recorded = json.loads((fixture / "calls.json").read_text())
  assert recorded["device"] == "NVIDIA H200"
  unzipped = tmp_path / "again.xplane.pb"
  unzipped.write_bytes(gzip.decompress((fixture / "profile.xplane.pb.gz").read_bytes()))
  assert [c.marker for c in read_op_calls(unzipped)] == [c["marker"] for c in recorded["calls"]]
  target = (root / "bench" / "h200_target_config.txtpb").read_text()
  assert target.startswith("# An NVIDIA H200 as XLA's") and "(bench/gpu_check.sh, 2026-12-01, jax 0.11.2)" in target
  assert "\ngpu_device_info {\n  threads_per_block_limit: 1024\n}\n" in target


def test_a_tuned_config_not_run_after_failing_in_tuning_is_not_confirmed():
  # gpu_check does not run a tuned config that hung or failed in a tuning worker; its
  # row had no config text, so land shipped the config if it had any good time.
  row = land.gpu_check.Row("w", "ragged_dot.pallas_triton tuned", status="not run here: timeout in tuning",
                           config="ragged_dot.pallas_triton: C(a=1); ragged_dot.pallas_triton_vjp: C(b=2)")
  assert land._unconfirmed_configs([row]) == ["ragged_dot.pallas_triton: C(a=1)",
                                              "ragged_dot.pallas_triton_vjp: C(b=2)"]


def test_landing_a_run_again_adds_nothing_and_a_new_run_adds_beside(tmp_path, capsys):
  folder, good = _results_folder(tmp_path)
  root = _repo(tmp_path)
  assert land.main([str(folder), "--root", str(root)]) == 0
  landed = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
  # Again (a re-run after a crash, say): its section and profile were added twice.
  assert land.main([str(folder), "--root", str(root)]) == 0
  assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == landed
  assert "has this run's section already" in capsys.readouterr().out
  # Another run (another date): a second section; its profile, the same bytes, is kept
  # once (another one would go beside the first: tests read old ones for what they
  # showed); the cache keeps the faster configs.
  data = json.loads((folder / "results.json").read_text())
  data["env"]["date"] = "2026-12-02 09:00:00 UTC"
  (folder / "results.json").write_text(json.dumps(data))
  assert land.main([str(folder), "--root", str(root)]) == 0
  text = (root / "BENCHMARKS.md").read_text()
  assert text.count("### bench/gpu_check.sh, 2026-12-0") == 2
  shipped = root / "src" / "stellarax" / "data" / "autotuning" / "NVIDIA_H200" / "ragged_dot.pallas_triton.json"
  assert [e.key for e in autotuning.AutotuningResult.load(shipped)] == [good.key]
  profiles = root / "tests" / "data" / "profiles"
  assert sorted(p.name for p in profiles.iterdir()) == ["NVIDIA_H200"]


def test_a_results_file_cut_short_or_foreign_is_refused_by_name(tmp_path, capsys):
  # Each gave a traceback (JSONDecodeError, KeyError, TypeError, FormatError).
  folder, _ = _results_folder(tmp_path)
  root = _repo(tmp_path)
  results = folder / "results.json"
  good = results.read_text()
  data = json.loads(good)
  for text in (good[:len(good) // 2], "{}",
               json.dumps(data | {"rows": [data["rows"][0] | {"colour": "red"}]})):
    results.write_text(text)
    assert land.main([str(folder), "--root", str(root)]) == 2
    assert f"{results}: not a results file of bench/gpu_check.py" in capsys.readouterr().err
  results.write_text(good)
  tuned = folder / "tuned.json"
  tuned.write_text(tuned.read_text()[:100])
  assert land.main([str(folder), "--root", str(root)]) == 2
  assert "Land without it by moving it aside" in capsys.readouterr().err


def test_dry_run_writes_nothing(tmp_path, capsys):
  folder, _ = _results_folder(tmp_path)
  root = _repo(tmp_path)
  assert land.main([str(folder), "--root", str(root), "--dry-run"]) == 0
  out = capsys.readouterr().out
  assert "would write" in out and "ragged_dot.pallas_triton.json" in out and "BENCHMARKS.md" in out
  assert (root / "BENCHMARKS.md").read_text() == BENCHMARKS
  assert sorted(p.name for p in root.rglob("*") if p.is_file()) == ["BENCHMARKS.md"]


def test_refuses_what_is_not_a_gpu_run(tmp_path, capsys):
  root = _repo(tmp_path)
  assert land.main([str(tmp_path / "nowhere"), "--root", str(root)]) == 2
  assert "no such file" in capsys.readouterr().err
  folder, _ = _results_folder(tmp_path, device="cpu")
  assert land.main([str(folder), "--root", str(root)]) == 2
  assert "not a GPU" in capsys.readouterr().err
  with pytest.raises(land.LandError, match="no row was timed"):
    data = json.loads((folder / "results.json").read_text())
    for row in data["rows"]:
      row["median_ms"] = None
    (folder / "results.json").write_text(json.dumps(data))
    land.load_run(folder, any_device=True)
  assert (root / "BENCHMARKS.md").read_text() == BENCHMARKS


def test_add_section_adds_a_missing_device_heading():
  text = land.add_section("# B\n\n## CPU\n\nfacts\n", "NVIDIA H100", "### run\n\nrows\n")
  assert text == "# B\n\n## NVIDIA H100\n\n### run\n\nrows\n\n## CPU\n\nfacts\n"
  with pytest.raises(land.LandError, match="no '## ' heading"):
    land.add_section("# B\n", "NVIDIA H100", "### run\n")


def test_a_profile_too_large_for_a_fixture_is_not_kept(tmp_path, monkeypatch, capsys):
  folder, _ = _results_folder(tmp_path)
  root = _repo(tmp_path)
  monkeypatch.setattr(land, "_MAX_FIXTURE_BYTES", 1000)
  assert land.main([str(folder), "--root", str(root)]) == 0
  assert "profile not kept" in capsys.readouterr().out
  assert not (root / "tests" / "data" / "profiles").exists()
  assert (root / "bench" / "h200_target_config.txtpb").exists()  # the rest still lands


def test_a_new_profile_goes_beside_the_earlier_ones(tmp_path):
  # Tests read old profiles for what they showed: an H200 profile of command buffers was
  # overwritten once.
  profiles = tmp_path / "profiles"
  names = []
  for _ in range(3):
    folder = land._new_fixture_folder(profiles, "NVIDIA_H200", "2026-12-01")
    folder.mkdir(parents=True)
    names.append(folder.name)
  assert names == ["NVIDIA_H200", "NVIDIA_H200_2026-12-01", "NVIDIA_H200_2026-12-01_2"]
