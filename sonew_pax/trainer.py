"""The training step, as T5X's trainer: a model and an optimizer compiled for a mesh.

`Trainer` holds the jitted train and eval steps, compiled with the layout's shardings and a
donated state. The step is a pure function of ``(state, batch)``: its dropout RNG is folded from
the state's step, so a resumed run draws the same randomness as one that never stopped.
`persistent_compilation_cache` keeps the compiled programs across processes and `CacheHits`
counts those loaded from it. The loop that drives the steps (data, checkpoints, metrics) is
`sonew_pax.loop`.
"""

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sonew_pax import optim, partitioning, train_state
from sonew_pax.models import losses
from sonew_pax.train_state import TrainState

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "weights")


def mean_loss(loss_sum: jax.Array, weight_sum: jax.Array) -> jax.Array:
    """Token-mean loss; 0 when no token has weight."""
    return loss_sum / jnp.maximum(weight_sum, 1.0)


def model_loss(
    model: nn.Module, params: Any, batch: Batch, deterministic: bool, rngs=None
) -> tuple[jax.Array, jax.Array]:
    """``(loss sum, weight sum)`` of ``model`` on ``batch``: the model's final features and
    output projection (``fused_head``) through `losses.fused_cross_entropy`, so no float32
    logits are kept for the backward pass."""
    features, kernel = model.apply(
        {"params": params},
        batch["inputs"],
        deterministic=deterministic,
        rngs=rngs,
        fused_head=True,
    )
    return losses.fused_cross_entropy(features, kernel, batch["targets"], batch["weights"])


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
            return mean_loss(*model_loss(model, params, batch, False, {"dropout": rng}))

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
        return model_loss(model, params, batch, deterministic=True)

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
        shardings in and out are the layout's; metrics come back replicated; compiled with
        ``compiler_options`` (XLA's, for this executable alone; e.g.
        ``optim.kernels.CONCURRENT_OPTIONS``). With ``skip_non_finite`` a non-finite step keeps
        the state (`make_train_step`).
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
        compiler_options: Mapping[str, Any] | None = None,
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
        stacked_axes = partitioning.stacked_axes(boxed)
        self.tx = optimizer(schedule, mesh=mesh, param_specs=param_specs, stacked_axes=stacked_axes)
        self.layout = train_state.derive_layout(boxed, self.tx, param_specs, mesh)
        self._init = train_state.make_init_fn(model, self.tx, self.layout, self.example)
        self.batch_sharding = partitioning.data_sharding(mesh, rules)
        batch_shardings = dict.fromkeys(BATCH_KEYS, self.batch_sharding)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.train_step = jax.jit(
            make_train_step(model, self.tx, schedule, seed, skip_non_finite),
            in_shardings=(self.layout.shardings, batch_shardings),
            out_shardings=(self.layout.shardings, replicated),
            donate_argnums=0,
            compiler_options=dict(compiler_options) if compiler_options else None,
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
        slice of the mesh's size. SONew picks its kernels by this process's backend, so on a GPU
        host build it with ``implementation="xla"`` to export for another platform.
        """
        with partitioning.axis_rules_context(self.mesh, self.rules):
            return jax.export.export(self.train_step, platforms=platforms)(
                self.layout.abstract_with_shardings(), self.abstract_batch()
            )

    def init_state(self, seed: int) -> TrainState:
        """A fresh step-0 state, each array created directly in its shard (one compiled
        initialiser serves every seed)."""
        with partitioning.axis_rules_context(self.mesh, self.rules):
            return self._init(jax.random.key(seed))

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


def _set_jax_config(settings: Mapping[str, Any]) -> None:
    """Applies ``jax.config`` ``settings`` and reopens the persistent compilation cache (JAX
    opens its directory once, at the first compile)."""
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@contextlib.contextmanager
def persistent_compilation_cache(path: str | None):
    """JAX's persistent compilation cache at ``path`` (None: off) while the block runs, then the
    process's own setting again. Only process 0 writes entries (JAX's rule); every process reads,
    so on a shared ``path`` all hosts of a restarted run skip compilation.

    At a URI (``gs://...``) XLA's own caches stay off: JAX would hand XLA ``path``'s autotuning
    subdirectory as a local path (``gs:/...``, under the working directory).

    Args:
      path: the cache's directory (a path or a URI), or None.
    """
    xla_caches = jax.config.jax_persistent_cache_enable_xla_caches
    settings = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_enable_xla_caches": "" if path and "://" in path else xla_caches,
    }
    before = {name: getattr(jax.config, name) for name in settings}
    _set_jax_config(settings)
    try:
        yield
    finally:
        _set_jax_config(before)


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
