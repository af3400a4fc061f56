"""Measuring configs in a worker process, so that a hung candidate cannot stall tuning.

In-process measurement gives up on a call that runs past `MeasureOptions.timeout_s`
but cannot stop it: on a GPU the hung kernel keeps the device, and every later
candidate queues behind it. With `Autotuner(isolate=True)` each call's configs are
measured by `measure_candidates` in a worker process, with `stop_after_run_timeout`:
after the first timeout the worker reports what it decided and exits, taking the hung
work with it, and a fresh worker measures the configs still undecided. A worker that dies (a crash,
out of memory) or stays silent past a generous deadline is killed, and the configs it
was measuring are recorded as `runtime_error` with what happened.

The worker rebuilds the call from its `BoundArguments` (sent pickled; the op's module
is imported by unpickling, so ops defined outside stellarax work when their module is
importable from `sys.path`), makes the same random inputs from the same seed, and keeps
compiled candidates while successive requests are for the same call. Workers are kept
per device and reused across calls; on a GPU they do not preallocate memory
(`XLA_PYTHON_CLIENT_PREALLOCATE=false`), so they fit beside the parent's arrays.

A worker lost while measuring several configs does not say which one killed it: the
configs are split in halves and measured again until the culprit is alone, so one bad
config costs about log2(#configs) extra workers. A worker says when it has set up the call
(its inputs, the op's reference output): one lost before that (the reference crashed it,
it could not start) fails the configs asked once, with its cause, and blames none. A
reply carries its request's number, so a reply left over from a request its asker gave
up on (an interrupt) is never read as another's; such a worker is shut. A config that loses the device (an
illegal address, a trap: `Measurement.lost_the_device`) leaves the worker alive but
unable to run anything more: the worker reports the configs decided so far, that one
among them, and stops, and a fresh worker measures the rest.

Messages are length-prefixed pickles on the worker's stdin and on a duplicate of its
original stdout (its own prints go to stderr). The worker's entry point is
`stellarax/autotuning/isolation_worker.py`.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, BinaryIO

from stellarax.autotuning import measure as measure_lib

_HEADER = struct.Struct("<Q")
# Seconds a worker may take to start (import JAX, build the inputs) on top of the work.
_STARTUP_S = 120.0


def _send(stream: BinaryIO, message: Any) -> None:
  data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(_HEADER.pack(len(data)) + data)
  stream.flush()


def _receive(stream: BinaryIO) -> Any:
  header = stream.read(_HEADER.size)
  if len(header) < _HEADER.size:
    raise EOFError("the other side closed the stream")
  (size,) = _HEADER.unpack(header)
  data = stream.read(size)
  if len(data) < size:
    raise EOFError("the stream ended inside a message")
  return pickle.loads(data)


@dataclasses.dataclass(frozen=True)
class _Request:
  bound_args: Any
  seed: int
  device_index: int | None
  configs: tuple[Any, ...]
  options: measure_lib.MeasureOptions
  effort: float


# JAX options that change what a traced call computes or where: a worker starts
# with this process's values (set in the environment, which JAX reads at import).
_INHERITED_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_platforms",
                          "jax_numpy_rank_promotion", "jax_compilation_cache_dir",
                          # which devices there are: a worker indexes them as this process does
                          "jax_num_cpu_devices", "jax_cuda_visible_devices",
                          "jax_rocm_visible_devices")


def _worker_environment() -> dict[str, str]:
  import jax
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  for name in _INHERITED_JAX_OPTIONS:
    value = getattr(jax.config, name, None)
    if value is not None and value != "":
      env[name.upper()] = str(value)
  return env


class _Worker:
  """One worker process and a thread that reads its replies into a queue.

  One request is in flight at a time (`_asking`), and a reply carries its request's
  number, so a reply left over from a request whose asker gave up is never read as
  another's. A worker whose request ran past its deadline, whose process is gone, or that
  stops after its reply (a stalled measurement) is shut while the asker still holds it:
  another thread never sends it a request (it is told "retired" and takes a fresh one).
  """

  def __init__(self):
    env = _worker_environment()
    self.process = subprocess.Popen(
        [sys.executable, "-m", "stellarax.autotuning.isolation_worker"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=env)
    self.replies: queue.Queue = queue.Queue()
    self._asking = threading.Lock()
    self._requests = 0
    self.closed = False
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    try:
      while True:
        self.replies.put(("reply", _receive(self.process.stdout)))
    except Exception as e:  # EOF: the worker exited or died
      self.replies.put(("gone", e))

  def alive(self) -> bool:
    return not self.closed and self.process.poll() is None

  def ask(self, request: _Request, deadline_s: float) -> tuple[str, Any]:
    """Sends a request; returns ("reply", measurements), ("gone", reason) for a worker
    lost while measuring, ("lost in set-up", reason) for one lost before it measured
    anything (making the call's inputs and reference), ("silent", None) past the
    deadline, or ("retired", None) for a worker another thread shut meanwhile."""
    with self._asking:
      if self.closed:
        return "retired", None
      self._requests += 1
      number = self._requests
      try:
        _send(self.process.stdin, (number, pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)))
      except (BrokenPipeError, OSError, ValueError) as e:
        self._shut()
        return "lost in set-up", e
      try:
        kind, value = self._wait_for(number, time.monotonic() + deadline_s)
      except BaseException:  # interrupted (Ctrl-C): its reply must never reach another request
        self._shut()
        raise
      if kind != "reply" or value.get("stalled"):
        self._shut()
      return kind, value

  def _wait_for(self, number: int, deadline: float) -> tuple[str, Any]:
    set_up = False
    while True:
      try:
        kind, value = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        return "silent", None
      if kind == "gone":
        return ("gone" if set_up else "lost in set-up"), value
      replied_to, message = value
      if replied_to != number:
        continue  # the reply to a request its asker gave up on
      if message.get("set_up"):
        set_up = True
        continue
      return "reply", message

  def retire(self) -> None:
    """Shuts the worker once the request in flight, if any, is answered."""
    with self._asking:
      self._shut()

  def _shut(self, wait_s: float = 10.0) -> None:
    """Closes the worker's stdin (it exits) and kills it if it does not exit within
    `wait_s` (at once for 0)."""
    self.closed = True
    try:
      self.process.stdin.close()
      if wait_s <= 0:
        raise TimeoutError  # no waiting: killed below
      self.process.wait(timeout=wait_s)
    except Exception:  # a stuck or already broken worker
      self.process.kill()
      self.process.wait()
    self.process.stdout.close()


_workers: dict[int | None, _Worker] = {}
_workers_lock = threading.Lock()


def _worker_for(device_index: int | None) -> _Worker:
  with _workers_lock:
    worker = _workers.get(device_index)
    if worker is None or not worker.alive():
      if worker is not None and not worker.closed:
        worker._shut()  # died between requests: its pipes are closed, not leaked
      worker = _workers[device_index] = _Worker()
    return worker


def _retire(device_index: int | None, worker: _Worker) -> None:
  with _workers_lock:
    if _workers.get(device_index) is worker:
      del _workers[device_index]
  worker.retire()


@atexit.register
def close_workers(*, at_once: bool = False) -> None:
  """Stops every worker process (run at exit; safe to call any time).

  Args:
    at_once: kill them, where a worker in the middle of a measurement would otherwise
      be given 10 s to finish (a program that must end now, at a hard time limit).
  """
  with _workers_lock:
    workers = list(_workers.items())
    _workers.clear()
  for _, worker in workers:
    if not worker.closed:
      worker._shut(wait_s=0.0 if at_once else 10.0)


def _deadline_s(count: int, options: measure_lib.MeasureOptions) -> float:
  """How long a worker may take for `count` configs before it is presumed stuck."""
  per_config = 2 * options.timeout_s + options.max_total_s
  return _STARTUP_S + options.timeout_s + count * per_config


def _what_happened(kind: str, value: Any, worker: _Worker) -> str:
  if kind == "silent":
    return "sent nothing within the deadline and was killed"
  if kind == "gone":
    return f"exited with code {worker.process.returncode} ({value})"
  if kind == "lost in set-up":
    return (f"exited with code {worker.process.returncode} ({value}) while it set up the call "
            "(its inputs and the op's reference output), before it measured any config")
  return value.get("error", "returned no measurement")


def _measure_in_workers(bound_args: Any, pending: list[Any], seed: int,
                        options: measure_lib.MeasureOptions, effort: float,
                        device_index: int | None) -> dict[Any, measure_lib.Measurement]:
  """Measures `pending` until each is decided; a worker lost with several configs
  in flight is blamed on none of them: they are split in halves and measured again,
  so the config that kills its process ends up alone."""
  results: dict[Any, measure_lib.Measurement] = {}
  while pending:
    worker = _worker_for(device_index)
    request = _Request(bound_args, seed, device_index, tuple(pending), options, effort)
    kind, value = worker.ask(request, _deadline_s(len(pending), options))
    if kind == "retired":
      continue  # another thread shut it meanwhile: ask a fresh one
    got = {}
    if kind == "reply":
      got = {pending[i]: m for i, m in value.get("measurements", {}).items()}
      results.update(got)
    if kind != "reply" or value.get("stalled") or not got:
      _retire(device_index, worker)
    if got:
      pending = [c for c in pending if c not in results]
      continue
    # A worker lost measuring several configs: one of them may have killed it. Lost in
    # its set-up, before any config ran, or answering with an error: none did.
    if len(pending) > 1 and kind in ("gone", "silent"):
      half = len(pending) // 2
      for part in (pending[:half], pending[half:]):
        results.update(_measure_in_workers(bound_args, part, seed, options, effort, device_index))
      return results
    failure = measure_lib.Measurement(
        status="runtime_error", method="isolated",
        error=(f"the measuring worker process {_what_happened(kind, value, worker)}"
               + ("; it was asked for " if kind == "lost in set-up" else " while measuring ")
               + ", ".join(map(str, pending)))[:600])
    results.update({c: failure for c in pending})
    return results
  return results


def prepare(bound_args: Any, *, seed: int, options: measure_lib.MeasureOptions,
            device_index: int | None = None) -> None:
  """Starts the device's worker, if none runs, and has it set up the call: its random
  inputs and the op's reference output, which later measurements of the call reuse.
  The autotuner calls it before its search's clock starts, so that an isolated search
  spends its budget measuring, as one in this process does (there `CallMeasurer` sets
  up the call first): a worker's start (JAX's import, the device's) and a reference
  took the whole of a budget of a few seconds, and the search measured nothing but
  its heuristic. A failure here is left to the first measurement, which meets it
  again and says what happened.

  Args:
    bound_args, seed, options, device_index: as `measure_isolated`'s.
  """
  worker = _worker_for(device_index)
  request = _Request(bound_args, seed, device_index, (), options, 1.0)
  kind, value = worker.ask(request, _deadline_s(0, options))
  if kind != "reply" or value.get("error"):
    _retire(device_index, worker)


def measure_isolated(bound_args: Any, configs: Sequence[Any], *, seed: int,
                     options: measure_lib.MeasureOptions, effort: float = 1.0,
                     device_index: int | None = None) -> dict[Any, measure_lib.Measurement]:
  """Measures `configs` of one call in worker processes (see the module docstring).

  Args:
    bound_args: the call (a `BoundArguments` without a pinned config).
    configs: the configs to measure, in the order to measure them.
    seed: seed of the random inputs (`BoundArguments.example_arrays`).
    options: measurement options (`stop_after_run_timeout` is set for the worker).
    effort: fraction of a full measurement, as in `measure_candidates`.
    device_index: index in `jax.local_devices()` of the device to measure on;
      None: the default device.

  Returns:
    config -> Measurement for every config, in `configs` order.

  Raises:
    ValueError: if configs is empty.
  """
  configs = list(dict.fromkeys(configs))
  if not configs:
    raise ValueError("No configs to measure.")
  options = dataclasses.replace(options, stop_after_run_timeout=True)
  results = _measure_in_workers(bound_args, configs, seed, options, effort, device_index)
  return {c: results[c] for c in configs}


# --- the worker --------------------------------------------------------------------------


class CallMeasurer:
  """Measures configs of one call in this process: the call's random inputs (from
  `seed`, on `device`), its reference output and the executables compiled so far
  are made once and kept between measurements. The autotuner uses it directly,
  and a worker process per request."""

  def __init__(self, bound_args: Any, seed: int, device: Any = None):
    import jax
    import numpy as np
    self.bound_args, self.seed, self.device = bound_args, seed, device
    self.arrays = self._fresh_arrays()
    # On the host, where no kernel's stray write can reach it (a copy: on a CPU the
    # host's view of an array may be its buffer); read-only, so that a measure's
    # compile cache may keep its copies from one call to the next.
    reference = jax.jit(bound_args.runner(reference=True))(*self.arrays)
    self.reference = jax.tree.map(_read_only_copy, jax.device_get(reference))
    self.digest = measure_lib.input_digest(self.arrays)
    self.output_types = _output_types(bound_args, self.arrays, self.reference)
    self.compiled: dict[Any, Any] = {}  # racing re-measures configs: compile each once

  def __call__(self, configs: Sequence[Any], effort: float,
              options: measure_lib.MeasureOptions) -> dict[Any, measure_lib.Measurement]:
    """`measure_candidates` over `configs`, in their order."""
    configs = list(configs)
    out = measure_lib.measure_candidates(
        {c: self.bound_args.runner(c) for c in configs}, self.arrays, reference=self.reference,
        output_types=self.output_types, options=options, order=configs,
        compile_cache=self.compiled, effort=effort)
    import numpy as np
    if not np.array_equal(measure_lib.input_digest(self.arrays), self.digest):
      # A config wrote into the inputs (measure_candidates says which, and measured the
      # rest on clean copies): the next measurement starts from fresh ones.
      self.arrays = self._fresh_arrays()
    return out

  def _fresh_arrays(self) -> tuple:
    import jax
    arrays = self.bound_args.example_arrays(self.seed)
    return tuple(jax.device_put(arrays, self.device) if self.device is not None else arrays)


def _read_only_copy(x: Any) -> Any:
  import numpy as np
  copy = np.array(x, copy=True)
  copy.setflags(write=False)
  return copy


def _output_types(bound_args: Any, arrays: tuple, reference: Any) -> Any:
  """The shapes and dtypes every config's output must have (no config may change what
  the op returns): those of the heuristic config's program (what an untuned call
  returns, so what the caller's program was traced with), where it has the reference's
  structure and shapes. Where it does not (a heuristic that computes something else),
  or cannot be traced (its measurement says why), the reference's structure and
  shapes, of any dtype (`measure.AnyDtype`: a reference may compute in another one).
  Taken from the heuristic alone, a heuristic of a wrong shape made every correct
  config a wrong result, and one that failed to trace left shapes unchecked."""
  import jax
  import numpy as np
  of_reference = jax.tree.map(lambda x: measure_lib.AnyDtype(np.shape(x)), reference)
  try:
    of_heuristic = jax.eval_shape(bound_args.runner(bound_args.heuristics_config), *arrays)
  except Exception:  # noqa: BLE001 (the heuristic's own measurement records the failure)
    return of_reference
  if measure_lib.other_output_types(of_heuristic, of_reference) is not None:
    return of_reference
  return of_heuristic


def _serve(request: _Request, measurer: CallMeasurer | None, set_up: Any
           ) -> tuple[dict[str, Any], CallMeasurer]:
  import jax
  device = None
  if request.device_index is not None:
    devices = jax.devices()
    if not 0 <= request.device_index < len(devices):
      raise ValueError(
          f"device {request.device_index} was asked for, and this worker process sees "
          f"{len(devices)} ({devices[0].platform}); set what selects devices in the environment "
          "before the tuning process starts (e.g. XLA_FLAGS or JAX_NUM_CPU_DEVICES), or use "
          "isolate=False")
    device = devices[request.device_index]
  if measurer is None or (measurer.bound_args, measurer.seed, measurer.device) != (
      request.bound_args, request.seed, device):
    measurer = CallMeasurer(request.bound_args, request.seed, device)
  set_up()  # from here on a lost worker was lost measuring a config
  configs = list(request.configs)
  if not configs:  # `prepare`: the call is set up, nothing to measure; a search starts
    # Its configs compile anew in it: a compile kept from an earlier search of the same
    # call reports a compile time that this one did not pay, and the search's cost model
    # takes a new config's reported compile as part of its call (search._split_compile).
    measurer.compiled.clear()
    return {"measurements": {}, "stalled": False}, measurer
  out = measurer(configs, request.effort, request.options)
  index = {c: i for i, c in enumerate(configs)}
  # Any timeout leaves work behind (a hung run on the device, or a compilation on an
  # abandoned thread), and a lost device fails all later work: this worker stops after
  # replying and a fresh one goes on.
  stalled = any(m.status == "timeout" or m.lost_the_device for m in out.values())
  return {"measurements": {index[c]: m for c, m in out.items()}, "stalled": stalled}, measurer


def serve_requests() -> None:
  """The worker's loop: answers requests on stdin until it closes (or a timeout)."""
  replies = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)  # prints from JAX or the op go to stderr, not into the message stream
  requests = sys.stdin.buffer
  import stellarax  # noqa: F401  (registers the ops before requests are unpickled)
  measurer = None
  while True:
    try:
      number, pickled = _receive(requests)  # the number is readable whatever the request
    except EOFError:
      return
    try:
      request = pickle.loads(pickled)
    except Exception as e:  # e.g. an op class this process cannot import
      _send(replies, (number, {"measurements": {}, "error": (
          f"could not read the request ({type(e).__name__}: {str(e)[:200]}); ops measured in a"
          " worker must be importable (not defined in __main__), or use isolate=False")}))
      continue
    try:
      reply, measurer = _serve(request, measurer,
                               lambda: _send(replies, (number, {"set_up": True})))
    except Exception as e:  # the call itself cannot be set up: report, do not hang
      reply = {"measurements": {}, "error": f"failed: {type(e).__name__}: {str(e)[:300]}"}
    _send(replies, (number, reply))
    if reply.get("stalled"):
      os._exit(0)  # abandoned threads may still hold the device: leave without joining them

