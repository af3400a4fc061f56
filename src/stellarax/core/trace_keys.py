"""What JAX's trace and jit caches see of our trace-time decisions.

Configs (and, for `implementation=None`, implementations) are chosen while a
function is traced, from the active `AutotuningResult`s. JAX caches traces and
executables by function and argument types plus the values of its
trace-context config states, so a function traced before `with result:` would
keep its old configs unless the active results were part of that context.
Putting the results themselves there would retrace *every* jitted function on
entering a result, including those that use none of our ops.

So the context holds a `TraceKey` instead: an object that records which
questions the traces keyed by it asked of the active results (e.g. "the
config of this call"), and what they were told. Its hash is constant and two
keys are equal when every recorded question still gets the same answer now.
JAX compares the key of each cached trace with the current one, so:

* a trace that asked nothing (no stellarax op, or only ops with pinned
  configs) is reused in any context;
* a trace that asked is reused exactly where its answers still hold, and is
  traced again where they do not.

Keeping records apart. A trace is cached under the key current when it
started. The current key is replaced by a fresh one after every top-level
trace (JAX's trace-duration event), after it takes a record, and on entering
a result; so each top-level function gets a key of its own and a function
with no op never shares a key with one that has ops. An answer given while
traces are being built is recorded in the key of each of them (the chain of
JAX traces from the current one outwards), and when JAX reuses a cached inner
trace (a nested `jit`, a `scan` body) inside a trace being built, the
equality check passes the inner key's records on to the outer trace's key,
since the outer computation now depends on them too.

Results entered inside a traced function: each key remembers the stack of
active results it was created under, and a record made deeper in the stack
keeps the extra results, so the question is asked again with the same inner
results on top of whatever is active then.

Equality is memoised per stack of active results until the next record: JAX
checks it on every call of a jitted function whose cached key is not the
current one. The one known gap: an answer given under
`jax.ensure_compile_time_eval()` inside a trace cannot reach the enclosing
trace's key, because JAX hides the outer trace from such code.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax._src import config as _jax_config
from jax._src import core as _jax_core

Stack = tuple[Any, ...]
Question = Callable[[Stack, Any], Any]
_Record = tuple[Question, Hashable, Stack]  # (question, subject, results pushed above the key's)

_CONFLICT = object()  # one question, two answers in one trace: never equal
_HASH = hash("stellarax.core.trace_keys.TraceKey")
_MEMO_LIMIT = 64
# Emitted by `jax.jit` when a top-level trace ends (jax/_src/dispatch.py).
_TRACE_END_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def _empty_stack() -> Stack:
  return ()


_active_stack: Callable[[], Stack] = _empty_stack


def set_stack_getter(getter: Callable[[], Stack]) -> None:
  """Sets the function returning the active results, outermost first (a new
  tuple whenever it changes)."""
  global _active_stack
  _active_stack = getter


class TraceKey:
  """The value of the `stellarax_trace_key` JAX config state (see module doc).

  Attributes:
    stack: the active results when this key became current.
  """

  __slots__ = ("stack", "_records", "_memo", "__weakref__")

  def __init__(self, stack: Stack = ()):
    self.stack = stack
    self._records: dict[_Record, Any] = {}
    self._memo: dict[int, tuple[Stack, bool]] = {}  # id(stack) -> (stack, holds); cleared on records

  def __hash__(self) -> int:
    return _HASH

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if not isinstance(other, TraceKey):
      return NotImplemented
    if not (self._records or other._records):
      return True
    same = self.holds() and other.holds()
    if same:
      _pass_on(self, other)
    return same

  def __repr__(self) -> str:
    return f"TraceKey({len(self._records)} recorded answers)"

  def __len__(self) -> int:
    return len(self._records)

  def holds(self) -> bool:
    """Whether every recorded question gets the same answer now."""
    if not self._records:
      return True
    now = _active_stack()
    memo = self._memo.get(id(now))
    if memo is not None and memo[0] is now:
      return memo[1]
    try:
      holds = all(answer is not _CONFLICT and _same(question(now + above, subject), answer)
                  for (question, subject, above), answer in tuple(self._records.items()))
    except Exception:  # a question that fails now must cost a retrace, not a crash
      holds = False
    if len(self._memo) >= _MEMO_LIMIT:
      self._memo.clear()
    self._memo[id(now)] = (now, holds)
    return holds

  def _merge(self, records: dict[_Record, Any], now: Stack) -> None:
    """Adds `records` (their `above` relative to the stack `now`)."""
    depth = len(self.stack)
    under_us = len(now) >= depth and all(a is b for a, b in zip(self.stack, now))
    for (question, subject, above), answer in records.items():
      if not under_us:  # the results changed under this key's trace: never reuse it
        self._records[(question, subject, ())] = _CONFLICT
        continue
      record = (question, subject, now[depth:] + above)
      known = self._records.get(record, answer)
      self._records[record] = answer if known is not _CONFLICT and _same(known, answer) else _CONFLICT
    self._memo.clear()


def _same(a: Any, b: Any) -> bool:
  try:
    return bool(a == b)
  except Exception:
    return False


_state = _jax_config.string_or_object_state(
    name="stellarax_trace_key", default=TraceKey(),
    include_in_trace_context=True, include_in_jit_key=True,
    help="What stellarax traces asked of the active AutotuningResults (see "
         "stellarax/core/trace_keys.py).")

# Trace -> the key it is cached under. Weak: an entry lives as long as its trace.
_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def current() -> TraceKey:
  """The key a trace started now would be cached under."""
  return _state.value


def _renew() -> None:
  _state.set_local(TraceKey(current().stack))


def enter(stack: Stack) -> Any:
  """Makes a fresh key for a new stack of active results current; returns
  what `leave` needs to restore the previous one."""
  return _state.swap_local(TraceKey(stack))


def leave(token: Any) -> None:
  """Undoes the matching `enter`."""
  _state.set_local(token)


def _traces_being_built() -> list[Any]:
  """The chain of JAX traces from the current one outwards, without the
  eager (eval) trace at its root."""
  chain = []
  trace = _jax_core.trace_ctx.trace
  while trace is not None and not isinstance(trace, _jax_core.EvalTrace):
    chain.append(trace)
    trace = getattr(trace, "parent_trace", None)
  return chain


def _add(records: dict[_Record, Any]) -> None:
  chain = _traces_being_built()
  if not chain or not records:
    return
  key_now = current()
  with _lock:
    keys: list[TraceKey] = []
    for trace in chain:
      key = _owners.get(trace)
      if key is None:
        # The current key has not been replaced since this trace started:
        # a replacement mid-trace only follows a record, which has given
        # every trace of the chain its key first.
        key = _owners[trace] = key_now
      if all(key is not k for k in keys):
        keys.append(key)
  now = _active_stack()
  for key in keys:
    key._merge(records, now)
  if any(key is key_now for key in keys):
    _renew()


def record(question: Question, subject: Hashable, answer: Any) -> None:
  """Records, for the traces being built, that `question(stack, subject)`
  answered `answer` under the active stack.

  Args:
    question: a module-level function of (active results, subject).
    subject: what was asked about (e.g. a `BoundArguments`); hashable.
    answer: what it answered (compared with `==`).
  """
  _add({(question, subject, ()): answer})


def _pass_on(*keys: TraceKey) -> None:
  """A cached trace keyed by one of `keys` is being reused: the traces being
  built now depend on its answers too."""
  if _traces_being_built():
    merged: dict[_Record, Any] = {}
    for key in keys:
      merged.update(key._records)
    _add(merged)


def _on_trace_end(event: str, duration: float, **kwargs: Any) -> None:
  del duration, kwargs
  if event == _TRACE_END_EVENT:
    _renew()


jax.monitoring.register_event_duration_secs_listener(_on_trace_end)
