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
transformation's ``apply``. Example::

    tx = sonew_pax.optim.chain(optax.clip_by_global_norm(1.0), sonew_pax.optim.sonew(1e-3))
    params, opt_state = sonew_pax.optim.apply_gradients(tx, grads, opt_state, params)
"""

from __future__ import annotations

from typing import Any, Protocol

import optax


class ApplyFn(Protocol):
    """``(updates, state, params, **extra_args) -> (new params, new state)``."""

    def __call__(
        self, updates: optax.Updates, state: optax.OptState, params: optax.Params, **extra_args: Any
    ) -> tuple[optax.Params, optax.OptState]: ...


class GradientTransformationWithApply(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` (``init``, ``update``) with ``apply``.

    ``apply(updates, state, params)`` returns what ``optax.apply_updates(params, u), new_state``
    returns for ``u, new_state = update(updates, state, params)``, to float rounding.
    """

    apply: ApplyFn

    def __new__(cls, init: optax.TransformInitFn, update: Any, apply: ApplyFn):
        tx = super().__new__(cls, init, update)
        tx.apply = apply
        return tx

    def __getnewargs__(self) -> tuple:
        return (self.init, self.update, self.apply)


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
    :func:`sonew_pax.optim.sonew`).

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
    leading = [optax.with_extra_args_support(t) for t in transforms[:-1]]
    last_apply = transforms[-1].apply

    def apply_fn(updates, state, params, **extra_args):
        states = []
        for tx, tx_state in zip(leading, state[:-1], strict=True):
            updates, tx_state = tx.update(updates, tx_state, params, **extra_args)
            states.append(tx_state)
        params, last_state = last_apply(updates, state[-1], params, **extra_args)
        return params, (*states, last_state)

    return GradientTransformationWithApply(chained.init, chained.update, apply_fn)
