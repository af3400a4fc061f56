"""`BoundArguments`: one op call, abstractly: the op and its argument specs.

Bound arguments are what the autotuner tunes and what results are keyed by.
Arrays are kept as `ArraySpec`s, so a `BoundArguments` is hashable,
comparable and round-trips through JSON. `vmap_axes` records the `jax.vmap`
levels the call was made under, innermost first: `(axis_size, batched)` with
one flag per array leaf of the arguments (batched leaves have the vmapped
dimension at the front, outermost level first).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from stellarax.core import specs
from stellarax.core.op import Op, op_from_json, op_to_json

VmapAxes = tuple[tuple[int, tuple[bool, ...]], ...]


@dataclasses.dataclass(frozen=True)
class BoundArguments:
  """An op and the abstract arguments of one call.

  Attributes:
    op: the op (an `Op` instance; its `config` is None unless pinned).
    arguments: argument name -> canonical value (`ArraySpec` for arrays).
    vmap_axes: the vmap levels, innermost first (see the module docstring).
  """

  op: Op
  arguments: specs.FrozenDict
  vmap_axes: VmapAxes = ()

  @classmethod
  def from_values(cls, op: Op, values: Mapping[str, Any], vmap_axes: VmapAxes = ()) -> BoundArguments:
    """Builds bound arguments from argument values.

    Args:
      op: the op called.
      values: each argument's value by name: arrays (concrete or abstract, kept as
        their shape and dtype), static options, or pytrees of them.
      vmap_axes: the `jax.vmap` levels around the call, innermost first: (axis size,
        which array leaves are batched).

    Returns:
      The `BoundArguments` of the call, with no config.

    Raises:
      TypeError: for a value that is neither an array nor a plain static value (a
        callable, an object of no JSON form).
    """
    arguments = specs.FrozenDict({k: specs.to_spec(v, what=k) for k, v in values.items()})
    return cls(op, arguments, tuple((int(n), tuple(map(bool, b))) for n, b in vmap_axes))

  # ---- what the autotuner and resolution need ---------------------------

  @functools.cached_property
  def heuristics_config(self) -> Any:
    """The op's heuristic config for these arguments."""
    return self.op._get_heuristics_config(self)

  @functools.cached_property
  def autotuning_configs(self) -> frozenset[Any]:
    """The search space: the op's configs plus the heuristic one."""
    return frozenset(self.op._get_autotuning_configs(self)) | {self.heuristics_config}

  @property
  def default_config(self) -> Any:
    """The config a call with these arguments runs with now (resolved)."""
    from stellarax.core.resolution import resolve_config
    return resolve_config(self).config

  @functools.cached_property
  def autotuning_cache_key(self) -> Any:
    """The JSON-able key results for this call are stored under."""
    return self.op._get_autotuning_cache_key(self)

  def key_json(self) -> str:
    """The cache key as canonical JSON (equal in every process)."""
    return specs.canonical_json(self.autotuning_cache_key)

  def op_json(self) -> str:
    """The op's identity (name and fields, no config) as canonical JSON."""
    return specs.canonical_json(op_to_json(self.op.replace(config=None)))

  def with_config(self, config: Any) -> BoundArguments:
    """The same call with `config` pinned on the op."""
    return dataclasses.replace(self, op=self.op.replace(config=config))

  def with_outer_vmap(self, axis_size: int, batched: tuple[bool, ...]) -> BoundArguments:
    """The same call seen one `jax.vmap` level further out.

    Args:
      axis_size: the size of the vmapped axis.
      batched: for each array leaf (`array_specs` order), whether that level maps it.
    """
    return dataclasses.replace(self, vmap_axes=self.vmap_axes + ((int(axis_size), tuple(batched)),))

  # ---- shapes of the batched call --------------------------------------

  def array_specs(self) -> list[specs.ArraySpec]:
    """The unbatched array leaves of the arguments, in flattening order."""
    return [spec for name in sorted(self.arguments) for spec in self.array_specs_of(name)]

  def array_specs_of(self, name: str) -> list[specs.ArraySpec]:
    """The unbatched array leaves of one argument, in flattening order.

    Args:
      name: the argument's name (a `KeyError` if the call has none of that name).
    """
    return [leaf for leaf in jax.tree.leaves(_thaw(self.arguments[name]), is_leaf=_is_spec)
            if isinstance(leaf, specs.ArraySpec)]

  def with_array_shapes(self, shapes: list[tuple[int, ...]]) -> BoundArguments:
    """The same call on array leaves of other shapes (a shard's), given as the batched
    call sees them (`batched_array_specs`): vmap dimensions in front.

    Raises:
      ValueError: for a number of shapes other than of array leaves, or a vmap level
        whose batched leaves disagree on its size.
    """
    old = self.array_specs()
    if len(shapes) != len(old):
      raise ValueError(f"{len(shapes)} shapes given for the {len(old)} array leaves of {self!r}.")
    sizes: list[set[int]] = [set() for _ in self.vmap_axes]
    unbatched = []
    for i, (spec, shape) in enumerate(zip(old, shapes)):
      # Outermost level first (`batched_array_specs`).
      levels = [j for j in reversed(range(len(self.vmap_axes))) if self.vmap_axes[j][1][i]]
      for pos, j in enumerate(levels):
        sizes[j].add(int(shape[pos]))
      unbatched.append(specs.ArraySpec(tuple(shape[len(levels):]), spec.dtype))
    if any(len(s) > 1 for s in sizes):
      raise ValueError(f"Shapes {shapes} give a vmap level of {self!r} two sizes.")
    it = iter(unbatched)
    arguments = {name: jax.tree.map(lambda s: next(it) if isinstance(s, specs.ArraySpec) else s,
                                    _thaw(value), is_leaf=_is_spec)
                 for name, value in self.arguments.items()}
    vmap_axes = tuple((s.pop() if s else n, b) for s, (n, b) in zip(sizes, self.vmap_axes))
    return BoundArguments.from_values(self.op, arguments, vmap_axes)

  def batched_array_specs(self) -> list[specs.ArraySpec]:
    """The array leaves as the vmapped call sees them (vmap dims in front)."""
    out = self.array_specs()
    for size, batched in self.vmap_axes:
      out = [specs.ArraySpec((size,) + s.shape, s.dtype) if b else s for s, b in zip(out, batched)]
    return out

  # ---- running ----------------------------------------------------------

  def example_values(self, seed: int = 0) -> dict[str, Any]:
    """Random unbatched argument values matching the specs (fresh, not zeros).

    Args:
      seed: seeds the draw: the same seed gives the same values.

    Returns:
      Each argument by name: arrays drawn as the op draws them (`Op._example_value`:
      e.g. group sizes that sum to at most M), static options as they are.
    """
    keys = iter(jax.random.split(jax.random.key(seed), max(1, len(self.array_specs()))))
    out = {}
    for name, value in self.arguments.items():
      out[name] = jax.tree.map(
          lambda s, name=name: self.op._example_value(name, s, next(keys), self.arguments) if isinstance(s, specs.ArraySpec) else s,
          _thaw(value), is_leaf=_is_spec)
    return self.op._complete_example(out)

  def example_arrays(self, seed: int = 0) -> list[jax.Array]:
    """Random array leaves for the (batched) call, as `runner()` takes them.

    Args:
      seed: as in `example_values`.

    Returns:
      The array leaves of `example_values(seed)`, broadcast along each vmap level that
      batches them.
    """
    values = self.example_values(seed)
    leaves = [x for x in jax.tree.leaves(values) if specs.is_array_value(x)]
    for size, batched in self.vmap_axes:
      leaves = [jnp.broadcast_to(x, (size,) + x.shape) + 0 if b else x for x, b in zip(leaves, batched)]
    return leaves

  def runner(self, config: Any = None, *, reference: bool = False):
    """Returns `fn(*array_leaves) -> output` running this call.

    Args:
      config: the config to pin; None resolves one as a call would.
      reference: run the op's plain reference instead of the op.
    """
    op = self.op if config is None else self.op.replace(config=config)
    statics = _thaw(dict(self.arguments))
    leaves_def = jax.tree.structure(statics, is_leaf=_is_spec)

    def unbatched(*arrays):
      it = iter(arrays)
      values = jax.tree.unflatten(leaves_def, [next(it) if isinstance(s, specs.ArraySpec) else s
                                               for s in jax.tree.leaves(statics, is_leaf=_is_spec)])
      if reference:
        return op._reference(**values)
      from stellarax.core import calling
      return calling.call_op(op, values)

    fn = unbatched
    for size, batched in self.vmap_axes:
      fn = _vmap_level(fn, batched, reference)
    return fn

  # ---- tuning -----------------------------------------------------------

  def autotune(self, **options) -> Any:
    """Tunes this one call: `Autotuner(**options).autotune([self])`.

    Args:
      **options: `stellarax.Autotuner` options (strategy, budget_s, ...).

    Returns:
      An `AutotuningResult` with one entry.
    """
    from stellarax.core.resolution import tuning_backend
    return tuning_backend().autotune_bound_args(self, **options)

  def benchmark(self, config: Any = None, **measure_options) -> Any:
    """Measures this call with one config (default: the resolved one).

    Args:
      config: the config to measure; None uses `default_config`.
      **measure_options: `stellarax.autotuning.MeasureOptions` fields.

    Returns:
      A `Measurement` (status, median time and its confidence interval).
    """
    from stellarax.core.resolution import tuning_backend
    return tuning_backend().benchmark(self, self.default_config if config is None else config,
                                      **measure_options)

  # ---- JSON -------------------------------------------------------------

  def to_json(self) -> dict[str, Any]:
    """JSON data for this call: op name and fields, arguments, vmap axes."""
    data: dict[str, Any] = {"op": op_to_json(self.op), "arguments": specs.encode(self.arguments)}
    if self.vmap_axes:
      data["vmap_axes"] = [[n, list(b)] for n, b in self.vmap_axes]
    return data

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> BoundArguments:
    """Inverse of `to_json`; validates through the op's `bind`.

    Raises:
      ValueError: for malformed data (with what is wrong).
      KeyError: for an unknown op name.
    """
    if not isinstance(data, Mapping) or "op" not in data or "arguments" not in data:
      raise ValueError(f"Bound arguments must be a JSON object with 'op' and 'arguments', got {str(data)[:200]}.")
    op = op_from_json(data["op"])
    arguments = specs.decode(data["arguments"])
    if not isinstance(arguments, specs.FrozenDict):
      raise ValueError(f"'arguments' must be a JSON object, got {data['arguments']!r}.")
    values = {k: _to_struct(v) for k, v in arguments.items()}
    # A stored call keeps the key it was recorded with: canonicalising reads this
    # process's jax settings only for live calls (`specs.decoding_stored`).
    with specs.stored_call():
      values = op._bind_values(**values)
      call = cls.from_values(op, values)
    return dataclasses.replace(call, vmap_axes=_vmap_axes_from_json(
        data.get("vmap_axes", []), len(call.array_specs())))

  def to_marker(self) -> str:
    """The compact JSON left in the lowered program."""
    return specs.canonical_json(self.to_json())

  def __repr__(self):
    args = ", ".join(f"{k}={_short(v)}" for k, v in self.arguments.items())
    vmap = f", vmap_axes={self.vmap_axes}" if self.vmap_axes else ""
    return f"BoundArguments({self.op.name}, {args}{vmap})"


_RECORDED_AS_IS = (bool, int, float, str)


def as_recorded(values: Mapping[str, Any]) -> dict[str, Any]:
  """Argument values as bound arguments record them, arrays kept.

  An op's `_fwd` and `_reference` get static values in this form on every path: a
  traced call, an eager one, and tuning, which has only the recorded values (JSON).
  Enums and dtypes become their names, lists tuples, numpy scalars Python numbers
  (`specs.to_spec`); dicts stay dicts.

  Args:
    values: argument name -> value (arrays, tracers and statics).

  Returns:
    The same names, with the arrays as given and every other value canonical.

  Raises:
    TypeError: for a value bound arguments cannot record (`specs.to_spec`).
  """
  out = {}
  for name, value in values.items():
    if value is None or type(value) in _RECORDED_AS_IS or specs.is_array_value(value):
      out[name] = value  # the common case, on every call: nothing to convert
      continue
    arrays = iter([x for x in jax.tree.leaves(value) if specs.is_array_value(x)])
    out[name] = jax.tree.map(lambda s: next(arrays) if isinstance(s, specs.ArraySpec) else s,
                             _thaw(specs.to_spec(value, what=name)), is_leaf=_is_spec)
  return out


def _vmap_axes_from_json(data: Any, num_arrays: int) -> VmapAxes:
  """Checks and reads `vmap_axes` JSON: [[size, [one bool per array leaf]], ...]."""
  def fail(why: str):
    raise ValueError(f"'vmap_axes' must be a list of [size, flags] pairs, a size >= 0 and one "
                     f"flag (true or false) for each of the call's {num_arrays} array "
                     f"arguments; {why}: {str(data)[:200]}.")
  if not isinstance(data, list):
    fail("not a list")
  axes = []
  for level in data:
    if not (isinstance(level, list) and len(level) == 2):
      fail("a level is not a [size, flags] pair")
    size, flags = level
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
      fail(f"size {size!r} is not an int >= 0")
    if not (isinstance(flags, list) and len(flags) == num_arrays
            and all(isinstance(f, bool) for f in flags)):
      fail(f"flags {flags!r} are not {num_arrays} bools")
    axes.append((size, tuple(flags)))
  return tuple(axes)


def _vmap_level(fn, batched, reference):
  # The op re-enters its own vmap handling (custom_vmap); the reference is
  # plain JAX and may lack batching rules, so it goes through the same
  # vmap-or-map fallback as implementations do.
  if reference:
    from stellarax.core.calling import _batch_one_level
    return _batch_one_level(fn, batched)
  return jax.vmap(fn, in_axes=tuple(0 if b else None for b in batched))


def _is_spec(x: Any) -> bool:
  return isinstance(x, specs.ArraySpec)


def _thaw(value: Any) -> Any:
  """FrozenDicts back to dicts so jax.tree can walk them."""
  if isinstance(value, specs.FrozenDict):
    return {k: _thaw(v) for k, v in value.items()}
  if isinstance(value, dict):
    return {k: _thaw(v) for k, v in value.items()}
  if isinstance(value, tuple):
    return tuple(_thaw(v) for v in value)
  return value


def _to_struct(value: Any) -> Any:
  return jax.tree.map(lambda s: s.to_shape_dtype_struct() if isinstance(s, specs.ArraySpec) else s,
                      _thaw(value), is_leaf=_is_spec)


def _short(value: Any) -> str:
  if isinstance(value, specs.ArraySpec):
    return f"{value.dtype}{list(value.shape)}"
  return repr(value)
