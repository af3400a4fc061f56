"""Triton kernels lowered in the tests are verified as XLA's GPU compile would (conftest.py)."""

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib import mlir
from jax._src.pallas.triton import pallas_call_registration
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from h200 import H200_MESH  # tests/ is on sys.path
from jax.sharding import use_abstract_mesh



def _lower(kernel):
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32))
  with use_abstract_mesh(H200_MESH):
    return jax.jit(call).trace(jax.ShapeDtypeStruct((16,), jnp.float32)).lower(
        lowering_platforms=("cuda",))


def test_the_hook_is_installed():
  assert getattr(pallas_call_registration.lowering.lower_jaxpr_to_triton_module, "verifies", False), (
      "conftest.py no longer wraps Pallas's Triton module builder (a jax upgrade moved it?):"
      " find where pallas_call lowers a jaxpr to a Triton module and verify there")


def test_a_valid_kernel_lowers():
  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  assert f"stablehlo.custom_call @{pltriton.CUSTOM_CALL_TARGET_NAME}" in _lower(double).as_text()


def test_an_invalid_kernel_is_caught():
  # Bounds of two integer types: lowering alone accepts this loop, Triton's verifier not.
  def loop(x_ref, o_ref):
    n = jnp.where(x_ref[0] > 0, 1, 0)
    o_ref[...] = jax.lax.fori_loop(0, n, lambda i, acc: acc + 1, x_ref[...])
  with pytest.raises(mlir.ir.MLIRError, match="same type"):
    _lower(loop)
