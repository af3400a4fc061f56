"""Which stellarax ops ran in an XProf profile, how often, and for how long.

`jax.profiler.trace(dir)` writes ``dir/plugins/profile/<timestamp>/<host>.xplane.pb``, a
serialized ``XSpace`` protobuf: a list of planes, each with lines of timed events.

What a profile holds (jax 0.11.2):

- ``/host:metadata``: no lines. Its event metadata holds one entry per compiled program,
  named ``"<module>(<program_id>)"``, with the stats ``program_id`` and ``Hlo Proto`` (the
  serialized ``xla.HloProto`` of the optimized, scheduled module). The HLO instructions
  carry ``frontend_attributes``, and so our markers, ``metadata.op_name``, which holds
  them too (`stellarax.core.markers`: ``stellarax_op=<marker>`` named scopes), and
  ``metadata.stack_frame_id``: the Python stack that JAX traced the instruction from,
  kept in the module's stack frame index. `jax.profiler.ProfileData` does not expose
  event metadata, so this plane is read here with a small protobuf reader.
- CPU: ``/host:CPU``. Line ``python`` has PjRt host work and Python frames; lines
  ``tf_XLAPjRtCpuClient/<tid>`` and ``tf_XLAEigen/<tid>`` are XLA:CPU worker threads, where
  each executed thunk is one event named after its top-level HLO instruction, with stats
  ``hlo_op``, ``hlo_module``, ``program_id``, ``run_id`` (one per execution of the
  program) and ``device_ordinal``.
- GPU (from XLA's CUPTI collector; read on an H200, 2026-12-04):
  ``/device:GPU:<n>`` planes, one line per stream, one event per kernel, memcpy or
  memset, with stats parsed from XLA's annotations: ``hlo_op``, ``hlo_module``,
  ``program_id`` (when XLA knows it), ``tf_op``, ``kernel_details``, and ``run_id`` where
  the annotation has it. Host planes hold the launches, which are not device time.
  XLA runs sequences of kernels as command buffers (CUDA graphs): their events carry
  the command buffer's thunk as ``hlo_op`` (``command_buffer_1``, no instruction of
  the HLO), no ``run_id``, and the kernel's name as their name, which is the
  instruction's made a C identifier (``gemm_fusion_dot_10`` for ``gemm_fusion_dot.10``);
  a Pallas kernel's name is its own (in its custom call's backend config).
- TPU (jax 0.10.2, the device machine's image; read on a v5e, 2026-12-07):
  ``/device:TPU:<n>`` planes. Line ``XLA Modules`` has one event per run of a program,
  named ``"<module>(<fingerprint>)"`` (a number above 2**63, not the program_id), with
  a ``run_id`` stat and neither ``hlo_module`` nor ``program_id``; line ``XLA Ops`` has
  one event per instruction, named by its HLO text (``%while = (s32[], ...``), with no
  stat that names an instruction or a program; line ``Async XLA Ops`` has the async
  copies, with ``hlo_op`` but no program. So only a program's device time is read
  there (`busy_time_by_program`, by module name); `read_op_calls` refuses a TPU's
  profile, since no instruction's event says which program ran it.

How events become op calls:

1. Events are the ones with an ``hlo_op`` stat on ``/device:*`` planes; a profile with
   none there (CPU) uses the other planes instead. An event names a program by
   ``program_id``, or else by ``hlo_module``, and an instruction of it by ``hlo_op``. A
   program *ran* when at least one event is filed under it. Where several programs
   may have run an event (found by module name: an event without ``program_id``, or
   of a module whose ids the file's programs do not match, as after JAX's persistent
   compilation cache, see `_ProgramIndex`), it is filed only if its instruction does
   the same ops' work in all of them, left out with a warning if it does different
   ops' work, and left out silently if no op's work in any. An event whose ``hlo_op``
   names no instruction of its program (a command buffer's kernel) is the instruction
   its kernel name gives; fusions whose fused computations are alike run one kernel,
   named after the first, so its events go to each of them in turn.
2. Markers. An instruction runs the work of its own HLO and of the computations it calls
   (fusion bodies, reducers, wrapped calls), but not of ``while``/``conditional`` bodies,
   which run as events of their own. Its markers are the ``stellarax_op`` attributes
   found on that work. XLA propagates the attribute unevenly (a pass that rewrites an
   instruction may drop it), hence three rules: a fusion counts when any instruction
   inside it is marked; an unmarked instruction whose result a marked
   ``get-tuple-element`` reads is the op's (XLA:CPU keeps the marker of an op built on a
   loop only there); and a marked loop or conditional marks its bodies. A marker that
   no instruction of a program carries as an attribute, after these rules, is read
   from op_name instead (XLA:CPU's expansion of ``jax.lax.ragged_dot`` drops the
   attribute from every instruction it creates, and keeps op_name): each unmarked
   instruction whose op_name names it in its innermost ``stellarax_op=`` scope is
   marked with it, and then every rule here applies as to an attribute. A marker that
   some instruction kept is left to the attribute alone, so op_name changes nothing
   where XLA kept the attribute.
3. Call sites. The call site of an instruction is its Python stack (HLO metadata: file,
   function, line and column of each frame, so two calls on one line are two sites) up
   to the op's outermost frame in this library's op modules (``core``, ``ops``),
   without the frames of its other modules, each run of repeated frames kept once.
   What lies inside the op's frames is left out because JAX fills it from its tracing
   caches: it repeats the caller's frames once per transformation level (a custom
   VJP's backward pass), and where it reuses what it traced for an earlier call with
   the same arguments (from another line, or another program compiled in the
   process) it repeats that call's caller instead, on some instructions of the call.
   So every instruction of one op call has that call's site, the user code that
   called the op, in the forward and in the backward pass.
4. Count = runs x calls, summed over the computations of every program that ran, and
   over files. The calls of a marker in a computation (the entry, or a body of a loop,
   conditional or call) add up over the distinct call sites of its marked instructions.
   A site has several calls when a Python loop calls the op from one line (unrolled
   layers), and its calls are counted by their results. A result is a value that
   the op's work (its marked instructions, and those whose op_name names it) computes
   and the user's work reads, or that leaves the computation, looked for at the
   instructions inside fusions, since XLA fuses an op's last step into the user's
   kernel that reads it. (Failing any, a value that another op call reads.) Values are
   numbered so that XLA's copies of one instruction in several fusions are one value,
   and two calls' values are two (`_value_numbers`). Results are grouped by (stack
   frame, shape); the site's calls are the fewest values of any group, since one call
   may have several results at one frame and shape (the d scale and d offset of
   layer_norm's VJP). Within a group, results that share a step of the op's work which
   read all the inputs of one of them are one call's (attention's dq and dk where q,
   k and v are one array, both from the scores' gradient); calls of one line share at
   most work on common inputs (a mask from the group sizes). A marker that a loop, conditional or call around the
   computation carries is counted there instead. A (marker, site)
   that a loop, conditional or call below the computation also has is work XLA hoisted
   out of that loop (loop-invariant code motion: a causal mask built once before a
   scan over layers), counted with the calls below, not as a call of its own. The runs of the
   entry computation are the program's executions: its distinct (device, ``run_id``)
   pairs; without ``run_id`` (GPU profiles whose annotations lack it), the fewest
   events of any one (instruction, event name) of the entry computation, so an
   instruction that launches two kernels still runs once. A loop body runs its
   parent's runs times the loop's ``known_trip_count`` (XLA's annotation); any other
   such computation runs as often as its rarest (instruction, event name) says, or
   else, for a branch of a conditional whose other branches have events, as often as
   its parent less their runs (an untaken branch ran 0 times), or else as often as its
   parent. So every marker in the HLO of a program that ran is
   reported, even when no executed instruction kept it.
5. Time: each event's duration goes to its instruction's markers, split evenly when a
   kernel holds parts of several ops (XLA fused them). An instruction that these rules
   leave unmarked but whose op_name names an op (its innermost ``stellarax_op=``
   scope) is that op's work, and its time goes there, even when other instructions of
   the op kept the attribute (XLA:CPU drops it from some loops of an op's backward:
   in the recorded CPU profile, tests/data/profiles, the attention VJP's own time rose
   from 21 us to 630 us of its three steps with this rule, 2026-12-02); counts are
   left to rule 4. Any other unmarked kernel traced from
   inside this library (an op's work whose attribute XLA dropped) goes to the markers
   of its call site that it is joined to by data flow, directly or through other such
   kernels and through data movement (``bitcast``, ``copy``, ``get-tuple-element``,
   ...); split evenly too. An event is left out for a marker when an enclosing
   ``while``/``conditional``/``call`` of the same marker (by either rule) has events of its own
   (XLA:CPU times a loop thunk and, inside it, each body thunk). An instruction that no
   event ran inside of ran its loop and conditional bodies within its own events
   (jax 0.12's XLA:CPU runs a small loop as one ``call`` thunk, its bodies give no
   events): their markers share its time. A marker whose kernels cannot be told apart
   from other work has a device time of 0.0.

Limits: a site counts at least one call; it counts fewer than ran when XLA computes a
result of several calls once (calls on equal inputs, which XLA's common-subexpression
pass merges, ran once) and when calls of one op chain from one line with no user work
between (each reading the last one's result), whose results but the last are the next
call's work. An op
called from another op's implementation has the outer call's site. A marker put on
outside this library's op modules keeps its whole stack, so JAX's reuse of an earlier
trace (3) can split one of its calls into two sites. An op that XLA unrolls into a
caller's loop counts per trip. A loop whose body gives no events (a small loop on
XLA:CPU 0.12, 5) shows no trips: an op in it counts once per run of the loop unless XLA
knows the trip count. A program compiled without stack metadata counts each
marker once per computation. A marker that XLA removed from every instruction's
attributes and op_name cannot be found. Read from op_name, an instruction that XLA
created without metadata goes to no op, and a backward pass that JAX derives from an
op's body (an op without a VJP op) counts as that op, since it carries the forward's
scope though not its attribute. A profile without the HLO (no metadata plane) cannot be
read: events carry instruction names, never frontend attributes. In a command buffer,
a kernel named neither after its instruction nor by its backend config (a cuBLAS or
cuDNN kernel) is no instruction's: its time goes to no op, and
alike fusions' time is shared in turn, not by which of them ran.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import tempfile
from typing import Any
import warnings

import jax
from jax import profiler

from stellarax.core.bound_args import BoundArguments
from stellarax.core.markers import MARKER_KEY
from stellarax.core.markers import SCOPE_PREFIX
from stellarax.core.markers import markers_in_op_name
from stellarax.core.warn import warn

_METADATA_PLANE = "/host:metadata"
_DEVICE_PLANE_PREFIX = "/device:"
_TPU_PLANE_PREFIX = "/device:TPU:"
_HLO_PROTO_STAT = "hlo proto"  # compared lowercased: XLA writes "Hlo Proto"
_CONTROL_FLOW = frozenset({"while", "conditional"})
# Instructions whose called computations run as sequences of thunks or kernels.
_SEQUENCE_CALLERS = _CONTROL_FLOW | {"call"}
# Instructions that only move or relabel data: never a call of their own.
_DATA_MOVEMENT = frozenset({
    "bitcast", "bitcast-convert", "copy", "copy-done", "copy-start",
    "get-tuple-element", "optimization-barrier", "reshape", "transpose", "tuple",
})
# Instructions whose result holds their operand's values, only laid out, shaped or
# typed otherwise: XLA writes one value with different ones of these in different
# fusions, so they do not make a value of their own.
_SAME_VALUE = _DATA_MOVEMENT | {"broadcast", "convert"}
# Instructions that compute no op result of their own: the above, inputs, and a fusion,
# whose value is its root's.
_NOT_VALUES = _SAME_VALUE | {"parameter", "constant", "fusion"}
_MODULE_WITH_ID = re.compile(r"^(?P<name>.*)\((?P<id>\d+)\)$")
# A TPU's device plane holds one event per program run on this line (module doc).
_TPU_PROGRAM_LINE = "XLA Modules"
# HloModuleProto.id: the program_id that XLA writes into the events of the module's work.
_HLO_MODULE_ID = 5
# HloInstructionProto fields that name an instruction or say where it came from, not
# what it computes: name, metadata, id, operand_ids, control_predecessor_ids,
# called_computation_ids, frontend_attributes.
_IDENTITY_FIELDS = frozenset({1, 7, 35, 36, 37, 38, 68})
_TRIP_COUNT = re.compile(rb'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
# This library's package directory: frames of its modules are cut from call sites.
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Its modules that run op calls (relative to _PACKAGE_ROOT): a call site ends at them.
_OP_MODULES = ("core/", "ops/")


@dataclasses.dataclass(frozen=True)
class OpCall:
  """One stellarax op (one marker) as it ran in a profile.

  Attributes:
    marker: the op's marker, compact JSON of its bound arguments.
    count: how many times the op ran, over all runs, loop trips and devices.
    device_time_s: total device time of its kernels, in seconds.
  """

  marker: str
  count: int
  device_time_s: float


class ProfileError(Exception):
  """A profile could not be read, or holds no stellarax op."""


def read_op_calls(path: str | os.PathLike[str]) -> list[OpCall]:
  """Reads which stellarax ops ran in an XProf profile.

  Args:
    path: a ``*.xplane.pb`` file, or a directory written by ``jax.profiler.trace``: the
      newest ``*.xplane.pb`` under it is read, with every other host's file beside it.

  Returns:
    One `OpCall` per marker in the HLO of a program that ran (module doc, 4), by
    device time, longest first.

  Raises:
    ProfileError: the path is missing or holds no profile; a file is not a profile, is
      truncated or corrupt, embeds no HLO, or is a TPU's (module doc); or no stellarax
      op ran in it.
  """
  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  for file in _profile_files(pathlib.Path(path)):
    for marker, (count, time_ns) in _read_file(file).items():
      totals[marker][0] += count
      totals[marker][1] += time_ns
  calls = [OpCall(m, int(c), t * 1e-9) for m, (c, t) in totals.items()]
  return sorted(calls, key=lambda call: (-call.device_time_s, call.marker))


def device_time_per_call(fn: Callable[..., Any], *args: Any,
                         runs: int = 3) -> dict[tuple[str, str], float]:
  """Each stellarax op call's own device time per run of the program `fn(*args)`.

  `fn` is compiled, run once outside the profile (one-time costs), then `runs` times
  inside `jax.profiler.trace`, and `read_op_calls` attributes the device time.

  Args:
    fn: a jittable function of arrays.
    *args: its arguments (arrays).
    runs: runs inside the trace (>= 1); the times are per run.

  Returns:
    (op JSON, key JSON) of a call (as `Entry.key`) -> seconds per run.

  Raises:
    ProfileError: as `read_op_calls` (e.g. no stellarax op ran).
    RuntimeError: if another trace is running (one at a time).
    ValueError: if runs < 1.
  """
  if not isinstance(runs, int) or runs < 1:
    raise ValueError(f"{runs=} must be an int >= 1: runs of the program inside the trace.")
  compiled = _compile_under_own_name(fn, args)
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory(prefix="stellarax-calls-") as folder:
    with jax.profiler.trace(folder, profiler_options=trace_options(hlo=True)):
      for _ in range(runs):
        jax.block_until_ready(compiled(*args))
    calls = read_op_calls(folder)
  times: dict[tuple[str, str], float] = collections.defaultdict(float)
  for call in calls:
    ba = BoundArguments.from_json(json.loads(call.marker)).with_config(None)
    times[ba.op_json(), ba.key_json()] += call.device_time_s / runs
  return dict(times)


def _compile_under_own_name(fn: Callable[..., Any], args: tuple) -> Any:
  """Compiles `fn` for `args` as a program named after its own text: the same program
  gets the same name in every process (so JAX's persistent compilation cache still finds
  it), another program another name. A profile then finds its events by module name,
  which a program loaded from that cache needs (its XLA:CPU events keep the program_id
  of the process that compiled it), even where the process also holds the same function
  compiled for other inputs or configs (`_ProgramIndex`)."""
  text = jax.jit(fn).lower(*args).as_text()

  def program(*arrays):
    return fn(*arrays)

  program.__name__ = program.__qualname__ = (
      "stellarax_profiled_" + hashlib.sha1(text.encode()).hexdigest()[:12])
  return jax.jit(program).lower(*args).compile()


def trace_options(*, hlo: bool) -> jax.profiler.ProfileOptions:
  """Options for this library's own traces: device (and XLA:CPU thunk) events, no
  Python frames.

  Args:
    hlo: embed the HLO of every live program, as `read_op_calls` needs (slow in a
      process that holds thousands); `busy_time_by_program` does not need it.

  Returns:
    Options for `jax.profiler.trace(..., profiler_options=...)`.
  """
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  options.enable_hlo_proto = hlo
  return options


def busy_time_by_program(path: str | os.PathLike[str], *, host_events: bool = True,
                         by_module: bool = False) -> dict[int | str, float]:
  """How long the device was busy with each program that ran in a profile.

  A program's busy time on a plane (a device; on a CPU, the host's XLA:CPU threads) is
  the length of the union of its events' intervals there (on a device, every event
  that names the program, with or without an instruction; on a TPU, its runs' events
  on the "XLA Modules" line, module doc), so kernels on several
  streams, a loop thunk and the thunks inside it, or thunks on several threads at
  once count once; its time is that of its busiest plane, over every host's file of
  the trace. Gaps between its kernels do not count: this is the device work, not the
  host's or the launch queue's share.

  Args:
    path: as for `read_op_calls`.
    host_events: read the host's events of XLA instructions when no device plane
      holds any (a CPU's profile). False for a device's profile: there the host's
      events, from the same annotations, time the launches, so a profile without the
      device's own events (no CUPTI) gives no time rather than a wrong one.
    by_module: name every program by its module name, whatever id its events carry:
      for programs named apart (the ids of programs loaded from JAX's persistent
      compilation cache come from the process that compiled them, see _ProgramIndex);
      programs of one name add up, and events that name no module are left out.

  Returns:
    program -> seconds. A program is named by the program_id its events carry (see
    `program_names`), or by its module name where they carry none (always, with
    by_module).

  Raises:
    ProfileError: the path is missing or holds no profile, or a file is not one.
  """
  busy: dict[int | str, float] = collections.defaultdict(float)
  for file in _profile_files(pathlib.Path(path)):
    try:
      space = profiler.ProfileData.from_serialized_xspace(file.read_bytes())
    except (OSError, RuntimeError) as e:
      raise ProfileError(f"{file}: cannot be read as a profile: {e}") from e
    intervals: dict[tuple[int | str, str], list[tuple[float, float]]] = (
        collections.defaultdict(list))
    for event in _op_events(space, device_work=True):
      if not host_events and not event.plane.startswith(_DEVICE_PLANE_PREFIX):
        continue
      program = event.names()[1] if by_module else event.program()
      if program is not None:
        intervals[program, event.plane].append(
            (event.start_ns, event.start_ns + event.duration_ns))
    for (program, _), spans in intervals.items():
      busy[program] = max(busy[program], union_length(spans) * 1e-9)
  return dict(busy)


def union_length(spans: list[tuple[float, float]]) -> float:
  """The total length covered by (start, end) intervals, overlaps counted once.

  Args:
    spans: (start, end) pairs, start <= end, in any order and unit.

  Returns:
    The length of their union, in the spans' unit (0.0 for none).
  """
  total, reach = 0.0, -math.inf
  for start, end in sorted(spans):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


def program_names(compiled: Any) -> tuple[int | None, str | None]:
  """The names under which a profile files the events of a compiled program.

  Args:
    compiled: a `jax.stages.Compiled` (``jax.jit(f).lower(...).compile()``).

  Returns:
    (program_id, module name): the id of its (first) HLO module, which XLA writes into
    its events as ``program_id``, and the module's name (``hlo_module``); each None
    where the executable does not say.
  """
  try:
    module = compiled.runtime_executable().hlo_modules()[0]
  except Exception:  # an executable of another kind, or one without modules
    return None, None
  try:
    fields = _fields(memoryview(module.as_serialized_hlo_module_proto()))
    ids = [value for number, _, value in fields if number == _HLO_MODULE_ID]
  except Exception:  # a serialization this reader does not parse: no id, the name stays
    ids = []
  return (ids[0] if ids and isinstance(ids[0], int) else None), module.name


def profile_files(path: str | os.PathLike[str]) -> tuple[list[pathlib.Path], int]:
  """Which files `read_op_calls` reads for `path`.

  Args:
    path: as for `read_op_calls`.

  Returns:
    (the files, sorted; how many other ``*.xplane.pb`` files under `path`, of older
    traces, it leaves out).

  Raises:
    ProfileError: the path is missing or holds no profile.
  """
  path = pathlib.Path(path)
  files = _profile_files(path)
  return files, (len(list(path.rglob("*.xplane.pb"))) - len(files) if path.is_dir() else 0)


def _profile_files(path: pathlib.Path) -> list[pathlib.Path]:
  """The files to read for `path`: itself, or the newest trace's files under it."""
  if not path.exists():
    raise ProfileError(
        f"{path}: no such file or directory; expected a *.xplane.pb file or a "
        "directory written by jax.profiler.trace")
  if not path.is_dir():
    return [path]
  found = list(path.rglob("*.xplane.pb"))
  if not found:
    raise ProfileError(
        f"{path}: no *.xplane.pb file under this directory; pass the directory given "
        "to jax.profiler.trace, after the trace has ended")
  # One trace writes one file per host into one directory, so read that directory.
  newest = max(found, key=lambda file: file.stat().st_mtime_ns)
  return sorted(file for file in found if file.parent == newest.parent)


def _read_file(path: pathlib.Path) -> dict[str, tuple[int, float]]:
  """Counts and device time (ns) per marker of one ``*.xplane.pb`` file."""
  events, programs = _load(path)
  tally = _Tally(_ProgramIndex(programs, events))
  for event in events:
    tally.add(event)
  result = tally.result()
  if not result:
    raise ProfileError(f"{path}: {tally.describe_no_ops()}")
  if tally.ambiguous:
    warn(f"{path}: {tally.describe_ambiguous()}", RuntimeWarning)
  return result


def _load(path: pathlib.Path) -> tuple[list[_Event], list[_Program]]:
  """The instruction events of one file and the programs whose HLO it embeds."""
  try:
    data = path.read_bytes()
  except OSError as e:
    raise ProfileError(f"{path}: cannot be read: {e}") from e
  metadata = _metadata_plane(data, path)
  try:
    space = profiler.ProfileData.from_serialized_xspace(data)
    events = _op_events(space)
  except RuntimeError as e:
    raise ProfileError(f"{path}: corrupt profile, XSpace does not parse: {e}") from e
  if (any(plane.name.startswith(_TPU_PLANE_PREFIX) for plane in space.planes)
      and all(e.program() is None for e in events)):
    raise ProfileError(
        f"{path}: a TPU's profile, whose instructions' events name no program (module "
        "doc), so the stellarax ops that ran cannot be told from it (nor their device "
        "times); the program itself names its op calls without a profile: "
        "stellarax.autotuning.get_bound_args(fn, *args), or autotune(fn, *args)")
  try:
    programs = _programs(metadata) if metadata is not None else []
  except _WireError as e:
    raise ProfileError(f"{path}: corrupt HLO in {_METADATA_PLANE!r}: {e}") from e
  if not programs:
    raise ProfileError(
        f"{path}: the profile embeds no HLO (no 'Hlo Proto' in a {_METADATA_PLANE!r} "
        "plane), so its events cannot be mapped to stellarax ops; record it with "
        "jax.profiler.trace, which embeds the HLO of every live program")
  return events, programs


# -- protobuf wire format ------------------------------------------------------------
# Only what is read here, with the field numbers it relies on:
#   XSpace (tsl/profiler/protobuf/xplane.proto): planes=1, errors=2, warnings=3,
#     hostnames=4.
#   XPlane: name=2, event_metadata=4 (map<int64, XEventMetadata>),
#     stat_metadata=5 (map<int64, XStatMetadata>). A map entry is key=1, value=2.
#   XEventMetadata: name=2, stats=5. XStatMetadata: id=1, name=2.
#   XStat: metadata_id=1, uint64_value=3, int64_value=4, str_value=5, bytes_value=6.
#   HloProto (xla/service/hlo.proto): hlo_module=1.
#   HloModuleProto: name=1, computations=3, id=5, entry_computation_id=6,
#     stack_frame_index=17.
#   HloComputationProto: instructions=2, id=5.
#   HloInstructionProto: name=1, opcode=2, metadata=7, id=35, operand_ids=36,
#     called_computation_ids=38 (a while's body first, then its condition),
#     backend_config=43, frontend_attributes=68.
#   StackFrameIndexProto: file_names=1, function_names=2, file_locations=3,
#     stack_frames=4; FileLocation: file_name_id=1, function_name_id=2, line=3;
#     StackFrame: file_location_id=1, parent_frame_id=2. Ids are 1-based, 0 is none.
#   OpMetadata (xla/xla_data.proto): op_name=2, stack_frame_id=15.
#   FrontendAttributes (xla/xla_data.proto): map=1 (map<string, string>).


class _WireError(ValueError):
  """A buffer does not follow the protobuf wire format.

  Attributes:
    truncated: the buffer ends inside a field (else a field is malformed).
  """

  def __init__(self, message: str, *, truncated: bool):
    super().__init__(message)
    self.truncated = truncated


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
  """Decodes the varint at `pos`; returns it and the position after it."""
  result = shift = 0
  while True:
    if pos >= len(buf):
      raise _WireError(
          f"a number runs past the end of its {len(buf)}-byte message", truncated=True)
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if byte < 0x80:
      return result, pos
    shift += 7
    if shift > 63:
      raise _WireError(f"a number longer than 10 bytes ends at byte {pos}",
                       truncated=False)


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
  """Yields (field number, wire type, value) of each field of a message.

  Varints come as ints; length-delimited and fixed-width fields as views of their bytes.
  """
  pos = 0
  while pos < len(buf):
    start = pos
    key, pos = _varint(buf, pos)
    number, wire_type = key >> 3, key & 7
    if wire_type == 0:
      value, pos = _varint(buf, pos)
    elif wire_type in (1, 2, 5):
      size = {1: 8, 5: 4}.get(wire_type)
      if size is None:
        size, pos = _varint(buf, pos)
      if pos + size > len(buf):
        raise _WireError(
            f"field {number} at byte {start} needs {size} bytes, {len(buf) - pos} remain",
            truncated=True)
      value, pos = buf[pos:pos + size], pos + size
    else:
      raise _WireError(
          f"field {number} at byte {start} has invalid wire type {wire_type}",
          truncated=False)
    if number == 0:
      raise _WireError(f"field number 0 at byte {start}", truncated=False)
    yield number, wire_type, value


def _ints(wire_type: int, value: int | memoryview) -> list[int]:
  """The values of a repeated integer field: packed into one run, or one varint."""
  if wire_type == 0:
    return [value]
  numbers, pos = [], 0
  while pos < len(value):
    number, pos = _varint(value, pos)
    numbers.append(number)
  return numbers


def _text(value: memoryview) -> str:
  return bytes(value).decode("utf-8", errors="replace")


def _map_entry(value: memoryview) -> tuple[int | memoryview | None, ...]:
  """(key, value) of one protobuf map entry."""
  entry = {number: field for number, _, field in _fields(value)}
  return entry.get(1), entry.get(2)


def _metadata_plane(data: bytes, path: pathlib.Path) -> memoryview | None:
  """Checks that `data` is an XSpace and returns its metadata plane, if any."""
  planes, found = 0, None
  not_a_profile = (f"{path}: not an XProf profile, since it does not parse as an XSpace "
                   "protobuf ({}); expected a *.xplane.pb written by jax.profiler.trace")
  try:
    for number, wire_type, value in _fields(memoryview(data)):
      if number not in (1, 2, 3, 4) or wire_type != 2:
        raise ProfileError(not_a_profile.format(
            f"field {number} of wire type {wire_type}, where an XSpace has fields 1-4, "
            "each length-delimited"))
      if number == 1:
        planes += 1
        if _plane_name(value, path) == _METADATA_PLANE:
          found = value
  except _WireError as e:
    if not e.truncated:
      raise ProfileError(not_a_profile.format(e)) from e
    raise ProfileError(
        f"{path}: truncated or corrupt profile ({e}); was the file written and copied "
        "whole?") from e
  if not planes:
    raise ProfileError(
        f"{path}: holds no profile planes (an empty file, or not an XSpace); expected a "
        "*.xplane.pb written by jax.profiler.trace")
  return found


def _plane_name(plane: memoryview, path: pathlib.Path) -> str:
  """The name of a serialized XPlane."""
  try:
    return _text(next((v for n, _, v in _fields(plane) if n == 2), b""))
  except _WireError as e:
    raise ProfileError(f"{path}: corrupt profile: a plane does not parse ({e})") from e


# -- HLO of each program -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  opcode: str
  id: int
  operand_ids: tuple[int, ...]
  called_ids: tuple[int, ...]
  marker: str | None
  frame: int  # the stack frame it was traced from; 0 when unknown
  trip_count: int | None  # of a while loop, when XLA knows it
  scope: str | None = None  # the innermost marker named in its op_name
  index: int | None = None  # a parameter's number, a get-tuple-element's tuple index
  shape: bytes = b""  # its serialized ShapeProto
  # What it computes from its operands, without its name, id or metadata: equal for
  # the copies of one instruction that XLA puts into each fusion that reads it.
  signature: int = 0
  # A custom call's kernel names, from its backend config (`_custom_call_kernels`).
  kernels: tuple[str, ...] = ()


_Computations = Mapping[int, Sequence[_Instruction]]
# A call site: the frames of the Python stack that are not this library's, as
# (file, function, line, column) from the outermost on; and whether the innermost frame
# is this library's (the instruction is work of an op).
_Site = tuple[tuple[tuple[str, str, int, int], ...], bool]


@dataclasses.dataclass(frozen=True)
class _Sequence:
  """A computation that runs as a sequence of thunks or kernels (module doc, 4).

  Attributes:
    parent: the computation whose loop, conditional or call runs this one; None for
      the entry computation.
    trip_count: the loop's known trip count, for the body of a while loop.
    calls: marker -> the number of its calls in this computation.
    other_branches: for a branch of a conditional, its other branches.
  """

  parent: int | None
  trip_count: int | None
  calls: Mapping[str, int]
  other_branches: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Program:
  """A compiled program: which markers each instruction runs, and the op calls.

  Attributes:
    program_id: XLA's id of the program in its process.
    name: the HLO module name (``hlo_module`` in events).
    entry: the id of the entry computation.
    markers: instruction name -> markers of the work it runs (empty when unmarked).
    markers_with_bodies: the same with the loop and conditional bodies it runs.
    shares: unmarked instruction name -> the markers its time goes to (module doc, 5).
    enclosing: instruction name -> the loops, conditionals and calls it runs inside.
    home: instruction name -> the id of its computation.
    sequences: computation id -> its runs and calls, for the computations that run as
      sequences (the entry, and bodies of loops, conditionals and calls).
    kernels: kernel name -> the instructions that may run as that kernel (module
      doc, 1: the events of a command buffer name their kernel, not their instruction).
  """

  program_id: int
  name: str
  entry: int
  markers: Mapping[str, frozenset[str]]
  markers_with_bodies: Mapping[str, frozenset[str]]
  shares: Mapping[str, frozenset[str]]
  enclosing: Mapping[str, frozenset[str]]
  home: Mapping[str, int]
  sequences: Mapping[int, _Sequence]
  kernels: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  def ops_of(self, name: str) -> frozenset[str]:
    """The markers that instruction `name`'s events may give time to (module doc, 5)."""
    return self.markers_with_bodies[name] or self.shares.get(name, frozenset())


def _programs(plane: memoryview) -> list[_Program]:
  """The programs whose HLO the metadata plane embeds."""
  stat_names: dict[int, str] = {}
  entries = []
  for number, _, value in _fields(plane):
    if number == 5:
      key, stat = _map_entry(value)
      name = next((v for n, _, v in _fields(stat or b"") if n == 2), b"")
      stat_names[key] = _text(name).lower()
    elif number == 4:
      entries.append(_map_entry(value)[1] or b"")
  programs = []
  for entry in entries:  # stat names may come after the entries, hence two passes
    name, stats = _event_metadata(entry, stat_names)
    if isinstance(stats.get(_HLO_PROTO_STAT), memoryview):
      programs.append(_program(name, stats))
  return programs


def _event_metadata(
    buf: memoryview, stat_names: Mapping[int, str],
) -> tuple[str, dict[str | None, int | memoryview | None]]:
  """(name, stat name -> value) of one XEventMetadata."""
  name, stats = "", {}
  for number, _, value in _fields(buf):
    if number == 2:
      name = _text(value)
    elif number == 5:
      stat = {n: v for n, _, v in _fields(value)}
      # uint64, int64, bytes, str: the value kinds that the metadata plane uses.
      stats[stat_names.get(stat.get(1))] = next(
          (stat[n] for n in (3, 4, 6, 5) if n in stat), None)
  return name, stats


def _program(entry_name: str, stats: Mapping[str | None, object]) -> _Program:
  """Parses one program's HLO; its id comes from its stat, else from its name."""
  module = next((v for n, _, v in _fields(stats[_HLO_PROTO_STAT]) if n == 1), b"")
  name, computations, roots, entry, stack_index = "", {}, {}, None, b""
  for number, _, value in _fields(module):
    if number == 1:
      name = _text(value)
    elif number == 3:
      cid, roots[cid], instructions = _computation(value)
      computations[cid] = instructions
    elif number == 6:
      entry = value
    elif number == 17:
      stack_index = value
  program_id = stats.get("program_id")
  if not isinstance(program_id, int):
    match = _MODULE_WITH_ID.match(entry_name)
    program_id = int(match["id"]) if match else -1
  if entry not in computations:  # callees come before callers, so the entry is last
    entry = next(reversed(computations), -1)
  computations = _restore_lost_markers(computations)
  computations = _mark_from_scopes(computations)
  markers = _markers_by_instruction(computations)
  site = _sites(stack_index)
  work = _work(computations, site)
  sequences = _sequences(computations, entry, markers, work, _outputs(computations, roots, site))
  shares = {}
  for cid in sequences:
    shares.update(_shares(computations, computations[cid], work))
  # An instruction no attribute marks but whose op_name names an op is that op's work
  # (XLA dropped the attribute, e.g. from a loop of a VJP op whose other instructions
  # kept it): its time goes there, before any share by data flow.
  shares.update({inst.name: frozenset({inst.scope}) for insts in computations.values()
                 for inst in insts if inst.scope and not markers[inst.name]})
  home = {inst.name: cid for cid, insts in computations.items() for inst in insts}
  return _Program(program_id, name, entry, markers,
                  _markers_by_instruction(computations, bodies=True), shares,
                  _enclosing(computations), home, sequences, _kernel_names(computations))


def _kernel_name(instruction_name: str) -> str:
  """The name XLA:GPU gives the kernel of an instruction: a C identifier."""
  return re.sub(r"[^A-Za-z0-9_]", "_", instruction_name)


def _kernel_names(computations: _Computations) -> dict[str, tuple[str, ...]]:
  """Kernel name -> the instructions that may run as that kernel.

  XLA:GPU names a kernel after its instruction (`_kernel_name`), and compiles one kernel
  for fusions whose fused computations are alike, named after the first of them: the
  others run it under its name. Alike here: the same instructions (what each computes,
  `_Instruction.signature`) reading the same operands, in the same order. A custom
  call's kernel is named by its backend config (`_custom_call_kernels`).
  """
  def fingerprint(cid: int) -> int:
    instructions = computations.get(cid, ())
    position = {inst.id: i for i, inst in enumerate(instructions)}
    return hash(tuple((inst.signature, tuple(position.get(o, -1) for o in inst.operand_ids),
                       tuple(fingerprints.get(c, c) for c in inst.called_ids))
                      for inst in instructions))
  fingerprints: dict[int, int] = {}
  for cid in computations:  # callees come before their callers
    fingerprints[cid] = fingerprint(cid)
  alike: dict[tuple, list[str]] = collections.defaultdict(list)
  for instructions in computations.values():
    for inst in instructions:
      if inst.opcode == "fusion":
        alike[(inst.signature, tuple(fingerprints.get(c) for c in inst.called_ids))].append(inst.name)
      else:
        alike[(inst.name,)].append(inst.name)
  kernels: dict[str, tuple[str, ...]] = {}

  def add(kernel: str, names: Iterable[str]) -> None:
    kernels[kernel] = tuple(dict.fromkeys((*kernels.get(kernel, ()), *names)))

  for group in alike.values():
    for name in group:
      add(_kernel_name(name), group)
  # A custom call runs a kernel of its own name (a Pallas kernel's); two calls of one
  # Pallas kernel (two layers) share it like alike fusions.
  for instructions in computations.values():
    for inst in instructions:
      for kernel in inst.kernels:
        add(kernel, [inst.name])
  return kernels


def _computation(buf: memoryview) -> tuple[int, int | None, list[_Instruction]]:
  """(id, root instruction id, instructions) of one HloComputationProto."""
  cid, root, instructions = 0, None, []
  for number, _, value in _fields(buf):
    if number == 5:
      cid = value
    elif number == 6:
      root = value
    elif number == 2:
      instructions.append(_instruction(value))
  return cid, root, instructions


def _instruction(buf: memoryview) -> _Instruction:
  """The fields of one HloInstructionProto that are read here."""
  name = opcode = ""
  iid, frame, operands, called, marker, config = 0, 0, [], [], None, b""
  scope = index = None
  shape, computes = b"", []
  for number, wire_type, value in _fields(buf):
    if number not in _IDENTITY_FIELDS:
      computes.append((number, bytes(value) if isinstance(value, memoryview) else value))
    if number == 1:
      name = _text(value)
    elif number == 2:
      opcode = _text(value)
    elif number == 3:
      shape = bytes(value)
    elif number == 7:
      frame, scope = _op_metadata(value)
    elif number in (9, 13):  # parameter_number, tuple_index
      index = value
    elif number == 35:
      iid = value
    elif number == 36:
      operands += _ints(wire_type, value)
    elif number == 38:
      called += _ints(wire_type, value)
    elif number == 43:
      config = value
    elif number == 68:
      for _, _, entry in _fields(value):
        key, text = _map_entry(entry)
        if key is not None and _text(key) == MARKER_KEY:
          marker = _text(text or b"")
  trips = _TRIP_COUNT.search(bytes(config)) if opcode == "while" else None
  if index is None and opcode in ("parameter", "get-tuple-element"):
    index = 0  # proto3 leaves a zero out
  return _Instruction(name, opcode, iid, tuple(operands), tuple(called), marker, frame,
                      int(trips[1]) if trips else None, scope, index, shape,
                      hash(tuple(computes)),
                      _custom_call_kernels(bytes(config)) if opcode == "custom-call" else ())


# A Pallas Triton call's kernel name in its backend config (an MLIR dictionary, keys in
# order; a quote inside a string is escaped, so this cannot match inside one).
_TRITON_KERNEL = re.compile(rb', name = "([A-Za-z_][A-Za-z0-9_]*)"')
# A Mosaic GPU call's host function, "<kernel name>_mosaic_gpu", among the strings of
# its module's bytecode (NUL-separated, "\00" where the config prints them escaped).
_MOSAIC_GPU_FUNCTION = re.compile(rb'(?:\\00|\x00)([A-Za-z_][A-Za-z0-9_]*_mosaic_gpu)(?=\\00|\x00)')


def _custom_call_kernels(config: bytes) -> tuple[str, ...]:
  """The names a custom call's kernels run under, from its backend config: a Pallas
  Triton kernel's own name; for a Mosaic GPU call, its host function's name with
  "_kernel" (``ragged_dot_fwd_mosaic_gpu_kernel``, as ptxas names it in
  bench/compile_h200.py's reports). Neither was seen in a GPU profile yet (module doc, 1).
  """
  names = [m.decode() for m in _TRITON_KERNEL.findall(config)]
  names += [m.decode() + "_kernel" for m in _MOSAIC_GPU_FUNCTION.findall(config)
            if m != b"stable_mosaic_gpu"]  # the dialect's name, among the strings too
  return tuple(dict.fromkeys(names))


def _op_metadata(buf: memoryview) -> tuple[int, str | None]:
  """(stack frame id, innermost marker of its op_name scopes) of an OpMetadata."""
  frame, scope = 0, None
  for number, wire_type, value in _fields(buf):
    if number == 15 and wire_type == 0:
      frame = value
    elif number == 2 and wire_type == 2:
      # Cheap test first: most instructions of a program are no op's.
      op_name = _text(value)
      if SCOPE_PREFIX in op_name:
        scope = next(reversed(markers_in_op_name(op_name)), None)
  return frame, scope


def _sites(index: memoryview) -> Callable[[int], _Site]:
  """Maps a stack frame id of a module's stack frame index to its call site."""
  files, functions, locations, frames = [], [], [], []
  for number, _, value in _fields(index):
    if number in (1, 2):
      (files if number == 1 else functions).append(_text(value))
    elif number in (3, 4):  # ints only: a malformed field reads as unset
      fields = {n: v for n, w, v in _fields(value) if w == 0}
      (locations if number == 3 else frames).append(fields)

  def at(items: Sequence[object], one_based: int, default: object) -> object:
    return items[one_based - 1] if 0 < one_based <= len(items) else default

  @functools.cache
  def site(frame_id: int) -> _Site:
    stack, seen = [], set()  # innermost frame first
    while frame_id and frame_id not in seen:  # a cyclic (malformed) index stops
      seen.add(frame_id)
      frame = at(frames, frame_id, {})
      location = at(locations, frame.get(1, 0), {})
      stack.append((at(files, location.get(1, 0), ""),
                    at(functions, location.get(2, 0), ""), location.get(3, 0),
                    location.get(4, 0)))  # the column: two calls on one line are two
      frame_id = frame.get(2, 0)
    return _call_site(stack[::-1]), bool(stack) and _in_library(stack[0][0])

  return site


def _call_site(frames: Sequence[tuple[str, str, int, int]]) -> tuple:
  """The user frames of a stack (outermost first) that lead to an op's call.

  The stack ends at the op's outermost frame in this library's op modules: what JAX
  records inside an op's call can come from another call. It caches what it traced
  inside a call (the custom VJP, its backward pass) by function and input types, so
  an instruction of one call can carry, after the op's frames, the caller's frames of
  an earlier call with the same arguments: from another line, or another program.
  Frames of this library's other modules (autotuning), which may call user code that
  calls ops, are left out and the stack goes on.
  """
  user = []
  for frame in frames:
    module = _library_module(frame[0])
    if module is None:
      user.append(frame)
    elif module.startswith(_OP_MODULES):
      break
  return _without_repeats(user)


def _without_repeats(frames: Sequence[tuple[str, str, int, int]]) -> tuple:
  """`frames` with each run of a repeated sequence of frames kept once.

  JAX builds the stack of an instruction traced under several transformations (a
  custom VJP's backward pass) by repeating the caller's frames once per level, and
  the number of levels differs between instructions of one call.
  """
  frames = list(frames)
  size = 1
  while 2 * size <= len(frames):
    for start in range(len(frames) - 2 * size + 1):
      if frames[start:start + size] == frames[start + size:start + 2 * size]:
        del frames[start + size:start + 2 * size]
        size = 1  # a removal may form new repeats; look again from the start
        break
    else:
      size += 1
  return tuple(frames)


@functools.cache
def _library_modules() -> frozenset[str]:
  """The paths of this library's modules, relative to its package directory."""
  return frozenset(p.relative_to(_PACKAGE_ROOT).as_posix()
                   for p in _PACKAGE_ROOT.rglob("*.py"))


@functools.cache
def _library_module(file: str) -> str | None:
  """The library module that a traced frame's file is, wherever installed.

  Returns its path relative to the package directory, or None for any other file.
  """
  file = file.replace("\\", "/")
  marker = f"/{_PACKAGE_ROOT.name}/"
  starts = [m.end() for m in re.finditer(re.escape(marker), file)]
  return next((file[start:] for start in starts if file[start:] in _library_modules()),
              None)


def _in_library(file: str) -> bool:
  """Whether a traced frame's file is a module of this library, wherever installed."""
  return _library_module(file) is not None


def _restore_lost_markers(computations: _Computations) -> _Computations:
  """Marks what XLA's loop rewrites left unmarked (module doc, 2).

  Instructions come operands first, so a reverse pass sees every get-tuple-element
  before what it reads, and chains of them pass the marker on.
  """
  own = {(cid, i.id): i.marker for cid, insts in computations.items() for i in insts}
  for cid, instructions in computations.items():
    for inst in reversed(instructions):
      marker = own[cid, inst.id]
      if inst.opcode == "get-tuple-element" and marker is not None:
        for operand in inst.operand_ids:
          if own.get((cid, operand), marker) is None:
            own[cid, operand] = marker
  pending = [
      (called, own[cid, inst.id])
      for cid, instructions in computations.items() for inst in instructions
      if inst.opcode in _CONTROL_FLOW and own[cid, inst.id] is not None
      for called in inst.called_ids
  ]
  while pending:
    cid, marker = pending.pop()
    for inst in computations.get(cid, ()):
      if own[cid, inst.id] is None:
        own[cid, inst.id] = marker
        if inst.opcode in _CONTROL_FLOW:
          pending.extend((called, marker) for called in inst.called_ids)
  return {
      cid: [dataclasses.replace(i, marker=own[cid, i.id]) for i in instructions]
      for cid, instructions in computations.items()
  }


def _mark_from_scopes(computations: _Computations) -> _Computations:
  """Marks by op_name the ops whose attribute no instruction kept (module doc, 2):
  each instruction of such an op gets the marker of its innermost scope."""
  # An op with its attribute on some instruction is left to the attribute rules,
  # which were written for partly marked ops.
  attributed = {i.marker for insts in computations.values() for i in insts if i.marker}
  return {
      cid: [dataclasses.replace(i, marker=i.scope)
            if i.marker is None and i.scope is not None and i.scope not in attributed
            else i for i in instructions]
      for cid, instructions in computations.items()
  }


def _markers_by_instruction(
    computations: _Computations, *, bodies: bool = False) -> dict[str, frozenset[str]]:
  """Instruction name -> markers of its own HLO and of what it calls (module doc, 2);
  with `bodies`, of the loop and conditional bodies it runs too (module doc, 5)."""
  inside: dict[int, frozenset[str]] = {}

  def of_computation(cid: int) -> frozenset[str]:
    if cid not in inside:
      inside[cid] = frozenset()  # a cyclic (malformed) module stops here
      inside[cid] = frozenset().union(*map(of_instruction, computations.get(cid, ())))
    return inside[cid]

  def of_instruction(inst: _Instruction) -> frozenset[str]:
    own = frozenset([inst.marker] if inst.marker else [])
    if inst.opcode in _CONTROL_FLOW and not bodies:
      return own
    return own.union(*map(of_computation, inst.called_ids))

  return {
      inst.name: of_instruction(inst)
      for instructions in computations.values() for inst in instructions
  }


@dataclasses.dataclass(frozen=True)
class _Work:
  """The call sites of what one instruction runs (its HLO and what it calls).

  Attributes:
    marked: marker -> the sites of the instructions that carry it.
    library: the sites of the instructions traced from inside this library.
  """

  marked: Mapping[str, frozenset]
  library: frozenset


def _work(
    computations: _Computations, site: Callable[[int], _Site],
) -> Callable[[_Instruction], _Work]:
  """Returns the function that finds an instruction's `_Work` (module doc, 3)."""
  inside: dict[int, _Work] = {}

  def union(parts: Iterable[_Work]) -> _Work:
    marked, library = collections.defaultdict(set), set()
    for part in parts:
      for marker, sites in part.marked.items():
        marked[marker] |= sites
      library |= part.library
    return _Work({m: frozenset(s) for m, s in marked.items()}, frozenset(library))

  def of_computation(cid: int) -> _Work:
    if cid not in inside:
      inside[cid] = _Work({}, frozenset())  # a cyclic (malformed) module stops here
      inside[cid] = union(map(of_instruction, computations.get(cid, ())))
    return inside[cid]

  def of_instruction(inst: _Instruction) -> _Work:
    key, in_library = site(inst.frame)
    own = _Work({inst.marker: frozenset([key])} if inst.marker else {},
                frozenset([key] if in_library else []))
    if inst.opcode in _CONTROL_FLOW:
      return own
    return union([own, *map(of_computation, inst.called_ids)])

  return functools.cache(of_instruction)


def _value_numbers(
    computations: _Computations, roots: Mapping[int, int | None],
) -> dict[tuple[int, int], int]:
  """(computation id, instruction id) -> a number for the value it computes.

  Equal numbers mean the same computation on the same inputs, up to layout, shape and
  type (`_SAME_VALUE`): the copies of one instruction that XLA puts into each fusion
  that reads it get one number, and the work of two calls of an op gets two, since
  their inputs differ. A fused
  computation's parameters take their fusion's operands' numbers, and a fusion takes
  its root's, so numbers see through fusion boundaries.
  """
  numbers: dict[tuple[int, int], int] = {}
  fused = {called for insts in computations.values() for inst in insts
           if inst.opcode == "fusion" for called in inst.called_ids[:1]}

  def number(cid: int, parameters: Sequence[int] | None, depth: int = 0) -> None:
    for inst in computations.get(cid, ()):
      operands = tuple(numbers.get((cid, o), o) for o in inst.operand_ids)
      if inst.opcode == "parameter" and parameters is not None:
        value = (parameters[inst.index] if inst.index is not None
                 and inst.index < len(parameters) else hash((cid, inst.signature)))
      elif inst.opcode == "parameter":
        value = hash((cid, inst.signature))
      elif inst.opcode in _SAME_VALUE and len(operands) == 1:
        value = operands[0]
      elif inst.opcode == "fusion" and inst.called_ids and depth < 64:
        body = inst.called_ids[0]
        number(body, operands, depth + 1)
        value = numbers.get((body, roots.get(body)), hash((inst.signature, operands)))
      else:
        value = hash((inst.signature, operands))
      numbers[cid, inst.id] = value

  for cid in computations:
    if cid not in fused:
      number(cid, None)
  return numbers


def _loop_result(inst: _Instruction, by_id: Mapping[int, _Instruction]) -> bool:
  """Whether `inst` reads a result of a loop, conditional or call that lost its marker
  (XLA:CPU keeps the marker of an op built on a loop only where its result is read)."""
  return inst.opcode == "get-tuple-element" and any(
      (source := by_id.get(o)) is not None and source.opcode in _SEQUENCE_CALLERS
      and source.marker is None for o in inst.operand_ids)


def _users(inst: _Instruction) -> bool:
  """Whether an instruction is the user's work: traced from somewhere (XLA creates some
  instructions with no metadata) and no op's by its marker or op_name. Work that JAX
  adds inside this library, like summing the cotangents of an input that several calls
  read, is the user's here."""
  return inst.marker is None and inst.scope is None and inst.frame != 0


# What reaches the root of a computation that runs as a sequence: read by its caller.
_LEAVES = None


def _readers_through_fusions(
    computations: _Computations, roots: Mapping[int, int | None], cid: int,
) -> Callable[[int, _Instruction], list[tuple[_Instruction | None, _Instruction]]]:
  """Returns the function that finds who reads an instruction's result in computation
  `cid` or the fusions it runs: the instructions that compute with it, looking
  through data movement and into and out of fusions (`_LEAVES` for its root), each
  with what it reads: the result, or what data movement made of it."""
  fusion_of: dict[int, tuple[int, _Instruction]] = {}  # fused computation -> caller
  readers: dict[tuple[int, int], list[_Instruction]] = collections.defaultdict(list)
  parameters: dict[tuple[int, int], list[_Instruction]] = collections.defaultdict(list)
  pending = [cid]
  while pending:
    current = pending.pop()
    for inst in computations.get(current, ()):
      for operand in inst.operand_ids:
        readers[current, operand].append(inst)
      if inst.opcode == "parameter" and inst.index is not None:
        parameters[current, inst.index].append(inst)
      if inst.opcode == "fusion" and inst.called_ids and inst.called_ids[0] not in fusion_of:
        fusion_of[inst.called_ids[0]] = (current, inst)
        pending.append(inst.called_ids[0])

  def read_by(home: int, inst: _Instruction) -> list[tuple[_Instruction | None, _Instruction]]:
    # (computation, instruction, the tuple index it is read at when inside a tuple, what
    # its readers read: the last instruction on the way that is not a tuple)
    pending: list[tuple[int, _Instruction, int | None, _Instruction]] = [
        (home, inst, None, inst)]
    seen, found = set(), []
    while pending:
      current, value, element, shown = pending.pop()
      if (current, value.id, element) in seen:
        continue
      seen.add((current, value.id, element))
      if value.id == roots.get(current):
        if current in fusion_of:
          pending.append((*fusion_of[current], element, shown))
        else:
          found.append((_LEAVES, shown))
      for reader in readers[current, value.id]:
        if reader.opcode == "get-tuple-element" and element is not None:
          if reader.index == element:
            pending.append((current, reader, None, shown))
        elif reader.opcode == "tuple":
          pending.append((current, reader, reader.operand_ids.index(value.id), shown))
        elif reader.opcode == "fusion" and reader.called_ids:
          body = reader.called_ids[0]
          for position, operand in enumerate(reader.operand_ids):
            if operand == value.id:
              pending.extend((body, p, element, shown) for p in parameters[body, position])
        elif reader.opcode in _DATA_MOVEMENT:
          pending.append((current, reader, element, reader if element is None else shown))
        else:
          found.append((reader, shown))
    return found

  return read_by


def _outputs(
    computations: _Computations, roots: Mapping[int, int | None],
    site: Callable[[int], _Site],
) -> Callable[[int], dict[tuple[str, object], dict[tuple, set[int]]]]:
  """Returns the function that finds the op calls' results in one computation that runs
  as a sequence (module doc, 4).

  A result is a marked instruction's value (in the computation or in a fusion it runs)
  that work other than its own op call's reads, or that leaves the computation. They
  are returned as (marker, call site) -> (stack frame, the shapes it is read in) ->
  value numbers.
  """
  numbers = _value_numbers(computations, roots)

  @functools.cache
  def op_inputs(body: int) -> frozenset[int]:
    """The parameters of fused computation `body` that its root reads other than
    through the user's work (`_users`)."""
    by_id = {inst.id: inst for inst in computations.get(body, ())}
    reached, seen, pending = set(), set(), [roots.get(body)]
    while pending:
      inst = by_id.get(pending.pop())
      if inst is None or inst.id in seen or _users(inst):
        continue
      seen.add(inst.id)
      if inst.opcode == "parameter" and inst.index is not None:
        reached.add(inst.index)
      pending.extend(inst.operand_ids)
    return frozenset(reached)

  def outputs(cid: int) -> dict[tuple[str, object], dict[tuple, set[int]]]:
    read_by = _readers_through_fusions(computations, roots, cid)
    # Results read by the user's work or leaving the computation; and those
    # read only by other op calls, which count where a call has none of the first kind.
    to_user: dict = collections.defaultdict(lambda: collections.defaultdict(set))
    to_ops: dict = collections.defaultdict(lambda: collections.defaultdict(set))
    # Each call's own data flow: its values, and (value, operand value) edges.
    own_values: dict = collections.defaultdict(set)
    own_edges: dict = collections.defaultdict(list)
    pending = [cid]
    while pending:
      current = pending.pop()
      by_id = {inst.id: inst for inst in computations.get(current, ())}
      for inst in computations.get(current, ()):
        if inst.opcode == "fusion":
          pending.extend(inst.called_ids[:1])
        op = inst.marker or inst.scope
        if op is None:
          continue
        call = (op, site(inst.frame)[0])
        number = numbers[current, inst.id]
        own_values[call].add(number)
        operands = inst.operand_ids
        if inst.opcode == "fusion" and inst.called_ids:
          # Only what its root computes from without the user's work: a fusion can hold
          # two calls with the user's work between (small arrays, XLA recomputing one
          # call's result in the next's fusion), and is no step of one from the other.
          reached = op_inputs(inst.called_ids[0])
          operands = tuple(o for i, o in enumerate(operands) if i in reached)
        own_edges[call] += [(number, numbers.get((current, o), o)) for o in operands]
        if inst.opcode in _NOT_VALUES and not _loop_result(inst, by_id):
          continue
        readers = read_by(current, inst)
        if read := [value for r, value in readers if r is _LEAVES or _users(r)]:
          found = to_user
        elif read := [value for r, value in readers
                      if (r.marker or r.scope, site(r.frame)[0]) != call]:
          found = to_ops
        else:
          continue
        # Grouped by the shapes its readers read it in: two results of one call can
        # share a frame and a shape, until one is transposed (a matmul's d x and d w).
        shapes = tuple(sorted({value.shape for value in read}))
        found[call][inst.frame, shapes].add(number)
    results = {call: to_user.get(call) or to_ops[call] for call in {*to_user, *to_ops}}
    # Several results of one call can share a frame and a shape (attention's dq, dk and
    # dv where q, k and v are one array): `_one_per_call` keeps one of each call's.
    for call, groups in results.items():
      sources = _sources_of(own_values[call], own_edges[call])
      results[call] = {key: _one_per_call(values, sources) for key, values in groups.items()}
    return results

  return outputs


def _sources_of(values: set[int], edges: Sequence[tuple[int, int]]
                ) -> Callable[[int], tuple[frozenset[int], frozenset[int]]]:
  """A function from a value of an op call's work to what it was computed from,
  following `edges` (value, operand): (the values outside that work, those not in
  `values`; the values of that work)."""
  operands: dict[int, set[int]] = collections.defaultdict(set)
  for value, operand in edges:
    if value != operand:
      operands[value].add(operand)

  @functools.cache
  def sources(value: int) -> tuple[frozenset[int], frozenset[int]]:
    inputs, seen, pending = set(), set(), [value]
    while pending:
      for operand in operands.get(pending.pop(), ()):
        if operand not in values:
          inputs.add(operand)
        elif operand not in seen:
          seen.add(operand)
          pending.append(operand)
    return frozenset(inputs), frozenset(seen)

  return sources


def _one_per_call(values: set[int], sources: Callable[[int], tuple[frozenset[int], frozenset[int]]]
                  ) -> set[int]:
  """One of `values` (results of one call site at one frame and shape) per call: two
  results are one call's when they share a step of the op's work that read all the
  inputs of one of them (attention's dq and dk both grew from the scores' gradient, which
  read q, k, v and dout). Two calls of one line may share work on common inputs (a mask
  from the group sizes), never work that read one call's own inputs."""
  def one_call(a: int, b: int) -> bool:
    shared = sources(a)[1] & sources(b)[1]
    return any(sources(step)[0] in (sources(a)[0], sources(b)[0]) for step in shared)

  ordered = sorted(values)
  links = ((a, b) for i, a in enumerate(ordered) for b in ordered[i + 1:] if one_call(a, b))
  return {min(group) for group in _connected(ordered, links)}


def _sequences(
    computations: _Computations, entry: int, markers: Mapping[str, frozenset[str]],
    work: Callable[[_Instruction], _Work],
    outputs: Callable[[int], Mapping[tuple[str, object], Mapping[tuple, set[int]]]],
) -> dict[int, _Sequence]:
  """The computations that run as sequences, with the calls of each (module doc, 4)."""
  # computation -> (parent, trip count, markers of the loops and calls around it)
  found: dict[int, tuple[int | None, int | None, frozenset[str]]] = {
      entry: (None, None, frozenset())}
  branches: dict[int, tuple[int, ...]] = {}  # a conditional's branch -> the others
  pending = [entry]
  while pending:
    cid = pending.pop()
    around = found[cid][2]
    for inst in computations.get(cid, ()):
      if inst.opcode not in _SEQUENCE_CALLERS:
        continue
      for i, called in enumerate(inst.called_ids):
        if called not in found:
          trips = inst.trip_count if inst.opcode == "while" and i == 0 else None
          found[called] = (cid, trips, around | markers[inst.name])
          pending.append(called)
          if inst.opcode == "conditional":
            branches[called] = tuple(c for c in inst.called_ids if c != called)
  sites = {cid: _marked_sites(computations.get(cid, ()), around, work)
           for cid, (_, _, around) in found.items()}
  # Work XLA hoisted out of a loop (loop-invariant code motion: a causal mask built
  # before a scan over layers) keeps the call site of the calls in the loop; where the
  # loop's caller has such a (marker, site), it is those calls' work, no call of its own.
  below: dict[int, set[tuple[str, object]]] = collections.defaultdict(set)
  for cid in found:
    parent = found[cid][0]
    while parent is not None:
      below[parent] |= {(m, s) for m, found_sites in sites[cid].items() for s in found_sites}
      parent = found[parent][0]
  return {
      cid: _Sequence(parent, trips, _calls(sites[cid], below[cid], outputs(cid)),
                     branches.get(cid, ()))
      for cid, (parent, trips, around) in found.items()
  }


def _marked_sites(instructions: Sequence[_Instruction], around: frozenset[str],
                  work: Callable[[_Instruction], _Work]) -> dict[str, set]:
  """Marker -> the call sites of its marked work in one computation, but for the
  markers of the loops and calls around it (counted there)."""
  sites: dict[str, set] = collections.defaultdict(set)
  for inst in instructions:
    for marker, found in work(inst).marked.items():
      if marker not in around:
        sites[marker] |= found
  return sites


def _calls(
    sites: Mapping[str, set], hoisted: set[tuple[str, object]],
    results: Mapping[tuple[str, object], Mapping[tuple, set[int]]],
) -> dict[str, int]:
  """Marker -> the number of its calls in one computation (module doc, 4), from its
  call sites there less those of calls in the loops it runs (`hoisted`), and the
  results of the calls of each site (`_outputs`)."""
  calls = {}
  for marker, found in sites.items():
    known = {key for key in found - {()} if (marker, key) not in hoisted}
    if not known and found - {()}:
      continue  # all of it hoisted out of loops below
    calls[marker] = sum(
        min(map(len, results.get((marker, key), {}).values()), default=1)
        for key in known) or 1
  return calls


def _shares(
    computations: _Computations, instructions: Sequence[_Instruction],
    work: Callable[[_Instruction], _Work],
) -> dict[str, frozenset[str]]:
  """Unmarked instruction -> markers of its call site joined to it (module doc, 5)."""
  by_id = {inst.id: inst for inst in instructions}
  movement = {inst.id for inst in instructions if _moves_data(inst, computations)}
  # (marker, site) -> its marked instructions; site -> unmarked work traced from it.
  members: dict[tuple[str, object], list[_Instruction]] = collections.defaultdict(list)
  helpers: dict[object, list[_Instruction]] = collections.defaultdict(list)
  for inst in instructions:
    if inst.id not in movement:
      found = work(inst)
      for marker, keys in found.marked.items():
        for key in keys - {()}:
          members[marker, key].append(inst)
      for key in found.library if not found.marked else ():
        helpers[key].append(inst)
  shares: dict[str, set[str]] = collections.defaultdict(set)
  for (marker, key), marked in members.items():
    names = {inst.name for inst in marked}
    for group in _joined([*marked, *helpers[key]], by_id, movement):
      if group & names:
        for name in group - names:
          shares[name].add(marker)
  return {name: frozenset(markers) for name, markers in shares.items()}


def _joined(
    nodes: Sequence[_Instruction], by_id: Mapping[int, _Instruction], movement: set[int],
) -> list[set[str]]:
  """Groups `nodes` that produce for one another, directly or through data movement."""
  names = {inst.name for inst in nodes}
  return _connected(names, ((source.name, inst.name) for inst in nodes
                            for source in _producers(inst, by_id, movement)
                            if source.name in names))


def _connected(nodes: Iterable[Any], links: Iterable[tuple[Any, Any]]) -> list[set[Any]]:
  """The groups of `nodes` that `links` (pairs of nodes) join, directly or in a chain."""
  parent = {node: node for node in nodes}

  def root(node: Any) -> Any:
    while parent[node] != node:
      parent[node] = parent[parent[node]]
      node = parent[node]
    return node

  for a, b in links:
    parent[root(a)] = root(b)
  groups: dict[Any, set[Any]] = collections.defaultdict(set)
  for node in parent:
    groups[root(node)].add(node)
  return list(groups.values())


def _enclosing(computations: _Computations) -> dict[str, frozenset[str]]:
  """Instruction name -> the non-fusion instructions whose computations it runs in."""
  callers: dict[int, list[_Instruction]] = collections.defaultdict(list)
  for instructions in computations.values():
    for inst in instructions:
      if inst.opcode != "fusion":
        for called in inst.called_ids:
          callers[called].append(inst)
  home = {inst.name: cid for cid, insts in computations.items() for inst in insts}
  around: dict[int, frozenset[str]] = {}

  def of_computation(cid: int) -> frozenset[str]:
    if cid not in around:
      around[cid] = frozenset()  # a cyclic (malformed) module stops here
      around[cid] = frozenset(
          name for caller in callers[cid]
          for name in (caller.name, *of_computation(home[caller.name])))
    return around[cid]

  return {name: of_computation(cid) for name, cid in home.items()}


def _moves_data(inst: _Instruction, computations: _Computations) -> bool:
  """Whether an unmarked instruction only moves data (a fusion of such included)."""
  if inst.marker is not None:
    return False
  if inst.opcode == "fusion":
    inner = [i for cid in inst.called_ids for i in computations.get(cid, ())]
    return all(i.opcode in _DATA_MOVEMENT | {"parameter"} for i in inner)
  return inst.opcode in _DATA_MOVEMENT


def _producers(
    inst: _Instruction, by_id: Mapping[int, _Instruction], movement: set[int],
) -> list[_Instruction]:
  """The instructions whose results `inst` consumes, looking through data movement."""
  pending, seen, found = list(inst.operand_ids), set(), []
  while pending:
    iid = pending.pop()
    if iid in seen or iid not in by_id:
      continue
    seen.add(iid)
    if iid in movement:
      pending.extend(by_id[iid].operand_ids)
    else:
      found.append(by_id[iid])
  return found
# -- events --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Event:
  name: str
  duration_ns: float
  hlo_op: str
  program_id: int | None
  module: str | None
  run: tuple[str, object, int] | None  # (plane, device_ordinal, run_id), if known
  plane: str = ""
  start_ns: float = 0.0

  def names(self) -> tuple[int | None, str | None]:
    """(program_id, module name) of the program this event ran in: the id from its
    stat, or from a module named "<name>(<id>)", whose name is then "<name>"."""
    program_id, module = self.program_id, self.module
    if module is not None and (match := _MODULE_WITH_ID.match(module)):
      program_id = program_id if program_id is not None else int(match["id"])
      module = match["name"]
    return program_id, module

  def program(self) -> int | str | None:
    """The program this event ran in: its program_id, else its module name (None if
    it has neither)."""
    program_id, module = self.names()
    return program_id if program_id is not None else module


def _op_events(space: profiler.ProfileData, *, device_work: bool = False) -> list[_Event]:
  """The events of XLA instructions (module doc, 1); with `device_work`, also the device
  planes' events that name only their program (a kernel or copy of it without an
  instruction, as in a CUDA graph): they are its device work too (hlo_op "")."""
  device, other = [], []
  # jaxlib's iterator types warn once, when first built, that they lack __module__.
  with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", r"builtin type \w+ has no __module__", DeprecationWarning)
    for plane in space.planes:
      if plane.name == _METADATA_PLANE:
        continue
      on_device = plane.name.startswith(_DEVICE_PLANE_PREFIX)
      target = device if on_device else other
      program_only = device_work and on_device
      for line in plane.lines:
        named_by_event = program_only and line.name == _TPU_PROGRAM_LINE
        target.extend(e for e in (_event(plane.name, e, program_only,
                                         named_by_event=named_by_event)
                                  for e in line.events) if e)
  return device or other


def _event(plane: str, event: profiler.ProfileEvent, program_only: bool = False, *,
           named_by_event: bool = False) -> _Event | None:
  """The event as an `_Event`, or None where it names no instruction (nor, with
  `program_only`, a program). `named_by_event`: the event's own name is its program's
  module, "<name>(<id>)" (a TPU's "XLA Modules" line)."""
  stats = dict(event.stats)
  hlo_op = stats.get("hlo_op")
  program_id, module, run_id = (
      stats.get("program_id"), stats.get("hlo_module"), stats.get("run_id"))
  if named_by_event and module is None:
    # The number in parentheses is no program_id (it exceeds 2**63: a fingerprint).
    match = _MODULE_WITH_ID.match(event.name)
    module = match["name"] if match else event.name
  if not isinstance(hlo_op, str):
    if not (program_only and (isinstance(program_id, int) or isinstance(module, str))):
      return None
    hlo_op = ""
  return _Event(
      name=event.name, duration_ns=event.duration_ns, hlo_op=hlo_op,
      program_id=program_id if isinstance(program_id, int) else None,
      module=module if isinstance(module, str) else None,
      run=((plane, stats.get("device_ordinal"), run_id)
           if isinstance(run_id, int) else None),
      plane=plane, start_ns=event.start_ns)


class _ProgramIndex:
  """Finds the program of an event: by program_id, else by module name.

  A module's program_ids are not trusted where one of its events carries an id that
  names no program of that module in the file: programs that JAX loaded from its
  persistent compilation cache keep, in XLA:CPU's events, the ids of the process that
  compiled them, and such an id may name another program of the file, even one of the
  same module compiled for other inputs. All events of such a module are found by its
  name.
  """

  def __init__(self, programs: Iterable[_Program], events: Iterable[_Event]):
    self.by_id: dict[int, _Program] = {}
    self.by_name: dict[str, list[_Program]] = collections.defaultdict(list)
    for program in programs:
      self.by_id[program.program_id] = program
      self.by_name[program.name].append(program)
    self.foreign_ids: dict[str, set[int]] = collections.defaultdict(set)
    for event in events:
      program_id, module = event.names()
      if program_id is not None and module is not None and not self._is_of(program_id, module):
        self.foreign_ids[module].add(program_id)

  def _is_of(self, program_id: int, module: str) -> bool:
    """Whether `program_id` names a program of module `module` in the file."""
    program = self.by_id.get(program_id)
    return program is not None and program.name == module

  def programs_of(self, event: _Event) -> list[_Program]:
    """The programs `event` may belong to, by its program_id or module name."""
    program_id, module = event.names()
    if program_id in self.by_id and (module is None or module not in self.foreign_ids):
      return [self.by_id[program_id]]
    return self.by_name.get(module, [])


class _Tally:
  """Adds up the events of one file per marker (module doc, 4 and 5)."""

  def __init__(self, index: _ProgramIndex):
    self.index = index
    # program_id -> instruction -> its events
    self.events: dict[int, dict[str, list[_Event]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    self.ran: collections.Counter[str] = collections.Counter()
    self.ambiguous = 0
    # The modules of ambiguous events whose program_ids were not trusted (_ProgramIndex).
    self.untrusted: set[str] = set()
    # (program_id, kernel name) -> events of it seen so far (_found).
    self.turns: collections.Counter[tuple[int, str]] = collections.Counter()

  def _found(self, event: _Event) -> tuple[_Event, list[_Program]]:
    """`event` and the programs it may belong to that hold its instruction; where its
    hlo_op names no instruction of its programs (module doc, 1: a command buffer's
    kernel), with the instruction its kernel name gives. A kernel that alike fusions share goes to each of them in turn (in the HLO's
    order), so each is counted once per run and their time is shared among them."""
    programs = self.index.programs_of(event)
    holding = [p for p in programs if event.hlo_op in p.markers]
    if holding:
      return event, holding
    for program in programs:
      instructions = program.kernels.get(event.name)
      if instructions:
        turn = self.turns[program.program_id, event.name]
        self.turns[program.program_id, event.name] += 1
        event = dataclasses.replace(event, hlo_op=instructions[turn % len(instructions)])
        return event, [p for p in programs if event.hlo_op in p.markers]
    return event, []

  def add(self, event: _Event) -> None:
    """Files `event` under its program and instruction."""
    event, candidates = self._found(event)
    if not candidates:
      self.ran[event.module or f"program {event.program_id}"] += 1
      return
    program = candidates[0]
    self.ran[f"{program.name}({program.program_id})"] += 1
    ops = program.ops_of(event.hlo_op)
    if any(p.ops_of(event.hlo_op) != ops for p in candidates):
      self.ambiguous += 1
      if program.name in self.index.foreign_ids:
        self.untrusted.add(program.name)
    elif len(candidates) == 1 or ops:
      self.events[program.program_id][event.hlo_op].append(event)
    # Else it is no op's work in any of its programs: it tells no op's time, and filed
    # under one of them it would count that program's calls for the runs of another.

  def result(self) -> dict[str, tuple[int, float]]:
    """Marker -> (count, time in ns) of the ops of every program that ran."""
    counts: collections.Counter[str] = collections.Counter()
    time_ns: dict[str, float] = collections.defaultdict(float)
    for program_id, events in self.events.items():
      program = self.index.by_id[program_id]
      counts.update(_Runs(program, events).counts())
      for marker, duration in _times(program, events).items():
        time_ns[marker] += duration
    return {m: (n, time_ns[m]) for m, n in counts.items() if n}

  def describe_no_ops(self) -> str:
    """Why no op was found: what ran, and which programs hold markers."""
    if not self.ran:
      return ("the profile holds no events of XLA instructions (no 'hlo_op' stat); "
              "were the programs run inside jax.profiler.trace?")
    ran = ", ".join(f"{name} ({n} events)" for name, n in sorted(self.ran.items()))
    marked = sorted(
        f"{p.name}({p.program_id})" for p in self.index.by_id.values()
        if any(s.calls for s in p.sequences.values()))
    message = (f"the profile contains no stellarax ops: no program that ran holds an "
               f"instruction with the frontend attribute {MARKER_KEY!r} or a "
               f"{SCOPE_PREFIX!r} scope in its op_name. Programs that ran: {ran}.")
    if marked:
      message += f" Programs whose stellarax ops did not run: {', '.join(marked)}."
    if self.ambiguous:
      message += f" Also, {self.describe_ambiguous()}"
    return message

  def describe_ambiguous(self) -> str:
    """Why events were left out as ambiguous, and what to do."""
    why = (f"{self.ambiguous} events were left out: several programs of their module name "
           "hold an instruction of their name with different markers (one function compiled "
           "for several inputs), and ")
    if not self.untrusted:
      return why + "the events carry no program_id to tell which one ran."
    ids = "; ".join(f"{module}: {', '.join(map(str, sorted(self.index.foreign_ids[module])))}"
                    for module in sorted(self.untrusted))
    return why + (
        f"their program_ids do not tell: some name no program of their module in this "
        f"profile ({ids}), as where JAX loaded the programs from its persistent "
        "compilation cache (XLA:CPU's events keep the ids of the process that compiled "
        "them). Profile a run that compiles its programs itself: "
        "jax.config.update('jax_enable_compilation_cache', False) before the first call.")


class _Runs:
  """How often each computation of a program ran in one file (module doc, 4)."""

  def __init__(self, program: _Program, events: Mapping[str, Sequence[_Event]]):
    self.program = program
    self.executions = len({e.run for found in events.values() for e in found if e.run})
    # computation id -> (instruction, event name) -> number of events
    self.kernels: dict[int, collections.Counter[tuple[str, str]]] = {}
    for name, found in events.items():
      kernels = self.kernels.setdefault(program.home[name], collections.Counter())
      kernels.update((name, e.name) for e in found)
    self.memo: dict[int, int] = {}

  def counts(self) -> dict[str, int]:
    """Marker -> runs x calls, summed over the program's computations."""
    counts: collections.Counter[str] = collections.Counter()
    for cid, sequence in self.program.sequences.items():
      runs = self.of(cid)
      for marker, calls in sequence.calls.items():
        counts[marker] += runs * calls
    return dict(counts)

  def of(self, cid: int) -> int:
    """How often computation `cid` ran."""
    if cid not in self.memo:
      self.memo[cid] = 0  # a cyclic (malformed) module stops here
      self.memo[cid] = self._find(cid)
    return self.memo[cid]

  def _find(self, cid: int) -> int:
    sequence = self.program.sequences[cid]
    if sequence.parent is None:
      # Without run_id: the entry's events tell the runs, else any computation's.
      return (self.executions or self._fewest_events(cid)
              or min(min(kernels.values()) for kernels in self.kernels.values()))
    parent = self.of(sequence.parent)
    if sequence.trip_count is not None:
      return parent * sequence.trip_count
    own = self._fewest_events(cid)
    if own or not sequence.other_branches:
      return own or parent
    # A branch with no events of its own ran when its conditional ran and no other branch
    # did; where no branch has events, that cannot be told, and it ran as its parent did.
    others = [self._fewest_events(b) for b in sequence.other_branches]
    return max(0, parent - sum(others)) if any(others) else parent

  def _fewest_events(self, cid: int) -> int:
    """The fewest events of one (instruction, event name) of computation `cid`."""
    return min(self.kernels.get(cid, {}).values(), default=0)


def _times(program: _Program, events: Mapping[str, Sequence[_Event]]) -> dict[str, float]:
  """Marker -> the time (ns) of the program's events that goes to it (module doc, 5)."""
  time_ns: dict[str, float] = collections.defaultdict(float)
  # Instructions that events ran inside of: loops and calls whose bodies ran as events.
  with_inner_events = frozenset().union(*(program.enclosing[name] for name in events))
  for name, found in events.items():
    # With no events inside it, an instruction ran its loops' bodies in its own events.
    own = program.markers if name in with_inner_events else program.markers_with_bodies
    markers = own[name] or program.shares.get(name, frozenset())
    for marker in markers:
      counted_outside = any(
          marker in (program.markers[outer] or program.shares.get(outer, frozenset()))
          and outer in events for outer in program.enclosing[name])
      if not counted_outside:
        time_ns[marker] += sum(e.duration_ns for e in found) / len(markers)
  return dict(time_ns)
