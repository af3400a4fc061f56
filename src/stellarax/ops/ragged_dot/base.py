"""The ragged_dot family: grouped matmul of mixture-of-experts layers.

`ragged_dot(lhs (M, K), rhs (G, K, N), group_sizes (G,))`: rows of group g
(consecutive, in group order) are multiplied by `rhs[g]`; rows past
`sum(group_sizes)` give zeros; groups may be empty. Semantics of
`jax.lax.ragged_dot`.

This file holds the family's base classes (signature, validation, reference,
example inputs) and its XLA implementations.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stellarax.core.config import check_choice, check_power_of_two, config_dataclass
from stellarax.core import partitioning
from stellarax.core.op import Op
from stellarax.ops import common
from stellarax.ops.ragged_dot import reference as ref
from stellarax.ops.ragged_dot import xla


# Only the output's columns may be split: rows are cut into groups by a runtime
# group_sizes that every device would need whole, and the contraction is left whole.
_LABELS = {"lhs": "m k", "rhs": "g k n", "group_sizes": "g"}
_FREE = frozenset({"n"})


class RaggedDot(Op):
  """Base of the ragged_dot implementations (forward)."""

  def _fwd(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, config):
    raise NotImplementedError

  def _canonicalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
    lhs, rhs, gs = arguments["lhs"], arguments["rhs"], arguments["group_sizes"]
    common.check_rank("lhs", lhs, 2, "(M, K)")
    common.check_rank("rhs", rhs, 3, "(G, K, N)")
    common.check_rank("group_sizes", gs, 1, "(G,)")
    if lhs.shape[1] != rhs.shape[1]:
      raise ValueError(f"lhs (M, K)={tuple(lhs.shape)} and rhs (G, K, N)={tuple(rhs.shape)} must agree on K.")
    if gs.shape[0] != rhs.shape[0]:
      raise ValueError(f"group_sizes has {gs.shape[0]} groups but rhs has G={rhs.shape[0]}.")
    if not jnp.issubdtype(common.dtype_of(gs), jnp.integer):
      raise TypeError(f"group_sizes must be an integer array, got dtype {common.dtype_of(gs)}.")
    common.check_floating("lhs", lhs)
    common.check_floating("rhs", rhs)
    arguments["precision"] = common.canonical_precision(arguments["precision"])
    out = common.canonical_dtype(arguments["preferred_element_type"], what="preferred_element_type")
    if out is None and common.dtype_of(lhs) != common.dtype_of(rhs):
      # Operands of two dtypes give their promoted type (jax.lax.ragged_dot too, but
      # for float16 with bfloat16: float32 here, bfloat16 there).
      out = jnp.result_type(common.dtype_of(lhs), common.dtype_of(rhs)).name
    arguments["preferred_element_type"] = out
    return arguments

  def _is_trivial(self, arguments):
    # M, K or N of zero: an empty output, or (K = 0) an empty sum; no group (G = 0):
    # every row in none. Zeros in each case, as jax.lax.ragged_dot gives.
    (m, k), (g, _, n) = arguments["lhs"].shape, arguments["rhs"].shape
    return 0 in (m, k, n, g)

  def _example_value(self, name, spec, key, arguments):
    if name == "group_sizes":
      return example_group_sizes(key, arguments["lhs"].shape[0], spec.shape[0])
    return Op._example_value(self, name, spec, key, arguments)

  def _reference(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None):
    del precision
    return ref.ragged_dot_reference(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

  def _array_layout(self, arguments):
    return partitioning.ShardingLayout(_LABELS, ("m n", None), _FREE)


def example_group_sizes(key: jax.Array, m: int, g: int) -> jax.Array:
  """Random uneven group sizes summing to `m` (some groups may be empty)."""
  if g == 0:
    return jnp.zeros((0,), jnp.int32)
  weights = np.asarray(jax.random.dirichlet(key, jnp.ones((g,))))
  sizes = np.floor(weights * m).astype(np.int32)
  sizes[np.argmax(weights)] += m - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


class RaggedDotVjp(Op):
  """Base of the ragged_dot backward implementations: d lhs and d rhs."""

  def _fwd(self, residuals, out, dout, lhs, rhs, group_sizes, *, precision=None,
           preferred_element_type=None, config):
    raise NotImplementedError

  def _canonicalize(self, arguments):
    fwd_args = {k: arguments[k] for k in ("lhs", "rhs", "group_sizes", "precision", "preferred_element_type")}
    arguments.update(RaggedDot._canonicalize(self, fwd_args))
    return arguments

  _example_value = RaggedDot._example_value

  def _reference(self, residuals, out, dout, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None):
    del residuals, out, precision
    f = lambda l, r: ref.ragged_dot_reference(l, r, group_sizes, preferred_element_type=preferred_element_type)
    _, pullback = jax.vjp(f, lhs, rhs)
    dlhs, drhs = pullback(dout.astype(jnp.result_type(lhs.dtype, preferred_element_type or lhs.dtype)))
    return {"lhs": dlhs, "rhs": drhs}

  def _array_layout(self, arguments):
    # d lhs sums over the output's columns: split, each device adds its part.
    labels = dict(_LABELS, out="m n", dout="m n")  # no residuals
    return partitioning.ShardingLayout(labels, {"lhs": "m k", "rhs": "g k n"}, _FREE)


# ---------------------------------------------------------------------------
# XLA implementations.

STRATEGIES = ("lax", "masked", "tiled")


@config_dataclass
class XlaRaggedDotConfig:
  """Tunables of the XLA ragged_dot.

  Attributes:
    strategy: "lax" (jax.lax.ragged_dot), "masked" (one masked matmul per
      group) or "tiled" (group-aware row tiles, one batched matmul).
    tile_m: rows per tile of the "tiled" strategy (power of two >= 8).
  """

  strategy: str = "lax"
  tile_m: int = 128

  def __post_init__(self):
    check_choice("strategy", self.strategy, STRATEGIES)
    check_power_of_two("tile_m", self.tile_m, minimum=8)


# "masked" multiplies every row by every group's weights: G times the work of
# the others. Past a few groups it cannot win, and at the sizes of real models
# (G=64, M=16384, K=2048, N=1536: 6.6 PFLOP, ~10 s on an H200) one measurement
# would eat a tuning budget.
_MASKED_MAX_GROUPS = 8


def _xla_space(m: int, g: int) -> set[XlaRaggedDotConfig]:
  space = {XlaRaggedDotConfig(strategy="lax")}
  if g <= _MASKED_MAX_GROUPS:
    space.add(XlaRaggedDotConfig(strategy="masked"))
  space |= {XlaRaggedDotConfig(strategy="tiled", tile_m=t) for t in (16, 32, 64, 128, 256, 512) if t <= max(16, 2 * m)}
  return space


def _xla_heuristic(ba) -> XlaRaggedDotConfig:
  """Native `lax.ragged_dot` where XLA has a grouped-matmul emitter (GPU,
  TPU); on a single CPU device, where it loops over groups with masks,
  group-aligned tiles of 64-128 rows measured 3-8x faster (M=2048, K=N=512,
  G=8 and 64). Not with several CPU devices: over Auto mesh axes XLA partitions
  this implementation itself (`core/partitioning.py`), and the tiles gather rows by
  where the groups fall, which it cannot keep split (lhs rows split over devices:
  every device computes every row, after an all-reduce of the tiles, and the
  output leaves whole), where `lax.ragged_dot` keeps them split. The platform is the
  one traced for (an abstract mesh's device when lowering for a GPU from a CPU host).
  Tiles no larger than the space offers (`_xla_space`: up to twice M rows)."""
  if partitioning.target_device().platform != "cpu" or jax.device_count() > 1:
    return XlaRaggedDotConfig(strategy="lax")
  m, g = ba.arguments["lhs"].shape[0], ba.arguments["rhs"].shape[0]
  tile = 64 if m < 128 * max(g, 1) else 128
  while tile > max(16, 2 * m):
    tile //= 2
  return XlaRaggedDotConfig(strategy="tiled", tile_m=tile)


def _wider(a: Any, b: Any) -> Any:
  """The dtype of more bits of two (float32 for two of one size, e.g. bfloat16 and
  float16). Not `jnp.promote_types`, which refuses 8-bit floats with any other."""
  a, b = jnp.dtype(a), jnp.dtype(b)
  if a == b:
    return a
  if a.itemsize != b.itemsize:
    return a if a.itemsize > b.itemsize else b
  return jnp.dtype(jnp.float32)


class XlaRaggedDotVjp(RaggedDotVjp, name="ragged_dot.xla_vjp"):
  """XLA backward of ragged_dot: d lhs is a ragged dot with rhs transposed,
  d rhs a grouped lhs^T @ dout; both use the config's strategy."""

  config_cls = XlaRaggedDotConfig

  def _fwd(self, residuals, out, dout, lhs, rhs, group_sizes, *, precision=None,
           preferred_element_type=None, config):
    del residuals, out
    kw = dict(strategy=config.strategy, tile_m=config.tile_m, precision=common.lax_precision(precision))
    # Each product in the wider of its operands' dtypes: a float32 cotangent cast down to
    # a bfloat16 lhs's dtype would cost a float32 rhs's gradient its precision.
    wide = _wider(dout.dtype, rhs.dtype)
    dlhs = xla.ragged_dot_xla(dout.astype(wide), jnp.swapaxes(rhs, 1, 2).astype(wide), group_sizes,
                              preferred_element_type=lhs.dtype, **kw)
    wide = _wider(lhs.dtype, dout.dtype)
    drhs = xla.ragged_dot_rhs_grad_xla(lhs.astype(wide), dout.astype(wide), group_sizes, rhs.shape[0],
                                       preferred_element_type=rhs.dtype, **kw)
    return {"lhs": dlhs, "rhs": drhs}

  def _get_heuristics_config(self, ba):
    return _xla_heuristic(ba)

  def _get_autotuning_configs(self, ba):
    return _xla_space(ba.arguments["lhs"].shape[0], ba.arguments["rhs"].shape[0])


class XlaRaggedDot(RaggedDot, name="ragged_dot.xla"):
  """ragged_dot in XLA, with the strategy and group tiling as tunables."""

  config_cls = XlaRaggedDotConfig
  vjp_cls = XlaRaggedDotVjp

  def _fwd(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, config):
    out = xla.ragged_dot_xla(lhs, rhs, group_sizes, strategy=config.strategy, tile_m=config.tile_m,
                             precision=common.lax_precision(precision),
                             preferred_element_type=preferred_element_type)
    return out, None

  def _get_heuristics_config(self, ba):
    return _xla_heuristic(ba)

  def _get_autotuning_configs(self, ba):
    return _xla_space(ba.arguments["lhs"].shape[0], ba.arguments["rhs"].shape[0])
