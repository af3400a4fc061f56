"""Finds the out-of-bounds memory accesses that Pallas interpret mode hides.

Interpret mode discharges a kernel's reference accesses to array operations that never
fail: a plain read or write of a window that runs past its array (`ref[pl.ds(i, n)]`)
becomes a `dynamic_slice` / `dynamic_update_slice`, which moves the window back inside
the array, and Pallas's masked `load` / `store` pad the array with NaN first. A kernel
whose block overruns its array so reads shifted data, or loses a write, and its test
may still pass (the rows involved are often ones no one checks), where on the GPU the
same access reads or writes past the buffer: garbage, corrupted neighbours, or an
illegal-address fault that ends the run.

`install()` wraps the discharge rules of every reference access (state get, swap and
add-update; Pallas's load and swap, with their masks) with a check of the access as
the GPU makes it: every element read or written (masked-in, for masked accesses) must
lie inside its array. Chained windows (`ref.at[a].at[b]`) compose to positions in the
array, and so do the integer-array indices of Triton-style pointer arithmetic
(`ref[rows[:, None], cols[None, :]]`); bitcast or reshaped views are not checked
(they are counted in `unchecked`). A violation is recorded by a host callback that
runs only when one happens, naming the kernel source line, the array's shape and
the first element out of bounds; `take()` returns and clears the record.
`tests/conftest.py` installs it for every test and fails a test that leaves a
violation behind (`fail_on_violations`).

Mosaic GPU interpret mode needs none of this: it raises on out-of-bounds accesses
itself.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import source_info_util
from jax._src.indexing import Slice
from jax._src.pallas import hlo_interpreter
from jax._src.pallas import primitives as pallas_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import primitives as state_primitives


@dataclasses.dataclass(frozen=True)
class Violation:
  """One out-of-bounds access: where in the kernel, read or write, of which array, where."""
  site: str  # file:line (function) of the access in the kernel's source, and its caller
  access: str  # "read" or "write"
  shape: tuple[int, ...]  # the array's shape
  element: str  # the first element out of bounds, e.g. "[37, 4]"

  def __str__(self) -> str:
    return f"{self.site}: {self.access} of element {self.element} of an array of shape {self.shape}"


_lock = threading.Lock()
_interpreting = threading.local()  # .active: discharging a kernel for interpret mode
_violations: list[Violation] = []
checked = 0  # accesses given a check (counted when a kernel is traced)
unchecked = 0  # accesses not checked (bitcast or reshaped views, gathers mixed with slices)


def take() -> list[Violation]:
  """The violations recorded since the last call (call jax.effects_barrier() first)."""
  with _lock:
    found = list(dict.fromkeys(_violations))
    _violations.clear()
  return found


def fail_on_violations() -> None:
  """Fails the running test if an access was out of bounds since the last take().

  Raises:
    pytest.fail.Exception: naming the first ten violations.
  """
  jax.effects_barrier()  # the callbacks of kernels still running
  if found := take():
    pytest.fail("out-of-bounds accesses in interpret mode (the GPU would make them):\n  "
                + "\n  ".join(map(str, found[:10])), pytrace=False)


def _i32(x: Any) -> Any:
  return x if isinstance(x, (int, np.integer)) else lax.convert_element_type(x, jnp.int32)


def _positions(shape: tuple[int, ...], transforms) -> list[Any] | None:
  """Per dimension of an array of `shape`, the positions the access through
  `transforms` touches, as int32 arrays that broadcast to the access's shape (scalars
  for integer indices). None when the access is not a composition of slices and
  integers with, at most, a gather of integer arrays last (bitcasts, reshapes, a
  gather mixed with slices)."""
  axes = [(d, 0, 1, n) for d, n in enumerate(shape)]  # (dim, offset, stride, size)
  fixed: dict[int, Any] = {}
  for level, transform in enumerate(transforms):
    if not isinstance(transform, state_indexing.NDIndexer) or len(transform.indices) != len(axes):
      return None
    if any(np.shape(i) and not isinstance(i, Slice) for i in transform.indices):
      # A gather (Triton-style pointer arithmetic): every index an integer array.
      if level != len(transforms) - 1 or any(isinstance(i, Slice) for i in transform.indices):
        return None
      out = dict(fixed)
      for (dim, offset, stride, _), index in zip(axes, transform.indices):
        out[dim] = offset + stride * _i32(jnp.asarray(index))
      return [out[d] for d in range(len(shape))]
    next_axes = []
    for (dim, offset, stride, size), index in zip(axes, transform.indices):
      if isinstance(index, Slice):
        next_axes.append((dim, offset + _i32(index.start) * stride, stride * index.stride, index.size))
      else:
        fixed[dim] = offset + _i32(index) * stride
    axes = next_axes
  out = dict(fixed)
  for i, (dim, offset, stride, size) in enumerate(axes):
    out[dim] = (offset + stride * lax.iota(jnp.int32, size)).reshape(
        [size if j == i else 1 for j in range(len(axes))])
  return [out[d] for d in range(len(shape))]


def _outside(shape, positions) -> Any:
  """Per element of the access, whether it lies outside the array."""
  inside = functools.reduce(jnp.logical_and, [(p >= 0) & (p < n) for p, n in zip(positions, shape)],
                            jnp.ones((), jnp.bool_))
  return ~inside


def _record(access: str, site: str, shape, *element) -> None:
  """Host side of a violation (runs only when one happens)."""
  where = "[" + ", ".join(str(int(e)) for e in element) + "]"
  with _lock:
    _violations.append(Violation(site, access, tuple(shape), where))


def _site() -> str:
  """The kernel source lines of the access being discharged: the innermost two user
  frames (an access is often made in a small helper)."""
  frames = itertools.islice(source_info_util.user_frames(source_info_util.current().traceback), 2)
  return " <- ".join(f"{os.path.relpath(f.file_name)}:{f.start_line} ({f.function_name})"
                     for f in frames) or "unknown"


def _check(access: str, ref_value, transforms, mask) -> None:
  """Adds to the traced kernel a check of one access (see the module docstring)."""
  global checked, unchecked
  shape = tuple(ref_value.shape)
  positions = _positions(shape, transforms)
  if positions is None:
    unchecked += 1
    return
  checked += 1
  outside = _outside(shape, positions)
  if mask is not None:
    outside = outside & mask
  if outside.size == 0:
    return  # an empty window touches nothing
  bad = jnp.any(outside)
  if not isinstance(bad, jax.core.Tracer) and not bool(bad):
    return  # in bounds whatever the runtime values
  site = _site()
  report = functools.partial(_record, access, site, shape)

  def first_bad_element():
    first = jnp.argmax(outside.reshape(-1))
    full = jnp.broadcast_shapes(outside.shape, *(jnp.shape(p) for p in positions))
    element = [jnp.broadcast_to(p, full).reshape(-1)[first] if full else p for p in positions]
    jax.debug.callback(report, *element)

  lax.cond(bad, first_bad_element, lambda: None)


# ----------------------------------------------------------------------------- the wrappers


def _interpreting_kernel() -> bool:
  # Other lowerings (Mosaic GPU's, for one) discharge references too, into code that
  # runs on the GPU itself, where a host callback cannot go.
  return getattr(_interpreting, "active", False)


# How each primitive's discharge rule receives an access: (ref, transforms, mask) from
# the rule's positional arguments and keyword parameters.
def _state_access(args, params, has_value):
  ref, *idx = args[:1] + args[1 + has_value:]
  return ref, tuple(jax.tree_util.tree_unflatten(params["tree"], idx)), None


def _pallas_access(args, params, mask_position):
  parts = params["args_tree"].unflatten(args)
  return parts[0], tuple(parts[1] or ()), parts[mask_position]


_ACCESSES = {  # primitive: (read or write, its access's unpacker)
    state_primitives.get_p: ("read", functools.partial(_state_access, has_value=False)),
    state_primitives.swap_p: ("write", functools.partial(_state_access, has_value=True)),
    state_primitives.addupdate_p: ("write", functools.partial(_state_access, has_value=True)),
    pallas_primitives.load_p: ("read", functools.partial(_pallas_access, mask_position=2)),
    pallas_primitives.swap_p: ("write", functools.partial(_pallas_access, mask_position=3)),
}


def _checked(rule: Callable, access: str, unpack: Callable) -> Callable:
  """`rule`, checking the access first while interpret mode discharges a kernel."""
  def checked(ctx, *args, **params):
    if _interpreting_kernel():
      _check(access, *unpack(args, params))
    return rule(ctx, *args, **params)
  checked.checks_bounds = True
  return checked


def _checking_while_interpreting(to_hlo_jaxpr: Callable) -> Callable:
  def checked(*args, **kwargs):
    before = getattr(_interpreting, "active", False)
    _interpreting.active = True
    try:
      return to_hlo_jaxpr(*args, **kwargs)
    finally:
      _interpreting.active = before
  checked.checks_bounds = True
  return checked


def install() -> None:
  """Wraps the discharge rules, and interpret mode's kernel discharge so that they
  check only there (once; later calls do nothing).

  Raises:
    RuntimeError: when jax moved what is wrapped (a jax upgrade: find where interpret
      mode discharges a kernel's reference accesses).
  """
  if not hasattr(hlo_interpreter, "kernel_to_hlo_jaxpr"):
    raise RuntimeError("interpret_bounds: jax's hlo_interpreter.kernel_to_hlo_jaxpr is gone.")
  if not getattr(hlo_interpreter.kernel_to_hlo_jaxpr, "checks_bounds", False):
    hlo_interpreter.kernel_to_hlo_jaxpr = _checking_while_interpreting(
        hlo_interpreter.kernel_to_hlo_jaxpr)
  for primitive, (access, unpack) in _ACCESSES.items():
    rule = state_discharge._discharge_rules.get(primitive)
    if rule is None:
      raise RuntimeError(f"interpret_bounds: no discharge rule for {primitive}; jax changed.")
    if not getattr(rule, "checks_bounds", False):
      state_discharge._discharge_rules[primitive] = _checked(rule, access, unpack)


def installed() -> bool:
  """Whether every access's discharge rule, and interpret mode's discharge, is wrapped."""
  wrapped = [hlo_interpreter.kernel_to_hlo_jaxpr,
             *(state_discharge._discharge_rules.get(p) for p in _ACCESSES)]
  return all(getattr(w, "checks_bounds", False) for w in wrapped)

