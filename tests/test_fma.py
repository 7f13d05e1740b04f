"""``fma.madd``: ``a * b + c`` as written, or one PTX ``fma.rn`` in the Triton kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from sonew_pax.optim import fma

# a * b = 1 + 2^-11 + 2^-24 exactly: float32 rounds the product to 1 + 2^-11 (a tie, to even), so
# a * b + c is 0 with two roundings and 2^-24 with one.
A = B = 1 + 2.0**-12
C = -(1 + 2.0**-11)


def _asm(fn, *args) -> list[str]:
    """The inline assembly of every ``elementwise_inline_asm`` in ``fn``'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.params["asm"] for e in jaxpr.eqns if e.primitive.name == "elementwise_inline_asm_p"]


def test_madd_is_multiply_then_add_outside_the_kernels():
    rng = np.random.default_rng(0)
    a, b, c = (jnp.asarray(rng.normal(size=64), jnp.float32) for _ in range(3))
    np.testing.assert_array_equal(fma.madd(a, b, c), a * b + c)
    assert _asm(fma.madd, a, b, c) == []
    with fma.contracted(False):
        assert _asm(fma.madd, a, b, c) == []
    assert float(fma.madd(jnp.float32(A), jnp.float32(B), jnp.float32(C))) == 0.0


@pytest.mark.parametrize("dtype, asm", [("float32", "fma.rn.f32"), ("float64", "fma.rn.f64")])
def test_contracted_madd_is_one_fused_instruction(x64, dtype, asm):
    """Within ``contracted`` (as ``fused`` traces its kernels) float32 and float64 operands,
    scalars among them, become one ``fma.rn`` of the operands' common dtype and shape."""
    a, c = jnp.ones((8,), dtype), jnp.zeros((8,), dtype)
    with fma.contracted():
        assert [s.split()[0] for s in _asm(fma.madd, a, jnp.asarray(2, dtype), c)] == [asm]
        out = jax.eval_shape(fma.madd, a, jnp.asarray(2, dtype), c)
    assert out.shape == (8,) and out.dtype == jnp.dtype(dtype)


def test_contracted_madd_of_other_dtypes_is_as_written():
    a = jnp.ones((8,), jnp.bfloat16)
    with fma.contracted():
        assert _asm(fma.madd, a, a, a) == []
        np.testing.assert_array_equal(fma.madd(a, a, a), a * a + a)


def test_subtract_products_as_written_and_contracted():
    """As written: ``c`` minus the products' sum, summed left to right (the window solve's form
    before ``fma``, so the XLA path's roundings stay). Contracted: one ``madd`` per product."""
    rng = np.random.default_rng(1)
    c, a0, b0, a1, b1 = (jnp.asarray(rng.normal(size=16), jnp.float32) for _ in range(5))
    got = fma.subtract_products(c, [(a0, b0), (a1, b1)], c)
    np.testing.assert_array_equal(got, c - (a0 * b0 + a1 * b1))
    np.testing.assert_array_equal(fma.subtract_products(1, [], c), jnp.ones_like(c))
    with fma.contracted():
        assert len(_asm(lambda x: fma.subtract_products(1, [(x, x), (x, x)], x), c)) == 2
        assert _asm(lambda x: fma.subtract_products(1, [], x), c) == []


def _madd_kernel(a_ref, b_ref, c_ref, out_ref):
    with fma.contracted():
        out_ref[...] = fma.madd(a_ref[...], b_ref[...], c_ref[...])


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the fused instruction is PTX")
def test_kernel_madd_rounds_once():
    """In a compiled Triton kernel ``madd`` rounds ``a * b + c`` once: 2^-24 where the product
    rounded first gives 0."""
    args = [jnp.full((32,), x, jnp.float32) for x in (A, B, C)]
    out = pl.pallas_call(_madd_kernel, out_shape=jax.ShapeDtypeStruct((32,), jnp.float32))(*args)
    np.testing.assert_array_equal(out, np.full(32, 2.0**-24, np.float32))
