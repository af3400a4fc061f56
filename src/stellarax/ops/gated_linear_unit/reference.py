"""Plain reference for the gated linear unit, and the registry of named activations.

  gated_linear_unit(x, w) = activation(x @ w[:, 0]) * (x @ w[:, 1])

with x (..., K) and w (K, 2, N). Activations are named (see `ACTIVATIONS`) so that
an op holds a string, never a callable: two ops built with `jax.nn.silu` and
`"silu"` are then equal and serialise the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def _identity(x: jax.Array) -> jax.Array:
  return x


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.swish,
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "identity": _identity,
}

# Names that mean the same function map to one canonical name.
_ALIASES = {"swish": "silu"}

# Known function objects and their canonical names (compared by identity: some
# jax.nn functions are custom_jvp objects, and partials compare unequal anyway).
_KNOWN_FUNCTIONS: tuple[tuple[Callable, str], ...] = (
    (jax.nn.silu, "silu"),
    (jax.nn.swish, "silu"),
    (jax.nn.gelu, "gelu"),  # its default is approximate=True
    (jax.nn.relu, "relu"),
    (jax.nn.sigmoid, "sigmoid"),
    (jnp.tanh, "tanh"),
    (jax.nn.tanh, "tanh"),
    *((fn, _ALIASES.get(name, name)) for name, fn in ACTIVATIONS.items()),
)


def activation_name(activation: str | Callable) -> str:
  """Returns the canonical name of a known activation given by name or function.

  Args:
    activation: a key of ACTIVATIONS, or a known function such as jax.nn.silu
      (jax.nn.gelu means its default, the tanh approximation: "gelu").

  Returns:
    The canonical name ("swish" and jax.nn.swish give "silu").

  Raises:
    ValueError: for an unknown name or function, listing the known names.
  """
  if isinstance(activation, str):
    if activation in ACTIVATIONS:
      return _ALIASES.get(activation, activation)
  else:
    for fn, name in _KNOWN_FUNCTIONS:
      if activation is fn:
        return name
  raise ValueError(
      f"activation={activation!r} is not a known activation; pass one of the names "
      f"{sorted(ACTIVATIONS)} (or the matching jax.nn function). Ops take names, not "
      f"arbitrary callables, so that they stay comparable and serialisable.")


def get_activation(activation: str | Callable) -> Callable[[jax.Array], jax.Array]:
  """Returns the function of a known activation given by name or function.

  Raises:
    ValueError: for an unknown activation (see activation_name).
  """
  return ACTIVATIONS[activation_name(activation)]


def check_glu_shapes(x: jax.Array, weights: jax.Array) -> None:
  """Checks x (..., K) against weights (K, 2, N).

  Raises:
    ValueError: when the shapes do not fit.
  """
  if x.ndim < 1 or weights.ndim != 3 or weights.shape[1] != 2 or x.shape[-1] != weights.shape[0]:
    raise ValueError(
        f"gated_linear_unit needs x of shape (..., K) and weights of shape (K, 2, N) (gate "
        f"then linear projection); got x.shape={x.shape}, weights.shape={weights.shape}.")


def gated_linear_unit_reference(x: jax.Array, weights: jax.Array, *,
                                activation: str | Callable) -> jax.Array:
  """Computes activation(x @ w[:, 0]) * (x @ w[:, 1]) in float32 at HIGHEST precision.

  Args:
    x: (..., K) array.
    weights: (K, 2, N) array; [:, 0] is the gate projection, [:, 1] the linear one.
    activation: a name from ACTIVATIONS or a known jax.nn function.

  Returns:
    (..., N) array in x.dtype.

  Raises:
    ValueError: for shapes that do not fit or an unknown activation.
  """
  check_glu_shapes(x, weights)
  act = get_activation(activation)
  proj = jnp.einsum("...k,kjn->...jn", x.astype(jnp.float32), weights.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)
  return (act(proj[..., 0, :]) * proj[..., 1, :]).astype(x.dtype)
