"""Out-of-bounds accesses of interpret-mode kernels are found as the GPU would make them
(interpret_bounds.py, installed for every test by conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import interpret_bounds


def _run(kernel, n=16, out=16, grid=(2,)):
  """Runs `kernel(x_ref, o_ref)` in interpret mode on arange(n); returns (output,
  violations recorded)."""
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((out,), jnp.float32), grid=grid,
                        interpret=True)
  result = np.asarray(jax.jit(call)(jnp.arange(n, dtype=jnp.float32) + 1))
  jax.effects_barrier()
  return result, interpret_bounds.take()


def test_the_checks_are_installed():
  assert interpret_bounds.installed(), (
      "conftest.py no longer wraps interpret mode's reference accesses (a jax upgrade"
      " moved them?): see interpret_bounds.install")


def test_an_in_bounds_kernel_passes():
  def shift(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i * 8, 8)] = x_ref[pl.ds(i * 8, 8)] * 2
  out, found = _run(shift)
  assert found == []
  np.testing.assert_array_equal(out, 2 * (np.arange(16) + 1))


def test_an_overrunning_window_is_caught_where_interpret_mode_shifts_it():
  def overrun(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i * 8, 8)] = x_ref[pl.ds(i * 8 + 4, 8)]
  out, found = _run(overrun)
  # Interpret mode moved the second window back inside: elements 8..15, not 12..19.
  np.testing.assert_array_equal(out[8:], np.arange(8, 16) + 1)
  [violation] = found
  assert violation.access == "read" and violation.shape == (16,) and violation.element == "[16]"
  assert "test_interpret_bounds.py" in violation.site and violation.site.endswith("overrun)")


def test_an_out_of_bounds_write_is_caught():
  def overwrite(x_ref, o_ref):
    o_ref[pl.ds(pl.program_id(0) * 8 + 1, 8)] = x_ref[pl.ds(0, 8)]
  _, found = _run(overwrite)
  assert [(v.access, v.element) for v in found] == [("write", "[16]")]


def test_an_out_of_bounds_read_modify_write_is_caught_twice():
  def accumulate(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[pl.ds(pl.program_id(0) * 8 + 2, 8)] += x_ref[pl.ds(0, 8)]
  _, found = _run(accumulate)  # `+=` reads, then writes
  assert [(v.access, v.element) for v in found] == [("read", "[16]"), ("write", "[16]")]


def test_an_integer_index_past_the_end_is_caught():
  def last(x_ref, o_ref):
    o_ref[...] = jnp.full((16,), x_ref[pl.program_id(0) + 15])
  _, found = _run(last)
  assert [(v.access, v.element) for v in found] == [("read", "[16]")]


def test_masked_accesses_are_checked_only_where_the_mask_is_on():
  def masked(x_ref, o_ref):
    i = pl.program_id(0)
    start = i * 8 + 4
    inside = start + jnp.arange(8) < 16
    window = pltriton.load(x_ref.at[pl.ds(start, 8)], mask=inside, other=0.0)
    pltriton.store(o_ref.at[pl.ds(start, 8)], window, mask=inside)
  out, found = _run(masked)
  assert found == []
  np.testing.assert_array_equal(out[4:], np.arange(4, 16) + 1)

  def leaky(x_ref, o_ref):
    start = pl.program_id(0) * 8 + 4
    leaks = start + jnp.arange(8) < 17  # one element past the end
    o_ref[pl.ds(0, 8)] = pltriton.load(x_ref.at[pl.ds(start, 8)], mask=leaks, other=0.0)
  _, found = _run(leaky)
  assert [(v.access, v.element) for v in found] == [("read", "[16]")]


def test_chained_windows_compose():
  def chained(x_ref, o_ref):
    inner = x_ref.at[pl.ds(8, 8)].at[pl.ds(pl.program_id(0) * 4, 8)]  # 8 + 4 + 8 > 16
    o_ref[pl.ds(0, 8)] = inner[...]
  _, found = _run(chained)
  assert [(v.access, v.element) for v in found] == [("read", "[16]")]


def test_pointer_style_gathers_are_checked():
  def gather(x_ref, o_ref):
    rows = pl.program_id(0) * 4 + jnp.arange(8)
    ok = rows < 16
    o_ref[pl.ds(0, 8)] = pltriton.load(x_ref.at[rows], mask=ok, other=0.0)
    o_ref[pl.ds(8, 8)] = pltriton.load(x_ref.at[rows + 9], mask=rows + 9 < 18, other=0.0)
  out, found = _run(gather, grid=(1,))
  np.testing.assert_array_equal(out[:8], np.arange(8) + 1)
  assert [(v.access, v.element) for v in found] == [("read", "[16]")]


def test_a_leftover_violation_fails_the_test():
  # What conftest.py's fixture calls after each test.
  def overrun(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(pl.program_id(0), 16)]
  call = pl.pallas_call(overrun, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(2,),
                        interpret=True)
  jax.jit(call)(jnp.ones(16))
  with pytest.raises(pytest.fail.Exception, match=r"overrun.*read of element \[16\]"):
    interpret_bounds.fail_on_violations()
  interpret_bounds.fail_on_violations()  # the record was cleared


@pytest.mark.slow  # every Triton kernel interpreted with bounds checks: CI's slow stage
def test_every_access_of_the_triton_kernels_is_checked():
  # The ops' kernels (forward and gradient) index with windows, integers and pointer-
  # style gathers: all of them must be understood, none skipped as `unchecked`.
  import stellarax
  from stellarax.ops.attention.pallas_triton import PallasTritonAttention
  from stellarax.ops.normalization.pallas_triton import PallasTritonLayerNorm
  from stellarax.ops.ragged_dot.pallas_triton import PallasTritonRaggedDot

  k = jax.random.split(jax.random.key(0), 5)
  sizes = jnp.array([20, 0, 25], jnp.int32)
  cases = [
      (lambda x, s: stellarax.layer_norm(x, s, s, implementation=PallasTritonLayerNorm(interpret=True)),
       (jax.random.normal(k[0], (37, 200)), jax.random.normal(k[1], (200,)))),
      (lambda q: stellarax.dot_product_attention(
          q, q, q, is_causal=True, implementation=PallasTritonAttention(interpret=True)),
       (jax.random.normal(k[2], (1, 40, 2, 64)),)),
      (lambda lhs, rhs: stellarax.ragged_dot(lhs, rhs, sizes,
                                             implementation=PallasTritonRaggedDot(interpret=True)),
       (jax.random.normal(k[3], (50, 40)), jax.random.normal(k[4], (3, 40, 24)))),
  ]
  before = (interpret_bounds.checked, interpret_bounds.unchecked)
  for f, args in cases:
    loss = lambda *a: jnp.sum(f(*a) ** 2)
    jax.block_until_ready(jax.grad(loss, argnums=tuple(range(len(args))))(*args))
  assert interpret_bounds.unchecked == before[1]
  assert interpret_bounds.checked > before[0] + 20
