"""The training loop in-process on 8 simulated devices: outputs, restore onto other meshes,
corrupt-checkpoint fallback, compiled shardings, optimizer factory and schedules.

One reference run (tiny model, 2x4 mesh, tridiagonal SONew) is shared by the module.
"""

import json
import logging
import re
import shutil

import flax.linen as nn
import gin
import jax
import numpy as np
import optax
import pytest

from sonew_pax import demo, loop, models, optimizers, partitioning, train, train_state, trainer
from tests.conftest import jax_config
from tests.test_trainer_configs import statistics

STEPS = 12
PERIOD = 6
# A smaller model than tiny.gin's so that compiling stays cheap; heads and mlp divide model=4.
TEST_BINDINGS = [
    f"TRAIN_STEPS = {STEPS}",
    "BATCH_SIZE = 8",
    "SEQ_LEN = 16",
    f"CHECKPOINT_PERIOD = {PERIOD}",
    f"EVAL_PERIOD = {PERIOD}",
    "TransformerConfig.d_model = 32",
    "TransformerConfig.num_layers = 1",
    "TransformerConfig.num_heads = 4",
    "TransformerConfig.head_dim = 8",
    "TransformerConfig.mlp_dim = 64",
    "make_eval_batches.max_batches = 1",
    "train.log_every = 4",
    "learning_rate_schedule.warmup_steps = 4",
    "make_mesh.data = 2",
    "make_mesh.model = 4",
]


def configure(model_dir, *extra: str, files=("tiny.gin",)) -> None:
    """Fresh gin config: tiny.gin + the test bindings + ``extra``, writing into ``model_dir``."""
    gin.clear_config()
    bindings = [*TEST_BINDINGS, f"MODEL_DIR = {json.dumps(str(model_dir))}", *extra]
    train.parse_gin(list(files), bindings, [])


# JAX's cache directory before any run (JAX_COMPILATION_CACHE_DIR, unset in CI): restored after.
PROCESS_CACHE = jax.config.jax_compilation_cache_dir


def losses(model_dir) -> dict[int, float]:
    """step -> training loss, from metrics.jsonl."""
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(autouse=True)
def _clear_gin():
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run on the 2x4 mesh with checkpoints at 6 and 12 (every program
    it compiles in its compilation cache: the tiny step may compile in less than JAX's 1 s)."""
    model_dir = tmp_path_factory.mktemp("reference")
    configure(model_dir)
    with (
        jax_config("jax_compilation_cache_dir", None),  # the default place, whatever the env says
        jax_config("jax_persistent_cache_min_compile_time_secs", 0),
    ):
        result = loop.train()
    gin.clear_config()
    return model_dir, result


def test_run_writes_everything(reference):
    model_dir, result = reference
    assert result.step == STEPS and not result.preempted
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all({"loss", "learning_rate", "grad_norm"} <= r.keys() for r in records)
    logged = [r for r in records if r["step"] % 4 == 0]  # train.log_every = 4: the progress lines
    assert logged and all(r["tokens_per_sec_per_device"] > 0 for r in logged)
    assert [r["step"] for r in records if "eval_loss" in r] == [PERIOD, STEPS]
    assert records[-1]["eval_perplexity"] == pytest.approx(np.exp(records[-1]["eval_loss"]))
    assert records[-1]["loss"] < records[0]["loss"]
    assert result.loss == records[-1]["loss"]
    for sub in ("train", "eval"):
        assert list((model_dir / sub).glob("events.out.tfevents.*"))
    assert {p.name for p in model_dir.glob("checkpoint_*")} == {
        f"checkpoint_{PERIOD}",
        f"checkpoint_{STEPS}",
    }
    config = (model_dir / "config.gin").read_text()
    assert f"TRAIN_STEPS = {STEPS}" in config and "sonew.band = 1" in config
    info = (model_dir / "model-info.txt").read_text()
    assert "Parameters:" in info and "Optimizer state:" in info
    assert "P(None, 'model')" in info  # mlp/wi is split over the model axis
    assert list((model_dir / loop.COMPILATION_CACHE).glob("jit_train_step-*"))
    assert jax.config.jax_compilation_cache_dir == PROCESS_CACHE  # restored after the run


def test_resume_loads_the_compiled_step(reference, tmp_path, caplog):
    """A resumed run that reads the reference's compilation cache loads its train step from it,
    and the loaded program computes what the compiled one did. (The cache is named, not copied:
    JAX keys entries by the cache's path too, via the XLA autotuning cache it places inside.)"""
    ref_dir, _ = reference
    cache = str(ref_dir / loop.COMPILATION_CACHE)
    jax.clear_caches()  # nothing compiled in this process serves the run
    with (  # the last sets caplog's handler level too: DEBUG
        caplog.at_level(logging.INFO, logger="absl"),
        caplog.at_level(logging.DEBUG, logger="jax._src.compiler"),
    ):
        result = _resume_from(
            reference, tmp_path, [PERIOD], eval_data=None, compilation_cache_dir=cache
        )
    messages = [r.getMessage() for r in caplog.records]
    hits = [m for m in messages if "compilation cache hit" in m]
    assert any("'jit_train_step'" in hit for hit in hits), hits
    # The trainer says so: its first step loaded a program from the cache.
    (first,) = [m for m in messages if m.startswith("First step done")]
    assert re.search(r"in \d+\.\d s, compiling included \([1-9]\d* program", first), first
    assert not (tmp_path / loop.COMPILATION_CACHE).exists()
    assert result.step == STEPS
    expected = losses(ref_dir)
    assert losses(tmp_path) == {s: expected[s] for s in range(PERIOD + 1, STEPS + 1)}


def test_compilation_cache_at_a_uri_keeps_xla_caches_off():
    """XLA's autotuning cache would land in a local ``gs:/...`` directory: off for URIs only."""
    default = jax.config.jax_persistent_cache_enable_xla_caches
    with trainer.persistent_compilation_cache("gs://bucket/run/compilation_cache"):
        assert jax.config.jax_compilation_cache_dir == "gs://bucket/run/compilation_cache"
        assert not jax.config.jax_persistent_cache_enable_xla_caches
    assert jax.config.jax_compilation_cache_dir == PROCESS_CACHE
    assert jax.config.jax_persistent_cache_enable_xla_caches == default
    with trainer.persistent_compilation_cache("/shared/run/compilation_cache"):
        assert jax.config.jax_persistent_cache_enable_xla_caches == default


def test_compilation_cache_path(tmp_path):
    with jax_config("jax_compilation_cache_dir", None):  # no JAX_COMPILATION_CACHE_DIR
        assert loop.compilation_cache_path(tmp_path, None) == str(tmp_path / "compilation_cache")
    assert loop.compilation_cache_path(tmp_path, "") is None
    assert loop.compilation_cache_path(tmp_path, "gs://bucket/cache") == "gs://bucket/cache"
    with jax_config("jax_compilation_cache_dir", str(tmp_path / "shared")):  # as the env var
        assert loop.compilation_cache_path(tmp_path, None) == str(tmp_path / "shared")


def _resume_from(reference, tmp_path, steps, **train_kwargs):
    """Copies the reference's checkpoints at ``steps`` into tmp_path and finishes the run."""
    ref_dir, _ = reference
    for step in steps:
        shutil.copytree(ref_dir / f"checkpoint_{step}", tmp_path / f"checkpoint_{step}")
    configure(tmp_path)
    return loop.train(**train_kwargs)


@pytest.mark.parametrize("shape", [(4, 2), (1, 1)], ids=["4x2", "1-device"])
def test_checkpoint_restores_on_other_meshes(reference, tmp_path, shape):
    devices = jax.devices()[: shape[0] * shape[1]]
    mesh = partitioning.make_mesh(data=shape[0], model=shape[1], devices=devices)
    result = _resume_from(reference, tmp_path, [PERIOD], mesh=mesh, eval_data=None)
    assert result.step == STEPS
    expected = losses(reference[0])
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(PERIOD + 1, STEPS + 1))
    np.testing.assert_allclose(
        [resumed[s] for s in sorted(resumed)], [expected[s] for s in sorted(resumed)], rtol=2e-5
    )


def test_corrupt_latest_checkpoint_falls_back(reference, tmp_path, caplog):
    ref_dir, _ = reference
    for step in (PERIOD, STEPS):
        shutil.copytree(ref_dir / f"checkpoint_{step}", tmp_path / f"checkpoint_{step}")
    for file in (tmp_path / f"checkpoint_{STEPS}" / "state").rglob("*"):
        if file.is_file() and file.parent.name == "d":  # the array data files
            file.write_bytes(file.read_bytes()[:7])
    configure(tmp_path)
    with caplog.at_level(logging.WARNING):
        result = loop.train(eval_data=None)
    assert any(str(tmp_path / f"checkpoint_{STEPS}") in r.getMessage() for r in caplog.records)
    assert (tmp_path / f"checkpoint_{STEPS}.corrupt").is_dir()  # kept for inspection
    assert (tmp_path / f"checkpoint_{STEPS}").is_dir()  # redone from checkpoint_6
    assert result.step == STEPS
    expected = losses(ref_dir)
    assert losses(tmp_path) == {s: expected[s] for s in range(PERIOD + 1, STEPS + 1)}


def _is_sharded(sharding) -> bool:
    return not sharding.is_fully_replicated


def test_compiled_shardings_match_the_derived_specs(tmp_path):
    configure(tmp_path)
    step_fns = trainer.Trainer(
        models.Transformer(gin.query_parameter("train.model_config").scoped_configurable_fn()),
        optimizers.make_optimizer,
        optimizers.learning_rate_schedule(),
        partitioning.make_mesh(),
        partitioning.logical_axis_rules(),
        (8, 16),
        seed=0,
    )
    layout = step_fns.layout
    with partitioning.axis_rules_context(step_fns.mesh, step_fns.rules):
        compiled = step_fns.train_step.lower(
            layout.abstract_with_shardings(), step_fns.abstract_batch()
        ).compile()
    state_in, _ = compiled.input_shardings[0]
    state_out, _ = compiled.output_shardings
    shapes = jax.tree.leaves(layout.abstract)
    for got in (state_in, state_out):
        for shape, derived, actual in zip(
            shapes, jax.tree.leaves(layout.shardings), jax.tree.leaves(got), strict=True
        ):
            assert actual.is_equivalent_to(derived, shape.ndim), (actual, derived)

    params = jax.tree_util.tree_leaves_with_path(layout.abstract.params)
    param_shardings = jax.tree.leaves(state_in.params)
    opt = statistics(layout.abstract.opt_state, state_in.opt_state)
    checked = 0
    for (path, param), p_sharding in zip(params, param_shardings, strict=True):
        if not _is_sharded(p_sharding):
            continue
        name = jax.tree_util.keystr(path)
        for opt_path, leaf, o_sharding in opt:
            if opt_path.endswith(name) and leaf.ndim >= param.ndim:
                assert _is_sharded(o_sharding), (opt_path, o_sharding)
                checked += 1
    assert checked >= 3 * sum(_is_sharded(s) for s in param_shardings)  # m, d and e per param


def test_init_shares_its_parameter_draws_across_optimizers(tmp_path, caplog):
    """`Trainer.init_state` equals the one jitted init it replaced, bit for bit and shard for
    shard, and its parameters' draws are a program of their own: a trainer of the same model
    with another optimizer loads them from the persistent compilation cache."""
    configure(tmp_path)
    model = models.Transformer(gin.query_parameter("train.model_config").scoped_configurable_fn())
    mesh, rules = partitioning.make_mesh(), partitioning.logical_axis_rules()

    def build(optimizer):
        schedule = optimizers.learning_rate_schedule()
        return trainer.Trainer(model, optimizer, schedule, mesh, rules, (8, 16), seed=0)

    states = []
    with (
        jax_config("jax_persistent_cache_min_compile_time_secs", 0),
        trainer.persistent_compilation_cache(str(tmp_path / "cache")),
        caplog.at_level(logging.DEBUG, logger="jax._src.compiler"),
    ):
        for optimizer in (optimizers.make_optimizer, lambda schedule, **_: optax.adamw(schedule)):
            caplog.clear()
            step_fns = build(optimizer)
            states.append(step_fns.init_state(3))
            hits = [r.getMessage() for r in caplog.records if "cache hit" in r.getMessage()]
    assert any("'jit_init_params'" in hit for hit in hits), hits  # the second optimizer's
    assert not jax.config.jax_threefry_gpu_kernel_lowering  # the GPU kernels for the draws only

    def single_program(rng):  # the parameters and the optimizer's state in one jitted init
        params = nn.unbox(train_state._init_params(model, rng, step_fns.example))
        return train_state.new_state(params, step_fns.tx)

    with partitioning.axis_rules_context(mesh, rules):
        init = jax.jit(single_program, out_shardings=step_fns.layout.shardings)
        expected = init(jax.random.key(3))
    for got, want in zip(jax.tree.leaves(states[1]), jax.tree.leaves(expected), strict=True):
        assert got.sharding == want.sharding and np.array_equal(got, want)
    for a, b in zip(
        jax.tree.leaves(states[0].params), jax.tree.leaves(expected.params), strict=True
    ):
        assert np.array_equal(a, b)  # the same draws whatever the optimizer


def test_draws_take_the_gpu_kernels_only_where_no_parameter_is_sharded(tmp_path, monkeypatch):
    """Inside `threefry_gpu_kernels` a draw lowers to the CUDA threefry kernel (exported for CUDA
    on this CPU host), and the trainer's init asks for it only where no parameter is sharded:
    the kernel would draw a sharded parameter whole on every device."""
    draw = jax.jit(lambda key: jax.random.normal(key, (4, 4)))

    def lowers_to_the_kernel(enabled):
        with train_state.threefry_gpu_kernels(enabled):
            exported = jax.export.export(draw, platforms=("cuda",))(jax.random.key(0))
        return "cu_threefry2x32" in exported.mlir_module()

    assert lowers_to_the_kernel(True) and not lowers_to_the_kernel(False)

    configure(tmp_path)
    model = models.Transformer(gin.query_parameter("train.model_config").scoped_configurable_fn())
    asked, kernels = [], train_state.threefry_gpu_kernels
    ask = lambda enabled: asked.append(enabled) or kernels(enabled)  # noqa: E731
    monkeypatch.setattr(train_state, "threefry_gpu_kernels", ask)
    for mesh in (partitioning.make_mesh(data=8, model=1), partitioning.make_mesh(data=2, model=4)):
        adamw = lambda schedule, **_: optax.adamw(schedule)  # noqa: E731
        schedule = optimizers.learning_rate_schedule()
        rules = partitioning.logical_axis_rules()
        step_fns = trainer.Trainer(model, adamw, schedule, mesh, rules, (8, 16), seed=0)
        step_fns.init_state(0)
    assert asked == [True, False]  # data parallel: every parameter whole; model=4: sharded


def test_profile_window_writes_a_trace(tmp_path):
    """``train.profile_steps = (2, 2)``: a jax.profiler trace of steps 2-3 in MODEL_DIR/profile/."""
    configure(tmp_path, "TRAIN_STEPS = 4", "train.profile_steps = (2, 2)")
    loop.train(eval_data=None)
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_demo_summary_reads_the_run(reference):
    text = demo.summary(reference[0])
    assert f"at step {STEPS}" in text and "Held-out loss" in text and "model-info.txt" in text
