"""The public op functions against JAX's own ops (XLA implementations; some tests also run a
Pallas kernel in the interpreter)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax


def _keys(n):
  return jax.random.split(jax.random.key(7), n)


@pytest.mark.parametrize("sizes", [(5, 0, 17, 3), (0, 0, 0, 0), (40, 2, 0, 6)])
def test_ragged_dot_matches_lax_with_empty_groups_and_short_sums(sizes):
  k = _keys(2)
  lhs = jax.random.normal(k[0], (48, 12), jnp.float32)
  rhs = jax.random.normal(k[1], (4, 12, 20), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  np.testing.assert_allclose(stellarax.ragged_dot(lhs, rhs, gs), jax.lax.ragged_dot(lhs, rhs, gs),
                             rtol=1e-5, atol=1e-5)


def test_ragged_dot_of_two_dtypes_promotes_as_lax():
  k = _keys(2)
  lhs = jax.random.normal(k[0], (48, 12), jnp.bfloat16)
  rhs = jax.random.normal(k[1], (4, 12, 20), jnp.float32)
  gs = jnp.asarray([5, 0, 17, 3], jnp.int32)
  expected = jax.lax.ragged_dot(lhs, rhs, gs)
  out = stellarax.ragged_dot(lhs, rhs, gs)
  assert out.dtype == expected.dtype == jnp.float32
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  cotangent = jax.random.normal(_keys(3)[2], expected.shape, jnp.float32)
  loss = lambda f: lambda a, b: jnp.sum(f(a, b, gs) * cotangent)
  grads = jax.grad(loss(stellarax.ragged_dot), argnums=(0, 1))(lhs, rhs)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.float32]
  # Each gradient as precise as its own dtype: the float32 rhs's is not computed from
  # a cotangent rounded to the bfloat16 lhs's dtype.
  want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
  np.testing.assert_allclose(grads[1], want[1], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(grads[0].astype(jnp.float32), want[0].astype(jnp.float32), rtol=2e-2, atol=2e-2)


def test_ragged_dot_of_8_bit_floats_differentiates():
  # jnp.promote_types refuses 8-bit floats with other dtypes: the backward's wider dtype
  # must not come from it.
  k = _keys(3)
  lhs = jax.random.normal(k[0], (16, 32)).astype(jnp.float8_e4m3fn)
  rhs = jax.random.normal(k[1], (3, 32, 16)).astype(jnp.float8_e5m2)
  gs = jnp.asarray([8, 0, 8], jnp.int32)
  loss = lambda f: lambda a, b: jnp.sum(f(a, b, gs, preferred_element_type=jnp.float32)
                                        * jax.random.normal(k[2], (16, 16)))
  got = jax.grad(loss(stellarax.ragged_dot), argnums=(0, 1))(lhs, rhs)
  want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32), rtol=0.25, atol=0.25)


@pytest.mark.parametrize("m, k, n, dtype", [
    (0, 64, 128, jnp.bfloat16), (48, 0, 128, jnp.bfloat16), (48, 64, 0, jnp.bfloat16),
    # Sizes and a dtype the Mosaic GPU kernel does not take: it runs no kernel, so it
    # takes the call all the same (Op._check_supported is not asked of trivial calls).
    (0, 40, 24, jnp.float32), (48, 40, 0, jnp.float32)])
def test_ragged_dot_with_an_empty_dimension_is_lax_s_zeros_in_every_implementation(m, k, n, dtype):
  keys = _keys(3)
  lhs = jax.random.normal(keys[0], (m, k), dtype)
  rhs = jax.random.normal(keys[1], (4, k, n), dtype)
  gs = jnp.asarray([m // 4, 0, m // 2, m // 8], jnp.int32)
  dout = jax.random.normal(keys[2], (m, n), dtype)
  expected, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), lhs, rhs)
  for impl in ("xla", stellarax.PallasTritonRaggedDot(interpret=True),
               stellarax.PallasMosaicGpuRaggedDot(interpret=True)):
    out, ours = jax.vjp(lambda a, b: stellarax.ragged_dot(a, b, gs, implementation=impl), lhs, rhs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_array_equal(out.astype(jnp.float32), expected.astype(jnp.float32))
    for got, want in zip(ours(dout), pullback(dout)):
      assert got.shape == want.shape
      np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=1e-2)
    # Under jit and vmap too; no op call is left in the program to tune.
    batched = jax.jit(jax.vmap(lambda a: stellarax.ragged_dot(a, rhs, gs, implementation=impl)))
    assert batched(jnp.stack([lhs, lhs])).shape == (2, m, n)
  assert stellarax.autotuning.get_bound_args(lambda a: stellarax.ragged_dot(a, rhs, gs), lhs) == []
  bound = stellarax.PallasTritonRaggedDot.bind(lhs, rhs, gs)  # its tile heuristic needs sizes > 0
  assert len(stellarax.Autotuner(budget_s=1, progress=False).autotune([bound])) == 0
  explained = stellarax.autotuning.explain(bound)
  assert explained.source == "trivial" and "runs no kernel" in str(explained)


def test_vmap_over_an_empty_batch_runs_no_kernel():
  rhs, gs = jnp.ones((2, 32, 24)), jnp.array([15, 20], jnp.int32)
  lhs = jnp.ones((0, 40, 32))
  for impl in ("xla", stellarax.PallasTritonRaggedDot(interpret=True)):
    f = jax.vmap(lambda l: stellarax.ragged_dot(l, rhs, gs, implementation=impl))
    assert f(lhs).shape == (0, 40, 24)
    assert jax.grad(lambda l: f(l).sum())(lhs).shape == lhs.shape
  norm = lambda x: stellarax.rms_norm(x, None, implementation=stellarax.PallasTritonLayerNorm(interpret=True))
  assert jax.vmap(jax.vmap(norm))(jnp.ones((3, 0, 4, 16))).shape == (3, 0, 4, 16)


@pytest.mark.parametrize("batch, t, head_dim, dtype", [
    (0, 16, 64, jnp.bfloat16), (2, 0, 64, jnp.bfloat16),
    # A head dim and a dtype the flash kernels do not take: no kernel runs, so they
    # take the call all the same.
    (2, 0, 40, jnp.float32),
    (2, 16, 0, jnp.float32)])  # heads of size 0: no logits, and no scale to derive
def test_attention_without_queries_is_empty_in_every_implementation(batch, t, head_dim, dtype):
  q = jax.random.normal(_keys(1)[0], (batch, t, 2, head_dim), dtype)
  kv = jax.random.normal(_keys(2)[1], (batch, 16, 1, head_dim), dtype)
  for impl in ("xla", stellarax.PallasTritonAttention(interpret=True),
               stellarax.PallasMosaicGpuAttention(interpret=True)):
    out, pullback = jax.vjp(
        lambda q, k: stellarax.dot_product_attention(q, k, k, implementation=impl), q, kv)
    assert out.shape == q.shape and out.dtype == q.dtype
    dq, dkv = pullback(out)
    assert dq.shape == q.shape and dkv.shape == kv.shape and not dkv.any()
  if batch:  # queries with no key: zeros, as jax gives, with no kernel
    queries = jax.random.normal(_keys(3)[2], (batch, 4, 2, 64), jnp.bfloat16)
    no_keys = jnp.ones((batch, 0, 1, 64), jnp.bfloat16)
    expected = jax.nn.dot_product_attention(queries, no_keys, no_keys)
    for impl in ("xla", "xla_chunked", stellarax.PallasTritonAttention(interpret=True),
                 stellarax.PallasMosaicGpuAttention(interpret=True)):
      attend = lambda q, k: stellarax.dot_product_attention(q, k, k, implementation=impl)
      out, pullback = jax.vjp(attend, queries, no_keys)
      assert out.dtype == expected.dtype
      np.testing.assert_array_equal(out.astype(jnp.float32), expected.astype(jnp.float32))
      dq, dk = pullback(out)
      assert dq.shape == queries.shape and not dq.any() and dk.shape == no_keys.shape
    # The kernels' backward, bound on its own, still refuses what it cannot run.
    with pytest.raises(NotImplementedError, match=r"no keys \(S=0\)"):
      stellarax.PallasTritonAttentionVjp.bind(
          residuals=None, out=queries, dout=queries, query=queries, key=no_keys, value=no_keys)


def test_ragged_dot_without_groups_is_lax_s_zeros():
  lhs = jax.random.normal(_keys(1)[0], (16, 8))
  rhs, gs = jnp.zeros((0, 8, 4)), jnp.zeros((0,), jnp.int32)
  for impl in ("xla", stellarax.PallasTritonRaggedDot(interpret=True)):
    f = lambda l, r: stellarax.ragged_dot(l, r, gs, implementation=impl)
    np.testing.assert_array_equal(f(lhs, rhs), jax.lax.ragged_dot(lhs, rhs, gs))
    dl, dr = jax.grad(lambda l, r: f(l, r).sum(), argnums=(0, 1))(lhs, rhs)
    assert not dl.any() and dl.shape == lhs.shape and dr.shape == rhs.shape
  assert stellarax.autotuning.get_bound_args(lambda l: stellarax.ragged_dot(l, rhs, gs), lhs) == []


@pytest.mark.parametrize("shape", [(4, 0), (0, 16)])
def test_norms_of_an_empty_array_in_every_implementation(shape):
  x, scale = jnp.ones(shape), jnp.ones(shape[1:])
  for impl in ("xla", stellarax.PallasTritonLayerNorm(interpret=True)):
    out, pullback = jax.vjp(lambda x, s: stellarax.rms_norm(x, s, implementation=impl), x, scale)
    assert out.shape == shape
    dx, dscale = pullback(out)
    assert dx.shape == shape and dscale.shape == scale.shape and not dscale.any()


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True),
    dict(local_window_size=(3, 1)),
    dict(query_seq_lengths=jnp.array([5, 9], jnp.int32), key_value_seq_lengths=jnp.array([7, 3], jnp.int32)),
])
def test_attention_matches_jax_with_gqa(kwargs):
  k = _keys(3)
  q = jax.random.normal(k[0], (2, 9, 4, 8), jnp.float32)
  kv = jax.random.normal(k[1], (2, 11, 2, 8), jnp.float32)
  v = jax.random.normal(k[2], (2, 11, 2, 8), jnp.float32)
  if kwargs.get("is_causal") or "local_window_size" in kwargs:
    kv, v = kv[:, :9], v[:, :9]
  expected = jax.nn.dot_product_attention(q, kv, v, **kwargs)
  for impl in ("xla", "xla_chunked"):
    out = stellarax.dot_product_attention(q, kv, v, implementation=impl, **kwargs)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


def test_lists_where_arrays_belong_say_so():
  x, rhs = jnp.ones((8, 4)), jnp.ones((2, 4, 3))
  with pytest.raises(TypeError, match=r"group_sizes must be an array .* jnp.asarray\(group_sizes\)"):
    stellarax.ragged_dot(x, rhs, [3, 5])
  with pytest.raises(TypeError, match="x must be an array"):
    stellarax.rms_norm([[1.0, 2.0]], None)
  with pytest.raises(TypeError, match="scale must be an array"):
    stellarax.rms_norm(x, [1.0] * 4)
  q = jnp.ones((1, 4, 1, 8))
  with pytest.raises(TypeError, match="bias must be an array"):
    stellarax.dot_product_attention(q, q, q, bias=[[0.0]])


@pytest.mark.parametrize("scale", ["a", float("inf"), [0.5]])
def test_attention_refuses_a_scale_that_is_not_a_number(scale):
  q = jnp.ones((1, 4, 1, 8))
  with pytest.raises(ValueError, match=r"must be None \(1/sqrt\(H\) = 0.3536\) or a finite") as e:
    stellarax.dot_product_attention(q, q, q, scale=scale)
  assert "traced" not in str(e.value)  # said only of a traced scale
  with pytest.raises(ValueError, match=r"or a finite Python number: it is a static option"):
    jax.jit(lambda s: stellarax.dot_product_attention(q, q, q, scale=s))(0.5)


def test_a_traced_epsilon_is_refused_as_a_static_option():
  x = jax.random.normal(_keys(1)[0], (8, 32))
  for norm in (lambda x, e: stellarax.rms_norm(x, None, epsilon=e),
               lambda x, e: stellarax.layer_norm(x, None, None, epsilon=e)):
    with pytest.raises(ValueError, match=r"must be a Python number >= 0: it is a static option"):
      jax.jit(norm)(x, 1e-3)
    # A concrete array scalar is a number.
    np.testing.assert_allclose(norm(x, jnp.float32(1e-3)), norm(x, 1e-3), rtol=1e-6)
  with pytest.raises(ValueError, match=r"epsilon=-1.0 must be >= 0"):
    stellarax.rms_norm(x, None, epsilon=-1.0)


def test_a_precision_pair_is_taken_as_jax_takes_it_when_both_agree():
  k = _keys(2)
  lhs, rhs = jax.random.normal(k[0], (12, 8)), jax.random.normal(k[1], (3, 8, 5))
  gs = jnp.array([5, 0, 6], jnp.int32)
  expected = jax.lax.ragged_dot(lhs, rhs, gs, precision=("highest", "highest"))
  for pair in (("highest", "highest"), (jax.lax.Precision.HIGHEST, "highest")):
    np.testing.assert_allclose(stellarax.ragged_dot(lhs, rhs, gs, precision=pair), expected,
                               rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"gives the operands different precisions; .* pass one, "
                     r"e.g. precision='HIGHEST'"):
    stellarax.ragged_dot(lhs, rhs, gs, precision=("highest", "default"))
  with pytest.raises(ValueError, match=r"or a pair of one of those for both operands"):
    stellarax.ragged_dot(lhs, rhs, gs, precision="fastest")


def test_a_call_s_key_tells_apart_what_jax_computes_differently():
  # An entry measured at the default matmul precision answered a call under
  # jax.default_matmul_precision("highest"), and one measured for a float32 output
  # (float64 asked for, x64 off) a float64 output under x64: their keys were equal.
  specs = (jax.ShapeDtypeStruct((12, 8), jnp.float32), jax.ShapeDtypeStruct((3, 8, 5), jnp.float32),
           jax.ShapeDtypeStruct((3,), jnp.int32))
  key = lambda op=stellarax.XlaRaggedDot, **kw: op.bind(*specs, **kw).key_json()
  with jax.default_matmul_precision("highest"):
    highest = key()
    assert key(op=stellarax.PallasTritonRaggedDot) == key(op=stellarax.PallasTritonRaggedDot,
                                                         precision="highest")
  assert highest == key(precision="highest") != key()
  with jax.default_matmul_precision("tensorfloat32"):
    assert key() == key(precision="high")
  plain = key()
  with jax.default_matmul_precision("BF16_BF16_F32_X3"):  # no precision names a preset
    assert key() == plain
  with jax.enable_x64(False):
    assert key(preferred_element_type=jnp.float64) == key(preferred_element_type=jnp.float32)
  with jax.enable_x64(True):
    assert key(preferred_element_type=jnp.float64) != key(preferred_element_type=jnp.float32)


def test_a_stored_call_keeps_its_key_whatever_the_reader_s_settings():
  # Decoding a stored call canonicalised it again under the reader's settings: under
  # default_matmul_precision("float32") an entry of precision None became HIGHEST (and
  # answered such calls), and without x64 a float64 entry became float32 (two entries
  # of a file became one).
  from stellarax.core.bound_args import BoundArguments
  specs = (jax.ShapeDtypeStruct((12, 8), jnp.float32), jax.ShapeDtypeStruct((3, 8, 5), jnp.float32),
           jax.ShapeDtypeStruct((3,), jnp.int32))
  plain = stellarax.XlaRaggedDot.bind(*specs)
  with jax.enable_x64(True):
    wide = stellarax.XlaRaggedDot.bind(*specs, preferred_element_type=jnp.float64)
    f64 = [jax.ShapeDtypeStruct(s.shape, jnp.float64 if s.dtype == jnp.float32 else s.dtype)
           for s in specs]
    float64 = stellarax.XlaRaggedDot.bind(*f64)  # float64 arrays, not float32 ones
  assert float64.key_json() != plain.key_json()
  with jax.default_matmul_precision("float32"), jax.enable_x64(False):
    for call in (plain, wide, float64):
      assert BoundArguments.from_json(call.to_json()).key_json() == call.key_json()


def test_attention_bias_mask_and_gradients():
  k = _keys(5)
  q = jax.random.normal(k[0], (1, 16, 2, 8), jnp.float32)
  kv = jax.random.normal(k[1], (1, 16, 2, 8), jnp.float32)
  bias = jax.random.normal(k[2], (1, 2, 16, 16), jnp.float32)
  mask = jax.random.bernoulli(k[3], 0.7, (1, 1, 16, 16))
  f = lambda impl: lambda q, kv: (impl(q, kv, kv, bias, mask) ** 2).sum()
  ours = jax.grad(f(stellarax.dot_product_attention), argnums=(0, 1))(q, kv)
  theirs = jax.grad(f(jax.nn.dot_product_attention), argnums=(0, 1))(q, kv)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_layer_and_rms_norm_and_their_gradients():
  k = _keys(3)
  x = jax.random.normal(k[0], (6, 33), jnp.float32) * 3 + 1
  scale = jax.random.normal(k[1], (33,), jnp.float32)
  offset = jax.random.normal(k[2], (33,), jnp.float32)
  mean = x.mean(-1, keepdims=True)
  ln = (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * scale[None] + offset[None]
  rms = x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale[None]
  np.testing.assert_allclose(stellarax.layer_norm(x, scale, offset), ln, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stellarax.rms_norm(x, scale), rms, rtol=1e-5, atol=1e-5)
  g = jax.grad(lambda x, s: (stellarax.rms_norm(x, s) ** 2).sum(), argnums=(0, 1))(x, scale)
  gr = jax.grad(lambda x, s: ((x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * s[None]) ** 2).sum(),
                argnums=(0, 1))(x, scale)
  for a, b in zip(g, gr):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(stellarax.rms_norm(x, None, epsilon=0),
                             x / jnp.sqrt((x * x).mean(-1, keepdims=True)), rtol=1e-5, atol=1e-5)
  for bad in (-1e-6, float("nan")):
    with pytest.raises(ValueError, match="epsilon=.* must be >= 0"):
      stellarax.layer_norm(x, scale, offset, epsilon=bad)


def test_gated_linear_unit_and_named_activations():
  k = _keys(2)
  x = jax.random.normal(k[0], (5, 16), jnp.float32)
  w = jax.random.normal(k[1], (16, 2, 24), jnp.float32)
  expected = jax.nn.swish(x @ w[:, 0]) * (x @ w[:, 1])
  np.testing.assert_allclose(stellarax.gated_linear_unit(x, w), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stellarax.gated_linear_unit(x, w, activation="relu"),
                             jax.nn.relu(x @ w[:, 0]) * (x @ w[:, 1]), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="silu"):
    stellarax.gated_linear_unit(x, w, activation=lambda v: v)
  gw = jax.grad(lambda w: stellarax.gated_linear_unit(x, w).sum())(w)
  gw_ref = jax.grad(lambda w: (jax.nn.swish(x @ w[:, 0]) * (x @ w[:, 1])).sum())(w)
  np.testing.assert_allclose(gw, gw_ref, rtol=1e-4, atol=1e-4)


# The XLA implementation and a Pallas kernel in the interpreter: the public wrapper
# reshapes what jax.nn.dot_product_attention takes, so each sees it alike.
_ATTENTION_IMPLS = pytest.mark.parametrize(
    "impl", ["xla", stellarax.PallasTritonAttention(interpret=True)],
    ids=["xla", "pallas_triton_interpret"])


def _attention_operands(seed, t=16, s=24, n=4, k=2, h=64):
  """Fresh normal float32 q (1, T, N, H) and k, v (1, S, K, H)."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (1, t, n, h), jnp.float32)
  kv = [jax.random.normal(x, (1, s, k, h), jnp.float32) for x in keys[1:]]
  return q, *kv


# The padding to 4-D is the public function's, the same for every implementation: one
# kernel (the bias gradient's test) shows that kernels take what it pads; the rest run XLA.
@pytest.mark.parametrize("impl", ["xla"])
@pytest.mark.parametrize("name, shape", [("bias", (16, 24)), ("mask", (16, 24)),
                                         ("bias", (4, 16, 24))])
def test_attention_takes_a_bias_or_mask_of_lower_rank_as_jax(impl, name, shape):
  q, k, v = _attention_operands(11)
  draw = jax.random.key(12)
  extra = (jax.random.bernoulli(draw, 0.7, shape) if name == "mask"
           else jax.random.normal(draw, shape, jnp.float32))
  expected = jax.nn.dot_product_attention(q, k, v, **{name: extra}, implementation="xla")
  out = stellarax.dot_product_attention(q, k, v, **{name: extra}, implementation=impl)
  np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


def test_attention_adds_an_integer_or_bool_bias_as_jax():
  # jax takes one; the flash kernels raised ValueError from inside their kernel, which a
  # preference list does not pass by. (The public function casts it, for every kernel.)
  q, k, v = _attention_operands(15, t=8, s=12, n=2, k=1)
  for dtype, impl in [(jnp.bool_, "xla"), (jnp.int32, stellarax.PallasTritonAttention(
      interpret=True))]:
    bias = jax.random.randint(jax.random.key(16), (8, 12), -3, 3).astype(dtype)
    grad = lambda f: jax.grad(lambda q: f(q, k, v, bias=bias).sum())(q)
    jax_attend = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    attend = functools.partial(stellarax.dot_product_attention, implementation=impl)
    np.testing.assert_allclose(attend(q, k, v, bias=bias), jax_attend(q, k, v, bias=bias),
                               rtol=2e-5, atol=2e-5)
    if impl == "xla":  # the cast and its float0 gradient are the public function's
      np.testing.assert_allclose(grad(attend), grad(jax_attend), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["xla"])
def test_attention_takes_unbatched_queries_keys_and_values_as_jax(impl):
  q, k, v = (x[0] for x in _attention_operands(13))  # (T, N, H) and (S, K, H)
  cotangent = jax.random.normal(jax.random.key(14), q.shape, jnp.float32)
  attend = lambda f: lambda q, k, v: f(q, k, v, is_causal=True)
  expected, expected_pullback = jax.vjp(
      attend(functools.partial(jax.nn.dot_product_attention, implementation="xla")), q, k, v)
  out, pullback = jax.vjp(
      attend(functools.partial(stellarax.dot_product_attention, implementation=impl)), q, k, v)
  assert out.shape == expected.shape == q.shape
  np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
  for grad, want in zip(pullback(cotangent), expected_pullback(cotangent)):
    assert grad.shape == want.shape
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-4)


def test_attention_refuses_unbatched_queries_with_batched_keys_naming_the_shapes():
  q, k, v = _attention_operands(13)
  k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])  # A batch of 2.
  with pytest.raises(ValueError, match=r"query has no batch dimension while key and value have "
                                       r"a batch of 2 \(query.shape=\(16, "):
    stellarax.dot_product_attention(q[0], k, v)
  # A batch of one broadcasts, as in jax.
  out = stellarax.dot_product_attention(q[0], k[:1], v[:1])
  np.testing.assert_allclose(out, jax.nn.dot_product_attention(q[0], k[:1], v[:1]), rtol=2e-5,
                             atol=2e-5)


def test_attention_and_norms_refuse_traced_static_options_saying_so():
  q, k, v = _attention_operands(13)
  with pytest.raises(ValueError, match=r"is_causal=.* must be a Python bool: it is a static option"):
    jax.jit(lambda c: stellarax.dot_product_attention(q, k, v, is_causal=c))(True)
  # The window and a norm's axis said "must be an int", of the int the caller passed.
  static = r"=.*JitTracer.* must be a Python int or a tuple of them: it is a static option of the call, and a traced"
  with pytest.raises(ValueError, match="local_window_size" + static):
    jax.jit(lambda w: stellarax.dot_product_attention(q, k, v, local_window_size=w))(3)
  with pytest.raises(ValueError, match="local_window_size" + static):
    jax.jit(lambda w: stellarax.dot_product_attention(q, k, v, local_window_size=(w, 2)))(3)
  with pytest.raises(ValueError, match="axis" + static):
    jax.jit(lambda a: stellarax.layer_norm(q, None, None, axis=a))(1)


def test_norm_axes_may_be_numpy_integers():
  x = jax.random.normal(_keys(1)[0], (8, 32))
  for axis in (np.int64(1), (np.int32(-1),)):
    np.testing.assert_allclose(stellarax.rms_norm(x, None, axis=axis), stellarax.rms_norm(x, None),
                               rtol=1e-6)
  with pytest.raises(ValueError, match=r"axis=True must be an int"):
    stellarax.rms_norm(x, None, axis=True)


@_ATTENTION_IMPLS
def test_attention_gradient_of_a_two_dimensional_bias_has_its_shape(impl):
  q, k, v = _attention_operands(15)
  bias = jax.random.normal(jax.random.key(16), (16, 24), jnp.float32)
  cotangent = jax.random.normal(jax.random.key(17), q.shape, jnp.float32)
  loss = lambda f: lambda bias: jnp.sum(f(q, k, v, bias) * cotangent)
  grad = jax.grad(loss(functools.partial(stellarax.dot_product_attention, implementation=impl)))(bias)
  want = jax.grad(loss(functools.partial(jax.nn.dot_product_attention, implementation="xla")))(bias)
  assert grad.shape == bias.shape
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(17, 24), (3, 16, 24), (2, 1, 1, 16, 24)])
def test_attention_refuses_a_bias_that_does_not_broadcast_naming_the_shapes(shape):
  q, k, v = _attention_operands(18)
  match = (rf"bias.shape={re.escape(str(shape))} does not broadcast to "
           r"\(B, N, T, S\)=\(1, 4, 16, 24\)")
  with pytest.raises(ValueError, match=match):
    stellarax.dot_product_attention(q, k, v, jnp.zeros(shape))


def test_attention_refuses_queries_of_another_rank_naming_the_layout():
  q, k, v = _attention_operands(19)
  with pytest.raises(ValueError, match=r"query.shape=\(4, 64\) must be .* or \(T, N, H\)"):
    stellarax.dot_product_attention(q[0, 0], k, v)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", ["xla", stellarax.PallasTritonRaggedDot(interpret=True)],
                         ids=["xla", "triton"])
def test_ragged_dot_gradients_take_nothing_from_rows_outside_a_group(impl):
  # NaN and inf in rows of other groups and in rows of no group reach only their own
  # group's rhs gradient (the Mosaic GPU kernel's case is in its own tests).
  k = _keys(3)
  lhs = jax.random.normal(k[0], (40, 16)).at[12, 3].set(jnp.nan).at[37, 5].set(jnp.inf)
  rhs = jax.random.normal(k[1], (3, 16, 8))
  dout = jax.random.normal(k[2], (40, 8)).at[25, 2].set(jnp.inf).at[39, 1].set(jnp.nan)
  sizes = jnp.array([10, 7, 15], jnp.int32)  # rows 32-39 are in no group
  _, pull = jax.vjp(lambda l, r: stellarax.ragged_dot(l, r, sizes, implementation=impl),
                    lhs, rhs)
  dlhs, drhs = pull(dout)
  starts = np.cumsum([0, 10, 7])
  for g, (start, size) in enumerate(zip(starts, (10, 7, 15))):
    rows = slice(start, start + size)
    with np.errstate(invalid="ignore", over="ignore"):
      want = np.asarray(lhs[rows]).T @ np.asarray(dout[rows])
    np.testing.assert_allclose(drhs[g], want, rtol=1e-4, atol=1e-4)
  assert np.isfinite(drhs[0]).all()  # the NaN row 12 is group 1's
  assert (np.asarray(dlhs[32:]) == 0).all()
