"""Lowering for a simulated H200 (no GPU needed): the tests' one way to check that a
kernel compiles to the CUDA custom call with the launch parameters it asks for."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
H200_MESH = AbstractMesh((1,), ("x",), abstract_device=H200)


def lower_for_h200(fn: Any, *args: Any) -> str:
  """StableHLO text of `jax.jit(fn)(*args)` lowered for CUDA on an abstract H200.

  Args:
    fn: the function to lower.
    *args: jax.ShapeDtypeStruct (or arrays) for its positional arguments.

  Returns:
    The lowered module's text.
  """
  with use_abstract_mesh(H200_MESH):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
