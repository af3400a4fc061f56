"""The registry of op implementations under stable names.

Names look like "ragged_dot.xla" or "attention.pallas_triton_vjp": the family
before the dot, the backend after it. Files store names, never import paths,
so renaming or moving a class does not invalidate tuned results.
"""

from __future__ import annotations

import importlib
from typing import Any

_REGISTRY: dict[str, type] = {}
_LOADED = False


def register(name: str, cls: type) -> None:
  """Registers `cls` under `name`.

  Raises:
    ValueError: for a malformed name or a name taken by another class.
  """
  family, dot, backend = name.partition(".")
  if not (family and dot and backend):
    raise ValueError(f"Op name {name!r} must look like '<family>.<backend>', e.g. 'ragged_dot.xla'.")
  existing = _REGISTRY.get(name)
  if existing is not None and existing.__qualname__ != cls.__qualname__:
    raise ValueError(f"Op name {name!r} is taken by {existing.__qualname__}; pick another name for {cls.__qualname__}.")
  _REGISTRY[name] = cls


def _load_ops() -> None:
  # Ops register when their module is imported; importing the package's ops
  # module once makes every shipped op known without core importing any op.
  global _LOADED
  if not _LOADED:
    _LOADED = True
    importlib.import_module("stellarax.ops")


def lookup(name: str) -> type[Any]:
  """Returns the op class registered under `name`.

  Raises:
    KeyError: naming the unknown op and listing the known ones.
  """
  if name not in _REGISTRY:
    _load_ops()
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(
        f"No stellarax op is registered as {name!r}. Known ops: {sorted(_REGISTRY)}. "
        "The data may come from a newer stellarax, or from a package of ops of its own "
        "that is not imported: import it first (on the command line: `--import MODULE`)."
    ) from None


def import_op_modules(modules: list[str] | tuple[str, ...]) -> None:
  """Imports modules that define ops, so that their ops register before data naming
  them is read (the command line's `--import MODULE`).

  Args:
    modules: importable module names, e.g. ["mylib.ops"].

  Raises:
    ImportError: naming the module that could not be imported, and why.
  """
  for module in modules:
    try:
      importlib.import_module(module)
    except ImportError as exc:
      raise ImportError(f"--import {module}: cannot import it ({exc}). Name a module on "
                        "this Python's path (PYTHONPATH, or an installed package) whose "
                        "import defines the ops.") from exc


def names(family: str | None = None) -> list[str]:
  """All registered names, or those of one family, sorted."""
  _load_ops()
  return sorted(n for n in _REGISTRY if family is None or n.partition(".")[0] == family)
