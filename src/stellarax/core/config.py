"""Op configs: frozen, keyword-only, slotted, hashable dataclasses.

An implementation's tunable hyperparameters (tile sizes, pipeline depth, chunk
sizes, strategies) live in one config class. Configs are validated when built
(`__post_init__`), so a search space is a plain `set` of valid configs and a
bad value fails at construction with a message that says what to pass.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from stellarax.core import specs

T = TypeVar("T")

def config_dataclass(cls: type[T]) -> type[T]:
  """Makes `cls` a config class: `@config_dataclass class MyConfig: ...`.

  Args:
    cls: a class whose annotated attributes are the tunables, each with a default.
      Validate values in `__post_init__` (e.g. `check_power_of_two`), raising
      ValueError, so that a search space holds valid configs only.

  Returns:
    A frozen, keyword-only, slotted dataclass: hashable (a search space is a set) and
    comparable, serialised field by field (`config_to_json`).

  Raises:
    TypeError: as `dataclasses.dataclass` does, e.g. for a field without a default
      after one with a default.
  """
  return dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)


@config_dataclass
class NoConfig:
  """The config of an implementation with nothing to tune."""


def check_power_of_two(name: str, value: int, *, minimum: int = 1, maximum: int | None = None) -> None:
  """Raises ValueError unless `value` is a power of two in [minimum, maximum]."""
  ok = isinstance(value, int) and value >= minimum and value & (value - 1) == 0
  if maximum is not None:
    ok = ok and value <= maximum
  if not ok:
    upper = f" and <= {maximum}" if maximum is not None else ""
    raise ValueError(f"{name}={value!r} must be a power of two >= {minimum}{upper}.")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
  """Raises ValueError unless `value` is one of `choices`."""
  choices = tuple(choices)
  if value not in choices:
    raise ValueError(f"{name}={value!r} must be one of {choices}.")


def check_positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
  """Raises ValueError unless `value` is an int >= 1 (or None when allowed)."""
  if value is None and allow_none:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    none = " or None" if allow_none else ""
    raise ValueError(f"{name}={value!r} must be a positive int{none}.")


def is_config_class(cls: Any) -> bool:
  """Whether `cls` can be an op's config class: a dataclass (`config_dataclass`) or a
  named tuple (`typing.NamedTuple`), whose fields are the tunables."""
  return isinstance(cls, type) and (dataclasses.is_dataclass(cls) or _is_named_tuple(cls))


def _is_named_tuple(cls: type) -> bool:
  return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def field_defaults(cls: type) -> dict[str, Any]:
  """A config class's (or an op's) field names, in order, and their defaults
  (`dataclasses.MISSING` for none).

  Raises:
    TypeError: for a class that is neither a dataclass nor a named tuple.
  """
  if dataclasses.is_dataclass(cls):
    return {f.name: f.default for f in dataclasses.fields(cls)}
  if isinstance(cls, type) and _is_named_tuple(cls):
    return {name: cls._field_defaults.get(name, dataclasses.MISSING) for name in cls._fields}
  raise TypeError(f"{cls!r} is neither a dataclass nor a named tuple, so it has no fields "
                  "to tune: make it a @stellarax.config_dataclass or a typing.NamedTuple.")


def config_items(config: Any) -> dict[str, Any]:
  """A config's tunables by name, in field order.

  Raises:
    TypeError: for a value that is no config (see `is_config_class`).
  """
  if isinstance(config, type) or not is_config_class(type(config)):
    raise TypeError(f"config={config!r} is not a config: a @stellarax.config_dataclass "
                    "instance or a typing.NamedTuple one.")
  return {name: getattr(config, name) for name in field_defaults(type(config))}


def config_to_json(config: Any) -> dict[str, Any]:
  """Returns a config's fields as JSON-able data (no class path).

  Raises:
    TypeError: for a value that is no config, or a field value JSON cannot record.
  """
  return {name: specs.encode(specs.to_spec(value, what=name))
          for name, value in config_items(config).items()}


def config_from_json(config_cls: type[T], data: Mapping[str, Any]) -> T:
  """Builds a `config_cls` from `config_to_json` output, validating it.

  Raises:
    ValueError: when `data` has fields the class lacks, a value of another type than a
      field annotated with a plain type (int, float, bool, str, None) takes, or values
      the class rejects.
  """
  if not isinstance(data, Mapping):
    raise ValueError(f"A {config_cls.__name__} must be a JSON object, got {data!r}.")
  known = set(field_defaults(config_cls))
  unknown = set(data) - known
  if unknown:
    raise ValueError(
        f"{config_cls.__name__} has no field(s) {sorted(unknown)}; its fields are "
        f"{sorted(known)}. The data may come from another stellarax version.")
  values = revived_enums(config_cls, {k: specs.decode(v) for k, v in data.items()})
  check_plain_types(config_cls, values)
  return config_cls(**values)


def revived_enums(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
  """Values read from JSON for the fields of `cls`, with each enum member recorded by
  its name (an IntEnum's or StrEnum's by its value) turned back into the member, where
  the field's annotation names its Enum class (alone, in a union, or as
  `tuple[E, ...]`/`list[E]`) or its default is a member of one. JSON records members
  by name (`specs.to_spec`): read back as strings, a loaded config's
  `config.order.value` raised AttributeError.

  Args:
    cls: a config class (`is_config_class`) or an `Op` subclass.
    values: field name -> value decoded from JSON (`specs.decode`).

  Returns:
    The values, names of members of a field's enum revived (others as they were).
  """
  enums = _enum_fields(cls)
  return {k: _revived(v, enums.get(k, ())) for k, v in values.items()}


def _revived(value: Any, enums: tuple[type[enum.Enum], ...]) -> Any:
  if isinstance(value, tuple):
    return tuple(_revived(v, enums) for v in value)
  for kind in enums:
    if issubclass(kind, (int, str)):  # an IntEnum or StrEnum is recorded as its value
      if not isinstance(value, bool) and value in kind._value2member_map_:
        return kind._value2member_map_[value]
    elif isinstance(value, str) and value in kind.__members__:  # others by name
      return kind[value]
  return value


@functools.cache
def _enum_fields(cls: type) -> dict[str, tuple[type[enum.Enum], ...]]:
  """Field name -> the Enum classes its annotation or default names (see
  `revived_enums`); fields naming none are left out."""
  try:
    hints = typing.get_type_hints(cls)
  except Exception:  # noqa: BLE001 (an annotation that does not resolve: the defaults say)
    hints = {}
  out = {}
  for name, default in field_defaults(cls).items():
    named = _members(hints.get(name))
    found = [m for m in named if isinstance(m, type) and issubclass(m, enum.Enum)]
    defaults = default if isinstance(default, tuple) else (default,)
    found += [type(d) for d in defaults if isinstance(d, enum.Enum)]
    if found:
      out[name] = tuple(dict.fromkeys(found))
  return out


def _members(hint: Any) -> list[Any]:
  """The types a hint names: a union's members, a tuple's or list's element types, or
  itself."""
  if hint is None:
    return []
  origin = typing.get_origin(hint)
  if isinstance(hint, types.UnionType) or origin in (typing.Union, tuple, list):
    return [m for arg in typing.get_args(hint) if arg is not Ellipsis for m in _members(arg)]
  return [hint]


def check_plain_types(cls: type, values: Mapping[str, Any]) -> None:
  """Checks values read from JSON against the fields of dataclass `cls` annotated with
  plain types (int, float, bool, str, None and unions of them); other fields and
  names that are no field are left to the caller. An int passes for a float (a
  hand-written 2 means 2.0), a bool never passes for an int.

  Args:
    cls: the dataclass the values are for.
    values: field name -> value.

  Raises:
    ValueError: naming the first field whose value has another type, and the types
      it takes.
  """
  for name, value in values.items():
    expected = _plain_types(cls).get(name)
    if expected is not None and not _is_instance(value, expected):
      takes = " or ".join("None" if t is type(None) else t.__name__ for t in expected)
      found = type(value).__name__
      article = "an" if found[0] in "aeiou" else "a"
      raise ValueError(f"{cls.__name__}.{name}={value!r} is {article} {found}; "
                       f"the field takes {takes}.")


_PLAIN = (bool, int, float, str, type(None))


@functools.cache
def _plain_types(config_cls: type) -> dict[str, tuple[type, ...]]:
  """The fields annotated with plain types (int, float, bool, str, None and unions of
  them), and those types; fields of other or unresolvable annotations are left out."""
  try:
    hints = typing.get_type_hints(config_cls)
  except Exception:  # noqa: BLE001 (an annotation that does not resolve: nothing checked)
    return {}
  out = {}
  for name, hint in hints.items():
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) or (
        typing.get_origin(hint) is typing.Union) else (hint,)
    if all(m in _PLAIN for m in members):
      out[name] = tuple(members)
  return out


def _is_instance(value: Any, expected: tuple[type, ...]) -> bool:
  if isinstance(value, bool):
    return bool in expected
  if isinstance(value, int) and float in expected:
    return True  # JSON writes 2.0 as 2.0, but a hand-written 2 means the same
  return isinstance(value, expected)
