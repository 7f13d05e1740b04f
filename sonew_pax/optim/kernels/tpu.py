"""SONew's step as Pallas TPU (Mosaic) kernels: one pass over the state, in place.

On a TPU the XLA step shifts arrays by rows along axis 0, the second-minor (sublane) axis of the
TPU's ``(8, 128)`` tiles. XLA materialises each shifted array, and the norms' reduction reads the
state again: several times AdamW's HBM bytes on a tensor too large for VMEM
(``benchmarks/tpu_compile.py``; docs/performance.md has the counts). These kernels keep a block of
``(rows, cols)`` of the tensor's 2-D view (``geometry.tile_view``) in VMEM, shift it there
(``pltpu.roll``, a rotate of the block's sublanes), and write the new state in place, ``u`` and
the block's norm pairs: they read ``g, m, d, e`` and write ``m, d, e, u`` once.

* Band 1 (:func:`_kernel`): each element's outputs need its chain neighbours' *new*
  moments. Inside a block they are the block's own, shifted; at a block's first and last rows
  they come from ``prev`` and ``next`` (``_neighbour_rows``), built before the kernel from the
  old state: the rows just outside each block and, beyond the view, the tensor's ``edges``
  (``neighbours.exchanged_edges``: the previous column's last row, or a neighbouring shard's), their
  moments updated by XLA (a few rows per block).
* Bands ``b >= 2`` (:func:`_banded_kernel`): each block is extended by :func:`banded_halo` rows
  of the old state on each side, the whole-tensor step (``solve``) runs on the extended block,
  and the block keeps its own rows, as the XLA path does for a shard
  (``engine._on_extended_block``).

So every program reads only old state and the blocks run in any order. The math is
:mod:`pointwise`'s and :mod:`solve`'s, as on XLA and in the GPU kernels. Opt-in (``sonew(...,
implementation="pallas")`` on a TPU) until they have run on one: they are tested in Pallas'
interpreter against the XLA step and lowered for TPU on a CPU host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sonew_pax.optim import pointwise, solve
from sonew_pax.optim.chain import halo_width
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.kernels.config import KernelConfig
from sonew_pax.optim.kernels.geometry import tile_view
from sonew_pax.optim.kernels.program import Apply, scale_floor
from sonew_pax.optim.pointwise import Raw

# Sublanes of a TPU tile for 16-bit dtypes (32-bit ones take 8): a block's rows are a multiple.
_SUBLANES = 16
_LANES = 128
# The scalars of a launch, in SMEM: b1, b2, eps, gamma, graft_eps, the bias corrections, and the
# fused apply's graft ratio, weight decay and scale.
_SCALARS = 10


def block_shape(shape: tuple[int, ...], band: int, config: KernelConfig) -> tuple[int, int] | None:
    """The ``(rows, cols)`` block of the view of a tensor of ``shape`` that one program of band
    ``band`` steps, or ``None`` where no kernel applies (the XLA step runs): band 0 or above
    ``config.max_band``, a tensor of fewer than two dimensions, a view whose rows are not a
    multiple of 16 or whose columns are not a multiple of 128 (the TPU's tiles).

    Columns: the largest multiple of 128 that divides the view's and is at most the second of
    ``config.tpu_block`` (band 1) or ``config.tpu_banded_block`` (bands >= 2: their solve holds
    ``O(b^2)`` block-sized values); rows: the largest multiple of 16 that divides the view's and
    keeps the block within that shape's elements, for bands >= 2 at least their halo
    (:func:`banded_halo`). Blocks that tile the view exactly need no masks.
    """
    if len(shape) < 2 or not 1 <= band <= config.max_band:
        return None
    rows, cols = tile_view(shape)
    if rows % _SUBLANES or cols % _LANES:
        return None
    max_rows, max_cols = config.tpu_block if band == 1 else config.tpu_banded_block
    block_cols = _largest_divisor(cols, _LANES, max_cols)
    block_rows = _largest_divisor(rows, _SUBLANES, max(max_rows * max_cols // block_cols, 1))
    if band >= 2 and block_rows < banded_halo(band):  # its halo comes from one block each side
        return None
    return block_rows, block_cols


def _largest_divisor(n: int, step: int, limit: int) -> int:
    """The largest multiple of ``step`` that divides ``n`` and is at most ``limit`` (``step`` if
    none is)."""
    for size in range(limit - limit % step, step - 1, -step):
        if n % size == 0:
            return size
    return step


def _neighbour_rows(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: jax.Array,
    pre: jax.Array,
    post: jax.Array,
    rows: int,
    hyper: SONewConfig,
) -> tuple[jax.Array, jax.Array]:
    """``(prev, next)``, each ``(blocks, 4, cols)`` in the arithmetic's dtype: per block of
    ``rows`` rows of the view, the chain neighbours of its first and last rows as ``g``, the new
    ``m`` and ``d``, and the old ``e`` (``e`` is ``e[0]`` of the state). They are rows of the old
    state (inside the view) or its edges ``pre`` and ``post`` (``(4, 1, *shape[1:])``, beyond
    it), their moments updated here: a few rows per block."""
    num_rows, cols = tile_view(g.shape)
    dtype = pointwise.compute_dtype(d.dtype)
    view = [x.reshape(num_rows, cols) for x in (g, m, d, e)]

    def rows_of(start: int, edge: jax.Array, last: bool) -> jax.Array:
        """Rows ``start, start + rows, ...`` (one per block boundary) of ``g, m, d, e`` with the
        ``edge`` row after them (``last``) or before, the moments updated."""
        # Sliced, then converted: converting first would write the whole tensor in f32.
        inner = (x[start : num_rows - rows + start : rows].astype(dtype) for x in view)
        edges = (edge[k].reshape(1, cols).astype(dtype) for k in range(4))
        g_rows, m_rows, d_rows, e_rows = (
            jnp.concatenate([x, y] if last else [y, x]) for x, y in zip(inner, edges, strict=True)
        )
        m_rows, d_rows = pointwise.moments(Raw(g_rows, m_rows, d_rows), hyper)
        return jnp.stack([g_rows, m_rows, d_rows, e_rows], axis=1)

    return rows_of(rows - 1, pre, last=False), rows_of(rows, post, last=True)


def update(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: jax.Array,
    pre: jax.Array,
    post: jax.Array,
    corrections,
    hyper: SONewConfig,
    block: tuple[int, int],
    *,
    interpret: bool,
    apply: Apply | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One tensor's (or shard's) step as a TPU kernel: ``(u, m, d, e, parts)``. Band 1 runs
    :func:`_kernel` on blocks with their outer neighbours' rows (``_neighbour_rows``); bands
    ``b >= 2`` run :func:`_banded_kernel` on blocks extended by :func:`banded_halo` rows of the
    old state on each side (the rows of the neighbouring blocks, or beyond the view the tensor's
    edges; :func:`_halo_rows`): the whole-tensor step runs on the extended block in VMEM
    (``solve.precondition``, reading the chain by rotating the block's rows) and the block keeps
    its own rows. Every row it keeps reads at most ``chain.halo_width`` rows away, inside the
    extension, so the rotation's wrap is never read: as on XLA for a shard's block
    (``engine._on_extended_block``).

    Args:
      g, m, d, e: the gradient and the old state as stored (``e`` of shape ``(b, *shape)``);
        ``m``, ``d`` and ``e`` are updated in place.
      pre, post: the tensor's edges (``neighbours.edge_rows``): the old ``g``, ``m``, ``d``, ``e``
        at the chain positions before the view's first and after its last row
        (``chain.halo_width`` of them).
      corrections: ``(1 - b1^t, 1 - b2^t)``.
      hyper: the step's hyperparameters, its ``eps`` this tensor's damping.
      block: :func:`block_shape` of the tensor and band.
      interpret: run in Pallas' interpreter (off TPU).
      apply: the fused apply (``program.Apply``, its graft ratio known before the step): the
        kernel writes the parameters in place instead of ``u``, which it returns in ``u``'s
        place.

    Returns:
      ``u`` in the arithmetic's dtype (``pointwise.compute_dtype``) and the new ``m``, ``d``,
      ``e`` as stored, and the blocks' norm pairs ``(2k, blocks)`` of Adam's direction, ``u``
      and, with a relative damping, ``sqrt(d_hat)``: rows ``scale_0, sum_0, ...``, one column
      per block (``chain.norm_pairs``).
    """
    band = e.shape[0]
    num_rows, cols = tile_view(g.shape)
    views = [x.reshape(num_rows, cols) for x in (g, m, d)] + [e.reshape(band, num_rows, cols)]
    if band == 1:
        prev, after = _neighbour_rows(g, m, d, e[0], pre, post, block[0], hyper)
        kernel, prev, after, static = _kernel, prev[:, :, None], after[:, :, None], {}
    else:
        halo = banded_halo(band)
        dtype = pointwise.compute_dtype(d.dtype)
        prev, after = _halo_rows(views, pre, post, block[0], halo, dtype)
        kernel, static = _banded_kernel, {"halo": halo}
    return _step_call(
        kernel, views, prev, after, corrections, hyper, block,
        shape=g.shape, interpret=interpret, apply=apply, **static,
    )  # fmt: skip


def _kernel(
    scalars_ref, g_ref, m_ref, d_ref, e_ref, prev_ref, next_ref, *refs, flags, pairs, apply,
):  # fmt: skip
    """One block of band 1: the new state, ``u`` (or the parameters) and the norm pairs
    (:func:`update`, :func:`_finish`)."""
    hyper, corrections = _hyper(scalars_ref, flags)
    dtype = scalars_ref.dtype
    g, m_old, d_old = (ref[...].astype(dtype) for ref in (g_ref, m_ref, d_ref))
    e_old = e_ref[0].astype(dtype)
    prev, after = prev_ref[0], next_ref[0]  # (4, 1, cols): g, new m, new d, old e
    rows = g.shape[0]
    first = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0) == 0
    last = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0) == rows - 1

    def before_of(x: jax.Array, row: jax.Array) -> jax.Array:
        """``x`` at ``j - 1``: rolled down one row, ``row`` (``(1, cols)``) in the first."""
        return jnp.where(first, row, pltpu.roll(x, 1, 0))

    def after_of(x: jax.Array, row: jax.Array) -> jax.Array:
        """``x`` at ``j + 1``: rolled up one row, ``row`` in the last."""
        return jnp.where(last, row, pltpu.roll(x, rows - 1, 0))

    m, d = pointwise.moments(Raw(g, m_old, d_old), hyper)
    e_here = pointwise.edge_statistic(e_old, g, after_of(g, after[0]), hyper)
    e_first = pointwise.edge_statistic(prev[3], prev[0], g[0:1], hyper)
    e_before = before_of(e_here, e_first)
    v_before = pointwise.vertex_of_moments(
        g, before_of(m, prev[1]), before_of(d, prev[2]), corrections, hyper
    )
    v_here = pointwise.vertex_of_moments(g, m, d, corrections, hyper)
    v_after = pointwise.vertex_of_moments(
        g, after_of(m, after[1]), after_of(d, after[2]), corrections, hyper
    )
    u = pointwise.tridiagonal_direction(
        v_before, v_here, v_after, e_here, e_before, corrections, hyper
    )
    normed = [pointwise.adam_direction(m, d, corrections, hyper), u]
    if pairs == 3:
        normed.append(pointwise.diagonal_root(d, corrections))
    _finish(scalars_ref, refs, apply, u, (m, d, e_here[None]), normed)


def banded_halo(band: int) -> int:
    """Rows a band ``b >= 2`` block reads beyond each of its ends (``chain.halo_width``, ``2b - 1``
    at most), rounded up to whole tiles of 16-bit rows, so that the extended block stays
    aligned."""
    return -(-max(halo_width(band)) // _SUBLANES) * _SUBLANES


def _step_call(
    kernel, views, prev, after, corrections, hyper: SONewConfig, block, *, shape, interpret, apply,
    **static,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """One launch of a step ``kernel`` over the blocks of a tensor's view: ``views`` are ``g, m,
    d`` as ``(rows, cols)`` and ``e`` as ``(b, rows, cols)``, the last three updated in place;
    ``prev`` and ``after`` the rows beyond each block, ``(blocks, 3 + b, halo, cols)``; with
    ``apply`` the parameters updated in place of ``u``. Returns ``(u or params, m, d, e,
    parts)`` (:func:`update`), the first three of ``shape``."""
    num_rows, cols = views[0].shape
    band = views[3].shape[0]
    block_rows, block_cols = block
    grid = (num_rows // block_rows, cols // block_cols)
    dtype = pointwise.compute_dtype(views[2].dtype)
    pairs = 3 if hyper.damping != "absolute" else 2
    here = pl.BlockSpec(block, lambda i, j: (i, j))
    off_diagonals = pl.BlockSpec((band, *block), lambda i, j: (0, i, j))
    rows = pl.BlockSpec((1, *prev.shape[1:3], block_cols), lambda i, j: (i, 0, 0, j))
    flags = (hyper.graft, hyper.precondition_1d, hyper.damping)
    inputs = [_scalars(hyper, corrections, apply, dtype), *views, prev, after]
    aliases = {2: 1, 3: 2, 4: 3}  # m, d, e in place
    first = jax.ShapeDtypeStruct((num_rows, cols), dtype)  # u
    if apply is not None:  # the parameters in place, instead of u
        inputs.append(apply.params.reshape(num_rows, cols))
        aliases[len(inputs) - 1] = 0
        first = jax.ShapeDtypeStruct((num_rows, cols), apply.params.dtype)
    out, m, d, e, parts = pl.pallas_call(
        functools.partial(kernel, flags=flags, pairs=pairs, apply=apply is not None, **static),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)]
        + [here] * 3
        + [off_diagonals, rows, rows]
        + [here] * (apply is not None),
        out_specs=[here] * 3
        + [off_diagonals, pl.BlockSpec((1, 1, 8, _LANES), lambda i, j: (i, j, 0, 0))],
        out_shape=[
            first,
            *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views[1:]),
            jax.ShapeDtypeStruct((*grid, 8, _LANES), dtype),
        ],
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name=f"sonew_tpu_band{band}",
    )(*inputs)
    parts = parts[:, :, : 2 * pairs, 0].reshape(-1, 2 * pairs).T
    return out.reshape(shape), m.reshape(shape), d.reshape(shape), e.reshape(band, *shape), parts


def _halo_rows(views, pre, post, rows: int, halo: int, dtype) -> tuple[jax.Array, jax.Array]:
    """``(prev, next)``, each ``(blocks, 3 + b, halo, cols)``: the ``halo`` rows of ``g, m, d, e_1
    .. e_b`` (``views``, the state as stored) before and after each block of ``rows`` rows, from
    the neighbouring blocks or, beyond the view, from the edges ``pre`` and ``post`` (padded with
    zeros on their far side, rows no kept row reads)."""
    num_rows, cols = views[0].shape
    blocks = num_rows // rows

    def side(take: slice) -> jax.Array:
        """Rows ``take`` of every block: ``(blocks, 3 + b, halo, cols)``."""
        g, m, d, e = views
        state = [x.reshape(blocks, 1, rows, cols)[:, :, take] for x in (g, m, d)]
        off_diagonals = e.reshape(e.shape[0], blocks, rows, cols)[:, :, take]
        return jnp.concatenate([*state, jnp.moveaxis(off_diagonals, 0, 1)], axis=1)

    def edge(x: jax.Array, before: bool) -> jax.Array:
        x = x.reshape(x.shape[0], x.shape[1], cols).astype(dtype)
        pad = ((0, 0), (halo - x.shape[1], 0) if before else (0, halo - x.shape[1]), (0, 0))
        return jnp.pad(x, pad)[None]

    tails = side(slice(rows - halo, rows)).astype(dtype)
    heads = side(slice(0, halo)).astype(dtype)
    return (
        jnp.concatenate([edge(pre, True), tails[:-1]]),
        jnp.concatenate([heads[1:], edge(post, False)]),
    )


def _scalars(hyper: SONewConfig, corrections, apply: Apply | None, dtype) -> jax.Array:
    """A launch's scalars (SMEM): b1, b2, eps, gamma, graft_eps, the bias corrections, and with
    the fused ``apply`` the tensor's graft ratio, weight decay (0 where not decayed) and scale."""
    numbers = [hyper.b1, hyper.b2, hyper.eps, hyper.gamma, hyper.graft_eps, *corrections]
    if apply is None:
        numbers += [0, 0, 0]
    else:
        decay = apply.weight_decay if apply.decayed else 0
        numbers += [apply.ratios[apply.slot], decay, apply.scale]
    return jnp.stack([jnp.asarray(x, dtype).reshape(()) for x in numbers])


def _hyper(scalars_ref, flags) -> tuple[SONewConfig, tuple]:
    """The step's :class:`SONewConfig` and bias corrections from a launch's scalars."""
    s = [scalars_ref[k] for k in range(_SCALARS)]
    graft, precondition_1d, damping = flags
    hyper = SONewConfig(
        b1=s[0], b2=s[1], eps=s[2], gamma=s[3], graft_eps=s[4], graft=graft,
        precondition_1d=precondition_1d, damping=damping,
    )  # fmt: skip
    return hyper, (s[5], s[6])


def _write_pairs(parts_ref, normed: list[jax.Array]) -> None:
    """The block's norm pairs ``(scale, sum (x / scale)^2)`` of ``normed``, at sublanes ``2k``
    and ``2k + 1`` of its ``(8, 128)`` tile (the scale at least ``program.scale_floor``)."""
    dtype = normed[0].dtype
    sublane = jax.lax.broadcasted_iota(jnp.int32, (8, _LANES), 0)
    tile = jnp.zeros((8, _LANES), dtype)
    for k, x in enumerate(normed):
        top = jnp.maximum(jnp.max(jnp.abs(x)), scale_floor(dtype))
        scaled = x * (1 / top)
        tile = jnp.where(sublane == 2 * k, top, tile)
        tile = jnp.where(sublane == 2 * k + 1, jnp.sum(scaled * scaled), tile)
    parts_ref[0, 0] = tile


def _finish(scalars_ref, refs, apply: bool, u, state, normed) -> None:
    """A block's outputs: ``u``, or with the fused ``apply`` the parameters written in its place
    (``pointwise.apply_update``; ``refs`` then start with the parameters' input), the new
    ``state`` (``m, d, e``) in its stored dtypes, and the norm pairs of ``normed``."""
    if apply:
        p_ref, out_ref, *state_refs, parts_ref = refs
        ratio, decay, scale = (scalars_ref[k] for k in range(_SCALARS - 3, _SCALARS))
        p = p_ref[...].astype(u.dtype)
        out_ref[...] = pointwise.apply_update(p, u, ratio, decay, scale).astype(out_ref.dtype)
    else:
        out_ref, *state_refs, parts_ref = refs
        out_ref[...] = u
    for x, ref in zip(state, state_refs, strict=True):
        ref[...] = x.astype(ref.dtype)
    _write_pairs(parts_ref, normed)


def _banded_kernel(
    scalars_ref, g_ref, m_ref, d_ref, e_ref, prev_ref, next_ref, *refs, flags, pairs, apply, halo,
):  # fmt: skip
    """One block of band ``b >= 2``, extended (:func:`update`, :func:`_finish`)."""
    hyper, corrections = _hyper(scalars_ref, flags)
    dtype = scalars_ref.dtype
    prev, after = prev_ref[0], next_ref[0]  # (3 + b, halo, cols)
    band = e_ref.shape[0]

    def extended(x: jax.Array, k: int) -> jax.Array:
        return jnp.concatenate([prev[k], x.astype(dtype), after[k]])

    g, m_old, d_old = (extended(ref[...], k) for k, ref in enumerate((g_ref, m_ref, d_ref)))
    e_old = jnp.stack([extended(e_ref[j], 3 + j) for j in range(band)])
    count = g.shape[0]

    def shift(x: jax.Array, k: int) -> jax.Array:
        """``x`` at ``j + k`` along the extended block's rows (wrapping: never read where kept)."""
        return pltpu.roll(x, (-k) % count, x.ndim - 2)

    m, d = pointwise.moments(Raw(g, m_old, d_old), hyper)
    successors = jnp.stack([shift(g, k) for k in range(1, band + 1)])
    e_new = pointwise.edge_statistic(e_old, g, successors, hyper)
    bc1, bc2 = corrections
    u = solve.precondition(d / bc2 + hyper.eps, e_new / bc2, m / bc1, hyper.gamma, shift)
    rows = g_ref.shape[0]

    def kept(x: jax.Array) -> jax.Array:
        return x[..., halo : halo + rows, :]

    m, d, u, e_new = kept(m), kept(d), kept(u), kept(e_new)
    normed = [pointwise.adam_direction(m, d, corrections, hyper), u]
    if pairs == 3:
        normed.append(pointwise.diagonal_root(d, corrections))
    _finish(scalars_ref, refs, apply, u, (m, d, e_new), normed)
