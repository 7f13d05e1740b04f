"""Smoke test of benchmarks/scaling.py on 8 simulated CPU devices, tiny tensors and a tiny model.

The script runs in a subprocess with its own XLA_FLAGS (8 host devices; cheap CPU compilation, as
compiling dominates at this size); the update part runs only the 2-D variant (the ``model`` one
goes through the same code and is covered by test_benchmarks_smoke.py). No timing is asserted.
The pure helpers are tested in-process.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import scaling, train_step
from tests.flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]

FAST_CPU = f"{xla_flags(8)} --xla_llvm_disable_expensive_passes=true"
TINY = [
    *("--scale", "0.03125", "--layers", "1", "--check_steps", "1"),
    *("--update_warmup", "0", "--update_iters", "1", "--device_counts", "1,8"),
    *("--variants", "data_model"),
    *("--model", "tiny", "--train_layers", "1", "--dtype", "float32", "--batch_size", "8"),
    *("--seq_len", "8", "--warmup", "0", "--iters", "1", "--meshes", "8x1,2x4"),
]


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def test_default_device_counts_and_meshes():
    assert scaling.default_device_counts(4) == [1, 2, 4]
    assert scaling.default_device_counts(8) == [1, 2, 4, 8]
    assert scaling.default_device_counts(6) == [1, 2, 4, 6]
    assert scaling.default_meshes(4) == [(4, 1), (2, 2), (1, 4)]
    assert scaling.default_meshes(8) == [(8, 1), (4, 2), (2, 4)]
    assert scaling.default_meshes(2) == [(2, 1), (1, 2)]
    assert scaling.parse_meshes("4x1,1x4", 4) == [(4, 1), (1, 4)]
    assert scaling.parse_meshes("", 8) == scaling.default_meshes(8)
    with pytest.raises(SystemExit):
        scaling.parse_meshes("4x2", 4)


def test_loss_agreement():
    rows = [
        {"optimizer": "adamw", "mesh": "4x1", "loss": 2.0, "first_loss": 5.0},
        {"optimizer": "adamw", "mesh": "2x2", "loss": 2.01, "first_loss": 5.0},
        {"optimizer": "adamw", "mesh": "1x4", "error": "OOM"},
        {"optimizer": "sonew_tridiag", "mesh": "4x1", "loss": 1.0, "first_loss": 5.0},
    ]
    agreement = scaling.loss_agreement(rows, rtol=1e-2)
    assert agreement["adamw"]["meshes"] == "4x1,2x2"
    assert agreement["adamw"]["max_abs_diff_loss"] == pytest.approx(0.01)
    assert agreement["adamw"]["agree"] and agreement["sonew_tridiag"]["agree"]
    assert rows[1]["loss_diff"] == pytest.approx(0.01) and "loss_diff" not in rows[2]
    assert not scaling.loss_agreement(rows[:2], rtol=1e-3)["adamw"]["agree"]


def test_train_args_reach_the_worker(tmp_path):
    args = scaling.parse_args(["--model", "tiny", "--train_layers", "1", "--batch_size", "4"])
    targs = scaling.train_args(args, (2, 4))
    child = train_step.parse_args(train_step.child_argv("adamw", targs, tmp_path / "r.json")[3:])
    assert (child.mesh_data, child.mesh_model) == (2, 4)
    assert (child.model, child.layers, child.batch_size) == ("tiny", 1, 4)
    assert (child.warmup, child.iters, child.dtype) == (args.warmup, args.iters, "bfloat16")


def test_scaling_runs_on_8_cpu_devices(tmp_path):
    out = tmp_path / "scaling.json"
    env = {**os.environ, "XLA_FLAGS": FAST_CPU, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "benchmarks.scaling", *TINY, "--no_isolate", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["devices"] == 8 and {"device", "date", "config"} <= result.keys()

    update = result["update_rows"]
    assert [(r["devices"], r["variant"]) for r in update] == [(1, "single"), (8, "data_model")]
    for row in update[1:]:
        assert row["equal"] and row["max_rel_diff"] <= 1e-5
        assert _finite(row["ms_sharded"]) and _finite(row["scaling_efficiency"])

    train = result["train_rows"]
    assert [(r["optimizer"], r["mesh"]) for r in train] == [
        ("adamw", "8x1"),
        ("sonew_tridiag_auto", "8x1"),
        ("adamw", "2x4"),
        ("sonew_tridiag_auto", "2x4"),
    ]
    for row in train:
        assert all(_finite(row[k]) for k in ("steps_per_s", "tokens_per_s", "loss", "first_loss"))
        assert "peak_memory_gib" in row  # None on CPU
    for name in ("adamw", "sonew_tridiag_auto"):
        assert result["loss_agreement"][name]["max_rel_diff_loss"] < 1e-4
    assert "## Train step" in out.with_suffix(".md").read_text()
