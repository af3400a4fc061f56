"""Warnings attributed to the user's code, and held back where no one can see them.

A fixed `stacklevel` cannot find the user's line: the path from a user's call to a
warning varies (through JAX's tracing, config resolution, caches, the autotuner), so
a warning would name a line of stellarax's or JAX's own. `warn` names the innermost
frame outside both packages instead.

Some of our code runs inside JAX's cache lookups: a trace key re-asks its recorded
questions when JAX compares it with another (`core/trace_keys.py`), and those read the
caches. A warning raised there would surface at no line of the user's, and under
`-W error` it would be an exception swallowed by the comparison, its once-per-file
warning spent on no one. So that code runs inside `held_back()`: warnings are collected
instead of emitted, and what depends on having emitted them (a cache's "warned once"
state, a file read that warned) is not kept, so the next lookup outside warns.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator

import jax

# The folders whose frames a warning passes over, ending in a separator so that a
# sibling folder whose name merely starts the same is not passed over.
_STELLARAX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_JAX = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep

_local = threading.local()


def warn(message: str | Warning, category: type[Warning]) -> bool:
  """Warns with `category`, at the innermost frame outside stellarax and JAX; inside
  `held_back()` (this thread) collects the warning instead.

  Args:
    message: what happened, and what to do (or a Warning instance).
    category: the warning's class.

  Returns:
    Whether the warning was emitted (False when held back).
  """
  held = getattr(_local, "held", None)
  if held is not None:
    held.append((message, category))
    return False
  warnings.warn(message, category, skip_file_prefixes=(_STELLARAX, _JAX))
  return True


@contextlib.contextmanager
def held_back() -> Iterator[list[tuple[str | Warning, type[Warning]]]]:
  """Inside the block, `warn` in this thread collects (message, category) pairs into the
  yielded list instead of warning (see the module docstring)."""
  previous = getattr(_local, "held", None)
  _local.held = []
  try:
    yield _local.held
  finally:
    _local.held = previous


def held_count() -> int | None:
  """How many warnings this thread's innermost `held_back()` has collected so far; None
  outside one. Code that keeps state only where its warnings were seen compares the
  counts before and after."""
  held = getattr(_local, "held", None)
  return None if held is None else len(held)
