"""Pallas Triton op classes through the framework, in interpret mode on CPU:
public functions with `implementation=`, gradients through their VJP ops,
capture, and a small tuning run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning.measure import MeasureOptions
from stellarax.ops.attention.pallas_triton import PallasTritonAttention, PallasTritonAttentionConfig
from stellarax.ops.normalization.pallas_triton import PallasTritonLayerNorm


def _close(a, b, tol=2e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_layer_norm_pallas_matches_xla_with_gradients():
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (37, 200)) * 2 + 1
  s, o = jax.random.normal(k[1], (200,)), jax.random.normal(k[2], (200,))
  op = PallasTritonLayerNorm(interpret=True)
  _close(stellarax.layer_norm(x, s, o, implementation=op), stellarax.layer_norm(x, s, o))
  _close(stellarax.rms_norm(x, s, implementation=op), stellarax.rms_norm(x, s))
  loss = lambda impl: lambda x, s, o: (stellarax.layer_norm(x, s, o, implementation=impl) ** 2).sum()
  _close(jax.grad(loss(op), argnums=(0, 1, 2))(x, s, o), jax.grad(loss("xla"), argnums=(0, 1, 2))(x, s, o), 1e-4)
  names = [b.op.name for b in autotuning.get_bound_args(jax.grad(loss(op)), x, s, o)]
  assert names == ["layer_norm.pallas_triton", "layer_norm.pallas_triton_vjp"]


@pytest.mark.parametrize("axis,subtract_mean", [((1, 2), True), ((0, 2), False), (1, False)],
                         ids=["layer-trailing-axes", "rms-split-axes", "rms-middle-axis"])
def test_norm_pallas_over_several_axes_and_rms_with_offset(axis, subtract_mean):
  """Several normalised axes (adjacent or not) and rms_norm with an offset: both
  run in the Triton kernel (not an XLA fallback) and match XLA, gradients too."""
  k = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(k[0], (5, 6, 24)) * 1.5 + 0.5
  axes = (axis,) if isinstance(axis, int) else axis
  pshape = tuple(x.shape[a] for a in axes)
  s, o = jax.random.normal(k[1], pshape) + 1.0, jax.random.normal(k[2], pshape)
  dy = jax.random.normal(k[3], x.shape)
  op = PallasTritonLayerNorm(interpret=True)

  def norm(x, s, o, impl):
    if subtract_mean:
      return stellarax.layer_norm(x, s, o, axis=axis, implementation=impl)
    return stellarax.rms_norm(x, s, offset=o, axis=axis, implementation=impl)

  def vjp(impl):
    y, pull = jax.vjp(lambda x, s, o: norm(x, s, o, impl), x, s, o)
    return y, pull(dy)

  _close(vjp(op), vjp("xla"), 1e-4)
  names = [b.op.name for b in autotuning.get_bound_args(lambda x, s, o: vjp(op), x, s, o)]
  assert names == ["layer_norm.pallas_triton", "layer_norm.pallas_triton_vjp"]


@pytest.mark.slow  # ~10 s; a bias's gradient runs fast in test_public_ops
def test_attention_pallas_matches_jax_with_bias_gradient():
  k = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(k[0], (1, 80, 4, 64))
  kv = jax.random.normal(k[1], (1, 80, 2, 64))
  bias = jax.random.normal(k[2], (1, 4, 80, 80))
  op = PallasTritonAttention(interpret=True, config=PallasTritonAttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=2))
  _close(stellarax.dot_product_attention(q, kv, kv, bias, is_causal=True, implementation=op),
         jax.nn.dot_product_attention(q, kv, kv, bias, is_causal=True))
  loss = lambda f: lambda q, kv, b: (f(q, kv, kv, b, is_causal=True) ** 2).sum()
  ours = jax.grad(loss(lambda *a, **kw: stellarax.dot_product_attention(*a, **kw, implementation=op)), argnums=(0, 1, 2))
  _close(ours(q, kv, bias), jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(q, kv, bias), 1e-4)


def test_attention_pallas_rejects_unsupported_head_dims_for_dispatch():
  q = jnp.ones((1, 8, 2, 24))
  with pytest.raises(NotImplementedError, match="head dim 24"):
    PallasTritonAttention.bind(q, q, q)
  out = stellarax.dot_product_attention(q, q, q, implementation=[PallasTritonAttention(interpret=True), "xla"])
  assert out.shape == q.shape


def test_tuning_a_pallas_call_in_interpret_mode():
  x = jax.random.normal(jax.random.key(2), (64, 512))
  ba = PallasTritonLayerNorm(interpret=True).bind(x, None, None)
  space = sorted(ba.autotuning_configs, key=repr)[:3]

  def first_three(space_, measure, *, heuristic, budget_s):
    from stellarax.autotuning import search
    return search.exhaustive([heuristic, *space], measure, heuristic=heuristic)

  fast = MeasureOptions(rounds=1, leader_rounds=0, warmup_s=0.0, max_total_s=0.2, min_batch_s=0.0)
  result = stellarax.Autotuner(strategy=first_three, progress=False, measure_options=fast).autotune([ba])
  (entry,) = list(result)
  assert all(m.status == "ok" for _, m in entry.measurements)
  assert entry.best_config in set(space) | {ba.heuristics_config}


def test_ragged_dot_pallas_matches_lax_with_gradients():
  from stellarax.ops.ragged_dot.pallas_triton import PallasTritonRaggedDot, PallasTritonRaggedDotConfig
  k = jax.random.split(jax.random.key(3), 2)
  lhs = jax.random.normal(k[0], (100, 48))
  rhs = jax.random.normal(k[1], (4, 48, 40))
  gs = jnp.array([30, 0, 45, 10], jnp.int32)
  op = PallasTritonRaggedDot(interpret=True, config=PallasTritonRaggedDotConfig(
      block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2))
  ref = lambda l, r: jax.lax.ragged_dot(l, r, gs, precision=jax.lax.Precision.HIGHEST)
  _close(stellarax.ragged_dot(lhs, rhs, gs, implementation=op), ref(lhs, rhs), 1e-4)
  loss = lambda f: lambda l, r: (f(l, r) ** 2).sum()
  ours = jax.grad(loss(lambda l, r: stellarax.ragged_dot(l, r, gs, implementation=op)), argnums=(0, 1))(lhs, rhs)
  _close(ours, jax.grad(loss(ref), argnums=(0, 1))(lhs, rhs), 1e-3)


def test_tuning_a_vjp_op_uses_residuals_its_forward_computed():
  # Random residuals (rstd) would make the correct kernel look wrong.
  x = jax.random.normal(jax.random.key(4), (64, 256))
  s = jnp.ones((256,))
  op = PallasTritonLayerNorm(interpret=True)
  loss = lambda x, s: jnp.sum(jnp.sin(stellarax.rms_norm(x, s, implementation=op)))
  (vjp,) = [b for b in autotuning.get_bound_args(jax.grad(loss), x, s) if b.op.name.endswith("_vjp")]
  values = vjp.example_values()
  np.testing.assert_allclose(values["out"], stellarax.rms_norm(values["x"], values["scale"]), rtol=1e-5, atol=1e-5)
  fast = MeasureOptions(rounds=1, leader_rounds=0, warmup_s=0.0, max_total_s=0.1, min_batch_s=0.0)
  entry = stellarax.Autotuner(progress=False, measure_options=fast, strategy="random", budget_s=5).tune_one(vjp)
  assert entry.best_time is not None
