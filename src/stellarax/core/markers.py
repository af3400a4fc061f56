"""Markers: each op call names itself in the lowered program.

A call is wrapped in `xla_metadata_call2`, which lowers to a `call` op with
`mhlo.frontend_attributes = {stellarax_op = "<bound arguments JSON>"}`. The
attribute survives `jit`, `grad` (the VJP op marks itself; the forward's
marker is dropped from derived computations), `vmap`, `remat`, the persistent
compilation cache (it is part of the program, not of its debug info), and XLA
propagates it to the instructions of the inlined call, so profiles carry it.

Capture parses the lowered *text*, not MLIR Python objects, whose API changes
between JAX versions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jax.experimental.xla_metadata import xla_metadata_call2

MARKER_KEY = "stellarax_op"

# stellarax_op = "..." inside a frontend_attributes dict; MLIR escapes '"' and
# '\' (and non-printables) as \XX hex pairs.
_MARKER_RE = re.compile(MARKER_KEY + r'\s*=\s*"((?:[^"\\]|\\.)*)"')
_HEX_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2})")


def mark(bound_args: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps `fn` so its lowered call op carries the bound arguments."""
  return xla_metadata_call2(fn, {MARKER_KEY: bound_args.to_marker()}, ad_metadata="drop")


def _unescape(s: str) -> str:
  # Marker JSON is ASCII (json.dumps escapes the rest), so each \XX is one char.
  return _HEX_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), s)


def find_markers(text: str) -> list[str]:
  """Returns every marker JSON string in a lowered program's text, in order."""
  return [_unescape(m.group(1)) for m in _MARKER_RE.finditer(text)]
