"""``graft_lag=True``: each step's direction is scaled by the previous step's graft ratio.

The reference is built from the exact optimizer itself: the ungrafted direction ``u_t`` of
``graft="none"`` times ``||adam_{t-1}|| / ||u_{t-1}||``, with Adam's direction computed in numpy
from the stored moments (``r_0 = 0``: the first update is zero).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from sonew_pax import optimizers
from sonew_pax.optim import (
    ScaleBySONewDampedState,
    ScaleBySONewLagState,
    ScaleBySONewState,
    scale_by_sonew,
    sonew,
    state_partition_specs,
)
from tests.test_sonew_sharded import assert_sharded_matches, case, make_mesh, run

HYPER = dict(b1=0.8, b2=0.9, eps=1e-3, gamma=1e-9, graft_eps=1e-8, damping="absolute")
SHAPES = {"w": (6, 5), "k": (3, 2, 5), "b": (5,)}  # "b": 1-D, takes Adam's direction
# Each preconditioned tensor's place in the state's ratios: the tree's (sorted) order, "b" left out.
SLOT = {"k": 0, "w": 1}


def _grads(shapes, steps, seed=0, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    return [
        {
            k: jnp.asarray(rng.normal(size=s) * rng.uniform(0.1, 10), dtype)
            for k, s in shapes.items()
        }
        for _ in range(steps)
    ]


def _trajectory(tx, grads_seq):
    """Updates and states of ``tx`` (jitted, one compilation) along ``grads_seq``."""
    state = tx.init(grads_seq[0])
    update = jax.jit(tx.update)
    out = []
    for grads in grads_seq:
        updates, state = update(grads, state)
        out.append((jax.tree.map(np.asarray, updates), state))
    return out


def _adam(state, t):
    """Adam's direction ``m_hat / (sqrt(d_hat) + graft_eps)`` per tensor from step ``t``'s state."""
    bc1, bc2 = 1 - HYPER["b1"] ** t, 1 - HYPER["b2"] ** t
    return {
        k: (np.asarray(state.m[k]) / bc1)
        / (np.sqrt(np.asarray(state.d[k]) / bc2) + HYPER["graft_eps"])
        for k in SHAPES
    }


@pytest.mark.parametrize("band", [0, 1, 2])
def test_lag_scales_by_previous_ratio(x64, band):
    grads_seq = _grads(SHAPES, 4, seed=band)
    kwargs = dict(band=band, stats_dtype=jnp.float64, **HYPER)
    plain = _trajectory(scale_by_sonew(graft="none", **kwargs), grads_seq)
    grafted = _trajectory(scale_by_sonew(graft="adam", **kwargs), grads_seq)
    lagged = _trajectory(scale_by_sonew(graft="adam", graft_lag=True, **kwargs), grads_seq)
    ratio = {k: 0.0 for k in ("w", "k")}
    for t, ((u, _), (_, state), (got, lag_state)) in enumerate(
        zip(plain, grafted, lagged, strict=True), start=1
    ):
        adam = _adam(lag_state, t)
        for k, r in ratio.items():
            np.testing.assert_allclose(got[k], u[k] * r, rtol=1e-10, atol=0)
            ratio[k] = np.linalg.norm(adam[k]) / np.linalg.norm(u[k])
            np.testing.assert_allclose(float(lag_state.ratio[SLOT[k]]), ratio[k], rtol=1e-10)
        np.testing.assert_allclose(got["b"], adam["b"], rtol=1e-10)
        assert lag_state.ratio.shape == (2,)  # none for "b"
        for name in ("m", "d", "e"):
            for a, b in zip(
                jax.tree.leaves(getattr(state, name)),
                jax.tree.leaves(getattr(lag_state, name)),
                strict=True,
            ):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=0)
    assert not np.any(lagged[0][0]["w"]) and not np.any(lagged[0][0]["k"])  # r_0 = 0


def test_state_holds_a_ratio_only_with_lag():
    """With the absolute damping and the lag the state is a ScaleBySONewLagState; without the
    lag, ScaleBySONewState keeps the four fields it had before ``graft_lag`` existed (so older
    checkpoints restore), also after updates. The default (relative) damping's state holds the
    ratios beside its scales."""
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    relative = scale_by_sonew(graft_lag=True).init(params)
    assert type(relative) is ScaleBySONewDampedState and relative.ratio.shape == (2,)
    absolute = functools.partial(scale_by_sonew, damping="absolute")
    state = absolute(graft_lag=True).init(params)
    assert type(state) is ScaleBySONewLagState
    assert state._fields == ("count", "m", "d", "e", "ratio")
    # One number per preconditioned tensor ("k", "w"; "b" takes Adam's direction), in one array.
    assert state.ratio.shape == (2,) and state.ratio.dtype == jnp.float32
    assert not np.any(state.ratio)
    lag_1d = absolute(graft_lag=True, precondition_1d=True).init(params)
    assert lag_1d.ratio.shape == (3,)
    plain = absolute().init(params)
    assert type(plain) is ScaleBySONewState and plain._fields == ("count", "m", "d", "e")
    for tx in (absolute(), absolute(graft_lag=True), scale_by_sonew(graft_lag=True)):
        state = tx.init(params)
        assert type(tx.update(params, state)[1]) is type(state)
    gin_sonew = functools.partial(optimizers.sonew, damping="absolute")
    assert gin_sonew(0.1, graft_lag=True).init(params)[0].ratio.shape == (2,)
    assert type(gin_sonew(0.1).init(params)[0]) is ScaleBySONewState


@pytest.mark.parametrize("band", [0, 1])
def test_pallas_equals_xla(x64, band):
    shapes = {"w": (5, 7), "b": (7,)}
    grads_seq = _grads(shapes, 3, seed=band)

    def trajectory(implementation):
        tx = scale_by_sonew(
            band=band, graft_lag=True, stats_dtype=jnp.float64, implementation=implementation
        )
        return [(u, s.ratio) for u, s in _trajectory(tx, grads_seq)]

    expect, got = trajectory("xla"), trajectory("pallas")
    for (u_x, r_x), (u_p, r_p) in zip(expect, got, strict=True):
        np.testing.assert_allclose(u_p["w"], u_x["w"], rtol=1e-11)
        np.testing.assert_allclose(u_p["b"], u_x["b"], rtol=1e-11)
        np.testing.assert_allclose(r_p, r_x, rtol=1e-11)


def test_sharded_equals_unsharded(x64):
    params, specs = case((2, 4))
    mesh = make_mesh((2, 4))
    grads_seq = _grads({k: p.shape for k, p in params.items()}, 3, seed=5)
    kwargs = dict(
        band=1,
        eps=1e-4,
        gamma=1e-6,
        precondition_1d=True,
        stats_dtype=jnp.float64,
        graft_lag=True,
        damping="absolute",
    )
    state = assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol=1e-10)
    _, expect = run(sonew(0.1, **kwargs), params, grads_seq)
    assert type(state[0]) is ScaleBySONewLagState
    np.testing.assert_allclose(state[0].ratio, expect[0].ratio, rtol=1e-10)
    abstract = jax.eval_shape(sonew(0.1, mesh=mesh, param_specs=specs, **kwargs).init, params)
    sonew_specs = state_partition_specs(abstract, specs)[0]
    assert type(sonew_specs) is ScaleBySONewLagState
    assert sonew_specs.ratio == P()


def test_graft_none_is_rejected():
    with pytest.raises(ValueError, match="graft_lag"):
        scale_by_sonew(graft="none", graft_lag=True)
    with pytest.raises(ValueError, match="graft_lag"):
        sonew(0.1, graft="none", graft_lag=True)


def test_jit_once_weight_decay_and_inject_hyperparams(x64):
    """One trace for every step; the first update is the weight decay alone; under
    ``inject_hyperparams`` (``graft_lag`` is a bool, so static) the updates are the same."""
    params = {k: jnp.full(s, 2.0, jnp.float64) for k, s in SHAPES.items()}
    grads_seq = _grads(SHAPES, 3)
    kwargs = dict(band=1, weight_decay=0.1, graft_lag=True, stats_dtype=jnp.float64)
    traces = []

    def trajectory(tx):
        @jax.jit
        def step(p, s, g):
            traces.append(1)
            updates, s = tx.update(g, s, p)
            return updates, optax.apply_updates(p, updates), s

        p, s, out = params, tx.init(params), []
        for g in grads_seq:
            updates, p, s = step(p, s, g)
            out.append(updates)
        return out

    plain = trajectory(sonew(0.5, **kwargs))
    assert len(traces) == 1
    for k in ("w", "k"):
        np.testing.assert_allclose(plain[0][k], -0.5 * 0.1 * 2.0, rtol=1e-12)
    injected = optax.inject_hyperparams(sonew, static_args=("band",))(learning_rate=0.5, **kwargs)
    assert "graft_lag" not in injected.init(params).hyperparams
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(trajectory(injected)), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-9)
