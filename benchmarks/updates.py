"""The optimizer rows of the LM-set benchmarks and their donated, jitted update.

Rows by name (``OPTIMIZERS``): ``adamw`` and the SONew variants of ``SONEW_VARIANTS``:
``sonew_diag``, ``sonew_tridiag``, ``sonew_band4`` with ``implementation="xla"``; the same name
with ``_pallas`` with the Pallas kernels of ``sonew_pax/optim/kernels``; ``_lag`` with
``graft_lag=True``; ``_bf16`` with momentum and off-diagonals stored in bfloat16; and
``sonew_tridiag_auto``, ``sonew(lr, band=1)`` as a user gets it: the kernels on GPU wherever
they apply, XLA elsewhere; ``sonew_tridiag_absolute``, the same with ``damping="absolute"`` (the
default damping is relative: it adds a norm pair to each step and a scalar per tensor to the
state); ``sonew_tridiag_by_shape`` and ``sonew_tridiag_auto_by_shape``, the XLA and the default
rows with ``stack_by_shape=True`` (the parameters of one shape stored and stepped as one stack);
``sonew_tridiag_auto_by_shape_e16``, the same with the off-diagonals ``e`` stored in bfloat16
(4 B/param less traffic, 2 B/param less state); ``_g16`` adds ``stack_dtype=bfloat16`` (the
stacks' copy of the gradients, and their ``u``, in bfloat16): the trainer's gin file;
``sonew_tridiag_auto_e16``, that file's choices per tensor (no stacks to narrow).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from benchmarks import lm_shapes
from sonew_pax import optim

# SONew variants by name: their ``sonew`` keyword arguments (besides the learning rate and decay).
_XLA = {"implementation": "xla"}
_BF16 = {"mu_dtype": jnp.bfloat16, "offdiag_dtype": jnp.bfloat16}
_XLA_VARIANTS = {
    "sonew_diag": {"band": 0, **_XLA},
    "sonew_tridiag": {"band": 1, **_XLA},
    "sonew_band4": {"band": 4, **_XLA},
    "sonew_band4_lag": {"band": 4, "graft_lag": True, **_XLA},
    "sonew_tridiag_bf16": {"band": 1, **_BF16, **_XLA},
    "sonew_diag_lag": {"band": 0, "graft_lag": True, **_XLA},
    "sonew_tridiag_lag": {"band": 1, "graft_lag": True, **_XLA},
    "sonew_tridiag_bf16_lag": {"band": 1, **_BF16, "graft_lag": True, **_XLA},
}
# Every variant also with the Pallas kernels ("<name>_pallas").
SONEW_VARIANTS = _XLA_VARIANTS | {
    f"{name}_pallas": {**kwargs, "implementation": "pallas"}
    for name, kwargs in _XLA_VARIANTS.items()
}
SONEW_VARIANTS["sonew_tridiag_auto"] = {"band": 1}
SONEW_VARIANTS["sonew_tridiag_absolute"] = {"band": 1, "damping": "absolute"}
SONEW_VARIANTS["sonew_tridiag_by_shape"] = {"band": 1, "stack_by_shape": True, **_XLA}
SONEW_VARIANTS["sonew_tridiag_auto_by_shape"] = {"band": 1, "stack_by_shape": True}
SONEW_VARIANTS["sonew_tridiag_auto_e16"] = {
    **SONEW_VARIANTS["sonew_tridiag_auto"],
    "offdiag_dtype": jnp.bfloat16,
}
SONEW_VARIANTS["sonew_tridiag_auto_by_shape_e16"] = {
    **SONEW_VARIANTS["sonew_tridiag_auto_by_shape"],
    "offdiag_dtype": jnp.bfloat16,
}
SONEW_VARIANTS["sonew_tridiag_auto_by_shape_e16_g16"] = {
    **SONEW_VARIANTS["sonew_tridiag_auto_by_shape_e16"],
    "stack_dtype": jnp.bfloat16,
}
OPTIMIZERS = ("adamw", *SONEW_VARIANTS)
LEARNING_RATE = 1e-4
# The random gradient every step applies: N(0, GRAD_STD).
GRAD_STD = 1e-3
WEIGHT_DECAY = 0.1


def make_optimizer(
    name: str, kernel_config: optim.KernelConfig | None = None, stacked_axes=None
) -> optax.GradientTransformation:
    """The optimizer called ``name`` (see OPTIMIZERS); SONew's kernels tuned by
    ``kernel_config`` (default: ``optim.KernelConfig()``), its ``stacked_axes`` as given."""
    if name == "adamw":
        return optax.adamw(LEARNING_RATE, b1=0.9, b2=0.95, weight_decay=WEIGHT_DECAY)
    kwargs = SONEW_VARIANTS[name] | {"kernel_config": kernel_config or optim.KernelConfig()}
    return optim.sonew(
        LEARNING_RATE, weight_decay=WEIGHT_DECAY, stacked_axes=stacked_axes, **kwargs
    )


def make_update(
    tx: optax.GradientTransformation, jit: Callable = jax.jit, **jit_kwargs
) -> Callable:
    """Jitted ``(params, state, grads) -> (params, state)`` (``optim.apply_gradients``), params and
    state donated.

    ``jit`` is ``jax.jit`` or ``common.jit_for``'s; ``jit_kwargs`` (e.g.
    ``in_shardings``, ``out_shardings``) go to it.
    """

    def update(params, state, grads):
        return optim.apply_gradients(tx, grads, state, params)

    return jit(update, donate_argnums=(0, 1), **jit_kwargs)


def lowered_update(name: str, shapes, sharding, platform: str) -> jax.stages.Lowered:
    """The optimizer ``name``'s donated update (:func:`make_update`) lowered on abstract arrays of
    ``shapes`` placed by ``sharding`` (nothing allocated: a compile-only device may compile it),
    its kernels for ``platform`` (``KernelConfig.platform``) and not interpreted."""

    def placed(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
        )

    config = optim.KernelConfig(platform=platform, interpret=False)
    tx = make_optimizer(name, config, lm_shapes.stacked_axes(shapes))
    params, state = placed(shapes), placed(jax.eval_shape(tx.init, shapes))
    return make_update(tx).trace(params, state, params).lower()


def init_state(tx: optax.GradientTransformation, params):
    """``tx.init(params)`` committed to the first device (else the first update compiles twice:
    once for the uncommitted state and once for its committed output)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.jit(tx.init, out_shardings=device)(params)


def fresh_update(tx, shapes, jit: Callable = jax.jit) -> tuple[Callable, tuple]:
    """``tx``'s donated update (:func:`make_update`, jitted by ``jit``) and its first
    ``(params, state)``: random parameters of ``shapes`` and the initial state, on the first
    device."""
    params = lm_shapes.random_tree(shapes, jax.random.key(1))
    return make_update(tx, jit), (params, init_state(tx, params))
