"""Scaling on one multi-GPU host: the sharded SONew update and the trainer's step over 1..N devices.

Two parts, each reusing another benchmark's functions:

- ``update`` (`sharded_update`): the ~335M LM-shaped tensor set (``--scale``, ``--layers``)
  updated by the one-device SONew update and by the sharded one on the first 2, 4 (, 8) devices
  (``--device_counts``), variants ``model`` (mesh 1 x n, Megatron specs) and ``data_model`` (mesh
  ``--data`` x n/``--data``, 2-D specs). The one-device reference is computed once per band and
  reused for every n. Rows: ms per step, speedup, scaling efficiency t1 / (n * tn), max relative
  difference of every parameter and state array from the reference after ``--check_steps`` steps.
- ``train`` (`train_step`): the trainer's full jitted step of ``configs/models/<--model>.gin`` (bf16
  compute) on ``data`` x ``model`` meshes (default, for N devices: N x 1, N/2 x 2, N/4 x 4) for
  each of ``--optimizers`` (default AdamW and tridiagonal SONew as ``sonew`` defaults it, the
  kernels on GPU: ``sonew_tridiag_auto``), on the same random batch
  (``--batch_size`` x ``--seq_len``; the batch must divide over every mesh's data axis). Rows:
  steps/s, tokens/s, peak memory per GPU (the largest over the mesh), the waited, pipelined and
  dispatch times of a step (`train_step`; ``--train_profile_steps``: the busiest GPU's kernel
  time, ``busy_ms``), first-step loss and the loss after the timed steps; ``loss_agreement``
  holds, per optimizer, the largest difference of those losses across meshes.

Every measurement runs in a fresh subprocess by default (one for the update part, one per
(optimizer, mesh) for the train part), so that no process holds GPU memory another needs and each
peak is its own; ``--no_isolate`` runs everything in this process (CPU smoke tests).

Output: tables, ``--out`` (default ``benchmarks/results/scaling.json``) ``{"device", "date",
"devices", "config", "update_rows": [{"band", "devices", "variant", "mesh", "ms_1dev",
"ms_sharded", "speedup", "scaling_efficiency", "max_rel_diff", "equal", ...}], "train_rows":
[{"optimizer", "mesh", "steps_per_s", "tokens_per_s", "peak_memory_gib", "loss", "first_loss",
"loss_diff", ...}], "loss_agreement": {optimizer: {...}}}`` and the same tables as markdown next to
it (``.md``). Both are rewritten after every row, so a run cut short keeps what it measured.

Usage: ``python -m benchmarks.scaling [--parts update,train] [--bands 1] [--iters 10]``. On CPU,
simulate devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax

from benchmarks import common, lm_shapes, sharded_update, train_step

PARTS = ("update", "train")
UPDATE_COLUMNS = ("band", "devices", *sharded_update.COLUMNS[1:])
TRAIN_COLUMNS = (
    "optimizer",
    "mesh",
    "steps_per_s",
    "tokens_per_s",
    "peak_memory_gib",
    "first_loss",
    "loss",
    "loss_diff",
    "step_ms",
    "pipelined_ms",
    "dispatch_ms",
    "busy_ms",
    "first_step_s",
)
AGREEMENT_COLUMNS = (
    "optimizer",
    "meshes",
    "max_abs_diff_first_loss",
    "max_abs_diff_loss",
    "max_rel_diff_loss",
    "agree",
)
PROBE = (
    "import json, jax; d = jax.devices(); "
    "print(json.dumps([len(d), getattr(d[0], 'device_kind', d[0].platform)]))"
)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    p.add_argument("--parts", default=",".join(PARTS), help="update and/or train, in run order")
    common.add_out_arg(p, "scaling")
    p.add_argument("--no_isolate", action="store_true", help="run every part in this process")
    u = p.add_argument_group("update part (sharded_update)")
    lm_shapes.add_args(u)
    u.add_argument("--device_counts", default="", help="e.g. 1,2,4 (default: 1, 2, 4, .. N)")
    sharded_update.add_variant_args(u)
    u.add_argument("--update_warmup", type=int, default=2, help="untimed update steps")
    u.add_argument("--update_iters", type=int, default=10, help="timed update steps (median)")
    u.add_argument(
        "--update_profile_steps", type=int, default=5, help="traced update steps (device time)"
    )
    t = p.add_argument_group("train part (train_step)")
    common.add_model_args(t, model="350m", dtype="bfloat16", batch_size=16, seq_len=1024)
    t.add_argument("--train_layers", type=int, help="override the model's number of layers")
    common.add_optimizers_arg(t, train_step.OPTIMIZERS, "adamw,sonew_tridiag_auto")
    t.add_argument("--meshes", default="", help="DATAxMODEL list, e.g. 4x1,2x2,1x4")
    common.add_timing_args(t, warmup=2, iters=10)
    t.add_argument(
        "--train_profile_steps",
        type=int,
        default=0,
        help="traced train steps per row (device time of the busiest GPU: busy_ms)",
    )
    t.add_argument("--loss_rtol", type=float, default=1e-2, help="loss gap counted as agreeing")
    p.add_argument("--worker", choices=("update",), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def default_device_counts(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    counts = [1]
    while counts[-1] * 2 <= n:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == n else [*counts, n]


def default_meshes(n: int) -> list[tuple[int, int]]:
    """``(data, model)`` meshes over all ``n`` devices: n x 1, n/2 x 2, n/4 x 4 (those that fit)."""
    return [(n // m, m) for m in (1, 2, 4) if m <= n and n % m == 0]


def parse_meshes(text: str, n: int) -> list[tuple[int, int]]:
    """``"4x1,2x2"`` -> [(4, 1), (2, 2)]; empty -> `default_meshes`."""
    if not text:
        return default_meshes(n)
    meshes = [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]
    too_big = [m for m in meshes if len(m) != 2 or m[0] * m[1] > n]
    if too_big:
        raise SystemExit(f"meshes {too_big} do not fit the {n} devices")
    return meshes


def device_counts(args: argparse.Namespace, n: int) -> list[int]:
    """The device counts of the update part (``--device_counts`` or `default_device_counts`)."""
    if not args.device_counts:
        return default_device_counts(n)
    return [int(c) for c in args.device_counts.split(",") if int(c) <= n]


def probe_devices(isolate: bool) -> tuple[int, str]:
    """(device count, device name), from a subprocess when ``isolate`` (this one keeps no GPU)."""
    if not isolate:
        return jax.device_count(), common.device_name()
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    count, name = json.loads(out.strip().splitlines()[-1])
    return count, name


def new_result(device: str, n: int, args: argparse.Namespace) -> dict:
    """The JSON object before any row: device, date, device count and every flag."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config.pop("worker")
    config["jax"] = jax.__version__
    return {
        "device": device,
        "date": common.utc_date(),
        "devices": n,
        "config": config,
        "update_rows": [],
        "train_rows": [],
        "loss_agreement": {},
    }


def markdown(result: dict) -> str:
    """The result's three tables as markdown, under a one-line heading."""
    head = f"# Scaling: {result['device']} x {result['devices']} ({result['date']})\n"
    parts = [head]
    tables = (
        ("Sharded SONew update", result["update_rows"], UPDATE_COLUMNS),
        ("Train step", result["train_rows"], TRAIN_COLUMNS),
        ("Losses across meshes", agreement_rows(result), AGREEMENT_COLUMNS),
    )
    for title, rows, columns in tables:
        if rows:
            parts.append(f"## {title}\n\n" + common.format_table(rows, columns, markdown=True))
    return "\n".join(parts)


def agreement_rows(result: dict) -> list[dict]:
    """``loss_agreement`` as table rows."""
    return [{"optimizer": k, **v} for k, v in result["loss_agreement"].items()]


def write_outputs(result: dict, out: Path) -> None:
    """Writes the JSON and the markdown tables next to it."""
    common.write_json(out, result)
    common.write_text(out.with_suffix(".md"), markdown(result))


def update_args(args: argparse.Namespace) -> argparse.Namespace:
    """The `sharded_update` flags for this run's update part."""
    return sharded_update.parse_args(
        [
            *("--scale", str(args.scale), "--layers", str(args.layers)),
            *("--data", str(args.data), "--variants", args.variants, "--tol", str(args.tol)),
            *("--check_steps", str(args.check_steps), "--warmup", str(args.update_warmup)),
            *("--iters", str(args.update_iters), "--out", str(args.out)),
            *("--profile_steps", str(args.update_profile_steps)),
        ]
    )


def single_row(band: int, ms_1dev: float) -> dict:
    """The one-device reference as a row of the update table."""
    return {
        "band": band,
        "devices": 1,
        "variant": "single",
        "mesh": "1 device (no mesh)",
        "ms_1dev": ms_1dev,
        "ms_sharded": ms_1dev,
        "speedup": 1.0,
        "scaling_efficiency": 1.0,
    }


def run_update(args: argparse.Namespace, result: dict) -> dict:
    """The update part in this process: rows appended to ``result``, outputs rewritten per row."""
    uargs = update_args(args)
    shapes = lm_shapes.from_args(uargs)
    devices = jax.devices()
    counts = device_counts(args, len(devices))
    result["update_params"] = lm_shapes.count(shapes)
    for band in (int(b) for b in args.bands.split(",")):
        reference, ms_1dev, profile_1dev = sharded_update.single_device(band, shapes, uargs)
        print(f"update band {band}: 1 device {ms_1dev:.3f} ms", flush=True)
        result["update_rows"].append(single_row(band, ms_1dev))
        write_outputs(result, args.out)
        for n in (c for c in counts if c > 1):
            rows = sharded_update.bench_variants(
                band, shapes, devices[:n], uargs, reference, ms_1dev, profile_1dev
            )
            result["update_rows"] += [{**row, "devices": n} for row in rows]
            write_outputs(result, args.out)
        del reference
    return result


def run_update_isolated(args: argparse.Namespace, argv: list[str], result: dict) -> dict:
    """The update part in a subprocess (which writes the outputs); its rows read back from them."""
    proc = subprocess.run(
        [*common.module_command("scaling"), *argv, "--worker", "update"], check=False
    )
    if proc.returncode:
        print(f"update part failed (exit {proc.returncode}); keeping the rows it wrote", flush=True)
    if args.out.is_file():
        written = json.loads(args.out.read_text())
        result["update_rows"] = written.get("update_rows", [])
        result["update_params"] = written.get("update_params")
    return result


def train_args(args: argparse.Namespace, mesh: tuple[int, int]) -> argparse.Namespace:
    """The `train_step` flags for one mesh of this run's train part."""
    argv = [
        *("--model", args.model, "--dtype", args.dtype, "--batch_size", str(args.batch_size)),
        *("--seq_len", str(args.seq_len), "--warmup", str(args.warmup)),
        *("--iters", str(args.iters), "--mesh_data", str(mesh[0]), "--mesh_model", str(mesh[1])),
        *("--profile_steps", str(args.train_profile_steps)),
    ]
    if args.train_layers is not None:
        argv += ["--layers", str(args.train_layers)]
    return train_step.parse_args(argv)


def train_row(name: str, mesh: tuple[int, int], args: argparse.Namespace) -> dict:
    """One (optimizer, mesh) measurement as a row of the train table (an error row on failure)."""
    targs = train_args(args, mesh)
    run = train_step.run_one if args.no_isolate else train_step.run_isolated
    row = run(name, targs)
    row["mesh"] = f"{mesh[0]}x{mesh[1]}"
    if row.get("step_ms"):
        row["steps_per_s"] = 1e3 / row["step_ms"]
    row.pop("device", None)
    return row


def loss_agreement(rows: list[dict], rtol: float) -> dict:
    """Per optimizer: the largest loss gaps between its meshes; sets each row's ``loss_diff``.

    ``loss_diff`` is the row's final loss minus that of the optimizer's first measured mesh.
    """
    agreement = {}
    for name in dict.fromkeys(r["optimizer"] for r in rows):
        done = [r for r in rows if r["optimizer"] == name and "loss" in r]
        if not done:
            continue
        for row in done:
            row["loss_diff"] = row["loss"] - done[0]["loss"]
        losses = [r["loss"] for r in done]
        firsts = [r["first_loss"] for r in done]
        spread = max(losses) - min(losses)
        rel = spread / max(abs(min(losses)), 1e-12)
        agreement[name] = {
            "meshes": ",".join(r["mesh"] for r in done),
            "max_abs_diff_first_loss": max(firsts) - min(firsts),
            "max_abs_diff_loss": spread,
            "max_rel_diff_loss": rel,
            "agree": rel <= rtol,
        }
    return agreement


def run_train(args: argparse.Namespace, result: dict) -> dict:
    """The train part: for each mesh, each optimizer; outputs rewritten after every row."""
    meshes = parse_meshes(args.meshes, result["devices"])
    uneven = [m for m in meshes if args.batch_size % m[0]]
    if uneven:
        raise SystemExit(f"--batch_size {args.batch_size} does not divide over meshes {uneven}")
    for mesh in meshes:
        for name in args.optimizers:
            row = train_row(name, mesh, args)
            result["train_rows"].append(row)
            result["loss_agreement"] = loss_agreement(result["train_rows"], args.loss_rtol)
            write_outputs(result, args.out)
            status = row.get("error") or row.get("skipped") or f"{row['step_ms']:.1f} ms/step"
            print(f"train {name} mesh {row['mesh']}: {status}", flush=True)
    return result


def print_tables(result: dict) -> None:
    """The result's tables on stdout."""
    print(f"\n{result['device']} x {result['devices']}")
    if result["update_rows"]:
        print(f"\nSharded SONew update, {result.get('update_params') or 0:,} parameters\n")
        print(common.format_table(result["update_rows"], UPDATE_COLUMNS))
    if result["train_rows"]:
        print(f"\nTrain step, model {result['config']['model']}\n")
        print(common.format_table(result["train_rows"], TRAIN_COLUMNS))
        print(common.format_table(agreement_rows(result), AGREEMENT_COLUMNS))


def main(argv=None) -> dict:
    """Runs the requested parts, prints the tables, writes and returns the JSON object."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        raise SystemExit(f"unknown parts {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    if args.worker == "update":
        result = new_result(common.device_name(), jax.device_count(), args)
        return run_update(args, result)
    n, device = probe_devices(not args.no_isolate)
    result = new_result(device, n, args)
    write_outputs(result, args.out)
    for part in parts:
        if part == "train":
            run_train(args, result)
        elif args.no_isolate:
            run_update(args, result)
        else:
            run_update_isolated(args, argv, result)
    write_outputs(result, args.out)
    print_tables(result)
    return result


if __name__ == "__main__":
    main()
