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
The grafting norms are one local reduction (:func:`norm_pairs`), merged across the shards of every
tensor in one all-reduce (:func:`merge_shards`).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any, NamedTuple

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
      stack: how many leading dimensions index tensors stacked together (the layer axis of flax's
        ``nn.scan``): each index of them is a tensor with a chain of its own, of shape
        ``shape[stack:]`` (:attr:`layer`). Never sharded.
    """

    shape: tuple[int, ...]
    axes: tuple[MeshAxes, ...]
    shards: tuple[int, ...]
    stack: int = 0

    @classmethod
    def unsharded(cls, shape: tuple[int, ...], stack: int = 0) -> ChainLayout:
        """The layout of a tensor that lives whole on one device."""
        return cls(tuple(shape), ((),) * len(shape), (1,) * len(shape), stack)

    @property
    def layer(self) -> ChainLayout:
        """The layout of one of the stacked tensors (the tensor itself when nothing is stacked)."""
        k = self.stack
        return ChainLayout(self.shape[k:], self.axes[k:], self.shards[k:])

    @property
    def layers(self) -> int:
        """How many tensors are stacked (1 when nothing is)."""
        return math.prod(self.shape[: self.stack])

    @property
    def mesh_axes(self) -> MeshAxes:
        """All mesh axes the tensor is sharded over (reductions run over these)."""
        return tuple(a for dim_axes in self.axes for a in dim_axes)


def shift(x: jax.Array, k: int, layout: ChainLayout) -> jax.Array:
    """Returns ``y`` with ``y[i] = x[i + k]`` along the chain (zero where ``i + k`` is off it).

    ``x`` may carry leading batch axes in front of the tensor's own axes (e.g. the stacked band
    axis of the off-diagonal statistics); they are shifted independently. For a sharded layout
    (inside ``shard_map``) the slabs it needs come from the other shards (:func:`run`).

    Args:
      x: the (local block of the) tensor, shape ``(*batch, *local_shape)``.
      k: the step along the chain, positive (successors) or negative (predecessors).
      layout: the tensor's :class:`ChainLayout`.
    """
    return run(_shift(x, k, layout, 0))


def move_rows(x: jax.Array, k: int, axis: int = 0) -> jax.Array:
    """``x`` moved ``k`` rows along ``axis``: ``y[i] = x[i - k]``, zero where ``i - k`` is off
    the array. One ``pad`` with a negative edge, which XLA's TPU compiler fuses into its
    consumers; it writes out the rows a slice keeps before a ``pad`` or ``concatenate`` restores
    the shape (a TPU tiles the last two axes by ``(8, 128)``, so a row is a sublane:
    ``benchmarks/tpu_compile.py``)."""
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (k, -k, 0)
    return lax.pad(x, jnp.zeros((), x.dtype), config)


def edges_of(last: jax.Array, first: jax.Array, layout: ChainLayout) -> Program:
    """An exchange program returning the chain neighbours of the local block's first and last
    rows along axis 0, from the block's ``last`` rows (``before`` of them) and ``first`` rows
    (``after``), both with leading batch axes, so the slabs of many tensors of one layout go
    through one program: ``(pre, post)`` of shapes ``(*batch, before, *rest)`` and ``(*batch,
    after, *rest)``, with ``pre[..., r, j...]`` the element ``before - r`` steps before row 0 of
    column ``j...`` on the chain and ``post[..., r, j...]`` the one ``r + 1`` steps after its
    last row; zero off the chain's ends, as :func:`shift` is. ``before`` and ``after`` are the
    halo widths of :func:`halo_width` (at most the block's rows: one hop).

    Along a sharded axis 0 the edges are the neighbouring shards' nearest rows; where the chain
    wraps from the last row of a column to the first of the next (Fortran order of the other
    axes), the rows of the next column, itself an exchange where those axes are sharded.
    """
    shards = layout.shards[0]
    turns = 1 // shards  # one hop along an unsharded axis 0 is a whole turn: the next column
    return (
        yield from parallel([
            _rows_from(last, -1, -turns, layout, 0, shards, -1),
            _rows_from(first, 1, turns, layout, 0, shards, 1),
        ])
    )  # fmt: skip


def halo_width(band: int) -> tuple[int, int]:
    """How far before and after an element along the chain its step reads its inputs.

    Band 1: ``u_i`` reads ``(g, m, d)`` at ``i - 1 .. i + 1`` and the edge statistics at ``i - 1``
    and ``i``. Band ``b >= 2`` (Algorithm 3): the factor of vertex ``j`` reads its window ``[j, j +
    b]`` and the cut tests of ``j .. j + b - 1`` (each its own window), so ``[j, j + 2b - 1]``;
    ``u_i`` applies the factors of ``i - b .. i``.
    """
    if band == 0:
        return 0, 0
    if band == 1:
        return 1, 1
    return band, 2 * band - 1


# --- Exchange programs ------------------------------------------------------------------------
#
# Everything that moves data between shards is written as a generator, an *exchange program*: it
# yields the list of `Send`s it needs at that point and is resumed with what they delivered, then
# returns its result. `parallel` runs several programs in lock step, merging their requests round
# by round, and `run` performs each round's requests with one collective-permute per (mesh axes,
# offset): however many tensors take part, a round costs as many messages as it has distinct
# directions. A program that needs nothing from other shards returns at once.


class Send(NamedTuple):
    """One request of an exchange program: shard ``s`` receives ``array`` (as computed on shard
    ``(s + offset) mod P``) from along the mesh axes ``names`` (``P`` shards, block order)."""

    array: jax.Array
    names: MeshAxes
    offset: int


Program = Generator[list[Send], list[jax.Array], Any]


def parallel(programs: list[Program]) -> Program:
    """An exchange program running ``programs`` in lock step; returns their results in order."""
    results: list[Any] = [None] * len(programs)
    requests: dict[int, list[Send]] = {}

    def advance(i: int, received: list[jax.Array] | None) -> None:
        try:
            requests[i] = programs[i].send(received)
        except StopIteration as stop:
            requests.pop(i, None)
            results[i] = stop.value

    for i in range(len(programs)):
        advance(i, None)
    while requests:
        order = [(i, len(sends)) for i, sends in requests.items()]
        received = yield [send for sends in requests.values() for send in sends]
        at = 0
        for i, count in order:
            advance(i, received[at : at + count])
            at += count
    return results


def run(program: Program) -> Any:
    """Performs ``program``'s requests round by round (:func:`exchange`); returns its result."""
    try:
        sends = program.send(None)
        while True:
            sends = program.send(exchange(sends))
    except StopIteration as stop:
        return stop.value


def exchange(sends: list[Send]) -> list[jax.Array]:
    """What each of ``sends`` delivers: the arrays going the same way (same mesh axes and offset)
    are packed into one byte buffer and moved by one collective-permute.

    Under ``shard_map``'s varying-axes check, arrays that vary over different mesh axes travel
    apart (a packed buffer varies over the union, and would make a piece of a tensor replicated
    over an axis look as if it varied over it): one message per direction and set of axes."""
    received: list[jax.Array | None] = [None] * len(sends)
    groups: dict[tuple, list[int]] = {}
    for i, send in enumerate(sends):
        groups.setdefault((send.names, send.offset, _varying(send.array)), []).append(i)
    for (names, offset, _), members in groups.items():
        arrays = [sends[i].array for i in members]
        buffer = jnp.concatenate([_as_bytes(x) for x in arrays])
        num_shards = math.prod(lax.axis_size(n) for n in names)
        buffer = _fetch_from(buffer, offset, names, num_shards)
        at = 0
        for i, x in zip(members, arrays, strict=True):
            size = x.size * x.dtype.itemsize
            received[i] = _from_bytes(buffer[at : at + size], x.shape, x.dtype)
            at += size
    return received


def _varying(x: jax.Array) -> frozenset[str]:
    """The mesh axes ``x`` varies over in ``shard_map``'s type (``vma``; ``manual_axis_type`` in
    older JAX), empty outside ``shard_map`` or without its check."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def _as_bytes(x: jax.Array) -> jax.Array:
    """``x``'s bytes, flat (uint8)."""
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(data: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The inverse of :func:`_as_bytes`."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize == 1:
        return lax.bitcast_convert_type(data.reshape(shape), dtype)
    return lax.bitcast_convert_type(data.reshape(*shape, itemsize), dtype)


def _shift(x: jax.Array, k: int, layout: ChainLayout, a: int) -> Program:
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
        return (yield from _shift(x, q, layout, a + 1))
    if layout.shards[a] == 1:
        head, tail = yield from parallel([
            _shift(lax.slice_in_dim(x, t, n, axis=axis), q, layout, a + 1),
            _shift(lax.slice_in_dim(x, 0, t, axis=axis), q + 1, layout, a + 1),
        ])  # fmt: skip
        return jnp.concatenate([head, tail], axis=axis)
    return (yield from _shift_sharded_axis(x, q, t, layout, a, axis))


def _rows_from(
    block: jax.Array, w: int, q: int, layout: ChainLayout, a: int, shards: int, carry: int
) -> Program:
    """Every shard ``s`` along axis ``a`` receives ``block`` (some of its own rows) as computed on
    shard ``s' = (s + w) mod P``, after the rest-axes shift by ``q``, or by ``q + carry`` where
    the fetch wraps around the axis: ``carry = 1`` (``w > 0``) where ``s + (w mod P) >= P``, i.e.
    ``s' < w mod P``; ``carry = -1`` (``w < 0``) where ``s - (-w mod P) < 0``, i.e.
    ``s' >= w mod P``. ``q`` counts the whole turns of ``|w| >= P``."""
    offset = w % shards
    wraps = offset != 0 and carry != 0
    plain_program = _shift(block, q, layout, a + 1)
    if not wraps:
        send = yield from plain_program
    else:
        plain, carried = yield from parallel(
            [plain_program, _shift(block, q + carry, layout, a + 1)]
        )
        index = lax.axis_index(layout.axes[a])
        wrapped = index < offset if carry > 0 else index >= offset
        send = jnp.where(wrapped, carried, plain)
    if offset == 0:
        return send
    (received,) = yield [Send(send, layout.axes[a], offset)]
    return received


def _shift_sharded_axis(
    x: jax.Array, q: int, t: int, layout: ChainLayout, a: int, axis: int
) -> Program:
    """:func:`_shift` along an axis split into ``P`` shards of ``l`` rows (inside ``shard_map``).

    Write ``t = u l + v`` (``0 <= v < l``). Local rows ``[0, l - v)`` come from rows ``[v, l)`` of
    shard ``s + u`` and rows ``[l - v, l)`` from rows ``[0, v)`` of shard ``s + u + 1`` (indices
    mod ``P``). A piece fetched from shard ``s + w`` has wrapped past the end of the axis, and so
    takes the carried (``q + 1``) rest shift, exactly when ``s + w >= P``: the sender picks the
    right version and sends one slab.
    """
    shards = layout.shards[a]
    rows = x.shape[axis]
    u, v = divmod(t, rows)

    def piece(start: int, stop: int, w: int) -> Program:
        block = lax.slice_in_dim(x, start, stop, axis=axis)
        if w == shards:  # every shard's piece wrapped: all carried, each from itself
            return (yield from _rows_from(block, 0, q + 1, layout, a, shards, 0))
        return (yield from _rows_from(block, w, q, layout, a, shards, 1))

    if v == 0:
        return (yield from piece(0, rows, u))
    first, second = yield from parallel([piece(v, rows, u), piece(0, v, u + 1)])
    return jnp.concatenate([first, second], axis=axis)


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


def norm_pairs(xs: list[jax.Array]) -> jax.Array:
    """Each array's local ``(scale, sum (x / scale)^2)`` norm pairs per row (its first axis; one
    pair for a vector), safe from underflow and overflow, in one pass: ``(2 len(xs), rows)``,
    rows ``scale_0, sum_0, scale_1, ...`` (the layout of the kernels' per-tile pairs, a row per
    tile). ``||x|| = scale sqrt(sum)`` once merged over the rows and the shards
    (:func:`merge_pairs`, :func:`merge_shards`).

    One variadic reduction over the pairs (:func:`_nrm2_combine`) for all ``xs`` together: the
    inputs are read once instead of four times for two two-pass norms. It stops at one pair per
    row so that the caller merges the rows of many tensors in one reduction: finished here, each
    tensor's norms took a small reduction kernel of their own after the pass. A 0-d array is a
    vector of one element.
    """
    xs = [jnp.atleast_1d(x) for x in xs]
    operands, inits = [], []
    for x in xs:
        operands += [jnp.abs(x), jnp.ones_like(x)]
        inits += [jnp.zeros((), x.dtype), jnp.zeros((), x.dtype)]
    ndim = xs[0].ndim
    axes = tuple(range(1, ndim)) if ndim >= 2 else (0,)
    pairs = lax.reduce(tuple(operands), tuple(inits), _nrm2_combine, axes)
    return jnp.stack(pairs).reshape(len(pairs), -1)


def merge_shards(
    pairs: dict[MeshAxes, tuple[jax.Array, jax.Array]],
) -> dict[MeshAxes, tuple[jax.Array, jax.Array]]:
    """Norm pairs ``(scales, sums)`` merged (:func:`merge_pairs`) over the shards of each set of
    mesh axes, every set in one all-reduce (inside ``shard_map``).

    Each device writes all its pairs into its own slot of a zero buffer over the union of the
    sets' axes; the buffer's ``psum`` holds every device's pairs side by side (adding zeros is
    exact), so one message replaces a ``pmax`` and a dependent ``psum`` per set. Each set then
    merges, locally, the slots along its own axes at position 0 of the others: a tensor is
    replicated along the axes it is not split over, so every position holds the same pairs, and
    a static choice keeps the result typed as replicated. The buffer holds ``devices x pairs``
    numbers: a few bytes per tensor and device of the union.
    """
    order = jax.sharding.get_abstract_mesh().axis_names
    union = tuple(a for a in order if any(a in axes for axes in pairs))
    sizes = tuple(lax.axis_size(a) for a in union)
    flat = jnp.concatenate([jnp.stack(pair).reshape(-1) for pair in pairs.values()])
    slot = lax.axis_index(union)
    buffer = jnp.zeros((math.prod(sizes), flat.size), flat.dtype).at[slot].set(flat)
    buffer = lax.psum(buffer, union).reshape(*sizes, flat.size)
    merged, offset = {}, 0
    for axes, (scales, _) in pairs.items():
        at = tuple(slice(None) if a in axes else 0 for a in union)
        part = buffer[(*at, slice(offset, offset + 2 * scales.size))]
        offset += 2 * scales.size
        part = part.reshape(-1, 2, *scales.shape)
        merged[axes] = merge_pairs(part[:, 0], part[:, 1], axis=0)
    return merged


def merge_pairs(scales, sums, axis: int) -> tuple[jax.Array, jax.Array]:
    """One ``(scale, sum (x / scale)^2)`` pair from the partial pairs along ``axis`` (kernel
    tiles, or shards).

    Each partial sum is rescaled to the largest scale before they are added, so nothing overflows
    or underflows.
    """
    top = jnp.max(scales, axis=axis)
    ratio = scales / jnp.expand_dims(jnp.where(top > 0, top, 1), axis)
    return top, jnp.sum(sums * ratio * ratio, axis=axis)
