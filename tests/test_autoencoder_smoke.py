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
def test_one_epoch_writes_schema_and_learns(optimizer, tmp_path, capsys):
    out = tmp_path / "autoencoder.json"
    result = run_one_epoch(optimizer, out)
    assert f"{optimizer} epoch 1/1: loss " in capsys.readouterr().out  # the progress line

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


@pytest.mark.skipif(not has_sonew(), reason="sonew_pax.optim.sonew not written")
def test_sonew_damping_flag_reaches_the_optimizer():
    """``--sonew_damping`` is parsed and builds SONew with that damping: the relative one's
    update of the autoencoder's parameters is finite and differs from the absolute one's."""
    import jax
    import jax.numpy as jnp

    assert autoencoder.parse_args(["--sonew_damping", "mean"]).sonew_damping == "mean"
    params = autoencoder.init_params(jax.random.PRNGKey(0), jnp.float32)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    grads = treedef.unflatten(
        [1e-3 * jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves, strict=True)]
    )
    hp = {"b1": 0.9, "b2": 0.999, "eps": 1e-2}

    def update(damping):
        tx = autoencoder.make_tx("sonew_tridiag", hp, 1e-3, damping=damping)
        return jax.jit(tx.update)(grads, tx.init(params), params)[0]

    relative, absolute = update("mean"), update("absolute")
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(relative))
    assert any(
        float(jnp.max(jnp.abs(a - b))) > 0
        for a, b in zip(jax.tree.leaves(relative), jax.tree.leaves(absolute), strict=True)
    )


def test_sonew_eps_flag_replaces_the_papers_for_sonew_only():
    """``--sonew_eps default`` runs SONew's variants at the library's ε (the paper's lr and betas
    kept), a number at that ε, and leaves the other optimizers at the paper's."""
    from sonew_pax.optim import DEFAULT_EPS

    paper = autoencoder.PAPER_HPARAMS["float32"]
    for value, expected in (("default", DEFAULT_EPS), ("3e-2", 3e-2), ("paper", None)):
        args = autoencoder.parse_args(["--sonew_eps", value, "--optimizers", "adam,sonew_band4"])
        (band4,) = autoencoder.runs_for("sonew_band4", args)
        assert band4["eps"] == (paper["sonew_band4"]["eps"] if expected is None else expected)
        assert band4["learning_rate"] == paper["sonew_band4"]["learning_rate"]
        assert autoencoder.runs_for("adam", args)[0]["eps"] == paper["adam"]["eps"]
    for bad in ("tiny", "0", "-1e-3"):
        with pytest.raises(SystemExit):
            autoencoder.parse_args(["--sonew_eps", bad])
