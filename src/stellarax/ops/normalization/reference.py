"""Plain, high-precision references for layer_norm and rms_norm.

Both normalise `x` over `axis` (an int or a tuple of ints). Statistics and the
affine transform are computed in float32; the result has x's dtype. `scale` and
`offset` have the shape of the normalised dimensions, in increasing axis order.

  layer_norm(x) = (x - mean) / sqrt(var + epsilon) * scale + offset
  rms_norm(x)   = x / sqrt(mean(x**2) + epsilon) * scale + offset
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from stellarax.ops import common

Axis = int | Sequence[int]


def normalize_axes(axis: Axis, ndim: int) -> tuple[int, ...]:
  """Returns `axis` as a sorted tuple of distinct non-negative axes of an ndim-D array.

  Args:
    axis: an integer (a numpy one too) or a sequence of them; negative ones count
      from the end.
    ndim: the array's number of dimensions.

  Raises:
    ValueError: for an axis out of range or not an integer (bools are not), a repeated
      axis or no axis at all.
  """
  common.refuse_traced("axis", axis)
  single = _integer(axis)
  try:
    axes = (single,) if single is not None else tuple(_integer(a) for a in axis)
  except TypeError:
    axes = (None,)  # Neither an integer nor a sequence: refused below.
  if not axes or not all(a is not None and -ndim <= a < ndim for a in axes):
    raise ValueError(f"axis={axis!r} must be an int or a non-empty tuple of ints in "
                     f"[{-ndim}, {ndim}) for an array of {ndim} dimensions.")
  canonical = tuple(sorted(a % ndim for a in axes))
  if len(set(canonical)) != len(canonical):
    raise ValueError(f"axis={axis!r} names the same dimension twice.")
  return canonical


def _integer(value) -> int | None:
  """`value` as an int when it is an integer (Python or numpy, not a bool), else None."""
  if isinstance(value, bool) or getattr(value, "dtype", None) == bool:
    return None
  try:
    return operator.index(value)
  except TypeError:
    return None


def param_shape(x: jax.Array, axes: tuple[int, ...]) -> tuple[int, ...]:
  """Returns the shape that scale and offset must have: x's sizes along `axes`."""
  return tuple(x.shape[a] for a in axes)


def broadcast_param(name: str, p: jax.Array | None, x: jax.Array,
                    axes: tuple[int, ...]) -> jax.Array | None:
  """Checks a scale or offset and reshapes it to broadcast against x (float32).

  Raises:
    ValueError: when p's shape is not x's sizes along the normalised axes.
  """
  if p is None:
    return None
  expected = param_shape(x, axes)
  if p.shape != expected:
    raise ValueError(f"{name}.shape={p.shape} must be {expected}: x.shape={x.shape} along the "
                     f"normalised axes {axes}, in increasing axis order.")
  shape = [x.shape[a] if a in axes else 1 for a in range(x.ndim)]
  return p.astype(jnp.float32).reshape(shape)


def layer_norm_reference(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
                         axis: Axis = -1, epsilon: float = 1e-6) -> jax.Array:
  """Layer normalisation with two-pass float32 statistics.

  Args:
    x: input array.
    scale: None or an array of x's sizes along `axis`; multiplies the normalised x.
    offset: None or an array of x's sizes along `axis`; added last.
    axis: the dimension(s) to normalise over.
    epsilon: added to the variance.

  Returns:
    An array of x's shape and dtype.

  Raises:
    ValueError: for a bad axis or a scale/offset of the wrong shape.
  """
  axes = normalize_axes(axis, x.ndim)
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=axes, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=axes, keepdims=True)
  y = (x32 - mean) / jnp.sqrt(var + epsilon)
  scale32 = broadcast_param("scale", scale, x, axes)
  offset32 = broadcast_param("offset", offset, x, axes)
  if scale32 is not None:
    y = y * scale32
  if offset32 is not None:
    y = y + offset32
  return y.astype(x.dtype)


def rms_norm_reference(x: jax.Array, scale: jax.Array | None, *, offset: jax.Array | None = None,
                       axis: Axis = -1, epsilon: float = 1e-6) -> jax.Array:
  """Root-mean-square normalisation with float32 statistics.

  Args:
    x: input array.
    scale: None or an array of x's sizes along `axis`; multiplies the normalised x.
    offset: None or an array of x's sizes along `axis`; added last, before the one
      rounding to x's dtype.
    axis: the dimension(s) to normalise over.
    epsilon: added to the mean square.

  Returns:
    An array of x's shape and dtype.

  Raises:
    ValueError: for a bad axis or a scale of the wrong shape.
  """
  axes = normalize_axes(axis, x.ndim)
  x32 = x.astype(jnp.float32)
  y = x32 / jnp.sqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + epsilon)
  scale32 = broadcast_param("scale", scale, x, axes)
  offset32 = broadcast_param("offset", offset, x, axes)
  if scale32 is not None:
    y = y * scale32
  if offset32 is not None:
    y = y + offset32
  return y.astype(x.dtype)
