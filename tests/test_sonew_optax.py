"""SONew behaves like an optax optimizer, stays finite on hostile gradients, rejects bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sonew_pax.optim import (
    ScaleBySONewDampedState,
    ScaleBySONewState,
    scale_by_sonew,
    sonew,
)

BANDS = [0, 1, 2, 4, 10]
PARAMS = {"w": jnp.ones((6, 5)), "k": jnp.ones((3, 2, 4)), "b": jnp.ones((5,))}


def _grads(kind: str, params):
    rng = np.random.default_rng(0)
    out = {}
    for name, p in params.items():
        g = rng.normal(size=p.shape)
        if kind == "zero":
            g = np.zeros(p.shape)
        elif kind == "identical":
            g = np.full(p.shape, 0.7)
        elif kind == "tiny":
            g = g * 1e-30
        elif kind == "huge":
            g = g * 1e18
        out[name] = jnp.asarray(g, jnp.bfloat16 if kind == "bf16" else jnp.float32)
    return out


@pytest.mark.parametrize("band", BANDS)
def test_finite_on_hostile_gradients(band):
    """Zero, identical-neighbour, rank-deficient first steps, 1e-30, 1e18 and bf16 gradients."""
    tx = sonew(1e-2, band=band, precondition_1d=True)
    update = jax.jit(tx.update)
    kinds = ["zero", "identical", "normal", "tiny", "huge", "bf16"]
    # bf16 parameters take the same solve whatever the band, and so does the 3-D tensor's 2-D
    # view: band 10 compiles its windows' solve per tensor shape and dtype, each among the
    # suite's slowest compilations.
    wide = band == 10
    base = {k: p for k, p in PARAMS.items() if not (wide and p.ndim == 3)}
    for kind in kinds[:-1] if wide else kinds:
        params = jax.tree.map(
            lambda p, k=kind: p.astype(jnp.bfloat16 if k == "bf16" else jnp.float32), base
        )
        state = tx.init(params)
        for step in range(3):  # step 1 is rank-deficient: H = P_G(g g^T) + eps I
            grads = _grads(kind, params) if step != 1 else _grads("identical", params)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            updates, state = update(grads, state, params)
            for name, u in updates.items():
                assert u.dtype == params[name].dtype
                assert bool(jnp.all(jnp.isfinite(u))), (band, kind, step, name)
            for leaf in jax.tree.leaves(state):
                assert bool(jnp.all(jnp.isfinite(leaf))), (band, kind, step)


def test_update_is_scale_free_for_graft_none(x64):
    """With eps = 0 the direction for gradients c*g is (1/c) times that for g (no square root)."""
    tx = scale_by_sonew(band=2, eps=0.0, gamma=1e-6, graft="none", stats_dtype=jnp.float64)
    rng = np.random.default_rng(1)
    grads = [{"w": jnp.asarray(rng.normal(size=(6, 5)))} for _ in range(4)]
    s1, s2 = tx.init(grads[0]), tx.init(grads[0])
    for g in grads:  # after 3 steps every band-2 window has full rank
        u1, s1 = tx.update(g, s1)
        u2, s2 = tx.update(jax.tree.map(lambda x: 1e6 * x, g), s2)
    np.testing.assert_allclose(np.asarray(u2["w"]) * 1e6, np.asarray(u1["w"]), rtol=1e-9)


def test_state_layout_and_dtypes():
    """Every state array has its parameter's shape; tridiag is 3x the parameters, with the
    default (relative) damping one more number per preconditioned tensor (in one array); the
    absolute damping's state has no more."""
    params = {"w": jnp.ones((6, 5), jnp.bfloat16), "b": jnp.ones((5,), jnp.bfloat16)}
    assert isinstance(scale_by_sonew(damping="absolute").init(params), ScaleBySONewState)
    tx = scale_by_sonew(band=1)
    state = tx.init(params)
    assert isinstance(state, ScaleBySONewDampedState)
    assert state.m["w"].shape == state.d["w"].shape == (6, 5)
    assert state.e["w"].shape == (1, 6, 5)
    assert state.diag.shape == (1,) and not jax.tree.leaves(state.ratio)  # "w" alone
    assert isinstance(state.e["b"], optax.MaskedNode)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state.m, state.d, state.e)))
    grads = jax.tree.map(jnp.ones_like, params)
    updates, new_state = jax.jit(tx.update)(grads, state)
    assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, state)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    assert state.e["w"].size + state.m["w"].size + state.d["w"].size == 3 * params["w"].size


def test_jit_no_recompilation_and_extra_args():
    tx = sonew(1e-3, band=2)
    state = tx.init(PARAMS)
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params, unused_extra_arg=1.0)
        return optax.apply_updates(params, updates), state

    params = PARAMS
    for _ in range(3):
        params, state = step(params, state, _grads("normal", PARAMS))
    assert len(traces) == 1


def test_composes_with_chain_multisteps_inject_and_masks():
    mask = {"w": True, "k": True, "b": False}
    base = optax.chain(optax.clip_by_global_norm(1.0), sonew(1e-2, weight_decay=0.1, mask=mask))
    multi = optax.MultiSteps(sonew(1e-2, band=2), every_k_schedule=2)
    injected = optax.inject_hyperparams(sonew, static_args=("band",))(
        learning_rate=optax.cosine_decay_schedule(1e-2, 10), b2=0.99, band=2
    )
    for tx in (base, multi, injected):
        state = tx.init(PARAMS)
        params = PARAMS
        for _ in range(3):
            updates, state = jax.jit(tx.update)(_grads("normal", PARAMS), state, params)
            params = optax.apply_updates(params, updates)
        assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
    state = injected.init(PARAMS)
    assert float(state.hyperparams["b2"]) == pytest.approx(0.99)


def test_mask_excludes_weight_decay():
    """With zero gradients the only movement is weight decay, exactly where the mask says."""
    mask = {"w": True, "k": False, "b": False}
    tx = sonew(0.5, weight_decay=0.1, mask=mask)
    updates, _ = tx.update(_grads("zero", PARAMS), tx.init(PARAMS), PARAMS)
    np.testing.assert_allclose(np.asarray(updates["w"]), -0.05 * np.ones((6, 5)), rtol=1e-6)
    assert not np.any(np.asarray(updates["k"])) and not np.any(np.asarray(updates["b"]))


def test_flax_params_tree():
    model = nn.Sequential([nn.Dense(7), nn.relu, nn.Dense(3)])
    x = jnp.ones((4, 5))
    params = model.init(jax.random.key(0), x)["params"]
    tx = sonew(1e-2, band=1)
    state = tx.init(params)

    def loss(p):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    for _ in range(3):
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


def test_minimises_a_quadratic():
    """Sanity: SONew reduces an ill-conditioned least-squares loss."""
    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.normal(size=(64, 12)) * np.logspace(0, 2, 12))
    y = jnp.asarray(rng.normal(size=(64,)))
    loss = lambda p: jnp.mean((A @ p["w"].reshape(-1) - y) ** 2)  # noqa: E731
    best = loss({"w": jnp.asarray(np.linalg.lstsq(A, y, rcond=None)[0])})
    params = {"w": jnp.zeros((4, 3))}
    tx = sonew(optax.cosine_decay_schedule(0.02, 300), band=2)
    state = tx.init(params)
    start = loss(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(300):
        params, state = step(params, state)
    assert loss(params) - best < 0.05 * (start - best)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"band": -1}, "band"),
        ({"band": 1.5}, "band"),
        ({"b1": 1.0}, "b1"),
        ({"b1": -0.1}, "b1"),
        ({"b2": 1.2}, "b2"),
        ({"graft": "sgd"}, "graft"),
        ({"eps": -1.0}, "eps"),
        ({"gamma": -1e-3}, "gamma"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"mesh": None, "param_specs": {"w": None}}, "mesh"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"learning_rate": jnp.array([1e-3, -1e-3])}, "learning_rate"),
        ({"b1": jnp.array(1.5)}, "b1"),
        ({"b2": np.float32(np.nan)}, "b2"),
        ({"eps": jnp.array(np.inf)}, "eps"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    kwargs = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=name):
        sonew(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "state"),
    [
        ({"b2": 0.999, "offdiag_dtype": jnp.bfloat16}, "e"),
        ({"b1": 0.998, "mu_dtype": jnp.bfloat16}, "m"),
        ({"b2": 0.999, "stats_dtype": jnp.bfloat16}, "d"),
    ],
)
def test_a_decay_finer_than_the_states_rounding_is_refused(kwargs, state):
    with pytest.raises(ValueError, match=rf"moves {state} .*rounding"):
        sonew(1e-3, **kwargs)
    sonew(1e-3, **{k: v for k, v in kwargs.items() if not k.endswith("dtype")})  # float32 holds it


def test_the_decay_rounding_threshold_is_where_bf16_averages_stop_moving():
    """Stored in bfloat16 after each step (the engine computes in float32, then casts), an
    average decayed by ``b`` rounds back to itself for some values when ``1 - b`` is below
    ``eps / 2`` (refused), and moves for every value at the largest accepted ``b``."""
    x = jnp.linspace(1.0, 2.0, 129, endpoint=False).astype(jnp.bfloat16)  # every mantissa
    rounding = float(jnp.finfo(jnp.bfloat16).eps) / 2

    def stuck(b):
        return bool(jnp.any((x.astype(jnp.float32) * b).astype(jnp.bfloat16) == x))

    assert stuck(1 - 0.9 * rounding) and stuck(0.999)
    assert not stuck(1 - rounding) and not stuck(0.95)
    sonew(1e-3, b2=1 - rounding, offdiag_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="rounding"):
        sonew(1e-3, b2=1 - 0.9 * rounding, offdiag_dtype=jnp.bfloat16)


def test_negative_schedule_value_is_refused_where_concrete():
    tx = sonew(lambda count: -0.1 * jnp.ones([]))
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"learning_rate .*step 0"):
        tx.update(PARAMS, state, PARAMS)


@pytest.mark.parametrize(
    ("dtype", "hint"), [(jnp.int32, "optax.masked"), (jnp.complex64, "real and imaginary")]
)
def test_integer_and_complex_parameters_are_a_type_error_naming_the_path(dtype, hint):
    params = {"layer": {"w": jnp.ones((3, 3)), "table": jnp.ones((4, 2), dtype)}}
    with pytest.raises(
        TypeError, match=rf"\['layer'\]\['table'\] has dtype {dtype.__name__}.*{hint}"
    ):
        sonew(1e-3).init(params)
    state = sonew(1e-3).init({"w": jnp.ones((3, 3))})
    with pytest.raises(TypeError, match="gradient"):
        sonew(1e-3).update({"w": jnp.ones((3, 3), dtype)}, state)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("band", [0, 1, 2, 4])
def test_zero_size_tensors_get_an_empty_update(band, implementation):
    params = {"w": jnp.ones((0, 5)), "k": jnp.ones((3, 0, 2)), "x": jnp.ones((8, 4))}
    tx = sonew(1e-2, band=band, implementation=implementation)
    state = tx.init(params)
    # The first update is zero (the relative damping has no statistic yet): check the second.
    _, state = jax.jit(tx.update)(params, state, params)
    updates, state = jax.jit(tx.update)(params, state, params)
    assert {k: u.shape for k, u in updates.items()} == {k: p.shape for k, p in params.items()}
    assert bool(jnp.all(jnp.isfinite(updates["x"]))) and bool(jnp.any(updates["x"] != 0))
    new_params, _ = jax.jit(tx.apply)(params, state, params)
    assert new_params["w"].shape == (0, 5)


def _chain_distance(shape, index, other) -> int:
    """Distance along the chain (Fortran order) between two multi-indices of ``shape``."""
    return abs(
        np.ravel_multi_index(index, shape, order="F")
        - np.ravel_multi_index(other, shape, order="F")
    )


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("graft", ["adam", "none"])
@pytest.mark.parametrize("band", [0, 1, 2, 4])
def test_one_non_finite_gradient_entry_spreads_by_one_rule(band, graft, implementation):
    """The documented rule (``scale_by_sonew``): without grafting, the entries within ``band``
    chain positions of a non-finite gradient entry are non-finite, the others finite; with Adam
    grafting, the whole tensor's update is non-finite. Every band, both implementations."""
    shape, bad = (16, 8), (5, 3)
    tx = scale_by_sonew(band=band, graft=graft, implementation=implementation)
    g = jax.random.normal(jax.random.key(0), shape)
    state = tx.init({"w": g})
    _, state = tx.update({"w": g}, state)
    updates, _ = tx.update({"w": g.at[bad].set(jnp.nan)}, state)
    non_finite = ~np.isfinite(np.asarray(updates["w"]))
    if graft == "adam":
        assert non_finite.all()
        return
    near = np.array(
        [
            [_chain_distance(shape, bad, (i, j)) <= band for j in range(shape[1])]
            for i in range(shape[0])
        ]
    )
    np.testing.assert_array_equal(non_finite, near)


def test_non_finite_spread_with_graft_lag_reaches_the_whole_tensor_a_step_later():
    g = jax.random.normal(jax.random.key(0), (16, 8))
    tx = scale_by_sonew(band=1, graft_lag=True)
    state = tx.init({"w": g})
    for grads in ({"w": g}, {"w": g}):
        _, state = tx.update(grads, state)
    now, state = tx.update({"w": g.at[5, 3].set(jnp.nan)}, state)
    later, _ = tx.update({"w": g}, state)
    assert int(jnp.sum(~jnp.isfinite(now["w"]))) == 3  # the lagged ratio was finite
    assert not bool(jnp.any(jnp.isfinite(later["w"])))


@pytest.mark.parametrize("band", [0, 1, 4])
def test_bf16_momentum_and_offdiagonals(band):
    """``mu_dtype`` / ``offdiag_dtype`` store m and e in bf16 (d stays fp32): the state
    keeps its dtypes through jitted steps, stays finite on hostile gradients, and the trajectory
    on a small ill-conditioned least-squares problem stays close to the fp32-state one."""
    bf16 = dict(mu_dtype=jnp.bfloat16, offdiag_dtype=jnp.bfloat16)
    params = {"w": jnp.zeros((4, 3))}
    state = scale_by_sonew(band=band, **bf16).init(params)
    assert state.m["w"].dtype == jnp.bfloat16 and state.d["w"].dtype == jnp.float32
    if band:
        assert state.e["w"].dtype == jnp.bfloat16

    tx = sonew(1e-2, band=band, precondition_1d=True, **bf16)
    for kind in ["zero", "identical", "tiny", "huge", "bf16"]:
        p = jax.tree.map(
            lambda x, k=kind: x.astype(jnp.bfloat16 if k == "bf16" else x.dtype), PARAMS
        )
        s = tx.init(p)
        dtypes = jax.tree.map(lambda a: a.dtype, s)
        for _ in range(3):
            grads = jax.tree.map(lambda g, x: g.astype(x.dtype), _grads(kind, p), p)
            updates, s = jax.jit(tx.update)(grads, s, p)
            assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates)), kind
            assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(s)), kind
        assert jax.tree.map(lambda a: a.dtype, s) == dtypes

    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.normal(size=(64, 12)) * np.logspace(0, 1, 12), jnp.float32)
    y = jnp.asarray(rng.normal(size=(64,)), jnp.float32)
    loss = lambda p: jnp.mean((A @ p["w"].reshape(-1) - y) ** 2)  # noqa: E731

    def trajectory(**kwargs):
        tx = sonew(optax.cosine_decay_schedule(0.02, 200), band=band, **kwargs)
        params = {"w": jnp.zeros((4, 3))}
        state = tx.init(params)
        step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
        losses = []
        for _ in range(200):
            updates, state = step(params, state)
            params = optax.apply_updates(params, updates)
            losses.append(float(loss(params)))
        return np.asarray(losses), params["w"]

    ref_losses, ref_w = trajectory()
    losses, w = trajectory(**bf16)
    start = float(loss({"w": jnp.zeros((4, 3))}))
    # bf16 e moves |rho| ~ 1 correlations of the first, rank-deficient steps by ~4e-3, which can
    # decide Algorithm 3's cuts differently: the early transient differs, the curve and the end
    # point do not.
    assert np.mean(np.abs(losses - ref_losses)) <= 0.02 * start
    assert np.max(np.abs(losses - ref_losses)) <= 0.1 * start
    assert losses[-1] <= ref_losses[-1] + 0.01 * start
    np.testing.assert_allclose(
        np.asarray(w), np.asarray(ref_w), atol=0.05 * float(jnp.abs(ref_w).max())
    )
