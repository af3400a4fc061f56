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

Which keys an answer goes to. Every cache entry JAX makes is keyed by the
key current when it looked the entry up, so an answer is recorded in the
current key; inside a top-level `jit` trace also in that trace's key and in
the keys of the results entered since it began (JAX reports top-level traces
as they start and end; inner jaxprs, such as a `checkpoint` being batched,
may be traced detached from the outer trace, so the trace stack alone would
not do). An op called eagerly runs through a cached `jit` of its call
(`core/eager.py`), so it is a top-level trace too. The current key is never
replaced while a top-level trace is being built; it is replaced by a fresh
one when the trace ends and on entering a result. So each top-level
function gets a key of its own, and a function with no op never shares a key
with one that has ops. While a trace is being built, a key with records
equals only itself: a cached inner trace that asked questions (a nested
`jit`, a `scan` body) is traced again inside each new outer trace, so that
its answers land in the outer trace's key too (JAX compares keys in many
small caches, so equality cannot tell a reuse that matters from one that
does not).

Results entered inside a traced function: each key remembers the stack of
active results it was created under, and a record made deeper in the stack
keeps the extra results, so the question is asked again with the same inner
results on top of whatever is active then.

Threads and async tasks. The active results follow the context (contextvars), the
current key the thread (JAX's thread-local state). Where they part (asyncio tasks
whose `with result:` blocks interleave, a context copied into a thread by
`asyncio.to_thread`), a top-level trace starts under a key not made for the results
active: that key is poisoned, never equal to another, and the key made when the trace
ends is made for them. A thread with no key of its own uses the process's default key,
which JAX's caches compare by identity before equality: after each trace under it the
default is replaced, so another thread's lookup compares by the records.

A trace reused without a top-level trace of its own (a function first traced inside
another's trace, then called on its own) is compiled into an executable cached under
the current key, which asked nothing: when such a program is lowered, the current key
takes the answers of the entries reused since the last lowering (`_on_lowering`).

Questions may read settings besides the results (the miss policy, the transfer switch:
a trace that met a miss under the "heuristics" policy must not be reused under "error");
their scopes are `settings_scope`s. Their environment variables are read when a call is
traced (set them before the program runs).

Equality is memoised per stack of active results and settings scope (a scope is one
thread's or task's) until the next record: JAX checks it on every call of a jitted
function whose cached key is not the current one, and such a call then lends the
current key its answers and makes a fresh one (`_note_reuse`). That is what a jitted
function with our ops pays per call over one without: about 2.5 us on the 2-core CPU
(2026-12-08; 1.5 us before the lending, which a function first traced by
`jax.eval_shape` or `.lower()` needs, and 2.3 us before a key already noted for reuse
was found by a mark instead of a search of the list).

Cost. Inner traces cached under a key with records (JAX's own jitted helpers,
such as `jnp` functions, traced inside a function that uses our ops) are traced
again by the next top-level trace instead of reused: tracing and lowering the
`make demo` training step as a new function took about 400 ms instead of 300 ms
(2026-11-30, 2-core CPU); the first trace of a program costs the same as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import types
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
from jax._src import config as _jax_config
from jax._src import core as _jax_core

from stellarax.core import warn as warn_lib

Stack = tuple[Any, ...]
Question = Callable[[Stack, Any], Any]
# (question, subject, results pushed above the key's stack, answer). Results
# need not be hashable: records are indexed by the identities of `above`.
_Record = tuple[Question, Hashable, Stack, Any]


def _index(question: Question, subject: Hashable, above: Stack) -> tuple:
  return question, subject, tuple(map(id, above))


_CONFLICT = object()  # one question, two answers in one trace: never equal
_HASH = hash("stellarax.core.trace_keys.TraceKey")
_MEMO_LIMIT = 64
# Emitted by `jax.jit` when a top-level trace starts (a scalar: its start time)
# and when it ends (its duration); see jax/_src/pjit.py and dispatch.py.
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
# Emitted when a top-level program starts being lowered (jax/_src/interpreters/pxla.py).
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def _empty_stack() -> Stack:
  return ()


# Bumped when a setting that questions read besides the active results changes (the miss
# policy, the transfer switch): equalities memoised before no longer stand.
_settings_epoch = 0
# A fresh object in each `settings_scope` (None outside any): an equality is memoised for
# the scope it was found in, since the epoch is process-wide and a scope is one thread's
# or task's (another thread's memo must not answer for it). One context variable read.
_scope_token: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "stellarax_settings_scope", default=None)


def settings_changed() -> None:
  """Says that a setting recorded questions read (not the active results) changed in
  this context, so that keys compare their answers again instead of from memory."""
  global _settings_epoch
  _settings_epoch += 1


@contextlib.contextmanager
def settings_scope(setting: contextvars.ContextVar, value: Any) -> Iterator[None]:
  """Sets `setting`, one that questions read besides the active results (the miss
  policy's scope, the transfer switch's), to `value` inside a `with` block: keys
  compare their answers again on entering and leaving it, and inside it no equality
  memoised outside (or in another thread's scope) answers.

  Args:
    setting: the setting's context variable.
    value: its value inside the block.
  """
  token, scope = setting.set(value), _scope_token.set(object())
  settings_changed()
  try:
    yield
  finally:
    _scope_token.reset(scope)
    setting.reset(token)
    settings_changed()


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
    parent: the key current when the result that made this one was entered.
  """

  __slots__ = ("stack", "parent", "_records", "_lent", "_memo", "_noted_in", "__weakref__")

  def __init__(self, stack: Stack = (), parent: TraceKey | None = None):
    self.stack = stack
    self.parent = parent
    self._records: dict[tuple, _Record] = {}
    # Keys whose answers this one holds too (`_note_reuse`), their own lent keys included.
    self._lent: tuple[TraceKey, ...] = ()
    # id(stack) -> (stack, settings, holds); cleared on records
    self._memo: dict[int, tuple[Stack, Any, bool]] = {}
    self._noted_in: list[TraceKey] | None = None  # the reuse list it was last noted in

  def __hash__(self) -> int:
    return _HASH

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if not isinstance(other, TraceKey):
      return NotImplemented
    if not (self._records or self._lent or other._records or other._lent):
      return True
    if building():
      # A cached trace reused inside a trace being built would hide its
      # answers from the new trace's key: trace it again (once per outer
      # trace; it is then cached under the current key, which has them).
      return False
    if not (self.holds() and other.holds()):
      return False
    _note_reuse(self, other)
    return True

  def __repr__(self) -> str:
    return f"TraceKey({len(self._records)} recorded answers)"

  def __len__(self) -> int:
    return len(self._records)

  def holds(self) -> bool:
    """Whether every recorded question gets the same answer now (those of the keys lent
    to it too)."""
    if not (self._records or self._lent):
      return True
    now, settings = _active_stack(), (_settings_epoch, _scope_token.get())
    memo = self._memo.get(id(now))
    if memo is not None and memo[0] is now and memo[1] == settings:
      return memo[2]
    try:
      # Inside JAX's cache lookup: a warning would reach no line of the user's (and under
      # -W error be swallowed here); the trace or call it leads to warns instead.
      with warn_lib.held_back():
        holds = all(answer is not _CONFLICT and _same(question(now + above, subject), answer)
                    for key in (self, *self._lent)
                    for question, subject, above, answer in tuple(key._records.values()))
    except Exception:  # a question that fails now must cost a retrace, not a crash
      holds = False
    if len(self._memo) >= _MEMO_LIMIT:
      self._memo.clear()
    self._memo[id(now)] = (now, settings, holds)
    return holds

  def _poison(self) -> None:
    """Makes this key equal no other: its records were made in a context it was not
    made for (see `_on_trace_start`)."""
    self._records[(_CONFLICT,)] = (_never_asked, None, (), _CONFLICT)
    self._memo.clear()

  def _merge(self, records: list[_Record], now: Stack) -> None:
    """Adds `records` (their `above` relative to the stack `now`)."""
    depth = len(self.stack)
    under_us = len(now) >= depth and all(a is b for a, b in zip(self.stack, now))
    for question, subject, above, answer in records:
      if not under_us:  # the results changed under this key's trace: never reuse it
        self._records[_index(question, subject, ())] = (question, subject, (), _CONFLICT)
        continue
      above = now[depth:] + above
      index = _index(question, subject, above)
      known = self._records.get(index)
      if known is not None and (known[3] is _CONFLICT or not _same(known[3], answer)):
        answer = _CONFLICT
      self._records[index] = (question, subject, above, answer)
    self._memo.clear()


def _never_asked(stack: Stack, subject: Any) -> Any:
  """The question of a poisoned key's record, whose answer (`_CONFLICT`) stops `holds`
  before any question is asked."""
  raise AssertionError("a conflicting record is never asked again")


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

_local = threading.local()


def current() -> TraceKey:
  """The key a trace started now would be cached under."""
  return _state.value


def _in_sync(key: TraceKey) -> bool:
  """Whether `key` was made for the results active now."""
  now = _active_stack()
  return len(key.stack) == len(now) and all(a is b for a, b in zip(key.stack, now))


def _renew() -> None:
  key = current()
  renewed = TraceKey(key.stack, key.parent) if _in_sync(key) else TraceKey(_active_stack())
  _state.set_local(renewed)


def enter(stack: Stack) -> Any:
  """Makes a fresh key for a new stack of active results current; returns
  what `leave` needs to restore the previous one."""
  return _state.swap_local(TraceKey(stack, current()))


def leave(token: Any) -> None:
  """Undoes the matching `enter`."""
  _state.set_local(token)


def _top_level() -> list[TraceKey]:
  """Keys of the top-level `jit` traces in progress in this thread (at most
  one: JAX reports only top-level traces)."""
  keys = getattr(_local, "top_level", None)
  if keys is None:
    keys = _local.top_level = []
  return keys


def building() -> bool:
  """Whether a trace is being built in this thread."""
  trace = _jax_core.trace_ctx.trace
  return bool(_top_level()) or not (trace is None or isinstance(trace, _jax_core.EvalTrace))


def _targets() -> list[TraceKey]:
  """The keys of every cache entry that may be being built now: the current
  key, the keys current outside the results entered (up to the top-level
  trace's key, if one is being built) and the top-level trace's key."""
  key, top_level = current(), _top_level()
  targets = [key]
  while key.parent is not None and all(key is not k for k in top_level):
    key = key.parent
    targets.append(key)
  return targets + [k for k in top_level if all(k is not t for t in targets)]


def _add(records: list[_Record]) -> None:
  if records:
    now = _active_stack()
    for key in _targets():
      key._merge(records, now)


def _reuse_state() -> Any:
  """This thread's record of cache entries reused since the last lowering (`_note_reuse`)."""
  state = getattr(_local, "reuse", None)
  if state is None:
    state = _local.reuse = types.SimpleNamespace(keys=[], unlowered_trace=None)
  return state


def _note_reuse(a: TraceKey, b: TraceKey) -> None:
  """Two keys found equal outside a trace, one of them current: JAX may be reusing the
  other's cache entry, and cache what it builds from it under the current key.

  The current key takes the other's answers at once (`_lent`): JAX may build and cache
  an executable from the reused entry with no event to tell us (a trace made by
  `jax.eval_shape`, `.trace()`, `.lower()` or `.lower().compile()` and then called:
  its lowering and executable are reused too), and a key with no answers equals every
  other. A fresh key then becomes current (about 1 us a call). The other key is also
  kept until the next lowering (`_on_lowering`), which gives its answers to every key
  of a trace being built."""
  key = current()
  source = b if a is key else a if b is key else None
  if source is None or not (source._records or source._lent):
    return
  # Lent by reference (a copy of a large program's answers on every call cost 30 us),
  # then a fresh key for what comes next: a function traced later must not take them.
  if not key._lent:  # (a fresh key: every call of a function cached under another)
    key._lent = (source, *source._lent)
  elif all(k is not source for k in key._lent):
    key._lent += tuple(k for k in (source, *source._lent) if all(k is not j for j in key._lent))
  key._memo.clear()
  if key is _state.get_global():
    # The default of threads with no key of their own: what they trace next must not
    # take these answers either (as after a trace under it, `_on_trace_end`).
    _state.set_global(TraceKey())
  _renew()
  keys = _reuse_state().keys  # a new list after each lowering, so this runs on every call:
  if source._noted_in is not keys and len(keys) < _MEMO_LIMIT:  # no search of the list
    keys.append(source)
    source._noted_in = keys


def _on_lowering() -> None:
  """A top-level program is being lowered. After a trace of its own, its executable is
  cached under that trace's key, which holds its answers. Without one, it was lowered
  from a trace JAX reused: one made inside another function's trace (a nested jit,
  first called on its own now). Its executable is cached under the current key, which
  asked nothing, so a result entered later would find it with nothing to tell it
  apart: the current key takes the answers of the entries reused since the last
  lowering, and a fresh key becomes current for what comes next. The key of the last
  trace not lowered yet is left out: this lowering may be that trace's own, whose
  executable is cached under that key (a trace may also never be lowered, as
  `jax.eval_shape`'s)."""
  state = _reuse_state()
  keys, state.keys = state.keys, []
  if _top_level():
    return
  own, state.unlowered_trace = state.unlowered_trace, None
  records = [r for k in keys if k is not own for lent in (k, *k._lent)
             for r in lent._records.values()]
  if records:
    _add(records)
    _renew()


def record(question: Question, subject: Hashable, answer: Any) -> None:
  """Records, for the traces being built, that `question(stack, subject)`
  answered `answer` under the active stack. Outside any trace (e.g. `explain()`)
  nothing is cached from the answer, and nothing is recorded.

  Args:
    question: a module-level function of (active results, subject).
    subject: what was asked about (e.g. a `BoundArguments`); hashable.
    answer: what it answered (compared with `==`).
  """
  if building():
    _add([(question, subject, (), answer)])


def _on_trace_start(event: str, value: float, **kwargs: Any) -> None:
  del value, kwargs
  if event == _TRACE_EVENT:
    key = current()
    if not _in_sync(key):
      # The results active here were not entered through this thread's keys: asyncio
      # tasks whose `with result:` blocks interleave (the thread's key is another task's),
      # or a context copied into a thread (asyncio.to_thread). Records would be asked
      # again with the wrong results under them: this trace is never reused, and the key
      # made when it ends is this context's own (`_renew`).
      key._poison()
    _top_level().append(key)
    _reuse_state().keys = []  # a new list: `_note_reuse` tells notes by the list they are in
  elif event == _LOWERING_EVENT:
    _on_lowering()


def _on_trace_end(event: str, duration: float, **kwargs: Any) -> None:
  del duration, kwargs
  if event == _TRACE_EVENT:
    top_level = _top_level()
    if top_level:
      key = _reuse_state().unlowered_trace = top_level.pop()
      if key is _state.get_global():
        # Made in a thread with no key of its own. Another such thread would find this
        # trace by identity, which JAX's caches compare before equality, whatever its
        # results: the next gets a fresh default key, which compares by its records.
        _state.set_global(TraceKey())
    _renew()


jax.monitoring.register_scalar_listener(_on_trace_start)
jax.monitoring.register_event_duration_secs_listener(_on_trace_end)
