"""The layer_norm family: layer normalisation and RMS normalisation.

One op family covers both: `subtract_mean=True` is layer norm
((x - mean) / sqrt(var + eps) * scale + offset), `subtract_mean=False` is RMS
norm (x / sqrt(mean(x^2) + eps) * scale + offset). Statistics are computed in
float32; the output has x's dtype. This file holds the family's base classes
and its XLA implementation.
"""

from __future__ import annotations

import math
from typing import Any

from stellarax.core.config import NoConfig
from stellarax.core import partitioning
from stellarax.core.op import Op
from stellarax.ops import common
from stellarax.ops.normalization import reference as ref
from stellarax.ops.normalization import xla

_DIFFERENTIABLE = ("x", "scale", "offset")


def _normalize(x, scale, offset, *, axis, epsilon, subtract_mean, impl_layer, impl_rms):
  if subtract_mean:
    return impl_layer(x, scale, offset, axis=axis, epsilon=epsilon)
  return impl_rms(x, scale, offset=offset, axis=axis, epsilon=epsilon)


def _norm_labels(a: dict[str, Any]) -> tuple[dict[str, str], str, frozenset[str]]:
  """The factors of x, scale and offset; those of the per-row statistics (x's shape
  less the normalised axes); and the free ones: every dimension not normalised."""
  ndim = len(a["x"].shape)
  axes = ref.normalize_axes(a["axis"], ndim)
  x = " ".join(f"c{i}" if i in axes else f"r{i}" for i in range(ndim))
  params = " ".join(f"c{i}" for i in axes)
  rows = [f"r{i}" for i in range(ndim) if i not in axes]
  labels = {"x": x, "scale": params, "offset": params}
  return labels, " ".join(rows), frozenset(rows)


def _statistics(subtract_mean: bool, rows: str) -> tuple[str, ...]:
  """The labels of the residuals: (mean, rstd) for layer_norm, (rstd,) for rms_norm."""
  return (rows, rows) if subtract_mean else (rows,)


class LayerNorm(Op):
  """Base of the layer_norm implementations (forward)."""

  def _fwd(self, x, scale=None, offset=None, *, axis=-1, epsilon=1e-6, subtract_mean=True, config):
    raise NotImplementedError

  def _canonicalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
    x = arguments["x"]
    common.check_floating("x", x)
    axes = ref.normalize_axes(arguments["axis"], len(x.shape))
    expected = tuple(x.shape[a] for a in axes)
    for name in ("scale", "offset"):
      p = arguments[name]
      if p is None:
        continue
      common.check_array(name, p)
      if tuple(p.shape) != expected:
        raise ValueError(f"{name}.shape={tuple(p.shape)} must be x's sizes along axis={axes}: {expected}.")
    arguments["axis"] = axes[0] if len(axes) == 1 else axes
    arguments["epsilon"] = _static_epsilon(arguments["epsilon"])
    arguments["subtract_mean"] = bool(arguments["subtract_mean"])
    return arguments

  def _is_trivial(self, arguments):
    # An empty x (no rows, or rows of no elements): the output is empty too.
    return math.prod(arguments["x"].shape) == 0

  def _reference(self, x, scale=None, offset=None, **static):
    return _normalize(x, scale, offset, **static, impl_layer=ref.layer_norm_reference,
                      impl_rms=ref.rms_norm_reference)

  def _array_layout(self, arguments):
    labels, rows, free = _norm_labels(arguments)
    statistics = _statistics(arguments["subtract_mean"], rows)
    return partitioning.ShardingLayout(labels, (labels["x"], statistics), free)


class LayerNormVjp(Op):
  """Base of the layer_norm backward implementations."""

  def _fwd(self, residuals, out, dout, x, scale=None, offset=None, *, axis=-1, epsilon=1e-6,
           subtract_mean=True, config):
    raise NotImplementedError

  def _canonicalize(self, arguments):
    fwd = {k: arguments[k] for k in LayerNorm._signature().parameters}
    arguments.update(LayerNorm._canonicalize(self, fwd))
    return arguments

  def _reference(self, residuals, out, dout, **primals):
    return common.vjp_by_autodiff(LayerNorm._reference.__get__(self), primals, dout, _DIFFERENTIABLE)

  def _array_layout(self, arguments):
    labels, rows, free = _norm_labels(arguments)
    grads = {name: labels[name] for name in _DIFFERENTIABLE if arguments[name] is not None}
    labels.update(residuals=_statistics(arguments["subtract_mean"], rows), out=labels["x"],
                  dout=labels["x"])
    return partitioning.ShardingLayout(labels, grads, free)


def _xla_normalize(x, scale=None, offset=None, **static):
  return _normalize(x, scale, offset, **static, impl_layer=xla.layer_norm_xla, impl_rms=xla.rms_norm_xla)


class XlaLayerNormVjp(LayerNormVjp, name="layer_norm.xla_vjp"):
  """XLA backward of layer_norm: JAX's derivative of the XLA forward."""

  config_cls = NoConfig

  def _fwd(self, residuals, out, dout, x, scale=None, offset=None, *, config, **static):
    del residuals, out
    return common.vjp_by_autodiff(_xla_normalize, dict(x=x, scale=scale, offset=offset, **static), dout,
                                  _DIFFERENTIABLE)

  def _get_heuristics_config(self, ba):
    return NoConfig()


class XlaLayerNorm(LayerNorm, name="layer_norm.xla"):
  """layer_norm / rms_norm in XLA (XLA fuses it; nothing to tune)."""

  config_cls = NoConfig
  vjp_cls = XlaLayerNormVjp

  def _fwd(self, x, scale=None, offset=None, *, config, **static):
    return _xla_normalize(x, scale, offset, **static), None

  def _array_layout(self, arguments):
    return super()._array_layout(arguments).without_residuals()  # `_fwd` returns (out, None)

  def _get_heuristics_config(self, ba):
    return NoConfig()


def _static_epsilon(epsilon) -> float:
  """epsilon as a Python float; ValueError for a traced, non-numeric or negative one."""
  value = common.concrete_float(epsilon)
  if value is None:
    raise common.static_option_error("epsilon", epsilon, "a Python number >= 0")
  if not value >= 0:  # NaN fails too
    raise ValueError(f"epsilon={value} must be >= 0: it is added to the variance (or mean"
                     " square) before the square root; typical values are 1e-6 to 1e-5.")
  return value
