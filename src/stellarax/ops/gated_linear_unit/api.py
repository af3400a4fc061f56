"""`stellarax.gated_linear_unit`: the public function and its dispatch."""

from __future__ import annotations

import jax

from stellarax.core import dispatch

# Tried in this order when `implementation=None` and no implementation of the
# call was measured (measurements in the active results or caches pick the
# fastest instead). On an H200 (bench/gpu_check.sh, 2026-12-04, BENCHMARKS.md) the
# Triton kernels were correct; XLA's forward was faster (2.69 ms against 3.08 ms) and
# Triton's forward and backward faster (11.7 ms against 16.1 ms): XLA stays first,
# and tuning picks Triton for the calls it wins.
PREFERENCE = ("xla", "pallas_triton")


def gated_linear_unit(x, weights, *, activation=jax.nn.swish, precision=None, implementation=None):
  """Gated linear unit: activation(x @ weights[:, 0]) * (x @ weights[:, 1]).

  Args:
    x: (..., K) array.
    weights: (K, 2, N) array.
    activation: a known activation function (jax.nn.swish, jax.nn.gelu, ...)
      or its name ("silu", "gelu", "relu", ...).
    precision: None, a `jax.lax.Precision` or its name, or a pair of one precision
      for both operands.
    implementation: None (best available), a name ("xla", "pallas_triton"), an Op,
      or a sequence of these tried in order.

  Returns:
    (..., N) array in x's dtype.

  Raises:
    ValueError: for shapes that do not fit or an unknown activation.
    NotImplementedError: when no requested implementation supports the input (a list
      passes by the kernels that do not run on the device traced for, saying why).
    ValueError: from JAX, for a Pallas kernel named alone where it cannot be lowered (a
      CPU, without `interpret=True`); called eagerly, a note says how to run it.
  """
  return dispatch.call_family("gated_linear_unit", PREFERENCE, implementation, (x, weights),
                              dict(activation=activation, precision=precision))
