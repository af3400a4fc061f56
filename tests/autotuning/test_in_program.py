"""check_in_program: tuned configs timed in the program they were tuned for."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning import in_program
from stellarax.autotuning.measure import Measurement, MeasureOptions
from profiling import drop_live_programs  # tests/ is on sys.path

FAST = MeasureOptions(rounds=3, leader_rounds=0, warmup_s=0.0, max_total_s=0.3, min_batch_s=2e-4)


def _inputs():
  k = jax.random.split(jax.random.key(7), 2)
  lhs = jax.random.normal(k[0], (96, 32), jnp.float32)
  rhs = jax.random.normal(k[1], (3, 32, 16), jnp.float32)
  return lhs, rhs, jnp.array([40, 0, 50], jnp.int32)  # an empty group, sum < M


def program(lhs, rhs, gs):
  y = stellarax.ragged_dot(lhs, rhs, gs, implementation="xla")
  return jnp.sum(jnp.sin(y)), stellarax.rms_norm(y, None, implementation="xla")


def _ok(ms):
  return Measurement(status="ok", median_s=ms * 1e-3, ci_low_s=ms * 1e-3, ci_high_s=ms * 1e-3,
                     num_samples=3, compile_time_s=0.1, method="test")


def _result_with_other_config():
  """A result whose ragged_dot entry chose a config other than its heuristic."""
  lhs, rhs, gs = _inputs()
  (ragged, norm) = autotuning.get_bound_args(program, lhs, rhs, gs)
  ragged = ragged.with_config(None)
  heuristic = ragged.heuristics_config
  other = next(c for c in sorted(ragged.autotuning_configs, key=repr) if c != heuristic)
  entry = autotuning.Entry(bound_args=ragged, best_config=other, heuristic_config=heuristic,
                           measurements=((heuristic, _ok(2.0)), (other, _ok(1.0))), method="test")
  return autotuning.AutotuningResult(jax.devices()[0].device_kind, {entry.key: entry}), entry


def test_the_program_is_timed_with_heuristics_tuned_and_each_call_left_out():
  result, entry = _result_with_other_config()
  check = autotuning.check_in_program(result, program, *_inputs(), options=FAST)
  assert check.num_calls == 2 and [c.entry for c in check.calls] == [entry]
  assert check.heuristics.ok and check.tuned.ok and check.calls[0].without.ok
  assert check.speedup == check.heuristics.median_s / check.tuned.median_s
  assert check.call_times == ()  # profiled only when asked
  lines = check.lines()
  assert lines[0].startswith("program: ") and "1 of 2 op calls run a tuned config other than their heuristic's" in lines[0]
  assert lines[1].startswith("  ragged_dot.xla: without it ")


def test_each_variant_runs_the_configs_it_names(monkeypatch):
  result, entry = _result_with_other_config()
  args = _inputs()
  traced = {}

  def fake_measure(programs, margs, **kwargs):
    for name, fn in programs.items():
      traced[name] = str(jax.make_jaxpr(fn)(*margs))
    return {name: _ok(1.0) for name in programs}

  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", fake_measure)
  autotuning.check_in_program(result, program, *args)
  # Left out, the only tuned call is at its heuristic: the heuristic program exactly.
  assert traced[0] == traced["heuristics"] != traced["tuned"]
  with result:
    assert traced["tuned"] == str(jax.make_jaxpr(lambda a: program(*a))(list(args)))


@pytest.mark.parametrize("without_ms, tuned_status, helps", [
    (2.0, "ok", True),            # faster beyond noise with the tuned config
    (1.005, "ok", False),         # within TIE_RELATIVE: the heuristic is kept
    (2.0, "wrong_result", False),  # wrong in context: never kept
])
def test_kept_puts_back_the_calls_that_do_not_help(monkeypatch, without_ms, tuned_status, helps):
  result, entry = _result_with_other_config()
  tuned = _ok(1.0) if tuned_status == "ok" else Measurement(status=tuned_status, error="max abs error 9")
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      "heuristics": _ok(2.0), "tuned": tuned, 0: _ok(without_ms)})
  check = autotuning.check_in_program(result, program, *_inputs())
  assert check.calls[0].helps is helps
  (kept,) = check.kept()
  assert kept.best_config == (entry.best_config if helps else entry.heuristic_config)
  assert kept.measurements == entry.measurements
  assert ("heuristic kept" in kept.method) is not helps
  assert ("helps" in check.lines()[1]) is helps
  assert ("its config is the culprit" in check.lines()[1]) is (tuned_status != "ok")


@pytest.mark.parametrize("tuned_ms, says", [
    (1.0, "program: 2.000 ms with heuristics -> 1.000 ms tuned (2.00x);"),
    (1.99, "program: 2.000 ms with heuristics -> 1.990 ms tuned (1.01x, within noise);"),
    (0.0005, "program: 2.000 ms with heuristics -> 0.5 us tuned (4000.00x);"),
    (3.0, "program: 2.000 ms with heuristics -> 3.000 ms tuned (0.67x, slower beyond noise);"),
])
def test_the_program_line_says_whether_the_gain_is_beyond_noise(monkeypatch, tuned_ms, says):
  result, _ = _result_with_other_config()
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      "heuristics": _ok(2.0), "tuned": _ok(tuned_ms), 0: _ok(2.0)})
  check = autotuning.check_in_program(result, program, *_inputs())
  assert check.faster_beyond_noise is (tuned_ms < 1.99)
  assert check.lines()[0].startswith(says), check.lines()
  gain = {1.0: "+1.000 ms", 1.99: "+10.0 us", 0.0005: "+2.000 ms", 3.0: "-1.000 ms"}[tuned_ms]
  helps = tuned_ms < 1.99  # a difference within noise is not called a gain
  assert check.lines()[1].endswith(
      f"without it 2.000 ms, {'its gain' if helps else 'a difference of'} {gain}; "
      + ("helps" if helps else "not faster beyond noise: kept() keeps the heuristic"))


def test_a_result_that_changes_no_config_reports_no_ratio(monkeypatch):
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      "heuristics": _ok(2.0), "tuned": _ok(1.8)})
  check = autotuning.check_in_program(autotuning.AutotuningResult("cpu"), program, *_inputs())
  assert check.calls == () and "(the same configs: no call's tuned config" in check.lines()[0]


def test_the_yardstick_is_todays_heuristic_not_the_one_recorded(monkeypatch):
  # An entry tuned under an older heuristic: its recorded heuristic is another config.
  result, entry = _result_with_other_config()
  today = entry.heuristic_config
  older = entry.best_config
  moved = dataclasses.replace(entry, best_config=today, heuristic_config=older)
  same = autotuning.AutotuningResult(result.device_kind, {moved.key: moved})
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      name: _ok(1.0) for name in programs})
  # Its best config is today's heuristic: nothing changes, nothing to leave out.
  assert autotuning.check_in_program(same, program, *_inputs()).calls == ()
  # Best differs from today's heuristic: left out, the call runs today's heuristic,
  # and kept() puts that one back.
  other = dataclasses.replace(entry, heuristic_config=older)
  result = autotuning.AutotuningResult(result.device_kind, {other.key: other})
  traced = {}
  def fake_measure(programs, margs, **kwargs):
    traced.update({n: str(jax.make_jaxpr(fn)(*margs)) for n, fn in programs.items()})
    return {"heuristics": _ok(1.0), "tuned": _ok(1.0), 0: _ok(1.0)}
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", fake_measure)
  check = autotuning.check_in_program(result, program, *_inputs())
  assert [c.entry for c in check.calls] == [other] and check.calls[0].heuristic_config == today
  assert traced[0] == traced["heuristics"] != traced["tuned"]
  (kept,) = check.kept()
  assert kept.best_config == today and "heuristic kept" in kept.method


def test_a_lowered_program_is_refused_up_front():
  result, _ = _result_with_other_config()
  lowered = jax.jit(program).lower(*_inputs())
  with pytest.raises(TypeError, match=r"Lowered.*pass f and its arguments"):
    autotuning.check_in_program(result, lowered)
  with pytest.raises(TypeError, match=r"Traced.*pass f and its arguments"):
    autotuning.check_in_program(result, jax.jit(program).trace(*_inputs()))


def test_a_program_failing_at_its_heuristics_says_nothing_can_be_checked():
  result, _ = _result_with_other_config()
  def failing(lhs, rhs, gs):
    out = program(lhs, rhs, gs)
    jax.debug.callback(lambda: 1 / 0)  # fails when it runs, not when traced
    return out
  with pytest.raises(Exception) as caught:
    autotuning.check_in_program(result, failing, *_inputs(), options=FAST)
  assert any("every op call at its heuristic config" in n
             for n in getattr(caught.value, "__notes__", [])), caught.value


def test_a_program_without_ops_is_refused():
  with pytest.raises(ValueError, match="calls no stellarax op"):
    autotuning.check_in_program(autotuning.AutotuningResult("cpu"), lambda x: x * 2, jnp.ones(3))


def test_keyword_arguments_reach_the_program():
  result, _ = _result_with_other_config()
  lhs, rhs, gs = _inputs()
  check = autotuning.check_in_program(result, lambda lhs, rhs, gs: program(lhs, rhs, gs), lhs,
                                      rhs=rhs, gs=gs, options=FAST)
  assert check.tuned.ok and len(check.calls) == 1


def test_static_arguments_reach_the_program_as_autotune_takes_them():
  # A plain function branching on a string, and a jitted one with a static argument:
  # autotune, the total budget's profile and check_in_program all take them.
  result, _ = _result_with_other_config()
  lhs, rhs, gs = _inputs()
  def plain(lhs, rhs, gs, mode, scale=1.0):
    out, norm = program(lhs, rhs, gs)
    return (out * scale if mode == "scaled" else out), norm
  jitted = jax.jit(plain, static_argnums=3, static_argnames="scale")
  for f in (plain, jitted):
    calls = autotuning.get_bound_args(f, lhs, rhs, gs, "scaled", scale=2.0)
    assert [ba.op.name for ba in calls] == ["ragged_dot.xla", "layer_norm.xla"]
    check = autotuning.check_in_program(result, f, lhs, rhs, gs, "scaled", options=FAST,
                                        scale=2.0)
    assert check.heuristics.ok and check.tuned.ok and len(check.calls) == 1
  tuned = stellarax.Autotuner(total_budget_s=1.0, progress=False).autotune(
      jitted, lhs, rhs, gs, "scaled", scale=2.0)
  assert len(tuned) == 2
  # NumPy scalars too: capture traced them, and a jitted f's static one raised JAX's
  # "Non-hashable static arguments"; an epsilon passed on to a norm, "traced".
  sliced = jax.jit(lambda x, n, eps: stellarax.rms_norm(x[:n], None, epsilon=eps),
                   static_argnums=(1, 2))
  (call,) = autotuning.get_bound_args(sliced, lhs, np.int64(5), np.float32(0.5))
  assert call.arguments["x"].shape == (5, lhs.shape[1]) and call.arguments["epsilon"] == 0.5
  plain_norm = lambda x, eps: stellarax.layer_norm(x, None, None, epsilon=eps)
  (call,) = autotuning.get_bound_args(plain_norm, lhs, np.float32(0.25))
  assert call.arguments["epsilon"] == 0.25
  check = autotuning.check_in_program(result, sliced, lhs, np.int64(5), np.float32(0.5),
                                      options=FAST)
  assert check.heuristics.ok


def test_profile_gives_each_calls_own_device_time_in_the_program():
  drop_live_programs()  # a trace embeds the HLO of every live program
  result, entry = _result_with_other_config()
  check = autotuning.check_in_program(result, program, *_inputs(), options=FAST, profile=True)
  times = {t.op: t for t in check.call_times}
  assert set(times) == {"ragged_dot.xla", "layer_norm.xla"}
  ragged, norm = times["ragged_dot.xla"], times["layer_norm.xla"]
  assert ragged.key == entry.key and ragged.alone == 2.0  # 2 ms -> 1 ms on its own
  assert ragged.heuristic_s > 0 and ragged.tuned_s > 0 and norm.heuristic_s > 0
  assert norm.alone is None  # not in the result
  lines = check.lines()
  start = lines.index("each call's own device time per run of the program (profiled, 3 runs):")
  assert any(line.startswith("  ragged_dot.xla: ") and "on its own 2.00x" in line
             for line in lines[start:]), lines
  # Not in the result: the same config in both programs, whose times differ by noise.
  assert ragged.changed and not norm.changed
  assert any(line.startswith("  layer_norm.xla: ") and line.endswith("(the same config in both)")
             for line in lines[start:]), lines


def attention_program(q, kv):
  return stellarax.dot_product_attention(q, kv, kv, is_causal=True)  # dispatch picks


def _attention_in_two_implementations(own_ms, other_ms):
  """attention_program's inputs, its call and a result timing that call at its heuristic
  config in its own implementation (own_ms) and in another one (other_ms)."""
  k = jax.random.split(jax.random.key(3), 2)
  q, kv = jax.random.normal(k[0], (1, 40, 4, 8)), jax.random.normal(k[1], (1, 40, 2, 8))
  (found,) = autotuning.get_bound_args(attention_program, q, kv)
  found = found.with_config(None)
  other_cls = stellarax.XlaAttention if found.op.name != "attention.xla" else stellarax.XlaChunkedAttention
  other = other_cls.bind(q, kv, kv, is_causal=True)
  own, alternative = (autotuning.Entry(ba, ba.heuristics_config, ba.heuristics_config,
                                       ((ba.heuristics_config, _ok(ms)),), method="test")
                      for ba, ms in ((found, own_ms), (other, other_ms)))
  result = autotuning.AutotuningResult(jax.devices()[0].device_kind,
                                       {own.key: own, alternative.key: alternative})
  return (q, kv), result, own, alternative


@pytest.mark.parametrize("helps", [True, False])
def test_a_call_the_result_moves_to_another_implementation_is_checked_and_kept(monkeypatch, helps):
  # Autotuner(implementations=...) times the call's other implementations too; dispatch
  # runs the fastest. The call at its heuristic config leaves the other one timed at its
  # best config: the switch is what the program gains, and what a left-out call drops.
  (q, kv), result, own, switch = _attention_in_two_implementations(5.0, 1.0)
  found, other = own.bound_args, switch.bound_args
  traced = {}

  def fake_measure(programs, margs, **kwargs):
    for name, fn in programs.items():
      traced[name] = str(jax.make_jaxpr(fn)(*margs))
    return {"heuristics": _ok(5.0), "tuned": _ok(1.0), 0: _ok(1.0 if not helps else 5.0)}

  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", fake_measure)
  check = autotuning.check_in_program(result, attention_program, q, kv)
  (call,) = check.calls
  assert call.entry == own and call.alternatives == (switch,) and call.helps is helps
  # Left out, the call runs as with heuristics: its own implementation, not the other.
  assert traced[0] == traced["heuristics"] != traced["tuned"]
  assert check.lines()[1].startswith(f"  {found.op.name} or {other.op.name}: without it ")
  kept = check.kept()
  assert (switch in list(kept)) is helps and len(kept) == (2 if helps else 1)


def test_a_slower_implementation_in_the_result_changes_nothing(monkeypatch):
  # Dispatch keeps the call's own implementation when it is timed fastest: a call at
  # its heuristic config then has nothing to check, however many others were timed.
  (q, kv), result, _, _ = _attention_in_two_implementations(1.0, 5.0)
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      name: _ok(1.0) for name in programs})
  check = autotuning.check_in_program(result, attention_program, q, kv)
  assert check.calls == ()


def two_calls(lhs, rhs, gs):
  a = stellarax.ragged_dot(lhs, rhs, gs, implementation="xla")
  b = stellarax.ragged_dot(lhs[:48], rhs, jnp.array([20, 0, 28], jnp.int32), implementation="xla")
  return jnp.sum(a) + jnp.sum(b)


def three_calls(lhs, rhs, gs):
  c = stellarax.ragged_dot(lhs[:72], rhs, jnp.array([30, 2, 40], jnp.int32), implementation="xla")
  return two_calls(lhs, rhs, gs) + jnp.sum(c)


def _every_call_tuned(f):
  """A result that pins every op call of f(*_inputs()) to a config other than its
  heuristic, and its entries in program order."""
  entries = []
  for ba in autotuning.get_bound_args(f, *_inputs()):
    ba = ba.with_config(None)
    heuristic = ba.heuristics_config
    other = next(c for c in sorted(ba.autotuning_configs, key=repr) if c != heuristic)
    entries.append(autotuning.Entry(bound_args=ba, best_config=other, heuristic_config=heuristic,
                                    measurements=((heuristic, _ok(2.0)), (other, _ok(1.0)))))
  return autotuning.AutotuningResult(jax.devices()[0].device_kind, {e.key: e for e in entries}), entries


def test_a_call_whose_config_fails_in_the_program_is_not_held_against_the_others(monkeypatch):
  # One call's tuned config gives wrong results in the program: the tuned program and
  # every other call's left-out program (which still holds it) fail, and every other
  # call was said to be "not faster beyond noise", its tuned config thrown away by kept().
  result, entries = _every_call_tuned(two_calls)
  wrong = Measurement(status="wrong_result", error="max abs error 9")
  passes = iter([
      {"heuristics": _ok(2.0), "tuned": wrong, 0: _ok(1.5), 1: wrong},  # call 0 is the culprit
      {"heuristics": _ok(2.0), "tuned": _ok(1.0), 0: _ok(2.0)},  # call 1 alone, culprit out
  ])
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates",
                      lambda programs, *a, **k: next(passes))
  check = autotuning.check_in_program(result, two_calls, *_inputs())
  culprit, other = check.calls
  assert (culprit.helps, culprit.culprits_out, other.helps, other.culprits_out) == (
      False, False, True, True)
  assert "its config is the culprit" in check.lines()[1]
  assert "helps (judged with the culprits at their heuristic configs)" in check.lines()[2]
  kept = {e.key: e.best_config for e in check.kept()}
  assert kept == {entries[0].key: entries[0].heuristic_config,
                  entries[1].key: entries[1].best_config}


def test_when_every_left_out_program_fails_too_the_report_says_so(monkeypatch):
  # It said "not faster beyond noise" of programs that never ran.
  result, _ = _every_call_tuned(two_calls)
  wrong = Measurement(status="compile_error", error="tile_m=-3")
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      "heuristics": _ok(2.0), "tuned": wrong, 0: wrong, 1: wrong})
  check = autotuning.check_in_program(result, two_calls, *_inputs())
  assert all("the program fails without it too" in line for line in check.lines()[1:3])
  assert not any(c.helps for c in check.calls)


def test_a_failing_tuned_program_is_not_profiled(monkeypatch):
  # profile=True profiled the tuned program without looking whether it ran: the culprit's
  # error escaped after all the timing.
  result, _ = _result_with_other_config()
  wrong = Measurement(status="compile_error", error="boom")
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      "heuristics": _ok(2.0), "tuned": wrong, 0: _ok(2.0)})
  profiled = []
  monkeypatch.setattr(in_program.profile_lib, "device_time_per_call",
                      lambda program, *a, **k: profiled.append(program) or {})
  check = autotuning.check_in_program(result, program, *_inputs(), profile=True)
  assert len(profiled) == 1 and "its config is the culprit" in check.lines()[1]


def step_with_key(lhs, rhs, gs, key):
  key, sub = jax.random.split(key)
  y = stellarax.ragged_dot(lhs + jax.random.normal(sub, lhs.shape), rhs, gs, implementation="xla")
  return jnp.sum(y ** 2), key


def test_outputs_holding_prng_keys_and_float0_gradients_are_compared():
  # A training step returning its next key, and a gradient of an integer input
  # (allow_int), raised TypeError in the output check.
  result, _ = _result_with_other_config()
  lhs, rhs, gs = _inputs()
  check = autotuning.check_in_program(result, step_with_key, lhs, rhs, gs, jax.random.key(3),
                                      options=FAST)
  assert check.tuned.ok and check.calls[0].without.ok, check.lines()
  grad = jax.grad(lambda lhs, rhs, gs: jnp.sum(program(lhs, rhs, gs)[1]), argnums=(0, 2),
                  allow_int=True)
  check = autotuning.check_in_program(result, grad, lhs, rhs, gs, options=FAST)
  assert check.tuned.ok, check.lines()
  assert autotuning.measure.check_close({"k": jax.random.key(1)}, {"k": jax.random.key(2)})
  assert autotuning.measure.check_close({"k": jax.random.key(1)}, {"k": jax.random.key(1)}) is None
  assert "PRNG keys" in autotuning.measure.check_close(
      [jax.random.key(1)], [jax.random.key_data(jax.random.key(1))])


@pytest.mark.parametrize("heuristics_ms, together", [(2.0, True), (1.005, False)])
def test_calls_within_noise_alone_are_kept_where_they_help_together(monkeypatch, heuristics_ms,
                                                                    together):
  # Each call gains 0.5% of the program (within TIE_RELATIVE), both together 50%: left
  # out one at a time neither "helps", and kept() threw away the program's whole gain.
  # With every changed call weak, the program without them all is the heuristic one.
  result, entries = _every_call_tuned(two_calls)
  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", lambda programs, *a, **k: {
      "heuristics": _ok(heuristics_ms), "tuned": _ok(1.0), 0: _ok(1.005), 1: _ok(1.005)})
  check = autotuning.check_in_program(result, two_calls, *_inputs())
  assert [(c.helps, c.together, c.others_together) for c in check.calls] == [
      (together, _ok(heuristics_ms), 1)] * 2
  says = "they help together" if together else "kept() keeps the heuristic"
  assert all(line.endswith(f"not faster beyond noise alone; without it and the 1 other such call"
                           f" {in_program.format_time(heuristics_ms * 1e-3)}: {says}")
             for line in check.lines()[1:]), check.lines()
  kept = {e.key: e.best_config for e in check.kept()}
  assert kept == {e.key: e.best_config if together else e.heuristic_config for e in entries}


def test_a_call_that_slows_the_program_is_not_kept_by_the_others_gain(monkeypatch):
  # Calls 1 and 2 gain together; call 0 slows the program beyond noise (faster without
  # it): judged with the weak calls, the group's gain kept it too.
  result, entries = _every_call_tuned(three_calls)

  def fake_measure(programs, margs, **kwargs):
    if "together" in programs:
      return {"together": _ok(1.5), "tuned": _ok(1.0)}
    return {"heuristics": _ok(2.0), "tuned": _ok(1.0), 0: _ok(0.8), 1: _ok(1.005), 2: _ok(1.005)}

  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", fake_measure)
  check = autotuning.check_in_program(result, three_calls, *_inputs())
  assert [(c.helps, c.others_together) for c in check.calls] == [(False, 0), (True, 1),
                                                                 (True, 1)]
  kept = {e.key: e.best_config for e in check.kept()}
  assert kept == {entries[0].key: entries[0].heuristic_config,
                  **{e.key: e.best_config for e in entries[1:]}}


@pytest.mark.parametrize("together_ms", [1.5, 1.004])
def test_the_weak_calls_are_timed_together_beside_one_that_helps(monkeypatch, together_ms):
  # Call 0 helps alone; calls 1 and 2 do not: the program with both of them at their
  # heuristics (call 0 tuned) is timed against the tuned one, in rounds of its own that
  # reuse the tuned program's executable.
  result, entries = _every_call_tuned(three_calls)
  measured, caches = [], []

  def fake_measure(programs, margs, **kwargs):
    measured.append({name: str(jax.make_jaxpr(fn)(*margs)) for name, fn in programs.items()})
    caches.append(kwargs["compile_cache"])
    if "together" in programs:
      return {"together": _ok(together_ms), "tuned": _ok(1.0)}
    return {"heuristics": _ok(2.0), "tuned": _ok(1.0), 0: _ok(1.5), 1: _ok(1.005), 2: _ok(1.005)}

  monkeypatch.setattr(in_program.measure_lib, "measure_candidates", fake_measure)
  check = autotuning.check_in_program(result, three_calls, *_inputs())
  first, second = measured
  assert sorted(second) == ["together", "tuned"] and caches[0] is caches[1]
  assert second["tuned"] == first["tuned"]
  weak_at_heuristics = [entries[0]] + [dataclasses.replace(e, best_config=e.heuristic_config)
                                       for e in entries[1:]]
  with autotuning.AutotuningResult(result.device_kind, {e.key: e for e in weak_at_heuristics}):
    assert second["together"] == str(jax.make_jaxpr(lambda a: three_calls(*a))(list(_inputs())))
  helps = together_ms == 1.5
  assert [(c.helps, c.together) for c in check.calls] == [
      (True, None), (helps, _ok(together_ms)), (helps, _ok(together_ms))]
  assert check.lines()[1].endswith("; helps")
  # The verdict's two times are shown: the tuned program's from the same rounds.
  assert all(c.tuned_together == _ok(1.0) for c in check.calls[1:])
  says = "they help together" if helps else "kept() keeps the heuristic"
  assert check.lines()[2].endswith(f"(tuned 1.000 ms in the same rounds): {says}"), check.lines()
  kept = {e.key: e.best_config for e in check.kept()}
  assert kept == {e.key: e.best_config if i == 0 or helps else e.heuristic_config
                  for i, e in enumerate(entries)}
