"""Abstract argument specs: what an op call's arguments look like, without data.

A bound call keeps the *shape* of its inputs, never the values: arrays become
`ArraySpec`s and everything else must be a plain, hashable, JSON-able value.
That makes bound arguments hashable (a search key), comparable, and portable
(JSON with no Python import paths).

Canonical JSON: arrays are `{"shape": [...], "dtype": "bfloat16"}` objects
tagged with `"__array__": true`; tuples and lists both become JSON lists and
come back as tuples; dicts come back as sorted tuples of items wrapped in a
`FrozenDict`. Keys are sorted and separators compact, so the same call gives
the same bytes in every process and version.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
  """The shape and dtype of an array argument.

  Attributes:
    shape: the array's shape, a tuple of non-negative ints.
    dtype: the dtype's canonical name, e.g. "bfloat16".
  """

  shape: tuple[int, ...]
  dtype: str

  def __post_init__(self):
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
               for d in self.shape):
      raise ValueError(f"ArraySpec shape must hold ints, got {tuple(self.shape)}.")
    shape = tuple(int(d) for d in self.shape)
    if any(d < 0 for d in shape):
      raise ValueError(f"ArraySpec shape must be non-negative, got {shape}.")
    object.__setattr__(self, "shape", shape)
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * jnp.dtype(self.dtype).itemsize

  def to_shape_dtype_struct(self) -> jax.ShapeDtypeStruct:
    """Returns the equivalent `jax.ShapeDtypeStruct` (for lowering)."""
    return jax.ShapeDtypeStruct(self.shape, jnp.dtype(self.dtype))

  @classmethod
  def of(cls, x: Any) -> ArraySpec:
    """Returns the spec of an array, tracer or `ShapeDtypeStruct`, with the dtype JAX
    computes it in: a NumPy int64 or float64 array is int32 or float32 in a program
    unless `jax_enable_x64` is on, so its call is keyed so too (a call bound from NumPy
    arrays then matches the program's)."""
    return cls(tuple(x.shape), jnp.dtype(computed_dtype(x.dtype)).name)


def computed_dtype(dtype: Any) -> Any:
  """The dtype jax computes `dtype` in (without `jax_enable_x64`, float64 is float32),
  for a live call's key; an extended dtype (a PRNG key's) and a stored call's
  (`decoding_stored`: as recorded) are kept."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or decoding_stored():
    return dtype
  return jax.dtypes.canonicalize_dtype(dtype)


_DECODING_STORED = contextvars.ContextVar("stellarax_decoding_stored", default=False)


def decoding_stored() -> bool:
  """Whether the call being bound is a stored one (`BoundArguments.from_json`: a file,
  a cache, a marker), not a live one. Binding folds the jax settings of a live call into
  its key (x64 into array dtypes, `jax.default_matmul_precision` into a precision of
  None: an op's `_canonicalize`), and leaves a stored call's as recorded: a file read
  under other settings must not change its keys (two entries could become one)."""
  return _DECODING_STORED.get()


@contextlib.contextmanager
def stored_call() -> Iterator[None]:
  """Marks what is bound inside a `with` block as a stored call (`decoding_stored`)."""
  token = _DECODING_STORED.set(True)
  try:
    yield
  finally:
    _DECODING_STORED.reset(token)


class FrozenDict(Mapping):
  """An immutable, hashable mapping with sorted keys (for dict arguments)."""

  __slots__ = ("_items",)

  def __init__(self, items: Mapping[str, Any] | Any = ()):
    pairs = items.items() if isinstance(items, Mapping) else items
    self._items = tuple(sorted(pairs, key=lambda kv: kv[0]))

  def __getitem__(self, key):
    for k, v in self._items:
      if k == key:
        return v
    raise KeyError(key)

  def __iter__(self):
    return (k for k, _ in self._items)

  def __len__(self):
    return len(self._items)

  def __hash__(self):
    return hash(self._items)

  def __eq__(self, other):
    # By value and type: 3, 3.0 and True are equal in Python, and compute differently
    # (two calls of an op that differ so are two calls to tune, `types_of`).
    return (isinstance(other, FrozenDict) and self._items == other._items
            and types_of(self._items) == types_of(other._items))

  def __repr__(self):
    return f"FrozenDict({dict(self._items)!r})"


def types_of(value: Any) -> Any:
  """The types of the plain values in `value` (tuples, mappings, dataclasses such as ops
  and configs, down to their fields), which equality does not see: 1, 1.0 and True are
  equal and hash alike, and compute differently.

  Args:
    value: any value.

  Returns:
    A hashable structure of types, equal for two values only where their types match
    throughout.
  """
  kind = type(value)
  if kind in _ATOMS:
    return kind
  if kind in (tuple, list):
    return kind, tuple(map(types_of, value))
  if kind is FrozenDict:
    return kind, tuple((k, types_of(v)) for k, v in value._items)
  if isinstance(value, dict):
    return kind, tuple((k, types_of(v)) for k, v in value.items())
  fields = getattr(kind, "__dataclass_fields__", None)
  if fields is not None:
    return kind, tuple(types_of(getattr(value, name)) for name in fields)
  return kind


_ATOMS = frozenset({str, int, float, bool, complex, bytes, type(None), type})


def is_array(x: Any) -> bool:
  """True for JAX/NumPy arrays, tracers and `ShapeDtypeStruct`s."""
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or (
      hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (type, np.dtype)))


def is_array_value(x: Any) -> bool:
  """True for values that travel through jit/vmap/grad as arrays (JAX and
  NumPy arrays, tracers); every other argument value is static."""
  return isinstance(x, (jax.Array, jax.core.Tracer, np.ndarray))


def split_arrays(tree: Any, is_input: Callable[[Any], bool] = is_array_value
                 ) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
  """Splits a pytree into its array leaves and a function that rebuilds it from new ones.

  Args:
    tree: e.g. argument values (arrays among static values).
    is_input: which leaves are the arrays (default `is_array_value`).

  Returns:
    (arrays, rebuild): the leaves `is_input` picks, in flattening order, and
    `rebuild(new_arrays)`, the tree with them in their places, the other leaves kept.
  """
  leaves, treedef = jax.tree.flatten(tree)
  picked = [is_input(x) for x in leaves]

  def rebuild(new_arrays):
    it = iter(new_arrays)
    return jax.tree.unflatten(treedef, [next(it) if p else x for x, p in zip(leaves, picked)])

  return [x for x, p in zip(leaves, picked) if p], rebuild


def to_spec(value: Any, *, what: str = "argument") -> Any:
  """Replaces arrays in `value` by `ArraySpec`s and checks the rest is plain.

  Args:
    value: an argument value: an array, None, bool, int, float, str, a dtype,
      an enum member, or a tuple/list/dict of those.
    what: the argument's name, for error messages.

  Returns:
    A hashable canonical value: arrays become `ArraySpec`, lists become
    tuples, dicts become `FrozenDict`, dtypes become their names, enum members
    their names.

  Raises:
    TypeError: for a value that cannot be made portable (a callable, an
      arbitrary object); the message says which argument and what to pass.
  """
  if isinstance(value, ArraySpec):
    return value
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, (int, float)) and not is_array(value):
    return value
  if isinstance(value, (np.integer, np.floating, np.bool_)):
    return value.item()
  if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
    return jnp.dtype(value).name
  if isinstance(value, enum.Enum):  # (an IntEnum or a StrEnum is its value, above)
    return value.name
  if is_array(value):
    return ArraySpec.of(value)
  if isinstance(value, (tuple, list)):
    return tuple(to_spec(v, what=f"{what}[{i}]") for i, v in enumerate(value))
  if isinstance(value, Mapping):
    return FrozenDict({str(k): to_spec(v, what=f"{what}[{k!r}]") for k, v in value.items()})
  try:
    dt = jnp.dtype(value)
  except TypeError:
    pass
  else:
    return dt.name
  raise TypeError(
      f"{what}={value!r} (a {type(value).__name__}) cannot be recorded in an op's "
      "bound arguments: op arguments must be arrays or plain values (None, bool, "
      "int, float, str, dtype, enum, or tuples/dicts of these). Pass a name "
      "instead of a callable or object.")


def _encode(value: Any) -> Any:
  if isinstance(value, ArraySpec):
    return {"__array__": True, "shape": list(value.shape), "dtype": value.dtype}
  if isinstance(value, FrozenDict):
    return {k: _encode(v) for k, v in value.items()}
  if isinstance(value, tuple):
    return [_encode(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return {"__float__": repr(value)}
  return value


def _decode(value: Any) -> Any:
  if isinstance(value, dict):
    if value.get("__array__") is True:
      return ArraySpec(tuple(value["shape"]), value["dtype"])
    if set(value) == {"__float__"}:
      return float(value["__float__"])
    return FrozenDict({k: _decode(v) for k, v in value.items()})
  if isinstance(value, list):
    return tuple(_decode(v) for v in value)
  return value


def encode(value: Any) -> Any:
  """Returns the JSON-able form of a canonical spec value (see module doc)."""
  return _encode(value)


def decode(value: Any) -> Any:
  """Inverse of `encode`: JSON data back to canonical spec values."""
  return _decode(value)


def canonical_json(data: Any) -> str:
  """Compact JSON with sorted keys: the same bytes for equal data everywhere."""
  return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
