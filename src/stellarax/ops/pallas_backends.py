"""The Pallas GPU backends this JAX has, and what stands in for one it lacks.

JAX 0.11 deprecated its Pallas Triton backend and says a future version removes it;
Mosaic GPU is new and moves fast. A JAX without a backend must still import
stellarax and run every op through the implementations it can: the lacking
backend's implementations stay registered (results, caches and profiles naming them
still load and merge), report `supported_on(...) == False` (so implementation=None
passes them by, as the autotuner does), and refuse a call that names them with
`ImplementationUnavailableError`, which says what failed and what to use instead.

Kernel modules import their backend from here (`pltriton = pallas_backends.triton`)
instead of from `jax.experimental.pallas`; where the backend is missing that name is a
stand-in whose every attribute raises the same error, so a module that only uses the
backend inside its kernels imports cleanly.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import jax

from stellarax.core.op import ImplementationUnavailableError

# Backend name -> (module path, the words users know it by).
_BACKENDS = {
    "triton": ("jax.experimental.pallas.triton", "Pallas Triton"),
    "mosaic_gpu": ("jax.experimental.pallas.mosaic_gpu", "Pallas Mosaic GPU"),
}


class _MissingBackend(types.ModuleType):
  """Stands in for a backend module JAX lacks: every attribute read raises."""

  def __init__(self, backend: str, reason: str):
    super().__init__(_BACKENDS[backend][0])
    self._backend, self._reason = backend, reason

  def __getattr__(self, attribute: str) -> Any:
    if attribute.startswith("__"):
      raise AttributeError(attribute)
    raise ImplementationUnavailableError(f"{self._reason} (needed for `{_BACKENDS[self._backend][0]}.{attribute}`).")


_missing: dict[str, str] = {}


def _load(backend: str) -> types.ModuleType:
  path, words = _BACKENDS[backend]
  try:
    return importlib.import_module(path)
  except Exception as e:  # noqa: BLE001 (removed, or broken on import: either way not there)
    reason = (f"{words} is not in this JAX ({jax.__version__}): importing {path} failed "
              f"with {type(e).__name__}: {e}. Use another implementation of the op "
              f"(implementation=None picks the best one this JAX runs, 'xla' always runs), "
              f"or install a JAX that has it (stellarax's CI runs jax 0.11.2, "
              f"requirements/ci.txt)")
    _missing[backend] = reason
    return _MissingBackend(backend, reason)


triton = _load("triton")
mosaic_gpu = _load("mosaic_gpu")


def missing_reason(backend: str) -> str | None:
  """Why `backend` cannot run here, or None when this JAX has it.

  Args:
    backend: "triton" or "mosaic_gpu".

  Returns:
    A sentence naming the failed import and what to use instead, or None.

  Raises:
    ValueError: for an unknown backend name.
  """
  if backend not in _BACKENDS:
    raise ValueError(f"Unknown Pallas backend {backend!r}; known: {sorted(_BACKENDS)}.")
  return _missing.get(backend)
