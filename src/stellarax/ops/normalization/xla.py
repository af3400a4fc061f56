"""layer_norm and rms_norm in plain JAX (XLA).

Statistics are float32 whatever x's dtype. The output is one elementwise pass,
y = (x - mean) * a + offset with a = scale / std per normalised slice: XLA fuses the two
reductions and that pass, so x is read twice and written once. (Not x * a + (offset -
mean * a), one multiply-add fewer: where a is huge, a constant row or a tiny epsilon, its
two products cancel and lose the offset.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from stellarax.ops.normalization.reference import Axis, broadcast_param, normalize_axes


def layer_norm_xla(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
                   axis: Axis = -1, epsilon: float = 1e-6) -> jax.Array:
  """Layer normalisation: (x - mean) / sqrt(var + epsilon) * scale + offset.

  The variance is the two-pass mean((x - mean)**2), which stays accurate when the
  mean is large against the spread (mean(x**2) - mean**2 would cancel); the output too
  is computed from x - mean.

  Args:
    x: input array.
    scale: None or an array of x's sizes along `axis` (increasing axis order).
    offset: None or an array of x's sizes along `axis` (increasing axis order).
    axis: an int or a tuple of ints, the dimension(s) to normalise over.
    epsilon: added to the variance.

  Returns:
    An array of x's shape and dtype.

  Raises:
    ValueError: for a bad axis or a scale/offset of the wrong shape.
  """
  axes = normalize_axes(axis, x.ndim)
  scale32 = broadcast_param("scale", scale, x, axes)
  offset32 = broadcast_param("offset", offset, x, axes)
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=axes, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=axes, keepdims=True)
  mul = lax.rsqrt(var + jnp.float32(epsilon))
  if scale32 is not None:
    mul = mul * scale32
  # (x - mean) * mul, not x * mul - mean * mul: where mul is huge (a constant row, a tiny
  # epsilon) the two products cancel and lose the offset (0.25 of 0.25 at epsilon 1e-12).
  out = (x32 - mean) * mul
  if offset32 is not None:
    out = out + offset32
  return out.astype(x.dtype)


def rms_norm_xla(x: jax.Array, scale: jax.Array | None, *, offset: jax.Array | None = None,
                 axis: Axis = -1, epsilon: float = 1e-6) -> jax.Array:
  """Root-mean-square normalisation: x / sqrt(mean(x**2) + epsilon) * scale + offset.

  Args:
    x: input array.
    scale: None or an array of x's sizes along `axis` (increasing axis order).
    offset: None or an array of x's sizes along `axis`, added in float32 (x's dtype
      is rounded to once).
    axis: an int or a tuple of ints, the dimension(s) to normalise over.
    epsilon: added to the mean square.

  Returns:
    An array of x's shape and dtype.

  Raises:
    ValueError: for a bad axis or a scale of the wrong shape.
  """
  axes = normalize_axes(axis, x.ndim)
  scale32 = broadcast_param("scale", scale, x, axes)
  offset32 = broadcast_param("offset", offset, x, axes)
  x32 = x.astype(jnp.float32)
  mul = lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + jnp.float32(epsilon))
  if scale32 is not None:
    mul = mul * scale32
  y = x32 * mul
  if offset32 is not None:
    y = y + offset32
  return y.astype(x.dtype)
