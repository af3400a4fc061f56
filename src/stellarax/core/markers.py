"""Markers: each op call names itself in the lowered program, twice.

A marker is the compact JSON of a call's bound arguments. `mark` leaves it in two
channels:

1. The frontend attribute (primary). The call is wrapped in `xla_metadata_call2`,
   which lowers to a `call` op with
   `mhlo.frontend_attributes = {stellarax_op = "<marker>"}`. The attribute survives
   `jit`, `grad` (the VJP op marks itself; the forward's marker is dropped from
   derived computations, but where JAX differentiates an op with no VJP op:
   `mark(derived_too=True)`), `vmap`, `remat` and the persistent compilation cache (it
   is part of the program, so of the cache key). XLA propagates it to the
   instructions of the inlined call, so profiles carry it, but unevenly: a pass
   that rewrites an instruction may drop it, and XLA:CPU's expansion of
   `jax.lax.ragged_dot` drops it from every instruction it creates.
2. The named scope (fallback). The call's body runs inside
   `jax.named_scope("stellarax_op=<marker>")`, so the `metadata.op_name` of every
   instruction traced inside it holds the marker, e.g.
   ``jit(f)/jvp()/xla_metadata_call/stellarax_op={"arguments":...}/dot_general``.
   XLA keeps op_name through the rewrites that drop attributes. The scope holds the
   whole marker, not a short tag of it, because the attribute may be dropped from
   every instruction of the op, and then nothing else in the compiled program could
   map a tag back to its JSON. op_name grows by the marker's length (a few hundred
   characters per op; `markers_in_op_name` reads it back).

   The cache caveat: the persistent compilation cache's key ignores names, so a
   cache hit reuses the op_names of whichever program was compiled first. That is
   harmless here: the scope text is a function of the marker alone, and the marker
   is in the key through the attribute, so every program with that key has the same
   scopes at the same calls. A user's own scopes around the call may be stale; they
   are never read. What the scope cannot tell apart: a backward pass that JAX
   derives from an op's body (an op without a VJP op, e.g. a VJP op differentiated
   again) carries the forward's scope, though not its attribute.

Capture parses the lowered *text*, not MLIR Python objects, whose API changes
between JAX versions; it reads the attribute only (`find_markers`).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import json
import re
from typing import Any

import jax
from jax.experimental.xla_metadata import xla_metadata_call2

MARKER_KEY = "stellarax_op"
SCOPE_PREFIX = MARKER_KEY + "="
"""Starts the named scope of a call; the marker JSON follows it."""

# stellarax_op = "..." inside a frontend_attributes dict; MLIR escapes '\' as '\\' and
# '"' (and non-printables) as \XX hex pairs. A named scope's location in text
# printed with debug info reads `stellarax_op={\22...`, which this never matches:
# a marker is a JSON object, so '{' and never '"' follows the '='.
_MARKER_RE = re.compile(MARKER_KEY + r'\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(\\|[0-9A-Fa-f]{2})")
_DECODER = json.JSONDecoder()


def mark(bound_args: Any, fn: Callable[..., Any], *, derived_too: bool = False
         ) -> Callable[..., Any]:
  """Wraps `fn` so its call leaves the bound arguments' marker in both channels.

  Args:
    bound_args: the call's `BoundArguments`.
    fn: the implementation to run.
    derived_too: the computations JAX derives from `fn` (its forward and backward
      under `jax.vjp`) keep the attribute too: where no VJP op marks a backward, JAX
      differentiates the implementation, whose config decides both passes (with the
      default, False, such a call left no marker under `grad`, and was not captured).

  Returns:
    `fn`, run inside the named scope of the marker and wrapped in a call op that
    carries the marker as a frontend attribute (module doc).
  """
  marker = bound_args.to_marker()

  @functools.wraps(fn)
  def scoped(*args, **kwargs):
    with jax.named_scope(SCOPE_PREFIX + marker):
      return fn(*args, **kwargs)

  return xla_metadata_call2(scoped, {MARKER_KEY: marker},
                            ad_metadata="same" if derived_too else "drop")


def _unescape(s: str) -> str:
  r"""MLIR's string escapes undone, left to right: '\\' is one backslash (a marker's own
  JSON escapes: a quote, a backslash, a non-ASCII '\u00e9' of a user op's string
  option), '\XX' one character (marker JSON is ASCII: json.dumps escapes the rest)."""
  return _ESCAPE.sub(lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1), 16)), s)


def find_markers(text: str) -> list[str]:
  """Returns every marker JSON string in a lowered program's text, in order.

  Args:
    text: the lowered program (`jax.stages.Lowered.as_text()`).

  Returns:
    The markers of the frontend attributes, as the calls left them.
  """
  return [_unescape(m.group(1)) for m in _MARKER_RE.finditer(text)]


def markers_in_op_name(op_name: str) -> list[str]:
  """Returns the markers of the named scopes in an HLO instruction's op_name.

  JAX may wrap a scope in transformation names (``transpose(jvp(...))``) and the
  marker may itself hold ``/`` or parentheses, so each marker is read as the JSON
  value that starts after ``stellarax_op=``, not by splitting the name.

  Args:
    op_name: the ``metadata.op_name`` of an instruction, as stored in the HLO proto
      (unescaped).

  Returns:
    The markers, outermost scope first (an op called from another op's
    implementation comes after it). A scope whose JSON does not parse (a name cut
    short) is skipped.
  """
  found, start = [], op_name.find(SCOPE_PREFIX)
  while start >= 0:
    begin = start + len(SCOPE_PREFIX)
    try:
      value, end = _DECODER.raw_decode(op_name, begin)
    except json.JSONDecodeError:
      start = op_name.find(SCOPE_PREFIX, begin)
      continue
    if isinstance(value, dict):
      found.append(op_name[begin:end])
    start = op_name.find(SCOPE_PREFIX, end)
  return found
