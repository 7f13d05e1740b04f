"""Which path runs a tensor's step: a GPU kernel, a TPU kernel, or XLA.

:func:`kernels_enabled` says whether the Pallas kernels (``kernels``) may run at all; the
predicates below say, per tensor (its ``ChainLayout`` and band), which of them takes its step in
the engine (``engine._leaf_steps``): whole tensors whose chain tiles on the kernels' platform go
to a kernel, stacks to a vectorized kernel, and everything else (0-d, empty, not preconditioned,
unsupported shapes) to XLA.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax

from sonew_pax.optim import kernels as pallas
from sonew_pax.optim.chain import ChainLayout
from sonew_pax.optim.config import SONewConfig
from sonew_pax.optim.kernels import KernelConfig


def preconditioned(ndim: int, precondition_1d: bool) -> bool:
    """Whether a tensor of ``ndim`` dimensions is preconditioned, else it takes Adam's direction."""
    return ndim >= 2 or precondition_1d


def kernels_enabled(
    implementation: str, mesh: Any, config: KernelConfig | None
) -> KernelConfig | None:
    """``config`` where the Pallas kernels (``kernels``) may run, else ``None`` (XLA only).

    ``"pallas"``: on any backend: the GPU kernels, or on a TPU its kernels
    (``KernelConfig.platform``); off their platform in Pallas' interpreter (slow, for tests).
    ``"auto"``: on GPU (``mesh``'s devices, else the default backend's: a step compiled for a GPU
    from a host without one gets them, compiled where ``config.interpret`` is False), under
    ``mesh`` (``shard_map`` then says which tensors are whole on the device) or on a one-device
    process; without a mesh on several devices the arrays may be sharded by the caller's ``jit``,
    which cannot partition a kernel (it would gather every tensor), so XLA runs.
    ``"xla"``: never.

    Args:
      implementation: ``"auto"``, ``"xla"`` or ``"pallas"`` (``SONewConfig.implementation``).
      mesh: the mesh the step runs on under ``shard_map``, or ``None``.
      config: the kernels' configuration (``None``: ``kernels.DEFAULT``).

    Returns:
      ``config`` where the kernels may run, else ``None``.
    """
    config = pallas.DEFAULT if config is None else config
    if implementation != "auto":
        enabled = implementation == "pallas"
    else:
        enabled = _platform_of(mesh) == "gpu" and (mesh is not None or jax.device_count() == 1)
    return config if enabled else None


def _platform_of(mesh: Any) -> str:
    """The platform of ``mesh``'s devices; the default backend's without a mesh of devices."""
    devices = getattr(mesh, "devices", None)
    return devices.flat[0].platform if devices is not None else jax.default_backend()


def interpreted(kernels: KernelConfig | None = None) -> bool:
    """Whether the kernels run in Pallas' interpreter: ``KernelConfig.interpret``, by default off
    their platform's backend (tests on CPU)."""
    if kernels is not None and kernels.interpret is not None:
        return kernels.interpret
    platform = "gpu" if kernels is None else kernel_platform(kernels)
    return jax.default_backend() != platform


def kernel_platform(kernels: KernelConfig) -> str:
    """The platform whose kernels run (``KernelConfig.platform``)."""
    if kernels.platform is not None:
        return kernels.platform
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def band_of(e: Any) -> int:
    """The band of a tensor's off-diagonal statistics ``e`` (0: none, ``optax.MaskedNode``)."""
    return 0 if isinstance(e, optax.MaskedNode) else e.shape[0]


def is_empty(layout: ChainLayout) -> bool:
    """Whether the tensor has no elements (a 0-size dimension): it has no chain to precondition."""
    return math.prod(layout.shape) == 0


def has_chain(layout: ChainLayout, hyper: SONewConfig) -> bool:
    """Whether the tensor's step reads its chain (it is preconditioned and not empty)."""
    return not is_empty(layout) and preconditioned(len(layout.layer.shape), hyper.precondition_1d)


def _has_axis(layout: ChainLayout) -> bool:
    """Whether the tensor (each stacked one) has an axis 0, along which the kernels lay out its
    chain: a 0-d tensor, a chain of one element, steps on XLA."""
    return bool(layout.layer.shape)


def _kernel_candidate(
    kernels: KernelConfig | None, platform: str, layout: ChainLayout, hyper: SONewConfig
) -> bool:
    """Whether ``platform``'s kernels are enabled and the tensor is one they may take: not a
    stack, with a chain laid out along an axis 0."""
    return (
        kernels is not None
        and kernel_platform(kernels) == platform
        and not layout.stack
        and has_chain(layout, hyper)
        and _has_axis(layout)
    )


def on_gpu_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: SONewConfig
) -> bool:
    """Whether ``engine._leaf_steps`` runs this preconditioned tensor's step as a GPU kernel."""
    return _kernel_candidate(kernels, "gpu", layout, hyper) and pallas.supported(
        layout, band, kernels
    )


def stack_on_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: SONewConfig
) -> bool:
    """Whether ``engine._leaf_steps`` runs a stack's steps as GPU kernels
    (``engine._stacked_step``): the kernels take each of its tensors."""
    return bool(layout.stack) and on_gpu_kernel(kernels, layout.layer, band, hyper)


def stack_on_tpu_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: SONewConfig
) -> bool:
    """Whether ``engine._leaf_steps`` runs a stack's steps as TPU kernels, one tensor after
    another (``engine._each_stacked``): the kernel takes each of its tensors."""
    return bool(layout.stack) and on_tpu_kernel(kernels, layout.layer, band, hyper)


def on_tpu_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: SONewConfig
) -> bool:
    """Whether ``engine._leaf_steps`` runs this tensor's step as a TPU kernel (``kernels.tpu``): on
    a block whose view tiles (``tpu.block_shape``)."""
    if not _kernel_candidate(kernels, "tpu", layout, hyper):
        return False
    return pallas.tpu.block_shape(pallas.local_shape(layout), band, kernels) is not None


def on_any_kernel(
    kernels: KernelConfig | None, layout: ChainLayout, band: int, hyper: SONewConfig
) -> bool:
    """Whether a kernel, the GPU's (:func:`on_gpu_kernel`) or the TPU's (:func:`on_tpu_kernel`),
    steps this tensor: its edges then hold the old state, and it may write its parameters."""
    return on_gpu_kernel(kernels, layout, band, hyper) or on_tpu_kernel(
        kernels, layout, band, hyper
    )
