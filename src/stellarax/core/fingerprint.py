"""Fingerprints of the code that implements an op, so that tuned results can tell when
the kernel they were measured on has changed.

A config measured on one version of a kernel may not be the fastest on the next, even
when the version strings stay the same (an editable install, a fork). The fingerprint
of an op class is a digest of the source files of its module and of every module that
module reaches through its globals (imported modules, or the modules of imported
functions and classes), staying inside the op's own code: `stellarax.ops` for
stellarax's ops (the kernels and what they share, not the tuning machinery), the
top-level package for an op defined elsewhere. Any edit to those files changes it,
comments included: a stale entry is measured again by the next `autotune`, never
dropped, so erring towards stale costs a measurement, not a config.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
from pathlib import Path

# Stellarax's own ops: the code below this package makes the kernels.
_STELLARAX_OPS = "stellarax.ops"
# Hex digits kept of the sha256 digest.
_DIGITS = 16


def _scope(module_name: str) -> str:
  """The package whose modules count as an op's code (see the module docstring)."""
  if module_name == _STELLARAX_OPS or module_name.startswith(_STELLARAX_OPS + "."):
    return _STELLARAX_OPS
  return module_name.partition(".")[0]


def _inside(name: str, scope: str) -> bool:
  return name == scope or name.startswith(scope + ".")


def module_closure(module_name: str) -> list[str]:
  """The modules whose source makes up the code of `module_name`.

  Args:
    module_name: an imported module's name.

  Returns:
    Sorted module names: `module_name` and every module of its scope (see the module
    docstring) that it reaches through module globals, transitively.

  Raises:
    KeyError: if `module_name` is not imported.
  """
  scope = _scope(module_name)
  seen, todo = set(), [module_name]
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    module = sys.modules[name]
    for value in vars(module).values():
      if isinstance(value, types.ModuleType):
        reached = value.__name__
      else:
        reached = getattr(value, "__module__", None)
        if not isinstance(reached, str) or not callable(value):
          continue
      if _inside(reached, scope) and reached in sys.modules and reached not in seen:
        todo.append(reached)
  return sorted(seen)


@functools.cache
def code_fingerprint(cls: type) -> str:
  """A digest of the source of the modules implementing `cls` (see `module_closure`).

  Args:
    cls: a class, e.g. an `Op` subclass.

  Returns:
    16 hex digits; "" when some module of the closure has no source file (defined in
    `__main__` interactively, or in a compiled extension): unknown code, never stale.
  """
  digest = hashlib.sha256()
  for name in module_closure(cls.__module__):
    path = getattr(sys.modules[name], "__file__", None)
    if not path or not Path(path).is_file() or not path.endswith(".py"):
      return ""
    digest.update(name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
  return digest.hexdigest()[:_DIGITS]
