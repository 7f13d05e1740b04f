"""The per-element math of one diag or tridiag SONew step, shared by both implementations.

For band 0 and band 1 every output at chain position ``j`` is a function of the gradient and the
stored state at ``j - 1``, ``j`` and ``j + 1`` only (Theorem 1 in closed form). These functions take
those values as arrays -- however they were obtained -- and return the step's outputs:

* the XLA path (``engine.py``) passes whole tensors (or shards' blocks) and their chain shifts;
* the Pallas kernels (``kernels``) pass the blocks they loaded at ``j`` and at the chain neighbours
  of ``j``.

So the two implementations cannot drift apart: they differ only in how values reach registers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sonew_pax.optim import solve
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.fma import madd


class Raw(NamedTuple):
    """A tensor's gradient and stored state ``(g, m, d)``, as read (or shifted) from memory."""

    g: jax.Array
    m: jax.Array
    d: jax.Array


class Step(NamedTuple):
    """One element's outputs: Adam's direction, SONew's (ungrafted) ``X m_hat`` and the new state.

    ``e`` is the new statistic of the edge ``(j, j + 1)`` (band 1) or ``None`` (band 0).
    """

    adam: jax.Array
    u: jax.Array
    m: jax.Array
    d: jax.Array
    e: jax.Array | None


def compute_dtype(stats_dtype: Any) -> jnp.dtype:
    """The dtype the step computes in for statistics stored in ``stats_dtype``: that one, or
    float32 where it is narrower. Narrower statistics (``stats_dtype=jnp.bfloat16``) are a
    storage format: every operation rounded to 8 bits would lose what float32 keeps, and Triton
    lowers no bfloat16 division."""
    return jnp.promote_types(stats_dtype, jnp.float32)


def _factors(corrections) -> tuple[Any, Any]:
    """``(1 / (1 - b1^t), 1 / (1 - b2^t))`` from the bias corrections ``(1 - b1^t, 1 - b2^t)``: one
    division per step (per kernel program), then products per element."""
    bc1, bc2 = corrections
    return 1 / bc1, 1 / bc2


def moments(raw: Raw, hyper: SONewConfig) -> tuple[jax.Array, jax.Array]:
    """The updated first and diagonal moments ``(m, d)`` before bias correction (``d``'s dtype)."""
    m = madd(hyper.b1, raw.m.astype(raw.d.dtype), (1 - hyper.b1) * raw.g)
    d = madd(hyper.b2, raw.d, (1 - hyper.b2) * jnp.square(raw.g))
    return m, d


def relative_eps(eps: Any, diag: jax.Array) -> jax.Array:
    """A relative damping: ``eps`` times ``diag`` (the tensor's mean or largest ``d_hat`` at the
    previous step), at least the smallest normal number; infinite while ``diag`` is 0 (no step
    yet, or only zero gradients), which makes the direction zero."""
    tiny = jnp.finfo(diag.dtype).tiny
    return jnp.where(diag > 0, jnp.maximum(eps * diag, tiny), jnp.inf)


def diagonal_root(d: jax.Array, corrections) -> jax.Array:
    """``sqrt(d_hat)`` for its norm pair, which gives ``sum d_hat`` and ``max d_hat`` (a relative
    damping's scale) with the grafting norms' reduction; entries below the smallest normal
    number count as 0.

    Computed as ``d_hat * rsqrt(d_hat)``, not as :func:`adam_direction`'s ``sqrt``: given one
    ``sqrt`` that both feed, XLA keeps it out of the step's reduction fusion (it does not fuse an
    expensive operation with two users there) and writes ``sqrt(d_hat)`` to memory, a full-size
    temporary of 8 B/param of traffic on the XLA path (``benchmarks/compile_profile.py``'s
    ``hlo_bytes_per_param``).
    """
    d_hat = d * _factors(corrections)[1]
    small = d_hat < jnp.finfo(d_hat.dtype).tiny
    normal = ~small & (d_hat < jnp.inf)
    root = d_hat * jax.lax.rsqrt(jnp.where(normal, d_hat, 1))
    # 0, +inf and NaN are their own square roots.
    return jnp.where(normal, root, jnp.where(small, 0, d_hat))


def adam_direction(m: jax.Array, d: jax.Array, corrections, hyper: SONewConfig) -> jax.Array:
    """``m_hat / (sqrt(d_hat) + graft_eps)``: the direction SONew's is grafted onto."""
    c1, c2 = _factors(corrections)
    return (m * c1) / (jnp.sqrt(d * c2) + hyper.graft_eps)


def diagonal_step(raw: Raw, corrections, hyper: SONewConfig) -> Step:
    """Band 0 (diag-SONew): ``u = m_hat / (d_hat + eps)``."""
    c1, c2 = _factors(corrections)
    m, d = moments(raw, hyper)
    u = solve.diagonal_precondition(d * c2 + hyper.eps, m * c1)
    return Step(adam_direction(m, d, corrections, hyper), u, m, d, None)


class Vertex(NamedTuple):
    """Band 1's per-position quantities: ``g``, the new moments ``(m, d)``, ``S = (d_hat +
    eps)^{-1/2}`` and ``w = S m_hat``."""

    g: jax.Array
    m: jax.Array
    d: jax.Array
    scale: jax.Array
    w: jax.Array


def vertex(raw: Raw, corrections, hyper: SONewConfig) -> Vertex:
    """The :class:`Vertex` of one position from its raw values."""
    return vertex_of_moments(raw.g, *moments(raw, hyper), corrections, hyper)


def vertex_of_moments(
    g: jax.Array, m: jax.Array, d: jax.Array, corrections, hyper: SONewConfig
) -> Vertex:
    """The :class:`Vertex` of one position from its gradient and new moments (:func:`moments`)."""
    c1, c2 = _factors(corrections)
    scale = solve.unit_scale(madd(d, c2, hyper.eps))
    return Vertex(g, m, d, scale, scale * (m * c1))


def edge_statistic(
    e_old: jax.Array, g_a: jax.Array, g_b: jax.Array, hyper: SONewConfig
) -> jax.Array:
    """The new statistic ``e`` of the edge between positions with gradients ``g_a`` and ``g_b``."""
    return madd(hyper.b2, e_old, (1 - hyper.b2) * g_a * g_b)


def correlation(e_old: jax.Array, a: Vertex, b: Vertex, corrections, hyper: SONewConfig) -> tuple:
    """The edge ``(a, b)`` of chain positions ``k`` apart (any ``k`` in the band): ``(e, rho)``
    with ``e`` its new statistic and ``rho = e_hat s_a s_b`` its entry of the unit-diagonal
    ``C = S H S`` (``solve.correlations``)."""
    e = edge_statistic(e_old, a.g, b.g, hyper)
    return e, _correlation_of(e, a, b, corrections)


def _correlation_of(e: jax.Array, a: Vertex, b: Vertex, corrections) -> jax.Array:
    """``rho = e_hat s_a s_b`` of the edge ``(a, b)`` with new statistic ``e``."""
    _, c2 = _factors(corrections)
    return e * c2 * a.scale * b.scale


def edge_factor(e: jax.Array, a: Vertex, b: Vertex, corrections, hyper: SONewConfig) -> tuple:
    """The edge ``(a, b)`` of consecutive chain positions from its new statistic ``e``: ``(l, z)``
    with ``(l, D)`` Theorem 1's ``L_{b,a}`` and ``D_aa`` on its correlation
    (``solve.tridiagonal_inverse``) and ``z = D_aa (w_a + l w_b)``, the factor's ``D L^T w`` at
    ``a``."""
    lower, diag = solve.tridiagonal_inverse(_correlation_of(e, a, b, corrections), hyper.gamma)
    return lower[0], diag * (a.w + lower[0] * b.w)


def edge(e_old: jax.Array, a: Vertex, b: Vertex, corrections, hyper: SONewConfig) -> tuple:
    """:func:`edge_factor` of the edge's statistic updated from ``e_old``: ``(e, l, z)``."""
    e = edge_statistic(e_old, a.g, b.g, hyper)
    return (e, *edge_factor(e, a, b, corrections, hyper))


def tridiagonal_direction(
    before: Vertex,
    here: Vertex,
    after: Vertex,
    e_here: jax.Array,
    e_before: jax.Array,
    corrections,
    hyper: SONewConfig,
) -> jax.Array:
    """Band 1's ``u_j = s_j [z_j + l_{j-1} z_{j-1}]`` (:func:`edge_factor`) from the vertices at
    ``j - 1``, ``j``, ``j + 1`` and the new statistics of the edges ``(j, j+1)`` and
    ``(j-1, j)``."""
    _, z = edge_factor(e_here, here, after, corrections, hyper)
    lower_before, z_before = edge_factor(e_before, before, here, corrections, hyper)
    return here.scale * (z + lower_before * z_before)


def tridiagonal_step(
    at: dict[int, Raw], e_at: jax.Array, e_before: jax.Array, corrections, hyper: SONewConfig
) -> Step:
    """Band 1 at position ``j`` from the raw values at ``j - 1``, ``j``, ``j + 1`` (``at[k]``).

    ``u_j = s_j [D_j (w_j + l_j w_{j+1}) + l_{j-1} D_{j-1} (w_{j-1} + l_{j-1} w_j)]`` with
    ``w = s m_hat``, ``s = (d_hat + eps)^{-1/2}`` and ``(l, D)`` from Theorem 1
    (``solve.tridiagonal_inverse``) on the correlations of the edges ``(j-1, j)`` and ``(j, j+1)``:
    the same math as ``solve.apply(solve.factorize(...))``, with every per-vertex and per-edge
    quantity (:func:`vertex`, :func:`edge_statistic`, :func:`tridiagonal_direction`) recomputed
    from the raw neighbours instead of read from materialised ``S``, ``L``, ``D`` arrays.
    ``e_at`` and ``e_before`` are the stored statistics of edges ``(j, j+1)`` and ``(j-1, j)``
    (zero past the chain's ends, as every neighbour value is). (The tile kernel's form; the XLA
    path shifts the new moments instead, ``engine._tridiagonal_step``.)
    """
    v = {k: vertex(r, corrections, hyper) for k, r in at.items()}
    e_next = edge_statistic(e_at, v[0].g, v[1].g, hyper)
    e_prev = edge_statistic(e_before, v[-1].g, v[0].g, hyper)
    u = tridiagonal_direction(v[-1], v[0], v[1], e_next, e_prev, corrections, hyper)
    return Step(adam_direction(v[0].m, v[0].d, corrections, hyper), u, v[0].m, v[0].d, e_next)


def apply_update(p: jax.Array, u: jax.Array, ratio: Any, decay: Any, scale: Any) -> jax.Array:
    """The parameter after one step, ``p + (ratio u + decay p) scale``: what
    ``optax.apply_updates`` makes of ``sonew``'s update (the grafted direction ``ratio u``,
    decoupled weight decay ``decay``, ``scale = -lr``), for the fused apply."""
    return madd(madd(ratio, u, decay * p), scale, p)
