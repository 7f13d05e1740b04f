"""The chain order of SONew, in the parameter's own layout.

SONew preconditions each tensor with a banded matrix over a *chain* of its entries. The chain is the
tensor in Fortran order (axis 0 fastest), i.e. ``x.T.reshape(-1)``: element ``(i0, i1, ...)`` is
followed by ``(i0 + 1, i1, ...)``, and the last entry along axis 0 carries into the next index of
axis 1, and so on. For a flax ``Dense`` kernel ``(in, out)`` the chain therefore runs along fan-in.

Nothing here flattens or transposes. The only non-local operation SONew needs is :func:`shift`, the
value ``k`` steps further along the chain (zero past either end), computed with slices and
concatenations in the parameter's layout. When a tensor is sharded (``ChainLayout.axes``), the same
function runs inside ``jax.shard_map`` on the local block and fetches the thin slabs it needs from
the neighbouring shards with ``ppermute`` (a *halo*), so sharded and unsharded results are equal.
The grafting norms (:func:`norms`) are one local reduction followed by ``pmax``/``psum``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

MeshAxes = tuple[str, ...]


class ChainLayout(NamedTuple):
    """Where one tensor's chain lives.

    Attributes:
      shape: the tensor's global shape.
      axes: for every dimension, the mesh axes it is sharded over (``()`` when unsharded).
      shards: for every dimension, the number of shards (product of the sizes of ``axes``).
    """

    shape: tuple[int, ...]
    axes: tuple[MeshAxes, ...]
    shards: tuple[int, ...]

    @classmethod
    def unsharded(cls, shape: tuple[int, ...]) -> ChainLayout:
        """The layout of a tensor that lives whole on one device."""
        return cls(tuple(shape), ((),) * len(shape), (1,) * len(shape))

    @property
    def mesh_axes(self) -> MeshAxes:
        """All mesh axes the tensor is sharded over (reductions run over these)."""
        return tuple(a for dim_axes in self.axes for a in dim_axes)


def shift(x: jax.Array, k: int, layout: ChainLayout) -> jax.Array:
    """Returns ``y`` with ``y[i] = x[i + k]`` along the chain (zero where ``i + k`` is off it).

    ``x`` may carry leading batch axes in front of the tensor's own axes (e.g. the stacked band
    axis of the off-diagonal statistics); they are shifted independently.

    Args:
      x: the (local block of the) tensor, shape ``(*batch, *local_shape)``.
      k: the step along the chain, positive (successors) or negative (predecessors).
      layout: the tensor's :class:`ChainLayout`.
    """
    return _shift(x, k, layout, 0)


def shift_many(xs: list[jax.Array], k: int, layout: ChainLayout) -> list[jax.Array]:
    """:func:`shift` of several same-shaped, same-dtype tensors of one layout.

    Sharded, they travel together (one halo exchange instead of one each: collective-permutes are
    latency-bound); unsharded, each is shifted on its own so nothing is stacked in memory.
    """
    if not layout.mesh_axes:
        return [shift(x, k, layout) for x in xs]
    return list(shift(jnp.stack(xs), k, layout))


def _shift(x: jax.Array, k: int, layout: ChainLayout, a: int) -> jax.Array:
    """Shift by ``k`` in the Fortran order of tensor axes ``a, a+1, ...`` (earlier ones are batch).

    With ``N`` the global size of axis ``a`` and ``k = q N + t`` (``0 <= t < N``), row ``i`` of the
    result is row ``i + t`` of the rest-axes shift by ``q`` while ``i + t < N``, and otherwise row
    ``i + t - N`` of the rest-axes shift by ``q + 1`` (the carry).
    """
    if k == 0:
        return x
    rank = len(layout.shape)
    if a == rank:
        return jnp.zeros_like(x)
    axis = x.ndim - rank + a
    n = layout.shape[a]
    q, t = divmod(k, n)
    if t == 0:
        return _shift(x, q, layout, a + 1)
    if layout.shards[a] == 1:
        head = _shift(lax.slice_in_dim(x, t, n, axis=axis), q, layout, a + 1)
        tail = _shift(lax.slice_in_dim(x, 0, t, axis=axis), q + 1, layout, a + 1)
        return jnp.concatenate([head, tail], axis=axis)
    return _shift_sharded_axis(x, q, t, layout, a, axis)


def _shift_sharded_axis(
    x: jax.Array, q: int, t: int, layout: ChainLayout, a: int, axis: int
) -> jax.Array:
    """:func:`_shift` along an axis split into ``P`` shards of ``l`` rows (inside ``shard_map``).

    Write ``t = u l + v`` (``0 <= v < l``). Local rows ``[0, l - v)`` come from rows ``[v, l)`` of
    shard ``s + u`` and rows ``[l - v, l)`` from rows ``[0, v)`` of shard ``s + u + 1`` (indices
    mod ``P``). A piece fetched from shard ``s + w`` has wrapped past the end of the axis, and so
    takes the carried (``q + 1``) rest shift, exactly when ``s + w >= P``, i.e. when the *sender*
    ``s' = (s + w) mod P`` has ``s' < w``: the sender picks the right version and sends one slab.
    """
    num_shards = layout.shards[a]
    names = layout.axes[a]
    rows = x.shape[axis]
    u, v = divmod(t, rows)
    index = lax.axis_index(names)

    def piece(start: int, stop: int, w: int) -> jax.Array:
        block = lax.slice_in_dim(x, start, stop, axis=axis)
        plain = _shift(block, q, layout, a + 1) if w < num_shards else None
        carried = _shift(block, q + 1, layout, a + 1) if w > 0 else None
        if carried is None:
            send = plain
        elif plain is None:
            send = carried
        else:
            send = jnp.where(index < w, carried, plain)
        return _fetch_from(send, w % num_shards, names, num_shards)

    if v == 0:
        return piece(0, rows, u)
    return jnp.concatenate([piece(v, rows, u), piece(0, v, u + 1)], axis=axis)


def _fetch_from(y: jax.Array, offset: int, names: MeshAxes, num_shards: int) -> jax.Array:
    """Every shard ``s`` receives ``y`` from shard ``(s + offset) mod P`` (a collective-permute).

    Shard ``s`` counts blocks in the spec's axis order (``axis_index(names)``); ``ppermute``
    numbers devices in the mesh's axis order, so the permutation is translated.
    """
    if offset == 0:
        return y
    device_index = _mesh_order_index(names)
    perm = [(device_index[(d + offset) % num_shards], device_index[d]) for d in range(num_shards)]
    return lax.ppermute(y, names, perm)


def _mesh_order_index(names: MeshAxes) -> list[int]:
    """Maps block index (``names`` order, major first) to ``ppermute``'s index (mesh order)."""
    sizes = [lax.axis_size(n) for n in names]
    mesh_order = sorted(range(len(names)), key=lambda i: _mesh_position(names[i]))
    out = []
    for block in range(math.prod(sizes)):
        coords, rest = [], block
        for size in reversed(sizes):
            rest, c = divmod(rest, size)
            coords.append(c)
        coords.reverse()
        index = 0
        for i in mesh_order:
            index = index * sizes[i] + coords[i]
        out.append(index)
    return out


def _mesh_position(name: str) -> int:
    """Position of a mesh axis among the current (abstract) mesh's axes."""
    return jax.sharding.get_abstract_mesh().axis_names.index(name)


def _nrm2_combine(acc: tuple, x: tuple) -> tuple:
    """Merges ``(scale, sumsq)`` pairs, several norms side by side: ``||v|| = scale * sqrt(sumsq)``.

    The scaled-sum recurrence of LAPACK's ``xNRM2`` as an associative combiner: the pair with the
    larger scale keeps it, the other's sum is rescaled by ``(small / large)^2 <= 1``, so nothing
    overflows or underflows whatever the entries' magnitude. One division per norm and merge.
    """
    out = []
    for i in range(0, len(acc), 2):
        s1, q1, s2, q2 = acc[i], acc[i + 1], x[i], x[i + 1]
        first = s1 >= s2
        big, small = jnp.where(first, s1, s2), jnp.where(first, s2, s1)
        q_big, q_small = jnp.where(first, q1, q2), jnp.where(first, q2, q1)
        ratio = small / jnp.where(big > 0, big, 1)
        out += [big, q_big + q_small * ratio * ratio]
    return tuple(out)


def norms(xs: list[jax.Array], layout: ChainLayout) -> list[jax.Array]:
    """Euclidean norms of same-shaped arrays, safe from underflow and overflow, in one pass.

    Equal to ``M * ||x / M||`` with ``M = max|x|`` (up to rounding), but computed as one variadic
    reduction over ``(scale, scaled sum of squares)`` pairs (:func:`_nrm2_combine`) for all ``xs``
    together: the inputs are read once instead of four times for two two-pass norms. Sharded, the
    local pairs are combined with one ``pmax`` and one ``psum``.
    """
    operands, inits = [], []
    for x in xs:
        operands += [jnp.abs(x), jnp.ones_like(x)]
        inits += [jnp.zeros((), x.dtype), jnp.zeros((), x.dtype)]
    pairs = lax.reduce(tuple(operands), tuple(inits), _nrm2_combine, tuple(range(xs[0].ndim)))
    scales, sums = jnp.stack(pairs[0::2]), jnp.stack(pairs[1::2])
    if not layout.mesh_axes:
        return list(scales * jnp.sqrt(sums))
    axes = layout.mesh_axes
    return list(
        merge_norm_parts(scales, sums, lambda x: lax.pmax(x, axes), lambda x: lax.psum(x, axes))
    )


def merge_norm_parts(scales, sums, reduce_max, reduce_sum) -> jax.Array:
    """``||x||`` from partial ``(scale, sum (x / scale)^2)`` pairs (shards, or kernel tiles).

    Each partial sum is rescaled to the largest scale before they are added, so nothing overflows
    or underflows. ``reduce_max`` / ``reduce_sum`` combine the parts (``pmax`` / ``psum`` across
    shards, ``jnp.max`` / ``jnp.sum`` over an axis of tiles).
    """
    top = reduce_max(scales)
    ratio = scales / jnp.where(top > 0, top, 1)
    return top * jnp.sqrt(reduce_sum(sums * ratio * ratio))
