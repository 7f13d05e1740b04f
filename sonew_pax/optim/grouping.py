"""Tensors of one shape stored and stepped as one stack: ``scale_by_sonew(stack_by_shape=True)``.

A model that keeps each layer's tensors apart gives the update a step per tensor, so its compile
time, its launches and the host's dispatch grow with the depth. Stacked on a new leading axis (the
layout flax's ``nn.scan`` gives its parameters), the tensors of one shape are one stacked tensor
for the engine (``stacked_axes``): traced, fused and launched once per stack. Each stacked tensor
keeps its own chain, damping and graft ratio, so the update equals the unstacked one.

What it trades: the state is stored stacked (a :class:`Grouping` says which parameters share an
entry), and every step stacks the gradients of each entry (one copy of ``g``, 8 B/param of traffic)
and slices the updates back (fused into their consumers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import sharding
from sonew_pax.optim.transform import scaled


@dataclasses.dataclass(frozen=True)
class Grouping:
    """Which parameters share a stored entry, and how the engine sees each entry. Static
    (hashable): it travels as pytree metadata.

    Attributes:
      treedef: the parameters' structure.
      groups: ``groups[k]`` lists the leaf indices (in ``treedef``'s order) stacked, in that order,
        into entry ``k``; an entry of one index holds that parameter as it is.
      stacks: each entry's stacked leading axes (``scale_by_sonew``'s ``stacked_axes``): its
        parameters' own, one more for a stacked entry.
      shapes: each entry's members' shape (one shape per entry, by construction).
      split_first: whether each entry's members are split across devices along their first axis
        (their spec's first entry), which decides how they are stacked (:func:`_stacked`).
    """

    treedef: Any
    groups: tuple[tuple[int, ...], ...]
    stacks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    split_first: tuple[bool, ...]

    def pack(
        self,
        tree: Any,
        dtype: Any = None,
        stack: Callable[[int, list], jax.Array | None] | None = None,
        scale: jax.Array | None = None,
    ) -> list:
        """``tree`` (the parameters' structure) as the list of stored entries, the stacked ones
        in ``dtype`` where given (``None``: their members'), cast as they are copied: by
        ``stack(k, members)`` for entry ``k`` where given and it returns a stack (which then
        applies ``scale`` itself), else by XLA (:func:`_stacked`). Every leaf is taken times
        ``scale`` where given (``transform.scaled``).

        Raises:
          ValueError: ``tree``'s structure or a leaf's shape is not the parameters' at ``init``
            (a gradient that does not match the parameters the state was built for).
        """
        structure = jax.tree.structure(tree)
        if structure != self.treedef:
            raise ValueError(
                "stack_by_shape: the tree's structure differs from the parameters' the state was "
                f"initialised with:\n  got      {structure}\n  expected {self.treedef}"
            )
        leaves = structure.flatten_up_to(tree)
        for group, shape in zip(self.groups, self.shapes, strict=True):
            wrong = [i for i in group if jnp.shape(leaves[i]) != shape]
            if wrong:
                flat = jax.tree_util.tree_flatten_with_path(tree)[0]
                found = ", ".join(
                    f"{jax.tree_util.keystr(flat[i][0])} {jnp.shape(leaves[i])}" for i in wrong
                )
                raise ValueError(
                    f"stack_by_shape: the parameters had shape {shape} at init; got {found}"
                )

        def entry(k: int, members: list, split: bool) -> jax.Array:
            copied = None if stack is None or len(members) == 1 else stack(k, members)
            if copied is not None:
                return copied
            members = [scaled(x, scale) for x in members]
            return members[0] if len(members) == 1 else _stacked(members, split, dtype)

        return [
            entry(k, [leaves[i] for i in group], split)
            for k, (group, split) in enumerate(zip(self.groups, self.split_first, strict=True))
        ]

    def unpack(self, entries: list) -> Any:
        """The inverse of :meth:`pack`: each stacked entry sliced back into its parameters."""
        leaves: list[Any] = [None] * self.treedef.num_leaves
        for group, entry in zip(self.groups, entries, strict=True):
            if len(group) == 1:
                leaves[group[0]] = entry
            else:
                for position, index in enumerate(group):
                    leaves[index] = entry[position]
        return self.treedef.unflatten(leaves)

    def specs(self, param_specs: Any) -> list | None:
        """Each entry's ``PartitionSpec`` from the parameters' (``None``: ``None``): a stacked
        entry's leading axis is unsharded."""
        if param_specs is None:
            return None
        specs = self.treedef.flatten_up_to(param_specs)
        return [P(None, *(specs[g[0]] or ())) if len(g) > 1 else specs[g[0]] for g in self.groups]


def _stacked(tensors: list, split_first: bool, dtype: Any = None) -> jax.Array:
    """``tensors`` (of one shape) stacked on a new leading axis, in ``dtype`` (``None``: theirs;
    XLA fuses the cast into the copy). Matrices and wider are concatenated along their first
    axis and reshaped, which keeps the stack row-major on a TPU: XLA's TPU compiler lays a
    ``jnp.stack`` out with the stack axis on the sublanes, where each tensor's slice is strided
    and the stacked step moves more bytes than per tensor. Tensors split along their first axis
    (``split_first``) are stacked as they are: concatenated along a split axis, their rows would
    move between devices."""
    if dtype is not None:
        tensors = [x.astype(dtype) for x in tensors]
    if tensors[0].ndim < 2 or split_first:
        return jnp.stack(tensors)
    return jnp.concatenate(tensors).reshape(len(tensors), *tensors[0].shape)


def grouping_of(params: Any, stacked_axes: Any, param_specs: Any) -> Grouping:
    """The :class:`Grouping` of ``params``: parameters with the same shape, dtype, stacked axes
    (``stacked_axes``, resolved by ``sharding.stack_counts``) and layout share an entry, in the
    order of their first member. The layout is ``param_specs``' where given, else the one each
    array carries (``sharding.specs_of``), so that no stack mixes layouts."""
    leaves, treedef = jax.tree.flatten(params)
    counts = treedef.flatten_up_to(sharding.stack_counts(stacked_axes, params))
    specs = sharding.specs_of(params) if param_specs is None else param_specs
    members: dict[tuple, list[int]] = {}
    for index, (leaf, count, spec) in enumerate(
        zip(leaves, counts, treedef.flatten_up_to(specs), strict=True)
    ):
        key = (jnp.shape(leaf), jnp.dtype(leaf.dtype), count, _spec_key(spec, jnp.ndim(leaf)))
        members.setdefault(key, []).append(index)
    groups = tuple(tuple(group) for group in members.values())
    stacks = tuple(counts[g[0]] + (len(g) > 1) for g in groups)
    shapes = tuple(tuple(jnp.shape(leaves[g[0]])) for g in groups)
    split = tuple(key[3][:1] not in ((), (None,)) for key in members)
    return Grouping(treedef, groups, stacks, shapes, split)


def _spec_key(spec: Any, ndim: int) -> tuple:
    """A spec as a hashable tuple padded to the array's rank (``None`` and ``P()`` alike)."""
    entries = tuple(spec or ())
    return entries + (None,) * (ndim - len(entries))
