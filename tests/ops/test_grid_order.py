"""The Pallas Triton kernels give the same bits whatever order their grid's programs run
in (interpret_order.py): no two programs write one element with different values, and
none reads what another wrote. On the GPU the programs run in parallel, in any order;
interpret mode runs them one after another, so only a changed order shows a race."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import interpret_order
from stellarax.ops.attention import pallas_triton as attention
from stellarax.ops.gated_linear_unit import pallas_triton as glu
from stellarax.ops.normalization import pallas_triton as norms
from stellarax.ops.ragged_dot import pallas_triton as ragged


def _normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def test_a_racy_kernel_is_caught():
  # Every program writes its id to the same element: the last one wins.
  def last_writer(o_ref):
    o_ref[0] = pl.program_id(0) + 10 * pl.program_id(1)
  call = pl.pallas_call(last_writer, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(3, 4),
                        interpret=True)
  forward = int(jax.jit(call)()[0])
  with interpret_order.reversed_grid():
    backward = int(jax.jit(call)()[0])
  # Row-major: (2, 3) last. Reversed: (0, 0), then (2, 3) down to (0, 1), which is last.
  assert (forward, backward) == (32, 10)
  with pytest.raises(AssertionError, match="depends on the order"):
    interpret_order.assert_order_independent(jax.jit(call))


def test_an_independent_kernel_passes():
  def double(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i * 4, 4)] = x_ref[pl.ds(i * 4, 4)] * 2
  call = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct((12,), jnp.float32), grid=(3,),
                        interpret=True)
  out = interpret_order.assert_order_independent(jax.jit(call), jnp.arange(12.0))
  np.testing.assert_array_equal(out, 2 * np.arange(12.0))


@pytest.mark.parametrize("group_sizes", [
    (37, 0, 50, 40), pytest.param((5, 0, 9, 3, 0, 20, 60, 1), marks=pytest.mark.slow)])
def test_ragged_dot_kernels(group_sizes):
  # Groups not multiples of the tile, empty ones, rows past the last group: tiles that
  # share rows (the forward moves a tile up to end at row M) and split sums.
  g, m, k, n = len(group_sizes), 150, 70, 90
  keys = jax.random.split(jax.random.key(0), 3)
  lhs, rhs, dout = _normal(keys[0], (m, k)), _normal(keys[1], (g, k, n)), _normal(keys[2], (m, n))
  sizes = jnp.array(group_sizes, jnp.int32)
  tiles = dict(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=3)

  def kernels(lhs, rhs, dout, sizes):
    return (ragged.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, **tiles),
            ragged.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, split_k=2, **tiles),
            ragged.ragged_dot_dlhs_pallas_triton(dout, rhs, sizes, interpret=True, **tiles),
            ragged.ragged_dot_drhs_pallas_triton(lhs, dout, sizes, g, interpret=True, split_rows=2,
                                                 **tiles))
  interpret_order.assert_order_independent(jax.jit(kernels), lhs, rhs, dout, sizes)


def test_gated_linear_unit_kernels():
  # Ragged rows, columns and K: the backward's masked stores into the two halves of
  # one (M, 2N) array, whose edge tiles overlap the other half's columns.
  m, k, n = 70, 40, 45
  keys = jax.random.split(jax.random.key(2), 3)
  x, w, dout = _normal(keys[0], (m, k)), _normal(keys[1], (k, 2, n)), _normal(keys[2], (m, n))
  tiles = dict(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=3)

  def kernels(x, w, dout):
    return (glu.gated_linear_unit_pallas_triton(x, w, activation="silu", interpret=True, **tiles),
            glu.gated_linear_unit_bwd_pallas_triton(x, w, dout, activation="silu", interpret=True,
                                                    **tiles))
  interpret_order.assert_order_independent(jax.jit(kernels), x, w, dout)


def test_attention_kernels():
  # Causal GQA with key lengths and a query tail: the dK/dV programs of one kv head
  # each sum over its query heads, the dQ programs over their key blocks.
  b, t, heads, kv_heads, h = 2, 80, 4, 2, 64
  keys = jax.random.split(jax.random.key(1), 4)
  q = _normal(keys[0], (b, t, heads, h))
  kk, v = _normal(keys[1], (b, t, kv_heads, h)), _normal(keys[2], (b, t, kv_heads, h))
  dout = _normal(keys[3], (b, t, heads, h))
  lengths = jnp.array([80, 45], jnp.int32)
  options = dict(is_causal=True, key_value_seq_lengths=lengths)
  blocks = dict(block_q=32, block_k=32, num_warps=4, num_stages=2)

  def kernels(q, kk, v, dout):
    out, lse = attention.attention_fwd_pallas_triton(q, kk, v, interpret=True, **options, **blocks)
    grads = attention.attention_bwd_pallas_triton(q, kk, v, None, None, out, lse, dout,
                                                  interpret=True, **options, **blocks)
    return out, lse, grads
  interpret_order.assert_order_independent(jax.jit(kernels), q, kk, v, dout)


@pytest.mark.parametrize("block_cols", [256, 64])  # one chunk a row, or rows in chunks
def test_norm_kernels(block_cols):
  # Several row tiles a program (blocks_per_program) whose column sums each program
  # keeps in its own row of partials, with a ragged last tile.
  rows, cols = 37, 200
  keys = jax.random.split(jax.random.key(2), 4)
  x, dy = _normal(keys[0], (rows, cols)), _normal(keys[1], (rows, cols))
  scale, offset = _normal(keys[2], (cols,)), _normal(keys[3], (cols,))
  tiles = dict(block_rows=4, block_cols=block_cols, num_warps=4, num_stages=2)

  def kernels(x, scale, offset, dy):
    y, mean, rstd = norms.layer_norm_fwd_pallas_triton(x, scale, offset, interpret=True, **tiles)
    grads = norms.layer_norm_bwd_pallas_triton(x, scale, mean, rstd, dy, offset_dtype=offset.dtype,
                                               blocks_per_program=3, interpret=True, **tiles)
    y_rms, rstd_rms = norms.rms_norm_fwd_pallas_triton(x, scale, interpret=True, **tiles)
    rms_grads = norms.rms_norm_bwd_pallas_triton(x, scale, rstd_rms, dy, blocks_per_program=3,
                                                 interpret=True, **tiles)
    return y, mean, rstd, grads, y_rms, rstd_rms, rms_grads
  interpret_order.assert_order_independent(jax.jit(kernels), x, scale, offset, dy)
