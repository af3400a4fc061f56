"""Ops as a user writes them (README: "Your own kernel"): pytree arguments, outputs and
residuals, static options in any form `specs.to_spec` records, each on every path (a
traced call, an eager one, tuning)."""

import dataclasses
import enum
import json
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning


@stellarax.config_dataclass
class _Config:
  unroll: int = 1


class _Tunable:
  """Heuristic and a two-config space, for every op here."""

  config_cls = _Config

  def _get_heuristics_config(self, ba):
    return _Config()

  def _get_autotuning_configs(self, ba):
    return {_Config(unroll=1), _Config(unroll=2)}


class AffineVjpBase(stellarax.Op):
  def _fwd(self, residuals, out, dout, x, params, *, config):
    raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class AffineVjp(_Tunable, AffineVjpBase, name="test_user_ops.affine_vjp"):
  """Gradients from dict residuals (the input, kept by the forward)."""

  def _fwd(self, residuals, out, dout, x, params, *, config):
    return {"x": dout @ params["w"].T,
            "params": {"w": residuals["x"].T @ dout, "b": dout.sum(0)}}

  def _reference(self, residuals, out, dout, x, params):
    _, pullback = jax.vjp(lambda x, p: x @ p["w"] + p["b"][None], x, params)
    dx, dparams = pullback(dout)
    return {"x": dx, "params": dparams}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Affine(_Tunable, stellarax.Op, name="test_user_ops.affine"):
  """x @ w + b, with the weights in a dict argument and dict residuals."""

  vjp_cls = AffineVjp

  def _fwd(self, x, params, *, config):
    return x @ params["w"] + params["b"][None], {"x": x}

  def _reference(self, x, params):
    return x @ params["w"] + params["b"][None]


def test_dict_arguments_and_residuals_are_tuned():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (4, 8))
  params = {"w": jax.random.normal(keys[1], (8, 2)), "b": jax.random.normal(keys[2], (2,))}
  loss = lambda x, p: jnp.sum(jnp.sin(Affine()(x, p)))
  want = jax.grad(lambda x, p: jnp.sum(jnp.sin(x @ p["w"] + p["b"][None])), argnums=(0, 1))(x, params)
  grads = jax.grad(loss, argnums=(0, 1))(x, params)
  for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  ba = Affine.bind(x, params)
  assert len(ba.array_specs()) == 3 and set(ba.example_values()["params"]) == {"b", "w"}
  result = stellarax.Autotuner(budget_s=1, progress=False).autotune(
      jax.grad(loss, argnums=(0, 1)), x, params)
  assert sorted(e.bound_args.op.name for e in result) == ["test_user_ops.affine",
                                                          "test_user_ops.affine_vjp"]
  assert all(e.num_failed == 0 for e in result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrozenBiasVjp(_Tunable, AffineVjpBase, name="test_user_ops.frozen_bias_vjp"):
  """None in a pytree gradient, for a leaf ("c") and for a subtree ("b")."""

  def _fwd(self, residuals, out, dout, x, params, *, config):
    return {"x": dout @ params["w"].T,
            "params": {"w": residuals["x"].T @ dout, "b": None, "c": None}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrozenBias(_Tunable, stellarax.Op, name="test_user_ops.frozen_bias"):
  vjp_cls = FrozenBiasVjp

  def _fwd(self, x, params, *, config):
    return x @ params["w"] + params["b"]["v"][None] * params["c"], {"x": x}


def test_a_none_leaf_or_subtree_in_a_pytree_gradient_is_a_zero_as_in_custom_vjp():
  # It was refused: "VJP op returned 1 gradient leaves for 'params', expected 2."
  x = jax.random.normal(jax.random.key(0), (4, 8))
  params = {"w": jax.random.normal(jax.random.key(1), (8, 2)), "b": {"v": jnp.ones((2,))},
            "c": jnp.float32(0.5)}
  dx, dparams = jax.grad(lambda x, p: jnp.sum(FrozenBias()(x, p) ** 2), argnums=(0, 1))(x, params)
  y = x @ params["w"] + 0.5
  np.testing.assert_allclose(dparams["w"], x.T @ (2 * y), rtol=1e-5)
  np.testing.assert_array_equal(dparams["b"]["v"], jnp.zeros(2))
  assert dparams["c"] == 0
  np.testing.assert_allclose(dx, (2 * y) @ params["w"].T, rtol=1e-5)


class Mode(enum.Enum):
  DOUBLE = 2
  TRIPLE = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scale(_Tunable, stellarax.Op, name="test_user_ops.scale"):
  """x * factor[mode] + sum(offsets); records what its _fwd was given."""

  seen = []  # (mode, offsets, factor) of every _fwd trace

  def _fwd(self, x, mode=Mode.DOUBLE, offsets=(0,), factor=1, *, config):
    Scale.seen.append((mode, offsets, factor))
    return x * {"DOUBLE": 2, "TRIPLE": 3}[mode] * factor + sum(offsets), None

  def _reference(self, x, mode=Mode.DOUBLE, offsets=(0,), factor=1):
    return x * {"DOUBLE": 2, "TRIPLE": 3}[mode] * factor + sum(offsets)


@stellarax.config_dataclass
class _ModeConfig:
  mode: Mode = Mode.DOUBLE
  modes: tuple[Mode, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByMode(stellarax.Op, name="test_user_ops.by_mode"):
  """x * config.mode.value * self.base.value: enums in a config and in a field."""

  config_cls = _ModeConfig
  base: object = Mode.DOUBLE  # an annotation that names no enum: the default does

  def _fwd(self, x, *, config):
    return x * config.mode.value * self.base.value * len(config.modes or (1,)), None

  def _get_heuristics_config(self, ba):
    return _ModeConfig()

  def _get_autotuning_configs(self, ba):
    return {_ModeConfig(), _ModeConfig(mode=Mode.TRIPLE, modes=(Mode.TRIPLE,))}


class Level(enum.IntEnum):
  LOW = 1
  HIGH = 2


class Act(enum.StrEnum):
  GELU = "gelu"
  RELU = "relu"


@stellarax.config_dataclass
class _MixedConfig:
  level: Level = Level.LOW  # an IntEnum: recorded as its value, as an int would be
  act: str = Act.GELU  # a StrEnum: recorded as its value, equal to it
  name_or_mode: str | Mode = "DOUBLE"
  modes: list[Mode] | None = None


def test_mixin_enums_are_recorded_by_value_and_every_enum_comes_back():
  from stellarax.core.config import config_from_json, config_to_json
  config = _MixedConfig(level=Level.HIGH, act=Act.RELU, name_or_mode=Mode.TRIPLE,
                        modes=(Mode.TRIPLE,))
  data = config_to_json(config)
  assert data == {"level": 2, "act": "relu", "name_or_mode": "TRIPLE", "modes": ["TRIPLE"]}
  again = config_from_json(_MixedConfig, data)
  assert again == config and again.level is Level.HIGH and again.name_or_mode is Mode.TRIPLE
  assert again.modes == (Mode.TRIPLE,)
  # A StrEnum static argument reaches the op as its value, which it equals.
  from stellarax.core import specs
  assert specs.to_spec(Act.GELU) == "gelu" and specs.to_spec(Mode.TRIPLE) == "TRIPLE"


def test_enums_in_configs_and_op_fields_survive_a_save_and_load():
  # Recorded by name, they came back as strings: a loaded result's config crashed the
  # program (AttributeError: 'str' object has no attribute 'value'), and bound arguments
  # read from JSON were another op.
  from stellarax.core.bound_args import BoundArguments
  x = jnp.ones((4,))
  op = ByMode(base=Mode.TRIPLE)
  tuned = _ModeConfig(mode=Mode.TRIPLE, modes=(Mode.TRIPLE,))
  ba = op.bind(x)
  entry = autotuning.Entry(ba, tuned, ba.heuristics_config, ())
  loaded = autotuning.AutotuningResult.loads(
      autotuning.AutotuningResult(jax.devices()[0].device_kind, {entry.key: entry}).dumps())
  (again,) = loaded
  assert again.best_config == tuned and again.bound_args.op == op
  assert BoundArguments.from_json(json.loads(ba.to_marker())) == ba
  with loaded:
    np.testing.assert_array_equal(jax.jit(op)(x), x * 9)


class _TupleConfig(typing.NamedTuple):
  chunk: int = 1
  mode: Mode = Mode.DOUBLE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunked(stellarax.Op, name="test_user_ops.chunked"):
  """x * mode, in `chunk` pieces: a named tuple for a config."""

  config_cls = _TupleConfig

  def _fwd(self, x, *, config):
    pieces = jnp.split(x, config.chunk)
    return jnp.concatenate([p * config.mode.value for p in pieces]), None

  def _reference(self, x):
    return x * 2

  def _get_heuristics_config(self, ba):
    return _TupleConfig()

  def _get_autotuning_configs(self, ba):
    return {_TupleConfig(chunk=c) for c in (1, 2, 4)}


def test_a_named_tuple_is_a_config_class_and_a_plain_tuple_is_refused():
  # A named tuple ran untuned, then failed once tuned: results could not record it.
  x = jnp.arange(8.0)
  result = stellarax.Autotuner(budget_s=1, progress=False).autotune(lambda x: Chunked()(x), x)
  (entry,) = autotuning.AutotuningResult.loads(result.dumps())
  assert entry == next(iter(result)) and isinstance(entry.best_config, _TupleConfig)
  assert json.loads(result.dumps())["entries"][0]["heuristic_config"] == {"chunk": 1,
                                                                         "mode": "DOUBLE"}
  with result:
    np.testing.assert_array_equal(jax.jit(Chunked())(x), 2 * x)
  with pytest.raises(TypeError, match="config_cls=<class 'tuple'>: an op's config class must"):
    class Positional(Chunked, name="test_user_ops.positional"):  # pylint: disable=unused-variable
      config_cls = tuple


def test_static_arguments_reach_the_op_as_recorded_on_every_path():
  # Tuning has only the recorded values (enum names, tuples), so a traced call and an
  # eager one get those too: one code path, the one tuning measured.
  x, op = jnp.ones((4,)), Scale()
  Scale.seen.clear()
  eager = op(x, Mode.TRIPLE, [1, 2])
  traced = jax.jit(lambda x: op(x, Mode.TRIPLE, [1, 2]))(x)
  stellarax.Autotuner(budget_s=0.5, progress=False).autotune(lambda x: op(x, Mode.TRIPLE, [1, 2]), x)
  np.testing.assert_array_equal(eager, traced)
  np.testing.assert_array_equal(eager, jnp.full((4,), 6.0))
  assert {(mode, offsets) for mode, offsets, _ in Scale.seen} == {("TRIPLE", (1, 2))}


def test_eager_calls_that_differ_only_in_a_value_s_type_are_not_confused():
  # 1, 1.0 and True are equal in Python and hash alike; their results' dtypes differ.
  x, op = jnp.arange(4, dtype=jnp.int32), Scale()
  for factor in (1, 1.0, True):
    assert op(x, factor=factor).dtype == jax.jit(lambda x: op(x, factor=factor))(x).dtype
  assert op(x, factor=1.0).dtype == jnp.float32 and op(x, factor=1).dtype == jnp.int32


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gain(_Tunable, stellarax.Op, name="test_user_ops.gain"):
  """x * gain, with the gain a field of the op."""

  gain: int | float | bool = 1

  def _fwd(self, x, *, config):
    return x * self.gain, None

  def _reference(self, x):
    return x * self.gain


def test_calls_that_differ_only_in_a_value_s_type_are_two_calls_to_tune():
  # factor=3 and factor=3.0 were one call to capture and tune (equal bound arguments),
  # stored under two keys: the other ran untuned, and under the "error" policy raised.
  x, op = jnp.ones((4,)), Scale()
  f = lambda x: op(x, factor=3) + op(x, factor=3.0) + op(x, factor=True)
  calls = autotuning.get_bound_args(f, x)
  assert len(calls) == len(set(calls)) == 3
  result = stellarax.Autotuner(budget_s=0.5, progress=False).autotune(f, x)
  assert len(result) == 3
  with result, autotuning.miss_policy_scope("error"):
    np.testing.assert_array_equal(jax.jit(f)(x), jnp.full((4,), 14.0))


def test_eager_calls_of_ops_that_differ_only_in_a_field_s_type_are_not_confused():
  # Gain(gain=1) == Gain(gain=1.0): the eager call's cache is keyed by the fields' types too.
  x = jnp.arange(4, dtype=jnp.int32)
  for gain in (1, 1.0, True, 1):
    assert Gain(gain=gain)(x).dtype == jax.jit(lambda x: Gain(gain=gain)(x))(x).dtype
  assert Gain(gain=1.0)(x).dtype == jnp.float32 and Gain(gain=1)(x).dtype == jnp.int32


def test_types_of_sees_through_containers_and_dataclasses():
  from stellarax.core.specs import types_of
  assert types_of((1, [2.0], {"a": True})) == types_of((3, [4.0], {"a": False}))
  assert types_of((1, [2.0])) != types_of((1, [2]))
  assert types_of({"a": 1}) != types_of({"a": True})
  assert types_of(Gain(gain=1)) != types_of(Gain(gain=1.0))
  assert types_of(Gain(gain=2)) == types_of(Gain(gain=3))


class PairVjpBase(stellarax.Op):
  def _fwd(self, residuals, out, dout, x, *, config):
    raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairVjp(_Tunable, PairVjpBase, name="test_user_ops.pair_vjp"):
  def _fwd(self, residuals, out, dout, x, *, config):
    return {"x": 2 * dout[0] + 3 * dout[1]}

  def _reference(self, residuals, out, dout, x):
    return {"x": 2 * dout[0] + 3 * dout[1]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pair(_Tunable, stellarax.Op, name="test_user_ops.pair"):
  """A tuple output: (2 x, 3 x)."""

  vjp_cls = PairVjp

  def _fwd(self, x, *, config):
    return (2 * x, 3 * x), None

  def _reference(self, x):
    return (2 * x, 3 * x)


def test_the_backward_of_a_forward_with_a_tuple_output_is_tuned():
  x = jax.random.normal(jax.random.key(1), (4, 4))
  loss = lambda x: sum(jnp.sum(o ** 2) for o in Pair()(x))
  np.testing.assert_allclose(jax.grad(loss)(x), 26 * x, rtol=1e-6)
  result = stellarax.Autotuner(budget_s=1, progress=False).autotune(jax.grad(loss), x)
  assert sorted(e.bound_args.op.name for e in result) == ["test_user_ops.pair",
                                                          "test_user_ops.pair_vjp"]
  assert all(e.num_failed == 0 for e in result)


def test_the_summary_tells_calls_apart_by_their_options():
  x = jnp.ones((8, 4))
  result = stellarax.Autotuner(budget_s=0.5, progress=False).autotune(
      lambda x: Scale()(x) + Scale()(x, Mode.TRIPLE) + Scale()(x, offsets=[1]), x)
  rows = result.summary().splitlines()[2:]
  assert len(rows) == 3 and len({row.split("  ")[1] for row in rows}) == 3
  assert any("mode='TRIPLE'" in row for row in rows) and any("offsets=(1,)" in row for row in rows)
  assert not any("factor=" in row for row in rows)  # the default is left out
  assert autotuning.AutotuningResult.loads(result.dumps()).summary() == result.summary()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Narrowing(_Tunable, stellarax.Op, name="test_user_ops.narrowing"):
  """A config (unroll=2) that returns float16 where the op returns float32: close to the
  float32 reference, but it would change the program's types under `with result:`."""

  def _fwd(self, x, *, config):
    out = x * 2
    return (out.astype(jnp.float16) if config.unroll == 2 else out), None

  def _reference(self, x):
    return x * 2


def test_a_config_that_changes_the_output_dtype_is_never_chosen():
  x = jax.random.normal(jax.random.key(2), (16, 16))
  tuner = stellarax.Autotuner(strategy="exhaustive", progress=False)
  (entry,) = tuner.autotune([Narrowing.bind(x)])
  measured = dict(entry.measurements)
  assert measured[_Config(unroll=2)].status == "wrong_result"
  assert "float16" in measured[_Config(unroll=2)].error and entry.best_config == _Config(unroll=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Labelled(_Tunable, stellarax.Op, name="test_user_ops.labelled"):
  """x times a string option's length: the option is all its calls' keys differ by."""

  def _fwd(self, x, *, label: str = "a", config):
    return x * len(label), None

  def _reference(self, x, *, label="a"):
    return x * len(label)


@pytest.mark.parametrize("label", ["plain", "café", "back\\slash", 'say "hi"', "tab\there"])
def test_string_options_with_escapes_are_captured_and_their_results_apply(label):
  # MLIR prints a backslash of the marker's JSON as two: capture read "café" back as
  # "caf\\u00e9" and a backslash doubled (the tuned entry never applied: a transfer),
  # and a quote's escape made autotune raise a JSONDecodeError.
  from stellarax.core import markers
  op, x = Labelled(), jnp.ones((4, 4))
  f = lambda x: op(x, label=label)
  assert markers.find_markers(jax.jit(f).lower(x).as_text()) == [op.bind(x, label=label).to_marker()]
  result = stellarax.Autotuner(progress=False, measure_options=autotuning.MeasureOptions(
      rounds=2, leader_rounds=0, warmup_s=0.0, max_total_s=0.2, min_batch_s=2e-4)).autotune(f, x)
  (entry,) = result
  assert entry.bound_args.arguments["label"] == label
  with result:
    assert autotuning.explain(op.bind(x, label=label)).source == "result"


def test_an_op_without_a_vjp_op_is_captured_under_grad():
  # JAX differentiates its implementation, whose config decides both passes; the
  # marker was dropped from what JAX derived, so where the gradient needs nothing of the
  # forward (a linear use: JAX removes the forward), autotune of a gradient (a training
  # step) found no call of the op.
  x = jnp.arange(12.0).reshape(3, 4)
  for loss, grad in ((lambda x: jnp.sum(Scale()(x) * 4), 8 * jnp.ones_like(x)),
                     (lambda x: jnp.sum(Scale()(x) ** 2), 8 * x)):
    (ba,) = autotuning.get_bound_args(jax.grad(loss), x)
    assert ba.op.name == "test_user_ops.scale" and ba.arguments["x"].shape == (3, 4)
    np.testing.assert_allclose(jax.grad(loss)(x), grad)
