"""Where the kernels work: a tensor's 2-D view, its row chunks, and the tiles a band runs."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonew_pax.optim.chain import ChainLayout, halo_width
from sonew_pax.optim.kernels.config import KernelConfig, Tile


def tile_view(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D row-major view ``(R, C)`` the kernels tile: axis 0 by the rest (``(n, 1)`` for 1-D).

    The chain runs down each column of the view (``+-C`` in memory) and wraps from the bottom of
    one column to the top of the next column in Fortran order of the trailing axes: the kernels
    read those wrapped neighbours, like every neighbour beyond the view's first and last rows,
    from their ``edges`` input (``halo.kernel_edges``).
    """
    return shape[0], math.prod(shape[1:])


def local_shape(layout: ChainLayout) -> tuple[int, ...]:
    """The shape of one shard of a tensor of ``layout`` (the whole tensor when unsharded)."""
    return tuple(n // k for n, k in zip(layout.shape, layout.shards, strict=True))


def chunk_rows(i, rows: int, num_rows: int):
    """First and last row of the view in row chunk ``i``."""
    return i * rows, jnp.minimum((i + 1) * rows, num_rows) - 1


def supported(layout: ChainLayout, band: int, config: KernelConfig) -> bool:
    """Whether a kernel computes this tensor's step on each device's block (:func:`local_shape`):
    indexable within ``config.max_offset`` (its ``band`` off-diagonals too), up to
    ``config.max_band``. The block needs as many rows along axis 0 as the step reads beyond it
    (``chain.halo_width``: one for band 1, ``2 band - 1`` for bands >= 2), so its edges come from
    its chain neighbours' blocks; thinner shards take the XLA path."""
    shape = local_shape(layout)
    size = math.prod(shape)
    if not 0 < max(band, 1) * size <= config.max_offset or band > config.max_band:
        return False
    return shape[0] >= max(halo_width(band))


def scan_stack(rows: int, config: KernelConfig) -> int:
    """How many walks the band-1 scan stacks in a program of ``rows`` rows: ``config.scan_stack``,
    at most ``rows`` (a walk of one row)."""
    return min(config.scan_stack, rows)


def launch_group(shape: tuple[int, ...], band: int, config: KernelConfig) -> int:
    """How many tensors of ``shape`` one launch updates together (``launch.group_update``):
    enough to reach ``config.group_elements`` elements, at most ``config.max_group`` (for bands
    >= 2 ``config.max_banded_group``)."""
    limit = config.max_banded_group if band >= 2 else config.max_group
    return max(1, min(limit, config.group_elements // max(1, math.prod(shape))))


def default_tile(band: int, shape: tuple[int, ...], config: KernelConfig) -> Tile:
    """The tile a band's kernel runs with on a tensor of ``shape`` unless told.

    Band 0: ``config.diagonal_tile``. The walking kernels take ``config.scan_tile`` (band 1) or
    ``config.banded_tile`` (bands >= 2) with fewer rows on small tensors, for shorter walks: the
    scan until it has ``config.scan_lanes`` walks times columns, bands >= 2 until a launch of
    :func:`launch_group` tensors has ``config.banded_programs`` programs. With
    ``config.concurrent`` bands >= 2 take ``config.concurrent_banded_tile`` on every tensor.
    """
    num_rows, num_cols = tile_view(shape)
    if band >= 2 and config.concurrent:
        return config.concurrent_banded_tile
    if band >= 2:
        rows, cols, num_warps = config.banded_tile
        tensors = launch_group(shape, band, config)
        while rows > config.banded_min_rows and (
            tensors * pl.cdiv(num_cols, cols) * pl.cdiv(num_rows, rows) < config.banded_programs
        ):
            rows //= 2
    elif band == 1:
        rows, cols, num_warps = config.scan_tile
        while rows > config.scan_min_walk * scan_stack(rows, config) and (
            num_cols * pl.cdiv(num_rows, rows // scan_stack(rows, config)) < config.scan_lanes
        ):
            rows //= 2
            # Half as many lanes on twice as many warps: the threads stay (down to one lane each).
            num_warps = min(2 * num_warps, max(num_warps, scan_stack(rows, config) * cols // 32))
    else:
        return config.diagonal_tile
    return rows, cols, num_warps
