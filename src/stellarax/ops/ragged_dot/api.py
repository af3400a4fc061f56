"""`stellarax.ragged_dot`: the public function and its dispatch."""

from __future__ import annotations

from stellarax.core import dispatch

# Tried in this order when `implementation=None` and no implementation of the
# call was measured (measurements in the active results or caches pick the
# fastest instead). On an H200 (bench/gpu_check.sh, 2026-12-04, BENCHMARKS.md) both
# Pallas kernels were correct at the target shapes, and by device time Mosaic GPU ran
# the forward 5.9x (G=8) to 33x (G=64) faster than XLA's ragged_dot, Triton about as
# fast; a device without Mosaic GPU (before Hopper) takes Triton, a CPU XLA.
PREFERENCE = ("pallas_mosaic_gpu", "pallas_triton", "xla")


def ragged_dot(lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, implementation=None):
  """Grouped matmul, as `jax.lax.ragged_dot`.

  Args:
    lhs: (M, K) array; rows of group g are consecutive, in group order.
    rhs: (G, K, N) array, one matrix per group.
    group_sizes: (G,) integer array; may sum to less than M (the remaining
      rows give zeros, and their values, NaN included, reach no gradient) and
      contain zeros (empty groups). Sizes must be >= 0 and
      sum to at most M; as in jax.lax.ragged_dot, the values are not checked
      (that would wait for them on the device), and other values give undefined
      results.
    precision: None, a `jax.lax.Precision` or its name, or a pair of one precision
      for both operands (the kernels take one precision for both).
    preferred_element_type: output dtype (default: the operands' dtype, or when they
      differ `jnp.result_type` of the two, as jax.lax.ragged_dot does, but for float16
      with bfloat16: float32 here, bfloat16 there).
    implementation: None (best available), a name ("xla", "pallas_triton",
      ...), an Op instance, or a sequence of these tried in order.

  Returns:
    The (M, N) product.

  Raises:
    ValueError, TypeError: for inconsistent shapes or dtypes.
    NotImplementedError: when no requested implementation supports the input (a list
      passes by the kernels that do not run on the device traced for, saying why).
    ValueError: from JAX, for a Pallas kernel named alone where it cannot be lowered (a
      CPU, without `interpret=True`); called eagerly, a note says how to run it.
  """
  return dispatch.call_family(
      "ragged_dot", PREFERENCE, implementation, (lhs, rhs, group_sizes),
      dict(precision=precision, preferred_element_type=preferred_element_type))
