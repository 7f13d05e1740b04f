"""SONew's math against the dense float64 reference (``sonew_reference.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sonew_pax.optim import solve as sonew_solve
from sonew_pax.optim import sonew
from sonew_pax.optim.chain import ChainLayout, shift
from tests import sonew_reference as ref


def dense_x(h_diag, h_off, gamma):
    """The preconditioner X of our solve, as a dense matrix, for a 1-D chain."""
    n = h_diag.shape[0]
    layout = ChainLayout.unsharded((n,))
    factor = sonew_solve.factorize(jnp.asarray(h_diag), jnp.asarray(h_off), gamma, layout)
    return np.asarray(jax.vmap(lambda v: sonew_solve.apply(factor, v, layout))(jnp.eye(n))).T


def banded_stats(H, band):
    n = H.shape[0]
    off = np.zeros((band, n))
    for k in range(1, band + 1):
        off[k - 1, : n - k] = np.diagonal(H, k)
    return np.diagonal(H).copy(), off


def random_banded_h(rng, n, band, rank=None):
    G = rng.normal(size=(n, rank or 3 * n))
    H = G @ G.T / G.shape[1] + 1e-3 * np.eye(n)
    mask = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= band
    return H * mask


@pytest.mark.parametrize("shape", [(3, 4, 2), (5,), (2, 3, 1, 3), (7, 3)])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, -1, -4, -9, 40])
def test_shift_follows_fortran_chain(shape, k):
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    v = ref.chain(x)
    expect = np.array([v[i + k] if 0 <= i + k < v.size else 0 for i in range(v.size)])
    got = shift(jnp.asarray(x), k, ChainLayout.unsharded(shape))
    np.testing.assert_array_equal(ref.chain(np.asarray(got)), expect)


@pytest.mark.parametrize("band", [1, 2, 4, 10])
def test_logdet_optimality(x64, band):
    """P_G(X^-1) = H, X has the band's sparsity, and X minimises -log det X + Tr(XH) on S_n(G)."""
    rng = np.random.default_rng(band)
    n = 23
    H = random_banded_h(rng, n, band)
    X = dense_x(*banded_stats(H, band), gamma=0.0)
    inside = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= band
    np.testing.assert_allclose(np.linalg.inv(X)[inside], H[inside], rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(X[~inside], 0)
    np.testing.assert_allclose(X, ref.logdet_solution(H, ref.band_edges(n, band)), rtol=1e-9)

    def objective(Y):
        return -np.linalg.slogdet(Y)[1] + np.trace(Y @ H)

    for _ in range(5):
        delta = rng.normal(size=(n, n)) * inside
        delta = 1e-3 * (delta + delta.T)
        assert objective(X) < objective(X + delta)


@pytest.mark.parametrize("band", [1, 2, 4])
def test_stable_solve_cuts_degenerate_windows(x64, band):
    """Algorithm 3: identical neighbouring gradients make H singular on a window; the chain is cut
    there and X is the exact LogDet solution on the reduced graph."""
    rng = np.random.default_rng(7)
    n = 17
    G = rng.normal(size=(n, 40))
    G[6] = G[5]  # Lemma (degenerate inputs), case 1
    G[12] = 2 * G[11]
    H = (G @ G.T / 40) * (np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= band)
    gamma = 1e-6
    edges = ref.cut_edges(H, band, gamma)
    assert len(edges) < len(ref.band_edges(n, band))
    X = dense_x(*banded_stats(H, band), gamma=gamma)
    assert np.all(np.isfinite(X))
    np.testing.assert_allclose(X, ref.logdet_solution(H, edges), rtol=1e-8, atol=1e-10)
    kept = np.zeros((n, n), bool)
    for p, q in edges:
        kept[p, q] = kept[q, p] = True
    kept |= np.eye(n, dtype=bool)
    np.testing.assert_allclose(np.linalg.inv(X)[kept], H[kept], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("band", [2, 4])
def test_truncated_factor_without_cuts_is_the_full_solve_bit_for_bit(band):
    """Where no vertex of a window cuts, the truncated solve's masks are exact ones: its factor is
    the full window solve's, bit for bit (the banded kernel takes it from the cut test's solve);
    a cut changes it."""
    rng = np.random.default_rng(3)
    n = 64
    G = rng.normal(size=(n, 3 * band)).astype(np.float32)
    H = G @ G.T * (np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= band)
    rho = [
        jnp.asarray(np.diagonal(H, k) / np.sqrt(np.diag(H)[k:] * np.diag(H)[:-k]))
        for k in range(1, band + 1)
    ]
    rows = [[r[1 + p : 1 + p + n - 2 * band] for r in rho[: band - 1 - p]] for p in range(band)]
    rhs = [r[: n - 2 * band] for r in rho]
    schur, x, _ = sonew_solve.window_solve(rows, rhs)
    full = sonew_solve.window_factor(schur, x)
    zeros = [jnp.zeros_like(schur)] * band
    truncated = sonew_solve.truncated_factor(rows, rhs, zeros)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(truncated), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cut = sonew_solve.truncated_factor(rows, rhs, [jnp.ones_like(schur), *zeros[1:]])
    assert not np.array_equal(np.asarray(cut[1]), np.asarray(full[1]))


SHAPES = {"v": (7,), "w": (5, 3), "t": (3, 5, 3), "q": (3, 1, 5, 3)}


@pytest.mark.parametrize("band", [0, 1, 2, 4])
# The default (relative) damping and the absolute one; 1-D tensors preconditioned with the second
# (the damping's math is the same for them).
@pytest.mark.parametrize("precondition_1d, damping", [(False, "mean"), (True, "absolute")])
def test_trajectory_matches_dense_reference(x64, band, precondition_1d, damping):
    """Several steps of ``sonew`` equal the dense float64 semantics (relative error <= 1e-8),
    with the default (relative, lagged) damping and with the absolute one."""
    rng = np.random.default_rng(band)
    params = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    schedule = optax.linear_schedule(0.125, 0.0625, 4)  # exact in float32, jitted or not
    kwargs = dict(
        b1=0.8,
        b2=0.9,
        eps=1e-3 if damping == "absolute" else 0.1,
        damping=damping,
        band=band,
        gamma=1e-9,
        graft="adam",
        graft_eps=1e-8,
        weight_decay=0.05,
    )
    tx = sonew(schedule, precondition_1d=precondition_1d, stats_dtype=jnp.float64, **kwargs)
    dense = ref.DenseSONew(schedule, precondition_1d=precondition_1d, **kwargs)
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    update = jax.jit(tx.update)
    for _ in range(4):
        grads = {k: rng.normal(size=s) * rng.uniform(0.1, 10) for k, s in SHAPES.items()}
        expect = dense.step(grads, jax.tree.map(np.asarray, p))
        got, state = update(jax.tree.map(jnp.asarray, grads), state, p)
        for k in SHAPES:
            scale = np.linalg.norm(expect[k])  # 0 for the first step of a relative damping
            err = np.linalg.norm(np.asarray(got[k]) - expect[k]) / (scale or 1.0)
            assert err <= 1e-8, (k, err)
        p = optax.apply_updates(p, got)


@pytest.mark.parametrize("graft", ["none", "adam"])
def test_trajectory_without_grafting_and_degenerate(x64, graft):
    """Ungrafted direction u = X m_hat, with gradients that make windows singular (gamma > 0)."""
    rng = np.random.default_rng(3)
    kwargs = dict(
        b1=0.9,
        b2=0.95,
        eps=0.0,
        damping="absolute",
        band=2,
        gamma=1e-3,
        graft=graft,
        graft_eps=1e-8,
        weight_decay=0.0,
    )
    tx = sonew(0.01, stats_dtype=jnp.float64, **kwargs)
    dense = ref.DenseSONew(0.01, **kwargs)
    p = {"w": jnp.zeros((4, 6))}
    state = tx.init(p)
    for _ in range(3):
        g = rng.normal(size=(4, 6))
        g[1] = g[0]  # identical neighbours along the chain
        expect = dense.step({"w": g}, {"w": np.zeros((4, 6))})
        got, state = tx.update({"w": jnp.asarray(g)}, state, p)
        np.testing.assert_allclose(np.asarray(got["w"]), expect["w"], rtol=1e-8, atol=1e-12)
