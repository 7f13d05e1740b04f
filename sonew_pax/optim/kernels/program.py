"""What every step kernel shares: its scalar input, its outputs, its norm pairs, its binding."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import fma, pointwise
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.fma import madd

# The numbers every tensor of an update shares (``SONewConfig``'s, the bias corrections and
# :class:`Apply`'s), packed into one input array (padded to a power of 2, as Triton's blocks must
# be) by :func:`pack_scalars`: every launch of an update passes the same array. A relative
# damping's statistics are an input of their own, with the tensor's slot (``StepRefs.diag``).
SHARED = ("b1", "b2", "eps", "gamma", "graft_eps", "bc1", "bc2", "weight_decay", "scale")


class Apply(NamedTuple):
    """The fused apply of one tensor: the kernel writes ``params`` in place with
    ``pointwise.apply_update(params, u, ratio, decay, scale)`` instead of writing ``u``, where
    ``decay`` is ``weight_decay`` if ``decayed`` else 0.

    ``ratios`` holds the graft ratio known before the step at ``slot``: ``graft_lag``'s array
    over the tensors (the state's, which XLA passes without a copy or a slice), or ``[1]``
    without grafting; ``weight_decay`` and ``scale`` (the factor of the sum, ``-lr`` in
    ``sonew``) are the same for every tensor; ``decayed`` is static."""

    params: jax.Array
    ratios: Any
    slot: int
    weight_decay: Any
    scale: Any
    decayed: bool


class StepRefs(NamedTuple):
    """The refs a band >= 1 step kernel takes after its named inputs: with a relative damping
    the update's statistics and the tensor's slot in them (``(1,)`` int32; :func:`numbers`;
    else ``None``), with the fused apply
    (:class:`Apply`) the parameters, the graft ratios and the tensor's slot in them (else
    ``None``), then its outputs:
    ``u``'s place (the new parameters with the apply), the new ``m``, ``d`` and ``e``, and the
    tiles' norm pairs."""

    diag: Any
    slot: Any
    p: Any
    ratio: Any
    ratio_slot: Any
    out: Any
    m: Any
    d: Any
    e: Any
    parts: Any

    @classmethod
    def of(cls, refs: tuple, relative: bool, apply: bool) -> StepRefs:
        """The named refs of ``refs``, the kernel's trailing positional refs."""
        refs = list(refs)
        diag, slot = (refs.pop(0), refs.pop(0)) if relative else (None, None)
        p, ratio, ratio_slot = (refs.pop(0) for _ in range(3)) if apply else (None,) * 3
        return cls(diag, slot, p, ratio, ratio_slot, *refs)


def pack_scalars(hyper: SONewConfig, corrections: tuple, apply: Apply | None, dtype) -> jax.Array:
    """The kernels' scalar input: :data:`SHARED` (``Apply``'s zero without ``apply``)."""
    values = {name: getattr(hyper, name) for name in ("b1", "b2", "eps", "gamma", "graft_eps")}
    values.update(bc1=corrections[0], bc2=corrections[1], weight_decay=0, scale=0)
    if apply is not None:
        values.update(weight_decay=apply.weight_decay, scale=apply.scale)
    numbers = [values[name] for name in SHARED]
    numbers += [0] * (pl.next_power_of_2(len(numbers)) - len(numbers))
    return jnp.stack([jnp.asarray(x, dtype) for x in numbers])


def numbers(scalars_ref, graft: str, diag_ref=None, slot_ref=None) -> tuple[SONewConfig, tuple]:
    """``SONewConfig`` and the bias corrections from the kernels' scalar input
    (:func:`pack_scalars`); with a relative damping's statistics (``diag_ref``) its ``eps`` is
    ``pointwise.relative_eps`` of the tensor's (at ``slot_ref[0]``)."""
    values = {name: scalars_ref[k] for k, name in enumerate(SHARED)}
    eps = values["eps"]
    if diag_ref is not None:
        # A read at one place: the array is as long as the preconditioned tensors are many (a
        # whole-array read would need a power-of-2 length, as the scalars above are padded to).
        eps = pointwise.relative_eps(eps, plgpu.load(diag_ref.at[slot_ref[0]]))
    hyper = SONewConfig(
        b1=values["b1"],
        b2=values["b2"],
        eps=eps,
        gamma=values["gamma"],
        graft_eps=values["graft_eps"],
        graft=graft,
        precondition_1d=True,
        damping="absolute",  # eps is this tensor's already
    )
    return hyper, (values["bc1"], values["bc2"])


def output(scalars_ref, ratio_ref, slot_ref, u, p, decayed: bool):
    """What the kernel writes in ``u``'s place: ``u``, or with the fused apply (``p`` read, not
    ``None``) the new parameter (:class:`Apply`)."""
    if p is None:
        return u
    weight_decay, scale = (scalars_ref[SHARED.index(k)] for k in ("weight_decay", "scale"))
    decay = weight_decay if decayed else 0
    ratio = plgpu.load(ratio_ref.at[slot_ref[0]])
    return pointwise.apply_update(p, u, ratio, decay, scale)


def write_parts(parts_ref, i, j, pairs) -> None:
    """Program ``(i, j)``'s norm pairs (Adam's direction's, ``u``'s, ...) from per-lane pairs
    ``(scale, sum (x / scale)^2)``: rescaled to the largest scale and added (as
    ``chain.merge_pairs``). The scale is at least the smallest normal number
    (:func:`scale_floor`)."""
    for k, (scales, sums) in enumerate(pairs):
        top = jnp.maximum(jnp.max(scales), scale_floor(scales.dtype))
        ratio = scales * (1 / top)
        parts_ref[2 * k, i, j] = top
        parts_ref[2 * k + 1, i, j] = jnp.sum(sums * ratio * ratio)


def scale_floor(dtype) -> Any:
    """The smallest scale of the kernels' norm pairs: the smallest normal number of ``dtype``.

    The kernels multiply by ``1 / scale`` (one division per pair, not per element). GPUs keep
    subnormal numbers, whose reciprocals overflow: a scale of ``|x| < 2^-128`` would make a norm
    ``inf * 0 = NaN`` and the tensor's update zero (moments of rarely lit inputs decay into
    subnormals). From a normal scale ``1 / scale`` is finite, and ``(x / scale)^2`` of smaller
    ``x`` underflows harmlessly.
    """
    return jnp.finfo(dtype).tiny


def running_pair(pair, x, valid):
    """The per-lane pair ``(scale, sum (x / scale)^2)`` with ``|x|`` added where ``valid``; the
    scale starts at :func:`scale_floor`."""
    scale, total = pair
    x = jnp.where(valid, jnp.abs(x), 0)
    new = jnp.maximum(scale, x)
    inverse = 1 / new
    ratio, scaled = scale * inverse, x * inverse
    return new, madd(scaled, scaled, total * ratio * ratio)


def per_tensor(scalars_ref, *refs, body, count: int, inputs: int, static: dict) -> None:
    """The kernel ``body`` on one of ``count`` tensors' refs (``inputs`` inputs each after the
    shared scalars, then each one's outputs): tensor ``program_id(2)``'s, a branch per tensor
    (the refs are static). ``body`` takes the program's ``(row chunk, column block)`` as
    ``program``."""
    # Read outside the branches: inside one, Pallas' interpreter finds no program ids.
    program = pl.program_id(0), pl.program_id(1)
    if count == 1:
        body(scalars_ref, *refs, program=program, **static)
        return
    outputs = (len(refs) - count * inputs) // count
    tensor = pl.program_id(2)
    for k in range(count):

        @pl.when(tensor == k)
        def _run(k=k):
            mine = refs[k * inputs : (k + 1) * inputs]
            out = refs[count * inputs + k * outputs : count * inputs + (k + 1) * outputs]
            body(scalars_ref, *mine, *out, program=program, **static)


def bind(kernel, name: str, contract: bool = False, **static):
    """``kernel`` with its static arguments bound, under ``name`` (as Pallas reports it), traced
    within ``fma.contracted(contract)``."""

    def bound(*refs):
        with fma.contracted(contract):
            kernel(*refs, **static)

    bound.__name__ = name
    return bound
