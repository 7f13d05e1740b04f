"""The whole-tree SONew step: per tensor, on a whole tensor or on a shard's block.

:func:`make_step` builds ``(updates, m, d, e, ratio, corrections, apply) -> (out, m, d, e,
ratio)`` for :func:`sonew_pax.optim.sonew.scale_by_sonew`. Per tensor (or, under ``shard_map``,
per shard) the step runs

* as the Pallas kernels (``kernels``) where they apply: the state's halo rows and every tensor's
  edges are gathered first, for all tensors at once (``neighbours``: sharded, one
  collective-permute per mesh axes and direction), then the tensors of one launch key share
  launches;
* on XLA elsewhere (:func:`_leaf_step`): ``pointwise``'s functions on chain shifts (``chain``)
  for bands 0 and 1, ``solve.precondition`` for wider bands (on a shard's block extended by its
  ``edges``, :func:`_on_extended_block`); on a TPU, where the kernels are enabled for it, bands
  1 and wider as Mosaic kernels (``kernels.tpu``) with the same ``edges``.

A parameter that stacks tensors (``ChainLayout.stack``, flax's ``nn.scan``) steps as one program
for all its tensors (:func:`_stacked_step`): on the GPU kernels a grid axis over its tensors per
launch, on XLA a loop over them; its edges travel in its group's exchange.

Both give local norm pairs (per kernel tile, or one per XLA step), which merge into the graft
ratios (and a relative damping's scales) for all tensors together, across shards in one
all-reduce (``slots.norm_results``).

Which path takes each tensor is ``dispatch``'s to say. Both run the same ``pointwise`` and
``solve`` math, so they agree to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sonew_pax.optim import kernels as pallas
from sonew_pax.optim import pointwise, sharding, solve
from sonew_pax.optim.chain import ChainLayout, halo_width, move_rows, norm_pairs, shift
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.dispatch import (
    band_of,
    has_chain,
    interpreted,
    is_empty,
    kernels_enabled,
    on_any_kernel,
    on_gpu_kernel,
    on_tpu_kernel,
    preconditioned,
    stack_on_kernel,
    stack_on_tpu_kernel,
)
from sonew_pax.optim.kernels import KernelConfig
from sonew_pax.optim.neighbours import (
    edge_rows,
    exchanged_edges,
    halo_rows,
    stack_edge_rows,
    stack_flat,
)
from sonew_pax.optim.pointwise import Raw, Step
from sonew_pax.optim.slots import (
    gathered,
    grafted,
    norm_results,
    per_tensor,
    slot_starts,
    slot_values,
)
from sonew_pax.optim.state import Leaves


class LeafStep(NamedTuple):
    """One tensor's step before grafting.

    Attributes:
      u: the direction (Adam's for tensors that are not preconditioned), or the new parameters
        where a kernel applied the update.
      m: the new first moment.
      d: the new diagonal.
      e: the new off-diagonals (as the state's ``e``).
      pairs: the local norm pairs (``chain.norm_pairs``; ``None`` without them).
    """

    u: jax.Array
    m: jax.Array
    d: jax.Array
    e: Any
    pairs: jax.Array | None


def _tridiagonal_step(
    raw: Raw, e: jax.Array, edge: pallas.Edges, corrections, hyper: SONewConfig
) -> Step:
    """Band 1 on XLA, on a whole tensor or a shard's block: :mod:`pointwise` on the chain shifts
    by one, the rows beyond the block from its ``edge`` (exchanged with those of every other
    tensor, ``neighbours.exchanged_edges``), which holds the gradient and the *old* state, as the
    kernels' edges do: the step computes the boundary rows' new moments from them.

    Two passes over the tensor, split by ``_materialized``: the new state ``(m, d, e)``, where
    every element reads only its own old values (and ``g`` at ``j + 1``), so XLA writes it in
    place; then ``u`` and the grafting norms from the new state at ``j - 1 .. j + 1``. Left to
    itself, XLA fuses the state's update into the consumers of its shifts, recomputing it per
    neighbour and copying each old array that a fusion reads at an offset after it is
    overwritten. The edges read nothing that the first pass writes, so ``m``, ``d`` and ``e``
    are one fusion (edges of the new moments would order ``e``'s update after ``m`` and ``d``'s:
    two fusions, and ``g`` read twice)."""
    pre, post = edge_rows(edge, 1, raw.g.shape)
    # The edges hold old boundary rows of the state: the new state (written in place) waits
    # for both, not only for ``post``, which it reads.
    pre, post = _materialized((pre, post))
    g_after = _row_shift(raw.g, post[0, 0], 1)
    m, d = pointwise.moments(raw, hyper)
    # The boundary rows' new moments, from their old ones.
    pre_md, post_md = (pointwise.moments(Raw(*x[:3, 0]), hyper) for x in (pre, post))
    # The new e in the tensor's own layout, stored as (1, *shape): a TPU's compile moves fewer
    # bytes than for the stored layout (benchmarks/tpu_compile.py), and a GPU's still writes it
    # in place (no copy; benchmarks/update_speed.py's XLA rows).
    e_here = pointwise.edge_statistic(e[0].astype(raw.d.dtype), raw.g, g_after, hyper)
    m, d, e_here = _materialized((m, d, e_here))
    e_new = e_here[None]
    e_pre = pointwise.edge_statistic(pre[3, 0], pre[0, 0], raw.g[0], hyper)
    here = [raw.g, m, d]
    after = [g_after] + [_row_shift(x, y, 1) for x, y in zip((m, d), post_md, strict=True)]
    before = [
        _row_shift(x, y, -1)
        for x, y in zip([*here, e_here], (pre[0, 0], *pre_md, e_pre), strict=True)
    ]
    v = [pointwise.vertex_of_moments(*x, corrections, hyper) for x in (before[:3], here, after)]
    u = pointwise.tridiagonal_direction(*v, e_here, before[3], corrections, hyper)
    return Step(pointwise.adam_direction(m, d, corrections, hyper), u, m, d, e_new)


def _row_shift(x: jax.Array, boundary: jax.Array, k: int) -> jax.Array:
    """``x`` moved ``k = 1`` row up (row ``i`` holds row ``i + 1``) or ``k = -1`` down along
    axis 0, ``boundary`` in the row that then has none (the last, or the first): a
    ``chain.move_rows`` and a select, which XLA's TPU compiler fuses into the consumers. (XLA's
    GPU compiler hoists a ``concatenate`` to the root of the fusion that reads it and emits it
    operand by operand.)
    """
    row = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    at = x.shape[0] - 1 if k > 0 else 0
    return jnp.where(row == at, jnp.broadcast_to(boundary, x.shape), move_rows(x, -k))


def _materialized(arrays: Any) -> Any:
    """``arrays`` (a pytree), computed whole before anything reads them: a pass boundary for XLA
    (``lax.optimization_barrier``, which XLA's GPU compiler keeps through fusion; its CPU
    compiler drops it first), so later fusions read them from memory, at any offset, instead of
    fusing and recomputing what produced them."""
    return jax.lax.optimization_barrier(arrays)


def _banded_step(
    raw: Raw,
    e: Any,
    band: int,
    corrections,
    hyper: SONewConfig,
    layout: ChainLayout,
    edge: pallas.Edges | None,
) -> tuple[Step, jax.Array | None]:
    """The XLA path: :mod:`pointwise` elementwise for band 0 and on the shifts by one for band 1
    (:func:`_tridiagonal_step`), the generic banded solve (``solve.precondition``) for wider
    bands; the local grafting norm pairs in one reduction (``chain.norm_pairs``)."""
    bc1, bc2 = corrections
    if band == 0:
        step = pointwise.diagonal_step(raw, corrections, hyper)
    elif band == 1:
        step = _tridiagonal_step(raw, e, edge, corrections, hyper)
    elif edge is not None:
        step = _on_extended_block(raw, e, band, corrections, hyper, edge)
    else:
        m, d = pointwise.moments(raw, hyper)
        successors = jnp.stack([shift(raw.g, k, layout) for k in range(1, band + 1)])
        e_new = pointwise.edge_statistic(e.astype(raw.d.dtype), raw.g, successors, hyper)
        u = solve.precondition(d / bc2 + hyper.eps, e_new / bc2, m / bc1, hyper.gamma, layout)
        step = Step(pointwise.adam_direction(m, d, corrections, hyper), u, m, d, e_new)
    return step, norm_pairs(_normed(step, corrections, hyper)) if _has_norms(hyper) else None


def _on_extended_block(
    raw: Raw, e: jax.Array, band: int, corrections, hyper: SONewConfig, edge
) -> Step:
    """Bands >= 2 on a shard's block: the whole-tensor step on the block extended by the rows
    its chain neighbours hold (its ``edge``, exchanged with those of every other tensor,
    ``neighbours.exchanged_edges``), cut back to the block. Each column of the extended block is
    the block's column with its chain's ``halo_width`` rows before and after it, which is all the
    step reads for the block's own rows, so the extended block's wraps between columns are never
    read. One exchange for the whole tree, instead of one per shift (``chain.shift``) per tensor;
    the extension is one more pass over the block."""
    pre, post = edge_rows(edge, band, raw.g.shape)

    def extended(x: jax.Array, k: int) -> jax.Array:
        return jnp.concatenate([pre[k].astype(x.dtype), x, post[k].astype(x.dtype)])

    g, m, d = (extended(x, k) for k, x in enumerate(raw))
    e_ext = jnp.stack([extended(e[j].astype(raw.d.dtype), 3 + j) for j in range(band)])
    step, _ = _banded_step(
        Raw(g, m, d), e_ext, band, corrections, hyper, ChainLayout.unsharded(g.shape), None
    )
    start, rows = halo_width(band)[0], raw.g.shape[0]

    def block(x: jax.Array, axis: int = 0) -> jax.Array:
        return jax.lax.slice_in_dim(x, start, start + rows, axis=axis)

    return Step(block(step.adam), block(step.u), block(step.m), block(step.d), block(step.e, 1))


def _has_norms(hyper: SONewConfig) -> bool:
    """Whether a preconditioned tensor's step gives norm pairs: to graft, or for a relative
    damping's next scale."""
    return hyper.graft == "adam" or hyper.damping != "absolute"


def _normed(step: Step, corrections, hyper: SONewConfig) -> list[jax.Array]:
    """The arrays whose norm pairs a step gives (:func:`_has_norms`), in the pairs' order: Adam's
    direction, ``u`` and, with a relative damping, ``sqrt(d_hat)`` (``pointwise.diagonal_root``)."""
    normed = [step.adam, step.u]
    if hyper.damping != "absolute":  # in u's dtype: one reduction takes one precision
        normed.append(pointwise.diagonal_root(step.d, corrections).astype(step.u.dtype))
    return normed


def _leaf_step(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: Any,
    corrections: tuple[jax.Array, jax.Array],
    hyper: SONewConfig,
    layout: ChainLayout,
    edge: pallas.Edges | None = None,
    tpu: KernelConfig | None = None,
    apply: pallas.Apply | None = None,
) -> LeafStep:
    """One tensor's SONew step (module docstring) before grafting, on XLA: a :class:`LeafStep`;
    band 1 with its ``edge`` (``neighbours.exchanged_edges``); as a TPU kernel (``kernels.tpu``,
    with its ``edge``) given its config ``tpu`` (``dispatch.on_tpu_kernel``), which writes the
    parameters in ``u``'s place given their fused ``apply`` (:func:`_kernel_apply`).

    ``u`` is the direction (Adam's for tensors that are not preconditioned) in the arithmetic's
    dtype (``pointwise.compute_dtype``).
    ``pairs`` is ``None`` without norm pairs (:func:`_has_norms`), else the local pairs of
    :func:`_normed`'s arrays as ``(4, rows)`` or ``(6, rows)`` (``chain.norm_pairs``): the
    kernels' per-tile pairs with a tile per row, which ``slots.norm_results`` merges with every
    other tensor's.
    """
    band = band_of(e)
    if tpu is not None:  # a preconditioned tensor (on_tpu_kernel)
        pre, post = edge_rows(edge, band, g.shape)
        block = pallas.tpu.block_shape(g.shape, band, tpu)
        u, m, d, e, parts = pallas.tpu.update(
            g, m, d, e, pre, post, corrections, hyper, block, interpret=interpreted(tpu),
            apply=apply,
        )  # fmt: skip
        return LeafStep(u, m, d, e, parts if _has_norms(hyper) else None)
    raw = _raw(g, m, d)
    if not preconditioned(len(layout.shape), hyper.precondition_1d) or is_empty(layout):
        # Adam's direction; for an empty tensor (a 0-size dimension) an empty update.
        m_new, d_new = pointwise.moments(raw, hyper)
        adam = pointwise.adam_direction(m_new, d_new, corrections, hyper)
        return LeafStep(adam, m_new.astype(m.dtype), d_new.astype(d.dtype), e, None)
    step, grafting = _banded_step(raw, e, band, corrections, hyper, layout, edge)
    e_new = e if step.e is None else step.e.reshape(e.shape).astype(e.dtype)
    return LeafStep(step.u, step.m.astype(m.dtype), step.d.astype(d.dtype), e_new, grafting)


def _leaf_steps(
    leaves: Leaves,
    halos: list,
    edges: list,
    applies: list,
    corrections,
    hyper: SONewConfig,
    kernels: KernelConfig | None,
    diag: tuple[jax.Array, list] | None = None,
) -> list[LeafStep]:
    """Every tensor's step before grafting (:class:`LeafStep`, of ``leaves``): with ``kernels``
    (``dispatch.kernels_enabled``) the steps of the tensors (or shards) where ``kernels.supported``
    as Pallas kernels (bands >= 1 with their state's ``halos``, ``neighbours.halo_rows``, and their
    chain neighbours beyond the block, ``edges``, ``neighbours.exchanged_edges``; with
    ``applies[k]``, ``kernels.Apply``, writing the parameters in ``u``'s
    place), where the tensors of one ``kernels.launch_key`` share launches
    (``kernels.group_update``, ``kernels.launch_group`` tensors each); :func:`_leaf_step` on XLA
    for the others. Each preconditioned tensor steps with its own damping (:func:`_damped`):
    with a relative one, ``diag`` is the state's statistics and each tensor's slot in them
    (``slots.slot_starts``); a kernel takes the whole vector and its slot and scales ``eps``
    itself, so every launch shares one scalar input and nothing is sliced out for it."""
    grads, m, d, e, layouts = leaves
    vector, slots = diag if diag is not None else (None, [None] * len(grads))
    hypers = [
        _damped(hyper, None if slot is None else slot_values(vector, slot, lay, flat=True))
        if has_chain(lay, hyper)
        else hyper
        for slot, lay in zip(slots, layouts, strict=True)
    ]
    steps: list = [None] * len(grads)
    groups: dict[tuple, list[int]] = {}
    for k, (g, lay, ei, apply) in enumerate(zip(grads, layouts, e, applies, strict=True)):
        if on_gpu_kernel(kernels, lay, band_of(ei), hyper):
            groups.setdefault(pallas.launch_key(g, m[k], d[k], ei, apply), []).append(k)
        elif stack_on_kernel(kernels, lay, band_of(ei), hyper):
            stats = None if vector is None else slot_values(vector, slots[k], lay, flat=True)
            steps[k] = _stacked_step(
                g, m[k], d[k], ei, corrections, hyper, lay, edges[k], kernels, stats
            )
        elif lay.stack:
            tpu = kernels if stack_on_tpu_kernel(kernels, lay, band_of(ei), hyper) else None
            steps[k] = _stacked_step(
                g, m[k], d[k], ei, corrections, hypers[k], lay, edges[k], tpu=tpu
            )
        else:
            tpu = kernels if on_tpu_kernel(kernels, lay, band_of(ei), hyper) else None
            steps[k] = _leaf_step(
                g, m[k], d[k], ei, corrections, hypers[k], lay, edges[k], tpu, apply
            )
    for (shape, band, *_), members in groups.items():
        size = pallas.launch_group(shape, band, kernels)
        for start in range(0, len(members), size):
            part = members[start : start + size]
            results = pallas.group_update(
                *([x[k] for k in part] for x in (grads, m, d, e)),
                corrections,
                hyper,
                interpret=interpreted(kernels),
                halos=[halos[k] for k in part],
                edges=[edges[k] for k in part],
                applies=[applies[k] for k in part],
                diag=None if diag is None else (vector, [slots[k] for k in part]),
                config=kernels,
            )
            for k, result in zip(part, results, strict=True):
                steps[k] = LeafStep(*result)
    return steps


def _stacked_step(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: Any,
    corrections,
    hyper: SONewConfig,
    layout: ChainLayout,
    edge: pallas.Edges | None,
    kernels: KernelConfig | None = None,
    stats: jax.Array | None = None,
    tpu: KernelConfig | None = None,
) -> LeafStep:
    """The step of a tensor whose leading ``layout.stack`` dimensions stack tensors (a layer axis):
    each stacked tensor's step over those dimensions flattened into one, so the stack is traced
    and compiled once, not once per tensor. Each stacked tensor has its own chain, its own
    damping and, from ``slots.norm_results``, its own graft ratio: the norm pairs come as
    ``(layers, pairs, tiles)``. ``edge`` is that of the first stacked tensor; the others'
    follow it in its buffer (``neighbours.exchanged_edges``).

    On XLA (``kernels`` None) the step is :func:`_leaf_step`'s on each tensor in turn
    (:func:`_each_stacked`; as a TPU kernel given its config ``tpu``), ``hyper.eps`` holding one
    per stacked tensor with a relative damping; a step that shifts nothing (band 0, or no chain:
    Adam's direction) is vectorized over the stack instead. With ``kernels``
    (``dispatch.stack_on_kernel``) it is one tensor's halo copies and step kernel
    (``kernels.gather_halos``, ``kernels.group_update``), which ``jax.vmap`` turns into launches
    with a grid axis over the stacked tensors: one compiled program per stack; ``stats`` are then
    a relative damping's statistics of the stacked tensors (the kernel scales ``eps`` from
    them), else ``None``."""
    n, k, layer = layout.layers, layout.stack, layout.layer
    band = band_of(e)
    interpret = interpreted(kernels)

    def on_xla(g, m, d, e, rows, eps):
        here = hyper if eps is None else hyper.with_eps(eps)
        edge = None if rows is None else pallas.Edges(rows, 0)
        return _leaf_step(g, m, d, e, corrections, here, layer, edge, tpu)

    def on_kernels(g, m, d, e, rows, stat):
        halos = edges = None
        if band:
            shapes = [g.shape] * 3
            halos = [
                tuple(
                    pallas.gather_halos(
                        [m, d, e], band=band, shapes=shapes, interpret=interpret, config=kernels
                    )
                )
            ]
            edges = [pallas.Edges(rows, 0)]
        (result,) = pallas.group_update(
            [g], [m], [d], [e], corrections, hyper, interpret=interpret, halos=halos,
            edges=edges, diag=None if stat is None else (stat, [0]), config=kernels,
        )  # fmt: skip
        return LeafStep(*result)

    if kernels is None:
        # A relative damping's eps, one per stacked tensor (_leaf_steps), where it has a chain.
        one, per_tensor = on_xla, hyper.eps if jnp.ndim(hyper.eps) == 1 else None
    else:
        one, per_tensor = on_kernels, None if stats is None else stats[:, None]
    rows = stack_edge_rows(edge, band, g.shape[k:], n)
    e_in = e if band == 0 else stack_flat(e, k, lead=1)
    arrays = (*(stack_flat(x, k) for x in (g, m, d)), e_in, rows, per_tensor)
    # A step that shifts nothing (band 0, or Adam's direction where there is no chain) is
    # elementwise: vectorized, the stack is one step's few fusions, where the loop launches its
    # fusions once per tensor (a model's norm scales: dozens of trips over 1-D tensors).
    if kernels is None and band and has_chain(layout, hyper):
        u, m_new, d_new, e_new, pairs = _each_stacked(one, arrays, band, n)
    else:
        u, m_new, d_new, e_new, pairs = jax.vmap(
            one, in_axes=(0, 0, 0, 1, 0, 0), out_axes=LeafStep(0, 0, 0, 1, 0)
        )(*arrays)
    e_new = e_new if band == 0 else e_new.reshape(e.shape)
    return LeafStep(
        u.reshape(g.shape), m_new.reshape(m.shape), d_new.reshape(d.shape), e_new, pairs
    )


def _each_stacked(one: Callable, arrays: tuple, band: int, n: int) -> LeafStep:
    """``one`` (a tensor's XLA step) on each of a stack's ``n`` tensors in turn, in one
    ``lax.scan``. ``arrays`` are ``(g, m, d, e, rows, eps)``, stacked on axis 0 (``e`` of a
    band >= 1 on axis 1, behind its band axis; band 0's ``e``, ``rows`` and ``eps`` may hold no
    array). Trip ``i`` reads tensor ``i``'s slices and writes its ``u``, ``m``, ``d`` and ``e``
    over the ones it read (the carry starts as ``g``, ``m``, ``d``, ``e``: the stack is updated
    in place), and its norm pairs as the scan's output.

    A loop rather than ``jax.vmap``: each trip is the tensor's own step, so a stack moves what
    its tensors would apart (where it is row-major: ``grouping.pack`` builds it so) and is
    compiled once; vectorized on a TPU, the step moves more and compiles longer than per tensor
    (docs/performance.md).

    Returns:
      The stack's :class:`LeafStep`: ``u``, ``m``, ``d`` stacked on axis 0, ``e`` as given, the
      pairs ``(n, ...)``.
    """
    g, m, d, e, rows, eps = arrays
    axes = (0, 0, 0, 1 if band else 0)  # of g (and u), m, d, e

    def trip(carry: tuple, xs: tuple) -> tuple:
        i, *others = xs
        take, put = jax.lax.dynamic_index_in_dim, jax.lax.dynamic_update_index_in_dim
        mine = [
            jax.tree.map(lambda leaf, a=axis: take(leaf, i, a, keepdims=False), stack)
            for stack, axis in zip(carry, axes, strict=True)
        ]
        step = one(*mine, *others)
        carry = tuple(
            jax.tree.map(lambda leaf, y, a=axis: put(leaf, y, i, a), stack, new)
            for stack, new, axis in zip(carry, step[:4], axes, strict=True)
        )
        return carry, step.pairs

    u = g.astype(pointwise.compute_dtype(d.dtype))
    (u, m, d, e), pairs = jax.lax.scan(trip, (u, m, d, e), (jnp.arange(n), rows, eps))
    return LeafStep(u, m, d, e, pairs)


def _raw(g: jax.Array, m: jax.Array, d: jax.Array) -> Raw:
    """A tensor's gradient and state as the step reads them: in the arithmetic's dtype
    (``pointwise.compute_dtype`` of the statistics')."""
    compute = pointwise.compute_dtype(d.dtype)
    return Raw(g.astype(compute), m.astype(compute), d.astype(compute))


def _damped(hyper: SONewConfig, diag: Any) -> SONewConfig:
    """``hyper`` with this tensor's damping (``sonew``'s ``damping``): ``"absolute"`` keeps
    ``eps``; a relative damping multiplies it by ``diag``, the mean (``"mean"``) or largest entry
    (``"max"``) of the tensor's bias-corrected diagonal ``d_hat`` at the previous step (the
    state's, which the step's norm pairs give at no extra pass or message: ``slots._diag_scales``),
    at least the smallest normal number. While ``diag`` is 0 (no step yet, or only zero
    gradients) the damping is infinite: ``u = 0``, the moments accumulate.

    A relative damping scales with the gradients' squared scale, as ``d_hat`` does, so the
    grafted update does not change when the gradients are scaled (the paper's regret bound takes
    ``eps`` proportional to the gradients' bound, Theorem 3).
    """
    if hyper.damping == "absolute":
        return hyper
    return hyper.with_eps(pointwise.relative_eps(hyper.eps, diag))


def _kernel_apply(
    apply: ApplyArgs | None,
    p,
    decayed,
    e,
    slot: int | None,
    ratio: jax.Array | None,
    hyper: SONewConfig,
    layout: ChainLayout,
    kernels: KernelConfig | None,
) -> pallas.Apply | None:
    """The ``kernels.Apply`` of a tensor whose kernel writes its parameters: one on the kernels
    whose graft ratio is known before the step, 1 without grafting or graft_lag's (``ratio``, the
    state's array, read at the tensor's ``slot``); else ``None`` (then its ``u`` is written out
    and grafted with the step's own ratio before it is applied)."""
    if apply is None or not on_any_kernel(kernels, layout, band_of(e), hyper):
        return None
    if hyper.graft == "none":
        return pallas.Apply(p, jnp.ones((1,)), 0, apply.weight_decay, apply.scale, decayed)
    if ratio is None:
        return None
    return pallas.Apply(p, ratio, slot, apply.weight_decay, apply.scale, decayed)


class ApplyArgs(NamedTuple):
    """What the fused apply adds to the whole-tree step: ``params <- params + (u + decay params)
    scale`` with ``decay = weight_decay`` where ``decayed`` (a static bool per parameter), else 0
    (``scale`` and ``weight_decay``: scalar arrays)."""

    params: optax.Params
    scale: jax.Array
    weight_decay: jax.Array
    decayed: Any


def make_step(config: SONewConfig, mesh: Any, param_specs: Any, unpacked: bool = False) -> Callable:
    """The whole-tree step of ``config``, on ``mesh`` with ``param_specs`` (or unsharded).

    The step runs SONew's update (paper Algorithm 1 with the closed forms of Theorems 1 and 2 and
    Algorithm 3's stable banded solve: ``pointwise``, ``solve``) per tensor, on the path that
    ``dispatch`` picks, and grafts its direction (``slots``).

    Args:
      config: the checked config-parameters; ``implementation``, ``kernel_config`` and
        ``stacked_axes`` (which leading dimensions of each tensor stack tensors,
        ``sharding.stack_counts``; their steps are :func:`_stacked_step`'s) pick the paths.
      mesh: the mesh the step runs on under ``shard_map``, or ``None``: on the arrays as they
        are (under ``shard_map`` with their own specs where their type splits them).
      param_specs: the parameters' ``PartitionSpec``s on ``mesh`` (``None`` without one).
      unpacked: the stacks are parameters packed by shape (``stack_by_shape``), sliced apart
        after the step: each stacked tensor's direction is then grafted on its own, so that XLA
        fuses its scale into its parameter's apply (``slots.grafted``), and left in the graft's
        dtype for the caller to cast to each parameter's gradients' dtype.

    Returns:
      ``step(updates, m, d, e, ratio, diag, corrections, apply=None) -> (out, m, d, e, ratio,
      diag)``: ``out`` is the grafted direction ``u`` in the gradients' dtype, or with ``apply``
      (:class:`ApplyArgs`) the new parameters, from the kernels where they know the graft ratio
      before the step (:func:`_kernel_apply`), else ``pointwise.apply_update`` of ``u`` on XLA.
      ``ratio`` (graft_lag's ratios) and ``diag`` (a relative damping's statistics,
      :func:`_damped`) are each one array over the preconditioned tensors
      (``slots.slot_starts``), or ``None``; ``corrections`` is ``(1 - b1^t, 1 - b2^t)``.

    References:
      Devvrit et al., "A Computationally Efficient Sparsified Online Newton Method", NeurIPS
      2023: Algorithm 1, Theorems 1 and 2, Algorithm 3.
    """
    stacked_axes = config.stacked_axes
    kernels = kernels_enabled(config.implementation, mesh, config.kernel_config)

    def tree_step(updates, m, d, e, ratio, diag, corrections, layouts, apply=None):
        treedef = jax.tree.structure(updates)
        leaves = Leaves(*(treedef.flatten_up_to(x) for x in (updates, m, d, e, layouts)))
        n = len(leaves.grads)
        params, decayed = (
            [treedef.flatten_up_to(x) for x in (apply.params, apply.decayed)]
            if apply is not None
            else ([None] * n, [None] * n)
        )
        layouts = leaves.layouts
        slots = slot_starts(layouts, config.precondition_1d)
        lagged = [
            None if ratio is None or k is None else slot_values(ratio, k, lay, flat=True)
            for k, lay in zip(slots, layouts, strict=True)
        ]
        halos = halo_rows(leaves.m, leaves.d, leaves.e, layouts, config, kernels)
        edges = exchanged_edges(leaves, config, kernels)
        fused_apply = [
            _kernel_apply(apply, p, flag, ei, slot, ratio, config, lay, kernels)
            for ei, slot, lay, p, flag in zip(
                leaves.e, slots, layouts, params, decayed, strict=True
            )
        ]
        steps = _leaf_steps(
            leaves,
            halos,
            edges,
            fused_apply,
            corrections,
            config,
            kernels,
            None if diag is None else (diag, slots),
        )
        ratios, scales = norm_results([step.pairs for step in steps], layouts, config)
        out: list[list[Any]] = [[] for _ in range(4)]
        for g, step, fresh, old, p, flag, leaf_apply, lay in zip(
            leaves.grads, steps, ratios, lagged, params, decayed, fused_apply, layouts, strict=True
        ):
            if leaf_apply is not None:  # the kernel wrote the parameters
                x = step.u
            else:
                fresh = None if fresh is None else per_tensor(fresh, lay, flat=True)
                x = grafted(step.u, fresh, old, lay, unpacked)
                # Packed stacks (unpacked) are cast to each member's gradients' dtype after
                # unpacking: a stack copied in a narrower dtype (stack_dtype) rounds only u.
                x = x if unpacked else x.astype(g.dtype)
                if apply is not None:
                    decay = apply.weight_decay if flag else 0.0
                    x = pointwise.apply_update(p, x, 1, decay, apply.scale).astype(p.dtype)
            for k, y in enumerate((x, step.m, step.d, step.e)):
                out[k].append(y)
        new_ratio = None if ratio is None else gathered(ratios, ratio, slots, layouts)
        new_diag = None if diag is None else gathered(scales, diag, slots, layouts)
        return (*(jax.tree.unflatten(treedef, y) for y in out), new_ratio, new_diag)

    if mesh is None:

        def step(updates, m, d, e, ratio, diag, corrections, apply=None):
            explicit = _explicit_mesh(updates)
            if explicit is not None:  # the arrays' types say how they are split
                specs = sharding.specs_of(updates)
                sharded = sharding.sharded_step(
                    tree_step, explicit, specs, stacked_axes=stacked_axes
                )
                return sharded(updates, m, d, e, ratio, diag, corrections, apply)
            stacks = sharding.stack_counts(stacked_axes, updates)
            layouts = jax.tree.map(
                lambda g, k: ChainLayout.unsharded(jnp.shape(g), k), updates, stacks
            )
            return tree_step(updates, m, d, e, ratio, diag, corrections, layouts, apply)

        return step

    # Pallas kernels declare plain output shapes, without the varying-axes type that
    # shard_map's check wants; their replicated outputs come from replicated inputs alone.
    return sharding.sharded_step(
        tree_step, mesh, param_specs, check_vma=kernels is None, stacked_axes=stacked_axes
    )


def _explicit_mesh(updates: Any) -> Any:
    """The mesh of the first array of ``updates`` whose sharding is part of its type (a mesh with
    Explicit axes) and splits it, else ``None``: such arrays cannot be sliced as whole tensors
    are, so the update runs under ``shard_map`` with the arrays' own specs."""
    for leaf in jax.tree.leaves(updates):
        found = sharding.named_sharding(leaf)
        if (
            found is not None
            and jax.sharding.AxisType.Explicit in found.mesh.axis_types
            and any(entry is not None for entry in found.spec)
        ):
            return found.mesh
    return None
