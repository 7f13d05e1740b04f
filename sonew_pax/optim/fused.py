"""The diag and tridiag SONew step of one tensor as a single Pallas kernel (GPU, Triton).

XLA compiles the band-1 step (``pointwise.tridiagonal_step`` on chain shifts) into several passes
over memory: the shifts are slices and concatenations that it will not fuse into their expensive
consumers, and the grafting norms re-read what the elementwise fusion wrote. This kernel makes the
bytes moved the floor of a two-pass update:

* **pass 1 (this kernel):** every program reads one contiguous block of ``g``, ``m``, ``d`` (and
  ``e``) plus the same arrays at each element's chain neighbours -- masked gathers whose addresses
  are still contiguous across a warp (``+-`` one row of axis 0, or the wrap into the next column),
  so they hit the cache lines the neighbouring blocks load -- and writes the new ``m``, ``d``,
  ``e``, the ungrafted direction ``u`` and, per block, the partial norms of Adam's direction and
  of ``u`` as ``(max |x|, sum (x / max)^2)`` pairs (safe from overflow and underflow, like
  ``chain.norms``);
* **pass 2 (XLA):** ``u * ||adam|| / ||u||``, fused by XLA with weight decay, the learning rate and
  ``optax.apply_updates``.

fp32 tridiag moves 32 B/param in pass 1 and 12 in pass 2, against 28 for a fused AdamW. The math
is ``pointwise``'s, the same functions the XLA path runs, so results agree to float rounding (the
norms are summed in another order). ``interpret=True`` runs the kernel with Pallas' interpreter
(any backend; the tests use it on CPU).

The chain is the tensor in Fortran order (``chain.py``). For the row-major element at flat offset
``f``, its successor is one step along the first axis whose index can still grow (the earlier
ones wrap to 0), and its predecessor symmetrically: a handful of integer operations per element.
Only tensors that live whole on the device take this path (sharded ones need halos, which the XLA
path exchanges), with fewer than ``2**31`` elements (int32 offsets).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import pointwise
from sonew_pax.optim.chain import ChainLayout

BLOCK = 1024  # elements per program: 8 per thread with 4 warps
NUM_WARPS = 4
_MAX_SIZE = 2**31 - 1
# The numbers of ``pointwise.Hyper`` and the bias corrections, packed into one input array.
_SCALARS = ("b1", "b2", "eps", "gamma", "graft_eps", "bc1", "bc2")


def supported(layout: ChainLayout, band: int) -> bool:
    """Whether the kernel computes this tensor's step: band 0 or 1, whole on the device (mesh axes
    of size 1 are fine: a one-device mesh), int32-indexable."""
    size = math.prod(layout.shape)
    return band <= 1 and all(n == 1 for n in layout.shards) and 0 < size <= _MAX_SIZE


def chain_neighbour(f: jax.Array, shape: tuple[int, ...], step: int) -> tuple[jax.Array, jax.Array]:
    """Row-major offset of the chain successor (``step=1``) or predecessor (``-1``) of offset ``f``.

    In Fortran order the successor of ``(i_0, i_1, ...)`` increments the first index ``i_p`` that
    is below its maximum and resets the earlier ones (all at their maximum) to 0: the offset moves
    by ``stride_p - sum_{q<p} (n_q - 1) stride_q``. The predecessor mirrors it. Returns
    ``(offset, exists)``; ``exists`` is False at the chain's last (first) element.
    """
    strides = [math.prod(shape[q + 1 :]) for q in range(len(shape))]
    out, found = jnp.zeros_like(f), jnp.zeros(f.shape, bool)
    wrapped = 0  # sum over the earlier axes of (n_q - 1) stride_q
    for n, stride in zip(shape, strides, strict=True):
        index = (f // stride) % n
        movable = index < n - 1 if step > 0 else index > 0
        target = f + stride - wrapped if step > 0 else f - stride + wrapped
        out = jnp.where(movable & ~found, target, out)
        found = found | movable
        wrapped += (n - 1) * stride
    return out, found


def _kernel(scalars_ref, g_ref, m_ref, d_ref, *refs, shape, band, graft, block):
    """One block of ``block`` elements: pass 1 of the module docstring."""
    if band:
        e_ref, u_ref, m_out, d_out, e_out, parts_ref = refs
    else:
        u_ref, m_out, d_out, parts_ref = refs
    program = pl.program_id(0)
    f = program * block + jnp.arange(block, dtype=jnp.int32)
    valid = f < math.prod(shape)
    values = {name: scalars_ref[i] for i, name in enumerate(_SCALARS)}
    hyper = pointwise.Hyper(
        **{k: values[k] for k in _SCALARS[:5]}, graft=graft, precondition_1d=True
    )
    corrections = (values["bc1"], values["bc2"])
    compute = d_ref.dtype

    def read(ref, offset, mask):
        return plgpu.load(ref.at[offset], mask=mask, other=0).astype(compute)

    def raw_at(offset, mask):
        return pointwise.Raw(
            read(g_ref, offset, mask), read(m_ref, offset, mask), read(d_ref, offset, mask)
        )

    raw = raw_at(f, valid)
    if band == 0:
        step = pointwise.diagonal_step(raw, corrections, hyper)
    else:
        after, has_after = chain_neighbour(f, shape, 1)
        before, has_before = chain_neighbour(f, shape, -1)
        at = {-1: raw_at(before, valid & has_before), 0: raw, 1: raw_at(after, valid & has_after)}
        step = pointwise.tridiagonal_step(
            at, read(e_ref, f, valid), read(e_ref, before, valid & has_before), corrections, hyper
        )
        plgpu.store(e_out.at[f], step.e.astype(e_out.dtype), mask=valid)
    for ref, x in ((u_ref, step.u), (m_out, step.m), (d_out, step.d)):
        plgpu.store(ref.at[f], x.astype(ref.dtype), mask=valid)
    for k, x in enumerate((step.adam, step.u)):
        magnitude = jnp.where(valid, jnp.abs(x), 0)
        top = jnp.max(magnitude)
        scaled = magnitude / jnp.where(top > 0, top, 1)
        parts_ref[program, 2 * k] = top
        parts_ref[program, 2 * k + 1] = jnp.sum(scaled * scaled)


def leaf_update(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: Any,
    corrections: tuple[jax.Array, jax.Array],
    hyper: pointwise.Hyper,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, Any, tuple[jax.Array, jax.Array] | None]:
    """One tensor's diag (``e`` is ``optax.MaskedNode``) or tridiag step in one kernel.

    Returns ``(u, m, d, e, norms)``: the ungrafted direction in ``d``'s dtype, the new state in
    the stored dtypes, and ``(||adam||, ||u||)`` (``None`` unless ``hyper.graft == "adam"``).
    """
    band = 0 if not hasattr(e, "shape") else e.shape[0]
    shape, size, compute = g.shape, g.size, d.dtype
    num_blocks = pl.cdiv(size, BLOCK)
    numbers = [getattr(hyper, k) for k in _SCALARS[:5]] + list(corrections)
    scalars = jnp.stack([jnp.asarray(x, compute) for x in [*numbers, 0]])
    inputs = [scalars, g.reshape(-1), m.reshape(-1), d.reshape(-1)]
    outputs = [
        jax.ShapeDtypeStruct((size,), compute),
        jax.ShapeDtypeStruct((size,), m.dtype),
        jax.ShapeDtypeStruct((size,), d.dtype),
    ]
    if band:
        inputs.append(e[0].reshape(-1))
        outputs.append(jax.ShapeDtypeStruct((size,), e.dtype))
    outputs.append(jax.ShapeDtypeStruct((num_blocks, 4), compute))
    kernel = pl.pallas_call(
        _kernel_with(shape=shape, band=band, graft=hyper.graft, block=BLOCK),
        grid=(num_blocks,),
        out_shape=outputs,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=NUM_WARPS),
        name=f"sonew_band{band}_step",
    )
    u, m_new, d_new, *rest = kernel(*inputs)
    parts = rest.pop()
    e_new = rest[0].reshape(e.shape) if band else e
    norms = None
    if hyper.graft == "adam":
        norms = (_combine(parts[:, 0], parts[:, 1]), _combine(parts[:, 2], parts[:, 3]))
    return u.reshape(shape), m_new.reshape(shape), d_new.reshape(shape), e_new, norms


def _kernel_with(**static):
    """``_kernel`` with its static arguments bound, under its own name (as Pallas reports it)."""

    def sonew_step(*refs):
        _kernel(*refs, **static)

    return sonew_step


def _combine(scales: jax.Array, sums: jax.Array) -> jax.Array:
    """``||x||`` from per-block ``(max |x|, sum (x / max)^2)`` pairs, safely rescaled."""
    top = jnp.max(scales)
    ratio = scales / jnp.where(top > 0, top, 1)
    return top * jnp.sqrt(jnp.sum(sums * ratio * ratio))
