"""The gated linear unit's Pallas Triton kernels: interpret mode on the CPU against the
float32 reference (forward and both gradients, awkward shapes, every activation), their
search space, the op classes through the framework, and lowering for a simulated H200."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h200 import lower_for_h200  # tests/ is on sys.path

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import MeasureOptions
from stellarax.ops import triton_matmul as tm
from stellarax.ops.gated_linear_unit import pallas_triton as gp
from stellarax.ops.gated_linear_unit import reference as ref

_ACTIVATIONS = ("silu", "gelu", "gelu_exact", "relu", "sigmoid", "tanh", "identity")
# Relative to the reference's largest magnitude: float32 is exact in interpret mode up
# to summation order (and erf's approximation); bfloat16 rounds the output and, in the
# backward, the pre-activations' gradients once.
_TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}


def _inputs(batch, k, n, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (*batch, k), jnp.float32)
  w = jax.random.normal(keys[1], (k, 2, n), jnp.float32) / np.sqrt(k)
  dout = jax.random.normal(keys[2], (*batch, n), jnp.float32)
  return x.astype(dtype), w.astype(dtype), dout.astype(dtype)


def _assert_close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape
  scale = max(float(np.max(np.abs(want))), 1e-6)
  err = float(np.max(np.abs(got - want))) / scale
  assert err <= tol, f"relative error {err:.3g} > {tol}"


def _reference_vjp(x, w, dout, activation):
  f = lambda a, b: ref.gated_linear_unit_reference(a, b, activation=activation)
  out, pull = jax.vjp(f, x.astype(jnp.float32), w.astype(jnp.float32))
  return out, *pull(dout.astype(jnp.float32))


@pytest.mark.parametrize("activation", _ACTIVATIONS)
def test_activation_formulas_match_jax(activation):
  """The kernels' explicit value and derivative of each activation match the
  reference's function and JAX's derivative of it."""
  g = jnp.concatenate([jnp.linspace(-6.0, 6.0, 601), jnp.array([0.0, 1e-3, -1e-3, 20.0, -20.0])])
  value, slope = gp.activation_and_derivative(activation, g)
  fn = ref.ACTIVATIONS[activation]
  np.testing.assert_allclose(value, fn(g), rtol=3e-7, atol=3e-7)
  want = jax.vmap(jax.grad(fn))(g)
  if activation == "relu":  # both agree that relu'(0) = 0
    assert float(slope[601]) == float(want[601]) == 0.0
  # 1 - tanh^2 cancels in float32 where tanh is near -1 or 1 (both sides then err
  # by up to 3e-6 from the float64 truth); a wrong formula errs by far more.
  np.testing.assert_allclose(slope, want, rtol=3e-7, atol=5e-6)


def test_an_unknown_activation_names_the_fix():
  with pytest.raises(ValueError, match="canonical name"):
    gp.activation_and_derivative("swiglu", jnp.ones(3))


@pytest.mark.parametrize("batch,k,n,dtype,activation,tunables", [
    # Sizes that are no multiple of any block, leading dims, one K step with a mask.
    ((3, 37), 70, 50, jnp.float32, "silu", {}),
    ((5,), 20, 130, jnp.float32, "gelu_exact", dict(block_m=16, block_n=64, block_k=32)),
    ((2, 5, 20), 96, 130, jnp.bfloat16, "gelu", {}),
    ((64,), 64, 64, jnp.float32, "relu", dict(block_m=32, block_n=32, block_k=16)),
    ((33,), 48, 17, jnp.bfloat16, "sigmoid", dict(block_m=16, block_n=16, block_k=16)),
], ids=["f32-ragged", "f32-wide-n", "bf16-batch", "f32-exact-tiles", "bf16-tiny-n"])
def test_forward_and_gradients_match_reference(batch, k, n, dtype, activation, tunables):
  x, w, dout = _inputs(batch, k, n, dtype, seed=len(batch) + k)
  t = gp.heuristic_tunables(math.prod(batch), k, n, dtype) | tunables
  out = gp.gated_linear_unit_pallas_triton(x, w, activation=activation, interpret=True, **t)
  dx, dw = gp.gated_linear_unit_bwd_pallas_triton(x, w, dout, activation=activation,
                                                  interpret=True, **t)
  want, want_dx, want_dw = _reference_vjp(x, w, dout, activation)
  assert out.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
  for got, expected in ((out, want), (dx, want_dx), (dw, want_dw)):
    _assert_close(got, expected, _TOL[dtype])


def test_op_runs_in_the_framework_with_gradients():
  """stellarax.gated_linear_unit with the Triton op, forward and jax.grad: the two
  ops are the ones called (captured in the program) and both match XLA."""
  x, w, dout = _inputs((2, 24), 40, 36, jnp.float32, seed=7)
  op = stellarax.PallasTritonGatedLinearUnit(interpret=True)

  def run(impl):
    f = lambda x, w: stellarax.gated_linear_unit(x, w, activation=jax.nn.gelu, implementation=impl)
    out, pull = jax.vjp(f, x, w)
    return out, *pull(dout)

  for got, want in zip(run(op), run("xla")):
    _assert_close(got, want, 2e-6)
  names = [b.op.name for b in autotuning.get_bound_args(lambda x, w: run(op), x, w)]
  assert names == ["gated_linear_unit.pallas_triton", "gated_linear_unit.pallas_triton_vjp"]


def test_unsupported_operands_fall_back_and_empty_ones_give_zeros():
  op = stellarax.PallasTritonGatedLinearUnit(interpret=True)
  x, w, _ = _inputs((4,), 16, 8, jnp.float32)
  with pytest.raises(NotImplementedError, match="bfloat16, float16, float32 for both"):
    gp.PallasTritonGatedLinearUnit.bind(x, w.astype(jnp.bfloat16))
  mixed = stellarax.gated_linear_unit(x, w.astype(jnp.bfloat16), implementation=[op, "xla"])
  _assert_close(mixed, stellarax.gated_linear_unit(x, w.astype(jnp.bfloat16)), 1e-6)
  for xs, ws in (((0, 16), (16, 2, 8)), ((4, 0), (0, 2, 8)), ((4, 16), (16, 2, 0))):
    x0, w0 = jnp.ones(xs), jnp.ones(ws)
    out = stellarax.gated_linear_unit(x0, w0, implementation=op)
    assert out.shape == (xs[0], ws[2]) and not np.any(np.asarray(out))
    grads = jax.grad(lambda a, b: stellarax.gated_linear_unit(a, b, implementation=op).sum(),
                     argnums=(0, 1))(x0, w0)
    assert [g.shape for g in grads] == [xs, ws] and not any(np.any(np.asarray(g)) for g in grads)


def test_kernel_calls_refuse_bad_input_with_the_fix():
  x, w, dout = _inputs((4,), 16, 8, jnp.float32)
  t = gp.heuristic_tunables(4, 16, 8, jnp.float32)
  call = lambda *a, **kw: gp.gated_linear_unit_pallas_triton(*a, activation="silu", interpret=True, **(t | kw))
  with pytest.raises(ValueError, match="Cast weights to float32"):
    call(x, w.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r"weights of shape \(K, 2, N\)"):
    call(x, w[:, :1])
  with pytest.raises(ValueError, match="block_m=48"):
    call(x, w, block_m=48)
  with pytest.raises(ValueError, match="empty dimension"):
    call(x[:0], w)
  with pytest.raises(ValueError, match="not a known activation"):
    gp.gated_linear_unit_pallas_triton(x, w, activation="swiglu", interpret=True, **t)
  with pytest.raises(ValueError, match=r"dout.shape=\(4, 9\) must be"):
    gp.gated_linear_unit_bwd_pallas_triton(x, w, jnp.ones((4, 9)), activation="silu",
                                           interpret=True, **t)


@pytest.mark.parametrize("m,k,n,dtype", [
    (8192, 4096, 14336, jnp.bfloat16),  # an MoE-sized MLP projection
    (16, 4096, 14336, jnp.bfloat16),    # decode: few rows
    (100, 40, 24, jnp.float32),
])
def test_search_space_is_valid_for_the_shape(m, k, n, dtype):
  space = gp.tunable_space(m, k, n, dtype)
  assert space[0] == gp.heuristic_tunables(m, k, n, dtype)
  assert len(space) == len({tuple(t.values()) for t in space}) >= 4
  itemsize = jnp.dtype(dtype).itemsize
  for t in space:
    tm.validate_tunables(**t)
    assert tm.acc_fits(t["block_m"], 2 * t["block_n"], t["num_warps"]), t
    assert tm.smem_bytes(t["block_m"], t["block_n"], t["block_k"], t["num_stages"], itemsize,
                         rhs_tiles=2) <= tm.SMEM_BYTES, t
    for name, size in (("block_m", m), ("block_n", n), ("block_k", k)):
      assert t[name] <= max(16, 1 << (size - 1).bit_length()), (name, t)


@pytest.mark.slow  # ~6 s of interpreted kernels; the heuristic configs run fast above
def test_extreme_configs_of_the_space_run():
  """The smallest and the largest tiles the space offers for a small problem give
  the reference's result."""
  x, w, dout = _inputs((40,), 72, 48, jnp.bfloat16, seed=11)
  space = gp.tunable_space(40, 72, 48, jnp.bfloat16)
  area = lambda t: t["block_m"] * t["block_n"] * t["block_k"]
  want, want_dx, want_dw = _reference_vjp(x, w, dout, "silu")
  for t in (min(space, key=area), max(space, key=area)):
    out = gp.gated_linear_unit_pallas_triton(x, w, activation="silu", interpret=True, **t)
    dx, dw = gp.gated_linear_unit_bwd_pallas_triton(x, w, dout, activation="silu", interpret=True, **t)
    for got, expected in ((out, want), (dx, want_dx), (dw, want_dw)):
      _assert_close(got, expected, _TOL[jnp.bfloat16])


@pytest.mark.parametrize("precision", [None, "highest"])
def test_precision_reaches_the_kernel_dots(precision):
  x, w, _ = _inputs((8,), 16, 8, jnp.float32)
  op = stellarax.PallasTritonGatedLinearUnit(interpret=True)
  loss = lambda a, b: stellarax.gated_linear_unit(a, b, precision=precision, implementation=op).sum()
  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
  dots, highest = text.count("dot_general["), text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)")
  assert dots >= 4 + 2  # two per kernel (gate and linear), then dx and dweights in XLA
  assert highest == (dots if precision else 0)


def test_tuning_measures_configs_of_the_space_and_keeps_one():
  x, w, _ = _inputs((24,), 32, 40, jnp.float32, seed=5)
  ba = stellarax.PallasTritonGatedLinearUnit(interpret=True).bind(x, w, activation="tanh")
  space = ba.autotuning_configs
  assert ba.heuristics_config in space
  fast = MeasureOptions(rounds=1, leader_rounds=0, warmup_s=0.0, max_total_s=0.2, min_batch_s=0.0)
  result = stellarax.Autotuner(strategy="random", budget_s=3, progress=False,
                               measure_options=fast).autotune([ba])
  (entry,) = list(result)
  assert entry.measurements and all(m.status == "ok" for _, m in entry.measurements)
  assert result.best_config(ba) in space


@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
def test_kernels_lower_for_h200(kernel):
  m, k, n, dtype = 8192, 4096, 14336, jnp.bfloat16
  t = gp.heuristic_tunables(m, k, n, dtype)
  x = jax.ShapeDtypeStruct((m, k), dtype)
  w = jax.ShapeDtypeStruct((k, 2, n), dtype)
  if kernel == "fwd":
    text = lower_for_h200(lambda x, w: gp.gated_linear_unit_pallas_triton(x, w, activation="silu", **t), x, w)
  else:
    dout = jax.ShapeDtypeStruct((m, n), dtype)
    text = lower_for_h200(lambda x, w, d: gp.gated_linear_unit_bwd_pallas_triton(x, w, d, activation="gelu_exact", **t),
                          x, w, dout)
  assert f'name = "gated_linear_unit_{kernel}"' in text
  assert f"num_stages = 3 : i32, num_warps = {t['num_warps']} : i32" in text
  assert f"grid_x = {(m // t['block_m']) * (n // t['block_n'])} : i32" in text
