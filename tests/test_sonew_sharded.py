"""Sharded SONew (shard_map + halo exchange) equals the unsharded optimizer, on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import sonew, state_partition_specs


def make_mesh(shape):
    devices = np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    return jax.sharding.Mesh(devices, ("data", "model"))


def case(mesh_shape):
    """Parameters and specs covering every sharding pattern for a mesh (data=a, model=b)."""
    a, b = mesh_shape
    shapes = {
        "rows": ((4 * a, 3), P("data", None)),  # axis 0 sharded
        "cols": ((5, 2 * b), P(None, "model")),  # axis 1 sharded
        "both": ((2 * a, 3 * b), P("data", "model")),  # both axes
        "two_axes": ((a * b, 3), P(("data", "model"), None)),  # one slab row per shard
        "cube": ((b, 3, a), P("model", None, "data")),  # 3-D, thin shards
        "vec": ((3 * a * b,), P(("model", "data"))),  # 1-D
        "rep": ((3, 5), P()),  # replicated
        "thin": ((2 * b, 7), P("model", None)),  # local slab of 2 rows
    }
    rng = np.random.default_rng(sum(mesh_shape))
    params = {k: jnp.asarray(rng.normal(size=s)) for k, (s, _) in shapes.items()}
    specs = {k: spec for k, (_, spec) in shapes.items()}
    return params, specs


def run(tx, params, grads_seq, mesh=None, specs=None):
    state = tx.init(params)
    if mesh is not None:
        shard = lambda tree, sp: jax.tree.map(  # noqa: E731
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, sp
        )
        state_specs = state_partition_specs(state, specs)
        params = shard(params, specs)
        state = jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, state_specs
        )
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    outs = []
    for grads in grads_seq:
        if mesh is not None:
            grads = shard(grads, specs)
        updates, state = step(params, state, grads)
        params = optax.apply_updates(params, updates)
        outs.append(updates)
    return outs, state


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (1, 8), (8, 1)])
@pytest.mark.parametrize("band", [0, 1, 2, 4])
def test_sharded_equals_unsharded(x64, mesh_shape, band):
    params, specs = case(mesh_shape)
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(band)
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(3)
    ]
    kwargs = dict(band=band, gamma=1e-6, precondition_1d=True, stats_dtype=jnp.float64)
    expect, _ = run(sonew(0.1, **kwargs), params, grads_seq)
    got, state = run(sonew(0.1, mesh=mesh, param_specs=specs, **kwargs), params, grads_seq, mesh,
                     specs)
    for e_step, g_step in zip(expect, got, strict=True):
        for k in params:
            e, g = np.asarray(e_step[k]), np.asarray(g_step[k])
            assert np.linalg.norm(g - e) <= 1e-10 * np.linalg.norm(e), (k, mesh_shape, band)
    # Every state array keeps its parameter's sharding.
    for k, spec in specs.items():
        sonew_state, ndim = state[0], params[k].ndim
        for leaf in (sonew_state.m[k], sonew_state.d[k]):
            assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), ndim)
        if band:
            band_sharding = NamedSharding(mesh, P(None, *spec))
            assert sonew_state.e[k].sharding.is_equivalent_to(band_sharding, ndim + 1)
