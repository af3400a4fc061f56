"""`stellarax.layer_norm` and `stellarax.rms_norm`: public functions."""

from __future__ import annotations

from stellarax.core import dispatch

# Tried in this order when `implementation=None` and no implementation of the
# call was measured (measurements in the active results or caches pick the
# fastest instead). On an H200 (bench/gpu_check.sh, 2026-12-04, BENCHMARKS.md) the
# Triton kernels were correct, and their forward 2x as fast as XLA's, but forward and
# backward 0.333 ms against XLA's 0.280 ms: training steps keep XLA until the Triton
# backward is faster. Tune (or pass implementation=) for inference.
PREFERENCE = ("xla", "pallas_triton")


def layer_norm(x, scale, offset, *, axis=-1, epsilon=1e-6, implementation=None):
  """Layer normalisation: (x - mean) / sqrt(var + epsilon) * scale + offset.

  Args:
    x: input array (floating).
    scale, offset: None or arrays of x's sizes along `axis`.
    axis: int or tuple of ints to normalise over.
    epsilon: added to the variance.
    implementation: None (best available), a name, an Op, or a sequence.

  Returns:
    An array of x's shape and dtype (statistics computed in float32).

  Raises:
    ValueError: for a bad axis or parameter shapes.
    NotImplementedError: when no requested implementation supports the input (a list
      passes by the kernels that do not run on the device traced for, saying why).
    ValueError: from JAX, for a Pallas kernel named alone where it cannot be lowered (a
      CPU, without `interpret=True`); called eagerly, a note says how to run it.
  """
  return dispatch.call_family("layer_norm", PREFERENCE, implementation, (x, scale, offset),
                              dict(axis=axis, epsilon=epsilon, subtract_mean=True))


def rms_norm(x, scale, *, offset=None, axis=-1, epsilon=1e-6, implementation=None):
  """RMS normalisation: x / sqrt(mean(x^2) + epsilon) * scale + offset.

  Args:
    x: input array (floating).
    scale: None or an array of x's sizes along `axis`.
    offset: None (the usual RMS norm) or an array of x's sizes along `axis`,
      added last.
    axis: int or tuple of ints to normalise over.
    epsilon: added to the mean square.
    implementation: None (best available), a name, an Op, or a sequence.

  Returns:
    An array of x's shape and dtype (statistics computed in float32).

  Raises:
    ValueError: for a bad axis or parameter shape.
    NotImplementedError: when no requested implementation supports the input (a list
      passes by the kernels that do not run on the device traced for, saying why).
    ValueError: from JAX, for a Pallas kernel named alone where it cannot be lowered (a
      CPU, without `interpret=True`); called eagerly, a note says how to run it.
  """
  return dispatch.call_family("layer_norm", PREFERENCE, implementation, (x, scale, offset),
                              dict(axis=axis, epsilon=epsilon, subtract_mean=False))
