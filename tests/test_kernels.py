"""The Pallas kernel path (``sonew_pax.optim.kernels``) equals the XLA path.

Off GPU the kernel runs in Pallas' interpreter, so these tests check the kernel's indexing (chain
neighbours, block edges, masks) and its per-block norms on CPU; on a GPU machine the same tests
compile it with Triton. Every comparison is against ``implementation="xla"``, itself checked
against the dense float64 reference in ``test_sonew_math.py``.
"""

import dataclasses
import functools
import hashlib
import importlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import SONewConfig, apply_gradients, kernels, sharding, sonew
from sonew_pax.optim.chain import ChainLayout, edges_of, halo_width
from sonew_pax.optim.chain import run as run_exchange
from sonew_pax.optim.kernels import KernelConfig, banded, launch
from tests.test_sonew_sharded import make_mesh, run

# 1-D to 4-D; several tiles (8 x 128 for band 0; the scan's 64-column blocks of 8 or 16 rows,
# ``KERNELS``) with ragged last ones (and a last row chunk of
# one row), so row chunks read each other's edge rows from the halo copies; views with one row or
# one column; size 1.
SHAPES = {
    "mat": (70, 130),
    "col": (7, 1),
    "row": (1, 9),
    "cube": (3, 4, 5),
    "tall": (33, 2, 3),
    "quad": (2, 3, 2, 3),
}
SHAPES_1D = {"vec": (33,), "one": (1,)}


def _trajectory(shapes, kinds, seed=0, dtype=jnp.float64):
    """Gradients per step: normal, or hostile (``zero``: all zeros; ``equal``: one value, so every
    neighbour correlation is 1 and Algorithm 3 cuts every edge; ``tiny``: 1e-30)."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in kinds:
        grads = {}
        for k, shape in shapes.items():
            g = rng.normal(size=shape)
            g = {"normal": g, "zero": 0 * g, "equal": np.full(shape, 0.3), "tiny": 1e-30 * g}[kind]
            grads[k] = jnp.asarray(g, dtype)
        out.append(grads)
    return out


def _assert_close(expect, got, rtol):
    """Same shapes and dtypes, and every leaf within ``rtol`` (relative, in norm)."""
    for a, b in zip(jax.tree.leaves(expect), jax.tree.leaves(got), strict=True):
        assert jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(b - a) <= rtol * np.linalg.norm(a) + 1e-300, (a.shape, rtol)


def _edges(x: jax.Array, layout: ChainLayout, before: int, after: int):
    """``chain.edges_of`` of the block ``x``'s last ``before`` and first ``after`` rows, run."""
    last = x[x.shape[0] - before :]
    return tuple(run_exchange(edges_of(last, x[:after], layout)))


def _dense_edges(x: np.ndarray, rows: int, before: int, after: int):
    """The chain neighbours of a block's first and last rows, from the whole tensor ``x`` in
    Fortran order (an independent reference for ``chain.edges_of``): ``(pre, post)`` per block of
    ``rows`` rows along axis 0 (all columns)."""
    flat = x.reshape(-1, order="F")
    index = np.arange(x.size).reshape(x.shape, order="F")  # chain position of each element
    out = []
    for first in range(0, x.shape[0], rows):
        top, bottom = index[first], index[first + rows - 1]

        def take(position):
            ok = (position >= 0) & (position < x.size)
            return np.where(ok, flat[np.clip(position, 0, x.size - 1)], 0)

        pre = np.stack([take(top - before + r) for r in range(before)])
        post = np.stack([take(bottom + 1 + r) for r in range(after)])
        out.append((pre, post))
    return out


@pytest.mark.parametrize("shape", [(1,), (6,), (5, 1), (4, 7), (3, 4, 5), (7, 1, 3, 2)])
@pytest.mark.parametrize("band", [1, 2])
def test_edges_of_a_whole_tensor_are_its_wrapped_chain_neighbours(shape, band):
    before, after = halo_width(band)
    if shape[0] < max(before, after):
        pytest.skip("the kernels take blocks with at least as many rows as the halo")
    x = np.arange(1, np.prod(shape) + 1, dtype=np.float64).reshape(shape)
    pre, post = _edges(jnp.asarray(x), ChainLayout.unsharded(shape), before, after)
    ((expect_pre, expect_post),) = _dense_edges(x, shape[0], before, after)
    np.testing.assert_array_equal(np.asarray(pre), expect_pre)
    np.testing.assert_array_equal(np.asarray(post), expect_post)


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((16, 3), P(("data", "model"), None)),  # rows: 2 per shard, the chain wraps between shards
        ((6, 8), P(None, "model")),  # columns: the wrap crosses column shards
        ((8, 12), P("data", "model")),  # both
        ((4, 3, 8), P("data", None, "model")),  # 3-D, the carry through an unsharded axis
        ((32,), P(("model", "data"))),  # 1-D
    ],
)
def test_edges_of_shards_are_the_chain_neighbours_of_their_blocks(shape, spec):
    """``chain.edges_of`` inside ``shard_map``: each shard's edges are the dense chain neighbours of
    its block's first and last rows, with band 2's widths (2 rows before, 3 after)."""
    mesh = make_mesh((2, 4))
    layout = sharding.chain_layout(shape, spec, mesh)
    local = kernels.local_shape(layout)
    before, after = 1, min(3, local[0])
    x = np.arange(1, np.prod(shape) + 1, dtype=np.float64).reshape(shape)

    def local_edges(block):
        return _edges(block, layout, before, after)

    sharded = jax.shard_map(local_edges, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
    placed = jax.device_put(jnp.asarray(x), jax.sharding.NamedSharding(mesh, spec))
    pre, post = jax.jit(sharded)(placed)
    pre, post = np.asarray(pre), np.asarray(post)
    blocks = _dense_edges(x, local[0], before, after)  # per block of rows
    # Shard (i, j...) holds rows [i l, (i + 1) l) and its columns; its edges sit at its place.
    for index in np.ndindex(*layout.shards):
        at = tuple(slice(k * n, (k + 1) * n) for k, n in zip(index[1:], local[1:], strict=True))
        p, q = blocks[index[0]]
        rows_p = slice(index[0] * before, (index[0] + 1) * before)
        rows_q = slice(index[0] * after, (index[0] + 1) * after)
        np.testing.assert_array_equal(pre[(rows_p, *at)], p[(slice(None), *at)])
        np.testing.assert_array_equal(post[(rows_q, *at)], q[(slice(None), *at)])


# Band 0, and band 1's scan kernel in blocks of 16 rows and 64 columns (several
# per test tensor, ragged) walking 8 rows (2 walks per block) with the default ``SCAN_AHEAD``, or
# 4 rows (4 walks; the ragged blocks' last walks are short or empty) loading 3 rows ahead (more
# than a walk has left), so walks read each other's edge rows within a block and the halo copies
# across blocks.
_KERNELS = [
    (0, "diagonal", None, None),
    (1, "scan", 2, None),
    (1, "scan", 4, 3),
]
KERNELS = pytest.mark.parametrize("band, kernel, stack, ahead", _KERNELS)
# ... and bands 2 and 4 (``banded.banded_kernel``), for the tests whose tensors suit them all.
ALL_KERNELS = pytest.mark.parametrize(
    "band, kernel, stack, ahead", [*_KERNELS, (2, "band", None, None), (4, "band", None, None)]
)


# Tiles small enough that the test tensors span several programs and row chunks.
SMALL = KernelConfig(banded_tile=(8, 64, 2), scan_tile=(16, 64, 2))


@pytest.fixture
def use_kernel():
    """``use(kernel, stack, ahead)``: :data:`SMALL`, with the scan's ``stack`` walks loading
    ``ahead`` rows ahead where given."""

    def use(kernel: str, stack: int | None, ahead: int | None) -> KernelConfig:
        del kernel  # the band picks the kernel; the parameter names the case
        changes = {"scan_stack": stack, "scan_ahead": ahead}
        return dataclasses.replace(SMALL, **{k: v for k, v in changes.items() if v})

    return use


# Every layout with grafting; without it the kernels skip the norms whatever the layout, so a
# matrix of several (ragged) tiles and a vector cover it (as in ``test_banded_kernel_equals_xla``).
@KERNELS
@pytest.mark.parametrize(
    "graft, names", [("adam", None), ("none", ("mat", "vec"))], ids=["adam", "none"]
)
def test_kernel_equals_xla(x64, band, kernel, stack, ahead, graft, names, use_kernel):
    config = use_kernel(kernel, stack, ahead)
    shapes = {k: s for k, s in {**SHAPES, **SHAPES_1D}.items() if names is None or k in names}
    expect, got = _xla_and_kernels(shapes, band, graft, config)
    _assert_close(expect, got, 1e-11)


def _xla_and_kernels(shapes, band, graft, config):
    """``run``'s outputs on the XLA path and on the kernels, float64, through a hostile
    trajectory (``equal`` gradients make every window singular: every edge is cut)."""
    params = {k: jnp.zeros(s, jnp.float64) for k, s in shapes.items()}
    grads = _trajectory(shapes, ["normal", "normal", "equal", "normal", "zero", "normal"])
    kwargs = dict(band=band, graft=graft, precondition_1d=True, stats_dtype=jnp.float64)
    expect = _xla_run(tuple(kwargs.items()), params, grads)
    return expect, run(
        sonew(0.1, implementation="pallas", kernel_config=config, **kwargs), params, grads
    )


_XLA_RUNS = {}


def _xla_run(kwargs, params, grads):
    """``run`` of ``sonew(0.1, implementation="xla", **kwargs)`` (``kwargs`` a tuple of items),
    once per module for each ``kwargs``, parameters and gradients (keyed by their bytes): the
    kernel variants of one band compare against one XLA trajectory, compiled and run once."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves((params, grads)):
        leaf = np.asarray(leaf)
        digest.update(f"{leaf.dtype}{leaf.shape}".encode() + leaf.tobytes())
    key = (kwargs, jax.tree.structure((params, grads)), digest.hexdigest())
    if key not in _XLA_RUNS:
        _XLA_RUNS[key] = run(sonew(0.1, implementation="xla", **dict(kwargs)), params, grads)
    return _XLA_RUNS[key]


@KERNELS
def test_kernel_with_bf16_storage_and_float32(band, kernel, stack, ahead, use_kernel):
    """float32 statistics with bf16 momentum and off-diagonals, bf16 gradients and parameters;
    the 1-D tensor takes the Adam direction (``precondition_1d=False``). Well-damped windows
    (``eps`` 0.1 against g^2 ~ 1): near-singular ones amplify the paths' different roundings."""
    config = use_kernel(kernel, stack, ahead)
    shapes = {"mat": (70, 130), "cube": (3, 4, 5), "bias": (60,)}
    params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in shapes.items()}
    grads = _trajectory(shapes, ["normal", "tiny", "normal", "normal"], dtype=jnp.bfloat16)
    kwargs = dict(band=band, eps=0.1, mu_dtype=jnp.bfloat16, offdiag_dtype=jnp.bfloat16)
    expect_updates, expect_state = _xla_run(tuple(kwargs.items()), params, grads)
    got_updates, got_state = run(
        sonew(0.1, implementation="pallas", kernel_config=config, **kwargs), params, grads
    )
    for a, b in zip(jax.tree.leaves(expect_state), jax.tree.leaves(got_state), strict=True):
        assert a.dtype == b.dtype
    # bf16 outputs: the paths may round a value to neighbouring bf16 numbers (0.4% apart), and a
    # flipped rounding of the stored momentum moves later directions by about as much (in float32
    # storage the paths agree to 1e-6).
    _assert_close(expect_updates, got_updates, 1.5e-2)
    _assert_close(expect_state, got_state, 1.5e-2)


# Tensors for bands >= 2: 1-D to 4-D with at least 2 b - 1 rows along axis 0
# (``kernels.supported``), in ``use_kernel``'s 8-row chunks of 64-column blocks (several of each,
# ragged last ones, a one-row last chunk), whose walks run 3 b - 1 rows past their chunk and read
# the neighbouring columns of the chain from the edges; one exactly 8 rows tall; one of a single
# column (no neighbouring column). "short" is too short for band 4: it takes the XLA path there.
BANDED_SHAPES = {
    "mat": (41, 70),
    "deep": (9, 4, 5),
    "tall": (33, 2, 3),
    "quad": (8, 3, 1, 2),
    "col": (9, 1),
    "short": (5, 6),
    "vec": (33,),
}


@pytest.fixture
def banded_spy(monkeypatch):
    """The shapes whose steps the banded kernel traced (``launch.step_call``'s cache is cleared
    before and after, so every configuration traces anew)."""
    traced = []
    kernel = banded.banded_kernel

    def spy(*refs, shape, **kwargs):
        traced.append(shape)
        kernel(*refs, shape=shape, **kwargs)

    monkeypatch.setattr(banded, "banded_kernel", spy)
    launch.step_call.cache_clear()
    yield traced
    launch.step_call.cache_clear()


def _on_banded_kernel(shapes, band):
    return {s for s in shapes.values() if kernels.supported(ChainLayout.unsharded(s), band, SMALL)}


# Band 4 covers the layouts' edges and carries, which no band changes: a matrix of several row
# chunks, the 3-D layout (two chunks, the last of one row), the 4-D one (one chunk), a single
# column, and "short" on the XLA path. "tall" (3-D, several chunks) takes the paths "deep" takes,
# and "vec" is one column (a 1-D view), as "col" is; band 2 runs "vec" without grafting. Band 2
# adds its own windows on a matrix, the 3-D layout and a block too short for band 4 (5 rows, which
# band 2's step reads beyond by 3). Without grafting the kernels skip the norms whatever the band
# and layout: a matrix and a vector cover it. Band 3 adds CI time and no path.
@pytest.mark.parametrize(
    "band, graft, names",
    [
        (2, "adam", ("mat", "deep", "short")),
        (2, "none", ("mat", "vec")),
        (4, "adam", ("mat", "deep", "quad", "col", "short")),
    ],
)
def test_banded_kernel_equals_xla(x64, band, graft, names, use_kernel, banded_spy):
    """Bands 2 to 4 through hostile steps: ``equal`` gradients make every window singular, so
    Algorithm 3 cuts every edge, and the steps after it solve windows near the tolerance."""
    config = use_kernel("band", None, None)
    shapes = {k: s for k, s in BANDED_SHAPES.items() if k in names}
    expect, got = _xla_and_kernels(shapes, band, graft, config)
    # The near-singular windows after the cuts amplify the two paths' roundings (the kernel
    # multiplies by 1 / (1 - b2^t) where XLA divides) to about 1e-10.
    _assert_close(expect, got, 1e-9)
    # Band 4's step reads 2 * 4 - 1 = 7 rows beyond a block: "short" (5 rows) runs on XLA.
    off = {"short"} if band == 4 else set()
    on_kernel = {s for k, s in shapes.items() if k not in off}
    assert set(banded_spy) == _on_banded_kernel(shapes, band) == on_kernel


def test_band_halos_are_each_chunks_first_and_last_rows():
    """Band b's halo copies: per row chunk its first 2b - 1 and last b rows of ``m``, ``d`` and
    each off-diagonal of ``e`` (a short chunk repeats its last or first row in the slots it does
    not fill: those are never read)."""
    # Band 2, a chunk of 16 rows and one of 4.
    assert kernels.band_halo_rows(20, 16, 2) == [0, 1, 2, 14, 15, 16, 17, 18, 18, 19]
    rng = np.random.default_rng(0)
    shape = (20, 3, 2)
    m, d = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    e = jnp.asarray(rng.normal(size=(2, *shape)), jnp.bfloat16)
    rows = kernels.band_halo_rows(20, 16, 2)
    halos = kernels.gather_halos([m, d, e], 16, band=2, shapes=[shape] * 3, interpret=True)
    assert [h.index for h in halos] == [0, 1, 0]  # m and d share a buffer; e has its own dtype
    for x, halo in zip((m, d, e), halos, strict=True):
        assert halo.buffer.dtype == x.dtype and halo.rows == 16
        view = np.asarray(x).reshape(-1, 20, 6)
        size = view[:, rows].size
        got = np.asarray(halo.buffer)[halo.index * len(rows) * 6 :][:size]
        np.testing.assert_array_equal(got, view[:, rows].reshape(-1))


def test_gather_halos_packs_sub_arrays_within_int32():
    """Band 2's halo launches count ``e``'s off-diagonals as sub-arrays: a launch holds no more
    sub-arrays than the kernels' offsets reach (``max_offset`` cut to 3 sub-arrays' halo rows), the
    launches of one kind of array are of one size, and every array's rows are where its ``Halo``
    says."""
    shape, band, rows = (20, 6), 2, 8
    per_sub = 3 * (3 * band - 1) * 6  # 3 chunks of 5 halo rows of 6 columns
    config = KernelConfig(max_offset=3 * per_sub)
    rng = np.random.default_rng(1)
    arrays = [
        jnp.asarray(rng.normal(size=(n, *shape) if n > 1 else shape), jnp.float32)
        for n in (1, 1, 2, 1, 1, 2)  # m, d, e of two tensors
    ]
    halos = kernels.gather_halos(
        arrays, rows, band=band, shapes=[shape] * 6, interpret=True, config=config
    )
    # Two launches [m d] [m d] of the four one-sub-array arrays (three fit: two launches of two
    # beat three and one), and one per ``e``.
    assert [h.index for h in halos] == [0, 1, 0, 0, 1, 0]
    assert halos[0].buffer is halos[1].buffer and halos[3].buffer is halos[4].buffer
    assert len({id(h.buffer) for h in halos}) == 4
    assert {h.buffer.size for h in halos} == {2 * per_sub}
    slots = kernels.band_halo_rows(20, rows, band)
    for x, halo in zip(arrays, halos, strict=True):
        expect = np.asarray(x).reshape(-1, 20, 6)[:, slots].reshape(-1)
        got = np.asarray(halo.buffer)[halo.index * per_sub :][: expect.size]
        np.testing.assert_array_equal(got, expect)


def test_banded_kernel_with_bf16_storage_and_float32(use_kernel, banded_spy):
    """Band 4 with float32 statistics, bf16 momentum and off-diagonals, bf16 gradients and
    parameters (as ``test_kernel_with_bf16_storage_and_float32``)."""
    config = use_kernel("band", None, None)
    shapes = {k: BANDED_SHAPES[k] for k in ("mat", "deep", "vec")}
    params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in shapes.items()}
    grads = _trajectory(shapes, ["normal", "tiny", "normal", "normal"], dtype=jnp.bfloat16)
    kwargs = dict(band=4, eps=0.1, mu_dtype=jnp.bfloat16, offdiag_dtype=jnp.bfloat16)
    expect_updates, expect_state = run(sonew(0.1, implementation="xla", **kwargs), params, grads)
    got_updates, got_state = run(
        sonew(0.1, implementation="pallas", kernel_config=config, **kwargs), params, grads
    )
    _assert_close(expect_updates, got_updates, 1.5e-2)
    _assert_close(expect_state, got_state, 1.5e-2)
    assert set(banded_spy) == {(41, 70), (9, 4, 5)}


@pytest.mark.parametrize("band, graft_lag", [(0, False), (1, False), (1, True), (2, True)])
def test_tensors_of_one_configuration_share_launches(x64, band, graft_lag, monkeypatch):
    """Same-shaped tensors of one dtype (and, for the fused apply, one ``decayed``) run in
    launches of up to ``kernels.launch_group`` tensors (2 here), each tensor's kernel on its own
    state and parameters, as on XLA (the parameters too, with ``graft_lag``'s fused apply);
    another dtype, shape or (with the fused apply) weight-decay mask launches apart."""
    config = KernelConfig(scan_tile=(16, 64, 2), max_group=2, max_banded_group=2)
    launches = []
    group_update = kernels.group_update

    def spy(gs, *args, applies, **kwargs):
        flags = [None if a is None else a.decayed for a in applies]
        launches.append(tuple((g.dtype.name, f) for g, f in zip(gs, flags, strict=True)))
        return group_update(gs, *args, applies=applies, **kwargs)

    monkeypatch.setattr(kernels, "group_update", spy)
    # Four matrices of one shape in ragged blocks of the scan's tile (two by two), a 3-D tensor.
    shapes = {"a": (24, 70), "c": (24, 70), "b": (24, 70), "d": (33, 2, 3), "w": (24, 70)}
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()}
    params["w"] = params["w"].astype(jnp.float32)
    mask = {k: k != "c" for k in shapes}
    grads = _trajectory(shapes, ["normal", "normal", "equal", "normal"])
    grads = [{**g, "w": g["w"].astype(jnp.float32)} for g in grads]

    def trajectory(implementation):
        tx = sonew(
            0.1, band=band, weight_decay=0.1, mask=mask, graft_lag=graft_lag,
            stats_dtype=jnp.float64, implementation=implementation, kernel_config=config,
        )  # fmt: skip
        p, state = params, tx.init(params)
        step = jax.jit(lambda p, s, g: apply_gradients(tx, g, s, p))
        for g in grads:
            p, state = step(p, state, g)
        return p, state

    expect, got = trajectory("xla"), trajectory("pallas")
    for x, y in zip(jax.tree.leaves(expect), jax.tree.leaves(got), strict=True):
        _assert_close(x, y, 1e-11 if x.dtype == jnp.float64 else 1e-6)
    # a and c, then b; with the fused apply a and b, then c (not decayed); w (float32) and d
    # apart.
    f64, f32 = "float64", "float32"
    if graft_lag:
        expect_launches = [((f64, True),) * 2, ((f64, False),), ((f32, True),), ((f64, True),)]
    else:
        expect_launches = [((f64, None),) * 2, ((f64, None),), ((f32, None),), ((f64, None),)]
    assert sorted(launches) == sorted(expect_launches)


def test_group_update_rejects_tensors_of_different_launch_keys():
    """One launch serves one shape, dtype set and apply: a float32 and a bfloat16 momentum, or
    two shapes, are refused before any kernel is built."""
    hyper = SONewConfig(
        b1=0.9, b2=0.95, eps=1e-8, gamma=0.0, precondition_1d=True, damping="absolute"
    )
    g, e = jnp.zeros((16, 64)), jnp.zeros((1, 16, 64))
    for m2, g2 in ((g.astype(jnp.bfloat16), g), (jnp.zeros((8, 64)), jnp.zeros((8, 64)))):
        with pytest.raises(ValueError, match="different launch keys"):
            kernels.group_update(
                [g, g2], [g, m2], [g, g2 + 1], [e, e[:, : g2.shape[0]]], (0.1, 0.05), hyper,
                interpret=True,
            )  # fmt: skip


@pytest.mark.parametrize("kernel", ["scan", "band"])
def test_kernel_under_inject_hyperparams_and_vmap(x64, kernel, use_kernel):
    """Hyperparameters as arrays (``inject_hyperparams``), vmapped over runs with different
    learning rates and eps, as the autoencoder benchmark sweeps them (band 1's kernel, and band
    4's)."""
    config = use_kernel(kernel, None, None)
    shapes = {"mat": (70, 130), "cube": (3, 4, 5)}

    def make(implementation):
        return optax.inject_hyperparams(sonew, static_args=("band", "kernel_config"))(
            learning_rate=0.1,
            eps=1e-8,
            band=4 if kernel == "band" else 1,
            stats_dtype=jnp.float64,
            implementation=implementation,
            kernel_config=config,
        )

    def trajectory(implementation, lrs, epss):
        tx = make(implementation)
        params = {k: jnp.zeros(s, jnp.float64) for k, s in shapes.items()}

        # The steps under one scan: the kernels are traced and compiled once, not per step.
        steps = jax.tree.map(lambda *g: jnp.stack(g), *_trajectory(shapes, ["normal"] * 3))

        def step(carry, grads):
            p, state = carry
            updates, state = tx.update(grads, state, p)
            return (optax.apply_updates(p, updates), state), None

        def one(lr, eps):
            state = tx.init(params)
            state.hyperparams["learning_rate"] = lr
            state.hyperparams["eps"] = eps
            return jax.lax.scan(step, (params, state), steps)[0][0]

        return jax.jit(jax.vmap(one))(lrs, epss)

    lrs, epss = jnp.array([0.1, 0.01, 1.0]), jnp.array([1e-8, 1e-2, 1e-6])
    _assert_close(trajectory("xla", lrs, epss), trajectory("pallas", lrs, epss), 1e-11)


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="CPUs treat subnormal numbers as zero (DAZ): only GPU arithmetic shows the overflow",
)
@ALL_KERNELS
def test_kernel_norms_of_subnormal_directions(band, kernel, stack, ahead, use_kernel):
    """float32 directions whose entries are all subnormal (``|x| < 2^-126``, as the decayed
    moments of rarely lit MNIST pixels): every tile's (and every scan lane's) largest ``|x|`` is
    subnormal, whose reciprocal overflows. The kernels' norms stay finite and their graft ratios
    equal the XLA path's (``program.scale_floor``); without the floor this test fails on a GPU."""
    config = use_kernel(kernel, stack, ahead)
    shapes = {"mat": (70, 130), "cube": (3, 4, 5)}
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    grads = [
        jax.tree.map(
            lambda x: jnp.asarray((1e-39 * np.asarray(x, np.float64)).astype(np.float32)), g
        )
        for g in _trajectory(shapes, ["normal"] * 2)
    ]
    # eps and graft_eps of 1: u and Adam's direction are about m_hat, as small as g; a learning
    # rate of 1e30 makes the updates normal numbers.
    kwargs = dict(band=band, eps=1.0, graft_eps=1.0, stats_dtype=jnp.float32)
    expect, _ = run(sonew(1e30, implementation="xla", **kwargs), params, grads)
    got, _ = run(
        sonew(1e30, implementation="pallas", kernel_config=config, **kwargs), params, grads
    )
    for a in jax.tree.leaves(expect):
        assert np.abs(np.asarray(a)).max() > 0  # the XLA path keeps the subnormals
    _assert_close(expect, got, 1e-5)


@pytest.fixture
def kernel_spy(monkeypatch):
    """The (band, local shape) of every tensor whose step a kernel traced."""
    traced = []
    real = kernels.group_update

    def spy(gs, ms, ds, es, *args, **kwargs):
        band = 0 if isinstance(es[0], optax.MaskedNode) else es[0].shape[0]
        traced.extend((band, g.shape) for g in gs)
        return real(gs, ms, ds, es, *args, **kwargs)

    monkeypatch.setattr(kernels, "group_update", spy)
    return traced


@pytest.mark.parametrize("band", [0, 1, 4])
def test_sharded_tensors_run_the_kernels_on_their_blocks(x64, band, use_kernel, kernel_spy):
    """Under a mesh every tensor whose block has the rows its step reads beyond it runs the
    kernel on that block, with its edges from the neighbouring shards: rows, columns, both, a
    1-D vector, a replicated tensor; thinner blocks take the XLA path. The result equals the
    unsharded XLA path."""
    config = use_kernel("band" if band > 1 else "scan", None, None)
    mesh = make_mesh((2, 4))
    shapes = {"cols": (9, 8), "rows": (16, 3), "both": (16, 12), "vec": (40,), "rep": (9, 7)}
    specs = {
        "cols": P(None, "model"),
        "rows": P("data", None),
        "both": P("data", "model"),
        "vec": P(("model", "data")),
        "rep": P(),
    }
    local = {"cols": (9, 2), "rows": (8, 3), "both": (8, 3), "vec": (5,), "rep": (9, 7)}
    supported = functools.partial(kernels.supported, config=config)
    assert not supported(ChainLayout((16, 8), (("data",), ()), (8, 1)), 2)  # 2 rows
    assert supported(ChainLayout((16, 8), (("data",), ()), (8, 1)), 1)
    assert supported(ChainLayout.unsharded((6, 7)), 3)  # 2 x 3 - 1 rows along axis 0
    assert not supported(ChainLayout.unsharded((6, 7)), 4)
    assert supported(ChainLayout.unsharded((42,)), 2)  # a 1-D view is one column
    assert supported(ChainLayout.unsharded((64, 7)), config.max_band)
    assert not supported(ChainLayout.unsharded((64, 7)), config.max_band + 1)
    params = {k: jnp.zeros(s, jnp.float64) for k, s in shapes.items()}
    grads = _trajectory(shapes, ["normal", "normal", "equal", "normal"])
    kwargs = dict(band=band, eps=1e-4, precondition_1d=True, stats_dtype=jnp.float64)
    expect = run(sonew(0.1, implementation="xla", **kwargs), params, grads)
    tx = sonew(
        0.1, implementation="pallas", kernel_config=config, mesh=mesh, param_specs=specs, **kwargs
    )
    got = run(tx, params, grads, mesh, specs)
    _assert_close(expect, got, 1e-11 if band <= 1 else 1e-9)
    rows_needed = max(halo_width(band))
    expected = {(band, s) for s in local.values() if s[0] >= rows_needed}
    assert set(kernel_spy) == expected and len(expected) >= 3


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="implementation"):
        sonew(0.1, implementation="triton")


def test_auto_takes_the_kernels_on_gpu_only_where_jit_cannot_shard_them(monkeypatch):
    """``implementation="auto"`` (the default): XLA off GPU; on GPU the kernels under a mesh
    (``shard_map`` knows which tensors are whole) or on one device, XLA without a mesh on several
    devices (the caller's ``jit`` may shard the arrays, and cannot partition a kernel). The
    platform is the mesh's devices', without a mesh the default backend's."""
    # (by module path: the package exports the function sonew(), not the module)
    enable = importlib.import_module("sonew_pax.optim.dispatch").kernels_enabled

    def enabled(implementation, mesh):
        return enable(implementation, mesh, kernels.DEFAULT) is not None

    mesh = make_mesh((2, 4))
    assert not enabled("xla", mesh) and enabled("pallas", None)
    assert enabled("auto", mesh) == (mesh.devices.flat[0].platform == "gpu")
    # Under a mesh, its devices' platform decides (a GPU compiled for from a CPU host).
    gpu_mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")] * 8))
    assert enabled("auto", gpu_mesh)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert enabled("auto", mesh) == (mesh.devices.flat[0].platform == "gpu")
    assert not enabled("auto", None)  # conftest's 8 CPU devices, no mesh
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert enabled("auto", None)


def test_auto_off_gpu_is_the_xla_path():
    if jax.default_backend() == "gpu":
        pytest.skip("on GPU, auto takes the kernels (test_kernel_equals_xla)")
    shapes = {"mat": (9, 6), "vec": (5,)}
    params = {k: jnp.zeros(s) for k, s in shapes.items()}
    grads = _trajectory(shapes, ["normal", "normal"], dtype=jnp.float32)
    expect = run(sonew(0.1, implementation="xla"), params, grads)
    got = run(sonew(0.1), params, grads)
    for a, b in zip(jax.tree.leaves(expect), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gather_halos_copies_every_chunks_edge_rows():
    """Each array's halo rows are its view's first and last row of every row chunk (the ragged
    last chunk's last row too); arrays of one view and dtype share launches of at most
    ``halo_group``."""
    config = KernelConfig(halo_group=2)
    rng = np.random.default_rng(0)
    shapes = [(70, 130), (70, 13, 10), (70, 130), (33, 6), (9,), (70, 130)]
    dtypes = [jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32]
    arrays = [jnp.asarray(rng.normal(size=s), t) for s, t in zip(shapes, dtypes, strict=True)]
    halos = kernels.gather_halos(arrays, rows=16, interpret=True, config=config)
    for x, halo in zip(arrays, halos, strict=True):
        num_rows, num_cols = kernels.tile_view(x.shape)
        view = np.asarray(x).reshape(num_rows, num_cols)
        firsts = list(range(0, num_rows, 16))
        lasts = [min(f + 16, num_rows) - 1 for f in firsts]
        expect = np.stack([view[firsts], view[lasts]], axis=1).reshape(-1)
        start = halo.index * expect.size
        got = np.asarray(halo.buffer)[start : start + expect.size]
        assert halo.rows == 16 and halo.buffer.dtype == x.dtype
        np.testing.assert_array_equal(got, expect)
    # (70, 130) and (70, 13, 10) share a view: the first two float32 arrays fill one launch of
    # two, the third gets its own, of the same size (it copies that array twice); bfloat16 and
    # the other views have theirs.
    assert halos[0].buffer is halos[1].buffer and (halos[0].index, halos[1].index) == (0, 1)
    assert halos[5].buffer is not halos[0].buffer and halos[5].index == 0
    assert halos[5].buffer.shape == halos[0].buffer.shape
    assert len({id(h.buffer) for h in halos}) == 5


def test_scan_kernel_rejects_blocks_smaller_than_its_lanes():
    """A scan block of ``scan_stack`` walks by ``cols`` needs a lane per element: 4 walks of 16
    columns are 64 elements for 128 lanes."""
    update = functools.partial(kernels.leaf_update, config=KernelConfig(scan_stack=4))
    shape = (40, 64)
    m, d, e = jnp.zeros(shape), jnp.ones(shape), jnp.zeros((1, *shape))
    hyper = SONewConfig(
        b1=0.9, b2=0.95, eps=1e-8, gamma=0.0, precondition_1d=True, damping="absolute"
    )
    with pytest.raises(ValueError, match="16 rows in 4 walks of 16 columns for 32 x 4 lanes"):
        update(m, m, d, e, (0.1, 0.05), hyper, interpret=True, tile=(16, 16, 4))
    update(m, m, d, e, (0.1, 0.05), hyper, interpret=True, tile=(16, 32, 4))


def test_banded_kernel_rejects_halo_copies_beyond_int32():
    """Chunks of one row copy 3b - 1 rows of halo per row of the state: on a 50M-element tensor
    band 4's copies pass the kernels' offsets, and the error says so (shapes only: nothing is
    allocated)."""
    shape = (50_000, 1_000)
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    e = jax.ShapeDtypeStruct((4, *shape), jnp.float32)
    hyper = SONewConfig(
        b1=0.9, b2=0.95, eps=1e-8, gamma=1e-4, precondition_1d=True, damping="absolute"
    )

    def step(g, m, d, e, tile):
        return kernels.leaf_update(g, m, d, e, (0.1, 0.05), hyper, interpret=True, tile=tile)

    with pytest.raises(ValueError, match=r"band 4 on \(50000, 1000\) in chunks of 1 rows"):
        jax.eval_shape(functools.partial(step, tile=(1, 128, 4)), spec, spec, spec, e)
    jax.eval_shape(functools.partial(step, tile=(64, 128, 4)), spec, spec, spec, e)


def test_leaf_update_rejects_halos_of_another_tile():
    shape = (40, 8)
    m, d = jnp.zeros(shape), jnp.ones(shape)
    e = jnp.zeros((1, *shape))
    halos = tuple(kernels.gather_halos([m, d, e[0]], rows=4, interpret=True))
    hyper = SONewConfig(
        b1=0.9, b2=0.95, eps=1e-8, gamma=0.0, precondition_1d=True, damping="absolute"
    )
    rows = kernels.default_tile(1, shape, kernels.DEFAULT)[0]
    with pytest.raises(ValueError, match=f"chunks of 4 rows, tile has {rows}"):
        kernels.leaf_update(m, m, d, e, (0.1, 0.05), hyper, interpret=True, halos=halos)


def test_default_tile_shortens_the_walk_on_small_tensors():
    """The scan halves its rows (down to walks of ``scan_min_walk``) until a tensor has
    ``scan_lanes`` walks times columns; band 0 keeps its tile; the halos follow the step's
    rows."""
    config = KernelConfig(scan_tile=(128, 64, 2), scan_stack=4, scan_lanes=2**18, scan_min_walk=8)
    # (rows, warps): each halving doubles the warps, up to one lane each (4 x 64 / 32).
    tiles = {
        (4096, 2048): (128, 2),  # walks of 32 rows: 128 x 2048 lanes
        (1024, 4096): (64, 4),  # 32 x 4096 lanes in walks of 32 rows, 64 x 4096 in walks of 16
        (4096, 1024): (64, 4),
        (1024, 1024): (32, 8),  # 128 x 1024 lanes in walks of 8: the shortest walk
        (16384, 4, 64): (64, 4),  # the view is 16384 x 256
        (70, 130): (32, 8),
        (100000,): (32, 8),  # one column
    }
    for shape, (rows, warps) in tiles.items():
        assert kernels.default_tile(1, shape, config) == (rows, 64, warps), shape
        assert kernels.default_tile(0, shape, config) == config.diagonal_tile
    # One walk per program: the walk is the block, already a lane per column on 2 warps.
    one_walk = dataclasses.replace(config, scan_stack=1)
    assert kernels.default_tile(1, (1024, 4096), one_walk) == (16, 64, 2)
    assert kernels.default_tile(1, (1024, 1024), one_walk) == (8, 64, 2)
    # Bands >= 2 likewise, from banded_tile's 64 rows down to 32.
    config = dataclasses.replace(
        config, banded_tile=(64, 128, 4), banded_programs=512, banded_min_rows=32
    )
    banded_rows = {(1024, 4096): 64, (4096, 1024): 64, (1024, 1024): 32, (70, 130): 32}
    for shape, expect in banded_rows.items():
        assert kernels.default_tile(4, shape, config) == (expect, 128, 4), shape
    # Four (1024, 1024) tensors a launch fill 512 programs with 64-row chunks.
    grouped = dataclasses.replace(config, max_banded_group=4)
    assert kernels.launch_group((1024, 1024), 4, grouped) == 4
    assert kernels.launch_group((1024, 4096), 4, grouped) == 1
    assert kernels.default_tile(4, (1024, 1024), grouped) == (64, 128, 4)
    # Where the caller lets XLA run the tensors' kernels at once, bands >= 2 take
    # concurrent_banded_tile on every tensor; band 1's scan keeps its tiles.
    concurrent = dataclasses.replace(config, concurrent=True)
    for shape in (*banded_rows, (8, 3)):
        assert kernels.default_tile(4, shape, concurrent) == config.concurrent_banded_tile
    assert kernels.default_tile(1, (1024, 1024), concurrent) == (32, 64, 8)
    arrays = [jnp.zeros((70, 130)), jnp.zeros((40, 1024, 2))]

    def halo_rows(lanes):
        config_here = dataclasses.replace(one_walk, scan_lanes=lanes)
        return [h.rows for h in kernels.gather_halos(arrays, interpret=True, config=config_here)]

    assert halo_rows(2**14) == [8, 8]  # the second has 5 x 2048 lanes at 8 rows
    assert halo_rows(2**12) == [8, 32]  # 2 x 2048 lanes at 32 rows; the first, never


@ALL_KERNELS
def test_kernels_lower_to_triton_for_cuda(band, kernel, stack, ahead, use_kernel):
    """Off GPU the tests run the kernels in the interpreter; this lowers the compiled path for
    CUDA (no GPU needed), so CI catches an op the Triton lowering lacks, and every kernel of a
    whole update (the halo gather of bands >= 1 too) picks the Triton backend, not Mosaic GPU. Three
    tensors of one shape share one lowered kernel (``launch.step_call``), also with their halo
    rows in launches of two (``kernels.gather_halos``' equal launches): lowering one per tensor
    would dominate the first step. The banded walk's multiply-adds are PTX ``fma.rn``
    (``KernelConfig.fma``), the other kernels' not."""
    from jax import export

    # Compiled, not interpreted, on this CPU host.
    # Lowered for CUDA on a host without a GPU, the multiply-adds are PTX (``launch.ptx``).
    config = dataclasses.replace(use_kernel(kernel, stack, ahead), halo_group=2, interpret=False)

    params = {f"mat{k}": jnp.zeros((70, 130)) for k in range(3)} | {"vec": jnp.zeros((33,))}
    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    name = "sonew_diagonal" if band == 0 else f"sonew_band{band}_scan"
    expected = {name} | ({"sonew_halo"} if band >= 1 else set())
    # The optax update, and the fused apply (the kernels write the parameters: graft_lag).
    make = functools.partial(sonew, 0.1, band=band, implementation="pallas", kernel_config=config)
    for tx, call in (
        (make(), lambda tx, g, s, p: tx.update(g, s, p)),
        (make(graft_lag=True), apply_gradients),
    ):
        state = tx.init(params)
        update = jax.jit(functools.partial(call, tx))
        exported = export.export(update, platforms=("cuda",), disabled_checks=[check])
        text = exported(params, state, params).mlir_module()
        calls = re.findall(r'custom_call @([\w$.]+)\(.*?name = "(\w+)"', text)
        assert {called for _, called in calls} == expected
        assert {target for target, _ in calls} == {"__gpu$xla.gpu.triton"}
        assert ("fma.rn.f32" in text) == (band >= 2)
        assert [called for _, called in calls].count(name) == 1
    # bf16 statistics, with the relative damping: the kernels compute in float32 (Triton lowers
    # no bf16 division), so they lower too.
    tx = make(stats_dtype=jnp.bfloat16, damping="mean")
    update = jax.jit(tx.update)
    export.export(update, platforms=("cuda",), disabled_checks=[check])(
        params, tx.init(params), params
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("scan_tile", (48, 64, 2)),
        ("banded_tile", (64, 128)),
        ("diagonal_tile", (8, 128, 3)),
        ("scan_stack", 3),
        ("max_group", 0),
        ("scan_ahead", -1),
    ],
)
def test_kernel_config_rejects_what_cannot_compile(field, value):
    """A tile that is not three powers of 2, or a count below its least value, fails when the
    configuration is built, with the field's name, not later inside Triton."""
    with pytest.raises(ValueError, match=f"KernelConfig.{field} = "):
        KernelConfig(**{field: value})
