"""Where an update's compile time goes: the compiler's phases, per optimizer, against AdamW's.

A train step's first call compiles it, and the optimizer's update is part of that program, so an
optimizer's compile time is part of every run's start (``train_step.py``'s ``first_step_s``). For
each optimizer this compiles the donated update of the LM set (``updates``, ``lm_shapes``) under
the profiler, and sums the host's trace events of XLA's GPU compiler by name:

* ``compile_s``: the whole ``.compile()``;
* ``hlo_passes_s`` (``OptimizeHloModule``), of which ``fusion_pass_s`` (``priority-fusion``: it
  re-costs a fusion each time it grows, so a fusion of many operations or operands costs the
  square of their number);
* ``codegen_s`` (``CompileToBackendResult``: LLVM, the Triton kernels' lowering and PTX), of
  which ``ptxas_s`` (``PTX->CUBIN``);
* ``autotune_s`` (``config-assigner``: tile configurations of Triton-emitted fusions, timed on
  the device; absent where nothing is tuned or there is no device);
* ``unattributed_s``: ``compile_s`` less the three phases above that do not nest. The profiler
  keeps a bounded number of host events, and a large program's compile (the XLA path of the
  full LM set) records past it, so its last phases (code generation) go missing: then this
  column holds them;
* ``fusions`` and ``custom_calls`` (the Pallas kernels' launches; ``lowering.py`` counts the
  distinct Triton programs among them, each lowered and compiled once);
* ``hlo_bytes_per_param``: the bytes the compiled update's launches read and write per parameter
  (``common.hlo_traffic``: each launch's operands and outputs, an operand read through slices
  counting the slices), AdamW's 28: the design's passes and temporaries, which bound an
  update's device time (memory-bound) before any GPU runs it. ``None`` for programs with custom
  calls: what a Pallas kernel reads of an operand (a few halo rows, or all of it) is not in the
  HLO.

``--gpu_target_config`` compiles for a GPU described by a ``GpuTargetConfigProto`` in text form
(what ``XLA_FLAGS=--xla_dump_to=DIR`` writes as ``*.gpu_target_config.pbtxt`` on a GPU machine;
``benchmarks/targets/`` keeps an H200's) on any host with JAX's CUDA plugin (``pip install
'jax[cuda12]'``) and no GPU (with no driver either, set ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` and
``JAX_PLATFORMS=cpu``: the plugin then skips its driver check and still compiles for the
target): every phase but autotuning runs on the host's CPUs, so the times are the host's.
Without it, the update compiles for the first local device. The rows compile in one process,
in the order given: what XLA caches in a process (autotuning results; a Triton kernel whose IR
another row compiled) is then cheaper for the later rows, as in a training script that compiles
its train step after another program.

Output: a table, and ``--out`` (default ``benchmarks/results/compile_profile.json``) ``{"device",
"date", "params", "config", "rows": [{"optimizer", "compile_s", "compile_ratio_vs_adamw", ...}]}``.

Usage: ``python -m benchmarks.compile_profile [--optimizers adamw,sonew_tridiag_pallas]
[--gpu_target_config benchmarks/targets/h200.pbtxt]``.
"""

import argparse
import tempfile
import time
from pathlib import Path

import jax

from benchmarks import common, device_trace, lm_shapes, updates

# Output column -> the compiler's trace event whose durations it sums.
PHASES = {
    "hlo_passes_s": "OptimizeHloModule",
    "fusion_pass_s": "priority-fusion",
    "codegen_s": "CompileToBackendResult",
    "ptxas_s": "PTX->CUBIN",
    "autotune_s": "config-assigner",
}
COLUMNS = (
    "optimizer",
    "compile_s",
    "compile_ratio_vs_adamw",
    *PHASES,
    "unattributed_s",
    "fusions",
    "custom_calls",
    "hlo_bytes_per_param",
)


def target_device(config_path: str | None):
    """The device compiled for: a compile-only GPU described by the target config at
    ``config_path`` (module docstring), or the first local device."""
    if config_path is None:
        return jax.devices()[0]
    from jax.experimental import topologies

    text = Path(config_path).read_text()
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="compile_profile", target_config=text, topology="1x1x1"
        )
    except Exception as error:  # no CUDA plugin, or a config this jaxlib cannot parse
        raise SystemExit(
            f"compile_profile: no GPU from {config_path} ({type(error).__name__}: {error}); this "
            "needs JAX's CUDA plugin and CUDA's libraries: pip install 'jax[cuda12]' for this "
            "JAX's version; on a host without a GPU driver also set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 and JAX_PLATFORMS=cpu"
        ) from error
    return topology.devices[0]


def phase_seconds(trace: dict) -> dict[str, float]:
    """Seconds per :data:`PHASES` column: the durations of the host's events of that name."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    totals = dict.fromkeys(PHASES, 0.0)
    names = {event: column for column, event in PHASES.items()}
    for e in events:
        column = names.get(e.get("name"))
        if column and e.get("ph") == "X":
            totals[column] += float(e["dur"]) / 1e6
    return totals


def profile_update(name: str, shapes, device) -> dict:
    """``name``'s donated update of ``shapes`` compiled for ``device`` under the profiler: the
    row's columns (module docstring)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    lowered = updates.lowered_update(name, shapes, sharding, "gpu")
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            start = time.perf_counter()
            compiled = lowered.compile()
            seconds = time.perf_counter() - start
        phases = phase_seconds(device_trace.read_trace(Path(tmp)))
    text = compiled.as_text()
    counts = common.launch_counts(text)
    attributed = phases["hlo_passes_s"] + phases["codegen_s"] + phases["autotune_s"]
    return {
        "optimizer": name,
        "compile_s": seconds,
        **phases,
        "unattributed_s": seconds - attributed,
        "fusions": counts["fusions"],
        "custom_calls": counts["custom_calls"],
        "hlo_bytes_per_param": (
            None if counts["custom_calls"] else common.hlo_traffic(text) / lm_shapes.count(shapes)
        ),
    }


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_optimizers_arg(
        p, updates.OPTIMIZERS, "adamw,sonew_tridiag,sonew_tridiag_pallas,sonew_band4_pallas"
    )
    lm_shapes.add_args(p, stack_layers=True)
    p.add_argument(
        "--gpu_target_config",
        default=None,
        help="a GpuTargetConfigProto text file: compile for that GPU without one",
    )
    common.add_out_arg(p, "compile_profile")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, writes and returns the JSON object (rewritten after
    every optimizer)."""
    args = parse_args(argv)
    device = target_device(args.gpu_target_config)
    shapes = lm_shapes.from_args(args)
    result = common.lm_set_result(
        args, lm_shapes.count(shapes), gpu_target_config=args.gpu_target_config
    )
    if args.gpu_target_config:
        result["device"] = f"{device.device_kind} (compiled without one, on {result['device']})"
    common.compiled_rows(
        args,
        result,
        lambda name: profile_update(name, shapes, device),
        "compile_s",
        "compile_ratio_vs_adamw",
        lambda row: f"{row['optimizer']}: {row['compile_s']:.1f} s",
    )
    print(f"\ncompiled for {device.device_kind}, {result['params'] / 1e6:.1f}M parameters\n")
    print(common.format_table(result["rows"], COLUMNS))
    return result


if __name__ == "__main__":
    main()
