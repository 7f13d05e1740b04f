"""The TPU kernels (``kernels.tpu``: band 1, and bands >= 2 on extended blocks) equal the XLA step,
whole and sharded, and lower for TPU.

On a CPU it runs in Pallas' interpreter (``KernelConfig(platform="tpu")``); ``interpret=False``
lowers it for TPU (``jax.export``), as a TPU host compiles it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import KernelConfig, apply_gradients, sonew
from sonew_pax.optim.kernels import tpu
from tests.test_sonew_sharded import make_mesh, run

# Small blocks, so that the tests' tensors have several of them along both axes.
TPU = KernelConfig(platform="tpu", tpu_block=(16, 128), tpu_banded_block=(16, 128))


def _grads(params, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        for _ in range(steps)
    ]


def _assert_close(expect, got, rtol):
    for e, g in zip(jax.tree.leaves(expect), jax.tree.leaves(got), strict=True):
        e, g = np.asarray(e), np.asarray(g)
        assert np.linalg.norm(g - e) <= rtol * max(np.linalg.norm(e), 1e-300), (e.shape, rtol)


def test_block_shape_tiles_the_view_or_declines():
    config = KernelConfig(platform="tpu", tpu_block=(256, 512))
    assert tpu.block_shape((32000, 1024), 1, config) == (256, 512)
    assert tpu.block_shape((1024, 4096), 1, config) == (256, 512)
    assert tpu.block_shape((48, 384), 1, config) == (48, 384)  # the rows of 512 x 256 elements
    assert tpu.block_shape((64, 4, 64), 1, config) == (64, 256)  # axis 0 by the rest
    for shape in [(1024,), (20, 128), (64, 100)]:  # a vector; rows, columns off the tiles
        assert tpu.block_shape(shape, 1, config) is None
    assert tpu.block_shape((1024, 4096), 4, config) == (128, 128)  # config.tpu_banded_block
    assert tpu.block_shape((1024, 4096), 0, config) is None  # XLA's diag step is at its floor
    assert tpu.block_shape((1024, 4096), config.max_band + 1, config) is None
    wide = dataclasses.replace(config, max_band=10)  # a halo of 32 rows: 176 = 16 x 11 rows
    assert tpu.block_shape((176, 4096), 10, wide) is None  # tile only in blocks of 16
    assert tpu.block_shape((1024, 4096), 10, wide) == (128, 128)
    with pytest.raises(ValueError, match="tpu_block"):
        KernelConfig(tpu_block=(10, 128))
    with pytest.raises(ValueError, match=r"KernelConfig\.platform = 'TPU'"):
        KernelConfig(platform="TPU")
    with pytest.raises(ValueError, match=r"KernelConfig\.interpret = 'no'"):
        KernelConfig(interpret="no")


@pytest.mark.parametrize(
    "band, damping, graft",
    [
        (1, "mean", "adam"),
        (1, "absolute", "adam"),
        (1, "mean", "none"),
        (2, "mean", "adam"),
        (4, "absolute", "adam"),
    ],
)
def test_kernel_equals_the_xla_step(x64, band, damping, graft):
    """Three steps of the whole update (grafted directions and state) in float64, on tensors of
    several blocks along both axes of the view, a 3-D one, and ones the kernels decline (their
    XLA step runs beside them)."""
    params = {
        "blocks": jnp.zeros((64, 256)),
        "cols": jnp.zeros((48, 384)),
        "cube": jnp.zeros((32, 4, 64)),
        "ragged": jnp.zeros((20, 128)),
        "vec": jnp.zeros((40,)),
    }
    kwargs = dict(band=band, damping=damping, graft=graft, stats_dtype=jnp.float64)
    kwargs["eps"] = 0.1 if damping == "mean" else 1e-2
    grads = _grads(params, 3)
    expect, expect_state = run(sonew(0.1, implementation="xla", **kwargs), params, grads)
    tx = sonew(0.1, implementation="pallas", kernel_config=TPU, **kwargs)
    got, state = run(tx, params, grads)
    # The first step's windows are rank one plus the damping: wider bands' solves amplify the two
    # programs' float64 roundings (their operation orders differ) to about 1e-12.
    _assert_close(expect, got, 1e-12 if band == 1 else 1e-10)
    _assert_close(expect_state, state, 1e-12)


@pytest.mark.parametrize("band", [1, 4])
def test_stacked_kernels_equal_the_xla_step(x64, band):
    """Stacked tensors (a layer axis, and parameters stacked by shape) run the kernel on each of
    them in turn: three steps equal the XLA step's."""
    params = {"layers": jnp.zeros((3, 64, 256)), "a": jnp.zeros((48, 384))}
    params |= {"b": jnp.zeros((48, 384)), "vec": jnp.zeros((40,))}
    stacked_axes = {"layers": 1, "a": 0, "b": 0, "vec": 0}
    kwargs = dict(band=band, stats_dtype=jnp.float64, stacked_axes=stacked_axes)
    kwargs |= dict(stack_by_shape=True)
    grads = _grads(params, 3)
    expect, expect_state = run(sonew(0.1, implementation="xla", **kwargs), params, grads)
    got, state = run(
        sonew(0.1, implementation="pallas", kernel_config=TPU, **kwargs), params, grads
    )
    _assert_close(expect, got, 1e-12 if band == 1 else 1e-10)
    _assert_close(expect_state, state, 1e-12)


@pytest.mark.parametrize(
    "band, graft, graft_lag", [(1, "adam", True), (1, "none", False), (4, "adam", True)]
)
def test_fused_apply_equals_the_xla_step(x64, band, graft, graft_lag):
    """Where the graft ratio is known before the step (``graft_lag``, or no grafting) the kernel
    writes the parameters in place of ``u`` (``apply_gradients``): the same parameters as XLA's
    step and apply, the matrices decayed."""
    params = {"w": jnp.ones((64, 256)), "cube": jnp.ones((32, 4, 64)), "vec": jnp.ones((40,))}
    kwargs = dict(band=band, graft=graft, graft_lag=graft_lag, stats_dtype=jnp.float64)
    kwargs |= dict(weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    grads = _grads(params, 3, seed=2)
    result = []
    for tx in (
        sonew(0.1, implementation="xla", **kwargs),
        sonew(0.1, implementation="pallas", kernel_config=TPU, **kwargs),
    ):
        p, state = params, tx.init(params)
        step = jax.jit(lambda g, s, p, tx=tx: apply_gradients(tx, g, s, p))
        for g in grads:
            p, state = step(g, state, p)
        result.append(p)
    _assert_close(*result, 1e-12)


def test_bf16_state_in_place(x64):
    """bf16 statistics are stored as bf16 (the kernel writes its aliased inputs in their dtype)
    and computed in float32, as on XLA."""
    params = {"w": jnp.zeros((32, 256), jnp.float32)}
    kwargs = dict(band=1, stats_dtype=jnp.bfloat16)
    grads = _grads(params, 3)
    expect, expect_state = run(sonew(0.1, implementation="xla", **kwargs), params, grads)
    tx = sonew(0.1, implementation="pallas", kernel_config=TPU, **kwargs)
    got, state = run(tx, params, grads)
    assert state[0].d["w"].dtype == jnp.bfloat16
    _assert_close(expect, got, 1e-2)
    _assert_close(expect_state[0].d, state[0].d, 1e-2)


@pytest.mark.parametrize("mesh_shape, band", [((2, 4), 1), ((4, 2), 1), ((2, 4), 2)])
def test_sharded_kernel_equals_unsharded(x64, mesh_shape, band):
    """On each shard's block, with the rows beyond it from the other shards (the tree's one
    exchange): rows, columns and both split, and a replicated tensor."""
    a, b = mesh_shape
    params = {
        "rows": jnp.zeros((32 * a, 128)),
        "cols": jnp.zeros((32, 128 * b)),
        "both": jnp.zeros((16 * a, 128 * b)),
        "rep": jnp.zeros((32, 128)),
    }
    specs = {
        "rows": P("data", None),
        "cols": P(None, "model"),
        "both": P("data", "model"),
        "rep": P(),
    }
    mesh = make_mesh(mesh_shape)
    kwargs = dict(band=band, stats_dtype=jnp.float64)
    grads = _grads(params, 3, seed=1)
    expect, _ = run(sonew(0.1, implementation="xla", **kwargs), params, grads)
    tx = sonew(
        0.1, mesh=mesh, param_specs=specs, implementation="pallas", kernel_config=TPU, **kwargs
    )
    got, _ = run(tx, params, grads, mesh, specs)
    _assert_close(expect, got, 1e-12)


@pytest.mark.parametrize("band", [1, 4])
def test_kernel_lowers_for_tpu(band):
    """Exported for TPU from this CPU host: one Mosaic call per tensor that tiles, no GPU kernel,
    the XLA step for the others."""
    params = {"a": jnp.zeros((64, 256)), "b": jnp.zeros((32, 4, 64)), "c": jnp.zeros((20, 128))}
    config = KernelConfig(platform="tpu", interpret=False)
    tx = sonew(0.1, band=band, implementation="pallas", kernel_config=config)
    state = tx.init(params)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    text = export.export(update, platforms=("tpu",))(params, state, params).mlir_module()
    assert text.count("tpu_custom_call") == 2
    assert f"sonew_tpu_band{band}" in text
    assert "triton" not in text
