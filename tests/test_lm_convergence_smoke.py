"""Smoke test of the LM convergence benchmark on CPU: a 1-layer tiny model, 2 learning rates per
optimizer, 20 steps; checks the JSON schema, the markdown and the plot. Plus its pure helpers."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lm_convergence

ARGV = [
    "--model", "tiny", "--layers", "1", "--batch_size", "2", "--seq_len", "16",
    "--steps", "20", "--eval_every", "10", "--eval_batches", "2", "--warmup_steps", "4",
    "--lrs_adamw", "1e-3,3e-3", "--lrs_adafactor", "1e-3,3e-3", "--lrs_sonew", "1e-3,3e-3",
]  # fmt: skip


def test_steps_to_reach_interpolates():
    steps, losses = [0, 10, 20], [5.0, 3.0, 2.0]
    assert lm_convergence.steps_to_reach(steps, losses, 4.0) == pytest.approx(5.0)
    assert lm_convergence.steps_to_reach(steps, losses, 2.0) == pytest.approx(20.0)
    assert lm_convergence.steps_to_reach(steps, losses, 6.0) == 0.0
    assert lm_convergence.steps_to_reach(steps, losses, 1.0) is None
    assert lm_convergence.steps_to_reach([0, 10], [5.0, None], 4.0) is None


def test_run_order_round_robin_middle_first():
    order = lm_convergence.run_order({"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0, 6.0, 7.0, 8.0]})
    assert order[:4] == [("a", 2.0), ("b", 6.0), ("a", 3.0), ("b", 7.0)]
    assert sorted(order) == sorted(
        (n, v) for n in "ab" for v in ([1, 2, 3, 4] if n == "a" else [5, 6, 7, 8])
    )


def test_adam_decay_rate_is_bias_corrected_ema():
    b2, v, g2 = 0.9, 0.0, [1.0, 4.0, 9.0]
    for step, x in enumerate(g2):
        decay = float(lm_convergence.adam_decay_rate(step, b2))
        v = decay * v + (1 - decay) * x
    ema = sum((1 - b2) * b2 ** (len(g2) - 1 - i) * x for i, x in enumerate(g2))
    assert v == pytest.approx(ema / (1 - b2 ** len(g2)), rel=1e-6)


def test_tiny_sweep_writes_schema_and_plot(tmp_path):
    out = tmp_path / "lm_convergence.json"
    result = lm_convergence.main([*ARGV, "--out", str(out)])

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"device", "date", "config", "rows", "runs"} <= written.keys()
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 0
    assert written["config"]["steps"] == 20 and written["config"]["tokenizer"].startswith("byte")

    assert len(written["runs"]) == 6
    for run in written["runs"]:
        assert run["curve"]["step"] == [0, 10, 20]
        assert all(math.isfinite(x) for x in run["curve"]["eval_loss"])
        assert run["final_eval_loss"] == run["curve"]["eval_loss"][-1]
    initial = {run["curve"]["eval_loss"][0] for run in written["runs"]}
    assert max(initial) - min(initial) < 1e-5  # same initial parameters for every run

    rows = {row["optimizer"]: row for row in written["rows"]}
    assert set(rows) == set(lm_convergence.OPTIMIZERS)
    keys = {"optimizer", "learning_rate", "final_eval_loss", "steps_to_adamw_final",
            "steps_ratio_vs_adamw"}  # fmt: skip
    for name, row in rows.items():
        assert keys <= row.keys()
        best = min(r["final_eval_loss"] for r in written["runs"] if r["optimizer"] == name)
        assert row["final_eval_loss"] == best
    assert rows["adamw"]["steps_ratio_vs_adamw"] == 1.0
    assert rows["adamw"]["final_eval_loss"] < written["runs"][0]["curve"]["eval_loss"][0]
