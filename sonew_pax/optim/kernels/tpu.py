"""Band 1 (tridiag-SONew) as one Pallas TPU (Mosaic) kernel: the step in one pass over the state.

On a TPU the XLA step (``engine._tridiagonal_step``) shifts the new moments by one row along axis
0, the second-minor (sublane) axis of the TPU's ``(8, 128)`` tiles. XLA materialises each shifted
array, and the norms' reduction reads the state again: compiled for a TPU v5e, a tensor too large
for VMEM moves about 128 B per parameter (``benchmarks/tpu_compile.py``) where AdamW moves 28.
This kernel keeps a block of ``(rows, cols)`` of the tensor's 2-D view (``geometry.tile_view``)
in VMEM, shifts it there (``pltpu.roll``, a rotate of the block's sublanes), and writes the new
state in place, ``u`` and the block's norm pairs: it reads ``g, m, d, e`` and writes ``m, d, e, u``
once (32 B per fp32 parameter).

Each element's outputs need its chain neighbours' *new* moments. Inside a block they are the
block's own, shifted; at a block's first and last rows they come from ``prev`` and ``next``
(:func:`neighbour_rows`), built before the kernel from the old state: the rows just outside each
block and, beyond the view, the tensor's ``edges`` (``engine._edges``: the previous column's last
row, or a neighbouring shard's), their moments updated by XLA (a few rows per block). So every
program reads only old state and the blocks run in any order, in place.

The math is :mod:`pointwise`'s, as on XLA and in the GPU kernels. Opt-in (``sonew(...,
implementation="pallas")`` on a TPU) until it has run on one: it is tested in Pallas' interpreter
against the XLA step and lowered for TPU on a CPU host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sonew_pax.optim import pointwise
from sonew_pax.optim.kernels.config import KernelConfig
from sonew_pax.optim.kernels.geometry import tile_view
from sonew_pax.optim.kernels.program import scale_floor
from sonew_pax.optim.pointwise import Hyper, Raw

# Sublanes of a TPU tile for 16-bit dtypes (32-bit ones take 8): a block's rows are a multiple.
_SUBLANES = 16
_LANES = 128
# The scalars of a launch, in SMEM: b1, b2, eps, gamma, graft_eps, then the bias corrections.
_SCALARS = 8


def block_shape(shape: tuple[int, ...], config: KernelConfig) -> tuple[int, int] | None:
    """The ``(rows, cols)`` block of the view of a tensor of ``shape`` that one program steps, or
    ``None`` where the kernel does not apply (the XLA step runs): a tensor of fewer than two
    dimensions, a view whose rows are not a multiple of 16 or whose columns are not a multiple
    of 128 (the TPU's tiles).

    Columns: the largest multiple of 128 that divides the view's and is at most
    ``config.tpu_block[1]``; rows: the largest multiple of 16 that divides the view's and keeps
    the block within ``config.tpu_block[0] * config.tpu_block[1]`` elements. Blocks that tile
    the view exactly need no masks.
    """
    if len(shape) < 2:
        return None
    rows, cols = tile_view(shape)
    if rows % _SUBLANES or cols % _LANES:
        return None
    max_rows, max_cols = config.tpu_block
    block_cols = _largest_divisor(cols, _LANES, max_cols)
    block_rows = _largest_divisor(rows, _SUBLANES, max(max_rows * max_cols // block_cols, 1))
    return block_rows, block_cols


def _largest_divisor(n: int, step: int, limit: int) -> int:
    """The largest multiple of ``step`` that divides ``n`` and is at most ``limit`` (``step`` if
    none is)."""
    for size in range(limit - limit % step, step - 1, -step):
        if n % size == 0:
            return size
    return step


def neighbour_rows(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: jax.Array,
    pre: jax.Array,
    post: jax.Array,
    rows: int,
    hyper: Hyper,
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


def tridiagonal_update(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: jax.Array,
    pre: jax.Array,
    post: jax.Array,
    corrections,
    hyper: Hyper,
    block: tuple[int, int],
    *,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One tensor's (or shard's) band-1 step as the TPU kernel: ``(u, m, d, e, parts)``.

    Args:
      g, m, d, e: the gradient and the old state as stored (``e`` of shape ``(1, *shape)``);
        ``m``, ``d`` and ``e`` are updated in place.
      pre, post: the tensor's edges (``engine._edge_rows``): the old ``g``, ``m``, ``d``, ``e``
        at the chain positions before the view's first and after its last row.
      corrections: ``(1 - b1^t, 1 - b2^t)``.
      hyper: the step's hyperparameters, its ``eps`` this tensor's damping.
      block: :func:`block_shape` of the tensor.
      interpret: run in Pallas' interpreter (off TPU).

    Returns:
      ``u`` in the arithmetic's dtype (``pointwise.compute_dtype``) and the new ``m``, ``d``,
      ``e`` as stored, and the blocks' norm pairs ``(2k, blocks)`` of Adam's direction, ``u``
      and, with a relative damping, ``sqrt(d_hat)``: rows ``scale_0, sum_0, ...``, one column
      per block (``chain.norm_pairs``).
    """
    shape = g.shape
    num_rows, cols = tile_view(shape)
    block_rows, block_cols = block
    grid = (num_rows // block_rows, cols // block_cols)
    dtype = pointwise.compute_dtype(d.dtype)
    prev, after = neighbour_rows(g, m, d, e[0], pre, post, block_rows, hyper)
    numbers = (hyper.b1, hyper.b2, hyper.eps, hyper.gamma, hyper.graft_eps, *corrections)
    scalars = jnp.stack([jnp.asarray(x, dtype) for x in numbers] + [jnp.zeros((), dtype)])
    pairs = 3 if hyper.damping != "absolute" else 2
    here = pl.BlockSpec(block, lambda i, j: (i, j))
    rows_spec = pl.BlockSpec((1, 4, block_cols), lambda i, j: (i, 0, j))
    views = [x.reshape(num_rows, cols) for x in (g, m, d, e)]
    kernel = functools.partial(
        _kernel, flags=(hyper.graft, hyper.precondition_1d, hyper.damping), pairs=pairs
    )
    u, m, d, e_new, parts = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [here] * 4 + [rows_spec] * 2,
        out_specs=[here] * 4 + [pl.BlockSpec((1, 1, 8, _LANES), lambda i, j: (i, j, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, cols), dtype),
            *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views[1:]),
            jax.ShapeDtypeStruct((*grid, 8, _LANES), dtype),
        ],
        input_output_aliases={2: 1, 3: 2, 4: 3},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="sonew_tpu_band1",
    )(scalars, *views, prev, after)
    parts = parts[:, :, : 2 * pairs, 0].reshape(-1, 2 * pairs).T
    return u.reshape(shape), m.reshape(shape), d.reshape(shape), e_new.reshape(e.shape), parts


def _kernel(
    scalars_ref, g_ref, m_ref, d_ref, e_ref, prev_ref, next_ref,
    u_ref, m_out, d_out, e_out, parts_ref, *, flags, pairs,
):  # fmt: skip
    """One block: the new state, ``u`` and the norm pairs (:func:`tridiagonal_update`)."""
    graft, precondition_1d, damping = flags
    s = [scalars_ref[k] for k in range(_SCALARS)]
    hyper = Hyper(s[0], s[1], s[2], s[3], s[4], graft, precondition_1d, damping)
    corrections = (s[5], s[6])
    dtype = u_ref.dtype
    g, m_old, d_old, e_old = (ref[...].astype(dtype) for ref in (g_ref, m_ref, d_ref, e_ref))
    prev, after = prev_ref[0], next_ref[0]  # (4, cols): g, new m, new d, old e
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
    e_here = pointwise.edge_statistic(e_old, g, after_of(g, after[0:1]), hyper)
    e_first = pointwise.edge_statistic(prev[3:4], prev[0:1], g[0:1], hyper)
    e_before = before_of(e_here, e_first)
    v_before = pointwise.vertex_of_moments(
        g, before_of(m, prev[1:2]), before_of(d, prev[2:3]), corrections, hyper
    )
    v_here = pointwise.vertex_of_moments(g, m, d, corrections, hyper)
    v_after = pointwise.vertex_of_moments(
        g, after_of(m, after[1:2]), after_of(d, after[2:3]), corrections, hyper
    )
    u = pointwise.tridiagonal_direction(
        v_before, v_here, v_after, e_here, e_before, corrections, hyper
    )
    u_ref[...] = u
    m_out[...], d_out[...], e_out[...] = (
        x.astype(ref.dtype) for x, ref in ((m, m_out), (d, d_out), (e_here, e_out))
    )
    normed = [pointwise.adam_direction(m, d, corrections, hyper), u]
    if pairs == 3:
        normed.append(pointwise.diagonal_root(d, corrections))
    sublane = jax.lax.broadcasted_iota(jnp.int32, (8, _LANES), 0)
    tile = jnp.zeros((8, _LANES), dtype)
    for k, x in enumerate(normed):
        top = jnp.maximum(jnp.max(jnp.abs(x)), scale_floor(dtype))
        scaled = x * (1 / top)
        tile = jnp.where(sublane == 2 * k, top, tile)
        tile = jnp.where(sublane == 2 * k + 1, jnp.sum(scaled * scaled), tile)
    parts_ref[0, 0] = tile
