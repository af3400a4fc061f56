"""Check and time every implementation of every op side by side.

    python bench/gpu_check.py --out results/2026-11-29-h200 [--tune-budget-s 20]
        [--deadline-s 540] [--only "ragged_dot,attention"]
    python bench/gpu_check.py --smoke --out /tmp/smoke     # tiny shapes, CPU, interpret mode
    python bench/gpu_check.py ... --leave-out attention.pallas_mosaic_gpu  # after it hung

For each workload (the speed targets of DESIGN.md: ragged_dot, attention,
rms_norm/layer_norm, forward and forward+backward; then, for information, a
sliding-window attention, a decode-sized ragged_dot and a Llama-style GQA
attention, last so that the deadline cuts them first) every implementation that
runs here is first checked against the op's float32 reference on fresh random
inputs, then all of them are timed together by `measure_candidates`
(interleaved shuffled rounds of batched asynchronous calls, one sync per
batch, each sample on a GPU the difference of batches of 2n and n calls, so that
what a batch pays once does not count: device time, not dispatch; a call faster
than its dispatch is timed in a loop inside one program, and its row says so). Ours run with the heuristic
config and, unless --tune-budget-s 0, with the config `stellarax.Autotuner`
finds within that budget per op call. Baselines: XLA (`jax.lax.ragged_dot`,
`jax.nn.dot_product_attention(implementation="xla")`), cuDNN attention,
cuBLAS dense matmuls of the same FLOPs, and an elementwise copy for bandwidth.

First, it profiles a small model (forward and gradient, every op family) into
`<out>/profile/` and reads it back with `read_op_calls`, printing the calls it
found: a real device profile for the profile tests, and a check of the device
event path of the profile reader. Then (unless --no-dispatch) it times small calls
against the dispatch floor and a long call's batches, before any workload: no
deadline cuts them, and no kernel that loses the device spoils them.

Writes `<out>/results.json` (every row, environment) and `<out>/tuned.json`
(an AutotuningResult for the library cache) after every workload, so a run cut
short keeps what it measured; prints each workload's rows as it ends, then
small calls timed both ways beside the dispatch floor (what sets
`MeasureOptions.host_bound_factor`), a long call's batches (per call with 1 to 16
calls a batch, and profiled batches split into lead, busy, gaps and tail), the whole table, the rows whose median is not
near the device time the profiler saw in one more batch (`MeasureOptions.profile`:
dispatch or gaps between kernels timed too), the code paths each
tuning measured (and those faster than the heuristic beyond both confidence
intervals), then whether each speed target of
the GPU-kernels issue was met. Past --deadline-s the remaining workloads are
checked and timed untuned, and past the deadline plus a minute they are skipped. A
candidate whose error exceeds the dtype's tolerance is marked WRONG (and still
timed, so the table shows what it would cost). Tuning measures in worker
processes; a heuristic or tuned config that hung or failed there is not run in
this process (a hung kernel or a poisoned CUDA context would cost every later
workload): its row says why. When some op call of a workload could not be tuned
(e.g. every config of the backward failed), its tuned row runs the calls that
were tuned with their configs and the others with their heuristics, and its
note says which. In this process a candidate that hangs (a check run past
CHECK_TIMEOUT_S, a timed run past its timeout) or loses the device ends the
workloads: its row says so, the ones left are skipped (they would queue behind
it), the tables are printed and the process leaves without waiting for the
kernel, well before --hard-limit-s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import stellarax
from stellarax.autotuning import file_format, measure, profile

# The deadlines count from here (the profile and jax's start-up included): the device
# tool's limit counts the whole call.
_STARTED = time.monotonic()
# Why the run stopped with a kernel still running on the device (see __main__), if it did.
HUNG: list[str] = []


@dataclasses.dataclass
class Row:
  workload: str
  impl: str
  median_ms: float | None = None
  rate: str = ""
  max_rel_err: float | None = None
  status: str = ""
  config: str = ""
  # What the status does not say, e.g. a tuned row's op calls that kept their heuristic
  # configs because their tuning failed (the status still says how the row ran).
  note: str = ""
  # How measure_candidates timed it: "<platform>-batched", or "-looped" for a call
  # faster than the host dispatches it (measure.py's docstring, step 4).
  method: str = ""
  # The device's busy time per call in one profiled batch (measure.py, step 8): where
  # median_ms is well above it, the batches did not time the device alone.
  profiled_ms: float | None = None


def _rel_err(out, ref) -> float:
  """The largest |out - ref| of any leaf over that leaf's largest |ref| (NaN where any
  output has one), computed where the arrays are: copied to the host and compared in
  NumPy, the ragged_dot target's backward (470M values) cost seconds a candidate of the
  GPU machine's 15 minutes (a TPU host took 0.5 s for 16.8M values, 2026-12-07)."""
  pairs = list(zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
  for o, r in pairs:
    if np.shape(o) != np.shape(r):  # (jnp would broadcast one against the other)
      raise ValueError(f"output shape {np.shape(o)} differs from the reference's {np.shape(r)}")
  pairs = [(o, r) for o, r in pairs if np.size(r)]
  # np.max, not max: Python's max passes over a NaN after the first leaf, and the NaN of
  # a wrong output must reach the tolerance test (which it fails).
  return float(np.max(jax.device_get(_rel_errs(pairs)))) if pairs else 0.0


@jax.jit
def _rel_errs(pairs):
  f32 = lambda x: jnp.asarray(x).astype(jnp.float32)
  return [jnp.max(jnp.abs(f32(o) - f32(r))) / jnp.maximum(jnp.max(jnp.abs(f32(r))), 1e-6)
          for o, r in pairs]


# Error relative to the reference's largest magnitude, by input dtype: bf16
# keeps 8 significant bits, and sums of thousands of products lose a few more.
_TOLERANCE = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-3}


def _ragged_inputs(g, m, k, n, dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / math.sqrt(k)).astype(dtype)
  w = np.asarray(jax.random.dirichlet(keys[2], jnp.ones(g) * 4))
  sizes = np.floor(w * m).astype(np.int32)
  sizes[-1] += m - sizes.sum()
  return lhs, rhs, jnp.asarray(sizes)


def _attention_inputs(b, t, h, d, dtype, kv_heads=None):
  """(q, k, v): q with h heads, k and v with kv_heads (default h; fewer: GQA)."""
  keys = jax.random.split(jax.random.key(1), 3)
  heads = (h, kv_heads or h, kv_heads or h)
  return tuple(jax.random.normal(kk, (b, t, n, d), jnp.float32).astype(dtype)
               for kk, n in zip(keys, heads))


def _impls(family: str, smoke: bool, leave_out: frozenset[str] = frozenset()
           ) -> list[tuple[str, Any]]:
  """Our implementations of a family that run here (interpret mode in smoke runs),
  but those named in `leave_out`."""
  from stellarax.core import registry
  device = jax.devices()[0]
  out = []
  for name in registry.names(family):
    if name.endswith("_vjp") or name in leave_out:
      continue
    cls = registry.lookup(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    if cls.supported_on(device):
      out.append((name, cls()))
    elif smoke and "interpret" in fields and "mosaic" not in name:
      out.append((name, cls(interpret=True)))
  return out


def _grad_of(f, argnums):
  """The gradient of sum(sin(f(...))): a loss with no degenerate directions
  (sum(f**2) of a normalisation has a zero gradient)."""
  return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))), argnums=argnums)


def _forward_and_vjp(f):
  """(y, gradients) of y = f(x, scale) for a given cotangent dy, as a training step
  runs a layer: its output for the next layer, then its backward from the next
  layer's dy. A memory-bound op is timed so, not through `_grad_of`: the loss's own
  elementwise pass (dy = cos(y)) fuses into XLA's autodiff but not into a kernel's
  backward, so it would time the loss as well as the op."""
  def run(x, scale, dy):
    y, vjp = jax.vjp(f, x, scale)
    return y, vjp(dy.astype(y.dtype))
  return run


@dataclasses.dataclass
class Workload:
  name: str
  family: str
  make_inputs: Callable[[], tuple]
  call: Callable[..., Any]  # call(op, *inputs)
  reference: Callable[..., Any]
  flops: float | None = None
  nbytes: float | None = None
  baselines: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
  # Baselines that compute something else of the same cost (not checked).
  unchecked: tuple[str, ...] = ()
  # The inputs' shapes and dtypes, where make_inputs cannot be traced (NumPy inside).
  specs: Callable[[], tuple] | None = None
  # bench/compile_h200.py fails a slow heuristic kernel (spills in a loop, serialized
  # wgmma, ...) of this workload as of a speed target's. False leaves a known one to the
  # GPU run (GQA: the Mosaic GPU dK/dV spills in one loop instruction; BENCHMARKS.md);
  # serialized wgmma still fail.
  compile_strict: bool = True

  def input_specs(self) -> tuple:
    """ShapeDtypeStructs of `make_inputs()`, without making them."""
    return self.specs() if self.specs is not None else jax.eval_shape(self.make_inputs)


def _ragged_workloads(smoke, dtype, shapes=None, backward=True):
  if shapes is None:
    shapes = [(8, 8192, 4096, 14336), (64, 16384, 2048, 1536)] if not smoke else [(4, 64, 32, 48)]
  out = []
  for g, m, k, n in shapes:
    inputs = functools.partial(_ragged_inputs, g, m, k, n, dtype)
    specs = lambda g=g, m=m, k=k, n=n: (jax.ShapeDtypeStruct((m, k), dtype),
                                        jax.ShapeDtypeStruct((g, k, n), dtype),
                                        jax.ShapeDtypeStruct((g,), jnp.int32))
    ref = lambda l, r, gs: jax.lax.ragged_dot(l.astype(jnp.float32), r.astype(jnp.float32), gs,
                                              precision=jax.lax.Precision.HIGHEST)
    call = lambda op, l, r, gs: stellarax.ragged_dot(l, r, gs, implementation=op)
    xla = lambda l, r, gs: jax.lax.ragged_dot(l, r, gs)
    dense = lambda l, r, gs, k=k, n=n: l @ r.reshape(-1, n)[:k]  # (M, K) @ (K, N): the same FLOPs
    label = f"ragged_dot G={g} M={m} K={k} N={n}"
    out.append(Workload(f"{label} fwd", "ragged_dot", inputs, call, ref, flops=2 * m * k * n,
                        baselines={"xla jax.lax.ragged_dot": xla, "cuBLAS dense same FLOPs": dense},
                        unchecked=("cuBLAS dense same FLOPs",), specs=specs))
    if not backward:
      continue
    out.append(Workload(
        f"{label} fwd+bwd", "ragged_dot", inputs,
        lambda op, l, r, gs, call=call: _grad_of(lambda a, b: call(op, a, b, gs), (0, 1))(l, r),
        lambda l, r, gs, ref=ref: _grad_of(lambda a, b: ref(a, b, gs), (0, 1))(l, r), flops=6 * m * k * n,
        baselines={"xla jax.lax.ragged_dot": lambda l, r, gs, xla=xla: _grad_of(lambda a, b: xla(a, b, gs), (0, 1))(l, r)},
        specs=specs))
  return out


def _attention_baselines(**options) -> dict[str, Callable[..., Any]]:
  """jax.nn.dot_product_attention with `options` through XLA and, on a GPU, cuDNN; each
  takes (q, k, v) or (q, k, v, key_value_seq_lengths)."""
  def through(implementation):
    return lambda q, k, v, lens=None: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lens, **options, implementation=implementation)
  base = {"xla jax.nn.dot_product_attention": through("xla")}
  if jax.devices()[0].platform == "gpu":
    base["cuDNN jax.nn.dot_product_attention"] = through("cudnn")
  return base


def _attention_workloads(smoke, dtype, kv_heads=None):
  """Causal attention forward and forward+backward: the speed target, or with
  `kv_heads` a Llama-style GQA layout (32 query heads on kv_heads), timed for
  information."""
  if kv_heads is None:
    b, t, h, d = (2, 8192, 16, 128) if not smoke else (1, 128, 2, 64)
  else:
    b, t, h, d = (1, 8192, 32, 128) if not smoke else (1, 128, 4, 64)
  inputs = functools.partial(_attention_inputs, b, t, h, d, dtype, kv_heads)
  flops = 4 * b * h * t * t * d / 2  # causal: half the logits
  f32 = lambda x: x.astype(jnp.float32)
  ref = lambda q, k, v: jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
  call = lambda op, q, k, v: stellarax.dot_product_attention(q, k, v, is_causal=True, implementation=op)
  base = _attention_baselines(is_causal=True)
  heads = f"H={h}" if kv_heads is None else f"H={h} KV={kv_heads}"
  label = f"attention B={b} T={t} {heads} D={d} causal"
  strict = kv_heads is None
  return [
      Workload(f"{label} fwd", "attention", inputs, call, ref, flops=flops, baselines=base,
               compile_strict=strict),
      Workload(f"{label} fwd+bwd", "attention", inputs,
               lambda op, q, k, v: _grad_of(lambda *a: call(op, *a), (0, 1, 2))(q, k, v),
               _grad_of(ref, (0, 1, 2)), flops=3.5 * flops,
               baselines={name: _grad_of(fn, (0, 1, 2)) for name, fn in base.items()},
               compile_strict=strict),
  ]


def _local_attention_workloads(smoke, dtype):
  """Causal sliding-window attention with per-batch key lengths (forward): the masking
  the Triton and Mosaic GPU kernels skip blocks for."""
  b, t, h, d = (2, 8192, 16, 128) if not smoke else (2, 128, 2, 64)
  # Every row keeps some key (a row with none is mean(V) in jax; cuDNN may differ), so
  # the comparison is about speed: the key length is at least T - window.
  window, kv_len = ((1024, 0), (t, t - t // 16)) if not smoke else ((32, 0), (t, 100))
  inputs = lambda: (*_attention_inputs(b, t, h, d, dtype), jnp.asarray(kv_len, jnp.int32))
  rows = np.arange(t)
  kept = sum(np.clip(np.minimum(rows + 1, length) - np.maximum(rows - window[0], 0), 0, None).sum()
             for length in kv_len)
  options = dict(is_causal=True, local_window_size=window)
  f32 = lambda x: x.astype(jnp.float32)
  ref = lambda q, k, v, lens: jax.nn.dot_product_attention(
      f32(q), f32(k), f32(v), key_value_seq_lengths=lens, **options)
  call = lambda op, q, k, v, lens: stellarax.dot_product_attention(
      q, k, v, key_value_seq_lengths=lens, **options, implementation=op)
  base = _attention_baselines(**options)
  label = f"attention B={b} T={t} H={h} D={d} causal window={window[0]} kv_len={kv_len}"
  return [Workload(f"{label} fwd", "attention", inputs, call, ref, flops=4 * h * d * kept,
                   baselines=base)]


def _norm_workloads(smoke, dtype):
  rows, cols = (8192, 8192) if not smoke else (64, 256)
  inputs = lambda: (jax.random.normal(jax.random.key(2), (rows, cols), jnp.float32).astype(dtype),
                    jnp.ones((cols,), dtype))
  nbytes = 2 * rows * cols * jnp.dtype(dtype).itemsize  # read x, write y
  f32 = lambda x: x.astype(jnp.float32)
  ref = lambda x, s: stellarax.rms_norm(f32(x), f32(s), implementation="xla")
  call = lambda op, x, s: stellarax.rms_norm(x, s, implementation=op)
  label = f"rms_norm ({rows}, {cols})"
  layer_ref = lambda x, s: stellarax.layer_norm(f32(x), f32(s), None, implementation="xla")
  copy = {"copy x*2 (bandwidth)": lambda x, s: x * 2}

  def with_cotangent():
    x, scale = inputs()
    return x, scale, jax.random.normal(jax.random.key(4), (rows, cols), jnp.float32).astype(dtype)

  return [
      Workload(f"{label} fwd", "layer_norm", inputs, call, ref, nbytes=nbytes,
               baselines=copy, unchecked=tuple(copy)),
      Workload(f"{label} fwd+bwd", "layer_norm", with_cotangent,
               lambda op, x, s, dy: _forward_and_vjp(lambda a, c: call(op, a, c))(x, s, dy),
               _forward_and_vjp(ref), nbytes=2.5 * nbytes,  # fwd: x -> y; bwd: x, dy -> dx
               baselines={"xla (autodiff)": _forward_and_vjp(
                   lambda x, s: stellarax.rms_norm(x, s, implementation="xla"))}),
      Workload(f"layer_norm ({rows}, {cols}) fwd", "layer_norm", inputs,
               lambda op, x, s: stellarax.layer_norm(x, s, None, implementation=op), layer_ref, nbytes=nbytes,
               baselines=copy, unchecked=tuple(copy)),
  ]


def _glu_workloads(smoke, dtype):
  """A SwiGLU MLP projection (Llama-style, 8192 tokens), forward and forward+backward,
  timed for information: no speed target is set for it."""
  m, k, n = (8192, 4096, 14336) if not smoke else (64, 32, 48)

  def inputs():
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (k, 2, n), jnp.float32) / math.sqrt(k)).astype(dtype)
    return x, w

  f32 = lambda x: x.astype(jnp.float32)
  ref = lambda x, w: stellarax.gated_linear_unit(f32(x), f32(w), precision="highest", implementation="xla")
  call = lambda op, x, w: stellarax.gated_linear_unit(x, w, implementation=op)
  dense = {"cuBLAS x @ W (K, 2N) alone": lambda x, w: x @ w.reshape(k, 2 * n)}
  flops = 2 * m * k * 2 * n
  label = f"gated_linear_unit silu M={m} K={k} N={n}"
  return [
      Workload(f"{label} fwd", "gated_linear_unit", inputs, call, ref, flops=flops,
               baselines=dense, unchecked=tuple(dense)),
      Workload(f"{label} fwd+bwd", "gated_linear_unit", inputs,
               lambda op, x, w: _grad_of(lambda a, b: call(op, a, b), (0, 1))(x, w),
               _grad_of(ref, (0, 1)), flops=3 * flops),
  ]


def _workloads(smoke: bool) -> list[Workload]:
  """The speed targets of DESIGN.md (tiny shapes in smoke runs)."""
  dtype = jnp.float32 if smoke else jnp.bfloat16
  # Last, so the deadline cuts them first: a decode-sized MoE step (128 tokens), the
  # case split-K is for, Llama-style GQA attention (what most models run), and the
  # gated linear unit (no target).
  decode = [] if smoke else _ragged_workloads(smoke, dtype, shapes=[(8, 128, 4096, 14336)], backward=False)
  gqa = [] if smoke else _attention_workloads(smoke, dtype, kv_heads=8)
  return (_ragged_workloads(smoke, dtype) + _attention_workloads(smoke, dtype)
          + _norm_workloads(smoke, dtype) + _local_attention_workloads(smoke, dtype) + decode
          + gqa + _glu_workloads(smoke, dtype))


def _rate(seconds: float | None, flops, nbytes) -> str:
  if not seconds:
    return ""
  if flops:
    return f"{flops / seconds / 1e12:.1f} TFLOP/s"
  return f"{nbytes / seconds / 1e12:.2f} TB/s"


def _only_parts(only: str) -> list[str]:
  """--only's parts; commas inside parentheses are part of a name: "=rms_norm (8192, 8192) fwd"."""
  return [s.strip() for s in re.split(r",(?![^()]*\))", only or "") if s.strip()]


def _selects(name: str, part: str) -> bool:
  """Whether a part of --only selects a workload: "=name" that workload alone, a plain
  part every name that holds it."""
  return name == part[1:] if part.startswith("=") else part in name


def run(args) -> list[Row]:
  rows: list[Row] = []
  tuned_all = None
  # A hung kernel costs timeout_s, not the run: tuning measures in worker processes
  # (isolate=True) outside smoke runs.
  opts = measure.MeasureOptions(rounds=3 if args.smoke else 10, max_total_s=1.0 if args.smoke else 5.0,
                                timeout_s=20.0)
  start = _STARTED
  only = _only_parts(args.only)

  skip_after_s = args.deadline_s + 60 if args.skip_after_s is None else args.skip_after_s
  # Seconds on the device, first: what no deadline may cut, and no kernel that loses the
  # device can spoil (printed after the workloads, as before).
  dispatch = batching = None
  if not args.no_dispatch:
    dispatch = dispatch_calibration(args.smoke, args.leave_out)
    batching = batch_size_check(args.smoke)
  save = lambda: _write(Path(args.out), rows, tuned_all, dispatch, batching)
  save()
  lost = ""  # why the device cannot run anything more, once a kernel lost it
  for w in _workloads(args.smoke):
    if only and not any(_selects(w.name, s) for s in only):
      continue
    elapsed = time.monotonic() - start
    if elapsed > skip_after_s or lost:
      why = lost or f"past {skip_after_s:.0f} s"
      rows.append(Row(w.name, "-", status=f"skipped: {why}"))
      continue
    tune = args.tune_budget_s if elapsed < args.deadline_s else 0.0
    try:
      new_rows, tuned = _run_workload(w, args.smoke, tune, opts, isolate=not args.smoke,
                                      leave_out=args.leave_out)
    except WorkloadStopped as e:  # the device runs nothing more here: the rest are skipped
      print(f"{e.why}: the workloads left are skipped", flush=True)
      new_rows, tuned, lost = e.rows, e.tuned, e.why
      HUNG.extend([e.why] if e.hung else [])
    except Exception as e:  # its inputs or reference, or a kernel that lost the device
      print(f"{w.name} failed: {type(e).__name__}: {e}", flush=True)
      new_rows, tuned = [Row(w.name, "-", status=f"error: {' '.join(str(e).split())[:300]}")], None
      if isinstance(e, measure.DeviceLostError):
        # This process's GPU context runs nothing more: the rest would fail too.
        lost = f"{w.name} lost the device ({e.key})"
    rows += new_rows
    if tuned is not None:
      tuned_all = tuned if tuned_all is None else tuned_all | tuned
    save()
    print_table(new_rows)
    print(f"-- {w.name}: done at {time.monotonic() - start:.0f} s", flush=True)
  save()  # the skipped rows too
  if args.no_dispatch:
    return rows
  print("\n== dispatch (small calls: batched, looped, and the dispatch floor) ==")
  print("\n".join(dispatch_lines(dispatch)))
  print("\n== batch size (a long call: per batch or per call costs) ==")
  print("\n".join(batch_size_lines(batching)))
  return rows


def config_label(entry) -> str:
  """How a tuned row names the best config of one of its op calls ("op: config"; a row
  joins those of its op calls with "; ")."""
  return f"{entry.bound_args.op.name}: {entry.best_config}"


def _failed_in_isolation(result, which: str) -> str:
  """How the `which` config ("heuristic_config" or "best_config") of some op call in a
  tuning result failed when measured (in isolated workers), or "" if none failed."""
  for entry in result:
    config = getattr(entry, which)
    for measured, m in entry.measurements:
      if measured == config and m.status in ("timeout", "runtime_error"):
        return f"{entry.bound_args.op.name} {m.status} in tuning: {str(m.error)[:160]}"
  return ""


def _heuristic_failed_in_tuning(failure: Exception | None) -> str:
  """How the heuristic config of an op call whose tuning failed hung or raised when it
  was measured (a timeout or a runtime error in the error's text), or "". Such a call
  runs its heuristic in every candidate of the implementation (the tuned one too), and a
  hung kernel here costs the check's whole timeout and stops the call's workloads."""
  for ba, text in (getattr(failure, "errors", None) or {}).items():
    heuristic = repr(ba.heuristics_config)
    for status in ("timeout", "runtime_error"):
      if f"{heuristic}: {status}" in text:
        return f"{ba.op.name} heuristic {status} in tuning"
  return ""


def _tuning_errors(failure: Exception) -> str:
  """Why tuning failed, in full: each op call's error (an `IncompleteTuningError` keeps
  them in `errors`; its message shows only their first lines)."""
  errors = getattr(failure, "errors", None)
  if not errors:
    return f"{type(failure).__name__}: {failure}"
  return "\n".join(f"{ba.op.name}: {text[:3000]}" for ba, text in errors.items())


def _has_choices(call: Callable, inputs) -> bool:
  """Whether some op call of `call` has more than one config to choose from (XLA
  attention and the XLA norms have one: tuning them would time the heuristic twice)."""
  try:
    calls = stellarax.autotuning.get_bound_args(call, *inputs)
  except Exception:  # noqa: BLE001 (tuning then says what fails)
    return True
  return any(len(ba.autotuning_configs) > 1 for ba in calls)


# Seconds a candidate's check run (its compilation, one call and the copy of its output)
# may take before it is presumed hung; interpret mode on a CPU is slow, not hung.
CHECK_TIMEOUT_S = {False: 120.0, True: 900.0}  # by smoke


class WorkloadStopped(Exception):
  """A candidate hung (a check run or a timed run past its timeout) or lost the device:
  the workload's rows so far, its tuning result, and why nothing more can run here."""

  def __init__(self, rows: list[Row], tuned: Any, why: str, hung: bool):
    super().__init__(why)
    self.rows, self.tuned, self.why, self.hung = rows, tuned, why, hung


class _CheckHung(Exception):
  pass


def _check_run(fn: Callable, inputs: tuple, timeout_s: float) -> Any:
  """fn's output for `inputs`, on the device, finished; raises _CheckHung past
  `timeout_s` (the run goes on in a daemon thread: a kernel that never ran on a GPU may
  never finish, and in-process it cannot be stopped), or fn's own error."""
  kind, value = measure.run_with_timeout(
      lambda: jax.block_until_ready(jax.jit(fn)(*inputs)), timeout_s)
  if kind == "timeout":
    raise _CheckHung()
  if kind == "error":
    raise value
  return value


def _run_workload(w: Workload, smoke: bool, tune_budget_s: float, opts, *,
                  isolate: bool, leave_out: frozenset[str] = frozenset()
                  ) -> tuple[list[Row], Any]:
  """Checks, tunes (within the budget) and times every candidate of one workload.

  Raises:
    WorkloadStopped: when a candidate hung or lost the device; it holds the rows so far.
  """
  rows: list[Row] = []
  tuned_all = None
  inputs = w.make_inputs()
  expected = jax.jit(w.reference)(*inputs)
  tolerance = _TOLERANCE.get(jnp.dtype(inputs[0].dtype).name, 3e-2)
  candidates: dict[str, Callable] = {}
  configs: dict[str, str] = {}
  notes: dict[str, str] = {}
  for impl_name, op in _impls(w.family, smoke, leave_out):
    call = functools.partial(w.call, op)
    candidates[f"{impl_name} heuristic"] = call
    if tune_budget_s > 0 and not _has_choices(call, inputs):
      print(f"{impl_name} on {w.name}: one config a call, nothing to tune", flush=True)
    elif tune_budget_s > 0:
      tuner = stellarax.Autotuner(budget_s=tune_budget_s, progress=False, measure_options=opts,
                                  isolate=isolate)
      result, failure = None, None
      try:
        result = tuner.autotune(call, *inputs)
      except stellarax.autotuning.IncompleteTuningError as e:
        # The op calls that were tuned still count (e.g. the forward when every
        # config of the backward failed); the others run their heuristic configs.
        result, failure = e.partial_result, e
        notes[f"{impl_name} tuned"] = "partly tuned: " + "; ".join(
            f"{ba.op.name} {error.splitlines()[0][:120]}" for ba, error in e.errors.items())
      except Exception as e:  # a failed tuning is a row, not a crash
        failure = e
      hung = _heuristic_failed_in_tuning(failure)
      if hung:  # not in this process: see _heuristic_failed_in_tuning
        del candidates[f"{impl_name} heuristic"]
        rows.append(Row(w.name, f"{impl_name} heuristic", status=f"not run here: {hung}"))
      if failure is not None and not (result is not None and len(result)):
        why = _tuning_errors(failure)
        print(f"tuning {impl_name} on {w.name} failed:\n{why}", flush=True)
        rows.append(Row(w.name, f"{impl_name} tuned", status="tuning failed: " + " ".join(
            why.split())[:400]))
        continue
      tuned_all = result if tuned_all is None else tuned_all | result
      configs[f"{impl_name} tuned"] = "; ".join(map(config_label, result))
      if hung:  # the untuned call runs its heuristic in the tuned candidate too
        rows.append(Row(w.name, f"{impl_name} tuned", status=f"not run here: {hung}",
                        config=configs[f"{impl_name} tuned"]))
        continue
      candidates[f"{impl_name} tuned"] = _with_result(result, call)
      # A config that hung or failed in an isolated worker is not run in this process:
      # a hung kernel or a poisoned CUDA context would cost every later workload.
      for kind, which in (("heuristic", "heuristic_config"), ("tuned", "best_config")):
        failure = _failed_in_isolation(result, which)
        if failure and f"{impl_name} {kind}" in candidates:
          # The tuned row names its configs, so that land ships none of them.
          del candidates[f"{impl_name} {kind}"]
          rows.append(Row(w.name, f"{impl_name} {kind}", status=f"not run here: {failure}",
                          config=configs.get(f"{impl_name} {kind}", "")))
  candidates.update(w.baselines)
  checked = []
  timeout_s = CHECK_TIMEOUT_S[smoke]
  for key, fn in candidates.items():
    try:
      out = _check_run(fn, inputs, timeout_s)
      err = None if key in w.unchecked else _rel_err(out, expected)
    except _CheckHung:
      why = f"{key} hung in its check run"
      rows.append(Row(w.name, key, status=f"timeout: its check run did not end in {timeout_s:.0f} s",
                      config=configs.get(key, "")))
      # Every other candidate gets a row that says why it was not timed (a tuned one
      # names its configs, so that land ships none of them unchecked).
      for r in rows:
        if r.impl in checked:
          r.status = "; ".join(filter(None, (r.status, f"not timed: {why}")))
      later = list(candidates)[list(candidates).index(key) + 1:]
      rows += [Row(w.name, k, status=f"not checked: {why}", config=configs.get(k, ""))
               for k in later]
      raise WorkloadStopped(rows, tuned_all, f"{w.name}: {why}", hung=True) from None
    except Exception as e:
      # All of it on one line: dispatch's first line says only that no implementation
      # took the call, the next ones say why (a backend this JAX lacks, a dtype).
      # The tuned row names its configs, so that land ships none of them unchecked.
      rows.append(Row(w.name, key, status=f"error: {' '.join(str(e).split())[:300]}",
                      config=configs.get(key, "")))
      continue
    wrong = err is not None and not err <= tolerance  # NaN is wrong too
    rows.append(Row(w.name, key, max_rel_err=err, config=configs.get(key, ""),
                    status=f"WRONG (tolerance {tolerance:g})" if wrong else "",
                    note=notes.get(key, "")))
    checked.append(key)
  # Profiled too (not while tuning: a trace costs time): each row also gets the
  # profiler's device time, a check of the timing method.
  # After a run that hangs or loses the device, nothing more can run in this process:
  # the measurement stops there (its other candidates untimed) and so does the run.
  timed = measure.measure_candidates(
      {k: candidates[k] for k in checked}, tuple(inputs),
      options=dataclasses.replace(opts, profile=True, stop_after_run_timeout=True))
  # (A compilation past its timeout holds no device: the workloads go on.)
  stop = next((k for k, m in timed.items() if m.run_timed_out or m.lost_the_device), None)
  for r in rows:
    if stop is not None and r.impl in checked and r.impl not in timed:
      r.status = "; ".join(filter(None, (r.status, f"not timed: {stop} stopped the timing")))
    if r.impl in timed:
      m = timed[r.impl]
      note = r.status
      r.status = m.status if m.status == "ok" else f"{m.status}: {m.error}"
      if note:
        r.status = f"{note}; {r.status}"
      r.method = m.method
      if m.status == "ok":
        r.median_ms = m.median_s * 1e3
        r.profiled_ms = None if m.profiled_s is None else m.profiled_s * 1e3
        r.rate = _rate(m.median_s, w.flops, w.nbytes)
        if m.method.endswith("-looped"):
          r.note = "; ".join(filter(None, (r.note, "timed in a loop: host-bound")))
  if stop is not None:
    hung = timed[stop].run_timed_out
    raise WorkloadStopped(rows, tuned_all, f"{w.name}: {stop} "
                          + ("hung in its timed runs" if hung else "lost the device"), hung=hung)
  return rows, tuned_all


def dispatch_calibration(smoke: bool, leave_out: frozenset[str] = frozenset()
                         ) -> list[dict[str, Any]]:
  """Small calls timed in batches and in a loop, beside the dispatch floor.

  The numbers that set `MeasureOptions.host_bound_factor` for this device: a call whose
  batched time is near its looped time is device-bound; one whose batched time stays
  near the floor while its looped time is far below it is host-bound.

  Args:
    smoke: use interpret mode for the Pallas kernel (CPU).
    leave_out: implementations not to run (`--leave-out`).

  Returns:
    One dict per call: name, floor_us, batched_us, looped_us, and profiled_us (the
    device's busy time per call in a profiled batch: what both should approach), None
    where it failed.
  """
  opts = measure.MeasureOptions(rounds=5, leader_rounds=0, max_total_s=0.5, timeout_s=20.0)
  dtype = jnp.float32 if smoke else jnp.bfloat16
  x = jax.random.normal(jax.random.key(4), (64, 1024), jnp.float32).astype(dtype)
  a = jax.random.normal(jax.random.key(5), (256, 256), jnp.float32).astype(dtype)
  # Not in interpret mode: a loop of interpreted grid steps takes seconds a call.
  norm = [] if smoke else [(n, op) for n, op in _impls("layer_norm", smoke, leave_out)
                           if "triton" in n][:1]
  calls = {"rms_norm (64, 1024) xla": (lambda x: stellarax.rms_norm(x, None, implementation="xla"), (x,)),
           "matmul 256^3 (cuBLAS on a GPU)": (lambda a: a @ a, (a,))}
  for name, op in norm:
    calls[f"rms_norm (64, 1024) {name}"] = (lambda x, op=op: stellarax.rms_norm(x, None, implementation=op), (x,))
  out = []
  for name, (fn, args) in calls.items():
    row = {"name": name, "floor_us": None, "batched_us": None, "looped_us": None,
           "profiled_us": None}
    try:
      row["floor_us"] = measure.dispatch_floor_s(args, opts) * 1e6
      # Both ways explicitly, whatever the measure would decide for this call.
      batched = dataclasses.replace(opts, loop_calls=0, profile=True)
      for column, program, calls in (("batched_us", fn, 1),
                                     ("looped_us", measure.looped(fn, opts.loop_calls), opts.loop_calls)):
        m = measure.measure_candidates({name: program}, args, options=batched)[name]
        row[column] = m.median_s * 1e6 / calls if m.ok else None
        if column == "batched_us" and m.profiled_s is not None:
          row["profiled_us"] = m.profiled_s * 1e6
    except Exception as e:  # calibration is information; the table matters more
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    out.append(row)
  return out


def batch_size_check(smoke: bool) -> dict[str, Any]:
  """Where a long call's batched median loses time: per call, n back-to-back calls of
  one matmul (about 1.4 ms on an H200) with one sync, for n = 1 to 16, and n = 1 timed
  on a new thread each time (as measure_candidates ran its batches until 2026-12-05),
  beside `measure_candidates` with batches of at least 1 ms (the default, one call a
  batch here) and of at least 20 ms, and the profiler's device time.

  On the H200 (2026-12-04) the batched medians of calls of 0.25 ms or more were 1.2 to
  2.4 times the profiled time, cuBLAS's too. Times the calls a batch, the excess was
  about the same, 0.35 to 0.8 ms, for calls of 0.25 to 1.6 ms (one to three a batch):
  a cost per batch, which falls as n grows (a cost per call, allocation or clocks,
  would not), and which a thread's first call may be part of.

  Returns:
    {"name", "per_call_ms": {n: ms}, "new_thread_ms", "timeline" (`batch_timeline`),
    "min_batch_1ms_ms", "min_batch_20ms_ms" (paired samples off the CPU), "single_1ms_ms"
    (single batches, as before 2026-12-07), "profiled_ms"}; "error" instead of what
    failed.
  """
  size = 256 if smoke else 8192
  dtype = jnp.float32 if smoke else jnp.bfloat16
  a = jax.random.normal(jax.random.key(6), (size, size), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.key(7), (size, size), jnp.float32).astype(dtype)
  matmul = jax.jit(lambda a, b: a @ b)
  row: dict[str, Any] = {"name": f"matmul {size}^3 {jnp.dtype(dtype).name}", "per_call_ms": {}}
  try:
    jax.block_until_ready(matmul(a, b))
    for n in (1, 2, 4, 8, 16):
      samples = []
      for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready([matmul(a, b) for _ in range(n)])
        samples.append((time.perf_counter() - start) / n)
      row["per_call_ms"][n] = float(np.median(samples)) * 1e3
    row["new_thread_ms"] = _one_call_from_new_threads_ms(matmul, a, b)
    row["timeline"] = batch_timeline(a, b)
    # Paired samples (the default off the CPU since 2026-12-07) and single batches, as
    # measured before: whether pairing takes the H200's cost per batch off, as on a TPU.
    for key, min_batch_s, paired in (("min_batch_1ms_ms", 1e-3, None),
                                     ("min_batch_20ms_ms", 2e-2, None),
                                     ("single_1ms_ms", 1e-3, False)):
      opts = measure.MeasureOptions(rounds=5, leader_rounds=0, max_total_s=2.0, timeout_s=20.0,
                                    min_batch_s=min_batch_s, loop_calls=0, profile=True,
                                    paired_batches=paired)
      m = measure.measure_candidates({"matmul": lambda a, b: a @ b}, (a, b), options=opts)["matmul"]
      row[key] = m.median_s * 1e3 if m.ok else None
      if m.profiled_s is not None:
        row["profiled_ms"] = m.profiled_s * 1e3
  except Exception as e:  # information, like the dispatch calibration
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return row


def batch_timeline(a, b, *, batches: int = 3, calls: int = 2) -> list[dict[str, float]]:
  """Where a batch's time goes, by the profiler's clock: `batches` batches of `calls`
  back-to-back calls of `a @ b` with one sync each, as `measure_candidates` times them,
  profiled. Each batch (a `TraceAnnotation` on the host, around the calls and the sync)
  is split into lead (its start to its first kernel: dispatch and launch), busy (kernels
  of the program running), gaps (idle between its first and last kernel) and tail (the
  last kernel's end to the sync's return). The program's kernels are the events of its
  module, on the GPU's planes, or on XLA:CPU's threads on a CPU.

  Returns:
    One {"calls", "total_us", "lead_us", "busy_us", "gap_us", "tail_us", "kernels"} a
    batch, in order; a batch in which no kernel of the program was seen has only "calls"
    and "total_us".

  Raises:
    RuntimeError: when another profiler trace is running.
  """
  def stellarax_batch_probe(a, b):
    return a @ b

  probe = jax.jit(stellarax_batch_probe)
  jax.block_until_ready(probe(a, b))
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for i in range(batches):
        with jax.profiler.TraceAnnotation(f"stellarax_batch_{i}"):
          jax.block_until_ready([probe(a, b) for _ in range(calls)])
    spans, kernels = _annotations_and_kernels(folder, "jit_stellarax_batch_probe")
  out = []
  for i in range(batches):
    start, end = spans[f"stellarax_batch_{i}"]
    inside = sorted(k for k in kernels if start <= k[0] <= end)
    row = {"calls": calls, "total_us": (end - start) / 1e3}
    if inside:
      first, last = inside[0][0], max(e for _, e in inside)
      busy = profile.union_length(inside)
      row.update(lead_us=(first - start) / 1e3, busy_us=busy / 1e3,
                 gap_us=(last - first - busy) / 1e3, tail_us=(end - last) / 1e3,
                 kernels=len(inside))
    out.append(row)
  return out


def _annotations_and_kernels(folder: str, module: str
                             ) -> tuple[dict[str, tuple[int, int]], list[tuple[int, int]]]:
  """From the one profile under `folder`: {annotation name: (start, end)} of the host's
  `stellarax_batch_*` annotations, and the (start, end) of every event of the program
  `module` (its `hlo_module` stat), in nanoseconds of the profile's clock."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel

  [path] = Path(folder).rglob("*.xplane.pb")
  spans, kernels = {}, []
  with warnings.catch_warnings():  # jax 0.11's event stats type warns when iterated
    warnings.simplefilter("ignore", DeprecationWarning)
    for plane in ProfileData.from_file(str(path)).planes:
      for line in plane.lines:
        for event in line.events:
          span = (event.start_ns, event.start_ns + event.duration_ns)
          if event.name.startswith("stellarax_batch_"):
            spans[event.name] = span
          elif dict(event.stats).get("hlo_module") == module:
            kernels.append(span)
  return spans, kernels


def _one_call_from_new_threads_ms(fn, *args, samples: int = 5) -> float:
  """Median ms of one call and its sync, each timed on a thread of its own (timing starts
  in the thread), as measure_candidates ran batches until 2026-12-05: beside n=1 of the
  same thread, what a thread's first call adds to a batch."""
  times: list[float] = []

  def one():
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)

  for _ in range(samples):
    thread = threading.Thread(target=one)
    thread.start()
    thread.join()
  return float(np.median(times)) * 1e3


def batch_size_lines(check: dict[str, Any]) -> list[str]:
  """`batch_size_check` as text lines."""
  ms = lambda v: "-" if v is None else f"{v:.3f} ms"
  per_call = ", ".join(f"n={n}: {ms(v)}" for n, v in check.get("per_call_ms", {}).items())
  us = lambda row, key: f"{row[key]:.0f}" if key in row else "-"
  timeline = [f"  batch of {r['calls']} calls, profiled: {us(r, 'total_us')} us = lead {us(r, 'lead_us')}"
              f" + busy {us(r, 'busy_us')} + gaps {us(r, 'gap_us')} + tail {us(r, 'tail_us')}"
              for r in check.get("timeline", ())]
  return [f"{check['name']}: per call with n calls a sync: {per_call or '-'};"
          f" n=1 from a new thread: {ms(check.get('new_thread_ms'))}", *timeline,
          f"  measure_candidates, batches >= 1 ms: {ms(check.get('min_batch_1ms_ms'))}, >= 20 ms: "
          f"{ms(check.get('min_batch_20ms_ms'))}, single batches >= 1 ms (not paired): "
          f"{ms(check.get('single_1ms_ms'))}; profiled {ms(check.get('profiled_ms'))}"
          + (f" ({check['error']})" if "error" in check else "")]


def dispatch_lines(calibration: list[dict[str, Any]]) -> list[str]:
  """The calibration as text lines, one per call."""
  us = lambda v: "-" if v is None else f"{v:.2f} us"
  return [f"{r['name']}: floor {us(r['floor_us'])}, batched {us(r['batched_us'])},"
          f" looped {us(r['looped_us'])}, profiled {us(r.get('profiled_us'))}"
          + (f" ({r['error']})" if "error" in r else "")
          for r in calibration]


def _write(out: Path, rows: list[Row], tuned_all, dispatch=None, batching=None) -> None:
  out.mkdir(parents=True, exist_ok=True)
  if tuned_all is not None:
    tuned_all.dump(out / "tuned.json")
  env = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "stellarax": stellarax.__version__,
         "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv}
  data = {"env": env, "rows": [dataclasses.asdict(r) for r in rows]}
  if dispatch is not None:
    data["dispatch"] = dispatch
  if batching is not None:
    data["batching"] = batching
  # Whole or not at all: the hard limit's exit (or the device tool's kill) may come at
  # any moment, and land reads this file.
  file_format.atomic_write(out / "results.json", json.dumps(data, indent=1))


def record_profile(out: Path, smoke: bool) -> list[Any]:
  """Profiles a few steps of a small model (ragged_dot, attention, rms_norm,
  forward and gradient) into `out`, and returns what `read_op_calls` finds
  there. Small shapes keep the profile small enough to keep as test data."""
  from stellarax.autotuning.profile import read_op_calls
  dtype = jnp.float32 if smoke else jnp.bfloat16
  lhs, rhs, sizes = _ragged_inputs(4, 256, 64, 128, dtype)
  x = _attention_inputs(1, 128, 2, 64, dtype)[0]

  def loss(lhs, rhs, x):
    y = stellarax.rms_norm(stellarax.ragged_dot(lhs, rhs, sizes), None)
    a = stellarax.dot_product_attention(x, x, x, is_causal=True)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))) + jnp.sum(jnp.sin(a.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  jax.block_until_ready(step(lhs, rhs, x))  # compile outside the profile
  out.mkdir(parents=True, exist_ok=True)
  with jax.profiler.trace(str(out)):
    for _ in range(3):
      jax.block_until_ready(step(lhs, rhs, x))
  # The device tool brings back files at most two folders below its $OUT: the trace
  # moves up from <out>/plugins/profile/<run>/ to <out>/ (land_gpu_check finds it
  # there), before it is read, so that a trace the reader fails on comes back too.
  for trace in list(out.rglob("*.xplane.pb")):
    if trace.parent != out:
      trace.replace(out / trace.name)
  calls = read_op_calls(out)
  for call in calls:
    name = json.loads(call.marker).get("op", {}).get("name", call.marker[:60])
    print(f"profile: {name} x{call.count} {call.device_time_s * 1e6:.1f} us", flush=True)
  return calls


def _with_result(result, fn):
  def run(*a):
    with result:
      return fn(*a)
  return run


def table_lines(rows: list[Row]) -> list[str]:
  """The rows as a plain-text table with aligned columns, header first."""
  header = ("workload", "implementation", "ms", "profiled ms", "rate", "max rel err", "status")
  ms = lambda v: f"{v:.3f}" if v else "-"
  table = [header] + [(r.workload, r.impl, ms(r.median_ms), ms(r.profiled_ms), r.rate,
                       f"{r.max_rel_err:.1e}" if r.max_rel_err is not None else "-",
                       "; ".join(filter(None, (r.status, r.note)))[:60]) for r in rows]
  widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
  return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]


def print_table(rows: list[Row]) -> None:
  print("\n".join(table_lines(rows)))


def _best(rows: list[Row], workload: str, impl_part: str) -> Row | None:
  """The fastest correct row, by device time, of the workload named `workload` (exactly:
  "... fwd" is a prefix of "... fwd+bwd") whose implementation contains `impl_part`."""
  ok = [r for r in rows if r.workload == workload and impl_part in r.impl and r.median_ms
        and r.status == "ok"]
  return min(ok, key=_device_ms, default=None)


# A row's median this far from its profiled device time, either way, is listed by
# `profile_lines`: the batches timed something besides the device's work (or the
# profiler's events missed some of it).
_PROFILE_GAP = 1.2


def profile_lines(rows: list[Row]) -> list[str]:
  """The timed rows whose median and profiled device time disagree beyond _PROFILE_GAP,
  one line each with the ratio, then a count of the rows that agree and of those
  without a profiled time."""
  both = [r for r in rows if r.median_ms and r.profiled_ms]
  far = [r for r in both if not 1 / _PROFILE_GAP <= r.median_ms / r.profiled_ms <= _PROFILE_GAP]
  lines = [f"{r.workload} | {r.impl}: median {r.median_ms:.3f} ms is"
           f" {r.median_ms / r.profiled_ms:.2f}x the profiled {r.profiled_ms:.3f} ms"
           f" ({r.method})" for r in far]
  without = sum(1 for r in rows if r.median_ms and not r.profiled_ms)
  lines.append(f"{len(both) - len(far)} of {len(both)} profiled rows within {_PROFILE_GAP:g}x"
               f" of their profiled device time; {without} timed rows without one")
  return lines


def _device_ms(row: Row) -> float:
  """A row's device time: the profiler's where it has one, else its median. On the H200
  the medians of batched calls of 0.25 ms or more were 1.2-2.4x the profiled time,
  cuBLAS's and cuDNN's too (BENCHMARKS.md, 2026-12-04); the issue's targets are device
  time."""
  return row.profiled_ms or row.median_ms


def target_lines(rows: list[Row]) -> list[str]:
  """The speed targets of the GPU-kernels issue, each met, missed or not measured, by
  device time (`_device_ms`), each line also giving the batched medians' verdict."""

  def verdict(name, ours, base, describe):
    if ours is None or base is None:
      return f"{name}: not measured"
    met, text = describe(ours, base, _device_ms)
    by_median = describe(ours, base, lambda r: r.median_ms)
    how = "by profiled device time" if ours.profiled_ms else "by median"
    return (f"{name}: {'MET' if met else 'missed'} ({text}, {how}; by batched medians "
            f"{'met' if by_median[0] else 'missed'}: {by_median[1]}; ours: {ours.impl})")

  def ratio(limit):
    def describe(ours, base, ms):
      return (ms(ours) <= limit * ms(base),
              f"{ms(ours):.3f} ms vs {base.impl} {ms(base):.3f} ms, goal <= {limit:g}x")
    return describe

  def rate(row, ms):  # the rate column is from the median
    return float(row.rate.split()[0]) * row.median_ms / ms(row)

  def tflops(ours, base, ms):
    del base
    value = rate(ours, ms)
    return value >= 600, f"{value:.0f} TFLOP/s, goal >= 600"

  def bandwidth(ours, copy, ms):
    value, limit = rate(ours, ms), 0.85 * rate(copy, ms)
    return value >= limit, f"{value:.2f} TB/s vs 85% of copy {limit:.2f} TB/s"

  ragged8, ragged64 = "ragged_dot G=8 M=8192 K=4096 N=14336 fwd", "ragged_dot G=64 M=16384 K=2048 N=1536 fwd"
  attention = "attention B=2 T=8192 H=16 D=128 causal"
  norm = "rms_norm (8192, 8192)"
  return [
      verdict("ragged_dot G=8 forward", _best(rows, ragged8, "pallas"), _best(rows, ragged8, ""), tflops),
      verdict("ragged_dot G=64 forward vs XLA", _best(rows, ragged64, "pallas"),
              _best(rows, ragged64, "jax.lax.ragged_dot"), ratio(1.0)),
      verdict("attention forward vs cuDNN", _best(rows, f"{attention} fwd", "pallas"),
              _best(rows, f"{attention} fwd", "cuDNN"), ratio(1.0)),
      verdict("attention fwd+bwd vs cuDNN", _best(rows, f"{attention} fwd+bwd", "pallas"),
              _best(rows, f"{attention} fwd+bwd", "cuDNN"), ratio(1.2)),
      verdict("rms_norm forward bandwidth", _best(rows, f"{norm} fwd", "pallas"),
              _best(rows, f"{norm} fwd", "copy"), bandwidth),
      # Forward and backward as a training step runs them (`_forward_and_vjp`): x -> y,
      # then x, dy -> dx (and the scale's small partial sums), against the same copy.
      verdict("rms_norm fwd+bwd bandwidth", _best(rows, f"{norm} fwd+bwd", "pallas"),
              _best(rows, f"{norm} fwd", "copy"), bandwidth),
  ]


def code_path_lines(result) -> list[str]:
  """Per tuned op call: the heuristic's time, each measured code-path variant's (one
  config per value of a bool or str tunable that the heuristic does not take, see
  `search.code_path_variants`) and the best: what says whether a heuristic should take
  the other code path (e.g. attention's fused dQ)."""
  from stellarax.autotuning import search

  def timing(entry, config):
    """The config's time, or why it has none (e.g. wrong_result: a kernel bug)."""
    statuses = [m.status for c, m in entry.measurements if c == config]
    t = entry.time_of(config)
    return f"{t * 1e3:.3f} ms" if t is not None else (statuses[-1] if statuses else "-")

  lines = []
  for entry in result:
    h = entry.heuristic_config
    measured = [c for c, _ in entry.measurements]
    parts = [f"heuristic {timing(entry, h)}"]
    for variant in search.code_path_variants(h, measured):
      parts.append(f"{_flipped(h, variant)}: {timing(entry, variant)}")
    parts.append(f"best {timing(entry, entry.best_config)}")
    lines.append(f"{_call_name(entry)}: " + "; ".join(parts))
  return lines


def faster_code_paths(result) -> list[str]:
  """The code-path variants (as in `code_path_lines`) that ran faster than their op
  call's heuristic beyond both confidence intervals: where a heuristic should
  perhaps take the other code path. One line each, with the ratio of medians."""
  from stellarax.autotuning import search
  lines = []
  for entry in result:
    h = entry.heuristic_config
    timed = {c: m for c, m in entry.measurements if m.status == "ok"}  # the last one counts
    base = timed.get(h)
    if base is None:
      continue
    for variant in search.code_path_variants(h, [c for c, _ in entry.measurements]):
      m = timed.get(variant)
      if m is not None and m.ci_high_s < base.ci_low_s:
        lines.append(f"{_call_name(entry)}: {_flipped(h, variant)} takes "
                     f"{m.median_s / base.median_s:.2f}x the heuristic's time")
  return lines


def _flipped(heuristic, variant) -> str:
  """The tunables in which `variant` differs from `heuristic`, as name=value (a
  dataclass's or named tuple's fields, a plain tuple's positions; tuples of two classes
  by positions: `search._shared_tunables`)."""
  from stellarax.autotuning import search
  names = search._shared_tunables([heuristic, variant])
  return ", ".join(f"{name}={search._value(variant, name)}" for name in names
                   if search._value(variant, name) != search._value(heuristic, name))


def _call_name(entry) -> str:
  """An op call as its op name and argument shapes."""
  shapes = " ".join(str(tuple(a.shape)) for a in entry.bound_args.array_specs())
  return f"{entry.bound_args.op.name} {shapes}"


def _stop_after(limit_s: float) -> None:
  """Ends the process `limit_s` seconds after it started, whatever runs then: a kernel
  that never ran on a GPU may hang in its check run (only tuning measures in workers
  with timeouts), and the device's whole call would wait for it. results.json holds
  every workload finished by then; the tuning workers are shut first."""
  stop = lambda: _leave_now(124, f"\ngpu_check: past --hard-limit-s {limit_s:.0f} s (a kernel "
                             "may hang): stopping; results.json holds the workloads that finished")
  timer = threading.Timer(max(0.0, limit_s - (time.monotonic() - _STARTED)), stop)
  timer.daemon = True
  timer.start()


def _leave_now(status: int, why: str) -> None:
  """Ends the process with `status` at once, saying `why`, its tuning workers shut: a
  kernel may still run on the device, and a normal exit (JAX's teardown) would wait for
  it until the device call's own limit."""
  print(why, flush=True)
  from stellarax.autotuning import isolation
  isolation.close_workers(at_once=True)  # a busy one was given 10 s of the limit's time
  sys.stderr.flush()
  os._exit(status)


def _implementations(text: str) -> frozenset[str]:
  """The registered implementations a comma-separated `text` names; exits (status 2)
  naming those that are not, before anything runs on the device."""
  from stellarax.core import registry
  names = frozenset(s.strip() for s in text.split(",") if s.strip())
  unknown = sorted(n for n in names if n not in registry.names(n.partition(".")[0]))
  if unknown:
    print(f"gpu_check: error: --leave-out names no implementation: {', '.join(unknown)}; name "
          "registered ones, e.g. attention.pallas_mosaic_gpu", file=sys.stderr)
    raise SystemExit(2)
  backward = sorted(n for n in names if n.endswith("_vjp"))
  if backward:
    print(f"gpu_check: error: --leave-out names backward ops: {', '.join(backward)}; name the "
          "forward implementation (its backward is left out with it)", file=sys.stderr)
    raise SystemExit(2)
  return names


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="results folder")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes; Pallas in interpret mode (CPU)")
  parser.add_argument("--tune-budget-s", type=float, default=20.0, help="tuning budget per op call; 0 = no tuning")
  parser.add_argument("--deadline-s", type=float, default=540.0,
                      help="stop tuning after this many seconds, and skip what is left a minute later")
  parser.add_argument("--skip-after-s", type=float, default=None,
                      help="skip the workloads left after this many seconds (default: the deadline plus a minute)")
  parser.add_argument("--no-dispatch", action="store_true",
                      help="skip timing small calls against the dispatch floor")
  parser.add_argument("--no-profile", action="store_true", help="skip profiling the small model first")
  parser.add_argument("--only", default="",
                      help="comma-separated parts of workload names to run, or =name for one (default: all)")
  parser.add_argument("--leave-out", default="",
                      help="comma-separated implementations not to run, e.g. "
                           "attention.pallas_mosaic_gpu (one that hung in an earlier call)")
  parser.add_argument("--hard-limit-s", type=float, default=None,
                      help="exit (status 124) after this many seconds whatever runs, e.g. a hung kernel")
  args = parser.parse_args(argv)
  args.leave_out = _implementations(args.leave_out)
  names = [w.name for w in _workloads(args.smoke)]
  if unmatched := [s for s in _only_parts(args.only) if not any(_selects(n, s) for n in names)]:
    # A typo would run nothing of that part, on the GPU's scarce time, and exit 0.
    print(f"gpu_check: error: --only {', '.join(map(repr, unmatched))} names no workload; "
          "the workloads are:\n  " + "\n  ".join(names), file=sys.stderr)
    return 2
  if args.hard_limit_s is not None:
    _stop_after(args.hard_limit_s)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  if not args.no_profile and args.leave_out:
    # The small model runs each op's default implementation, whatever is left out.
    print("profile: skipped: --leave-out is given, and the small model's profile runs the "
          "default implementations", flush=True)
  elif not args.no_profile:
    try:
      record_profile(Path(args.out) / "profile", args.smoke)
    except Exception as e:  # the timings below matter more than the profile
      print(f"profile: failed: {type(e).__name__}: {e}", flush=True)
  rows = run(args)
  print("\n== all workloads ==")
  print_table(rows)
  print("\n== timing vs the profiler's device time ==")
  print("\n".join(profile_lines(rows)))
  tuned = Path(args.out) / "tuned.json"
  if tuned.exists():
    print("\n== code paths (tuning measurements of one op call) ==")
    result = stellarax.AutotuningResult.load(tuned)
    for line in code_path_lines(result):
      print(line)
    print("\n== code paths faster than the heuristic (beyond both confidence intervals) ==")
    print("\n".join(faster_code_paths(result)) or "none")
  print("\n== targets ==")
  for line in target_lines(rows):
    print(line)
  return 0


if __name__ == "__main__":
  status = main()
  if HUNG:  # the results are written; a kernel still runs on the device
    _leave_now(status, f"gpu_check: leaving with a kernel still running ({HUNG[0]})")
  sys.exit(status)
