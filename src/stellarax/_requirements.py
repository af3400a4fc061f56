"""The oldest jax stellarax runs on, checked when it is imported."""

from __future__ import annotations

import re

MINIMUM_JAX = (0, 11, 2)
"""stellarax marks its op calls with `jax.experimental.xla_metadata.xla_metadata_call2`
and uses Pallas names of this release; pyproject.toml asks for the same."""


def require_jax(version: str | None = None) -> None:
  """Refuses a jax older than `MINIMUM_JAX`, with what to do.

  Args:
    version: a jax version string; default: the installed jax's.

  Raises:
    ImportError: when `version` is older, or jax is not installed.
  """
  if version is None:
    try:
      import jax  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("stellarax needs jax: pip install 'jax>={}'".format(
          ".".join(map(str, MINIMUM_JAX)))) from e
    version = jax.__version__
  numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:3])
  if numbers < MINIMUM_JAX:
    wanted = ".".join(map(str, MINIMUM_JAX))
    raise ImportError(
        f"stellarax needs jax {wanted} or newer; this environment has jax {version}. Upgrade "
        f"jax and jaxlib together (pip install -U 'jax>={wanted}' 'jaxlib>={wanted}'; on a TPU "
        f"or GPU, the matching libtpu or CUDA plugin too), or use an environment that has them.")
