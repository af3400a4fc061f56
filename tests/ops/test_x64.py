"""The Pallas kernels in a process with `jax_enable_x64` on.

There a Python int met by an int32 index is int64, and `lax.div`/`lax.rem` refuse the
pair: every kernel but the norms failed to trace ("lax.div requires arguments to have
the same dtypes, got int32, int64"), so a user with 64-bit types on got an error from
`implementation=` and XLA's speed from dispatch. The kernels now index through
`stellarax.ops.index_math`, and the Mosaic GPU ragged_dot kernels (whose jax pipeline
helper has the same fault) are traced with 64-bit types off.

Numerics run in interpret mode where jax's interpreter allows it under x64; jax's
Triton-style interpreter itself fails on the attention kernel's stores there
(`_swap_discharge_rule` mixes int32 and int64 starts; jax 0.11.2), so attention is
checked by lowering for a simulated H200, which is what runs on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h200 import lower_for_h200  # tests/ is on sys.path

import stellarax
from stellarax.ops import index_math
from stellarax.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuAttention
from stellarax.ops.attention.pallas_triton import PallasTritonAttention
from stellarax.ops.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from stellarax.ops.normalization.pallas_triton import PallasTritonLayerNorm
from stellarax.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from stellarax.ops.ragged_dot.pallas_triton import PallasTritonRaggedDot


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _close(got, want, tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=tol, atol=tol)


def test_index_math_takes_python_ints_as_int32_under_x64(x64):
  i = jnp.arange(-5, 6, dtype=jnp.int32)
  assert index_math.div(i, 3).dtype == jnp.int32
  np.testing.assert_array_equal(index_math.div(i, 3), [-1, -1, -1, 0, 0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(index_math.rem(i, 3), [-2, -1, 0, -2, -1, 0, 1, 2, 0, 1, 2])
  np.testing.assert_array_equal(index_math.cdiv(jnp.arange(7, dtype=jnp.int64), 3),
                                [0, 1, 1, 1, 2, 2, 2])
  assert index_math.cdiv(7, jnp.int64(2)).dtype == jnp.int32


@pytest.mark.slow  # CI's slow stage (`make test` within 10 minutes on two cores)
def test_triton_ragged_dot_and_gated_linear_unit_run_under_x64(x64):
  k = jax.random.split(jax.random.key(0), 4)
  lhs = jax.random.normal(k[0], (70, 32), jnp.float32)
  rhs = jax.random.normal(k[1], (3, 32, 48), jnp.float32)
  sizes = jnp.array([20, 0, 40], jnp.int64)  # Sums to less than M; an empty group.
  op = PallasTritonRaggedDot(interpret=True)

  def loss(f):
    return lambda a, b: (f(a, b) ** 2).sum()

  ours = jax.value_and_grad(loss(lambda a, b: stellarax.ragged_dot(a, b, sizes, implementation=op)),
                            (0, 1))(lhs, rhs)
  want = jax.value_and_grad(loss(lambda a, b: jax.lax.ragged_dot(a, b, sizes)), (0, 1))(lhs, rhs)
  _close(ours, want, 1e-4)

  x = jax.random.normal(k[2], (37, 32), jnp.float32)
  w = jax.random.normal(k[3], (32, 2, 24), jnp.float32) / 6
  glu = PallasTritonGatedLinearUnit(interpret=True)
  _close(jax.grad(lambda x: stellarax.gated_linear_unit(x, w, implementation=glu).sum())(x),
         jax.grad(lambda x: stellarax.gated_linear_unit(x, w, implementation="xla").sum())(x), 1e-4)


def test_interpreting_triton_attention_under_x64_is_refused_so_a_list_moves_on(x64):
  # jax's interpreter failed deep in the kernel's stores (a TypeError no list passes by).
  q = jax.random.normal(jax.random.key(1), (1, 16, 2, 64), jnp.float32)
  out = stellarax.dot_product_attention(
      q, q, q, implementation=[PallasTritonAttention(interpret=True), "xla"])
  np.testing.assert_allclose(out, jax.nn.dot_product_attention(q, q, q), rtol=1e-5, atol=1e-5)
  with pytest.raises(NotImplementedError, match="interpret mode with jax_enable_x64 on"):
    stellarax.dot_product_attention(q, q, q, implementation=PallasTritonAttention(interpret=True))


def _attention_grad(op):
  def f(q):
    out = stellarax.dot_product_attention(q, q, q, is_causal=True, implementation=op)
    return out.astype(jnp.float32).sum()
  return jax.grad(f)


def _ragged_dot_grads(op):
  def f(lhs, rhs, sizes):
    def loss(a, b):
      # Squared, so that the gradient needs the forward's output: jax 0.12 drops a forward
      # kernel whose output nothing reads (the gradient of a plain sum).
      out = stellarax.ragged_dot(a, b, sizes, implementation=op).astype(jnp.float32)
      return (out * out).sum()
    return jax.grad(loss, (0, 1))(lhs, rhs)
  return f


@pytest.mark.parametrize("op", [PallasTritonAttention(), PallasMosaicGpuAttention()],
                         ids=["triton", "mosaic_gpu"])
def test_attention_forward_and_backward_lower_for_h200_under_x64(x64, op):
  q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  text = lower_for_h200(_attention_grad(op), q)
  assert text.count("stablehlo.custom_call") >= 2  # Forward and backward kernels.


@pytest.mark.parametrize("op", [PallasTritonRaggedDot(), PallasMosaicGpuRaggedDot()],
                         ids=["triton", "mosaic_gpu"])
def test_ragged_dot_forward_and_backward_lower_for_h200_under_x64(x64, op):
  S = jax.ShapeDtypeStruct
  text = lower_for_h200(_ragged_dot_grads(op), S((512, 256), jnp.bfloat16),
                        S((4, 256, 512), jnp.bfloat16), S((4,), jnp.int64))
  assert text.count("stablehlo.custom_call") >= 3  # Forward, d lhs and d rhs kernels.


def test_norm_lowers_for_h200_under_x64(x64):
  op = PallasTritonLayerNorm()
  grad = jax.grad(lambda x: stellarax.rms_norm(x, jnp.ones(512, jnp.bfloat16),
                                               implementation=op).astype(jnp.float32).sum())
  assert "stablehlo.custom_call" in lower_for_h200(grad, jax.ShapeDtypeStruct((64, 512), jnp.bfloat16))


def test_float64_calls_are_tuned_under_x64(x64, user_cache_dir):
  # Inside `jax.enable_x64(True)` (a thread's setting) the compile threads traced float64
  # arguments as float32, and every config's output was "of another dtype"; with x64 on,
  # the float64 output check (rtol 1e-7) failed every config against the float32
  # reference (ops compute float64 inputs at float32 precision).
  keys = jax.random.split(jax.random.key(2), 2)
  lhs = jax.random.normal(keys[0], (48, 32), jnp.float64)
  rhs = jax.random.normal(keys[1], (4, 32, 16), jnp.float64)
  group_sizes = jnp.array([20, 0, 28, 0], jnp.int32)
  (entry,) = stellarax.Autotuner(budget_s=1, progress=False).autotune(
      stellarax.XlaRaggedDot.bind(lhs, rhs, group_sizes))
  assert entry.bound_args.arguments["lhs"].dtype == "float64"
  assert entry.num_failed == 0, entry.measurements
