"""Which stellarax ops ran in an XProf profile, how often, and for how long.

`jax.profiler.trace(dir)` writes ``dir/plugins/profile/<timestamp>/<host>.xplane.pb``, a
serialized ``XSpace`` protobuf: a list of planes, each with lines of timed events.

What a profile holds (jax 0.11.2):

- ``/host:metadata``: no lines. Its event metadata holds one entry per compiled program,
  named ``"<module>(<program_id>)"``, with the stats ``program_id`` and ``Hlo Proto`` (the
  serialized ``xla.HloProto`` of the optimized, scheduled module). The HLO instructions
  carry ``frontend_attributes``, and so our markers. `jax.profiler.ProfileData` does not
  expose event metadata, so this plane is read here with a small protobuf reader.
- CPU: ``/host:CPU``. Line ``python`` has PjRt host work and Python frames; lines
  ``tf_XLAPjRtCpuClient/<tid>`` and ``tf_XLAEigen/<tid>`` are XLA:CPU worker threads, where
  each executed thunk is one event named after its top-level HLO instruction, with stats
  ``hlo_op``, ``hlo_module``, ``program_id``, ``run_id`` and ``device_ordinal``.
- GPU (from XLA's CUPTI collector; not yet checked against a real profile here):
  ``/device:GPU:<n>`` planes, one line per stream, one event per kernel, memcpy or
  memset, with stats parsed from XLA's annotations: ``hlo_op``, ``hlo_module``,
  ``program_id`` (when XLA knows it), ``tf_op``, ``kernel_details``. Host planes hold
  the launches, which are not device time.

How events become op calls:

1. Events are the ones with an ``hlo_op`` stat on ``/device:*`` planes; a profile with
   none there (CPU) uses the other planes instead.
2. An event names a program by ``program_id``, or else by ``hlo_module``, and an
   instruction of it by ``hlo_op``. The instruction runs the work of its own HLO and of
   the computations it calls (fusion bodies, reducers, wrapped calls), but not of
   ``while``/``conditional`` bodies, which run as events of their own. Its markers are
   the ``stellarax_op`` attributes found on that work. XLA propagates the attribute
   unevenly (a pass that rewrites an instruction may drop it), hence three rules: a
   fusion counts when any instruction inside it is marked; an unmarked instruction whose
   result a marked ``get-tuple-element`` reads is the op's (XLA:CPU keeps the marker of
   an op built on a loop only there); and a marked loop or conditional marks its bodies.
3. Time: each event's duration goes to its instruction's markers, split evenly when a
   kernel holds parts of several ops (XLA fused them). An event is left out for a marker
   when an enclosing ``while``/``conditional``/``call`` of the same marker has events of
   its own (XLA:CPU times a loop thunk and, inside it, each body thunk).
4. Count: the op's calls are found in the HLO, then each call's executions in the events.
   A call is a group of marked instructions of one computation, joined where one
   consumes what the other produced (directly or through unmarked data movement such as
   ``bitcast`` or ``get-tuple-element``) and the producer's own attribute is the marker:
   a call that compiles to a preparation fusion and a kernel is one call, while a matmul
   whose fused epilogue belongs to another op does not join the next matmul. A call's
   executions are those of its most executed instruction, and an instruction's
   executions are the number of events of its rarest event name, so an instruction that
   launches two kernels counts once. Counts add up over runs, loop trips and devices.

Limits of the count: calls of the same op with the same arguments that feed each other
directly (``f(f(x))``), or that XLA fused into one kernel, count as one call. On GPU an
op built on a loop counts once per loop trip, since the ``while`` launches nothing.
A profile without the HLO (no metadata plane) cannot be read: events carry instruction
names, never frontend attributes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping, Sequence
import dataclasses
import os
import pathlib
import re
import warnings

from jax import profiler

MARKER_KEY = "stellarax_op"
"""The frontend attribute under which each op call leaves its marker."""

_METADATA_PLANE = "/host:metadata"
_DEVICE_PLANE_PREFIX = "/device:"
_HLO_PROTO_STAT = "hlo proto"  # compared lowercased: XLA writes "Hlo Proto"
_CONTROL_FLOW = frozenset({"while", "conditional"})
# Instructions that only move or relabel data: never a call of their own.
_DATA_MOVEMENT = frozenset({
    "bitcast", "bitcast-convert", "copy", "copy-done", "copy-start",
    "get-tuple-element", "optimization-barrier", "reshape", "transpose", "tuple",
})
_MODULE_WITH_ID = re.compile(r"^(?P<name>.*)\((?P<id>\d+)\)$")


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
    One `OpCall` per marker that ran, by device time, longest first.

  Raises:
    ProfileError: the path is missing or holds no profile; a file is not a profile, is
      truncated or corrupt, embeds no HLO; or no stellarax op ran in it.
  """
  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  for file in _profile_files(pathlib.Path(path)):
    for marker, (count, time_ns) in _read_file(file).items():
      totals[marker][0] += count
      totals[marker][1] += time_ns
  calls = [OpCall(m, int(c), t * 1e-9) for m, (c, t) in totals.items()]
  return sorted(calls, key=lambda call: (-call.device_time_s, call.marker))


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
  tally = _Tally(_ProgramIndex(programs))
  for event in events:
    tally.add(event)
  result = tally.result()
  if not result:
    raise ProfileError(f"{path}: {tally.describe_no_ops()}")
  if tally.ambiguous:
    warnings.warn(f"{path}: {tally.describe_ambiguous()}", RuntimeWarning, stacklevel=4)
  return result


def _load(path: pathlib.Path) -> tuple[list[_Event], list[_Program]]:
  """The instruction events of one file and the programs whose HLO it embeds."""
  try:
    data = path.read_bytes()
  except OSError as e:
    raise ProfileError(f"{path}: cannot be read: {e}") from e
  metadata = _metadata_plane(data, path)
  try:
    events = _op_events(profiler.ProfileData.from_serialized_xspace(data))
  except RuntimeError as e:
    raise ProfileError(f"{path}: corrupt profile, XSpace does not parse: {e}") from e
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
#   HloModuleProto: name=1, computations=3.
#   HloComputationProto: instructions=2, id=5.
#   HloInstructionProto: name=1, opcode=2, id=35, operand_ids=36,
#     called_computation_ids=38, frontend_attributes=68.
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


_Computations = Mapping[int, Sequence[_Instruction]]


@dataclasses.dataclass(frozen=True)
class _Program:
  """A compiled program: which markers each instruction runs, and the op calls.

  Attributes:
    program_id: XLA's id of the program in its process.
    name: the HLO module name (``hlo_module`` in events).
    markers: instruction name -> markers of the work it runs (empty when unmarked).
    enclosing: instruction name -> the loops, conditionals and calls it runs inside.
    calls: marker -> one set of instruction names per call of the op.
  """

  program_id: int
  name: str
  markers: Mapping[str, frozenset[str]]
  enclosing: Mapping[str, frozenset[str]]
  calls: Mapping[str, tuple[frozenset[str], ...]]


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
  name, computations = "", {}
  for number, _, value in _fields(module):
    if number == 1:
      name = _text(value)
    elif number == 3:
      cid, instructions = _computation(value)
      computations[cid] = instructions
  program_id = stats.get("program_id")
  if not isinstance(program_id, int):
    match = _MODULE_WITH_ID.match(entry_name)
    program_id = int(match["id"]) if match else -1
  computations = _restore_lost_markers(computations)
  markers = _markers_by_instruction(computations)
  return _Program(program_id, name, markers, _enclosing(computations),
                  _calls(computations, markers))


def _computation(buf: memoryview) -> tuple[int, list[_Instruction]]:
  """(id, instructions) of one HloComputationProto."""
  cid, instructions = 0, []
  for number, _, value in _fields(buf):
    if number == 5:
      cid = value
    elif number == 2:
      instructions.append(_instruction(value))
  return cid, instructions


def _instruction(buf: memoryview) -> _Instruction:
  """The fields of one HloInstructionProto that are read here."""
  name = opcode = ""
  iid, operands, called, marker = 0, [], [], None
  for number, wire_type, value in _fields(buf):
    if number == 1:
      name = _text(value)
    elif number == 2:
      opcode = _text(value)
    elif number == 35:
      iid = value
    elif number == 36:
      operands += _ints(wire_type, value)
    elif number == 38:
      called += _ints(wire_type, value)
    elif number == 68:
      for _, _, entry in _fields(value):
        key, text = _map_entry(entry)
        if key is not None and _text(key) == MARKER_KEY:
          marker = _text(text or b"")
  return _Instruction(name, opcode, iid, tuple(operands), tuple(called), marker)


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


def _markers_by_instruction(computations: _Computations) -> dict[str, frozenset[str]]:
  """Instruction name -> markers of its own HLO and of what it calls (module doc, 2)."""
  inside: dict[int, frozenset[str]] = {}

  def of_computation(cid: int) -> frozenset[str]:
    if cid not in inside:
      inside[cid] = frozenset()  # a cyclic (malformed) module stops here
      inside[cid] = frozenset().union(*map(of_instruction, computations.get(cid, ())))
    return inside[cid]

  def of_instruction(inst: _Instruction) -> frozenset[str]:
    own = frozenset([inst.marker] if inst.marker else [])
    if inst.opcode in _CONTROL_FLOW:
      return own
    return own.union(*map(of_computation, inst.called_ids))

  return {
      inst.name: of_instruction(inst)
      for instructions in computations.values() for inst in instructions
  }


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


def _calls(
    computations: _Computations, markers: Mapping[str, frozenset[str]],
) -> dict[str, tuple[frozenset[str], ...]]:
  """Marker -> instruction names of each of its calls (module doc, 4)."""
  parent: dict[tuple[str, str], tuple[str, str]] = {}

  def root(key: tuple[str, str]) -> tuple[str, str]:
    while parent[key] != key:
      parent[key] = parent[parent[key]]
      key = parent[key]
    return key

  for instructions in computations.values():
    by_id = {inst.id: inst for inst in instructions}
    movement = {inst.id for inst in instructions if _moves_data(inst, computations)}
    for inst in instructions:
      for marker in markers[inst.name]:
        key = parent.setdefault((inst.name, marker), (inst.name, marker))
        for source in _producers(inst, by_id, movement):
          if source.marker == marker:
            other = parent.setdefault((source.name, marker), (source.name, marker))
            parent[root(other)] = root(key)
  groups: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
  for key in parent:
    groups[root(key)].add(key[0])
  calls: dict[str, list[frozenset[str]]] = collections.defaultdict(list)
  for (_, marker), names in groups.items():
    calls[marker].append(frozenset(names))
  return {marker: tuple(group) for marker, group in calls.items()}


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


def _op_events(space: profiler.ProfileData) -> list[_Event]:
  """The events of XLA instructions (module doc, 1)."""
  device, other = [], []
  # jaxlib's iterator types warn once, when first built, that they lack __module__.
  with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", r"builtin type \w+ has no __module__", DeprecationWarning)
    for plane in space.planes:
      if plane.name == _METADATA_PLANE:
        continue
      target = device if plane.name.startswith(_DEVICE_PLANE_PREFIX) else other
      for line in plane.lines:
        target.extend(e for e in map(_event, line.events) if e is not None)
  return device or other


def _event(event: profiler.ProfileEvent) -> _Event | None:
  stats = dict(event.stats)
  hlo_op = stats.get("hlo_op")
  if not isinstance(hlo_op, str):
    return None
  program_id = stats.get("program_id")
  module = stats.get("hlo_module")
  return _Event(
      name=event.name, duration_ns=event.duration_ns, hlo_op=hlo_op,
      program_id=program_id if isinstance(program_id, int) else None,
      module=module if isinstance(module, str) else None)


class _ProgramIndex:
  """Finds the program of an event: by program_id, else by module name."""

  def __init__(self, programs: Iterable[_Program]):
    self.by_id: dict[int, _Program] = {}
    self.by_name: dict[str, list[_Program]] = collections.defaultdict(list)
    for program in programs:
      self.by_id[program.program_id] = program
      self.by_name[program.name].append(program)

  def find(self, event: _Event) -> list[_Program]:
    """The programs `event` may belong to that hold its instruction."""
    program_id, module = event.program_id, event.module
    if module is not None and (match := _MODULE_WITH_ID.match(module)):
      program_id = program_id if program_id is not None else int(match["id"])
      module = match["name"]
    if program_id in self.by_id:
      candidates = [self.by_id[program_id]]
    else:
      candidates = self.by_name.get(module, [])
    return [p for p in candidates if event.hlo_op in p.markers]


class _Tally:
  """Adds up the events of one file per marker (module doc, 3 and 4)."""

  def __init__(self, index: _ProgramIndex):
    self.index = index
    # (program_id, instruction) -> its events
    self.events: dict[tuple[int, str], list[_Event]] = collections.defaultdict(list)
    self.ran: collections.Counter[str] = collections.Counter()
    self.ambiguous = 0

  def add(self, event: _Event) -> None:
    """Files `event` under its program and instruction."""
    candidates = self.index.find(event)
    if not candidates:
      self.ran[event.module or f"program {event.program_id}"] += 1
      return
    program = candidates[0]
    self.ran[f"{program.name}({program.program_id})"] += 1
    if any(p.markers[event.hlo_op] != program.markers[event.hlo_op] for p in candidates):
      self.ambiguous += 1
    else:
      self.events[program.program_id, event.hlo_op].append(event)

  def result(self) -> dict[str, tuple[int, float]]:
    """Marker -> (count, time in ns) of the ops that ran."""
    time_ns: dict[str, float] = collections.defaultdict(float)
    executions: dict[tuple[int, str, str], int] = {}
    for (program_id, name), events in self.events.items():
      program = self.index.by_id[program_id]
      markers = program.markers[name]
      runs = min(collections.Counter(e.name for e in events).values())
      for marker in markers:
        if not self._counted_outside(program, name, marker):
          time_ns[marker] += sum(e.duration_ns for e in events) / len(markers)
          executions[program_id, name, marker] = runs
    counts: collections.Counter[str] = collections.Counter()
    for program in self.index.by_id.values():
      for marker, calls in program.calls.items():
        for names in calls:
          counts[marker] += max(
              executions.get((program.program_id, name, marker), 0) for name in names)
    return {m: (counts[m], t) for m, t in time_ns.items() if counts[m]}

  def _counted_outside(self, program: _Program, name: str, marker: str) -> bool:
    """Whether an enclosing instruction of `marker` ran and so holds this time."""
    return any(
        marker in program.markers[outer] and (program.program_id, outer) in self.events
        for outer in program.enclosing[name])

  def describe_no_ops(self) -> str:
    """Why no op was found: what ran, and which programs hold markers."""
    if not self.ran:
      return ("the profile holds no events of XLA instructions (no 'hlo_op' stat); "
              "were the programs run inside jax.profiler.trace?")
    ran = ", ".join(f"{name} ({n} events)" for name, n in sorted(self.ran.items()))
    marked = sorted(
        f"{p.name}({p.program_id})" for p in self.index.by_id.values() if p.calls)
    message = (f"the profile contains no stellarax ops: no instruction that ran carries "
               f"the frontend attribute {MARKER_KEY!r}. Programs that ran: {ran}.")
    if marked:
      message += f" Programs whose stellarax ops did not run: {', '.join(marked)}."
    if self.ambiguous:
      message += f" Also, {self.describe_ambiguous()}"
    return message

  def describe_ambiguous(self) -> str:
    """Why events were left out as ambiguous."""
    return (f"{self.ambiguous} events were left out: they carry no program_id, and "
            "several programs of their module name hold an instruction of their name "
            "with different markers (one function compiled for several inputs).")
