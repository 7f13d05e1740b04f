"""Sharded SONew: the update under ``jax.shard_map`` with the parameters' own partition specs.

Each device updates only its block of every parameter, gradient and statistic. The neighbour
products ``g_i g_{i+k}``, the banded solve and ``u = X m`` fetch thin halos from the neighbouring
shards along each sharded axis (``ppermute``, see ``chain.shift``); the grafting norms are local
pairs merged across shards after one ``psum`` (``chain.merge_shards``), so the lagged graft
ratios (``graft_lag``) and a relative damping's scales are replicated. Nothing is
gathered, so the compiled update holds collective-permutes and all-reduces only, and it equals the
single-device update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sonew_pax.optim.chain import ChainLayout
from sonew_pax.optim.state import (
    ScaleBySONewDampedState,
    ScaleBySONewLagState,
    ScaleBySONewState,
    StackedByShapeState,
)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


def _is_spec_or_sharding(x: Any) -> bool:
    return _is_spec(x) or isinstance(x, NamedSharding)


def named_sharding(x: Any) -> NamedSharding | None:
    """The ``NamedSharding`` an array carries: a concrete array's, or, inside ``jit`` on a mesh
    with Explicit axes, its type's; ``None`` for anything else (single-device arrays, tracers on
    Auto meshes, whose layout XLA decides, NumPy arrays, numbers)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.sharding if isinstance(x.sharding, NamedSharding) else None
    try:
        found = jax.typeof(x).sharding
    except (TypeError, AttributeError):
        return None
    if isinstance(found, NamedSharding) and AxisType.Explicit in found.mesh.axis_types:
        return found
    return None


def _padded(spec: P | None, ndim: int) -> tuple:
    """``spec``'s entries, one per dimension (``None`` for the unnamed trailing ones)."""
    entries = tuple(P() if spec is None else spec)
    return entries + (None,) * (ndim - len(entries))


def specs_of(tree: Any) -> Any:
    """Each array's ``PartitionSpec`` as the array carries it.

    E.g. ``sonew(lr, mesh=mesh, param_specs=specs_of(params))`` for parameters already placed on
    ``mesh``.

    Args:
      tree: a pytree of arrays (or of ``jax.ShapeDtypeStruct`` with a sharding).

    Returns:
      A tree of ``tree``'s structure: each leaf's ``PartitionSpec`` (`named_sharding`'s, padded to
      the leaf's rank), ``P()`` where the leaf carries no ``NamedSharding``.

    References:
      JAX's ``jax.sharding.NamedSharding`` and ``PartitionSpec`` (distributed arrays guide).
    """

    def spec(x: Any) -> P:
        found = named_sharding(x)
        return P() if found is None else P(*_padded(found.spec, jax.numpy.ndim(x)))

    return jax.tree.map(spec, tree)


def as_specs(param_specs: Any, mesh: Any) -> tuple[Any, Any]:
    """``(mesh, specs)`` from ``param_specs`` given as ``PartitionSpec``s (or ``None``) with
    ``mesh``, or as ``NamedSharding``s (then ``mesh`` may be ``None``: theirs is used).

    Raises:
      ValueError: naming a parameter whose ``NamedSharding`` is on another mesh.
    """
    if param_specs is None:
        return mesh, None
    named = jax.tree_util.tree_leaves_with_path(
        param_specs, is_leaf=lambda x: isinstance(x, NamedSharding)
    )
    for path, leaf in named:
        if not isinstance(leaf, NamedSharding):
            continue
        if mesh is None:
            mesh = leaf.mesh
        elif dict(leaf.mesh.shape) != dict(mesh.shape):
            raise ValueError(
                f"param_specs{jax.tree_util.keystr(path)} is a NamedSharding on mesh "
                f"{dict(leaf.mesh.shape)}, but mesh is {dict(mesh.shape)}."
            )
    specs = jax.tree.map(
        lambda x: x.spec if isinstance(x, NamedSharding) else x,
        param_specs,
        is_leaf=_is_spec_or_sharding,
    )
    return mesh, specs


def state_shardings(params: Any, mesh: Any, param_specs: Any) -> tuple[list, Any]:
    """Where the state of each parameter (a list, in leaf order) and the state's scalars live,
    for concrete parameters: by ``mesh`` and ``param_specs`` where given (replicated scalars),
    else each parameter's own ``NamedSharding`` (or ``None``: default placement) with the
    scalars replicated on the first mesh found. Traced parameters (``init`` under ``jit``) get
    ``None`` throughout: ``jit``'s shardings, or the parameters' types on a mesh with Explicit
    axes, lay the state out.

    Raises:
      ValueError: naming a parameter whose spec does not fit it, or that carries a sharding
        other than its spec says.
    """
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if mesh is not None and param_specs is not None:
        specs = jax.tree.structure(params).flatten_up_to(param_specs)
        for (path, leaf), spec in zip(leaves, specs, strict=True):
            _check_layout(jax.tree_util.keystr(path), leaf, spec, mesh)
    if any(isinstance(leaf, jax.core.Tracer) for _, leaf in leaves):
        return [None] * len(leaves), None
    if mesh is None or param_specs is None:
        carried = [named_sharding(leaf) for _, leaf in leaves]
        meshes = [s.mesh for s in carried if s is not None]
        return carried, NamedSharding(meshes[0], P()) if meshes else None
    placed = [
        NamedSharding(mesh, P(*_padded(spec, jax.numpy.ndim(leaf))))
        for (_, leaf), spec in zip(leaves, specs, strict=True)
    ]
    return placed, NamedSharding(mesh, P())


def _check_layout(path: str, leaf: Any, spec: P | None, mesh: Any) -> None:
    """Raises ``ValueError`` naming ``path`` where ``spec`` does not fit the parameter
    (`chain_layout`) or a concrete parameter is laid out otherwise."""
    chain_layout(jax.numpy.shape(leaf), spec, mesh, path)
    have = None if isinstance(leaf, jax.core.Tracer) else named_sharding(leaf)
    ndim = jax.numpy.ndim(leaf)
    if have is not None and (
        _padded(have.spec, ndim) != _padded(spec, ndim) or dict(have.mesh.shape) != dict(mesh.shape)
    ):
        raise ValueError(
            f"parameter {path} is laid out as {have.spec} on mesh {dict(have.mesh.shape)}, but "
            f"param_specs says {spec} on {dict(mesh.shape)}: pass specs_of(params), or place "
            "the parameters by param_specs."
        )


def zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding | None):
    """Zeros of ``shape`` (a scalar), created in ``sharding``, or by default where it is None."""
    if sharding is None:
        return jax.numpy.zeros(shape, dtype)
    return jax.numpy.zeros(shape, dtype, device=sharding)


def zeros_beside(param: Any, dtype: Any, sharding: NamedSharding | None, band: int = 0):
    """Zeros of ``param``'s shape (behind a leading unsharded axis of size ``band`` if given),
    created in ``sharding``; where it is None, laid out as ``param`` is (inside ``jit`` on a mesh
    with Explicit axes its type says how)."""
    shape = (*((band,) if band else ()), *jax.numpy.shape(param))
    if sharding is None:
        zeros = jax.numpy.zeros_like(param, dtype)
        return jax.numpy.broadcast_to(zeros[None], shape) if band else zeros
    spec = P(*((None,) if band else ()), *_padded(sharding.spec, jax.numpy.ndim(param)))
    return jax.numpy.zeros(shape, dtype, device=NamedSharding(sharding.mesh, spec))


def stack_counts(stacked_axes: Any, tree: Any) -> Any:
    """``stacked_axes`` (``scale_by_sonew``'s) resolved against ``tree``: for every leaf, how many
    of its leading dimensions index stacked tensors (``chain.ChainLayout.stack``), in a tree of
    ``tree``'s structure.

    Args:
      stacked_axes: ``None`` (none stacked); an int (or bool: ``True`` is 1) for every leaf; a
        pytree prefix of ``tree`` holding them (``None`` is 0); or a function of ``tree``
        returning one.
      tree: the parameters or gradients (arrays or shape-dtype structs).

    Returns:
      A tree of ``tree``'s structure holding each leaf's count, an int in ``[0, ndim]``.

    Raises:
      ValueError: naming a leaf whose count is not an int in ``[0, ndim]``, or a prefix that does
        not match ``tree``.

    References:
      flax's ``nn.scan`` (a layer's parameters stacked on a leading axis), which each stacked
      tensor then preconditions as a parameter of its own (paper: Algorithm 1 per tensor).
    """
    prefix = stacked_axes(tree) if callable(stacked_axes) else stacked_axes

    def is_count(x: Any) -> bool:  # inject_hyperparams makes numbers arrays
        return x is None or isinstance(x, int | np.integer | np.ndarray | jax.Array)

    try:
        counts = jax.tree.map(
            lambda count, sub: jax.tree.map(lambda _: 0 if count is None else count, sub),
            prefix,
            tree,
            is_leaf=is_count,
        )
    except ValueError as err:
        raise ValueError(f"stacked_axes must be a prefix of the parameters' tree: {err}") from err

    def checked(path, count, leaf):
        if isinstance(count, jax.core.Tracer):
            raise ValueError(
                "stacked_axes must be concrete: it decides how the update is laid out. Under "
                "optax.inject_hyperparams, keep it static: static_args=('stacked_axes',)."
            )
        value = np.asarray(count)
        integral = value.dtype == bool or np.issubdtype(value.dtype, np.integer)
        if value.ndim or not integral:
            raise ValueError(
                f"stacked_axes of {jax.tree_util.keystr(path)} must be an int (or bool), got "
                f"{count!r}."
            )
        count = int(value)
        if not 0 <= count <= len(jax.numpy.shape(leaf)):
            raise ValueError(
                f"stacked_axes of {jax.tree_util.keystr(path)} is {count}, but the parameter has "
                f"rank {len(jax.numpy.shape(leaf))} (shape {tuple(jax.numpy.shape(leaf))})."
            )
        return count

    return jax.tree.map_with_path(checked, counts, tree)


def _dim_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def chain_layout(
    shape: tuple[int, ...],
    spec: P | None,
    mesh: jax.sharding.Mesh,
    path: str = "<param>",
    stack: int = 0,
) -> ChainLayout:
    """The :class:`ChainLayout` of a parameter of ``shape`` partitioned by ``spec`` over ``mesh``,
    its ``stack`` leading dimensions stacked tensors.

    Raises:
      ValueError: naming ``path`` when the spec has more entries than the parameter has
        dimensions, names an unknown mesh axis (or one twice), splits a dimension into shards
        that do not divide it, or splits a stacked dimension.
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
    if any(axes[:stack]):
        raise ValueError(
            f"{path}: partition spec {spec} splits one of its {stack} stacked dimensions "
            "(stacked_axes); SONew needs each stacked tensor whole along them: shard the "
            "other dimensions."
        )
    return ChainLayout(tuple(shape), axes, shards, stack)


def _band_spec(spec: P) -> P:
    """The spec of a ``(band, *shape)`` statistic: the stacked band axis is never sharded."""
    return P(None, *spec)


def sharded_step(
    tree_step: Callable,
    mesh: jax.sharding.Mesh,
    param_specs: Any,
    check_vma: bool = True,
    stacked_axes: Any = None,
) -> Callable:
    """Wraps SONew's whole-tree step in ``jax.shard_map`` over ``mesh`` with ``param_specs``.

    ``check_vma`` is shard_map's varying-axes type check; SONew turns it off only for its Pallas
    kernels, whose outputs carry no such type. With the fused apply (``apply``: the parameters,
    the scalars ``scale`` and ``weight_decay`` and static per-parameter flags ``decayed``) the
    parameters are sharded like the gradients and the step returns them in place of ``u``.
    ``stacked_axes`` is :func:`stack_counts`'s.
    """

    def step(updates, m, d, e, ratio, diag, corrections, apply=None):
        stacks = stack_counts(stacked_axes, updates)
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
            lambda t, stack: chain_layout(jax.numpy.shape(t[1]), t[2], mesh, t[0], stack),
            paths_and_specs,
            stacks,
            is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str),
        )
        e_specs = jax.tree.map(
            lambda s, ei: ei if isinstance(ei, optax.MaskedNode) else _band_spec(s),
            specs,
            e,
            is_leaf=_is_spec,
        )
        inputs = [updates, m, d, e, ratio, diag, corrections]
        in_specs = [specs, specs, specs, e_specs, P(), P(), (P(), P())]
        if apply is not None:
            inputs += [apply.params, apply.scale, apply.weight_decay]
            in_specs += [specs, P(), P()]

        def local(u, mi, di, ei, ri, si, c, *applied):
            # The flags are static: they stay out of shard_map's arguments.
            here = None
            if applied:
                params, scale, weight_decay = applied
                here = apply._replace(params=params, scale=scale, weight_decay=weight_decay)
            return tree_step(u, mi, di, ei, ri, si, c, layouts, here)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=(specs, specs, specs, e_specs, P(), P()),
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

    Args:
      opt_state: the optimizer's state (arrays or ``jax.ShapeDtypeStruct``).
      param_specs: the parameters' ``PartitionSpec``s, a tree of the parameters' structure.

    Returns:
      A tree of ``opt_state``'s structure holding a ``PartitionSpec`` per leaf, e.g. for
      ``jax.jit(..., out_shardings=...)`` or a checkpoint's restore.

    References:
      JAX's ``jax.sharding.PartitionSpec``; optax's state pytrees (``optax.chain``'s tuple).
    """
    return _state_specs(opt_state, param_specs)


def _sonew_specs(node: Any, param_specs: Any) -> Any:
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
    replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    if isinstance(node, StackedByShapeState):
        entries = node.grouping.specs(param_specs)
        return StackedByShapeState(_state_specs(node.inner, entries), node.grouping)
    if isinstance(node, ScaleBySONewDampedState):
        specs = _sonew_specs(node, param_specs)
        return ScaleBySONewDampedState(*specs, replicated(node.ratio), P())
    if isinstance(node, ScaleBySONewLagState):
        return ScaleBySONewLagState(*_sonew_specs(node, param_specs), replicated(node.ratio))
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
