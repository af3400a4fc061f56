"""Entering a result retraces exactly the jitted functions whose configs it changes."""

import asyncio
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import Measurement
from stellarax.core import trace_keys
from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig

TUNED = XlaRaggedDotConfig(strategy="tiled", tile_m=16)
OTHER = XlaRaggedDotConfig(strategy="masked")


def _inputs(m=48, k=16, n=8, sizes=(10, 0, 30, 5)):
  keys = jax.random.split(jax.random.key(3), 2)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32)
  rhs = jax.random.normal(keys[1], (len(sizes), k, n), jnp.float32)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _result(*pairs):
  entries = {}
  for ba, config in pairs:
    m = Measurement(status="ok", median_s=1e-3, ci_low_s=9e-4, ci_high_s=1.1e-3, num_samples=5,
                    compile_time_s=0.1, error=None, method="test")
    entry = autotuning.Entry(bound_args=ba, best_config=config, heuristic_config=ba.heuristics_config,
                             measurements=((config, m),))
    entries[entry.key] = entry
  return autotuning.AutotuningResult("cpu", entries)


@pytest.fixture
def traced(monkeypatch):
  """Records (function name, config) each time XlaRaggedDot is traced."""
  seen = []
  original = stellarax.XlaRaggedDot._fwd

  def spy(self, *a, config, **k):
    seen.append(config)
    return original(self, *a, config=config, **k)

  monkeypatch.setattr(stellarax.XlaRaggedDot, "_fwd", spy)
  return seen


def _counting(fn):
  """`jax.jit(fn)` with a list counting its traces."""
  count = []

  def wrapped(*args):
    count.append(1)
    return fn(*args)

  return jax.jit(wrapped), count


def test_only_functions_whose_configs_change_are_traced_again(traced, monkeypatch):
  monkeypatch.setenv("STELLARAX_TRANSFER", "0")  # keep the 40-row call out of the result's reach
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  uses_op, op_traces = _counting(lambda l, r: stellarax.ragged_dot(l, r, gs))
  plain, plain_traces = _counting(lambda x: jnp.sin(x) * 2)
  pinned, pinned_traces = _counting(
      lambda l, r: stellarax.ragged_dot(l, r, gs, implementation=stellarax.XlaRaggedDot(config=OTHER)))
  other_shape, other_traces = _counting(lambda l, r: stellarax.ragged_dot(l[:40], r, gs))
  everything = (uses_op, plain, pinned, other_shape)
  for f in everything:
    f(lhs, rhs) if f is not plain else f(lhs)
  assert traced == [ba.heuristics_config, OTHER, ba.heuristics_config]
  result = _result((ba, TUNED))
  for _ in range(3):  # entering again reuses the traces made the first time
    with result:
      for f in everything:
        f(lhs, rhs) if f is not plain else f(lhs)
    for f in everything:  # and leaving goes back to the first traces
      f(lhs, rhs) if f is not plain else f(lhs)
  assert traced[3:] == [TUNED]
  assert (len(op_traces), len(plain_traces), len(pinned_traces), len(other_traces)) == (2, 1, 1, 1)


def test_a_call_whose_config_transfers_from_the_result_is_traced_again(traced):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  f, count = _counting(lambda l, r: stellarax.ragged_dot(l[:40], r, gs))
  f(lhs, rhs)
  with _result((ba, TUNED)):  # the nearest tuned call is the 48-row one
    f(lhs, rhs)
  assert len(count) == 2 and traced == [ba.heuristics_config, TUNED]


def test_a_result_with_the_same_configs_reuses_the_trace(traced):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  f, count = _counting(lambda l, r: stellarax.ragged_dot(l, r, gs))
  with _result((ba, TUNED)):
    f(lhs, rhs)
  with _result((ba, TUNED)):  # another object, same answer
    f(lhs, rhs)
  with _result((ba, OTHER)):
    f(lhs, rhs)
  assert len(count) == 2 and traced == [TUNED, OTHER]


def test_outer_function_reusing_a_cached_inner_jit_is_traced_again(traced):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  inner = jax.jit(lambda l, r: stellarax.ragged_dot(l, r, gs))
  inner(lhs, rhs)  # cached before the outer function is traced
  outer, count = _counting(lambda l, r: inner(l, r) * 2)
  outer(lhs, rhs)
  with _result((ba, TUNED)):
    np.testing.assert_allclose(outer(lhs, rhs), 2 * jax.lax.ragged_dot(lhs, rhs, gs), rtol=1e-5, atol=1e-5)
  assert len(count) == 2 and traced[-1] == TUNED


def test_inner_jit_first_traced_inside_another_then_called_alone(traced):
  # f's trace, made inside g's, is reused when f is called on its own (no top-level
  # trace of f): the executable compiled from it must still follow the results.
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  pinned = lambda config: stellarax.ragged_dot(
      lhs, rhs, gs, implementation=stellarax.XlaRaggedDot(config=config))
  heuristic, tuned = pinned(ba.heuristics_config), pinned(TUNED)
  f = jax.jit(lambda l: stellarax.ragged_dot(l, rhs, gs) + 0)
  g = jax.jit(lambda l: f(l) * 1)
  g(lhs)
  jax.eval_shape(lambda l: l * 2, lhs)  # a top-level trace that is never lowered
  np.testing.assert_array_equal(f(lhs), heuristic)
  with _result((ba, TUNED)):
    np.testing.assert_array_equal(f(lhs), tuned)
    assert traced[-1] == TUNED
  np.testing.assert_array_equal(f(lhs), heuristic)
  with _result((ba, TUNED)):
    np.testing.assert_array_equal(g(lhs), tuned)
  with _result((ba, OTHER)):
    np.testing.assert_array_equal(f(lhs), pinned(OTHER))


def test_outer_function_reusing_a_cached_scan_body_is_traced_again(traced):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)

  def body(carry, _):
    return carry, stellarax.ragged_dot(carry, rhs, gs)

  first, _ = _counting(lambda l: jax.lax.scan(body, l, length=2)[1])
  second, count = _counting(lambda l: jax.lax.scan(body, l, length=2)[1] + 1)
  first(lhs)
  second(lhs)
  with _result((ba, TUNED)):
    second(lhs)
  assert len(count) == 2 and traced[-1] == TUNED


def test_result_entered_inside_a_traced_function(traced):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  inside = _result((ba, TUNED))

  def fn(l, r):
    with inside:
      return stellarax.ragged_dot(l, r, gs)

  f, count = _counting(fn)
  for _ in range(3):
    f(lhs, rhs)
  with _result((ba, OTHER)):  # the inner result still wins: same answer, same trace
    f(lhs, rhs)
  assert len(count) == 1 and traced == [TUNED]


def test_gradient_traced_before_the_result(traced):
  lhs, rhs, gs = _inputs()
  vjp_ba = stellarax.XlaRaggedDotVjp.bind  # noqa: F841 (the class exists)
  grad, count = _counting(jax.grad(lambda l, r: stellarax.ragged_dot(l, r, gs).sum(), argnums=(0, 1)))
  grad(lhs, rhs)
  (fwd_ba,) = [b for b in autotuning.get_bound_args(lambda l, r: stellarax.ragged_dot(l, r, gs), lhs, rhs)]
  with _result((fwd_ba, TUNED)):
    grad(lhs, rhs)
  with _result():  # an empty result changes nothing
    grad(lhs, rhs)
  assert len(count) == 2 and TUNED in traced


@pytest.mark.parametrize("first", ["eval_shape", "trace", "lower", "compile", "make_jaxpr"])
def test_a_function_first_traced_without_a_call_follows_the_results(traced, first):
  # A trace (and lowering, and executable) made by eval_shape, .trace(), .lower() or
  # .lower().compile() is reused by the first call, which cached its executable under a
  # key that had asked nothing and so equalled every other: inside a result, f kept
  # the result's config after the block; outside, a result entered later was ignored.
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  ahead = {"eval_shape": lambda f: jax.eval_shape(f, lhs), "trace": lambda f: f.trace(lhs),
           "lower": lambda f: f.lower(lhs), "compile": lambda f: f.lower(lhs).compile(),
           "make_jaxpr": lambda f: jax.make_jaxpr(f)(lhs)}[first]
  result = _result((ba, TUNED))
  inside, count_inside = _counting(lambda l: stellarax.ragged_dot(l, rhs, gs))
  with result:
    ahead(inside)
    inside(lhs)
  assert traced == [TUNED]
  inside(lhs)  # traced again for the heuristic (it ran the result's config)
  assert traced == [TUNED, ba.heuristics_config] and len(count_inside) == 2
  outside, count_outside = _counting(lambda l: stellarax.ragged_dot(l, rhs, gs))
  ahead(outside)
  outside(lhs)
  with result:
    outside(lhs)  # traced again for the result (it was ignored)
  assert traced[2:] == [ba.heuristics_config, TUNED] and len(count_outside) == 2
  plain, count_plain = _counting(lambda l: l * 2)  # traced after the reuses: asks nothing
  plain(lhs)
  with result:
    plain(lhs)
  assert len(count_plain) == 1


def test_threads_in_other_settings_do_not_share_equalities():
  # The equality of two keys was memoised per stack of results and a process-wide
  # epoch: a thread inside miss_policy_scope("error") reused the main thread's trace
  # made under "heuristics" (no ConfigMissError), and one inside transfer_scope(False)
  # a transferred config, whenever the main thread had called f in between.
  lhs, rhs, gs = _inputs()
  f = jax.jit(lambda l: stellarax.ragged_dot(l, rhs, gs))
  f(lhs)
  entered, called = threading.Event(), threading.Event()
  seen = {}

  def strict():
    with autotuning.miss_policy_scope("error"):
      entered.set()
      called.wait(60)
      try:
        f(lhs)
        seen["strict"] = "ran"
      except autotuning.ConfigMissError:
        seen["strict"] = "raised"

  thread = threading.Thread(target=strict)
  thread.start()
  entered.wait(60)
  f(lhs)  # memoises the equality under "heuristics" for the empty stack
  called.set()
  thread.join(120)
  assert seen["strict"] == "raised"


def test_a_fresh_thread_s_reuse_leaves_the_default_key_without_answers():
  # A thread with no key of its own uses the process-wide default; reusing another
  # thread's trace lent the default f's answers, so a plain function traced later by
  # another fresh thread was traced again on entering a result that changes f's config.
  lhs, rhs, gs = _inputs()
  f = jax.jit(lambda l: stellarax.ragged_dot(l, rhs, gs))
  f(lhs)
  thread = threading.Thread(target=lambda: f(lhs))
  thread.start()
  thread.join(120)
  plain, count = _counting(lambda x: jnp.sin(x) * 2)
  result = _result((stellarax.XlaRaggedDot.bind(lhs, rhs, gs), TUNED))

  def other():
    plain(lhs)
    with result:
      plain(lhs)

  thread = threading.Thread(target=other)
  thread.start()
  thread.join(120)
  assert len(count) == 1


def test_threads_see_their_own_results(traced):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  f = jax.jit(lambda l, r: stellarax.ragged_dot(l, r, gs))
  result = _result((ba, TUNED))
  order = [threading.Event() for _ in range(3)]
  seen = {}

  def tuned_thread():
    with result:
      order[0].wait()
      f(lhs, rhs)
      seen["tuned"] = list(traced)
      order[1].set()
      order[2].wait()

  def plain_thread():
    f(lhs, rhs)
    order[0].set()
    order[1].wait()
    count = len(traced)
    f(lhs, rhs)  # the tuned thread's trace must not be reused here
    seen["plain_again"] = len(traced) - count
    order[2].set()

  threads = [threading.Thread(target=tuned_thread), threading.Thread(target=plain_thread)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert seen["tuned"][-1] == TUNED and traced[0] == ba.heuristics_config
  assert seen["plain_again"] == 0  # reused its own heuristic trace


def test_threads_may_enter_one_result_at_once():
  # The first thread in leaves first, while the second is still inside.
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  shared = _result((ba, TUNED))
  first_in, second_in, first_out = (threading.Event() for _ in range(3))
  seen, errors = {}, []

  def worker(name, wait_for, then_set, leave_after):
    try:
      wait_for.wait(timeout=60)
      with shared:
        then_set.set()
        leave_after.wait(timeout=60)
        seen[name + " inside"] = autotuning.explain(ba).config
      seen[name + " after"] = autotuning.explain(ba).config
      first_out.set()
    except Exception as exc:  # noqa: BLE001 (reported below)
      errors.append(exc)

  go = threading.Event()
  go.set()
  threads = [threading.Thread(target=worker, args=("first", go, first_in, second_in)),
             threading.Thread(target=worker, args=("second", first_in, second_in, first_out))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not errors, errors
  assert seen == {"first inside": TUNED, "first after": ba.heuristics_config,
                  "second inside": TUNED, "second after": ba.heuristics_config}


def test_async_tasks_see_their_own_results(traced):
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  f = jax.jit(lambda l, r: stellarax.ragged_dot(l, r, gs))
  result = _result((ba, TUNED))
  configs = {}

  async def tuned():
    with result:
      await asyncio.sleep(0.01)  # the plain task runs here, inside our `with`
      f(lhs, rhs)
      configs["tuned"] = traced[-1]

  async def plain():
    f(lhs, rhs)
    configs["plain"] = traced[-1]

  async def main():
    await asyncio.gather(tuned(), plain())

  asyncio.run(main())
  assert configs == {"tuned": TUNED, "plain": ba.heuristics_config}


def test_async_tasks_whose_results_overlap_without_nesting(traced):
  # Task A enters a result, task B enters another, A leaves, B leaves. B then traced under
  # the thread's key of before A's result, took its own result for one entered inside the
  # traced function, and the trace was reused after B left it (and after asyncio.run).
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  f = jax.jit(lambda l: stellarax.ragged_dot(l, rhs, gs))
  other, tuned = _result(), _result((ba, TUNED))
  configs = []

  async def task_a(a_in, b_in, a_out):
    with other:
      a_in.set()
      await b_in.wait()
    a_out.set()

  async def task_b(a_in, b_in, a_out):
    await a_in.wait()
    with tuned:
      b_in.set()
      await a_out.wait()
      f(lhs)
      configs.append(traced[-1])
    f(lhs)
    configs.append(traced[-1])

  async def main():
    events = [asyncio.Event() for _ in range(3)]
    await asyncio.gather(task_a(*events), task_b(*events))

  asyncio.run(main())
  f(lhs)
  configs.append(traced[-1])
  assert configs == [TUNED, ba.heuristics_config, ba.heuristics_config]


def test_a_context_copied_into_a_thread_keys_its_traces(traced):
  # asyncio.to_thread copies the context, results included, into a thread with no key of
  # its own: its trace was cached under the process's default key, which another fresh
  # thread's lookup found by identity, with no result active (and the reverse).
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  f = jax.jit(lambda l: stellarax.ragged_dot(l, rhs, gs))
  result = _result((ba, TUNED))
  configs = []

  def fresh_thread():
    f(lhs)
    configs.append(traced[-1])

  async def copied():
    with result:
      await asyncio.to_thread(fresh_thread)

  for run in (lambda: asyncio.run(copied()), fresh_thread, lambda: asyncio.run(copied())):
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
  assert configs == [TUNED, ba.heuristics_config, TUNED]


def test_trace_key_equality_follows_recorded_answers():
  def question(stack, subject):
    return stack[-1] if stack else None

  key = trace_keys.TraceKey()
  assert key == trace_keys.TraceKey() and hash(key) == hash(trace_keys.TraceKey())
  key._merge([(question, "x", (), None)], ())
  assert len(key) == 1 and key.holds()
  a = _result()
  with a:
    assert not key.holds() and key != trace_keys.current()
  key._merge([(question, "x", (), "other")], ())  # two answers to one question
  assert not key.holds()


def test_implementation_choice_follows_the_result_under_jit(monkeypatch):
  from stellarax.core.config import NoConfig
  q = jnp.ones((1, 16, 2, 8))
  chunked, full = stellarax.XlaChunkedAttention.bind(q, q, q), stellarax.XlaAttention.bind(q, q, q)

  def entry(ba, config, t):
    m = Measurement(status="ok", median_s=t, ci_low_s=t, ci_high_s=t, num_samples=3, compile_time_s=0.1, method="t")
    return autotuning.Entry(ba, config, config, ((config, m),))

  seen = []
  original = stellarax.XlaAttention._fwd
  monkeypatch.setattr(stellarax.XlaAttention, "_fwd", lambda self, *a, **k: (seen.append(1), original(self, *a, **k))[1])
  f, count = _counting(lambda x: stellarax.dot_product_attention(x, x, x))
  f(q)
  fast_full = autotuning.AutotuningResult(
      "cpu", {e.key: e for e in (entry(chunked, chunked.heuristics_config, 2e-3), entry(full, NoConfig(), 1e-3))})
  with fast_full:
    f(q)
  f(q)
  assert len(count) == 2 and seen == [1]


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_implementation_choice_under_vmap_reads_the_batched_calls_times(monkeypatch, jitted):
  # The measured calls of a vmapped op are keyed with their vmap levels; dispatch looked
  # for the unbatched calls' times, found none, and took the first implementation.
  from stellarax.core.config import NoConfig
  q = jnp.ones((2, 1, 16, 2, 8))  # a batch of 2 to vmap over
  level = ((2, (True, True, True)),)
  unbatched = jax.ShapeDtypeStruct(q.shape[1:], q.dtype)
  chunked, full = (dataclasses.replace(cls.bind(unbatched, unbatched, unbatched), vmap_axes=level)
                   for cls in (stellarax.XlaChunkedAttention, stellarax.XlaAttention))

  def entry(ba, config, t):
    m = Measurement(status="ok", median_s=t, ci_low_s=t, ci_high_s=t, num_samples=3)
    return autotuning.Entry(ba, config, config, ((config, m),))

  seen = []
  original = stellarax.XlaAttention._fwd
  monkeypatch.setattr(stellarax.XlaAttention, "_fwd",
                      lambda self, *a, **k: (seen.append(1), original(self, *a, **k))[1])
  attend = jax.vmap(lambda x: stellarax.dot_product_attention(x, x, x))
  fast_full = autotuning.AutotuningResult("cpu", {e.key: e for e in (
      entry(chunked, chunked.heuristics_config, 2e-3), entry(full, NoConfig(), 1e-3))})
  with fast_full:
    (jax.jit(attend) if jitted else attend)(q)
    assert seen
    # A level that maps none of the call's arguments is not one of its levels.
    seen.clear()
    outer = jax.vmap(lambda s: attend(q) * s)
    (jax.jit(outer) if jitted else outer)(jnp.ones(3))
    assert seen


def test_vmapped_and_rematerialised_calls_under_jit(traced):
  lhs, rhs, gs = _inputs()
  batched = jnp.stack([lhs, 2 * lhs])
  per_row = lambda l: stellarax.ragged_dot(l, rhs, gs)
  (vmapped_ba,) = autotuning.get_bound_args(jax.vmap(per_row), batched)
  f, count = _counting(jax.vmap(jax.checkpoint(per_row)))
  expected = 2 * jax.lax.ragged_dot(lhs, rhs, gs)
  f(batched)
  with _result((vmapped_ba, TUNED)):
    np.testing.assert_allclose(f(batched)[1], expected, rtol=1e-5, atol=1e-4)
    text = f.lower(batched).as_text()  # lowering in the context reuses the new trace
  assert len(count) == 2 and traced[-1] == TUNED and "stellarax_op" in text


def test_asking_outside_a_trace_records_nothing():
  lhs, rhs, gs = _inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  before = len(trace_keys.current())
  autotuning.explain(ba)
  stellarax.ragged_dot(lhs, rhs, gs)  # an eager call leaves the current key fresh
  outside = trace_keys.current()
  with _result((ba, TUNED)):
    stellarax.ragged_dot(lhs, rhs, gs)  # nor does it leave records outside the result
  assert trace_keys.current() is outside
  assert len(outside) == before == 0


def test_eager_calls_compile_once_and_follow_results(traced):
  lhs, rhs, gs = _inputs(m=40)
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  expected = jax.lax.ragged_dot(lhs, rhs, gs)
  for _ in range(3):
    np.testing.assert_allclose(stellarax.ragged_dot(lhs, rhs, gs), expected, rtol=1e-5, atol=1e-5)
  with _result((ba, TUNED)):
    for _ in range(2):
      np.testing.assert_allclose(stellarax.ragged_dot(lhs, rhs, gs), expected, rtol=1e-5, atol=1e-5)
  stellarax.ragged_dot(lhs, rhs, gs)
  assert traced == [ba.heuristics_config, TUNED]  # one trace per distinct config


def test_jax_reports_top_level_traces():
  """The keys rely on JAX's trace-duration events (start and end of a top-level jit
  trace): if a JAX upgrade stops sending them, this fails first."""
  seen = []

  def f(x):
    seen.append((len(trace_keys._top_level()), trace_keys.building()))
    return x + 1

  before = trace_keys.current()
  jax.jit(f)(1.0)
  assert seen == [(1, True)] and not trace_keys._top_level() and not trace_keys.building()
  assert trace_keys.current() is not before  # a fresh key after the trace
