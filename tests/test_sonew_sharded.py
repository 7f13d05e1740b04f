"""Sharded SONew (shard_map + halo exchange) equals the unsharded optimizer, on 8 CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import ScaleBySONewDampedState, slots, sonew, specs_of, state_partition_specs


def make_mesh(shape):
    """A (data, model) mesh of ``shape`` over the first devices; skips the test where there are
    fewer (a one-GPU machine: the suite's 8 devices are conftest's simulated CPUs)."""
    if jax.device_count() < shape[0] * shape[1]:
        pytest.skip(f"needs {shape[0] * shape[1]} devices, {jax.device_count()} here")
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


def run(tx, params, grads_seq, mesh=None, specs=None, state=None):
    """Jitted updates from ``state`` (default: ``tx.init``), placed by ``specs`` on ``mesh``."""
    state = tx.init(params) if state is None else state
    if mesh is not None:
        put = lambda tree, sp: jax.tree.map(  # noqa: E731
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, sp
        )
        state = put(state, state_partition_specs(state, specs))
        params = put(params, specs)
        grads_seq = [put(g, specs) for g in grads_seq]
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    outs = []
    for grads in grads_seq:
        updates, state = step(params, state, grads)
        params = optax.apply_updates(params, updates)
        outs.append(updates)
    return outs, state


def assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol, expect=None):
    """``sonew(**kwargs)`` sharded by ``specs`` on ``mesh`` follows the unsharded updates
    ``expect`` (default: run here; relative error of every update <= ``rtol``); returns the
    sharded state."""
    if expect is None:
        expect, _ = run(sonew(0.1, **kwargs), params, grads_seq)
    got, state = run(
        sonew(0.1, mesh=mesh, param_specs=specs, **kwargs), params, grads_seq, mesh, specs
    )
    for step, (e_step, g_step) in enumerate(zip(expect, got, strict=True)):
        for k in params:
            e, g = np.asarray(e_step[k]), np.asarray(g_step[k])
            assert np.linalg.norm(g - e) <= rtol * np.linalg.norm(e), (k, step, kwargs)
    return state


# Band 1 on every mesh (both axes split either way round, one axis alone either way); bands 2
# and 4 on two of them, both axes split and the rows alone: their exchange is band 1's with wider
# halos over the same mesh axes; band 0 on one: it exchanges no halo, and its grafting norms'
# all-reduce over the mesh axes is the one band 1 runs on every mesh.
MESH_BANDS = [(m, b) for m in [(2, 4), (4, 2), (1, 8), (8, 1)] for b in (0, 1, 2, 4)]


@pytest.mark.parametrize(
    "mesh_shape, band",
    [
        (m, b)
        for m, b in MESH_BANDS
        if b == 1 or (b in (2, 4) and m in ((2, 4), (8, 1))) or (b == 0 and m == (2, 4))
    ],
)
def test_sharded_equals_unsharded(x64, mesh_shape, band):
    params, specs = case(mesh_shape)
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(band)
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(3)
    ]
    # eps keeps the rank-deficient first windows well conditioned: the check is the halo exchange,
    # not how float64 rounding is amplified near singular windows.
    kwargs = dict(band=band, eps=1e-4, gamma=1e-6, precondition_1d=True, stats_dtype=jnp.float64)
    state = assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol=1e-10)
    # Every state array keeps its parameter's sharding.
    for k, spec in specs.items():
        sonew_state, ndim = state[0], params[k].ndim
        for leaf in (sonew_state.m[k], sonew_state.d[k]):
            assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), ndim)
        if band:
            band_sharding = NamedSharding(mesh, P(None, *spec))
            assert sonew_state.e[k].sharding.is_equivalent_to(band_sharding, ndim + 1)


@pytest.mark.parametrize("band", [1, 2])
def test_more_tensors_of_one_layout_than_one_norm_reduction_takes(x64, band):
    """The norm pairs of at most ``slots.GRAFT_GROUP`` tensors are merged by one reduction:
    with more tensors of one layout than that, each tensor still steps as it does alone, and
    sharded as unsharded (band 1's edges on XLA; band 2's extended blocks)."""
    count = slots.GRAFT_GROUP + 3
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(band)
    params = {f"w{i:02d}": jnp.asarray(rng.normal(size=(8, 8))) for i in range(count)}
    specs = {k: P("data", "model") for k in params}
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(2)
    ]
    kwargs = dict(band=band, eps=1e-4, gamma=1e-6, stats_dtype=jnp.float64)
    together, _ = run(sonew(0.1, **kwargs), params, grads_seq)
    assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol=1e-10, expect=together)
    for k in ("w00", f"w{slots.GRAFT_GROUP:02d}", f"w{count - 1:02d}"):
        alone, _ = run(sonew(0.1, **kwargs), {k: params[k]}, [{k: g[k]} for g in grads_seq])
        for a, t in zip(alone, together, strict=True):
            np.testing.assert_allclose(t[k], a[k], rtol=1e-12, atol=0)


@pytest.mark.parametrize("band", [0, 1, 2])
def test_sharded_zero_size_tensors(band):
    """A 0-size dimension, sharded or not, gets an empty update beside the others' usual one."""
    mesh = make_mesh((2, 4))
    params = {
        "empty_rows": jnp.ones((0, 8)),
        "empty_cols": jnp.ones((4, 0)),
        "w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32),
    }
    specs = {"empty_rows": P(None, "model"), "empty_cols": P("data", None), "w": P("data", "model")}
    grads_seq = [jax.tree.map(lambda p: p * (k + 1), params) for k in range(2)]
    assert_sharded_matches(dict(band=band), params, specs, mesh, grads_seq, rtol=1e-5)


@pytest.mark.parametrize("band", [2, 4])
def test_sharded_equals_unsharded_where_the_chain_is_cut(x64, band):
    """A large ``gamma`` cuts the chain at data-dependent vertices (Algorithm 3), so an element's
    update reads inputs up to ``2 band - 1`` positions ahead; shards of 2 and 3 rows are thinner
    than that, so the neighbours come from several shards away."""
    mesh = make_mesh((2, 4))
    params = {
        "thin": jnp.zeros((16, 3)),
        "thin_cols": jnp.zeros((3, 24)),
        "cube": jnp.zeros((4, 2, 6)),
    }
    specs = {
        "thin": P(("data", "model"), None),
        "thin_cols": P(None, ("model", "data")),
        "cube": P("model", None, "data"),
    }
    rng = np.random.default_rng(band)
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(4)
    ]
    kwargs = dict(band=band, eps=1e-3, gamma=0.3, stats_dtype=jnp.float64)
    assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol=1e-10)


def _compiled_update(params, specs, mesh, **kwargs) -> str:
    """The compiled HLO of ``sonew(**kwargs)``'s sharded update of abstract ``params``."""
    tx = sonew(0.1, mesh=mesh, param_specs=specs, **kwargs)
    state = jax.eval_shape(tx.init, params)
    shardings = lambda sp: jax.tree.map(lambda s: NamedSharding(mesh, s), sp)  # noqa: E731
    state_shardings = shardings(state_partition_specs(state, specs))
    step = jax.jit(
        lambda p, s, g: tx.update(g, s, p),
        in_shardings=(shardings(specs), state_shardings, shardings(specs)),
        out_shardings=(shardings(specs), state_shardings),
    )
    return step.lower(params, state, params).compile().as_text()


def test_compiled_update_has_no_gathers():
    """Only collective-permutes (halos) and all-reduces (grafting norms): nothing is gathered."""
    params, specs = case((2, 4))
    hlo = _compiled_update(params, specs, make_mesh((2, 4)), band=2)
    assert "collective-permute" in hlo and "all-reduce" in hlo
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def _collectives(hlo: str) -> dict[str, int]:
    """How many collective-permutes and all-reduces a compiled module holds."""
    ops = ("collective-permute", "all-reduce")
    return {op: len(re.findall(rf"\s{op}(-start)?\(", hlo)) for op in ops}


# 8 against 32 tensors on XLA; 4 against 12 with the kernels (Pallas' interpreter on a CPU is
# slow to trace more). More tensors than one norm reduction takes: the test below.
@pytest.mark.parametrize("implementation, few, many", [("xla", 2, 8), ("pallas", 1, 3)])
def test_one_exchange_per_step_whatever_the_number_of_tensors(implementation, few, many):
    """Band 1's update of ``4 few`` tensors (``few`` of each of 4 layouts) sends as many messages
    as that of ``4 many``: the edges of all tensors going the same way travel in one
    collective-permute, and the grafting norms of all tensors, whatever mesh axes each is sharded
    over, in one all-reduce."""
    params, specs = case((2, 4))
    layouts = ("rows", "cols", "both", "vec")
    mesh = make_mesh((2, 4))

    def counts(copies):
        tree = {f"{k}{i}": params[k] for k in layouts for i in range(copies)}
        tree_specs = {f"{k}{i}": specs[k] for k in layouts for i in range(copies)}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        hlo = _compiled_update(abstract, tree_specs, mesh, band=1, implementation=implementation)
        return _collectives(hlo)

    few, many = counts(few), counts(many)
    assert few["collective-permute"] == many["collective-permute"], (few, many)
    # The bound: per direction (2) and per set of mesh axes a layout's edges vary over and travel
    # along (here rows over data, columns over model, and both over each), one message.
    assert 0 < few["collective-permute"] <= 8
    assert few["all-reduce"] == many["all-reduce"] == 1, (few, many)


# Blocks of at least 2 * 4 - 1 = 7 rows, where band 4's XLA step runs on the block extended by its
# neighbours' rows: along a sharded axis 0 (chain ends and shard boundaries), along an unsharded
# axis 0 whose columns wrap across shards, and both.
THICK = {
    "rows": ((16, 3), P("data", None)),
    "cols": ((8, 8), P(None, "model")),
    "both": ((14, 12), P("data", "model")),
}


def _thick(copies: int = 1):
    rng = np.random.default_rng(copies)
    params = {
        f"{k}{i}": jnp.asarray(rng.normal(size=s))
        for k, (s, _) in THICK.items()
        for i in range(copies)
    }
    specs = {f"{k}{i}": spec for k, (_, spec) in THICK.items() for i in range(copies)}
    return params, specs


def test_band4_on_extended_blocks_equals_unsharded_with_one_exchange(x64):
    """Bands >= 2 on XLA run a thick enough block's step on the block extended by its chain
    neighbours' rows (``engine._on_extended_block``): the same numbers as one device, and the
    rows of all tensors travel in one exchange per direction and set of mesh axes, so 3 and 9
    tensors send as many collective-permutes (the per-shift exchanges sent dozens per tensor)."""
    mesh = make_mesh((2, 4))
    params, specs = _thick()
    rng = np.random.default_rng(4)
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(3)
    ]
    kwargs = dict(band=4, eps=1e-4, gamma=1e-6, stats_dtype=jnp.float64, implementation="xla")
    assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol=1e-10)

    def counts(copies):
        tree, tree_specs = _thick(copies)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        return _collectives(
            _compiled_update(abstract, tree_specs, mesh, band=4, implementation="xla")
        )

    few, many = counts(1), counts(3)
    assert few == many, (few, many)
    assert 0 < few["collective-permute"] <= 8 and few["all-reduce"] == 1


def test_state_partition_specs_for_chains_and_abstract_states():
    params, specs = case((2, 4))
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
        sonew(1e-3, band=2),
    )
    abstract = jax.eval_shape(tx.init, params)
    out = state_partition_specs(abstract, specs)
    _, adamw_state, (sonew_state, *_) = out
    assert adamw_state.inner_state[0].mu == specs
    assert adamw_state.hyperparams["learning_rate"] == P()
    # The default damping's statistics are replicated (one array); no lagged ratio.
    assert type(sonew_state) is ScaleBySONewDampedState and not jax.tree.leaves(sonew_state.ratio)
    assert sonew_state.diag == P()
    assert sonew_state.count == P() and sonew_state.m == specs
    assert sonew_state.e["rows"] == P(None, "data", None)
    assert isinstance(sonew_state.e["rep"], P) and sonew_state.e["rep"] == P(None)
    real = state_partition_specs(tx.init(params), specs)
    assert jax.tree.structure(real) == jax.tree.structure(out)


def test_state_moves_between_meshes(x64):
    """A state saved from a 2x4 mesh continues identically on 4x2 (and unsharded)."""
    params, _ = case((2, 4))
    params = {k: v for k, v in params.items() if k in ("both", "rep")}  # shapes valid on both
    mesh_a, mesh_b = make_mesh((2, 4)), make_mesh((4, 2))
    specs_a = {"both": P("data", "model"), "rep": P()}
    specs_b = {"both": P("model", "data"), "rep": P()}
    rng = np.random.default_rng(0)
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(4)
    ]
    kw = dict(band=2, stats_dtype=jnp.float64)
    tx_a = sonew(0.1, mesh=mesh_a, param_specs=specs_a, **kw)
    tx_b = sonew(0.1, mesh=mesh_b, param_specs=specs_b, **kw)
    _, state = run(tx_a, params, grads[:2], mesh_a, specs_a)
    saved = jax.device_get(state)  # what a checkpoint holds
    expect, _ = run(sonew(0.1, **kw), params, grads[2:], state=saved)
    got, _ = run(tx_b, params, grads[2:], mesh_b, specs_b, state=saved)
    for e, g in zip(expect, got, strict=True):
        for k in params:
            np.testing.assert_allclose(np.asarray(g[k]), np.asarray(e[k]), rtol=1e-10)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ({"w": P("data", None, None)}, r"\['w'\].*rank 2"),
        ({"w": P("model", None)}, r"\['w'\].*dimension 0 of size 6 is not divisible by its 4"),
        ({"w": P("expert", None)}, r"\['w'\].*unknown|\['w'\].*'expert'"),
    ],
)
def test_bad_specs_name_the_parameter(specs, message):
    mesh = make_mesh((2, 4))
    params = {"w": jnp.ones((6, 4))}
    tx = sonew(0.1, mesh=mesh, param_specs=specs)
    with pytest.raises(ValueError, match=message):
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("band", [1, 2])
def test_sharded_bf16_state_equals_unsharded(band):
    """bf16 momentum and off-diagonals: specs cover the mixed-dtype state, sharded == unsharded,
    and the state keeps its dtypes and its parameters' sharding."""
    params, specs = case((2, 4))
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(band)
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        for _ in range(3)
    ]
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    kwargs = dict(
        band=band, precondition_1d=True, mu_dtype=jnp.bfloat16, offdiag_dtype=jnp.bfloat16
    )
    state = assert_sharded_matches(kwargs, params, specs, mesh, grads_seq, rtol=1e-3)
    sonew_state = state[0]
    for k, spec in specs.items():
        assert sonew_state.m[k].dtype == jnp.bfloat16 and sonew_state.d[k].dtype == jnp.float32
        assert sonew_state.e[k].dtype == jnp.bfloat16
        assert sonew_state.m[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), params[k].ndim)


def _placed(params, specs, mesh):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto-mesh", "explicit-mesh"])
@pytest.mark.parametrize("with_mesh", [False, True], ids=["no-mesh-arg", "mesh-arg"])
def test_eager_init_follows_the_parameters_shardings(explicit, with_mesh):
    """As optax's states do: every state array where its parameter lives, scalars replicated."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
    params, specs = case((2, 4))
    params = _placed(params, specs, mesh)
    kwargs = dict(mesh=mesh, param_specs=specs) if with_mesh else {}
    state = sonew(0.1, band=2, precondition_1d=True, graft_lag=True, **kwargs).init(params)
    wanted = state_partition_specs(state, specs)
    for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(wanted), strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf, spec)


@pytest.mark.parametrize("with_mesh", [False, True], ids=["no-mesh-arg", "mesh-arg"])
def test_jitted_init_on_an_explicit_mesh_follows_the_parameters(with_mesh):
    """Under ``jit`` (in the mesh context JAX asks for) the state takes the parameters' types,
    so the update's shard_map accepts it."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=explicit)
    params, specs = case((2, 4))
    params = _placed(params, specs, mesh)
    kwargs = dict(mesh=mesh, param_specs=specs) if with_mesh else {}
    tx = sonew(0.1, band=2, precondition_1d=True, **kwargs)
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
        jax.jit(tx.update)(params, state, params)
    wanted = state_partition_specs(state, specs)
    for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(wanted), strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf, spec)


def test_specs_read_from_the_parameters_and_checked_against_them():
    mesh = make_mesh((2, 4))
    params, specs = case((2, 4))
    params = _placed(params, specs, mesh)
    read = specs_of(params)
    for name, spec in specs.items():
        padded = tuple(spec) + (None,) * (params[name].ndim - len(spec))
        assert tuple(read[name]) == padded
    sonew(0.1, mesh=mesh, param_specs=read).init(params)  # agrees
    as_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    sonew(0.1, param_specs=as_shardings).init(params)  # NamedShardings: their mesh is used
    wrong = {**specs, "rows": P("model", None)}  # divides, but not how "rows" is laid out
    with pytest.raises(ValueError, match=r"parameter \['rows'\] is laid out as"):
        sonew(0.1, mesh=mesh, param_specs=wrong).init(params)
    other = make_mesh((4, 2))
    with pytest.raises(ValueError, match=r"param_specs\['\w+'\] is a NamedSharding on mesh"):
        sonew(0.1, mesh=other, param_specs=as_shardings)


@pytest.mark.parametrize("with_mesh", [False, True], ids=["no-mesh-arg", "mesh-arg"])
def test_explicit_mesh_update_equals_unsharded(x64, with_mesh):
    """On a mesh with Explicit axes the arrays' types carry their specs: without ``mesh=`` the
    update reads them and runs sharded (no gathers), and equals the single-device update."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=explicit)
    params, specs = case((2, 4))
    rng = np.random.default_rng(0)
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(2)
    ]
    kwargs = dict(band=1, eps=1e-4, precondition_1d=True, stats_dtype=jnp.float64)
    expect, _ = run(sonew(0.1, **kwargs), params, grads)
    mesh_kwargs = dict(mesh=mesh, param_specs=specs) if with_mesh else {}
    tx = sonew(0.1, **kwargs, **mesh_kwargs)
    placed = _placed(params, specs, mesh)
    state = tx.init(placed)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    hlo = step.lower(placed, state, placed).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    for g, e in zip(grads, expect, strict=True):
        updates, state = step(placed, state, _placed(g, specs, mesh))
        placed = optax.apply_updates(placed, updates)
        for k in params:
            got, want = np.asarray(updates[k]), np.asarray(e[k])
            assert np.linalg.norm(got - want) <= 1e-10 * np.linalg.norm(want), k
