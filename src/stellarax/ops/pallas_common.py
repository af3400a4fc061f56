"""What every Pallas implementation shares: the interpret switch, where it
runs, and configs built from the kernels' tunable dicts."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from stellarax.core.op import Op


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonOp(Op):
  """Mixin of the Pallas Triton implementations.

  Attributes:
    interpret: run the kernel in Pallas interpret mode (any backend, slow;
      for tests and debugging on a CPU). Part of the op's identity.
  """

  interpret: bool = False

  @classmethod
  def supported_on(cls, device: Any) -> bool:
    """Pallas Triton kernels compile for NVIDIA GPUs."""
    return getattr(device, "platform", None) == "gpu" and "nvidia" in str(getattr(device, "device_kind", "")).lower()


def config_from_tunables(config_cls: type, tunables: Mapping[str, Any]) -> Any:
  """A config from a kernel's tunable dict (keys must be its fields)."""
  return config_cls(**dict(tunables))


def configs_from_tunables(config_cls: type, space: Iterable[Mapping[str, Any]]) -> set[Any]:
  """The configs of a kernel's tunable space."""
  return {config_from_tunables(config_cls, t) for t in space}


def tunables_of(config: Any) -> dict[str, Any]:
  """A config's fields as keyword arguments for a kernel wrapper."""
  return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuOp(Op):
  """Mixin of the Pallas Mosaic GPU implementations (Hopper and later).

  Attributes:
    interpret: run under Mosaic GPU interpret mode
      (`plgpu.force_gpu_interpret_mode`) on any backend; for tests on a CPU.
  """

  interpret: bool = False

  @classmethod
  def supported_on(cls, device: Any) -> bool:
    """Mosaic GPU kernels need an NVIDIA GPU of compute capability >= 9.0."""
    if getattr(device, "platform", None) != "gpu" or "nvidia" not in str(getattr(device, "device_kind", "")).lower():
      return False
    try:
      return float(getattr(device, "compute_capability", "0")) >= 9.0
    except ValueError:
      return False
