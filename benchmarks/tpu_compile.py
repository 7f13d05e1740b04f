"""An update compiled for a TPU on any host: the HBM bytes its schedule moves, against AdamW's.

TPUs run SONew's XLA path by default (the ``sonew_*`` rows), or with ``implementation="pallas"``
band 1 as a Mosaic kernel (``kernels.tpu``; the ``_pallas`` rows compile it), and the update is
memory-bound, so its time follows the bytes it moves through HBM. libtpu compiles for a TPU
topology without a TPU (``jax.experimental.topologies``: "deviceless" compilation), so this runs on
a CPU host: for each optimizer it compiles the donated update of the LM set (``updates``,
``lm_shapes``) on abstract arrays on one chip of ``--topology``, and reads the compiled module:

* ``hbm_b_per_param``: the bytes the instructions read from and write to HBM (memory space 0;
  operands and results that XLA's memory-space assignment put in VMEM are free; a loop's body
  once per trip), per parameter (:func:`hbm_bytes`). AdamW's floor is 28 (fp32: ``g``, ``m``,
  ``v``, ``p`` read, ``m``, ``v``, ``p`` written); the compiler's own ``cost_analysis()`` counts
  VMEM traffic too, so it is not used;
* ``ratio_vs_adamw``: that against AdamW's, compiled the same way: what a TPU's update time would
  be relative to AdamW's if both ran at the same bandwidth;
* ``fusions``, ``copies`` (``copy`` and ``copy-start``): launches and layout or memory-space moves.

Needs libtpu (``pip install 'jax[tpu]'`` gives the version this JAX pins); nothing is allocated.

Output: a table, and ``--out`` (default ``benchmarks/results/tpu_compile.json``) ``{"device",
"date", "params", "config", "rows": [{"optimizer", "hbm_b_per_param", "ratio_vs_adamw",
"fusions", "copies", "compile_s"}]}``.

With ``--train_step GIN_FILE`` it compiles instead a run's whole train step (the one ``train`` runs,
``loop.configured_trainer``) for all chips of ``--topology`` (e.g. ``v4:2x2x4``, a v4-32 slice),
once per ``--step_optimizers`` entry (:data:`STEP_OPTIMIZERS`) and ``--step_layers`` depth, and
reads per chip its compiled ``memory_analysis()`` (arguments, outputs, aliased, temporaries,
generated code, peak; ``total_gib`` = arguments + outputs - aliased + temporaries + code, against
the chip's HBM), ``hbm_gb``, :func:`hbm_bytes` of the step (a loop's body once per trip), and
``collective_matmul_gb``, the part of it in XLA's windowed einsum loops. With two or more depths
each entry also gets a row at the config's own depth, extrapolated linearly in layers from the two
deepest (:func:`extrapolate`). Output (default
``benchmarks/results/tpu_compile_step.json``) as above, rows
``{"optimizer", "layers", "extrapolated", *memory, "hbm_gb", "collective_matmul_gb",
"total_vs_adamw", "compile_s"}``.

Usage: ``python -m benchmarks.tpu_compile [--topology v5e:2x2] [--optimizers adamw,sonew_tridiag]``,
``python -m benchmarks.tpu_compile --train_step runs/pretrain_1b_v4_32.gin --topology v4:2x2x4``.
"""

import argparse
import collections
import math
import pathlib
import re
import time
from collections.abc import Sequence

import gin
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import common, lm_shapes, updates
from sonew_pax import loop, partitioning, train

COLUMNS = ("optimizer", "hbm_b_per_param", "ratio_vs_adamw", "fusions", "copies", "compile_s")
# The train step's memory per chip, GiB, by ``memory_analysis()`` field.
MEMORY_FIELDS = {
    "argument_gib": "argument_size_in_bytes",
    "output_gib": "output_size_in_bytes",
    "alias_gib": "alias_size_in_bytes",
    "temp_gib": "temp_size_in_bytes",
    "code_gib": "generated_code_size_in_bytes",
    "peak_gib": "peak_memory_in_bytes",
}
STEP_COLUMNS = (
    "optimizer", "layers", *MEMORY_FIELDS, "total_gib", "total_vs_adamw", "hbm_gb",
    "collective_matmul_gb",
)  # fmt: skip
# The train step's optimizers: gin files and bindings added to the run's config ("config": the
# run's own; "config_pallas": with the TPU kernels, lowered as Mosaic kernels from this host;
# "config_by_shape": with the parameters stacked by shape, as the optimizer file has it).
STEP_OPTIMIZERS = {
    "adamw": (("optimizers/adamw.gin",), ()),
    "config": ((), ()),
    "config_pallas": (
        (),
        (
            'sonew.implementation = "pallas"',
            "sonew.kernel_config = @KernelConfig()",
            'KernelConfig.platform = "tpu"',
            "KernelConfig.interpret = False",
        ),
    ),
    "config_by_shape": ((), ("sonew.stack_by_shape = True", 'sonew.stack_dtype = "bfloat16"')),
}
# Bindings every run config leaves required; nothing is written and no step runs.
STEP_REQUIRED = ('MODEL_DIR = "/unused"', "TRAIN_STEPS = 100000")
# TPU generations whose chips JAX runs as one device of two TensorCores.
_MEGACORE = ("v4", "v5p")
# HBM per chip, GiB, by device kind.
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}
GIB = 2**30
# Instructions that move no data of their own (aliases, views, bookkeeping): the async slice's and
# copy's second halves are counted at their starts (reads) and ends (writes).
_FREE = common.HLO_NO_TRAFFIC | {"after-all", "slice-done", "partition-id", "replica-id"}


def hbm_bytes(text: str) -> tuple[int, collections.Counter]:
    """The bytes a compiled TPU module moves through HBM, in all and by opcode: each instruction's
    operands and results in memory space 0, an operand that its fusion only slices counted at the
    slices' size (a slice's at what it keeps, :func:`_slice_read`), an async copy's or slice's
    read at its start and its write at its end, a ``dynamic-update-slice`` (fused or not, which
    XLA runs in the buffer it updates) at the update it reads and writes, and a ``while`` loop's
    body once per trip (:func:`_trips`)."""
    by_opcode, _ = _step_bytes(text)
    return sum(by_opcode.values()), by_opcode


# XLA's SPMD partitioner names the loops of a windowed einsum (a collective matmul: a sharded
# product computed a piece per trip while an operand or the partial result goes round the ring)
# after this.
_WINDOWED_EINSUM = "windowed_dot_general_body"


def collective_matmul_bytes(text: str) -> int:
    """The part of :func:`hbm_bytes` moved inside XLA's windowed einsum loops: the products of a
    model sharded FSDP-style, which an optimizer changes only through the partitioner's and
    fusion passes' choices around the gradients it consumes."""
    return sum(_step_bytes(text)[1].values())


def _step_bytes(text: str) -> tuple[collections.Counter, collections.Counter]:
    """A compiled module's HBM bytes by opcode (:func:`hbm_bytes`) and, of them, those moved in
    windowed einsum loops (:func:`collective_matmul_bytes`), from one walk."""
    computations = common.hlo_computations(text)
    by_opcode: collections.Counter = collections.Counter()
    windowed: collections.Counter = collections.Counter()
    _computation_bytes(computations, common.hlo_entry(text), 1, by_opcode, windowed)
    return by_opcode, windowed


def _computation_bytes(
    computations,
    computation: str,
    times: int,
    by_opcode: collections.Counter,
    windowed: collections.Counter | None = None,
):
    """Adds to ``by_opcode`` the HBM bytes ``computation`` moves, run ``times`` times
    (:func:`hbm_bytes`'s rules), and to ``windowed`` (where given) those of them moved in a
    windowed einsum's loop."""
    shapes: dict[str, list[tuple[int, int]]] = {}
    texts: dict[str, str] = {}
    for name, shape, opcode, operands, line in common.hlo_instructions(computations[computation]):
        results = shapes[name] = common.hlo_arrays(shape)
        texts[name] = shape
        if opcode in _FREE:
            continue
        if opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", line).group(1)
            trips = times * _trips(computations, line)
            if windowed is not None and _WINDOWED_EINSUM in body:
                loop: collections.Counter = collections.Counter()  # the loop and all it runs
                _computation_bytes(computations, body, trips, loop)
                windowed.update(loop)
                by_opcode.update(loop)
            else:
                _computation_bytes(computations, body, trips, by_opcode, windowed)
            continue
        inputs = [shapes.get(operand, []) for operand in operands]
        if opcode == "slice-start":  # reads the slice from its source
            moved = results[-2][0] if inputs and inputs[0] and inputs[0][0][1] == 0 else 0
        elif opcode == "copy-start":
            moved = sum(b for x in inputs for b, space in x if space == 0)
        elif opcode == "copy-done":
            moved = sum(b for b, space in results[:1] if space == 0)
        elif opcode == "dynamic-update-slice":
            update = sum(b for b, space in inputs[1] if space == 0)
            moved = update + (sum(b for b, _ in inputs[1]) if results[0][1] == 0 else 0)
        else:
            moved = sum(b for b, space in results if space == 0)
            reads = [sum(b for b, space in x if space == 0) for x in inputs]
            if opcode == "fusion":
                moved, reads = _fusion_bytes(computations, line, shape, operands, texts, reads)
            elif opcode == "slice":
                reads = [min(r, _slice_read(line, results)) for r in reads[:1]]
            moved += sum(reads)
        if moved:
            by_opcode[opcode] += moved * times


def _trips(computations, line: str) -> int:
    """How many times the ``while`` of ``line`` runs its body: its ``known_trip_count``, else
    what its condition says for a counter from 0 (``counter < N``, as ``fori_loop`` lowers)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    if known:
        return int(known.group(1))
    condition = computations[re.search(r"condition=%([\w.\-]+)", line).group(1)]
    bound = re.findall(r"constant\((\d+)\)", "\n".join(condition))
    if len(bound) != 1 or not any("direction=LT" in x for x in condition):
        raise ValueError(f"a while loop's trip count is unknown: {line[:200]}")
    return int(bound[0])


def _slice_read(line: str, results: list[tuple[int, int]]) -> int:
    """The HBM bytes a slice reads: what it keeps, or for a strided slice the whole ``(8, 128)``
    tiles that hold its rows (at most 8 rows read per row kept)."""
    kept = sum(b for b, _ in results)
    strided = re.search(r"slice=\{[^}]*\[\d+:\d+:(\d+)\]", line)
    return kept * 8 if strided and int(strided.group(1)) > 1 else kept


def _fusion_bytes(computations, line: str, shape: str, operands, texts, reads):
    """A fusion's HBM bytes written, and read per operand (``reads``: each operand's whole size in
    HBM): an output that is a ``dynamic-update-slice`` writes the update (in its operand's
    buffer, not read); it reads at most the slices it takes (:func:`common.hlo_sliced_reads`, not
    through bitcasts) and, where it does not update in place, at most what
    :func:`common.hlo_capped_reads` allows."""
    body = common.hlo_fused(computations, line)
    results = common.hlo_arrays(shape)
    in_place = common.hlo_in_place_outputs(body)
    written = 0
    for k, (size, space) in enumerate(results):
        update = in_place[k] if len(in_place) == len(results) else None
        if update is not None:
            base, size = update
            reads = [0 if j == base else r for j, r in enumerate(reads)]
        written += size if space == 0 else 0
    sliced = common.hlo_sliced_reads(body, through_bitcasts=False)
    reads = [min(r, sliced.get(k, r)) for k, r in enumerate(reads)]
    if any(in_place):
        return written, reads
    return written, common.hlo_capped_reads(body, shape, operands, texts, reads)


def topology_devices(name: str) -> list:
    """The chips of TPU topology ``name`` (e.g. ``v5e:2x2``, ``v4:2x2x4``), compiled for without a
    TPU: one device per chip, a megacore chip's two TensorCores as one (as JAX runs them)."""
    from jax.experimental import topologies

    options = {"chip_config_name": "megacore"} if name.startswith(_MEGACORE) else {}
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices
    except Exception as error:  # libtpu missing, or a name it does not know
        raise SystemExit(
            f"tpu_compile: no TPU topology {name!r} ({type(error).__name__}: {error}); this needs "
            "libtpu: pip install 'jax[tpu]' gives the version this JAX pins"
        ) from error


def topology_device(name: str):
    """One chip of TPU topology ``name`` (:func:`topology_devices`)."""
    return topology_devices(name)[0]


def compile_update(name: str, shapes, device) -> dict:
    """``name``'s donated update of ``shapes`` compiled for ``device``'s TPU, read by
    :func:`hbm_bytes`."""
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    start = time.perf_counter()
    text = updates.lowered_update(name, shapes, sharding, "tpu").compile().as_text()
    seconds = time.perf_counter() - start
    moved, _ = hbm_bytes(text)
    entry = text[text.index("\nENTRY") :]
    return {
        "optimizer": name,
        "hbm_b_per_param": moved / lm_shapes.count(shapes),
        "fusions": len(re.findall(r" fusion\(", entry)),
        "copies": len(re.findall(r" copy(?:-start)?\(", entry)),
        "compile_s": seconds,
    }


def compile_train_step(files: Sequence[str], bindings: Sequence[str], devices: Sequence) -> dict:
    """The train step of gin config ``files`` + ``bindings`` compiled for ``devices`` (a TPU
    topology's chips, in a mesh as the config's ``make_mesh`` lays it out), read per chip.

    Args:
      files: a run config, e.g. ``runs/pretrain_1b_v4_32.gin``, and any files that override it.
      bindings: gin bindings applied after them (``STEP_REQUIRED`` are added).
      devices: the chips (:func:`topology_devices`).

    Returns:
      ``{"layers", "params", *MEMORY_FIELDS, "total_gib", "hbm_gb", "collective_matmul_gb",
      "compile_s"}``: the model's depth and parameter count, the compiled program's memory per
      chip in GiB (``total_gib``: arguments + outputs - aliased + temporaries + generated code),
      :func:`hbm_bytes` of its entry computation in GB and the part of it in windowed einsum
      loops (:func:`collective_matmul_bytes`), and the seconds lowering and compiling took.
    """
    gin.clear_config()
    try:
        train.parse_gin(files, [*STEP_REQUIRED, *bindings], [])
        trainer = loop.configured_trainer(partitioning.make_mesh(devices=devices))
        start = time.perf_counter()
        with partitioning.axis_rules_context(trainer.mesh, trainer.rules):
            lowered = trainer.train_step.lower(
                trainer.layout.abstract_with_shardings(), trainer.abstract_batch()
            )
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        layers = gin.query_parameter("TransformerConfig.num_layers")
    finally:
        gin.clear_config()
    memory = compiled.memory_analysis()
    row = {k: getattr(memory, field) / GIB for k, field in MEMORY_FIELDS.items()}
    row["total_gib"] = (
        row["argument_gib"] + row["output_gib"] - row["alias_gib"] + row["temp_gib"]
    ) + row["code_gib"]
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(trainer.layout.abstract.params))
    moved, windowed = (sum(c.values()) for c in _step_bytes(compiled.as_text()))
    return {
        "layers": layers,
        "params": params,
        **row,
        "hbm_gb": moved / 1e9,
        "collective_matmul_gb": windowed / 1e9,
        "compile_s": seconds,
    }


def extrapolate(rows: Sequence[dict], layers: int) -> list[dict]:
    """Rows at depth ``layers`` from measured ``rows`` (:func:`compile_train_step`'s, with
    ``optimizer``): for each optimizer measured at two or more depths, every number but
    ``compile_s`` continued linearly in the depth through its two deepest rows.

    Args:
      rows: measured rows.
      layers: the depth to extrapolate to.

    Returns:
      One row per optimizer measured at two depths or more, with ``"extrapolated": True``.
    """
    by_optimizer = collections.defaultdict(list)
    for row in rows:
        by_optimizer[row["optimizer"]].append(row)
    found = []
    for name, measured in by_optimizer.items():
        if len(measured) < 2:
            continue
        low, high = sorted(measured, key=lambda r: r["layers"])[-2:]
        scale = (layers - high["layers"]) / (high["layers"] - low["layers"])
        numbers = [k for k, v in high.items() if isinstance(v, float) and k != "compile_s"]
        found.append(
            {
                "optimizer": name,
                "layers": layers,
                "extrapolated": True,
                "params": round(high["params"] + scale * (high["params"] - low["params"])),
                **{k: high[k] + scale * (high[k] - low[k]) for k in numbers},
            }
        )
    return found


def train_step_rows(args: argparse.Namespace, devices: Sequence, result: dict) -> list[dict]:
    """Compiles ``args.train_step`` for each ``--step_optimizers`` entry and ``--step_layers``
    depth (the JSON at ``args.out`` rewritten after each), then adds :func:`extrapolate`'s rows at
    the config's depth and each row's ``total_vs_adamw``.

    Args:
      args: the parsed flags.
      devices: the topology's chips.
      result: the JSON object, its ``rows`` filled in place.

    Returns:
      ``result["rows"]``.
    """
    rows = result["rows"]
    for name in args.step_optimizers:
        files, bindings = STEP_OPTIMIZERS[name]
        for layers in args.step_layers or [None]:
            depth = [f"TransformerConfig.num_layers = {layers}"] if layers else []
            row = compile_train_step(
                [args.train_step, *files], [*bindings, *depth, *args.gin], devices
            )
            rows.append({"optimizer": name, "extrapolated": False, **row})
            print(
                f"{name}, {row['layers']} layers: {row['total_gib']:.2f} GiB per chip "
                f"({row['compile_s']:.0f} s)",
                flush=True,
            )
            common.write_json(args.out, result)
    rows += extrapolate(rows, _config_layers(args.train_step))
    adamw = {(r["optimizer"], r["layers"]): r["total_gib"] for r in rows}
    for row in rows:
        base = adamw.get(("adamw", row["layers"]))
        row["total_vs_adamw"] = row["total_gib"] / base if base else None
    common.write_json(args.out, result)
    return rows


def _config_layers(gin_file: str) -> int:
    """The model depth ``gin_file`` configures."""
    gin.clear_config()
    try:
        train.parse_gin([gin_file], STEP_REQUIRED, [])
        return gin.query_parameter("TransformerConfig.num_layers")
    finally:
        gin.clear_config()


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_optimizers_arg(
        p,
        updates.OPTIMIZERS,
        "adamw,sonew_diag,sonew_tridiag,sonew_tridiag_pallas,sonew_band4,sonew_band4_pallas",
    )
    lm_shapes.add_args(p, stack_layers=True)
    p.add_argument("--topology", default="v5e:2x2", help="TPU topology compiled for")
    step = p.add_argument_group("train step (--train_step)")
    step.add_argument("--train_step", metavar="GIN_FILE", help="compile this run's train step")
    step.add_argument(
        "--step_optimizers",
        type=lambda text: [n for n in text.split(",") if n],
        default=list(STEP_OPTIMIZERS),
        help=f"comma-separated, of {', '.join(STEP_OPTIMIZERS)}",
    )
    step.add_argument(
        "--step_layers",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="model depths to compile (comma-separated; default: the config's)",
    )
    step.add_argument(
        "--gin", action="append", default=[], help="a gin binding to add (repeatable)"
    )
    p.add_argument("--out", type=pathlib.Path, help="JSON output path")
    args = p.parse_args(argv)
    unknown = sorted(set(args.step_optimizers) - set(STEP_OPTIMIZERS))
    if unknown:
        p.error(f"--step_optimizers: unknown {', '.join(unknown)}")
    name = "tpu_compile_step" if args.train_step else "tpu_compile"
    args.out = args.out or common.RESULTS / f"{name}.json"
    return args


def main_train_step(args: argparse.Namespace) -> dict:
    """The ``--train_step`` mode: prints the table, writes and returns the JSON object."""
    devices = topology_devices(args.topology)
    kind = devices[0].device_kind
    result = {
        "device": f"{len(devices)} x {kind} (compiled without one, on {common.device_name()})",
        "date": common.utc_date(),
        "config": {
            "gin_file": args.train_step,
            "gin": args.gin,
            "topology": args.topology,
            "chips": len(devices),
            "hbm_gib_per_chip": HBM_GIB.get(kind),
            "libtpu": _libtpu_version(),
            **common.run_config(args),
        },
        "rows": [],
    }
    train_step_rows(args, devices, result)
    print(
        f"\n{args.train_step} compiled for {result['device']}, libtpu {result['config']['libtpu']}"
        f"; per chip, of {HBM_GIB.get(kind)} GiB HBM\n"
    )
    print(common.format_table(result["rows"], STEP_COLUMNS))
    return result


def _libtpu_version() -> str:
    """The installed libtpu's version."""
    from importlib import metadata

    return metadata.version("libtpu")


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object (rewritten after
    every optimizer)."""
    args = parse_args(argv)
    if args.train_step:
        return main_train_step(args)
    device = topology_device(args.topology)
    shapes = lm_shapes.from_args(args)
    result = common.lm_set_result(args, lm_shapes.count(shapes), topology=args.topology)
    result["device"] = f"{device.device_kind} (compiled without one, on {result['device']})"
    common.compiled_rows(
        args,
        result,
        lambda name: compile_update(name, shapes, device),
        "hbm_b_per_param",
        "ratio_vs_adamw",
        lambda row: (
            f"{row['optimizer']}: {row['hbm_b_per_param']:.1f} B/param ({row['compile_s']:.0f} s)"
        ),
    )
    print(f"\ncompiled for {device.device_kind}, {result['params'] / 1e6:.1f}M parameters\n")
    print(common.format_table(result["rows"], COLUMNS))
    return result


if __name__ == "__main__":
    main()
