"""Split-K for the ragged_dot kernels: how many programs share one output tile's sum.

An output with fewer tiles than the GPU has cores leaves cores idle; sharing each
tile's contraction among `split` programs, each writing a float32 partial that XLA
sums, fills them at the price of the partials' memory traffic. The Pallas Triton and
Mosaic GPU kernels offer the same splits, chosen here.
"""

from __future__ import annotations

# The largest split the kernels take (a power of two).
MAX_SPLIT = 16
# Streaming multiprocessors of an H200, the target.
H200_CORES = 132


def pow2_at_least(x: int) -> int:
  """The smallest power of two >= x (1 for x <= 1)."""
  return 1 << (max(1, x) - 1).bit_length()


def split_choices(tiles: int, steps: int) -> list[int]:
  """Splits worth trying of a contraction of `steps` blocks per output tile, for an
  output of `tiles` tiles, the guess first.

  Splitting pays where the output has fewer tiles than the H200's 132 cores. The
  guess is the smallest split giving about two programs per core, halved until every
  share has two blocks; also tried: no split, half and twice the guess (while there
  are at most 4 programs per core and a block per share).

  Args:
    tiles: output tiles of the launch.
    steps: contraction blocks per output tile.

  Returns:
    Distinct powers of two, each <= MAX_SPLIT, the guess first.
  """
  guess = 1
  if tiles < H200_CORES:
    guess = min(MAX_SPLIT, pow2_at_least(-(-2 * H200_CORES // tiles)))
    while guess > 1 and steps // guess < 2:
      guess //= 2
  useful = lambda s: s == 1 or (s <= MAX_SPLIT and tiles * s <= 4 * H200_CORES and steps // s >= 1)
  return [s for s in dict.fromkeys([guess, 1, max(1, guess // 2), 2 * guess]) if useful(s)]
