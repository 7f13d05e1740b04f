"""The banded LogDet solve of SONew (paper Theorems 1-2, Algorithms 2-3), in the parameter's layout.

Given the banded statistics ``H`` (diagonal ``h``, ``k``-th off-diagonals ``e_k``) over one tensor's
chain, SONew's preconditioner is

    X = argmin_{X in S_n(G)^{++}}  -log det X + Tr(X H),                          (paper eq. 6)

whose explicit solution (Theorem 2, Algorithm 2) is ``X = L D L^T`` with, for each vertex ``j`` and
its window ``I_j = {j+1, ..., j+b}``,

    L_{I_j j} = -H_{I_j I_j}^{-1} H_{I_j j},
    D_jj = 1 / (H_jj - H_{I_j j}^T H_{I_j I_j}^{-1} H_{I_j j}).

**Scale-free form.** The solve runs on the correlation matrix ``C = S H S`` with
``S = diag(h)^{-1/2}``
(unit diagonal, off-diagonals ``rho``). The LogDet problem is equivariant under diagonal scaling,
``X_H = S X_C S``, so the result is unchanged while every quantity in the solve is O(1) whatever the
gradients' scale.

**Stability (Algorithm 3).** A Schur complement ``D_jj^{-1}`` that is not finite or ``<= gamma``
(relative to ``H_jj``; it is ``<= 1`` in correlation form), or undefined because the window
``H_{I_j I_j}`` is singular -- numerically: one of its Cholesky pivots, the Schur complements
inside the window, is ``<= gamma`` in correlation form -- marks vertex ``j`` as degenerate.
We then drop every edge of the band that spans the gap between ``j`` and
``j + 1``: the chain is *cut* there. For the tridiagonal case this drops exactly the edge
``(j, j+1)``, as the authors' code does; for wider bands it is the smallest edge removal that keeps
the graph a disjoint union of banded chains, so the explicit formula is again the exact LogDet
minimiser on the reduced graph ``G~``: ``P_G~(X^{-1}) = P_G~(H)``. Vertices before a cut solve over
the truncated window ``{j+1, ..., cut}``; the last vertex before a cut gets ``D_jj = 1 / H_jj``.

All windows are solved at once with an unrolled ``b x b`` Cholesky factorisation on arrays of the
parameter's shape: ``O(b^3)`` elementwise operations, no loop over ``n``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sonew_pax.optim.chain import ChainLayout, shift
from sonew_pax.optim.fma import subtract_products

# Where a solve reads its chain at ``j + k``: the tensor's ``ChainLayout`` (``chain.shift``), or a
# function ``(x, k) -> x at j + k`` (a TPU kernel's shift of the block it holds).
Chain = ChainLayout | Callable[[jax.Array, int], jax.Array]


def _shift(x: jax.Array, k: int, chain: Chain) -> jax.Array:
    """``x`` read at ``j + k`` along ``chain``."""
    return chain(x, k) if callable(chain) else shift(x, k, chain)


class BandedFactor(NamedTuple):
    """``X = S L D L^T S`` in the parameter's layout.

    Attributes:
      scale: ``S``, ``diag(H)^{-1/2}`` (zero where ``H_jj = 0``).
      lower: ``(band, *shape)``; ``lower[p - 1]`` at position ``j`` is ``L_{j+p, j}`` of the
        correlation-form factor.
      d: ``D_jj`` of the correlation-form factor.
    """

    scale: jax.Array
    lower: jax.Array
    d: jax.Array


def unit_scale(h_diag: jax.Array) -> jax.Array:
    """``S = diag(H)^{-1/2}``, zero where ``H_jj <= 0`` (a coordinate with no statistics); NaN
    where ``H_jj`` is NaN, so that a non-finite statistic stays visible."""
    empty = h_diag <= 0
    return jnp.where(empty, 0, jax.lax.rsqrt(jnp.where(empty, 1, h_diag)))


def correlations(h_diag: jax.Array, h_off: jax.Array, layout: Chain) -> tuple[jax.Array, jax.Array]:
    """Scale ``H`` to unit diagonal: returns ``S = h^{-1/2}`` and ``rho_k = e_k s_j s_{j+k}``."""
    scale = unit_scale(h_diag)
    band = h_off.shape[0]
    if band == 0:
        return scale, h_off
    successors = jnp.stack([_shift(scale, k, layout) for k in range(1, band + 1)])
    return scale, h_off * scale * successors


def window_solve(
    rows: list[list[jax.Array]], rhs: list[jax.Array]
) -> tuple[jax.Array, list[jax.Array], jax.Array]:
    """Solves every window system ``A x = c`` with ``A`` unit-diagonal, ``b x b``, batched.

    Args:
      rows: ``rows[p][k]`` is ``A[p, p + 1 + k]`` (strict upper triangle, row by row).
      rhs: ``rhs[p]`` is ``c[p]``.

    Returns:
      ``(schur, x, pivot)`` with ``schur = 1 - c^T A^{-1} c``, ``x = A^{-1} c`` and ``pivot`` the
      smallest Cholesky pivot of ``A`` (the smallest Schur complement within the window). A window
      that is not positive definite gives non-finite values (inverse square roots of negative
      pivots). The factorisation keeps ``1 / G_pp`` (one ``rsqrt`` per pivot after the first,
      which is 1) and multiplies by it: no divisions, which dominate the cost of the elementwise
      solve on a GPU. Every sum is ``fma.subtract_products``: a chain of fused multiply-adds in
      the kernels.
    """
    b = len(rhs)
    upper = lambda p, q: rows[p][q - p - 1]  # noqa: E731  A[p, q] for p < q
    like = rhs[0]
    # Cholesky A = G G^T, G lower triangular: g[q][p] = G[q, p] for p < q, inverse[p] = 1 / G[p, p].
    # A's unit diagonal makes the first pivot 1 (G_00 = 1): no rsqrt, no scaling by it.
    g: list[list[jax.Array]] = [[None] * b for _ in range(b)]  # type: ignore[list-item]
    inverse: list[jax.Array] = [None]  # type: ignore[list-item]
    smallest = jnp.ones_like(like)

    def over_pivot(v, p):
        """``v / G_pp``."""
        return v * inverse[p] if p else v

    for p in range(b):
        if p:
            pivot = subtract_products(1, [(g[p][k], g[p][k]) for k in range(p)], like)
            smallest = jnp.minimum(smallest, pivot)
            inverse.append(jax.lax.rsqrt(pivot))
        for q in range(p + 1, b):
            off = subtract_products(upper(p, q), [(g[q][k], g[p][k]) for k in range(p)], like)
            g[q][p] = over_pivot(off, p)
    z: list[jax.Array] = []
    for p in range(b):
        terms = [(g[p][k], z[k]) for k in range(p)]
        z.append(over_pivot(subtract_products(rhs[p], terms, like), p))
    schur = subtract_products(1, [(zp, zp) for zp in z], like)
    x: list[jax.Array] = [None] * b  # type: ignore[list-item]
    for p in reversed(range(b)):
        terms = [(g[q][p], x[q]) for q in range(p + 1, b)]
        x[p] = over_pivot(subtract_products(z[p], terms, like), p)
    return schur, x, smallest


def _windows(rho: jax.Array, layout: Chain) -> list[list[jax.Array]]:
    """``rows[p][k] = C_{j+1+p, j+2+p+k} = rho_{k+1}`` at position ``j + 1 + p``."""
    band = rho.shape[0]
    return [list(_shift(rho[: band - 1 - p], p + 1, layout)) for p in range(band)]


def window_cut(schur: jax.Array, pivot: jax.Array, gamma: float | jax.Array) -> jax.Array:
    """Algorithm 3's test on a vertex's full window (:func:`window_solve`'s ``schur`` and
    ``pivot``): 1 where the chain is cut after the vertex (its Schur complement, or a pivot of its
    window, is not ``> gamma``, or is NaN), else 0."""
    return jnp.logical_not((schur > gamma) & (pivot > gamma)).astype(schur.dtype)


def truncated_factor(
    rows: list[list[jax.Array]], rhs: list[jax.Array], cuts: list[jax.Array]
) -> tuple[list[jax.Array], jax.Array]:
    """One vertex's column of ``L`` and ``D_jj`` over its window truncated at the first cut.

    Args:
      rows, rhs: the vertex's window system (as :func:`window_solve`): ``rhs[p] = C_{j, j+1+p}``.
      cuts: ``cuts[q]`` is :func:`window_cut` of vertex ``j + q``, ``q = 0, ..., band - 1``.

    Returns:
      ``(lower, d)``: ``lower[p] = L_{j+1+p, j}`` and ``D_jj``; an isolated vertex (``lower = 0``,
      ``D_jj = 1``) where the truncated solve still failed in rounding.
    """
    # keep[p]: the window of j still reaches j + 1 + p, i.e. no cut at j, ..., j + p.
    keep = [1 - cuts[0]]
    for cut in cuts[1:]:
        keep.append(keep[-1] * (1 - cut))
    masked_rows = [[a * keep[p + 1 + k] for k, a in enumerate(row)] for p, row in enumerate(rows)]
    schur, x, _ = window_solve(masked_rows, [c * kp for c, kp in zip(rhs, keep, strict=True)])
    return window_factor(schur, x)


def window_factor(schur: jax.Array, x: list[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
    """``(lower, d)`` of a vertex from its window's :func:`window_solve` (``schur``, ``x``):
    ``L_{j+1+p, j} = -x[p]`` and ``D_jj = 1 / schur``, or an isolated vertex (``lower = 0``,
    ``D_jj = 1``) where the solve failed.

    :func:`truncated_factor` applies it to the truncated window. Where no vertex of the window
    cuts the chain the masks are exact ones, so the full window's solve (the one the cut test
    ran) gives the same values: the banded kernel reuses it then.
    """
    # Exact arithmetic guarantees a positive truncated Schur complement after the cuts; guard
    # against rounding by isolating any vertex whose solve still failed.
    ok = jnp.isfinite(schur) & (schur > 0)
    for xp in x:
        ok &= jnp.isfinite(xp)
    lower = [jnp.where(ok, -xp, 0) for xp in x]
    return lower, jnp.where(ok, 1 / jnp.where(ok, schur, 1), 1)


def sparsified_inverse(rho: jax.Array, gamma: float | jax.Array, layout: Chain) -> tuple:
    """Algorithms 2-3 in correlation form: returns ``(lower, d)`` of ``X_C = L D L^T``.

    Args:
      rho: ``(band, *shape)`` off-diagonals of the unit-diagonal banded matrix ``C``.
      gamma: tolerance; vertex ``j`` cuts the chain when its Schur complement is ``<= gamma``.
      layout: the tensor's chain layout, or how to read it at ``j + k`` (``Chain``).
    """
    band = rho.shape[0]
    if band == 0:
        return rho, jnp.ones(rho.shape[1:], rho.dtype)
    if band == 1:
        return tridiagonal_inverse(rho[0], gamma)
    rows = _windows(rho, layout)
    rhs = list(rho)
    schur, _, pivot = window_solve(rows, rhs)
    cut = window_cut(schur, pivot, gamma)
    cuts = [cut] + [_shift(cut, q, layout) for q in range(1, band)]
    lower, d = truncated_factor(rows, rhs, cuts)
    return jnp.stack(lower), d


def tridiagonal_inverse(rho: jax.Array, gamma: float | jax.Array) -> tuple:
    """Theorem 1 (band 1) in closed form: the window of ``j`` is ``{j + 1}``, ``C_{j+1,j+1} = 1``.

    The generic two-pass window solve reduces to: Schur complement ``1 - rho_j^2``, a cut where it
    is not ``> gamma`` (nor the unit pivot), ``L_{j+1,j} = -rho_j keep_j`` and
    ``D_jj = 1 / (1 - rho_j^2 keep_j)`` -- the same operations, one elementwise pass, no shifts.
    """
    schur = 1 - rho * rho
    keep = ((schur > gamma) & (gamma < 1)).astype(rho.dtype)
    x = rho * keep
    schur = 1 - x * x
    ok = jnp.isfinite(schur) & (schur > 0) & jnp.isfinite(x)
    lower = jnp.where(ok, -x, 0)[None]
    d = jnp.where(ok, 1 / jnp.where(ok, schur, 1), 1)
    return lower, d


def factorize(
    h_diag: jax.Array, h_off: jax.Array, gamma: float | jax.Array, layout: Chain
) -> BandedFactor:
    """The stable banded LogDet solution ``X = S L D L^T S`` for ``H = (h_diag, h_off)``."""
    scale, rho = correlations(h_diag, h_off, layout)
    lower, d = sparsified_inverse(rho, gamma, layout)
    return BandedFactor(scale, lower, d)


def precondition(
    h_diag: jax.Array,
    h_off: jax.Array,
    v: jax.Array,
    gamma: float | jax.Array,
    layout: Chain,
) -> jax.Array:
    """``X v`` for the stable LogDet solution ``X`` of ``H = (h_diag, h_off)``.

    Band 0 (diag-SONew) is :func:`diagonal_precondition`, without correlations or a solve. Wider
    bands run :func:`factorize` then :func:`apply`.
    """
    if h_off.shape[0] == 0:
        return diagonal_precondition(h_diag, v)
    return apply(factorize(h_diag, h_off, gamma, layout), v, layout)


def diagonal_precondition(h_diag: jax.Array, v: jax.Array) -> jax.Array:
    """Band 0: ``X v = v / h`` (zero where ``h <= 0``, as the generic ``S D S`` with ``S = 0``;
    NaN where ``h`` is NaN)."""
    empty = h_diag <= 0
    return jnp.where(empty, 0, v / jnp.where(empty, 1, h_diag))


def apply(factor: BandedFactor, v: jax.Array, layout: Chain) -> jax.Array:
    """``X v = S L D L^T S v`` in O(band) shifts: successors for ``L^T``, predecessors for ``L``."""
    scaled = factor.scale * v
    y = scaled
    for p, lp in enumerate(factor.lower):
        y = y + lp * _shift(scaled, p + 1, layout)
    z = factor.d * y
    out = z
    for p, lp in enumerate(factor.lower):
        out = out + _shift(lp * z, -(p + 1), layout)
    return factor.scale * out
