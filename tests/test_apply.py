"""The fused apply: ``tx.apply`` (``optim.apply_gradients``) equals ``tx.update`` followed by
``optax.apply_updates``, on the XLA path, in the kernels (Pallas' interpreter on CPU), sharded, in
a chain behind gradient clipping and in the trainer's step.

The reference is the optax path of the same optimizer, itself checked against the dense float64
reference in ``test_sonew_math.py`` and ``test_graft_lag.py``.
"""

import copy
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sonew_pax import optim, optimizers, trainer
from sonew_pax.models import Transformer, TransformerConfig
from sonew_pax.optim import KernelConfig, kernels
from sonew_pax.train_state import TrainState
from tests.test_graft_lag import _grads
from tests.test_kernels import _assert_close
from tests.test_sonew_sharded import case, make_mesh

SHAPES = {"mat": (70, 130), "cube": (3, 4, 5), "bias": (33,)}  # "bias": 1-D, Adam's direction
SCHEDULE = optax.linear_schedule(0.1, 0.01, 10)


def _matrices(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _problem(shapes, steps=4, seed=0, dtype=jnp.float64):
    """Random parameters and ``steps`` gradients (``test_graft_lag``'s, of varied scales)."""
    rng = np.random.default_rng(seed + 1000)
    params = {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}
    return params, _grads(shapes, steps, seed, dtype)


def _optax_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _apply_step(tx):
    return lambda params, state, grads: optim.apply_gradients(tx, grads, state, params)


def _both_paths(tx, params, grads_seq, place=lambda tree: tree, place_state=lambda state: state):
    """``(params, state)`` after ``grads_seq`` through ``update`` + ``optax.apply_updates`` and
    through ``optim.apply_gradients`` (each jitted once); ``place`` puts parameter-shaped trees
    and ``place_state`` the state on devices."""
    results = []
    for step in (_optax_step(tx), _apply_step(tx)):
        step = jax.jit(step)
        p, s = place(params), place_state(tx.init(params))
        for g in grads_seq:
            p, s = step(p, s, place(g))
        results.append((p, s))
    return results


@pytest.fixture
def kernel_spy(monkeypatch):
    """Records, per tensor of each ``kernels.group_update`` call, whether the kernel was given the
    parameters."""
    calls = []
    group_update = kernels.group_update

    def spy(*args, applies=None, **kwargs):
        calls.extend(apply is not None for apply in applies)
        return group_update(*args, applies=applies, **kwargs)

    monkeypatch.setattr(kernels, "group_update", spy)
    return calls


# graft_lag and no grafting write the parameters in the kernels; the step's own graft ratio
# (the default) makes the kernels write u, which XLA applies.
GRAFTS = {"lag": dict(graft_lag=True), "none": dict(graft="none"), "exact": dict()}


# Band 0, band 1's scan kernel, band 4's kernel ("band").
@pytest.mark.parametrize(
    "band, kernel, graft",
    [
        (0, "scan", "lag"),
        (1, "scan", "lag"),
        (1, "scan", "none"),
        (1, "scan", "exact"),
        (4, "band", "lag"),
    ],
)
def test_kernel_apply_equals_update_then_apply_updates(
    x64, band, kernel, graft, monkeypatch, kernel_spy
):
    params, grads = _problem(SHAPES)
    kwargs = dict(band=band, weight_decay=0.1, mask=_matrices, stats_dtype=jnp.float64)
    kwargs["kernel_config"] = KernelConfig(scan_tile=(16, 64, 2), banded_tile=(16, 64, 2))
    tx = optim.sonew(SCHEDULE, implementation="pallas", **kwargs, **GRAFTS[graft])
    (expect_p, expect_s), (got_p, got_s) = _both_paths(tx, params, grads)
    _assert_close(expect_p, got_p, 1e-13)
    _assert_close(expect_s, got_s, 1e-13)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got_p, params)
    assert min(moved.values()) > 1e-3  # every tensor stepped (the bias by Adam's direction, on XLA)
    # Traced once per path, the preconditioned tensors on the kernels each (band 4's kernel
    # needs 8 rows: not the cube's): the kernels had the parameters exactly where the graft ratio
    # was known before the step.
    on_kernel = 1 if band == 4 else 2
    assert kernel_spy == [False] * on_kernel + [graft != "exact"] * on_kernel


def test_kernel_apply_with_bf16_parameters(monkeypatch):
    """bf16 parameters and gradients, float32 statistics: the kernel rounds ``p + (r u + decay p)
    scale`` once, where optax rounds the update to bf16 first and then the sum: the paths may
    differ by a bf16 rounding (0.4%) in a few elements."""
    params, grads = _problem({"mat": (70, 130)}, dtype=jnp.bfloat16)
    config = KernelConfig(scan_tile=(16, 64, 2))
    tx = optim.sonew(
        1e-2, implementation="pallas", graft_lag=True, weight_decay=0.1, kernel_config=config
    )
    (expect_p, expect_s), (got_p, got_s) = _both_paths(tx, params, grads)
    _assert_close(expect_p, got_p, 1e-2)
    _assert_close(expect_s, got_s, 1e-5)
    assert got_p["mat"].dtype == jnp.bfloat16


@pytest.mark.parametrize("graft", ["lag", "exact"])
def test_xla_apply_equals_update_then_apply_updates(x64, graft):
    params, grads = _problem(SHAPES)
    kwargs = dict(band=1, weight_decay=0.1, mask=_matrices, stats_dtype=jnp.float64)
    tx = optim.sonew(SCHEDULE, implementation="xla", **kwargs, **GRAFTS[graft])
    (expect_p, expect_s), (got_p, got_s) = _both_paths(tx, params, grads)
    _assert_close(expect_p, got_p, 1e-14)
    _assert_close(expect_s, got_s, 1e-14)


def test_sharded_apply_equals_unsharded(x64):
    """Every sharding pattern of ``test_sonew_sharded``; the compiled sharded apply moves halos
    and norms only (no all-gather, no all-to-all)."""
    mesh = make_mesh((2, 4))
    params, specs = case((2, 4))
    grads = _problem({k: p.shape for k, p in params.items()}, steps=3, seed=1)[1]
    kwargs = dict(band=1, graft_lag=True, weight_decay=0.1, stats_dtype=jnp.float64)
    expect = _both_paths(optim.sonew(SCHEDULE, **kwargs), params, grads)[1]

    def put(tree, tree_specs):
        return jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, tree_specs
        )

    tx = optim.sonew(SCHEDULE, mesh=mesh, param_specs=specs, **kwargs)
    state = tx.init(params)
    state_specs = optim.state_partition_specs(state, specs)
    got = _both_paths(tx, params, grads, lambda t: put(t, specs), lambda s: put(s, state_specs))
    for paths in got:
        _assert_close(expect[0], paths[0], 1e-12)
        _assert_close(expect[1], paths[1], 1e-12)
    for x, spec in zip(jax.tree.leaves(got[1][0]), jax.tree.leaves(specs), strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    apply = jax.jit(_apply_step(tx))
    text = apply.lower(put(params, specs), put(state, state_specs), put(params, specs))
    text = text.compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text


def test_sharded_kernel_apply_equals_unsharded(x64, kernel_spy):
    """Under a mesh every tensor's kernel writes its parameters inside ``shard_map`` (the sharded
    ones with their edges from the neighbouring shards); all equal the unsharded optimizer. Behind
    a clip whose factor folds into the kernels' reads: the edges from the other shards come
    scaled as the kernels scale their own rows."""
    mesh = make_mesh((2, 4))
    specs = {"cols": P(None, "model"), "rows": P("data", None), "rep": P()}
    params, grads = _problem({"cols": (5, 8), "rows": (8, 3), "rep": (6, 7)}, steps=3)
    clip = 0.5 * min(float(optax.tree.norm(g)) for g in grads)
    kwargs = dict(band=1, graft_lag=True, weight_decay=0.1, stats_dtype=jnp.float64)
    reference = optax.chain(
        optax.clip_by_global_norm(clip), optim.sonew(SCHEDULE, implementation="xla", **kwargs)
    )
    expect = _both_paths(reference, params, grads)[0]
    tx = optim.chain(
        optim.clip_by_global_norm(clip),
        optim.sonew(SCHEDULE, implementation="pallas", mesh=mesh, param_specs=specs, **kwargs),
    )
    state_specs = optim.state_partition_specs(tx.init(params), specs)

    def put(tree, tree_specs):
        return jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, tree_specs
        )

    step = jax.jit(_apply_step(tx))
    p, s = put(params, specs), put(tx.init(params), state_specs)
    for g in grads:
        p, s = step(p, s, put(g, specs))
    _assert_close(expect[0], p, 1e-12)
    _assert_close(expect[1], s, 1e-12)
    assert kernel_spy == [True] * 3


def test_chain_keeps_the_last_apply(x64):
    params, grads = _problem(SHAPES, steps=3)
    sonew = optim.sonew(0.1, graft_lag=True, stats_dtype=jnp.float64)
    tx = optim.chain(optax.clip_by_global_norm(1.0), sonew)
    assert isinstance(tx, optim.GradientTransformationWithApply)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    (expect_p, expect_s), (got_p, got_s) = _both_paths(tx, params, grads)
    _assert_close(expect_p, got_p, 1e-14)
    _assert_close(expect_s, got_s, 1e-14)
    # A chain whose last transformation cannot apply itself is optax.chain's: apply_gradients
    # then updates and applies the updates.
    plain = optim.chain(optim.sonew(0.1), optax.scale(0.5))
    assert not isinstance(plain, optim.GradientTransformationWithApply)
    (expect_p, _), (got_p, _) = _both_paths(plain, params, grads)
    _assert_close(expect_p, got_p, 0)


def test_clip_by_global_norm_is_optaxs(x64):
    params, grads = _problem(SHAPES, steps=1)
    norm = float(optax.tree.norm(grads[0]))
    for max_norm in (0.5 * norm, 2 * norm):  # clipped, kept
        ours, theirs = optim.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
        assert ours.init(params) == theirs.init(params) == optax.EmptyState()
        got, _ = ours.update(grads[0], ours.init(params))
        expect, _ = theirs.update(grads[0], theirs.init(params))
        _assert_close(expect, got, 1e-15)
    assert float(optax.tree.norm(got)) == pytest.approx(norm)
    with pytest.raises(ValueError, match="max_norm must be positive, got 0"):
        optim.clip_by_global_norm(0)


@pytest.mark.parametrize("implementation, stack_by_shape", [("xla", False), ("pallas", True)])
def test_clip_folds_into_the_apply(x64, implementation, stack_by_shape):
    """``optim.chain(optim.clip_by_global_norm(c), sonew)``'s apply hands the clip's factor to
    SONew (``gradient_scale``), which multiplies the gradients as it reads them: the same step
    as optax's clip followed by SONew's update, on XLA and stacked by shape on the kernels
    (``kernels.stack`` scales as it copies; the unstacked ``bias`` is scaled on XLA), clipped at
    every step."""
    shapes = {"a": (24, 40), "b": (24, 40), "bias": (33,)}
    params, grads = _problem(shapes, steps=3)
    clip = 0.5 * min(float(optax.tree.norm(g)) for g in grads)
    kwargs = dict(band=1, weight_decay=0.1, mask=_matrices, stats_dtype=jnp.float64)
    kwargs |= dict(implementation=implementation, stack_by_shape=stack_by_shape)
    kwargs["kernel_config"] = KernelConfig(scan_tile=(16, 64, 2))
    reference = optax.chain(optax.clip_by_global_norm(clip), optim.sonew(SCHEDULE, **kwargs))
    expect = _both_paths(reference, params, grads)[0]
    sonew, scales = optim.sonew(SCHEDULE, **kwargs), []

    def apply(updates, state, params, **extra):
        scales.append(extra.get("gradient_scale"))
        return sonew.apply(updates, state, params, **extra)

    spied = optim.GradientTransformationWithApply(sonew.init, sonew.update, apply)
    tx = optim.chain(optim.clip_by_global_norm(clip), spied)
    step = jax.jit(_apply_step(tx))
    p, s = params, tx.init(params)
    for g in grads:
        p, s = step(p, s, g)
    _assert_close(expect[0], p, 1e-12)
    _assert_close(expect[1], s, 1e-12)
    assert len(scales) == 1 and scales[0] is not None  # traced once, with the clip's factor
    program = str(jax.make_jaxpr(_apply_step(tx))(params, tx.init(params), grads[0]))
    assert ("name=sonew_stack" in program) == stack_by_shape


def test_transformation_with_apply_is_an_optax_transformation():
    tx = optim.sonew(0.1)
    init, update = tx  # unpacks as an optax transformation: two functions
    assert (init, update) == (tx.init, tx.update)
    for clone in (copy.copy(tx), copy.deepcopy(tx)):
        assert type(clone) is type(tx) and clone.apply is tx.apply


def test_trainer_step_applies_through_the_fused_apply():
    """The trainer's step with SONew's apply (behind make_optimizer's clipping) equals the same
    step through optax's update and apply_updates. Well damped (``eps`` 1e-3) and float32
    matmuls at full precision: the two programs fuse differently, so their gradients differ by
    float32 roundings (reduction orders; on a GPU also TF32), which the first steps' near-singular
    windows (two samples: every neighbour correlation near 1) amplify: to about 1e-5 on a CPU,
    1e-3 on a GPU."""
    config = TransformerConfig(
        vocab_size=64, d_model=32, num_layers=1, num_heads=4, head_dim=8, mlp_dim=48, max_len=16
    )
    model = Transformer(config)
    tokens = jax.random.randint(jax.random.key(0), (2, 13), 0, 64, dtype=jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": jnp.ones((2, 12))}
    params = nn.unbox(model.init(jax.random.key(1), batch["inputs"]))["params"]
    schedule = optax.constant_schedule(1e-2)
    factory = functools.partial(optimizers.sonew, graft_lag=True, weight_decay=0.1, eps=1e-3)
    tx = optimizers.make_optimizer(schedule, factory=factory, clip_norm=1.0)
    assert isinstance(tx, optim.GradientTransformationWithApply)
    without_apply = optax.GradientTransformationExtraArgs(tx.init, tx.update)
    states = []
    for t in (tx, without_apply):
        step = jax.jit(trainer.make_train_step(model, t, schedule, seed=0))
        state = TrainState(jnp.zeros([], jnp.int32), params, t.init(params))
        with jax.default_matmul_precision("float32"):
            for _ in range(3):
                state, _ = step(state, batch)
        states.append(state)
    _assert_close(states[1].params, states[0].params, 3e-5)
    _assert_close(states[1].opt_state, states[0].opt_state, 3e-5)
    assert int(states[0].step) == 3


def test_traced_weight_decay_mask_is_named():
    params = {"w": jnp.ones((4, 3))}
    tx = optim.sonew(0.1, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.sum() > 0, p))
    with pytest.raises(ValueError, match="weight-decay mask must give concrete bools"):
        jax.jit(_apply_step(tx))(params, tx.init(params), params)


def test_apply_gradients_of_a_plain_optax_transformation():
    params, grads = _problem({"w": (4, 3)}, steps=1, dtype=jnp.float32)
    tx = optax.adamw(0.1)
    state = tx.init(params)
    got, got_state = optim.apply_gradients(tx, grads[0], state, params)
    updates, expect_state = tx.update(grads[0], state, params)
    _assert_close(optax.apply_updates(params, updates), got, 0)
    _assert_close(expect_state, got_state, 0)


@pytest.mark.parametrize("wrap", ["optax.chain", "inject_hyperparams", "MultiSteps"])
def test_wrapped_sonew_falls_back_to_update_then_apply_updates(x64, wrap):
    """Wrapped in another optax transformation, SONew has no ``apply`` (as its docstring says):
    ``apply_gradients`` runs ``update`` and ``optax.apply_updates``, and follows the unwrapped
    optimizer's fused apply step for step."""
    params, grads = _problem(SHAPES, steps=3)
    kwargs = dict(band=1, graft_lag=True, weight_decay=0.1, stats_dtype=jnp.float64)
    wrapped = {
        "optax.chain": lambda: optax.chain(
            optax.clip_by_global_norm(1e9), optim.sonew(0.1, **kwargs)
        ),
        "inject_hyperparams": lambda: optax.inject_hyperparams(optim.sonew, static_args=("band",))(
            learning_rate=0.1, **kwargs
        ),
        "MultiSteps": lambda: optax.MultiSteps(optim.sonew(0.1, **kwargs), every_k_schedule=1),
    }[wrap]()
    assert not isinstance(wrapped, optim.GradientTransformationWithApply)
    expect = _both_paths(optim.sonew(0.1, **kwargs), params, grads)[1][0]  # the fused apply's
    got_update, got_apply = (p for p, _ in _both_paths(wrapped, params, grads))
    _assert_close(expect, got_update, 1e-13)
    _assert_close(expect, got_apply, 1e-13)


def test_band_is_static_under_inject_hyperparams():
    """``band`` decides the state's shapes: injected as a hyperparameter it is traced when the
    state is initialised under ``jit``, and the error names the fix (``static_args``)."""
    tx = optax.inject_hyperparams(optim.sonew)(learning_rate=0.1, band=1)
    with pytest.raises(ValueError, match=r"static_args=\('band',\)"):
        jax.jit(tx.init)({"w": jnp.ones((4, 3))})
