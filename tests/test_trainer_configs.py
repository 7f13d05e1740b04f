"""Shipped gin files, the optimizer factory and the learning-rate schedules (no compiling).

Every optimizer config is checked on the 2x4 mesh: its state derives specs from the parameters,
and no optimizer-state tensor is replicated where its parameter is sharded.
"""

import inspect
import pathlib
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sonew_pax import optim, optimizers, partitioning, train, train_state, trainer
from sonew_pax.models import Transformer

CONFIGS = train.CONFIGS_DIR
GIN_FILES = sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*.gin"))
OPTIMIZER_FILES = [f for f in GIN_FILES if f.startswith("optimizers/")]


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_the_expected_configs_ship():
    for name in ("tiny.gin", "runs/pretrain.gin", "optimizers/adamw.gin",
                 "optimizers/adafactor.gin", "optimizers/sonew_diag.gin",
                 "optimizers/sonew_tridiag.gin", "optimizers/sonew_band4.gin"):  # fmt: skip
        assert name in GIN_FILES


@pytest.mark.parametrize("name", GIN_FILES)
def test_every_shipped_gin_file_parses(name):
    train.set_search_paths([])
    gin.parse_config_file(name, skip_unknown=False)


def test_gin_flag_rewriting():
    argv = ["prog", '--gin.MODEL_DIR="/tmp/x"', "--gin.sonew.band=4", "--gin_file=tiny.gin"]
    assert train.rewrite_gin_args(argv) == [
        "prog",
        '--gin_bindings=MODEL_DIR = "/tmp/x"',
        "--gin_bindings=sonew.band = 4",
        "--gin_file=tiny.gin",
    ]
    with pytest.raises(ValueError, match=r"--gin\.NAME=VALUE"):
        train.rewrite_gin_args(["prog", "--gin.MODEL_DIR"])


def test_misspelled_binding_fails_with_gins_message():
    with pytest.raises(ValueError, match="num_layrs"):
        train.parse_gin(["tiny.gin"], ['MODEL_DIR = "/tmp/x"', "TransformerConfig.num_layrs = 1"],
                        [])  # fmt: skip


def test_unset_macro_fails_naming_it():
    with pytest.raises(ValueError, match="MODEL_DIR"):
        train.parse_gin(["tiny.gin"], [], [])


def _configured_model():
    """The parsed gin files' ``train.model_config``."""
    return gin.query_parameter("train.model_config").scoped_configurable_fn()


def _configured_trainer(config) -> trainer.Trainer:
    """A Trainer of ``config``'s model and the parsed gin files' optimizer and schedule, on a 2 x 4
    mesh with a global batch of 8 x 16."""
    return trainer.Trainer(
        Transformer(config),
        optimizers.make_optimizer,
        optimizers.learning_rate_schedule(),
        partitioning.make_mesh(data=2, model=4),
        partitioning.logical_axis_rules(),
        (8, 16),
        seed=0,
    )


@pytest.mark.parametrize("name", OPTIMIZER_FILES)
def test_optimizer_state_is_sharded_like_its_parameters(name):
    train.parse_gin(["runs/pretrain.gin", "models/tiny.gin", name],
                    ['MODEL_DIR = "/tmp/unused"', "TRAIN_STEPS = 2000",
                     "adafactor.min_dim_size_to_factor = 1024"], [])  # fmt: skip
    step_fns = _configured_trainer(_configured_model())
    layout = step_fns.layout
    params = jax.tree_util.tree_leaves_with_path(layout.abstract.params)
    param_specs = jax.tree.leaves(layout.specs.params, is_leaf=_is_spec)
    opt = statistics(layout.abstract.opt_state, layout.specs.opt_state)
    matched = 0
    for (path, param), spec in zip(params, param_specs, strict=True):
        name_ = jax.tree_util.keystr(path)
        for opt_path, leaf, opt_spec in opt:
            same_shape = leaf.shape[leaf.ndim - param.ndim :] == param.shape
            if opt_path.endswith(name_) and same_shape:
                assert tuple(opt_spec)[leaf.ndim - param.ndim :] == tuple(spec), opt_path
                matched += 1
    assert matched >= len(params)  # at least one parameter-shaped statistic per parameter


def statistics(state, layouts) -> list[tuple[str, jax.ShapeDtypeStruct, Any]]:
    """``(path, leaf, layout)`` of every state leaf, ``layouts`` its ``PartitionSpec``s or
    shardings; a stacked entry of a ``StackedByShapeState`` (``stack_by_shape``) once for each of
    its parameters, under that parameter's path."""
    stacked = lambda x: isinstance(x, optim.StackedByShapeState)  # noqa: E731
    nodes = jax.tree_util.tree_leaves_with_path(state, is_leaf=stacked)
    node_specs = jax.tree.leaves(layouts, is_leaf=lambda x: stacked(x) or _is_layout(x))
    assert len(nodes) == len(node_specs)
    out = []
    for (path, node), spec in zip(nodes, node_specs, strict=True):
        if not stacked(node):
            out.append((jax.tree_util.keystr(path), node, spec))
            continue
        grouping = node.grouping
        members = jax.tree_util.tree_leaves_with_path(
            grouping.treedef.unflatten(range(grouping.treedef.num_leaves))
        )
        names = {index: jax.tree_util.keystr(p) for p, index in members}
        inner = jax.tree_util.tree_leaves_with_path(node.inner)
        inner_specs = jax.tree.leaves(spec.inner, is_leaf=_is_layout)
        for (inner_path, leaf), inner_spec in zip(inner, inner_specs, strict=True):
            entry = [k.idx for k in inner_path if isinstance(k, jax.tree_util.SequenceKey)]
            for index in grouping.groups[entry[0]] if entry else ():
                out.append((names[index], leaf, inner_spec))
    return out


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _is_layout(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec | jax.sharding.Sharding)


@pytest.mark.parametrize("decay", optimizers.SCHEDULE_KINDS)
def test_schedules_warm_up_then_decay(decay):
    schedule = optimizers.learning_rate_schedule(
        peak_value=1.0, warmup_steps=10, decay=decay, total_steps=100, end_factor=0.1
    )
    values = np.array([float(schedule(s)) for s in range(101)])
    assert values[0] == 0.0 and values[5] == pytest.approx(0.5) and values[10] == pytest.approx(1)
    assert np.all(np.diff(values[10:]) <= 1e-7)
    expected_end = {"cosine": 0.1, "linear": 0.1, "rsqrt": np.sqrt(10 / 100), "constant": 1.0}
    assert values[100] == pytest.approx(expected_end[decay], rel=1e-5)


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="decay"):
        optimizers.learning_rate_schedule(peak_value=1.0, decay="exp", total_steps=10)
    with pytest.raises(ValueError, match="warmup_steps=20"):
        optimizers.learning_rate_schedule(peak_value=1.0, warmup_steps=20, total_steps=10)


def test_clipping_comes_first():
    tx = optimizers.make_optimizer(optax.constant_schedule(1.0), factory=optimizers.adamw,
                                   clip_norm=1e-3)  # fmt: skip
    params = {"w": np.ones((2, 2), np.float32)}
    updates, _ = tx.update({"w": np.full((2, 2), 1e6, np.float32)}, tx.init(params), params)
    assert np.all(np.isfinite(updates["w"]))
    assert isinstance(tx.init(params)[0], optax.ClipByGlobalNormState)


def test_configs_dir_is_the_repository_configs():
    assert pathlib.Path(__file__).resolve().parent.parent / "configs" == CONFIGS


def test_parses_with_a_runs_directory_in_the_working_directory(tmp_path, monkeypatch):
    """``make demo`` leaves ./runs/; gin must not take it for the package of runs/pretrain.gin."""
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    train.parse_gin(["tiny.gin"], ['MODEL_DIR = "/tmp/unused"'], [])


@pytest.mark.parametrize("name", list(inspect.signature(optim.sonew).parameters))
def test_every_sonew_argument_is_bindable_in_gin(name):
    """gin's ``sonew`` has ``optim.sonew``'s arguments, none restated (gin rejects a binding of a
    parameter its configurable lacks)."""
    gin.parse_config(f"sonew.{name} = None")
    assert gin.query_parameter(f"sonew.{name}") is None


def test_gin_sonew_passes_bindings_through_and_decays_matrices_only():
    """A dtype named in gin reaches ``optim.sonew``; weight decay skips vectors by default."""
    gin.parse_config('sonew.stats_dtype = "bfloat16"\nsonew.weight_decay = 1.0')
    tx = optimizers.sonew(1.0)
    params = {"w": np.ones((2, 2), np.float32), "b": np.ones(2, np.float32)}
    state = tx.init(params)
    assert {leaf.dtype for leaf in jax.tree.leaves(state[0].d)} == {jnp.dtype(jnp.bfloat16)}
    zeros = jax.tree.map(np.zeros_like, params)
    updates, _ = tx.update(zeros, state, params)
    np.testing.assert_allclose(updates["w"], -params["w"])
    np.testing.assert_allclose(updates["b"], 0.0)


def test_scanned_model_trains_sharded_with_sonew_per_layer():
    """``TransformerConfig.scan_layers`` through gin: the trainer tells SONew the stacked layer
    axis (one damping statistic per layer's matrix in the state) and the sharded step runs."""
    train.parse_gin(["runs/pretrain.gin", "models/tiny.gin", "optimizers/sonew_tridiag.gin"],
                    ['MODEL_DIR = "/tmp/unused"', "TRAIN_STEPS = 2000",
                     "TransformerConfig.scan_layers = True"], [])  # fmt: skip
    config = _configured_model()
    step_fns = _configured_trainer(config)
    params = step_fns.layout.abstract.params
    stacks = partitioning.stacked_axes(
        train_state.abstract_boxed_params(Transformer(config), step_fns.example)
    )
    assert jax.tree.leaves(stacks["layers"]) == [1] * len(jax.tree.leaves(params["layers"]))
    expected = sum(
        p.shape[0] if k else 1
        for p, k in zip(jax.tree.leaves(params), jax.tree.leaves(stacks), strict=True)
        if p.ndim - k >= 2
    )
    state = step_fns.init_state(0)
    (diag,) = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
        if jax.tree_util.keystr(path).endswith(".diag")
    ]
    assert diag.shape == (expected,)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 17), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((8, 16))}
    for _ in range(2):
        state, metrics = step_fns.step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
