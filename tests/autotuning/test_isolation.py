"""Tuning an op whose configs fail in every way, in this process and in workers.

`FaultyOp` computes 2 * x; its configs compute it fast or slowly, or fail to compile,
raise at run time, return NaN, return wrong values, hang, or (only in worker
processes) kill the process. The run must finish within its limits, record each
failure with its status, and pick the fast config.
"""

import dataclasses
import io
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import stellarax
from stellarax.autotuning import isolation
from stellarax.autotuning.measure import MeasureOptions
from stellarax.core.config import check_choice, config_dataclass
from stellarax.core.op import Op

# Every test here holds configs to a time limit and picks the fast one by measuring.
pytestmark = pytest.mark.timing

BEHAVIOURS = ("fast", "slow", "compile_error", "raise", "nan", "wrong", "hang", "crash", "poison",
              "scribble", "unrolled")
HANG_S = 60.0  # how long the hang config sleeps (a worker process is killed first)
# What a kernel's illegal memory access leaves on a GPU: the poison config sets it, and
# then every run of FaultyOp(poison=True) in the process fails as on a lost device.
_POISONED = False
_LOST = "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"
POISON_SPACE = ("fast", "slow", "compile_error", "raise", "wrong", "poison")
# The scribble config writes into the buffer at this address (the call's input, as a
# kernel writing out of bounds on a GPU can); "unrolled" is a correct config after it.
_SCRIBBLE_AT = None
SCRIBBLE_SPACE = ("slow", "fast", "scribble", "unrolled")


@config_dataclass
class FaultyConfig:
  """How FaultyOp computes (or fails to compute) 2 * x."""

  behaviour: str = "slow"

  def __post_init__(self):
    check_choice("behaviour", self.behaviour, BEHAVIOURS)


def _on_host(fn, x):
  return jax.pure_callback(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _hang(v):
  time.sleep(HANG_S)  # read when called, so a test can shorten it
  return v


def _raise(v):
  raise RuntimeError("boom from a faulty config")


def _crash(v):
  os._exit(3)


def _poison(v):
  global _POISONED
  _POISONED = True
  raise RuntimeError(f"INTERNAL: Failed to launch CUDA kernel: {_LOST}")


def _scribble():
  import ctypes
  ctypes.memset(_SCRIBBLE_AT, 0x7F, 16)
  return np.int32(0)


def _fail_if_poisoned(v):
  if _POISONED:
    raise RuntimeError(f"INTERNAL: CUDA error: Could not synchronize CUDA stream: {_LOST}")
  return v


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultyOp(Op, name="test_isolation.faulty"):
  """2 * x with configs that misbehave; `crash` adds the config that kills its process,
  `poison` the one that leaves the process unable to run anything more (a small space)."""

  config_cls = FaultyConfig
  crash: bool = False
  poison: bool = False
  scribble: bool = False
  crash_in_reference: bool = False  # its reference kills the process (in a worker only)
  reference_s: float = 0.0  # seconds its reference takes (then a space of correct configs)

  def _fwd(self, x, *, config):
    b = config.behaviour
    if b == "compile_error":
      raise TypeError("this config does not compile")
    y = 2 * x
    if b == "slow":
      y = jax.lax.fori_loop(0, 300, lambda i, v: v + 0.0 * jnp.sin(v), y)
    elif b == "raise":
      y = _on_host(_raise, y)
    elif b == "nan":
      y = y.at[0].set(jnp.nan)
    elif b == "wrong":
      y = 3 * x
    elif b == "hang":
      y = _on_host(_hang, y)
    elif b == "crash":
      y = _on_host(_crash, y)
    elif b == "poison":
      y = _on_host(_poison, y)
    elif b == "scribble":
      io_callback(_scribble, jax.ShapeDtypeStruct((), jnp.int32), ordered=False)
    elif b == "unrolled":
      y = x + x
    if self.poison:
      y = _on_host(_fail_if_poisoned, y)
    return y, None

  def _reference(self, x):
    if self.crash_in_reference:
      return _on_host(_crash, 2 * x)
    if self.reference_s:
      return _on_host(lambda v: time.sleep(self.reference_s) or v, 2 * x)
    return 2 * x

  def _get_heuristics_config(self, ba):
    return FaultyConfig(behaviour="slow")

  def _get_autotuning_configs(self, ba):
    if self.poison:
      return {FaultyConfig(behaviour=b) for b in POISON_SPACE}
    if self.scribble:
      return {FaultyConfig(behaviour=b) for b in SCRIBBLE_SPACE}
    if self.reference_s:
      return {FaultyConfig(behaviour=b) for b in ("slow", "fast", "unrolled")}
    return {FaultyConfig(behaviour=b) for b in BEHAVIOURS
            if b not in ("poison", "scribble", "unrolled") and (self.crash or b != "crash")}


OPTIONS = MeasureOptions(rounds=3, leader_rounds=1, warmup_s=0.0, max_total_s=0.3, min_batch_s=2e-4,
                         timeout_s=3.0)
EXPECTED = {"fast": "ok", "slow": "ok", "compile_error": "compile_error", "raise": "runtime_error",
            "nan": "wrong_result", "wrong": "wrong_result", "hang": "timeout"}


def _tune(op, isolate):
  x = jax.random.normal(jax.random.key(0), (256, 64))
  tuner = stellarax.Autotuner(progress=False, measure_options=OPTIONS, strategy="exhaustive",
                              isolate=isolate)
  started = time.perf_counter()
  (entry,) = tuner.autotune(op.bind(x))
  return entry, time.perf_counter() - started


def _statuses(entry):
  return {c.behaviour: m.status for c, m in entry.measurements}


def test_every_failure_is_recorded_and_a_valid_config_wins(monkeypatch):
  # In this process the hung call cannot be stopped, only abandoned: keep it short,
  # and wait it out at the end so it does not share the machine with later tests.
  monkeypatch.setattr(sys.modules[__name__], "HANG_S", 8.0)
  entry, seconds = _tune(FaultyOp(), isolate=False)
  assert _statuses(entry) == EXPECTED
  hang = dict((c.behaviour, m) for c, m in entry.measurements)["hang"]
  assert "did not finish within timeout_s=3 s" in hang.error
  assert entry.best_config == FaultyConfig(behaviour="fast")
  time.sleep(max(0.0, 8.0 - seconds))


@pytest.fixture
def fresh_workers():
  isolation.close_workers()
  yield
  isolation.close_workers()


@pytest.mark.slow  # ~14 s, serial (timing): its hangs and crash cost timeouts and fresh workers
def test_isolated_workers_survive_hangs_and_crashes(fresh_workers):
  entry, seconds = _tune(FaultyOp(crash=True), isolate=True)
  statuses = _statuses(entry)
  assert {b: s for b, s in statuses.items() if b != "crash"} == EXPECTED
  assert statuses["crash"] == "runtime_error"
  crash = dict((c.behaviour, m) for c, m in entry.measurements)["crash"]
  assert "exited with code 3" in crash.error
  assert entry.best_config == FaultyConfig(behaviour="fast")
  assert seconds < HANG_S


@pytest.mark.slow  # ~7 s, serial (timing); every status is also met in test_every_failure_is_recorded_and_a_valid_config_wins
def test_isolated_measurement_matches_in_process_statuses(fresh_workers):
  x = jax.random.normal(jax.random.key(1), (128, 32))
  ba = FaultyOp().bind(x)
  configs = sorted(ba.autotuning_configs, key=lambda c: c.behaviour)
  got = isolation.measure_isolated(ba, configs, seed=0, options=OPTIONS)
  assert list(got) == configs  # every config, in the order asked
  assert {c.behaviour: m.status for c, m in got.items()} == EXPECTED
  with pytest.raises(ValueError, match="No configs"):
    isolation.measure_isolated(ba, [], seed=0, options=OPTIONS)


def test_an_op_the_worker_cannot_import_is_reported(tmp_path):
  script = tmp_path / "main_op.py"
  script.write_text(
      "import dataclasses\n"
      "import jax.numpy as jnp\n"
      "from stellarax.autotuning import isolation\n"
      "from stellarax.autotuning.measure import MeasureOptions\n"
      "from stellarax.core.config import NoConfig\n"
      "from stellarax.core.op import Op\n"
      "@dataclasses.dataclass(frozen=True, kw_only=True)\n"
      "class MainOp(Op, name='main.toy'):\n"
      "  def _fwd(self, x, *, config): return x * 2, None\n"
      "  def _reference(self, x): return x * 2\n"
      "  def _get_heuristics_config(self, ba): return NoConfig()\n"
      "ba = MainOp.bind(jnp.ones(4))\n"
      "(m,) = isolation.measure_isolated(ba, [NoConfig()], seed=0, options=MeasureOptions()).values()\n"
      "print(m.status, m.error)\n")
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("runtime_error") and "must be importable" in proc.stdout


def test_workers_start_with_this_process_jax_options():
  env = isolation._worker_environment()
  assert env["JAX_NUMPY_RANK_PROMOTION"] == jax.config.jax_numpy_rank_promotion == "raise"  # conftest
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  # Devices set with jax.config reach the worker, which indexes them as this process does.
  assert env["JAX_NUM_CPU_DEVICES"] == str(jax.config.jax_num_cpu_devices)
  assert all(p in env["PYTHONPATH"].split(os.pathsep) for p in sys.path if p)


def test_a_config_that_loses_the_device_stops_in_process_tuning_with_advice(monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "_POISONED", False)  # and back after
  with pytest.raises(stellarax.autotuning.DeviceLostError) as info:
    _tune(FaultyOp(poison=True), isolate=False)
  exc = info.value
  assert exc.key == FaultyConfig(behaviour="poison")
  assert "CUDA_ERROR_ILLEGAL_ADDRESS" in exc.measurements[exc.key].error
  assert exc.measurements[exc.key].lost_the_device
  # Measuring stopped at it: no config was timed after the device was lost.
  assert not any(m.ok for m in exc.measurements.values())
  assert "isolate=True" in str(exc) and len(exc.partial_result) == 0
  assert "It happened while tuning" in "\n".join(exc.__notes__)


def test_isolated_tuning_records_the_config_that_lost_the_device_and_goes_on(fresh_workers):
  entry, _ = _tune(FaultyOp(poison=True), isolate=True)
  statuses = _statuses(entry)
  assert statuses == {b: EXPECTED.get(b, "runtime_error") for b in POISON_SPACE}
  poison = dict((c.behaviour, m) for c, m in entry.measurements)["poison"]
  assert poison.lost_the_device and "CUDA_ERROR_ILLEGAL_ADDRESS" in poison.error
  assert not any(m.lost_the_device for c, m in entry.measurements if c.behaviour != "poison")
  assert entry.best_config == FaultyConfig(behaviour="fast")


def test_the_autotune_command_says_to_isolate_what_lost_the_device(tmp_path, monkeypatch, capsys,
                                                                   user_cache_dir, fresh_workers):
  from stellarax.tools import cli
  monkeypatch.setattr(sys.modules[__name__], "_POISONED", False)
  calls = tmp_path / "calls.json"
  stellarax.autotuning.bound_args_to_json([FaultyOp(poison=True).bind(jnp.ones((64, 32)))], calls)
  out = tmp_path / "result.json"
  assert cli.main(["autotune", str(calls), "--output", str(out), "--no-progress"]) == 1
  assert "lost the device" in capsys.readouterr().err and not out.exists()  # nothing tuned
  monkeypatch.setattr(sys.modules[__name__], "_POISONED", False)
  assert cli.main(["autotune", str(calls), "--output", str(out), "--no-progress", "--isolate"]) == 0
  (entry,) = stellarax.AutotuningResult.load(out)
  assert entry.best_config == FaultyConfig(behaviour="fast")


def test_a_config_that_writes_into_its_inputs_is_never_chosen_nor_spoils_the_rest(monkeypatch):
  # Each config measured on its own (chunks of one), so the configs after the scribbler
  # run on the call's kept inputs: those must be fresh again, not what it wrote.
  import functools
  from stellarax.autotuning import search
  real_init = isolation.CallMeasurer.__init__

  def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    monkeypatch.setattr(sys.modules[__name__], "_SCRIBBLE_AT", self.arrays[0].unsafe_buffer_pointer())

  monkeypatch.setattr(isolation.CallMeasurer, "__init__", init)
  x = jax.random.normal(jax.random.key(0), (256, 64))
  tuner = stellarax.Autotuner(progress=False, measure_options=OPTIONS,
                              strategy=functools.partial(search.exhaustive, chunk_size=1))
  (entry,) = tuner.autotune(FaultyOp(scribble=True).bind(x))
  assert _statuses(entry) == {"slow": "ok", "fast": "ok", "scribble": "wrong_result",
                              "unrolled": "ok"}
  scribble = dict((c.behaviour, m) for c, m in entry.measurements)["scribble"]
  assert scribble.error.startswith("it changed its inputs")
  assert entry.best_config in (FaultyConfig(behaviour="fast"), FaultyConfig(behaviour="unrolled"))


def _configs(*behaviours):
  return [FaultyConfig(behaviour=b) for b in behaviours]


def test_a_request_interrupted_while_waiting_leaves_no_reply_for_the_next(fresh_workers,
                                                                          monkeypatch):
  # Interrupted (Ctrl-C reaching the tuning process alone), the worker stayed in the pool
  # measuring, and its reply was read as the next request's: by position, so the wrong
  # config came back ok and the right one wrong.
  wait = isolation._Worker._wait_for

  def interrupted(self, number, deadline):
    monkeypatch.setattr(isolation._Worker, "_wait_for", wait)
    raise KeyboardInterrupt

  monkeypatch.setattr(isolation._Worker, "_wait_for", interrupted)
  x = jax.random.normal(jax.random.key(2), (64, 32))
  with pytest.raises(KeyboardInterrupt):
    isolation.measure_isolated(FaultyOp().bind(x), _configs("wrong", "fast"), seed=0,
                               options=OPTIONS)
  got = isolation.measure_isolated(FaultyOp().bind(x[:32]), _configs("fast", "wrong"), seed=0,
                                   options=OPTIONS)
  assert [m.status for m in got.values()] == ["ok", "wrong_result"]


def test_an_isolated_search_spends_its_budget_measuring(fresh_workers):
  # The worker's start and the call's set-up (here a reference of 2.5 s) counted in the
  # budget: a 2 s search measured its heuristic alone, where one in this process sets
  # the call up first and measures the rest.
  x = jax.random.normal(jax.random.key(3), (256, 64))
  tuner = stellarax.Autotuner(progress=False, measure_options=OPTIONS, budget_s=2.0, isolate=True,
                              strategy="exhaustive")
  (entry,) = tuner.autotune(FaultyOp(reference_s=2.5).bind(x))
  assert _statuses(entry) == {"slow": "ok", "fast": "ok", "unrolled": "ok"}
  assert entry.best_config != FaultyConfig(behaviour="slow")


def test_a_worker_lost_setting_up_the_call_fails_its_configs_once(fresh_workers):
  # Lost before it measured anything, no config is to blame: the configs were split in
  # halves down to one each, 2n - 1 workers, every config blamed.
  x = jax.random.normal(jax.random.key(2), (64, 32))
  configs = _configs("fast", "slow", "wrong", "nan")
  started = []
  real = isolation._Worker.__init__

  def counted(self):
    started.append(1)
    real(self)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(isolation._Worker, "__init__", counted)
    got = isolation.measure_isolated(FaultyOp(crash_in_reference=True).bind(x), configs, seed=0,
                                     options=OPTIONS)
  assert len(started) == 1
  for m in got.values():
    assert m.status == "runtime_error" and "exited with code 3" in m.error
    assert "before it measured any config" in m.error


def test_a_shut_or_dead_worker_is_never_asked_again(fresh_workers):
  # Another thread's shut worker was written to ('write to closed file'), or its end read
  # as the next request's; a worker dead between requests was replaced with its pipes open.
  worker = isolation._worker_for(None)
  worker.retire()
  request = isolation._Request(None, 0, None, (), OPTIONS, 1.0)
  assert worker.ask(request, 1.0) == ("retired", None)
  fresh = isolation._worker_for(None)
  assert fresh is not worker
  fresh.process.kill()
  fresh.process.wait()
  again = isolation._worker_for(None)
  assert again is not fresh and fresh.closed and fresh.process.stdin.closed


def test_a_worker_asked_for_a_device_it_does_not_see_says_how_to_fix_it(fresh_workers):
  x = jax.random.normal(jax.random.key(2), (64, 32))
  (m,) = isolation.measure_isolated(FaultyOp().bind(x), _configs("fast"), seed=0,
                                    options=OPTIONS, device_index=len(jax.devices())).values()
  assert m.status == "runtime_error"
  assert f"device {len(jax.devices())} was asked for" in m.error and "JAX_NUM_CPU_DEVICES" in m.error


def test_a_worker_compiles_each_search_s_configs_anew():
  # A worker keeps its measurer while the same call comes back, and racing re-measures
  # configs within a search on its compiles. A new search starts with `prepare` (an
  # empty request): kept compiles would report times that it did not pay, which its
  # cost model takes as part of its calls (search._split_compile).
  x = jax.random.normal(jax.random.key(4), (64, 32))
  request = isolation._Request(FaultyOp().bind(x), 0, None, tuple(_configs("fast")), OPTIONS, 1.0)
  (fast,) = request.configs
  reply, measurer = isolation._serve(request, None, lambda: None)
  assert reply["measurements"][0].ok and fast in measurer.compiled
  again, same = isolation._serve(request, measurer, lambda: None)  # the same search
  assert same is measurer and fast in measurer.compiled
  assert again["measurements"][0].compile_time_s == reply["measurements"][0].compile_time_s
  _, same = isolation._serve(dataclasses.replace(request, configs=()), measurer, lambda: None)
  assert same is measurer and fast not in measurer.compiled  # a new search: its own


def test_closing_workers_at_once_kills_a_busy_one_without_waiting(monkeypatch):
  # At gpu_check's hard limit a worker in the middle of a measurement was given 10 s to
  # exit, 10 s past a limit meant to bound the device's time.
  class Busy:  # a process that never exits on its own
    def __init__(self):
      self.stdin, self.stdout, self.killed, self.waits = io.BytesIO(), io.BytesIO(), False, []

    def wait(self, timeout=None):
      self.waits.append(timeout)
      if not self.killed:
        time.sleep(timeout or 0)
        raise subprocess.TimeoutExpired("worker", timeout)

    def kill(self):
      self.killed = True

  worker = object.__new__(isolation._Worker)
  worker.process, worker.closed = Busy(), False
  monkeypatch.setattr(isolation, "_workers", {None: worker})
  start = time.monotonic()
  isolation.close_workers(at_once=True)
  assert worker.process.killed and worker.closed and time.monotonic() - start < 1.0
  assert worker.process.waits == [None]  # only the wait for the killed process
