"""Launching the step kernels: one tensor, or several of one shape per launch, state in place."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import pointwise
from sonew_pax.optim.chain import ChainLayout, run
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.kernels import banded, diagonal, scan
from sonew_pax.optim.kernels.config import DEFAULT, KernelConfig
from sonew_pax.optim.kernels.geometry import default_tile, scan_stack, tile_view
from sonew_pax.optim.kernels.halo import Edges, Halo, gather_halos, kernel_edges
from sonew_pax.optim.kernels.program import Apply, bind, pack_scalars, per_tensor


def launch_key(g: jax.Array, m: jax.Array, d: jax.Array, e: Any, apply: Apply | None) -> tuple:
    """What the tensors of one :func:`group_update` launch share: ``(shape, band, dtypes of g
    and the state, apply)``, ``apply`` being ``None`` or the parameters' ``(dtype, decayed)``."""
    band = 0 if not hasattr(e, "shape") else e.shape[0]
    dtypes = tuple(jnp.dtype(x.dtype) for x in (g, m, d, *([e] if band else [])))
    fused_apply = None if apply is None else (jnp.dtype(apply.params.dtype), bool(apply.decayed))
    return g.shape, band, dtypes, fused_apply


def direction_dtype(g_dtype: Any, compute: Any) -> jnp.dtype:
    """The dtype the kernels write ``u`` in: the gradients' where it is narrower than float32 (a
    storage format, as ``pointwise.compute_dtype`` treats it; the step returns ``u`` in the
    gradients' dtype, so only its rounding moves, before the graft's scale, and its write and the
    apply's read shrink), else the arithmetic's ``compute``."""
    g_dtype = jnp.dtype(g_dtype)
    return g_dtype if pointwise.compute_dtype(g_dtype) != g_dtype else jnp.dtype(compute)


def leaf_update(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: Any,
    corrections: tuple[jax.Array, jax.Array],
    hyper: SONewConfig,
    *,
    interpret: bool = False,
    tile: tuple[int, int, int] | None = None,
    halos: tuple[Halo, Halo, Halo] | None = None,
    edges: Edges | None = None,
    apply: Apply | None = None,
    config: KernelConfig = DEFAULT,
) -> tuple[jax.Array, jax.Array, jax.Array, Any, jax.Array | None]:
    """One tensor's diag (``e`` is ``optax.MaskedNode``), tridiag or banded (``e`` of ``band >=
    2`` off-diagonals, ``geometry.supported``) step.

    ``m``, ``d`` and ``e`` are updated in place (their buffers are the outputs'). ``tile`` is
    ``(rows, cols, num_warps)``: a program handles ``rows x cols`` (powers of 2) of the view
    (``geometry.tile_view``) with ``num_warps`` warps; default ``geometry.default_tile`` of
    ``config`` (:class:`KernelConfig`). Band 0 runs ``diagonal.diagonal_kernel``, band 1
    ``scan.scan_kernel``, bands >= 2 ``banded.banded_kernel``. Returns ``(u, m, d, e, parts)``:
    the ungrafted direction (in :func:`direction_dtype`), the new state in the stored dtypes, and
    per tile the norm pairs ``(max |x|, sum (x / max)^2)`` of Adam's direction and of ``u`` as
    ``(4, tiles)``: rows ``scale_adam, sum_adam, scale_u, sum_u``, then with a relative damping
    (``hyper.damping``) those of ``sqrt(d_hat)`` (``(6, tiles)``); ``None`` without them (no
    grafting, absolute damping). Each row is contiguous, so XLA reduces along the minor axis; see
    ``chain.merge_pairs``.

    Bands >= 1 read the halo rows of ``(m, d, e)`` (``halo.band_halo_rows``) from ``halos``
    (``halo.gather_halos``, which can gather those of a model's tensors in a few launches);
    default: gathered here. They read the chain neighbours beyond the view's first and last rows
    from ``edges`` (``halo.kernel_edges``: a shard's come from the other shards); default: those
    of a tensor whole on the device.

    With ``apply`` (:class:`Apply`) the kernel also reads the parameters and writes them in place,
    updated with ``u``, and returns them in ``u``'s place: 36 B/param for fp32 tridiag, where
    writing ``u`` for XLA to apply moves 44.
    """
    kwargs = dict(interpret=interpret, tile=tile, halos=[halos], edges=[edges], config=config)
    kwargs["applies"] = [apply]
    (step,) = group_update([g], [m], [d], [e], corrections, hyper, **kwargs)
    return step


def group_update(
    gs: list[jax.Array],
    ms: list[jax.Array],
    ds: list[jax.Array],
    es: list[Any],
    corrections: tuple[jax.Array, jax.Array],
    hyper: SONewConfig,
    *,
    interpret: bool = False,
    tile: tuple[int, int, int] | None = None,
    halos: list[tuple[Halo, Halo, Halo] | None] | None = None,
    edges: list[Edges | None] | None = None,
    applies: list[Apply | None] | None = None,
    diag: tuple[jax.Array, list[int]] | None = None,
    config: KernelConfig = DEFAULT,
) -> list[tuple[jax.Array, jax.Array, jax.Array, Any, jax.Array | None]]:
    """:func:`leaf_update` of several tensors of one :func:`launch_key` (shape, dtypes, and all
    with or all without :class:`Apply`, of one parameter dtype and ``decayed``) in one launch:
    the grid gains an axis over the tensors and each program runs one tensor's kernel. A small
    tensor's kernel is short and its walk's first loads wait on memory before any row is
    computed; launched together, the tensors fill the GPU as one larger tensor does
    (``geometry.launch_group``). ``diag``: with a relative damping (``hyper.damping``) the
    update's statistics (the state's array) and each tensor's slot in it, which its kernel reads
    to scale ``eps`` (``program.numbers``). Returns :func:`leaf_update`'s
    tuple per tensor, in order."""
    count = len(gs)
    halos = halos or [None] * count
    edges = edges or [None] * count
    applies = applies or [None] * count
    keys = set(map(launch_key, gs, ms, ds, es, applies))
    if len(keys) != 1:
        raise ValueError(f"group_update: tensors of different launch keys {sorted(map(str, keys))}")
    ((shape, band, dtypes, apply_config),) = keys
    rows, cols, num_warps = tile or default_tile(band, shape, config)
    kernel = "band" if band >= 2 else "scan" if band == 1 else "diagonal"
    stack = scan_stack(rows, config) if kernel == "scan" else 1
    if kernel != "diagonal" and (rows % stack or stack * cols < 32 * num_warps):
        raise ValueError(
            f"{kernel} kernel: {rows} rows in {stack} walks of {cols} columns for 32 x "
            f"{num_warps} lanes (one each)"
        )
    compute = pointwise.compute_dtype(ds[0].dtype)
    num_rows, num_cols = tile_view(shape)
    apply = applies[0]
    relative = hyper.damping != "absolute"
    if relative and (diag is None or len(diag[1]) != count):
        raise ValueError(f"group_update: a relative damping needs {count} statistics' slots")
    # One array for every launch of an update: XLA builds it once.
    scalars = pack_scalars(hyper, corrections, apply, compute)
    halo_size = (3 * band - 1) * pl.cdiv(num_rows, rows) * num_cols  # one sub-array's
    if band and band * halo_size > config.max_offset:
        raise ValueError(
            f"band {band} on {shape} in chunks of {rows} rows: {band * halo_size} halo "
            "elements exceed the kernels' offsets; use longer row chunks (tile)"
        )
    inputs = [scalars]
    for k, (g, m, d, e, halo, edge, applied) in enumerate(
        zip(gs, ms, ds, es, halos, edges, applies, strict=True)
    ):
        state = [m, d] + ([e[0]] if band == 1 else [e] if band else [])
        extra = []
        if band:
            halo = halo or gather_halos(
                state, rows, band=band, shapes=[shape] * 3, interpret=interpret, config=config
            )
            if any(h.rows != rows for h in halo):
                raise ValueError(
                    f"halos gathered in chunks of {halo[0].rows} rows, tile has {rows}"
                )
            if edge is None:
                (edge,) = run(kernel_edges([g], [m], [d], [e], ChainLayout.unsharded(shape)))
            edge_size = (3 + band) * (3 * band - 1) * num_cols  # one tensor's edges
            starts = [h.index * halo_size for h in halo] + [edge.index * edge_size]
            extra = [h.buffer for h in halo]
            extra += [jnp.array(starts, jnp.int32), edge.buffer]
        if relative:
            extra += [diag[0], jnp.array([diag[1][k]], jnp.int32)]
        params = []
        if applied is not None:
            ratios = jnp.asarray(applied.ratios, compute).reshape(-1)
            params = [applied.params.reshape(-1), ratios, jnp.array([applied.slot], jnp.int32)]
        inputs += [g.reshape(-1), *(x.reshape(-1) for x in state), *extra, *params]
    step = step_call(
        shape,
        band,
        hyper.graft,
        relative,
        (rows, cols, num_warps),
        dtypes[1:],  # the state's
        direction_dtype(dtypes[0], compute),
        kernel,
        (stack, config.scan_ahead) if kernel == "scan" else None,
        interpret,
        apply_config,
        len(extra),
        count,
        config.fma and kernel == "band" and not interpret and ptx(),
    )
    outputs = step(*inputs)
    per = len(outputs) // count
    steps = []
    for k, e in enumerate(es):
        u, *new_state, parts = outputs[k * per : (k + 1) * per]
        m_new, d_new = (x.reshape(shape) for x in new_state[:2])
        e_new = new_state[2].reshape(e.shape) if band else e
        parts = parts.reshape(4 + 2 * relative, -1) if hyper.graft == "adam" or relative else None
        steps.append((u.reshape(shape), m_new, d_new, e_new, parts))
    return steps


@functools.cache
def step_call(
    shape,
    band,
    graft,
    relative,
    tile,
    state_dtypes,
    u_dtype,
    kernel,
    walks,
    interpret,
    apply,
    halo_inputs,
    count=1,
    contract=False,
) -> Callable:
    """:func:`leaf_update`'s ``kernel`` (``"diagonal"``, ``"scan"`` with ``walks = (stack, ahead)``:
    ``stack`` walks per program, each loading ``ahead`` rows ahead, or ``"band"`` for bands >= 2)
    for one static configuration (``relative``: a relative damping, whose statistic each tensor
    passes among its ``halo_inputs`` and whose ``sqrt(d_hat)`` adds a norm pair; ``u`` written in
    ``u_dtype``, or with the fused apply when ``apply`` is the parameters' ``(dtype, decayed)``, not
    ``None``, the parameters in theirs; ``halo_inputs``: how many inputs come between the state and
    the parameters; ``count``: tensors per launch, :func:`group_update`; ``contract``: whether the
    kernel's ``fma.madd`` are fused multiply-adds), jitted and cached: the tensors of one shape then
    call one jitted function, which JAX lowers to Triton once per program instead of once per
    tensor, and whose Triton module the program holds once (lowering dominates the first step's time
    otherwise)."""
    rows, cols, num_warps = tile
    num_rows, num_cols = tile_view(shape)
    grid = (pl.cdiv(num_rows, rows), pl.cdiv(num_cols, cols))
    size, compute = math.prod(shape), pointwise.compute_dtype(state_dtypes[1])
    params_dtype, decayed = apply or (u_dtype, False)
    outputs = [jax.ShapeDtypeStruct((size,), params_dtype)]
    sizes = (size, size, max(band, 1) * size)[: len(state_dtypes)]  # m, d and e
    outputs += [jax.ShapeDtypeStruct((n,), t) for n, t in zip(sizes, state_dtypes, strict=True)]
    outputs.append(jax.ShapeDtypeStruct((4 + 2 * relative, *grid), compute))
    # Per tensor, after the scalars: g, the state, the halo inputs and with ``apply`` the
    # parameters, the graft ratios and the tensor's slot. The state's inputs are its outputs'
    # buffers; so are the parameters' with ``apply``.
    inputs = 1 + len(state_dtypes) + halo_inputs + 3 * bool(apply)
    aliases = {}
    for k in range(count):
        first_in, first_out = 1 + k * inputs, k * len(outputs)
        aliases.update({first_in + 1 + n: first_out + 1 + n for n in range(len(state_dtypes))})
        if apply:
            aliases[first_in + 1 + len(state_dtypes) + halo_inputs] = first_out
    static = dict(
        shape=shape,
        graft=graft,
        relative=relative,
        rows=rows,
        cols=cols,
        apply=bool(apply),
        decayed=decayed,
    )
    if kernel == "scan":
        body, name = scan.scan_kernel, "sonew_band1_scan"
        static.update(stack=walks[0], ahead=walks[1], interpret=interpret)
    elif kernel == "band":
        body, name, static["band"] = banded.banded_kernel, f"sonew_band{band}_scan", band
    else:
        body, name = diagonal.diagonal_kernel, "sonew_diagonal"
    step = pl.pallas_call(
        bind(
            per_tensor,
            name,
            contract=contract,
            body=body,
            count=count,
            inputs=inputs,
            static=static,
        ),
        grid=grid if count == 1 else (*grid, count),
        out_shape=outputs * count,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps),
        name=name,
    )
    return jax.jit(step)


def ptx() -> bool:
    """Whether the compiled kernels are for NVIDIA GPUs, whose PTX ``fma.madd``'s assembly is (on
    ROCm's the walk's multiply-adds stay apart): on an NVIDIA GPU, or lowered for one on a host
    without a GPU (``jax.export`` or a compile-only CUDA device, the kernels not interpreted)."""
    device = jax.devices()[0]
    return device.platform != "gpu" or device.device_kind.startswith("NVIDIA")
