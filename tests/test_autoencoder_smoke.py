"""Smoke test of the MNIST autoencoder benchmark: one epoch on 2,000 images, on CPU."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import autoencoder


def has_sonew() -> bool:
    """Whether the SONew optimizer is importable yet."""
    try:
        return importlib.util.find_spec("sonew_pax.optim.sonew") is not None
    except ModuleNotFoundError:
        return False


def run_one_epoch(optimizer: str, out: Path) -> dict:
    """One epoch of 10 steps (2,000 images, batch 200), learning rate decaying from its peak."""
    argv = ["--optimizers", optimizer, "--epochs", "1", "--warmup_epochs", "0"]
    argv += ["--subset", "2000", "--batch_size", "200", "--out", str(out)]
    return autoencoder.main(argv)


@pytest.mark.parametrize(
    "optimizer",
    [
        "adam",
        pytest.param(
            "sonew_tridiag",
            marks=pytest.mark.skipif(not has_sonew(), reason="sonew_pax.optim.sonew not written"),
        ),
    ],
)
def test_one_epoch_writes_schema_and_learns(optimizer, tmp_path):
    out = tmp_path / "autoencoder.json"
    result = run_one_epoch(optimizer, out)

    written = json.loads(out.read_text())
    assert written == result
    assert {"device", "date", "config", "rows"} <= written.keys()
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
    (row,) = written["rows"]
    assert row["optimizer"] == optimizer
    assert {"train_loss", "seconds", "dtype", "learning_rate", "eps", "paper_train_loss"} <= set(
        row
    )
    assert np.isfinite(row["train_loss"]) and np.isfinite(row["curve"]).all()
    assert row["train_loss"] < 0.8 * row["initial_loss"]


def test_model_shape_and_initial_loss():
    """784-...-30-...-784 layers, zero biases, and ≈ 784·ln 2 loss for outputs near 1/2."""
    import jax

    params = autoencoder.init_params(jax.random.PRNGKey(0), "float32")
    assert [p["kernel"].shape[1] for p in params] == list(autoencoder.LAYER_SIZES[1:])
    assert all(not p["bias"].any() for p in params)
    x = jax.random.uniform(jax.random.PRNGKey(1), (8, 784))
    assert abs(float(autoencoder.loss_fn(params, x)) - 784 * np.log(2)) < 100


def test_schedule_warms_up_then_decays_to_zero():
    schedule = autoencoder.lr_schedule(1.0, steps_per_epoch=10, epochs=100, warmup_epochs=5)
    assert float(schedule(0)) == 0.0
    assert float(schedule(25)) == pytest.approx(0.5)
    assert float(schedule(50)) == pytest.approx(1.0)
    assert float(schedule(1000)) == 0.0
    assert float(schedule(525)) == pytest.approx(0.5)
