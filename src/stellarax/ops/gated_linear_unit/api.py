"""`stellarax.gated_linear_unit`: the public function and its dispatch."""

from __future__ import annotations

import jax

from stellarax.core import dispatch

# Tried in this order when `implementation=None` and no implementation of the
# call was measured (measurements in the active results or caches pick the
# fastest instead). XLA comes first until the Pallas kernels, which pass the
# interpret-mode and lowering tests, have been checked on a GPU
# (bench/gpu_check.sh): a kernel never run on hardware is not a safe default.
PREFERENCE = ("xla", "pallas_triton")


def gated_linear_unit(x, weights, *, activation=jax.nn.swish, precision=None, implementation=None):
  """Gated linear unit: activation(x @ weights[:, 0]) * (x @ weights[:, 1]).

  Args:
    x: (..., K) array.
    weights: (K, 2, N) array.
    activation: a known activation function (jax.nn.swish, jax.nn.gelu, ...)
      or its name ("silu", "gelu", "relu", ...).
    precision: None, a `jax.lax.Precision` or its name.
    implementation: None (best available), a name ("xla", "pallas_triton"), an Op,
      or a sequence of these tried in order.

  Returns:
    (..., N) array in x's dtype.

  Raises:
    ValueError: for shapes that do not fit or an unknown activation.
    NotImplementedError: when no requested implementation supports the input.
  """
  return dispatch.call_family("gated_linear_unit", PREFERENCE, implementation, (x, weights),
                              dict(activation=activation, precision=precision))
