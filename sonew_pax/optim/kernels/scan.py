"""Band 1 (tridiagonal, Theorem 1): each lane walks a few rows of one column, once."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import pointwise
from sonew_pax.optim.kernels.geometry import chunk_rows, tile_view
from sonew_pax.optim.kernels.halo import across_chunks
from sonew_pax.optim.kernels.program import (
    StepRefs,
    numbers,
    output,
    running_pair,
    scale_floor,
    write_parts,
)


def scan_kernel(
    scalars_ref,
    g_ref,
    m_ref,
    d_ref,
    e_ref,
    halo_m,
    halo_d,
    halo_e,
    starts_ref,
    edge_ref,
    *refs,
    shape,
    graft,
    relative,
    rows,
    cols,
    stack,
    ahead,
    apply,
    decayed,
    interpret,
    program,
):
    """Band 1 walking down a ``rows x cols`` block of the view: ``stack`` walks of ``rows /
    stack`` rows one under another, one lane per walk and column, all a row at a time.

    Each lane carries the previous row's :func:`pointwise.vertex` and the ``(l, z)`` of the edge
    above, so every array is read once and every vertex and edge computed once, with
    ``pointwise.tridiagonal_step``'s float operations. A walk needs the pre-step state of the row
    above its first and below its last: at the block's top and bottom, the neighbouring blocks'
    rows, from the halo copies; between two walks of the block, each other's edge rows, which
    every lane reads before a barrier and no lane writes before it; at the view's top and bottom,
    the ``edges`` input (``halo.kernel_edges``). So the halo copies are ``2 / rows`` of the state
    while each walk stays short (the chain is serial: a lane's walk of ``w`` rows waits on about
    ``w`` row loads). Rows up to ``r + ahead + 1`` are loaded while row ``r`` is computed, so the
    walk does not wait on each row's load. After the barrier a lane writes only
    rows it has read (``stack x cols`` must cover the warps' lanes: no lane's element is
    another's). With ``apply`` (:class:`Apply`) the parameters (``StepRefs.p``) are read with
    the other arrays and ``StepRefs.out`` takes the new parameters, else ``u``. The tiles' norm
    pairs are Adam's direction's and ``u``'s, then with ``relative`` (a relative damping, its
    statistic in ``StepRefs.diag``) ``sqrt(d_hat)``'s.
    """
    named = StepRefs.of(refs, relative, apply)
    num_rows, num_cols = tile_view(shape)
    i, j = program
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)[None, :]
    in_cols = c < num_cols
    hyper, corrections = numbers(scalars_ref, graft, named.diag, named.slot)
    compute = pointwise.compute_dtype(d_ref.dtype)
    block_first, block_last = chunk_rows(i, rows, num_rows)
    # Each walk's first and last row, (stack, 1); a walk below the view's last row is empty
    # (first > last: it reads and writes nothing).
    first = block_first + (rows // stack) * jnp.arange(stack, dtype=jnp.int32)[:, None]
    last = jnp.minimum(first + rows // stack - 1, block_last)
    walking = in_cols & (first <= last)
    top, bottom = first == block_first, last == block_last
    above, halo_above, edge_above = across_chunks(i, c, num_rows, num_cols, rows, -1)
    below, halo_below, edge_below = across_chunks(i, c, num_rows, num_cols, rows, 1)
    m0, d0, e0, edge0 = (starts_ref[k] for k in range(4))

    def read(ref, at, mask):
        return plgpu.load(ref.at[at], mask=mask, other=0).astype(compute)

    def row(r) -> tuple[pointwise.Raw, jax.Array, jax.Array | None]:
        """Row ``r``'s raw values, edge statistic and parameters (``None`` without ``apply``);
        zeros past the walk's last row."""
        at, mask = r * num_cols + c, in_cols & (r <= last)
        raw = pointwise.Raw(read(g_ref, at, mask), read(m_ref, at, mask), read(d_ref, at, mask))
        p = None if named.p is None else read(named.p, at, mask)
        return raw, read(e_ref, at, mask), p

    def neighbour(r, outer, at, halo, edge, slot) -> Callable:
        """A reader of row ``r`` next to each walk: where ``outer`` (the block's edge) the chain
        neighbour at offset ``at``, the state from its halo copy (at ``halo``; ``g`` is
        read-only: its rows are their own halo), or beyond the view (``edge``) row ``slot`` of
        the ``edges`` input; elsewhere the block's row ``r``."""
        inner, outer = walking & ~outer, walking & outer
        beyond, within = outer & edge, outer & ~edge
        own = r * num_cols + c
        at, halo = (jnp.broadcast_to(x, own.shape) for x in (at, halo))

        def value(k, ref, halo_ref=None, start=0):
            """Array ``k`` of the edges (0 ``g``, 1 ``m``, 2 ``d``, 3 ``e``) read from ``ref``."""
            if halo_ref is None:
                far = read(ref, at, within)
            else:
                far = read(halo_ref, start + halo, within)
            edge_at = jnp.broadcast_to(edge0 + (2 * k + slot) * num_cols + c, own.shape)
            far = jnp.where(beyond, read(edge_ref, edge_at, beyond), far)
            return jnp.where(inner, read(ref, own, inner), far)

        return value

    def vertex(raw):
        return pointwise.vertex(raw, corrections, hyper)

    up = neighbour(first - 1, top, above, halo_above, edge_above, 0)
    down = neighbour(last + 1, bottom, below, halo_below, edge_below, 1)
    raw_above = pointwise.Raw(up(0, g_ref), up(1, m_ref, halo_m, m0), up(2, d_ref, halo_d, d0))
    e_above = up(3, e_ref, halo_e, e0)
    below_raw = pointwise.Raw(
        down(0, g_ref), down(1, m_ref, halo_m, m0), down(2, d_ref, halo_d, d0)
    )
    raw_first, e_first, p_first = row(first)
    queue = tuple(row(first + k) for k in range(1, ahead + 1))
    if not interpret:
        # Every lane has read the edge rows of the walks next to its own before any overwrites.
        plgpu.debug_barrier()
    here = vertex(raw_first)
    _, lower, z = pointwise.edge(e_above, vertex(raw_above), here, corrections, hyper)
    zero = jnp.zeros((stack, cols), compute)

    def body(k, carry):
        here, e_here, p_here, above, queue, pairs = carry
        r = first + k
        valid = in_cols & (r <= last)
        # Rows r + 1 ... r + ahead were loaded in earlier iterations; row r + ahead + 1 is loaded
        # now, so its latency hides behind arithmetic (the stores below may alias the loads:
        # nothing reorders them).
        (raw_next, e_next, p_next), queue = queue[0], (*queue[1:], row(r + ahead + 1))
        next_raw = pointwise.Raw(
            *(jnp.where(r == last, b, x) for b, x in zip(below_raw, raw_next, strict=True))
        )
        after = vertex(next_raw)
        e_new, lower, z = pointwise.edge(e_here, here, after, corrections, hyper)
        u = here.scale * (z + above[0] * above[1])  # tridiagonal_step's expression
        adam = pointwise.adam_direction(here.m, here.d, corrections, hyper)
        at = r * num_cols + c
        out = output(scalars_ref, named.ratio, named.ratio_slot, u, p_here, decayed)
        for ref, x in ((named.out, out), (named.m, here.m), (named.d, here.d), (named.e, e_new)):
            plgpu.store(ref.at[at], x.astype(ref.dtype), mask=valid)
        normed = (adam, u) + (pointwise.diagonal_root(here.d, corrections),) * relative
        pairs = tuple(running_pair(p, x, valid) for p, x in zip(pairs, normed, strict=True))
        return after, e_next, p_next, (lower, z), queue, pairs

    floor = jnp.full((stack, cols), scale_floor(compute), compute)
    init = (here, e_first, p_first, (lower, z), queue, ((floor, zero),) * (2 + relative))
    *_, pairs = jax.lax.fori_loop(0, rows // stack, body, init)
    write_parts(named.parts, i, j, pairs)
