"""The gated_linear_unit family: activation(x @ w[:, 0]) * (x @ w[:, 1]).

x (..., K), weights (K, 2, N). The activation is named (see
`reference.ACTIVATIONS`), never a callable, so ops stay comparable and
serialisable. This file holds the family's base classes and its XLA
implementation.
"""

from __future__ import annotations

import math
from typing import Any

from stellarax.core import partitioning
from stellarax.core.config import config_dataclass
from stellarax.core.op import Op
from stellarax.ops import common
from stellarax.ops.gated_linear_unit import reference as ref
from stellarax.ops.gated_linear_unit import xla

_DIFFERENTIABLE = ("x", "weights")


def _glu_labels(a: dict[str, Any]) -> tuple[dict[str, str], str, frozenset[str]]:
  """The factors of x and the weights, those of the output, and the free ones: x's rows
  and the output's columns (the weights' N)."""
  rows = [f"r{i}" for i in range(len(a["x"].shape) - 1)]
  labels = {"x": " ".join(rows + ["k"]), "weights": "k gate_or_linear n"}
  return labels, " ".join(rows + ["n"]), frozenset(rows + ["n"])


class GatedLinearUnit(Op):
  """Base of the gated_linear_unit implementations (forward)."""

  def _fwd(self, x, weights, *, activation="silu", precision=None, config):
    raise NotImplementedError

  def _canonicalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
    x, w = arguments["x"], arguments["weights"]
    common.check_floating("x", x)
    common.check_floating("weights", w)
    if len(w.shape) != 3 or w.shape[1] != 2 or not x.shape or x.shape[-1] != w.shape[0]:
      raise ValueError(f"gated_linear_unit needs x (..., K) and weights (K, 2, N); got "
                       f"x.shape={tuple(x.shape)}, weights.shape={tuple(w.shape)}.")
    arguments["activation"] = ref.activation_name(arguments["activation"])
    arguments["precision"] = common.canonical_precision(arguments["precision"])
    return arguments

  def _is_trivial(self, arguments):
    # No row, an empty contraction (both projections are zeros, and every activation
    # gives act(0) * 0 = 0) or no output column: zeros, with no kernel.
    x, w = arguments["x"], arguments["weights"]
    return 0 in (math.prod(x.shape[:-1]), w.shape[0], w.shape[2])

  def _reference(self, x, weights, *, activation, precision=None):
    del precision
    return ref.gated_linear_unit_reference(x, weights, activation=activation)

  def _array_layout(self, arguments):
    labels, out, free = _glu_labels(arguments)
    return partitioning.ShardingLayout(labels, (out, None), free)


class GatedLinearUnitVjp(Op):
  """Base of the gated_linear_unit backward implementations."""

  def _fwd(self, residuals, out, dout, x, weights, *, activation="silu", precision=None, config):
    raise NotImplementedError

  def _canonicalize(self, arguments):
    fwd = {k: arguments[k] for k in GatedLinearUnit._signature().parameters}
    arguments.update(GatedLinearUnit._canonicalize(self, fwd))
    return arguments

  def _reference(self, residuals, out, dout, **primals):
    return common.vjp_by_autodiff(GatedLinearUnit._reference.__get__(self), primals, dout, _DIFFERENTIABLE)

  def _array_layout(self, arguments):
    labels, out, free = _glu_labels(arguments)
    grads = {name: labels[name] for name in _DIFFERENTIABLE}
    labels.update(out=out, dout=out)  # no residuals
    return partitioning.ShardingLayout(labels, grads, free)


@config_dataclass
class XlaGatedLinearUnitConfig:
  """Tunables of the XLA gated linear unit.

  Attributes:
    fused: one matmul against the (K, 2, N) weights, then split (True), or two
      matmuls (False).
  """

  fused: bool = True

  def __post_init__(self):
    if not isinstance(self.fused, bool):
      raise ValueError(f"fused={self.fused!r} must be a bool.")


def _xla_glu(x, weights, *, activation, precision, config):
  return xla.gated_linear_unit_xla(x, weights, activation=activation, fused=config.fused,
                                   precision=common.lax_precision(precision))


class XlaGatedLinearUnitVjp(GatedLinearUnitVjp, name="gated_linear_unit.xla_vjp"):
  """XLA backward: JAX's derivative of the XLA forward with this config."""

  config_cls = XlaGatedLinearUnitConfig

  def _fwd(self, residuals, out, dout, x, weights, *, config, **static):
    del residuals, out
    f = lambda **kw: _xla_glu(**kw, config=config)
    return common.vjp_by_autodiff(f, dict(x=x, weights=weights, **static), dout, _DIFFERENTIABLE)

  def _get_heuristics_config(self, ba):
    return XlaGatedLinearUnitConfig(fused=True)

  def _get_autotuning_configs(self, ba):
    return {XlaGatedLinearUnitConfig(fused=f) for f in (True, False)}


class XlaGatedLinearUnit(GatedLinearUnit, name="gated_linear_unit.xla"):
  """gated_linear_unit in XLA, fused or split projections."""

  config_cls = XlaGatedLinearUnitConfig
  vjp_cls = XlaGatedLinearUnitVjp

  def _fwd(self, x, weights, *, config, **static):
    return _xla_glu(x, weights, **static, config=config), None

  def _get_heuristics_config(self, ba):
    return XlaGatedLinearUnitConfig(fused=True)

  def _get_autotuning_configs(self, ba):
    return {XlaGatedLinearUnitConfig(fused=f) for f in (True, False)}
