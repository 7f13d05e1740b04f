"""First compile of an optimizer's update, cold and from the trainer's compilation cache.

On a GPU, SONew's update compiles Triton kernels (for bands >= 2 one banded walk per tensor shape,
each long to compile), so a first step is slow. ``trainer.train`` keeps JAX's persistent compilation
cache in MODEL_DIR (``trainer.persistent_compilation_cache``), so a run restarted after a preemption
loads its compiled step instead. This measures what that saves, and that the loaded executable
computes the same thing: for each optimizer, two fresh processes build the donated update of
``update_speed`` (``updates.make_update``) on the LM-shaped tensors and compile it inside
``trainer.persistent_compilation_cache`` at one directory. The first finds it empty and writes the
entry (``cold``), the second reads it (``warm``). Each process reports:

* ``lower_s``: tracing and lowering to StableHLO (Pallas lowers its kernels to Triton IR here),
  which every process pays: the cache is looked up with the lowered module;
* ``compile_s``: ``.compile()``, what the cache saves;
* whether JAX loaded ``jit_update`` from the cache (``trainer.CacheHits``, the trainer's own
  count for its first-step log);
* a checksum of the parameters after ``--steps`` updates of the same random gradient.

JAX writes an entry only when a compile took ``jax_persistent_cache_min_compile_time_secs``
(default 1 s, which the trainer keeps); the processes here set it to 0, so that tiny sets (the CPU
smoke test) are cached too. Larger compiles are cached either way.

Output: a table, and ``--out`` (default ``benchmarks/results/compile_cache.json``) ``{"device",
"date", "params", "config", "rows": [{"optimizer", "cold_lower_s", "cold_compile_s",
"warm_lower_s", "warm_compile_s", "compile_speedup", "warm_hit", "same_result"}]}``.

Usage: ``python -m benchmarks.compile_cache [--optimizers sonew_band4_lag_pallas] [--layers 2]``.
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import common, lm_shapes, updates
from sonew_pax import trainer

COLUMNS = (
    "optimizer",
    "cold_lower_s",
    "cold_compile_s",
    "warm_lower_s",
    "warm_compile_s",
    "compile_speedup",
    "warm_hit",
    "same_result",
)


def compile_once(name: str, cache_dir: str, args: argparse.Namespace) -> dict:
    """In this process: ``name``'s update compiled inside the cache at ``cache_dir``, then run
    ``args.steps`` times; its seconds, whether the cache hit, and the parameters' checksum."""
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    shapes = lm_shapes.from_args(args)
    grads = lm_shapes.random_tree(shapes, jax.random.key(0), std=updates.GRAD_STD)
    tx = updates.make_optimizer(name, common.kernel_config(args))
    update, (params, state) = updates.fresh_update(tx, shapes)
    # Only jit_update compiles in here.
    with trainer.persistent_compilation_cache(cache_dir), trainer.CacheHits() as hits:
        start = time.perf_counter()
        lowered = update.lower(params, state, grads)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        compiled_at = time.perf_counter()
    for _ in range(args.steps):
        params, state = compiled(params, state, grads)
    leaves = jax.tree.leaves(jax.device_get(params))
    return {
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "hit": hits.count > 0,
        "checksum": float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in leaves)),
    }


def run_child(name: str, cache_dir: Path, args: argparse.Namespace) -> dict:
    """:func:`compile_once` in a fresh process (nothing compiled, no in-memory cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        argv = [*common.module_command("compile_cache"), "--optimizers", name]
        argv += ["--steps", str(args.steps)]
        argv += ["--scale", str(args.scale), "--layers", str(args.layers)]
        argv += [*common.kernel_argv(args), "--child", str(cache_dir), "--out", str(out)]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
            raise SystemExit(
                f"{name}: the compiling process failed (exit {proc.returncode}):\n{tail}"
            )
        return json.loads(out.read_text())


def measure(name: str, args: argparse.Namespace) -> dict:
    """``name``'s row: a cold process writes a fresh cache, a warm one reads it."""
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = run_child(name, Path(cache_dir), args)
        warm = run_child(name, Path(cache_dir), args)
    if cold["hit"]:
        raise SystemExit(f"{name}: the first process found an entry in a fresh cache")
    return {
        "optimizer": name,
        "cold_lower_s": cold["lower_s"],
        "cold_compile_s": cold["compile_s"],
        "warm_lower_s": warm["lower_s"],
        "warm_compile_s": warm["compile_s"],
        "compile_speedup": cold["compile_s"] / warm["compile_s"],
        "warm_hit": warm["hit"],
        "same_result": cold["checksum"] == warm["checksum"],
        "checksums": [cold["checksum"], warm["checksum"]],
    }


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_optimizers_arg(
        p, updates.OPTIMIZERS, "adamw,sonew_tridiag_lag_pallas,sonew_band4_lag_pallas"
    )
    lm_shapes.add_args(p)
    p.add_argument(
        "--steps", type=common.int_at_least(1), default=3, help="updates run after compiling"
    )
    common.add_kernel_arg(p)
    p.add_argument("--child", help=argparse.SUPPRESS)  # the cache directory of one process
    common.add_out_arg(p, "compile_cache")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object (rewritten after
    every optimizer, so a run cut short keeps what it measured)."""
    args = parse_args(argv)
    if args.child:
        (name,) = args.optimizers
        result = compile_once(name, args.child, args)
        common.write_json(args.out, result)
        return result
    shapes = lm_shapes.from_args(args)
    result = common.lm_set_result(args, lm_shapes.count(shapes), steps=args.steps)
    for name in args.optimizers:
        result["rows"].append(measure(name, args))
        print(f"{name}: compiled in {result['rows'][-1]['cold_compile_s']:.1f} s", flush=True)
        common.write_json(args.out, result)
    print(f"\n{result['device']}, {result['params'] / 1e6:.1f}M parameters\n")
    print(common.format_table(result["rows"], COLUMNS))
    return result


if __name__ == "__main__":
    main()
