"""An update compiled for a TPU on any host: the HBM bytes its schedule moves, against AdamW's.

TPUs run SONew's XLA path by default (the ``sonew_*`` rows), or with ``implementation="pallas"``
band 1 as a Mosaic kernel (``kernels.tpu``; the ``_pallas`` rows compile it), and the update is
memory-bound, so its time follows the bytes it moves through HBM. libtpu compiles for a TPU
topology without a TPU (``jax.experimental.topologies``: "deviceless" compilation), so this runs on
a CPU host: for each optimizer it compiles the donated update of the LM set (``updates``,
``lm_shapes``) on abstract arrays on one chip of ``--topology``, and reads the compiled module:

* ``hbm_b_per_param``: the bytes the top-level instructions read from and write to HBM (memory
  space 0; operands and results that XLA's memory-space assignment put in VMEM are free), per
  parameter (:func:`hbm_bytes`). AdamW's floor is 28 (fp32: ``g``, ``m``, ``v``, ``p`` read, ``m``,
  ``v``, ``p`` written); the compiler's own ``cost_analysis()`` counts VMEM traffic too, so it is
  not used;
* ``ratio_vs_adamw``: that against AdamW's, compiled the same way: what a TPU's update time would
  be relative to AdamW's if both ran at the same bandwidth;
* ``fusions``, ``copies`` (``copy`` and ``copy-start``): launches and layout or memory-space moves.

Needs libtpu (``pip install 'jax[tpu]'`` gives the version this JAX pins); nothing is allocated.

Output: a table, and ``--out`` (default ``benchmarks/results/tpu_compile.json``) ``{"device",
"date", "params", "config", "rows": [{"optimizer", "hbm_b_per_param", "ratio_vs_adamw",
"fusions", "copies", "compile_s"}]}``.

Usage: ``python -m benchmarks.tpu_compile [--topology v5e:2x2] [--optimizers adamw,sonew_tridiag]``.
"""

import argparse
import collections
import math
import re
import time

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import common, lm_shapes, updates

COLUMNS = ("optimizer", "hbm_b_per_param", "ratio_vs_adamw", "fusions", "copies", "compile_s")
# Instructions that move no data of their own (aliases, views, bookkeeping): the async slice's and
# copy's second halves are counted at their starts (reads) and ends (writes).
_FREE = common.HLO_NO_TRAFFIC | {"after-all", "slice-done", "partition-id", "replica-id"}


def _elements(text: str) -> int:
    """The most elements of any array in an HLO shape's ``text``."""
    return max(
        (
            math.prod(int(d) for d in dims.split(",") if d)
            for _, dims, _ in common.HLO_ARRAY.findall(text)
        ),
        default=1,
    )


def _reduces(instructions: list) -> bool:
    """Whether a fused computation (its :func:`common.hlo_instructions`) reduces (then it reads its
    operands whole, whatever its results' size)."""
    return any(opcode.startswith("reduce") for _, _, opcode, _, _ in instructions)


def hbm_bytes(text: str) -> tuple[int, collections.Counter]:
    """The bytes a compiled TPU module's entry computation moves through HBM, in all and by
    opcode: each instruction's operands and results in memory space 0, an operand that its
    fusion only slices counted at the slices' size (a slice's at what it keeps,
    :func:`_slice_read`), an async copy's or slice's read at its start and its write at its end."""
    computations = common.hlo_computations(text)
    entry = common.hlo_entry(text)
    shapes: dict[str, list[tuple[int, int]]] = {}
    texts: dict[str, str] = {}
    by_opcode: collections.Counter = collections.Counter()
    for name, shape, opcode, operands, line in common.hlo_instructions(computations[entry]):
        results = shapes[name] = common.hlo_arrays(shape)
        texts[name] = shape
        if opcode in _FREE:
            continue
        inputs = [shapes.get(operand, []) for operand in operands]
        if opcode == "slice-start":  # reads the slice from its source
            moved = results[-2][0] if inputs and inputs[0] and inputs[0][0][1] == 0 else 0
        elif opcode == "copy-start":
            moved = sum(b for x in inputs for b, space in x if space == 0)
        elif opcode == "copy-done":
            moved = sum(b for b, space in results[:1] if space == 0)
        else:
            moved = sum(b for b, space in results if space == 0)
            reads = [sum(b for b, space in x if space == 0) for x in inputs]
            if opcode == "fusion":
                reads = _fusion_reads(computations, line, shape, operands, texts, reads)
            elif opcode == "slice":
                reads = [min(r, _slice_read(line, results)) for r in reads[:1]]
            moved += sum(reads)
        if moved:
            by_opcode[opcode] += moved
    return sum(by_opcode.values()), by_opcode


def _slice_read(line: str, results: list[tuple[int, int]]) -> int:
    """The HBM bytes a slice reads: what it keeps, or for a strided slice the whole ``(8, 128)``
    tiles that hold its rows (at most 8 rows read per row kept)."""
    kept = sum(b for b, _ in results)
    strided = re.search(r"slice=\{[^}]*\[\d+:\d+:(\d+)\]", line)
    return kept * 8 if strided and int(strided.group(1)) > 1 else kept


def _fusion_reads(computations, line: str, shape: str, operands, texts, reads) -> list[int]:
    """A fusion's HBM reads per operand (``reads``: each operand's whole size in HBM), at most the
    slices it takes (:func:`common.hlo_sliced_reads`, not through bitcasts) and, where it does
    not reduce, at most one element per result element (it computes only its results' elements:
    a fused slice reads only what it keeps)."""
    body = common.hlo_fused(computations, line)
    sliced = common.hlo_sliced_reads(body, through_bitcasts=False)
    reads = [min(r, sliced.get(k, r)) for k, r in enumerate(reads)]
    if _reduces(body):
        return reads
    elements = _elements(shape)
    capped = []
    for operand, read in zip(operands, reads, strict=True):
        text = texts.get(operand, "")
        item = max(
            (common.HLO_ITEM_BYTES[dtype] for dtype, _, _ in common.HLO_ARRAY.findall(text)),
            default=0,
        )
        capped.append(min(read, item * elements))
    return capped


def topology_device(name: str):
    """One chip of TPU topology ``name`` (e.g. ``v5e:2x2``), compiled for without a TPU."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu").devices[0]
    except Exception as error:  # libtpu missing, or a name it does not know
        raise SystemExit(
            f"tpu_compile: no TPU topology {name!r} ({type(error).__name__}: {error}); this needs "
            "libtpu: pip install 'jax[tpu]' gives the version this JAX pins"
        ) from error


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


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_optimizers_arg(
        p,
        updates.OPTIMIZERS,
        "adamw,sonew_diag,sonew_tridiag,sonew_tridiag_pallas,sonew_band4,sonew_band4_pallas",
    )
    lm_shapes.add_args(p, stack_layers=True)
    p.add_argument("--topology", default="v5e:2x2", help="TPU topology compiled for (one chip)")
    common.add_out_arg(p, "tpu_compile")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object (rewritten after
    every optimizer)."""
    args = parse_args(argv)
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
