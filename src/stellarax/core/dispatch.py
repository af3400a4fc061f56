"""Choosing an implementation for a public op function (`implementation=`).

- None: the implementations that run on the device the call is traced for (the
  default device, or an abstract mesh's when lowering for another machine), fastest
  first when measurements of this call exist in the active results or caches, else
  in the family's stated preference order;
- a name ("xla", "pallas_triton", or the full "ragged_dot.xla") or an `Op`
  instance: that one;
- a list or tuple of those: tried in order, passing by those that do not run on that
  device (a Pallas kernel not in interpret mode on a CPU); a single name or instance is
  always tried.

Candidates that raise `NotImplementedError` for the given arguments, and those
the installed JAX cannot run (`Op.require_available`), are skipped; when none
applies, the error lists each candidate's reason.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from stellarax.core import calling
from stellarax.core import eager as eager_calls
from stellarax.core import partitioning
from stellarax.core import registry
from stellarax.core import resolution
from stellarax.core import specs
from stellarax.core.bound_args import BoundArguments
from stellarax.core.op import Op


def _as_op(family: str, implementation: str | Op) -> Op:
  if isinstance(implementation, type) and issubclass(implementation, Op):
    raise TypeError(f"implementation={implementation.__name__} is an op class; pass an"
                    f" instance, e.g. implementation={implementation.__name__}().")
  op = _named(family, implementation) if isinstance(implementation, str) else implementation
  if not isinstance(op, Op):
    raise TypeError(f"implementation={implementation!r} must be None, a name, an Op or a list "
                    "or tuple of those.")
  if op.name is None or not op.name.startswith(family + "."):
    raise ValueError(f"implementation={implementation!r} is not a {family} op; choose one of "
                     f"{_forward_names(family)} (or None for the best available).")
  if op.name.endswith("_vjp"):
    raise ValueError(
        f"implementation={implementation!r} is a backward (VJP) op; pass a forward {family}"
        " op. A forward op differentiates with its own backward op (op.vjp_op()), which the"
        " autotuner tunes with it.")
  return op


def _named(family: str, name: str) -> Op:
  """The op registered as `name` ("xla", or in full "ragged_dot.xla")."""
  full = name if "." in name else f"{family}.{name}"
  try:
    return registry.lookup(full)()
  except KeyError:
    raise ValueError(f"implementation={name!r}: {family} has no such implementation; choose "
                     f"one of {_forward_names(family)} (or None for the best available).") from None


def _forward_names(family: str) -> list[str]:
  return [n.partition(".")[2] for n in registry.names(family) if not n.endswith("_vjp")]


def _runs_on(op: Op, device: Any) -> bool:
  """Whether `op` runs on `device`: its class says so, or it interprets its kernel
  (which runs anywhere)."""
  return bool(getattr(op, "interpret", False)) or type(op).supported_on(device)


def _device_words(device: Any) -> str:
  """How messages name the device a call is traced for."""
  if isinstance(device, jax.sharding.AbstractDevice):
    return f"the abstract mesh's device ({device.device_kind})"
  return f"the default device ({device.device_kind})"


def _times_in(sources: Sequence[Any], ba: BoundArguments) -> list[float]:
  lookups = (getattr(source, "lookup_time", None) for source in sources)
  return [t for t in (lookup(ba) for lookup in lookups if lookup is not None) if t is not None]


def _fastest_in_results(results: tuple[Any, ...], ba: BoundArguments) -> float | None:
  return min(_times_in(results, ba), default=None)


def _with_levels(ba: BoundArguments, levels) -> BoundArguments:
  """`ba` seen through the vmap levels `calling.vmap_levels` found (innermost first)."""
  for size, batched in levels:
    ba = ba.with_outer_vmap(size, batched)
  return ba


def _measured_time(ba: BoundArguments) -> float | None:
  times = _times_in(resolution.cache_sources(), ba)
  in_results = resolution.ask_active_results(_fastest_in_results, ba)
  if in_results is not None:
    times.append(in_results)
  return min(times, default=None)


def call_family(family: str, preference: Sequence[str], implementation: Any, args: tuple, kwargs: dict) -> Any:
  """Runs the op family `family` with the chosen implementation.

  Args:
    family: e.g. "ragged_dot".
    preference: backend names in the order to try when none is given.
    implementation: see the module docstring.
    args, kwargs: the op's arguments.

  Returns:
    The op's output.

  Raises:
    NotImplementedError: when no candidate supports the arguments, listing
      each one's reason (an implementation the installed JAX cannot run is one).
    ValueError: for an unknown implementation name, an Op of another family, a
      backward (VJP) op, or an empty sequence; a kernel named alone that JAX cannot
      lower on the default device raises JAX's error, called eagerly with a note on how
      to run it (under `jit` the error comes when the caller's program is lowered).
    TypeError: for an op class instead of an instance, or an implementation of
      another type.
  """
  sequence = isinstance(implementation, (list, tuple))
  head = (family, tuple(preference), type(implementation) if sequence else None,
          tuple(implementation) if sequence else implementation)
  eager = eager_calls.jitted_call(_run_family, head, args, kwargs, name=family,
                                  static_options=_static_options(family))
  if eager is None:
    return _call_family(family, preference, implementation, args, kwargs)
  program, arrays = eager
  try:
    return program(*arrays)
  except ValueError as e:  # also raised while compiling, after the traced call returned
    # Only a kernel that fails to lower gets the note: bad arguments fail the trace too.
    if isinstance(implementation, (str, Op)) and _traces(program, arrays):
      with contextlib.suppress(ValueError):  # an unknown name: its error says so already
        _note_where_it_runs(e, _as_op(family, implementation))
    raise


def _traces(program: Callable[..., Any], arrays: list[Any]) -> bool:
  """Whether `program(*arrays)` traces (binding checked its arguments), so that what
  failed came after: lowering or compiling."""
  try:
    jax.eval_shape(program, *arrays)
  except Exception:  # noqa: BLE001 (the caller raises the call's own error)
    return False
  return True


@functools.cache
def _static_options(family: str) -> frozenset[str]:
  """The static options of a family's forward ops (`Op._static_options`): they share
  their family base's signature."""
  classes = [registry.lookup(name) for name in registry.names(family)]
  return frozenset().union(*(c._static_options() for c in classes if c.fwd_cls is None))


def _run_family(family: str, preference: tuple[str, ...], sequence_type: type | None,
                implementation: Any, /, *args, **kwargs) -> Any:
  """`_call_family` as `eager_calls.jitted_call` calls it: a sequence of implementations
  comes as a tuple (hashable) and is rebuilt as given, for the errors that quote it."""
  if sequence_type is not None:
    implementation = sequence_type(implementation)
  return _call_family(family, preference, implementation, args, kwargs)


def _note_where_it_runs(e: Exception, op: Op) -> None:
  """Adds to JAX's error for a kernel that cannot lower here (its own words, such as
  "Only interpret mode is supported on CPU backend.", say neither which op asked for the
  kernel nor how to run it here) which op it was and how to run it."""
  device = partitioning.target_device()
  if _runs_on(op, device) or any(n.startswith("stellarax:") for n in getattr(e, "__notes__", ())):
    return
  e.add_note(f"stellarax: {op.name} does not run on {_device_words(device)}; pass"
             f" {type(op).__name__}(interpret=True) to run"
             " its kernel here, or a preference list such as"
             f" [{op.name.partition('.')[2]!r}, 'xla'] to fall back.")


def _call_family(family: str, preference: Sequence[str], implementation: Any, args: tuple,
                 kwargs: dict) -> Any:
  """`call_family` without the eager shortcut."""
  if isinstance(implementation, type):
    _as_op(family, implementation)  # an op class: says to pass an instance
  if implementation is None:
    registered = set(registry.names(family))
    ops = [_as_op(family, name) for name in preference if f"{family}.{name}" in registered]
    explicit = False
  elif isinstance(implementation, (list, tuple)):
    ops, explicit = [_as_op(family, i) for i in implementation], True
    if not ops:
      raise ValueError(f"implementation={implementation!r} names no {family} implementation; "
                       "give a name, an Op or a non-empty sequence of those, or None for the "
                       "best available.")
  else:  # a name or an Op; anything else is refused by _as_op
    ops, explicit = [_as_op(family, implementation)], True

  reasons = []
  device = partitioning.target_device()  # an H200's when lowering for one from a CPU host
  if not explicit or isinstance(implementation, (list, tuple)):  # named alone: always tried
    runs = [_runs_on(op, device) for op in ops]
    if explicit:
      reasons = [f"  {op.name}: does not run on {_device_words(device)}; "
                 "pass an instance with interpret=True to run its kernel here, or name it "
                 "alone to lower it for another device" for op, ok in zip(ops, runs) if not ok]
    ops = [op for op, ok in zip(ops, runs) if ok]
  bound = []
  for op in ops:
    try:
      op.require_available()  # before binding: no other reason matters then
      bound.append((op, op._bind_values(*args, **kwargs)))
    except NotImplementedError as e:
      reasons.append(f"  {op.name}: {e}")
  if not bound:
    why = "\n".join(reasons) or f"  none of {list(preference)} runs on {device.platform}"
    raise NotImplementedError(f"No {family} implementation supports these arguments:\n{why}")
  if not explicit and len(bound) > 1:
    # Under jax.vmap the measured call is the batched one (its key holds the levels).
    levels = calling.vmap_levels(specs.split_arrays(bound[0][1])[0]) or ()
    timed = [(_measured_time(_with_levels(BoundArguments.from_values(op, v), levels)), i)
             for i, (op, v) in enumerate(bound)]
    timed = [(t, i) for t, i in timed if t is not None]
    if timed:
      bound = [bound[min(timed)[1]]]
  op, values = bound[0]
  try:
    return calling.call_op(op, values)
  except ValueError as e:
    if explicit:
      _note_where_it_runs(e, op)
    raise
