"""What every Pallas implementation shares: the interpret switch, where it
runs, configs built from the kernels' tunable dicts, and the kernels' optional
operands."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stellarax.core.op import Op


def unpack_refs(refs: Sequence[Any], present: Sequence[bool]) -> list[Any]:
  """Spreads the refs a kernel got over the slots of its operands, None for absent ones.

  Args:
    refs: the refs Pallas passed, only those of present operands, in order.
    present: one flag per operand slot.

  Returns:
    One entry per slot: the next ref where present, else None.

  Raises:
    ValueError: when the refs do not match the present operands in number (a kernel
      called with other operands than its flags say).
  """
  refs, wanted = list(refs), sum(map(bool, present))
  if len(refs) != wanted:
    raise ValueError(f"{len(refs)} refs for {wanted} present operands.")
  it = iter(refs)
  return [next(it) if p else None for p in present]


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
