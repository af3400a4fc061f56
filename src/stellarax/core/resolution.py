"""Config resolution: where the config of an op call comes from.

One function, `resolve_config`, decides, in this order:

1. the config pinned on the op (`SomeOp(config=...)`);
2. the innermost active `AutotuningResult` (`with result:`), then the outer ones;
3. the user cache (on disk, written by `autotune(..., cache=True)`);
4. the shipped library cache (`stellarax/data/autotuning/<device_kind>/`);
5. registered fallbacks (e.g. transfer from the nearest tuned shapes);
6. on a miss, the miss policy (unless the call's space holds only its heuristic config,
   which is then its config, whatever the policy): `"heuristics"` (default) uses the op's heuristic
   config, `"error"` raises `ConfigMissError`, `"autotune"` tunes the call on
   the spot (and keeps the result for the rest of the process).

Reproducible mode (`reproducible_scope()`, on by default where `XLA_FLAGS` asks
XLA for deterministic GPU ops): every step above but the first passes over configs
that the op says are not bit-reproducible (`Op._is_reproducible`, e.g. one that adds
with atomics): a result or cache entry gives its fastest measured config that is,
and a heuristic that is not gives way to the first config of the space that is. The
mode is part of JAX's jit key, so a function traced outside it is traced again
inside.

Sources 3 and 4, and the `autotune` policy, are provided by
`stellarax.autotuning`, which registers them here at import; `core` knows no
cache format. Active results live on a `contextvars` stack, so threads and
async tasks each see only the results they entered.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from jax._src import config as _jax_config

from stellarax.core import trace_keys
from stellarax.core.config import config_to_json
from stellarax.core.specs import canonical_json

MISS_POLICIES = ("heuristics", "error", "autotune")
ONLY_CONFIG = "heuristics:only config"
"""The source of a call whose space holds its heuristic config alone: never a miss."""
_MISS_POLICY_ENV = "STELLARAX_MISS_POLICY"


class ConfigSource(Protocol):
  """Anything that can answer "which config for this call?"."""

  source_name: str

  def lookup_config(self, bound_args: Any, accept: Callable[[Any], bool] | None = None
                    ) -> Any | None:
    """Returns the config for `bound_args` (the best one `accept` takes, when given),
    or None on a miss."""


class ConfigMissError(LookupError):
  """Raised under the "error" miss policy when no config was measured."""


@dataclasses.dataclass(frozen=True)
class Resolution:
  """A resolved config and where it came from.

  Attributes:
    config: the config the call runs with.
    source: "explicit", "result", "user_cache", "library_cache",
      "autotuned" or "heuristics" (possibly with a detail after a colon).
  """

  config: Any
  source: str


def _xla_asks_determinism(flags: str) -> bool:
  """Whether XLA_FLAGS turn on XLA's deterministic GPU ops (then ours are too)."""
  found = re.findall(r"--xla_gpu_(?:deterministic_ops|exclude_nondeterministic_ops)(?:=(\S*))?",
                     flags)
  return bool(found) and found[-1].lower() in ("", "true", "1")


_reproducible = _jax_config.bool_state(
    name="stellarax_reproducible", default=_xla_asks_determinism(os.environ.get("XLA_FLAGS", "")),
    include_in_jit_key=True, include_in_trace_context=True,
    help="Choose only configs whose outputs are bit-identical run after run (see "
         "stellarax/core/resolution.py); on by default where XLA_FLAGS turn on "
         "--xla_gpu_deterministic_ops.")


def reproducible() -> bool:
  """Whether configs are chosen for bit-identical outputs run after run: inside
  `reproducible_scope()`, else the `STELLARAX_REPRODUCIBLE` environment variable or
  `jax.config.update("stellarax_reproducible", ...)`, else whether `XLA_FLAGS` turn on
  `--xla_gpu_deterministic_ops` (or `--xla_gpu_exclude_nondeterministic_ops`)."""
  return bool(_reproducible.value)


@contextlib.contextmanager
def reproducible_scope(on: bool = True) -> Iterator[None]:
  """Chooses only bit-reproducible configs inside a `with` block (see the module
  docstring), or, with `on=False`, lifts that where it is on by default.

  Args:
    on: whether to choose only reproducible configs.

  Raises:
    TypeError: if `on` is not a bool.
  """
  if not isinstance(on, bool):
    raise TypeError(f"reproducible_scope(on={on!r}): pass True or False.")
  with _reproducible(on):
    yield


def reproducible_filter(op: Any) -> Callable[[Any], bool] | None:
  """What configs of `op` may be chosen now: `op._is_reproducible` in reproducible
  mode, None (any) otherwise."""
  return op._is_reproducible if reproducible() else None


_active_results: contextvars.ContextVar[tuple[ConfigSource, ...]] = contextvars.ContextVar(
    "stellarax_active_results", default=())
_miss_policy: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "stellarax_miss_policy", default=None)
_cache_sources: list[ConfigSource] = []
# Traces record what they asked of the active results (core/trace_keys.py).
trace_keys.set_stack_getter(_active_results.get)

_fallbacks: list[Callable[[Any, Any], Resolution | None]] = []
_autotune_on_miss: Callable[[Any], Any] | None = None


def push_result(result: ConfigSource) -> tuple[contextvars.Token, Any]:
  """Makes `result` the innermost active result; returns the token to pop it."""
  stack = _active_results.get() + (result,)
  return _active_results.set(stack), trace_keys.enter(stack)


def pop_result(token: tuple[contextvars.Token, Any]) -> None:
  """Undoes the matching `push_result`."""
  ctx_token, key_token = token
  trace_keys.leave(key_token)
  _active_results.reset(ctx_token)


def active_results() -> tuple[ConfigSource, ...]:
  """The active results, outermost first.

  Code that traces a computation from what it reads here must go through
  `ask_active_results` instead, so that JAX's caches learn of it.
  """
  return _active_results.get()


def ask_active_results(question: Callable[[tuple[ConfigSource, ...], Any], Any], bound_args: Any) -> Any:
  """Answers `question(active_results, bound_args)` and records the answer
  for the computation being traced, so that JAX reuses that trace only
  where the same question gets the same answer (see `core/trace_keys.py`).

  Args:
    question: a module-level function (it is kept as part of a cache key)
      of the active results (outermost first) and `bound_args`.
    bound_args: a hashable `BoundArguments`.

  Returns:
    The answer.
  """
  answer = question(_active_results.get(), bound_args)
  trace_keys.record(question, bound_args, answer)
  return answer


# Other settings resolution reads, carried by `snapshot` and `restored`: (read the value
# now, a context manager making a value current); `carry_setting` adds one.
_carried_settings: list[tuple[Callable[[], Any], Callable[[Any], Any]]] = []


def carry_setting(read: Callable[[], Any], scope: Callable[[Any], Any]) -> None:
  """Adds a setting that resolving a call reads, so that `snapshot` keeps it and
  `restored` makes it current again (e.g. the transfer switch's scope).

  Args:
    read: returns the setting's value in this context now.
    scope: `scope(value)` is a context manager under which `read()` gives `value`.
  """
  if (read, scope) not in _carried_settings:
    _carried_settings.append((read, scope))


carry_setting(reproducible, _reproducible)


def snapshot() -> tuple[Any, ...]:
  """The active results, the miss-policy scope and the other settings resolution reads
  (the reproducible mode, those `carry_setting` added), to resolve later as if now
  (`restored`): for calls whose per-device shapes are known only when XLA partitions
  the program, which may be compiled after the scopes have ended."""
  return (_active_results.get(), _miss_policy.get(),
          tuple(read() for read, _ in _carried_settings))


@contextlib.contextmanager
def restored(state: tuple[Any, ...]) -> Iterator[None]:
  """Makes a `snapshot()`'s results and settings the current ones inside a `with`
  block."""
  results, policy, values = state
  with contextlib.ExitStack() as stack:
    for (_, scope), value in zip(_carried_settings, values):
      stack.enter_context(scope(value))
    stack.enter_context(trace_keys.settings_scope(_miss_policy, policy))
    token = _active_results.set(results)
    try:
      yield
    finally:
      _active_results.reset(token)


def _innermost_config(results: tuple[ConfigSource, ...], bound_args: Any) -> Any | None:
  # The mode is read here, not passed: a trace keyed by this question is reused only
  # where the mode (part of JAX's jit key) is the one it was asked under.
  accept = reproducible_filter(bound_args.op)
  for result in reversed(results):
    config = result.lookup_config(bound_args, accept)
    if config is not None:
      return config
  return None


def register_cache_source(source: ConfigSource) -> None:
  """Adds a cache consulted after the active results, in registration order."""
  if source not in _cache_sources:
    _cache_sources.append(source)


def cache_sources() -> tuple[ConfigSource, ...]:
  """The registered caches, in the order they are consulted."""
  return tuple(_cache_sources)


def register_fallback(fallback: Callable[[Any, Any], Resolution | None]) -> None:
  """Adds a step consulted after the caches and before the miss policy.

  `fallback(bound_args, heuristic_config)` returns a Resolution or None (used
  e.g. by transfer from the nearest tuned shapes).
  """
  if fallback not in _fallbacks:
    _fallbacks.append(fallback)


def set_autotune_on_miss(fn: Callable[[Any], Any]) -> None:
  """Sets what the "autotune" policy calls: `fn(bound_args) -> config`."""
  global _autotune_on_miss
  _autotune_on_miss = fn


_tuning_backend: Any = None


def set_tuning_backend(backend: Any) -> None:
  """Sets what `BoundArguments.autotune/benchmark` call (autotuning registers it)."""
  global _tuning_backend
  _tuning_backend = backend


def tuning_backend() -> Any:
  """The registered tuning backend.

  Raises:
    RuntimeError: when `stellarax.autotuning` was not imported.
  """
  if _tuning_backend is None:
    raise RuntimeError("Tuning needs stellarax.autotuning; `import stellarax` loads it.")
  return _tuning_backend


def miss_policy() -> str:
  """The active miss policy: `with miss_policy_scope(...)`, else the
  `STELLARAX_MISS_POLICY` environment variable, else "heuristics"."""
  policy = _miss_policy.get() or os.environ.get(_MISS_POLICY_ENV) or "heuristics"
  if policy not in MISS_POLICIES:
    raise ValueError(
        f"miss policy {policy!r} (from {_MISS_POLICY_ENV} or miss_policy_scope) must be "
        f"one of {MISS_POLICIES}.")
  return policy


@contextlib.contextmanager
def miss_policy_scope(policy: str) -> Iterator[None]:
  """Sets the miss policy inside a `with` block.

  Args:
    policy: "heuristics", "error" or "autotune".

  Raises:
    ValueError: for any other policy.
  """
  if policy not in MISS_POLICIES:
    raise ValueError(f"policy={policy!r} must be one of {MISS_POLICIES}.")
  with trace_keys.settings_scope(_miss_policy, policy):
    yield


def resolve_config(bound_args: Any) -> Resolution:
  """Returns the config of a bound op call and where it comes from.

  Args:
    bound_args: a `BoundArguments`.

  Returns:
    A `Resolution` (see the module docstring for the order).

  Raises:
    ConfigMissError: when nothing was measured and the policy is "error".
  """
  op = bound_args.op
  if op.config is not None:
    return Resolution(op.config, "explicit")
  config = ask_active_results(_innermost_config, bound_args)
  if config is not None:
    return Resolution(config, "result")
  accept = reproducible_filter(op)
  for cache in _cache_sources:
    config = cache.lookup_config(bound_args, accept)
    if config is not None:
      return Resolution(config, cache.source_name)
  heuristic = reproducible_heuristic(bound_args, accept)
  for fallback in _fallbacks:
    found = fallback(bound_args, heuristic)
    if found is not None:
      return found
  if set(bound_args.autotuning_configs) <= {heuristic}:
    # Nothing to choose: no policy applies (under "error", a norm would have to be tuned).
    return Resolution(heuristic, ONLY_CONFIG)
  # Recorded: a trace that met this miss is reused only under the same policy.
  policy = ask_active_results(_miss_policy_now, bound_args)
  if policy == "error":
    raise ConfigMissError(
        f"No tuned config for {op.name} with key {bound_args.key_json()} in the active "
        "results or caches, and the miss policy is 'error'. Tune it "
        "(stellarax.autotune), pin one (SomeOp(config=...)), or set the policy to "
        "'heuristics'. stellarax.autotuning.explain(bound_args) shows the nearest keys.")
  if policy == "autotune":
    if _autotune_on_miss is None:
      raise RuntimeError("The 'autotune' miss policy needs stellarax.autotuning imported.")
    return Resolution(_autotune_on_miss(bound_args), "autotuned")
  return Resolution(heuristic, "heuristics")


def _miss_policy_now(results: tuple[ConfigSource, ...], bound_args: Any) -> str:
  """The miss policy, as a question a trace records (`ask_active_results`)."""
  del results, bound_args
  return miss_policy()


def reproducible_heuristic(bound_args: Any, accept: Callable[[Any], bool] | None) -> Any:
  """The call's heuristic config; where `accept` (`reproducible_filter`'s) refuses it,
  the first config of its space, in canonical order, that it takes.

  Raises:
    ValueError: when `accept` takes no config of the space.
  """
  heuristic = bound_args.heuristics_config
  if accept is None or accept(heuristic):
    return heuristic
  space = sorted(bound_args.autotuning_configs, key=lambda c: canonical_json(config_to_json(c)))
  for config in space:
    if accept(config):
      return config
  raise ValueError(
      f"{bound_args.op.name} has no bit-reproducible config for {bound_args.key_json()}, and "
      "configs are being chosen for reproducibility (reproducible_scope, "
      "STELLARAX_REPRODUCIBLE or XLA's --xla_gpu_deterministic_ops). Use another "
      "implementation of the op, or leave reproducible mode: reproducible_scope(False).")
