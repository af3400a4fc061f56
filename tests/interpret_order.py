"""Runs interpret-mode Pallas grids in another order, to find programs that depend on
the order they run in.

On a GPU the programs of a Triton-style grid run in parallel, in any order. Interpret
mode runs them one after another in row-major order, so a kernel in which two programs
write the same element with different values, or one program reads what another
wrote, still gives one fixed answer on the CPU and passes its test, where the GPU's
answer would change from run to run. Running the same kernel with the grid walked in
another order and comparing the outputs bit for bit finds such kernels: a kernel
whose programs are independent gives identical bits in any order.

`reversed_grid()` walks the grid as (0, ..., 0) first, then backwards from the last
program (interpret mode's loop starts at zero, and every order here has to): every
pair of programs but those with the first one run in the opposite order.
`assert_order_independent(fn, *args)` runs `fn` both ways and compares.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas import hlo_interpreter


def _previous_indices(grid, indices):
  """The row-major predecessor of `indices` in `grid`; (0, ..., 0) wraps to the last."""
  out = []
  borrow = jnp.bool_(True)
  for size, index in reversed(list(zip(grid, indices))):
    wraps = borrow & (index == 0)
    out.append(jnp.where(wraps, size - 1, jnp.where(borrow, index - 1, index)).astype(index.dtype))
    borrow = wraps
  return tuple(reversed(out))


@contextlib.contextmanager
def reversed_grid() -> Iterator[None]:
  """Within: interpret-mode grids run (0, ..., 0) first, then from the last program
  backwards. Clears JAX's caches on entry and exit (the order is baked into what is
  compiled, which the caches do not know)."""
  if not hasattr(hlo_interpreter, "_get_next_indices"):
    raise RuntimeError("interpret_order: jax's hlo_interpreter._get_next_indices is gone; find"
                       " where interpret mode steps through the grid.")
  original = hlo_interpreter._get_next_indices
  hlo_interpreter._get_next_indices = _previous_indices
  jax.clear_caches()
  try:
    yield
  finally:
    hlo_interpreter._get_next_indices = original
    jax.clear_caches()


def assert_order_independent(fn: Callable[..., Any], *args: Any) -> Any:
  """Runs `fn(*args)` with the grids of its interpret-mode kernels in row-major and in
  reversed order, and checks that every output is bitwise the same.

  Returns:
    The outputs (of the row-major run).

  Raises:
    AssertionError: naming the output that differs, or one with NaNs (NaN compares
      equal to NaN here, so an output of NaNs would hide any difference).
  """
  forward = jax.tree.map(np.asarray, fn(*args))
  with reversed_grid():
    backward = jax.tree.map(np.asarray, fn(*args))
  for (where, a), b in zip(jax.tree_util.tree_flatten_with_path(forward)[0],
                           jax.tree.leaves(backward), strict=True):
    if np.issubdtype(a.dtype, np.inexact):
      assert not np.isnan(a).any(), f"output {jax.tree_util.keystr(where)} has NaNs"
    np.testing.assert_array_equal(
        a, b, err_msg=f"output {jax.tree_util.keystr(where)} depends on the order of the grid's"
                      " programs (a race on the GPU)")
  return forward
