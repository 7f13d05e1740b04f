"""Where an optimizer update's device time goes: a profiler trace of the LM-set update, per kernel.

``update_speed`` gives one number per optimizer; this script says which kernels make it up.
For each ``--optimizers`` entry it runs the donated update of the LM-shaped set (``updates``,
``lm_shapes``) under ``jax.profiler.trace`` (Perfetto JSON), then reads the device's kernel
events back (``device_trace``) and reports, per step:

* ``wall_ms``: the host's time per step (as ``update_speed`` measures it);
* ``busy_ms``: the sum of kernel durations on the device, and ``kernels``: how many ran;
* ``span_ms``: the time at least one kernel ran (the union of their intervals): ``busy_ms``
  where kernels run one after another, less where they overlap (concurrent streams or command
  buffers: ``--concurrent``, the update compiled with ``kernels.CONCURRENT_OPTIONS``, or the
  process's ``XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT``);
* ``idle_ms`` = ``wall_ms - span_ms``: launch gaps and host overhead;
* ``families``: kernel time grouped by name with numeric suffixes dropped (``loop_add_fusion.12``
  -> ``loop_add_fusion``; the Pallas kernels are named ``sonew_band0_step``, ``sonew_band1_step``
  ...), largest first.

Output: a table per optimizer, and ``--out`` (default ``benchmarks/results/profile_update.json``)
``{"device", "date", "params", "config", "rows": [{"optimizer", "wall_ms", "busy_ms", "span_ms",
"idle_ms", "kernels", "families": [{"name", "ms", "count"}]}]}``, all per step. The trace
directories stay in ``--trace_dir`` for Perfetto / TensorBoard. Off GPU the trace has no device
lane, so ``busy_ms``, ``span_ms`` and ``kernels`` are 0 (the CPU smoke test checks the plumbing
only).

Usage: ``python -m benchmarks.profile_update --optimizers adamw,sonew_tridiag_pallas``.
"""

import argparse
import dataclasses
import tempfile
from pathlib import Path

import jax

from benchmarks import common, device_trace, lm_shapes, updates
from sonew_pax.optim.config import DEFAULT_EPS

COLUMNS = ("optimizer", "wall_ms", "busy_ms", "span_ms", "idle_ms", "kernels")
FAMILY_COLUMNS = ("name", "ms", "count")


def profile_optimizer(name: str, shapes, grads, args, directory: Path, config=None) -> dict:
    """Warms up, then traces ``args.iters`` donated update steps of optimizer ``name`` (SONew's
    kernels configured by ``config``, default ``common.kernel_config(args)``; the trace kept in
    ``directory``)."""
    config = config or common.kernel_config(args)
    tx = updates.make_optimizer(name, config)
    update, carry = updates.fresh_update(tx, shapes, common.jit_for(args))
    for _ in range(args.warmup):
        carry = jax.block_until_ready(update(*carry, grads))
    summary, _ = device_trace.trace_steps(lambda c: update(*c, grads), carry, args.iters, directory)
    return {"optimizer": name, **summary}


def _counts(text: str) -> list[int]:
    """``--scan_stacks``: a comma list of powers of 2."""
    try:
        counts = [int(k) for k in text.split(",") if k]
    except ValueError:
        counts = []
    if not counts or any(k < 1 or k & (k - 1) for k in counts):
        raise argparse.ArgumentTypeError(f"expected powers of 2, got {text!r}")
    return counts


def band1(config, tile: tuple[int, int, int] | None, stack: int | None = None):
    """``config`` with the band-1 scan's tile and walks per program (``scan_tile``,
    ``scan_stack``) where given."""
    changes = {"scan_tile": tile, "scan_stack": stack}
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if v})


def parse_args(argv=None) -> argparse.Namespace:
    p = common.argument_parser(__doc__)
    common.add_optimizers_arg(p, updates.OPTIMIZERS, "adamw,sonew_tridiag,sonew_tridiag_pallas")
    common.add_timing_args(p, warmup=3, iters=5)
    lm_shapes.add_args(p)
    p.add_argument(
        "--band1_tiles",
        type=common.parse_tiles,
        help="RxCxW,...: profile every optimizer once per band-1 scan tile (the scan's "
        "default set to it; rows named optimizer@RxCxW), to tune "
        "the tile on the whole update, where kernel_speed.py's one tensor stays partly in L2",
    )
    p.add_argument(
        "--scan_stacks",
        type=_counts,
        help="S,...: profile every optimizer once per number of walks the band-1 scan stacks in "
        "a program (KernelConfig.scan_stack; rows named optimizer@...:sS)",
    )
    common.add_kernel_arg(p)
    common.add_concurrent_arg(p)
    p.add_argument(
        "--grad_std",
        type=float,
        default=updates.GRAD_STD,
        help="standard deviation of the random gradient every step applies. sonew's default "
        f"damping (eps {DEFAULT_EPS:g} times each tensor's mean diagonal) keeps the repeated "
        "gradient's rank-one statistics regular whatever this scale: no band >= 2 window cuts "
        "the chain (nor did the demo LM's at step 300). An absolute eps far below the "
        "gradients' square makes every window singular and Algorithm 3 cut every edge: the "
        "banded kernel's slow path (solve.truncated_factor)",
    )
    p.add_argument("--top", type=int, default=8, help="kernel families printed per optimizer")
    p.add_argument("--trace_dir", type=Path, help="where the traces stay (default: a temp dir)")
    common.add_out_arg(p, "profile_update")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Profiles every optimizer, prints the tables, writes and returns the JSON object."""
    args = parse_args(argv)
    shapes = lm_shapes.from_args(args)
    grads = lm_shapes.random_tree(shapes, jax.random.key(0), std=args.grad_std)
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="profile_update_"))
    config = {k: getattr(args, k) for k in ("iters", "warmup", "grad_std")}
    result = common.lm_set_result(args, lm_shapes.count(shapes), **config)
    settings = [
        (tile, stack) for tile in args.band1_tiles or [None] for stack in args.scan_stacks or [None]
    ]
    for tile, stack in settings:
        suffix = ["x".join(map(str, tile))] if tile else []
        suffix += [f"s{stack}"] if stack else []
        for name in args.optimizers:
            label = f"{name}@{':'.join(suffix)}" if suffix else name
            config = band1(common.kernel_config(args), tile, stack)
            row = profile_optimizer(name, shapes, grads, args, trace_dir / label, config)
            row["optimizer"] = label
            result["rows"].append(row)
            print(
                f"\n{row['optimizer']}: {row['wall_ms']:.3f} ms per step, "
                f"{row['busy_ms']:.3f} ms in kernels"
            )
            print(common.format_table(row["families"][: args.top], FAMILY_COLUMNS))
            common.write_json(args.out, result)
    print(f"\n{result['device']}, per step ({args.iters} traced), traces in {trace_dir}\n")
    print(common.format_table(result["rows"], COLUMNS))
    return result


if __name__ == "__main__":
    main()
