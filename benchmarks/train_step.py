"""Full train-step time and peak memory of a model config: SONew, Muon, Adafactor against AdamW.

The step is the trainer's own: `sonew_pax.trainer.Trainer` on a one-device mesh (or a
``--mesh_data`` x ``--mesh_model`` mesh over the first devices) builds the model
from ``configs/models/<model>.gin`` (compute dtype from ``--dtype``, parameters float32), the
optimizer through `sonew_pax.optimizers.make_optimizer` (global-norm clipping, then the optimizer,
as in training; weight decay 0.1 on matrices; constant learning rate), and the jitted,
state-donating train step (forward, backward, update; ``--concurrent``: compiled with
``kernels.CONCURRENT_OPTIONS``, SONew with ``KernelConfig(concurrent=True)``). Batches are random
tokens, fixed across steps (``--tokens zipf``: with text's frequencies). After ``--warmup``
untimed steps each of ``--iters`` steps is timed to ``block_until_ready``; the median is
reported. Then ``--iters`` steps run back to back, waited
on once (``pipelined_ms``, their mean: the host dispatches each step while the device still runs
the last, as ``Trainer.train`` does). Then ``--iters`` steps each waited on before the next are
timed to their return (``dispatch_ms``, the median: the host's cost of a step, which bounds a
pipelined loop once it exceeds the device's).

Peak memory is ``memory_stats()["peak_bytes_in_use"]``, the largest over the mesh's devices (null
where the backend has no memory stats, e.g. CPU). Each optimizer runs in a fresh subprocess by
default, so peaks don't carry over (``--no_isolate`` runs them in this process, e.g. for CPU smoke
tests).

Output: a table, and ``--out`` (default ``benchmarks/results/train_step.json``)
``{"device", "date", "params", "config", "rows": [{"optimizer", "step_ms", "ratio_vs_adamw",
"peak_memory_gib", "memory_ratio_vs_adamw", "step_ms_min", "pipelined_ms",
"pipelined_ratio_vs_adamw", "dispatch_ms", "init_s", "first_step_s", "first_step_trace_s",
"first_step_lower_s", "first_step_compile_s", "tokens_per_s", "mfu", "loss",
"first_loss", "steps", "mesh"}]}`` (``init_s``: the state's initialisation, its compile
included, before the first step; ``first_step_{trace,lower,compile}_s``: of the first step,
the seconds JAX traced, lowered and compiled, autotuning included (`common.compile_seconds`);
``loss`` after ``steps`` steps on the same batch; ``mfu``
of the pipelined step as the trainer's progress line counts it, null on a device of unknown
peak);
with ``--profile_steps N`` each row also has, for the busiest device of the mesh, ``busy_ms``
(its kernel time per step), ``span_ms`` (the time at least one kernel ran: less than ``busy_ms``
where kernels overlap), ``kernels`` and the largest ``--profile_families`` kernel ``families``
of ``N`` traced steps (``device_trace``; ``--profile_families 400`` keeps them all).
SONew rows are ``updates.SONEW_VARIANTS`` (``*_pallas``: with the Pallas kernels; the trainer
applies through ``optim.apply_gradients``, so in ``*_lag_pallas`` rows the kernels write the
parameters: the fused apply); Muon rows are `MUON_VARIANTS`.

Usage: ``python -m benchmarks.train_step [--model 350m] [--batch_size 8] [--seq_len 1024]``.
"""

import argparse
import dataclasses
import functools
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from benchmarks import common, device_trace, updates
from sonew_pax import metrics, optim, optimizers, partitioning
from sonew_pax.models import (
    REMAT_POLICIES,
    Transformer,
    TransformerConfig,
    attention,
    count_params,
    flops_per_token,
)
from sonew_pax.trainer import Trainer

# Muon as the convergence tables run it (`optimizers.muon`, its Newton-Schulz iteration in the
# gradients' float32), and with the iteration in bfloat16 (``ns_dtype``).
MUON_VARIANTS = {"muon": {}, "muon_bf16": {"ns_dtype": "bfloat16"}}
OPTIMIZERS = ("adamw", "adafactor", *MUON_VARIANTS, *updates.SONEW_VARIANTS)
COLUMNS = (
    "optimizer",
    "step_ms",
    "step_ms_min",
    "ratio_vs_adamw",
    "pipelined_ms",
    "pipelined_ratio_vs_adamw",
    "dispatch_ms",
    "peak_memory_gib",
    "memory_ratio_vs_adamw",
    "init_s",
    "first_step_s",
    "first_step_compile_s",
    "mfu",
    "loss",
    "busy_ms",
)
PROFILE_FAMILIES = 16


def load_model_config(model: str, dtype: str | None, **overrides: Any) -> TransformerConfig:
    """``configs/models/<model>.gin``'s TransformerConfig; ``dtype`` and the ``overrides`` that
    are not None (``num_layers``, ``scan_layers``, ``attention``, ``remat``) replace its fields."""
    import gin

    gin.clear_config()
    gin.parse_config_file(str(common.ROOT / "configs" / "models" / f"{model}.gin"))
    config = gin.get_configurable(TransformerConfig)()
    gin.clear_config()
    overrides = {"dtype": dtype, **overrides}
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def optimizer_factory(name: str, unsharded: bool, kernel_config=None):
    """``make_optimizer`` (clipping + the named optimizer) as the Trainer calls it; SONew's
    kernels configured by ``kernel_config`` (default ``optim.KernelConfig()``)."""
    if name == "adamw":
        factory = functools.partial(optimizers.adamw, weight_decay=updates.WEIGHT_DECAY)
    elif name == "adafactor":
        factory = optimizers.adafactor
    elif name in MUON_VARIANTS:
        factory = functools.partial(optimizers.muon, **MUON_VARIANTS[name])
    else:
        kwargs = updates.SONEW_VARIANTS[name]
        kwargs = kwargs | {"kernel_config": kernel_config or optim.KernelConfig()}
        factory = functools.partial(optimizers.sonew, weight_decay=updates.WEIGHT_DECAY, **kwargs)
    if unsharded:
        plain = factory

        def factory(schedule, *, mesh=None, param_specs=None, stacked_axes=None):
            del mesh, param_specs
            return plain(schedule, stacked_axes=stacked_axes)

    return functools.partial(optimizers.make_optimizer, factory=factory, clip_norm=1.0)


TOKENS = ("uniform", "zipf")


def random_batch(
    vocab: int, batch_size: int, seq_len: int, tokens: str = "uniform"
) -> dict[str, np.ndarray]:
    """Random token ids (inputs, targets) and unit weights. ``tokens="uniform"`` draws every id
    alike; ``"zipf"`` draws id ``k`` with probability proportional to ``1 / (k + 1)``, the rank
    law of text's pieces (the commonest about 9% of a 32k vocabulary's tokens), so the steps that
    depend on the ids, like the embedding gradient's scatter-add, see text's repeats."""
    rng = np.random.default_rng(0)
    shape = (batch_size, seq_len + 1)
    if tokens == "uniform":
        tokens = rng.integers(0, vocab, shape, dtype=np.int32)
    elif tokens == "zipf":
        weights = 1.0 / np.arange(1, vocab + 1)
        tokens = rng.choice(vocab, size=shape, p=weights / weights.sum()).astype(np.int32)
    else:
        raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
    weights = np.ones((batch_size, seq_len), np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def peak_memory_gib(devices=None) -> float | None:
    """The largest peak bytes in use so far over ``devices`` (default: the first), in GiB.

    None where a device has no memory stats (e.g. CPU).
    """
    peaks = []
    for device in devices or jax.devices()[:1]:
        stats = device.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(stats["peak_bytes_in_use"] / 2**30)
    return max(peaks)


def run_one(name: str, args: argparse.Namespace) -> dict:
    """Builds the Trainer for optimizer ``name``, times its train step, returns the row."""
    optimizer = optimizer_factory(name, args.unsharded_optimizer, common.kernel_config(args))
    config = load_model_config(
        args.model,
        args.dtype,
        num_layers=args.layers,
        scan_layers=args.scan_layers or None,
        attention=args.attention,
        remat=args.remat,
    )
    devices = jax.devices()[: args.mesh_data * args.mesh_model]
    mesh = partitioning.make_mesh(data=args.mesh_data, model=args.mesh_model, devices=devices)
    rules = partitioning.logical_axis_rules()
    trainer = Trainer(
        Transformer(config),
        optimizer,
        optax.constant_schedule(updates.LEARNING_RATE),
        mesh,
        rules,
        (args.batch_size, args.seq_len),
        seed=0,
        compiler_options=common.compiler_options(args),
    )
    with partitioning.axis_rules_context(mesh, rules):
        start = time.perf_counter()
        state = jax.block_until_ready(trainer.init_state(0))
        init_s = time.perf_counter() - start
        tokens = random_batch(config.vocab_size, args.batch_size, args.seq_len, args.tokens)
        batch = trainer.global_batch(tokens)
        with common.compile_seconds() as first_compile:
            start = time.perf_counter()
            carry = jax.block_until_ready(trainer.train_step(state, batch))
            first_step_s = time.perf_counter() - start
        first_loss = float(carry[1]["loss"])

        def step(carry):
            return trainer.train_step(carry[0], batch)

        median, times, carry = common.time_steps(step, carry, args.warmup, args.iters)
        pipelined, carry = common.time_pipelined(step, carry, args.iters)
        dispatch, carry = common.time_dispatch(step, carry, args.iters)
        profile = {}
        if args.profile_steps:
            summary, carry = device_trace.trace_steps(step, carry, args.profile_steps)
            busiest = summary["devices"][0] if summary["devices"] else summary
            profile = {
                "busy_ms": busiest["busy_ms"],
                "span_ms": busiest["span_ms"],
                "kernels": busiest["kernels"],
                "families": busiest["families"][: args.profile_families],
            }
    return {
        "optimizer": name,
        "step_ms": median,
        "step_ms_min": min(times),
        "pipelined_ms": pipelined,
        "dispatch_ms": dispatch,
        "peak_memory_gib": peak_memory_gib(devices),
        "init_s": init_s,
        "first_step_s": first_step_s,
        **{f"first_step_{phase}": seconds for phase, seconds in first_compile.items()},
        "tokens_per_s": args.batch_size * args.seq_len / (median / 1e3),
        "mfu": model_flops_utilization(config, args, pipelined, len(devices)),
        "loss": float(carry[1]["loss"]),
        "first_loss": first_loss,
        "steps": 1 + args.warmup + 3 * args.iters + args.profile_steps,
        "mesh": f"{args.mesh_data}x{args.mesh_model}",
        "params": count_params(trainer.layout.abstract.params),
        "device": common.device_name(),
        **profile,
    }


def model_flops_utilization(
    config: TransformerConfig, args: argparse.Namespace, step_ms: float, devices: int
) -> float | None:
    """MFU of a step of ``step_ms`` as the trainer's progress line counts it: tokens/s per device
    times ``models.flops_per_token`` over the device's peak bf16 FLOP/s
    (``metrics.peak_flops``); ``None`` on a device of unknown peak."""
    peak = metrics.peak_flops(jax.devices()[0].device_kind)
    if peak is None:
        return None
    tokens_per_s = args.batch_size * args.seq_len / (step_ms / 1e3) / devices
    return tokens_per_s * flops_per_token(config, args.seq_len) / peak


def child_argv(name: str, args: argparse.Namespace, row_out: Path) -> list[str]:
    """Command line that runs one optimizer's measurement in a fresh Python process."""
    argv = [
        *common.module_command("train_step"),
        "--worker",
        name,
        "--row_out",
        str(row_out),
        "--model",
        args.model,
        "--batch_size",
        str(args.batch_size),
        "--seq_len",
        str(args.seq_len),
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--profile_steps",
        str(args.profile_steps),
        "--profile_families",
        str(args.profile_families),
        "--mesh_data",
        str(args.mesh_data),
        "--mesh_model",
        str(args.mesh_model),
    ]
    for flag in ("dtype", "layers", "attention", "remat", "tokens"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    if args.unsharded_optimizer:
        argv.append("--unsharded_optimizer")
    if args.scan_layers:
        argv.append("--scan_layers")
    if args.concurrent:
        argv.append("--concurrent")
    return argv + common.kernel_argv(args)


def run_isolated(name: str, args: argparse.Namespace) -> dict:
    """`run_one` in a subprocess (fresh peak-memory counter); a failure becomes an error row."""
    with tempfile.TemporaryDirectory() as tmp:
        row_out = Path(tmp) / "row.json"
        proc = subprocess.run(
            child_argv(name, args, row_out), capture_output=True, text=True, check=False
        )
        if proc.returncode == 0 and row_out.is_file():
            return json.loads(row_out.read_text())
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-20:]
    print(f"{name} failed (exit {proc.returncode}):\n" + "\n".join(tail), flush=True)
    return {"optimizer": name, "error": tail[-1] if tail else f"exit {proc.returncode}"}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Fills ``ratio_vs_adamw`` (step time), ``pipelined_ratio_vs_adamw`` and
    ``memory_ratio_vs_adamw`` (peak memory)."""
    adamw = next((r for r in rows if r["optimizer"] == "adamw" and "step_ms" in r), None)
    for row in rows:
        ok = adamw is not None and row.get("step_ms") is not None
        row["ratio_vs_adamw"] = row["step_ms"] / adamw["step_ms"] if ok else None
        row["pipelined_ratio_vs_adamw"] = (
            row["pipelined_ms"] / adamw["pipelined_ms"] if ok else None
        )
        peaks = (row.get("peak_memory_gib"), adamw and adamw.get("peak_memory_gib"))
        row["memory_ratio_vs_adamw"] = peaks[0] / peaks[1] if all(peaks) else None
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_model_args(
        p, model="350m", dtype="bfloat16", layers=True, batch_size=8, seq_len=1024
    )
    common.add_optimizers_arg(p, OPTIMIZERS, ",".join(OPTIMIZERS))
    p.add_argument(
        "--scan_layers",
        action="store_true",
        help="the model's layers as one nn.scan (TransformerConfig.scan_layers), its parameters "
        "stacked; SONew takes the stacked axes from their logical names",
    )
    p.add_argument(
        "--attention",
        choices=attention.IMPLEMENTATIONS,
        help="override TransformerConfig.attention (default: the model config's, auto)",
    )
    p.add_argument(
        "--remat",
        choices=tuple(REMAT_POLICIES),
        help="override TransformerConfig.remat (default: the model config's, none)",
    )
    p.add_argument(
        "--tokens",
        choices=TOKENS,
        default="uniform",
        help="the batch's ids: uniform, or zipf (text's frequencies: repeated ids)",
    )
    p.add_argument("--mesh_data", type=int, default=1, help="data-axis size of the mesh")
    p.add_argument("--mesh_model", type=int, default=1, help="model-axis size of the mesh")
    common.add_timing_args(p, warmup=3, iters=20)
    common.add_kernel_arg(p)
    common.add_concurrent_arg(p)
    common.add_profile_steps_arg(
        p,
        "add the device's kernel time per step (busy_ms), kernel count and the top "
        "--profile_families kernel families to each row (profile_update's summary)",
    )
    p.add_argument(
        "--profile_families",
        type=common.int_at_least(1),
        default=PROFILE_FAMILIES,
        help="kernel families kept per row with --profile_steps, the largest first",
    )
    p.add_argument(
        "--unsharded_optimizer",
        action="store_true",
        help="build SONew without the trainer's (one-device) mesh: no shard_map",
    )
    p.add_argument(
        "--no_isolate",
        action="store_true",
        help="run every optimizer in this process (peak memory then accumulates)",
    )
    common.add_out_arg(p, "train_step")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--row_out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_result(rows: list[dict], args: argparse.Namespace) -> dict:
    """The JSON object for the rows measured so far (ratios filled in)."""
    rows = add_ratios([dict(r) for r in rows])
    measured = [r for r in rows if "device" in r]
    return {
        "device": measured[0]["device"] if measured else None,
        "date": common.utc_date(),
        "params": measured[0]["params"] if measured else None,
        "config": {
            "model": args.model,
            "dtype": args.dtype,
            "layers": args.layers,
            "scan_layers": args.scan_layers,
            "attention": args.attention,
            "remat": args.remat,
            "tokens": args.tokens,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "mesh_data": args.mesh_data,
            "mesh_model": args.mesh_model,
            "warmup": args.warmup,
            "iters": args.iters,
            "unsharded_optimizer": args.unsharded_optimizer,
            "isolated": not args.no_isolate,
            **common.run_config(args),
        },
        "rows": [{k: v for k, v in r.items() if k not in ("device", "params")} for r in rows],
    }


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object.

    The JSON is rewritten after every optimizer, so a run cut short keeps what it measured.
    """
    args = parse_args(argv)
    if args.worker:
        common.write_json(args.row_out, run_one(args.worker, args))
        return {}
    rows = []
    for name in args.optimizers:
        row = run_one(name, args) if args.no_isolate else run_isolated(name, args)
        status = row.get("error") or f"{row['step_ms']:.2f} ms"
        print(f"{name}: {status}", flush=True)
        rows.append(row)
        result = build_result(rows, args)
        common.write_json(args.out, result)
    print(
        f"\n{result['device']}, model {args.model} ({result['params']} parameters), "
        f"batch {args.batch_size} x {args.seq_len}, median of {args.iters} steps\n"
    )
    print(common.format_table(result["rows"], COLUMNS))
    return result


if __name__ == "__main__":
    main()
