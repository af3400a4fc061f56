"""An op called eagerly (outside `jit`) runs as one cached `jax.jit` of the whole call.

Choosing and binding an implementation costs 100-500 us of Python a call (2026-12-06,
CPU), 5-17 times a small jitted call's dispatch, and the pieces of a call (custom_vjp,
custom_vmap, the marker) are new functions every time, which JAX would trace and compile
again on every eager call. Inside one jit all of it runs once per array shapes and static
arguments, when JAX traces it; the trace keys (`core/trace_keys.py`) trace it again where
an entered result answers differently, as for any jitted function of the user's.

Both eager entry points take this one way: a public op function (`dispatch.call_family`,
keyed by the family, its preference and the implementation asked for) and an `Op`
instance called directly (`Op.__call__`, keyed by the op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax

from stellarax.core import specs
from stellarax.core import trace_keys


def jitted_call(fn: Callable[..., Any], head: tuple[Hashable, ...], args: tuple, kwargs: dict,
                *, name: str, static_options: frozenset[str] = frozenset()
                ) -> tuple[Callable[..., Any], list[Any]] | None:
  """`fn(*head, *args, **kwargs)` as a cached jit over the array leaves of args and kwargs.

  Args:
    fn: a module-level function (it is part of the cache key, so not a new closure per call).
    head: leading arguments of `fn` that are not the user's (an op, a family name...);
      hashable, and keyed by their types too.
    args, kwargs: the user's arguments; array leaves become the jit's arguments, every
      other leaf is static and keyed by its value and type.
    name: the program's name in profiles.
    static_options: names in kwargs that are never traced (`Op._static_options`): an
      array given there is a value the call reads (`axis=np.array([0, 1])`).

  Returns:
    (program, arrays): call `program(*arrays)`. None where the call must run as it is: while
    a jit is being traced or under `jax.disable_jit()` (the jit would run the call eagerly
    again, without end), with a tracer among the arguments, with a concrete 0-d array (a
    static option may be given as one, e.g. `epsilon=jnp.float32(1e-6)`, and binding reads
    it as a number, which a traced one cannot give) or an array given as a static option
    (the same, for several numbers), or with an unhashable static value.
  """
  if trace_keys.building() or jax.config.jax_disable_jit:
    return None
  for option in static_options.intersection(kwargs):
    if not isinstance(kwargs[option], _PLAIN) and any(
        map(specs.is_array_value, jax.tree.leaves(kwargs[option]))):
      return None
  leaves, treedef = jax.tree.flatten((args, kwargs))
  arrays, statics, is_array = [], [], []
  for x in leaves:  # one pass: this runs on every eager call
    array = specs.is_array_value(x)
    if array and (isinstance(x, jax.core.Tracer) or x.ndim == 0):
      return None
    (arrays if array else statics).append(x)
    is_array.append(array)
  statics = tuple(statics)
  try:
    # The statics are leaves (jax.tree.flatten took tuples, lists and dicts apart).
    program = _program(fn, head, treedef, tuple(is_array), statics,
                       (specs.types_of(head), tuple(map(type, statics))), name)
  except TypeError:  # an unhashable value
    return None
  return program, arrays


# Values of static options that hold no array, checked without flattening them.
_PLAIN = (type(None), bool, int, float, str)


@functools.lru_cache(maxsize=512)
def _program(fn: Callable[..., Any], head: tuple, treedef: Any, is_array: tuple[bool, ...],
             statics: tuple, types: Any, name: str) -> Callable[..., Any]:
  del types  # in the key only

  def program(*arrays):
    arrays_left, statics_left = iter(arrays), iter(statics)
    leaves = [next(arrays_left) if array else next(statics_left) for array in is_array]
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    return fn(*head, *args, **kwargs)

  program.__name__ = program.__qualname__ = name
  return jax.jit(program)
