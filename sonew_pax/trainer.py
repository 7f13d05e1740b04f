"""The training step and the training loop.

`Trainer` holds the jitted train and eval steps, compiled with the layout's shardings and a
donated state. The step is a pure function of ``(state, batch)``: its dropout RNG is folded from
the state's step, so a resumed run draws the same randomness as one that never stopped
(ARCHITECTURE decision 6).

`train` (gin-configurable, what ``python -m sonew_pax.train`` calls) wires the parts together in
the order of a T5X run: mesh and rules (`partitioning`), data, state layout and initialisation
(`train_state`), restore (`checkpoints`), then the loop: step, write metrics (`metrics`), evaluate
every EVAL_PERIOD, save every CHECKPOINT_PERIOD, on SIGTERM and at the end.
"""

import dataclasses
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sonew_pax import checkpoints, metrics, optimizers, partitioning, train_state
from sonew_pax.models import Transformer, TransformerConfig
from sonew_pax.train_state import StateLayout, TrainState

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "weights")


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
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """``(state, batch) -> (state + 1 step, metrics)``; metrics: loss, learning_rate, grad_norm.

    The learning rate reported is the one this step applied (``schedule(state.step)``), and
    grad_norm is the global norm before any clipping.
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
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
            "grad_norm": optax.global_norm(grads),
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
    """Compiled train and eval steps for one model, optimizer and mesh.

    Attributes:
      train_step: jitted ``(state, batch) -> (state, metrics)``; the input state is donated, its
        shardings in and out are the layout's; metrics come back replicated.
      eval_step: jitted ``(params, batch) -> (loss sum, weight sum)``.
      batch_sharding: how the global [batch, length] arrays are laid out over the mesh.
    """

    def __init__(
        self,
        model: nn.Module,
        tx: optax.GradientTransformation,
        schedule: Callable[[jax.Array], jax.Array],
        layout: StateLayout,
        mesh: Mesh,
        rules: partitioning.Rules,
        seed: int,
    ):
        self.mesh = mesh
        self.rules = rules
        self.layout = layout
        self.batch_sharding = partitioning.data_sharding(mesh, rules)
        batch_shardings = dict.fromkeys(BATCH_KEYS, self.batch_sharding)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.train_step = jax.jit(
            make_train_step(model, tx, schedule, seed),
            in_shardings=(layout.shardings, batch_shardings),
            out_shardings=(layout.shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            make_eval_step(model),
            in_shardings=(layout.shardings.params, batch_shardings),
            out_shardings=replicated,
        )

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


def _write_text(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` from process 0 only."""
    if jax.process_index() == 0:
        path.write_text(text)


def _due(step: int, period: int, last_step: int) -> bool:
    """Whether a ``period``-ic action falls on ``step`` (always on the last step)."""
    return step == last_step or (period > 0 and step % period == 0)


def _check_vocab(model_config: TransformerConfig, batches: Any) -> None:
    """Fails early when the tokenizer emits ids the model's embedding cannot hold."""
    vocab = batches.tokenizer.vocab_size
    if model_config.vocab_size < vocab:
        raise ValueError(
            f"TransformerConfig.vocab_size={model_config.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({vocab})"
        )


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
    mesh: jax.sharding.Mesh | None = None,
) -> RunResult:
    """Trains ``model_config``'s Transformer for ``train_steps`` steps, resuming from MODEL_DIR.

    Args:
      model_dir: the run directory (checkpoints, metrics, config).
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
      mesh: the device mesh; default `partitioning.make_mesh()` as configured in gin.

    Returns:
      A `RunResult`.
    """
    stop = checkpoints.StopSignal()
    with stop.installed():
        model_dir_path = pathlib.Path(model_dir)
        model_dir_path.mkdir(parents=True, exist_ok=True)
        mesh = partitioning.make_mesh() if mesh is None else mesh
        rules = partitioning.logical_axis_rules()
        model = Transformer(model_config)
        example = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        data_args = {
            "seq_len": seq_len,
            "batch_size": batch_size,
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
        }
        batches = train_data(seed=seed, **data_args)
        _check_vocab(model_config, batches)
        eval_batches = None if eval_data is None else eval_data(**data_args)

        with partitioning.axis_rules_context(mesh, rules):
            boxed = train_state.abstract_boxed_params(model, example)
            param_specs = partitioning.param_specs(boxed, rules)
            partitioning.validate_specs(boxed, param_specs, mesh)
            tx = optimizer(learning_rate, mesh=mesh, param_specs=param_specs)
            layout = train_state.derive_layout(boxed, tx, param_specs, mesh)
            step_fns = Trainer(model, tx, learning_rate, layout, mesh, rules, seed)
            ckpts = checkpoints.Checkpoints(model_dir_path, keep=keep_checkpoints)
            restored = ckpts.restore_latest(layout.abstract_with_shardings())
            if restored is None:
                state = train_state.make_init_fn(model, tx, layout, example)(jax.random.key(seed))
                logging.info("Initialised a new run in %s", model_dir_path)
            else:
                state, data_state = restored
                batches.set_state(data_state)
                logging.info("Resumed %s from step %d", model_dir_path, int(state.step))

        _write_text(model_dir_path / "config.gin", gin.operative_config_str())
        _write_text(model_dir_path / "model-info.txt", train_state.describe(layout))

        step = int(state.step)
        writer = metrics.MetricsWriter(
            model_dir_path, enabled=jax.process_index() == 0, resume_step=step
        )
        progress = metrics.Progress(train_steps, batch_size * seq_len, log_every, start_step=step)
        pending: tuple[int, dict[str, Any]] | None = None
        loss = None
        preempted = stop.received
        while step < train_steps and not preempted:
            state, step_metrics = step_fns.step(state, next(batches))
            step += 1
            if pending is not None:  # the previous step's metrics are ready by now
                writer.write(*pending)
            pending = (step, dict(step_metrics))
            if eval_batches is not None and _due(step, eval_period, train_steps):
                pending[1].update(step_fns.evaluate(state.params, eval_batches))
            if progress.due(step):
                loss = float(step_metrics["loss"])
                progress.log(step, loss)
            preempted = stop.received or ckpts.reached_preemption(step)
            if preempted or _due(step, checkpoint_period, train_steps):
                ckpts.save(state, batches.get_state())
        if pending is not None:
            writer.write(*pending)
            loss = float(pending[1]["loss"])
        writer.close()
        ckpts.close()
    _write_text(model_dir_path / "config.gin", gin.operative_config_str())
    if preempted:
        logging.warning("Stopped by preemption at step %d; rerun to resume.", step)
    return RunResult(step=step, loss=loss, preempted=preempted)


