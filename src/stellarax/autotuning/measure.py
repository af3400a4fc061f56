"""Measuring interchangeable candidates: one primitive with one stated method.

`measure_candidates` times candidates that compute the same thing from the same arguments
(jittable functions `fn(*args)`) and returns one `Measurement` per candidate; `pick_best`
chooses among them. A candidate that fails is recorded, never raised: only `pick_best` with
no successful candidate raises.

Method, in the order `measure_candidates` runs it:

1. Inputs. Array leaves of `args` are put on the device once, so no host-to-device copy is
   ever timed. With `MeasureOptions.cold_cache`, k copies of the inputs are made, k the
   smallest count whose total size exceeds `llc_bytes` (at most `max_input_copies`), and
   successive calls rotate through them, so no call finds its inputs in the last-level
   cache where the call before left them.
2. Compilation. Every candidate is traced, lowered and compiled ahead of time
   (`jax.jit(fn).lower(*args).compile()`) on up to `compile_threads` threads. An exception
   is a `compile_error`; a compilation still running after `timeout_s` is a `timeout`.
3. Check. Each compiled candidate runs once. An exception is a `runtime_error`; an output
   that the check rejects (by default `check_close` against `reference`, with tolerances
   from `default_tolerance`) is a `wrong_result`, its largest error in `error`. The
   default check is made on the device first, and the output is copied to the host only
   where that cannot say it passes (`_surely_close`; the host check of a large output
   took longer than the config's whole measurement on a TPU). After each
   check run a digest of the inputs (`input_digest`) is compared with theirs before any
   run: no candidate may write into its inputs (none is compiled with donation), and a
   kernel that writes out of bounds on a GPU can land there without a fault. Such a
   candidate is a `wrong_result` whatever its output, and the others go on with clean
   copies of the inputs (kept on the host), so they are not checked on what it wrote.
   A run that loses the device (`Measurement.lost_the_device`) stops the measurement.
4. Warm-up and batch size. Each surviving candidate runs batches of n calls, n growing from
   1, until it has run `warmup_runs` calls for at least `warmup_s` and one batch lasts at
   least `min_batch_s` (or n reached `max_batch_calls`). That n is kept for its samples.
   Host-bound candidates: a call whose device work is shorter than the host's cost of
   dispatching it leaves the device idle between calls, so its batch times the host, not
   the device (a dispatch costs microseconds: 4-7 us on the 2-core CPU here; gpu_check
   measures the H200's; every call shorter would look the same). So the dispatch floor is measured too: the per-call time, taken
   the same way, of a program that takes the same arguments and does almost nothing (not when
   every candidate takes a millisecond or more: no dispatch costs that). A candidate
   whose warm-up per-call time is below `host_bound_factor` times the floor is compiled
   again as one program that runs it k times in a loop (each iteration's inputs and
   outputs pass through an optimization barrier, so XLA can neither hoist the call out
   of the loop nor merge iterations), warmed up again, and timed in batches of that
   program, each call counting k times. k makes one run of the loop last
   `host_bound_factor` times the floor and `min_batch_s`, at most `loop_calls`
   (`_loop_trips`): the run is then device-bound by the same test, and no longer than a
   batch needs to be. Its method is "<platform>-looped"
   (cold_cache does not apply inside the loop). So are the candidates within twice a
   host-bound one's time per call, so that close rivals are timed the same way (where a
   dispatch does not overlap the work, XLA:CPU's, a batch times it too). A looped program
   that fails to compile leaves the candidate timed in batches. With a compile cache the
   floor, each candidate's first warm-up time and its loop's calls are kept, so the
   calls of a search time a candidate one way, not as the noise near the line goes.
5. Rounds. In each of `rounds` rounds the surviving candidates are visited in an order
   shuffled by `random.Random(seed)`, and each takes one sample: n back-to-back calls, one
   `jax.block_until_ready` on all n outputs, wall time divided by n (off the CPU, the
   difference of a pair of batches: see "Why batches"). Interleaving spreads
   slow drifts (clock boost, temperature, other load) over all candidates instead of
   charging them to whichever candidate ran at the time.
6. Statistic. The median of a candidate's samples, with a distribution-free 95%
   confidence interval from order statistics (see `median_interval`).
7. Leaders. Candidates whose interval reaches the fastest one's (ci_low_s <= the fastest's
   ci_high_s) take `leader_rounds` more shuffled rounds among themselves, and their
   statistic is recomputed over all their samples: close calls get decided on more data.
8. Profile (only with `MeasureOptions.profile`). Each surviving candidate runs one more
   batch, all of them inside one `jax.profiler.trace`, and `Measurement.profiled_s` is
   the time the device was busy with the candidate's program per call, from the
   profiler's events (`profile.busy_time_by_program`; on a GPU, CUPTI's kernel times).
   It is a check of the timing, not a sample: the choice stays with the medians. Well
   above it, a median says the calls were not device-bound (dispatch, gaps between
   kernels, a host-side sync); near it, that the batches timed the device. On a CPU the
   events are XLA:CPU's thunks, each with the tracer's own cost in it: a program of
   many small thunks (a loop, a Pallas kernel in interpret mode) looks several times
   slower profiled (2026-12-02: 0.16 ms against 0.04 ms looped for a tiny interpreted
   ragged_dot), so there the check only shows the mechanism works. Each candidate's
   events are found by its program's module name, which is its own (`_program_name`),
   not by program_id (a program loaded from JAX's persistent compilation cache keeps,
   in XLA:CPU's events, the id of the process that compiled it). A candidate that left
   no events gets None; so does every one when a trace cannot start (another one is
   running: one warning).

Budget. Time spent on one candidate (warm-up and samples) stops growing at about
`max_total_s`: a round skips a candidate that has spent its share (the main rounds may use
`rounds / (rounds + leader_rounds)` of it), but every surviving candidate takes at least
one sample.

Why batches. A JAX call returns once its work is enqueued (asynchronous dispatch). Timing
each call with its own sync adds the launch and synchronisation latency to every sample:
on an H200 a 4096^3 bf16 matmul timed that way looked about twice as slow as the device
runs it. A batch of n back-to-back calls with one sync keeps the device queue full, so the
batch time divided by n tends to the device time per call once the batch is long compared
with one sync. A batch still pays once for the device starting on an empty queue and once
for the host noticing its end: on a TPU v5e about 0.6 ms a batch, and calls of 0.36 to
5.9 ms were timed 1.14 to 1.85 times their device time in batches of 1 ms (2026-12-07,
BENCHMARKS.md); the H200's batched medians of 2026-12-04 carried 0.35 to 0.8 ms. So off
the CPU each sample is a pair (`MeasureOptions.paired_batches`): a batch of 2n calls,
then one of n, each with its sync, and the sample is their difference, what n calls add,
where what a batch pays once cancels. On the TPU those samples came within 2% of the
profiler's device time, with batches of 1 ms as of 20 ms. It also holds where the host
cannot keep the device busy (a host-bound call: the difference is then the host's time
per call), and where the runtime slows the host as calls pile up in its queue. A primer
(n calls queued before the batch, the batch timed from the primer's end) did as well
with few calls, but not with many: on the TPU queueing 64 calls of a 0.72 ms product
took 24 ms, 0.37 ms a call against 0.13 for 4, so the primer ended before the batch was
queued, and its samples came out up to twice the device time. The CPU is not paired:
there a batch's overhead is small beside its dispatch, which samples include. It is not
a profiler: gaps between the kernels inside one call count. A batch keeps its n outputs
alive until its sync, so that the sync waits for all n calls on every backend; its
memory is n outputs (2n paired).

Timeouts. Compilation runs on daemon worker threads; the check runs and timed batches of
one measurement run in turn on one daemon thread of its own (a thread's first JAX call
costs more than its later ones, so a thread a batch would add that to every sample). The
caller waits at most `timeout_s` for each. A candidate that does not finish in time is
recorded as `timeout` and its thread is abandoned (the next run gets a fresh one). Nothing can cancel a running XLA
computation, so the device may stay busy with it and slow or stall later candidates;
`Autotuner(isolate=True)` measures in a worker process instead, which stops at the first
such timeout and is replaced (`autotuning/isolation.py`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import dataclasses
import hashlib
import math
import os
import queue
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping
from typing import Any, Final, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from stellarax.autotuning import profile
from stellarax.core.config import check_plain_types
from stellarax.core.warn import warn

# How this module takes a time, as a revision that tuned entries record among their
# versions (`file_format.current_versions`, key "timing"). Bump it with any change after
# which a time taken before is not comparable with one taken after (another way to take
# a sample, another default): an entry of another revision is stale, so `autotune`
# measures its call again, and a current entry wins any merge with it. The op-code
# fingerprint cannot see such a change: it covers the ops, not this module.
#   (none): entries written before the revision was kept. They include single batches
#     off the CPU ("gpu-batched"), which read up to twice an H200's device time.
#   "2": paired samples off the CPU; host-bound calls looped; outputs checked on the device.
TIMING_REVISION: Final = "2"

K = TypeVar("K", bound=Hashable)

STATUSES: Final = ("ok", "compile_error", "runtime_error", "wrong_result", "timeout")
# Two candidates whose medians differ by at most this fraction are tied (see pick_best).
TIE_RELATIVE: Final = 0.01
# Seconds to wait for a measuring or compiling thread that is done to end.
_JOIN_S: Final = 10.0
# How a compilation's timeout starts its error (`Measurement.run_timed_out` tells it apart).
_COMPILE_TIMEOUT: Final = "compilation did not finish"
# Longest `error` text kept from an exception; the first and last lines are what matter.
_MAX_ERROR_CHARS: Final = 300
# Cap on how fast the batch size grows between two warm-up batches, so that one fluky
# fast batch cannot make the next one run for seconds.
_MAX_BATCH_GROWTH: Final = 100
# A call this long is never host-bound (no dispatch takes a tenth of it), so when every
# candidate takes longer the dispatch floor is not measured.
_SURELY_DEVICE_BOUND_S: Final = 1e-3
# Errors after which a process's GPU context is unusable: CUDA's "sticky" errors (a
# kernel that wrote out of bounds, trapped or asserted). Every later call in that process
# fails the same way, so no measurement taken after one means anything.
_DEVICE_LOST: Final = re.compile(
    r"CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|MISALIGNED_ADDRESS|ILLEGAL_INSTRUCTION|"
    r"HARDWARE_STACK_ERROR|INVALID_PC|ASSERT|ECC_UNCORRECTABLE|CONTEXT_IS_DESTROYED)"
    r"|an illegal memory access was encountered|unspecified launch failure")
# Measurement.to_json leaves these out when they are None.
_OPTIONAL_JSON_KEYS: Final = frozenset({"profiled_s"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
  """The outcome of measuring one candidate.

  Attributes:
    status: one of `STATUSES`: "ok", "compile_error", "runtime_error", "wrong_result",
      "timeout".
    median_s: median seconds per call; set exactly when status is "ok".
    ci_low_s: low end of the 95% confidence interval of the median; set when "ok".
    ci_high_s: high end of that interval; set when "ok".
    num_samples: number of timed samples behind the statistic (0 for a failure).
    compile_time_s: seconds spent tracing, lowering and compiling; None when unknown.
    error: short reason for a failure; None exactly when status is "ok".
    method: how the time was taken, e.g. "gpu-batched" (see the module docstring).
    profiled_s: seconds per call the device was busy with the candidate in a profiled
      batch (step 8 of the module docstring), or None where not profiled.

  Raises:
    ValueError: when made with a status not in `STATUSES`, with fields that do not fit
      it (an "ok" without a median and interval, a failure without an error or with a
      time), or a negative or non-finite time.
  """

  status: str
  median_s: float | None = None
  ci_low_s: float | None = None
  ci_high_s: float | None = None
  num_samples: int = 0
  compile_time_s: float | None = None
  error: str | None = None
  method: str = ""
  profiled_s: float | None = None

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"{self.status=} is not one of {STATUSES}.")
    if self.status == "ok":
      self._validate_ok()
    else:
      self._validate_failure()
    if self.compile_time_s is not None and not self.compile_time_s >= 0:
      raise ValueError(f"{self.compile_time_s=} must be None or >= 0.")
    if self.profiled_s is not None and not (self.ok and 0 <= self.profiled_s < math.inf):
      raise ValueError(f"{self.profiled_s=} must be None, or a finite time >= 0 of an ok"
                       f" measurement (status is {self.status!r}).")

  @property
  def run_timed_out(self) -> bool:
    """Whether a run of the candidate (its check run or a timed batch), not its
    compilation, went past `timeout_s`: nothing can stop it, so the device may still be
    busy with it, and calls queued after it in the process wait for it."""
    return self.status == "timeout" and not (self.error or "").startswith(_COMPILE_TIMEOUT)

  @property
  def lost_the_device(self) -> bool:
    """Whether this run failed with an error that leaves the process's GPU context
    unusable (an illegal address, a trap, a device-side assert): every later call in the
    process fails too, so measurements taken after it there mean nothing."""
    return self.status == "runtime_error" and bool(self.error) and bool(
        _DEVICE_LOST.search(self.error))

  def _validate_ok(self):
    times = (self.ci_low_s, self.median_s, self.ci_high_s)
    if any(t is None or not math.isfinite(t) or t < 0 for t in times):
      raise ValueError(
          f"An ok measurement needs finite times >= 0, got ci_low_s={self.ci_low_s},"
          f" median_s={self.median_s}, ci_high_s={self.ci_high_s}.")
    if not self.ci_low_s <= self.median_s <= self.ci_high_s:
      raise ValueError(
          f"Expected ci_low_s <= median_s <= ci_high_s, got {self.ci_low_s},"
          f" {self.median_s}, {self.ci_high_s}.")
    if self.num_samples < 1:
      raise ValueError(f"An ok measurement needs num_samples >= 1, got {self.num_samples}.")
    if self.error is not None:
      raise ValueError(f"An ok measurement has no error, got {self.error=}.")

  def _validate_failure(self):
    if (self.median_s, self.ci_low_s, self.ci_high_s) != (None, None, None):
      raise ValueError(
          f"A {self.status!r} measurement has no times, got median_s={self.median_s},"
          f" ci_low_s={self.ci_low_s}, ci_high_s={self.ci_high_s}.")
    if not isinstance(self.error, str) or not self.error:
      raise ValueError(f"A {self.status!r} measurement needs a non-empty error, got {self.error=}.")
    if self.num_samples < 0:
      raise ValueError(f"{self.num_samples=} must be >= 0.")

  @property
  def ok(self) -> bool:
    """Whether the candidate compiled, ran, was correct and was timed."""
    return self.status == "ok"

  def to_json(self) -> dict[str, Any]:
    """Returns the measurement as a dict of plain JSON values (str, int, float, None).

    `profiled_s` is written only when set, so files of measurements taken without a
    profile stay as they were (and readable by earlier versions).
    """
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    if self.profiled_s is None:
      del d["profiled_s"]
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Measurement:
    """Builds a measurement from `to_json`'s output.

    Args:
      d: a mapping with exactly the keys that `to_json` writes (`profiled_s` optional).

    Returns:
      The measurement.

    Raises:
      ValueError: if keys are missing or unknown, a value has another JSON type than
        its field takes (a time written as a string, a count as true), or the values
        are inconsistent.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, Mapping):
      raise ValueError(f"Expected a JSON object with keys {names}, got {type(d).__name__}.")
    missing = [n for n in names if n not in d and n not in _OPTIONAL_JSON_KEYS]
    unknown = sorted(set(d) - set(names))
    if missing or unknown:
      raise ValueError(
          f"A measurement needs exactly the keys {names}; missing {missing},"
          f" unknown {unknown}, in {dict(d)!r}.")
    values = dict(d)
    # float() below would read "0.001" or true as a time: a hand edit must not pass.
    check_plain_types(cls, values)
    for name in ("median_s", "ci_low_s", "ci_high_s", "compile_time_s", "profiled_s"):
      if values.get(name) is not None:
        values[name] = float(values[name])
    return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MeasureOptions:
  """How thoroughly and how safely `measure_candidates` measures.

  Attributes:
    warmup_s: minimum seconds of warm-up calls per candidate before its samples.
    warmup_runs: minimum number of warm-up calls per candidate (after the check run).
    rounds: shuffled rounds of samples over all surviving candidates.
    leader_rounds: extra rounds among the candidates tied with the fastest; 0 disables.
    min_batch_s: a sample's batch of calls lasts at least this long, to amortise its sync.
    max_batch_calls: upper bound on the calls in one batch (very fast candidates).
    max_total_s: about how many seconds of warm-up and samples one candidate may take.
    timeout_s: limit for one compilation, the check run, and each timed batch.
    cold_cache: rotate copies of the inputs so calls do not find them in cache.
    llc_bytes: last-level cache size that the rotated copies together must exceed.
    max_input_copies: upper bound on the rotated copies (small inputs stay partly warm).
    rtol: relative tolerance of the output check; None uses `default_tolerance`.
    atol: absolute tolerance of the output check; None uses `default_tolerance`.
    seed: seed of the round shuffling.
    compile_threads: compilations at once; None uses min(#candidates, os.cpu_count()).
    stop_after_run_timeout: after a check run or timed batch times out, measure
      nothing more and return only the candidates already decided (failed ones):
      the device may still be busy with the hung call. The same after a run that
      lost the device (`Measurement.lost_the_device`), which otherwise raises
      `DeviceLostError`. For measuring in a worker process that is replaced
      afterwards (see `autotuning/isolation.py`).
    loop_calls: the most calls of a host-bound candidate in one looped program (step 4
      of the module docstring); 0 never loops, so that every candidate is timed in
      batches.
    host_bound_factor: a candidate whose warm-up time per call is below this multiple
      of the dispatch floor is host-bound (>= 1).
    profile: after the rounds, run each candidate once more under the profiler and
      record the device's busy time per call as `Measurement.profiled_s` (step 8).
    paired_batches: take each sample as the difference of two batches, of 2n and n
      calls ("Why batches" in the module docstring), so that what a batch pays once
      (its start on an empty queue, its sync) does not count; None: on every platform
      but the CPU. Its samples' method is "<platform>-paired".

  Raises:
    ValueError: when made with a time that is negative or not finite (`timeout_s` 0),
      a count that is not an int or below its least value (e.g. `rounds` < 1), a
      negative tolerance, `host_bound_factor` < 1, `compile_threads` < 1, or a
      `paired_batches` other than None, True or False.
  """

  warmup_s: float = 0.05
  warmup_runs: int = 1
  rounds: int = 10
  leader_rounds: int = 10
  min_batch_s: float = 1e-3
  max_batch_calls: int = 10_000
  max_total_s: float = 5.0
  timeout_s: float = 60.0
  cold_cache: bool = False
  llc_bytes: int = 64 * 2**20
  max_input_copies: int = 64
  rtol: float | None = None
  atol: float | None = None
  seed: int = 0
  compile_threads: int | None = None
  stop_after_run_timeout: bool = False
  loop_calls: int = 256
  host_bound_factor: float = 8.0
  profile: bool = False
  paired_batches: bool | None = None

  def __post_init__(self):
    for name in ("warmup_s", "min_batch_s", "max_total_s", "timeout_s"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0) or (name == "timeout_s" and value == 0):
        raise ValueError(f"{name}={value} must be a finite number of seconds"
                         f" ({'> 0' if name == 'timeout_s' else '>= 0'}).")
    for name, low in (("warmup_runs", 0), ("rounds", 1), ("leader_rounds", 0),
                      ("max_batch_calls", 1), ("llc_bytes", 0), ("max_input_copies", 1),
                      ("loop_calls", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}.")
    for name in ("rtol", "atol"):
      value = getattr(self, name)
      if value is not None and not value >= 0:
        raise ValueError(f"{name}={value} must be None (dtype default) or >= 0.")
    if not (math.isfinite(self.host_bound_factor) and self.host_bound_factor >= 1):
      raise ValueError(f"host_bound_factor={self.host_bound_factor} must be a finite number"
                       " >= 1: a multiple of the dispatch floor.")
    if self.paired_batches not in (None, True, False):
      raise ValueError(f"paired_batches={self.paired_batches!r} must be None (on every "
                       "platform but the CPU), True or False.")
    if self.compile_threads is not None and self.compile_threads < 1:
      raise ValueError(f"{self.compile_threads=} must be None (one per core) or >= 1.")

  def with_effort(self, effort: float) -> MeasureOptions:
    """Returns options for a measurement `effort` times as thorough as these.

    Rounds, leader rounds, warm-up seconds and the per-candidate budget are scaled; at
    least one round stays. Compilation and the check run cannot be scaled.

    Args:
      effort: fraction of a full measurement, 0 < effort <= 1.

    Returns:
      The scaled options.

    Raises:
      ValueError: if effort is outside (0, 1].
    """
    if not 0 < effort <= 1:
      raise ValueError(f"{effort=} must be in (0, 1]: the fraction of a full measurement.")
    return dataclasses.replace(
        self,
        warmup_s=self.warmup_s * effort,
        rounds=max(1, round(self.rounds * effort)),
        leader_rounds=round(self.leader_rounds * effort),
        max_total_s=self.max_total_s * effort,
    )

  def effective_effort(self, effort: float) -> float:
    """The fraction of a full measurement's timed rounds that `with_effort(effort)` keeps.

    It is not `effort` itself: at least one round stays, so with 10 rounds every effort
    up to 0.15 takes one round, a tenth of a full measurement. Search strategies count
    this when they predict what a measurement costs (search.py, "The measure").

    Args:
      effort: fraction of a full measurement, 0 < effort <= 1.

    Returns:
      The kept rounds over `rounds`, in (0, 1].

    Raises:
      ValueError: if effort is outside (0, 1].
    """
    return self.with_effort(effort).rounds / self.rounds


class DeviceLostError(RuntimeError):
  """A candidate's run lost the device (`Measurement.lost_the_device`): the process's
  GPU context cannot run anything more, so measuring stopped there.

  Attributes:
    key: the candidate whose run lost the device.
    measurements: key -> Measurement of the candidates decided before measuring
      stopped (failures, and `key`'s own).
    partial_result: set by `Autotuner.autotune`: the calls tuned before this one, as
      an `AutotuningResult` (None elsewhere).
  """

  def __init__(self, key: Any, measurements: Mapping[Any, Measurement]):
    self.key, self.measurements = key, dict(measurements)
    self.partial_result = None
    error = measurements[key].error if key in measurements else "(no measurement)"
    super().__init__(
        f"Running candidate {key!r} lost the device: {error}. After such "
        "an error (an illegal memory access, a trap or a device-side assert in a kernel) the "
        "process's GPU context is unusable and every later call fails the same way, so "
        "measuring stopped. Restart the process; to tune configs that may do this, measure "
        "in worker processes, stellarax.Autotuner(isolate=True) (`stellarax autotune "
        "--isolate`), which records such a config as failed and goes on.")


class AllCandidatesFailedError(ValueError):
  """No candidate measured "ok"; the message lists why each failed."""

  def __init__(self, measurements: Mapping[Any, Measurement]):
    self.measurements = dict(measurements)
    if not measurements:
      super().__init__("No candidate was measured, so none can be chosen.")
      return
    shown = 100
    lines = [f"  {key!r}: {m.status}: {m.error}"
             for key, m in list(measurements.items())[:shown]]
    if len(measurements) > shown:
      lines.append(f"  ... and {len(measurements) - shown} more")
    super().__init__(
        f"None of the {len(measurements)} candidates succeeded; fix the failures below"
        " or widen the search space:\n" + "\n".join(lines))


# --- statistics -------------------------------------------------------------------------


def median_interval(samples: Iterable[float], confidence: float = 0.95
                    ) -> tuple[float, float, float]:
  """Median of samples with a distribution-free confidence interval.

  With n sorted samples x_(1) <= ... <= x_(n), the interval is [x_(j), x_(n+1-j)], j the
  largest rank with 2 * P(Binomial(n, 1/2) < j) <= 1 - confidence: the number of samples
  below the true median is Binomial(n, 1/2) whatever the distribution. When no rank
  qualifies (n < 6 at 95%), the interval is [min, max].

  Args:
    samples: at least one finite number.
    confidence: coverage of the interval, in (0, 1).

  Returns:
    (median, low, high).

  Raises:
    ValueError: if there are no samples, a sample is not finite, or confidence is out of range.
  """
  x = np.sort(np.asarray(list(samples), dtype=np.float64))
  if x.size == 0 or not np.all(np.isfinite(x)):
    raise ValueError(f"Need at least one finite sample, got {x.tolist()}.")
  if not 0 < confidence < 1:
    raise ValueError(f"{confidence=} must be in (0, 1).")
  n = x.size
  # P(B = k) for B ~ Binomial(n, 1/2), in logs so that large n neither overflows nor is slow.
  pmf = lambda k: math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                           - n * math.log(2))
  j, below = 1, pmf(0)  # below = P(B < j)
  while j + 1 <= (n + 1) // 2 and 2 * (below + pmf(j)) <= 1 - confidence:
    j, below = j + 1, below + pmf(j)
  return float(np.median(x)), float(x[j - 1]), float(x[n - j])


# --- output check -----------------------------------------------------------------------

# (rtol, atol) relative to the reference's largest magnitude (see check_close). float32 is
# loose because GPU matmuls run f32 as TF32 (10-bit mantissa) by default; the 16-bit types
# allow about four units in the last place. float64 takes float32's: ops compute float64
# inputs at float32 precision, and their references too (README; under jax_enable_x64 a
# float64 ragged_dot, 1e-7 off its float32 reference, failed every config at 1e-7).
_TOLERANCES: Final = {
    np.dtype(np.float64): (2e-3, 1e-6),
    np.dtype(np.float32): (2e-3, 1e-6),
    np.dtype(np.float16): (4e-3, 1e-4),
    np.dtype(jnp.bfloat16): (3e-2, 1e-3),
}


def default_tolerance(dtype: Any) -> tuple[float, float]:
  """Tolerances of the output check for one dtype.

  Args:
    dtype: anything `np.dtype` accepts, including JAX's bfloat16 and float8 types.

  Returns:
    (rtol, atol): floats without an entry in the table get 4 eps and eps, complex types
    their component's, and integers and bools (0, 0): exact.

  Raises:
    TypeError: for a dtype that is neither numeric nor bool.
  """
  dt = np.dtype(dtype)
  if dt in _TOLERANCES:
    return _TOLERANCES[dt]
  if jnp.issubdtype(dt, jnp.complexfloating):
    return default_tolerance(jnp.finfo(dt).dtype)
  if jnp.issubdtype(dt, jnp.floating):
    eps = float(jnp.finfo(dt).eps)
    return 4 * eps, eps
  if jnp.issubdtype(dt, jnp.integer) or dt == np.bool_:
    return 0.0, 0.0
  raise TypeError(f"No output tolerance for {dt=}: expected a numeric or bool dtype.")


def check_close(output: Any, reference: Any, *, rtol: float | None = None,
                atol: float | None = None) -> str | None:
  """Compares an output pytree with a reference pytree, leaf by leaf.

  A leaf passes when every element satisfies |out - ref| <= atol + rtol * scale, scale the
  largest finite |ref| of that leaf (relative to the leaf's scale, not elementwise: kernels
  that accumulate differently differ in absolute terms near zero), but at least
  `CROSS_LEAF_SCALE` times the largest of the whole reference: a leaf that is zero or
  nearly so (a gradient whose terms cancel, such as attention's dK where every query
  keeps one key) holds the rounding of terms as large as its siblings', and a kernel
  right up to that rounding is correct. Positions where the
  reference is NaN are not compared; a NaN elsewhere fails, and an infinity must match.
  Shapes must match; dtypes may differ (a float32 reference for a bfloat16 output), and
  the looser of the two dtypes' default tolerances applies. Typed PRNG keys compare by
  their key data, exactly; float0 leaves (integer inputs' gradients) hold nothing to
  compare.

  Args:
    output: the candidate's output, a pytree of arrays.
    reference: the expected output, a pytree of arrays of the same structure.
    rtol: relative tolerance, or None for the dtype default.
    atol: absolute tolerance, or None for the dtype default.

  Returns:
    None when the output is close, else a short reason naming the leaf and the error.
  """
  out_leaves, out_tree = jax.tree.flatten_with_path(_comparable(output))
  ref_leaves, ref_tree = jax.tree.flatten_with_path(_comparable(reference))
  if out_tree != ref_tree:
    return f"output structure {out_tree} differs from the reference's {ref_tree}"
  if [_is_key(x) for x in jax.tree.leaves(output)] != [
      _is_key(x) for x in jax.tree.leaves(reference)]:
    return "PRNG keys where the reference has none, or the other way round"
  refs = [np.asarray(ref) for _, ref in ref_leaves]
  scales = [_finite_scale(ref) for ref in refs]
  least_scale = CROSS_LEAF_SCALE * max(scales, default=0.0)
  for (path, out), ref, scale in zip(out_leaves, refs, scales):
    reason = _compare_leaf(np.asarray(out), ref, rtol, atol, max(scale, least_scale))
    if reason is not None:
      return f"{jax.tree_util.keystr(path) or 'output'}: {reason}"
  return None


def _is_key(x: Any) -> bool:
  """Whether `x` is a typed PRNG key array."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _comparable(tree: Any) -> Any:
  """`tree` with the leaves NumPy cannot compare made comparable: a typed PRNG key (a
  training step that returns its next key) as its key data, which must be equal; a
  float0 leaf (the gradient of an integer input, `jax.grad(allow_int=True)`), which holds
  nothing, as booleans of its shape."""
  def leaf(x):
    if getattr(x, "dtype", None) == jax.dtypes.float0:
      return np.zeros(np.shape(x), np.bool_)
    return _key_data(x)
  return jax.tree.map(leaf, tree)


# The least scale of a leaf, relative to the largest of the whole reference (see
# check_close).
CROSS_LEAF_SCALE: Final = 1e-3


def _finite_scale(ref: np.ndarray) -> float:
  """The largest finite |ref| (0 for none, or for a leaf of neither numbers nor bools)."""
  if ref.size == 0 or not (jnp.issubdtype(ref.dtype, jnp.number) or ref.dtype == np.bool_):
    return 0.0
  values = np.abs(ref.astype(_compared_dtype(ref, ref)))
  finite = np.isfinite(values)
  if not finite.all():
    values = np.where(finite, values, 0)
  return float(values.max())


def _compared_dtype(out: np.ndarray, ref: np.ndarray) -> type:
  """The type an output and its reference are compared in: float32 where both are
  floats of 32 bits or fewer (bfloat16, float16, float8; exact for them, and their
  difference's rounding is far below any tolerance); float64 for wider floats and for
  integers (exact), complex128 for complex. A check runs for every candidate of every
  measure call, and a large output's was a good part of a tuning's time: for a
  4096x4096 output, 0.26 s in float64 against 0.07 s now (medians of 5 on the 2-core
  CPU, 2026-12-07; a process's first, 1.8 s against 0.65 s for bfloat16), and the
  H200's ragged_dot target has 7 times as many values."""
  if np.iscomplexobj(out) or np.iscomplexobj(ref):
    return np.complex128
  narrow = lambda d: jnp.issubdtype(d, jnp.floating) and np.dtype(d).itemsize <= 4
  return np.float32 if narrow(out.dtype) and narrow(ref.dtype) else np.float64


def _compare_leaf(out: np.ndarray, ref: np.ndarray, rtol: float | None,
                  atol: float | None, scale: float) -> str | None:
  """`check_close` for one leaf; `scale` is the leaf's (see there), from `_finite_scale`:
  past the NaN and infinity checks, its finite values are the ones compared."""
  if out.shape != ref.shape:
    return f"shape {out.shape} differs from the reference's {ref.shape}"
  if out.size == 0:
    return None
  rtol, atol = _leaf_tolerances(out.dtype, ref.dtype, rtol, atol)
  wide = _compared_dtype(out, ref)
  o, r = out.astype(wide), ref.astype(wide)
  if np.isfinite(o).all() and np.isfinite(r).all():  # most outputs: no NaN, no infinity
    err = np.abs(o - r)
    return _max_error_reason(err, o.shape, atol, rtol, scale)
  compared = ~np.isnan(r)
  bad_nan = np.isnan(o) & compared
  if bad_nan.any():
    first = np.unravel_index(np.argmax(bad_nan), o.shape)
    return (f"NaN at {int(bad_nan.sum())} positions where the reference has none"
            f" (first at index {tuple(map(int, first))})")
  infinite = (np.isinf(o) | np.isinf(r)) & compared
  bad_inf = infinite & (o != r)
  if bad_inf.any():
    first = np.unravel_index(np.argmax(bad_inf), o.shape)
    return (f"infinity does not match the reference at {int(bad_inf.sum())} positions"
            f" (first at index {tuple(map(int, first))})")
  finite = compared & ~infinite
  if not finite.any():
    return None
  return _max_error_reason(np.where(finite, np.abs(o - r), 0), o.shape, atol, rtol, scale)


def _leaf_tolerances(out_dtype: Any, ref_dtype: Any, rtol: float | None,
                     atol: float | None) -> tuple[float, float]:
  """(rtol, atol) for one leaf: those given, else the looser of the two dtypes' defaults."""
  rtol_out, atol_out = default_tolerance(out_dtype)
  rtol_ref, atol_ref = default_tolerance(ref_dtype)
  return (max(rtol_out, rtol_ref) if rtol is None else rtol,
          max(atol_out, atol_ref) if atol is None else atol)


def _surely_close(output: Any, reference: Any, rtol: float | None,
                  atol: float | None) -> bool:
  """Whether `check_close(output, reference, rtol=rtol, atol=atol)` passes, decided on
  the device that holds both: True only where it surely does, False where it may not
  (the host check then decides, and words the reason).

  Why: the check runs for every candidate of every measure call, and on the host it
  copies the output there and compares it in NumPy. On a TPU v5e's host that took
  0.51 s of a 0.58-s call for a 4096x4096 bfloat16 output, 2026-12-07 (a search's call
  of one config at its lowest effort; bench/measure_call_cost.py), more than a full
  measurement of the config. Here only a few numbers a leaf come back.

  The device computes what the host would, in the same types (`_compared_dtype`):
  per float leaf, whether all of both are finite, the largest |out - ref| and the
  largest |ref|; per leaf of another type, whether it equals the reference. Where
  anything differs from the common case (a NaN or an infinity, unequal integers or
  complex numbers, leaves of two kinds, PRNG keys, host arrays) it answers False. The
  cross-leaf scale is taken over the float leaves only, never more than the host's, so
  the bound is never looser than the host check's. Nor is one below what the device
  keeps: XLA flushes subnormal numbers to zero, so a bound within a few of the
  smallest normal float32 is left to the host.
  """
  outs, out_tree = jax.tree.flatten(output)
  refs, ref_tree = jax.tree.flatten(reference)
  if out_tree != ref_tree or not all(isinstance(x, jax.Array) for x in (*outs, *refs)):
    return False
  if any(map(_is_key, (*outs, *refs))):
    return False  # (the host check compares their key data)
  if any(o.shape != r.shape for o, r in zip(outs, refs)):
    return False
  floats = [_both_real_floats(o.dtype, r.dtype) for o, r in zip(outs, refs)]
  if any(not f and o.dtype != r.dtype for f, o, r in zip(floats, outs, refs)):
    return False
  try:
    stats = jax.device_get([_leaf_stats(o, r) for o, r in zip(outs, refs)])
  except Exception:  # noqa: BLE001 (unsure: the host check runs and says what is wrong)
    return False
  scales = [float(scale) for f, (_, _, scale) in zip(floats, stats) if f]
  least_scale = CROSS_LEAF_SCALE * max(scales, default=0.0)
  for f, o, r, (good, max_err, scale) in zip(floats, outs, refs, stats):
    if not bool(good):
      return False
    if f:
      leaf_rtol, leaf_atol = _leaf_tolerances(o.dtype, r.dtype, rtol, atol)
      bound = leaf_atol + leaf_rtol * max(float(scale), least_scale)
      if not (bound > _FLUSHED and float(max_err) <= bound):
        return False
  return True


# Below this a bound may lie among the subnormal numbers that XLA flushes to zero (on
# XLA:CPU and on a TPU): a difference the host sees could read 0 on the device.
_FLUSHED: Final = 16 * float(np.finfo(np.float32).tiny)


def _both_real_floats(a: Any, b: Any) -> bool:
  return all(jnp.issubdtype(d, jnp.floating) for d in (a, b))


@jax.jit
def _leaf_stats(o: jax.Array, r: jax.Array) -> tuple:
  """One leaf's (see `_surely_close`): (all finite, largest |out - ref|, largest |ref|)
  for floats, compared in `_compared_dtype`'s type; (equal, 0, 0) for the others. A
  leaf at a time: one program per leaf's shapes and types serves every output that has
  such a leaf, where one program over all leaves compiled anew for each combination
  (most of a 150-case test's 18 s, 2026-12-07)."""
  zero = jnp.zeros((), jnp.float32)
  if o.size == 0:
    return jnp.array(True), zero, zero
  if _both_real_floats(o.dtype, r.dtype):
    narrow = o.dtype.itemsize <= 4 and r.dtype.itemsize <= 4
    wide = jnp.float32 if narrow else jnp.promote_types(o.dtype, r.dtype)
    o, r = o.astype(wide), r.astype(wide)
    finite = jnp.all(jnp.isfinite(o)) & jnp.all(jnp.isfinite(r))
    return finite, jnp.max(jnp.abs(o - r)), jnp.max(jnp.abs(r))
  return jnp.all(o == r), zero, zero


def _max_error_reason(err: np.ndarray, shape: tuple, atol: float, rtol: float,
                      scale: float) -> str | None:
  """None where the largest of `err` is within atol + rtol * scale, else the reason."""
  worst = np.unravel_index(np.argmax(err), shape)
  max_err, bound = float(err[worst]), atol + rtol * scale
  if max_err <= bound:
    return None
  return (f"max abs error {max_err:.3g} at index {tuple(map(int, worst))} exceeds"
          f" {bound:.3g} = atol {atol:g} + rtol {rtol:g} x reference scale {scale:.3g}"
          f" (relative error {max_err / scale if scale else math.inf:.3g})")


# --- candidates and worker threads ------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Candidate:
  """Mutable bookkeeping for one candidate during one measure_candidates call."""
  key: Any
  executable: Any = None
  compile_time_s: float | None = None
  status: str = "ok"
  error: str | None = None
  batch_calls: int = 1
  calls_per_run: int = 1  # its loop's calls once it runs as a looped program
  call_s: float | None = None  # seconds per call at the end of its warm-up
  spent_s: float = 0.0
  next_input: int = 0
  samples: list[float] = dataclasses.field(default_factory=list)
  profiled_s: float | None = None  # step 8 of the module docstring

  @property
  def alive(self) -> bool:
    return self.status == "ok"

  def fail(self, status: str, error: str):
    self.status, self.error = status, error


@dataclasses.dataclass(frozen=True)
class _Aux:
  """A compile_cache key of a program measure_candidates adds: never equal to a caller's key.

  kind "floor" is the dispatch floor's program (key None), "looped" a candidate's looped
  program (key: (its key, the calls the loop makes)); "trips" holds no program but the
  calls a candidate's loop makes (key: (its key, `loop_calls`)), see `_loop_trips`;
  "floor_s" the dispatch floor measured (key: the options that time it), see
  `_dispatch_floor_s`; "call_s" a candidate's first warm-up time per call (key: its
  key and the options that time it), see `_first_call_s`; "inputs" the host copy of the
  inputs that `_InputGuard` restores from; "reference" the reference's copies, on the
  host and the device (see `_Expected.of`).
  """
  kind: str
  key: Any = None


@dataclasses.dataclass(frozen=True)
class _Compiled:
  """A compile_cache entry: the executable, or the failure that replaced it."""
  executable: Any
  compile_time_s: float | None
  status: str = "ok"
  error: str | None = None


def _short_error(exc: BaseException) -> str:
  """First and last lines of an exception: the kind of failure and its root cause."""
  lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
  text = type(exc).__name__
  if lines:
    text += f": {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")
  if len(text) > _MAX_ERROR_CHARS:
    text = text[:_MAX_ERROR_CHARS - 3] + "..."
  lost = _DEVICE_LOST.search(str(exc))
  if lost and not _DEVICE_LOST.search(text):  # what tells a lost device must survive the cut
    text = text[:_MAX_ERROR_CHARS - len(lost[0]) - 3] + f" [{lost[0]}]"
  return text


class _Runner:
  """One long-lived daemon thread that runs a measurement's calls, each with a timeout.

  Why one thread and not one a call: the first JAX call from a new thread costs more
  than later ones (about 40 us more on the 2-core CPU here, 2026-12-05), and a batch
  that started a thread of its own paid that in its time, once a sample. A call that
  times out leaves its thread to finish (or hang) on its own; the next call gets a
  fresh thread.
  """

  def __init__(self):
    self._jobs: queue.SimpleQueue | None = None
    self._thread: threading.Thread | None = None

  def run(self, fn: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
    """("ok", fn()), ("error", the exception) or ("timeout", None) after timeout_s."""
    if self._jobs is None:
      self._jobs = queue.SimpleQueue()
      self._thread = threading.Thread(target=self._serve, args=(self._jobs,),
                                      name="stellarax-measure", daemon=True)
      self._thread.start()
    box: list[tuple[str, Any]] = []
    done = threading.Event()
    self._jobs.put((carried_settings(fn), box, done))
    if done.wait(timeout_s):
      return box[0]
    self.close(wait=False)  # The thread is stuck in fn: it stops if fn ever returns.
    return "timeout", None

  def close(self, wait: bool = True):
    """Ends the thread once it is idle; with `wait`, waits (a few seconds at most) for
    it to end. An idle one ends at once, but a thread still freeing the last call's
    arrays when the process exits may be stopped inside XLA's code, which aborts the
    process ("terminate called ..."; a script that exited right after a measurement
    did so about one time in eight on a loaded 2-core machine)."""
    if self._jobs is not None:
      self._jobs.put(None)
      self._jobs = None
    if wait and self._thread is not None:
      self._thread.join(timeout=_JOIN_S)
    self._thread = None

  @staticmethod
  def _serve(jobs: queue.SimpleQueue):
    while (job := jobs.get()) is not None:
      fn, box, done = job
      try:
        box.append(("ok", fn()))
      except BaseException as exc:  # Reported to the caller as data, never lost.
        box.append(("error", exc))
      done.set()


_runners = threading.local()  # .current: the _Runner of this thread's measurement


@contextlib.contextmanager
def _one_runner():
  """Within it, `run_with_timeout` runs everything on one `_Runner` (nested: the outer's)."""
  if getattr(_runners, "current", None) is not None:
    yield
    return
  _runners.current = _Runner()
  try:
    yield
  finally:
    _runners.current.close(wait=True)
    _runners.current = None


def run_with_timeout(fn: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
  """Runs fn() on a measuring thread (inside a measurement, its one `_Runner`'s: see
  `_one_runner`), waiting at most timeout_s: a call that may hang (a kernel that never
  ran on this device) cannot stall its caller. A thread that finished is joined before
  this returns; one past its timeout is abandoned (a daemon: it does not keep the
  process alive).

  Args:
    fn: the work, a function of no arguments.
    timeout_s: seconds to wait for it.

  Returns:
    ("ok", fn()), ("error", the exception fn raised, KeyboardInterrupt included) or
    ("timeout", None).
  """
  with _one_runner():
    return _runners.current.run(fn, timeout_s)


def _ordered_keys(mapping: Mapping[K, Any], order: Iterable[K] | None) -> list[K]:
  """The keys of mapping in `order` (entries not in mapping are skipped)."""
  if order is None:
    return list(mapping)
  keys = [k for k in dict.fromkeys(order) if k in mapping]
  if len(keys) != len(mapping):
    listed = set(keys)
    missing = [k for k in mapping if k not in listed]
    raise ValueError(f"order must list every candidate; it misses {missing[:10]!r}"
                     f"{' ...' if len(missing) > 10 else ''}. Pass order=None to keep the"
                     " mapping's order.")
  return keys


# --- phases -----------------------------------------------------------------------------


def _program_name(key: Any) -> str:
  """The name a candidate's program is compiled under: the same for one key in every
  call and process (so JAX's persistent compilation cache still finds it), another for
  every other key of a call (so a profile tells its events from the others' by module
  name, step 8: a program loaded from that cache keeps, in XLA:CPU's events, the
  program_id of the process that compiled it)."""
  return "stellarax_candidate_" + hashlib.sha1(repr(key).encode()).hexdigest()[:12]


def _compile_one(fn: Callable[..., Any], args: tuple, name: str) -> tuple[str, Any, float]:
  """Compiles `fn` for `args` as a program named `name`: ("ok", executable, seconds),
  ("error", the exception, seconds), or ("raise", a KeyboardInterrupt or SystemExit
  raised while tracing, seconds): not the candidate's failure, so it stops measuring."""
  def program(*arrays):
    return fn(*arrays)
  program.__name__ = program.__qualname__ = name
  start = time.perf_counter()
  try:
    executable = jax.jit(program).lower(*args).compile()
  except Exception as exc:  # Any failure to build the program is the candidate's.
    return "error", exc, time.perf_counter() - start
  except BaseException as exc:  # KeyboardInterrupt, SystemExit: the caller's, raised there
    return "raise", exc, time.perf_counter() - start
  return "ok", executable, time.perf_counter() - start


def carried_settings(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, to run on another thread under this thread's JAX settings that a `with` block
  may have set (`jax.enable_x64`, `jax.default_matmul_precision`): JAX keeps those per
  thread, so a worker thread traced with the process's defaults (inside
  `jax.enable_x64(True)`, float64 arguments traced as float32: every config "wrong").

  Args:
    fn: what the other thread runs.

  Returns:
    fn, wrapped to run under the settings read now.
  """
  x64, precision = jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with jax.enable_x64(x64), jax.default_matmul_precision(precision):
      return fn(*args, **kwargs)
  return run


def _compile_all(cands: list[_Candidate], fns: Mapping[Any, Callable[..., Any]], args: tuple,
                 options: MeasureOptions, cache: MutableMapping[Any, Any] | None):
  """Compiles on worker threads; a compilation past timeout_s is abandoned as a timeout."""
  todo = collections.deque()
  for cand in cands:
    if cache is not None and cache.get(cand.key) is not None:
      _apply_compiled(cand, cache[cand.key])
    else:
      todo.append(cand)
  threads = options.compile_threads or min(len(todo), os.cpu_count() or 1)
  finished: queue.SimpleQueue = queue.SimpleQueue()
  running: dict[_Candidate, float] = {}  # candidate -> start time
  workers: dict[_Candidate, threading.Thread] = {}
  while todo or running:
    while todo and len(running) < threads:
      cand = todo.popleft()
      running[cand] = time.perf_counter()
      worker = carried_settings(lambda cand=cand: finished.put(
          (cand, _compile_one(fns[cand.key], args, _program_name(cand.key)))))
      workers[cand] = threading.Thread(target=worker, name="stellarax-compile", daemon=True)
      workers[cand].start()
    wait_s = min(running.values()) + options.timeout_s - time.perf_counter()
    try:
      cand, (kind, value, seconds) = finished.get(timeout=max(wait_s, 0.0))
    except queue.Empty:
      _expire_compilations(running, options.timeout_s, cache)
      continue
    if running.pop(cand, None) is None:
      continue  # An abandoned compilation finished late; its timeout stands.
    # Its thread has put its result and is ending: let it end (see _Runner.close).
    workers.pop(cand).join(timeout=_JOIN_S)
    if kind == "raise":
      raise value
    entry = (_Compiled(value, seconds) if kind == "ok" else
             _Compiled(None, seconds, "compile_error", _short_error(value)))
    _apply_compiled(cand, entry)
    if cache is not None:
      cache[cand.key] = entry


def _expire_compilations(running: dict[_Candidate, float], timeout_s: float,
                         cache: MutableMapping[Any, Any] | None):
  now = time.perf_counter()
  for cand, start in list(running.items()):
    if now - start >= timeout_s:
      del running[cand]
      entry = _Compiled(None, None, "timeout",
                        f"{_COMPILE_TIMEOUT} within timeout_s={timeout_s:g} s")
      _apply_compiled(cand, entry)
      if cache is not None:
        cache[cand.key] = entry


def _apply_compiled(cand: _Candidate, entry: _Compiled):
  cand.executable, cand.compile_time_s = entry.executable, entry.compile_time_s
  if entry.status != "ok":
    cand.fail(entry.status, entry.error)


class _Stalled(Exception):
  """A run timed out under `stop_after_run_timeout`: measure nothing more."""


def input_digest(args: Any) -> np.ndarray:
  """A digest of every array in `args`, computed on their device: two sums of each
  array's bits (one weighted by position), so that a write into any element shows.

  Args:
    args: a pytree of arrays.

  Returns:
    A (number of arrays, 2) uint32 numpy array; equal digests mean equal contents,
    unless a change was made to cancel out (a wrong write does not).
  """
  return np.asarray(jax.device_get(_digest(args)))


@jax.jit
def _digest(args: Any) -> jax.Array:
  sums = [jnp.zeros((0, 2), jnp.uint32)]
  for x in jax.tree.leaves(args):
    bits = _bits_as_uint32(jnp.asarray(x)).ravel()
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
    sums.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                           jnp.sum(bits * weights, dtype=jnp.uint32)])[None])
  return jnp.concatenate(sums)


def _bits_as_uint32(x: jax.Array) -> jax.Array:
  """The array's bit patterns as uint32 (NaNs included, unlike its values)."""
  x = _key_data(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag])
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(x.dtype.itemsize)
  if x.dtype == jnp.bool_ or unsigned is None:
    return x.astype(jnp.uint32)
  try:  # 8-byte types come out as two uint32 each
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  except (TypeError, ValueError):  # a sub-byte type (int4): an itemsize of 1, fewer bits
    return x.astype(jnp.uint32)


class _InputGuard:
  """The inputs candidates run on, with what they held before any run (see step 3).

  The host copy to restore from is kept in a compile cache where one is given, and a
  later call on inputs of the same shapes and digest uses it again: a measure call
  copied all its inputs to the host (the H200 ragged_dot target's weights are 0.9 GB),
  and a search makes tens of calls on the same inputs.
  """

  def __init__(self, args: tuple, cache: MutableMapping[Any, Any] | None = None):
    self.args = args
    self._digest = input_digest(args)
    layout = _layout(args)
    kept = cache.get(_Aux("inputs")) if cache is not None else None
    if kept is not None and kept[0] == layout and np.array_equal(kept[1], self._digest):
      self._host = kept[2]
      return
    # To restore from, should a candidate write there: a copy, since on a CPU the
    # host's view of an array may be its buffer itself. A PRNG key array keeps its key
    # data (NumPy holds no key type) and is wrapped again on the way back.
    self._host = jax.tree.map(lambda x: np.array(_key_data(x), copy=True), args)
    if cache is not None:
      cache[_Aux("inputs")] = (layout, self._digest, self._host)

  def intact(self) -> bool:
    return np.array_equal(input_digest(self.args), self._digest)

  def restore(self) -> None:
    def put(host, now):
      if not isinstance(now, jax.Array):
        return host
      if _is_key(now):
        host = jax.random.wrap_key_data(host, impl=jax.random.key_impl(now))
      return jax.device_put(host, now.sharding)
    self.args = jax.block_until_ready(jax.tree.map(put, self._host, self.args))


def _key_data(x: Any) -> Any:
  """`x`, or its key data where it is a PRNG key array."""
  return jax.random.key_data(x) if _is_key(x) else x


def _wrote_its_inputs(cand: _Candidate) -> None:
  also = f" (and: {cand.error})" if not cand.alive and cand.error else ""
  cand.fail("wrong_result", "it changed its inputs, which no correct config writes (a write "
            "out of bounds, or into a buffer it only reads); the other candidates ran on "
            "clean copies" + also)


class _DeviceLost(Exception):
  """A run lost the device (see `_DEVICE_LOST`): nothing more can run in this process."""

  def __init__(self, key: Any):
    super().__init__(key)
    self.key = key


def _run_failed(cand: _Candidate, exc: BaseException) -> None:
  """Records a run's exception as a runtime error; one that lost the device stops all."""
  cand.fail("runtime_error", _short_error(exc))
  if _DEVICE_LOST.search(str(exc)):
    raise _DeviceLost(cand.key)


def _timed_out(cand: _Candidate, error: str, options: MeasureOptions) -> None:
  cand.fail("timeout", error)
  if options.stop_after_run_timeout:
    raise _Stalled(error)


def _check_output(cand: _Candidate, args: tuple, expected: _Expected,
                  check: Callable[[Any, Any], str | None] | None, options: MeasureOptions):
  """Runs the candidate once and records a runtime error, timeout or wrong result.

  The run, and a copy of its output to the host where a check needs one, are made
  within `timeout_s`; the check itself on this thread (the device's part of the default
  check, `_surely_close`, on the finished output: its first trace and compile are not
  the candidate's time)."""
  kind, out = run_with_timeout(lambda: jax.block_until_ready(cand.executable(*args)),
                               options.timeout_s)
  if kind == "ok":
    reason = other_output_types(out, expected.output_types)
    if reason is not None:
      cand.fail("wrong_result", reason)
      return
    if check is None and (expected.host is None or _surely_close(
        out, expected.device, options.rtol, options.atol)):
      return  # nothing to compare, or it passed on the device
    kind, out = run_with_timeout(lambda: jax.device_get(out), options.timeout_s)
  if kind == "timeout":
    _timed_out(cand, f"the check run did not finish within timeout_s={options.timeout_s:g} s",
               options)
  elif kind == "error":
    _run_failed(cand, out)
  else:
    reason = (check(out, expected.host) if check is not None else
              check_close(out, expected.host, rtol=options.rtol, atol=options.atol))
    if reason is not None:
      cand.fail("wrong_result", reason)


@dataclasses.dataclass(frozen=True)
class _Expected:
  """What a check run's output must be: the reference on the host, a copy of it on the
  device where the default check runs (for `_surely_close`; else None), and the shapes
  and dtypes of the output (or None: unchecked).

  The device's copy is a copy (on a CPU, a host array put on the device can share its
  buffer): a stray write can reach it and not the host's, and then a right output
  looks wrong there and the host's copy decides."""
  host: Any
  device: Any
  output_types: Any

  @classmethod
  def of(cls, reference: Any, output_types: Any, args: tuple, on_device: bool,
         cache: MutableMapping[Any, Any] | None = None) -> _Expected:
    """From `measure_candidates`'s reference (a pytree or a function that returns one)
    and output_types; with `on_device`, a copy on the device a check on `args` runs on
    (their first array's).

    With a compile cache, the copies made for a reference are kept there, and a later
    call given the same object (a measurer passes its one reference to every call of a
    search) uses them again, where it cannot have changed since: its arrays are jax
    arrays or read-only NumPy arrays (`CallMeasurer`'s are). The H200 ragged_dot
    target's backward reference is 1 GB, which every call copied to the device."""
    if callable(reference):
      reference = reference()
    if reference is None:
      return cls(None, None, output_types)
    arrays = [x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
    devices = tuple(arrays[0].devices()) if arrays else ()
    kept = cache.get(_Aux("reference")) if cache is not None else None
    if kept is not None and kept[0] is reference and kept[1] == (devices, on_device):
      return cls(kept[2].host, kept[2].device, output_types)

    def put(x):
      if len(devices) != 1 or not isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return x
      try:
        copy = jax.device_put(np.array(x, copy=True) if isinstance(x, np.ndarray) else x,
                              devices[0])
      except Exception:  # noqa: BLE001 (no room, a dtype it cannot hold: the host checks)
        return x
      # A float64 reference becomes float32 there without x64: the host copy stays, and
      # the check with it, which compares what it was given.
      return copy if copy.dtype == x.dtype else x

    expected = cls(jax.device_get(reference),
                   jax.block_until_ready(jax.tree.map(put, reference)) if on_device else None,
                   output_types)
    unchanging = lambda x: isinstance(x, jax.Array) or (
        isinstance(x, np.ndarray) and not x.flags.writeable)
    if cache is not None and all(unchanging(x) for x in jax.tree.leaves(reference)):
      cache[_Aux("reference")] = (reference, (devices, on_device), expected)
    return expected


@dataclasses.dataclass(frozen=True)
class AnyDtype:
  """A leaf of `measure_candidates`' output_types that asks for a shape only: the
  output's leaf may have any dtype.

  Attributes:
    shape: the leaf's shape.
  """

  shape: tuple[int, ...]


def other_output_types(output: Any, expected: Any) -> str | None:
  """Why `output` does not have the `expected` structure, shapes and dtypes, or None
  when it does.

  Args:
    output: a pytree of objects with .shape and .dtype (arrays, ShapeDtypeStructs).
    expected: the same; a leaf of it that is `AnyDtype` matches any dtype; None
      matches anything.

  Returns:
    A reason for a wrong result, or None.
  """
  if expected is None:
    return None
  got, want = _layout(output), _layout(expected)
  leaves_match = all(g_shape == w_shape and w_dtype in (None, g_dtype)
                     for (g_shape, g_dtype), (w_shape, w_dtype) in zip(got[1], want[1]))
  if got[0] != want[0] or not leaves_match:
    return (f"the output's shapes and dtypes {list(got[1])} differ from the expected "
            f"{list(want[1])}: a config may change how the op computes, not what it returns")
  return None


def _layout(tree: Any) -> tuple:
  """A pytree's structure and its leaves' (shape, dtype name): what two pytrees of
  arrays must share to hold the same kind of values (dtype None for `AnyDtype`)."""
  return jax.tree.structure(tree), tuple(map(_leaf_layout, jax.tree.leaves(tree)))


def _leaf_layout(x: Any) -> tuple[tuple[int, ...], str | None]:
  if isinstance(x, AnyDtype):
    return tuple(x.shape), None
  return tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))


def _on_device(args: tuple) -> tuple:
  """Puts host arrays on the device once, so that no timed call copies them."""
  put = lambda x: jax.device_put(x) if isinstance(x, (np.ndarray, np.generic)) else x
  return jax.block_until_ready(jax.tree.map(put, args))


def _input_sets(args: tuple, options: MeasureOptions) -> list[tuple]:
  """The argument tuples that successive calls rotate through (one unless cold_cache)."""
  nbytes = sum(x.nbytes for x in jax.tree.leaves(args) if isinstance(x, jax.Array))
  if not options.cold_cache or nbytes == 0:
    return [args]
  count = min(options.max_input_copies, options.llc_bytes // nbytes + 1)
  copy = lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x
  return [args] + [jax.block_until_ready(jax.tree.map(copy, args)) for _ in range(count - 1)]


def _run_batch(cand: _Candidate, input_sets: list[tuple], n: int,
               options: MeasureOptions) -> float | None:
  """Times n back-to-back calls and one sync; returns the batch seconds, None on failure.

  With `options.paired_batches` it times a batch of 2n calls, then one of n, each with
  its own sync and its own `timeout_s`, and returns the difference, what n calls add
  (see "Why batches" in the module docstring); where noise makes it zero or less, half
  the long batch's time. The long one comes first, so that whatever the first calls
  after another candidate's pay is in the sample (erring slow), not taken off it.
  """
  paired = bool(options.paired_batches)
  start_input = cand.next_input
  cand.next_input = (start_input + _calls_of_a_sample(n, options)) % len(input_sets)
  times = []
  for first, count in ((0, 2 * n), (2 * n, n)) if paired else ((0, n),):
    seconds = _timed_batch(cand, input_sets, start_input + first, count, options)
    if seconds is None:
      return None
    times.append(seconds)
  if not paired:
    return times[0]
  long, short = times
  return long - short if long > short else long / 2


def _timed_batch(cand: _Candidate, input_sets: list[tuple], first_input: int, count: int,
                 options: MeasureOptions) -> float | None:
  """The seconds of `count` back-to-back calls and one sync, within `timeout_s`; None
  (the candidate failed or timed out) otherwise."""
  def batch():
    start = time.perf_counter()
    jax.block_until_ready([cand.executable(*input_sets[(first_input + i) % len(input_sets)])
                           for i in range(count)])
    return time.perf_counter() - start

  started = time.perf_counter()
  kind, value = run_with_timeout(batch, options.timeout_s)
  cand.spent_s += time.perf_counter() - started
  if kind == "timeout":
    _timed_out(cand, f"a batch of {count} calls did not finish within timeout_s={options.timeout_s:g} s",
               options)
    return None
  if kind == "error":
    _run_failed(cand, value)
    return None
  return value


def _calls_of_a_sample(n: int, options: MeasureOptions) -> int:
  """The calls `_run_batch` makes for a sample of n: 3n paired, else n."""
  return 3 * n if options.paired_batches else n


def _paired(options: MeasureOptions, platform: str) -> MeasureOptions:
  """`options` with `paired_batches` decided: where None, on every platform but the CPU."""
  if options.paired_batches is not None:
    return options
  return dataclasses.replace(options, paired_batches=platform != "cpu")


def _warm_up(cand: _Candidate, input_sets: list[tuple], options: MeasureOptions):
  """Warms the candidate up and sets its batch size (see step 4 of the module docstring)."""
  n, runs, started = 1, 0, time.perf_counter()
  while True:
    batch_s = _run_batch(cand, input_sets, n, options)
    if batch_s is None:
      return
    runs += _calls_of_a_sample(n, options)
    long_enough = batch_s >= options.min_batch_s or n >= options.max_batch_calls
    warm = runs >= options.warmup_runs and time.perf_counter() - started >= options.warmup_s
    if (long_enough and warm) or cand.spent_s >= options.max_total_s:
      cand.batch_calls, cand.call_s = n, batch_s / (n * cand.calls_per_run)
      return
    if not long_enough:
      wanted = math.ceil(1.2 * n * options.min_batch_s / max(batch_s, 1e-9))
      n = min(options.max_batch_calls, max(2 * n, min(_MAX_BATCH_GROWTH * n, wanted)))


def _take_rounds(cands: list[_Candidate], input_sets: list[tuple], options: MeasureOptions,
                 rng: random.Random, num_rounds: int, spend_limit_s: float):
  """Shuffled rounds of one sample per live candidate; see step 5 of the module docstring."""
  for _ in range(num_rounds):
    live = [c for c in cands if c.alive and (not c.samples or c.spent_s < spend_limit_s)]
    if not live:
      return
    rng.shuffle(live)
    for cand in live:
      batch_s = _run_batch(cand, input_sets, cand.batch_calls, options)
      if batch_s is not None:
        cand.samples.append(batch_s / (cand.batch_calls * cand.calls_per_run))


def _leaders(intervals: Mapping[K, tuple[float, float, float]]) -> list[K]:
  """Keys whose (median, low, high) interval reaches the fastest median's interval."""
  if not intervals:
    return []
  fastest = min(intervals, key=lambda k: intervals[k][0])
  return [k for k, (_, low, _) in intervals.items() if low <= intervals[fastest][2]]


def _nothing(*args):
  """The dispatch floor's program: it takes the candidates' arguments and does almost nothing.

  It reads one element of each argument, so that it launches one small kernel as the
  smallest candidate would (a program returning a constant may launch none).
  """
  readable = lambda x: x.size and (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == bool)
  firsts = [x.ravel()[0].astype(jnp.int32) for x in jax.tree.leaves(args) if readable(x)]
  return sum(firsts, jnp.zeros((), jnp.int32))


def looped(fn: Callable[..., Any], calls: int) -> Callable[..., Any]:
  """fn(*args) run `calls` times in one program, as host-bound candidates are timed.

  Each iteration reads its inputs through an optimization barrier and passes them on,
  with its output, through another, so that the compiler sees every iteration's inputs as
  new values: it can neither hoist the call out of the loop nor merge two iterations.

  Args:
    fn: a jittable function of arrays.
    calls: iterations, >= 1.

  Returns:
    A function of the same arguments returning the last call's output (jit it).

  Raises:
    ValueError: if calls < 1.
  """
  if not isinstance(calls, int) or calls < 1:
    raise ValueError(f"{calls=} must be an int >= 1: the calls of fn in one program.")

  def run(*args):
    first = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))

    def step(_, carry):
      inputs, _ = carry
      out = fn(*jax.lax.optimization_barrier(inputs))
      return jax.lax.optimization_barrier((inputs, out))

    return jax.lax.fori_loop(0, calls, step, (args, first))[1]

  return run


def _dispatch_floor_s(input_sets: list[tuple], options: MeasureOptions,
                      cache: MutableMapping[Any, Any] | None) -> float | None:
  """Seconds per call of `_nothing`, timed as candidates are; None if it could not run.

  Where a compile cache is kept, it is measured once for it (per way of timing): it
  only decides which candidates loop, and measured anew each call its noise moved
  candidates near the line from batches to loops between a search's calls (a compile
  of the loop each time; on a TPU v5e a 4096^3 matmul's call at the lowest effort
  took 0.29 s instead of 0.03), and it was 40% of such a call's cost besides."""
  measured = _Aux("floor_s", _timing(options))
  if cache is not None and measured in cache:
    return cache[measured]
  key = _Aux("floor")
  entry = cache.get(key) if cache is not None else None
  if entry is None:
    program = jax.jit(_nothing, keep_unused=True)  # keep_unused: it must take every argument
    kind, value = run_with_timeout(lambda: program.lower(*input_sets[0]).compile(),
                                    options.timeout_s)
    if kind != "ok":
      return None
    entry = _Compiled(value, None)
    if cache is not None:
      cache[key] = entry
  probe = _Candidate(key, executable=entry.executable)
  options = dataclasses.replace(options, stop_after_run_timeout=False)  # it hangs nothing
  _warm_up(probe, input_sets, options)
  samples = [_run_batch(probe, input_sets, probe.batch_calls, options) for _ in range(3)]
  if not probe.alive or None in samples:
    return None
  floor_s = float(np.median(samples)) / probe.batch_calls
  if cache is not None:
    cache[measured] = floor_s
  return floor_s


# A candidate whose warm-up time per call is within this factor of a host-bound one's is
# looped with it, host-bound or not: batches time the host's dispatch too where it does
# not overlap the work (XLA:CPU), so two near-equal candidates timed one looped and one
# in batches would be compared on different clocks (2.7x apart for twins on the CPU).
_RIVAL_FACTOR: Final = 2.0


def _to_loop(call_s: Mapping[Any, float], floor_s: float, factor: float) -> set[Any]:
  """The candidates to time in loops, from their warm-up time per call: the host-bound
  ones (under `factor` times the dispatch floor) and their rivals (`_RIVAL_FACTOR`)."""
  bound = [t for t in call_s.values() if t < factor * floor_s]
  if not bound:
    return set()
  limit = max(factor * floor_s, _RIVAL_FACTOR * min(bound))
  return {key for key, t in call_s.items() if t < min(limit, _SURELY_DEVICE_BOUND_S)}


def _loop_trips(cand: _Candidate, floor_s: float, options: MeasureOptions,
                cache: MutableMapping[Any, Any] | None) -> int:
  """How many calls the candidate's looped program makes: enough that one run of it is
  device-bound by this module's own test (`host_bound_factor` times the dispatch floor)
  and lasts a batch (`min_batch_s`), at least 2 and at most `loop_calls`. A 0.9 ms call
  looped 256 times ran 0.24 s, and its samples of three runs made a full measurement
  take the whole `max_total_s` (a TPU v5e, 2026-12-07). Where a compile cache is kept,
  a candidate keeps the count it was first given, so its loop compiles once.

  Each run's own cost (about one dispatch floor where dispatch does not overlap the
  work, XLA:CPU's) is shared by its calls, so candidates given fewer calls read slower
  by up to 1/`host_bound_factor` of their time when `min_batch_s` is below the loop's
  8 floors: three copies of one program read 0.78-1.13 us a call at 160-20 calls with
  `min_batch_s=2e-4` (2026-12-07). At the default 1 ms a run, that is under 1% on the
  CPU here, and where dispatch overlaps the device's work (GPU, TPU) a device-bound
  run hides it."""
  remembered = _Aux("trips", (cand.key, options.loop_calls))
  if cache is not None and remembered in cache:
    return cache[remembered]
  run_s = max(options.min_batch_s, options.host_bound_factor * floor_s)
  trips = min(options.loop_calls, max(2, math.ceil(run_s / max(cand.call_s, 1e-9))))
  if cache is not None:
    cache[remembered] = trips
  return trips


def _first_call_s(cand: _Candidate, options: MeasureOptions,
                  cache: MutableMapping[Any, Any] | None) -> float:
  """The candidate's warm-up time per call when a measure with this compile cache first
  timed it the same way (its own now, without a cache). Which candidates loop is
  decided on it, so that whether a candidate near the line is host-bound does not
  change from one call of a search to the next as its warm-up's noise goes (a 0.94 ms
  TPU matmul near 8 floors of 0.12 ms: each flip cost a compile of its loop, and its
  times in two calls came from two methods); a rival of a host-bound candidate is
  still looped with it in the calls that have both (`_to_loop`)."""
  if cache is None:
    return cand.call_s
  return cache.setdefault(_Aux("call_s", (cand.key, *_timing(options), options.cold_cache)),
                          cand.call_s)


def _timing(options: MeasureOptions) -> tuple:
  """The options that decide how a call's time per call is taken (batches, pairs)."""
  return options.paired_batches, options.min_batch_s, options.max_batch_calls


def _loop_host_bound(cands: list[_Candidate], fns: Mapping[Any, Callable[..., Any]],
                     input_sets: list[tuple], options: MeasureOptions,
                     cache: MutableMapping[Any, Any] | None):
  """Moves host-bound candidates to looped programs (step 4 of the module docstring)."""
  call_s = {c.key: _first_call_s(c, options, cache) for c in cands
            if c.alive and c.call_s is not None}
  if not options.loop_calls or not call_s or min(call_s.values()) >= _SURELY_DEVICE_BOUND_S:
    return
  floor_s = _dispatch_floor_s(input_sets, options, cache)
  if floor_s is None:
    return
  looping = _to_loop(call_s, floor_s, options.host_bound_factor)
  bound = [c for c in cands if c.key in looping]
  trips = {c.key: _loop_trips(c, floor_s, options, cache) for c in bound}
  # Keyed by the calls a loop makes too: a measurer (an isolated worker's) outlives one
  # tuning, and a loop compiled for other options divided by these is wrong by their ratio.
  loops = [_Candidate(_Aux("looped", (c.key, trips[c.key]))) for c in bound]
  _compile_all(loops, {loop.key: looped(fns[c.key], trips[c.key])
                       for loop, c in zip(loops, bound)}, input_sets[0], options, cache)
  for cand, loop in zip(bound, loops):
    if not loop.alive:
      continue  # The candidate itself works: it stays timed in batches.
    cand.executable, cand.calls_per_run, cand.batch_calls = (
        loop.executable, trips[cand.key], 1)
    cand.compile_time_s = (cand.compile_time_s or 0.0) + (loop.compile_time_s or 0.0)
    _warm_up(cand, input_sets, options)


def _time_all(cands: list[_Candidate], fns: Mapping[Any, Callable[..., Any]], args: tuple,
              options: MeasureOptions, cache: MutableMapping[Any, Any] | None):
  """Warm-up (looping host-bound candidates), shuffled rounds, then rounds among leaders."""
  if not cands:
    return
  input_sets = _input_sets(args, options)
  for cand in cands:
    _warm_up(cand, input_sets, options)
  _loop_host_bound(cands, fns, input_sets, options, cache)
  rng = random.Random(options.seed)
  main_share = options.rounds / (options.rounds + options.leader_rounds)
  _take_rounds(cands, input_sets, options, rng, options.rounds,
               options.max_total_s * main_share)
  intervals = {c: median_interval(c.samples) for c in cands if c.alive}
  leaders = _leaders(intervals)
  if len(leaders) > 1 and options.leader_rounds:
    _take_rounds(leaders, input_sets, options, rng, options.leader_rounds,
                 options.max_total_s)
  if options.profile:
    _profile_batches(cands, input_sets, options)


def _profile_batches(cands: list[_Candidate], input_sets: list[tuple], options: MeasureOptions):
  """One more batch of every live candidate, inside one trace (step 8 of the module
  docstring): sets each one's profiled_s that the profile's events tell apart."""
  live = [c for c in cands if c.alive]
  if not live:
    return
  modules = {c: profile.program_names(c.executable)[1] for c in live}
  with tempfile.TemporaryDirectory(prefix="stellarax-profile-") as folder:
    try:
      jax.profiler.start_trace(folder, profiler_options=profile.trace_options(hlo=False))
    except Exception as exc:  # e.g. the caller is profiling: one trace at a time
      warn(f"MeasureOptions.profile: no profile taken, the trace did not start"
           f" ({_short_error(exc)}); profiled_s stays None.", RuntimeWarning)
      return
    # One batch, not a pair: the profiler's busy time has no sync in it, and it is
    # divided by the batch's calls.
    single = dataclasses.replace(options, paired_batches=False)
    try:
      ran = [c for c in live if _run_batch(c, input_sets, c.batch_calls, single) is not None]
    finally:
      jax.profiler.stop_trace()
    try:
      # Off a CPU only the device's own events time the device (not the host's launches).
      busy = profile.busy_time_by_program(folder, by_module=True,
                                          host_events=_platform(input_sets[0]) == "cpu")
    except profile.ProfileError as exc:
      warn(f"MeasureOptions.profile: the profile could not be read ({exc});"
           " profiled_s stays None.", RuntimeWarning)
      return
  # Each candidate's program has a name of its own (_program_name), unless two keys
  # have one repr: those cannot be told apart.
  shared = collections.Counter(modules.values())
  for cand in ran:
    seconds = busy.get(modules[cand]) if shared[modules[cand]] == 1 else None
    if seconds is not None:
      cand.profiled_s = seconds / (cand.batch_calls * cand.calls_per_run)


def _platform(args: tuple) -> str:
  devices = [x.devices() for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
  return next(iter(devices[0])).platform if devices else jax.default_backend()


def _to_measurement(cand: _Candidate, platform: str, options: MeasureOptions) -> Measurement:
  if cand.calls_per_run > 1:
    method = f"{platform}-looped"
  else:
    method = (f"{platform}-{'paired' if options.paired_batches else 'batched'}"
              + ("-cold" if options.cold_cache else ""))
  if not cand.alive:
    return Measurement(status=cand.status, error=cand.error,
                       compile_time_s=cand.compile_time_s, method=method)
  median, low, high = median_interval(cand.samples)
  return Measurement(status="ok", median_s=median, ci_low_s=low, ci_high_s=high,
                     num_samples=len(cand.samples), compile_time_s=cand.compile_time_s,
                     method=method, profiled_s=cand.profiled_s)


def measure_candidates(
    candidates: Mapping[K, Callable[..., Any]],
    args: tuple,
    *,
    reference: Any = None,
    options: MeasureOptions = MeasureOptions(),
    check: Callable[[Any, Any], str | None] | None = None,
    order: Iterable[K] | None = None,
    compile_cache: MutableMapping[K, Any] | None = None,
    effort: float = 1.0,
    output_types: Any = None,
) -> dict[K, Measurement]:
  """Checks and times candidates by the method in this module's docstring.

  Args:
    candidates: key -> jittable function called as fn(*args), returning a pytree of arrays.
      Every leaf of args is traced; close over static values in the function.
    args: the positional arguments, a tuple of arrays or pytrees of arrays.
    reference: the expected output (a pytree of arrays, or a zero-argument callable that
      returns it, called once), or None to skip the default check.
    options: measurement options.
    check: check(output, reference) -> None when acceptable, else a short reason; it
      replaces `check_close` and is called even when reference is None. Outputs and
      reference reach it as numpy pytrees.
    order: the keys in the order to compile, check, warm up and shuffle them (makes the
      run reproducible); None uses the mapping's order. Extra entries are ignored.
    compile_cache: a mapping in which compiled executables (and compile failures) are
      kept by key, so that a later call with the same candidates and argument shapes
      does not compile again; it also keeps, under keys of their own (`_Aux`), the
      dispatch floor's program and time, looped programs and their calls, each
      candidate's first warm-up time, the host copy of the inputs, and the reference's
      copies (on the device too: memory the size of the reference while it is kept).
      None compiles every time.
    effort: fraction of a full measurement, in (0, 1]: the options are replaced by
      `options.with_effort(effort)` (fewer rounds, same compilation and check). Search
      strategies pass it to measure cheaply first (see search.py).
    output_types: the shapes and dtypes every candidate's output must have (a pytree
      of objects with .shape and .dtype, as `jax.eval_shape` returns; an `AnyDtype`
      leaf asks for its shape only), checked before the values
      (`other_output_types`); a candidate whose output differs is a `wrong_result`. None: not
      checked (a reference computed in another dtype passes `check_close`).

  Returns:
    key -> Measurement, in `order`; under `options.stop_after_run_timeout`, after a
    run timed out or lost the device, only the candidates that failed before it and
    that one.

  Raises:
    ValueError: if candidates is empty, order misses a candidate, or effort is not in (0, 1].
    TypeError: if a candidate is not callable.
    DeviceLostError: when a run lost the device (an illegal address, a trap), unless
      `options.stop_after_run_timeout`: nothing more can run in this process.
    KeyboardInterrupt, SystemExit: raised while a candidate was traced (they are the
      caller's, not the candidate's failure).
  """
  if not candidates:
    raise ValueError("No candidates to measure: pass a non-empty mapping of key -> function.")
  keys = _ordered_keys(candidates, order)
  options = options.with_effort(effort)
  for key in keys:
    if not callable(candidates[key]):
      raise TypeError(f"Candidate {key!r} is {candidates[key]!r}; expected a function fn(*args).")
  args = _on_device(tuple(args))
  platform = _platform(args)
  options = _paired(options, platform)
  cands = [_Candidate(key) for key in keys]
  _compile_all(cands, candidates, args, options, compile_cache)
  try:
    with _one_runner():  # every check run and batch on one thread (see _Runner)
      if any(c.alive for c in cands):
        expected = _Expected.of(reference, output_types, args, check is None, compile_cache)
        guard = _InputGuard(args, compile_cache)
        for cand in cands:
          if cand.alive:
            _check_output(cand, guard.args, expected, check, options)
            # (after a timeout the device may still be busy: a digest would wait on it)
            if cand.status != "timeout" and not guard.intact():
              _wrote_its_inputs(cand)
              guard.restore()
        args = guard.args
      _time_all([c for c in cands if c.alive], candidates, args, options, compile_cache)
  except (_Stalled, _DeviceLost) as stop:
    decided = {c.key: _to_measurement(c, platform, options) for c in cands if not c.alive}
    if isinstance(stop, _DeviceLost) and not options.stop_after_run_timeout:
      raise DeviceLostError(stop.key, decided) from None
    return decided
  return {c.key: _to_measurement(c, platform, options) for c in cands}


def dispatch_floor_s(args: tuple, options: MeasureOptions = MeasureOptions()) -> float:
  """Seconds per call of a program that takes `args` and does almost nothing.

  It is the floor below which `measure_candidates` cannot time a call in batches (the
  host's cost of dispatching it), measured the same way; a candidate below
  `options.host_bound_factor` times it is timed in a loop instead.

  Args:
    args: the positional arguments, as `measure_candidates` takes them.
    options: measurement options (warm-up, batch length, timeout).

  Returns:
    The floor in seconds per call.

  Raises:
    RuntimeError: if the floor's program failed to compile or run within options.timeout_s;
      DeviceLostError (a RuntimeError) if running it lost the device.
  """
  args = _on_device(tuple(args))
  options = _paired(options, _platform(args))
  try:
    with _one_runner():
      floor_s = _dispatch_floor_s(_input_sets(args, options), options, None)
  except _DeviceLost as lost:
    raise DeviceLostError(lost.key, {}) from None
  if floor_s is None:
    raise RuntimeError(f"The dispatch floor's program did not compile or run within"
                       f" timeout_s={options.timeout_s:g} s for arguments"
                       f" {jax.tree.map(lambda x: getattr(x, 'shape', x), args)}.")
  return floor_s


# --- choice -----------------------------------------------------------------------------


def within_noise(measurements: Mapping[K, Measurement], of: K | None = None) -> list[K]:
  """The keys measured ok whose confidence intervals reach `of`'s: those a choice
  cannot yet tell from it, to be measured again side by side.

  Args:
    measurements: measurements by key.
    of: the key to compare with (measured ok); None: the one of the fastest median.

  Returns:
    `of` first, then the others that reach its interval (ci_low_s <= its ci_high_s),
    fastest median first; [] where nothing was measured ok.

  Raises:
    ValueError: if `of` was not measured ok.
  """
  ok = {k: m for k, m in measurements.items() if m.ok}
  if of is None:
    if not ok:
      return []
    of = min(ok, key=lambda k: ok[k].median_s)
  if of not in ok:
    raise ValueError(f"within_noise: {of!r} was not measured ok; name a key that was.")
  reach = ok[of].ci_high_s
  return [of] + sorted((k for k, m in ok.items() if k != of and m.ci_low_s <= reach),
                       key=lambda k: ok[k].median_s)


def pick_best(measurements: Mapping[K, Measurement], *, prefer: K | None = None,
              order: Iterable[K] | None = None) -> K:
  """Chooses the fastest successful candidate, breaking ties deterministically.

  Let F be the ok candidate with the smallest median (the first in `order` among equal
  medians). `prefer` wins when it is tied with F: median(prefer) <= (1 + TIE_RELATIVE) *
  median(F), or its interval reaches F's (ci_low(prefer) <= ci_high(F)). So a faster
  candidate replaces the preferred (heuristic) one only when it is faster beyond noise.
  Otherwise the first in `order` among the candidates within TIE_RELATIVE of F's median
  wins (F is one), so noise cannot flip the choice between near-equal candidates. An
  interval that reaches F's is not a tie between two candidates that are not preferred:
  the faster median is the better guess there, and short measurements have wide
  intervals (fewer than 6 samples: their whole range), so taking the first in order
  chose a finalist 8% slower than another on a TPU (2026-12-07).

  Args:
    measurements: key -> Measurement.
    prefer: key that wins ties, usually the heuristic config; None for no preference.
    order: the keys in tie-breaking order; None uses the mapping's order. Extra entries
      are ignored.

  Returns:
    The chosen key; never one whose status is not "ok".

  Raises:
    AllCandidatesFailedError: (a ValueError) if no candidate is ok; it lists each failure.
    ValueError: if prefer is not among the measurements or order misses a key.
  """
  keys = _ordered_keys(measurements, order)
  if prefer is not None and prefer not in measurements:
    raise ValueError(f"{prefer=} was not measured; measure it too or pass prefer=None.")
  ok = [k for k in keys if measurements[k].ok]
  if not ok:
    raise AllCandidatesFailedError({k: measurements[k] for k in keys})
  fastest = measurements[min(ok, key=lambda k: measurements[k].median_s)]
  near = lambda k: measurements[k].median_s <= (1 + TIE_RELATIVE) * fastest.median_s
  if prefer in ok and (near(prefer) or measurements[prefer].ci_low_s <= fastest.ci_high_s):
    return prefer
  return next(k for k in ok if near(k))
