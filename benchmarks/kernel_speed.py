"""The SONew GPU kernels (``sonew_pax/optim/kernels``) on their own, and what XLA makes around it.

Two parts, to find where an update's time goes:

* **one tensor** (``--shape``, default 4096 x 4096 float32): the achieved bandwidth of a plain copy,
  of the whole jitted update (``updates.make_update``: ``optim.apply_gradients``, params
  and state donated) for AdamW and the SONew variants of ``updates``, and of the kernel
  alone (``kernels.leaf_update``) for several ``(rows, cols, num_warps)`` tiles (``--tiles``
  for band 0's kernel, ``--scan_tiles`` for band 1's scan kernel, whose columns must cover its
  lanes). ``gbps`` counts the bytes each one
  must move (kernel alone: read g, m, d (, e), write u, m, d (, e)).
* **HLO** of the update of the ~335M LM-shaped set (``lm_shapes.py``): how many kernels the
  compiled program launches per optimizer (fusions, custom calls such as the Pallas kernel, and
  copies), since each launch costs a few microseconds and a copy costs a pass over memory.

Output: the tables, and ``--out`` (default ``benchmarks/results/kernel_speed.json``)
``{"device", "date", "shape", "rows": [{"name", "ms", "gbps", "bytes"}], "hlo": [{"optimizer",
"fusions", "custom_calls", "copies", "kernels"}]}``.

Usage: ``python -m benchmarks.kernel_speed [--shape 4096,4096] [--iters 30]``.
"""

import argparse
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from benchmarks import common, lm_shapes, update_speed, updates
from sonew_pax.optim import SONewConfig, kernels

# (rows, cols, num_warps) of a program's tile, as ``--tiles`` and ``--scan_tiles`` spell them
TILES = "16x64x4,16x64x8,8x64x4,8x128x4,8x128x8,16x128x8,32x64x8,32x32x4,16x32x2"
SCAN_TILES = "64x64x2,32x64x2,64x128x4,128x32x2,32x128x2"
UPDATES = "adamw,sonew_diag,sonew_diag_pallas,sonew_tridiag,sonew_tridiag_pallas"


def time_kernel(band: int, setting: tuple, shape, args) -> tuple[float, int]:
    """(median ms, bytes) of ``kernels.leaf_update`` alone on one random tensor of ``shape``."""
    key = jax.random.key(0)
    g = 1e-3 * jax.random.normal(key, shape)
    m, d = jnp.zeros(shape), jnp.full(shape, 1e-6)
    e = jnp.zeros((1, *shape)) if band else optax.MaskedNode()
    hyper = SONewConfig(
        b1=0.9, b2=0.95, eps=1e-8, gamma=1e-4, precondition_1d=True, damping="absolute"
    )
    corrections = (jnp.float32(0.1), jnp.float32(0.05))

    interpret = jax.default_backend() != "gpu"

    def step(state):
        m, d, e = state
        _, m, d, e, _ = kernels.leaf_update(
            g, m, d, e, corrections, hyper, interpret=interpret, tile=setting
        )
        return m, d, e

    step = jax.jit(step, donate_argnums=0)
    median, _, _ = common.time_steps(step, (m, d, e), args.warmup, args.iters)
    arrays = 4 if band else 3
    return median, 2 * arrays * 4 * g.size


def time_update(name: str, shape, args) -> tuple[float, int]:
    """(median ms, floor bytes) of ``update_speed``'s donated update on one tensor."""
    shapes = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
    grads = lm_shapes.random_tree(shapes, jax.random.key(0), std=1e-3)
    timing = update_speed.time_optimizer(updates.make_optimizer(name), shapes, grads, args)
    return timing.ms, timing.bytes


def hlo_counts(name: str, shapes, hlo_dir: Path | None) -> dict:
    """Kernel launches in the compiled update of ``shapes`` for optimizer ``name``; the compiled
    HLO is written to ``hlo_dir/<name>.txt`` when given."""
    tx = updates.make_optimizer(name)
    state = jax.eval_shape(tx.init, shapes)
    text = updates.make_update(tx).lower(shapes, state, shapes).compile().as_text()
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{name}.txt").write_text(text)
    counts = common.launch_counts(text)
    return {"optimizer": name, **counts}


def parse_args(argv=None) -> argparse.Namespace:
    p = common.argument_parser(__doc__)
    p.add_argument("--shape", default="4096,4096", help="the single tensor's shape")
    common.add_timing_args(p, warmup=3, iters=30)
    p.add_argument(
        "--tiles",
        type=common.parse_tiles,
        default=TILES,
        help="band 0's tiles, rows x cols x warps (powers of 2), comma-separated",
    )
    p.add_argument(
        "--scan_tiles",
        type=common.parse_tiles,
        default=SCAN_TILES,
        help="band 1's scan kernel tiles, as --tiles; cols >= 32 x warps",
    )
    p.add_argument("--updates", default=UPDATES, help="whole updates to time (updates.OPTIMIZERS)")
    p.add_argument("--no_hlo", action="store_true", help="skip the LM-set HLO counts")
    p.add_argument("--hlo_dir", type=Path, help="also write each compiled LM-set update's HLO here")
    lm_shapes.add_args(p)
    common.add_out_arg(p, "kernel_speed")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Runs both parts, prints the tables, writes and returns the JSON object."""
    args = parse_args(argv)
    shape = tuple(int(n) for n in args.shape.split(","))
    size = math.prod(shape)
    rows = []

    def add(name, ms, moved):
        rows.append({"name": name, "ms": ms, "gbps": moved / ms / 1e6, "bytes": moved})
        print(f"{name}: {ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s", flush=True)

    copy_bytes = 8 * size
    add("copy", update_speed.time_copy(copy_bytes, args)[0], copy_bytes)
    updates = args.updates.split(",")
    for name in updates:
        add(f"update {name}", *time_update(name, shape, args))
    for band, tiles in ((0, args.tiles), (1, args.scan_tiles)):
        for setting in tiles:
            label = "tile {}x{} warps {}".format(*setting)
            add(f"kernel band{band} {label}", *time_kernel(band, setting, shape, args))
    hlo = []
    if not args.no_hlo:
        shapes = lm_shapes.from_args(args)
        hlo = [hlo_counts(name, shapes, args.hlo_dir) for name in updates]
    result = {
        "device": common.device_name(),
        "date": common.utc_date(),
        "shape": list(shape),
        "rows": rows,
        "hlo": hlo,
    }
    print(f"\n{result['device']}, one tensor {shape}\n")
    print(common.format_table(rows, ("name", "ms", "gbps")))
    if hlo:
        print("\nLM set, kernels in the compiled update:\n")
        print(
            common.format_table(hlo, ("optimizer", "fusions", "custom_calls", "copies", "kernels"))
        )
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
