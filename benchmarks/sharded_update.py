"""Sharded SONew update on N devices against the one-device update: same numbers, time per step.

The ~335M LM-shaped parameters of `lm_shapes` (``--scale`` shrinks them) are updated by
``sonew(..., mesh=mesh, param_specs=specs)`` under ``jax.jit`` with the parameters, gradients and
state sharded by ``specs`` (state specs from `sonew_pax.optim.state_partition_specs`) and params and
state donated. Variants:

- ``model``: mesh ``data=1 x model=N``, Megatron specs (attention q/k/v and MLP-in split by
  column, attention-out and MLP-out by row, embedding by vocabulary row, norms replicated);
- ``data_model``: mesh ``data=D x model=N/D`` (``--data``), each matrix's other dimension also
  split over ``data`` (2-D).

For each band the one-device update (device 0, no mesh) and each sharded variant start from the
same parameters and state; after ``--check_steps`` steps every parameter and state array is
compared (``max_rel_diff`` = max over arrays of max|sharded - single| / max|single|). Then both are
timed (``--warmup`` untimed steps, median of ``--iters`` wall times), then ``--profile_steps`` are
traced (kept in ``--trace_dir``): a step's device time is the busiest device's kernel time (a
sharded step waits for its slowest shard), and ``device_speedup`` compares those. Scaling
efficiency = t1 / (N * tN) on wall times: 1 is ideal N-fold scaling. The compiled sharded
update's collectives and kernel launches (``common.launch_counts``) are counted from its HLO text,
the collective-permutes against ``permute_bound`` (what the exchange design allows).

Output: a table, and ``--out`` (default ``benchmarks/results/sharded_update.json``)
``{"device", "date", "params", "devices", "config", "rows": [{"band", "variant", "mesh", "specs",
"ms_1dev", "ms_sharded", "speedup", "scaling_efficiency", "max_rel_diff", "equal",
"collectives", "permute_bound", "device_ms_1dev", "device_ms_sharded", "device_speedup",
"devices_ms_sharded", "families_1dev", "families_sharded"}]}`` (the device columns with
``--profile_steps``).

Usage: ``python -m benchmarks.sharded_update [--devices 2] [--bands 1] [--scale 1]``. On CPU,
simulate devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import argparse
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import common, device_trace, lm_shapes, updates
from sonew_pax import optim

VARIANTS = ("model", "data_model")
COLUMNS = (
    "band",
    "variant",
    "mesh",
    "ms_1dev",
    "ms_sharded",
    "speedup",
    "device_ms_1dev",
    "device_ms_sharded",
    "device_speedup",
    "scaling_efficiency",
    "max_rel_diff",
    "equal",
)
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def make_sonew(band: int, mesh: Mesh | None = None, specs=None):
    """The SONew optimizer of this benchmark (sharded when ``mesh`` and ``specs`` are given).

    The one-device reference runs the kernels on a GPU, as a one-GPU process does by default: in
    a process of several devices the default (``"auto"``) keeps an update without ``mesh`` on
    XLA, since the caller's ``jit`` might shard its arrays, and the reference would be slower
    than one GPU's update.
    """
    implementation = "pallas" if mesh is None and jax.default_backend() == "gpu" else "auto"
    return optim.sonew(
        updates.LEARNING_RATE,
        band=band,
        weight_decay=updates.WEIGHT_DECAY,
        mesh=mesh,
        param_specs=specs,
        implementation=implementation,
    )


def make_mesh(devices: list, data: int) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` with ``data`` rows."""
    return Mesh(np.asarray(devices).reshape(data, len(devices) // data), ("data", "model"))


def named(mesh: Mesh, specs):
    """A tree of PartitionSpecs -> the same tree of NamedShardings on ``mesh``."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def copy_tree(tree):
    """A fresh copy of every array (so that donating one copy leaves the other intact)."""
    return jax.tree.map(jnp.copy, tree)


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many instructions of each collective kind the compiled HLO holds."""
    return {name: len(re.findall(rf"\s{name}(-start)?\(", hlo_text)) for name in COLLECTIVES}


def permute_bound(specs, band: int) -> int:
    """The most collective-permutes a sharded update holds (2-D tensors, shards at least as
    thick as the band's halo, ``chain.halo_width``): ``4 K``, with ``K`` the distinct pairs
    (mesh axes splitting a dimension of a matrix, mesh axes that matrix is split over); 0 for
    band 0, which reads no neighbour.

    Bands >= 1 move only the tree's edges (``chain.edges_of``): each block's rows before and
    after it (two directions), along the axes splitting axis 0, after the wrap into the next
    column along those splitting the others (at most two rounds). Arrays going the same way and
    varying over the same mesh axes travel in one message (``chain.exchange``): the bound counts
    neither the tensors nor the band. Thinner shards take more hops, more dimensions more rounds.
    """
    if band == 0:
        return 0
    pairs = set()
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
        splits = [e if isinstance(e, tuple) else (e,) for e in spec if e is not None]
        varying = frozenset(axis for split in splits for axis in split)
        pairs |= {(split, varying) for split in splits}
    return 4 * len(pairs)


def max_rel_diff(sharded, single) -> float:
    """Max over arrays of max|sharded - single| / max|single| (single moved to the sharding)."""
    single = jax.device_put(single, jax.tree.map(lambda a: a.sharding, sharded))

    @jax.jit
    def per_array(a_tree, b_tree):
        def one(a, b):
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            scale = jnp.max(jnp.abs(b))
            return jnp.max(jnp.abs(a - b)) / jnp.where(scale > 0, scale, 1.0)

        return jax.tree.map(one, a_tree, b_tree)

    return max((float(x) for x in jax.tree.leaves(per_array(sharded, single))), default=0.0)


def run_steps(update, carry, grads, steps: int):
    """``steps`` donated updates from ``carry = (params, state)``."""
    for _ in range(steps):
        carry = update(*carry, grads)
    return jax.block_until_ready(carry)


def device_time(step, carry, args, label: str) -> dict:
    """The busiest device's kernel time per step over ``--profile_steps`` traced steps, and all
    its kernel families, largest first (``{}`` without ``--profile_steps``; ``device_ms`` 0 off
    GPU). The trace stays in ``--trace_dir``/``label`` when given."""
    if not args.profile_steps:
        return {}
    directory = args.trace_dir / label if args.trace_dir else None
    summary, _ = device_trace.trace_steps(step, carry, args.profile_steps, directory)
    busiest = summary["devices"][0] if summary["devices"] else {"busy_ms": 0.0, "families": []}
    return {
        "device_ms": busiest["busy_ms"],
        "devices_ms": [d["busy_ms"] for d in summary["devices"]],
        "families": busiest["families"],
    }


def single_device(band: int, shapes, args) -> tuple[tuple, float, dict]:
    """The unsharded reference: (params, state) after ``check_steps``, its median ms and
    `device_time`."""
    grads = lm_shapes.random_tree(shapes, jax.random.key(0), std=1e-3)
    update, carry = updates.fresh_update(make_sonew(band), shapes)
    reference = run_steps(update, carry, grads, args.check_steps)
    median, _, carry = common.time_steps(
        lambda c: update(*c, grads), copy_tree(reference), args.warmup, args.iters
    )
    profile = device_time(lambda c: update(*c, grads), carry, args, f"band{band}_1dev")
    return reference, median, profile


def sharded(band: int, shapes, mesh: Mesh, specs, args) -> tuple[tuple, float, dict, dict]:
    """The sharded update: (params, state) after ``check_steps``, median ms, collective counts
    and `device_time`."""
    tx = make_sonew(band, mesh, specs)
    param_sh = named(mesh, specs)
    state_sh = named(mesh, optim.state_partition_specs(jax.eval_shape(tx.init, shapes), specs))
    params = jax.device_put(lm_shapes.random_tree(shapes, jax.random.key(1)), param_sh)
    grads = jax.device_put(lm_shapes.random_tree(shapes, jax.random.key(0), std=1e-3), param_sh)
    state = jax.jit(tx.init, out_shardings=state_sh)(params)
    update = updates.make_update(
        tx, in_shardings=(param_sh, state_sh, param_sh), out_shardings=(param_sh, state_sh)
    )
    compiled = update.lower(params, state, grads).compile()
    after = run_steps(compiled, (params, state), grads, args.check_steps)
    median, _, carry = common.time_steps(
        lambda c: compiled(*c, grads), copy_tree(after), args.warmup, args.iters
    )
    name = "x".join(f"{k}{v}" for k, v in mesh.shape.items())
    profile = device_time(lambda c: compiled(*c, grads), carry, args, f"band{band}_{name}")
    text = compiled.as_text()
    return after, median, {**count_collectives(text), **common.launch_counts(text)}, profile


def variant_mesh(variant: str, devices: list, data: int) -> tuple[Mesh, str]:
    """The mesh of a variant and a name for it."""
    rows = 1 if variant == "model" else data
    if len(devices) % rows:
        raise SystemExit(f"--data {data} does not divide the {len(devices)} devices")
    mesh = make_mesh(devices, rows)
    return mesh, f"data={mesh.shape['data']} x model={mesh.shape['model']}"


def bench_band(band: int, shapes, devices: list, args) -> list[dict]:
    """Rows (one per variant) for one band."""
    reference, ms_1dev, profile_1dev = single_device(band, shapes, args)
    print(f"band {band}: 1 device {ms_1dev:.3f} ms {_device_note(profile_1dev)}", flush=True)
    return bench_variants(band, shapes, devices, args, reference, ms_1dev, profile_1dev)


def _device_note(profile: dict) -> str:
    """``(device ... ms)`` of a `device_time` result, or nothing without one."""
    return f"(device {profile['device_ms']:.3f} ms)" if profile else ""


def bench_variants(
    band: int, shapes, devices: list, args, reference, ms_1dev: float, profile_1dev: dict
) -> list[dict]:
    """Rows (one per variant in ``args.variants``) against a `single_device` result."""
    rows = []
    for variant in args.variants.split(","):
        mesh, mesh_name = variant_mesh(variant, devices, args.data)
        data_axis = "data" if variant == "data_model" else None
        specs = lm_shapes.megatron_specs(shapes, "model", data_axis)
        after, ms, collectives, profile = sharded(band, shapes, mesh, specs, args)
        diff = max_rel_diff(after, reference)
        del after
        rows.append(
            {
                "band": band,
                "variant": variant,
                "mesh": mesh_name,
                "specs": "megatron" if data_axis is None else "megatron x data (2-D)",
                "ms_1dev": ms_1dev,
                "ms_sharded": ms,
                "speedup": ms_1dev / ms,
                "scaling_efficiency": ms_1dev / (len(devices) * ms),
                "max_rel_diff": diff,
                "equal": diff <= args.tol,
                "collectives": collectives,
                "permute_bound": permute_bound(specs, band),
                **_device_columns(profile_1dev, profile),
            }
        )
        print(
            f"band {band} {variant} ({mesh_name}): {ms:.3f} ms {_device_note(profile)}, "
            f"rel diff {diff:.2e}",
            flush=True,
        )
    return rows


def _device_columns(profile_1dev: dict, profile: dict) -> dict:
    """A row's device-time columns: the busiest device's kernel ms, one device's and sharded,
    their ratio, each device's ms and the largest kernel families of both."""
    if not profile:
        return {}
    ms_1dev, ms = profile_1dev["device_ms"], profile["device_ms"]
    return {
        "device_ms_1dev": ms_1dev,
        "device_ms_sharded": ms,
        "device_speedup": ms_1dev / ms if ms else float("nan"),
        "devices_ms_sharded": profile["devices_ms"],
        "families_1dev": profile_1dev["families"],
        "families_sharded": profile["families"],
    }


def add_variant_args(parser: argparse.ArgumentParser) -> None:
    """The flags of what is compared (``parser`` may be an argument group): ``--data``,
    ``--bands``, ``--variants``, ``--check_steps`` and ``--tol``."""
    parser.add_argument(
        "--data", type=int, default=2, help="data-axis size of the data_model variant"
    )
    parser.add_argument("--bands", default="1", help="comma-separated SONew bands, e.g. 0,1,4")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="model and/or data_model")
    parser.add_argument("--check_steps", type=int, default=3, help="steps before the comparison")
    parser.add_argument("--tol", type=float, default=1e-5, help="max_rel_diff counted as equal")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    lm_shapes.add_args(p)
    p.add_argument("--devices", type=int, default=0, help="devices to shard over (0: all)")
    add_variant_args(p)
    common.add_timing_args(p, warmup=3, iters=30)
    p.add_argument(
        "--profile_steps",
        type=int,
        default=5,
        help="steps traced for the device-time columns (0: wall time only)",
    )
    p.add_argument("--trace_dir", type=Path, help="keep the traces here (default: not kept)")
    common.add_out_arg(p, "sharded_update")
    return p.parse_args(argv)


def build_result(rows: list[dict], shapes, devices: list, args: argparse.Namespace) -> dict:
    """The JSON object for the rows measured so far."""
    return {
        "device": common.device_name(),
        "date": common.utc_date(),
        "params": lm_shapes.count(shapes),
        "devices": len(devices),
        "config": {
            "scale": args.scale,
            "layers": args.layers,
            "check_steps": args.check_steps,
            "warmup": args.warmup,
            "iters": args.iters,
            "tol": args.tol,
            "profile_steps": args.profile_steps,
            "jax": jax.__version__,
        },
        "rows": rows,
    }


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object.

    The JSON is rewritten after every band, so a run cut short keeps what it measured.
    """
    args = parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    devices = jax.devices()[: args.devices or None]
    shapes = lm_shapes.from_args(args)
    rows = []
    for band in (int(b) for b in args.bands.split(",")):
        rows += bench_band(band, shapes, devices, args)
        result = build_result(rows, shapes, devices, args)
        common.write_json(args.out, result)
    print(
        f"\n{result['device']} x {len(devices)}, {result['params'] / 1e6:.1f}M parameters, "
        f"median of {args.iters} steps\n"
    )
    print(common.format_table(rows, COLUMNS))
    return result


if __name__ == "__main__":
    main()
