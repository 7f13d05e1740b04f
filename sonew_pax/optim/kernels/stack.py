"""Same-shaped tensors copied into one stack (``stack_by_shape``'s gradients) by a GPU kernel.

XLA's GPU compiler emits a ``concatenate`` of many operands as one loop over the output that
stores about one element per multiprocessor cycle, whatever the element's size: a third of a
copy's bandwidth on the stacks of an LM's layers. This kernel copies each member in blocks of
contiguous elements, so its loads and stores are as wide as a plain copy's, and it multiplies by
a gradient clip's factor as it copies (``scale``). What it trades: XLA cannot fuse a member's
producer into the kernel (a split-K matrix product's reduction of its partial sums, or the
transpose that puts a 3-D attention weight's gradient in the weight's layout), so such a producer
writes its result once before the copy reads it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim.kernels.config import DEFAULT, KernelConfig
from sonew_pax.optim.kernels.program import bind


def stack_kernel(*refs, size: int, block: int, count: int, first: int, scaled: bool):
    """Program ``(s, i)`` copies block ``i`` of ``block`` elements of member ``s`` (of
    ``count``: the first ``count`` refs, each flat of ``size`` elements) into the flat stack (the
    last ref) at member ``first + s``, cast to the stack's dtype; where ``scaled``, times the
    scalar in the next ref (the product in the scalar's dtype, rounded once). A ref between
    those and the stack is an earlier launch's stack, aliased to it and not read."""
    members, out_ref = refs[:count], refs[-1]
    scale = refs[count][0] if scaled else None
    s, i = pl.program_id(0), pl.program_id(1)
    at = i * block + jnp.arange(block, dtype=jnp.int32)
    mask = at < size
    # Masked lanes point past the stack: a GPU stores nothing there, and Pallas' interpreter,
    # which writes a masked block's every lane back, drops stores out of range.
    to = jnp.where(mask, (first + s) * size + at, out_ref.shape[0])
    for k, ref in enumerate(members):

        @pl.when(s == k)
        def _copy(ref=ref):
            x = plgpu.load(ref.at[jnp.where(mask, at, 0)], mask=mask)
            x = x if scale is None else x.astype(scale.dtype) * scale
            plgpu.store(out_ref.at[to], x.astype(out_ref.dtype), mask=mask)


def stackable(shape: tuple[int, ...], count: int, config: KernelConfig = DEFAULT) -> bool:
    """Whether :func:`stack` copies ``count`` tensors of ``shape``: the stack's flat offsets
    stay within ``config.max_offset`` (int32) and it has elements."""
    return 0 < count * math.prod(shape) <= config.max_offset


def stack(
    tensors: Sequence[jax.Array],
    dtype: jax.typing.DTypeLike,
    config: KernelConfig = DEFAULT,
    interpret: bool = False,
    scale: jax.Array | None = None,
) -> jax.Array:
    """``jnp.stack(tensors).astype(dtype)``, each element times ``scale`` where given (a
    gradient clip's factor, ``transform.GradientScaling``), copied by :func:`stack_kernel`.

    Up to ``config.stack_group`` tensors per launch (each is a kernel argument and a branch);
    later launches write into the first's output in place. Check :func:`stackable` first.

    Args:
      tensors: arrays of one shape and dtype.
      dtype: the stack's dtype (each member cast as it is copied).
      config: the kernels' configuration (``stack_tile``, ``stack_group``).
      interpret: run in Pallas' interpreter (off a GPU).
      scale: ``None``, or a scalar: each element is cast to its dtype, multiplied by it and
        rounded to ``dtype``.

    Returns:
      The ``(len(tensors), *shape)`` stack.
    """
    shape, count = tuple(tensors[0].shape), len(tensors)
    size = math.prod(shape)
    per = min(config.stack_group, count)
    flat = [x.reshape(-1) for x in tensors]
    factor = [] if scale is None else [jnp.reshape(scale, (1,))]
    out = None
    for first in range(0, count, per):
        part = flat[first : first + per]
        launch = (size, count, len(part), first, jnp.dtype(dtype), config.stack_tile)
        call = stack_call(*launch, bool(factor), out is not None, interpret)
        out = call(*part, *factor) if out is None else call(*part, *factor, out)
    return out.reshape(count, *shape)


@functools.cache
def stack_call(
    size: int,
    count: int,
    members: int,
    first: int,
    dtype,
    tile: tuple[int, int],
    scaled: bool,
    aliased: bool,
    interpret: bool,
) -> Callable:
    """One launch of :func:`stack`: ``members`` flat tensors of ``size`` elements (then the
    scalar where ``scaled``) into members ``first`` on of a flat stack of ``count`` (the last
    argument where ``aliased``, updated in place), jitted and cached (as ``halo.halo_call``)."""
    block, num_warps = tile
    static = dict(size=size, block=block, count=members, first=first, scaled=scaled)
    copy = pl.pallas_call(
        bind(stack_kernel, "sonew_stack", **static),
        grid=(members, pl.cdiv(size, block)),
        out_shape=jax.ShapeDtypeStruct((count * size,), dtype),
        input_output_aliases={members + scaled: 0} if aliased else {},
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps),
        name="sonew_stack",
    )
    return jax.jit(copy)
