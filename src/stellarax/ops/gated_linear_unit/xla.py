"""The gated linear unit in plain JAX (XLA), with one fused or two separate matmuls.

The tunable `fused` chooses between one (K, 2N) matmul split afterwards (one pass
over x, a larger matmul) and two (K, N) matmuls; which is faster depends on the
shapes and the backend. Both accumulate in float32 and apply the activation and
the product in float32 before casting to x's dtype.
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
  """(..., K) x (K, D) -> (..., D) float32."""
  return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def gated_linear_unit_xla(x: jax.Array, weights: jax.Array, *, activation: str | Callable,
                          fused: bool, precision: lax.PrecisionLike = None) -> jax.Array:
  """Computes activation(x @ weights[:, 0]) * (x @ weights[:, 1]).

  Args:
    x: (..., K) array.
    weights: (K, 2, N) array; [:, 0] is the gate projection, [:, 1] the linear one.
    activation: a name from ACTIVATIONS or a known jax.nn function.
    fused: True: one matmul against weights.reshape(K, 2N), then split; False: two
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
  k, _, n = weights.shape
  if fused:
    # (K, 2, N) -> (K, 2N): columns [0, N) are the gate, [N, 2N) the linear part.
    proj = _project(x, weights.reshape(k, 2 * n), precision)
    gate, linear = proj[..., :n], proj[..., n:]
  else:
    gate = _project(x, weights[:, 0], precision)
    linear = _project(x, weights[:, 1], precision)
  return (act(gate) * linear).astype(x.dtype)
