"""Where an optimizer update's device time goes: a profiler trace of the LM-set update, per kernel.

``update_speed.py`` gives one number per optimizer; this script says which kernels make it up.
For each ``--optimizers`` entry it runs ``update_speed``'s donated update of the LM-shaped set
(``lm_shapes.py``) under ``jax.profiler.trace`` (Perfetto JSON), then reads the device's kernel
events back and reports, per step:

* ``wall_ms``: the host's time per step (as ``update_speed.py`` measures it);
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

Usage: ``python benchmarks/profile_update.py --optimizers adamw,sonew_tridiag_pallas``.
"""

import argparse
import dataclasses
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import kernel_speed
import lm_shapes
import update_speed

from sonew_pax.optim.sonew import DEFAULT_EPS

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "profile_update.json"
COLUMNS = ("optimizer", "wall_ms", "busy_ms", "span_ms", "idle_ms", "kernels")
FAMILY_COLUMNS = ("name", "ms", "count")


def device_events(trace: dict) -> list[dict]:
    """Every complete event on a device lane of a Perfetto trace.

    Device lanes are the processes named ``/device:...`` (``/device:GPU:0``); the host's are
    ``/host:...``. Events without a duration (instants, counters, metadata) are skipped.
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:")
    }
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]


def device_kernels(trace: dict) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of every :func:`device_events` event."""
    return [(e["name"], float(e["dur"])) for e in device_events(trace)]


def device_span(trace: dict) -> float:
    """Microseconds in which at least one :func:`device_events` event ran: the length of the
    union of their ``[ts, ts + dur]`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device_events(trace)
    ):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def family(name: str) -> str:
    """A kernel's name without XLA's numeric suffixes (``fusion.12`` -> ``fusion``)."""
    return re.sub(r"(\.\d+)+$", "", name)


def summarize(kernels: list[tuple[str, float]], steps: int) -> dict:
    """Per-step kernel time, count and families (largest first) of ``steps`` traced steps."""
    families: dict[str, list[float]] = {}
    for name, us in kernels:
        families.setdefault(family(name), []).append(us)
    rows = [
        {"name": k, "ms": sum(v) / 1e3 / steps, "count": len(v) / steps}
        for k, v in families.items()
    ]
    rows.sort(key=lambda r: -r["ms"])
    return {
        "busy_ms": sum(us for _, us in kernels) / 1e3 / steps,
        "kernels": len(kernels) / steps,
        "families": rows,
    }


def read_trace(directory: Path) -> dict:
    """The Perfetto trace ``jax.profiler.trace(..., create_perfetto_trace=True)`` wrote."""
    paths = sorted(directory.glob("**/perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    with gzip.open(paths[-1], "rt") as f:
        return json.load(f)


def trace_steps(step, carry, iters: int, directory: Path | None = None) -> tuple[dict, object]:
    """``iters`` blocking calls ``carry = step(carry)`` under the profiler (the trace kept in
    ``directory``; without one, in a temporary directory removed after reading): returns
    ``({"wall_ms", "idle_ms", "busy_ms", "span_ms", "kernels", "families"}, carry)``, all per
    step."""
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return trace_steps(step, carry, iters, Path(tmp))
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        start = time.perf_counter()
        for _ in range(iters):
            carry = jax.block_until_ready(step(carry))
        wall_ms = 1e3 * (time.perf_counter() - start) / iters
    trace = read_trace(directory)
    summary = summarize(device_kernels(trace), iters)
    summary["span_ms"] = device_span(trace) / 1e3 / iters
    return {"wall_ms": wall_ms, "idle_ms": wall_ms - summary["span_ms"], **summary}, carry


def profile_optimizer(name: str, shapes, grads, args, directory: Path, config=None) -> dict:
    """Warms up, then traces ``args.iters`` donated update steps of optimizer ``name`` (SONew's
    kernels configured by ``config``, default ``common.kernel_config(args)``; the trace kept in
    ``directory``)."""
    config = config or common.kernel_config(args)
    tx = update_speed.make_optimizer(name, config)
    update, carry = update_speed.fresh_update(tx, shapes, common.jit_for(args))
    for _ in range(args.warmup):
        carry = jax.block_until_ready(update(*carry, grads))
    summary, _ = trace_steps(lambda c: update(*c, grads), carry, args.iters, directory)
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_optimizers_arg(
        p, update_speed.OPTIMIZERS, "adamw,sonew_tridiag,sonew_tridiag_pallas"
    )
    common.add_timing_args(p, warmup=3, iters=5)
    lm_shapes.add_args(p)
    p.add_argument(
        "--band1_tiles",
        type=kernel_speed.parse_tiles,
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
        default=update_speed.GRAD_STD,
        help="standard deviation of the random gradient every step applies. At the default, "
        f"sonew's eps ({DEFAULT_EPS:g}) keeps the repeated gradient's rank-one statistics "
        "regular: no band >= 2 window cuts the chain (nor did the demo LM's at step 300). At 1 "
        "every window is singular and Algorithm 3 cuts every edge: the banded kernel's slow path "
        "(solve.truncated_factor)",
    )
    p.add_argument("--top", type=int, default=8, help="kernel families printed per optimizer")
    p.add_argument("--trace_dir", type=Path, help="where the traces stay (default: a temp dir)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
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
