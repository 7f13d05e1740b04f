"""Smoke tests of the speed benchmarks at a tiny scale on CPU: they run and write their schema.

No timing is asserted. The 8 simulated CPU devices come from conftest.py.
"""

import argparse
import ast
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import (
    attention,
    common,
    compile_cache,
    compile_profile,
    device_trace,
    kernel_speed,
    lm_shapes,
    lowering,
    profile_update,
    sharded_update,
    step_traffic,
    tpu_compile,
    train_step,
    update_speed,
    updates,
)

TINY = ["--scale", "0.0078125", "--layers", "1"]
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _read(path: Path, returned: dict) -> dict:
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(returned))
    assert {"device", "date", "params", "rows"} <= written.keys()
    return written


def imported_names(tree: ast.AST, package: str) -> set[str]:
    """The top-level names a module's syntax ``tree`` imports, in functions too, with those of
    ``package`` named by their module: ``import package.m``, ``from package import m``,
    ``from package.m import x``, ``from . import m`` and ``from .m import x`` all give ``m``;
    ``import m`` (a sibling found on ``sys.path``) gives ``m`` too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            parts = [alias.name.split(".") for alias in node.names]
            found |= {p[1] if p[0] == package and len(p) > 1 else p[0] for p in parts}
        elif isinstance(node, ast.ImportFrom):
            module = [m for m in (node.module or "").split(".") if m]
            if node.level == 0 and module[0] != package:
                found.add(module[0])
                continue
            inside = module[1:] if node.level == 0 else module
            found |= {inside[0]} if inside else {alias.name for alias in node.names}
    return found


def import_graph(directory: Path) -> dict[str, set[str]]:
    """Each module of the package at ``directory``: the package's modules it imports (however
    spelled, see :func:`imported_names`)."""
    modules = {path.stem: path for path in directory.glob("*.py")}
    return {
        name: imported_names(ast.parse(path.read_text()), directory.name) & set(modules)
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph`` (``[a, b, ..., a]``), or None where it is a DAG."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for child in sorted(graph.get(node, ())):
            cycle = visit(child, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return None


def test_benchmarks_import_no_circle_and_no_sys_path():
    """The benchmarks' imports form a DAG, and none puts a folder on ``sys.path``."""
    graph = import_graph(BENCHMARKS)
    assert {"common", "updates", "device_trace"} <= graph["update_speed"]  # the parser sees them
    assert find_cycle(graph) is None
    for path in BENCHMARKS.glob("*.py"):
        assert "sys.path.insert" not in path.read_text(), path.name


def test_import_circle_is_found(tmp_path):
    """A circle through a function's lazy, a relative and an absolute import is found."""
    package = tmp_path / "benchmarks"
    package.mkdir()
    (package / "a.py").write_text("from benchmarks import b\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text("import benchmarks.a\nimport json\n")
    (package / "d.py").write_text("from . import a\nimport c\nfrom sonew_pax import optim\n")
    graph = import_graph(package)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "c"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (package / "c.py").write_text("import json\n")
    assert find_cycle(import_graph(package)) is None


def test_lm_shapes_full_size_and_specs():
    shapes = lm_shapes.lm_shapes()
    assert 300e6 < lm_shapes.count(shapes) < 350e6
    layer = shapes["layer_00"]
    assert layer["query"].shape == (1024, 1024) and layer["mlp_in"].shape == (1024, 4096)
    specs = lm_shapes.megatron_specs(shapes, "model", "data")
    assert jax.tree.structure(
        specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
    ) == jax.tree.structure(shapes)
    assert specs["layer_00"]["out"] == jax.sharding.PartitionSpec("model", "data")


def test_update_speed_schema(tmp_path, monkeypatch):
    out = tmp_path / "update_speed.json"
    argv = [*TINY, "--optimizers", "adamw,sonew_tridiag", "--warmup", "1", "--iters", "2"]
    argv += ["--profile_steps", "1", "--kernel", "banded_min_rows=16"]
    built = []
    make = updates.make_optimizer

    def spy(name, config=None, stacked_axes=None):
        built.append((name, config and config.banded_min_rows))  # None: the copy's AdamW bytes
        return make(name, config, stacked_axes)

    monkeypatch.setattr(updates, "make_optimizer", spy)
    written = _read(out, update_speed.main([*argv, "--out", str(out)]))
    # conftest.py sets XLA_FLAGS (8 CPU devices): the result says what the timings ran under.
    assert written["config"]["xla_flags"] == os.environ["XLA_FLAGS"]
    # --kernel builds each timed optimizer's KernelConfig, and the result records it.
    assert built[-2:] == [("adamw", 16), ("sonew_tridiag", 16)]
    assert written["config"]["kernel"] == {"banded_min_rows": "16"}
    rows = {row["optimizer"]: row for row in written["rows"]}
    assert set(rows) == {"copy", "adamw", "sonew_tridiag"}
    for row in rows.values():
        assert all(_finite(row[k]) for k in ("ms", "ratio_vs_adamw", "gbps", "floor_ratio"))
    for name in ("adamw", "sonew_tridiag"):
        assert _finite(rows[name]["pipelined_ms"]) and rows[name]["pipelined_ms"] > 0
        assert _finite(rows[name]["pipelined_ratio_vs_adamw"])
        assert _finite(rows[name]["dispatch_ms"]) and rows[name]["dispatch_ms"] > 0
    assert rows["copy"]["pipelined_ms"] is None and rows["copy"]["dispatch_ms"] is None
    # Traced, but the CPU trace has no device lane: 0 ms, so no ratio (profile_update's parser
    # test reads a device lane); copy is never traced.
    for key in ("busy", "span"):
        assert rows["adamw"][f"{key}_ms"] == 0 and rows["adamw"][f"{key}_ratio_vs_adamw"] is None
        assert rows["copy"][f"{key}_ms"] is None
    assert rows["adamw"]["ratio_vs_adamw"] == 1.0
    assert abs(rows["adamw"]["bytes_per_param"] - 28) < 0.01
    assert abs(rows["sonew_tridiag"]["bytes_per_param"] - 36) < 0.1
    # The compiled program's columns: the copy has none; AdamW is one pass per tensor, while
    # SONew's XLA step keeps its direction u between the norms and the apply (4 B/param).
    assert "compile_s" not in rows["copy"]
    assert rows["adamw"]["compile_ratio_vs_adamw"] == 1.0
    for name in ("adamw", "sonew_tridiag"):
        assert rows[name]["compile_s"] > 0 and rows[name]["kernels"] >= rows[name]["fusions"] > 0
    assert rows["adamw"]["temp_bytes_per_param"] < 1
    assert rows["sonew_tridiag"]["temp_bytes_per_param"] >= 4


def test_kernel_speed_schema(tmp_path):
    """One tile setting on a small tensor (Pallas' interpreter on CPU) and the HLO counts."""
    out, hlo_dir = tmp_path / "kernel_speed.json", tmp_path / "hlo"
    argv = ["--shape", "24,40", "--warmup", "1", "--iters", "1", "--tiles", "8x32x4", *TINY]
    argv += ["--scan_tiles", "8x64x2", "--out", str(out), "--hlo_dir", str(hlo_dir)]
    returned = kernel_speed.main(argv)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))
    names = [row["name"] for row in written["rows"]]
    assert names[0] == "copy" and "update sonew_tridiag_pallas" in names
    assert {"kernel band0 tile 8x32 warps 4", "kernel band1 tile 8x64 warps 2"} <= set(names)
    assert all(_finite(row["ms"]) and row["bytes"] > 0 for row in written["rows"])
    hlo = {row["optimizer"]: row for row in written["hlo"]}
    assert set(hlo) == set(kernel_speed.UPDATES.split(","))
    assert "ENTRY" in (hlo_dir / "sonew_tridiag.txt").read_text()
    assert hlo["sonew_tridiag"]["custom_calls"] == 0  # the XLA path launches no Pallas kernel


def test_tiles_flag():
    assert common.parse_tiles("16x64x4,8x128x8") == [(16, 64, 4), (8, 128, 8)]
    for bad in ("16x64", "16x48x4", "ax64x4", "0x64x4"):
        with pytest.raises(argparse.ArgumentTypeError, match="tile"):
            common.parse_tiles(bad)


def test_train_step_schema(tmp_path):
    out = tmp_path / "train_step.json"
    argv = [
        "--model",
        "tiny",
        "--layers",
        "1",
        "--batch_size",
        "2",
        "--seq_len",
        "16",
        "--dtype",
        "float32",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--optimizers",
        "adamw,sonew_diag,muon_bf16",
        "--no_isolate",
        "--profile_steps",
        "1",
        "--concurrent",  # compiled with CONCURRENT_OPTIONS (no-op on CPU)
    ]
    written = _read(out, train_step.main([*argv, "--out", str(out)]))
    assert written["config"]["concurrent"] is True
    assert [row["optimizer"] for row in written["rows"]] == ["adamw", "sonew_diag", "muon_bf16"]
    for row in written["rows"]:
        assert _finite(row["step_ms"]) and _finite(row["ratio_vs_adamw"]) and _finite(row["loss"])
        assert _finite(row["pipelined_ms"]) and _finite(row["pipelined_ratio_vs_adamw"])
        assert _finite(row["dispatch_ms"]) and _finite(row["init_s"]) and row["init_s"] > 0
        assert "peak_memory_gib" in row  # None on CPU
        # The trace has no device lane on CPU: the plumbing only (profile_update's test reads one).
        assert row["busy_ms"] == row["span_ms"] == 0 and row["families"] == []
        assert row["steps"] == 5  # first, timed, pipelined, dispatch-timed, traced


def test_train_step_child_argv_round_trips(tmp_path):
    args = train_step.parse_args(
        [
            "--model",
            "tiny",
            "--batch_size",
            "3",
            "--seq_len",
            "8",
            "--unsharded_optimizer",
            "--iters",
            "4",
            "--layers",
            "1",
            "--profile_steps",
            "2",
            "--profile_families",
            "50",
            "--kernel",
            "banded_tile=(16, 64, 2)",
            "--kernel",
            "banded_min_rows=8",
            "--concurrent",
            "--attention",
            "xla",
            "--remat",
            "dots",
            "--tokens",
            "zipf",
        ]
    )
    argv = train_step.child_argv("adamw", args, tmp_path / "r.json")
    assert argv[:3] == common.module_command("train_step")
    child = train_step.parse_args(argv[3:])
    assert child.worker == "adamw" and child.row_out == tmp_path / "r.json"
    assert child.kernel == args.kernel == [("banded_tile", (16, 64, 2)), ("banded_min_rows", 8)]
    for name in (
        "model",
        "dtype",
        "layers",
        "batch_size",
        "seq_len",
        "warmup",
        "iters",
        "profile_steps",
        "profile_families",
        "unsharded_optimizer",
        "concurrent",
        "attention",
        "remat",
        "tokens",
    ):
        assert getattr(child, name) == getattr(args, name)


def test_train_step_zipf_tokens_repeat_as_text_does():
    """``--tokens zipf``: ids in the vocabulary, the commonest about 1 / H(V) of them (9.5% of a
    32k vocabulary; uniform ids repeat about once per V / n), both from the fixed seed."""
    zipf, uniform = (train_step.random_batch(32000, 16, 1024, t) for t in ("zipf", "uniform"))
    top = np.unique(zipf["inputs"], return_counts=True)[1].max() / zipf["inputs"].size
    harmonic = np.sum(1.0 / np.arange(1, 32001))
    assert abs(top - 1 / harmonic) < 0.01 and zipf["inputs"].min() >= 0
    assert zipf["inputs"].max() < 32000 and zipf["inputs"].dtype == uniform["inputs"].dtype
    assert np.unique(uniform["inputs"], return_counts=True)[1].max() < 10
    assert (zipf["targets"][:, :-1] == zipf["inputs"][:, 1:]).all()
    with pytest.raises(ValueError, match="tokens must be one of"):
        train_step.random_batch(10, 1, 2, "text")


def test_attention_schema_and_equality(tmp_path):
    """On CPU only the reference form runs: its error against itself upcast is rounding."""
    out = tmp_path / "attention.json"
    argv = ["--shapes", "1x16x4x2x8", "--dtype", "bfloat16", "--warmup", "0", "--iters", "1"]
    returned = attention.main([*argv, "--out", str(out)])
    written = json.loads(out.read_text())  # no model, so no "params"
    assert written == json.loads(json.dumps(returned))
    (row,) = written["rows"]
    assert (row["shape"], row["implementation"], row["speedup_vs_xla"]) == ("1x16x4x2x8", "xla", 1)
    assert _finite(row["fwd_bwd_ms"]) and 0 < row["rel_err"] < 1e-2


def test_sharded_update_schema_and_equality(tmp_path):
    out = tmp_path / "sharded_update.json"
    argv = [
        *TINY,
        "--devices",
        "8",
        "--data",
        "2",
        "--bands",
        "1",
        "--check_steps",
        "1",
        "--warmup",
        "0",
        "--iters",
        "1",
    ]
    written = _read(out, sharded_update.main([*argv, "--out", str(out)]))
    assert written["devices"] == 8
    assert [row["variant"] for row in written["rows"]] == ["model", "data_model"]
    for row in written["rows"]:
        assert row["equal"] and row["max_rel_diff"] <= 1e-5
        assert _finite(row["scaling_efficiency"]) and _finite(row["ms_sharded"])
        assert row["collectives"]["all-gather"] == 0 and row["collectives"]["all-to-all"] == 0
        assert 0 < row["collectives"]["collective-permute"] <= row["permute_bound"]
    # model=8: one split (model), so 4; data=2 x model=4: two splits of the matrices, so 8.
    assert [row["permute_bound"] for row in written["rows"]] == [4, 8]


def test_permute_bound_counts_splits_and_varying_axes_not_tensors():
    """``permute_bound`` is 4 per (mesh axes splitting a dimension, mesh axes the tensor varies
    over): tensors, replicated ones and the band add nothing; band 0 needs no permute."""
    spec = jax.sharding.PartitionSpec
    one = {"a": spec("model", None), "b": spec(None, "model"), "norm": spec()}
    assert sharded_update.permute_bound(one, 1) == sharded_update.permute_bound(one, 4) == 4
    assert sharded_update.permute_bound({**one, "c": spec("model", None)}, 1) == 4
    assert sharded_update.permute_bound(one, 0) == 0
    two = {"a": spec("data", "model"), "e": spec("model", None)}  # e varies over model only
    assert sharded_update.permute_bound(two, 2) == 4 * 3
    assert sharded_update.permute_bound({"a": spec(("data", "model"), None)}, 1) == 4


def test_device_trace_reads_device_kernels():
    """The trace parser keeps only device lanes' complete events and groups XLA's suffixes; the
    span counts overlapping kernels' time once."""
    trace = {
        "traceEvents": [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "X", "pid": 1, "name": "PjitFunction(update)", "ts": 0.0, "dur": 900.0},
            {"ph": "X", "pid": 7, "name": "loop_add_fusion.3", "ts": 100.0, "dur": 30.0},
            {"ph": "X", "pid": 7, "name": "loop_add_fusion.12", "ts": 10.0, "dur": 50.0},
            {"ph": "X", "pid": 7, "name": "sonew_band1_scan", "ts": 20.0, "dur": 120.0},
            {"ph": "i", "pid": 7, "name": "marker", "ts": 5.0},
        ]
    }
    # [10, 60] and [100, 130] lie within or overlap [20, 140]: the union is [10, 140].
    assert device_trace.device_span(trace) == 130.0
    # A kernel after a gap adds its own time only (not the gap).
    later = {"ph": "X", "pid": 7, "name": "sonew_halo", "ts": 200.0, "dur": 10.0}
    assert device_trace.device_span({"traceEvents": [*trace["traceEvents"], later]}) == 140.0
    kernels = device_trace.device_kernels(trace)
    assert sorted(kernels) == [
        ("loop_add_fusion.12", 50.0),
        ("loop_add_fusion.3", 30.0),
        ("sonew_band1_scan", 120.0),
    ]
    summary = device_trace.summarize(kernels, steps=2)
    assert summary["kernels"] == 1.5 and abs(summary["busy_ms"] - 0.1) < 1e-12
    assert [f["name"] for f in summary["families"]] == ["sonew_band1_scan", "loop_add_fusion"]
    assert abs(summary["families"][1]["ms"] - 0.04) < 1e-12
    # A second device lane: each lane is summarized alone, the busiest first.
    second = [
        {"ph": "M", "pid": 8, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "X", "pid": 8, "name": "sonew_band1_scan", "ts": 0.0, "dur": 400.0},
    ]
    lanes = device_trace.per_device({"traceEvents": [*trace["traceEvents"], *second]}, steps=2)
    assert [lane["device"] for lane in lanes] == ["/device:GPU:1", "/device:GPU:0"]
    assert abs(lanes[0]["busy_ms"] - 0.2) < 1e-12 and abs(lanes[1]["busy_ms"] - 0.1) < 1e-12
    assert abs(lanes[1]["span_ms"] - 0.065) < 1e-12 and lanes[1]["kernels"] == 1.5


def test_compile_profile_schema(tmp_path):
    """On the CPU the update compiles for the CPU: no GPU phases, but the schema and counts."""
    out = tmp_path / "compile_profile.json"
    argv = ["--optimizers", "adamw,sonew_tridiag", *TINY, "--out", str(out)]
    written = _read(out, compile_profile.main(argv))
    rows = {row["optimizer"]: row for row in written["rows"]}
    assert set(rows) == {"adamw", "sonew_tridiag"}
    for row in rows.values():
        assert set(compile_profile.COLUMNS) <= row.keys()
        assert _finite(row["compile_s"]) and row["compile_s"] > 0
        assert row["custom_calls"] == 0
    assert rows["adamw"]["compile_ratio_vs_adamw"] == 1.0


def test_hlo_traffic_counts_each_launchs_operands_and_outputs():
    """Against the arrays each compiled launch must touch: a fusion of two (64, 64) inputs into
    one output moves three arrays; a fusion reading two rows of its input moves those rows (and
    writes as many); bitcasts, tuples and parameters move nothing."""
    f32 = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    whole = jax.jit(lambda a, b: a * 2 + b).lower(f32, f32).compile().as_text()
    assert common.hlo_traffic(whole) == 3 * 64 * 64 * 4
    rows = jax.jit(lambda a, b: a[:2] * b[:2] + 1).lower(f32, f32).compile().as_text()
    assert common.hlo_traffic(rows) == 3 * 2 * 64 * 4
    text = """HloModule m

%fused (param_0.1: f32[8,4], param_1.1: f32[8,4]) -> f32[1,4] {
  %param_0.1 = f32[8,4]{1,0} parameter(0)
  %param_1.1 = f32[8,4]{1,0} parameter(1)
  %bitcast.1 = f32[32]{0} bitcast(%param_1.1)
  %slice.1 = f32[4]{0} slice(%bitcast.1), slice={[0:4]}
  %slice.2 = f32[1,4]{1,0} slice(%param_0.1), slice={[7:8], [0:4]}
  %bitcast.2 = f32[1,4]{1,0} bitcast(%slice.1)
  ROOT %add.1 = f32[1,4]{1,0} add(%slice.2, %bitcast.2)
}

ENTRY %main (a: f32[8,4], b: bf16[8,4]) -> (f32[1,4], bf16[8,4]) {
  %a = f32[8,4]{1,0} parameter(0)
  %b = bf16[8,4]{1,0} parameter(1)
  %bitcast.3 = f32[8,4]{1,0} bitcast(%a)
  %fusion = f32[1,4]{1,0} fusion(%a, %bitcast.3), kind=kLoop, calls=%fused
  %custom-call = bf16[8,4]{1,0} custom-call(%b, %fusion), custom_call_target="k"
  ROOT %tuple = (f32[1,4]{1,0}, bf16[8,4]{1,0}) tuple(%fusion, %custom-call)
}
"""
    # The fusion: two 4-element slices read, 4 elements written; the custom call: b (64 B) and
    # the fusion's output (16 B) read, 64 B written.
    assert common.hlo_traffic(text) == (4 + 4 + 4) * 4 + 64 + 16 + 64


def test_hlo_traffic_reads_an_elementwise_fusion_at_its_results_size():
    """A fusion that slices a product of its operand reads one element per result element (XLA's
    loop fusion computes only the slice), where a reduction of the same operand reads it whole;
    a scalar operand counts once."""
    text = """HloModule m

%scaled_row (param_0.1: f32[8,4], param_1.1: f32[]) -> f32[1,4] {
  %param_0.1 = f32[8,4]{1,0} parameter(0)
  %param_1.1 = f32[] parameter(1)
  %broadcast.1 = f32[8,4]{1,0} broadcast(%param_1.1), dimensions={}
  %multiply.1 = f32[8,4]{1,0} multiply(%param_0.1, %broadcast.1)
  ROOT %slice.1 = f32[1,4]{1,0} slice(%multiply.1), slice={[7:8], [0:4]}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%column_sums (param_0.2: f32[8,4]) -> f32[4] {
  %param_0.2 = f32[8,4]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %reduce.1 = f32[4]{0} reduce(%param_0.2, %zero), dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[8,4], s: f32[]) -> (f32[1,4], f32[4]) {
  %a = f32[8,4]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %row = f32[1,4]{1,0} fusion(%a, %s), kind=kLoop, calls=%scaled_row
  %sums = f32[4]{0} fusion(%a), kind=kInput, calls=%column_sums
  ROOT %tuple = (f32[1,4]{1,0}, f32[4]{0}) tuple(%row, %sums)
}
"""
    # The row: 4 elements of a, the scalar, 4 written; the sums: all 32 of a, 4 written.
    assert common.hlo_traffic(text) == (4 + 1 + 4) * 4 + (32 + 4) * 4


def test_compile_profile_sums_the_phases_events():
    trace = {
        "traceEvents": [
            {"ph": "X", "name": "priority-fusion", "ts": 0.0, "dur": 1.5e6},
            {"ph": "X", "name": "PTX->CUBIN", "ts": 0.0, "dur": 2e5},
            {"ph": "X", "name": "PTX->CUBIN", "ts": 1.0, "dur": 3e5},
            {"ph": "i", "name": "priority-fusion", "ts": 2.0},  # an instant: no duration
            {"ph": "X", "name": "something-else", "ts": 0.0, "dur": 9e6},
        ]
    }
    phases = compile_profile.phase_seconds(trace)
    assert set(phases) == set(compile_profile.PHASES)
    assert phases["fusion_pass_s"] == 1.5 and abs(phases["ptxas_s"] - 0.5) < 1e-12
    assert phases["hlo_passes_s"] == phases["autotune_s"] == 0.0


def test_compile_profile_names_an_unusable_target_config(tmp_path):
    if jax.devices()[0].platform == "gpu":
        pytest.skip("a GPU host has the CUDA plugin")
    config = tmp_path / "gpu.pbtxt"
    config.write_text("gpu_device_info { core_count: 132 }\n")
    with pytest.raises(SystemExit, match=r"gpu\.pbtxt"):
        compile_profile.target_device(str(config))


def test_profile_update_schema(tmp_path):
    out = tmp_path / "profile_update.json"
    argv = ["--optimizers", "adamw,sonew_tridiag", "--warmup", "1", "--iters", "1", *TINY]
    argv += ["--concurrent"]  # each update compiled with CONCURRENT_OPTIONS (no-op on CPU)
    returned = profile_update.main(
        [*argv, "--grad_std", "0.5", "--trace_dir", str(tmp_path / "traces"), "--out", str(out)]
    )
    written = _read(out, returned)
    assert written["config"]["grad_std"] == 0.5 and written["config"]["concurrent"] is True
    rows = {row["optimizer"]: row for row in written["rows"]}
    assert set(rows) == {"adamw", "sonew_tridiag"}
    for row in rows.values():
        assert _finite(row["wall_ms"]) and row["wall_ms"] > 0
        assert row["idle_ms"] == row["wall_ms"] - row["span_ms"]
    assert list((tmp_path / "traces" / "adamw").glob("**/perfetto_trace.json.gz"))


def test_profile_update_band1_tiles(tmp_path, monkeypatch):
    """One row per (tile, stack, optimizer), each profiled with its tile and stack in the scan's
    KernelConfig into a trace folder of its own. (The profiling itself is a stub:
    test_profile_update_schema runs it.)"""
    seen = []

    def stub(name, shapes, grads, args, trace_dir, config):
        seen.append((config.scan_tile, config.scan_stack, trace_dir))
        return _stub_row(name)

    monkeypatch.setattr(profile_update, "profile_optimizer", stub)
    traces = tmp_path / "traces"
    argv = ["--optimizers", "sonew_tridiag", "--warmup", "0", "--iters", "1", *TINY]
    argv += ["--band1_tiles", "8x32x2,16x64x4", "--scan_stacks", "2"]
    argv += ["--trace_dir", str(traces)]
    out = tmp_path / "p.json"
    written = _read(out, profile_update.main([*argv, "--out", str(out)]))
    labels = ["sonew_tridiag@8x32x2:s2", "sonew_tridiag@16x64x4:s2"]
    assert [row["optimizer"] for row in written["rows"]] == labels
    assert seen == [
        ((8, 32, 2), 2, traces / labels[0]),
        ((16, 64, 4), 2, traces / labels[1]),
    ]
    for bad in (["--scan_stacks", "3"], ["--scan_stacks", "x"]):
        with pytest.raises(SystemExit):
            profile_update.parse_args(bad)


def _stub_row(name: str) -> dict:
    """A row as ``profile_update.profile_optimizer`` returns it, for tests of what surrounds it."""
    return dict(optimizer=name, wall_ms=1.0, busy_ms=0.0, idle_ms=1.0, kernels=0, families=[])


def test_profile_update_builds_the_kernel_config(tmp_path, monkeypatch):
    """--kernel FIELD=VALUE configures every profiled row's kernels and is recorded in the
    config; a name that is not a field of KernelConfig, or a value of another type, is refused."""
    seen = []

    def stub(name, shapes, grads, args, directory, config):  # test_profile_update_schema profiles
        seen.append((config.banded_tile, config.banded_min_rows))
        return _stub_row(name)

    monkeypatch.setattr(profile_update, "profile_optimizer", stub)
    argv = ["--optimizers", "adamw,sonew_tridiag", "--warmup", "0", "--iters", "1", *TINY]
    argv += ["--kernel", "banded_min_rows=16", "--kernel", "banded_tile=(64, 64, 2)"]
    out = tmp_path / "p.json"
    written = _read(out, profile_update.main([*argv, "--out", str(out)]))
    assert seen == [((64, 64, 2), 16)] * 2
    assert written["config"]["kernel"] == {"banded_min_rows": "16", "banded_tile": "(64, 64, 2)"}
    for bad in ("NOPE=1", "banded_min_rows", "banded_min_rows=16.0", "banded_tile=[64]", "x=1"):
        with pytest.raises(SystemExit):
            profile_update.parse_args(["--kernel", bad])


def test_step_counts_must_be_whole_and_large_enough():
    for argv in (["--iters", "0"], ["--warmup", "-1"], ["--profile_steps", "-2"], ["--iters", "x"]):
        with pytest.raises(SystemExit):
            update_speed.parse_args(argv)
    with pytest.raises(SystemExit):
        train_step.parse_args(["--profile_steps", "-1"])
    assert update_speed.parse_args(["--warmup", "0", "--profile_steps", "0"]).warmup == 0


def test_optimizers_flag_names_the_unknown_ones(capsys):
    """Every LM-set script's ``--optimizers``: a list of known names, else a usage error that
    names the unknown ones; the defaults parse too."""
    for script in (update_speed, profile_update, compile_cache, lowering, train_step):
        assert script.parse_args(["--optimizers", "adamw,"]).optimizers == ["adamw"]
        assert script.parse_args([]).optimizers
        for bad in ("adamw,nope", ""):
            with pytest.raises(SystemExit):
                script.parse_args(["--optimizers", bad])
        assert "unknown optimizers ['nope']" in capsys.readouterr().err


def test_time_dispatch_waits_before_each_call_not_inside_it(monkeypatch):
    """Each of ``iters`` calls starts on a finished carry; the timed span is the call alone."""
    events = []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append("wait") or real_wait(x))

    def step(c):
        events.append("call")
        return c + 1

    ms, carry = common.time_dispatch(step, jnp.zeros(()), 3)
    assert float(carry) == 3.0 and ms >= 0
    assert events == ["wait", "call"] * 3 + ["wait"]


def test_time_pipelined_dispatches_every_step_then_waits_once(monkeypatch):
    """``iters`` calls, each fed the last one's result, one wait at the end (none in between)."""
    waits = []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waits.append(x) or real_wait(x))
    ms, carry = common.time_pipelined(lambda c: c + 1, jnp.zeros(()), 5)
    assert float(carry) == 5.0 and ms > 0
    assert len(waits) == 2  # the carry before the first dispatch, and after the last


def test_compile_cache_schema(tmp_path):
    """A second process loads the first one's compiled update from the cache (JAX logs the hit)
    and computes the same parameters."""
    out = tmp_path / "compile_cache.json"
    argv = [*TINY, "--optimizers", "sonew_tridiag_lag", "--steps", "2", "--out", str(out)]
    written = _read(out, compile_cache.main(argv))
    (row,) = written["rows"]
    assert row["optimizer"] == "sonew_tridiag_lag"
    assert row["warm_hit"] is True and row["same_result"] is True
    assert all(_finite(row[k]) and row[k] > 0 for k in compile_cache.COLUMNS[1:6])
    assert row["checksums"][0] == row["checksums"][1] > 0


def test_lowering_counts_one_walk_program_per_shape(tmp_path, monkeypatch):
    """Lowered for CUDA on the CPU, band 4's update launches a walk per tensor but lowers one
    Triton program per tensor shape, also with the halo rows in many launches (two arrays each
    here); AdamW lowers none."""
    out = tmp_path / "lowering.json"
    argv = [*TINY[:2], "--layers", "2", "--optimizers", "adamw,sonew_band4_lag_pallas"]
    argv += ["--kernel", "halo_group=2"]
    written = _read(out, lowering.main([*argv, "--out", str(out)]))
    adamw, band4 = written["rows"]
    assert adamw["launches"] == adamw["programs"] == 0 and adamw["programs_by_kernel"] == {}
    shapes = lm_shapes.lm_shapes(scale=float(TINY[1]), layers=2)
    matrices = [x.shape for x in jax.tree.leaves(shapes) if len(x.shape) == 2]
    assert band4["programs_by_kernel"]["sonew_band4_scan"] == len(set(matrices))
    assert band4["launches"] > len(matrices)  # every matrix's walk and the halo launches
    assert adamw["triton_mb"] == 0
    for key in ("trace_s", "lower_s", "mlir_mb", "triton_mb"):
        assert _finite(band4[key]) and band4[key] > 0, key


# A compiled TPU module in miniature: a fusion that reads one operand whole and only slices the
# other, results in HBM and in VMEM (S(1)), an async copy into VMEM and an async slice from HBM.
_TPU_MODULE = """HloModule jit_update, is_scheduled=true

%fused_computation (param_0: f32[8,128], param_1: f32[16,128]) -> f32[8,128] {
  %param_0 = f32[8,128]{1,0} parameter(0)
  %param_1 = f32[16,128]{1,0} parameter(1)
  %slice.1 = f32[8,128]{1,0} slice(%param_1), slice={[8:16], [0:128]}
  ROOT %add.1 = f32[8,128]{1,0} add(%param_0, %slice.1)
}

%fused_late_slice (param_0: f32[16,128]) -> f32[8,128] {
  %param_0 = f32[16,128]{1,0} parameter(0)
  %negate.1 = f32[16,128]{1,0} negate(%param_0)
  ROOT %slice.2 = f32[8,128]{1,0} slice(%negate.1), slice={[0:8], [0:128]}
}

%fused_sum (param_0: f32[16,128]) -> f32[] {
  %param_0 = f32[16,128]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %reduce.1 = f32[] reduce(%param_0, %zero), dimensions={0,1}, to_apply=%add
}

ENTRY %main (a: f32[8,128], b: f32[16,128]) -> (f32[8,128], f32[8,128]) {
  %a = f32[8,128]{1,0} parameter(0)
  %b = f32[16,128]{1,0} parameter(1)
  %fusion.1 = f32[8,128]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_computation
  %fusion.2 = f32[8,128]{1,0:S(1)} fusion(%a, %b), kind=kLoop, calls=%fused_computation
  %fusion.3 = f32[8,128]{1,0:S(1)} fusion(%b), kind=kLoop, calls=%fused_late_slice
  %fusion.4 = f32[]{:S(1)} fusion(%b), kind=kLoop, calls=%fused_sum
  %copy-start.1 = (f32[8,128]{1,0:S(1)}, f32[8,128]{1,0}, u32[]) copy-start(%a)
  %copy-done.1 = f32[8,128]{1,0:S(1)} copy-done(%copy-start.1)
  %slice-start.1 = ((f32[16,128]{1,0}), f32[4,128]{1,0:S(1)}, s32[]) slice-start(%b)
  %slice-done.1 = f32[4,128]{1,0:S(1)} slice-done(%slice-start.1)
  %slice.3 = f32[4,128]{1,0:S(1)} slice(%b), slice={[0:4], [0:128]}
  %slice.4 = f32[1,128]{1,0:S(1)} slice(%b), slice={[3:16:8], [0:128]}
  ROOT %tuple.1 = (f32[8,128]{1,0}, f32[8,128]{1,0}) tuple(%fusion.1, %copy-done.1)
}
"""


def test_tpu_compile_counts_what_the_schedule_moves_through_hbm():
    """The first two fusions read ``a`` whole (4 KiB) and half of ``b`` (the slice they use: 4
    KiB, not 8); the first writes its result to HBM, the others to VMEM (free); the third slices
    after an elementwise op, and computes only its 8 result rows (4 KiB); the reduction reads
    ``b`` whole (8 KiB); the async copy reads ``a`` from HBM into VMEM; the async slice reads its
    4 rows (2 KiB), and so does the synchronous one; the strided slice keeps one row of ``b``
    and reads the (8, 128) tile that holds it (4 KiB)."""
    total, by_opcode = tpu_compile.hbm_bytes(_TPU_MODULE)
    page = 8 * 128 * 4
    assert by_opcode == {
        "fusion": 3 * page + 2 * page + page + 2 * page,
        "copy-start": page,
        "slice-start": page // 2,
        "slice": page // 2 + page,
    }
    assert total == sum(by_opcode.values())
    assert common.hlo_arrays("(f32[2,3]{1,0:T(2,128)S(1)}, bf16[4]{0})") == [(24, 1), (8, 0)]


_TPU_LOOP_MODULE = """HloModule tpu_loop

%fused_step (param_0: f32[4,8,128], param_1: f32[4,8,128], param_2: s32[]) -> (f32[4,8,128], f32[8,128]) {
  %param_0 = f32[4,8,128]{2,1,0} parameter(0)
  %param_1 = f32[4,8,128]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %ds = f32[1,8,128]{2,1,0} dynamic-slice(%param_1, %param_2, %zero, %zero), dynamic_slice_sizes={1,8,128}
  %neg = f32[1,8,128]{2,1,0} negate(%ds)
  %dus = f32[4,8,128]{2,1,0} dynamic-update-slice(%param_0, %neg, %param_2, %zero, %zero)
  %flat = f32[8,128]{1,0:S(1)} bitcast(%neg)
  ROOT %tuple = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0:S(1)}) tuple(%dus, %flat)
}

%body (carry: (s32[], f32[4,8,128], f32[4,8,128])) -> (s32[], f32[4,8,128], f32[4,8,128]) {
  %carry = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %i = s32[]{:S(1)} get-tuple-element(%carry), index=0
  %u = f32[4,8,128]{2,1,0} get-tuple-element(%carry), index=1
  %g = f32[4,8,128]{2,1,0} get-tuple-element(%carry), index=2
  %fusion.1 = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0:S(1)}) fusion(%u, %g, %i), kind=kLoop, calls=%fused_step
  %new = f32[4,8,128]{2,1,0} get-tuple-element(%fusion.1), index=0
  %one = s32[]{:S(1)} constant(1)
  %next = s32[]{:S(1)} add(%i, %one)
  ROOT %tuple.1 = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%next, %new, %g)
}

%cond (carry: (s32[], f32[4,8,128], f32[4,8,128])) -> pred[] {
  %carry = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %i = s32[]{:S(1)} get-tuple-element(%carry), index=0
  %n = s32[]{:S(1)} constant(4)
  ROOT %lt = pred[]{:S(1)} compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4,8,128], b: f32[4,8,128]) -> f32[4,8,128] {
  %a = f32[4,8,128]{2,1,0} parameter(0)
  %b = f32[4,8,128]{2,1,0} parameter(1)
  %i0 = s32[]{:S(1)} constant(0)
  %init = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%i0, %a, %b)
  %while.1 = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4,8,128]{2,1,0} get-tuple-element(%while.1), index=1
}
"""  # noqa: E501


def test_tpu_compile_counts_a_loop_per_trip_and_its_in_place_updates():
    """The loop's condition (``i < 4`` from 0) gives its 4 trips; each reads its 4 KiB slice of
    ``g`` and writes it into the stack in place (the fusion's first output: not the 16 KiB
    stack, which it does not read), its second output going to VMEM. A loop whose trip count
    cannot be read is named, not counted once."""
    total, by_opcode = tpu_compile.hbm_bytes(_TPU_LOOP_MODULE)
    page = 8 * 128 * 4
    assert by_opcode == {"fusion": 4 * 2 * page} and total == 4 * 2 * page
    unknown = _TPU_LOOP_MODULE.replace("direction=LT", "direction=NE")
    with pytest.raises(ValueError, match="trip count is unknown"):
        tpu_compile.hbm_bytes(unknown)


def test_collective_matmul_bytes_are_the_windowed_einsum_loops_share():
    """A loop whose body XLA's partitioner named as a windowed einsum's is counted in
    ``collective_matmul_bytes`` with its trips, also when it runs inside another loop (twice here:
    2 x 4 trips); the rest of the module is not; ``hbm_bytes`` counts both alike."""
    page = 8 * 128 * 4
    plain = _TPU_LOOP_MODULE
    assert tpu_compile.collective_matmul_bytes(plain) == 0
    windowed = plain.replace("%body", "%windowed_dot_general_body_rs.7")
    assert tpu_compile.collective_matmul_bytes(windowed) == 4 * 2 * page
    assert tpu_compile.hbm_bytes(windowed) == tpu_compile.hbm_bytes(plain)
    outer = """
%outer (c: (s32[], f32[4,8,128], f32[4,8,128])) -> (s32[], f32[4,8,128], f32[4,8,128]) {
  %c = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %j = s32[]{:S(1)} get-tuple-element(%c), index=0
  %a = f32[4,8,128]{2,1,0} get-tuple-element(%c), index=1
  %b = f32[4,8,128]{2,1,0} get-tuple-element(%c), index=2
  %i0 = s32[]{:S(1)} constant(0)
  %init = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%i0, %a, %b)
  %w = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) while(%init), condition=%cond, body=%windowed_dot_general_body_rs.7
  %n = f32[4,8,128]{2,1,0} get-tuple-element(%w), index=1
  %one = s32[]{:S(1)} constant(1)
  %next = s32[]{:S(1)} add(%j, %one)
  ROOT %t = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%next, %n, %b)
}

%cond2 (c: (s32[], f32[4,8,128], f32[4,8,128])) -> pred[] {
  %c = (s32[]{:S(1)}, f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %j = s32[]{:S(1)} get-tuple-element(%c), index=0
  %n = s32[]{:S(1)} constant(2)
  ROOT %lt = pred[]{:S(1)} compare(%j, %n), direction=LT
}

ENTRY"""  # noqa: E501
    nested = windowed.replace("\nENTRY", outer, 1).replace(
        "condition=%cond, body=%windowed_dot_general_body_rs.7\n  ROOT",
        "condition=%cond2, body=%outer\n  ROOT",
    )
    assert nested.count("body=%outer") == 1
    assert tpu_compile.collective_matmul_bytes(nested) == 2 * 4 * 2 * page
    assert tpu_compile.hbm_bytes(nested)[0] == 2 * 4 * 2 * page


def test_byte_counts_read_a_fused_matrix_products_operands_whole():
    """A fusion holding a matrix product reads each element of its operands more than once per
    result element: both counters take its operands whole (a cap at the result's 8 x 4 elements
    would hide most of the (8, 32) and (32, 4) operands)."""
    text = """HloModule m

%product (param_0.1: f32[8,32], param_1.1: f32[32,4]) -> f32[8,4] {
  %param_0.1 = f32[8,32]{1,0} parameter(0)
  %param_1.1 = f32[32,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,32], b: f32[32,4]) -> f32[8,4] {
  %a = f32[8,32]{1,0} parameter(0)
  %b = f32[32,4]{1,0} parameter(1)
  ROOT %out = f32[8,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%product
}
"""  # noqa: E501
    moved = (8 * 32 + 32 * 4 + 8 * 4) * 4
    assert common.hlo_traffic(text) == moved
    assert tpu_compile.hbm_bytes(text)[0] == moved


def test_update_speed_with_stacked_layers(tmp_path, monkeypatch):
    """``--stack_layers``: the set's layers stacked, and SONew told so (its stacked axes)."""
    given = []
    make = updates.make_optimizer

    def spy(name, config=None, stacked_axes=None):
        given.append(stacked_axes)
        return make(name, config, stacked_axes)

    monkeypatch.setattr(updates, "make_optimizer", spy)
    out = tmp_path / "update_speed.json"
    argv = [*TINY, "--stack_layers", "--optimizers", "sonew_tridiag", "--warmup", "1"]
    written = _read(out, update_speed.main([*argv, "--iters", "2", "--out", str(out)]))
    assert written["config"]["stack_layers"] is True
    assert given[-1] == {"embedding": 0, "layers": 1, "final_norm": 0}
    assert [r["optimizer"] for r in written["rows"]] == ["copy", "sonew_tridiag"]


_LOOP_MODULE = """HloModule loop

%fused_stash (param_0: f32[4,8,128], param_1: f32[8,128], param_2: s32[]) -> f32[4,8,128] {
  %param_0 = f32[4,8,128]{2,1,0} parameter(0)
  %param_1 = f32[8,128]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %negate.1 = f32[8,128]{1,0} negate(%param_1)
  %bitcast.1 = f32[1,8,128]{2,1,0} bitcast(%negate.1)
  %zero = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[4,8,128]{2,1,0} dynamic-update-slice(%param_0, %bitcast.1, %param_2, %zero, %zero)
}

%body (carry: (f32[4,8,128], f32[8,128], s32[])) -> (f32[4,8,128], f32[8,128], s32[]) {
  %carry = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}, s32[]) parameter(0)
  %stack = f32[4,8,128]{2,1,0} get-tuple-element(%carry), index=0
  %x = f32[8,128]{1,0} get-tuple-element(%carry), index=1
  %i = s32[] get-tuple-element(%carry), index=2
  %fusion.1 = f32[4,8,128]{2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused_stash, metadata={op_name="jit(f)/while/body/layer_3/stash"}
  ROOT %tuple.1 = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}, s32[]) tuple(%fusion.1, %x, %i)
}

%cond (carry: (f32[4,8,128], f32[8,128], s32[])) -> pred[] {
  %carry = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}, s32[]) parameter(0)
  ROOT %true = pred[] constant(true)
}

%fused_dot (param_0: f32[8,128], param_1: f32[128,64]) -> f32[8,64] {
  %param_0 = f32[8,128]{1,0} parameter(0)
  %param_1 = f32[128,64]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,64]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,8,128], b: f32[8,128], w: f32[128,64]) -> f32[8,64] {
  %a = f32[4,8,128]{2,1,0} parameter(0)
  %b = f32[8,128]{1,0} parameter(1)
  %w = f32[128,64]{1,0} parameter(2)
  %i0 = s32[] constant(0)
  %init = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}, s32[]) tuple(%a, %b, %i0)
  %while.1 = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}, s32[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %fusion.2 = f32[8,64]{1,0} fusion(%b, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(f)/layer_0/proj/dot_general"}
}
"""  # noqa: E501


def test_step_traffic_counts_loops_in_place_updates_and_matrix_flops():
    """Each of the loop's 4 trips reads its 4 KiB row and its index and writes the row into the
    stack in place (not the 16 KiB stack); the product reads 4 KiB and 32 KiB, writes 2 KiB, and
    does 2 * 8 * 64 * 128 FLOPs. Layers merge under one name."""
    page = 8 * 128 * 4
    found = {x["op"]: x for x in step_traffic.launches(_LOOP_MODULE)}
    assert found["while/body/layer_N/stash"] == {
        "op": "while/body/layer_N/stash", "bytes": 4 * (2 * page + 4), "flops": 0, "launches": 4
    }  # fmt: skip
    assert found["layer_N/proj/dot_general"] == {
        "op": "layer_N/proj/dot_general",
        "bytes": page + 128 * 64 * 4 + 8 * 64 * 4,
        "flops": 2 * 8 * 64 * 128,
        "launches": 1,
    }


def test_step_traffic_smoke(tmp_path):
    """The tiny model's step compiled for this host's device, for AdamW and SONew."""
    out = tmp_path / "step_traffic.json"
    argv = ["--model", "tiny", "--dtype", "float32", "--batch_size", "2", "--seq_len", "16"]
    argv += ["--optimizers", "adamw,sonew_tridiag_auto", "--top", "3", "--out", str(out)]
    written = json.loads(out.read_text()) if step_traffic.main(argv) else {}
    assert [r["optimizer"] for r in written["rows"]] == ["adamw", "sonew_tridiag_auto"]
    for row in written["rows"]:
        assert len(row["top"]) == 3 and row["matmul_tflop"] > 0
        assert sum(t["gb"] for t in row["top"]) <= row["gb"]
    assert written["rows"][1]["gb"] > written["rows"][0]["gb"]  # SONew's state moves more
