"""Bands ``b >= 2`` (Theorem 2, Algorithm 3): each lane walks its column's chunk, solving each
vertex's ``b x b`` window once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import pointwise, solve
from sonew_pax.optim.fma import madd
from sonew_pax.optim.kernels.geometry import chunk_rows, tile_view
from sonew_pax.optim.kernels.program import (
    StepRefs,
    numbers,
    output,
    running_pair,
    scale_floor,
    write_parts,
)


def banded_kernel(
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
    band,
    graft,
    relative,
    rows,
    cols,
    apply,
    decayed,
    program,
):
    """Band ``b >= 2`` (Theorem 2, Algorithm 3) walking down a ``rows x cols`` block of the view.

    Each lane owns a column and walks the chain from ``b`` rows above its chunk to ``2b - 1``
    rows below it (the rows beyond the view's top and bottom come from the ``edges`` input,
    :func:`kernel_edges`).
    On reading row ``t`` it computes, with ``solve``'s and ``pointwise``'s float operations:

    * ``t``'s moments and :func:`pointwise.vertex`, and the new statistics and correlations
      ``rho_k`` of the edges ``(t - k, t)``, ``k = 1..b`` (:func:`pointwise.correlation`): the
      last entries of ``C`` that vertex ``t - b``'s window needs;
    * Algorithm 3's cut test of vertex ``t - b`` on its full window (``solve.window_cut``);
    * the truncated factor of vertex ``i = t - 2b + 1``, whose window's cuts are now all known
      (``solve.truncated_factor``), and its ``z_i = D_ii (w_i + sum_p L_{i+1+p,i} w_{i+1+p})``.
      Where no lane of the program has a cut in its window, the truncated solve is the full
      one (the masks are exact ones): the walk queues the last ``b - 1`` full solves and takes
      vertex ``i``'s (``solve.window_factor``), the truncated solve running under a
      ``lax.cond`` on the program's largest cut. A repeated gradient with ``|g| >> eps`` (every
      window singular) takes the second solve in every row; LM statistics rarely cut an edge;
    * ``u_i = s_i (z_i + sum_p L_{i, i-1-p} z_{i-1-p})``, as ``solve.apply``; each factored
      vertex adds its terms to the ``b`` sums of the vertices below it, so the walk carries ``b``
      sums instead of the last ``b`` columns of ``L`` and their ``z``.

    Rows are read once per walk (the ``3b - 1`` rows around a chunk by two walks), every vertex
    and window solved once. The state is updated in place; the walk reads the state of other
    chunks' rows from the halo copies (:func:`band_halo_rows`), taken before the step. With
    ``apply`` (:class:`Apply`) the kernel reads the parameters (``StepRefs.p``) at row ``i`` and
    writes the new ones there (in place) instead of ``u``. The norm pairs are Adam's direction's
    and ``u``'s, then with ``relative`` (a relative damping, its statistic in ``StepRefs.diag``)
    ``sqrt(d_hat)``'s.
    """
    named = StepRefs.of(refs, relative, apply)
    b = band
    num_rows, num_cols = tile_view(shape)
    size = num_rows * num_cols
    i, j = program
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)
    in_cols = c < num_cols
    hyper, corrections = numbers(scalars_ref, graft, named.diag, named.slot)
    compute = pointwise.compute_dtype(d_ref.dtype)
    first, last = chunk_rows(i, rows, num_rows)
    span = 3 * b - 1  # halo rows per chunk, and the edges' rows (b above, 2b - 1 below)
    halo_size = pl.cdiv(num_rows, rows) * span * num_cols  # one sub-array's halo rows
    # Each array's first halo element, and the tensor's first edges element.
    m0, d0, e0, edge0 = (starts_ref[k] for k in range(4))

    def locate(t):
        """The walk's row ``t``: ``(offset, halo, edge, beyond, ok)``, its flat offset, that of
        its copy in the halo rows, that of its column in array 0 of the ``edges``, whether it is
        beyond the view (then only ``edge`` is a place), and whether the walk reads it: within
        ``b`` rows above the chunk or ``2b - 1`` below it (the rows the chunk's outputs depend
        on)."""
        beyond = (t < 0) | (t >= num_rows)
        row = jnp.clip(t, 0, num_rows - 1)
        chunk = row // rows
        within = row - chunk * rows
        length = jnp.minimum(rows, num_rows - chunk * rows)
        slot = jnp.where(within < 2 * b - 1, within, within - length + span)
        edge_row = jnp.where(t < 0, t + b, t - num_rows + b)
        ok = in_cols & (t >= first - b) & (t <= last + 2 * b - 1)
        halo = (chunk * span + slot) * num_cols + c
        return row * num_cols + c, halo, edge_row * num_cols + c, beyond, ok

    def read(ref, at, mask):
        return plgpu.load(ref.at[at], mask=mask, other=0).astype(compute)

    def own(t):
        """Whether row ``t`` is this chunk's (the walk writes its outputs there)."""
        return (t >= first) & (t <= last)

    def from_edges(index, edge, beyond, ok):
        """Array ``index`` of the ``edges`` (0 ``g``, 1 ``m``, 2 ``d``, ``3 + k`` ``e``'s ``k``-th
        off-diagonal) at ``edge``."""
        return read(edge_ref, edge0 + index * span * num_cols + edge, ok & beyond)

    def read_state(ref, halo_ref, start, index, k, t):
        """Row ``t`` of sub-array ``k`` of ``ref`` (``e``'s ``k``-th off-diagonal; array
        ``index`` of the edges): the chunk's own rows as stored, the others' from their halo
        copies or, beyond the view, from the edges."""
        offset, halo, edge, beyond, ok = locate(t)
        stored = read(ref, k * size + offset, ok & own(t))
        copied = read(halo_ref, start + k * halo_size + halo, ok & ~own(t) & ~beyond)
        far = jnp.where(beyond, from_edges(index, edge, beyond, ok), copied)
        return jnp.where(own(t), stored, far)

    def write(ref, at, x, mask):
        plgpu.store(ref.at[at], x.astype(ref.dtype), mask=mask)

    def mine(t):
        """:func:`own` in this program's columns: where the walk writes."""
        return in_cols & own(t)

    zero = jnp.zeros((cols,), compute)

    def load(t) -> tuple[pointwise.Raw, tuple]:
        """Row ``t``'s raw values and the stored statistics of its edges from ``t - 1``, ...,
        ``t - b`` (zeros off the chain)."""
        at, _, edge, beyond, ok = locate(t)
        g = jnp.where(beyond, from_edges(0, edge, beyond, ok), read(g_ref, at, ok & ~beyond))
        raw = pointwise.Raw(
            g,
            read_state(m_ref, halo_m, m0, 1, 0, t),
            read_state(d_ref, halo_d, d0, 2, 0, t),
        )
        return raw, tuple(read_state(e_ref, halo_e, e0, 3 + k, k, t - 1 - k) for k in range(b))

    def load_own(t) -> tuple[pointwise.Raw, tuple]:
        """:func:`load` of a row ``t`` with ``t - b`` in the chunk: every value is the chunk's
        own, read as stored (without :func:`load`'s choices between the state and its halo)."""
        at = t * num_cols + c
        raw = pointwise.Raw(*(read(ref, at, in_cols) for ref in (g_ref, m_ref, d_ref)))
        e_old = (read(e_ref, k * size + at - (1 + k) * num_cols, in_cols) for k in range(b))
        return raw, tuple(e_old)

    def body(loader, t, carry):
        loaded, g_q, s_q, w_q, rho_q, solved_q, cut_q, acc_q, pairs = carry
        # Row t was loaded in the previous iteration; row t + 1's loads are in flight while
        # row t is computed (as the band-1 scan's ``ahead``).
        (raw, e_olds), loaded = loaded, loader(t + 1)
        v = pointwise.vertex(raw, corrections, hyper)
        for ref, x in ((named.m, v.m), (named.d, v.d)):
            write(ref, t * num_cols + c, x, mine(t))
        adam = pointwise.adam_direction(v.m, v.d, corrections, hyper)
        # rho_q[n][k - 1]: rho_k of position t - 2b + 1 + n (queued positions t - 2b + 1 ... t - 1).
        rho_q = [list(x) for x in rho_q]
        for dist in range(1, b + 1):
            a = pointwise.Vertex(g_q[-dist], zero, zero, s_q[-dist], zero)
            e_new, rho = pointwise.correlation(e_olds[dist - 1], a, v, corrections, hyper)
            at = (dist - 1) * size + (t - dist) * num_cols + c
            write(named.e, at, e_new, mine(t - dist))
            rho_q[-dist][dist - 1] = rho

        def window(n):
            """The window system of queued position ``n`` (``solve.window_solve``'s arguments)."""
            rows_ = [[rho_q[n + 1 + p][q] for q in range(b - 1 - p)] for p in range(b)]
            return rows_, rho_q[n]

        schur, solution, pivot = solve.window_solve(*window(b - 1))  # vertex t - b
        cut = solve.window_cut(schur, pivot, hyper.gamma)
        vertex_i = t - 2 * b + 1
        cuts = [*cut_q, cut]
        # Vertex i's window solve ran b - 1 rows ago (solved_q[0]); without cuts in its window
        # it is the truncated one. A branch on the whole program skips the second solve.
        lower, diag = jax.lax.cond(
            jnp.max(functools.reduce(jnp.maximum, cuts)) > 0,
            lambda: solve.truncated_factor(*window(0), cuts),
            lambda: solve.window_factor(*solved_q[0]),
        )
        y = w_q[0]
        for p in range(b):
            y = madd(lower[p], w_q[1 + p], y)
        z = diag * y
        # acc_q[n]: sum_p L_{i+n, i+n-1-p} z_{i+n-1-p} over the vertices factored so far.
        u = s_q[0] * (acc_q[0] + z)
        at_i = vertex_i * num_cols + c
        p_i = None if named.p is None else read(named.p, at_i, mine(vertex_i))
        write(
            named.out,
            at_i,
            output(scalars_ref, named.ratio, named.ratio_slot, u, p_i, decayed),
            mine(vertex_i),
        )
        normed = ((adam, t), (u, vertex_i))
        normed += ((pointwise.diagonal_root(v.d, corrections), t),) * relative
        pairs = tuple(
            running_pair(pair, x, mine(r)) for pair, (x, r) in zip(pairs, normed, strict=True)
        )
        return (
            loaded,
            (*g_q[1:], v.g),
            (*s_q[1:], v.scale),
            (*w_q[1:], v.w),
            (*(tuple(x) for x in rho_q[1:]), (zero,) * b),
            (*solved_q[1:], (schur, tuple(solution))),
            (*cut_q[1:], cut),
            tuple(madd(lp, z, acc) for acc, lp in zip((*acc_q[1:], zero), lower, strict=True)),
            pairs,
        )

    floor = jnp.full((cols,), scale_floor(compute), compute)
    init = (
        load(first - b),
        (zero,) * b,
        (zero,) * (2 * b - 1),
        (zero,) * (2 * b - 1),
        ((zero,) * b,) * (2 * b - 1),
        ((zero + 1, (zero,) * b),) * (b - 1),  # the solve of a window of zeros
        (zero,) * (b - 1),
        (zero,) * b,
        ((floor, zero),) * (2 + relative),
    )
    # Rows first - b ... last + 2b - 1, in three loops: the middle one loads rows t + 1 whose
    # values are all the chunk's own (most of the walk) without choosing, the others choose row by
    # row between the chunk, its halo copies and the edges (one loop choosing by a lax.cond on t,
    # or an unrolled middle loop, ran slower).
    inner, end = first + b - 1, first + rows + 2 * b - 1
    carry = jax.lax.fori_loop(first - b, inner, functools.partial(body, load), init)
    carry = jax.lax.fori_loop(
        inner, jnp.maximum(inner, last), functools.partial(body, load_own), carry
    )
    *_, pairs = jax.lax.fori_loop(
        jnp.maximum(inner, last), end, functools.partial(body, load), carry
    )
    write_parts(named.parts, i, j, pairs)
