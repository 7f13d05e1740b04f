"""Sharded SONew: the update under ``jax.shard_map`` with the parameters' own partition specs.

Each device updates only its block of every parameter, gradient and statistic. The neighbour
products ``g_i g_{i+k}``, the banded solve and ``u = X m`` fetch thin halos from the neighbouring
shards along each sharded axis (``ppermute``, see ``chain.shift``); the grafting norms are local
sums followed by ``psum``, so the lagged graft ratios (``graft_lag``) are replicated. Nothing is
gathered, so the compiled update holds collective-permutes and all-reduces only, and it equals the
single-device update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from sonew_pax.optim.chain import ChainLayout
from sonew_pax.optim.sonew import ScaleBySONewLagState, ScaleBySONewState


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


def _dim_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def chain_layout(
    shape: tuple[int, ...], spec: P | None, mesh: jax.sharding.Mesh, path: str = "<param>"
) -> ChainLayout:
    """The :class:`ChainLayout` of a parameter of ``shape`` partitioned by ``spec`` over ``mesh``.

    Raises:
      ValueError: naming ``path`` when the spec has more entries than the parameter has
        dimensions, names an unknown mesh axis (or one twice), or splits a dimension into shards
        that do not divide it.
    """
    spec = P() if spec is None else spec
    if len(spec) > len(shape):
        raise ValueError(
            f"{path}: partition spec {spec} has {len(spec)} entries but the parameter has rank "
            f"{len(shape)} (shape {tuple(shape)})."
        )
    axes = tuple(_dim_axes(entry) for entry in spec) + ((),) * (len(shape) - len(spec))
    used = [a for dim_axes in axes for a in dim_axes]
    for name in used:
        if name not in mesh.shape:
            raise ValueError(
                f"{path}: partition spec {spec} names mesh axis {name!r}, but the mesh has axes "
                f"{tuple(mesh.shape)}."
            )
    if len(set(used)) != len(used):
        raise ValueError(f"{path}: partition spec {spec} uses a mesh axis more than once.")
    shards = tuple(math.prod(mesh.shape[a] for a in dim_axes) for dim_axes in axes)
    for dim, (size, count) in enumerate(zip(shape, shards, strict=True)):
        if size % count:
            raise ValueError(
                f"{path}: dimension {dim} of size {size} is not divisible by its {count} shards "
                f"(mesh axes {axes[dim]} of spec {spec})."
            )
    return ChainLayout(tuple(shape), axes, shards)


def _band_spec(spec: P) -> P:
    """The spec of a ``(band, *shape)`` statistic: the stacked band axis is never sharded."""
    return P(None, *spec)


def sharded_step(
    tree_step: Callable, mesh: jax.sharding.Mesh, param_specs: Any, check_vma: bool = True
) -> Callable:
    """Wraps SONew's whole-tree step in ``jax.shard_map`` over ``mesh`` with ``param_specs``.

    ``check_vma`` is shard_map's varying-axes type check; SONew turns it off only for its Pallas
    kernels, whose outputs carry no such type. With the fused apply (``apply``: the parameters,
    the scalars ``scale`` and ``weight_decay`` and static per-parameter flags ``decayed``) the
    parameters are sharded like the gradients and the step returns them in place of ``u``.
    """

    def step(updates, m, d, e, ratio, corrections, apply=None):
        specs = jax.tree.map(lambda s: P() if s is None else s, param_specs, is_leaf=_is_spec)
        try:
            paths_and_specs = jax.tree.map_with_path(
                lambda path, g, s: (jax.tree_util.keystr(path), g, s),
                updates,
                specs,
                is_leaf=_is_spec,
            )
        except ValueError as err:
            raise ValueError(
                f"param_specs must have the parameters' tree structure: {err}"
            ) from err
        layouts = jax.tree.map(
            lambda t: chain_layout(jax.numpy.shape(t[1]), t[2], mesh, t[0]),
            paths_and_specs,
            is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str),
        )
        e_specs = jax.tree.map(
            lambda s, ei: ei if isinstance(ei, optax.MaskedNode) else _band_spec(s),
            specs,
            e,
            is_leaf=_is_spec,
        )
        inputs = [updates, m, d, e, ratio, corrections]
        in_specs = [specs, specs, specs, e_specs, P(), (P(), P())]
        if apply is not None:
            inputs += [apply.params, apply.scale, apply.weight_decay]
            in_specs += [specs, P(), P()]

        def local(u, mi, di, ei, ri, c, *applied):
            # The flags are static: they stay out of shard_map's arguments.
            here = None
            if applied:
                params, scale, weight_decay = applied
                here = apply._replace(params=params, scale=scale, weight_decay=weight_decay)
            return tree_step(u, mi, di, ei, ri, c, layouts, here)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=(specs, specs, specs, e_specs, P()),
            check_vma=check_vma,
        )(*inputs)

    return step


def _param_like(node: Any, param_specs: Any) -> bool:
    """Whether ``node`` mirrors the parameters (same tree, MaskedNodes allowed at leaves)."""
    try:
        jax.tree.map(lambda s, x: None, param_specs, node, is_leaf=_is_spec)
    except (ValueError, TypeError):
        return False
    return True


def _leaf_spec(spec: P | None, leaf: Any, extra_leading: int = 0) -> Any:
    if isinstance(leaf, optax.MaskedNode):
        return leaf
    spec = P() if spec is None else spec
    ndim = len(getattr(leaf, "shape", ()))
    if ndim == 0 or ndim < len(spec) + extra_leading:
        return P()  # scalars, and smaller-rank summaries (e.g. factored moments): replicated.
    return P(*([None] * extra_leading), *spec)


def state_partition_specs(opt_state: Any, param_specs: Any) -> Any:
    """Partition specs for an optimizer state whose parameter-shaped parts follow ``param_specs``.

    ``opt_state`` may hold arrays or ``jax.ShapeDtypeStruct`` (e.g. from
    ``jax.eval_shape(tx.init, params)``), and may be the state of an ``optax.chain`` or any
    wrapper (``inject_hyperparams``, ``MultiSteps``, masks). Every sub-tree that mirrors the
    parameters gets the parameters' specs; SONew's stacked off-diagonals get an unsharded leading
    band axis; scalars (SONew's lagged graft ratios among them) and anything else are replicated.
    """
    return _state_specs(opt_state, param_specs)


def _sonew_specs(node: ScaleBySONewState | ScaleBySONewLagState, param_specs: Any) -> Any:
    """The specs of a SONew state's ``count``, ``m``, ``d`` and ``e``, as a ScaleBySONewState."""
    return ScaleBySONewState(
        count=P(),
        m=_state_specs(node.m, param_specs),
        d=_state_specs(node.d, param_specs),
        e=jax.tree.map(
            lambda s, x: _leaf_spec(s, x, extra_leading=1),
            param_specs,
            node.e,
            is_leaf=_is_spec,
        ),
    )


def _state_specs(node: Any, param_specs: Any) -> Any:
    if isinstance(node, ScaleBySONewLagState):
        ratio = jax.tree.map(lambda _: P(), node.ratio)
        return ScaleBySONewLagState(*_sonew_specs(node, param_specs), ratio=ratio)
    if isinstance(node, ScaleBySONewState):
        return _sonew_specs(node, param_specs)
    if _param_like(node, param_specs) and jax.tree.leaves(node):
        return jax.tree.map(_leaf_spec, param_specs, node, is_leaf=_is_spec)
    if isinstance(node, optax.MaskedNode) or node is None:
        return node
    children, treedef = jax.tree.flatten(node, is_leaf=lambda x: x is not node)
    if treedef.num_leaves == 1 and not treedef.children():
        return P()  # a leaf: a scalar or an array unrelated to the parameters.
    return jax.tree.unflatten(treedef, [_state_specs(c, param_specs) for c in children])
