"""Speed of one optimizer update on ~335M LM-shaped parameters: SONew against optax.adamw.

``--stack_layers`` updates the same set with each layer tensor stacked over the layers (as a model
with ``scan_layers`` holds them), SONew told so (``stacked_axes``).

What is timed: ``params, state = update(params, state, grads)`` where ``update`` is
``optim.apply_gradients(tx, grads, state, params)`` in one jitted function whose params and
optimizer state are donated (updated in place): for AdamW and most SONew rows
``optax.apply_updates(params, tx.update(grads, state, params))``; in the ``*_lag_pallas`` rows
SONew's kernels write the parameters themselves (the fused apply: with ``graft_lag`` the graft
ratio is known before the step). After ``--warmup`` untimed steps, each of
``--iters`` steps is timed to ``block_until_ready``; the median is reported. Then ``--iters``
steps run back to back, waited on once (``pipelined_ms``, their mean): the host dispatches each
while the device still works on the last, as in a training loop. ``dispatch_ms`` is the median time
the host spends in one call before it returns (``common.time_dispatch``): where it exceeds the
device's time, the pipelined loop waits on the host.

The update is memory-bound, so each optimizer's floor is the bytes it must move through device
memory: read g, p and every state array, write p and every state array (fp32: AdamW 28 B/param,
diag-SONew 28, tridiag 36, band-b 28 + 8b; bf16 momentum and off-diagonals bring tridiag to 28).
``copy`` is ``x -> x * s`` (``s`` = 1 at run time, so nothing folds away) over AdamW's byte count:
its bandwidth is the practical ceiling, and ``floor_ratio`` = time / (floor bytes / copy bandwidth).

Time to ``block_until_ready`` includes the host's dispatch of the update (arguments, launches),
the same few milliseconds for every optimizer of this set. ``--profile_steps N`` also traces N
steps per optimizer with ``jax.profiler`` and reports the device's kernel time per step
(``busy_ms``, ``profile_update``'s measure) and its ratio to AdamW's: the update's cost on the
device, which in a training loop the next step's dispatch overlaps; and ``span_ms``, the time at
least one kernel ran, which is ``busy_ms`` when the kernels run one at a time and less where they
overlap (``--concurrent``: every row's update compiled with ``kernels.CONCURRENT_OPTIONS``; the
JSON's config records it).

Each update is compiled ahead of the timing (``compile_update``): ``compile_s`` (its part of a
first step; ``compile_ratio_vs_adamw``), its launches (``fusions``, ``custom_calls``, ``copies``,
``kernels``: ``common.launch_counts``) and ``temp_bytes_per_param``, XLA's temporaries per
parameter (what one pass writes for a later one to read, such as the XLA path's ``u``).

Output: a table, and ``--out`` (default ``benchmarks/results/update_speed.json``)
``{"device", "date", "params", "config", "rows": [{"optimizer", "ms", "ratio_vs_adamw", "gbps",
"floor_ratio", "bytes_per_param", "ms_min", "pipelined_ms", "pipelined_ratio_vs_adamw",
"dispatch_ms", "busy_ms", "busy_ratio_vs_adamw", "span_ms", "span_ratio_vs_adamw", "compile_s",
"compile_ratio_vs_adamw", "fusions", "custom_calls", "copies", "kernels",
"temp_bytes_per_param"}]}`` (the
pipelined pair and ``dispatch_ms`` null for ``copy``, the busy and span pairs also without
``--profile_steps``).

SONew rows use the XLA implementation (``implementation="xla"``); each ``*_pallas`` row is the
same optimizer with the Pallas kernels of ``sonew_pax/optim/kernels`` (``sonew``'s default on GPU,
``"auto"``). ``*_lag`` rows scale by the previous step's graft ratio (``graft_lag=True``).

Usage: ``python -m benchmarks.update_speed [--scale 1] [--layers 24] [--iters 50]``.
"""

import argparse
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from benchmarks import common, device_trace, lm_shapes, updates

COLUMNS = (
    "optimizer",
    "ms",
    "ms_min",
    "ratio_vs_adamw",
    "gbps",
    "bytes_per_param",
    "floor_ratio",
    "pipelined_ms",
    "pipelined_ratio_vs_adamw",
    "dispatch_ms",
    "busy_ms",
    "busy_ratio_vs_adamw",
    "span_ms",
    "span_ratio_vs_adamw",
    "compile_s",
    "compile_ratio_vs_adamw",
    "kernels",
    "copies",
    "temp_bytes_per_param",
)


def nbytes(tree) -> int:
    """Bytes held by the arrays (or ShapeDtypeStructs) of a tree."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def floor_bytes(params_shape, state_shape) -> int:
    """Fewest bytes one update moves: read g, p, state; write p, state."""
    return 3 * nbytes(params_shape) + 2 * nbytes(state_shape)


class Timing(NamedTuple):
    """One optimizer's update: median and fastest ms to ``block_until_ready``, the floor bytes,
    the mean ms of steps dispatched back to back (``common.time_pipelined``; None for the copy),
    the host's ms per call (``common.time_dispatch``; None for the copy) and the device's kernel
    ms and span per step (None unless profiled)."""

    ms: float
    ms_min: float
    bytes: int
    pipelined_ms: float | None = None
    dispatch_ms: float | None = None
    busy_ms: float | None = None
    span_ms: float | None = None
    program: dict | None = None


def compile_update(update, carry, grads) -> tuple[Callable, dict]:
    """``update`` compiled for ``(*carry, grads)`` and what its program asks: ``compile_s``
    (lowering and compiling, the update's part of a first step), its launches
    (``common.launch_counts``: fusions, custom calls, copies) and ``temp_bytes`` (XLA's
    temporaries beyond the donated inputs and the outputs: the arrays a pass writes for a later
    one to read)."""
    start = time.perf_counter()
    compiled = update.lower(*carry, grads).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    program = {"compile_s": seconds, **common.launch_counts(compiled.as_text()), "temp_bytes": temp}
    return compiled, program


def time_optimizer(tx, shapes, grads, args, profile_steps: int = 0) -> Timing:
    """Times ``tx``'s donated update on fresh random parameters; then, with ``profile_steps``,
    traces that many more steps for the device's kernel time and span."""
    moved = floor_bytes(shapes, jax.eval_shape(tx.init, shapes))
    update, carry = updates.fresh_update(tx, shapes, common.jit_for(args))
    update, program = compile_update(update, carry, grads)

    def step(c):
        return update(*c, grads)

    median, times, carry = common.time_steps(step, carry, args.warmup, args.iters)
    pipelined, carry = common.time_pipelined(step, carry, args.iters)
    dispatch, carry = common.time_dispatch(step, carry, args.iters)
    busy = span = None
    if profile_steps:
        summary = device_trace.trace_steps(step, carry, profile_steps)[0]
        busy, span = summary["busy_ms"], summary["span_ms"]
    return Timing(median, min(times), moved, pipelined, dispatch, busy, span, program)


def time_copy(total_bytes: int, args, chunk: int = 1 << 26) -> tuple[float, float]:
    """(median ms, min ms) of ``x -> x * s`` in place over fp32 buffers moving ``total_bytes``."""
    elements = total_bytes // 8  # 4 bytes read + 4 written per element
    sizes = [chunk] * (elements // chunk) + ([elements % chunk] if elements % chunk else [])
    key = jax.random.key(2)
    buffers = [jax.random.normal(jax.random.fold_in(key, i), (n,)) for i, n in enumerate(sizes)]
    scale = jnp.float32(1.0)
    copy = jax.jit(lambda xs, s: [x * s for x in xs], donate_argnums=0)
    median, times, _ = common.time_steps(
        lambda xs: copy(xs, scale), buffers, args.warmup, args.iters
    )
    return median, min(times)


def make_row(name: str, timing: Timing, n: int) -> dict:
    """One table row before the ratios (filled in by `add_ratios`)."""
    return {
        "optimizer": name,
        "ms": timing.ms,
        "ms_min": timing.ms_min,
        "gbps": timing.bytes / timing.ms / 1e6,
        "bytes_per_param": timing.bytes / n,
        "pipelined_ms": timing.pipelined_ms,
        "dispatch_ms": timing.dispatch_ms,
        "busy_ms": timing.busy_ms,
        "span_ms": timing.span_ms,
        **program_columns(timing.program, n),
        "_bytes": timing.bytes,
    }


def program_columns(program: dict | None, n: int) -> dict:
    """A row's compiled-program columns (:func:`compile_update`; none for the copy), the
    temporaries per parameter."""
    if program is None:
        return {}
    temp = program["temp_bytes"]
    columns = {k: v for k, v in program.items() if k != "temp_bytes"}
    return {**columns, "temp_bytes_per_param": None if temp is None else temp / n}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Output rows: ``ratio_vs_adamw`` and ``floor_ratio`` (against the copy's bandwidth) added."""
    by_name = {row["optimizer"]: row for row in rows}
    adamw = by_name.get("adamw")
    copy_gbps = by_name["copy"]["gbps"]
    out = []
    for row in rows:
        row = dict(row)
        moved = row.pop("_bytes")
        row["ratio_vs_adamw"] = row["ms"] / adamw["ms"] if adamw else None
        row["floor_ratio"] = row["ms"] / (moved / copy_gbps / 1e6)
        for key in ("pipelined", "busy", "span", "compile"):
            unit = "s" if key == "compile" else "ms"
            pair = (row.get(f"{key}_{unit}"), adamw and adamw[f"{key}_{unit}"])
            row[f"{key}_ratio_vs_adamw"] = pair[0] / pair[1] if all(pair) else None
        out.append(row)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    lm_shapes.add_args(p, stack_layers=True)
    common.add_optimizers_arg(p, updates.OPTIMIZERS, ",".join(updates.OPTIMIZERS))
    common.add_timing_args(p, warmup=5, iters=50)
    common.add_kernel_arg(p)
    common.add_concurrent_arg(p)
    common.add_profile_steps_arg(
        p, "report the device's kernel time per step (busy_ms) and its ratio to AdamW's"
    )
    common.add_out_arg(p, "update_speed")
    return p.parse_args(argv)


def build_result(rows: list[dict], n: int, args: argparse.Namespace) -> dict:
    """The JSON object for the rows measured so far."""
    config = {k: getattr(args, k) for k in ("warmup", "iters", "profile_steps")}
    return {**common.lm_set_result(args, n, **config), "rows": add_ratios(rows)}


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object.

    The JSON is rewritten after every optimizer, so a run cut short keeps what it measured.
    """
    args = parse_args(argv)
    shapes = lm_shapes.from_args(args)
    n = lm_shapes.count(shapes)
    grads = lm_shapes.random_tree(shapes, jax.random.key(0), std=updates.GRAD_STD)
    copy_bytes = floor_bytes(shapes, jax.eval_shape(updates.make_optimizer("adamw").init, shapes))
    rows = [make_row("copy", Timing(*time_copy(copy_bytes, args), copy_bytes), n)]
    for name in args.optimizers:
        stacks = lm_shapes.stacked_axes(shapes)
        tx = updates.make_optimizer(name, common.kernel_config(args), stacks)
        timing = time_optimizer(tx, shapes, grads, args, args.profile_steps)
        rows.append(make_row(name, timing, n))
        print(f"{name}: {timing.ms:.3f} ms", flush=True)
        common.write_json(args.out, build_result(rows, n, args))
    result = build_result(rows, n, args)
    print(f"\n{result['device']}, {n / 1e6:.1f}M parameters, median of {args.iters} steps\n")
    print(common.format_table(result["rows"], COLUMNS))
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
