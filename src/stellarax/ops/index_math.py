"""Integer index arithmetic for kernels, in int32 whatever `jax_enable_x64` says.

`lax.div` and `lax.rem` want operands of one dtype. In a kernel the traced side is
int32 (a program id, a loop index, a group offset) while the other is often a Python
int, which JAX takes as int64 once `jax_enable_x64` is on: every kernel that divided
a program id by a Python int failed to trace in such a process ("lax.div requires
arguments to have the same dtypes"). These take both sides as int32, the width every
Pallas backend indexes with.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax


def _int32(x: Any) -> Any:
  return lax.convert_element_type(x, jnp.int32)  # No op on int32 arrays.


def div(x: Any, d: Any) -> Any:
  """x / d rounded toward zero (floor for the non-negative indices kernels use).

  Args:
    x, d: int32 scalars or arrays, traced or Python ints (d != 0); other integer
      dtypes are converted to int32.

  Returns:
    An int32 array.
  """
  return lax.div(_int32(x), _int32(d))


def rem(x: Any, d: Any) -> Any:
  """The remainder of `div(x, d)`, with the sign of x (as C's %; lax.rem).

  Args:
    x, d: as for `div`.

  Returns:
    An int32 array.
  """
  return lax.rem(_int32(x), _int32(d))


def cdiv(x: Any, d: Any) -> Any:
  """x / d rounded up, for x >= 0 and d > 0 (`pl.cdiv` for traced operands).

  Args:
    x, d: as for `div`.

  Returns:
    An int32 array.
  """
  return div(_int32(x) + (_int32(d) - 1), d)
