"""Pallas Triton kernels for the gated linear unit: activation(x @ w[:, 0]) * (x @ w[:, 1]).

  gated_linear_unit_pallas_triton      out = act(x @ Wg) * (x @ Wl)          (M, N)
  gated_linear_unit_bwd_pallas_triton  dx (M, K) and dweights (K, 2, N)

The forward is one matmul kernel with two float32 accumulators: each program loads
an x tile once per K step and multiplies it by the matching tiles of the gate and
the linear weights, then applies the activation and the product in its epilogue.
So x is read once, and the two (M, N) projections never reach memory (XLA's fused
form writes the (M, 2N) projection and reads it back for the elementwise part).

The backward recomputes both projections with the same loop (nothing but x and the
weights is kept from the forward) and writes, in its epilogue, the gradients of the
pre-activations, d_gate = dout * linear * act'(gate) and d_linear = dout *
act(gate), as one (M, 2N) array in x's dtype. dx and dweights are then two plain
matmuls against it, which XLA runs on cuBLAS:

  dx = d_pre @ W.reshape(K, 2N).T        dweights = x.T @ d_pre

Shapes need not be multiples of the blocks: the row, column and K edges are
masked only when the size is not a multiple of its block (decided statically).
Programs run in the grouped (L2-friendly) order of `triton_matmul.swizzle`.

Activations are computed in the kernel from explicit formulas for the value and
its derivative (`activation_and_derivative`): Pallas Triton has no lowering for
`lax.erf`, so the exact GELU uses a rational approximation of erf (absolute error
below 2e-7, Abramowitz and Stegun 7.1.26).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.core.config import config_dataclass
from stellarax.ops import common
from stellarax.ops import pallas_backends
from stellarax.ops import pallas_common
from stellarax.ops import triton_matmul as tm
from stellarax.ops.gated_linear_unit import base as _base
from stellarax.ops.gated_linear_unit.reference import activation_name, check_glu_shapes

pltriton = pallas_backends.triton

_KERNEL = "gated_linear_unit"
# Each program holds two block_m x block_n float32 accumulators (gate and linear).
_ACCUMULATORS = 2


# --------------------------------------------------------------------------- activations

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
# erf(x) ~ 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-x^2), t = 1 / (1 + p x),
# for x >= 0 (Abramowitz and Stegun, 7.1.26; absolute error <= 1.5e-7).
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x: jax.Array) -> jax.Array:
  """erf in operations Pallas Triton lowers (it has no rule for `lax.erf`)."""
  ax = jnp.abs(x)
  t = 1.0 / (1.0 + _ERF_P * ax)
  poly = functools.reduce(lambda acc, a: acc * t + a, reversed(_ERF_A[:-1]), _ERF_A[-1])
  e = 1.0 - t * poly * jnp.exp(-ax * ax)
  return jnp.where(x < 0, -e, e)


def activation_and_derivative(name: str, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An activation's value and derivative at `g`, in operations the kernels lower.

  Args:
    name: a canonical activation name (`reference.activation_name`).
    g: float32 pre-activations.

  Returns:
    (act(g), act'(g)), float32; they match `reference.ACTIVATIONS[name]` and its JAX
    derivative (the exact GELU's erf to within 2e-7; relu's derivative at 0 is 0).

  Raises:
    ValueError: for an unknown name.
  """
  if name == "silu":
    s = jax.nn.sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))
  if name == "gelu":  # the tanh approximation, jax.nn.gelu's default
    t = jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g))
    slope = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * slope
  if name == "gelu_exact":
    cdf = 0.5 * (1.0 + _erf(g * math.sqrt(0.5)))
    return g * cdf, cdf + g * jnp.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
  if name == "relu":
    return jnp.maximum(g, 0.0), jnp.where(g > 0, 1.0, 0.0).astype(g.dtype)
  if name == "sigmoid":
    s = jax.nn.sigmoid(g)
    return s, s * (1.0 - s)
  if name == "tanh":
    t = jnp.tanh(g)
    return t, 1.0 - t * t
  if name == "identity":
    return g, jnp.ones_like(g)
  raise ValueError(f"activation={name!r} has no kernel formula; use a canonical name "
                   "from reference.ACTIVATIONS (see reference.activation_name).")


# --------------------------------------------------------------------------- tunables


def heuristic_tunables(m: int, k: int, n: int, dtype: Any) -> dict[str, int]:
  """Tunables that are a reasonable guess on an H200, without measuring.

  16-bit inputs use 128x128 output tiles with K steps of 64, float32 64x64x32,
  3 stages. Blocks never exceed the problem size rounded up to a power of two (at
  least 16). 4 warps, or 8 where the two float32 accumulators would take more
  than 128 registers a thread on 4 (128x128 tiles: 256; they spill).

  Args:
    m: rows of x (all its leading dimensions together).
    k: the contracted size K.
    n: output columns N.
    dtype: the operands' dtype.

  Returns:
    A dict with block_m, block_n, block_k, num_warps and num_stages, valid for
    `triton_matmul.validate_tunables`.

  Raises:
    ValueError: for an unsupported dtype.
  """
  if tm.check_dtype("dtype", dtype, _KERNEL).itemsize == 2:
    bm, bn, bk = 128, 128, 64
  else:
    bm, bn, bk = 64, 64, 32
  bm, bn, bk = tm.cap(bm, m), tm.cap(bn, n), tm.cap(bk, k)
  warps = 4
  while not tm.acc_fits(bm, _ACCUMULATORS * bn, warps) and warps < 8:
    warps *= 2
  return dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=3)


def tunable_space(m: int, k: int, n: int, dtype: Any) -> list[dict[str, int]]:
  """The autotuning search space for one problem (a few dozen configs).

  Tiles: block_m of 32 to 128, block_n of 32 to 256 and block_k of 32 to 128 (16 to
  64 for float32), with the two accumulators together at most 2 x 128 x 128 floats
  (2 x 64 x 128 for float32); 4 or 8 warps where the accumulators fit in registers;
  3 or 4 stages (3 for block_k = 128). Blocks are capped at the problem size,
  duplicates dropped, and configs whose pipelined tiles overflow the H200's shared
  memory left out. The heuristic config comes first.

  Args:
    m, k, n: the problem (rows of x, contraction, output columns).
    dtype: the operands' dtype.

  Returns:
    Distinct dicts of tunables, each valid for `triton_matmul.validate_tunables`.

  Raises:
    ValueError: for an unsupported dtype.
  """
  heuristic = heuristic_tunables(m, k, n, dtype)
  itemsize = jnp.dtype(dtype).itemsize
  block_ks = (32, 64, 128) if itemsize == 2 else (16, 32, 64)
  max_acc = 128 * 128 if itemsize == 2 else 64 * 128
  keys = [tuple(heuristic[name] for name in tm.TUNABLE_NAMES)]
  for bm in (32, 64, 128):
    for bn in (32, 64, 128, 256):
      if bm * bn > max_acc:
        continue
      for bk in block_ks:
        cbm, cbn, cbk = tm.cap(bm, m), tm.cap(bn, n), tm.cap(bk, k)
        for warps in (4, 8):
          if not tm.acc_fits(cbm, _ACCUMULATORS * cbn, warps):
            continue
          for stages in (3, 4) if cbk <= 64 else (3,):
            if tm.smem_bytes(cbm, cbn, cbk, stages, itemsize, rhs_tiles=2) <= tm.SMEM_BYTES:
              keys.append((cbm, cbn, cbk, warps, stages))
  return [dict(zip(tm.TUNABLE_NAMES, key)) for key in dict.fromkeys(keys)]


# --------------------------------------------------------------------------- kernels


def _projections(x_ref, w_ref, *, tile_m, tile_n, block_m, block_n, block_k, precision):
  """Both projections of one output tile: (gate, linear), block_m x block_n float32.

  x_ref is (M, K); w_ref is (K, 2N) with the gate in columns [0, N) and the linear
  weights in [N, 2N). Also returns the tile's row and column masks (None when the
  size is a multiple of the block).
  """
  rows, contract = x_ref.shape
  cols = w_ref.shape[1] // 2
  m0, n0 = tile_m * block_m, tile_n * block_n
  row_mask = (tm.span(m0, block_m) < rows)[:, None] if rows % block_m else None
  col_mask = (tm.span(n0, block_n) < cols)[None, :] if cols % block_n else None

  def k_step(k0, k_mask, accs):
    gate, linear = accs
    x = tm.load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)], tm.all_of(row_mask, k_mask))
    w_mask = tm.all_of(None if k_mask is None else k_mask.T, col_mask)
    w_gate = tm.load(w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)], w_mask)
    w_linear = tm.load(w_ref.at[pl.ds(k0, block_k), pl.ds(cols + n0, block_n)], w_mask)
    return (gate + tm.dot(x, w_gate, 1, 0, precision),
            linear + tm.dot(x, w_linear, 1, 0, precision))

  def full_k(i, accs):
    return k_step(pl.multiple_of(i * block_k, block_k), None, accs)

  def ragged_k(i, accs):
    k0 = i * block_k
    return k_step(k0, (tm.span(k0, block_k) < contract)[None, :], accs)

  accs = (jnp.zeros((block_m, block_n), jnp.float32),) * 2
  num_full_k = contract // block_k
  # Static guards: a loop body is traced even when it never runs, and interpret mode
  # cannot trace an unmasked block larger than the array.
  if num_full_k:
    accs = lax.fori_loop(0, num_full_k, full_k, accs)
  if contract % block_k:
    # One trip with a traced start (a static start whose block runs past K is
    # rejected at trace time, masked or not); only a ragged K pays for the mask.
    accs = lax.fori_loop(num_full_k, num_full_k + 1, ragged_k, accs)
  return accs, row_mask, col_mask


def _tile_of_program(rows: int, cols: int, block_m: int, block_n: int):
  return tm.swizzle(pl.program_id(0), pl.cdiv(rows, block_m), pl.cdiv(cols, block_n))


def _forward_kernel(x_ref, w_ref, out_ref, *, activation, block_m, block_n, block_k, precision):
  """One program: one block_m x block_n tile of act(x @ Wg) * (x @ Wl)."""
  rows, cols = out_ref.shape
  tile_m, tile_n = _tile_of_program(rows, cols, block_m, block_n)
  (gate, linear), row_mask, col_mask = _projections(
      x_ref, w_ref, tile_m=tile_m, tile_n=tile_n, block_m=block_m, block_n=block_n,
      block_k=block_k, precision=precision)
  value, _ = activation_and_derivative(activation, gate)
  out = (value * linear).astype(out_ref.dtype)
  tm.store(out_ref.at[pl.ds(tile_m * block_m, block_m), pl.ds(tile_n * block_n, block_n)], out,
           tm.all_of(row_mask, col_mask))


def _pre_activation_grad_kernel(x_ref, w_ref, dout_ref, dpre_ref, *, activation, block_m,
                                block_n, block_k, precision):
  """One program: the gradients of both pre-activations on one output tile, stored in
  columns [n0, n0 + block_n) (gate) and [N + n0, ...) (linear) of dpre (M, 2N)."""
  rows, cols = dout_ref.shape
  tile_m, tile_n = _tile_of_program(rows, cols, block_m, block_n)
  (gate, linear), row_mask, col_mask = _projections(
      x_ref, w_ref, tile_m=tile_m, tile_n=tile_n, block_m=block_m, block_n=block_n,
      block_k=block_k, precision=precision)
  mask = tm.all_of(row_mask, col_mask)
  m0, n0 = tile_m * block_m, tile_n * block_n
  dout = tm.load(dout_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], mask).astype(jnp.float32)
  value, slope = activation_and_derivative(activation, gate)
  # Masked columns of the gate's tile lie in the linear half, and the other way round:
  # the masks keep each store to its own half.
  tm.store(dpre_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)],
           (dout * linear * slope).astype(dpre_ref.dtype), mask)
  tm.store(dpre_ref.at[pl.ds(m0, block_m), pl.ds(cols + n0, block_n)],
           (dout * value).astype(dpre_ref.dtype), mask)


def _check_call(x: jax.Array, weights: jax.Array, tunables: dict[str, int]) -> tuple[int, int, int]:
  """Validates a kernel call; returns (M, K, N)."""
  tm.validate_tunables(**tunables)
  check_glu_shapes(x, weights)
  tm.check_same_dtype("x", x, "weights", weights, _KERNEL)
  k, _, n = weights.shape
  m = math.prod(x.shape[:-1])
  if 0 in (m, k, n):
    raise ValueError(f"x.shape={x.shape} and weights.shape={weights.shape} have an empty "
                     "dimension; the kernels need M, K, N >= 1 (the op returns zeros for "
                     "such calls without a kernel).")
  tm.check_int32_addressing(x=(m, k), weights=(k, 2 * n), out=(m, 2 * n))
  return m, k, n


def _run(body, x2, w2, *more, out_cols, out_dtype, activation, block_m, block_n, block_k,
         num_warps, num_stages, precision, interpret, name):
  """Launches a kernel `body` over x2 (M, K), w2 (K, 2N) and `more` operands, one program
  per block_m x block_n tile of the (M, N) projections, writing (M, out_cols)."""
  rows, cols = x2.shape[0], w2.shape[1] // 2
  kernel = functools.partial(body, activation=activation_name(activation), block_m=block_m,
                             block_n=block_n, block_k=block_k,
                             precision=common.canonical_precision(precision))
  return pl.pallas_call(
      kernel,
      out_shape=pallas_common.out_struct((rows, out_cols), out_dtype, like=x2),
      grid=(pl.cdiv(rows, block_m) * pl.cdiv(cols, block_n),),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(x2, w2, *more)


_STATIC = ("activation", "block_m", "block_n", "block_k", "num_warps", "num_stages", "precision",
           "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_linear_unit_pallas_triton(
    x: jax.Array,
    weights: jax.Array,
    *,
    activation: Any,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    precision: Any = None,
    interpret: bool = False,
) -> jax.Array:
  """Computes activation(x @ weights[:, 0]) * (x @ weights[:, 1]) in one Triton kernel.

  Args:
    x: (..., K) bfloat16, float16 or float32.
    weights: (K, 2, N), the same dtype as x.
    activation: a known activation, by name or function (`reference.activation_name`).
    block_m, block_n: output tile (rows of x, columns of the output).
    block_k: contracted columns per pipelined step.
    num_warps, num_stages: Triton launch parameters.
    precision: None, a `jax.lax.Precision` or its name: float32 operands multiply as
      TF32 unless it is HIGHEST (as XLA does on the GPU); 16-bit ones are exact.
    interpret: run in Pallas interpret mode (CPU, for tests).

  Returns:
    (..., N) array in x's dtype; products accumulate in float32, and the activation
    and the gating run in float32.

  Raises:
    ValueError: for shapes that do not fit, an empty dimension, mixed or unsupported
      dtypes, an unknown activation or invalid tunables.
  """
  tunables = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                  num_stages=num_stages)
  m, k, n = _check_call(x, weights, tunables)
  out = _run(_forward_kernel, x.reshape(m, k), weights.reshape(k, 2 * n), out_cols=n,
             out_dtype=x.dtype, activation=activation, precision=precision, interpret=interpret,
             name="gated_linear_unit_fwd", **tunables)
  return out.reshape(*x.shape[:-1], n)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_linear_unit_bwd_pallas_triton(
    x: jax.Array,
    weights: jax.Array,
    dout: jax.Array,
    *,
    activation: Any,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    precision: Any = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """The gradients of `gated_linear_unit_pallas_triton` with respect to x and weights.

  A Triton kernel recomputes both projections and writes the pre-activations'
  gradients (M, 2N) in x's dtype; two XLA matmuls then give dx and dweights.

  Args:
    x, weights: the forward's operands.
    dout: (..., N) cotangent of the forward's output (cast to x's dtype).
    activation, block_m, block_n, block_k, num_warps, num_stages, precision,
      interpret: as for the forward; the tiles are those of the recomputing kernel.

  Returns:
    (dx, dweights): shaped and typed like x and weights.

  Raises:
    ValueError: as the forward, and for a dout not shaped like the forward's output.
  """
  tunables = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                  num_stages=num_stages)
  m, k, n = _check_call(x, weights, tunables)
  if tuple(dout.shape) != (*x.shape[:-1], n):
    raise ValueError(f"dout.shape={dout.shape} must be the forward output's shape "
                     f"{(*x.shape[:-1], n)} for x.shape={x.shape}, weights.shape={weights.shape}.")
  x2, w2 = x.reshape(m, k), weights.reshape(k, 2 * n)
  dpre = _run(_pre_activation_grad_kernel, x2, w2, dout.reshape(m, n).astype(x.dtype),
              out_cols=2 * n, out_dtype=x.dtype, activation=activation, precision=precision,
              interpret=interpret, name="gated_linear_unit_bwd", **tunables)
  matmul = functools.partial(lax.dot_general, preferred_element_type=jnp.float32,
                             precision=common.lax_precision(common.canonical_precision(precision)))
  dx = matmul(dpre, w2, (((1,), (1,)), ((), ())))
  dweights = matmul(x2, dpre, (((0,), (0,)), ((), ())))
  return dx.astype(x.dtype).reshape(x.shape), dweights.astype(weights.dtype).reshape(weights.shape)


# --------------------------------------------------------------------------- op classes


@config_dataclass
class PallasTritonGatedLinearUnitConfig:
  """Tiles and pipelining of the gated linear unit's Triton kernel (the forward's, or
  the backward's recomputing kernel); see `triton_matmul.validate_tunables`."""

  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    tm.validate_tunables(**pallas_common.tunables_of(self))


def _mkn(ba) -> tuple[int, int, int, Any]:
  x, w = ba.arguments["x"], ba.arguments["weights"]
  return math.prod(x.shape[:-1]), w.shape[0], w.shape[2], x.dtype


def _configs(ba) -> list[PallasTritonGatedLinearUnitConfig]:
  return [PallasTritonGatedLinearUnitConfig(**t) for t in tunable_space(*_mkn(ba))]


def _check_kernel_takes(arguments: dict[str, Any]) -> None:
  x, w = arguments["x"], arguments["weights"]
  m, k, n = math.prod(x.shape[:-1]), w.shape[0], w.shape[2]
  tm.refuse_unsupported("x", x, "weights", w, x=(m, k), weights=(k, 2 * n), out=(m, 2 * n))


class PallasTritonGatedLinearUnitVjp(pallas_common.PallasTritonOp, _base.GatedLinearUnitVjp,
                                     name="gated_linear_unit.pallas_triton_vjp"):
  """gated_linear_unit backward: a Triton kernel recomputes the projections and writes
  the pre-activations' gradients; dx and dweights are XLA matmuls against them."""

  config_cls = PallasTritonGatedLinearUnitConfig

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments)

  def _fwd(self, residuals, out, dout, x, weights, *, activation, precision=None, config):
    del residuals, out
    dx, dweights = gated_linear_unit_bwd_pallas_triton(
        x, weights, dout, activation=activation, precision=precision, interpret=self.interpret,
        **pallas_common.tunables_of(config))
    return {"x": dx, "weights": dweights}

  def _get_heuristics_config(self, ba):
    return _configs(ba)[0]

  def _get_autotuning_configs(self, ba):
    return set(_configs(ba))


class PallasTritonGatedLinearUnit(pallas_common.PallasTritonOp, _base.GatedLinearUnit,
                                  name="gated_linear_unit.pallas_triton"):
  """gated_linear_unit in one Pallas Triton kernel: both projections accumulate in
  float32 side by side, and the activation and gating run in the epilogue."""

  config_cls = PallasTritonGatedLinearUnitConfig
  vjp_cls = PallasTritonGatedLinearUnitVjp

  def _check_supported(self, arguments):
    _check_kernel_takes(arguments)

  def _fwd(self, x, weights, *, activation, precision=None, config):
    out = gated_linear_unit_pallas_triton(x, weights, activation=activation, precision=precision,
                                          interpret=self.interpret,
                                          **pallas_common.tunables_of(config))
    return out, None

  def _get_heuristics_config(self, ba):
    return _configs(ba)[0]

  def _get_autotuning_configs(self, ba):
    return set(_configs(ba))
