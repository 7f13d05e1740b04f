"""The rows a kernel reads beyond its row chunk: halo copies of the state, and a block's edges.

The step kernels update the state in place, so no program may read a row that another one
overwrites. Before the steps, :func:`gather_halos` copies the rows each chunk's walk reads from
the chunks beside it (:func:`band_halo_rows`), for many arrays per launch; the chain neighbours
beyond the view's first and last rows (the wrap into the next column, or a neighbouring shard's
rows) come in the :class:`Edges` built by :func:`kernel_edges`, for all tensors of one layout at
once and, sharded, exchanged with one collective-permute per direction.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import pointwise
from sonew_pax.optim.chain import ChainLayout, Program, edges_of, halo_width
from sonew_pax.optim.kernels.config import DEFAULT, KernelConfig
from sonew_pax.optim.kernels.geometry import chunk_rows, default_tile, tile_view
from sonew_pax.optim.kernels.program import bind


class Halo(NamedTuple):
    """Where one state array's halo rows live: a flat ``buffer`` that holds the halo rows of
    several same-shaped arrays (:func:`gather_halos`), this one's from sub-array ``index`` on, in
    row chunks of ``rows``. A sub-array is one ``R x C`` view (:func:`tile_view`): ``m`` and
    ``d`` have one, ``e`` one per off-diagonal. Its halo rows (:func:`band_halo_rows`: ``3b - 1``
    per chunk, for band 1 the chunk's first and last row) start at ``sub * chunks * (3b - 1) *
    C``."""

    buffer: jax.Array
    index: int
    rows: int


def halo_rows(i, rows: int, num_rows: int, band: int) -> tuple[jax.Array, jax.Array]:
    """The rows of the view in chunk ``i``'s halo slots, as :func:`band_halo_rows`, as a vector
    over the slots padded to a power of two, and which of its entries are slots."""
    first, last = chunk_rows(i, rows, num_rows)
    head, span = 2 * band - 1, 3 * band - 1
    slot = jnp.arange(pl.next_power_of_2(span), dtype=jnp.int32)
    tail = jnp.maximum(last - band + 1 + slot - head, first)
    return jnp.where(slot < head, jnp.minimum(first + slot, last), tail), slot < span


def halo_kernel(*refs, view, rows, cols, band, subs):
    """Program ``(s, i, j)`` copies column block ``j`` of chunk ``i``'s halo rows of sub-array
    ``s`` (input ``k`` holds sub-arrays ``k subs`` to ``(k + 1) subs - 1``; a branch per input:
    the refs are static) into its slots, all slots in one masked load and store of a block of
    ``next_pow2(3b - 1)`` rows (unrolled row by row, the copies' Triton code is several times a
    banded walk's, and slow to lower)."""
    *inputs, out_ref = refs
    num_rows, num_cols = view
    size, chunks, span = num_rows * num_cols, pl.cdiv(num_rows, rows), 3 * band - 1
    s, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)
    sources, slots = halo_rows(i, rows, num_rows, band)
    mask = slots[:, None] & (c < num_cols)[None, :]
    slot = jnp.arange(sources.shape[0], dtype=jnp.int32)
    at = ((s * chunks + i) * span + slot[:, None]) * num_cols + c[None, :]
    # A masked lane's address would be another slot's: on a GPU it stores nothing, but the
    # interpreter stores a masked block by writing every lane back, in an order its device does
    # not fix. Out of range, the interpreter drops it.
    at = jnp.where(mask, at, out_ref.shape[0])
    for k, ref in enumerate(inputs):

        @pl.when(s // subs == k)
        def _copy(ref=ref, first=k * subs):
            offsets = (s - first) * size + sources[:, None] * num_cols + c[None, :]
            plgpu.store(out_ref.at[at], plgpu.load(ref.at[offsets], mask=mask), mask=mask)


def gather_halos(
    arrays: list[jax.Array],
    rows: int | None = None,
    *,
    band: int = 1,
    shapes: list[tuple[int, ...]] | None = None,
    interpret: bool = False,
    config: KernelConfig = DEFAULT,
) -> list[Halo]:
    """The halo rows (:func:`band_halo_rows`) of band-``band`` state arrays, read before the step
    kernels overwrite them in place.

    Array ``k`` is the state of a parameter of ``shapes[k]`` (default: its own shape): ``m``,
    ``d``, or ``e`` of ``band`` off-diagonals stacked in front. Arrays of one view shape, dtype
    and number of sub-arrays share launches (up to ``config.halo_group`` arrays each), so a
    model's update adds a few small kernels, not one per tensor. Those launches are of equal size
    (a short last one repeats its last array), so the buffers of such arrays all have one shape:
    the step kernels of one tensor shape, which take the buffers as inputs, are then one compiled
    program, not one per combination of buffer sizes (each is slow to compile). ``rows`` is the
    step kernel's row chunk (default: ``geometry.default_tile``'s for each view). Returns one
    :class:`Halo` per array, in order.
    """
    shapes = shapes or [x.shape for x in arrays]
    groups: dict[tuple, list[int]] = {}
    for k, (x, shape) in enumerate(zip(arrays, shapes, strict=True)):
        view = tile_view(shape)
        groups.setdefault((view, jnp.dtype(x.dtype), x.size // math.prod(view)), []).append(k)
    halos: list[Halo | None] = [None] * len(arrays)
    for (view, dtype, subs), members in groups.items():
        rows_here = rows or default_tile(band, view, config)[0]
        one = subs * (3 * band - 1) * pl.cdiv(view[0], rows_here) * view[1]  # an array's halo
        most = min(config.halo_group, max(1, config.max_offset // one))  # per indexable buffer
        per = pl.cdiv(len(members), pl.cdiv(len(members), most))
        cols = min(config.halo_cols, pl.next_power_of_2(view[1]))
        gather = halo_call(view, dtype, rows_here, cols, band, subs, per, interpret)
        for first in range(0, len(members), per):
            part = [arrays[k].reshape(-1) for k in members[first : first + per]]
            # A short last launch repeats its last array: every launch, and so every buffer, is
            # the same (see the docstring).
            buffer = gather(*part, *part[-1:] * (per - len(part)))
            for position, k in enumerate(members[first : first + per]):
                halos[k] = Halo(buffer, position * subs, rows_here)
    return halos


@functools.cache
def halo_call(
    view: tuple[int, int],
    dtype,
    rows: int,
    cols: int,
    band: int,
    subs: int,
    count: int,
    interpret: bool,
) -> Callable:
    """:func:`gather_halos`' launch for ``count`` arrays of ``subs`` sub-arrays each of one
    ``view`` and ``dtype`` (programs of ``cols`` columns), jitted and cached (as
    ``launch.step_call``): its launches lower to one Triton module."""
    num_rows, num_cols = view
    chunks, span = pl.cdiv(num_rows, rows), 3 * band - 1
    gather = pl.pallas_call(
        bind(halo_kernel, "sonew_halo", view=view, rows=rows, cols=cols, band=band, subs=subs),
        grid=(count * subs, chunks, pl.cdiv(num_cols, cols)),
        out_shape=jax.ShapeDtypeStruct((count * subs * span * chunks * num_cols,), dtype),
        interpret=interpret,
        # Triton's parameters select Triton: without them Pallas may lower for Mosaic GPU, whose
        # copies reject these rows (tests/test_kernels.py lowers the update for CUDA).
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4),
        name="sonew_halo",
    )
    return jax.jit(gather)


def band_halo_rows(num_rows: int, rows: int, band: int) -> list[int]:
    """The rows of the view whose pre-step state the band-``b`` walks of other chunks read: per
    row chunk of ``rows``, its first ``2b - 1`` rows (read by the walk of the chunk above) and its
    last ``b`` (read by the chunk below), in this order (a chunk shorter than that repeats its
    last or first row: those slots are never read)."""
    out = []
    for first in range(0, num_rows, rows):
        last = min(first + rows, num_rows) - 1
        out += [min(first + s, last) for s in range(2 * band - 1)]
        out += [max(last - band + 1 + s, first) for s in range(band)]
    return out


def across_chunks(i, c, num_rows: int, num_cols: int, rows: int, step: int) -> tuple:
    """The chain neighbours of row chunk ``i``'s first row (``step=-1``, above) or last row
    (``step=1``, below) in columns ``c``: ``(offset, halo, edge)``.

    Inside the view the neighbour is the previous / next chunk's edge row: ``offset`` is its flat
    offset and ``halo`` its place in the halo rows (:class:`Halo`, relative to the array's start),
    which hold the state as it was before this step. At the view's top and bottom (``edge``) it
    is row 0 (above) or 1 (below) of the band-1 ``edges`` input (:func:`kernel_edges`).
    """
    first, last = chunk_rows(i, rows, num_rows)
    row = first - 1 if step < 0 else last + 1
    edge = i == 0 if step < 0 else last == num_rows - 1
    row = jnp.clip(row, 0, num_rows - 1)
    slot = 2 * (row // rows) + (1 if step < 0 else 0)
    return row * num_cols + c, slot * num_cols + c, edge


class Edges(NamedTuple):
    """Where one tensor's ``edges`` input lives (:func:`kernel_edges`): in a flat ``buffer`` of
    the edges of several tensors of one layout, ``(tensors, 3 + b, 3b - 1, C)``, as tensor
    ``index``."""

    buffer: jax.Array
    index: int


def kernel_edges(
    gs: list[jax.Array],
    ms: list[jax.Array],
    ds: list[jax.Array],
    es: list[Any],
    layout: ChainLayout,
    stacked: list[bool] | None = None,
) -> Program:
    """An exchange program returning the :class:`Edges` of band-``b`` step kernels on the local
    blocks of tensors of one ``layout`` and dtypes: the chain neighbours beyond the view's first
    and last rows (``chain.edges_of``, ``chain.halo_width``: ``b`` rows above, ``2b - 1`` below,
    one each for band 1) of ``g``, ``m``, ``d`` and ``e``'s ``b`` off-diagonals, in the kernels'
    arithmetic's dtype (``pointwise.compute_dtype`` of ``d``'s), per tensor as ``(3 + b, 3b - 1,
    C)``: the rows above, then those below, of array ``0`` (``g``), ``1`` (``m``), ``2`` (``d``)
    and ``3 + k`` (``e[k]``) of the view (:func:`tile_view`).

    For a tensor whole on the device these are a column's neighbours at the wraps between columns
    (zero at the chain's ends); for a shard, the neighbouring shards' rows. The slabs of all the
    tensors go through one program, stacked: a model's update builds its edges in a few
    operations per layout, not per tensor, and sharded, they travel with every other layout's
    (``chain.run`` of ``chain.parallel`` programs).

    Where ``stacked[i]``, member ``i`` holds several tensors of ``layout`` on a leading axis
    (``g``, ``m``, ``d`` as ``(n, *shape)``, ``e`` as ``(b, n, *shape)``): its edges are those of
    its ``n`` tensors, one after another, and its :class:`Edges` is the first's.
    """
    stacked = [False] * len(gs) if stacked is None else stacked
    band = es[0].shape[0]
    before, after = halo_width(band)
    compute = pointwise.compute_dtype(ds[0].dtype)
    rows = ds[0].shape[int(stacked[0])]

    def rows_of(start: int, stop: int) -> jax.Array:
        """Rows ``start:stop`` of every array (and of each of ``e``'s off-diagonals), stacked:
        each sliced along the tensor's axis 0 before anything else. Stacked, or sliced along
        another axis first, a TPU's layout assignment writes whole arrays out to take a few
        rows: band 1's one off-diagonal is sliced as ``e[0]`` (a bitcast), several together
        along ``e``'s axis 1 (split first, each would be written out). A stacked member's slabs
        are interleaved per tensor."""
        slabs = []
        for g, m, d, e, lead in zip(gs, ms, ds, es, stacked, strict=True):
            arrays = (g, m, d, e[0]) if band == 1 else (g, m, d)
            parts = [lax.slice_in_dim(x, start, stop, axis=int(lead))[None] for x in arrays]
            if band > 1:
                parts.append(lax.slice_in_dim(e, start, stop, axis=1 + int(lead)))
            if lead:  # (3 + b, n, rows, ...) -> each tensor's 3 + b slabs together
                block = jnp.concatenate(parts)
                parts = [jnp.moveaxis(block, 1, 0).reshape(-1, *block.shape[2:])]
            slabs += [x.astype(compute) for x in parts]
        return jnp.concatenate(slabs)

    pre, post = yield from edges_of(rows_of(rows - before, rows), rows_of(0, after), layout)
    buffer = jnp.concatenate([pre, post], axis=1).reshape(-1)
    counts = [g.shape[0] if lead else 1 for g, lead in zip(gs, stacked, strict=True)]
    firsts = [sum(counts[:i]) for i in range(len(gs))]
    return [Edges(buffer, first) for first in firsts]
