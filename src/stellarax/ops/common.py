"""Argument canonicalisation shared by the op families."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from stellarax.core import specs

PRECISIONS = ("DEFAULT", "HIGH", "HIGHEST")


def canonical_precision(precision: Any) -> str | None:
  """None, a `jax.lax.Precision` or its name, or a pair of one of those for both
  operands (as jax takes) -> None or the name.

  None takes `jax.default_matmul_precision`'s precision where one is set (what jax
  computes then), so that a call's key tells the two apart: an entry measured at the
  default precision answered a call under "highest". A dot-algorithm preset there,
  which no precision names, leaves None. A stored call's None stays None
  (`specs.decoding_stored`).

  Raises:
    ValueError: for anything else, a pair of two different precisions included (the
      kernels take one precision for both operands).
  """
  if isinstance(precision, (tuple, list)) and len(precision) == 2:
    first, second = (_one_precision(p) for p in precision)
    if first != second:
      higher = max(first or "DEFAULT", second or "DEFAULT", key=PRECISIONS.index)
      raise ValueError(
          f"precision={precision!r} gives the operands different precisions; stellarax's"
          f" kernels take one for both: pass one, e.g. precision={higher!r} (the higher).")
    return first
  return _one_precision(precision)


def _one_precision(precision: Any) -> str | None:
  if precision is None:
    return None if specs.decoding_stored() else _default_precision()
  if isinstance(precision, jax.lax.Precision):
    return precision.name
  if isinstance(precision, str) and precision.upper() in PRECISIONS:
    return precision.upper()
  raise ValueError(f"precision={precision!r} must be None, a jax.lax.Precision or one of"
                   f" {PRECISIONS} (or a pair of one of those for both operands).")


def _default_precision() -> str | None:
  """The precision `jax.default_matmul_precision` sets now, by name; None if none."""
  value = jax.config.jax_default_matmul_precision
  if value is None:
    return None
  try:
    return jax.lax.Precision(value).name  # "tensorfloat32" -> HIGH, "float32" -> HIGHEST
  except (ValueError, TypeError):
    return None  # a dot-algorithm preset (e.g. "BF16_BF16_F32_X3"): no precision names it


def concrete_float(value: Any) -> float | None:
  """`value` as a Python float, or None when it is no concrete number (a traced value,
  a string, a list): the check of a static numeric option (a scale, an epsilon)."""
  try:
    return float(value)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
    return None


def static_option_error(name: str, value: Any, expected: str, *, other_way: str = "") -> ValueError:
  """The error for a static option (one that shapes what is computed, so it must be known
  when the call is traced) given a value it cannot take: a traced one (the message says
  how to pass a constant), or another (a string, NaN). One message for every op's
  static options.

  Args:
    name: the option's name.
    value: what was given.
    expected: what it must be, e.g. "a Python bool".
    other_way: a further way out, said after the usual one (e.g. "choose between two
      calls with lax.cond").

  Returns:
    A ValueError for the caller to raise.
  """
  if not _is_traced(value):
    return ValueError(f"{name}={value!r:.80} must be {expected}.")
  also = f", or {other_way}" if other_way else ""
  return ValueError(f"{name}={value!r:.80} must be {expected}: it is a static option of the "
                    "call, and a traced value cannot be one. Pass a constant, or mark the "
                    f"argument static (jax.jit(f, static_argnames=...)){also}.")


def refuse_traced(name: str, value: Any) -> None:
  """Raises `static_option_error` when a static option (a window, an axis) holds a traced
  value, or a tuple or list of them does.

  Args:
    name: the option's name, for the message.
    value: what was given (a value, or a tuple or list of them).
  """
  if _is_traced(value):
    raise static_option_error(name, value, "a Python int or a tuple of them")


def _is_traced(value: Any) -> bool:
  """Whether `value`, or an item of a tuple or list of them, is traced."""
  leaves = value if isinstance(value, (tuple, list)) else (value,)
  return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


def lax_precision(name: str | None) -> jax.lax.Precision | None:
  """Inverse of `canonical_precision`."""
  return None if name is None else jax.lax.Precision[name]


def canonical_dtype(dtype: Any, *, what: str) -> str | None:
  """None or anything `jnp.dtype` takes -> None or the name of the dtype jax computes
  in: without x64, float64 is float32 (a call's key told them apart only by name, so an
  entry measured for a float32 output answered a float64 one). A stored call's dtype
  stays as recorded (`specs.decoding_stored`)."""
  if dtype is None:
    return None
  try:
    return jnp.dtype(specs.computed_dtype(jnp.dtype(dtype))).name
  except TypeError:
    raise ValueError(f"{what}={dtype!r} is not a dtype.") from None


def dtype_of(x: Any) -> jnp.dtype:
  """The dtype of an array, tracer, ShapeDtypeStruct or ArraySpec."""
  return jnp.dtype(x.dtype)


def check_array(name: str, x: Any) -> None:
  """Raises TypeError unless `x` is array-like (an array, tracer or spec: shape and dtype)."""
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(f"{name} must be an array (jax or numpy), got {type(x).__name__}: "
                    f"{x!r:.60}. Wrap it: jnp.asarray({name}).")


def check_rank(name: str, x: Any, rank: int, layout: str) -> None:
  """Raises ValueError unless `x` has `rank` dims (`layout` names them); TypeError unless
  it is an array."""
  check_array(name, x)
  if len(x.shape) != rank:
    raise ValueError(f"{name} must have shape {layout}, got shape {tuple(x.shape)}.")


def check_floating(name: str, x: Any) -> None:
  """Raises TypeError unless `x` is an array of a floating dtype."""
  check_array(name, x)
  if not jnp.issubdtype(dtype_of(x), jnp.floating):
    raise TypeError(f"{name} must be a floating array, got dtype {dtype_of(x)}.")


def vjp_by_autodiff(fn, primals: dict[str, Any], dout: Any, differentiable: tuple[str, ...]) -> dict[str, Any]:
  """Gradients of `fn(**primals)` for the named (non-None) arguments.

  Used by VJP ops whose backward is JAX's derivative of a forward
  implementation run with the VJP op's own config (e.g. other chunk sizes).
  """
  names = [n for n in differentiable if primals.get(n) is not None]
  def f(*xs):
    return fn(**{**primals, **dict(zip(names, xs))})
  _, pullback = jax.vjp(f, *(primals[n] for n in names))
  return dict(zip(names, pullback(dout)))
