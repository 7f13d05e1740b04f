"""The LM-shaped tensor set that the optimizer-speed benchmarks update, and its sharding specs.

At ``scale=1`` it is about 335M parameters in the shapes of a 24-layer, 1024-wide decoder: per layer
four (1024, 1024) attention projections, a (1024, 4096) and a (4096, 1024) MLP kernel and two
(1024,) norm scales, plus a (32000, 1024) token embedding and a final norm. ``scale`` shrinks every
width (multiples of 8 are kept, so the tensors still split over up to 8 shards) and ``layers`` the
depth, for CPU smoke runs. ``stacked`` gives each per-layer tensor once, stacked over the layers
on a leading axis (``STACKED``), as a model with ``scan_layers`` holds them; ``stacked_axes`` says
so to SONew.

Specs: ``megatron_specs`` shards over ``model`` the usual tensor-parallel way: the attention input
projections and the MLP's first kernel by output column, the attention output and the MLP's
second kernel by input row, the embedding by vocabulary row, norms replicated. With a ``data``
axis the other dimension of each matrix is also split over ``data`` (2-D, FSDP-like).
"""

import argparse
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# Per layer: (name, shape kind); "d" is the model width, "f" the MLP width.
_LAYER = (
    ("query", ("d", "d"), "column"),
    ("key", ("d", "d"), "column"),
    ("value", ("d", "d"), "column"),
    ("out", ("d", "d"), "row"),
    ("mlp_in", ("d", "f"), "column"),
    ("mlp_out", ("f", "d"), "row"),
    ("attn_norm", ("d",), "vector"),
    ("mlp_norm", ("d",), "vector"),
)


def _width(size: int, scale: float) -> int:
    """``size * scale`` rounded to a multiple of 8 (at least 8)."""
    return max(8, 8 * round(size * scale / 8))


# The key of the stacked layers' tensors (``lm_shapes(stacked=True)``).
STACKED = "layers"


def lm_shapes(
    scale: float = 1.0,
    layers: int = 24,
    d_model: int = 1024,
    mlp_dim: int = 4096,
    vocab: int = 32000,
    dtype=jnp.float32,
    stacked: bool = False,
) -> dict:
    """A nested dict of ``jax.ShapeDtypeStruct``: the LM-shaped parameter set (module docstring)."""
    sizes = {"d": _width(d_model, scale), "f": _width(mlp_dim, scale)}
    tree = {"embedding": jax.ShapeDtypeStruct((_width(vocab, scale), sizes["d"]), dtype)}
    lead = (layers,) if stacked else ()
    for i in range(1 if stacked else layers):
        tree[STACKED if stacked else f"layer_{i:02d}"] = {
            name: jax.ShapeDtypeStruct(lead + tuple(sizes[k] for k in kinds), dtype)
            for name, kinds, _ in _LAYER
        }
    tree["final_norm"] = jax.ShapeDtypeStruct((sizes["d"],), dtype)
    return tree


def stacked_axes(tree) -> dict:
    """SONew's ``stacked_axes`` of a set from :func:`lm_shapes`: 1 for the stacked layers."""
    return {key: int(key == STACKED) for key in tree}


def count(tree) -> int:
    """Number of scalars in a tree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _roles() -> dict[str, str]:
    return {name: role for name, _, role in _LAYER}


def megatron_specs(tree, model: str = "model", data: str | None = None) -> dict:
    """PartitionSpecs for ``lm_shapes`` trees (module docstring); ``data`` adds the 2-D split."""
    by_role = {
        "column": P(data, model),
        "row": P(model, data),
        "vector": P(),
    }
    roles = _roles()
    specs = {"embedding": P(model, data), "final_norm": P()}
    for key, sub in tree.items():
        if isinstance(sub, dict):
            specs[key] = {name: by_role[roles[name]] for name in sub}
    return specs


def random_tree(tree, key: jax.Array, std: float = 1.0, device=None) -> dict:
    """Normal(0, std) arrays of the tree's shapes and dtypes on ``device`` (default: the first).

    One small jitted sampler per distinct (shape, dtype), reused across leaves: a single program
    drawing all ~300M values at once takes minutes to compile on GPU.
    """
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0] if device is None else device)
    leaves, treedef = jax.tree.flatten(tree)
    samplers: dict = {}

    def sample(i: int, leaf) -> jax.Array:
        sig = (tuple(leaf.shape), jnp.dtype(leaf.dtype))
        if sig not in samplers:
            samplers[sig] = jax.jit(
                lambda k, s=sig: (std * jax.random.normal(k, s[0], jnp.float32)).astype(s[1]),
                out_shardings=sharding,
            )
        return samplers[sig](jax.random.fold_in(key, i))

    return jax.tree.unflatten(treedef, [sample(i, leaf) for i, leaf in enumerate(leaves)])


def add_args(parser: argparse.ArgumentParser, stack_layers: bool = False) -> None:
    """Adds ``--scale`` and ``--layers`` (the tensor set's size) to a benchmark's parser, and
    ``--stack_layers`` where the benchmark gives SONew the set's :func:`stacked_axes`."""
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="width multiplier of the LM-shaped tensors (1: ~335M parameters)",
    )
    parser.add_argument("--layers", type=int, default=24, help="number of layers")
    if not stack_layers:
        return
    parser.add_argument(
        "--stack_layers",
        action="store_true",
        help="each layer tensor once, stacked over the layers (as nn.scan holds them); SONew "
        "takes them with stacked_axes",
    )


def from_args(args: argparse.Namespace) -> dict:
    """``lm_shapes`` for the parsed ``--scale``, ``--layers`` and ``--stack_layers``."""
    stacked = getattr(args, "stack_layers", False)
    return lm_shapes(scale=args.scale, layers=args.layers, stacked=stacked)
