"""The gated linear unit in plain JAX (XLA), with one fused or two separate matmuls.

The tunable `fused` chooses between one matmul against the whole (K, 2, N) weights,
split afterwards (one pass over x, a larger matmul), and two (K, N) matmuls; which is
faster depends on the shapes and the backend. Both accumulate in float32 and apply
the activation and the product in float32 before casting to x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from stellarax.ops.gated_linear_unit.reference import (
    ACTIVATIONS as ACTIVATIONS, activation_name as activation_name, check_glu_shapes,
    get_activation)


def _project(x, w, precision):
  """(..., K) x (K, *D) -> (..., *D) float32."""
  return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def gated_linear_unit_xla(x: jax.Array, weights: jax.Array, *, activation: str | Callable,
                          fused: bool, precision: lax.PrecisionLike = None) -> jax.Array:
  """Computes activation(x @ weights[:, 0]) * (x @ weights[:, 1]).

  Args:
    x: (..., K) array.
    weights: (K, 2, N) array; [:, 0] is the gate projection, [:, 1] the linear one.
    activation: a name from ACTIVATIONS or a known jax.nn function.
    fused: True: one matmul against the (K, 2, N) weights, then split; False: two
      matmuls against weights[:, 0] and weights[:, 1].
    precision: matmul precision, as for `jax.lax.dot`.

  Returns:
    (..., N) array in x.dtype.

  Raises:
    ValueError: for shapes that do not fit, an unknown activation or a non-bool fused.
  """
  check_glu_shapes(x, weights)
  if not isinstance(fused, bool):
    raise ValueError(f"fused={fused!r} must be True or False.")
  act = get_activation(activation)
  if fused:
    # One matmul against the (K, 2, N) weights as they are, not reshaped to (K, 2N):
    # the same product (XLA multiplies by the contiguous (K, 2N) view either way), but
    # N stays a dimension of its own, so weights split on N stay split when XLA
    # partitions it (a reshape merging 2 and a split N makes XLA gather them).
    proj = _project(x, weights, precision)
    gate, linear = proj[..., 0, :], proj[..., 1, :]
  else:
    gate = _project(x, weights[:, 0], precision)
    linear = _project(x, weights[:, 1], precision)
  return (act(gate) * linear).astype(x.dtype)
