"""The whole-tree SONew step: per tensor, on a whole tensor or on a shard's block.

:func:`make_step` builds ``(updates, m, d, e, ratio, corrections, apply) -> (out, m, d, e,
ratio)`` for :func:`sonew_pax.optim.sonew.scale_by_sonew`. Per tensor (or, under ``shard_map``,
per shard) the step runs

* as the Pallas kernels (``kernels``) where they apply: the state's halo rows and every tensor's
  edges are gathered first, for all tensors at once (:func:`_halos`, :func:`_edges`: sharded, one
  collective-permute per mesh axes and direction), then the tensors of one launch key share
  launches;
* on XLA elsewhere (:func:`_leaf_step`): ``pointwise``'s functions on chain shifts (``chain``)
  for bands 0 and 1, ``solve.precondition`` for wider bands (on a shard's block extended by its
  ``edges``, :func:`_on_extended_block`); on a TPU, where the kernels are enabled for it, bands
  1 and wider as Mosaic kernels (``kernels.tpu``) with the same ``edges``.

A parameter that stacks tensors (``ChainLayout.stack``, flax's ``nn.scan``) steps as one
vectorized step of its tensors (:func:`_stacked_step`): on XLA, or on the GPU kernels, a grid axis
over its tensors per launch; its edges travel in its group's exchange.

Both give local norm pairs (per kernel tile, or one per XLA step), which merge into the graft
ratios (and a relative damping's scales) for all tensors together, across shards in one
all-reduce (:func:`_norm_results`).

Both run the same ``pointwise`` and ``solve`` math, so they agree to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sonew_pax.optim import kernels as pallas
from sonew_pax.optim import pointwise, sharding, solve
from sonew_pax.optim.chain import (
    ChainLayout,
    halo_width,
    merge_pairs,
    merge_shards,
    norm_pairs,
    parallel,
    run,
    shift,
)
from sonew_pax.optim.kernels import KernelConfig
from sonew_pax.optim.pointwise import Hyper, Raw, Step


def preconditioned(ndim: int, precondition_1d: bool) -> bool:
    return ndim >= 2 or precondition_1d


Implementation = Literal["auto", "xla", "pallas"]
IMPLEMENTATIONS = get_args(Implementation)


class Leaves(NamedTuple):
    """The whole tree's tensors, each field a list in the tree's leaf order."""

    grads: list[jax.Array]
    m: list[jax.Array]
    d: list[jax.Array]
    e: list[Any]  # (band, *shape) arrays, or optax.MaskedNode
    layouts: list[ChainLayout]


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


def kernels_enabled(implementation: str, mesh: Any, config: KernelConfig) -> KernelConfig | None:
    """``config`` where the Pallas kernels (``kernels``) may run, else ``None`` (XLA only).

    ``"pallas"``: on any backend: the GPU kernels, or on a TPU its kernels
    (``KernelConfig.platform``); off their platform in Pallas' interpreter (slow, for tests).
    ``"auto"``: on GPU, under ``mesh`` (``shard_map`` then says which tensors are whole on the
    device) or on a one-device process; without a mesh on several devices the arrays may be
    sharded by the caller's ``jit``, which cannot partition a kernel (it would gather every
    tensor), so XLA runs.
    ``"xla"``: never.
    """
    if implementation != "auto":
        enabled = implementation == "pallas"
    else:
        enabled = jax.default_backend() == "gpu" and (mesh is not None or jax.device_count() == 1)
    return config if enabled else None


def _edge_rows(edge: pallas.Edges, band: int, shape: tuple[int, ...]) -> tuple:
    """A tensor's edges (``kernels.kernel_edges``) in its own layout: ``(pre, post)`` of shapes
    ``(3 + b, before, *shape[1:])`` and ``(3 + b, after, *shape[1:])`` (``chain.halo_width``),
    arrays ``g, m, d, e[0], ..`` along the first axis."""
    before, after = halo_width(band)
    count = edge.buffer.size // ((3 + band) * (before + after) * math.prod(shape[1:]))
    rows = edge.buffer.reshape(count, 3 + band, before + after, *shape[1:])[edge.index]
    return rows[:, :before], rows[:, before:]


def _tridiagonal_step(
    raw: Raw, e: jax.Array, edge: pallas.Edges, corrections, hyper: Hyper
) -> Step:
    """Band 1 on XLA, on a whole tensor or a shard's block: :mod:`pointwise` on the chain shifts
    by one, the rows beyond the block from its ``edge`` (exchanged with those of every other
    tensor, ``_edges``), which holds the gradient and the *old* state, as the kernels' edges do:
    the step computes the boundary rows' new moments from them.

    Two passes over the tensor, split by ``_materialized``: the new state ``(m, d, e)``, where
    every element reads only its own old values (and ``g`` at ``j + 1``), so XLA writes it in
    place; then ``u`` and the grafting norms from the new state at ``j - 1 .. j + 1``. Left to
    itself, XLA fuses the state's update into the consumers of its shifts, recomputing it per
    neighbour and copying each old array that a fusion reads at an offset after it is
    overwritten. The edges read nothing that the first pass writes, so ``m``, ``d`` and ``e``
    are one fusion (edges of the new moments would order ``e``'s update after ``m`` and ``d``'s:
    two fusions, and ``g`` read twice)."""
    pre, post = _edge_rows(edge, 1, raw.g.shape)
    # The edges hold old boundary rows of the state: the new state (written in place) waits
    # for both, not only for ``post``, which it reads.
    pre, post = _materialized((pre, post))
    g_after = _successors(raw.g, post[0, 0])
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
    after = [g_after] + [
        jnp.concatenate([x[1:], y[None]]) for x, y in zip((m, d), post_md, strict=True)
    ]
    before = [
        jnp.concatenate([y[None], x[:-1]])
        for x, y in zip([*here, e_here], (pre[0, 0], *pre_md, e_pre), strict=True)
    ]
    v = [pointwise.vertex_of_moments(*x, corrections, hyper) for x in (before[:3], here, after)]
    u = pointwise.tridiagonal_direction(*v, e_here, before[3], corrections, hyper)
    return Step(pointwise.adam_direction(m, d, corrections, hyper), u, m, d, e_new)


def _successors(x: jax.Array, last: jax.Array) -> jax.Array:
    """``x`` shifted up one row along axis 0, ``last`` its new last row, as a sum of two pads.

    The same values as a ``concatenate``, which XLA's GPU compiler hoists to the root of the fusion
    that updates ``e`` and then emits operand by operand, at about half the bandwidth of a loop.
    """
    rest = ((0, 0),) * (x.ndim - 1)
    return jnp.pad(x[1:], ((0, 1), *rest)) + jnp.pad(last[None], ((x.shape[0] - 1, 0), *rest))


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
    hyper: Hyper,
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


def _on_extended_block(raw: Raw, e: jax.Array, band: int, corrections, hyper: Hyper, edge) -> Step:
    """Bands >= 2 on a shard's block: the whole-tensor step on the block extended by the rows
    its chain neighbours hold (its ``edge``, exchanged with those of every other tensor,
    ``_edges``), cut back to the block. Each column of the extended block is the block's column
    with its chain's ``halo_width`` rows before and after it, which is all the step reads for the
    block's own rows, so the extended block's wraps between columns are never read. One exchange
    for the whole tree, instead of one per shift (``chain.shift``) per tensor; the extension is
    one more pass over the block."""
    pre, post = _edge_rows(edge, band, raw.g.shape)

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


def _has_norms(hyper: Hyper) -> bool:
    """Whether a preconditioned tensor's step gives norm pairs: to graft, or for a relative
    damping's next scale."""
    return hyper.graft == "adam" or hyper.damping != "absolute"


def _normed(step: Step, corrections, hyper: Hyper) -> list[jax.Array]:
    """The arrays whose norm pairs a step gives (:func:`_has_norms`), in the pairs' order: Adam's
    direction, ``u`` and, with a relative damping, ``sqrt(d_hat)`` (``pointwise.diagonal_root``)."""
    normed = [step.adam, step.u]
    if hyper.damping != "absolute":  # in u's dtype: one reduction takes one precision
        normed.append(pointwise.diagonal_root(step.d, corrections).astype(step.u.dtype))
    return normed


def _graft_ratio(grafting: tuple[jax.Array, jax.Array]) -> jax.Array:
    """``||adam|| / ||u||`` from the pair of norms; ``0`` where ``||u|| == 0``, NaN where either
    norm is NaN (a non-finite gradient entry makes the whole tensor's update non-finite)."""
    num, den = grafting
    zero = den == 0
    return jnp.where(zero, 0, num / jnp.where(zero, 1, den))


def _leaf_step(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: Any,
    corrections: tuple[jax.Array, jax.Array],
    hyper: Hyper,
    layout: ChainLayout,
    edge: pallas.Edges | None = None,
    tpu: KernelConfig | None = None,
    apply: pallas.Apply | None = None,
) -> LeafStep:
    """One tensor's SONew step (module docstring) before grafting, on XLA: a :class:`LeafStep`;
    band 1 with its ``edge`` (:func:`_edges`); as a TPU kernel (``kernels.tpu``, with
    its ``edge``) given its config ``tpu`` (:func:`_on_tpu_kernel`), which writes the parameters
    in ``u``'s place given their fused ``apply`` (:func:`_kernel_apply`).

    ``u`` is the direction (Adam's for tensors that are not preconditioned) in the arithmetic's
    dtype (``pointwise.compute_dtype``).
    ``pairs`` is ``None`` without norm pairs (:func:`_has_norms`), else the local pairs of
    :func:`_normed`'s arrays as ``(4, rows)`` or ``(6, rows)`` (``chain.norm_pairs``): the
    kernels' per-tile pairs with a tile per row, which :func:`_norm_results` merges with every
    other tensor's.
    """
    band = _band(e)
    if tpu is not None:  # a preconditioned tensor (_on_tpu_kernel)
        pre, post = _edge_rows(edge, band, g.shape)
        block = pallas.tpu.block_shape(g.shape, band, tpu)
        u, m, d, e, parts = pallas.tpu.update(
            g, m, d, e, pre, post, corrections, hyper, block, interpret=_interpret(tpu),
            apply=apply,
        )  # fmt: skip
        return LeafStep(u, m, d, e, parts if _has_norms(hyper) else None)
    raw = _raw(g, m, d)
    if not preconditioned(len(layout.shape), hyper.precondition_1d) or _empty(layout):
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
    hyper: Hyper,
    kernels: KernelConfig | None,
    diag: tuple[jax.Array, list] | None = None,
) -> list[LeafStep]:
    """Every tensor's step before grafting (:class:`LeafStep`, of ``leaves``): with ``kernels``
    (:func:`kernels_enabled`) the steps of the tensors (or shards) where ``kernels.supported`` as
    Pallas kernels (bands >= 1 with their state's ``halos``, :func:`_halos`, and their chain
    neighbours beyond the block, ``edges``, :func:`_edges`; with ``applies[k]``,
    ``kernels.Apply``, writing the parameters in ``u``'s
    place), where the tensors of one ``kernels.launch_key`` share launches
    (``kernels.group_update``, ``kernels.launch_group`` tensors each); :func:`_leaf_step` on XLA
    for the others. Each preconditioned tensor steps with its own damping (:func:`_damped`):
    with a relative one, ``diag`` is the state's statistics and each tensor's slot in them
    (:func:`_slots`); a kernel takes the whole vector and its slot and scales ``eps`` itself, so
    every launch shares one scalar input and nothing is sliced out for it."""
    grads, m, d, e, layouts = leaves
    vector, slots = diag if diag is not None else (None, [None] * len(grads))
    hypers = [
        _damped(hyper, None if slot is None else _slot_values(vector, slot, lay, flat=True))
        if _has_chain(lay, hyper)
        else hyper
        for slot, lay in zip(slots, layouts, strict=True)
    ]
    steps: list = [None] * len(grads)
    groups: dict[tuple, list[int]] = {}
    for k, (g, lay, ei, apply) in enumerate(zip(grads, layouts, e, applies, strict=True)):
        if _on_kernel(kernels, lay, _band(ei), hyper):
            groups.setdefault(pallas.launch_key(g, m[k], d[k], ei, apply), []).append(k)
        elif _stack_on_kernel(kernels, lay, _band(ei), hyper):
            stats = None if vector is None else _slot_values(vector, slots[k], lay, flat=True)
            steps[k] = _stacked_step(
                g, m[k], d[k], ei, corrections, hyper, lay, edges[k], kernels, stats
            )
        elif lay.stack:
            steps[k] = _stacked_step(g, m[k], d[k], ei, corrections, hypers[k], lay, edges[k])
        else:
            tpu = kernels if _on_tpu_kernel(kernels, lay, _band(ei), hyper) else None
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
                interpret=_interpret(kernels),
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
    hyper: Hyper,
    layout: ChainLayout,
    edge: pallas.Edges | None,
    kernels: KernelConfig | None = None,
    stats: jax.Array | None = None,
) -> LeafStep:
    """The step of a tensor whose leading ``layout.stack`` dimensions stack tensors (a layer axis):
    each stacked tensor's step, vectorized (``jax.vmap``) over those dimensions flattened into one,
    so the stack is traced and compiled once, not once per tensor. Each stacked tensor has its own
    chain, its own damping and, from :func:`_norm_results`, its own graft ratio: the norm pairs
    come as ``(layers, pairs, tiles)``. ``edge`` is that of the first stacked tensor; the others'
    follow it in its buffer (:func:`_edges`).

    On XLA (``kernels`` None) the step is :func:`_leaf_step`'s, ``hyper.eps`` holding one per
    stacked tensor with a relative damping. With ``kernels`` (:func:`_stack_on_kernel`) it is one
    tensor's halo copies and step kernel (``kernels.gather_halos``, ``kernels.group_update``),
    which the vectorization turns into launches with a grid axis over the stacked tensors: one
    compiled program per stack; ``stats`` are then a relative damping's statistics of the stacked
    tensors (the kernel scales ``eps`` from them), else ``None``."""
    n, k, layer = layout.layers, layout.stack, layout.layer
    band = _band(e)
    interpret = _interpret(kernels)

    def on_xla(g, m, d, e, rows, eps):
        here = hyper if eps is None else hyper._replace(eps=eps)
        edge = None if rows is None else pallas.Edges(rows, 0)
        return _leaf_step(g, m, d, e, corrections, here, layer, edge)

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
    rows = _stack_edge_rows(edge, band, g.shape[k:], n)
    e_in = e if band == 0 else _stack_flat(e, k, lead=1)
    u, m_new, d_new, e_new, pairs = jax.vmap(
        one, in_axes=(0, 0, 0, 1, 0, 0), out_axes=LeafStep(0, 0, 0, 1, 0)
    )(*(_stack_flat(x, k) for x in (g, m, d)), e_in, rows, per_tensor)
    e_new = e_new if band == 0 else e_new.reshape(e.shape)
    return LeafStep(
        u.reshape(g.shape), m_new.reshape(m.shape), d_new.reshape(d.shape), e_new, pairs
    )


def _stack_edge_rows(
    edge: pallas.Edges | None, band: int, shape: tuple[int, ...], n: int
) -> jax.Array | None:
    """The edges of a stack's ``n`` tensors of local ``shape`` (``(n, 3 + b, rows, *shape[1:])``
    flattened per tensor), which follow its first's in its ``edge``'s buffer (:func:`_edges`)."""
    if edge is None:
        return None
    before, after = halo_width(band)
    per = (3 + band) * (before + after) * math.prod(shape[1:])
    return edge.buffer[edge.index * per : (edge.index + n) * per].reshape(n, per)


def _stack_flat(x: jax.Array, stack: int, lead: int = 0) -> jax.Array:
    """``x`` with its ``stack`` stacked dimensions (after ``lead`` others) flattened into one: a
    reshape of leading dimensions, which moves no data."""
    return x if not stack else x.reshape(*x.shape[:lead], -1, *x.shape[lead + stack :])


def _raw(g: jax.Array, m: jax.Array, d: jax.Array) -> Raw:
    """A tensor's gradient and state as the step reads them: in the arithmetic's dtype
    (``pointwise.compute_dtype`` of the statistics')."""
    compute = pointwise.compute_dtype(d.dtype)
    return Raw(g.astype(compute), m.astype(compute), d.astype(compute))


def _interpret(kernels: KernelConfig | None = None) -> bool:
    """Whether the kernels run in Pallas' interpreter: ``KernelConfig.interpret``, by default off
    their platform's backend (tests on CPU)."""
    if kernels is not None and kernels.interpret is not None:
        return kernels.interpret
    platform = "gpu" if kernels is None else _platform(kernels)
    return jax.default_backend() != platform


def _band(e: Any) -> int:
    """The band of a tensor's off-diagonal statistics ``e`` (0: none, ``optax.MaskedNode``)."""
    return 0 if isinstance(e, optax.MaskedNode) else e.shape[0]


def _empty(layout: ChainLayout) -> bool:
    """Whether the tensor has no elements (a 0-size dimension): it has no chain to precondition."""
    return math.prod(layout.shape) == 0


def _has_chain(layout: ChainLayout, hyper: Hyper) -> bool:
    """Whether the tensor's step reads its chain (it is preconditioned and not empty)."""
    return not _empty(layout) and preconditioned(len(layout.layer.shape), hyper.precondition_1d)


def _has_axis(layout: ChainLayout) -> bool:
    """Whether the tensor (each stacked one) has an axis 0, along which the kernels lay out its
    chain: a 0-d tensor, a chain of one element, steps on XLA."""
    return bool(layout.layer.shape)


def _on_kernel(kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: Hyper) -> bool:
    """Whether :func:`_leaf_steps` runs this preconditioned tensor's step as a GPU kernel."""
    return (
        kernels is not None
        and _platform(kernels) == "gpu"
        and not layout.stack
        and _has_chain(layout, hyper)
        and _has_axis(layout)
        and pallas.supported(layout, band, kernels)
    )


def _platform(kernels: KernelConfig) -> str:
    """The platform whose kernels run (``KernelConfig.platform``)."""
    if kernels.platform is not None:
        return kernels.platform
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def _stack_on_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: Hyper
) -> bool:
    """Whether :func:`_leaf_steps` runs a stack's steps as GPU kernels (:func:`_stacked_step`):
    the kernels take each of its tensors."""
    return bool(layout.stack) and _on_kernel(kernels, layout.layer, band, hyper)


def _on_tpu_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: Hyper
) -> bool:
    """Whether :func:`_leaf_steps` runs this tensor's step as a TPU kernel (``kernels.tpu``): on a
    block whose view tiles (``tpu.block_shape``)."""
    return (
        kernels is not None
        and _platform(kernels) == "tpu"
        and not layout.stack
        and _has_chain(layout, hyper)
        and _has_axis(layout)
        and pallas.tpu.block_shape(pallas.local_shape(layout), band, kernels) is not None
    )


def _on_any_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: Hyper
) -> bool:
    """Whether a kernel, the GPU's (:func:`_on_kernel`) or the TPU's (:func:`_on_tpu_kernel`),
    steps this tensor: its edges then hold the old state, and it may write its parameters."""
    return _on_kernel(kernels, layout, band, hyper) or _on_tpu_kernel(kernels, layout, band, hyper)


def _damped(hyper: Hyper, diag: Any) -> Hyper:
    """``hyper`` with this tensor's damping (``sonew``'s ``damping``): ``"absolute"`` keeps
    ``eps``; a relative damping multiplies it by ``diag``, the mean (``"mean"``) or largest entry
    (``"max"``) of the tensor's bias-corrected diagonal ``d_hat`` at the previous step (the
    state's, which the step's norm pairs give at no extra pass or message: :func:`_diag_scales`),
    at least the smallest normal number. While ``diag`` is 0 (no step yet, or only zero
    gradients) the damping is infinite: ``u = 0``, the moments accumulate.

    A relative damping scales with the gradients' squared scale, as ``d_hat`` does, so the
    grafted update does not change when the gradients are scaled (the paper's regret bound takes
    ``eps`` proportional to the gradients' bound, Theorem 3).
    """
    if hyper.damping == "absolute":
        return hyper
    return hyper._replace(eps=pointwise.relative_eps(hyper.eps, diag))


def _halos(
    m: list, d: list, e: list, layouts: list, hyper: Hyper, kernels: KernelConfig | None
) -> list:
    """The halo rows of every kernel tensor's ``(m, d, e)`` (bands >= 1; ``kernels.gather_halos``),
    gathered together before any step kernel overwrites its state: a few launches per model
    instead of one per tensor. ``None`` for the other tensors."""
    bands = [_band(ei) for ei in e]  # 0 where a tensor has no off-diagonals (1-D)
    on = [
        band >= 1 and _on_kernel(kernels, lay, band, hyper)
        for band, lay in zip(bands, layouts, strict=True)
    ]
    halos: list = [None] * len(on)
    for band in sorted({b for b, flag in zip(bands, on, strict=True) if flag}):
        members = [k for k, flag in enumerate(on) if flag and bands[k] == band]
        arrays = [x for k in members for x in (m[k], d[k], e[k])]
        shapes = [pallas.local_shape(layouts[k]) for k in members for _ in range(3)]
        gathered = iter(
            pallas.gather_halos(
                arrays, band=band, shapes=shapes, interpret=_interpret(kernels), config=kernels
            )
        )
        for k in members:
            halos[k] = tuple(next(gathered) for _ in range(3))
    return halos


def _edges(leaves: Leaves, hyper: Hyper, kernels: KernelConfig | None) -> list:
    """The ``edges`` (``kernels.Edges``) of every band >= 1 kernel tensor, every band-1 tensor on
    XLA and every sharded band >= 2 tensor on XLA thick enough to extend (:func:`_extends`),
    ``None`` for the others: those of the tensors of one layout, band and statistics
    dtype built together (``kernels.kernel_edges``). Sharded, the slabs of all tensors that go
    the same way travel together: one collective-permute per mesh axes, direction and round
    (``chain.run``), whatever the number of tensors."""
    grads, m, d, e, layouts = leaves
    groups: dict[tuple, list[int]] = {}
    for k, (ei, lay) in enumerate(zip(e, layouts, strict=True)):
        band = _band(ei)
        if band == 0 or not _has_chain(lay, hyper):
            continue
        kernel = _on_any_kernel(kernels, lay, band, hyper) or _stack_on_kernel(
            kernels, lay, band, hyper
        )
        if kernel or band == 1 or _extends(grads[k].shape[lay.stack], lay.layer, band):
            groups.setdefault((lay.layer, band, jnp.dtype(d[k].dtype), kernel), []).append(k)
    programs = [
        pallas.kernel_edges(  # a stack's tensors on one axis
            *([_stack_flat(x[k], layouts[k].stack) for k in members] for x in (grads, m, d)),
            [_stack_flat(e[k], layouts[k].stack, lead=1) for k in members],
            layout,
            [bool(layouts[k].stack) for k in members],
        )
        for (layout, *_), members in groups.items()
    ]
    edges: list = [None] * len(grads)
    for members, found in zip(groups.values(), run(parallel(programs)), strict=True):
        for k, x in zip(members, found, strict=True):
            edges[k] = x
    return edges


def _extends(rows: int, layout: ChainLayout, band: int) -> bool:
    """Whether a band >= 2 tensor's XLA step runs on its block (of ``rows`` local rows along its
    chain's axis 0) extended by its neighbours' rows (:func:`_on_extended_block`): sharded, with
    at least as many rows as one hop of the halo (``chain.edges_of``); thinner shards shift
    through ``chain.shift``'s exchanges."""
    return band >= 2 and bool(layout.mesh_axes) and rows >= max(halo_width(band))


# Tensors whose norm pairs one reduction merges (over their stacked pairs). The results, graft_lag's
# ratios and a relative damping's statistics, go to one array each (``_gathered``).
_GRAFT_GROUP = 32


def _norm_results(
    parts: list[jax.Array | None], layouts: list, hyper: Hyper
) -> tuple[list[jax.Array | None], list[jax.Array | None]]:
    """Each tensor's graft ratio ``||adam|| / ||u||`` (``None`` without grafting) and a relative
    damping's scale for the next step (:func:`_diag_scales`; ``None`` with the absolute one), each
    of shape ``(layout.layers,)``, from :func:`_leaf_steps`' local norm pairs ``(2 pairs,
    tiles)`` of the kernels' tiles, or of the XLA step (a tile per row), ``(layers, 2 pairs,
    tiles)`` for a stack (:func:`_stacked_step`); ``None`` for tensors without pairs.

    The pairs are merged over the tiles (``chain.merge_pairs``) for the tensors of one shape
    together (up to ``_GRAFT_GROUP`` at a time, over their stacked pairs): a model's update
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
        for start in range(0, len(members), _GRAFT_GROUP):
            group = members[start : start + _GRAFT_GROUP]
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


def _diag_scales(top: jax.Array, total: jax.Array, sizes: list[int], hyper: Hyper) -> Any:
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


def _slots(layouts: list, precondition_1d: bool) -> list[int | None]:
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
    """How many per-tensor numbers the state keeps for tensors of ``layouts`` (:func:`_slots`)."""
    return sum(
        lay.layers for lay in layouts if preconditioned(len(lay.layer.shape), precondition_1d)
    )


def _slot_values(
    vector: jax.Array, slot: int, layout: ChainLayout, flat: bool = False
) -> jax.Array:
    """A tensor's numbers in ``vector`` (:func:`_slots`): a scalar, or for a stack one per stacked
    tensor, shaped to scale the stack (``flat``: as a vector)."""
    return _per_tensor(vector[slot : slot + layout.layers], layout, flat)


def _per_tensor(values: jax.Array, layout: ChainLayout, flat: bool = False) -> jax.Array:
    """``values``, one per stacked tensor of ``layout``: a scalar when nothing is stacked, else
    ``(layers,)`` (``flat``) or shaped to broadcast over the stack."""
    if not layout.stack:
        return values.reshape(())
    return (
        values
        if flat
        else values.reshape(layout.shape[: layout.stack] + (1,) * len(layout.layer.shape))
    )


def _gathered(fresh: list, vector: jax.Array, slots: list, layouts: list) -> jax.Array:
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


def _graft(u: jax.Array, ratio: jax.Array | None, lagged: Any) -> jax.Array:
    """``u`` scaled by this step's ``ratio``, or with ``graft_lag`` (``lagged``, the previous
    step's, not ``None``) by that one."""
    if ratio is None:
        return u
    return u * (ratio if lagged is None else lagged)


def _kernel_apply(
    apply: ApplyArgs | None,
    p,
    decayed,
    e,
    slot: int | None,
    ratio: jax.Array | None,
    hyper: Hyper,
    layout: ChainLayout,
    kernels: KernelConfig | None,
) -> pallas.Apply | None:
    """The ``kernels.Apply`` of a tensor whose kernel writes its parameters: one on the kernels
    whose graft ratio is known before the step, 1 without grafting or graft_lag's (``ratio``, the
    state's array, read at the tensor's ``slot``); else ``None`` (then its ``u`` is written out
    and grafted with the step's own ratio before it is applied)."""
    if apply is None or not _on_any_kernel(kernels, layout, _band(e), hyper):
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


def make_step(
    hyper: Hyper,
    mesh: Any,
    param_specs: Any,
    implementation: str,
    kernel_config: KernelConfig,
    stacked_axes: Any = None,
) -> Callable:
    """The whole-tree step ``(updates, m, d, e, ratio, diag, corrections, apply) -> (out, m, d,
    e, ratio, diag)``: ``out`` is the grafted direction ``u`` in the gradients' dtype, or with
    ``apply`` (:class:`ApplyArgs`) the new parameters, from the kernels where they know the graft
    ratio before the step (:func:`_kernel_apply`), else ``pointwise.apply_update`` of ``u`` on
    XLA. ``ratio`` (graft_lag's ratios) and ``diag`` (a relative damping's statistics,
    :func:`_damped`) are each one array over the preconditioned tensors (:func:`_slots`), or
    ``None``. ``stacked_axes`` says which leading dimensions of each tensor stack tensors
    (``sharding.stack_counts``); their steps are :func:`_stacked_step`'s."""
    kernels = kernels_enabled(implementation, mesh, kernel_config)

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
        slots = _slots(layouts, hyper.precondition_1d)
        lagged = [
            None if ratio is None or k is None else _slot_values(ratio, k, lay)
            for k, lay in zip(slots, layouts, strict=True)
        ]
        halos = _halos(leaves.m, leaves.d, leaves.e, layouts, hyper, kernels)
        edges = _edges(leaves, hyper, kernels)
        fused_apply = [
            _kernel_apply(apply, p, flag, ei, slot, ratio, hyper, lay, kernels)
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
            hyper,
            kernels,
            None if diag is None else (diag, slots),
        )
        ratios, scales = _norm_results([step.pairs for step in steps], layouts, hyper)
        out: list[list[Any]] = [[] for _ in range(4)]
        for g, step, fresh, old, p, flag, leaf_apply, lay in zip(
            leaves.grads, steps, ratios, lagged, params, decayed, fused_apply, layouts, strict=True
        ):
            if leaf_apply is not None:  # the kernel wrote the parameters
                x = step.u
            else:
                fresh = None if fresh is None else _per_tensor(fresh, lay)
                x = _graft(step.u, fresh, old).astype(g.dtype)
                if apply is not None:
                    decay = apply.weight_decay if flag else 0.0
                    x = pointwise.apply_update(p, x, 1, decay, apply.scale).astype(p.dtype)
            for k, y in enumerate((x, step.m, step.d, step.e)):
                out[k].append(y)
        new_ratio = None if ratio is None else _gathered(ratios, ratio, slots, layouts)
        new_diag = None if diag is None else _gathered(scales, diag, slots, layouts)
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
