"""Tests for reading stellarax op calls from XProf profiles (`read_op_calls`)."""

import collections
import functools
import gzip
import json
import os
import pathlib
import re

import jax
from jax import lax
from jax.experimental.xla_metadata import xla_metadata_call2
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.profile import OpCall
from stellarax.autotuning.profile import ProfileError
from stellarax.autotuning.profile import read_op_calls
from stellarax.autotuning.profile import union_length
from stellarax.autotuning.profile import _Instruction
from stellarax.autotuning.profile import _custom_call_kernels
from stellarax.autotuning.profile import _kernel_names
from stellarax.autotuning.profile import _without_repeats
from stellarax.core.markers import markers_in_op_name
from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig
from profiling import drop_live_programs  # tests/ is on sys.path

MATMUL = '{"op":"matmul"}'
TANH = '{"op":"tanh"}'
TANH_VJP = '{"op":"tanh_vjp"}'
SCANNED = '{"op":"scanned"}'
STEPPED = '{"op":"stepped"}'
UNROLLED = '{"op":"unrolled"}'
RUNS = 3  # executions of each program inside the trace
TRIPS = 5  # trips of the scan around the scanned op
CALLS = 3  # calls of the unrolled op from one line in a Python loop


def _profiled_runs(path, program, *args):
  """The op calls of RUNS runs of `program(*args)` profiled into `path`, after one run
  outside the profile (so that it holds no compilation)."""
  jax.block_until_ready(program(*args))
  with jax.profiler.trace(path):
    for _ in range(RUNS):
      jax.block_until_ready(program(*args))
  return read_op_calls(path)


def _marked(fn, marker):
  # As the ops mark themselves: the backward pass is left to its own (VJP) op.
  return xla_metadata_call2(fn, {"stellarax_op": marker}, ad_metadata="drop")


matmul = _marked(lambda x, w: x @ w, MATMUL)


@jax.custom_vjp
def tanh(x):
  return _marked(jnp.tanh, TANH)(x)


def _tanh_fwd(x):
  y = tanh(x)
  return y, y


def _tanh_bwd(y, g):
  return (_marked(lambda y, g: g * (1.0 - y * y), TANH_VJP)(y, g),)


tanh.defvjp(_tanh_fwd, _tanh_bwd)


def loss(w, x):
  # Each op is called twice; the tanh between the matmuls keeps them two calls.
  h = tanh(matmul(x, w))
  h = tanh(matmul(h, w))
  return jnp.sum(h * h)


def loop_op(x, n):
  # An op built on a loop: XLA:CPU keeps its marker only on the loop's result.
  return lax.fori_loop(0, n, lambda i, v: jnp.tanh(v) @ v, x)


def ops_in_loops(x, w, n):
  # Ops called in every trip of a caller's loops: a scan of static length, whose trip
  # count XLA knows, a loop of `n` trips, which only the events tell, and a Python
  # loop, whose calls share their stack.
  scanned, stepped = _marked(jnp.tanh, SCANNED), _marked(jnp.sin, STEPPED)
  x = lax.scan(lambda h, _: (scanned(h) * 0.5, None), x, None, length=TRIPS)[0]
  x = lax.fori_loop(0, n, lambda i, h: stepped(h) * 0.5, x)
  unrolled = _marked(lambda h, w: h @ w, UNROLLED)
  for _ in range(CALLS):
    x = jnp.sin(unrolled(x, w))
  return x


def _loop_marker(size):
  return f'{{"op":"loop","size":{size}}}'


def _loop_program(size):
  # The sizes' programs share a module name, which only program_ids tell apart; named
  # for this process, so that none is loaded from the tests' persistent compilation
  # cache (conftest.py) with the id another process gave it.
  marked = _marked(loop_op, _loop_marker(size))
  def program(x, n):
    return marked(x, n)
  program.__name__ = program.__qualname__ = f"loop_op_{os.getpid()}"
  return jax.jit(program)


def _entry_instructions(hlo_text):
  """Name -> text of each instruction of a compiled program's entry computation."""
  entry = hlo_text[hlo_text.index("\nENTRY "):].split("\n}")[0]
  matches = (re.match(r"\s*(?:ROOT )?%?(\S+) = ", line) for line in entry.splitlines())
  return {m[1]: m.string for m in matches if m}


def _marked_names(hlo_text, marker):
  """Names of the entry instructions whose own attribute is `marker`."""
  return sorted(
      name for name, line in _entry_instructions(hlo_text).items()
      if f"stellarax_op={marker}" in line)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
  """A CPU trace of the forward and backward pass, of a loop op at two sizes and of
  ops in loops."""
  drop_live_programs()
  keys = jax.random.split(jax.random.key(0), 2)
  w = jax.random.normal(keys[0], (40, 40)) / 8
  x = jax.random.normal(keys[1], (24, 40))
  step = jax.jit(jax.grad(loss)).lower(w, x).compile()
  loops = {size: _loop_program(size) for size in (16, 24)}
  inputs = {size: jnp.eye(size) / 2 for size in loops}
  trips = jnp.int32(3)
  in_loops = jax.jit(ops_in_loops)
  # Run once before tracing, so that the trace holds no compilation.
  step(w, x).block_until_ready()
  in_loops(x, w, trips).block_until_ready()
  for size, program in loops.items():
    program(inputs[size], trips).block_until_ready()
  trace_dir = tmp_path_factory.mktemp("trace")
  with jax.profiler.trace(trace_dir):
    for _ in range(RUNS):
      step(w, x).block_until_ready()
      in_loops(x, w, trips).block_until_ready()
      for size, program in loops.items():
        program(inputs[size], trips).block_until_ready()
  (file,) = trace_dir.rglob("*.xplane.pb")
  return trace_dir, file, step.as_text()


@pytest.fixture(scope="module")
def unmarked_profile(tmp_path_factory):
  """A CPU trace of a program without stellarax ops."""

  def plain(x):
    return jnp.sin(x) @ x

  drop_live_programs()
  program = jax.jit(plain)
  x = jax.random.normal(jax.random.key(1), (8, 8))
  program(x).block_until_ready()
  trace_dir = tmp_path_factory.mktemp("plain")
  with jax.profiler.trace(trace_dir):
    program(x).block_until_ready()
  (file,) = trace_dir.rglob("*.xplane.pb")
  return file


@functools.cache
def _ops_in_loops_hlo() -> str:
  """The compiled HLO of `ops_in_loops` at the traced fixture's shapes."""
  args = jnp.ones((24, 40)), jnp.ones((40, 40)), jnp.int32(3)
  return jax.jit(ops_in_loops).lower(*args).compile().as_text()


def test_counts_every_call_forward_and_backward(traced):
  trace_dir, _, _ = traced
  calls = read_op_calls(trace_dir)
  counts = {call.marker: call.count for call in calls}
  # jax 0.12's XLA:CPU compiles small while loops into one call each ("small call"),
  # whose bodies give no events: a loop's trips are then known only where XLA knows them.
  one_call = "xla_cpu_small_call" in _ops_in_loops_hlo()
  assert counts == {
      MATMUL: 2 * RUNS,
      TANH: 2 * RUNS,
      TANH_VJP: 2 * RUNS,
      _loop_marker(16): RUNS,
      _loop_marker(24): RUNS,
      SCANNED: TRIPS * RUNS,
      STEPPED: (1 if one_call else 3) * RUNS,  # 3 trips, which only body events tell
      UNROLLED: CALLS * RUNS,
  }
  assert all(call.device_time_s > 0 for call in calls)
  times = [call.device_time_s for call in calls]
  assert times == sorted(times, reverse=True)


def test_a_call_site_keeps_repeated_frames_once():
  # A custom VJP's backward pass repeats the caller's frames once per level.
  outer, call, inner = ("run.py", "<module>", 3), ("model.py", "f", 7), ("m.py", "g", 2)
  once = (outer, call, inner)
  assert _without_repeats((outer, call, call, call, inner)) == once
  assert _without_repeats((outer, call, inner, call, inner, call, inner)) == once
  assert _without_repeats((outer, call, inner, outer)) == (outer, call, inner, outer)


def test_reads_a_file_as_its_directory(traced):
  trace_dir, file, _ = traced
  assert read_op_calls(file) == read_op_calls(str(trace_dir))


def test_reads_every_host_of_the_newest_trace(traced, unmarked_profile, tmp_path):
  _, file, _ = traced
  old = tmp_path / "plugins" / "profile" / "old" / "host.xplane.pb"
  old.parent.mkdir(parents=True)
  old.write_bytes(unmarked_profile.read_bytes())
  os.utime(old, (1, 1))
  for host in ("host0", "host1"):
    new = tmp_path / "plugins" / "profile" / "new" / f"{host}.xplane.pb"
    new.parent.mkdir(parents=True, exist_ok=True)
    new.write_bytes(file.read_bytes())
  single = {c.marker: c for c in read_op_calls(file)}
  both = read_op_calls(tmp_path)
  assert {c.marker for c in both} == set(single)
  for call in both:
    assert call.count == 2 * single[call.marker].count
    assert call.device_time_s == pytest.approx(2 * single[call.marker].device_time_s)


def _gpu_plane(events, run_ids=None):
  """A serialized XSpace with one GPU plane, events as XLA:GPU records them.

  Args:
    events: (kernel name, hlo_op or None, hlo_module, duration in ps) per event. Like
      XLA:GPU events whose module id is unknown, they carry no program_id.
    run_ids: the run_id stat of each event, or None for events without one.

  Returns:
    The bytes; appended to a profile's bytes they add the plane to it.
  """
  names = sorted({kernel for kernel, _, _, _ in events})
  lines, offset = [], 0
  for i, (kernel, hlo_op, module, duration) in enumerate(events):
    stats = f'stats {{ metadata_id: 3 str_value: "grid:132,1,1 block:128,1,1" }}'
    if hlo_op is not None:
      stats += (f' stats {{ metadata_id: 1 str_value: "{hlo_op}" }}'
                f' stats {{ metadata_id: 2 str_value: "{module}" }}')
    if run_ids is not None:
      stats += f' stats {{ metadata_id: 4 int64_value: {run_ids[i]} }}'
    lines.append(f"events {{ metadata_id: {names.index(kernel) + 1} "
                 f"offset_ps: {offset} duration_ps: {duration} {stats} }}")
    offset += duration + 1000
  line = f'lines {{ id: 1 name: "Stream #13(compute)" timestamp_ns: 1000 {" ".join(lines)} }}'
  return _gpu_xspace([line], names, ["hlo_op", "hlo_module", "kernel_details", "run_id"])


def _gpu_xspace(lines, kernels, stats):
  """A serialized XSpace of one GPU plane: the `lines` texts, events naming `kernels`
  (metadata ids 1, 2, ... in order) and stats named `stats` (ids 1, 2, ... in order)."""
  metadata = " ".join(
      f'event_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{name}" }} }}'
      for i, name in enumerate(kernels))
  metadata += " " + " ".join(
      f'stat_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{name}" }} }}'
      for i, name in enumerate(stats))
  text = f'planes {{ id: 1000 name: "/device:GPU:0" {" ".join(lines)} {metadata} }}'
  return jax.profiler.ProfileData.text_proto_to_serialized_xspace(text)


def test_gpu_planes_hold_the_device_time(traced, tmp_path):
  _, file, hlo_text = traced
  matmuls = _marked_names(hlo_text, MATMUL)
  assert len(matmuls) == 2, hlo_text
  unmarked = next(
      name for name, line in _entry_instructions(hlo_text).items()
      if "stellarax_op" not in line and " parameter(" not in line)
  # Each matmul launches two kernels per run, beside a copy and unmarked kernels.
  events = []
  for run in range(2):
    for i, name in enumerate(matmuls):
      events += [("gemm_main", name, "jit_loss", 7_000_000 + 10_000 * i + 1000 * run),
                 ("gemm_split_k_reduce", name, "jit_loss", 2_000_000)]
    events += [("MemcpyD2D", None, None, 500_000),
               ("loop_fusion", unmarked, "jit_loss", 3_000_000),
               ("other_kernel", "no_such_instruction", "jit_loss", 3_000_000)]
  gpu_profile = tmp_path / "gpu.xplane.pb"
  gpu_profile.write_bytes(file.read_bytes() + _gpu_plane(events))
  expected_s = sum(d for _, op, _, d in events if op in matmuls) * 1e-12
  calls = read_op_calls(gpu_profile)
  # Without run_id, the program ran as often as its rarest kernel: twice. Every op of
  # a program that ran is reported; the tanh ops, with no kernel on the GPU plane, get
  # no device time, since the host's thunk events, which time them too, are not.
  assert [(c.marker, c.count) for c in calls] == [(MATMUL, 4), (TANH, 4), (TANH_VJP, 4)]
  assert calls[0].device_time_s == pytest.approx(expected_s, rel=1e-9)
  assert [c.device_time_s for c in calls[1:]] == [0.0, 0.0]


def test_a_loop_with_no_events_inside_gives_its_time_to_its_body(traced, tmp_path):
  # jax 0.12's XLA:CPU runs a small loop as one call thunk, whose body gives no events.
  _, file, _ = traced
  text = _ops_in_loops_hlo()
  loops = [name for name, line in _entry_instructions(text).items()
           if re.search(r" (while|call)\(", line)]
  assert len(loops) == 2, text  # the scan and the fori_loop
  events = [("loop_thunk", name, "jit_ops_in_loops", 1_000_000) for name in loops]
  gpu_profile = tmp_path / "gpu.xplane.pb"
  gpu_profile.write_bytes(file.read_bytes() + _gpu_plane(events))
  calls = {call.marker: call for call in read_op_calls(gpu_profile)}
  # Each loop's microsecond goes to the op in its body; the scan's trips are known.
  assert calls[SCANNED].device_time_s == pytest.approx(1e-6, rel=1e-9)
  assert calls[STEPPED].device_time_s == pytest.approx(1e-6, rel=1e-9)
  assert (calls[SCANNED].count, calls[STEPPED].count) == (TRIPS, 1)


def test_a_branch_a_conditional_did_not_take_ran_no_times(tmp_path):
  # Runs of a branch with no events of its own were its parent's: an untaken branch's
  # op counted every run of the conditional.
  drop_live_programs()
  tanh_op = _marked(jnp.tanh, TANH)
  program = jax.jit(lambda x, w, take: lax.cond(take, lambda x: matmul(x, w), tanh_op, x))
  keys = jax.random.split(jax.random.key(7), 2)
  x, w = jax.random.normal(keys[0], (32, 32)), jax.random.normal(keys[1], (32, 32))
  for take in (True, False):
    program(x, w, take).block_until_ready()
  ran = {}
  for takes in ((False,) * RUNS, (True,) + (False,) * (RUNS - 1)):
    path = tmp_path / str(sum(takes))
    with jax.profiler.trace(path):
      for take in takes:
        program(x, w, take).block_until_ready()
    ran[sum(takes)] = {call.marker: call.count for call in read_op_calls(path)}
  assert ran == {0: {TANH: RUNS}, 1: {MATMUL: 1, TANH: RUNS - 1}}


def test_calls_of_one_line_that_xla_fuses_together_count_each(tmp_path):
  # On small arrays XLA fuses the three calls with the user's work between and
  # recomputes each call's result in the next one's fusion; a fusion's operands read
  # through the user's work counted as a step of one call from the other (1 call a run).
  drop_live_programs()
  def normed(x):
    for _ in range(CALLS):
      x = stellarax.rms_norm(x, None) * 2.0 + 1.0
    return x
  program = jax.jit(normed)
  x = jax.random.normal(jax.random.key(8), (4, 4))
  (call,) = _profiled_runs(tmp_path, program, x)
  assert call.count == CALLS * RUNS


def test_two_calls_on_one_line_are_two_call_sites(tmp_path):
  # A call site was (file, function, line): two calls on one line were one site, whose
  # calls were counted by results grouped by stack frame (one each), so 1 a run.
  drop_live_programs()
  scale = jnp.ones((16,))
  program = jax.jit(lambda x: stellarax.rms_norm(x, scale).sum() + stellarax.rms_norm(x * 2, scale).sum())
  x = jax.random.normal(jax.random.key(9), (8, 16))
  (call,) = _profiled_runs(tmp_path, program, x)
  assert call.count == 2 * RUNS


def test_run_ids_count_the_executions(traced, tmp_path):
  _, file, hlo_text = traced
  matmuls = _marked_names(hlo_text, MATMUL)
  # Each matmul launches the same kernel twice per run, so only run_id tells the runs.
  events, run_ids = [], []
  for run in range(3):
    for name in matmuls:
      events += [("gemm", name, "jit_loss", 1_000_000)] * 2
      run_ids += [700 + run] * 2
  gpu_profile = tmp_path / "gpu.xplane.pb"
  gpu_profile.write_bytes(file.read_bytes() + _gpu_plane(events, run_ids))
  calls = {call.marker: call for call in read_op_calls(gpu_profile)}
  assert {m: c.count for m, c in calls.items()} == {MATMUL: 6, TANH: 6, TANH_VJP: 6}
  assert calls[MATMUL].device_time_s == pytest.approx(12e-6, rel=1e-9)


def test_events_matching_several_programs_are_left_out(traced, tmp_path):
  _, file, hlo_text = traced
  loop_text = _loop_program(16).lower(jnp.eye(16), jnp.int32(3)).compile().as_text()
  (loop_result,) = _marked_names(loop_text, _loop_marker(16))
  matmul_name = _marked_names(hlo_text, MATMUL)[0]
  module = re.match(r"HloModule (\S+),", loop_text)[1]
  # Without a program_id, the loop's events fit both of its compilations.
  events = [("gemm", matmul_name, "jit_loss", 1_000_000),
            ("loop_kernel", loop_result, module, 1_000_000)]
  gpu_profile = tmp_path / "gpu.xplane.pb"
  gpu_profile.write_bytes(file.read_bytes() + _gpu_plane(events))
  with pytest.warns(RuntimeWarning, match="1 events were left out"):
    calls = read_op_calls(gpu_profile)
  # jit_loss ran once, with its two calls of each op; no loop program ran.
  assert [(c.marker, c.count) for c in calls] == [(MATMUL, 2), (TANH, 2), (TANH_VJP, 2)]
  assert calls[0].device_time_s == pytest.approx(1e-6, rel=1e-9)
  assert [c.device_time_s for c in calls[1:]] == [0.0, 0.0]


def test_no_stellarax_ops_names_the_programs_that_ran(unmarked_profile):
  with pytest.raises(ProfileError, match="no stellarax ops") as error:
    read_op_calls(unmarked_profile)
  assert str(unmarked_profile) in str(error.value)
  assert "jit_plain" in str(error.value)


def test_missing_path(tmp_path):
  with pytest.raises(ProfileError, match="no such file or directory"):
    read_op_calls(tmp_path / "missing.xplane.pb")


def test_directory_without_profiles(tmp_path):
  with pytest.raises(ProfileError, match=r"no \*\.xplane\.pb file"):
    read_op_calls(tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"this is a text file, not a profile\n", "not an XProf profile"),
        (np.random.default_rng(0).bytes(4096), "not an XProf profile|truncated"),
        (b"", "holds no profile planes"),
    ],
    ids=["text", "random", "empty"],
)
def test_not_a_profile(tmp_path, content, message):
  path = tmp_path / "host.xplane.pb"
  path.write_bytes(content)
  with pytest.raises(ProfileError, match=message) as error:
    read_op_calls(path)
  assert str(path) in str(error.value)


def test_truncated_profile(traced, tmp_path):
  _, file, _ = traced
  data = file.read_bytes()
  path = tmp_path / "cut.xplane.pb"
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(ProfileError, match="truncated or corrupt") as error:
    read_op_calls(path)
  assert str(path) in str(error.value)


def test_op_call_is_a_frozen_value():
  call = OpCall(MATMUL, 2, 1e-3)
  assert call == OpCall(MATMUL, 2, 1e-3)
  with pytest.raises(AttributeError):
    call.count = 3  # type: ignore[misc]


# -- ops whose frontend attribute XLA dropped everywhere --------------------------------

# XLA:CPU's expansion of lax.ragged_dot keeps no frontend attribute, so this op is
# found only by the named scope in op_name. Its VJP op, with its own (heuristic)
# config, keeps the attribute on some instructions.
LAX_RAGGED_DOT = stellarax.XlaRaggedDot(config=XlaRaggedDotConfig(strategy="lax"))
SCALES = (1.0, -0.5)  # one call per scale, from one line


def lax_loss(lhs, rhs, group_sizes):
  total = jnp.float32(0)
  for scale in SCALES:
    out = stellarax.ragged_dot(
        lhs * scale, rhs, group_sizes, implementation=LAX_RAGGED_DOT)
    total += jnp.sum(jnp.sin(out))
  return total


@pytest.fixture(scope="module")
def lax_traced(tmp_path_factory):
  """A CPU trace of the forward pass and of the gradient of `lax_loss`, with the
  compiled gradient program's text and the bound arguments of its op calls."""
  drop_live_programs()
  keys = jax.random.split(jax.random.key(2), 2)
  # Awkward sizes: rows past the last group, and an empty group.
  args = (jax.random.normal(keys[0], (37, 24)), jax.random.normal(keys[1], (3, 24, 20)),
          jnp.array([11, 0, 19], jnp.int32))
  forward = jax.jit(lax_loss).lower(*args).compile()
  step = jax.jit(jax.grad(lax_loss, argnums=(0, 1))).lower(*args).compile()
  jax.block_until_ready((forward(*args), step(*args)))
  trace_dir = tmp_path_factory.mktemp("lax")
  with jax.profiler.trace(trace_dir):
    for _ in range(RUNS):
      jax.block_until_ready((forward(*args), step(*args)))
  bound = autotuning.get_bound_args(jax.grad(lax_loss, argnums=(0, 1)), *args)
  return trace_dir, step.as_text(), {ba.op.name: ba.to_marker() for ba in bound}


def test_an_op_without_attributes_is_found_by_its_named_scope(lax_traced):
  trace_dir, step_text, markers = lax_traced
  forward, vjp = markers["ragged_dot.xla"], markers["ragged_dot.xla_vjp"]
  # What this test is about: no instruction of the forward kept its attribute.
  assert f"stellarax_op={forward}" not in step_text
  assert f"stellarax_op={vjp}" in step_text
  calls = {call.marker: call for call in read_op_calls(trace_dir)}
  # The forward runs in both programs, the VJP op in the gradient's only; each is
  # called once per scale, from one line.
  assert {m: c.count for m, c in calls.items()} == {
      forward: 2 * len(SCALES) * RUNS, vjp: len(SCALES) * RUNS}
  assert calls[forward].device_time_s > 0 and calls[vjp].device_time_s > 0


def test_markers_in_op_name():
  inner = '{"op":"a/b(c)","s":"stellarax_op={\\"x\\"}"}'
  outer = '{"op":"outer","n":[1,{"k":null}]}'
  assert markers_in_op_name(
      f"jit(f)/transpose(jvp(stellarax_op={outer}))/xla_metadata_call/"
      f"stellarax_op={inner}/dot_general") == [outer, inner]
  assert markers_in_op_name("jit(f)/jvp()/sin") == []
  # A name cut inside its JSON, and a scope that is not a JSON object, are skipped.
  assert markers_in_op_name(f"stellarax_op={outer[:-3]}/stellarax_op=3/sin") == []


# -- calls whose instructions JAX traced for other calls ----------------------------


def one_call(lhs, rhs, group_sizes):
  return jnp.sum(jnp.cos(stellarax.ragged_dot(lhs, rhs, group_sizes)))


def two_calls(lhs, rhs, group_sizes):
  # Same arguments, two lines: the second call reuses what JAX traced for the first.
  first = stellarax.ragged_dot(lhs, rhs, group_sizes)
  second = stellarax.ragged_dot(jnp.sin(lhs), rhs, group_sizes)
  return jnp.sum(first * second)


def test_counts_do_not_depend_on_what_else_was_compiled(tmp_path):
  drop_live_programs()
  keys = jax.random.split(jax.random.key(4), 2)
  # Awkward sizes: rows past the last group, and an empty group.
  args = (jax.random.normal(keys[0], (29, 24)), jax.random.normal(keys[1], (3, 24, 12)),
          jnp.array([9, 0, 17], jnp.int32))
  # Before the profiled program is traced, other programs with the very same markers
  # are compiled and run; JAX caches what it traced inside their op calls.
  for other in (one_call, jax.grad(one_call, argnums=(0, 1))):
    jax.block_until_ready(jax.jit(other)(*args))
  step = jax.jit(jax.grad(two_calls, argnums=(0, 1)))
  jax.block_until_ready(step(*args))  # so that the trace holds no compilation
  with jax.profiler.trace(tmp_path):
    for _ in range(RUNS):
      jax.block_until_ready(step(*args))
  grad = jax.grad(two_calls, argnums=(0, 1))
  markers = {ba.op.name: ba.to_marker() for ba in autotuning.get_bound_args(grad, *args)}
  calls = {call.marker: call for call in read_op_calls(tmp_path)}
  assert {m: c.count for m, c in calls.items()} == {
      markers["ragged_dot.xla"]: 2 * RUNS, markers["ragged_dot.xla_vjp"]: 2 * RUNS}
  assert all(call.device_time_s > 0 for call in calls.values())


def _streams(streams):
  """A serialized XSpace with one GPU plane of kernels on several streams.

  Args:
    streams: stream name -> (start in ns from the line's start, duration in ns,
      hlo_module, program_id or None[, hlo_op or None: default "fusion"]) per kernel.
  """
  lines = []
  for number, (stream, kernels) in enumerate(streams.items()):
    events = []
    for start, duration, module, program_id, *hlo_op in kernels:
      hlo_op = hlo_op[0] if hlo_op else "fusion"
      stats = f' stats {{ metadata_id: 2 str_value: "{module}" }}'
      if hlo_op is not None:
        stats += f' stats {{ metadata_id: 1 str_value: "{hlo_op}" }}'
      if program_id is not None:
        stats += f" stats {{ metadata_id: 3 int64_value: {program_id} }}"
      events.append(f"events {{ metadata_id: 1 offset_ps: {start * 1000}"
                    f" duration_ps: {duration * 1000} {stats} }}")
    lines.append(f'lines {{ id: {number + 1} name: "{stream}" timestamp_ns: 1000'
                 f' {" ".join(events)} }}')
  return _gpu_xspace(lines, ["kernel"], ["hlo_op", "hlo_module", "program_id"])


def test_union_length_counts_overlaps_once_in_any_order():
  assert union_length([]) == 0.0
  assert union_length([(5, 7), (0, 2), (1, 3)]) == 5  # [0, 3] and [5, 7]
  assert union_length([(0, 10), (2, 3), (4, 12)]) == 12  # nested, then reaching past
  assert union_length([(1, 1), (2, 2)]) == 0  # empty spans


def test_busy_time_is_the_union_of_each_programs_kernels(tmp_path):
  file = tmp_path / "gpu.xplane.pb"
  file.write_bytes(_streams({
      # Program 7 on two streams: [0, 100) and [50, 120) overlap, [200, 210) does not.
      "Stream #1": [(0, 100, "jit_f", 7), (200, 10, "jit_f", 7), (300, 40, "jit_g(9)", None)],
      "Stream #2": [(50, 70, "jit_f", 7), (120, 30, "jit_h", None)],
  }))
  busy = autotuning.profile.busy_time_by_program(file)
  # By program_id, from the stat or from a module named "<name>(<id>)"; else by name.
  assert busy == pytest.approx({7: 130e-9, 9: 40e-9, "jit_h": 30e-9}, rel=1e-9)
  assert autotuning.profile.busy_time_by_program(file, host_events=False) == busy
  # By module name alone, whatever ids the events carry.
  assert autotuning.profile.busy_time_by_program(file, by_module=True) == pytest.approx(
      {"jit_f": 130e-9, "jit_g": 40e-9, "jit_h": 30e-9}, rel=1e-9)
  with pytest.raises(ProfileError, match="no such file"):
    autotuning.profile.busy_time_by_program(tmp_path / "missing")
  # A device event that names its program but no instruction (a kernel of a CUDA
  # graph) is device work of the program too.
  file.write_bytes(_streams({"Stream #1": [(0, 100, "jit_f", 7), (100, 50, "jit_f", 7, None)]}))
  assert autotuning.profile.busy_time_by_program(file) == pytest.approx({7: 150e-9}, rel=1e-9)


def _recorded_tpu_trace(tmp_path):
  """The trace bench/record_tpu_trace.py wrote on a TPU v5e, and what its events said."""
  folder = pathlib.Path(__file__).resolve().parents[1] / "data" / "busy_time" / "tpu_v5_lite"
  path = tmp_path / "tpu.xplane.pb"
  path.write_bytes(gzip.decompress((folder / "profile.xplane.pb.gz").read_bytes()))
  return path, json.loads((folder / "busy.json").read_text())


def test_busy_time_reads_a_tpus_programs_from_their_own_line(tmp_path):
  # A TPU's device plane names a program only in the name of its "XLA Modules" events;
  # their "(number)" is no program_id, so programs are named by module either way.
  path, recorded = _recorded_tpu_trace(tmp_path)
  assert recorded["device"] == "TPU v5 lite" and recorded["runs"] == {
      "jit_tpu_fixture_product": 3, "jit_tpu_fixture_looped": 3}
  for options in ({"by_module": True, "host_events": False}, {}):
    busy = autotuning.profile.busy_time_by_program(path, **options)
    assert busy == pytest.approx(recorded["busy_s"], rel=1e-9)
  # The looped program (16 products and tanh) took longer than one product.
  assert busy["jit_tpu_fixture_looped"] > 10 * busy["jit_tpu_fixture_product"] > 0


def test_read_op_calls_says_a_tpus_profile_names_no_instructions(tmp_path):
  path, _ = _recorded_tpu_trace(tmp_path)
  with pytest.raises(ProfileError, match=r"a TPU's profile.*get_bound_args\(fn, \*args\)"):
    read_op_calls(path)


def test_a_compiled_program_is_found_under_its_names_in_a_trace(tmp_path):
  drop_live_programs()
  x = jax.random.normal(jax.random.key(3), (64, 64))
  compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(x).compile()
  compiled(x).block_until_ready()
  program_id, module = autotuning.profile.program_names(compiled)
  assert isinstance(program_id, int) and module == "jit__lambda"
  with jax.profiler.trace(str(tmp_path)):
    compiled(x).block_until_ready()
  busy = autotuning.profile.busy_time_by_program(tmp_path)
  assert busy[program_id] > 0
  # A device's profile is read from device planes only; a CPU's has none.
  assert autotuning.profile.busy_time_by_program(tmp_path, host_events=False) == {}
  assert autotuning.profile.program_names(object()) == (None, None)


def _scanned_layers(x, weights):
  """Two layers in a scan, each a norm, a projection and causal attention: XLA hoists the
  attention's loop-invariant work (its causal mask) out of the loop, into the entry."""
  b, t, d = x.shape

  def layer(h, w):
    h = h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
    q = (h @ w).reshape(b, t, 4, d // 4)
    a = stellarax.dot_product_attention(q, q, q, is_causal=True, implementation="xla_chunked")
    return h + a.reshape(b, t, d), None

  return lax.scan(layer, x, weights)[0]


def test_work_hoisted_out_of_a_loop_is_no_call_of_its_own(tmp_path):
  drop_live_programs()
  keys = jax.random.split(jax.random.key(4), 2)
  x, weights = jax.random.normal(keys[0], (2, 24, 48)), 0.2 * jax.random.normal(keys[1], (2, 48, 48))
  program = jax.jit(_scanned_layers)
  (call,) = _profiled_runs(tmp_path, program, x, weights)
  assert call.count == 2 * RUNS  # two layers a run
  # The case at hand: marked work outside the loop too, which read alone would count as
  # one more call a run.
  hlo = program.lower(x, weights).compile().as_text()
  assert any("stellarax_op=" in line for line in _entry_instructions(hlo).values())


def _unrolled_layers(x, scale, wq, w, wg, group_sizes, *, layers):
  """A model whose layers a Python loop unrolls: each op is called `layers` times from
  one line. The weights, and ragged_dot's group sizes, are shared by the layers, so JAX
  adds the calls' cotangents of them; XLA fuses each norm into the matmul that reads it."""
  b, t, d = x.shape
  for _ in range(layers):
    h = stellarax.layer_norm(x, scale, scale)  # d scale and d offset: one frame and shape
    q = (h @ wq).reshape(b, t, 2, d // 2)
    x = x + stellarax.dot_product_attention(q, q, q, is_causal=True).reshape(b, t, d)
    x = x + stellarax.ragged_dot(x[0], w, group_sizes)[None]
    x = x + stellarax.gated_linear_unit(stellarax.rms_norm(x[0], scale), wg)[None]
  return jnp.sum(x * x)


@pytest.mark.parametrize("layers", [1, 3])
def test_counts_unrolled_layers_and_backward_ops_with_several_results(layers, tmp_path):
  drop_live_programs()
  keys = jax.random.split(jax.random.key(5), 5)
  d = 64
  args = (jax.random.normal(keys[0], (1, 48, d)), jax.random.normal(keys[1], (d,)),
          0.05 * jax.random.normal(keys[2], (d, d)),
          0.05 * jax.random.normal(keys[3], (4, d, d)),
          0.05 * jax.random.normal(keys[4], (d, 2, d)), jnp.array([13, 0, 20, 9], jnp.int32))
  step = jax.jit(jax.grad(functools.partial(_unrolled_layers, layers=layers),
                          argnums=(0, 1, 2, 3, 4)))
  calls = _profiled_runs(tmp_path, step, *args)
  counts = collections.Counter()
  for call in calls:
    ba = json.loads(call.marker)
    # rms_norm is layer_norm without the mean: two keys of one op name.
    counts[ba["op"]["name"], ba["arguments"].get("subtract_mean")] += call.count
  assert len(calls) == len(counts) == 10, counts  # 5 ops and their VJP ops
  assert set(counts.values()) == {layers * RUNS}, counts


def test_a_backward_op_with_two_results_at_one_frame_is_one_call(tmp_path):
  # rms_norm's VJP computes d x and d scale from one line of its body; they once
  # counted as two calls.
  drop_live_programs()
  keys = jax.random.split(jax.random.key(6), 2)
  x, scale = jax.random.normal(keys[0], (64, 96)), jax.random.normal(keys[1], (96,))
  step = jax.jit(jax.grad(lambda x, s: jnp.sum(stellarax.rms_norm(x, s) ** 2), (0, 1)))
  counts = {json.loads(c.marker)["op"]["name"]: c.count
            for c in _profiled_runs(tmp_path, step, x, scale)}
  assert counts == {"layer_norm.xla": RUNS, "layer_norm.xla_vjp": RUNS}


# -- kernels of command buffers (GPU) -------------------------------------------------


def _inst(name, opcode, iid, operands=(), called=(), signature=0, kernels=()):
  return _Instruction(name, opcode, iid, tuple(operands), tuple(called), None, 0, None,
                      signature=signature, kernels=tuple(kernels))


def test_kernel_names_give_the_instructions_a_command_buffer_kernel_may_be():
  # A command buffer's events name their kernels, not their instructions (profile.py,
  # module doc, 1): XLA names a kernel after its instruction as a C identifier, runs
  # alike fusions as one kernel named after the first, and a Pallas Triton kernel
  # under its own name, which two layers' calls share.
  body = lambda first: [_inst("p", "parameter", first, signature=1),
                        _inst("e", "exponential", first + 1, [first], signature=2)]
  computations = {
      10: body(100), 11: body(200),
      12: [_inst("p", "parameter", 300, signature=1), _inst("n", "negate", 301, [300], signature=3)],
      1: [_inst("input_reduce_fusion.4", "fusion", 1, called=[10], signature=7),
          _inst("input_reduce_fusion.2", "fusion", 2, called=[11], signature=7),
          _inst("loop_fusion", "fusion", 3, called=[12], signature=7),
          _inst("custom-call.3", "custom-call", 4, kernels=["ragged_dot_fwd"]),
          _inst("custom-call.5", "custom-call", 5, kernels=["ragged_dot_fwd"])],
  }
  kernels = _kernel_names(computations)
  assert kernels["input_reduce_fusion_4"] == ("input_reduce_fusion.4", "input_reduce_fusion.2")
  assert kernels["loop_fusion"] == ("loop_fusion",)
  assert kernels["custom_call_3"] == ("custom-call.3",)
  assert kernels["ragged_dot_fwd"] == ("custom-call.3", "custom-call.5")


def test_a_pallas_calls_kernel_name_is_read_from_its_backend_config():
  # As jax 0.11.2 lowers them for an H200: a Triton call names its kernel; a Mosaic GPU
  # call's module bytecode holds "<kernel>_mosaic_gpu" among its NUL-separated strings,
  # and ptxas names the kernel "<kernel>_mosaic_gpu_kernel" (bench/compile_h200.py).
  triton = (b'{debug = false, grid_x = 32 : i32, ir = "ML\\EFR, name = \\22x\\22", '
            b'name = "ragged_dot_fwd", num_stages = 3 : i32, num_warps = 4 : i32}')
  assert _custom_call_kernels(triton) == ("ragged_dot_fwd",)
  mosaic = (b'{kernel_hash = "..", module = "ML\\EFR\\11builtin\\00stable_mosaic_gpu\\00llvm'
            b'\\00llvm.emit_c_interface\\00ragged_dot_fwd_mosaic_gpu\\00ordering\\00"}')
  assert _custom_call_kernels(mosaic) == ("ragged_dot_fwd_mosaic_gpu_kernel",)
  assert _custom_call_kernels(b'{kernel_hash = "..", module = "ML\\EFR"}') == ()
