"""Warnings attributed to the user's code.

A fixed `stacklevel` cannot find the user's line: the path from a user's call to a
warning varies (through JAX's tracing, config resolution, caches, the autotuner), so
a warning would name a line of stellarax's or JAX's own. `warn` names the innermost
frame outside both packages instead.
"""

from __future__ import annotations

import os
import warnings

import jax

# The folders whose frames a warning passes over, ending in a separator so that a
# sibling folder whose name merely starts the same is not passed over.
_STELLARAX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_JAX = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def warn(message: str, category: type[Warning]) -> None:
  """Warns with `category`, at the innermost frame outside stellarax and JAX.

  Args:
    message: what happened, and what to do.
    category: the warning's class.
  """
  warnings.warn(message, category, skip_file_prefixes=(_STELLARAX, _JAX))
