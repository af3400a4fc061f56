"""Fingerprints of the code that implements an op, so that tuned results can tell when
the kernel they were measured on has changed.

A config measured on one version of a kernel may not be the fastest on the next, even
when the version strings stay the same (an editable install, a fork). The fingerprint
of an op class is a digest of the source files of its module and of every module that
module imports, transitively, staying inside the op's own code: `stellarax.ops` for
stellarax's ops (the kernels and what they share, not the tuning machinery), the
top-level package for an op defined elsewhere. The imports are read from the source
(`import a.b` imports the module `a.b`; `from a import b` the module `a.b` if there is
one, else `a`), not from the modules' globals: `import a.b` binds the package `a`, whose
globals hold every submodule imported so far, so the code would change with whatever
else the process imported. A package's `__init__` counts only when it is imported
itself, not because one of its submodules was. A module imported from a zip archive
counts by the source its loader gives. Any edit to those files changes the
fingerprint, comments included: a stale entry is measured again by the next
`autotune`, never dropped, so erring towards stale costs a measurement, not a config.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterator
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


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
  """Where the module `name` that is not imported would come from; None if nowhere.

  Nothing is imported: finding `a.b.c` through `importlib.util.find_spec` would import
  `a.b`, running its code, so below a package that is not imported the search goes
  through the package's folders instead.
  """
  parent = name.rpartition(".")[0]
  try:
    if parent and parent not in sys.modules:
      parent_spec = _find_spec(parent)
      folders = parent_spec.submodule_search_locations if parent_spec else None
      return importlib.machinery.PathFinder.find_spec(name, folders) if folders else None
    return importlib.util.find_spec(name)
  except (ImportError, ValueError):  # e.g. a parent that is a module, not a package
    return None


def _locate(name: str) -> tuple[str | None, str] | None:
  """The source file of module `name` (None if it has none) and the package its relative
  imports resolve in; None if `name` is not a module."""
  module = sys.modules.get(name)
  if module is not None:
    package = getattr(module, "__package__", None)
    if package is None:  # set by the import system; a module made by hand may lack it
      package = name if hasattr(module, "__path__") else name.rpartition(".")[0]
    return getattr(module, "__file__", None), package
  spec = _find_spec(name)
  if spec is None:
    return None
  return (spec.origin if spec.has_location else None), spec.parent


def _source(name: str, path: str | None) -> bytes | None:
  """The Python source of module `name`, whose file is `path`: the file's bytes, or for
  a module inside an archive (zipimport: `path` is no file) what its loader gives; None
  when it has none (no path, not a .py file, or gone since)."""
  if path is None or not path.endswith(".py"):
    return None
  try:
    return Path(path).read_bytes()
  except OSError:
    pass
  module = sys.modules.get(name)
  loader = getattr(module, "__loader__", None)
  if loader is None:
    spec = _find_spec(name)
    loader = spec.loader if spec is not None else None
  try:
    text = loader.get_source(name) if hasattr(loader, "get_source") else None
  except (ImportError, OSError):
    return None
  return None if text is None else text.encode()


def _imports(source: bytes, path: str, package: str, scope: str) -> Iterator[str]:
  """The modules inside `scope` that `source` (read from `path`) imports, anywhere in it
  (a function's lazy import is code the op runs too); relative imports resolve in
  `package`."""
  try:
    tree = ast.parse(source, filename=path)
  except (SyntaxError, ValueError):
    # Edited into something unreadable since it was imported: its bytes still go into
    # the fingerprint, which is all that is needed to make it change.
    return
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names if _inside(alias.name, scope))
    elif isinstance(node, ast.ImportFrom):
      try:
        base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
      except (ImportError, ValueError):  # a relative import above the top-level package
        continue
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        # `from a import b` imports the module `a.b` if there is one, else a name of `a`.
        if alias.name != "*" and _inside(submodule, scope) and _locate(submodule):
          yield submodule
        elif _inside(base, scope):
          yield base


def _closure(module_name: str) -> dict[str, str | None]:
  """`module_closure`'s modules, each with its source file (None if it has none)."""
  scope = _scope(module_name)
  found: dict[str, str | None] = {}
  todo = [module_name]
  while todo:
    name = todo.pop()
    if name in found:
      continue
    located = _locate(name)
    if located is None:  # imported under try/except, or removed since: not code it runs
      continue
    path, package = located
    if path is None and package == name:  # a namespace package: no code of its own
      continue
    found[name] = path
    source = _source(name, path)
    if source is not None:
      todo.extend(n for n in _imports(source, path, package, scope) if n not in found)
  return found


def module_closure(module_name: str) -> list[str]:
  """The modules whose source makes up the code of `module_name`.

  The result depends only on the source files, not on which other modules the process
  has imported (see the module docstring).

  Args:
    module_name: a module's name, e.g. an op class's `__module__`.

  Returns:
    Sorted module names: `module_name` and every module of its scope (see the module
    docstring) that it imports, transitively.

  Raises:
    KeyError: if there is no module `module_name`.
  """
  found = _closure(module_name)
  if module_name not in found:
    raise KeyError(f"module_closure({module_name!r}): no module of that name is imported or "
                   f"can be found on sys.path; pass the name of a module, e.g. an op "
                   f"class's __module__.")
  return sorted(found)


@functools.cache
def code_fingerprint(cls: type) -> str:
  """A digest of the source of the modules implementing `cls` (see `module_closure`).

  Args:
    cls: a class, e.g. an `Op` subclass.

  Returns:
    16 hex digits; "" when some module of the closure has no Python source (defined in
    `__main__` interactively, or in a compiled extension), or the module of `cls` cannot
    be found: unknown code, never stale. Modules imported from a zip archive count by
    the source their loader gives.
  """
  closure = _closure(cls.__module__)
  if cls.__module__ not in closure:  # its module is gone (a test removed it): unknown code
    return ""
  digest = hashlib.sha256()
  for name, path in sorted(closure.items()):
    source = _source(name, path)
    if source is None:
      return ""
    digest.update(name.encode() + b"\0" + source + b"\0")
  return digest.hexdigest()[:_DIGITS]
