"""Tests of the Pallas Triton layer_norm / rms_norm kernels.

The kernels run in Pallas interpret mode on the CPU and are compared with a
float32 reference written here; a last group lowers them for a simulated H200
(no GPU needed) to check they produce the Triton custom call with the config.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h200 import lower_for_h200  # tests/ is on sys.path

from stellarax.ops.normalization import pallas_triton as pt

EPSILON = 1e-6
# Tolerance relative to the largest reference magnitude, by the dtype of the
# kernel's inputs and outputs: float32 differs only by summation order, bf16 also
# by the final rounding of the outputs (2**-8 relative).
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 1.6e-2}


@pytest.fixture(autouse=True)
def _strict_promotion():
  with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
    yield


# ---------------------------------------------------------------------------
# References (float32, plain jnp).
# ---------------------------------------------------------------------------


def _axes(ndim: int, axis) -> tuple[int, ...]:
  return tuple(sorted(a % ndim for a in ((axis,) if isinstance(axis, int) else axis)))


def _param(p, ndim, axis):
  """A scale or offset (x's sizes along the axes) as float32, broadcastable against x."""
  axes = _axes(ndim, axis)
  shape = [1] * ndim
  for a, size in zip(axes, p.shape):
    shape[a] = size
  return p.astype(jnp.float32).reshape(shape)


def _affine(y, scale, offset, axis):
  if scale is not None:
    y = y * _param(scale, y.ndim, axis)
  if offset is not None:
    y = y + _param(offset, y.ndim, axis)
  return y


def _layer_norm_ref(x, scale, offset, *, axis):
  x = x.astype(jnp.float32)
  mean = jnp.mean(x, axis=axis, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=axis, keepdims=True) + EPSILON)
  return _affine(y, scale, offset, axis)


def _rms_norm_ref(x, scale, offset, *, axis):
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=axis, keepdims=True) + EPSILON)
  return _affine(y, scale, offset, axis)


def _f32(a):
  return None if a is None else a.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames="axis")
def _layer_norm_expected(x, scale, offset, dy, *, axis):
  """Reference (y, mean, rstd, (dx, dscale, doffset)) in float32; one compile per case."""
  x32 = _f32(x)
  y, vjp = jax.vjp(functools.partial(_layer_norm_ref, axis=axis), x32, _f32(scale), _f32(offset))
  mean = jnp.mean(x32, axis=axis)
  rstd = jax.lax.rsqrt(jnp.var(x32, axis=axis) + EPSILON)
  return y, mean, rstd, vjp(_f32(dy))


@functools.partial(jax.jit, static_argnames="axis")
def _rms_norm_expected(x, scale, offset, dy, *, axis):
  """Reference (y, rstd, (dx, dscale, doffset)) in float32; one compile per case."""
  x32 = _f32(x)
  y, vjp = jax.vjp(functools.partial(_rms_norm_ref, axis=axis), x32, _f32(scale), _f32(offset))
  rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axis) + EPSILON)
  return y, rstd, vjp(_f32(dy))


def _assert_close(actual, expected, dtype, what):
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  tol = TOLERANCE[jnp.dtype(dtype)]
  expected = np.asarray(expected, np.float32)
  scale = float(np.max(np.abs(expected))) if expected.size else 1.0
  np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=tol,
                             atol=tol * scale, err_msg=what)


def _inputs(shape, axis, dtype, seed):
  """Fresh random x, scale, offset, dy; x has a non-zero mean so centring matters."""
  kx, ks, ko, kd = jax.random.split(jax.random.key(seed), 4)
  pshape = tuple(shape[a] for a in _axes(len(shape), axis))
  x = (1.5 * jax.random.normal(kx, shape) + 0.7).astype(dtype)
  scale = (1.0 + 0.5 * jax.random.normal(ks, pshape)).astype(dtype)
  offset = jax.random.normal(ko, pshape).astype(dtype)
  dy = jax.random.normal(kd, shape).astype(dtype)
  return x, scale, offset, dy


def _fwd_tunables(tunables):
  return {k: v for k, v in tunables.items() if k not in ("blocks_per_program", "prefetch")}


# Shapes with ragged rows and columns (37 rows, 200 columns), a leading batch,
# a normalised axis that is not last, exact multiples (no masks at all), and
# chunked rows (block_cols < cols) with several row tiles per backward program.
_CHUNKED = dict(block_rows=4, block_cols=64, num_warps=4, num_stages=2, blocks_per_program=3)
_CASES = {
    "37x200-f32-heuristic": ((37, 200), -1, jnp.float32, {}),
    "37x200-bf16-chunked": ((37, 200), -1, jnp.bfloat16, _CHUNKED),
    "3x5x96-bf16": ((3, 5, 96), -1, jnp.bfloat16, {}),
    "64x512-f32-exact": ((64, 512), -1, jnp.float32, dict(block_rows=8, blocks_per_program=2)),
    "5x96x3-f32-axis1": ((5, 96, 3), 1, jnp.float32, {}),
    # Rows shorter than the shortest chunk (MIN_BLOCK_COLS): masked within one.
    "7x3-f32-short": ((7, 3), -1, jnp.float32, {}),
    "5x1-bf16-one-column": ((5, 1), -1, jnp.bfloat16, {}),
    # Several normalised axes, adjacent or not, flattened into one row (and a
    # row of 8 * 64 read in 64-column chunks).
    "4x6x40-bf16-axes12": ((4, 6, 40), (1, 2), jnp.bfloat16, {}),
    "6x20x5-f32-axes02": ((6, 20, 5), (0, 2), jnp.float32, {}),
    "13x8x64-f32-axes12-chunked": ((13, 8, 64), (-2, -1), jnp.float32, _CHUNKED),
    # The backward's prefetch: an odd number of tiles a program (the last one after the
    # loop) with ragged rows and a program past the last tile, an even number with no
    # masks at all, and one tile a program (no loop).
    "37x200-bf16-prefetch-odd": ((37, 200), -1, jnp.bfloat16,
                                 dict(block_rows=4, blocks_per_program=3, prefetch=True)),
    "64x512-f32-prefetch-even": ((64, 512), -1, jnp.float32,
                                 dict(block_rows=4, blocks_per_program=4, prefetch=True)),
    "9x96-bf16-prefetch-one": ((9, 96), -1, jnp.bfloat16,
                               dict(block_rows=2, blocks_per_program=1, prefetch=True)),
}


def _cases(*with_params):
  """Every case with scale/offset present; the given variants on a few cases.

  Args:
    *with_params: (case names, flags) pairs; flags are appended to the case's
      parameters in addition to the all-present flags.
  """
  params = []
  for name, case in _CASES.items():
    for flags in [(True,) * len(with_params[0][1])] + [f for names, f in with_params if name in names]:
      label = "-".join(str(f)[0] for f in flags)
      params.append(pytest.param(*case, *flags, id=f"{name}-{label}"))
  return params


# Each absent parameter is tested in both dtypes; a missing scale also with
# chunked rows, where only doffset has partial sums.
_LAYER_NORM_CASES = _cases(
    (("3x5x96-bf16", "5x96x3-f32-axis1"), (True, False)),
    (("37x200-f32-heuristic", "37x200-bf16-chunked"), (False, True)),
)
_RMS_NORM_CASES = _cases(
    (("37x200-bf16-chunked", "64x512-f32-exact"), (False, False)),
    (("37x200-f32-heuristic", "3x5x96-bf16"), (True, False)),
)


@pytest.mark.parametrize("shape,axis,dtype,tunables,with_scale,with_offset", _LAYER_NORM_CASES)
def test_layer_norm_matches_reference(shape, axis, dtype, tunables, with_scale, with_offset):
  x, scale, offset, dy = _inputs(shape, axis, dtype, seed=sum(shape))
  scale = scale if with_scale else None
  offset = offset if with_offset else None

  ref_y, ref_mean, ref_rstd, ref_grads = _layer_norm_expected(x, scale, offset, dy, axis=axis)

  # Forward and backward in one jit: one compile instead of one per eager op.
  @jax.jit
  def run(x, scale, offset, dy):
    y, mean, rstd = pt.layer_norm_fwd_pallas_triton(
        x, scale, offset, axis=axis, epsilon=EPSILON, interpret=True, **_fwd_tunables(tunables))
    grads = pt.layer_norm_bwd_pallas_triton(
        x, scale, mean, rstd, dy, offset_dtype=None if offset is None else offset.dtype,
        axis=axis, interpret=True, **tunables)
    return y, mean, rstd, grads

  y, mean, rstd, grads = run(x, scale, offset, dy)
  assert y.dtype == x.dtype and mean.dtype == rstd.dtype == jnp.float32
  _assert_close(y, ref_y, dtype, "y")
  _assert_close(mean, ref_mean, jnp.float32, "mean")
  _assert_close(rstd, ref_rstd, jnp.float32, "rstd")
  _assert_grads_close(grads, ref_grads, (x, scale, offset), dtype)


def _assert_grads_close(grads, ref_grads, primals, dtype):
  """Each grad matches its reference in its primal's dtype, or is None with it."""
  for grad, ref, primal, name in zip(grads, ref_grads, primals, ("dx", "dscale", "doffset")):
    if primal is None:
      assert grad is None, name
    else:
      assert grad.dtype == primal.dtype, name
      _assert_close(grad, ref, dtype, name)


@pytest.mark.parametrize("shape,axis,dtype,tunables,with_scale,with_offset", _RMS_NORM_CASES)
def test_rms_norm_matches_reference(shape, axis, dtype, tunables, with_scale, with_offset):
  x, scale, offset, dy = _inputs(shape, axis, dtype, seed=3 * sum(shape))
  scale = scale if with_scale else None
  offset = offset if with_offset else None

  ref_y, ref_rstd, ref_grads = _rms_norm_expected(x, scale, offset, dy, axis=axis)

  @jax.jit
  def run(x, scale, offset, dy):
    y, rstd = pt.rms_norm_fwd_pallas_triton(
        x, scale, offset, axis=axis, epsilon=EPSILON, interpret=True, **_fwd_tunables(tunables))
    grads = pt.rms_norm_bwd_pallas_triton(
        x, scale, rstd, dy, offset_dtype=None if offset is None else offset.dtype, axis=axis,
        interpret=True, **tunables)
    return y, rstd, grads

  y, rstd, grads = run(x, scale, offset, dy)
  assert y.dtype == x.dtype and rstd.dtype == jnp.float32
  _assert_close(y, ref_y, dtype, "y")
  _assert_close(rstd, ref_rstd, jnp.float32, "rstd")
  _assert_grads_close(grads, ref_grads, (x, scale, offset), dtype)


def test_no_rows_gives_empty_outputs_and_zero_grads():
  x = jnp.zeros((0, 3, 16), jnp.float32)
  scale = jnp.ones((16,), jnp.float32)
  y, mean, rstd = pt.layer_norm_fwd_pallas_triton(x, scale, scale, interpret=True)
  assert y.shape == x.shape and mean.shape == rstd.shape == (0, 3)
  dx, dscale, doffset = pt.layer_norm_bwd_pallas_triton(
      x, scale, mean, rstd, x, offset_dtype=jnp.float32, interpret=True)
  assert dx.shape == x.shape
  np.testing.assert_array_equal(dscale, np.zeros(16))
  np.testing.assert_array_equal(doffset, np.zeros(16))


# ---------------------------------------------------------------------------
# Tunables.
# ---------------------------------------------------------------------------

SPACE_SHAPES = [(8192, 8192), (37, 200), (3, 5), (4096, 1024), (100_000, 128), (16, 65_536),
                (1, 40_000), (9, 1)]


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows,cols", SPACE_SHAPES)
def test_space_is_valid_and_holds_the_heuristic(rows, cols, dtype, backward):
  heuristic = pt.heuristic_tunables(rows, cols, dtype, backward=backward)
  space = pt.tunable_space(rows, cols, dtype, backward=backward)
  assert heuristic in space
  assert 1 <= len(space) <= 40
  assert len({tuple(sorted(c.items())) for c in space}) == len(space)
  config_cls = pt.PallasTritonLayerNormVjpConfig if backward else pt.PallasTritonLayerNormConfig
  for config in space:
    assert ("blocks_per_program" in config) == ("prefetch" in config) == backward
    pt.check_tunables(rows, cols, **config)
    config_cls(**config)  # what the op resolves must be a valid config too


@pytest.mark.parametrize("backward", [False, True])
def test_space_of_the_target_shape_is_big_enough_to_tune(backward):
  space = pt.tunable_space(8192, 8192, jnp.bfloat16, backward=backward)
  assert len(space) >= 7
  # One 8192-column row per chunk, never looped, for the bandwidth target shape.
  assert {c["block_cols"] for c in space} == {8192}
  if backward:  # both code paths, so that tuning (and gpu_check's variants) weigh them
    assert {c["prefetch"] for c in space} == {False, True}
    assert pt.heuristic_tunables(8192, 8192, jnp.bfloat16, backward=True)["prefetch"]


def test_chunked_rows_never_prefetch():
  assert not any(c["prefetch"] for c in pt.tunable_space(16, 65_536, jnp.bfloat16, backward=True))
  assert not pt.heuristic_tunables(16, 65_536, jnp.bfloat16, backward=True)["prefetch"]
  # A caller's chunk leaves the heuristic's prefetch off rather than failing.
  x, rstd = jnp.ones((4, 256), jnp.float32), jnp.ones((4,), jnp.float32)
  dx, _, _ = pt.rms_norm_bwd_pallas_triton(x, None, rstd, x, block_cols=64, interpret=True)
  assert dx.shape == x.shape


def test_long_rows_are_chunked():
  config = pt.heuristic_tunables(4, 100_000, jnp.bfloat16)
  assert config["block_cols"] <= pt.MAX_BLOCK_COLS < 100_000


@pytest.mark.parametrize("overrides,match", [
    (dict(block_rows=3), r"block_rows=3 must be a power of two <= 32 \(next_power_of_2\(rows=20\)\)"),
    (dict(block_rows=64), r"block_rows=64 must be a power of two <= 32"),
    (dict(block_cols=96), r"block_cols=96 must be a power of two <= 256"),
    (dict(block_cols=512), r"block_cols=512 must be a power of two <= 256"),
    (dict(block_rows=32, block_cols=256, num_warps=4), None),
    (dict(num_warps=3), r"num_warps=3 must be one of"),
    (dict(num_stages=0), r"num_stages=0 must be an int in \[1, 8\]"),
    (dict(blocks_per_program=0), r"blocks_per_program=0 must be a positive int"),
    (dict(block_rows=16, blocks_per_program=4), r"blocks_per_program=4 exceeds the 2 row tiles"),
    (dict(prefetch=1), r"prefetch=1 must be True or False"),
    (dict(block_cols=64, prefetch=True),
     r"prefetch=True needs each row read in one chunk, but block_cols=64 < cols=200; pass "
     r"prefetch=False, or block_cols=256"),
])
def test_check_tunables_names_the_bad_value(overrides, match):
  config = dict(block_rows=8, block_cols=256, num_warps=4, num_stages=2, blocks_per_program=1,
                prefetch=False)
  config.update(overrides)
  if match is None:
    pt.check_tunables(20, 200, **config)
  else:
    with pytest.raises(ValueError, match=match):
      pt.check_tunables(20, 200, **config)


def test_check_tunables_limits_the_tile():
  with pytest.raises(ValueError, match=r"block_rows \* block_cols = 4 \* 16384 exceeds 32768"):
    pt.check_tunables(64, 16384, block_rows=4, block_cols=16384, num_warps=16, num_stages=1)


def test_wrappers_reject_bad_inputs():
  x = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"scale must have shape \(8,\)"):
    pt.layer_norm_fwd_pallas_triton(x, jnp.ones((7,)), None, interpret=True)
  with pytest.raises(ValueError, match=r"axis=2 must be an int or a non-empty tuple of ints in \[-2, 2\)"):
    pt.rms_norm_fwd_pallas_triton(x, None, axis=2, interpret=True)
  with pytest.raises(ValueError, match=r"is empty"):
    pt.rms_norm_fwd_pallas_triton(jnp.ones((4, 0)), None, interpret=True)
  with pytest.raises(ValueError, match=r"dy must have x's shape"):
    pt.rms_norm_bwd_pallas_triton(x, None, jnp.ones((4,)), jnp.ones((4, 9)), interpret=True)
  with pytest.raises(ValueError, match=r"rstd must have shape \(4,\)"):
    pt.rms_norm_bwd_pallas_triton(x, None, jnp.ones((8,)), x, interpret=True)
  with pytest.raises(ValueError, match=r"needs the forward's mean"):
    pt.layer_norm_bwd_pallas_triton(x, None, None, jnp.ones((4,)), x, offset_dtype=None)
  with pytest.raises(ValueError, match=r"num_warps=5 must be one of"):
    pt.layer_norm_fwd_pallas_triton(x, None, None, num_warps=5, interpret=True)


# ---------------------------------------------------------------------------
# Lowering for a simulated H200.
# ---------------------------------------------------------------------------

_TRITON_CALL = re.compile(r"custom_call @__gpu\$xla\.gpu\.triton\(.*?num_warps = (\d+)")


def _lower_for_h200(fn, *args) -> str:
  """StableHLO text of `fn(*args)` lowered for CUDA on an abstract H200."""
  return lower_for_h200(fn, *(jax.ShapeDtypeStruct(*a) for a in args))


@pytest.mark.parametrize("rows,cols,tunables", [
    (8192, 8192, {}),
    (6, 40_000, dict(block_rows=2, block_cols=4096, num_warps=8, num_stages=3,
                     blocks_per_program=2)),
])
def test_lowers_to_triton_for_h200(rows, cols, tunables):
  bf16, f32 = jnp.bfloat16, jnp.float32
  x, vec, stat = ((rows, cols), bf16), ((cols,), bf16), ((rows,), f32)
  bwd_config = tunables or pt.heuristic_tunables(rows, cols, bf16, backward=True)
  fwd_config = _fwd_tunables(tunables) or pt.heuristic_tunables(rows, cols, bf16)
  lowered = {
      "ln_fwd": _lower_for_h200(functools.partial(
          pt.layer_norm_fwd_pallas_triton, **fwd_config), x, vec, vec),
      "rms_fwd": _lower_for_h200(functools.partial(
          pt.rms_norm_fwd_pallas_triton, **fwd_config), x, vec),
      "ln_bwd": _lower_for_h200(functools.partial(
          pt.layer_norm_bwd_pallas_triton, offset_dtype=bf16, **bwd_config),
          x, vec, stat, stat, x),
      "rms_bwd": _lower_for_h200(functools.partial(
          pt.rms_norm_bwd_pallas_triton, **bwd_config), x, vec, stat, x),
  }
  for name, text in lowered.items():
    calls = _TRITON_CALL.findall(text)
    config = fwd_config if name.endswith("fwd") else bwd_config
    assert calls == [str(config["num_warps"])], (name, calls)
