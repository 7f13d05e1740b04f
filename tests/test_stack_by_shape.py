"""``stack_by_shape``: the parameters of one shape stored and stepped as one stack give the update
of the parameters stepped apart, whole and sharded, in one step per shape."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import (
    StackedByShapeState,
    apply_gradients,
    kernels,
    scale_by_sonew,
    sonew,
    state_partition_specs,
)
from tests.test_sonew_sharded import make_mesh, run
from tests.test_stacked import VARIANTS, assert_close

# name -> (shape, stacked axes). Three (8, 12) matrices, two (12, 8), two vectors, two
# parameters that stack 3 tensors each (a scanned model's), and one of a shape of its own.
SHAPES = {
    "a0": ((8, 12), 0),
    "a1": ((8, 12), 0),
    "a2": ((8, 12), 0),
    "b0": ((12, 8), 0),
    "b1": ((12, 8), 0),
    "v0": ((12,), 0),
    "v1": ((12,), 0),
    "s0": ((3, 8, 12), 1),
    "s1": ((3, 8, 12), 1),
    "x": ((6, 4), 0),
}
STACKS = {name: stack for name, (_, stack) in SHAPES.items()}


def _problem(seed=0, steps=3):
    rng = np.random.default_rng(seed)
    draw = lambda: {k: jnp.asarray(rng.normal(size=s)) for k, (s, _) in SHAPES.items()}  # noqa: E731
    return draw(), [draw() for _ in range(steps)]


@pytest.mark.parametrize("band, kwargs", VARIANTS)
def test_stacked_by_shape_equals_stepped_apart(x64, band, kwargs):
    params, grads = _problem(seed=band)
    kwargs = (
        dict(band=band, stats_dtype=jnp.float64, weight_decay=0.1, stacked_axes=STACKS) | kwargs
    )
    expect, expect_state = run(sonew(0.1, **kwargs), params, grads)
    got, state = run(sonew(0.1, stack_by_shape=True, **kwargs), params, grads)
    for e_step, g_step in zip(expect, got, strict=True):
        assert_close(e_step, g_step, 1e-12)
    stacked = state[0]
    assert isinstance(stacked, StackedByShapeState)
    # One entry per (shape, stacking), leaves in sorted order: a's, b's, s's, v's and x.
    assert stacked.grouping.groups == ((0, 1, 2), (3, 4), (5, 6), (7, 8), (9,))
    for name in ("m", "d"):
        unpacked = stacked.grouping.unpack(getattr(stacked.inner, name))
        assert_close(getattr(expect_state[0], name), unpacked, 1e-12)


@pytest.mark.parametrize("band", [1, 4])
def test_sharded_stacked_by_shape_equals_unsharded_stepped_apart(x64, band):
    """On a 2 x 4 mesh: parameters of one shape and layout share a stack, sharded as they are
    (its leading axis unsharded); one of the same shape laid out otherwise stays apart."""
    mesh = make_mesh((2, 4))
    params, grads = _problem(seed=10 + band)
    specs = {k: P() for k in SHAPES} | {
        "a0": P("data", "model"),
        "a1": P("data", "model"),
        "a2": P(None, "model"),
        "b0": P("model"),
        "b1": P("model"),
        "s0": P(None, "data"),
        "s1": P(None, "data"),
    }
    kwargs = dict(band=band, eps=1e-2, stats_dtype=jnp.float64, stacked_axes=STACKS)
    expect, _ = run(sonew(0.1, **kwargs), params, grads)
    tx = sonew(0.1, mesh=mesh, param_specs=specs, stack_by_shape=True, **kwargs)
    got, state = run(tx, params, grads, mesh, specs)
    for e_step, g_step in zip(expect, got, strict=True):
        assert_close(e_step, g_step, 1e-10)
    stacked = state[0]
    assert stacked.grouping.groups == ((0, 1), (2,), (3, 4), (5, 6), (7, 8), (9,))
    # The first stack is split along its members' first axis (stacked as they are), the fourth not
    # (concatenated along it, grouping._stacked): both equal the unsharded steps above.
    assert stacked.grouping.split_first[0] and not stacked.grouping.split_first[3]
    state_specs = state_partition_specs(state, specs)[0]
    assert state_specs.inner.m[0] == P(None, "data", "model")
    assert state_specs.inner.e[0] == P(None, None, "data", "model")  # (band, stack, ...)
    assert state_specs.inner.m[3] == P(None, None, "data")  # the s stack (leaves sorted by name)
    assert stacked.inner.m[0].sharding.spec == P(None, "data", "model")


def test_kernel_stack_is_the_stack_cast():
    """``kernels.stack`` copies the members (several launches, blocks that do not divide a member)
    into ``jnp.stack``'s array in the stack's dtype, times a scale where given (the product
    rounded once); ``stackable`` refuses stacks past int32."""
    config = dataclasses.replace(kernels.DEFAULT, stack_tile=(16, 1), stack_group=2)
    rng = np.random.default_rng(0)
    members = [jnp.asarray(rng.normal(size=(5, 7)), jnp.float32) for _ in range(5)]
    scale = jnp.float32(0.37)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = kernels.stack(members, dtype, config, interpret=True)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, jnp.stack(members).astype(dtype))
        got = kernels.stack(members, dtype, config, interpret=True, scale=scale)
        np.testing.assert_array_equal(got, (jnp.stack(members) * scale).astype(dtype))
    assert kernels.stackable((5, 7), 5, config)
    assert not kernels.stackable((5, 7), 5, dataclasses.replace(config, max_offset=174))
    assert not kernels.stackable((0, 7), 5, config)


def test_stacks_for_the_kernels_are_copied_by_a_kernel_on_each_device(x64):
    """Where SONew's GPU kernels run on a mesh, the gradients are copied into their stacks by
    ``kernels.stack`` under ``shard_map`` (each device its blocks), and the update equals the
    tensors stepped apart (on XLA, unsharded). Unsharded: ``test_apply``'s clip-fold test."""
    mesh_shape = (2, 4)
    names = ("a0", "a1", "a2", "b0", "b1", "x")
    params, grads = _problem(seed=5, steps=2)
    params, grads = {k: params[k] for k in names}, [{k: g[k] for k in names} for g in grads]
    kwargs = dict(band=1, eps=1e-2, stats_dtype=jnp.float64)
    expect, _ = run(sonew(0.1, implementation="xla", **kwargs), params, grads)
    mesh = make_mesh(mesh_shape)
    specs = {k: P(None, "model") for k in names} | {"b0": P("model"), "b1": P("model")}
    kwargs |= dict(mesh=mesh, param_specs=specs)
    tx = sonew(0.1, stack_by_shape=True, implementation="pallas", **kwargs)
    got, state = run(tx, params, grads, mesh, specs)
    for e_step, g_step in zip(expect, got, strict=True):
        assert_close(e_step, g_step, 1e-10)
    program = str(jax.make_jaxpr(tx.update)(grads[0], state, params))
    assert program.count("name=sonew_stack") == 2  # the a's and the b's


def test_one_step_per_shape_whatever_the_depth():
    """The preconditioner's program grows with the number of shapes; each further tensor of a
    shape adds only its gradient's stacking, its update's slicing and its graft scale (a few
    equations, ``slots.grafted``), where stepped apart it adds a step of its own."""

    def equations(layers: int, stack_by_shape: bool) -> int:
        params = {f"w{i}": jnp.zeros((8, 12)) for i in range(layers)}
        params |= {f"b{i}": jnp.zeros((12,)) for i in range(layers)}
        tx = scale_by_sonew(stack_by_shape=stack_by_shape)
        state = tx.init(params)
        return len(jax.make_jaxpr(tx.update)(params, state, params).eqns)

    per_tensor = lambda stacked: (equations(16, stacked) - equations(2, stacked)) / 28  # noqa: E731
    assert per_tensor(True) <= 8 < 100 < per_tensor(False)


def test_only_steps_that_shift_rows_loop_over_a_stack():
    """On XLA a stack's tensors step in turn (a ``lax.scan``) only where the step shifts rows
    (band >= 1 on a chain); elementwise steps (band 0, 1-D tensors taking Adam's direction) are
    vectorized over the stack, not one trip (and its launches) per tensor."""
    params = {f"n{i}": jnp.ones((16,)) for i in range(6)}
    params |= {f"w{i}": jnp.ones((8, 12)) for i in range(3)}
    for band, loops in ((0, 0), (1, 1)):  # band 1: the matrices' stack loops, the vectors' not
        tx = sonew(0.1, band=band, stack_by_shape=True, implementation="xla")
        program = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
        assert len(re.findall(r"\bscan\[", program)) == loops, band
        assert "while[" not in program


def test_apply_adds_the_update_as_apply_updates_does(x64):
    """``apply`` (``apply_gradients``) with weight decay on a mask equals ``update`` followed by
    ``optax.apply_updates``."""
    params, grads = _problem()
    mask = {k: k != "x" for k in SHAPES}
    tx = sonew(0.1, stack_by_shape=True, weight_decay=0.1, mask=mask, stats_dtype=jnp.float64)
    state = tx.init(params)
    updates, expect_state = tx.update(grads[0], state, params)
    expect = optax.apply_updates(params, updates)
    got, got_state = apply_gradients(tx, grads[0], state, params)
    assert_close(expect, got, 1e-15)
    assert_close(
        expect_state[0].grouping.unpack(expect_state[0].inner.m),
        got_state[0].grouping.unpack(got_state[0].inner.m),
        0,
    )


def test_stack_by_shape_is_structural():
    """A bool, named when it is not one; ``inject_hyperparams`` keeps a bool static."""
    params = {"w": jnp.zeros((8, 12)), "u": jnp.zeros((8, 12))}
    with pytest.raises(ValueError, match="stack_by_shape must be a bool, got 1"):
        sonew(0.1, stack_by_shape=1)
    tx = optax.inject_hyperparams(sonew)(learning_rate=0.1, stack_by_shape=True)
    state = tx.init(params)
    assert isinstance(state.inner_state[0], StackedByShapeState)
    jax.jit(tx.update)(params, state, params)


def test_gradients_unlike_the_parameters_are_named_errors():
    """A gradient tree of another structure, or a member of an entry of another shape, is a
    ValueError that says so (and names the parameters), not an error from inside the step."""
    params = {"w": jnp.zeros((8, 12)), "u": jnp.zeros((8, 12))}
    tx = sonew(0.1, stack_by_shape=True)
    state = tx.init(params)
    with pytest.raises(ValueError, match="structure differs"):
        tx.update({"w": params["w"]}, state, params)
    shape = re.escape("the parameters had shape (8, 12) at init; got ['u'] (12, 8)")
    with pytest.raises(ValueError, match=shape):
        tx.update({"w": jnp.zeros((8, 12)), "u": jnp.zeros((12, 8))}, state, params)
    # The same for an entry of one parameter, and for every member of an entry changed alike.
    alone = sonew(0.1, stack_by_shape=True)
    with pytest.raises(ValueError, match=re.escape("got ['b'] (1, 12)")):
        alone.update({"b": jnp.zeros((1, 12))}, alone.init({"b": jnp.zeros((8, 12))}))
    with pytest.raises(ValueError, match=re.escape("got ['u'] (12, 8), ['w'] (12, 8)")):
        tx.update({"w": jnp.zeros((12, 8)), "u": jnp.zeros((12, 8))}, state, params)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bfloat16_stacks_of_bfloat16_gradients_change_only_the_rounding_of_u(
    implementation, monkeypatch
):
    """``stack_dtype="bfloat16"`` on gradients that are bfloat16 values (a bfloat16 model's
    weights' gradients): the copy is exact, so the state equals float32 stacking's bit for bit;
    each update differs only by its direction's rounding to bfloat16 (the kernels write such a
    stack's ``u`` in it), and comes back in the gradients' dtype."""
    # Two stacks (of 3 and 2 matrices) and a tensor alone, two steps.
    names = ("a0", "a1", "a2", "b0", "b1", "x")
    params, grads = _problem(steps=2)
    params = {k: params[k].astype(jnp.float32) for k in names}
    grads = [{k: g[k].astype(jnp.bfloat16).astype(jnp.float32) for k in names} for g in grads]
    kwargs = dict(band=1, stack_by_shape=True, implementation=implementation)
    expect, expect_state = run(sonew(0.1, **kwargs), params, grads)
    directions, real = [], kernels.group_update

    def spy(gs, *args, **kw):
        steps = real(gs, *args, **kw)
        directions.extend((g.dtype, step[0].dtype) for g, step in zip(gs, steps, strict=True))
        return steps

    monkeypatch.setattr(kernels, "group_update", spy)
    got, state = run(sonew(0.1, stack_dtype="bfloat16", **kwargs), params, grads)
    for e_step, g_step in zip(expect, got, strict=True):
        for name in e_step:
            assert g_step[name].dtype == jnp.float32, name
            np.testing.assert_allclose(g_step[name], e_step[name], rtol=2**-8, err_msg=name)
    for name in ("m", "d", "e"):
        jax.tree.map(
            np.testing.assert_array_equal,
            getattr(state[0].inner, name),
            getattr(expect_state[0].inner, name),
        )
    if implementation == "pallas":  # the stacked tensors' kernels read and write bfloat16
        assert (jnp.bfloat16, jnp.bfloat16) in directions
        assert all(u == (g if g == jnp.bfloat16 else jnp.float32) for g, u in directions)
    else:  # gradients that are not bfloat16 values are rounded in the stacks, and only there
        raw = [{k: g[k] + 1e-3 * jnp.abs(g[k]) for k in names} for g in grads[:1]]
        _, exact = run(sonew(0.1, **kwargs), params, raw)
        _, rounded = run(sonew(0.1, stack_dtype="bfloat16", **kwargs), params, raw)
        stacked, alone = rounded[0].inner.d[0], rounded[0].inner.d[-1]  # the a's; x
        assert not np.array_equal(stacked, exact[0].inner.d[0])
        np.testing.assert_allclose(stacked, exact[0].inner.d[0], rtol=2**-7)
        np.testing.assert_array_equal(alone, exact[0].inner.d[-1])


def test_stack_dtype_is_checked():
    with pytest.raises(ValueError, match=r"stack_dtype='bfloat16' .* needs stack_by_shape=True"):
        sonew(0.1, stack_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"stack_dtype must be a float dtype, got 'int8'\."):
        sonew(0.1, stack_by_shape=True, stack_dtype="int8")
