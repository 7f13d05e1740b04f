"""Where a train step's memory traffic goes, read from its compiled program, with or without a GPU.

Compiles the trainer's whole train step (``train_step.py``'s Trainer: ``--model``, batch, each of
``--optimizers``) for one device and sums, per operation of the program (its op name, layers
merged), the bytes its launches move (``common.hlo_traffic``'s rule: outputs and operands, an
operand read through slices at the slices' size; a fusion rooted in a dynamic-update-slice, run in
place, at the update it writes) and the FLOPs of its matrix products; launches inside a ``while``
loop (the fused loss's chunks, scanned layers) count once per trip.

``--gpu_target_config`` compiles for the GPU its target config describes (as
``compile_profile.py``) on a host with JAX's CUDA plugin and no GPU; SONew's kernels are then
compiled for that GPU, not interpreted. The compiler then tunes nothing, so every matrix
product is a Triton fusion, where a GPU may pick cuBLAS and fuse less into it; layouts,
transposes, reductions, copies and the optimizer's launches are what the card's compiler emits.
The bytes count the design's passes, not time: a pass that should not be there shows up by name.

Output: per optimizer its total and the ``--top`` operations by bytes, and ``--out`` (default
``benchmarks/results/step_traffic.json``) ``{"device", "date", "config", "rows": [{"optimizer",
"gb", "matmul_tflop", "launches", "top": [{"op", "gb", "tflop", "launches"}]}]}``.

Usage: ``python -m benchmarks.step_traffic --model 350m --batch_size 16 --seq_len 1024
--gpu_target_config benchmarks/targets/h200.pbtxt``.
"""

import argparse
import collections
import dataclasses
import re

import optax

from benchmarks import common, compile_profile, train_step, updates
from sonew_pax import partitioning
from sonew_pax.models import Transformer
from sonew_pax.trainer import Trainer

TOP = 20
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _dot_flops(computations: dict, line: str) -> int:
    """``2 * output elements * contracted size`` of the first ``dot`` in the computations a
    fusion's ``line`` calls (nested ones too), or of ``line`` itself; 0 without one."""
    lines, pending = [line], re.findall(r"calls=%([\w.\-]+)", line)
    while pending:
        body = computations.get(pending.pop(), [])
        lines += body
        pending += [c for text in body for c in re.findall(r"calls=%([\w.\-]+)", text)]
    instructions = common.hlo_instructions(lines)
    dims = {}
    for name, shape, _, _, _ in instructions:
        arrays = common.HLO_ARRAY.findall(shape)
        if len(arrays) == 1:
            dims[name] = [int(d) for d in arrays[0][1].split(",") if d]
    for name, _, opcode, operands, text in instructions:
        if opcode != "dot" or operands[0] not in dims:
            continue
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", text).group(1)
        size = 1
        for axis in (int(a) for a in contracted.split(",") if a):
            size *= dims[operands[0]][axis]
        outputs = 1
        for d in dims.get(name, []):
            outputs *= d
        return 2 * outputs * size
    return 0


def _op_of(line: str, opcode: str) -> str:
    """An instruction's operation: its op name without the jit prefix, layers merged."""
    found = _OP_NAME.search(line)
    if not found:
        return opcode
    name = re.sub(r"layer_\d+", "layer_N", found.group(1))
    return re.sub(r"^jit\([\w.]+\)/", "", name)


def launches(text: str) -> list[dict]:
    """Each launch of a compiled module's ``text`` (``while`` bodies times their trip count):
    ``{"op", "bytes", "flops", "launches"}``."""
    computations = common.hlo_computations(text)
    found = []

    def walk(name: str, times: int) -> None:
        shapes = {}
        for instruction in common.hlo_instructions(computations[name]):
            inst, shape, opcode, _, line = instruction
            shapes[inst] = shape
            if opcode == "while":
                trips = _TRIP_COUNT.search(line)
                body = re.search(r"body=%([\w.\-]+)", line).group(1)
                walk(body, times * (int(trips.group(1)) if trips else 1))
                continue
            if opcode in common.HLO_NO_TRAFFIC:
                continue
            moved = common.hlo_launch_bytes(computations, shapes, instruction, in_place=True)
            found.append(
                {
                    "op": _op_of(line, opcode),
                    "bytes": moved * times,
                    "flops": _dot_flops(computations, line) * times,
                    "launches": times,
                }
            )

    walk(common.hlo_entry(text), 1)
    return found


def summary(name: str, text: str, top: int) -> dict:
    """The row of optimizer ``name``'s compiled step ``text``: totals and the ``top`` operations
    by bytes."""
    items = launches(text)
    by_op: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0])
    for item in items:
        entry = by_op[item["op"]]
        entry[0] += item["bytes"]
        entry[1] += item["flops"]
        entry[2] += item["launches"]
    largest = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "optimizer": name,
        "gb": sum(i["bytes"] for i in items) / 1e9,
        "matmul_tflop": sum(i["flops"] for i in items) / 1e12,
        "launches": sum(i["launches"] for i in items),
        "top": [
            {"op": op, "gb": b / 1e9, "tflop": f / 1e12, "launches": n} for op, (b, f, n) in largest
        ],
    }


def compiled_step(name: str, args: argparse.Namespace, device) -> str:
    """The compiled text of optimizer ``name``'s train step on ``device`` (abstract arrays)."""
    kernels = common.kernel_config(args)
    if args.gpu_target_config:
        kernels = dataclasses.replace(kernels, platform="gpu", interpret=False)
    config = train_step.load_model_config(args.model, args.dtype, attention=args.attention)
    mesh = partitioning.make_mesh(data=1, model=1, devices=[device])
    rules = partitioning.logical_axis_rules()
    trainer = Trainer(
        Transformer(config),
        train_step.optimizer_factory(name, False, kernels),
        optax.constant_schedule(updates.LEARNING_RATE),
        mesh,
        rules,
        (args.batch_size, args.seq_len),
        seed=0,
    )
    with partitioning.axis_rules_context(mesh, rules):
        lowered = trainer.train_step.lower(
            trainer.layout.abstract_with_shardings(), trainer.abstract_batch()
        )
    return lowered.compile().as_text()


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_model_args(p, model="350m", dtype="bfloat16", batch_size=16, seq_len=1024)
    common.add_optimizers_arg(p, train_step.OPTIMIZERS, "adamw,sonew_tridiag_auto_by_shape_e16")
    p.add_argument(
        "--attention",
        choices=("auto", "xla", "cudnn", "splash"),
        help="override TransformerConfig.attention (a host without a GPU resolves auto to xla)",
    )
    p.add_argument("--gpu_target_config", help="compile for this GPU (compile_profile.py)")
    p.add_argument("--top", type=int, default=TOP, help="operations listed per optimizer")
    common.add_kernel_arg(p)
    common.add_out_arg(p, "step_traffic")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Compiles, prints the tables, writes and returns the JSON object."""
    args = parse_args(argv)
    device = compile_profile.target_device(args.gpu_target_config)
    result = {
        "device": device.device_kind
        + (" (compiled without one)" if args.gpu_target_config else ""),
        "date": common.utc_date(),
        "config": {
            "model": args.model,
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "attention": args.attention,
            "gpu_target_config": args.gpu_target_config,
            **common.run_config(args),
        },
        "rows": [],
    }
    for name in args.optimizers:
        row = summary(name, compiled_step(name, args, device), args.top)
        result["rows"].append(row)
        print(
            f"\n{name}: {row['gb']:.2f} GB, {row['matmul_tflop']:.2f} TFLOP of matrix products, "
            f"{row['launches']} launches"
        )
        print(common.format_table(row["top"], ("gb", "tflop", "launches", "op")))
        common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
