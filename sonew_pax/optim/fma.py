"""``a * b + c`` for the math ``pointwise`` and ``solve`` share: one rounding in the GPU kernels.

The XLA path and Pallas' interpreter compute :func:`madd` as written, ``a * b + c``. The Triton
kernels, as XLA compiles them, keep every multiply and add apart, each waiting on the last where
one fused instruction would do. Within :func:`contracted` (the banded walk is traced there for
NVIDIA GPUs, ``kernels.KernelConfig.fma``) :func:`madd` of float32 or float64 values is PTX's
``fma.rn`` instead: ``a * b + c`` rounded once. The kernels' results then differ from the XLA
path's within float rounding.

:func:`subtract_products` is ``c - sum_k a_k b_k``, the form of every sum in the window solve
(``solve.window_solve``): a chain of :func:`madd` within :func:`contracted`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

_CONTRACTED = contextvars.ContextVar("sonew_pax_fma_contracted", default=False)
# PTX's fused multiply-add per dtype, with the inline-assembly register class of its operands.
_PTX = {
    jnp.dtype(jnp.float32): ("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f"),
    jnp.dtype(jnp.float64): ("fma.rn.f64 $0, $1, $2, $3;", "=d,d,d,d"),
}


@contextlib.contextmanager
def contracted(enabled: bool = True) -> Iterator[None]:
    """Within (while a Triton kernel is traced): :func:`madd` of float32 and float64 values is
    one fused multiply-add, when ``enabled``."""
    token = _CONTRACTED.set(enabled)
    try:
        yield
    finally:
        _CONTRACTED.reset(token)


def madd(a, b, c) -> jax.Array:
    """``a * b + c``: as written, or rounded once within :func:`contracted`."""
    if not _CONTRACTED.get() or (dtype := jnp.result_type(a, b, c)) not in _PTX:
        return a * b + c
    asm, constraints = _PTX[dtype]
    args = jnp.broadcast_arrays(*(jnp.asarray(x, dtype) for x in (a, b, c)))
    (out,) = plgpu.elementwise_inline_asm(
        asm,
        args=args,
        constraints=constraints,
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, dtype)],
    )
    return out


def subtract_products(c, pairs: Sequence[tuple], like: jax.Array) -> jax.Array:
    """``c - sum_k a_k b_k`` for ``pairs`` ``(a_k, b_k)`` (``c`` broadcast like ``like``).

    As written, ``c - (a_0 b_0 + a_1 b_1 + ...)``, the sum left to right; within
    :func:`contracted`, ``c - a_0 b_0 - a_1 b_1 - ...``, each step one :func:`madd`. (The second
    form on the XLA path too changed its roundings: on CPU, band 4's sharded and unsharded
    updates then differed by 3.5e-9 relative, against the 1e-10 the sharded tests allow.)
    """
    if not pairs:
        return c - jnp.zeros_like(like)
    if not _CONTRACTED.get():
        total = pairs[0][0] * pairs[0][1]
        for a, b in pairs[1:]:
            total = total + a * b
        return c - total
    total = jnp.broadcast_to(jnp.asarray(c, like.dtype), like.shape)
    for a, b in pairs:
        total = madd(-a, b, total)
    return total
