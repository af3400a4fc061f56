"""Tests of the Pallas Triton ragged_dot kernels.

Numerics run in Pallas interpret mode on the CPU against float64 NumPy loops over
the groups (no compile, so the file stays fast), and once each against the
project's float32 HIGHEST references (`reference.py`) and `jax.lax.ragged_dot` with
its VJP, which pin the semantics. Interpret mode runs grid steps one after another,
so a race shows only when the order changes (tests/ops/test_grid_order.py); the
invariants that make the kernels race-free on a GPU (work items partition the rows,
the program order covers every tile once) are also tested directly. Lowering is
checked for a simulated H200.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
# Interpret mode imports this module lazily, which adds an entry to JAX's tracing
# context and so makes every jitted function retrace once; importing it first keeps
# the compiled kernels shared between tests.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
import pytest
from h200 import lower_for_h200  # tests/ is on sys.path

import stellarax
from stellarax.ops import triton_matmul as tm
from stellarax.ops.ragged_dot import pallas_triton as pt
from stellarax.ops.ragged_dot import split_k as splits
from stellarax.ops.ragged_dot.reference import ragged_dot_reference, ragged_dot_rhs_grad_reference

# Inputs are scaled so that outputs are O(1). bfloat16 outputs carry 8 significant
# bits (relative rounding 2**-9) on top of float32 accumulation; float32 outputs
# differ from the reference only by summation order.
TOLERANCES = {
    jnp.dtype(jnp.bfloat16): dict(atol=1e-2, rtol=1e-2),
    jnp.dtype(jnp.float16): dict(atol=2e-3, rtol=2e-3),
    jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """A ragged_dot problem and the (large, few-step) blocks it is run with."""
  m: int
  k: int
  n: int
  group_sizes: tuple[int, ...]
  block_m: int
  block_n: int
  block_k: int

  @property
  def problem(self) -> tuple[int, int, int, tuple[int, ...]]:
    return self.m, self.k, self.n, self.group_sizes

  def tunables(self) -> dict[str, int]:
    return dict(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                num_warps=4, num_stages=3)


_RAGGED = Workload(150, 70, 90, (37, 0, 50, 40), 64, 64, 32)
# Group sizes are runtime values, so workloads that differ only in them share one
# compiled kernel (compiling dominates the run time of these tests).
WORKLOADS = {
    # Sizes not multiples of block_m, an empty group, rows past the last group, and
    # K and N not multiples of their blocks.
    "ragged": _RAGGED,
    # The groups ask for more rows than M: group 1 is cut at row M, group 3 vanishes.
    "overflowing": dataclasses.replace(_RAGGED, group_sizes=(60, 100, 0, 5)),
    "all_empty": dataclasses.replace(_RAGGED, group_sizes=(0, 0, 0, 0)),
    # Everything divides: the mask-free load and store paths.
    "aligned": Workload(128, 128, 128, (64, 32, 32), 64, 128, 64),
    # Many groups smaller than a tile, two of them empty, and one starting at row 0.
    "tiny_groups": Workload(40, 32, 32, (5, 0, 9, 3, 0, 20), 16, 32, 16),
    # block_m larger than M (rows masked at the array end) and block_k larger than K.
    "block_m_over_m": Workload(20, 24, 16, (7, 13), 64, 16, 32),
}


def _inputs(problem, dtype, seed: int = 0):
  """Fresh random lhs (M, K), rhs (G, K, N), dout (M, N) and the group sizes."""
  m, k, n, group_sizes = problem
  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32)
  rhs = jax.random.normal(keys[1], (len(group_sizes), k, n), jnp.float32) / np.sqrt(k)
  dout = jax.random.normal(keys[2], (m, n), jnp.float32) / np.sqrt(m)
  sizes = jnp.asarray(group_sizes, jnp.int32)
  return lhs.astype(dtype), rhs.astype(dtype), dout.astype(dtype), sizes


def _group_rows(group_sizes, m):
  """Yields (group, start, end): the row range of each group, cut at row m."""
  start = 0
  for group, size in enumerate(group_sizes):
    end = min(start + max(int(size), 0), m)
    yield group, start, end
    start = end


def _np_forward(lhs, rhs, group_sizes):
  """ragged_dot in float64: rows of group g times rhs[g]; rows in no group are zero."""
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  for group, start, end in _group_rows(group_sizes, lhs.shape[0]):
    out[start:end] = lhs[start:end] @ rhs[group]
  return out


def _np_drhs(lhs, dout, group_sizes):
  """The rhs gradient in float64: lhs[rows of g].T @ dout[rows of g] per group."""
  lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
  out = np.zeros((len(group_sizes), lhs.shape[1], dout.shape[1]))
  for group, start, end in _group_rows(group_sizes, lhs.shape[0]):
    out[group] = lhs[start:end].T @ dout[start:end]
  return out


def _assert_close(actual, expected, dtype):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             **TOLERANCES[jnp.dtype(dtype)])


# ------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("name, dtype", [
    *((name, jnp.float32) for name in WORKLOADS if name != "aligned"),
    ("ragged", jnp.bfloat16),
    ("aligned", jnp.float16),
])
def test_forward_matches_reference(name, dtype):
  w = WORKLOADS[name]
  lhs, rhs, _, sizes = _inputs(w.problem, dtype)
  out = pt.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, **w.tunables())
  assert out.shape == (w.m, w.n) and out.dtype == jnp.dtype(dtype)
  _assert_close(out, _np_forward(lhs, rhs, w.group_sizes), dtype)
  # Rows in no group are exactly zero; rows in a group are not.
  total = max(end for _, _, end in _group_rows(w.group_sizes, w.m))
  assert np.all(np.asarray(out[total:]) == 0.0)
  assert np.all(np.abs(np.asarray(out[:total], np.float32)).max(axis=1) > 0.0)


def test_forward_preferred_element_type_float32_from_bfloat16():
  w = WORKLOADS["ragged"]
  lhs, rhs, _, sizes = _inputs(w.problem, jnp.bfloat16)
  out = pt.ragged_dot_pallas_triton(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                    interpret=True, **w.tunables())
  assert out.dtype == jnp.float32
  # Products of bfloat16 values are exact in float32: only summation order differs.
  _assert_close(out, _np_forward(lhs, rhs, w.group_sizes), jnp.float32)


def test_forward_and_gradients_match_lax_ragged_dot():
  """Pins the semantics to jax.lax.ragged_dot itself, gradients through its VJP."""
  w = WORKLOADS["ragged"]
  lhs, rhs, dout, sizes = _inputs(w.problem, jnp.float32, seed=1)
  lax_dot = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision=jax.lax.Precision.HIGHEST)
  expected, vjp = jax.vjp(lax_dot, lhs, rhs)
  expected_dlhs, expected_drhs = vjp(dout)
  tunables = w.tunables()
  _assert_close(pt.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, **tunables),
                expected, jnp.float32)
  _assert_close(pt.ragged_dot_dlhs_pallas_triton(dout, rhs, sizes, interpret=True, **tunables),
                expected_dlhs, jnp.float32)
  _assert_close(pt.ragged_dot_drhs_pallas_triton(lhs, dout, sizes, len(w.group_sizes),
                                                 interpret=True, **tunables),
                expected_drhs, jnp.float32)


def test_kernels_match_the_project_references():
  w = WORKLOADS["ragged"]
  lhs, rhs, dout, sizes = _inputs(w.problem, jnp.float32, seed=7)
  g, tunables = len(w.group_sizes), w.tunables()
  _assert_close(pt.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, **tunables),
                ragged_dot_reference(lhs, rhs, sizes), jnp.float32)
  _assert_close(pt.ragged_dot_drhs_pallas_triton(lhs, dout, sizes, g, interpret=True, **tunables),
                ragged_dot_rhs_grad_reference(lhs, dout, sizes, g), jnp.float32)


@pytest.mark.parametrize("name, dtype", [
    ("ragged", jnp.float32),
    ("ragged", jnp.bfloat16),
    ("overflowing", jnp.float32),
    ("block_m_over_m", jnp.float32),
])
def test_dlhs_matches_reference(name, dtype):
  w = WORKLOADS[name]
  _, rhs, dout, sizes = _inputs(w.problem, dtype, seed=2)
  dlhs = pt.ragged_dot_dlhs_pallas_triton(dout, rhs, sizes, interpret=True, **w.tunables())
  assert dlhs.shape == (w.m, w.k) and dlhs.dtype == jnp.dtype(dtype)
  _assert_close(dlhs, _np_forward(dout, jnp.swapaxes(rhs, 1, 2), w.group_sizes), dtype)


@pytest.mark.parametrize("name, dtype", [
    ("ragged", jnp.float32),
    ("ragged", jnp.bfloat16),
    ("aligned", jnp.float16),
    ("overflowing", jnp.float32),
    ("all_empty", jnp.float32),
    ("block_m_over_m", jnp.float32),
])
def test_drhs_matches_reference(name, dtype):
  w = WORKLOADS[name]
  lhs, _, dout, sizes = _inputs(w.problem, dtype, seed=3)
  g = len(w.group_sizes)
  drhs = pt.ragged_dot_drhs_pallas_triton(lhs, dout, sizes, g, interpret=True, **w.tunables())
  assert drhs.shape == (g, w.k, w.n) and drhs.dtype == jnp.dtype(dtype)
  _assert_close(drhs, _np_drhs(lhs, dout, w.group_sizes), dtype)
  for group, start, end in _group_rows(w.group_sizes, w.m):
    assert (np.abs(np.asarray(drhs[group], np.float32)).max() == 0.0) == (start == end)


@pytest.mark.parametrize("name,split_rows", [
    ("ragged", 2), ("ragged", 4), ("tiny_groups", 4), ("overflowing", 2), ("all_empty", 2),
    ("aligned", 8),
])
def test_drhs_split_over_rows_matches_reference(name, split_rows):
  """Split-K: several programs sum shares of a group's row blocks (more shares than
  blocks leaves some programs with nothing to add)."""
  w = WORKLOADS[name]
  lhs, _, dout, sizes = _inputs(w.problem, jnp.float32, seed=4)
  g = len(w.group_sizes)
  drhs = pt.ragged_dot_drhs_pallas_triton(lhs, dout, sizes, g, interpret=True, split_rows=split_rows,
                                          **w.tunables())
  assert drhs.shape == (g, w.k, w.n) and drhs.dtype == jnp.float32
  _assert_close(drhs, _np_drhs(lhs, dout, w.group_sizes), jnp.float32)
  with pytest.raises(ValueError, match="split_rows=3 must be a power of two"):
    pt.ragged_dot_drhs_pallas_triton(lhs, dout, sizes, g, interpret=True, split_rows=3, **w.tunables())


def test_group_sizes_are_runtime_values():
  """One compiled kernel serves different group sizes (they are traced, not static)."""
  w = WORKLOADS["tiny_groups"]
  lhs, rhs, _, _ = _inputs(w.problem, jnp.float32, seed=4)
  compiled_before = pt.ragged_dot_pallas_triton._cache_size()
  for sizes in ((20, 0, 0, 10, 2, 8), (0, 0, 0, 0, 0, 40)):
    out = pt.ragged_dot_pallas_triton(lhs, rhs, jnp.asarray(sizes, jnp.int32), interpret=True,
                                      **w.tunables())
    _assert_close(out, _np_forward(lhs, rhs, sizes), jnp.float32)
  assert pt.ragged_dot_pallas_triton._cache_size() - compiled_before <= 1


# ---------------------------------------------------------- race-freedom invariants


@pytest.mark.parametrize("block_m", [16, 64])
def test_work_items_partition_the_rows(block_m):
  """Each output row lies in exactly one work item, within one group (or the tail)."""
  m, g = 200, 7
  rng = np.random.default_rng(5)
  items_fn = jax.jit(lambda sizes: pt._work_items(pt._group_offsets(sizes, m), m, block_m))
  for trial in range(20):
    sizes = rng.integers(0, 2 * m // g, size=g)
    sizes[rng.integers(0, g)] = 0  # always at least one empty group
    part, start, end = np.asarray(items_fn(jnp.asarray(sizes, jnp.int32)))
    assert part.shape == (pt.pl.cdiv(m, block_m) + g,)
    bounds = np.minimum(np.concatenate([[0], np.cumsum(sizes), [m]]), m)
    owner = np.full(m, -1)
    for p, s, e in zip(part, start, end):
      assert 0 <= e - s <= block_m, (trial, p, s, e)
      if e > s:
        assert bounds[p] <= s and e <= bounds[p + 1], (trial, p, s, e)
        assert np.all(owner[s:e] == -1), f"rows {s}:{e} written twice"
        owner[s:e] = p
    assert np.all(owner >= 0), "some rows belong to no work item"


@pytest.mark.parametrize("num_items, num_n_tiles", [(1, 1), (5, 3), (8, 2), (19, 7), (30, 1)])
def test_program_order_covers_every_tile_once(num_items, num_n_tiles):
  pids = jnp.arange(num_items * num_n_tiles, dtype=jnp.int32)
  item, tile_n = (np.asarray(x) for x in tm.swizzle(pids, num_items, num_n_tiles))
  assert np.all((0 <= item) & (item < num_items) & (0 <= tile_n) & (tile_n < num_n_tiles))
  assert len(set(zip(item.tolist(), tile_n.tolist()))) == num_items * num_n_tiles


# ------------------------------------------------------------------------- errors


@pytest.mark.parametrize("field, value, message", [
    ("block_m", 8, r"block_m=8 must be a power of two >= 16"),
    ("block_n", 48, r"block_n=48 must be a power of two"),
    ("block_k", 512, r"block_k=512 must be a power of two >= 16 and <= 256"),
    ("block_k", True, r"block_k=True must be an int"),
    ("num_warps", 3, r"num_warps=3 must be one of"),
    ("num_stages", 0, r"num_stages=0 must be an int in \[1, 8\]"),
])
def test_invalid_tunables_are_rejected(field, value, message):
  tunables = dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
  pt.validate_tunables(**tunables)
  tunables[field] = value
  with pytest.raises(ValueError, match=message):
    pt.validate_tunables(**tunables)
  lhs, rhs, _, sizes = _inputs(WORKLOADS["ragged"].problem, jnp.float32)
  with pytest.raises(ValueError, match=message):
    pt.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, **tunables)


def test_invalid_operands_are_rejected():
  w = WORKLOADS["ragged"]
  lhs, rhs, dout, sizes = _inputs(w.problem, jnp.float32)
  tunables = w.tunables()
  with pytest.raises(ValueError, match=r"lhs.dtype=float32 and rhs.dtype=bfloat16 differ"):
    pt.ragged_dot_pallas_triton(lhs, rhs.astype(jnp.bfloat16), sizes, **tunables)
  with pytest.raises(ValueError, match=r"lhs.dtype=int8 is not supported"):
    pt.ragged_dot_pallas_triton(lhs.astype(jnp.int8), rhs.astype(jnp.int8), sizes, **tunables)
  with pytest.raises(ValueError, match=r"contracting sizes differ"):
    pt.ragged_dot_pallas_triton(lhs[:, :60], rhs, sizes, **tunables)
  with pytest.raises(ValueError, match=r"group_sizes.shape=\(3,\) must be \(4,\)"):
    pt.ragged_dot_pallas_triton(lhs, rhs, sizes[:3], **tunables)
  with pytest.raises(ValueError, match=r"dout \(M, N\) and rhs \(G, K, N\) with the same N"):
    pt.ragged_dot_dlhs_pallas_triton(dout[:, :50], rhs, sizes, **tunables)
  with pytest.raises(ValueError, match=r"lhs \(M, K\) and dout \(M, N\) with the same M"):
    pt.ragged_dot_drhs_pallas_triton(lhs[:100], dout, sizes, 4, **tunables)
  with pytest.raises(ValueError, match=r"lhs.dtype=float32 and dout.dtype=bfloat16 differ"):
    pt.ragged_dot_drhs_pallas_triton(lhs, dout.astype(jnp.bfloat16), sizes, 4, **tunables)


def test_arrays_beyond_int32_addressing_are_rejected():
  lhs = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((64, 4096, 8192), jnp.bfloat16)  # 2**31 elements
  sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
  tunables = WORKLOADS["aligned"].tunables()
  with pytest.raises(ValueError, match=r"rhs.shape=\(64, 4096, 8192\) has too many elements"):
    jax.eval_shape(lambda a, b, c: pt.ragged_dot_pallas_triton(a, b, c, **tunables),
                   lhs, rhs, sizes)
  # The op does not take such a call, so dispatch goes on to the next implementation.
  with pytest.raises(NotImplementedError, match="too many elements"):
    pt.PallasTritonRaggedDot.bind(lhs, rhs, sizes)
  with pytest.raises(NotImplementedError, match="too many elements"):
    pt.PallasTritonRaggedDotVjp.bind(residuals=None, out=jax.ShapeDtypeStruct((8, 8192), jnp.bfloat16),
                                     dout=jax.ShapeDtypeStruct((8, 8192), jnp.bfloat16), lhs=lhs,
                                     rhs=rhs, group_sizes=sizes)
  out = jax.eval_shape(lambda a, b, c: stellarax.ragged_dot(
      a, b, c, implementation=[pt.PallasTritonRaggedDot(interpret=True), "xla"]), lhs, rhs, sizes)
  assert out.shape == (8, 8192)


# ---------------------------------------------------------------------- tunables

SHAPES = [
    (8192, 4096, 14336, 8),   # the H200 speed target, G=8
    (16384, 2048, 1536, 64),  # the H200 speed target, G=64
    (4096, 1024, 2048, 512),  # groups of 8 rows
    (150, 70, 90, 4),
    (16, 16, 16, 1),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_tunable_space_is_valid_for_the_shape(shape, dtype):
  m, k, n, g = shape
  space = pt.tunable_space(m, k, n, g, dtype)
  assert space[0] == pt.heuristic_tunables(m, k, n, g, dtype)
  assert 1 <= len(space) <= 60
  keys = [tuple(sorted(config.items())) for config in space]
  assert len(set(keys)) == len(keys)
  for config in space:
    pt.validate_tunables(**config)
    for block, dim in ((config["block_m"], m), (config["block_n"], n), (config["block_k"], k)):
      assert block <= max(16, splits.pow2_at_least(dim)), (config, shape)
    smem = tm.smem_bytes(config["block_m"], config["block_n"], config["block_k"],
                          config["num_stages"], jnp.dtype(dtype).itemsize)
    assert smem <= 227 * 1024, config
    # No accumulator of more than 128 floats a thread: those spilled on an H200.
    assert config["block_m"] * config["block_n"] <= 128 * 32 * config["num_warps"], config
  if min(m, k, n) >= 1024:
    assert len(space) >= 20


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_configs_fit_the_rhs_gradient_kernel(shape, dtype):
  # One config tiles both gradients; the rhs gradient pipelines block_m x (block_k +
  # block_n) a stage into a block_k x block_n accumulator.
  m, k, n, g = shape
  ba = pt.PallasTritonRaggedDot().vjp_op().bind(
      None, jax.ShapeDtypeStruct((m, n), dtype), jax.ShapeDtypeStruct((m, n), dtype),
      jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
      jax.ShapeDtypeStruct((g,), jnp.int32))
  configs = ba.autotuning_configs
  assert ba.heuristics_config in configs and len(configs) >= (10 if min(m, k, n) >= 1024 else 1)
  itemsize = jnp.dtype(dtype).itemsize
  for c in configs:
    assert c.num_stages * c.block_m * (c.block_k + c.block_n) * itemsize <= 227 * 1024, c
    assert c.block_k * c.block_n <= 128 * 32 * c.num_warps, c


def test_heuristic_tunables():
  assert pt.heuristic_tunables(8192, 4096, 14336, 8, jnp.bfloat16) == dict(
      block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)
  # Groups of 8 rows: a 16-row tile wastes less than a 128-row one.
  assert pt.heuristic_tunables(4096, 1024, 2048, 512, jnp.bfloat16)["block_m"] == 16
  # Tiny problems get tiles no larger than needed.
  small = pt.heuristic_tunables(20, 24, 16, 2, jnp.float32)
  assert (small["block_m"], small["block_n"], small["block_k"]) == (16, 16, 32)
  with pytest.raises(ValueError, match=r"dtype=int8 is not supported"):
    pt.heuristic_tunables(64, 64, 64, 2, jnp.int8)
  with pytest.raises(ValueError, match=r"g=0 must be a positive int"):
    pt.tunable_space(64, 64, 64, 0, jnp.bfloat16)


def test_a_config_from_the_space_runs():
  """The last config of a small shape's space (unlike the workloads' blocks) computes correctly."""
  m, k, n, group_sizes = problem = (64, 32, 48, (10, 30, 0, 20))
  lhs, rhs, _, sizes = _inputs(problem, jnp.bfloat16, seed=6)
  space = pt.tunable_space(m, k, n, len(group_sizes), jnp.bfloat16)
  out = pt.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, **space[-1])
  _assert_close(out, _np_forward(lhs, rhs, group_sizes), jnp.bfloat16)


# ---------------------------------------------------------------------- lowering


@pytest.mark.parametrize("kernel", ["fwd", "dlhs", "drhs"])
@pytest.mark.parametrize("m, k, n, g, dtype", [
    (8192, 4096, 14336, 8, jnp.bfloat16),
    (150, 70, 90, 4, jnp.float32),
])
def test_kernels_lower_for_h200(kernel, m, k, n, g, dtype):
  tunables = pt.heuristic_tunables(m, k, n, g, dtype) | dict(num_warps=8, num_stages=4)
  lhs = jax.ShapeDtypeStruct((m, k), dtype)
  rhs = jax.ShapeDtypeStruct((g, k, n), dtype)
  dout = jax.ShapeDtypeStruct((m, n), dtype)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  bm, bn, bk = tunables["block_m"], tunables["block_n"], tunables["block_k"]
  fn, args, programs = {
      "fwd": (pt.ragged_dot_pallas_triton, (lhs, rhs, sizes),
              (pt.pl.cdiv(m, bm) + g) * pt.pl.cdiv(n, bn)),
      "dlhs": (pt.ragged_dot_dlhs_pallas_triton, (dout, rhs, sizes),
               (pt.pl.cdiv(m, bm) + g) * pt.pl.cdiv(k, bn)),
      "drhs": (functools.partial(pt.ragged_dot_drhs_pallas_triton, num_groups=g),
               (lhs, dout, sizes), g * pt.pl.cdiv(k, bk) * pt.pl.cdiv(n, bn)),
  }[kernel]
  text = lower_for_h200(functools.partial(fn, **tunables), *args)
  assert f"stablehlo.custom_call @{pt.pltriton.CUSTOM_CALL_TARGET_NAME}" in text
  assert f'name = "ragged_dot_{kernel}"' in text
  assert "num_stages = 4 : i32, num_warps = 8 : i32" in text
  assert f"grid_x = {programs} : i32" in text


def test_splits_are_offered_where_the_output_has_few_tiles():
  tiling = dict(block_m=128, block_n=128, block_k=64)
  assert pt.split_k_choices(8192, 4096, 14336, 8, **tiling) == [1]
  assert pt.split_k_choices(64, 4096, 1024, 8, **tiling) == [4, 1, 2]  # decode: 72 tiles (x8 > 4 per core)
  assert pt.split_k_choices(64, 64, 1024, 8, **tiling) == [1]  # one K block: nothing to split
  forward = pt._fwd_configs(64, 4096, 1024, 8, jnp.bfloat16)
  assert forward[0].split_k == 4 and len(set(forward)) == len(forward)
  assert pt.split_rows_choices(8192, 4096, 14336, 8, **tiling) == [1]  # 28672 tiles
  assert pt.split_rows_choices(4096, 256, 256, 4, **tiling) == [4, 1, 2, 8]  # 32 tiles
  assert pt.split_rows_choices(512, 256, 256, 4, **tiling) == [1]  # 128 rows a group: one block
  configs = pt._vjp_configs(4096, 256, 256, 4, jnp.bfloat16)
  assert configs[0].split_rows == 4 and len(set(configs)) == len(configs)
  with pytest.raises(ValueError, match="split_rows=6 must be a power of two"):
    pt.PallasTritonRaggedDotVjpConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3,
                                      split_rows=6)
  with pytest.raises(ValueError, match="split_k=32 must be a power of two"):
    pt.PallasTritonRaggedDotConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3,
                                   split_k=32)


def test_vjp_op_with_split_rows_matches_lax():
  w = WORKLOADS["ragged"]
  lhs, rhs, dout, sizes = _inputs(w.problem, jnp.float32, seed=5)
  config = pt.PallasTritonRaggedDotVjpConfig(**w.tunables(), split_rows=2)
  vjp = pt.PallasTritonRaggedDotVjp(interpret=True, config=config)
  out = jax.lax.ragged_dot(lhs, rhs, sizes)
  grads = vjp(residuals=None, out=out, dout=dout, lhs=lhs, rhs=rhs, group_sizes=sizes)
  _assert_close(grads["rhs"], _np_drhs(lhs, dout, w.group_sizes), jnp.float32)
  _assert_close(grads["lhs"], _np_forward(dout, jnp.swapaxes(rhs, 1, 2), w.group_sizes), jnp.float32)


def test_split_kernels_lower_for_h200():
  m, k, n, g, dtype = 4096, 256, 256, 4, jnp.bfloat16
  tunables = pt.heuristic_tunables(m, k, n, g, dtype)
  fn = functools.partial(pt.ragged_dot_drhs_pallas_triton, num_groups=g, split_rows=4, **tunables)
  text = lower_for_h200(fn, jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((m, n), dtype),
                         jax.ShapeDtypeStruct((g,), jnp.int32))
  tiles = g * pt.pl.cdiv(k, tunables["block_k"]) * pt.pl.cdiv(n, tunables["block_n"])
  assert f"grid_x = {4 * tiles} : i32" in text and "tensor<4x4x256x256xf32>" in text
  m, k, n = 64, 4096, 1024  # decode-sized forward
  tunables = pt.heuristic_tunables(m, k, n, g, dtype)
  fn = functools.partial(pt.ragged_dot_pallas_triton, split_k=4, **tunables)
  text = lower_for_h200(fn, jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
                         jax.ShapeDtypeStruct((g,), jnp.int32))
  items = pt.pl.cdiv(m, tunables["block_m"]) + g
  assert f"grid_x = {4 * items * pt.pl.cdiv(n, tunables['block_n'])} : i32" in text
  assert "tensor<4x64x1024xf32>" in text


@pytest.mark.parametrize("name,split_k", [
    ("ragged", 2), ("ragged", 4), ("tiny_groups", 2), ("overflowing", 2), ("aligned", 2),
    ("block_m_over_m", 2),
])
def test_forward_split_over_k_matches_reference(name, split_k):
  """Split-K forward, K not a multiple of block_k included (more shares than K blocks
  leaves some programs with only zeros to add)."""
  w = WORKLOADS[name]
  lhs, rhs, _, sizes = _inputs(w.problem, jnp.float32, seed=6)
  out = pt.ragged_dot_pallas_triton(lhs, rhs, sizes, interpret=True, split_k=split_k, **w.tunables())
  assert out.shape == (w.m, w.n) and out.dtype == jnp.float32
  _assert_close(out, _np_forward(lhs, rhs, w.group_sizes), jnp.float32)
  op = pt.PallasTritonRaggedDot(interpret=True, config=pt.PallasTritonRaggedDotConfig(
      **w.tunables(), split_k=split_k))
  _assert_close(op(lhs, rhs, sizes), _np_forward(lhs, rhs, w.group_sizes), jnp.float32)


@pytest.mark.parametrize("precision", [None, "highest"])
def test_precision_reaches_every_kernel_dot(precision):
  """Pallas Triton multiplies float32 as TF32 unless the dot asks for HIGHEST, so the
  op's `precision` must reach each dot of the forward and of both gradients (they had
  dropped it: HIGHEST got TF32 on a GPU, which interpret mode on a CPU cannot show)."""
  lhs, rhs, _, sizes = _inputs((100, 72, 40, (30, 0, 50)), jnp.float32, seed=3)
  op = pt.PallasTritonRaggedDot(interpret=True)
  loss = lambda a, b: stellarax.ragged_dot(a, b, sizes, precision=precision, implementation=op).sum()
  text = str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs))
  dots = text.count("dot_general[")
  highest = text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)")
  assert dots >= 3  # forward, lhs and rhs gradients
  assert highest == (dots if precision else 0)
