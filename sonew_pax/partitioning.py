"""Device mesh, logical axis rules and partition specs, in the manner of T5X's partitioner.

The mesh always has the axes ("replica", "data", "model"): "data" and "replica" split the batch,
"model" splits the vocab / MLP / head dimensions of the parameters. Parameters name their
dimensions with logical axes (see `sonew_pax.models`); a rule table maps each logical name to a
mesh axis, a tuple of mesh axes, or None (replicated). Everything here is a small pure function;
gin configures `make_mesh` and `logical_axis_rules`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sonew_pax.errors import ConfigError

MESH_AXES = ("replica", "data", "model")

# The logical axis of a parameter's stacked layers (a model's `scan_layers`): `stacked_axes`.
LAYERS = "layers"

# Logical axis name -> mesh axis (or tuple of mesh axes, or None for replicated).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("replica", "data")),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("embed", None),
    ("kv", None),
    ("length", None),
    (LAYERS, None),  # SONew needs each stacked layer whole
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def _auto_axis_types(n: int) -> dict:
    """`axis_types=(Auto,) * n` where this JAX has axis types, else nothing."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    return {} if axis_type is None else {"axis_types": (axis_type.Auto,) * n}


def mesh_shape(data: int, model: int, replica: int, num_devices: int) -> tuple[int, int, int]:
    """Resolves the (replica, data, model) sizes for `num_devices`; one size may be -1 (fill).

    Raises ValueError, naming the numbers, when the sizes are not positive, when more than one is
    -1, or when their product does not equal (or, with a -1, divide) the device count.
    """
    sizes = {"replica": replica, "data": data, "model": model}
    fill = [name for name, size in sizes.items() if size == -1]
    bad = {name: size for name, size in sizes.items() if size != -1 and size < 1}
    if bad or len(fill) > 1:
        raise ValueError(f"mesh sizes must be positive with at most one -1, got {sizes}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise ValueError(
                f"mesh {_describe(sizes)} (product {known}) does not divide the "
                f"{num_devices} devices"
            )
        sizes[fill[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"mesh {_describe(sizes)} has {known} positions but there are {num_devices} devices"
        )
    return sizes["replica"], sizes["data"], sizes["model"]


def _describe(sizes: dict[str, int]) -> str:
    return " x ".join(f"{name}={size}" for name, size in sizes.items())


def _device_grid(shape: tuple[int, int, int], devices: Sequence) -> np.ndarray:
    """Arranges devices as `shape`; across TPU slices the replica axis spans the slices (DCN)."""
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    if num_slices == 1:
        return mesh_utils.create_device_mesh(shape, devices)
    replica, data, model = shape
    if replica % num_slices:
        raise ValueError(f"replica={replica} must be a multiple of the {num_slices} slices")
    return mesh_utils.create_hybrid_device_mesh(
        (replica // num_slices, data, model), (num_slices, 1, 1), devices
    )


@gin.configurable
def make_mesh(
    data: int = -1, model: int = 1, replica: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ("replica", "data", "model") mesh over `devices` (default: all devices) with auto axes.

    Args:
      data: size of the "data" axis; -1 takes whatever devices the other axes leave.
      model: size of the "model" axis (tensor parallelism over vocab / mlp / heads).
      replica: size of the "replica" axis (data parallelism across slices; spans TPU slices).
      devices: the devices to use, all of them; defaults to `jax.devices()`.

    Raises:
      ValueError: naming the mesh sizes and the device count when they do not fit.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, model, replica, len(devices))
    return Mesh(_device_grid(shape, devices), MESH_AXES, **_auto_axis_types(len(MESH_AXES)))


@gin.configurable
def logical_axis_rules(overrides: Rules = (), base: Rules = DEFAULT_RULES) -> tuple:
    """`base` rules with `overrides` replacing the rule of the same logical name (or appended).

    E.g. `logical_axis_rules.overrides = [("embed", "data")]` in gin adds FSDP-style sharding
    of the embed dimension over the data axis.
    """
    replaced = dict(overrides)
    rules = [(name, replaced.pop(name, axes)) for name, axes in base]
    return tuple(rules + list(replaced.items()))


def logical_to_mesh_spec(
    logical_axes: Sequence[str | None], rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """Translates logical axis names to a mesh PartitionSpec; a name without a rule is an error.

    A mesh axis already used by an earlier dimension leaves later dimensions unsharded (flax's
    rule semantics).
    """
    known = {name for name, _ in rules}
    unknown = [name for name in logical_axes if name is not None and name not in known]
    if unknown:
        raise ValueError(f"logical axes {unknown} have no rule in {[n for n, _ in rules]}")
    return nn.logical_to_mesh_axes(tuple(logical_axes), rules)


def param_specs(params, rules: Rules = DEFAULT_RULES):
    """PartitionSpecs, one per parameter, from the logical names of `nn.LogicallyPartitioned` boxes.

    `params` may hold arrays or ShapeDtypeStructs (e.g. from `jax.eval_shape(model.init, ...)`);
    the result has the structure of the unboxed tree. Unboxed leaves get `PartitionSpec()`.

    Raises:
      ValueError: naming the parameter path when one of its logical names has no rule.
    """
    logical = nn.get_partition_spec(params)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731

    def translate(path, spec):
        try:
            return logical_to_mesh_spec(tuple(spec), rules)
        except ValueError as err:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)}: {err}") from None

    return jax.tree_util.tree_map_with_path(translate, logical, is_leaf=is_spec)


def stacked_axes(params) -> Any:
    """For each parameter, how many of its leading logical axes are `LAYERS` (a model's stacked
    layers): SONew's ``stacked_axes``, from `nn.LogicallyPartitioned` boxes (as `param_specs`
    reads them); in the unboxed tree's structure, 0 for unboxed leaves."""
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731

    def leading(spec: PartitionSpec) -> int:
        names = tuple(spec)
        return next((i for i, name in enumerate(names) if name != LAYERS), len(names))

    return jax.tree.map(leading, nn.get_partition_spec(params), is_leaf=is_spec)


def validate_specs(shapes, specs, mesh: Mesh) -> None:
    """Checks that every sharded dimension divides evenly over its mesh axes.

    Args:
      shapes: pytree of arrays / ShapeDtypeStructs (boxed or not) with the structure of `specs`.
      specs: pytree of PartitionSpec, e.g. from `param_specs`.
      mesh: the mesh the specs refer to.

    Raises:
      ValueError: naming the parameter path, the dimension and its size, and the mesh axes and
        the product of their sizes; or naming a mesh axis the mesh does not have.
    """
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    flat_specs, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    flat_shapes = treedef.flatten_up_to(_strip_boxes(shapes))
    for (path, spec), leaf in zip(flat_specs, flat_shapes, strict=True):
        _validate_one(jax.tree_util.keystr(path), tuple(leaf.shape), spec, mesh)


def _strip_boxes(tree):
    """The values inside `nn.LogicallyPartitioned` boxes, without applying any constraint."""
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, tree, is_leaf=is_box
    )


def _validate_one(name: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    if len(spec) > len(shape):
        raise ValueError(f"parameter {name}: spec {spec} has more entries than shape {shape}")
    for dim, axes in enumerate(spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        missing = [a for a in axes if a not in mesh.shape]
        if missing:
            raise ValueError(
                f"parameter {name}: mesh axes {missing} not in mesh {dict(mesh.shape)}"
            )
        product = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % product:
            raise ValueError(
                f"parameter {name}: dimension {dim} of size {shape[dim]} is not "
                f"divisible by mesh axes {axes} of total size {product}"
            )


def shardings(specs, mesh: Mesh):
    """NamedShardings on `mesh` for a pytree of PartitionSpecs."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def batch_spec(rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """Spec of a [batch, length] input array: batch over the data axes, length per the rules."""
    return logical_to_mesh_spec(("batch", "length"), rules)


def data_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding of the global [batch, length] input arrays on `mesh`."""
    return NamedSharding(mesh, batch_spec(rules))


def check_batch_size(batch_size: int, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Raises `ConfigError` unless the global ``batch_size`` splits evenly over the mesh axes
    that shard the batch and over the processes (each reads its share), naming both."""
    axes = batch_spec(rules)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(mesh.shape[axis] for axis in axes)
    processes = jax.process_count()
    if batch_size < 1 or batch_size % shards or batch_size % processes:
        over = " x ".join(f"{axis}={mesh.shape[axis]}" for axis in axes) or "no axis"
        unit = math.lcm(shards, processes)
        near = sorted({max(unit, batch_size // unit * unit), -(-batch_size // unit) * unit})
        raise ConfigError(
            f"BATCH_SIZE (train.batch_size) = {batch_size} must be a positive multiple of the "
            f"{shards} batch shards ({over}) and of the {processes} process(es): "
            f"try {' or '.join(map(str, near))}."
        )


@contextlib.contextmanager
def axis_rules_context(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Makes `mesh` the current mesh and `rules` the logical axis rules (activation constraints
    in the model then take effect when it is traced under jit)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
