"""Plain, high-precision references for ragged_dot and its weight gradient.

Semantics are those of `jax.lax.ragged_dot`: `lhs` rows are split into `G`
consecutive groups of `group_sizes[g]` rows; row `m` of group `g` is multiplied
by `rhs[g]`. Rows past `sum(group_sizes)` belong to no group and give zeros; a
group that runs past the last row is cut at it.

The references loop over groups and mask rows, one float32 HIGHEST-precision
matmul per group. That costs `G` times the FLOPs of the op but keeps memory at
the size of the output, and it is simple enough to trust: tests and the
autotuner's output check compare the fast implementations against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """Returns the [start, end) row range of every group, cut at `num_rows`.

  Args:
    group_sizes: (G,) integer array of rows per group; negative sizes count as 0.
    num_rows: the number of lhs rows M.

  Returns:
    (starts, ends): two (G,) int32 arrays with 0 <= starts <= ends <= num_rows.
  """
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def check_ragged_dot_shapes(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                            min_groups: int = 1) -> None:
  """Checks the operand shapes of a ragged_dot.

  Args:
    lhs: expected (M, K).
    rhs: expected (G, K, N).
    group_sizes: expected (G,) with an integer dtype.
    min_groups: the fewest groups taken (a kernel needs one; the reference none).

  Raises:
    ValueError: naming the operand whose shape or dtype does not fit.
  """
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(
        f"ragged_dot needs lhs of shape (M, K) and rhs of shape (G, K, N); got "
        f"lhs.shape={lhs.shape} and rhs.shape={rhs.shape}.")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
        f"The contracting sizes differ: lhs.shape={lhs.shape} has K={lhs.shape[1]} but "
        f"rhs.shape={rhs.shape} has K={rhs.shape[1]}; rhs must be (G, K, N).")
  check_group_sizes(group_sizes, rhs.shape[0], min_groups=min_groups)


def check_group_sizes(group_sizes: jax.Array, num_groups: int, *, min_groups: int = 1) -> None:
  """Checks that `group_sizes` is a (num_groups,) integer array with num_groups >=
  min_groups (a kernel needs a group; the reference and the op take none: zeros).

  Raises:
    ValueError: when the shape, dtype or group count does not fit.
  """
  if num_groups < min_groups:
    raise ValueError(f"this ragged_dot kernel needs at least {min_groups} group; got "
                     f"{num_groups=} (stellarax.ragged_dot takes none, returning zeros).")
  if group_sizes.shape != (num_groups,):
    raise ValueError(
        f"group_sizes.shape={group_sizes.shape} must be ({num_groups},), one size per group "
        f"of rhs (or per num_groups for the weight gradient).")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes.dtype={group_sizes.dtype} must be an integer dtype (int32).")


def _row_masks(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """Returns a (G, M) bool array: True where row m belongs to group g."""
  starts, ends = group_bounds(group_sizes, num_rows)
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def ragged_dot_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
  """Computes `jax.lax.ragged_dot(lhs, rhs, group_sizes)` in float32, HIGHEST precision.

  Args:
    lhs: (M, K) array.
    rhs: (G, K, N) array.
    group_sizes: (G,) integer array; groups are consecutive row ranges of lhs.
    preferred_element_type: output dtype; defaults to lhs.dtype.

  Returns:
    (M, N) array: row m of group g is lhs[m] @ rhs[g]; rows in no group are zero.

  Raises:
    ValueError: when the operand shapes do not fit together.
  """
  check_ragged_dot_shapes(lhs, rhs, group_sizes, min_groups=0)
  out_dtype = preferred_element_type or lhs.dtype
  lhs32 = lhs.astype(jnp.float32)

  def add_group(out, group):
    rhs_g, rows_g = group
    y = jnp.dot(lhs32, rhs_g.astype(jnp.float32), precision=_HIGHEST)
    return jnp.where(rows_g[:, None], y, out), None

  init = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
  out, _ = lax.scan(add_group, init, (rhs, _row_masks(group_sizes, lhs.shape[0])))
  return out.astype(out_dtype)


def ragged_dot_rhs_grad_reference(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    num_groups: int,
    *,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
  """Computes the rhs (weight) gradient of ragged_dot in float32, HIGHEST precision.

  Args:
    lhs: (M, K) array, the forward lhs.
    dout: (M, N) array, the cotangent of the forward output.
    group_sizes: (num_groups,) integer array.
    num_groups: G, the number of groups (rhs.shape[0] in the forward pass).
    preferred_element_type: output dtype; defaults to lhs.dtype.

  Returns:
    (G, K, N) array whose slice g is lhs[rows of g].T @ dout[rows of g]; zero for
    an empty group.

  Raises:
    ValueError: when the operand shapes do not fit together.
  """
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(
        f"The weight gradient needs lhs (M, K) and dout (M, N) with the same M; got "
        f"lhs.shape={lhs.shape} and dout.shape={dout.shape}.")
  check_group_sizes(group_sizes, num_groups, min_groups=0)
  out_dtype = preferred_element_type or lhs.dtype
  lhs32, dout32 = lhs.astype(jnp.float32), dout.astype(jnp.float32)

  def group_grad(rows_g):
    masked = jnp.where(rows_g[:, None], lhs32, 0.0)
    return jnp.dot(masked.T, dout32, precision=_HIGHEST)

  grads = lax.map(group_grad, _row_masks(group_sizes, lhs.shape[0]))
  return grads.astype(out_dtype)
