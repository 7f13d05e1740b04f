"""An update's lowering for a GPU: the host's seconds, and how many Triton programs it asks for.

A first step on a GPU traces the update, lowers it to StableHLO (Pallas lowers each kernel launch to
a Triton module) and compiles it; XLA compiles every distinct Triton module once. SONew's kernels
therefore make a first step slow in two ways: the host's tracing and lowering, and one Triton
compile per distinct program (long for the banded walk: ``KernelConfig.max_banded_group``).
Neither needs a GPU to count: JAX lowers for CUDA on any machine
(``Traced.lower(lowering_platforms=("cuda",))``), so this also runs on a CPU, with SONew's
compiled kernel path forced (``KernelConfig(interpret=False)``, not Pallas' interpreter, as
``tests/test_kernels.py::test_kernels_lower_to_triton_for_cuda`` does). Nothing is allocated: the
update is traced on abstract arrays, so the full 335M-parameter set lowers on a laptop.

Per optimizer (each with empty tracing caches): ``trace_s`` (Python tracing to a jaxpr, the
Pallas kernels' bodies included), ``lower_s`` (to StableHLO, the kernels to Triton IR), the
module's size, ``launches`` (Triton calls in the update), ``programs`` (distinct Triton
modules among them, what XLA compiles), also per kernel name, and ``triton_mb`` (their bytecode's
size, in MB: what Triton compiles). On a GPU, ``compile_cache``
times the compile itself.

Output: a table, and ``--out`` (default ``benchmarks/results/lowering.json``) ``{"device",
"date", "params", "config", "rows": [{"optimizer", "trace_s", "lower_s", "mlir_mb", "launches",
"programs", "triton_mb", "programs_by_kernel"}]}``.

Usage: ``python -m benchmarks.lowering [--optimizers sonew_band4_lag_pallas] [--layers 24]``.
"""

import argparse
import collections
import dataclasses
import functools
import re
import time

import jax

from benchmarks import common, lm_shapes, updates
from sonew_pax.optim.kernels import halo, launch

COLUMNS = (
    "optimizer",
    "trace_s",
    "lower_s",
    "mlir_mb",
    "launches",
    "programs",
    "triton_mb",
    "kernels",
)
# A function of the lowered module (its name), and a call of one.
_FUNCTION = re.compile(r"func\.func (?:public |private )?@(\w+)\(")
_CALL = re.compile(r"\bcall @(\w+)\(")


def triton_programs(text: str) -> tuple[int, dict[str, set[str]]]:
    """In a lowered module's ``text``: how many Triton kernels it launches, and per kernel name
    the set of its distinct Triton modules (JAX emits a function per distinct lowering, called
    from each launch, maybe through other functions)."""
    starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(text)]
    ends = [s for s, _ in starts[1:]] + [len(text)]
    bodies = {name: text[start:end] for (start, name), end in zip(starts, ends, strict=True)}
    calls = {name: collections.Counter(_CALL.findall(body)) for name, body in bodies.items()}

    @functools.cache
    def times(name: str) -> int:
        """How often function ``name`` runs in one run of the module (``main``)."""
        if name == "main":
            return 1
        return sum(n[name] * times(caller) for caller, n in calls.items() if name in n)

    launches, programs = 0, collections.defaultdict(set)
    for name, body in bodies.items():
        kernels = re.findall(r'ir = "((?:[^"\\]|\\.)*)".*?name = "(\w+)"', body)
        launches += len(kernels) * times(name)
        for ir, kernel in kernels:
            programs[kernel].add(ir)
    return launches, programs


def _bytes(ir: str) -> int:
    """The length of a Triton module's bytecode, from its escaped form in the module's text."""
    return len(re.sub(r"\\[0-9A-Fa-f]{2}|\\.", "x", ir))


def lower(name: str, shapes, args: argparse.Namespace) -> dict:
    """``name``'s donated update of the LM set's ``shapes`` (``updates.make_update``, jitted
    by ``common.jit_for``), lowered for CUDA."""
    launch.step_call.cache_clear()
    halo.halo_call.cache_clear()
    jax.clear_caches()
    tx = updates.make_optimizer(
        name, dataclasses.replace(common.kernel_config(args), interpret=False)
    )
    update = updates.make_update(tx, common.jit_for(args))
    state = jax.eval_shape(tx.init, shapes)
    start = time.perf_counter()
    traced = update.trace(shapes, state, shapes)
    traced_at = time.perf_counter()
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    lowered_at = time.perf_counter()
    launches, programs = triton_programs(text)
    return {
        "optimizer": name,
        "trace_s": traced_at - start,
        "lower_s": lowered_at - traced_at,
        "mlir_mb": len(text.encode()) / 1e6,
        "launches": launches,
        "programs": sum(map(len, programs.values())),
        "triton_mb": sum(_bytes(ir) for irs in programs.values() for ir in irs) / 1e6,
        "programs_by_kernel": {k: len(v) for k, v in sorted(programs.items())},
    }


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_optimizers_arg(
        p, updates.OPTIMIZERS, "adamw,sonew_tridiag_lag_pallas,sonew_band4_lag_pallas"
    )
    lm_shapes.add_args(p)
    common.add_kernel_arg(p)
    common.add_concurrent_arg(p)
    common.add_out_arg(p, "lowering")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object (rewritten after
    every optimizer, so a run cut short keeps what it measured)."""
    args = parse_args(argv)
    shapes = lm_shapes.from_args(args)
    result = common.lm_set_result(args, lm_shapes.count(shapes), platform="cuda")
    for name in args.optimizers:
        row = lower(name, shapes, args)
        result["rows"].append(row)
        print(f"{name}: lowered in {row['trace_s'] + row['lower_s']:.1f} s", flush=True)
        common.write_json(args.out, result)
    rows = [
        {**r, "kernels": " ".join(f"{k}:{n}" for k, n in r["programs_by_kernel"].items())}
        for r in result["rows"]
    ]
    print(f"\nlowered for CUDA on {result['device']}, {result['params'] / 1e6:.1f}M parameters\n")
    print(common.format_table(rows, COLUMNS))
    return result


if __name__ == "__main__":
    main()
