"""The Op framework: bind, BoundArguments, resolution, markers, capture."""

import dataclasses
import functools
import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.core import resolution
from stellarax.core.config import NoConfig
from stellarax.core.bound_args import BoundArguments
from stellarax.core.specs import ArraySpec
from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig


def _ragged_inputs(m=48, k=16, n=8, sizes=(10, 0, 30, 5)):
  keys = jax.random.split(jax.random.key(1), 2)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32)
  rhs = jax.random.normal(keys[1], (len(sizes), k, n), jnp.float32)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def test_bind_on_class_and_instance_agree():
  lhs, rhs, gs = _ragged_inputs()
  a = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  b = stellarax.XlaRaggedDot().bind(lhs, rhs, group_sizes=gs)
  assert a == b and hash(a) == hash(b)
  assert a.arguments["lhs"] == ArraySpec((48, 16), "float32")
  assert a.heuristics_config in a.autotuning_configs
  assert a.default_config == a.heuristics_config


def test_bind_keys_numpy_arrays_by_the_dtypes_jax_computes_in():
  # NumPy's int64 group sizes were keyed int64, the program's call int32: a result tuned
  # from the bound call did not apply to the program.
  lhs, rhs, gs = (np.asarray(a) for a in _ragged_inputs())
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs.astype(np.int64))
  (in_program,) = autotuning.get_bound_args(
      lambda l, r, g: stellarax.ragged_dot(l, r, g, implementation="xla"),
      lhs, rhs, gs.astype(np.int64))
  assert ba.arguments["group_sizes"].dtype == "int32" and ba == in_program
  assert ArraySpec.of(jax.ShapeDtypeStruct((2,), np.float64)).dtype == "float32"


def test_bind_rejects_bad_shapes_with_a_clear_message():
  lhs, rhs, gs = _ragged_inputs()
  with pytest.raises(ValueError, match="must agree on K"):
    stellarax.XlaRaggedDot.bind(lhs[:, :3], rhs, gs)
  with pytest.raises(TypeError, match="integer"):
    stellarax.XlaRaggedDot.bind(lhs, rhs, gs.astype(jnp.float32))
  with pytest.raises(TypeError, match="unexpected keyword"):
    stellarax.XlaRaggedDot.bind(lhs, rhs, gs, bogus=1)


def test_config_from_json_checks_plain_field_types():
  from stellarax.core.config import config_from_json
  assert config_from_json(XlaRaggedDotConfig, {"strategy": "tiled", "tile_m": 32}).tile_m == 32
  for bad in ({"tile_m": "32"}, {"tile_m": 32.0}, {"tile_m": True}, {"strategy": 1}):
    with pytest.raises(ValueError, match=r"XlaRaggedDotConfig\.\w+=.* the field takes"):
      config_from_json(XlaRaggedDotConfig, {"strategy": "tiled", "tile_m": 32, **bad})


def test_config_is_validated_at_construction():
  with pytest.raises(ValueError, match="tile_m=12 must be a power of two"):
    XlaRaggedDotConfig(strategy="tiled", tile_m=12)
  with pytest.raises(ValueError, match="strategy='nope' must be one of"):
    XlaRaggedDotConfig(strategy="nope")
  with pytest.raises(TypeError, match="expects a XlaRaggedDotConfig"):
    stellarax.XlaRaggedDot(config="tiled")


def test_bound_args_json_round_trip_has_no_import_paths():
  lhs, rhs, gs = _ragged_inputs()
  bas = [stellarax.XlaRaggedDot.bind(lhs, rhs, gs, precision="highest"),
         stellarax.XlaChunkedAttention.bind(*(jnp.ones((1, 8, 2, 4)),) * 3, is_causal=True)]
  text = autotuning.bound_args_to_json(bas)
  assert "stellarax." not in text and "<class" not in text
  assert autotuning.bound_args_from_json(text) == bas


def test_bound_args_from_json_reads_a_path(tmp_path):
  lhs, rhs, gs = _ragged_inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  path = tmp_path / "ba.json"
  autotuning.bound_args_to_json([ba], path)
  assert autotuning.bound_args_from_json(str(path)) == [ba]
  with pytest.raises(ValueError, match="not valid JSON"):
    autotuning.bound_args_from_json("[{oops")
  # A results file where bound arguments belong: the error says what it is instead.
  result = autotuning.AutotuningResult(jax.devices()[0].device_kind)
  with pytest.raises(ValueError, match=r"got an autotuning result .*AutotuningResult.load"):
    autotuning.bound_args_from_json(result.dumps())
  with pytest.raises(ValueError, match="got a JSON object"):
    autotuning.bound_args_from_json('{"call": 1}')
  # It said "a JSON int" of the file, an object, and "a JSON NoneType" of null.
  with pytest.raises(ValueError, match="its 'calls' must be a JSON list .*got a JSON number"):
    autotuning.bound_args_from_json('{"calls": 5}')
  (tmp_path / "null.json").write_text("null")
  with pytest.raises(ValueError, match="got null"):
    autotuning.bound_args_from_json(str(tmp_path / "null.json"))
  # An unknown op's name came quoted twice (a KeyError's str).
  data = ba.to_json()
  data["op"]["name"] = "ragged_dot.nonesuch"
  with pytest.raises(ValueError) as raised:
    autotuning.bound_args_from_json(json.dumps([data]))
  assert "item 0: \"" not in str(raised.value) and "ragged_dot.nonesuch" in str(raised.value)


@pytest.mark.parametrize("change, complaint", [
    (lambda d: d.update(vmap_axes=[[3, [True]]]), r"flags \[True\] are not 3 bools"),
    (lambda d: d.update(vmap_axes=[[-2, [True, False, False]]]), "size -2 is not an int >= 0"),
    (lambda d: d.update(vmap_axes=[[2.5, [True, False, False]]]), "size 2.5 is not an int"),
    (lambda d: d.update(vmap_axes={"3": True}), "not a list"),
    (lambda d: d["arguments"]["lhs"].update(shape=[48.7, 16]), "shape must hold ints"),
    (lambda d: d["arguments"]["lhs"].update(shape=[True, 16]), "shape must hold ints")])
def test_bound_args_from_json_says_what_is_wrong_with_a_call(change, complaint):
  lhs, rhs, gs = _ragged_inputs()
  data = json.loads(autotuning.bound_args_to_json([
      stellarax.XlaRaggedDot.bind(lhs, rhs, gs).with_outer_vmap(3, (True, False, False))]))
  assert autotuning.bound_args_from_json(json.dumps(data))[0].vmap_axes == ((3, (True, False, False)),)
  change(data[0] if isinstance(data, list) else data["calls"][0])
  with pytest.raises(ValueError, match=complaint):
    autotuning.bound_args_from_json(json.dumps(data))


def test_op_call_matches_jax_and_differentiates():
  lhs, rhs, gs = _ragged_inputs()
  out = stellarax.ragged_dot(lhs, rhs, gs)
  np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, gs), rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda l, r: (f(l, r, gs) ** 2).sum()
  ours = jax.grad(loss(stellarax.ragged_dot), argnums=(0, 1))(lhs, rhs)
  theirs = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_resolution_order_explicit_beats_result_beats_heuristics():
  lhs, rhs, gs = _ragged_inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  tuned = XlaRaggedDotConfig(strategy="tiled", tile_m=16)
  pinned = XlaRaggedDotConfig(strategy="masked")
  result = _result_with(ba, tuned)
  assert resolution.resolve_config(ba).source == "heuristics"
  with result:
    r = resolution.resolve_config(ba)
    assert (r.config, r.source) == (tuned, "result")
    assert resolution.resolve_config(ba.with_config(pinned)).config == pinned
    inner = _result_with(ba, XlaRaggedDotConfig(strategy="tiled", tile_m=32))
    with inner:
      assert resolution.resolve_config(ba).config.tile_m == 32
    assert resolution.resolve_config(ba).config == tuned
  assert resolution.resolve_config(ba).source == "heuristics"


def test_miss_policy_error_names_the_op():
  lhs, rhs, gs = _ragged_inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  with resolution.miss_policy_scope("error"):
    with pytest.raises(resolution.ConfigMissError, match="ragged_dot.xla"):
      resolution.resolve_config(ba)
    # explain, which the error points to, explains instead of raising.
    explained = autotuning.explain(ba)
    assert explained.source == "miss:error" and explained.config == ba.heuristics_config
    assert "the call raises ConfigMissError" in str(explained)
  with resolution.miss_policy_scope("autotune"):  # nor does it tune
    assert autotuning.explain(ba).source == "miss:autotune"
  with pytest.raises(ValueError, match="must be one of"):
    with resolution.miss_policy_scope("sometimes"):
      pass


def test_result_applies_inside_jit_traced_in_the_context():
  lhs, rhs, gs = _ragged_inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  result = _result_with(ba, XlaRaggedDotConfig(strategy="tiled", tile_m=16))
  seen = []
  original = stellarax.XlaRaggedDot._fwd

  def spy(self, *a, config, **k):
    seen.append(config)
    return original(self, *a, config=config, **k)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(stellarax.XlaRaggedDot, "_fwd", spy)
    with result:
      jax.jit(lambda l, r: stellarax.ragged_dot(l, r, gs))(lhs, rhs)
  assert seen[-1] == XlaRaggedDotConfig(strategy="tiled", tile_m=16)


def _model(lhs, rhs, gs, x):
  y = stellarax.ragged_dot(lhs, rhs, gs)
  return (stellarax.rms_norm(y, None) ** 2).sum() + stellarax.dot_product_attention(x, x, x).sum()


def test_get_bound_args_finds_forward_and_vjp_ops_through_transforms():
  lhs, rhs, gs = _ragged_inputs()
  x = jnp.ones((1, 8, 2, 4))
  fwd = autotuning.get_bound_args(_model, lhs, rhs, gs, x)
  assert {ba.op.name for ba in fwd} == {"ragged_dot.xla", "layer_norm.xla", "attention.xla_chunked"}
  grad = autotuning.get_bound_args(jax.grad(_model, argnums=(0, 1, 3)), lhs, rhs, gs, x)
  names = {ba.op.name for ba in grad}
  assert {"ragged_dot.xla_vjp", "layer_norm.xla_vjp", "attention.xla_vjp"} <= names
  closure = functools.partial(jax.grad(_model), lhs, rhs, gs, x)
  assert set(autotuning.get_bound_args(closure)) == set(
      autotuning.get_bound_args(jax.jit(jax.grad(_model)), lhs, rhs, gs, x))
  remat = autotuning.get_bound_args(jax.grad(jax.checkpoint(_model)), lhs, rhs, gs, x)
  assert {"ragged_dot.xla", "ragged_dot.xla_vjp"} <= {ba.op.name for ba in remat}
  lowered = jax.jit(_model).lower(lhs, rhs, gs, x)
  assert set(autotuning.get_bound_args(lowered)) == set(fwd)


def test_vmap_axes_are_recorded_in_the_key():
  lhs, rhs, gs = _ragged_inputs()
  f = lambda l: stellarax.ragged_dot(l, rhs, gs)
  batched = jnp.stack([lhs, 2 * lhs, 3 * lhs])
  (ba,) = autotuning.get_bound_args(jax.vmap(f), batched)
  assert ba.vmap_axes == ((3, (False, True, False)),)  # leaves: group_sizes, lhs, rhs
  assert ba.batched_array_specs()[1].shape == (3, 48, 16)
  assert ba.key_json() != stellarax.XlaRaggedDot.bind(lhs, rhs, gs).key_json()
  np.testing.assert_allclose(jax.vmap(f)(batched)[2], 3 * f(lhs), rtol=1e-5, atol=1e-4)
  assert BoundArguments.from_json(json.loads(ba.to_marker())) == ba


def test_nested_vmaps_are_recorded_innermost_first():
  """vmap of vmap, of sizes 2 (outer, over lhs) and 3 (inner, over lhs and rhs): the
  recorded levels and the batched shapes follow the order the call sees them in."""
  lhs, rhs, gs = _ragged_inputs()
  f = lambda l, r: stellarax.ragged_dot(l, r, gs)
  lhs_b = jnp.stack([jnp.stack([lhs * (i + j + 1) for j in range(3)]) for i in range(2)])
  rhs_b = jnp.stack([rhs * (j + 1) for j in range(3)])
  program = jax.vmap(jax.vmap(f), in_axes=(0, None))
  (ba,) = autotuning.get_bound_args(program, lhs_b, rhs_b)
  assert ba.vmap_axes == ((3, (False, True, True)), (2, (False, True, False)))
  assert [s.shape for s in ba.batched_array_specs()[1:]] == [(2, 3, *lhs.shape), (3, *rhs.shape)]


def test_an_eager_call_chooses_and_binds_once_per_shapes_and_static_arguments(monkeypatch):
  from stellarax.core import dispatch
  chosen = []
  choose = dispatch._call_family
  monkeypatch.setattr(dispatch, "_call_family", lambda *a: chosen.append(a[0]) or choose(*a))
  x = jax.random.normal(jax.random.key(0), (7, 33))  # shapes no other test calls with
  scale = jnp.arange(33, dtype=jnp.float32)
  expected = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale[None]
  for _ in range(3):
    np.testing.assert_allclose(stellarax.rms_norm(x, scale), expected, rtol=1e-5, atol=1e-5)
  assert len(chosen) == 1  # one trace of the whole call, then JAX's cache
  stellarax.rms_norm(x, scale, epsilon=1e-5)  # another static argument
  stellarax.rms_norm(x[:5], scale)  # other shapes
  stellarax.rms_norm(x, scale, epsilon=1e-5)
  assert len(chosen) == 3
  # An op instance as the implementation: once per op (equal ops alike), as a name is.
  for _ in range(2):
    stellarax.rms_norm(x, scale, implementation=stellarax.XlaLayerNorm())
    stellarax.rms_norm(x, scale, implementation=[stellarax.XlaLayerNorm(), "xla"])
  assert len(chosen) == 5


def test_an_op_called_eagerly_binds_once_per_shapes_and_static_arguments(monkeypatch):
  bound = []
  bind = stellarax.Op._bind_values
  monkeypatch.setattr(stellarax.Op, "_bind_values", lambda self, *a, **k: bound.append(self) or bind(self, *a, **k))
  lhs, rhs = jax.random.normal(jax.random.key(3), (9, 5)), jax.random.normal(jax.random.key(4), (3, 5, 6))
  gs = jnp.array([4, 0, 5], jnp.int32)
  for _ in range(3):
    np.testing.assert_allclose(stellarax.XlaRaggedDot()(lhs, rhs, gs), jax.lax.ragged_dot(lhs, rhs, gs),
                               rtol=1e-5, atol=1e-5)
  assert len(bound) == 1
  stellarax.XlaRaggedDot()(lhs[:7], rhs, gs - jnp.array([0, 0, 2]))  # other shapes
  assert len(bound) == 2


def test_an_eager_call_reads_an_array_given_as_a_static_option(monkeypatch):
  # `axis=np.array([1, 2])` works inside jit (the array is a constant there); eagerly it
  # was traced with the data and the call failed ("axis=JitTracer(int32[2]) must be an
  # int...") until 2026-12-06.
  x = jax.random.normal(jax.random.key(5), (3, 4, 5))
  scale = jnp.linspace(0.5, 1.5, 20).reshape(4, 5)
  want = stellarax.rms_norm(x, scale, axis=(1, 2))
  for axis in (np.array([1, 2]), jnp.array([1, 2]), [np.int32(1), jnp.array(2)]):
    np.testing.assert_array_equal(stellarax.rms_norm(x, scale, axis=axis), want)
    np.testing.assert_array_equal(stellarax.XlaLayerNorm()(x, scale, axis=axis, subtract_mean=False), want)
  # Arrays under the options that take them (sequence lengths) are still the jit's
  # arguments: other lengths of the same shapes reuse the traced call.
  from stellarax.core import dispatch
  chosen = []
  choose = dispatch._call_family
  monkeypatch.setattr(dispatch, "_call_family", lambda *a: chosen.append(a[0]) or choose(*a))
  q = jax.random.normal(jax.random.key(6), (2, 11, 2, 8))  # shapes no other test calls with
  for lengths in ([3, 11], [7, 1]):
    lengths = np.array(lengths, np.int32)
    np.testing.assert_allclose(
        stellarax.dot_product_attention(q, q, q, query_seq_lengths=lengths, key_value_seq_lengths=lengths),
        jax.nn.dot_product_attention(q, q, q, query_seq_lengths=lengths, key_value_seq_lengths=lengths),
        rtol=1e-5, atol=1e-5)
  assert len(chosen) == 1


def test_an_op_reads_a_static_option_given_as_an_array_as_its_values():
  # Binding read a static option's array as an array: the op's _fwd got it traced
  # (reading its value raised TracerArrayConversionError, eagerly and under jit alike),
  # and calls that differed only in it bound equal, sharing a tuning key. Ops of the
  # library read theirs in _canonicalize; one of a user's need not.
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Times(stellarax.Op, name="test_op.times_static.xla"):
    def _fwd(self, x, *, factors=1, config):
      return x * float(np.sum(factors)), None

    def _get_heuristics_config(self, ba):
      return NoConfig()

  x = jax.random.normal(jax.random.key(8), (2, 3))
  for factors in (np.array(2.0), np.array([1.0, 1.0]), jnp.array([2.0]), [np.float32(1), 1.0]):
    np.testing.assert_allclose(Times()(x, factors=factors), 2 * x, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x: Times()(x, factors=factors))(x), 2 * x, rtol=1e-6)
  assert Times.bind(x, factors=np.array([2.0, 3.0])).arguments["factors"] == (2.0, 3.0)
  assert Times.bind(x, factors=np.array([2.0])) != Times.bind(x, factors=np.array([3.0]))


def test_an_eager_call_with_bad_arguments_gets_no_note_on_where_kernels_run():
  # Eager calls jit the whole call, binding too: a plain argument error was given the
  # note for a kernel that cannot lower here, whose advice (interpret=True) fails alike.
  lhs, rhs, gs = _ragged_inputs()
  for named in ("pallas_triton", "xla"):
    with pytest.raises(ValueError, match="must agree on K") as raised:
      stellarax.ragged_dot(lhs[:, :5], rhs, gs, implementation=named)
    assert not [n for n in getattr(raised.value, "__notes__", []) if n.startswith("stellarax")]


def test_array_options_must_be_keyword_only_parameters():
  class Odd(stellarax.XlaLayerNorm):
    array_options = frozenset({"scale"})  # positional: always the jit's argument anyway
  with pytest.raises(TypeError, match=r"Odd.array_options names \['scale'\]"):
    Odd._static_options()
  assert stellarax.XlaLayerNorm._static_options() == {"axis", "epsilon", "subtract_mean"}
  from stellarax.ops.attention import base as attention_base
  assert stellarax.XlaAttention._static_options() == set(attention_base._STATIC)


def test_ops_run_under_disable_jit_as_they_do_jitted():
  # The eager ways go through a jit of the call; with jit disabled that jit would run the
  # call eagerly again, without end (a RecursionError until 2026-12-06).
  x = jax.random.normal(jax.random.key(1), (4, 16))
  scale = jnp.linspace(0.5, 1.5, 16)
  lhs, rhs = jnp.ones((8, 4)), jax.random.normal(jax.random.key(2), (2, 4, 3))
  gs = jnp.array([3, 5], jnp.int32)
  loss = lambda x: jnp.sum(stellarax.rms_norm(x, scale) ** 2)
  expected = (stellarax.rms_norm(x, scale), jax.grad(loss)(x),
              stellarax.ragged_dot(lhs, rhs, gs), stellarax.XlaRaggedDot()(lhs, rhs, gs))
  with jax.disable_jit():
    got = (stellarax.rms_norm(x, scale), jax.grad(loss)(x),
           stellarax.ragged_dot(lhs, rhs, gs), stellarax.XlaRaggedDot()(lhs, rhs, gs))
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_implementation_selection_and_errors():
  lhs, rhs, gs = _ragged_inputs()
  ref = jax.lax.ragged_dot(lhs, rhs, gs)
  for impl in ("xla", "ragged_dot.xla", stellarax.XlaRaggedDot(), ["xla"]):
    np.testing.assert_allclose(stellarax.ragged_dot(lhs, rhs, gs, implementation=impl), ref, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="no such implementation"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation="cuda_magic")
  with pytest.raises(ValueError, match=r"implementation=\[\] names no ragged_dot implementation"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation=[])
  with pytest.raises(ValueError, match="is not a ragged_dot op"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation=stellarax.XlaLayerNorm())
  # Names get the checks instances get (they raised TypeErrors about missing or
  # unexpected arguments of the op they named), and other types say what is taken.
  with pytest.raises(ValueError, match=r"'layer_norm.xla' is not a ragged_dot op; choose one"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation="layer_norm.xla")
  for vjp in ("xla_vjp", "ragged_dot.xla_vjp", ["xla_vjp", "xla"]):
    with pytest.raises(ValueError, match="is a backward \\(VJP\\) op; pass a forward ragged_dot"):
      stellarax.ragged_dot(lhs, rhs, gs, implementation=vjp)
  for bad in (3, {"xla"}):
    with pytest.raises(TypeError, match="must be None, a name, an Op or a list or tuple"):
      stellarax.ragged_dot(lhs, rhs, gs, implementation=bad)


def test_a_preference_list_passes_by_kernels_that_do_not_run_on_the_device():
  # The tests run on a CPU, where a Pallas kernel runs only in interpret mode: a list
  # moves on to the next entry instead of failing in JAX's lowering.
  assert jax.devices()[0].platform == "cpu"
  lhs, rhs, gs = _ragged_inputs()
  ref = jax.lax.ragged_dot(lhs, rhs, gs)
  out = stellarax.ragged_dot(lhs, rhs, gs, implementation=["pallas_triton", "pallas_mosaic_gpu", "xla"])
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  # Interpreting, it runs anywhere, so it is taken.
  op = stellarax.PallasTritonRaggedDot(interpret=True)
  with mock.patch.object(type(op), "_fwd", side_effect=AssertionError("the kernel ran")):
    with pytest.raises(AssertionError, match="the kernel ran"):
      stellarax.ragged_dot(lhs, rhs, gs, implementation=[op, "xla"])
  with pytest.raises(NotImplementedError, match=(
      r"ragged_dot.pallas_triton: does not run on the default device \(cpu\); pass an "
      r"instance with interpret=True to run its kernel here, or name it alone")):
    stellarax.ragged_dot(lhs, rhs, gs, implementation=["pallas_triton", "pallas_mosaic_gpu"])
  # A list of one is a list (it was tried as if named alone, and failed in JAX's lowering).
  with pytest.raises(NotImplementedError, match=r"pallas_triton: does not run on the default"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation=["pallas_triton"])


def test_a_kernel_named_alone_that_cannot_run_here_says_how_to_run_it():
  lhs, rhs, gs = _ragged_inputs()
  for named in ("pallas_triton", stellarax.PallasTritonRaggedDot()):  # a name or an instance
    with pytest.raises(ValueError) as raised:  # JAX's lowering refuses it on a CPU
      stellarax.ragged_dot(lhs, rhs, gs, implementation=named)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert ("stellarax: ragged_dot.pallas_triton does not run on the default device (cpu);"
            " pass PallasTritonRaggedDot(interpret=True)") in notes, named
    assert "['pallas_triton', 'xla']" in notes


def test_an_op_class_or_a_backward_op_as_implementation_is_refused_with_the_fix():
  lhs, rhs, gs = _ragged_inputs()
  with pytest.raises(TypeError, match=r"is an op class; pass an instance, e\.g\. "
                     r"implementation=XlaRaggedDot\(\)"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation=stellarax.XlaRaggedDot)
  with pytest.raises(TypeError, match="op class"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation=[stellarax.XlaRaggedDot])
  with pytest.raises(ValueError, match=r"XlaRaggedDotVjp\(config=None\) is a backward \(VJP\) op;"
                     r" pass a forward ragged_dot op"):
    stellarax.ragged_dot(lhs, rhs, gs, implementation=stellarax.XlaRaggedDotVjp())


def _result_with(ba, config):
  from stellarax.autotuning.measure import Measurement
  entry = autotuning.Entry(
      bound_args=ba, best_config=config, heuristic_config=ba.heuristics_config,
      measurements=((config, Measurement(status="ok", median_s=1e-3, ci_low_s=9e-4, ci_high_s=1.1e-3,
                                         num_samples=5, compile_time_s=0.1, error=None, method="test")),))
  return autotuning.AutotuningResult("cpu", {entry.key: entry})


def test_result_applies_to_a_function_traced_before_the_context():
  lhs, rhs, gs = _ragged_inputs()
  ba = stellarax.XlaRaggedDot.bind(lhs, rhs, gs)
  tuned = XlaRaggedDotConfig(strategy="tiled", tile_m=16)
  result = _result_with(ba, tuned)
  seen, traces = [], []
  original = stellarax.XlaRaggedDot._fwd

  def spy(self, *a, config, **k):
    seen.append(config)
    return original(self, *a, config=config, **k)

  f = jax.jit(lambda l, r: stellarax.ragged_dot(l, r, gs))
  plain = jax.jit(lambda x: (traces.append(1), x * 2)[1])
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(stellarax.XlaRaggedDot, "_fwd", spy)
    f(lhs, rhs)
    plain(1.0)
    for _ in range(2):
      with result:
        f(lhs, rhs)
        plain(1.0)
  assert seen[0] == ba.heuristics_config and seen[-1] == tuned
  assert len(traces) == 1  # no op inside: entering a result does not retrace it


def test_implementation_none_picks_the_measured_fastest():
  from stellarax.autotuning.measure import Measurement
  from stellarax.core.config import NoConfig
  q = jnp.ones((1, 16, 2, 8))
  chunked = stellarax.XlaChunkedAttention.bind(q, q, q)
  full = stellarax.XlaAttention.bind(q, q, q)

  def entry(ba, config, t):
    m = Measurement(status="ok", median_s=t, ci_low_s=t, ci_high_s=t, num_samples=3, compile_time_s=0.1, method="t")
    return autotuning.Entry(ba, config, config, ((config, m),))

  seen = []
  original = stellarax.XlaAttention._fwd

  def spy(self, *a, **k):
    seen.append(type(self).__name__)
    return original(self, *a, **k)

  fast_full = [entry(chunked, chunked.heuristics_config, 2e-3), entry(full, NoConfig(), 1e-3)]
  result = autotuning.AutotuningResult("cpu", {e.key: e for e in fast_full})
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(stellarax.XlaAttention, "_fwd", spy)
    stellarax.dot_product_attention(q, q, q)
    assert seen == []  # preference order: xla_chunked first
    with result:
      stellarax.dot_product_attention(q, q, q)
    assert seen == ["XlaAttention"]


def test_a_miss_policy_scope_overrides_the_environment(monkeypatch):
  monkeypatch.setenv("STELLARAX_MISS_POLICY", "error")
  assert resolution.miss_policy() == "error"
  with resolution.miss_policy_scope("autotune"):
    assert resolution.miss_policy() == "autotune"
  assert resolution.miss_policy() == "error"


def test_code_traced_under_one_miss_policy_is_traced_again_under_another(user_cache_dir):
  # A trace (or an eager call) that met a miss under "heuristics" was reused inside
  # miss_policy_scope("error"), which then raised nothing.
  lhs, rhs, gs = _ragged_inputs()
  f = jax.jit(lambda l: stellarax.ragged_dot(l, rhs, gs, implementation="xla"))
  eager = lambda l: stellarax.ragged_dot(l, rhs, gs, implementation="xla")
  for call in (f, eager):
    call(lhs)
    with resolution.miss_policy_scope("error"):
      with pytest.raises(autotuning.ConfigMissError):
        call(lhs)
    call(lhs)  # and back: the trace of the default policy serves again


@pytest.mark.parametrize("program", ["vmap", "nested vmap", "vmap of grad", "grad of vmap",
                                     "empty batch"])
def test_vmapped_calls_a_result_covers_run_under_the_error_policy(program):
  # custom_vmap traces the call for its unbatched shapes before the batching rule makes
  # the vmapped one: that trace, which never runs, met the policy and raised
  # ConfigMissError (and "autotune" tuned it).
  lhs, rhs, gs = _ragged_inputs()
  ragged = lambda l, r: stellarax.ragged_dot(l, r, gs, implementation="xla")
  loss = lambda l, r: jnp.sum(ragged(l, r) ** 2)
  stack = lambda x: jnp.stack([x, 2 * x])
  f, args = {
      "vmap": (jax.vmap(ragged, in_axes=(0, None)), (stack(lhs), rhs)),
      "nested vmap": (jax.vmap(jax.vmap(ragged, in_axes=(0, None)), in_axes=(0, None)),
                      (stack(stack(lhs)), rhs)),
      "vmap of grad": (jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None)),
                       (stack(lhs), rhs)),
      "grad of vmap": (jax.grad(lambda l, r: jnp.sum(jax.vmap(ragged, in_axes=(0, None))(l, r)),
                                argnums=1), (stack(lhs), rhs)),
      "empty batch": (jax.vmap(ragged, in_axes=(0, None)), (jnp.zeros((0, *lhs.shape)), rhs)),
  }[program]
  calls = autotuning.get_bound_args(f, *args)
  assert calls or program == "empty batch"
  covering = functools.reduce(lambda a, b: a | b, [_result_with(ba, ba.heuristics_config)
                                                  for ba in calls],
                              autotuning.AutotuningResult("cpu"))
  expected = jax.jit(f)(*args)
  with covering, resolution.miss_policy_scope("error"):
    got = jax.jit(f)(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5)
  if calls:  # a call the result does not cover still raises
    with resolution.miss_policy_scope("error"), pytest.raises(resolution.ConfigMissError):
      jax.jit(f)(*args)


def test_a_call_with_one_config_is_no_miss_under_any_policy():
  # Under "error" a norm (nothing to tune) raised ConfigMissError until "tuned".
  x = jax.random.normal(jax.random.key(3), (4, 16))
  with resolution.miss_policy_scope("error"):
    got = jax.grad(lambda x: stellarax.rms_norm(x, None).sum())(x)
    explained = autotuning.explain(stellarax.XlaLayerNorm.bind(x, None, None, subtract_mean=False))
  assert got.shape == x.shape
  assert explained.source == resolution.ONLY_CONFIG
  assert "nothing to tune, whatever the miss policy" in str(explained)


def test_static_values_have_one_canonical_form():
  """Keys must be equal for equal calls: dict order does not matter, NumPy scalars are
  plain Python numbers, and non-finite floats survive strict JSON and come back."""
  from stellarax.core import specs
  a, b = specs.to_spec({"b": 1, "a": 2}), specs.to_spec({"a": 2, "b": 1})
  assert a == b and hash(a) == hash(b) and list(a) == ["a", "b"]
  for value, plain in ((np.float32(1.5), 1.5), (np.int64(3), 3), (np.bool_(True), True)):
    spec = specs.to_spec(value)
    assert spec == plain and type(spec) is type(plain), (value, spec)
  for value in (float("inf"), float("-inf")):
    text = specs.canonical_json(specs.encode(specs.to_spec(value)))
    assert specs.decode(json.loads(text)) == value
  nan = specs.decode(json.loads(specs.canonical_json(specs.encode(float("nan")))))
  assert np.isnan(nan)


def test_finding_the_calls_of_a_program_neither_tunes_nor_raises_on_a_miss(user_cache_dir):
  """Capture only reads which ops run: under the "error" or "autotune" miss policy, an
  untuned call is found, not refused or tuned on the spot."""
  lhs, rhs, gs = _ragged_inputs()
  f = lambda l: stellarax.ragged_dot(l, rhs, gs)
  for policy in ("error", "autotune"):
    with resolution.miss_policy_scope(policy):
      (ba,) = autotuning.get_bound_args(f, lhs)
    assert ba.op.name == "ragged_dot.xla"
  with resolution.miss_policy_scope("error"), pytest.raises(resolution.ConfigMissError):
    jax.jit(f).lower(lhs)  # the policy itself is in force outside capture
