"""What a tensor's step reads beyond its own block: the state's halo rows and the chain's edges.

The kernels read their tensor's neighbouring rows of ``(m, d, e)`` from halos gathered before
any step overwrites the state (:func:`halo_rows`); a shard's step reads the rows its chain
neighbours hold on other devices from its edges (:func:`exchanged_edges`), which every tensor
exchanges together. Both are built for all tensors at once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sonew_pax.optim import kernels as pallas
from sonew_pax.optim.chain import ChainLayout, halo_width, parallel, run
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.dispatch import (
    band_of,
    has_chain,
    interpreted,
    on_any_kernel,
    on_gpu_kernel,
    stack_on_kernel,
    stack_on_tpu_kernel,
)
from sonew_pax.optim.kernels import KernelConfig
from sonew_pax.optim.state import Leaves


def halo_rows(
    m: list, d: list, e: list, layouts: list, hyper: SONewConfig, kernels: KernelConfig | None
) -> list:
    """The halo rows of every kernel tensor's ``(m, d, e)`` (bands >= 1; ``kernels.gather_halos``),
    gathered together before any step kernel overwrites its state: a few launches per model
    instead of one per tensor. ``None`` for the other tensors."""
    bands = [band_of(ei) for ei in e]  # 0 where a tensor has no off-diagonals (1-D)
    on = [
        band >= 1 and on_gpu_kernel(kernels, lay, band, hyper)
        for band, lay in zip(bands, layouts, strict=True)
    ]
    halos: list = [None] * len(on)
    for band in sorted({b for b, flag in zip(bands, on, strict=True) if flag}):
        members = [k for k, flag in enumerate(on) if flag and bands[k] == band]
        arrays = [x for k in members for x in (m[k], d[k], e[k])]
        shapes = [pallas.local_shape(layouts[k]) for k in members for _ in range(3)]
        gathered = iter(
            pallas.gather_halos(
                arrays, band=band, shapes=shapes, interpret=interpreted(kernels), config=kernels
            )
        )
        for k in members:
            halos[k] = tuple(next(gathered) for _ in range(3))
    return halos


def exchanged_edges(leaves: Leaves, hyper: SONewConfig, kernels: KernelConfig | None) -> list:
    """The ``edges`` (``kernels.Edges``) of every band >= 1 kernel tensor, every band-1 tensor on
    XLA and every sharded band >= 2 tensor on XLA thick enough to extend (:func:`_extends`),
    ``None`` for the others: those of the tensors of one layout, band and statistics
    dtype built together (``kernels.kernel_edges``). Sharded, the slabs of all tensors that go
    the same way travel together: one collective-permute per mesh axes, direction and round
    (``chain.run``), whatever the number of tensors."""
    grads, m, d, e, layouts = leaves
    groups: dict[tuple, list[int]] = {}
    for k, (ei, lay) in enumerate(zip(e, layouts, strict=True)):
        band = band_of(ei)
        if band == 0 or not has_chain(lay, hyper):
            continue
        kernel = any(
            on(kernels, lay, band, hyper)
            for on in (on_any_kernel, stack_on_kernel, stack_on_tpu_kernel)
        )
        if kernel or band == 1 or _extends(grads[k].shape[lay.stack], lay.layer, band):
            groups.setdefault((lay.layer, band, jnp.dtype(d[k].dtype), kernel), []).append(k)
    programs = [
        pallas.kernel_edges(  # a stack's tensors on one axis
            *([stack_flat(x[k], layouts[k].stack) for k in members] for x in (grads, m, d)),
            [stack_flat(e[k], layouts[k].stack, lead=1) for k in members],
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


def edge_rows(edge: pallas.Edges, band: int, shape: tuple[int, ...]) -> tuple:
    """A tensor's edges (``kernels.kernel_edges``) in its own layout: ``(pre, post)`` of shapes
    ``(3 + b, before, *shape[1:])`` and ``(3 + b, after, *shape[1:])`` (``chain.halo_width``),
    arrays ``g, m, d, e[0], ..`` along the first axis."""
    before, after = halo_width(band)
    count = edge.buffer.size // ((3 + band) * (before + after) * math.prod(shape[1:]))
    rows = edge.buffer.reshape(count, 3 + band, before + after, *shape[1:])[edge.index]
    return rows[:, :before], rows[:, before:]


def stack_edge_rows(
    edge: pallas.Edges | None, band: int, shape: tuple[int, ...], n: int
) -> jax.Array | None:
    """The edges of a stack's ``n`` tensors of local ``shape`` (``(n, 3 + b, rows, *shape[1:])``
    flattened per tensor), which follow its first's in its ``edge``'s buffer
    (:func:`exchanged_edges`)."""
    if edge is None:
        return None
    before, after = halo_width(band)
    per = (3 + band) * (before + after) * math.prod(shape[1:])
    return edge.buffer[edge.index * per : (edge.index + n) * per].reshape(n, per)


def stack_flat(x: jax.Array, stack: int, lead: int = 0) -> jax.Array:
    """``x`` with its ``stack`` stacked dimensions (after ``lead`` others) flattened into one: a
    reshape of leading dimensions, which moves no data."""
    return x if not stack else x.reshape(*x.shape[:lead], -1, *x.shape[lead + stack :])


def _extends(rows: int, layout: ChainLayout, band: int) -> bool:
    """Whether a band >= 2 tensor's XLA step runs on its block (of ``rows`` local rows along its
    chain's axis 0) extended by its neighbours' rows (``engine._on_extended_block``): sharded, with
    at least as many rows as one hop of the halo (``chain.edges_of``); thinner shards shift
    through ``chain.shift``'s exchanges."""
    return band >= 2 and bool(layout.mesh_axes) and rows >= max(halo_width(band))
