"""Gin-configurable optimizers and learning-rate schedules for the trainer.

Every optimizer factory here has the same shape,
``factory(learning_rate, *, mesh, param_specs, stacked_axes) -> optax.GradientTransformation``,
with its hyper-parameters bound in gin (``configs/optimizers/*.gin``). The trainer calls
`make_optimizer` with the learning-rate schedule (which it also logs) once it knows the mesh, the
parameter specs and which parameters stack layers (``stacked_axes``, from the logical "layers"
axis of a model with ``scan_layers``), because SONew's sharded update needs all three; the others
use only the last, for their weight-decay mask. `make_optimizer` adds global-norm gradient
clipping in front.

Weight decay is applied to matrices only (two or more dimensions per layer): norm scales and
biases are not decayed, as in most LM recipes.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax

from sonew_pax import optim
from sonew_pax.errors import ConfigError
from sonew_pax.optim.config import as_dtype

Schedule = Callable[[Any], Any]
OptimizerFactory = Callable[..., optax.GradientTransformation]

SCHEDULE_KINDS = ("cosine", "linear", "rsqrt", "constant")


def matrices(stacked_axes: Any = None) -> Callable[[Any], Any]:
    """Weight-decay mask: True for parameters with two or more dimensions besides their
    ``stacked_axes`` (``optim.sonew``'s: a scanned model's layer axis)."""

    def mask(params: Any) -> Any:
        stacks = optim.stack_counts(stacked_axes, params)
        return jax.tree.map(lambda p, k: p.ndim - k >= 2, params, stacks)

    return mask


@gin.configurable
def learning_rate_schedule(
    peak_value: float = gin.REQUIRED,
    warmup_steps: int = 0,
    decay: str = "cosine",
    total_steps: int = gin.REQUIRED,
    end_factor: float = 0.0,
) -> Schedule:
    """Linear warmup from 0 to ``peak_value`` over ``warmup_steps``, then a decay.

    Args:
      peak_value: the learning rate reached at the end of warmup.
      warmup_steps: length of the linear warmup.
      decay: "cosine" or "linear" (to ``end_factor * peak_value`` at ``total_steps``), "rsqrt"
        (``peak * sqrt(warmup / step)``, the T5 inverse square root) or "constant".
      total_steps: the run's length (bind to ``%TRAIN_STEPS``).
      end_factor: final learning rate as a fraction of the peak, for cosine and linear.

    Returns:
      An optax schedule, step -> learning rate.
    """
    if decay not in SCHEDULE_KINDS:
        raise ValueError(f"decay={decay!r}, expected one of {SCHEDULE_KINDS}")
    if not total_steps >= 1:
        raise ConfigError(
            "TRAIN_STEPS (learning_rate_schedule.total_steps) must be at least 1, "
            f"got {total_steps}."
        )
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be in [0, total_steps={total_steps}]")
    warmup = optax.linear_schedule(0.0, peak_value, max(warmup_steps, 1))
    decay_steps = max(total_steps - warmup_steps, 1)
    end_value = end_factor * peak_value
    if decay == "cosine":
        after = optax.cosine_decay_schedule(peak_value, decay_steps, alpha=end_factor)
    elif decay == "linear":
        after = optax.linear_schedule(peak_value, end_value, decay_steps)
    elif decay == "rsqrt":
        offset = max(warmup_steps, 1)

        def after(step):
            return peak_value * jnp.sqrt(offset / (jnp.maximum(step, 0) + offset))
    else:
        after = optax.constant_schedule(peak_value)
    if warmup_steps == 0:
        return after
    return optax.join_schedules([warmup, after], [warmup_steps])


@gin.configurable
def adamw(
    learning_rate: Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    stacked_axes: Any = None,
) -> optax.GradientTransformation:
    """optax.adamw with decoupled weight decay on matrices (mesh and specs are unused)."""
    del mesh, param_specs
    return optax.adamw(
        learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=matrices(stacked_axes)
    )


@gin.configurable
def adafactor(
    learning_rate: Schedule,
    *,
    factored: bool = True,
    decay_rate: float = 0.8,
    min_dim_size_to_factor: int = 128,
    multiply_by_parameter_scale: bool = False,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    weight_decay: float = 0.0,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    stacked_axes: Any = None,
) -> optax.GradientTransformation:
    """optax.adafactor; ``factored=False`` keeps the full second moment (mesh, specs unused)."""
    del mesh, param_specs
    return optax.adafactor(
        learning_rate,
        factored=factored,
        decay_rate=decay_rate,
        min_dim_size_to_factor=min_dim_size_to_factor,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        clipping_threshold=clipping_threshold,
        momentum=momentum,
        weight_decay_rate=weight_decay or None,
        weight_decay_mask=matrices(stacked_axes),
    )


def adam_decay_rate(step: jax.Array, b2: float) -> jax.Array:
    """Adafactor's second-moment decay at ``step`` (0-based) that makes it Adam's.

    ``b2 (1 - b2^t) / (1 - b2^(t+1))`` turns Adafactor's running average of ``g^2`` into Adam's
    bias-corrected EMA (Adafactor's "adam" decay method); it is 0 at the first step.

    Args:
      step: the update's index, counted from 0.
      b2: Adam's decay of the second moment.

    Returns:
      The decay, a float32 scalar.
    """
    t = jnp.asarray(step, jnp.float32)
    return b2 * (1.0 - b2**t) / (1.0 - b2 ** (t + 1.0))


@gin.configurable
def adafactor_unfactored(
    learning_rate: Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-30,
    clipping_threshold: float = 1.0,
    weight_decay: float = 1e-3,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    stacked_axes: Any = None,
) -> optax.GradientTransformation:
    """The SONew paper's Adafactor baseline: full second moment, Adam's decay, momentum.

    Per parameter: ``u = g / sqrt(v)`` with ``v`` the bias-corrected EMA (decay ``b2``,
    `adam_decay_rate`) of ``g^2 + eps``; ``u`` clipped to a root mean square of at most
    ``clipping_threshold`` per tensor; its EMA with ``b1`` (no bias correction) plus
    ``weight_decay * param`` on matrices; the step is that times ``-learning_rate``. Unlike
    `adafactor` with ``factored=False`` (optax's), the second moment decays as Adam's rather than
    as ``1 - step^-0.8``, and the learning rate scales the momentum and the weight decay as well.
    Mesh and specs are unused.

    Args:
      learning_rate: the schedule.
      b1: decay of the momentum of the clipped updates.
      b2: Adam's decay of the second moment.
      eps: added to ``g^2`` before its average.
      clipping_threshold: the largest root mean square of a tensor's update before momentum.
      weight_decay: decoupled weight decay of matrices (`matrices`), scaled by the learning rate.
      mesh: unused.
      param_specs: unused.
      stacked_axes: leading axes that stack layers, for the weight-decay mask.

    Returns:
      The optax transformation.
    """
    del mesh, param_specs
    return optax.chain(
        optax.scale_by_factored_rms(
            factored=False, decay_rate=b2, epsilon=eps, decay_rate_fn=adam_decay_rate
        ),
        optax.clip_by_block_rms(clipping_threshold),
        optax.ema(b1, debias=False),
        optax.add_decayed_weights(weight_decay, matrices(stacked_axes)),
        optax.scale_by_learning_rate(learning_rate),
    )


# Parameters that Muon leaves to AdamW whatever their shape: the token embedding, the learned
# positions and the output projection (Muon's recipe: orthogonalised steps for hidden matrices).
MUON_EXCLUDED = ("embedding", "pos_embedding", "output")
# Kernels whose input is their first two axes, (heads, kv): the attention output projection.
_TWO_AXIS_INPUTS = ("out",)


def muon_dimension_numbers(stacked_axes: Any = None) -> Callable[[Any], Any]:
    """Which parameters Muon orthogonalises, and as which matrix: a function of the parameters.

    A hidden kernel with two or more dimensions besides its ``stacked_axes`` (a scanned model's
    layer axis, which Muon treats as a batch of matrices) is the matrix from its input axes to its
    output axes: the attention output projection ``(heads, kv, embed)`` reduces over its first two
    axes, every other kernel (``(embed, heads, kv)``, ``(embed, mlp)``, ``(mlp, embed)``) over its
    first. Norm scales and `MUON_EXCLUDED` get None: AdamW steps them.

    Args:
      stacked_axes: leading axes that stack layers (the trainer's, from the logical "layers" axis).

    Returns:
      ``params -> tree`` of ``optax.contrib.MuonDimensionNumbers`` or None, as
      ``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` takes it.
    """

    def dimension_numbers(params: Any) -> Any:
        stacks = optim.stack_counts(stacked_axes, params)

        def leaf(path, p, stack):
            names = [getattr(key, "key", None) for key in path]
            if p.ndim - stack < 2 or any(name in MUON_EXCLUDED for name in names):
                return None
            inputs = 2 if names[-1] in _TWO_AXIS_INPUTS else 1
            axes = tuple(range(stack, p.ndim))
            return optax.contrib.MuonDimensionNumbers(axes[:inputs], axes[inputs:])

        return jax.tree_util.tree_map_with_path(leaf, params, stacks)

    return dimension_numbers


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(as_dtype(dtype), jnp.floating)
    except TypeError:  # not a dtype at all
        return False


def cast_to(dtype: Any, select: Callable[[Any], Any]) -> optax.GradientTransformation:
    """The updates cast to ``dtype`` where ``select(updates)`` has an entry that is not None (as
    `muon_dimension_numbers` marks Muon's matrices), the others as they come. Stateless."""

    def update(updates, state, params=None):
        del params
        cast = lambda u, entry: u if entry is None else u.astype(dtype)  # noqa: E731
        return jax.tree.map(cast, updates, select(updates)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@gin.configurable
def muon(
    learning_rate: Schedule,
    *,
    beta: float = 0.95,
    ns_steps: int = 5,
    consistent_rms: float | None = 0.2,
    weight_decay: float = 0.1,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    ns_dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    stacked_axes: Any = None,
) -> optax.GradientTransformation:
    """optax.contrib.muon on the hidden matrices, AdamW on the rest (`muon_dimension_numbers`).

    With ``consistent_rms`` (0.2, Liu et al. 2025) Muon's steps have AdamW's root-mean-square
    size, so AdamW's learning rate and weight decay carry over; both branches follow
    ``learning_rate``. ``weight_decay`` applies to Muon's matrices; the AdamW branch (embedding,
    output projection, norm scales) is not decayed (optax's default for it). Mesh and specs are
    unused: the Newton-Schulz iteration runs on whole matrices, which XLA gathers on a sharded
    mesh.

    Args:
      ns_dtype: the dtype of the Newton-Schulz iteration (None: the gradients', float32 in the
        trainer). optax's muon iterates in its momentum's dtype, so with ``ns_dtype`` Muon's
        gradients are cast to it and its momentum kept in it (optax's ``mu_dtype``, which also
        stores the AdamW branch's first moment in it): bfloat16 is the reference implementation's
        precision, its matrix products several times as fast on a GPU's tensor cores as float32's.

    References:
      Jordan et al., Muon (2024); Liu et al., "Muon is Scalable for LLM Training" (2025).
    """
    del mesh, param_specs
    if ns_dtype is not None and not _is_float_dtype(ns_dtype):
        raise ConfigError(f"muon.ns_dtype = {ns_dtype!r}: expected a float dtype, e.g. 'bfloat16'")
    dimension_numbers = muon_dimension_numbers(stacked_axes)
    tx = optax.contrib.muon(
        learning_rate,
        ns_steps=ns_steps,
        beta=beta,
        eps=adam_eps,
        weight_decay=weight_decay,
        weight_decay_mask=matrices(stacked_axes),
        mu_dtype=ns_dtype,
        adam_b1=adam_b1,
        adam_b2=adam_b2,
        muon_weight_dimension_numbers=dimension_numbers,
        consistent_rms=consistent_rms,
    )
    return tx if ns_dtype is None else optax.chain(cast_to(ns_dtype, dimension_numbers), tx)


def _with_defaults(fn: Callable[..., Any], **defaults: Any) -> Callable[..., Any]:
    """``fn`` with other defaults for some of its keyword arguments, and ``fn``'s signature.

    The signature (``__signature__``, which gin reads) is ``fn``'s with those defaults, so gin
    binds, and checks the names of, exactly ``fn``'s arguments, none restated here.

    Args:
      fn: the function wrapped.
      **defaults: argument name -> its default in the wrapper.

    Returns:
      A function that calls ``fn`` with ``defaults`` under the arguments it is given.

    Raises:
      TypeError: ``fn`` has no argument of a name in ``defaults``.
    """
    signature = inspect.signature(fn)
    unknown = defaults.keys() - signature.parameters.keys()
    if unknown:
        raise TypeError(f"{fn.__qualname__} has no argument {', '.join(sorted(unknown))}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **(defaults | kwargs))

    wrapper.__signature__ = signature.replace(
        parameters=[
            p.replace(default=defaults.get(p.name, p.default))
            for p in signature.parameters.values()
        ]
    )
    return wrapper


# The default weight-decay mask of `sonew`: `matrices` of its own ``stacked_axes``.
MATRICES = "matrices"


def _sonew(learning_rate: Schedule, **kwargs: Any) -> optax.GradientTransformation:
    """``optim.sonew``, its ``mask`` `MATRICES` by default (`matrices` of its ``stacked_axes``)."""
    if kwargs.get("mask", MATRICES) == MATRICES:
        kwargs["mask"] = matrices(kwargs.get("stacked_axes"))
    return optim.sonew(learning_rate, **kwargs)


_sonew.__signature__ = inspect.signature(optim.sonew)
# SONew (`sonew_pax.optim.sonew`, every argument bindable in gin), with weight decay on matrices
# only. Dtype arguments take names in gin (``sonew.mu_dtype = "bfloat16"``).
sonew = gin.external_configurable(
    _with_defaults(_sonew, mask=MATRICES), name="sonew", module=__name__
)
# SONew's kernels' configuration, for ``sonew.kernel_config = @KernelConfig()``: e.g. band 1's TPU
# kernel (``sonew.implementation = "pallas"``; on a TPU ``KernelConfig.platform`` is "tpu").
KernelConfig = gin.external_configurable(optim.KernelConfig, name="KernelConfig", module=__name__)


@gin.configurable
def make_optimizer(
    schedule: Schedule,
    *,
    factory: OptimizerFactory = gin.REQUIRED,
    clip_norm: float | None = 1.0,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    stacked_axes: Any = None,
) -> optax.GradientTransformation:
    """Global-norm clipping (when ``clip_norm`` is set) followed by the configured optimizer,
    keeping its fused apply (``optim.chain``), into which the clip's factor folds: SONew
    multiplies the gradients as it reads them (``optim.clip_by_global_norm``, optax's clip).
    Optimizers without an apply (optax's) take ``optax.clip_by_global_norm``, whose product
    XLA fuses into their update."""
    tx = factory(schedule, mesh=mesh, param_specs=param_specs, stacked_axes=stacked_axes)
    if clip_norm is None:
        return tx
    if not isinstance(tx, optim.GradientTransformationWithApply):
        return optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    return optim.chain(optim.clip_by_global_norm(clip_norm), tx)
