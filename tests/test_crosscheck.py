"""`sonew_pax.crosscheck`, the first check of a new slice: two runs of one config compared step by
step. End to end as ``launch/tpu_pod.sh check`` runs it, with the CPU standing in for the TPU:
the run with splash attention (Pallas, interpreted) against its reference with the einsum form,
on the same 8-device mesh, agree; a step whose loss is off, a run that logged nothing and runs
that logged different steps (one stopped early) are told apart by the exit status."""

import json

import pytest

from sonew_pax import crosscheck
from tests.test_cli import env, run  # noqa: F401  (env is a fixture)

STEPS = 4
# The check's shape: a sequence length splash takes, the learning rate warmed up after 2 steps.
CHECK = ("--gin.SEQ_LEN=128", "--gin.learning_rate_schedule.warmup_steps=2")


def _write_metrics(model_dir, records) -> str:
    model_dir.mkdir(exist_ok=True)
    lines = [json.dumps({"step": s, **values}) for s, values in records.items()]
    (model_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return str(model_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, env):  # noqa: F811
    """The checked run (splash) and its reference (einsum attention): their MODEL_DIRs."""
    dirs = []
    for attention in ("splash", "xla"):
        model_dir = tmp_path_factory.mktemp(attention)
        choice = f'--gin.TransformerConfig.attention="{attention}"'
        done = run(model_dir, STEPS, env, *CHECK, choice)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"Attention: {attention}" in done.stderr
        dirs.append(model_dir)
    return dirs


def test_splash_run_agrees_with_its_reference(runs, capsys):
    run_dir, reference_dir = runs
    assert crosscheck.main([str(run_dir), str(reference_dir), "--rtol=1e-3"]) == 0
    out = capsys.readouterr().out
    assert f"{STEPS} steps agree" in out
    steps = crosscheck.read_steps(str(reference_dir))
    assert sorted(steps) == list(range(1, STEPS + 1))
    # The compared values moved: the check compares training, not a constant.
    assert steps[STEPS]["loss"] < steps[1]["loss"]


def test_a_step_off_by_more_than_rtol_fails_and_is_named(runs, tmp_path, capsys):
    _, reference_dir = runs
    records = crosscheck.read_steps(str(reference_dir))
    records[3] = dict(records[3], loss=records[3]["loss"] * 1.05)
    changed = _write_metrics(tmp_path / "changed", records)
    assert crosscheck.main([changed, str(reference_dir), "--rtol=0.02"]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if "past rtol" in line]
    assert len(flagged) == 1 and flagged[0].split()[:2] == ["3", "loss"]
    assert "DISAGREE" in out and "(loss, step 3)" in out


def test_non_finite_values_agree_only_with_non_finite():
    assert crosscheck.relative_difference(None, None) == 0.0
    assert crosscheck.relative_difference(None, 1.0) == crosscheck.relative_difference(1.0, None)
    assert crosscheck.relative_difference(1.0, None) == float("inf")
    assert crosscheck.relative_difference(1.01, 1.0) == pytest.approx(0.01)


def test_missing_metrics_and_disjoint_steps_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    one = _write_metrics(tmp_path / "one", {1: {"loss": 2.0, "grad_norm": 1.0}})
    two = _write_metrics(tmp_path / "two", {2: {"loss": 2.0, "grad_norm": 1.0}})
    assert crosscheck.main([str(empty), one]) == 2
    assert "no metrics.jsonl in" in capsys.readouterr().err
    assert crosscheck.main([one, two]) == 2
    assert "only the run has [1], only the reference [2]" in capsys.readouterr().err


def test_a_run_that_stopped_early_exits_2_naming_the_missing_steps(runs, tmp_path, capsys):
    _, reference_dir = runs
    records = crosscheck.read_steps(str(reference_dir))
    shorter = _write_metrics(tmp_path / "shorter", {s: records[s] for s in range(1, STEPS)})
    assert crosscheck.main([shorter, str(reference_dir)]) == 2
    assert f"only the reference [{STEPS}]" in capsys.readouterr().err
