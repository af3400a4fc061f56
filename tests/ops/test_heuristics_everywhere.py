"""Heuristics answer for every input an implementation takes.

Where nothing was measured a call runs its heuristic config, so for every shape an
implementation accepts, its heuristic must be a valid config that its kernel traces
with, forward and backward, and its search space must hold valid configs only. A
shape it cannot take must be refused when bound (NotImplementedError, so that
dispatch moves on), never by a crash in a tile computation. Nothing runs here: the
kernels are traced abstractly (`jax.eval_shape`) at awkward sizes (1, primes, sizes
no tile divides, the speed-target shapes).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest

import stellarax
from stellarax.core import partitioning
from stellarax.core import registry
from stellarax.core.bound_args import BoundArguments

S = jax.ShapeDtypeStruct


def _split(values, *, skip=()):
  """Bound values as (array specs, the rest), by name, without the names in `skip`."""
  kept = {k: v for k, v in values.items() if k not in skip}
  return ({k: v for k, v in kept.items() if isinstance(v, S)},
          {k: v for k, v in kept.items() if not isinstance(v, S)})


def _check_heuristics(op, args, kwargs) -> str:
  """Binds op to the specs; checks its heuristic and space forward and backward.

  Returns "refused" when the op does not take the input, else "ok".
  """
  try:
    ba = op.bind(*args, **kwargs)
  except NotImplementedError:
    return "refused"
  _check_bound(ba)
  values = op._bind_values(*args, **kwargs)
  arrays, statics = _split(values)
  out, residuals = jax.eval_shape(
      lambda a: op._fwd(**a, **statics, config=ba.heuristics_config), arrays)
  _check_layout(ba, (out, residuals))
  if op.vjp_cls is not None:
    vjp, grads = op.vjp_op(), dict(residuals=residuals, out=out, dout=out, **values)
    try:
      vjp_ba = vjp.bind(**grads)
    except NotImplementedError:  # the backward falls back to XLA's (BackwardFallbackWarning)
      vjp = registry.lookup(f"{op.name.partition('.')[0]}.xla_vjp")()
      vjp_ba = vjp.bind(**grads)
    _check_bound(vjp_ba)
    vjp_values = vjp._bind_values(residuals=residuals, out=out, dout=out, **values)
    vjp_arrays, vjp_statics = _split(vjp_values, skip=("residuals",))
    grads = jax.eval_shape(lambda a, r: vjp._fwd(residuals=r, **a, **vjp_statics,
                                                 config=vjp_ba.heuristics_config),
                           vjp_arrays, residuals)
    _check_layout(vjp_ba, grads)
  return "ok"


def _check_layout(ba: BoundArguments, outputs) -> None:
  """The layout by which the call runs per shard fits it: every argument and output
  dimension named, each factor of one size. That is `_partitioning` for a kernel, and
  `_array_layout` for any op over Explicit mesh axes (XLA's too)."""
  layout = partitioning._layout(ba, kernels_only=False)
  if layout is None:
    return
  plan = partitioning._Plan.of(ba, layout)
  plan.check_outputs(ba, [s.shape for s in ba.batched_array_specs()],
                     [x.shape for x in jax.tree.leaves(outputs)])


def _check_bound(ba: BoundArguments) -> None:
  heuristic = ba.heuristics_config
  assert isinstance(heuristic, ba.op.config_cls), (ba, heuristic)
  space = ba.autotuning_configs
  assert space and all(isinstance(c, ba.op.config_cls) for c in space), ba


RAGGED_SHAPES = [  # (M, K, N, G)
    (1, 16, 1, 1), (7, 100, 3, 3), (1000, 512, 768, 5), (64, 64, 64, 64),
    (8192, 4096, 14336, 8), (16384, 2048, 1536, 64), (128, 4096, 14336, 8),
]


@pytest.mark.parametrize("op", [stellarax.XlaRaggedDot(), stellarax.PallasTritonRaggedDot(),
                                stellarax.PallasMosaicGpuRaggedDot()], ids=lambda op: op.name)
def test_ragged_dot_heuristics_answer_every_shape(op):
  taken = []
  for (m, k, n, g), dtype in itertools.product(RAGGED_SHAPES, (jnp.bfloat16, jnp.float32)):
    args = (S((m, k), dtype), S((g, k, n), dtype), S((g,), jnp.int32))
    taken.append(_check_heuristics(op, args, {}))
  assert taken.count("ok") >= 4, taken  # not everything refused


ATTENTION_SHAPES = [  # (B, T, S, N, K, H), options
    ((1, 1, 1, 1, 1, 64), {}), ((2, 7, 9, 4, 2, 128), {}), ((1, 100, 100, 2, 1, 256), {"is_causal": True}),
    ((2, 1000, 1000, 4, 4, 64), {"local_window_size": (128, 0)}),
    ((2, 8192, 8192, 16, 16, 128), {"is_causal": True}), ((1, 1, 4096, 8, 1, 128), {}),
]


@pytest.mark.parametrize("op", [stellarax.XlaAttention(), stellarax.XlaChunkedAttention(),
                                stellarax.PallasTritonAttention(), stellarax.PallasMosaicGpuAttention()],
                         ids=lambda op: op.name)
def test_attention_heuristics_answer_every_shape(op):
  taken = []
  for ((b, t, s, n, k, h), options), dtype in itertools.product(ATTENTION_SHAPES,
                                                                 (jnp.bfloat16, jnp.float16)):
    args = (S((b, t, n, h), dtype), S((b, s, k, h), dtype), S((b, s, k, h), dtype))
    taken.append(_check_heuristics(op, args, dict(options)))
  assert taken.count("ok") >= 4, taken
  # A bias broadcast over the batch, a mask over the heads, and sequence lengths.
  b, t, s, n, k, h = 2, 7, 9, 4, 2, 128
  args = (S((b, t, n, h), jnp.bfloat16), S((b, s, k, h), jnp.bfloat16), S((b, s, k, h), jnp.bfloat16))
  extras = dict(bias=S((1, n, t, s), jnp.bfloat16), mask=S((b, 1, t, s), jnp.bool_),
                key_value_seq_lengths=S((b,), jnp.int32))
  assert _check_heuristics(op, args, extras) == "ok"


NORM_SHAPES = [(1, 1), (7, 3), (5, 17), (37, 200), (8192, 8192), (3, 40_000), (100_000, 128)]


@pytest.mark.parametrize("op", [stellarax.XlaLayerNorm(), stellarax.PallasTritonLayerNorm()],
                         ids=lambda op: op.name)
@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer_norm", "rms_norm"])
def test_norm_heuristics_answer_every_shape(op, subtract_mean):
  for (rows, cols), dtype in itertools.product(NORM_SHAPES, (jnp.bfloat16, jnp.float32)):
    param = S((cols,), dtype)
    args = (S((rows, cols), dtype), param, param if subtract_mean else None)
    assert _check_heuristics(op, args, dict(subtract_mean=subtract_mean)) == "ok", (rows, cols)
  # Two normalised axes of three, in the middle and last.
  x, param = S((3, 5, 7), jnp.float32), S((5, 7), jnp.float32)
  args = (x, param, param if subtract_mean else None)
  assert _check_heuristics(op, args, dict(axis=(1, 2), subtract_mean=subtract_mean)) == "ok"


GLU_SHAPES = [  # (x.shape, K, N)
    ((1,), 1, 1), ((7, 3), 100, 5), ((1000,), 512, 768), ((4, 2048), 4096, 14336), ((16,), 4096, 14336),
]


@pytest.mark.parametrize("op", [stellarax.XlaGatedLinearUnit(), stellarax.PallasTritonGatedLinearUnit()],
                         ids=lambda op: op.name)
def test_gated_linear_unit_heuristics_answer_every_shape(op):
  for (rows, k, n), dtype in itertools.product(GLU_SHAPES, (jnp.bfloat16, jnp.float32)):
    args = (S((*rows, k), dtype), S((k, 2, n), dtype))
    assert _check_heuristics(op, args, dict(activation="gelu_exact")) == "ok", (rows, k, n)
