"""Pallas Triton flash attention against jax.nn.dot_product_attention.

Kernels run in the Pallas interpreter on small, awkward shapes with few large blocks; a
last test lowers them for a simulated H200 without a GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu

import stellarax
from h200 import H200_MESH  # tests/ is on sys.path
from stellarax.ops.attention import pallas_triton as pt
from stellarax.ops.attention import reference

# (atol, rtol) against a float32 reference, per input dtype.
_FWD_TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 2e-2), jnp.float16: (4e-3, 4e-3)}
_BWD_TOL = {jnp.float32: (1e-4, 1e-4), jnp.bfloat16: (6e-2, 5e-2), jnp.float16: (1e-2, 1e-2)}

# The interpreter's programs are large and run for milliseconds: optimising them costs
# more than it saves, so tests compile them with XLA's cheapest settings.
_FAST_COMPILE = {"xla_backend_optimization_level": 0,
                 "xla_llvm_disable_expensive_passes": True}


def _run_fast(fn, *args):
  return jax.jit(fn).lower(*args).compile(_FAST_COMPILE)(*args)


def _next_pow2(x):
  return 1 << (x - 1).bit_length()


_FWD_TUNABLES = dict(block_q=64, block_k=32, num_warps=4, num_stages=2)
_BWD_TUNABLES = dict(block_q=32, block_k=64, num_warps=4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  b: int = 2
  t: int = 100
  s: int = 100
  n: int = 2
  k: int = 2
  h: int = 64
  dtype: type = jnp.float32
  causal: bool = False
  bias_shape: tuple | None = None
  mask_shape: tuple | None = None
  q_lens: tuple | None = None
  kv_lens: tuple | None = None
  window: int | tuple | None = None


CASES = [
    # GQA, T and S not multiples of the blocks, causal: block skipping, unmasked inner
    # blocks, masked diagonal and tail blocks.
    Case("causal_gqa_f32", n=4, k=2, causal=True),
    # Non-causal, T != S, head dim 128, a key-padding style bias broadcast over N and T.
    Case("full_bias_bf16_h128", b=1, t=64, s=160, h=128, dtype=jnp.bfloat16,
         bias_shape=(1, 1, 1, 160)),
    # Bias per head and query, mask per batch with fully masked rows (built in _inputs),
    # query lengths cutting rows and a kv length of 0 that masks all of batch 1.
    Case("bias_mask_lengths_f32", t=70, s=90, n=2, k=1, bias_shape=(1, 2, 70, 90),
         mask_shape=(2, 1, 70, 90), q_lens=(60, 70), kv_lens=(50, 0)),
    # T > S + left: the last rows see no key at all.
    Case("window_f32", t=130, s=100, window=(20, 5)),
    # MQA, causal sliding window, float16.
    Case("window_causal_mqa_fp16", b=1, t=128, s=128, n=4, k=1, dtype=jnp.float16,
         causal=True, window=16),
]


def _inputs(case: Case, seed: int = 0):
  """Fresh normal q, k, v, dout in the case's dtype, and its float32 bias and bool mask."""
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (case.b, case.t, case.n, case.h), jnp.float32)
  k = jax.random.normal(keys[1], (case.b, case.s, case.k, case.h), jnp.float32)
  v = jax.random.normal(keys[2], (case.b, case.s, case.k, case.h), jnp.float32)
  do = jax.random.normal(keys[3], (case.b, case.t, case.n, case.h), jnp.float32)
  q, k, v, do = (x.astype(case.dtype) for x in (q, k, v, do))
  bias = mask = None
  if case.bias_shape is not None:
    bias = jax.random.normal(keys[4], case.bias_shape, jnp.float32)
  if case.mask_shape is not None:
    mask = jax.random.bernoulli(keys[5], 0.7, case.mask_shape)
    mask = mask.at[..., 3, :].set(False).at[..., -1, :].set(False)  # fully masked rows
  return q, k, v, do, bias, mask


def _options(case: Case) -> tuple[dict, dict]:
  """(static options, sequence-length arrays) of a case."""
  as_lens = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
  static = dict(is_causal=case.causal, local_window_size=case.window)
  lengths = dict(query_seq_lengths=as_lens(case.q_lens),
                 key_value_seq_lengths=as_lens(case.kv_lens))
  return static, lengths


def _reference(q, k, v, do, bias, mask, lengths, static):
  """float32 jax.nn.dot_product_attention: out, lse (B, N, T) and (dq, dk, dv)."""

  def run(q, k, v, do, bias, mask, lengths):
    q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, mask, **static,
                                                          **lengths)
    out, vjp = jax.vjp(attend, q, k, v)
    _, lse = jax.nn.dot_product_attention(q, k, v, bias, mask, return_residual=True,
                                          **static, **lengths)
    return out, lse.transpose(0, 2, 1), vjp(do)

  with jax.default_matmul_precision("highest"):
    return _run_fast(run, q, k, v, do, bias, mask, lengths)


def _kernels(q, k, v, do, bias, mask, lengths, static):
  """The forward and backward kernels in the interpreter: out, lse and (dq, dk, dv)."""

  def run(q, k, v, do, bias, mask, lengths):
    options = dict(static, **lengths, interpret=True)
    out, lse = pt.attention_fwd_pallas_triton(q, k, v, bias, mask, **options,
                                              **_FWD_TUNABLES)
    grads = pt.attention_bwd_pallas_triton(q, k, v, bias, mask, out, lse, do, **options,
                                           **_BWD_TUNABLES)
    return out, lse, grads

  return _run_fast(run, q, k, v, do, bias, mask, lengths)


def _close(name, actual, expected, tol):
  atol, rtol = tol
  # Scale atol with the reference's magnitude so big gradients are held to the same
  # relative standard as small ones.
  atol = atol * max(1.0, float(jnp.max(jnp.abs(expected))))
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected),
                             atol=atol, rtol=rtol, err_msg=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_backward_match_reference(case):
  inputs = _inputs(case)
  static, lengths = _options(case)
  out, lse, grads = _kernels(*inputs, lengths, static)
  ref_out, ref_lse, ref_grads = _reference(*inputs, lengths, static)

  assert out.dtype == case.dtype and lse.dtype == jnp.float32
  assert [g.dtype for g in grads] == [case.dtype] * 3
  _close("out", out, ref_out, _FWD_TOL[case.dtype])
  # lse of fully masked rows is about -2.4e38 in both; rtol covers it.
  np.testing.assert_allclose(lse, ref_lse, atol=1e-4 if case.dtype == jnp.float32 else 2e-2,
                             rtol=1e-5, err_msg="lse")
  for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
    _close(name, g, ref, _BWD_TOL[case.dtype])


def test_fully_masked_rows_follow_jax():
  """A row with no kept key is mean(V) with lse = MASK_VALUE; past q_len it is zero."""
  case = Case("dead", b=1, t=40, s=50, n=1, k=1, q_lens=(30,))
  q, k, v, _, _, _ = _inputs(case, seed=3)
  _, lengths = _options(case)
  mask = jnp.ones((1, 1, 40, 50), bool).at[:, :, 5, :].set(False)
  out, lse = _run_fast(lambda q, k, v, mask, lengths: pt.attention_fwd_pallas_triton(
      q, k, v, None, mask, **lengths, interpret=True, **_FWD_TUNABLES), q, k, v, mask, lengths)
  np.testing.assert_allclose(out[0, 5, 0], v[0, :, 0].mean(axis=0), atol=1e-5, rtol=1e-5)
  assert lse[0, 0, 5] == pt.MASK_VALUE
  assert not np.any(out[0, 30:]) and np.all(lse[0, 0, 30:] == pt.MASK_VALUE)


@pytest.mark.slow  # ~7 s of interpreted kernels; int32 lengths run fast in the other tests
def test_op_takes_sequence_lengths_of_any_integer_dtype():
  """The kernels take int32 lengths; the op casts others (int16 here), as the Mosaic GPU
  op does: the Triton op raised the kernel's ValueError, which dispatch does not pass."""
  q = jax.random.normal(jax.random.key(4), (2, 40, 2, 64))
  lengths = jnp.array([30, 17], jnp.int16)
  op = pt.PallasTritonAttention(interpret=True)

  def attend(implementation):
    return lambda q: stellarax.dot_product_attention(
        q, q, q, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        implementation=implementation)

  np.testing.assert_allclose(attend(op)(q), attend("xla")(q), atol=2e-5, rtol=2e-5)
  loss = lambda impl: lambda q: (attend(impl)(q) ** 2).sum()
  np.testing.assert_allclose(jax.grad(loss(op))(q), jax.grad(loss("xla"))(q), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_q=48), "block_q=48"),
    (dict(block_k=512), "block_k=512"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
    (dict(local_window_size=(-1, 2)), "local_window_size"),
    (dict(mask=jnp.ones((1, 1, 8, 16), jnp.int32)), "mask dtype"),
    (dict(bias=jnp.ones((3, 1, 8, 16))), "bias has shape"),
    (dict(query_seq_lengths=jnp.ones((1,), jnp.int16)), "query_seq_lengths"),
])
def test_invalid_arguments_raise_clear_errors(kwargs, match):
  q = jnp.ones((1, 8, 2, 64), jnp.float32)
  k = jnp.ones((1, 16, 1, 64), jnp.float32)
  args = dict(_FWD_TUNABLES, interpret=True) | kwargs
  with pytest.raises(ValueError, match=match):
    pt.attention_fwd_pallas_triton(q, k, k, **args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_q=512), "block_q=512 must be one of"),
    (dict(num_warps=32), "num_warps=32 must be one of"),
    (dict(num_stages=9), "num_stages=9 must be an int in"),
])
def test_a_config_the_kernels_refuse_is_refused_when_made(kwargs, match):
  # The configs took any power of two (block 512, 32 warps), which the kernels refused
  # only when called; and their own check replaced the kernels' by name.
  with pytest.raises(ValueError, match=match):
    stellarax.PallasTritonAttention.config_cls(**(dict(_FWD_TUNABLES) | kwargs))
  vjp = dict(block_q=32, block_k=32, block_q_dq=32, block_k_dq=32, num_warps=4, num_stages=2)
  with pytest.raises(ValueError, match=match):
    stellarax.PallasTritonAttentionVjp.config_cls(**(vjp | kwargs))
  with pytest.raises(ValueError, match=match):
    pt.check_fwd_tunables(**(dict(_FWD_TUNABLES) | kwargs))


def test_unsupported_shapes_raise():
  with pytest.raises(ValueError, match="head dim H=96"):
    x = jnp.ones((1, 8, 1, 96))
    pt.attention_fwd_pallas_triton(x, x, x, **_FWD_TUNABLES)
  with pytest.raises(ValueError, match="multiple of the number of kv heads"):
    q, k = jnp.ones((1, 8, 3, 64)), jnp.ones((1, 8, 2, 64))
    pt.attention_fwd_pallas_triton(q, k, k, **_FWD_TUNABLES)
  with pytest.raises(ValueError, match="lse has shape"):
    x = jnp.ones((1, 8, 1, 64))
    pt.attention_bwd_pallas_triton(x, x, x, None, None, x, jnp.ones((1, 8, 1)), x,
                                   **_BWD_TUNABLES)


_TARGET = (jax.ShapeDtypeStruct((2, 8192, 16, 128), jnp.bfloat16),
           jax.ShapeDtypeStruct((2, 8192, 16, 128), jnp.bfloat16))


@pytest.mark.parametrize("h,dtype,t", [(128, jnp.bfloat16, 8192), (64, jnp.float16, 1000),
                                       (256, jnp.bfloat16, 4096), (256, jnp.float32, 2048),
                                       (128, jnp.float32, 40)])
@pytest.mark.parametrize("backward", [False, True])
def test_tunable_spaces_are_valid_and_contain_the_heuristic(h, dtype, t, backward):
  q = jax.ShapeDtypeStruct((2, t, 16, h), dtype)
  k = jax.ShapeDtypeStruct((2, t, 4, h), dtype)
  check = pt.check_bwd_tunables if backward else pt.check_fwd_tunables
  configs = pt.tunable_space(q, k, backward=backward)
  assert configs[0] == pt.heuristic_tunables(q, k, backward=backward)
  assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
  if t >= 1000:
    assert 10 <= len(configs) <= 40, len(configs)
  for c in configs:
    check(**c)
    assert all(c[name] <= max(16, _next_pow2(t)) for name in c if name.startswith("block"))
    if not backward:
      # Accumulator and logits within 160 floats a thread: at 192 (128 x 64 blocks of
      # head dim 128 on 4 warps) the forward spilled registers on an H200.
      assert c["block_q"] * (h + c["block_k"]) <= 160 * 32 * c["num_warps"], c


def test_tunables_of_the_target_shape():
  """B=2, T=8192, 16 heads of 128, bf16: the shape the H200 targets are set for."""
  q, k = _TARGET
  assert pt.heuristic_tunables(q, k) == dict(block_q=128, block_k=64, num_warps=8,
                                             num_stages=3)
  assert pt.heuristic_tunables(q, k, backward=True) == dict(
      block_q=32, block_k=128, block_q_dq=128, block_k_dq=32, num_warps=8, num_stages=3)
  with pytest.raises(ValueError, match="head dim 96"):
    pt.tunable_space(jax.ShapeDtypeStruct((1, 8, 1, 96), jnp.bfloat16), k)


def test_lowers_for_simulated_h200():
  """Forward and backward lower to Triton custom calls for an H200 without a GPU."""
  mesh = H200_MESH
  q, k = _TARGET
  lse = jax.ShapeDtypeStruct((2, 16, 8192), jnp.float32)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  bias = jax.ShapeDtypeStruct((1, 16, 8192, 8192), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 1, 1, 8192), jnp.bool_)
  fwd_cfg = pt.heuristic_tunables(q, k)
  bwd_cfg = pt.heuristic_tunables(q, k, backward=True)

  def fwd(q, k, v):
    return pt.attention_fwd_pallas_triton(q, k, v, is_causal=True, **fwd_cfg)

  def bwd(q, k, v, out, lse, dout, bias, mask, lens):
    return pt.attention_bwd_pallas_triton(
        q, k, v, bias, mask, out, lse, dout, local_window_size=(256, 0),
        query_seq_lengths=lens, key_value_seq_lengths=lens, **bwd_cfg)

  with jax.sharding.use_abstract_mesh(mesh):
    fwd_text = jax.jit(fwd).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    bwd_text = jax.jit(bwd).trace(q, k, k, q, lse, q, bias, mask, lens).lower(
        lowering_platforms=("cuda",)).as_text()
  target = plgpu.CUSTOM_CALL_TARGET_NAME
  assert fwd_text.count(target) == 1
  assert bwd_text.count(target) == 3  # preprocess, dK/dV, dQ


def test_negative_windows_fall_back_through_dispatch():
  """jax takes windows with a negative side; the kernels do not, so dispatch moves on."""
  keys = jax.random.split(jax.random.key(9), 3)
  q, k, v = (jax.random.normal(key, (1, 16, 2, 64)) for key in keys)
  op = pt.PallasTritonAttention(interpret=True)
  with pytest.raises(NotImplementedError, match="negative side"):
    op.bind(q, k, v, local_window_size=(3, -1))
  out = stellarax.dot_product_attention(q, k, v, local_window_size=(3, -1),
                                        implementation=[op, "xla"])
  np.testing.assert_allclose(out, reference.attention_reference(q, k, v, local_window_size=(3, -1)),
                             atol=1e-5, rtol=1e-5)
