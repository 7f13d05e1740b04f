"""The state of :func:`sonew_pax.optim.scale_by_sonew`: every array in its parameter's layout (or,
with ``stack_by_shape``, in its stack's)."""

from typing import Any, NamedTuple

import jax
import optax

from sonew_pax.optim.chain import ChainLayout


class ScaleBySONewState(NamedTuple):
    """State of :func:`scale_by_sonew`; every array has its parameter's layout.

    Attributes:
      count: number of updates so far (int32 scalar).
      m: first moment of the gradients.
      d: diagonal of ``H`` (second moment of the gradients).
      e: ``(band, *shape)``: ``e[k-1]`` at element ``i`` is the moment of ``g_i g_{i+k}``;
        ``optax.MaskedNode()`` for tensors that are not preconditioned (or ``band == 0``).
    """

    count: jax.Array
    m: optax.Updates
    d: optax.Updates
    e: optax.Updates


class ScaleBySONewLagState(NamedTuple):
    """State of :func:`scale_by_sonew` with ``graft_lag=True``.

    A type of its own, so that :class:`ScaleBySONewState` (and checkpoints of it) keep their
    structure when the option is off.

    Attributes:
      count: as in :class:`ScaleBySONewState`.
      m: as in :class:`ScaleBySONewState`.
      d: as in :class:`ScaleBySONewState`.
      e: as in :class:`ScaleBySONewState`.
      ratio: the graft ratio ``||adam|| / ||u||`` of the last step of each preconditioned
        tensor (``0`` before the first step): one ``stats_dtype`` array over those tensors in the
        order of ``jax.tree.leaves(params)`` (tensors that take Adam's direction have no entry),
        which the update writes in one kernel.
    """

    count: jax.Array
    m: optax.Updates
    d: optax.Updates
    e: optax.Updates
    ratio: optax.Updates


class ScaleBySONewDampedState(NamedTuple):
    """State of :func:`scale_by_sonew` with a relative damping (``damping="mean"`` or ``"max"``).

    Attributes:
      count: as in :class:`ScaleBySONewState`.
      m: as in :class:`ScaleBySONewState`.
      d: as in :class:`ScaleBySONewState`.
      e: as in :class:`ScaleBySONewState`.
      ratio: with ``graft_lag``, as in :class:`ScaleBySONewLagState`; otherwise ``None``.
      diag: the mean (or largest entry) of each preconditioned tensor's bias-corrected diagonal
        ``d_hat`` at the last step (``0`` before the first): the next step's damping is ``eps``
        times it. One ``stats_dtype`` array over those tensors in the order of
        ``jax.tree.leaves(params)`` (tensors that take Adam's direction have no entry): the update
        writes it in one kernel, where a scalar per tensor would take one each.
    """

    count: jax.Array
    m: optax.Updates
    d: optax.Updates
    e: optax.Updates
    ratio: optax.Updates
    diag: optax.Updates


@jax.tree_util.register_pytree_with_keys_class
class StackedByShapeState:
    """The state of ``scale_by_sonew(stack_by_shape=True)``: the SONew state of the stored
    entries (``inner``, over ``grouping.Grouping.pack``'s list) and the ``grouping.Grouping``
    that packs them (static metadata, so ``jit`` and checkpoints see only ``inner``'s arrays)."""

    def __init__(self, inner: Any, grouping: Any):
        self.inner = inner
        self.grouping = grouping

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("inner"), self.inner),), self.grouping

    @classmethod
    def tree_unflatten(cls, grouping: Any, children):
        return cls(children[0], grouping)

    def __repr__(self) -> str:
        return f"StackedByShapeState(inner={self.inner!r}, groups={self.grouping.groups})"


class Leaves(NamedTuple):
    """The whole tree's tensors as the engine steps them (gradients, state, chain layouts), each
    field a list in the tree's leaf order."""

    grads: list[jax.Array]
    m: list[jax.Array]
    d: list[jax.Array]
    e: list[Any]  # (band, *shape) arrays, or optax.MaskedNode
    layouts: list[ChainLayout]
