"""What the Pallas Triton matmul kernels share (ragged_dot's three products and the
gated linear unit): the tunables' checks, the resource estimates that prune their
search spaces, the L2-friendly program order, masked loads and the tensor-core dot.

One place for these so that a fix to, say, the shared-memory estimate or the
precision of the dot reaches every kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stellarax.core.config import check_choice, check_power_of_two
from stellarax.ops import index_math
from stellarax.ops import pallas_backends

pltriton = pallas_backends.triton

# Triton's tensor-core dot needs every block dimension >= 16. Blocks above 256 are
# refused: no useful Hopper tile needs them, and most would overflow registers.
MIN_BLOCK = 16
MAX_BLOCK = 256
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)
MAX_NUM_STAGES = 8
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
TUNABLE_NAMES = ("block_m", "block_n", "block_k", "num_warps", "num_stages")

# Number of m-tiles that sweep the n-tiles together, for L2 reuse; 8 is the usual
# value for Hopper-sized L2 caches and not worth a tunable of its own.
L2_GROUP_M = 8
# Shared memory one H200 thread block may use (227 KiB); used to prune search spaces.
SMEM_BYTES = 227 * 1024
# Float32 accumulator elements per thread beyond which a tile spills registers. Compiled
# for an H200 (bench/compile_h200.py), 128 x 128 on 4 warps (128 a thread) used 166
# registers and no local memory; 128 x 256 and 256 x 128 on 4 warps (256 a thread)
# spilled over 1 KB a thread, on 8 warps none.
ACC_PER_THREAD = 128


def validate_tunables(*, block_m: int, block_n: int, block_k: int, num_warps: int,
                      num_stages: int) -> None:
  """Checks the tunables of a Triton matmul kernel.

  Args:
    block_m: rows per tile (ragged_dot's weight gradient: rows per step).
    block_n: output columns per tile.
    block_k: contracted columns per step (weight gradient: output rows of the tile).
    num_warps: warps per program.
    num_stages: software-pipelining depth of the inner loop.

  Raises:
    ValueError: naming the first tunable that Triton cannot use, what was given
      and what is expected.
  """
  for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
    if isinstance(value, bool):
      raise ValueError(f"{name}={value!r} must be an int, not a bool.")
    check_power_of_two(name, value, minimum=MIN_BLOCK, maximum=MAX_BLOCK)
  if isinstance(num_warps, bool):
    raise ValueError(f"num_warps={num_warps!r} must be an int, not a bool.")
  check_choice("num_warps", num_warps, NUM_WARPS_CHOICES)
  if (not isinstance(num_stages, int) or isinstance(num_stages, bool)
      or not 1 <= num_stages <= MAX_NUM_STAGES):
    raise ValueError(
        f"num_stages={num_stages!r} must be an int in [1, {MAX_NUM_STAGES}] "
        "(Triton's software-pipelining depth; 3 or 4 suit Hopper).")


def check_dtype(what: str, dtype: Any, kernel: str) -> jnp.dtype:
  """Returns `dtype` as a jnp.dtype if the `kernel` kernels take it.

  Raises:
    ValueError: for other dtypes, naming the accepted ones.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"{what}={dtype} is not supported by the Triton {kernel} kernels; expected one "
        f"of {[str(d) for d in SUPPORTED_DTYPES]}. Cast the operands first.")
  return dtype


def check_same_dtype(a_name: str, a: Any, b_name: str, b: Any, kernel: str) -> None:
  """Triton's dot takes operands of one element type, so mixed inputs are refused.

  Raises:
    ValueError: for an unsupported dtype or two different ones, saying what to cast.
  """
  check_dtype(f"{a_name}.dtype", a.dtype, kernel)
  if a.dtype != b.dtype:
    raise ValueError(
        f"{a_name}.dtype={a.dtype} and {b_name}.dtype={b.dtype} differ; the Triton dot "
        f"needs one element type. Cast {b_name} to {a.dtype} (or both to a common dtype).")


def int32_overflow(**shapes: tuple[int, ...]) -> str | None:
  """Why some array's element offsets would overflow Pallas Triton's int32 indexing, or None.

  Masked edge tiles reach up to MAX_BLOCK rows and columns past an array, so the
  bound leaves that much room.
  """
  for name, shape in shapes.items():
    reach = math.prod(shape) + (MAX_BLOCK + 1) * (shape[-1] + MAX_BLOCK)
    if reach >= 2**31:
      return (f"{name}.shape={shape} has too many elements for the Triton kernels, which "
              f"address elements with int32 offsets (limit about 2**31 = {2**31}). Split "
              "the call, e.g. over groups or rows.")
  return None


def check_int32_addressing(**shapes: tuple[int, ...]) -> None:
  """Raises ValueError for arrays the kernels cannot index (`int32_overflow`)."""
  why = int32_overflow(**shapes)
  if why:
    raise ValueError(why)


def refuse_unsupported(a_name: str, a: Any, b_name: str, b: Any, **shapes: tuple[int, ...]) -> None:
  """Raises NotImplementedError, so that dispatch goes on to the next implementation, for
  operands `a` and `b` of two dtypes or of one the kernels lack, and for `shapes` too
  large to index (`int32_overflow`). For op classes' `_check_supported`.
  """
  dtypes = {jnp.dtype(a.dtype), jnp.dtype(b.dtype)}
  if len(dtypes) != 1 or not dtypes <= set(SUPPORTED_DTYPES):
    raise NotImplementedError(f"{a_name} and {b_name} dtypes {sorted(map(str, dtypes))}: the "
                              "kernel needs one of bfloat16, float16, float32 for both.")
  why = int32_overflow(**shapes)
  if why:
    raise NotImplementedError(why)


def pow2_at_most(x: int) -> int:
  """The largest power of two <= max(1, x)."""
  return 1 << (max(1, x).bit_length() - 1)


def cap(block: int, dim: int) -> int:
  """Shrinks `block` to the smallest power of two >= 16 that covers `dim`."""
  return max(MIN_BLOCK, min(block, pl.next_power_of_2(dim)))


def smem_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, itemsize: int,
               *, rhs_tiles: int = 1) -> int:
  """Estimates the shared memory of a pipelined K loop: per stage one lhs tile and
  `rhs_tiles` rhs tiles (two for the gated linear unit's gate and linear halves)."""
  return num_stages * (block_m * block_k + rhs_tiles * block_k * block_n) * itemsize


def acc_fits(rows: int, cols: int, num_warps: int) -> bool:
  """Whether a float32 accumulator of rows x cols fits in registers on num_warps."""
  return rows * cols <= ACC_PER_THREAD * 32 * num_warps


def swizzle(pid: jax.Array, num_m_tiles: int, num_n_tiles: int) -> tuple[jax.Array, jax.Array]:
  """Maps a 1-D program id to (m-tile, n-tile) in the grouped order of Triton's matmul
  tutorial: L2_GROUP_M consecutive m-tiles sweep the n-tiles together, so the rows and
  columns they share stay in L2."""
  per_band = L2_GROUP_M * num_n_tiles
  band = index_math.div(pid, per_band)
  first_m = band * L2_GROUP_M
  band_rows = jnp.minimum(num_m_tiles - first_m, L2_GROUP_M)
  within = index_math.rem(pid, per_band)
  return first_m + index_math.rem(within, band_rows), index_math.div(within, band_rows)


def span(start: jax.Array | int, size: int) -> jax.Array:
  """The indices [start, start + size) as an int32 vector."""
  return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def dot_precision(precision: str | None) -> tuple[lax.Precision, lax.Precision] | None:
  """The in-kernel dot's precision for an op's canonical `precision` name.

  Pallas Triton runs a float32 dot as TF32 unless asked for HIGHEST (then IEEE float32),
  as XLA does on the GPU; 16-bit operands are exact either way.
  """
  return None if precision is None else (lax.Precision[precision],) * 2


def dot(a: jax.Array, b: jax.Array, contract_a: int, contract_b: int,
        precision: str | None = None) -> jax.Array:
  """A 2-D dot on the tensor cores with a float32 accumulator.

  Args:
    a, b: 2-D tiles of one dtype.
    contract_a, contract_b: the contracted dimension of each.
    precision: None or a `jax.lax.Precision` name (see `dot_precision`).
  """
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         precision=dot_precision(precision), preferred_element_type=jnp.float32)


def all_of(*masks: jax.Array | None) -> jax.Array | None:
  """The conjunction of the masks that are not None; None when all are."""
  present = [mask for mask in masks if mask is not None]
  return functools.reduce(jnp.logical_and, present) if present else None


def load(ref: Any, mask: jax.Array | None) -> jax.Array:
  """Loads a block; masked-off elements read as zero (never garbage: 0 * NaN is NaN)."""
  if mask is None:
    return ref[...]
  return pltriton.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def store(ref: Any, value: jax.Array, mask: jax.Array | None) -> None:
  """Stores a block, only where `mask` holds (everywhere when it is None)."""
  if mask is None:
    ref[...] = value
  else:
    pltriton.store(ref, value, mask=jnp.broadcast_to(mask, value.shape))
