"""Both Pallas attention kernels on rows that a huge negative bias masks, against jax.

A bias of -1e9 over a whole query row made the row's log-sum-exp lose log2(row sum) in
float32, so the backward took each of the row's probabilities as 1 instead of 1/S (dQ,
dK and dV off by up to S times); a bias of finfo.min overflowed to -inf in base 2 and
the row gave 0 instead of jax's mean(V). The kernels now floor biased logits
(flash_blocks.BIASED_LOGIT_FLOOR). Rows here: ordinary ones, -1e9, finfo.min, -1e4
(jax's result, not floored), -1e9 on half the keys, a boolean mask and -1e9 together,
and a row masked whole by the boolean mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuAttention
from stellarax.ops.attention.pallas_triton import PallasTritonAttention

_T = 64
_ROWS = {"-1e9": 3, "finfo.min": 7, "-1e4": 13, "half -1e9": 20, "mask and -1e9": 25,
         "mask": 30}


def _inputs(dtype):
  k = jax.random.split(jax.random.key(0), 5)
  q, key, value, dout = (jax.random.normal(k[i], (1, _T, 2, 64), jnp.float32).astype(dtype)
                         for i in range(4))
  bias = jax.random.normal(k[4], (1, 2, _T, _T), jnp.float32)
  r = _ROWS
  bias = (bias.at[:, :, r["-1e9"]].set(-1e9)
          .at[:, :, r["finfo.min"]].set(float(np.finfo(np.float32).min))
          .at[:, :, r["-1e4"]].set(-1e4)
          .at[:, :, r["half -1e9"], ::2].set(-1e9)
          .at[:, :, r["mask and -1e9"]].set(-1e9))
  mask = np.ones((1, 1, _T, _T), bool)
  mask[..., r["mask and -1e9"], :10] = False  # The -1e9 keys are the ones kept.
  mask[..., r["mask"], :] = False
  return q, key, value, dout, bias, jnp.asarray(mask)


@pytest.mark.parametrize("op,dtype,tol", [
    pytest.param(PallasTritonAttention(interpret=True), jnp.float32, 2e-3, id="triton"),
    pytest.param(PallasMosaicGpuAttention(interpret=True), jnp.bfloat16, 1.5e-2,
                 id="mosaic_gpu", marks=pytest.mark.mosaic_interpret),
])
def test_rows_masked_by_a_huge_negative_bias_match_jax(op, dtype, tol):
  q, key, value, dout, bias, mask = _inputs(dtype)

  def ours(q, k, v, b):
    return stellarax.dot_product_attention(q, k, v, b, mask, implementation=op)

  def ref(q, k, v, b):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return jax.nn.dot_product_attention(*f32, b, mask)

  out, pull = jax.vjp(ours, q, key, value, bias)
  with jax.default_matmul_precision("highest"):
    want, pull_ref = jax.vjp(ref, q, key, value, bias)
    want_grads = pull_ref(dout.astype(jnp.float32))
  grads = pull(dout)
  for name, got, exp in zip(("out", "dq", "dk", "dv", "dbias"), (out, *grads),
                            (want, *want_grads)):
    got, exp = np.asarray(got, np.float32), np.asarray(exp, np.float32)
    assert np.isfinite(got).all(), name
    # Relative to the largest magnitude: before the floor, dq was 11x off on the
    # -1e9 row and out 0.24 off on the finfo.min row.
    err = np.abs(got - exp).max() / np.abs(exp).max()
    assert err < tol, (name, err)


def test_a_row_biased_minus_inf_averages_its_kept_values():
  """A bias of -inf over a whole row gives NaN in jax; the kernels floor it to the
  mean of V like any whole-row bias mask (documented in flash_blocks)."""
  q, key, value, dout, bias, _ = _inputs(jnp.float32)
  bias = bias.at[:, :, 5].set(-jnp.inf)
  op = PallasTritonAttention(interpret=True)
  out, pull = jax.vjp(lambda q, k, v: stellarax.dot_product_attention(
      q, k, v, bias, implementation=op), q, key, value)
  np.testing.assert_allclose(out[0, 5], value[0].mean(axis=0), rtol=1e-5, atol=1e-5)
  assert all(np.isfinite(g).all() for g in pull(dout))


@pytest.mark.parametrize("op", [
    pytest.param(PallasTritonAttention(interpret=True), id="triton"),
    pytest.param(PallasMosaicGpuAttention(interpret=True), id="mosaic_gpu",
                 marks=pytest.mark.mosaic_interpret),
])
@pytest.mark.parametrize("dtype,huge", [(jnp.float16, 7e4), (jnp.bfloat16, 3e38)])
def test_a_bias_above_float16_s_range_attends_to_its_key_as_jax(op, dtype, huge):
  # The Mosaic GPU kernels' per-query bias tile is stored in the inputs' dtype: 7e4
  # became float16's +inf, and its query row NaN; 3e38, finite in bfloat16, overflowed
  # once scaled by log2(e). jax (float32 logits) gives v[key].
  q, key, value, _, _, _ = _inputs(dtype)
  bias = jnp.zeros((1, 1, _T, _T), jnp.float32).at[0, 0, 5, 3].set(huge)
  out = stellarax.dot_product_attention(q, key, value, bias, implementation=op)
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out[0, 5], np.asarray(value[0, 3], np.float32), atol=1e-3)


@pytest.mark.parametrize("op,dtype,tol", [
    pytest.param(PallasTritonAttention(interpret=True), jnp.float32, 2e-3, id="triton"),
    pytest.param(PallasMosaicGpuAttention(interpret=True), jnp.bfloat16, 2e-2,
                 id="mosaic_gpu", marks=pytest.mark.mosaic_interpret),
])
@pytest.mark.parametrize("per_query", [False, True], ids=["mask per key", "mask per query"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["mask", "mask and bias"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_keys_under_the_mask_are_ignored_as_jax(op, dtype, tol, per_query,
                                                           with_bias):
  # The Mosaic GPU kernels added -inf to a masked logit, and NaN + -inf is NaN: a NaN
  # or infinite key under the mask gave NaN rows, where jax selects.
  q, key, value, dout, _, _ = _inputs(dtype)
  # An ordinary bias: the huge rows of _inputs meet jax's finfo.min for masked logits.
  bias = jax.random.normal(jax.random.key(1), (1, 2, _T, _T), jnp.float32)
  key = key.at[0, 4, 0].set(jnp.nan).at[0, 9, 1].set(jnp.inf)
  mask = np.ones((1, 1, _T if per_query else 1, _T), bool)
  mask[..., [4, 9]] = False
  mask[..., 0, 11] = False  # A per-query mask differs between rows.
  bias = bias if with_bias else None
  operands = (q, key, value) + ((bias,) if with_bias else ())

  def ours(q, k, v, b=None):
    return stellarax.dot_product_attention(q, k, v, b, jnp.asarray(mask),
                                           implementation=op)

  def ref(q, k, v, b=None):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return jax.nn.dot_product_attention(*f32, b, jnp.asarray(mask))

  out, pull = jax.vjp(ours, *operands)
  with jax.default_matmul_precision("highest"):
    want, pull_ref = jax.vjp(ref, *operands)
    want_grads = pull_ref(dout.astype(jnp.float32))
  grads = pull(dout)
  # dq is NaN in jax too (the masked column of dlogits is 0, and 0 x NaN is NaN).
  names = ("out", "dq", "dk", "dv", "dbias")
  for name, got, exp in zip(names, (out, *grads), (want, *want_grads)):
    if name == "dq":
      continue
    got, exp = np.asarray(got, np.float32), np.asarray(exp, np.float32)
    assert np.isfinite(exp).all(), name
    np.testing.assert_allclose(got, exp, atol=tol * np.abs(exp).max(), err_msg=name)
