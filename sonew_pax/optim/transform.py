"""optax transformations that can apply themselves: the parameters written in the update's pass.

optax splits an optimizer step in two: ``tx.update`` returns the updates and
``optax.apply_updates`` adds them to the parameters. For a memory-bound update that costs a round
trip: the updates are written out and read back with the parameters (for fp32 tridiag-SONew's
kernels 44 B/param instead of 36). A :class:`GradientTransformationWithApply` also has
``apply(updates, state, params) -> (params, state)``, which returns the parameters and the state
that ``update`` followed by ``optax.apply_updates`` returns (equal to float rounding), possibly in
one pass. It is an ``optax.GradientTransformationExtraArgs``, so whatever takes an optax
transformation (``optax.chain``, ``optax.MultiSteps``, flax's ``TrainState``) takes it and sees
``init`` and ``update`` only.

:func:`apply_gradients` applies through ``apply`` where a transformation has one and through
``optax.apply_updates`` otherwise; :func:`chain` is ``optax.chain`` keeping the last
transformation's ``apply``.

A transformation that only multiplies the gradients by a scalar computed from them
(:class:`GradientScaling`, e.g. :func:`clip_by_global_norm`) costs a pass over the gradients
of its own when it runs before an ``apply``: its product is written out and read back. In a
:func:`chain`'s ``apply`` it passes the scalar on instead (``gradient_scale``), and the
``apply`` that follows multiplies the gradients as it reads them. Example::

    tx = sonew_pax.optim.chain(
        sonew_pax.optim.clip_by_global_norm(1.0), sonew_pax.optim.sonew(1e-3)
    )
    params, opt_state = sonew_pax.optim.apply_gradients(tx, grads, opt_state, params)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax


class ApplyFn(Protocol):
    """``(updates, state, params, **extra_args) -> (new params, new state)``."""

    def __call__(
        self, updates: optax.Updates, state: optax.OptState, params: optax.Params, **extra_args: Any
    ) -> tuple[optax.Params, optax.OptState]: ...


class GradientTransformationWithApply(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` (``init``, ``update``) with ``apply``.

    ``apply(updates, state, params)`` returns what ``optax.apply_updates(params, u), new_state``
    returns for ``u, new_state = update(updates, state, params)``, to float rounding. Given
    ``gradient_scale`` (a scalar, :func:`chain`'s), ``apply`` and ``update`` take the updates
    as :func:`scaled` by it.
    """

    apply: ApplyFn

    def __new__(cls, init: optax.TransformInitFn, update: Any, apply: ApplyFn):
        tx = super().__new__(cls, init, update)
        tx.apply = apply
        return tx

    def __getnewargs__(self) -> tuple:
        return (self.init, self.update, self.apply)


class GradientScaling(optax.GradientTransformationExtraArgs):
    """An optax transformation (stateless: ``optax.EmptyState``) whose ``update`` multiplies
    every update by one scalar, ``factor(updates)`` (:func:`scaled`), which :func:`chain` can
    hand to the ``apply`` that follows (``gradient_scale``) instead of multiplying."""

    factor: Callable[[optax.Updates], jax.Array]

    def __new__(cls, factor: Callable[[optax.Updates], jax.Array]):
        def init_fn(params):
            del params
            return optax.EmptyState()

        def update_fn(updates, state, params=None, **extra_args):
            del params, extra_args
            return scaled(updates, factor(updates)), state

        tx = super().__new__(cls, init_fn, update_fn)
        tx.factor = factor
        return tx

    def __getnewargs__(self) -> tuple:
        return (self.factor,)


def scaled(updates: optax.Updates, factor: jax.Array | None) -> optax.Updates:
    """Each update times ``factor``, rounded to its dtype; ``updates`` where ``factor`` is
    ``None``."""
    if factor is None:
        return updates
    return jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)


def clip_by_global_norm(max_norm: float) -> GradientScaling:
    """``optax.clip_by_global_norm(max_norm)`` as a :class:`GradientScaling`: the updates times
    ``max_norm / norm`` where their global norm is at least ``max_norm``. Its state is optax's
    (``EmptyState``), so checkpoints of either restore into the other; in a :func:`chain` before
    an ``apply`` (SONew's) the product costs no pass of its own.

    Args:
      max_norm: the largest global norm the updates keep.

    Returns:
      A :class:`GradientScaling`.

    References:
      Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural networks",
      ICML 2013; ``optax.clip_by_global_norm``.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be positive, got {max_norm}")

    def factor(updates: optax.Updates) -> jax.Array:
        norm = optax.tree.norm(updates)
        return jnp.where(norm < max_norm, jnp.ones_like(norm), max_norm / norm)

    return GradientScaling(factor)


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer step, through ``tx.apply`` when ``tx`` has it, else ``tx.update`` and
    ``optax.apply_updates``.

    Args:
      tx: an optax transformation, a :class:`GradientTransformationWithApply` or not.
      grads: the gradients, a tree of the parameters' structure.
      opt_state: ``tx``'s state.
      params: the parameters.
      **extra_args: passed on to ``tx.apply`` or ``tx.update`` (optax's extra arguments).

    Returns:
      ``(new params, new state)``: those of ``update`` then ``optax.apply_updates``, to float
      rounding.

    References:
      optax's ``GradientTransformation.update`` and ``optax.apply_updates``.
    """
    if isinstance(tx, GradientTransformationWithApply):
        return tx.apply(grads, opt_state, params, **extra_args)
    updates, opt_state = optax.with_extra_args_support(tx).update(
        grads, opt_state, params, **extra_args
    )
    return optax.apply_updates(params, updates), opt_state


def chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(*transforms)``; when the last one has ``apply``, so does the chain.

    The leading transformations update, the last one applies (e.g. gradient clipping in front of
    :func:`sonew_pax.optim.sonew`). A :class:`GradientScaling` among them multiplies nothing in
    ``apply``: its factor (times any before it) goes to the next transformation's reads, to the
    last one's ``apply`` as ``gradient_scale`` where nothing comes between; a transformation
    between gets the updates multiplied.

    Args:
      *transforms: optax transformations, applied in order.

    Returns:
      ``optax.chain(*transforms)``, as a :class:`GradientTransformationWithApply` whose ``apply``
      is the last transformation's after the others' ``update`` when the last one has ``apply``.

    References:
      ``optax.chain``.
    """
    chained = optax.chain(*transforms)
    if not transforms or not isinstance(transforms[-1], GradientTransformationWithApply):
        return chained
    leading = transforms[:-1]
    last_apply = transforms[-1].apply

    def apply_fn(updates, state, params, *, gradient_scale=None, **extra_args):
        states = []
        for tx, tx_state in zip(leading, state[:-1], strict=True):
            if isinstance(tx, GradientScaling):
                # The factor of the scaled updates: XLA fuses the product into its reduction.
                factor = tx.factor(scaled(updates, gradient_scale))
                gradient_scale = factor if gradient_scale is None else gradient_scale * factor
            else:
                updates, gradient_scale = scaled(updates, gradient_scale), None
                tx = optax.with_extra_args_support(tx)
                updates, tx_state = tx.update(updates, tx_state, params, **extra_args)
            states.append(tx_state)
        if gradient_scale is not None:
            extra_args["gradient_scale"] = gradient_scale
        params, last_state = last_apply(updates, state[-1], params, **extra_args)
        return params, (*states, last_state)

    return GradientTransformationWithApply(chained.init, chained.update, apply_fn)
