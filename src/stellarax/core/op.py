"""`Op`: one implementation of one operation, with its config space.

An `Op` subclass is one implementation (XLA, Pallas Triton, ...) of an op
family. It declares a config class and six hooks:

- `_fwd(*args, config, **kwargs)`: compute. A forward op returns
  `(out, residuals)`; residuals are what its VJP op needs (or None).
- `_get_heuristics_config(ba)`: the config to use when nothing was measured.
- `_get_autotuning_configs(ba)`: the search space, a set of configs.
- `_get_autotuning_cache_key(ba)`: the key results are stored under
  (default: the canonical abstract arguments, vmap axes included).
- `supported_on(device)`: whether it runs on a device.
- `_check_supported(arguments)`: refuses, with NotImplementedError, a call its
  kernel does not take (dispatch then tries the next implementation).
- `_unavailable_reason()`: why it cannot run with the installed JAX at all (a
  Pallas backend JAX removed), or None; such an implementation stays registered,
  so data naming it still loads, and refuses calls with
  `ImplementationUnavailableError`.

Calling an op binds its arguments (`bind`), resolves a config (see
`resolution.py`) and runs `_fwd` inside a marker that names the op and its
bound arguments in the lowered program, so capture finds it later. The
backward pass is its own op (`vjp_cls`), reached through `jax.custom_vjp`,
with its own config space; an op without one is differentiated by JAX through
`_fwd` (see `calling.py`). `jax.vmap` goes through `custom_vmap` so the key
records the vmap axes.

An op of a user's own is written the same way, outside this package: subclass
`Op` under a name of one's own, with a `config_dataclass` config (README: "Your
own kernel").
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from stellarax.core import eager
from stellarax.core import registry
from stellarax.core import specs
from stellarax.core.config import NoConfig, is_config_class


def _static_value(value: Any) -> Any:
  """A static option's value with each concrete array in it read as Python numbers
  (nested tuples for more than one: hashable, so calls that differ in it are told apart);
  a traced one is left for the op to refuse."""
  def read(x):
    if specs.is_array_value(x) and not isinstance(x, jax.core.Tracer):
      listed = np.asarray(x).tolist()
      return _tuples(listed) if isinstance(listed, list) else listed
    return x
  return jax.tree.map(read, value)


def _tuples(listed: list) -> tuple:
  return tuple(_tuples(x) if isinstance(x, list) else x for x in listed)


class ImplementationUnavailableError(NotImplementedError):
  """An implementation cannot run with the installed JAX (a Pallas backend it needs
  is missing): raised when a call names it. A NotImplementedError, so that dispatch
  given several implementations moves on to the next."""


class _bind_descriptor:
  """Lets `bind` be called on the class (default op) or on an instance."""

  def __init__(self, method):
    self._method = method
    functools.update_wrapper(self, method)

  def __get__(self, obj, cls):
    return functools.partial(self._method, obj if obj is not None else cls())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op(abc.ABC):
  """Base class of every op implementation.

  Subclasses register a stable name with a class keyword:
  `class XlaRaggedDot(RaggedDot, name="ragged_dot.xla"): ...`. Fields of a
  subclass (dataclass fields) are part of the op's identity and must be plain
  values (no callables), so that equal ops compare and serialise equal.

  Attributes:
    config: pins a config for every call of this op; None resolves one per
      call (tuned results, caches, heuristics).
    array_options: (class) the keyword-only parameters of `_fwd` that take arrays;
      every other keyword-only parameter is a static option, which a call never
      traces (an op called eagerly reads an array given there as a value).

  Raises:
    TypeError: when a subclass registering a name has a `config_cls` that is neither
      a `@stellarax.config_dataclass` nor a `typing.NamedTuple`; when an op is made
      with a `config` that is not of its `config_cls`, or with a field that is not a
      plain value (a callable, an array).
    ValueError: when a subclass registers a malformed name (not "<family>.<backend>")
      or one another class already has.
  """

  config: Any = None

  name: ClassVar[str | None] = None
  config_cls: ClassVar[type] = NoConfig
  vjp_cls: ClassVar[type[Op] | None] = None
  # Set on a VJP op class: the forward op whose residuals it consumes (the
  # first forward class naming it as `vjp_cls`).
  fwd_cls: ClassVar[type[Op] | None] = None
  # The keyword-only parameters of `_fwd` that take arrays (sequence lengths); the
  # others are static options (`_static_options`).
  array_options: ClassVar[frozenset[str]] = frozenset()

  def __init_subclass__(cls, name: str | None = None, **kwargs):
    super().__init_subclass__(**kwargs)
    if name is not None:
      if not is_config_class(cls.config_cls):
        raise TypeError(
            f"{cls.__name__}.config_cls={cls.config_cls!r}: an op's config class must be a "
            "@stellarax.config_dataclass or a typing.NamedTuple, whose fields (the tunables) "
            "results and caches record by name.")
      cls.name = name
      registry.register(name, cls)
    vjp = cls.__dict__.get("vjp_cls")
    if vjp is not None and vjp.__dict__.get("fwd_cls") is None:
      vjp.fwd_cls = cls

  def __post_init__(self):
    if self.config is not None and not isinstance(self.config, self.config_cls):
      raise TypeError(
          f"{type(self).__name__}(config=...) expects a {self.config_cls.__name__}, got "
          f"{type(self.config).__name__}: {self.config!r}.")
    for f in dataclasses.fields(self):
      if f.name != "config" and not isinstance(getattr(self, f.name), Op):
        specs.to_spec(getattr(self, f.name), what=f"{type(self).__name__}.{f.name}")

  # ---- hooks -----------------------------------------------------------

  @abc.abstractmethod
  def _fwd(self, *args, config: Any, **kwargs) -> Any:
    """Computes the op with `config`. Forward ops return (out, residuals)."""

  def _canonicalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
    """Validates and canonicalises bound arguments (arrays or ArraySpecs).

    Raise ValueError/TypeError for bad input (input no implementation of the
    family takes); what one implementation does not support is `_check_supported`'s.
    """
    return arguments

  def _check_supported(self, arguments: dict[str, Any]) -> None:
    """Raises NotImplementedError, saying why, for canonical `arguments` this
    implementation does not take (a dtype or size its kernel lacks); dispatch then
    tries the next one. Not asked of a trivial call (`_is_trivial`), which runs no
    kernel, so every implementation takes it."""
    del arguments

  def _array_layout(self, arguments: dict[str, Any]) -> Any:
    """How the arrays of a call with canonical `arguments` line up: a
    `stellarax.ShardingLayout` naming every dimension of every array argument and
    output, or None where that is not known (the default). Over Explicit mesh axes a
    call with one runs per shard (`core/partitioning.py`)."""
    del arguments
    return None

  def _partitioning(self, arguments: dict[str, Any]) -> Any:
    """The layout by which a call runs per shard when its arrays are sharded across
    devices (`core/partitioning.py`), or None to leave the call whole to XLA, which
    partitions what it compiles itself (the default: XLA implementations). Kernels opt
    in: `pallas_common`'s mixins return `_array_layout`."""
    del arguments
    return None

  def _is_trivial(self, arguments: dict[str, Any]) -> bool:
    """Whether a call's output is zeros whatever its inputs (a matmul with an empty
    dimension): such a call of a forward op returns zeros of its reference's output
    shapes and dtypes, with no kernel, config, marker or tuning, so that no kernel
    or tile heuristic has to handle sizes of zero. `arguments` are arrays or
    ArraySpecs: read shapes, dtypes and static options only."""
    del arguments
    return False

  def _is_reproducible(self, config: Any) -> bool:
    """Whether the op run with `config` gives bit-identical outputs run after run on the
    same inputs: False for a config that sums in an order that varies between runs
    (atomic adds). Under `stellarax.autotuning.reproducible_scope()` such configs are
    never chosen (see core/resolution.py)."""
    del config
    return True

  @abc.abstractmethod
  def _get_heuristics_config(self, ba: Any) -> Any:
    """Returns the config to use when nothing was measured."""

  def _get_autotuning_configs(self, ba: Any) -> set[Any]:
    """Returns the search space for `ba` (the heuristic config is added)."""
    return {self._get_heuristics_config(ba)}

  def _get_autotuning_cache_key(self, ba: Any) -> Any:
    """Returns the JSON-able key results for `ba` are stored under."""
    return {"arguments": specs.encode(ba.arguments),
            "vmap_axes": [[size, list(batched)] for size, batched in ba.vmap_axes]}

  @classmethod
  def supported_on(cls, device: Any) -> bool:
    """Whether this implementation runs on `device` (a jax Device)."""
    del device
    return True

  @classmethod
  def _unavailable_reason(cls) -> str | None:
    """Why this implementation cannot run with the installed JAX (e.g. the Pallas
    backend it is written in is not there), or None (the default) when it can. Asked
    when a call runs and by dispatch, never when data naming the op loads."""
    return None

  @classmethod
  def require_available(cls) -> None:
    """Raises where this implementation cannot run with the installed JAX.

    Raises:
      ImplementationUnavailableError: naming the implementation and why
        (`_unavailable_reason`), with what to use instead.
    """
    reason = cls._unavailable_reason()
    if reason is not None:
      raise ImplementationUnavailableError(f"{cls.__name__} ({cls.name}) cannot run: {reason}.")

  def _example_value(self, name: str, spec: specs.ArraySpec, key: jax.Array,
                     arguments: Mapping[str, Any]) -> jax.Array:
    """Returns a random array for argument `name` (override for constraints).

    `arguments` are all the bound arguments (specs), for values that depend
    on other arguments' shapes (e.g. group sizes summing to the rows).
    """
    del name, arguments
    dtype = jnp.dtype(spec.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
      return jax.random.normal(key, spec.shape, jnp.float32).astype(dtype)
    if dtype == jnp.bool_:
      return jax.random.bernoulli(key, 0.8, spec.shape)
    return jax.random.randint(key, spec.shape, 0, 8, dtype)

  def _complete_example(self, values: dict[str, Any]) -> dict[str, Any]:
    """Makes random example values consistent where they must be.

    For a VJP op, `out` and `residuals` are what its forward op computes
    from the primal arguments (random residuals would make a correct
    backward look wrong); other ops return `values` as they are.
    """
    if self.fwd_cls is None or "residuals" not in values:
      return values
    from stellarax.core.bound_args import BoundArguments
    shared = {f.name for f in dataclasses.fields(self.fwd_cls)} - {"config"}
    fwd = self.fwd_cls(**{k: v for k, v in self.identity_fields().items() if k in shared})
    primal = {k: values[k] for k in fwd._signature().parameters}
    config = BoundArguments.from_values(fwd, primal).heuristics_config
    arrays = {k: v for k, v in primal.items() if specs.is_array_value(v)}
    statics = {k: v for k, v in primal.items() if k not in arrays}
    out, residuals = jax.jit(lambda a: fwd._fwd(**a, **statics, config=config))(arrays)
    out = jax.tree.map(lambda o, like: o.astype(like.dtype), out, values["out"])
    return {**values, "out": out, "residuals": residuals}

  def _reference(self, **arguments) -> Any:
    """The op's plain high-precision reference output for `arguments`."""
    raise NotImplementedError(f"{type(self).__name__} has no reference.")

  # ---- binding ----------------------------------------------------------

  @classmethod
  @functools.cache
  def _signature(cls) -> inspect.Signature:
    """The op's call signature: the family base's `_fwd` (the one nearest
    `Op` in the MRO that spells out its parameters), so implementations may
    take `**kwargs` or drop defaults without changing how calls bind."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for klass in reversed(cls.__mro__):
      fwd = klass.__dict__.get("_fwd")
      if fwd is None:
        continue
      sig = inspect.signature(fwd)
      if not any(p.kind in variadic for p in sig.parameters.values()):
        params = [p for n, p in sig.parameters.items() if n not in ("self", "config")]
        return sig.replace(parameters=params)
    raise TypeError(f"{cls.__name__} has no _fwd with explicit parameters.")

  @classmethod
  @functools.cache
  def _static_options(cls) -> frozenset[str]:
    """The keyword-only parameters that are static options (an axis, a flag, a
    precision): values binding reads, never traced, even when given as an array
    (`axis=np.array([0, 1])`). All keyword-only parameters but `array_options`."""
    keyword_only = {n for n, p in cls._signature().parameters.items() if p.kind is p.KEYWORD_ONLY}
    unknown = cls.array_options - keyword_only
    if unknown:
      raise TypeError(f"{cls.__name__}.array_options names {sorted(unknown)}, which are not "
                      f"keyword-only parameters of its _fwd {cls._signature()}.")
    return frozenset(keyword_only - cls.array_options)

  def _bind_values(self, *args, **kwargs) -> dict[str, Any]:
    """Binds call arguments by name, applies defaults and canonicalises."""
    try:
      bound = self._signature().bind(*args, **kwargs)
    except TypeError as e:
      raise TypeError(f"{type(self).__name__}{self._signature()}: {e}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name in self._static_options().intersection(values):
      values[name] = _static_value(values[name])
    values = self._canonicalize(values)
    if self.fwd_cls is not None or not self._is_trivial(values):
      self._check_supported(values)
    return values

  @_bind_descriptor
  def bind(self, *args, **kwargs):
    """Binds arguments to this op: `SomeOp.bind(x, w, ...)` or `op.bind(...)`.

    Args:
      *args, **kwargs: the op's arguments; arrays may be concrete, tracers or
        `jax.ShapeDtypeStruct`s.

    Returns:
      A `BoundArguments` holding the op and the abstract arguments.

    Raises:
      TypeError, ValueError: for arguments the op rejects.
      NotImplementedError: for arguments this implementation does not support.
    """
    from stellarax.core.bound_args import BoundArguments
    values = self._bind_values(*args, **kwargs)
    return BoundArguments.from_values(self, values)

  # ---- identity ---------------------------------------------------------

  def identity_fields(self) -> dict[str, Any]:
    """The fields (besides config) that make up this op's identity."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}

  def replace(self, **changes) -> Op:
    """Returns a copy of this op with fields replaced (e.g. `config=`).

    Raises:
      TypeError: for a field the op does not have, or a value `Op` refuses (above).
    """
    return dataclasses.replace(self, **changes)

  def vjp_op(self) -> Op:
    """The op computing this op's backward pass.

    Returns:
      An instance of `vjp_cls` carrying the fields this op shares with it (such as
      `interpret`), with no pinned config.

    Raises:
      NotImplementedError: when the op has no VJP op (`vjp_cls` is None): its
        gradient is JAX's autodiff of its forward.
    """
    vjp = getattr(self, "vjp", None)
    if vjp is not None:
      return vjp
    if self.vjp_cls is None:
      raise NotImplementedError(f"{type(self).__name__} has no VJP op.")
    # Fields both ops have (e.g. `interpret`) carry over to the backward.
    shared = {f.name for f in dataclasses.fields(self.vjp_cls)} - {"config"}
    return self.vjp_cls(**{k: v for k, v in self.identity_fields().items() if k in shared})

  # ---- calling ----------------------------------------------------------

  def __call__(self, *args, **kwargs):
    """Binds, resolves a config and runs the op (works under jit/grad/vmap); called
    eagerly, as one cached jit of the call (`core/eager.py`)."""
    eager_call = eager.jitted_call(_bind_and_call, (self,), args, kwargs,
                                   name=(self.name or type(self).__name__).replace(".", "_"),
                                   static_options=self._static_options())
    if eager_call is None:
      return _bind_and_call(self, *args, **kwargs)
    program, arrays = eager_call
    return program(*arrays)


def _bind_and_call(op: Op, /, *args, **kwargs) -> Any:
  from stellarax.core import calling  # calling imports this module
  return calling.call_op(op, op._bind_values(*args, **kwargs))


def op_to_json(op: Op) -> dict[str, Any]:
  """JSON data naming `op` by its registered name and identity fields."""
  from stellarax.core.config import config_to_json
  if op.name is None:
    raise TypeError(f"{type(op).__name__} is not registered under a name.")
  fields = {}
  for k, v in op.identity_fields().items():
    fields[k] = op_to_json(v) if isinstance(v, Op) else specs.encode(specs.to_spec(v, what=k))
  data: dict[str, Any] = {"name": op.name, "fields": fields}
  if op.config is not None:
    data["config"] = config_to_json(op.config)
  return data


def op_from_json(data: Mapping[str, Any]) -> Op:
  """Inverse of `op_to_json`.

  Raises:
    KeyError: for an unknown op name.
    ValueError: for fields or a config the op rejects.
  """
  from stellarax.core.config import config_from_json, revived_enums
  cls = registry.lookup(data["name"])
  field_types = {f.name for f in dataclasses.fields(cls)}
  fields = {}
  for k, v in data.get("fields", {}).items():
    if k not in field_types:
      raise ValueError(f"{cls.__name__} has no field {k!r} (known: {sorted(field_types)}).")
    fields[k] = op_from_json(v) if isinstance(v, dict) and "name" in v and "fields" in v else specs.decode(v)
  fields = revived_enums(cls, fields)  # recorded by name; the op's code reads members
  config = data.get("config")
  if config is not None:
    fields["config"] = config_from_json(cls.config_cls, config)
  return cls(**fields)
