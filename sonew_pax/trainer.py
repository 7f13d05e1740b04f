"""The training step and the training loop.

`Trainer` holds the jitted train and eval steps, compiled with the layout's shardings and a
donated state. The step is a pure function of ``(state, batch)``: its dropout RNG is folded from
the state's step, so a resumed run draws the same randomness as one that never stopped
(ARCHITECTURE decision 6).

`train` (gin-configurable, what ``python -m sonew_pax.train`` calls) wires the parts together in
the order of a T5X run: mesh and rules (`partitioning`), data, state layout and initialisation
(`train_state`), restore (`checkpoints`), then the loop: step, write metrics (`metrics`), evaluate
every EVAL_PERIOD, save every CHECKPOINT_PERIOD, on SIGTERM and at the end. Compiled programs go
to JAX's persistent compilation cache (default ``MODEL_DIR/compilation_cache``), so that a resumed
run loads its train step instead of compiling it again. `configured_trainer` builds the `Trainer`
that `train` would from the gin config alone, reading no data: `Trainer.export_train_step` then
lowers its step for other platforms (tests/test_tpu_export.py exports it for TPU on a CPU host).
"""

import contextlib
import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import optax
from absl import logging
from etils import epath
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sonew_pax import (
    checkpoints,
    metrics,
    optim,
    optimizers,
    partitioning,
    paths,
    run_lock,
    train_state,
)
from sonew_pax.errors import ConfigError, RunError
from sonew_pax.models import Transformer, TransformerConfig, flops_per_token
from sonew_pax.train_state import TrainState

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "weights")
COMPILATION_CACHE = "compilation_cache"


def weighted_cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sum over tokens of ``weights * -log p(target)`` (in float32), and the sum of weights."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    weights = weights.astype(jnp.float32)
    return jnp.sum(losses * weights), jnp.sum(weights)


def mean_loss(loss_sum: jax.Array, weight_sum: jax.Array) -> jax.Array:
    """Token-mean loss; 0 when no token has weight."""
    return loss_sum / jnp.maximum(weight_sum, 1.0)


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: Callable[[jax.Array], jax.Array],
    seed: int,
    skip_non_finite: bool = False,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """``(state, batch) -> (state + 1 step, metrics)``; metrics: loss, learning_rate, grad_norm.

    The learning rate reported is the one this step applied (``schedule(state.step)``), and
    grad_norm is the global norm before any clipping. With ``skip_non_finite``, a step whose loss
    or grad_norm is not finite keeps the parameters and optimizer state as they were (only the
    step count advances, so the next step reads the next batch): the update runs inside a
    ``lax.cond``, which costs no pass over memory (a ``where`` over the state would read and write
    it all again) but may make a GPU wait for the predicate before launching the update.
    """
    base_rng = jax.random.key(seed)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        rng = jax.random.fold_in(base_rng, state.step)

        def loss_fn(params):
            logits = model.apply(
                {"params": params},
                batch["inputs"],
                deterministic=False,
                rngs={"dropout": rng},
            )
            return mean_loss(*weighted_cross_entropy(logits, batch["targets"], batch["weights"]))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grad_norm = optax.tree.norm(grads)

        def update() -> tuple[Any, Any]:
            # Where tx can apply itself (SONew), its kernels may write the parameters in place.
            return optim.apply_gradients(tx, grads, state.opt_state, state.params)

        if skip_non_finite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            params, opt_state = jax.lax.cond(
                finite, update, lambda: (state.params, state.opt_state)
            )
        else:
            params, opt_state = update()
        metrics = {
            "loss": loss,
            "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
            "grad_norm": grad_norm,
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def make_eval_step(model: nn.Module) -> Callable[[Any, Batch], tuple[jax.Array, jax.Array]]:
    """``(params, batch) -> (loss sum, weight sum)``, deterministic (no dropout)."""

    def eval_step(params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        logits = model.apply({"params": params}, batch["inputs"], deterministic=True)
        return weighted_cross_entropy(logits, batch["targets"], batch["weights"])

    return eval_step


class Trainer:
    """One model, optimizer and mesh: the state layout and the compiled train and eval steps.

    Construction derives everything from shapes alone: parameter specs from the model's logical
    axis names and ``rules`` (checked against the mesh), the optimizer (which may need the mesh
    and specs), and the state layout. Nothing is allocated until `init_state` or a restore.

    Attributes:
      layout: the `StateLayout` (abstract state, specs, shardings).
      tx: the optimizer.
      train_step: jitted ``(state, batch) -> (state, metrics)``; the input state is donated, its
        shardings in and out are the layout's; metrics come back replicated. With
        ``concurrent_launches`` it is jitted by ``optim.concurrent_jit`` (see `train`); with
        ``skip_non_finite`` a non-finite step keeps the state (`make_train_step`).
      eval_step: jitted ``(params, batch) -> (loss sum, weight sum)``.
      batch_sharding: how the global [batch, length] arrays are laid out over the mesh.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., optax.GradientTransformation],
        schedule: Callable[[jax.Array], jax.Array],
        mesh: Mesh,
        rules: partitioning.Rules,
        batch_shape: tuple[int, int],
        seed: int,
        concurrent_launches: bool = False,
        skip_non_finite: bool = False,
    ):
        self.model = model
        self.mesh = mesh
        self.rules = rules
        self.example = jax.ShapeDtypeStruct(batch_shape, jnp.int32)
        with partitioning.axis_rules_context(mesh, rules):
            boxed = train_state.abstract_boxed_params(model, self.example)
        param_specs = partitioning.param_specs(boxed, rules)
        partitioning.validate_specs(boxed, param_specs, mesh)
        self.tx = optimizer(schedule, mesh=mesh, param_specs=param_specs)
        self.layout = train_state.derive_layout(boxed, self.tx, param_specs, mesh)
        self.batch_sharding = partitioning.data_sharding(mesh, rules)
        batch_shardings = dict.fromkeys(BATCH_KEYS, self.batch_sharding)
        replicated = NamedSharding(mesh, PartitionSpec())
        jit = optim.concurrent_jit if concurrent_launches else jax.jit
        self.train_step = jit(
            make_train_step(model, self.tx, schedule, seed, skip_non_finite),
            in_shardings=(self.layout.shardings, batch_shardings),
            out_shardings=(self.layout.shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            make_eval_step(model),
            in_shardings=(self.layout.shardings.params, batch_shardings),
            out_shardings=replicated,
        )

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes, dtypes and shardings of one global batch (for ``train_step.lower``)."""
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
        shape = self.example.shape
        return {
            key: jax.ShapeDtypeStruct(shape, dtypes[key], sharding=self.batch_sharding)
            for key in BATCH_KEYS
        }

    def export_train_step(self, platforms: Sequence[str]) -> jax.export.Exported:
        """`train_step` lowered for ``platforms`` (e.g. ``("tpu",)``) from abstract inputs.

        The step is traced as `step` runs it (under the mesh and the logical axis rules) on the
        layout's abstract state and `abstract_batch`, both carrying their shardings, so the
        exported module has the step's in and out shardings; nothing is allocated or compiled.
        The platforms need not be this host's: a CPU host proves the step lowers for a TPU
        slice of the mesh's size.
        """
        with partitioning.axis_rules_context(self.mesh, self.rules):
            return jax.export.export(self.train_step, platforms=platforms)(
                self.layout.abstract_with_shardings(), self.abstract_batch()
            )

    def init_state(self, seed: int) -> TrainState:
        """A fresh step-0 state, each array created directly in its shard."""
        init = train_state.make_init_fn(self.model, self.tx, self.layout, self.example)
        with partitioning.axis_rules_context(self.mesh, self.rules):
            return init(jax.random.key(seed))

    def global_batch(self, local_batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """This host's rows of the batch -> global arrays sharded like ``batch_sharding``."""
        return {
            key: jax.make_array_from_process_local_data(self.batch_sharding, local_batch[key])
            for key in BATCH_KEYS
        }

    def step(self, state: TrainState, local_batch: Mapping[str, Any]) -> tuple[TrainState, Metrics]:
        """One optimizer step on this host's share of the global batch."""
        with partitioning.axis_rules_context(self.mesh, self.rules):
            return self.train_step(state, self.global_batch(local_batch))

    def evaluate(self, params: Any, local_batches: Iterable[Mapping[str, Any]]) -> dict[str, float]:
        """Token-mean held-out loss and its perplexity over all ``local_batches``."""
        loss_sum, weight_sum = 0.0, 0.0
        with partitioning.axis_rules_context(self.mesh, self.rules):
            for local_batch in local_batches:
                batch_loss, batch_weight = self.eval_step(params, self.global_batch(local_batch))
                loss_sum += float(batch_loss)
                weight_sum += float(batch_weight)
        loss = loss_sum / max(weight_sum, 1.0)
        return {"eval_loss": loss, "eval_perplexity": float(jnp.exp(loss))}


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How `train` ended: the step reached, its loss, and whether SIGTERM stopped it early."""

    step: int
    loss: float | None
    preempted: bool


def _write_text(path: epath.Path, text: str) -> None:
    """Writes ``text`` to ``path`` from process 0 only, atomically (`paths.write_text_atomic`)."""
    if jax.process_index() == 0:
        paths.write_text_atomic(path, text)


def _due(step: int, period: int, last_step: int) -> bool:
    """Whether a ``period``-ic action falls on ``step`` (always on the last step)."""
    return step == last_step or (period > 0 and step % period == 0)


def gin_bindings(config: str) -> dict[str, str]:
    """``binding -> value`` of a gin config text (``config.gin``), continuation lines joined."""
    bindings: dict[str, str] = {}
    key = None
    for line in config.splitlines():
        if not line.strip() or line.startswith(("#", "import ", "from ")):
            key = None
        elif line[0].isspace() and key is not None:
            bindings[key] += " " + line.strip()
        elif " = " in line:
            key, value = line.split(" = ", 1)
            bindings[key] = value.strip().removesuffix("\\").strip()
    return bindings


def config_differences(saved: str, current: str, limit: int = 12) -> list[str]:
    """Lines naming the bindings whose value differs between two gin configs (changed values
    first, then bindings only one has), at most ``limit``; MODEL_DIR is left out."""
    before, after = gin_bindings(saved), gin_bindings(current)
    changed = [f"{k} = {before[k]} (checkpoints) / {after[k]} (this run)"
               for k in sorted(before.keys() & after.keys())
               if before[k] != after[k] and k != "MODEL_DIR"]  # fmt: skip
    only = [f"{k} = {before[k]} (checkpoints only)" for k in sorted(before.keys() - after.keys())]
    only += [f"{k} = {after[k]} (this run only)" for k in sorted(after.keys() - before.keys())]
    return (changed + only)[:limit]


def _restore_or_init(
    step_fns: Trainer, ckpts: checkpoints.Checkpoints, batches: Any, seed: int
) -> tuple[TrainState, dict[str, Any]]:
    """The newest restorable checkpoint (moving ``batches`` to its position) and the trainer's
    counters saved with it, else a new state and ``{}``.

    Raises:
      checkpoints.ConfigMismatchError: the checkpoints hold other arrays; the message adds the
        settings that differ from the run's ``config.gin``.
    """
    try:
        restored = ckpts.restore_latest(step_fns.layout.abstract_with_shardings())
    except checkpoints.ConfigMismatchError as error:
        saved = ckpts.model_dir / "config.gin"
        if not saved.exists():
            raise
        lines = config_differences(saved.read_text(), gin.operative_config_str())
        raise checkpoints.ConfigMismatchError(
            f"{error}\nSettings that differ from {saved}:\n  " + "\n  ".join(lines)
        ) from None
    if restored is None:
        logging.info("Initialising a new run in %s", ckpts.model_dir)
        return step_fns.init_state(seed), {}
    batches.set_state(restored.data)
    logging.info("Resumed %s from step %d", ckpts.model_dir, int(restored.state.step))
    return restored.state, restored.run


NON_FINITE_POLICIES = ("stop", "skip")


class NonFiniteError(RunError):
    """A step's loss, gradient norm or learning rate is not finite (or the rate is negative)."""


class NonFiniteGuard:
    """The host side of `train`'s ``non_finite`` policy.

    `check` reads each step's metrics where the loop already brings them to the host (one step
    behind the device, and before every save), so the guard adds no device work and no wait.
    Under ``"stop"`` a non-finite loss or grad_norm ends the run; nothing is saved after it (the
    loop checks a step's metrics before saving its state). Under ``"skip"`` the train step has
    kept the state (`make_train_step`'s ``skip_non_finite``) and the guard counts the step, up to
    ``max_skipped_steps`` in the whole run (the count is saved in checkpoints). A learning rate
    that is not finite or negative ends the run under both.

    Args:
      policy: ``"stop"`` or ``"skip"``.
      max_skipped_steps: ``"skip"``: the most steps skipped before the run stops.
      skipped_steps: steps already skipped (from the checkpoint resumed).
      newest_checkpoint: returns where the run can be resumed from, for the message.
    """

    def __init__(
        self,
        policy: str,
        max_skipped_steps: int,
        skipped_steps: int,
        newest_checkpoint: Callable[[], str],
    ):
        self.policy = policy
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps = skipped_steps
        self._newest_checkpoint = newest_checkpoint

    def metrics(self) -> dict[str, float]:
        """What the guard adds to each step's metrics: ``skipped_steps`` (the run's total) under
        ``"skip"``."""
        return {"skipped_steps": self.skipped_steps} if self.policy == "skip" else {}

    def run_state(self) -> dict[str, int]:
        """The counters a checkpoint keeps."""
        return {"skipped_steps": self.skipped_steps}

    def check(self, step: int, scalars: Mapping[str, float]) -> NonFiniteError | None:
        """Counts a skipped step and returns the error that ends the run, if any (the caller
        raises it after writing the step's metrics)."""
        rate = scalars["learning_rate"]
        if not (math.isfinite(rate) and rate >= 0):
            return NonFiniteError(
                f"step {step}: the learning rate is {rate}; it must be finite and >= 0 (check "
                f"the schedule). {self._newest_checkpoint()}"
            )
        bad = [f"{name} {scalars[name]}" for name in ("loss", "grad_norm")
               if not math.isfinite(scalars[name])]  # fmt: skip
        if not bad:
            return None
        what = f"step {step}: non-finite {' and '.join(bad)}"
        if self.policy == "stop":
            return NonFiniteError(
                f"{what}. The run stopped; nothing after the last finite checkpoint was saved. "
                f"{self._newest_checkpoint()} Lower the learning rate (or raise warmup, clip "
                f"harder), or set train.non_finite = 'skip' to skip such steps."
            )
        self.skipped_steps += 1
        if self.skipped_steps > self.max_skipped_steps:
            return NonFiniteError(
                f"{what}: {self.skipped_steps} steps skipped, more than "
                f"train.max_skipped_steps = {self.max_skipped_steps}. The run stopped. "
                f"{self._newest_checkpoint()}"
            )
        logging.warning(
            "%s: step skipped (parameters and optimizer state kept; %d of at most %d).",
            what,
            self.skipped_steps,
            self.max_skipped_steps,
        )
        return None


def check_settings(**settings: Any) -> None:
    """Raises `ConfigError` naming the first of `train`'s settings that cannot work (before the
    run writes anything). ``settings``: `train`'s arguments of the same names."""
    at_least = {
        "train_steps": ("TRAIN_STEPS", 1),
        "batch_size": ("BATCH_SIZE", 1),
        "seq_len": ("SEQ_LEN", 1),
        "checkpoint_period": ("CHECKPOINT_PERIOD", 0),
        "eval_period": ("EVAL_PERIOD", 0),
        "log_every": (None, 1),
        "max_skipped_steps": (None, 0),
        "keep_checkpoints": (None, 1),
    }
    for name, (macro, least) in at_least.items():
        value = settings[name]
        if value is None and name == "keep_checkpoints":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            label = f"{macro} (train.{name})" if macro else f"train.{name}"
            raise ConfigError(f"{label} must be an integer >= {least}, got {value!r}.")
    window = settings["profile_steps"]
    if window is not None and (
        len(window) != 2 or not all(isinstance(n, int) and n >= 1 for n in window)
    ):
        raise ConfigError(f"train.profile_steps must be (START, COUNT), both >= 1; got {window!r}.")
    policy = settings["non_finite"]
    if policy not in NON_FINITE_POLICIES:
        raise ConfigError(f"train.non_finite must be one of {NON_FINITE_POLICIES}, got {policy!r}.")


def compilation_cache_path(model_dir: epath.Path, setting: str | None) -> str | None:
    """Where a run's compiled programs are cached (`train`'s ``compilation_cache_dir``): None
    picks JAX's own cache directory if it has one (``JAX_COMPILATION_CACHE_DIR``), else
    ``model_dir/compilation_cache``; ``""`` turns the cache off (None is returned); anything
    else is the directory (a path or a URI)."""
    if setting is None:
        return jax.config.jax_compilation_cache_dir or str(model_dir / COMPILATION_CACHE)
    return setting or None


@contextlib.contextmanager
def persistent_compilation_cache(path: str | None):
    """JAX's persistent compilation cache at ``path`` (None: off) while the block runs, then the
    process's own setting again. Only process 0 writes entries (JAX's rule); every process reads,
    so on a shared ``path`` all hosts of a restarted run skip compilation.

    At a URI (``gs://...``) XLA's own caches stay off: JAX would hand XLA ``path``'s autotuning
    subdirectory as a local path (``gs:/...``, under the working directory)."""
    before = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_enable_xla_caches,
    )
    xla_caches = "" if path and "://" in path else before[1]
    if (path, xla_caches) == before:
        yield
        return

    def use(directory: str | None, xla: str | None) -> None:
        jax.config.update("jax_persistent_cache_enable_xla_caches", xla)
        compilation_cache.set_cache_dir(directory)
        compilation_cache.reset_cache()  # the cache opens its directory once; reopen it

    use(path, xla_caches)
    try:
        yield
    finally:
        use(*before)


# The event JAX's compiler records each time it loads an executable from the persistent cache.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CacheHits:
    """Within ``with``: counts (``count``) the executables JAX loads from its persistent
    compilation cache, by JAX's monitoring event for each."""

    def __init__(self):
        self.count = 0

    def _listen(self, event: str, **_) -> None:
        self.count += event == _CACHE_HIT_EVENT

    def __enter__(self) -> "CacheHits":
        jax.monitoring.register_event_listener(self._listen)
        return self

    def __exit__(self, *exc_info) -> None:
        jax.monitoring.unregister_event_listener(self._listen)


@contextlib.contextmanager
def first_step_log():
    """Logs before and after the block (a run's first step, whose metrics it waits for) how long
    it took, compiling included, and how many programs JAX loaded from the persistent compilation
    cache meanwhile: on a GPU, SONew's kernels make the first step of a large model take minutes
    to compile, and a resumed run should load it instead (:func:`persistent_compilation_cache`)."""
    logging.info("First step: compiling the train step")
    start = time.perf_counter()
    with CacheHits() as hits:
        yield
    logging.info(
        "First step done in %.1f s, compiling included (%d program(s) loaded from the "
        "compilation cache)",
        time.perf_counter() - start,
        hits.count,
    )


def _peak_flops() -> float | None:
    """This run's devices' peak bf16 FLOP/s (`metrics.peak_flops`); says once when unknown."""
    kind = jax.devices()[0].device_kind
    peak = metrics.peak_flops(kind)
    if peak is None:
        logging.info("MFU is not reported: no peak FLOP/s is known for device kind %r.", kind)
    return peak


def _check_vocab(model_config: TransformerConfig, batches: Any) -> None:
    """Fails early when the tokenizer emits ids the model's embedding cannot hold."""
    vocab = batches.tokenizer.vocab_size
    if model_config.vocab_size < vocab:
        raise ValueError(
            f"TransformerConfig.vocab_size={model_config.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({vocab})"
        )


def _make_trainer(
    *,
    model_config: TransformerConfig,
    optimizer: Callable[..., Any],
    learning_rate: optimizers.Schedule,
    batch_size: int,
    seq_len: int,
    seed: int,
    concurrent_launches: bool,
    non_finite: str,
    mesh: Mesh | None,
) -> Trainer:
    """`train`'s `Trainer` for its arguments of the same names, on the gin-configured mesh
    (unless ``mesh`` is given) and logical axis rules; fails first if ``batch_size`` does not
    split over the mesh (`partitioning.check_batch_size`)."""
    mesh = partitioning.make_mesh() if mesh is None else mesh
    rules = partitioning.logical_axis_rules()
    partitioning.check_batch_size(batch_size, mesh, rules)
    return Trainer(
        Transformer(model_config),
        optimizer,
        learning_rate,
        mesh,
        rules,
        (batch_size, seq_len),
        seed,
        concurrent_launches,
        skip_non_finite=non_finite == "skip",
    )


def configured_trainer(mesh: Mesh | None = None) -> Trainer:
    """The `Trainer` that `train` builds from the parsed gin config: its model, optimizer,
    schedule, mesh, logical axis rules, batch shape and step options, from ``train.*``'s
    bindings (and `train`'s defaults). Reads no data and allocates nothing, so a host without
    the run's devices can lower its train step (`Trainer.export_train_step`).

    Args:
      mesh: the device mesh; default `partitioning.make_mesh()` as configured in gin.

    Raises:
      ConfigError: a ``train`` argument the trainer needs is not bound, or the batch size does
        not split over the mesh.
    """
    defaults = {name: p.default for name, p in inspect.signature(train).parameters.items()}
    arguments = defaults | gin.get_bindings(train)
    names = inspect.signature(_make_trainer).parameters.keys() - {"mesh"}
    unbound = sorted(name for name in names if arguments[name] is gin.REQUIRED)
    if unbound:
        raise ConfigError(f"the gin config binds no {', '.join(f'train.{n}' for n in unbound)}.")
    return _make_trainer(mesh=mesh, **{name: arguments[name] for name in names})


@gin.configurable(denylist=["mesh"])
def train(
    *,
    model_dir: str = gin.REQUIRED,
    train_steps: int = gin.REQUIRED,
    batch_size: int = gin.REQUIRED,
    seq_len: int = gin.REQUIRED,
    checkpoint_period: int = gin.REQUIRED,
    eval_period: int = gin.REQUIRED,
    seed: int = gin.REQUIRED,
    model_config: TransformerConfig = gin.REQUIRED,
    learning_rate: optimizers.Schedule = gin.REQUIRED,
    train_data: Callable[..., Any] = gin.REQUIRED,
    eval_data: Callable[..., list[Any]] | None = None,
    optimizer: Callable[..., Any] = optimizers.make_optimizer,
    keep_checkpoints: int | None = None,
    log_every: int = 10,
    compilation_cache_dir: str | None = None,
    concurrent_launches: bool = False,
    non_finite: str = "stop",
    max_skipped_steps: int = 10,
    profile_steps: tuple[int, int] | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> RunResult:
    """Trains ``model_config``'s Transformer for ``train_steps`` steps, resuming from MODEL_DIR.

    Args:
      model_dir: the run directory (checkpoints, metrics, config): a local path or a gs://,
        s3:// or az:// URI (its filesystem package is checked before anything else runs).
      train_steps: total number of optimizer steps.
      batch_size: global batch size in sequences (each process reads its share).
      seq_len: tokens per sequence.
      checkpoint_period: save every this many steps (and at the end, and on SIGTERM).
      eval_period: evaluate every this many steps (and at the end); 0: only at the end.
      seed: seeds parameter init, dropout (folded with the step) and data order.
      model_config: the `TransformerConfig`.
      learning_rate: the schedule (also logged per step).
      train_data: ``f(seq_len=, batch_size=, seed=, process_index=, process_count=)`` -> iterator
        of this process's batches with ``get_state()``/``set_state()`` and ``tokenizer``.
      eval_data: ``f(seq_len=, batch_size=, process_index=, process_count=)`` -> list of this
        process's held-out batches; None: no evaluation.
      optimizer: ``f(schedule, mesh=, param_specs=)`` -> optax transformation.
      keep_checkpoints: how many checkpoints to keep (None: all).
      log_every: steps between progress lines.
      compilation_cache_dir: JAX's persistent compilation cache for this run: None (default)
        ``JAX_COMPILATION_CACHE_DIR`` if set, else ``MODEL_DIR/compilation_cache``; ``""`` off;
        else that directory. A resumed run (or a rerun of the same config) then loads its
        compiled train step: JAX keys entries by program, devices, flags and versions (and by
        the cache's own path, where it keeps XLA's autotuning cache: a moved cache misses),
        and caches compilations longer than ``jax_persistent_cache_min_compile_time_secs`` (1 s).
        Trust the directory as you trust the code: JAX runs what it loads from it.
      concurrent_launches: compile the train step with ``optim.concurrent_jit``: on a GPU its
        independent kernels may run at the same time, and banded SONew (band >= 2) walks longer
        chunks for it. On an H100 band 4's update of the 335M LM set then took 2.80x AdamW's
        device time instead of 3.84x, and its 350m train step 117.3 ms instead of 121.1; it
        costs the step memory (XLA keeps apart the buffers of kernels that may overlap: the
        band-4 step peaked at 40.5 GiB instead of 36.5). ``configs/optimizers/sonew_band4.gin``
        shows the binding; see benchmarks/README.md, version 22.
      non_finite: what a step with a non-finite loss or gradient norm does (`NonFiniteGuard`):
        ``"stop"`` (default) ends the run with `NonFiniteError` naming the step, having saved
        nothing after it; ``"skip"`` keeps the parameters and optimizer state for that step,
        counts it (``skipped_steps`` in the metrics) and ends the run after
        ``max_skipped_steps`` such steps.
      max_skipped_steps: see ``non_finite``.
      profile_steps: ``(START, COUNT)``: trace steps ``START .. START + COUNT - 1`` with
        ``jax.profiler`` into ``MODEL_DIR/profile/`` (process 0; `metrics.ProfileWindow`);
        None (default): no trace.
      mesh: the device mesh; default `partitioning.make_mesh()` as configured in gin.

    Returns:
      A `RunResult`.

    Raises:
      ConfigError: a setting that cannot work (named), before anything is written.
      run_lock.RunLockedError: another run is using ``model_dir``.
      checkpoints.ConfigMismatchError: ``model_dir``'s checkpoints hold another model or
        optimizer.
      NonFiniteError: the run diverged (see ``non_finite``).
    """
    check_settings(
        train_steps=train_steps,
        batch_size=batch_size,
        seq_len=seq_len,
        checkpoint_period=checkpoint_period,
        eval_period=eval_period,
        log_every=log_every,
        max_skipped_steps=max_skipped_steps,
        keep_checkpoints=keep_checkpoints,
        non_finite=non_finite,
        profile_steps=profile_steps,
    )
    model_dir_path = paths.model_dir(model_dir)  # fails here if a cloud backend is missing
    step_fns = _make_trainer(  # shapes only: nothing is allocated or written yet
        model_config=model_config,
        optimizer=optimizer,
        learning_rate=learning_rate,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        concurrent_launches=concurrent_launches,
        non_finite=non_finite,
        mesh=mesh,
    )
    data_args = {
        "seq_len": seq_len,
        "batch_size": batch_size,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
    }
    batches = train_data(seed=seed, **data_args)
    _check_vocab(model_config, batches)
    eval_batches = None if eval_data is None else eval_data(**data_args)
    stop = checkpoints.StopSignal()
    cache = compilation_cache_path(model_dir_path, compilation_cache_dir)
    with (
        run_lock.held(model_dir_path),
        stop.installed(),
        persistent_compilation_cache(cache),
        # Closed on any exit, errors included: pending checkpoint writes finish.
        contextlib.closing(checkpoints.Checkpoints(model_dir_path, keep=keep_checkpoints)) as ckpts,
    ):
        state, run_counters = _restore_or_init(step_fns, ckpts, batches, seed)
        _write_text(model_dir_path / "config.gin", gin.operative_config_str())
        _write_text(model_dir_path / "model-info.txt", train_state.describe(step_fns.layout))

        step = int(state.step)
        writer = metrics.MetricsWriter(
            model_dir_path, enabled=jax.process_index() == 0, resume_step=step
        )
        progress = metrics.Progress(
            train_steps,
            batch_size * seq_len,
            log_every,
            start_step=step,
            devices=jax.device_count(),
            flops_per_token=flops_per_token(model_config, seq_len),
            peak_flops_per_device=_peak_flops(),
        )
        guard = NonFiniteGuard(
            non_finite,
            max_skipped_steps,
            run_counters.get("skipped_steps", 0),
            ckpts.describe_newest,
        )

        def record(step: int, step_metrics: Mapping[str, Any]) -> float:
            """Writes one step's metrics (now on the host) and applies the guard; its loss."""
            scalars = {name: float(value) for name, value in step_metrics.items()}
            error = guard.check(step, scalars)
            writer.write(step, {**scalars, **guard.metrics()})
            if error is not None:
                raise error
            return scalars["loss"]

        profile = metrics.ProfileWindow(profile_steps, model_dir_path, jax.process_index() == 0)
        pending: tuple[int, dict[str, Any]] | None = None
        loss = None
        preempted = stop.received
        first = step
        try:
            while step < train_steps and not preempted:
                profile.before(step + 1)
                with first_step_log() if step == first else contextlib.nullcontext():
                    state, step_metrics = step_fns.step(state, next(batches))
                    if step == first:
                        jax.block_until_ready(step_metrics)
                step += 1
                profile.after(step, step_metrics)
                if pending is not None:  # the previous step's metrics are ready by now
                    record(*pending)
                pending = (step, dict(step_metrics))
                if eval_batches is not None and _due(step, eval_period, train_steps):
                    pending[1].update(step_fns.evaluate(state.params, eval_batches))
                if progress.due(step):
                    loss = float(step_metrics["loss"])
                    pending[1].update(progress.log(step, loss))
                    writer.flush(force=False)
                preempted = stop.received or ckpts.reached_preemption(step)
                if preempted or _due(step, checkpoint_period, train_steps):
                    # The log on disk reaches at least the checkpoint, and the guard has seen
                    # the step whose state is saved.
                    loss, pending = record(*pending), None
                    writer.flush()
                    ckpts.save(state, batches.get_state(), guard.run_state())
        finally:  # also on errors: end a trace, flush the metrics
            profile.close()
            writer.close()
        _write_text(model_dir_path / "config.gin", gin.operative_config_str())
    if preempted:
        logging.warning("Stopped by preemption at step %d; rerun to resume.", step)
    return RunResult(step=step, loss=loss, preempted=preempted)
