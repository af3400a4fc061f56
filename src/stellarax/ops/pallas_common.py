"""What every Pallas implementation shares: the interpret switch, where it
runs, configs built from the kernels' tunable dicts, the kernels' optional
operands, and the Mosaic GPU kernels' help for the interpreter's race detector."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax

from stellarax.core.op import Op
from stellarax.ops import pallas_backends

plgpu = pallas_backends.mosaic_gpu


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


def out_struct(shape: Sequence[int], dtype: Any, *, like: Any) -> jax.ShapeDtypeStruct:
  """A kernel output's shape and dtype (`pallas_call`'s `out_shape`), of the same
  type as `like` as to the manual mesh axes it varies over: inside a user's
  `jax.shard_map(check_vma=True)` Pallas needs that stated, and the kernel's output
  varies as its inputs do (`partitioning.vary_alike` made them all alike).

  Args:
    shape, dtype: the output's.
    like: one of the kernel's input arrays (or tracers).

  Returns:
    A `jax.ShapeDtypeStruct`.
  """
  return jax.ShapeDtypeStruct(tuple(shape), dtype,
                              manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonOp(Op):
  """Mixin of the Pallas Triton implementations.

  Attributes:
    interpret: run the kernel in Pallas interpret mode (any backend, slow;
      for tests and debugging on a CPU). Part of the op's identity.
  """

  interpret: bool = False

  def _partitioning(self, arguments):
    """Kernels are opaque to XLA's partitioner: they run per shard (`_array_layout`)."""
    return self._array_layout(arguments)

  @classmethod
  def supported_on(cls, device: Any) -> bool:
    """Pallas Triton kernels compile for NVIDIA GPUs, with a JAX that has the backend;
    these kernels' spaces and heuristics assume 227 KiB of shared memory a block, which
    data-centre Hopper and Blackwell GPUs have (compute capability 9.0, 10.x): on others
    (A100's 163 KiB, L40S's and consumer GPUs' 99 KiB) their configs would not compile,
    so a call does not pick them there (named, they are still tried)."""
    return (cls._unavailable_reason() is None and _is_nvidia_gpu(device)
            and _compute_capability(device)[0] in (9, 10))

  @classmethod
  def _unavailable_reason(cls) -> str | None:
    """JAX deprecated Pallas Triton in 0.11; a JAX without it cannot run these kernels."""
    return pallas_backends.missing_reason("triton")


def config_from_tunables(config_cls: type, tunables: Mapping[str, Any]) -> Any:
  """A config from a kernel's tunable dict (keys must be its fields)."""
  return config_cls(**dict(tunables))


def configs_from_tunables(config_cls: type, space: Iterable[Mapping[str, Any]]) -> set[Any]:
  """The configs of a kernel's tunable space."""
  return {config_from_tunables(config_cls, t) for t in space}


def tunables_of(config: Any) -> dict[str, Any]:
  """A config's fields as keyword arguments for a kernel wrapper."""
  return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def detects_races(interpret: Any) -> bool:
  """Whether a Mosaic GPU kernel's `interpret` option (False, True or
  `plgpu.InterpretGPUParams`) runs the interpreter's race detector."""
  return isinstance(interpret, plgpu.InterpretGPUParams) and bool(interpret.detect_races)


def read_again_for_race_detector(operands: Iterable[Any]) -> None:
  """Reads shared-memory `operands` with ordinary loads: call it where a wgmma that
  reads them completes, in interpret mode under the race detector only.

  The Mosaic GPU interpreter runs wgmma at once and its race detector does not check
  wgmma's reads, so a tile freed (and refilled by TMA) before its asynchronous product
  is done would pass unnoticed. These reads make such a release a race the detector
  reports. A no-op debug callback consumes them, so that no dead-code elimination can
  drop them (`pallas_call` applies one to kernel bodies; `plgpu.kernel` does not today),
  and a fence orders them before the refill, a TMA (async-proxy) write.

  Args:
    operands: shared-memory refs (views such as slices or transposes too).
  """
  reads = [operand[...] for operand in operands]
  jax.debug.callback(lambda *_: None, *reads)
  plgpu.commit_smem()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuOp(Op):
  """Mixin of the Pallas Mosaic GPU implementations (Hopper and later).

  Attributes:
    interpret: run under Mosaic GPU interpret mode
      (`plgpu.force_gpu_interpret_mode`) on any backend; for tests on a CPU.
  """

  interpret: bool = False

  def _partitioning(self, arguments):
    """Kernels are opaque to XLA's partitioner: they run per shard (`_array_layout`)."""
    return self._array_layout(arguments)

  @classmethod
  def _unavailable_reason(cls) -> str | None:
    """A JAX without Pallas Mosaic GPU cannot run these kernels."""
    return pallas_backends.missing_reason("mosaic_gpu")

  @classmethod
  def supported_on(cls, device: Any) -> bool:
    """These Mosaic GPU kernels need a Hopper GPU (compute capability 9.x: their products
    are wgmma, which only sm_90a has; Blackwell's are other instructions), and a JAX
    with the backend."""
    return (cls._unavailable_reason() is None and _is_nvidia_gpu(device)
            and _compute_capability(device)[0] == 9)


def _is_nvidia_gpu(device: Any) -> bool:
  return (getattr(device, "platform", None) == "gpu"
          and "nvidia" in str(getattr(device, "device_kind", "")).lower())


# Compute capabilities of NVIDIA GPUs by the words of their device kind, for a device
# that does not state its own: a `jax.sharding.AbstractDevice` (lowering for a GPU from
# a CPU host: `jax.export`, deviceless compiles) has a kind and a platform only. Data-centre
# parts only; any other kind is taken as unknown, and no kernel is picked for it.
_CAPABILITY_BY_KIND = (
    (re.compile(r"\bG?H(100|200|800|20)\b"), (9, 0)),  # Hopper
    (re.compile(r"\bG?B(100|200)\b"), (10, 0)),        # Blackwell
    (re.compile(r"\bG?B300\b"), (10, 3)),
    (re.compile(r"\bA(100|800|30)\b"), (8, 0)),        # Ampere
    (re.compile(r"\bL(4|40|40S)\b"), (8, 9)),          # Ada
)


def _compute_capability(device: Any) -> tuple[int, int]:
  """(major, minor) of a device's `compute_capability` ("9.0"); for a device that has
  none (an abstract one), that of its kind where `_CAPABILITY_BY_KIND` knows it; else
  (0, 0)."""
  stated = str(getattr(device, "compute_capability", "") or "")
  if not stated:
    kind = str(getattr(device, "device_kind", ""))
    return next((cc for pattern, cc in _CAPABILITY_BY_KIND if pattern.search(kind)), (0, 0))
  major, _, minor = stated.partition(".")
  try:
    return int(major), int(minor or 0)
  except ValueError:
    return 0, 0
