"""Distributed tuning: processes on localhost (jax.distributed, CPU) and local devices.

Each multi-process test starts real JAX processes running this file as a script
(`_worker_main`); they tune the ops of a small model (ragged_dot and rms_norm, forward
and backward) from bound-argument JSON that the test writes, record which process and
device tuned each call, and write what they got to a JSON file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import stellarax
from stellarax.autotuning import distributed
from stellarax.autotuning import search
from stellarax.autotuning.measure import Measurement, MeasureOptions
from stellarax.autotuning.result import AutotuningResult, Entry

FAST = MeasureOptions(rounds=1, leader_rounds=0, warmup_s=0.0, max_total_s=0.1, min_batch_s=0.0)
# Worst case for one worker process to start, tune its share and write its output on a
# loaded 2-core machine.
WORKER_LIMIT_S = 150


def two_configs(space, measure, *, heuristic, budget_s):
  """A search over the heuristic and the next config only: fast, still a real choice."""
  return search.exhaustive(list(space)[:2], measure, heuristic=heuristic)


def model(lhs, rhs, group_sizes):
  y = stellarax.ragged_dot(lhs, rhs, group_sizes)
  return jnp.mean(stellarax.rms_norm(y, None) ** 2)


@pytest.fixture(scope="module")
def calls():
  """The model's op calls, forward and backward, with awkward sizes and an empty group."""
  k = jax.random.split(jax.random.key(7), 2)
  lhs = jax.random.normal(k[0], (61, 24), jnp.float32)
  rhs = jax.random.normal(k[1], (3, 24, 20), jnp.float32)
  group_sizes = jnp.array([30, 0, 25], jnp.int32)
  grad = jax.value_and_grad(model, argnums=(0, 1))
  return stellarax.Autotuner(progress=False).collect(grad, lhs, rhs, group_sizes)


@pytest.fixture
def calls_file(calls, tmp_path):
  path = tmp_path / "calls.json"
  path.write_text(stellarax.autotuning.bound_args_to_json(calls))
  return path


def _keys(calls):
  return sorted((ba.op_json(), ba.key_json()) for ba in calls)


# --- in this process --------------------------------------------------------------------


def test_split_is_deterministic_complete_and_balanced(calls):
  more = [stellarax.XlaRaggedDot.bind(jnp.ones((m, 8)), jnp.ones((2, 8, 4)), jnp.array([m // 2, m - m // 2]))
          for m in (5, 17, 40)]
  every = calls + [ba.with_config(None) for ba in more]
  sizes = {(ba.op_json(), ba.key_json()): len(ba.autotuning_configs) for ba in every}
  for workers in (1, 2, 3, 4, 9):
    shares = distributed.split_calls(every, workers)
    assert shares == distributed.split_calls(list(reversed(every)), workers)
    assert len(shares) == workers
    assert sorted(k for s in shares for k in _keys(s)) == sorted(sizes)
    loads = [sum(sizes[k] for k in _keys(s)) for s in shares]
    assert max(loads) - min(loads) <= max(sizes.values())
    for share in shares:
      assert _keys(share) == [(ba.op_json(), ba.key_json()) for ba in share]  # sorted order
  with pytest.raises(ValueError, match="num_workers=0 must be >= 1"):
    distributed.split_calls(every, 0)


def test_one_process_one_device_keeps_the_plain_path(calls, monkeypatch):
  assert not distributed.should_distribute()

  def not_here(*args, **kwargs):
    raise AssertionError("tune_distributed must not run with one process and one device")

  monkeypatch.setattr(distributed, "tune_distributed", not_here)
  norm = [ba for ba in calls if ba.op.name == "layer_norm.xla"]
  result = stellarax.Autotuner(progress=False, measure_options=FAST).autotune(norm)
  assert len(result) == 1


def test_a_share_stops_once_a_call_lost_the_device(calls):
  # After a lost device nothing runs in the process: its later calls are reported as
  # not tuned, with why, instead of each failing on the dead device.
  tried, published = [], []

  class LosesTheDevice:
    def entry_for(self, ba, **kwargs):
      tried.append(ba)
      failure = Measurement(status="runtime_error", error="CUDA_ERROR_ILLEGAL_ADDRESS: ...")
      raise stellarax.autotuning.DeviceLostError("the bad config", {"the bad config": failure})

  class Publisher:
    def publish(self, worker, index, entry, error):
      published.append((index, entry, error))

  share = list(calls[:3])
  distributed._tune_share(LosesTheDevice(), None, share, None, Publisher(), None, {})
  assert tried == share[:1]
  assert [(i, e) for i, e, _ in published] == [(0, None), (1, None), (2, None)]
  assert published[0][2].startswith("DeviceLostError: Running candidate 'the bad config' lost")
  assert all("lost its device ('the bad config' of BoundArguments(" in error
             for _, _, error in published[1:])


def test_timeout_is_validated():
  with pytest.raises(ValueError, match="distributed_timeout_s=0 must be a positive"):
    stellarax.Autotuner(distributed_timeout_s=0)


def test_config_digest_follows_the_selected_configs(calls):
  (ba,) = [b for b in calls if b.op.name == "ragged_dot.xla"]
  configs = sorted(ba.autotuning_configs, key=repr)[:2]
  ok = Measurement(status="ok", median_s=1e-3, ci_low_s=1e-3, ci_high_s=2e-3, num_samples=3)

  def result_with(best):
    entry = Entry(bound_args=ba, best_config=best, heuristic_config=configs[0],
                  measurements=tuple((c, ok) for c in configs))
    return AutotuningResult("cpu", {entry.key: entry})

  a, b = result_with(configs[0]), result_with(configs[1])
  assert distributed.config_digest(a) == distributed.config_digest(result_with(configs[0]))
  assert distributed.config_digest(a) != distributed.config_digest(b)
  assert stellarax.autotuning.check_consistent(a) == distributed.config_digest(a)  # One process.


# --- other processes --------------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_workers(tmp_path: Path, calls_file: Path, num_processes: int, *, devices: int = 1,
                 wait_for=None, **spec) -> dict[int, dict]:
  """Starts the workers, waits for the outputs of `wait_for` (default all), kills the rest."""
  wait_for = range(num_processes) if wait_for is None else wait_for
  # Keeps conftest's XLA_FLAGS (cheap compiles); adds the device count.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
  port, procs, outputs, logs = _free_port(), {}, {}, []
  try:
    for i in range(num_processes):
      out = tmp_path / f"out{i}.json"
      worker_spec = {"process_id": i, "num_processes": num_processes, "port": port,
                     "calls": str(calls_file), "out": str(out), **spec}
      logs.append(open(tmp_path / f"log{i}.txt", "w"))
      procs[i] = subprocess.Popen([sys.executable, __file__, json.dumps(worker_spec)], env=env,
                                  stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + WORKER_LIMIT_S
    while any(not (tmp_path / f"out{i}.json").exists() for i in wait_for):
      for i in wait_for:
        if procs[i].poll() is not None and not (tmp_path / f"out{i}.json").exists():
          pytest.fail(f"worker {i} exited with {procs[i].returncode} and no output:\n"
                      + (tmp_path / f"log{i}.txt").read_text()[-3000:])
      if time.monotonic() > deadline:
        pytest.fail(f"workers {list(wait_for)} gave no output within {WORKER_LIMIT_S} s")
      time.sleep(0.2)
    for i in wait_for:
      outputs[i] = json.loads((tmp_path / f"out{i}.json").read_text())
      assert "crash" not in outputs[i], f"worker {i} crashed:\n{outputs[i]['crash']}"
  finally:
    for proc in procs.values():  # Done: a hung worker would block the others' shutdown.
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    for log in logs:
      log.close()
  return outputs


def _check_tuned_once_everywhere(outputs, calls):
  results = [out["result"] for out in outputs.values()]
  assert all(r == results[0] for r in results), "processes ended with different results"
  result = AutotuningResult.loads(results[0])
  assert sorted(e.key for e in result) == _keys(calls)
  for entry in result:
    assert entry.best_time is not None and entry.best_config in entry.bound_args.autotuning_configs
  tuned = [(process, device, op, key) for out in outputs.values() for process, device, op, key in out["tuned"]]
  assert sorted((op, key) for _, _, op, key in tuned) == _keys(calls), "a call was tuned twice or never"
  return result, tuned


def _check_measured_where_tuned(outputs):
  for out in outputs.values():
    for _, device, _, _ in out["tuned"]:
      assert [device] in out["inputs_on"]
    assert all(len(devices) == 1 for devices in out["inputs_on"])


@pytest.mark.parametrize("num_processes", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_processes_split_the_calls_and_agree(num_processes, calls, calls_file, tmp_path):
  outputs = _run_workers(tmp_path, calls_file, num_processes, check_consistent=num_processes == 2)
  result, tuned = _check_tuned_once_everywhere(outputs, calls)
  # Four calls, two of them with larger spaces: every process gets work.
  assert {process for process, _, _, _ in tuned} == set(range(num_processes))
  shares = distributed.split_calls(calls, num_processes)  # One device per process.
  for process, _, op, key in tuned:
    assert (op, key) in _keys(shares[process])
  _check_measured_where_tuned(outputs)
  assert all(out["process_count"] == num_processes for out in outputs.values())
  if num_processes == 2:
    digests = {out["digest"] for out in outputs.values()}
    assert digests == {distributed.config_digest(result)}
    for out in outputs.values():  # Process 1 changed one config; both name that op.
      assert out["inconsistent"].startswith("Processes 0 and 1 run BoundArguments(ragged_dot.xla, ")
      assert "different configs" in out["inconsistent"]


@pytest.mark.slow  # CI's slow stage (`make test` within 10 minutes on two cores)
def test_local_devices_split_the_calls_in_one_process(calls, calls_file, tmp_path):
  outputs = _run_workers(tmp_path, calls_file, 1, devices=2)
  assert outputs[0]["process_count"] == 1 and outputs[0]["local_devices"] == 2
  _, tuned = _check_tuned_once_everywhere(outputs, calls)
  assert {device for _, device, _, _ in tuned} == {0, 1}
  _check_measured_where_tuned(outputs)


@pytest.mark.slow  # ~9 s of worker processes
def test_a_total_budget_is_shared_by_the_devices_by_weight(calls, tmp_path):
  # Device times as a profile would give them (xplane_to_bound_args output).
  weights = dict(zip(sorted(calls, key=lambda ba: (ba.op_json(), ba.key_json())), (4.0, 2.0, 1.0, 1.0)))
  weighted = tmp_path / "profiled_calls.json"
  weighted.write_text(json.dumps({"calls": [
      {"bound_args": ba.to_json(), "count": 1, "device_time_s": t} for ba, t in weights.items()]}))
  outputs = _run_workers(tmp_path, weighted, 1, devices=2, total_budget_s=3.0)
  _check_tuned_once_everywhere(outputs, calls)
  # Two devices in parallel share twice the budget, 6 s, by weight: 3, 1.5, 0.75, 0.75,
  # split so that each device's calls add up to 3 s, each share heaviest first.
  static = {(ba.op_json(), ba.key_json()): 6.0 * w / 8.0 for ba, w in weights.items()}
  budgets = outputs[0]["budgets"]
  per_device = {d: [(op, key, b) for device, op, key, b in budgets if device == d] for d in (0, 1)}
  assert sorted(sum(static[op, key] for op, key, _ in calls_of) for calls_of in per_device.values()) \
      == pytest.approx([3.0, 3.0])
  for calls_of in per_device.values():
    shares = [static[op, key] for op, key, _ in calls_of]
    assert shares == sorted(shares, reverse=True)
    # The first call takes its share; the next ones share what it left (BudgetPool, more
    # or less than their static shares as it under- or overran).
    assert calls_of[0][2] == pytest.approx(shares[0])


def test_split_balances_the_given_loads(calls):
  loads = dict(zip(sorted(calls, key=lambda ba: (ba.op_json(), ba.key_json())), (4.0, 2.0, 1.0, 1.0)))
  shares = distributed.split_calls(calls, 2, loads=loads)
  assert sorted(sum(loads[ba] for ba in share) for share in shares) == [4.0, 4.0]


@pytest.mark.slow
def test_hung_and_failing_processes_are_reported_and_the_rest_kept(calls, calls_file, tmp_path):
  timeout_s = 15.0
  shares = distributed.split_calls(calls, 4)
  outputs = _run_workers(tmp_path, calls_file, 4, wait_for=[0, 2], timeout_s=timeout_s, hang=3, fail=1)
  expected_partial = sorted(_keys(shares[0]) + _keys(shares[2]))
  for i, out in outputs.items():
    error = out["error"]
    assert error["type"] == "DistributedTuningError" and error["failed_processes"] == [1, 3]
    assert "process 3 (local device 0) delivered no tuned call for timeout_s=15 s" in error["message"]
    assert "process 1 (local device 0): tuning" in error["message"]
    assert "injected failure in process 1" in error["message"]
    for ba in shares[3]:
      assert str(ba) in error["message"]
    partial = AutotuningResult.loads(error["partial"])
    assert sorted(e.key for e in partial) == expected_partial
    assert sorted(map(tuple, error["not_tuned"])) == sorted(_keys(shares[1]) + _keys(shares[3]))
    assert timeout_s <= error["waited_s"] < timeout_s + 60
  assert outputs[0]["error"]["partial"] == outputs[2]["error"]["partial"]


# --- the worker ---------------------------------------------------------------------------


def _worker_main(spec: dict) -> None:
  """One process of a test: tunes the calls and writes what happened to spec["out"]."""
  out: dict = {"tuned_by_me": [], "inputs_on": [], "budgets": []}
  try:
    if spec["num_processes"] > 1:
      jax.distributed.initialize(coordinator_address=f"localhost:{spec['port']}",
                                 num_processes=spec["num_processes"], process_id=spec["process_id"])
    _record(spec, out)
    tuner = stellarax.Autotuner(progress=False, measure_options=FAST, strategy=two_configs,
                                distributed_timeout_s=spec.get("timeout_s", 120.0),
                                total_budget_s=spec.get("total_budget_s"))
    out.update(process_count=jax.process_count(), local_devices=len(jax.local_devices()))
    start = time.monotonic()
    try:
      result = tuner.autotune(spec["calls"])
    except distributed.DistributedTuningError as exc:
      out["error"] = {"type": type(exc).__name__, "message": str(exc), "waited_s": time.monotonic() - start,
                      "failed_processes": list(exc.failed_processes),
                      "partial": exc.partial_result.dumps(),
                      "not_tuned": [[ba.op_json(), ba.key_json()] for ba in exc.not_tuned]}
    else:
      out["result"] = result.dumps()
      if spec.get("check_consistent"):
        _check_consistency(result, out)
  except BaseException:  # The test reads the traceback.
    out["crash"] = traceback.format_exc()
  out["tuned"] = [[spec["process_id"], *t] for t in out["tuned_by_me"]]
  tmp = Path(spec["out"] + ".tmp")
  tmp.write_text(json.dumps(out))
  tmp.rename(spec["out"])


def _record(spec: dict, out: dict) -> None:
  """Wraps tune_one and measure_candidates to record where calls are tuned and measured."""
  from stellarax.autotuning import autotuner as autotuner_lib
  from stellarax.autotuning import measure as measure_lib
  tune_one, measure = autotuner_lib.Autotuner.tune_one, measure_lib.measure_candidates

  def recording_tune_one(self, ba, *, progress=None, device=None):
    if spec.get("hang") == spec["process_id"]:
      time.sleep(3600)
    if spec.get("fail") == spec["process_id"]:
      raise ValueError(f"injected failure in process {spec['process_id']}")
    entry = tune_one(self, ba, progress=progress, device=device)
    index = jax.local_devices().index(device)
    out["tuned_by_me"].append([index, ba.op_json(), ba.key_json()])
    out["budgets"].append([index, ba.op_json(), ba.key_json(), self.budget_s])
    return entry

  def recording_measure(candidates, args, **kwargs):
    local = jax.local_devices()
    out["inputs_on"].append(sorted({local.index(d) for x in jax.tree.leaves(args) for d in x.devices()}))
    return measure(candidates, args, **kwargs)

  autotuner_lib.Autotuner.tune_one = recording_tune_one
  measure_lib.measure_candidates = recording_measure


def _check_consistency(result: AutotuningResult, out: dict) -> None:
  out["digest"] = stellarax.autotuning.check_consistent(result, timeout_s=60)
  if jax.process_index() == 1:  # Pick the other measured config of a ragged_dot call.
    (entry,) = [e for e in result if e.bound_args.op.name == "ragged_dot.xla"]
    other = next(c for c, _ in entry.measurements if c != entry.best_config)
    result = result.with_entry(dataclasses.replace(entry, best_config=other))
  try:
    stellarax.autotuning.check_consistent(result, timeout_s=60)
  except stellarax.autotuning.InconsistentConfigsError as exc:  # exported where users catch it
    out["inconsistent"] = str(exc)


if __name__ == "__main__":
  _worker_main(json.loads(sys.argv[1]))
