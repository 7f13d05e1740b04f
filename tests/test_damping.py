"""The relative damping (``sonew(..., damping="mean" | "max")``): each step's ``eps`` is the given
one times a statistic of the tensor's bias-corrected diagonal, which makes the grafted update
independent of the gradients' scale."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import KernelConfig, kernels, pointwise, scale_by_sonew, sonew
from tests.test_sonew_sharded import assert_sharded_matches, make_mesh

B2 = 0.95


def _grads(shape, steps, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(scale * rng.normal(size=shape)) for _ in range(steps)]


@pytest.mark.parametrize("band", [0, 1, 2])
@pytest.mark.parametrize("damping", ["mean", "max"])
def test_each_step_is_the_absolute_step_with_the_last_steps_scale(x64, band, damping):
    """Step 1 is zero (no diagonal yet to scale ``eps`` by: an infinite damping, while the
    moments accumulate); step ``t`` equals the absolute-damping step whose ``eps`` is the given
    one times the mean (or max) of the previous step's ``d_hat_{t-1} = d_{t-1} / (1 -
    b2^(t-1))``, ``d_t = b2 d_{t-1} + (1 - b2) g_t^2``, computed here from the gradients alone;
    the state keeps that statistic of ``d_hat_t``."""
    shape, rel = (6, 5), 1e-2
    grads = _grads(shape, 4, seed=band)
    kwargs = dict(band=band, b2=B2, graft="none", stats_dtype=jnp.float64)
    relative = scale_by_sonew(eps=rel, damping=damping, **kwargs)
    absolute = optax.inject_hyperparams(scale_by_sonew, static_args=("band", "damping"))(
        eps=1.0, damping="absolute", **kwargs
    )
    params = jnp.zeros(shape)
    state_rel, state_abs = relative.init(params), absolute.init(params)
    reduce = np.mean if damping == "mean" else np.max
    d, scale = np.zeros(shape), None
    for t, g in enumerate(grads, start=1):
        if scale is not None:
            state_abs.hyperparams["eps"] = jnp.asarray(rel * scale)
        u_rel, state_rel = relative.update(g, state_rel, params)
        u_abs, state_abs = absolute.update(g, state_abs, params)
        if scale is None:
            assert np.all(np.asarray(u_rel) == 0)
        else:
            # The statistic is summed in another order here: eps differs in its last bits, which
            # band 2's window solve amplifies in the smallest entries.
            atol = 1e-12 * np.max(np.abs(u_abs))
            np.testing.assert_allclose(u_rel, u_abs, rtol=1e-10, atol=atol)
        d = B2 * d + (1 - B2) * np.square(np.asarray(g))
        scale = reduce(d / (1 - B2**t))
        np.testing.assert_allclose(state_rel.diag, scale, rtol=1e-12)


@pytest.mark.parametrize("band", [0, 1, 4])
def test_relative_damping_makes_the_grafted_update_scale_free(x64, band):
    """Gradients scaled by 1e-3 or 1e3 give the same grafted update with a relative damping;
    with the absolute one they do not (the damping then weighs 1e6 times more or less). Adam's
    ``graft_eps`` is 0 here: it is absolute too."""
    shape = (8, 6)
    params = {"w": jnp.zeros(shape), "b": jnp.zeros((5,))}

    def updates(damping, scale):
        tx = sonew(
            1.0, band=band, eps=1e-2, damping=damping, graft_eps=0.0, stats_dtype=jnp.float64
        )
        state = tx.init(params)
        rng = np.random.default_rng(band)
        for _ in range(3):
            grads = jax.tree.map(lambda p: jnp.asarray(scale * rng.normal(size=p.shape)), params)
            u, state = tx.update(grads, state, params)
        return u

    for damping in ("mean", "max"):
        base = updates(damping, 1.0)
        for scale in (1e-3, 1e3):
            jax.tree.map(
                lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=0),
                updates(damping, scale),
                base,
            )
    base, scaled = updates("absolute", 1.0)["w"], updates("absolute", 1e-3)["w"]
    assert np.max(np.abs(scaled - base)) > 1e-3 * np.max(np.abs(base))


@pytest.mark.parametrize("damping", ["mean", "max"])
def test_sharded_relative_damping_equals_unsharded(x64, damping):
    """The statistic is taken over the whole tensor, across its shards."""
    mesh = make_mesh((2, 4))
    params = {"rows": jnp.zeros((8, 3)), "both": jnp.zeros((4, 12)), "rep": jnp.zeros((3, 5))}
    specs = {"rows": P("data", None), "both": P("data", "model"), "rep": P()}
    rng = np.random.default_rng(7)
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(3)
    ]
    kwargs = dict(band=1, eps=1e-2, damping=damping, stats_dtype=jnp.float64)
    assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_diagonal_root_is_the_square_root_of_d_hat(x64, dtype):
    """The statistic's ``sqrt(d_hat)`` (computed as ``d_hat * rsqrt(d_hat)``, apart from Adam's
    ``sqrt``) against numpy's float64 square root: to a few roundings for normal numbers, 0 below
    the smallest normal one, and +inf and NaN kept."""
    tiny = float(jnp.finfo(dtype).tiny)
    d = np.array([0.0, tiny / 8, tiny, 1e-30, 0.3, 7.0, 1e30, np.inf, np.nan])
    corrections = (jnp.asarray(0.5, dtype), jnp.asarray(0.25, dtype))  # d_hat = d / 0.25
    got = np.asarray(pointwise.diagonal_root(jnp.asarray(d, dtype), corrections), np.float64)
    d_hat = d / 0.25
    want = np.where(d_hat < tiny, 0.0, np.sqrt(d_hat))
    np.testing.assert_allclose(got, want, rtol=4 * float(jnp.finfo(dtype).eps))
    assert np.isnan(got[-1]) and got[-2] == np.inf and got[1] == 0


def test_unknown_damping_is_named():
    with pytest.raises(ValueError, match="damping must be one of"):
        sonew(1e-3, damping="median")


@pytest.mark.parametrize("band", [0, 1, 2])
def test_kernels_take_the_relative_damping(band, monkeypatch):
    """The Pallas kernels (in Pallas' interpreter here) with ``damping="mean"`` follow the XLA
    path: the two tensors of one shape share a launch, each with its own eps, and their norm
    pairs give the same next scale."""
    launches = []
    group_update = kernels.group_update

    def spy(gs, *args, **kwargs):
        launches.append(len(gs))
        return group_update(gs, *args, **kwargs)

    monkeypatch.setattr(kernels, "group_update", spy)
    params = {"a": jnp.zeros((32, 64)), "b": jnp.zeros((32, 64))}
    small = KernelConfig(banded_tile=(8, 64, 2), scan_tile=(16, 64, 2), max_banded_group=2)
    rng = np.random.default_rng(band)
    grads_seq = [
        {k: jnp.asarray(s * rng.normal(size=p.shape), jnp.float32) for (k, p), s in
         zip(params.items(), (1.0, 1e-2), strict=True)}
        for _ in range(3)
    ]  # fmt: skip

    def run(implementation):
        tx = sonew(
            1.0, band=band, eps=1e-2, damping="mean", implementation=implementation,
            kernel_config=small,
        )  # fmt: skip
        state, out = tx.init(params), []
        for grads in grads_seq:
            u, state = tx.update(grads, state, params)
            out.append(u)
        return out, optax.tree_utils.tree_get(state, "diag")

    # Float32 rounding of the two paths differs by ~1e-5 of the largest entry (the first steps'
    # correlations are near +-1). A wrong eps moves "b" (gradients 1e-2: relative eps 1e-6 there,
    # not 1e-2) by O(1).
    (got_all, got_diag), (want_all, want_diag) = run("pallas"), run("xla")
    assert launches and set(launches) == {2}  # one launch per step for both tensors
    assert all(np.all(np.asarray(u) == 0) for u in got_all[0].values())  # the first step
    for got, want in zip(got_all[1:], want_all[1:], strict=True):
        for k in params:
            scale = np.abs(want[k]).max()
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-4 * scale)
    # The kernels' norm pairs of sqrt(d_hat) give the next step's scales, as XLA's reduction does.
    assert got_diag.shape == (2,)  # one per tensor, in the tree's order
    np.testing.assert_allclose(got_diag, want_diag, rtol=1e-6)


@pytest.mark.parametrize("band", [1])  # the norm pairs' reduction is every band's
def test_relative_damping_with_bf16_statistics(band):
    """bf16 statistics on XLA: ``sqrt(d_hat)``'s norm pair joins the grafting norms' reduction in
    their precision, and the steps after the first are finite and nonzero."""
    params = {"w": jnp.ones((4, 3))}
    kwargs = dict(eps=0.1, damping="mean", stats_dtype=jnp.bfloat16, implementation="xla")
    tx = sonew(1.0, band=band, **kwargs)
    state = tx.init(params)
    for grads in _grads((4, 3), 2, seed=band):
        u, state = tx.update({"w": grads.astype(jnp.float32)}, state, params)
    assert bool(jnp.all(jnp.isfinite(u["w"]))) and bool(jnp.any(u["w"] != 0))
