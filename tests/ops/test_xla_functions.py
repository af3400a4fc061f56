"""The XLA implementations of the op families against their references and JAX's ops.

Every comparison uses fresh random inputs and shapes chosen to be awkward: empty
groups, groups that do not fill (or overfill) the rows, sequence lengths that are
not multiples of the chunks, GQA/MQA, rows with no key to attend to.

Each test computes all its results in one jitted function: on a small CPU one
compiled program per test is far cheaper than compiling every eager primitive.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax.ops.attention.reference import attention_reference, attention_reference_with_lse
from stellarax.ops.attention.xla import attention_xla
from stellarax.ops.gated_linear_unit.reference import (
    ACTIVATIONS, activation_name, gated_linear_unit_reference)
from stellarax.ops.gated_linear_unit.xla import gated_linear_unit_xla
from stellarax.ops.normalization.reference import layer_norm_reference, rms_norm_reference
from stellarax.ops.normalization.xla import layer_norm_xla, rms_norm_xla
from stellarax.ops.ragged_dot.reference import ragged_dot_reference, ragged_dot_rhs_grad_reference
from stellarax.ops.ragged_dot.xla import ragged_dot_rhs_grad_xla, ragged_dot_xla

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


def _tol(dtype) -> dict[str, float]:
  """Tolerances for results in `dtype` against a float32 HIGHEST reference.

  Float32 matmuls at default precision are exact float32 on CPU but may use TF32
  on GPU, hence the looser float32 row there.
  """
  if jnp.dtype(dtype) == BF16:
    return dict(atol=3e-2, rtol=3e-2)
  if jax.default_backend() == "cpu":
    return dict(atol=5e-5, rtol=5e-5)
  return dict(atol=5e-3, rtol=5e-3)


def _assert_close(actual, expected, dtype=F32, what=""):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             err_msg=what, **_tol(dtype))


def _assert_all_close(results: dict, expected, dtype=F32):
  """Compares every named result with `expected`; a failure names the result."""
  for name, actual in results.items():
    _assert_close(actual, expected, dtype, what=name)


def _normal(rng: np.random.Generator, shape, dtype, scale=1.0, shift=0.0):
  """Fresh standard-normal data (numpy draws cost no compilation), scaled and shifted."""
  return jnp.asarray(shift + scale * rng.standard_normal(shape, np.float32), dtype)


# ----------------------------------------------------------------------------- ragged_dot

# (M, K, N, group_sizes, dtype): empty groups, sums below and above M, one group,
# no rows at all, and many one-row groups (the worst case for the tile bound).
RAGGED_CASES = {
    "empty_groups": (64, 32, 48, [10, 0, 30, 0, 24], F32),
    "sum_below_m_bf16": (70, 40, 24, [0, 13, 20, 7], BF16),
    "sum_above_m": (50, 16, 24, [20, 30, 40], F32),
    "one_group": (33, 24, 16, [33], F32),
    "all_groups_empty": (20, 16, 8, [0, 0, 0], F32),
    "one_row_groups": (24, 16, 8, [1] * 12 + [12], F32),
}
STRATEGY_TILES = [("lax", 8), ("masked", 8), ("tiled", 8), ("tiled", 16)]


def _ragged_inputs(case, seed=0):
  m, k, n, sizes, dtype = RAGGED_CASES[case]
  rng = np.random.default_rng(seed)
  lhs = _normal(rng, (m, k), dtype)
  rhs = _normal(rng, (len(sizes), k, n), dtype, scale=k ** -0.5)
  dout = _normal(rng, (m, n), dtype)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32), dout, dtype


def _precision(dtype):
  # Exact float32 products everywhere, so float32 tolerances hold on GPU too.
  return "highest" if dtype == F32 else None


def test_ragged_dot_reference_matches_numpy_loop():
  lhs, rhs, sizes, dout, _ = _ragged_inputs("sum_below_m_bf16")
  # bf16 inputs, float32 results: exact products of the bf16 values, as numpy computes.
  out, grad = jax.jit(lambda *a: (
      ragged_dot_reference(*a[:3], preferred_element_type=F32),
      ragged_dot_rhs_grad_reference(a[0], a[3], a[2], 4, preferred_element_type=F32)))(
          lhs, rhs, sizes, dout)
  lhs, rhs, dout = (np.asarray(a, np.float32) for a in (lhs, rhs, dout))
  expected_out, expected_grad = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros(rhs.shape)
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    rows = slice(start, start + size)
    expected_out[rows] = lhs[rows] @ rhs[g]
    expected_grad[g] = lhs[rows].T @ dout[rows]
    start += size
  _assert_close(out, expected_out)
  _assert_close(grad, expected_grad)


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_dot_forward(case):
  lhs, rhs, sizes, _, dtype = _ragged_inputs(case)

  @jax.jit
  def run(lhs, rhs, sizes):
    outs = {f"{s}/{t}": ragged_dot_xla(lhs, rhs, sizes, strategy=s, tile_m=t,
                                       precision=_precision(dtype)) for s, t in STRATEGY_TILES}
    return outs, ragged_dot_reference(lhs, rhs, sizes), jax.lax.ragged_dot(
        lhs, rhs, sizes, precision="highest")

  outs, expected, lax_out = run(lhs, rhs, sizes)
  assert all(o.shape == (lhs.shape[0], rhs.shape[2]) and o.dtype == dtype for o in outs.values())
  _assert_all_close(outs, expected, dtype)
  _assert_close(lax_out, expected, dtype, what="jax.lax.ragged_dot")


@pytest.mark.parametrize("case", ["empty_groups", "sum_below_m_bf16", "one_row_groups"])
def test_ragged_dot_gradients(case):
  lhs, rhs, sizes, dout, dtype = _ragged_inputs(case, seed=1)
  num_groups = rhs.shape[0]

  @jax.jit
  def run(lhs, rhs, sizes, dout):
    ref_vjp = jax.vjp(functools.partial(ragged_dot_reference, group_sizes=sizes), lhs, rhs)[1]
    lhs_grads, rhs_grads = {}, {}
    for s, t in STRATEGY_TILES:
      tunables = dict(strategy=s, tile_m=t, precision=_precision(dtype))
      # The lhs gradient is a ragged_dot with rhs transposed; the rhs one its own function.
      lhs_grads[f"{s}/{t}"] = ragged_dot_xla(dout, jnp.swapaxes(rhs, 1, 2), sizes, **tunables)
      rhs_grads[f"{s}/{t}"] = ragged_dot_rhs_grad_xla(lhs, dout, sizes, num_groups, **tunables)
      # Autodiff through the forward strategy (what an op without a VJP op would use).
      fwd = functools.partial(ragged_dot_xla, group_sizes=sizes, **tunables)
      lhs_grads[f"autodiff {s}/{t}"], rhs_grads[f"autodiff {s}/{t}"] = (
          jax.vjp(fwd, lhs, rhs)[1](dout))
    rhs_grads["rhs_grad_reference"] = ragged_dot_rhs_grad_reference(lhs, dout, sizes, num_groups)
    return lhs_grads, rhs_grads, ref_vjp(dout)

  lhs_grads, rhs_grads, (ref_lhs_grad, ref_rhs_grad) = run(lhs, rhs, sizes, dout)
  assert all(g.shape == rhs.shape and g.dtype == dtype for g in rhs_grads.values())
  _assert_all_close(lhs_grads, ref_lhs_grad, dtype)
  _assert_all_close(rhs_grads, ref_rhs_grad, dtype)


def test_ragged_dot_preferred_element_type():
  lhs, rhs, sizes, dout, _ = _ragged_inputs("sum_below_m_bf16")

  @jax.jit
  def run(lhs, rhs, sizes, dout):
    outs, grads = {}, {}
    for s in ("lax", "masked", "tiled"):
      outs[s] = ragged_dot_xla(lhs, rhs, sizes, strategy=s, tile_m=8, preferred_element_type=F32)
      grads[s] = ragged_dot_rhs_grad_xla(lhs, dout, sizes, 4, strategy=s, tile_m=8,
                                         preferred_element_type=F32)
    return (outs, grads, ragged_dot_reference(lhs, rhs, sizes, preferred_element_type=F32),
            ragged_dot_rhs_grad_reference(lhs, dout, sizes, 4, preferred_element_type=F32))

  outs, grads, expected_out, expected_grad = run(lhs, rhs, sizes, dout)
  assert expected_out.dtype == expected_grad.dtype == F32
  assert all(x.dtype == F32 for x in (*outs.values(), *grads.values()))
  # bf16 products accumulated in float32: only product rounding remains, far below
  # the bf16 output rounding that the default dtype would add.
  for name in outs:
    np.testing.assert_allclose(outs[name], expected_out, atol=1e-3, rtol=1e-3, err_msg=name)
    np.testing.assert_allclose(grads[name], expected_grad, atol=1e-3, rtol=1e-3, err_msg=name)


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="dense", tile_m=8), "strategy='dense' must be one of"),
    (dict(strategy="tiled", tile_m=12), "tile_m=12 must be a power of two >= 8"),
    (dict(strategy="tiled", tile_m=4), "tile_m=4 must be a power of two >= 8"),
])
def test_ragged_dot_rejects_bad_tunables(kwargs, match):
  lhs, rhs, sizes, dout, _ = _ragged_inputs("one_group")
  with pytest.raises(ValueError, match=match):
    ragged_dot_xla(lhs, rhs, sizes, **kwargs)
  with pytest.raises(ValueError, match=match):
    ragged_dot_rhs_grad_xla(lhs, dout, sizes, 1, **kwargs)


def test_ragged_dot_rejects_bad_shapes():
  lhs, rhs, sizes, dout, _ = _ragged_inputs("empty_groups")
  with pytest.raises(ValueError, match="contracting sizes differ"):
    ragged_dot_xla(lhs[:, :-1], rhs, sizes, strategy="lax", tile_m=8)
  with pytest.raises(ValueError, match=r"group_sizes.shape=\(4,\) must be \(5,\)"):
    ragged_dot_xla(lhs, rhs, sizes[:4], strategy="lax", tile_m=8)
  with pytest.raises(ValueError, match=r"must be \(3,\)"):
    ragged_dot_rhs_grad_xla(lhs, dout, sizes, 3, strategy="masked", tile_m=8)
  with pytest.raises(ValueError, match="integer dtype"):
    ragged_dot_reference(lhs, rhs, sizes.astype(jnp.float32))


# ----------------------------------------------------------------------------- attention

B, T, S, N, H = 2, 45, 38, 4, 16


def _attention_inputs(dtype, *, kv_heads=2, t=T, s=S, seed=0):
  rng = np.random.default_rng(seed)
  q = _normal(rng, (B, t, N, H), dtype)
  k = _normal(rng, (B, s, kv_heads, H), dtype)
  v = _normal(rng, (B, s, kv_heads, H), dtype)
  empty_rows = np.ones((1, N, t, s), np.bool_)
  empty_rows[:, :, :3, :] = False  # these rows keep nothing: they must average the values
  extras = dict(
      bias=_normal(rng, (1, N, t, s), dtype),
      mask=jnp.asarray(rng.random((B, 1, t, s)) < 0.6),
      mask_empty_rows=jnp.asarray(empty_rows),
      q_lengths=jnp.asarray([t - 7, t], jnp.int32),
      kv_lengths=jnp.asarray([s - 11, 0], jnp.int32),  # batch 1 sees no key at all
  )
  return q, k, v, extras


# name -> (kv_heads, kwargs built from the extras, chunks of the online softmax). Each
# case runs the full-logits path and one chunking; the chunks divide neither T=45 nor
# S=38, and None (the whole axis) appears on either side. One chunking per case keeps
# the number of compiled loops, the cost of this file, small.
ATTENTION_CASES = {
    "plain_gqa": (2, lambda e: {}, (16, 16)),
    "mqa_causal": (1, lambda e: dict(is_causal=True), (32, 8)),
    "mha_bias": (4, lambda e: dict(bias=e["bias"]), (8, None)),
    "mask_with_empty_rows": (2, lambda e: dict(mask=e["mask"] & e["mask_empty_rows"]), (16, 16)),
    "causal_seq_lengths": (2, lambda e: dict(is_causal=True, query_seq_lengths=e["q_lengths"],
                                             key_value_seq_lengths=e["kv_lengths"]), (16, 8)),
    "local_window": (2, lambda e: dict(local_window_size=(5, 2), bias=e["bias"], scale=0.3),
                     (32, 16)),
    "window_causal_mask": (1, lambda e: dict(local_window_size=3, is_causal=True,
                                             mask=e["mask"]), (None, 16)),
}


def _attention_results(case, dtype, seed):
  """Runs attention_xla (full and chunked), the reference and JAX's op in one program."""
  kv_heads, make_kwargs, chunking = ATTENTION_CASES[case]
  chunks = [(None, None), chunking]
  q, k, v, extras = _attention_inputs(dtype, kv_heads=kv_heads, seed=seed)
  kwargs = make_kwargs(extras)
  arrays = {name: kwargs.pop(name) for name in ("bias", "mask", "query_seq_lengths",
                                                "key_value_seq_lengths") if name in kwargs}

  @jax.jit
  def run(q, k, v, arrays):
    results = {f"chunks={c}": attention_xla(q, k, v, **arrays, **kwargs, chunk_q=c[0],
                                            chunk_k=c[1]) for c in chunks}
    reference = attention_reference_with_lse(q, k, v, **arrays, **kwargs)
    # JAX's own bf16 path promotes bf16 with float32 implicitly, which strict
    # promotion (a test setting we may run under) forbids; ours must not need it.
    with jax.numpy_dtype_promotion("standard"):
      jax_out, jax_lse = jax.nn.dot_product_attention(q, k, v, **arrays, **kwargs,
                                                      return_residual=True)
    plain_reference = attention_reference(q, k, v, **arrays, **kwargs)
    return results, reference, (jax_out, jnp.swapaxes(jax_lse, 1, 2)), plain_reference

  return run(q, k, v, arrays)


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_float32(case):
  results, (ref_out, ref_lse), (jax_out, jax_lse), plain_ref = _attention_results(
      case, F32, seed=1)
  _assert_close(ref_out, jax_out, what="reference vs jax.nn.dot_product_attention")
  _assert_close(ref_lse, jax_lse, what="reference lse vs jax residual")
  _assert_close(plain_ref, ref_out, what="attention_reference")
  for name, (out, lse) in results.items():
    assert out.shape == (B, T, N, H) and out.dtype == F32 and lse.shape == (B, N, T)
    _assert_close(out, ref_out, what=name)
    _assert_close(lse, ref_lse, what=f"lse {name}")
    _assert_close(out, jax_out, what=f"{name} vs jax.nn.dot_product_attention")


@pytest.mark.parametrize("case", ["mask_with_empty_rows", "causal_seq_lengths", "local_window"])
def test_attention_bfloat16(case):
  results, (ref_out, ref_lse), (jax_out, _), _ = _attention_results(
      case, BF16, seed=2)
  for name, (out, lse) in results.items():
    assert out.dtype == BF16 and lse.dtype == F32
    _assert_close(out, ref_out, BF16, what=name)
    _assert_close(lse, ref_lse, BF16, what=f"lse {name}")
    _assert_close(out, jax_out, BF16, what=f"{name} vs jax.nn.dot_product_attention")


def test_attention_gradient_through_chunks():
  # T < S, chunks that divide neither, and a batch element with no key at all.
  q, k, v, extras = _attention_inputs(F32, t=20, s=50, seed=3)
  kwargs = dict(is_causal=True, key_value_seq_lengths=extras["kv_lengths"])

  def loss(fn, q, k, v, **chunks):
    out = fn(q, k, v, **kwargs, **chunks)
    return jnp.sum(jnp.sin(out[0] if isinstance(out, tuple) else out))

  @jax.jit
  def run(q, k, v):
    grad = functools.partial(jax.grad, argnums=(0, 1, 2))
    return (grad(functools.partial(loss, attention_xla, chunk_q=8, chunk_k=16))(q, k, v),
            grad(functools.partial(loss, attention_reference))(q, k, v))

  grads, ref_grads = run(q, k, v)
  for name, grad, ref_grad in zip("qkv", grads, ref_grads):
    _assert_close(grad, ref_grad, what=f"d{name}")


def test_attention_rejects_bad_arguments():
  q, k, v, extras = _attention_inputs(F32)
  with pytest.raises(ValueError, match="chunk_q=0 must be a positive int"):
    attention_xla(q, k, v, chunk_q=0)
  with pytest.raises(ValueError, match="multiple of the key/value heads"):
    attention_xla(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
  # No key/value head (a ZeroDivisionError), and one check failed named alone.
  with pytest.raises(ValueError, match="key/value heads K=0 .*nothing to attend to"):
    attention_xla(q, k[:, :, :0], v[:, :, :0])
  with pytest.raises(ValueError, match=r"must share the head dim H; got \d+ and 4"):
    attention_xla(q, k[..., :4], v[..., :4])
  no_heads = attention_reference(q[:, :, :0], k[:, :, :0], v[:, :, :0])
  assert no_heads.shape == q[:, :, :0].shape
  with pytest.raises(ValueError, match="mask.dtype=float32 must be bool"):
    attention_xla(q, k, v, mask=extras["bias"])
  with pytest.raises(ValueError, match="bias.shape=.* must be 4-D and broadcastable"):
    attention_xla(q, k, v, bias=extras["bias"][0])
  with pytest.raises(ValueError, match="local_window_size=.* must be None, an int"):
    attention_xla(q, k, v, local_window_size=(1, 2, 3))


# ----------------------------------------------------------------------------- normalization

# (shape, axis, scale shape); axis tuples normalise several dimensions at once.
NORM_CASES = [((6, 7, 33), -1, (33,)), ((5, 9, 12), (0, 2), (5, 12)), ((4, 130), (1,), (130,))]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape,axis,param_shape", NORM_CASES)
def test_normalization(dtype, shape, axis, param_shape):
  rng = np.random.default_rng(4)
  x = _normal(rng, shape, dtype, scale=3.0, shift=0.5)
  scale, offset = _normal(rng, param_shape, dtype), _normal(rng, param_shape, dtype)
  axes = tuple(a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,)))
  bshape = [size if d in axes else 1 for d, size in enumerate(shape)]
  norm = dict(axis=axis, epsilon=1e-5)

  @jax.jit
  def run(x, scale, offset):
    results = {}
    for affine in (True, False):
      s, o = (scale, offset) if affine else (None, None)
      # Independent formulas: jax.nn.standardize and an explicit root mean square.
      x32 = x.astype(jnp.float32)
      s32 = s.astype(jnp.float32).reshape(bshape) if affine else jnp.ones((), jnp.float32)
      o32 = o.astype(jnp.float32).reshape(bshape) if affine else jnp.zeros((), jnp.float32)
      standard = jax.nn.standardize(x32, axis=axes, epsilon=1e-5, algorithm="stable")
      rms = jnp.sqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + 1e-5)
      results[f"layer_norm {affine=}"] = (
          layer_norm_xla(x, s, o, **norm),
          {"reference": layer_norm_reference(x, s, o, **norm), "standardize": standard * s32 + o32})
      results[f"rms_norm {affine=}"] = (
          rms_norm_xla(x, s, **norm),
          {"reference": rms_norm_reference(x, s, **norm), "formula": x32 / rms * s32})
      results[f"rms_norm with offset {affine=}"] = (
          rms_norm_xla(x, s, offset=o, **norm),
          {"reference": rms_norm_reference(x, s, offset=o, **norm),
           "formula": x32 / rms * s32 + o32})
    return results

  for name, (actual, expected) in run(x, scale, offset).items():
    assert actual.dtype == dtype and actual.shape == shape, name
    for source, value in expected.items():
      _assert_close(actual, value, dtype, what=f"{name} vs {source}")


def test_rms_norm_with_offset_rounds_to_the_dtype_once():
  """The offset is added in float32: rounding the normalised x to bfloat16 first and
  the sum again (as the op's XLA implementation and reference did) is off by a
  bfloat16 unit on a fifth of the elements here (23%)."""
  k = jax.random.split(jax.random.key(8), 3)
  x = jax.random.normal(k[0], (64, 256), jnp.float32).astype(BF16)
  scale = jax.random.normal(k[1], (256,), jnp.float32).astype(BF16)
  offset = jax.random.normal(k[2], (256,), jnp.float32).astype(BF16)
  x32 = np.asarray(x, np.float64)
  exact = x32 / np.sqrt(np.mean(x32 ** 2, axis=-1, keepdims=True) + 1e-6)
  exact = exact * np.asarray(scale, np.float64) + np.asarray(offset, np.float64)
  want = np.asarray(jnp.asarray(exact, jnp.float32).astype(BF16), np.float32)
  for name, impl in (("xla", "xla"), ("reference", None)):
    if impl is None:
      got = rms_norm_reference(x, scale, offset=offset)
    else:
      got = stellarax.rms_norm(x, scale, offset=offset, implementation=impl)
    differ = np.mean(np.asarray(got, np.float32) != want)
    assert differ < 0.005, (name, differ)  # Ties at float32 precision aside.


def test_layer_norm_large_mean_is_stable():
  # mean 1e4, spread 1: a one-pass variance would lose every digit in float32.
  spread = np.random.default_rng(5).standard_normal((8, 256), np.float32)
  x = jnp.asarray(spread + np.float32(1e4))
  centred = np.asarray(x, np.float64) - 1e4
  expected = (centred - centred.mean(-1, keepdims=True)) / np.sqrt(
      centred.var(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(jax.jit(layer_norm_xla)(x, None, None), expected, atol=2e-3)


def test_layer_norm_of_constant_rows_is_the_offset():
  # x - mean is exactly 0 there; the output was folded into x * m + (offset - mean * m),
  # whose two products cancel where m = scale / sqrt(epsilon) is huge: 0.25 off of 0.25.
  # (Values whose mean float32 sums exactly: of 3.7 it is 1e-6 off, which epsilon 1e-12
  # rightly scales up in any implementation.)
  scale, offset = jnp.full((64,), 1.5), jnp.full((64,), 0.25)
  for value in (100.0, 1000.0):
    for epsilon in (1e-6, 1e-12):
      x = jnp.full((4, 64), value, jnp.float32)
      out = jax.jit(layer_norm_xla, static_argnames="epsilon")(x, scale, offset,
                                                               epsilon=epsilon)
      np.testing.assert_array_equal(out, 0.25)
  one = jax.random.normal(jax.random.key(0), (4, 6, 1)) * 3 + 1  # rows of one element
  np.testing.assert_array_equal(layer_norm_xla(one, jnp.array([1.3]), jnp.array([0.25])), 0.25)


def test_normalization_rejects_bad_arguments():
  x = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"scale.shape=\(4,\) must be \(8,\)"):
    layer_norm_xla(x, jnp.ones((4,)), None)
  with pytest.raises(ValueError, match="axis=2 must be an int or a non-empty tuple"):
    rms_norm_xla(x, None, axis=2)
  with pytest.raises(ValueError, match="names the same dimension twice"):
    layer_norm_reference(x, None, None, axis=(1, -1))


# ----------------------------------------------------------------------------- gated_linear_unit

@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gated_linear_unit(dtype):
  rng = np.random.default_rng(6)
  x = _normal(rng, (3, 5, 40), dtype)
  w = _normal(rng, (40, 2, 24), dtype, scale=40 ** -0.5)

  @jax.jit
  def run(x, w):
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    gate = jnp.dot(x32, w32[:, 0], precision="highest")
    linear = jnp.dot(x32, w32[:, 1], precision="highest")
    results = {}
    for name, fn in ACTIVATIONS.items():
      outs = {f"{name} {fused=}": gated_linear_unit_xla(x, w, activation=name, fused=fused,
                                                         precision=_precision(dtype))
              for fused in (True, False)}
      # Independently: the activation straight from the registry, split projections.
      expected = {"reference": gated_linear_unit_reference(x, w, activation=name),
                  "formula": fn(gate) * linear}
      results[name] = (outs, expected)
    return results

  for outs, expected in run(x, w).values():
    assert all(o.shape == (3, 5, 24) and o.dtype == dtype for o in outs.values())
    for source, value in expected.items():
      _assert_all_close({f"{k} vs {source}": o for k, o in outs.items()}, value, dtype)


def test_activation_names():
  assert activation_name(jax.nn.swish) == activation_name("swish") == "silu"
  assert activation_name(jax.nn.silu) == "silu"
  assert activation_name(jax.nn.gelu) == activation_name("gelu") == "gelu"
  assert activation_name("gelu_exact") == "gelu_exact"
  assert activation_name(jax.nn.relu) == "relu"
  assert activation_name(jnp.tanh) == "tanh"
  assert all(activation_name(fn) in ACTIVATIONS for fn in ACTIVATIONS.values())
  x = jnp.linspace(-3.0, 3.0, 7)
  assert not np.allclose(ACTIVATIONS["gelu"](x), ACTIVATIONS["gelu_exact"](x), atol=1e-6, rtol=0)
  np.testing.assert_allclose(ACTIVATIONS["gelu"](x), jax.nn.gelu(x, approximate=True))
  with pytest.raises(ValueError, match=r"not a known activation.*'gelu_exact'"):
    activation_name(lambda y: y)
  with pytest.raises(ValueError, match="'mish' is not a known activation"):
    activation_name("mish")


def test_gated_linear_unit_rejects_bad_shapes():
  with pytest.raises(ValueError, match=r"weights.shape=\(8, 3, 4\)"):
    gated_linear_unit_xla(jnp.ones((2, 8)), jnp.ones((8, 3, 4)), activation="relu", fused=True)
