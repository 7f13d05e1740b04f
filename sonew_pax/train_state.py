"""The training state, its partition specs, and its initialisation straight into its sharding.

`TrainState` is ``(step, params, opt_state)``. Nothing here runs the model on real data: the
state's shapes come from ``jax.eval_shape``; the parameter specs are given (derived from the
model's logical axis names by `sonew_pax.partitioning`); the optimizer-state specs come from
`sonew_pax.optim.state_partition_specs` (SONew state lives in its parameter's layout, so its spec
is the parameter's); and the one real initialisation is two jitted functions (the parameters'
draws, then the optimizer's state around them) whose ``out_shardings`` are those specs, so no state
array is ever materialised whole on one device.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sonew_pax import optim

PyTree = Any


class TrainState(NamedTuple):
    """Everything a checkpoint holds besides the data position."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The state's abstract shapes, partition specs and shardings on one mesh."""

    abstract: TrainState
    specs: TrainState
    shardings: TrainState

    def abstract_with_shardings(self) -> TrainState:
        """ShapeDtypeStructs carrying their target sharding (what a restore needs)."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract,
            self.shardings,
        )


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def strip_boxes(boxed: PyTree) -> PyTree:
    """The values inside the logical-axis boxes, without applying sharding constraints."""
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if _is_box(x) else x, boxed, is_leaf=_is_box
    )


def _init_params(model: nn.Module, rng: jax.Array, example_tokens: jax.Array) -> PyTree:
    """The model's parameters, still boxed with their logical axis names."""
    return model.init(rng, example_tokens)["params"]


def new_state(params: PyTree, tx: optax.GradientTransformation) -> TrainState:
    """A step-0 state for unboxed ``params``."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def abstract_boxed_params(model: nn.Module, example_tokens: jax.ShapeDtypeStruct) -> PyTree:
    """Parameter shapes with their logical-axis boxes, without allocating anything."""
    rng = jax.eval_shape(jax.random.key, 0)
    return jax.eval_shape(lambda r: _init_params(model, r, example_tokens), rng)


def derive_layout(
    boxed_params: PyTree,
    tx: optax.GradientTransformation,
    param_specs: PyTree,
    mesh: Mesh,
) -> StateLayout:
    """Abstract state, specs and shardings for ``tx`` applied to the (abstract) parameters."""
    params = strip_boxes(boxed_params)
    opt_state = jax.eval_shape(tx.init, params)
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state)
    specs = TrainState(
        step=PartitionSpec(),
        params=param_specs,
        opt_state=optim.state_partition_specs(opt_state, param_specs),
    )
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return StateLayout(abstract=abstract, specs=specs, shardings=shardings)


@contextlib.contextmanager
def threefry_gpu_kernels(enabled: bool = True):
    """Within the block (where ``enabled``), JAX lowers each threefry draw on a GPU to its CUDA
    kernel instead of XLA's element-wise form (``jax_threefry_gpu_kernel_lowering``; the same
    bits; no effect on other platforms); the process's setting again after it.

    XLA fuses the element-wise draws of one program into ever larger kernels and compiles them
    in time that grows faster than their number; with the kernels a model's initialiser compiles
    in a fraction of it (docs/performance.md). What it trades: XLA cannot split the kernel's
    custom call, so on a mesh each device draws a sharded parameter's bits whole before keeping
    its shard, holding a share of the whole model's bits at once (`draws_by_gpu_kernels`).
    """
    before = jax.config.jax_threefry_gpu_kernel_lowering
    jax.config.update("jax_threefry_gpu_kernel_lowering", enabled or before)
    try:
        yield
    finally:
        jax.config.update("jax_threefry_gpu_kernel_lowering", before)


def draws_by_gpu_kernels(param_shardings: PyTree) -> bool:
    """Whether the parameters' draws take `threefry_gpu_kernels`: only where no parameter is
    sharded. Each device then holds every parameter whole anyway, and the kernels' buffers of
    bits are transient beside the training step's peak. On a sharded mesh the kernels would
    draw every parameter whole on every device: temporary bits several times a device's shard
    (docs/performance.md), a share of the whole model that grows with it while the shards
    shrink; XLA's element-wise form draws each device's shard alone, at a slower compile."""
    return all(s.is_fully_replicated for s in jax.tree.leaves(param_shardings))


def make_init_fn(
    model: nn.Module,
    tx: optax.GradientTransformation,
    layout: StateLayout,
    example_tokens: jax.ShapeDtypeStruct,
) -> Callable[[jax.Array], TrainState]:
    """A ``rng -> TrainState`` that writes every array directly into its shard.

    Two jitted programs: the parameters' random draws (by `threefry_gpu_kernels` where
    `draws_by_gpu_kernels`), which depend on the model and its shardings alone, then the step-0
    state around them (the optimizer's initial state; the parameters donated, so none is
    copied). As their own program the draws compile once for every optimizer of one model:
    trainers of one model with different optimizers load them from the persistent compilation
    cache (a sweep over optimizers).
    """

    def init_params(rng: jax.Array) -> PyTree:
        return nn.unbox(_init_params(model, rng, example_tokens))

    draw = jax.jit(init_params, out_shardings=layout.shardings.params)
    wrap = jax.jit(
        functools.partial(new_state, tx=tx), out_shardings=layout.shardings, donate_argnums=0
    )

    kernels = draws_by_gpu_kernels(layout.shardings.params)

    def init(rng: jax.Array) -> TrainState:
        with threefry_gpu_kernels(kernels):
            params = draw(rng)
        return wrap(params)

    return init


def describe(layout: StateLayout) -> str:
    """model-info.txt: every parameter and optimizer-state array with shape, dtype, spec, size."""
    lines = []
    for title, tree, specs in (
        ("Parameters", layout.abstract.params, layout.specs.params),
        ("Optimizer state", layout.abstract.opt_state, layout.specs.opt_state),
    ):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        total = sum(a.size for _, a in leaves)
        lines.append(f"{title}: {len(leaves)} arrays, {total:,} elements")
        for (path, a), spec in zip(leaves, spec_leaves, strict=True):
            name = jax.tree_util.keystr(path)
            lines.append(f"  {name:<60} {a.dtype!s:<9} {a.shape!s:<22} {spec!s:<32} {a.size:,}")
        lines.append("")
    return "\n".join(lines)
