"""Reverse-mode derivatives where no VJP op computes them: an op without a VJP op of
its own (as a user writes one), and second derivatives (the forward pass and the VJP op
differentiated by JAX, `calling._differentiated_by_jax`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import stellarax
from stellarax import autotuning
from stellarax.core.config import config_dataclass
from stellarax.ops.gated_linear_unit.reference import gated_linear_unit_reference
from stellarax.ops.ragged_dot.reference import ragged_dot_reference

HIGHEST = jax.lax.Precision.HIGHEST


@config_dataclass
class _ScaleConfig:
  block_rows: int = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class JnpPolynomial(stellarax.Op, name="test_differentiation.polynomial"):
  """A user's op without a VJP op: x ** power * (1 + rows), with integer `rows`
  (an input with no gradient) and a static `power`."""

  config_cls = _ScaleConfig

  def _fwd(self, x, rows, power: int = 3, *, config):
    return x ** power * (1 + rows[:, None].astype(x.dtype)), None

  def _get_heuristics_config(self, ba):
    return _ScaleConfig()

  def _get_autotuning_configs(self, ba):
    return {_ScaleConfig(block_rows=b) for b in (8, 16)}

  def _reference(self, x, rows, power=3):
    return x ** power * (1 + rows[:, None].astype(x.dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasDouble(stellarax.Op, name="test_differentiation.pallas_double"):
  """A user's Pallas kernel without a VJP op: JAX cannot differentiate pallas_call."""

  config_cls = _ScaleConfig

  def _fwd(self, x, *, config):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2
    spec = pl.BlockSpec((config.block_rows, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], config.block_rows),), in_specs=[spec],
                          out_specs=spec, interpret=True)(x), None

  def _get_heuristics_config(self, ba):
    return _ScaleConfig()


def _normal(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _close(a, b, rtol=2e-4, atol=2e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_an_op_without_a_vjp_op_is_differentiated_through_its_implementation():
  x, rows = _normal((16, 8), 0), jnp.arange(16, dtype=jnp.int32) % 3
  op = JnpPolynomial()
  loss = lambda x: jnp.sum(jnp.sin(op(x, rows, 3)))
  want = lambda x: jnp.sum(jnp.sin(x ** 3 * (1 + rows[:, None])))
  _close(jax.grad(loss)(x), jax.grad(want)(x))
  _close(jax.jit(jax.grad(loss))(x), jax.grad(want)(x))
  batched = jax.vmap(jax.grad(loss))(jnp.stack([x, -x]))
  _close(batched, jnp.stack([jax.grad(want)(x), jax.grad(want)(-x)]))
  # The integer input gets no gradient, and differentiating with respect to it is
  # refused by JAX as for any integer input.
  grad_x, grad_rows = jax.grad(lambda x, r: jnp.sum(op(x, r)), argnums=(0, 1),
                               allow_int=True)(x, rows)
  assert grad_rows.dtype == jax.dtypes.float0
  _close(grad_x, 3 * x ** 2 * (1 + rows[:, None]))


def test_the_gradient_program_still_names_the_forward_call_and_tunes_it():
  x, rows = _normal((16, 8), 1), jnp.arange(16, dtype=jnp.int32) % 3
  grad = jax.grad(lambda x: jnp.sum(JnpPolynomial()(x, rows, 2)))
  found = autotuning.get_bound_args(grad, x)
  assert [ba.op.name for ba in found] == ["test_differentiation.polynomial"]
  result = stellarax.Autotuner(budget_s=2, progress=False).autotune(grad, x)
  assert len(result) == 1 and next(iter(result)).best_config in found[0].autotuning_configs
  with result:
    _close(jax.jit(grad)(x), 2 * x * (1 + rows[:, None]))


def test_an_op_jax_cannot_differentiate_says_which_and_what_to_do():
  x = _normal((16, 8), 2)
  _close(PallasDouble()(x), 2 * x)
  with pytest.raises(NotImplementedError, match=r"PallasDouble \(test_differentiation"
                     r".pallas_double\).*it has no VJP op.*vjp_cls"):
    jax.grad(lambda x: jnp.sum(PallasDouble()(x)))(x)


def _second_derivative(f, *args):
  """d/dx of sum(d/dx sum(f)) * 3-ish: the gradient of a function of the gradient, with
  respect to every float argument."""
  argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
  inner = jax.grad(lambda *a: jnp.sum(jnp.tanh(f(*a))), argnums=argnums)
  return jax.grad(lambda *a: sum(jnp.sum(g ** 2) for g in inner(*a)), argnums=argnums)(*args)


def _layer_norm(x, scale, offset):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale[None] + offset[None]


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


@pytest.mark.parametrize("family", ["layer_norm", "rms_norm", "ragged_dot",
                                    pytest.param("attention", marks=pytest.mark.slow),  # CI's
                                    "gated_linear_unit"])
def test_second_derivatives_of_xla_implementations_match_jax(family):
  x, w = _normal((12, 16), 3), _normal((16,), 4)
  if family == "layer_norm":
    args = (x, w, _normal((16,), 5))
    ours = lambda x, s, o: stellarax.layer_norm(x, s, o, implementation="xla")
    want = _layer_norm
  elif family == "rms_norm":
    args = (x, w)
    ours = lambda x, s: stellarax.rms_norm(x, s, implementation="xla")
    want = lambda x, s: _rms_norm(x, s[None])
  elif family == "ragged_dot":
    sizes = jnp.array([5, 0, 4], jnp.int32)  # an empty group, sizes summing to less than M
    args = (x, _normal((3, 16, 8), 6))
    ours = lambda l, r: stellarax.ragged_dot(l, r, sizes, implementation="xla")
    want = lambda l, r: ragged_dot_reference(l, r, sizes)
  elif family == "attention":
    q, k, v = (_normal((1, 8, 2, 16), s) for s in (7, 8, 9))
    args = (q, k, v)
    ours = lambda q, k, v: stellarax.dot_product_attention(q, k, v, is_causal=True,
                                                           implementation="xla")
    want = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  else:
    args = (x, _normal((16, 2, 8), 10))
    ours = lambda x, w: stellarax.gated_linear_unit(x, w, activation="silu",
                                                    implementation="xla")
    want = lambda x, w: gated_linear_unit_reference(x, w, activation="silu")
  with jax.default_matmul_precision("highest"):
    got, expected = _second_derivative(ours, *args), _second_derivative(want, *args)
    vmapped = jax.vmap(lambda a0: _second_derivative(ours, a0, *args[1:]))(
        jnp.stack([args[0], 0.5 * args[0]]))
    expected_half = _second_derivative(want, 0.5 * args[0], *args[1:])
  for g, e in zip(got, expected):
    _close(g, e, rtol=2e-3, atol=2e-4)
  for g, e0, e1 in zip(vmapped, expected, expected_half):
    _close(g[0], e0, rtol=2e-3, atol=2e-4)
    _close(g[1], e1, rtol=2e-3, atol=2e-4)


def test_a_second_derivative_through_a_pallas_kernel_says_how_to_get_one():
  x = _normal((16, 32), 11)
  op = stellarax.PallasTritonLayerNorm(interpret=True)
  f = lambda x: stellarax.rms_norm(x, None, implementation=op)
  _close(jax.grad(lambda x: jnp.sum(f(x) ** 3))(x),
         jax.grad(lambda x: jnp.sum(_rms_norm(x, 1.0) ** 3))(x), rtol=1e-3, atol=1e-4)
  with pytest.raises(NotImplementedError, match=r"PallasTritonLayerNorm.*second derivative "
                     r"differentiates the forward pass too.*implementation=\"xla\""):
    _second_derivative(f, x)
