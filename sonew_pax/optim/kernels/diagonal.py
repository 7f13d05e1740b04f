"""Band 0 (diagonal): one tile of the view, each element on its own."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import pointwise
from sonew_pax.optim.kernels.geometry import tile_view
from sonew_pax.optim.kernels.program import numbers, output, write_parts


def diagonal_kernel(
    scalars_ref, *refs, shape, graft, relative, rows, cols, apply, decayed, program
):
    """One ``rows x cols`` tile of the view: the diagonal step (band 0). With ``relative`` it reads
    its relative damping's statistics and slot (``program.numbers``) and adds the norm pair of
    ``sqrt(d_hat)`` after those of Adam's direction and ``u``; with ``apply`` it reads ``p_ref``
    and writes the new parameters in ``u``'s place."""
    inputs = 3 + 2 * relative + 3 * apply
    g_ref, m_ref, d_ref = refs[:3]
    out_ref, m_out, d_out, parts_ref = refs[inputs:]
    diag_ref, slot_ref = refs[3:5] if relative else (None, None)
    p_ref, ratio_ref, ratio_slot = refs[3 + 2 * relative : inputs] if apply else (None,) * 3
    num_rows, num_cols = tile_view(shape)
    i, j = program
    r = i * rows + jnp.arange(rows, dtype=jnp.int32)[:, None]
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)[None, :]
    valid = (r < num_rows) & (c < num_cols)
    offset = r * num_cols + c
    hyper, corrections = numbers(scalars_ref, graft, diag_ref, slot_ref)
    compute = pointwise.compute_dtype(d_ref.dtype)

    def here(ref):
        return plgpu.load(ref.at[offset], mask=valid, other=0).astype(compute)

    raw = pointwise.Raw(here(g_ref), here(m_ref), here(d_ref))
    p = None if p_ref is None else here(p_ref)
    step = pointwise.diagonal_step(raw, corrections, hyper)
    out = output(scalars_ref, ratio_ref, ratio_slot, step.u, p, decayed)
    plgpu.store(out_ref.at[offset], out.astype(out_ref.dtype), mask=valid)
    for ref, x in ((m_out, step.m), (d_out, step.d)):
        plgpu.store(ref.at[offset], x.astype(ref.dtype), mask=valid)
    ones = jnp.ones(valid.shape, compute)
    normed = [step.adam, step.u] + [pointwise.diagonal_root(step.d, corrections)] * relative
    pairs = [(jnp.where(valid, jnp.abs(x), 0), ones) for x in normed]
    write_parts(parts_ref, i, j, pairs)
