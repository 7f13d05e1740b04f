"""Small helpers shared by the benchmark scripts: flags, device name, date, JSON output, tables,
child processes and plots."""

import argparse
import ast
import collections
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A script's argument parser, described by the first paragraph of its docstring ``doc``."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_out_arg(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out``: the JSON output path, by default ``benchmarks/results/<name>.json``."""
    parser.add_argument(
        "--out", type=Path, default=RESULTS / f"{name}.json", help="JSON output path"
    )


def module_command(name: str) -> list[str]:
    """The command that runs benchmark ``name`` in a fresh process of this interpreter:
    ``python -m benchmarks.<name>`` (from the repository root, as every benchmark runs)."""
    return [sys.executable, "-m", f"{__package__}.{name}"]


def run_shards(name: str, argv: list[str], processes: int, out: Path) -> list[dict]:
    """Benchmark ``name`` split over ``processes`` child processes at once: child ``k`` runs
    ``argv`` with ``--shard k/N --out <out>.shard<k>.json`` on the k-th visible GPU
    (``CUDA_VISIBLE_DEVICES``, else GPUs 0 to N-1), alone on it.

    Args:
      name: the benchmark's module, as `module_command` takes it.
      argv: its flags; a ``--processes`` among them is dropped.
      processes: N.
      out: where the merged result goes; each shard's files (``<out>.shard<k>.*``) are removed
        once its JSON is read.

    Returns:
      The children's JSON results, in shard order.

    Raises:
      ValueError: ``CUDA_VISIBLE_DEVICES`` names fewer than N GPUs.
      RuntimeError: a child failed (its output is above).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(k) for k in range(processes)]
    if len(gpus) < processes:
        raise ValueError(f"--processes {processes}: CUDA_VISIBLE_DEVICES={visible} names fewer")
    shards = [out.with_suffix(f".shard{k}.json") for k in range(processes)]
    command = [*module_command(name), *_without_flag(argv, "--processes")]
    children = [
        subprocess.Popen(
            [*command, "--shard", f"{k}/{processes}", "--out", str(path)],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus[k]},
        )
        for k, path in enumerate(shards)
    ]
    failed = [k for k, child in enumerate(children) if child.wait() != 0]
    if failed:
        raise RuntimeError(f"{name} shards {failed} of {processes} failed (their output above)")
    results = [json.loads(path.read_text()) for path in shards]
    for path in shards:
        for written in path.parent.glob(f"{path.stem}.*"):
            written.unlink()
    return results


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(f"{flag}="):
            out.append(item)
    return out


def shard_arg(text: str) -> tuple[int, int]:
    """An argparse type for ``--shard`` (`run_shards`): ``K/N`` with ``0 <= K < N``."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, got {text!r}")
    return k, n


def float_list(text: str) -> list[float]:
    """An argparse type: a comma-separated list of numbers, maybe empty."""
    return [float(x) for x in text.split(",") if x.strip()]


def add_model_args(
    parser: argparse.ArgumentParser,
    *,
    model: str | None = None,
    dtype: str | None = None,
    layers: bool = False,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> None:
    """Adds the model and batch flags a script uses, with that script's defaults.

    ``parser`` may also be an argument group. A flag is added only when its default is given;
    ``--layers`` (no default: None keeps the config's depth) only when ``layers`` is True.
    """
    if model is not None:
        parser.add_argument("--model", default=model, help="configs/models/<model>.gin, e.g. tiny")
    if dtype is not None:
        parser.add_argument(
            "--dtype", default=dtype, choices=("float32", "bfloat16"), help="compute dtype"
        )
    if layers:
        parser.add_argument("--layers", type=int, help="override the model's number of layers")
    if batch_size is not None:
        parser.add_argument("--batch_size", type=int, default=batch_size, help="global batch size")
    if seq_len is not None:
        parser.add_argument("--seq_len", type=int, default=seq_len, help="tokens per sequence")


def add_optimizers_arg(parser: argparse.ArgumentParser, known: Sequence[str], default: str) -> None:
    """Adds ``--optimizers``: a comma-separated, non-empty subset of ``known`` (parsed to a list;
    else a usage error that names the unknown ones)."""

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = sorted(set(names) - set(known))
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown optimizers {unknown}; choose from {','.join(known)}"
            )
        return names

    parser.add_argument(
        "--optimizers",
        type=parse,
        default=default,
        help=f"comma-separated subset of {','.join(known)}",
    )


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``, else a usage error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def add_timing_args(parser: argparse.ArgumentParser, *, warmup: int, iters: int) -> None:
    """Adds ``--warmup`` and ``--iters`` (untimed, then timed steps) with a script's defaults."""
    parser.add_argument(
        "--warmup", type=int_at_least(0), default=warmup, help="untimed warm-up steps"
    )
    parser.add_argument(
        "--iters", type=int_at_least(1), default=iters, help="timed steps (median reported)"
    )


def add_profile_steps_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--profile_steps N`` (default 0: none): after timing, trace N steps with ``jax.profiler``
    (``device_trace.trace_steps``) and report ``what``."""
    parser.add_argument(
        "--profile_steps",
        type=int_at_least(0),
        default=0,
        help=f"after timing, trace this many steps with jax.profiler and {what}",
    )


def parse_tiles(text: str) -> list[tuple[int, int, int]]:
    """An argparse type: ``RxCxW,...``, tiles of ``(rows, cols, num_warps)``, powers of 2
    (Triton's block shapes and warp counts)."""
    tiles = []
    for tile in text.split(","):
        parts = tile.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"tile {tile!r} is not rows x cols x warps")
        values = tuple(int(p) for p in parts)
        if any(v & (v - 1) for v in values):
            raise argparse.ArgumentTypeError(f"tile {tile!r}: every number must be a power of 2")
        tiles.append(values)
    return tiles


def _kernel_override(text: str) -> tuple[str, Any]:
    """``--kernel FIELD=VALUE``: a field of ``optim.KernelConfig`` and its value, a Python literal
    of the field's type (``banded_tile=(64,64,2)``, ``banded_min_rows=16``)."""
    from sonew_pax.optim import kernels  # lazy: autoencoder.py keeps the optimizer optional

    name, sep, value = text.partition("=")
    fields = {f.name for f in dataclasses.fields(kernels.KernelConfig)}
    if not sep or name not in fields:
        raise argparse.ArgumentTypeError(
            f"expected FIELD=VALUE with FIELD one of optim.KernelConfig's {sorted(fields)}, "
            f"got {text!r}"
        )
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError) as err:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a Python literal") from err
    current = getattr(kernels.DEFAULT, name)
    if type(parsed) is not type(current):
        raise argparse.ArgumentTypeError(
            f"{name} is a {type(current).__name__}, got {value!r} ({type(parsed).__name__})"
        )
    return name, parsed


def add_kernel_arg(parser: argparse.ArgumentParser) -> None:
    """``--kernel FIELD=VALUE`` (repeatable): fields of the ``optim.KernelConfig`` every SONew
    optimizer of the run is built with (:func:`kernel_config`), as ``args.kernel``, a list of
    ``(field, value)`` pairs; results record them (:func:`lm_set_result`)."""
    parser.add_argument(
        "--kernel",
        type=_kernel_override,
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a field of sonew_pax.optim.KernelConfig for the whole run (repeatable), e.g. "
        "--kernel banded_min_rows=16 --kernel 'banded_tile=(64,64,2)'; recorded in "
        "config.kernel",
    )


def kernel_config(args: argparse.Namespace):
    """The ``optim.KernelConfig`` of ``--kernel`` and ``--concurrent``."""
    from sonew_pax.optim import kernels

    fields = dict(getattr(args, "kernel", []))
    if getattr(args, "concurrent", False):
        fields["concurrent"] = True
    return dataclasses.replace(kernels.DEFAULT, **fields)


def kernel_argv(args: argparse.Namespace) -> list[str]:
    """The ``--kernel`` flags that give a child process the same configuration."""
    return [arg for name, value in args.kernel for arg in ("--kernel", f"{name}={value!r}")]


def add_concurrent_arg(parser: argparse.ArgumentParser) -> None:
    """``--concurrent``: compile every row's step so that XLA may run its independent GPU kernels
    at the same time (``kernels.CONCURRENT_OPTIONS``, :func:`jit_for`) and build SONew with
    ``KernelConfig(concurrent=True)`` (bands >= 2 walk longer chunks), as ``args.concurrent``;
    :func:`lm_set_result` records it."""
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="compile each optimizer's step with XLA's concurrent command-buffer scheduling "
        "(that executable alone, AdamW's too) and SONew's kernels configured for it",
    )


def compiler_options(args: argparse.Namespace) -> dict | None:
    """The compile options of ``--concurrent`` (``None`` without it)."""
    from sonew_pax.optim import kernels

    return dict(kernels.CONCURRENT_OPTIONS) if getattr(args, "concurrent", False) else None


def jit_for(args: argparse.Namespace) -> Callable:
    """``jax.jit`` with :func:`compiler_options`."""
    return functools.partial(jax.jit, compiler_options=compiler_options(args))


def run_config(args: argparse.Namespace) -> dict:
    """What every timing ran under, for a result's config: ``--concurrent``, JAX's version,
    ``XLA_FLAGS`` and the ``--kernel`` fields (where any)."""
    return {
        "concurrent": getattr(args, "concurrent", False),
        "jax": jax.__version__,
        "xla_flags": xla_flags(),
        **(
            {"kernel": {k: repr(v) for k, v in args.kernel}}
            if getattr(args, "kernel", None)
            else {}
        ),
    }


def lm_set_result(args: argparse.Namespace, params: int, **config: Any) -> dict:
    """A result of the LM-set benchmarks (``lm_shapes.add_args``, ``add_kernel_arg``) with no rows
    yet: the device, date, parameter count and a config of the set's ``--scale`` and ``--layers``,
    the script's own ``config`` and :func:`run_config`."""
    return {
        "device": device_name(),
        "date": utc_date(),
        "params": params,
        "config": {
            "scale": args.scale,
            "layers": args.layers,
            "stack_layers": getattr(args, "stack_layers", False),
            **config,
            **run_config(args),
        },
        "rows": [],
    }


def device_name() -> str:
    """A readable name of the default device, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu'."""
    device = jax.devices()[0]
    return getattr(device, "device_kind", device.platform)


def xla_flags() -> str | None:
    """``XLA_FLAGS`` as this process runs under it (``None`` if unset): results record it, since
    flags such as ``--xla_gpu_command_buffer_scheduling_mode`` change the device's timings."""
    return os.environ.get("XLA_FLAGS") or None


def code_fingerprint(root: Path = ROOT) -> str:
    """12 hex digits of a SHA-256 over the library's source and gin files (``sonew_pax/`` and
    ``configs/``, paths and contents): the code a step program is built from. Results record it
    so that step times measured on different code are not compared (a change to the model's step
    changes every optimizer's time, so ratios across it would mix two programs)."""
    digest = hashlib.sha256()
    files = [*root.glob("sonew_pax/**/*.py"), *root.glob("configs/**/*.gin")]
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def utc_date() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Writes `text` atomically (temporary file, then rename), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_json(path: str | os.PathLike, obj) -> Path:
    """Writes `obj` as indented JSON, atomically."""
    return write_text(path, json.dumps(obj, indent=2) + "\n")


def compiled_rows(
    args: argparse.Namespace,
    result: dict,
    row_of: Callable[[str], dict],
    key: str,
    ratio_key: str,
    line: Callable[[dict], str],
) -> dict:
    """``result`` with a row ``row_of(name)`` for each of ``args.optimizers`` (each printed as
    ``line(row)``; the JSON at ``args.out`` rewritten after each, so a run cut short keeps what it
    measured), then each row's ``ratio_key``: its ``key`` over AdamW's row's, ``None`` without
    one (the compile-only benchmarks' loop)."""
    for name in args.optimizers:
        row = row_of(name)
        result["rows"].append(row)
        print(line(row), flush=True)
        write_json(args.out, result)
    adamw = {r["optimizer"]: r for r in result["rows"]}.get("adamw")
    for row in result["rows"]:
        row[ratio_key] = row[key] / adamw[key] if adamw else None
    write_json(args.out, result)
    return result


def _cell(value) -> str:
    """One table cell: floats with 3 decimals (3 significant digits below 1), None as '-', lists
    as their cells joined by ' / '."""
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return " / ".join(_cell(v) for v in value)
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"
    return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str], markdown: bool = False) -> str:
    """Rows (dicts) as an aligned text table, or a GitHub markdown table if `markdown`."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells]) + "\n"
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines) + "\n"


# JAX's duration events of a jit's compile, by the column they add to (`compile_seconds`).
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}


@contextlib.contextmanager
def compile_seconds():
    """Sums the seconds JAX spends tracing, lowering and compiling (XLA's passes, code generation,
    autotuning) inside the ``with``, from ``jax.monitoring``'s duration events: yields a dict
    ``{"trace_s", "lower_s", "compile_s"}`` filled as they happen. What a first call takes beyond
    them is the program's first run (loading its kernels, the allocator's first growth)."""
    totals = dict.fromkeys(COMPILE_EVENTS.values(), 0.0)

    def listen(event: str, seconds: float, **kwargs: Any) -> None:
        if event in COMPILE_EVENTS:
            totals[COMPILE_EVENTS[event]] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield totals
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def time_steps(step: Callable, carry, warmup: int, iters: int) -> tuple[float, list[float], object]:
    """Times ``carry = step(carry)`` (a jitted, donating step): median ms, every run's ms, carry.

    ``warmup`` untimed calls first (compilation, allocator), then ``iters`` calls each timed on the
    host clock around the call and ``jax.block_until_ready`` of its result.
    """
    for _ in range(warmup):
        carry = jax.block_until_ready(step(carry))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), times, carry


def time_dispatch(step: Callable, carry, iters: int) -> tuple[float, object]:
    """Median ms the host spends in ``carry = step(carry)`` before the call returns (the device
    still running the step), each call waited on before the next: the host's cost per step, which
    bounds a pipelined loop when it exceeds the device's. Returns ``(ms, carry)``."""
    times = []
    for _ in range(iters):
        carry = jax.block_until_ready(carry)
        start = time.perf_counter()
        carry = step(carry)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), jax.block_until_ready(carry)


def time_pipelined(step: Callable, carry, iters: int) -> tuple[float, object]:
    """Mean ms per step of ``iters`` calls of ``carry = step(carry)`` dispatched back to back and
    waited on once, at the end: the throughput of a loop whose host does not wait for each step
    (``Trainer.train`` waits only for the previous step's metrics), where the host's dispatch
    overlaps the device's work. Returns ``(ms, carry)``."""
    carry = jax.block_until_ready(carry)
    start = time.perf_counter()
    for _ in range(iters):
        carry = step(carry)
    carry = jax.block_until_ready(carry)
    return 1e3 * (time.perf_counter() - start) / iters, carry


def launch_counts(hlo_text: str) -> dict[str, int]:
    """Kernel launches in a compiled program's entry computation: fusions, custom calls (such as
    the Pallas kernels) and copies, and their sum ``kernels`` (each launch costs a few
    microseconds, and a copy a pass over its bytes)."""
    entry = hlo_text[hlo_text.index("ENTRY") :]
    counts = {
        kind: len(re.findall(rf"^\s*%\S+ = .*? {op}\(", entry, re.MULTILINE))
        for kind, op in (("fusions", "fusion"), ("custom_calls", "custom-call"), ("copies", "copy"))
    }
    counts["kernels"] = sum(counts.values())
    return counts


# Reading compiled HLO text (``compile_profile.py``'s and ``tpu_compile.py``'s byte counts).
HLO_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
HLO_ITEM_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
HLO_ARRAY = re.compile(r"\b(" + "|".join(HLO_ITEM_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_HLO_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z\-]*)\((.*)$")
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ", re.MULTILINE)


def hlo_arrays(text: str) -> list[tuple[int, int]]:
    """``(bytes, memory space)`` of every array in an HLO shape's ``text`` (a tuple's in order);
    the memory space is the layout's ``S(n)`` (a TPU's VMEM is 1), 0 (device memory) without
    one."""
    found = []
    for dtype, dims, layout in HLO_ARRAY.findall(text):
        size = HLO_ITEM_BYTES[dtype]
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        space = re.search(r"S\((\d+)\)", layout)
        found.append((size, int(space.group(1)) if space else 0))
    return found


def hlo_computations(text: str) -> dict[str, list[str]]:
    """A module's computations by name: their instruction lines."""
    starts = [(m.start(), m.group(1)) for m in _HLO_COMPUTATION.finditer(text)]
    ends = [s for s, _ in starts[1:]] + [len(text)]
    return {name: text[s:e].splitlines()[1:] for (s, name), e in zip(starts, ends, strict=True)}


def hlo_entry(text: str) -> str:
    """The name of a module's entry computation."""
    return re.search(r"^ENTRY %([\w.\-]+) ", text, re.MULTILINE).group(1)


def hlo_instructions(lines: list[str]) -> list[tuple[str, str, str, list[str], str]]:
    """``(name, shape, opcode, operands, line)`` of each instruction line."""
    found = []
    for line in lines:
        match = _HLO_INSTRUCTION.match(line)
        if match:
            name, shape, opcode, rest = match.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            found.append((name, shape, opcode, operands, line))
    return found


def hlo_fused(computations: dict[str, list[str]], line: str) -> list[tuple]:
    """The :func:`hlo_instructions` of the computation a fusion's ``line`` calls."""
    return hlo_instructions(computations[re.search(r"calls=%([\w.\-]+)", line).group(1)])


# Instructions that launch nothing and move no data of their own.
HLO_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier"}
# Fused instructions after which a launch may read more than one element of an operand per
# element it writes (reductions, matrix products, scatters, sorts, calls), so its reads are not
# bounded by its results' size.
_HLO_MANY_TO_ONE = ("reduce", "dot", "convolution", "scatter", "sort", "custom-call", "fft")
_HLO_MANY_TO_ONE += ("select-and-scatter", "while", "conditional", "call")


def hlo_max_elements(text: str) -> int:
    """The most elements of any array in an HLO shape's ``text``."""
    return max(
        (math.prod(int(d) for d in dims.split(",") if d) for _, dims, _ in HLO_ARRAY.findall(text)),
        default=1,
    )


def hlo_item_bytes(text: str) -> int:
    """The widest element, in bytes, of the arrays in an HLO shape's ``text`` (0: none)."""
    return max((HLO_ITEM_BYTES[dtype] for dtype, _, _ in HLO_ARRAY.findall(text)), default=0)


def hlo_capped_reads(
    body: list[tuple], shape: str, operands: list[str], shapes: dict[str, str], reads: list[int]
) -> list[int]:
    """A fusion's ``reads`` (bytes, per operand) capped at one operand element per result element
    where its fused computation ``body`` computes each result element from one element of each
    operand (XLA's loop fusions compute only their results' elements: a fused slice of a
    product reads what it keeps); unchanged where a reduction, matrix product, scatter or call
    is fused. ``shape``: the fusion's result shape; ``shapes``: its operands' by name."""
    if any(instruction[2].startswith(_HLO_MANY_TO_ONE) for instruction in body):
        return reads
    elements = hlo_max_elements(shape)
    return [
        min(read, hlo_item_bytes(shapes.get(operand, "")) * elements)
        for operand, read in zip(operands, reads, strict=True)
    ]


def hlo_sliced_reads(fused: list[tuple], through_bitcasts: bool = True) -> dict[int, int]:
    """For a fused computation (its :func:`hlo_instructions`): the bytes it reads of each
    parameter that only slices use (the slices' sizes), directly or, ``through_bitcasts``, also
    through bitcasts of it; parameters read whole are absent."""
    users = collections.defaultdict(list)
    for name, shape, opcode, operands, _ in fused:
        for operand in operands:
            users[operand].append((name, shape, opcode))

    def sliced(name: str) -> int | None:
        total = 0
        for user, shape, opcode in users[name]:
            if opcode in ("slice", "dynamic-slice"):
                total += sum(b for b, _ in hlo_arrays(shape))
            elif through_bitcasts and opcode == "bitcast" and (inner := sliced(user)) is not None:
                total += inner
            else:
                return None
        return total

    params = {
        name: int(re.search(r"parameter\((\d+)\)", line).group(1))
        for name, _, opcode, _, line in fused
        if opcode == "parameter"
    }
    reads = {params[name]: sliced(name) for name in params}
    return {k: read for k, read in reads.items() if read is not None}


def hlo_launch_bytes(
    computations: dict[str, list[str]],
    shapes: dict[str, str],
    instruction: tuple[str, str, str, list[str], str],
    in_place: bool = False,
) -> int:
    """The bytes one launch moves (:func:`hlo_traffic`'s rule): its outputs and its operands
    (their HLO shapes in ``shapes``, by name), a fusion's operand read only through slices at
    the slices' size, and a fusion that computes each result element from one element of each
    operand (no reduction, matrix product, scatter or call inside: XLA's loop fusions, whose
    threads compute only their results' elements) reading at most one operand element per
    result element; with ``in_place``, a fusion rooted in a dynamic-update-slice (which XLA runs
    in the buffer it updates) at the update it writes, the updated operand unread."""
    _, shape, opcode, operands, line = instruction
    sizes = [_hlo_bytes(shapes.get(operand, "")) for operand in operands]
    written = _hlo_bytes(shape)
    if opcode == "fusion":
        body = hlo_fused(computations, line)
        sliced = hlo_sliced_reads(body)
        sizes = [sliced.get(k, size) for k, size in enumerate(sizes)]
        update = hlo_in_place_update(body) if in_place else None
        if update is not None:
            base, written = update
            sizes = [0 if k == base else size for k, size in enumerate(sizes)]
        else:
            sizes = hlo_capped_reads(body, shape, operands, shapes, sizes)
    return written + sum(sizes)


def _hlo_bytes(text: str) -> int:
    """The bytes of the arrays of an HLO shape's ``text``, any memory space."""
    return sum(b for b, _ in hlo_arrays(text))


def hlo_in_place_update(body: list[tuple]) -> tuple[int | None, int] | None:
    """For a fused computation whose root is a ``dynamic-update-slice``: the index of the
    parameter it updates (None if not a parameter) and the bytes of the update; else None."""
    outputs = hlo_in_place_outputs(body)
    return outputs[0] if len(outputs) == 1 else None


def hlo_in_place_outputs(body: list[tuple]) -> list[tuple[int | None, int] | None]:
    """For each output of a fused computation (its root, or each element of a root ``tuple``):
    where it is a ``dynamic-update-slice`` (which XLA runs in the buffer it updates), the index
    of the parameter it updates (None if not a parameter) and the bytes of the update; else
    None."""
    by_name = {i[0]: i for i in body}
    roots = [i for i in body if i[4].lstrip().startswith("ROOT")]
    if not roots:
        return []
    outputs = [by_name[x] for x in roots[0][3]] if roots[0][2] == "tuple" else roots[:1]
    found = []
    for _, _, opcode, operands, _ in outputs:
        if opcode != "dynamic-update-slice":
            found.append(None)
            continue
        base, update = operands[:2]
        index = re.search(r"parameter\((\d+)\)", by_name[base][4] if base in by_name else "")
        written = sum(b for b, _ in hlo_arrays(by_name[update][1] if update in by_name else ""))
        found.append(((int(index.group(1)) if index else None), written))
    return found


def hlo_traffic(hlo_text: str) -> int:
    """An estimate of the bytes a compiled program's launches move through device memory: per
    fusion, custom call (such as a Pallas kernel) or other data-moving instruction of the entry
    computation, its outputs and its operands, except that a fusion reads an operand used only
    through slices at the slices' size (a few rows of an edge, not the whole array) and, where
    it computes each result element from one element of each operand, at most its results'
    size (:func:`hlo_launch_bytes`). A custom call counts all its operands, which bounds what a
    kernel reads from above. Caches, and operands read at several offsets, are not modelled: a
    count of the design's passes, for comparing designs without a device.
    (``tpu_compile.hbm_bytes`` is a TPU's: it keeps VMEM out.)"""
    computations = hlo_computations(hlo_text)
    shapes: dict[str, str] = {}
    total = 0
    for instruction in hlo_instructions(computations[hlo_entry(hlo_text)]):
        name, shape, opcode = instruction[:3]
        shapes[name] = shape
        if opcode not in HLO_NO_TRAFFIC:
            total += hlo_launch_bytes(computations, shapes, instruction)
    return total


def pyplot(hint: str = ""):
    """matplotlib's ``pyplot`` drawing to files (the Agg backend), or None where matplotlib, the
    ``[bench]`` extra, is missing: then a line on stdout says so (and ``hint``)."""
    try:
        import matplotlib
    except ImportError:
        extra = f"; {hint}" if hint else ""
        print(f"matplotlib missing: no plot (pip install -e '.[bench]'){extra}", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
