"""The per-tensor numbers of a SONew step: graft ratios and a relative damping's statistics.

Each preconditioned tensor (each stacked one) has one place, its slot, in the state's per-tensor
arrays (``ScaleBySONewLagState.ratio``, ``ScaleBySONewDampedState.diag``): :func:`slot_starts`,
:func:`slot_count`. Each step's local norm pairs merge into the new numbers for every tensor at
once (:func:`norm_results`, one all-reduce across shards), which go back to one array each
(:func:`gathered`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sonew_pax.optim.chain import ChainLayout, merge_pairs, merge_shards
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.dispatch import preconditioned


def slot_starts(layouts: list, precondition_1d: bool) -> list[int | None]:
    """Each tensor's first place in the per-tensor numbers the state keeps (graft_lag's ratios, a
    relative damping's statistics: ``ScaleBySONewDampedState.diag``): the preconditioned tensors
    in the tree's order, ``layout.layers`` places each (one per stacked tensor); ``None`` for the
    others."""
    slots, count = [], 0
    for lay in layouts:
        if preconditioned(len(lay.layer.shape), precondition_1d):
            slots.append(count)
            count += lay.layers
        else:
            slots.append(None)
    return slots


def slot_count(layouts: list[ChainLayout], precondition_1d: bool) -> int:
    """How many per-tensor numbers the state keeps for tensors of ``layouts``
    (:func:`slot_starts`)."""
    return sum(
        lay.layers for lay in layouts if preconditioned(len(lay.layer.shape), precondition_1d)
    )


def slot_values(vector: jax.Array, slot: int, layout: ChainLayout, flat: bool = False) -> jax.Array:
    """A tensor's numbers in ``vector`` (:func:`slot_starts`): a scalar, or for a stack one per
    stacked tensor, shaped to scale the stack (``flat``: as a vector)."""
    return per_tensor(vector[slot : slot + layout.layers], layout, flat)


def per_tensor(values: jax.Array, layout: ChainLayout, flat: bool = False) -> jax.Array:
    """``values``, one per stacked tensor of ``layout``: a scalar when nothing is stacked, else
    ``(layers,)`` (``flat``) or shaped to broadcast over the stack."""
    if not layout.stack:
        return values.reshape(())
    return (
        values
        if flat
        else values.reshape(layout.shape[: layout.stack] + (1,) * len(layout.layer.shape))
    )


def gathered(fresh: list, vector: jax.Array, slots: list, layouts: list) -> jax.Array:
    """The per-tensor numbers the state keeps (graft_lag's ratios, a relative damping's
    statistics): each slot's tensor's new ones (``fresh``, per tensor ``(layers,)``), its old ones
    where it has none (an empty tensor), in one array: XLA writes it in one kernel, where a scalar
    per tensor took a launch each."""
    pieces = [
        vector[slot : slot + lay.layers] if x is None else x.astype(vector.dtype)
        for slot, x, lay in zip(slots, fresh, layouts, strict=True)
        if slot is not None
    ]
    return jnp.concatenate(pieces) if pieces else vector


# Tensors whose norm pairs one reduction merges (over their stacked pairs). The results, graft_lag's
# ratios and a relative damping's statistics, go to one array each (``gathered``).
GRAFT_GROUP = 32


def norm_results(
    parts: list[jax.Array | None], layouts: list, hyper: SONewConfig
) -> tuple[list[jax.Array | None], list[jax.Array | None]]:
    """Each tensor's graft ratio ``||adam|| / ||u||`` (``None`` without grafting) and a relative
    damping's scale for the next step (:func:`_diag_scales`; ``None`` with the absolute one), each
    of shape ``(layout.layers,)``, from ``engine._leaf_steps``' local norm pairs ``(2 pairs,
    tiles)`` of the kernels' tiles, or of the XLA step (a tile per row), ``(layers, 2 pairs,
    tiles)`` for a stack (``engine._stacked_step``); ``None`` for tensors without pairs.

    The pairs are merged over the tiles (``chain.merge_pairs``) for the tensors of one shape
    together (up to ``GRAFT_GROUP`` at a time, over their stacked pairs): a model's update
    launches a few reductions instead of several small ones per tensor. The sharded tensors' pairs
    are then merged across their shards, those of every set of mesh axes in one all-reduce
    (``chain.merge_shards``), and the ratios and scales of each set are computed together.
    """
    # Every tensor's pairs with a leading axis over its stacked tensors (1 when not stacked).
    parts = [
        p if p is None or lay.stack else p[None] for p, lay in zip(parts, layouts, strict=True)
    ]
    groups: dict[tuple, list[int]] = {}
    for k, part in enumerate(parts):
        if part is not None:
            groups.setdefault((part.shape[1:], layouts[k].mesh_axes), []).append(k)
    across: dict[tuple[str, ...], list[tuple[list[int], jax.Array, jax.Array]]] = {}
    for (_, axes), members in groups.items():
        for start in range(0, len(members), GRAFT_GROUP):
            group = members[start : start + GRAFT_GROUP]
            stacked = jnp.concatenate([parts[k] for k in group])  # (tensors, 2 pairs, tiles)
            top, total = merge_pairs(stacked[:, 0::2], stacked[:, 1::2], axis=2)
            across.setdefault(axes, []).append((group, top, total))
    # Every preconditioned tensor has as many pairs (the damping is the update's), so each set's
    # pairs stack as (tensors, pairs).
    pairs = {
        axes: tuple(jnp.concatenate(x) for x in zip(*((t, s) for _, t, s in entries), strict=True))
        for axes, entries in across.items()
    }
    sharded = {axes: pair for axes, pair in pairs.items() if axes}
    if sharded:
        pairs.update(merge_shards(sharded))
    ratios: list[jax.Array | None] = [None] * len(parts)
    scales: list[jax.Array | None] = [None] * len(parts)
    for axes, entries in across.items():
        top, total = pairs[axes]
        members = [k for group, _, _ in entries for k in group]
        counts = [parts[k].shape[0] for k in members]
        norm = top * jnp.sqrt(total)
        ratio = _graft_ratio((norm[:, 0], norm[:, 1])) if hyper.graft == "adam" else None
        sizes = [
            math.prod(layouts[k].layer.shape)
            for k, n in zip(members, counts, strict=True)
            for _ in range(n)
        ]
        scale = _diag_scales(top, total, sizes, hyper)
        start = 0
        for k, n in zip(members, counts, strict=True):
            ratios[k] = None if ratio is None else ratio[start : start + n]
            scales[k] = None if scale is None else scale[start : start + n]
            start += n
    return ratios, scales


def _graft_ratio(grafting: tuple[jax.Array, jax.Array]) -> jax.Array:
    """``||adam|| / ||u||`` from the pair of norms; ``0`` where ``||u|| == 0``, NaN where either
    norm is NaN (a non-finite gradient entry makes the whole tensor's update non-finite)."""
    num, den = grafting
    zero = den == 0
    return jnp.where(zero, 0, num / jnp.where(zero, 1, den))


def _diag_scales(top: jax.Array, total: jax.Array, sizes: list[int], hyper: SONewConfig) -> Any:
    """A relative damping's scales for the next step (``None`` with the absolute one) from the
    merged pairs ``(tensors, pairs)`` of tensors of ``sizes`` elements, whose third is
    ``sqrt(d_hat)``'s: the mean of ``d_hat`` (``"mean"``: ``||sqrt(d_hat)||^2 / size``) or its
    largest entry (``"max"``: the square of the pair's scale)."""
    if hyper.damping == "absolute":
        return None
    square = top[:, 2] * top[:, 2]
    if hyper.damping == "max":
        return square
    return square * total[:, 2] / np.array(sizes).astype(square.dtype)


def grafted(
    u: jax.Array, ratio: jax.Array | None, lagged: Any, layout: ChainLayout, each: bool = False
) -> jax.Array:
    """``u`` scaled by this step's ``ratio``, or with ``graft_lag`` (``lagged``, the previous
    step's, not ``None``) by that one: one number per tensor of ``layout``, flat (``(layers,)``)
    for a stack.

    With ``each`` a stack's tensors are scaled one by one and stacked again, for a stack that is
    unpacked after the step (``stack_by_shape``): XLA then reads each parameter's slice as its
    own product (a slice of a concatenation) and fuses it into that parameter's apply, where a
    product broadcast over the stack is written out whole first (a pass over the stack: 8 B per
    parameter). Without it the program does not grow with the stack's size."""
    if ratio is None:
        return u
    scale = ratio if lagged is None else lagged
    if not (layout.stack and each):
        return u * per_tensor(scale, layout)
    tensors = u.reshape(-1, *u.shape[layout.stack :])
    return jnp.stack([x * s for x, s in zip(tensors, scale, strict=True)]).reshape(u.shape)
