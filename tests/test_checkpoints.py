"""Checkpoints on disk: round trip onto other meshes, never overwriting, keep limit, corrupt
checkpoints falling back to the previous one (kept, renamed aside), SONew states (those written
before ``graft_lag`` existed among them), and the metrics log."""

import itertools
import json
import logging
import pathlib
import shutil
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sonew_pax import checkpoints, metrics, partitioning, train_state
from sonew_pax.optim import (
    ScaleBySONewDampedState,
    ScaleBySONewLagState,
    ScaleBySONewState,
    sonew,
)
from sonew_pax.train_state import TrainState

SPECS = TrainState(
    step=PartitionSpec(),
    params={"w": PartitionSpec("data", "model"), "b": PartitionSpec()},
    opt_state=(PartitionSpec(), {"w": PartitionSpec(None, "data", "model")}),
)


def _target(mesh) -> TrainState:
    shapes = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params={
            "w": jax.ShapeDtypeStruct((8, 8), jnp.float32),
            "b": jax.ShapeDtypeStruct((3,), jnp.float32),
        },
        opt_state=(
            jax.ShapeDtypeStruct((), jnp.int32),
            {"w": jax.ShapeDtypeStruct((2, 8, 8), jnp.float32)},
        ),
    )
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        shapes,
        SPECS,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )


def _state(step: int, mesh) -> TrainState:
    """A small state whose values depend on ``step``, placed per SPECS on ``mesh``."""
    values = TrainState(
        step=jnp.int32(step),
        params={"w": jnp.arange(64.0).reshape(8, 8) + step, "b": jnp.ones(3) * step},
        opt_state=(jnp.int32(step), {"w": jnp.full((2, 8, 8), float(step))}),
    )
    return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), values, _target(mesh))


def _assert_same(a: TrainState, b: TrainState) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture
def mesh_2x4():
    return partitioning.make_mesh(data=2, model=4)


@pytest.mark.parametrize("shape", [(4, 2), (1, 1)], ids=["4x2", "1-device"])
def test_restore_onto_another_mesh(tmp_path, mesh_2x4, shape):
    ckpts = checkpoints.Checkpoints(tmp_path, keep=None)
    ckpts.save(_state(5, mesh_2x4), {"step": 5})
    ckpts.close()
    devices = jax.devices()[: shape[0] * shape[1]]
    other = partitioning.make_mesh(data=shape[0], model=shape[1], devices=devices)
    state, data, _ = checkpoints.Checkpoints(tmp_path).restore_latest(_target(other))
    assert data == {"step": 5}
    _assert_same(state, _state(5, other))
    assert state.params["w"].sharding.is_equivalent_to(NamedSharding(other, SPECS.params["w"]), 2)


def test_no_checkpoint_restores_none(tmp_path, mesh_2x4):
    assert checkpoints.Checkpoints(tmp_path).restore_latest(_target(mesh_2x4)) is None


def test_never_overwrites_and_keeps_the_newest(tmp_path, mesh_2x4):
    ckpts = checkpoints.Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3):
        assert ckpts.save(_state(step, mesh_2x4), {"step": step})
    assert not ckpts.save(_state(3, mesh_2x4), {"step": -1})
    ckpts.close()
    assert checkpoints.Checkpoints(tmp_path).steps() == [2, 3]
    _, data, _ = checkpoints.Checkpoints(tmp_path).restore_latest(_target(mesh_2x4))
    assert data == {"step": 3}  # the second save of step 3 did not replace the first


def _corrupt(path: pathlib.Path) -> None:
    """Truncates every array data file of a checkpoint (what a torn write could leave)."""
    for file in (path / "state").rglob("*"):
        if file.is_file() and file.parent.name == "d":
            file.write_bytes(b"")


def test_corrupt_latest_falls_back_and_is_kept(tmp_path, mesh_2x4, caplog):
    ckpts = checkpoints.Checkpoints(tmp_path)
    for step in (4, 8):
        ckpts.save(_state(step, mesh_2x4), {"step": step})
    ckpts.close()
    _corrupt(tmp_path / "checkpoint_8")
    with caplog.at_level(logging.WARNING):
        state, data, _ = checkpoints.Checkpoints(tmp_path).restore_latest(_target(mesh_2x4))
    assert data == {"step": 4}
    _assert_same(state, _state(4, mesh_2x4))
    assert any(str(tmp_path / "checkpoint_8") in r.getMessage() for r in caplog.records)
    assert (tmp_path / "checkpoint_8.corrupt" / "state").is_dir()  # renamed aside, not deleted
    assert checkpoints.Checkpoints(tmp_path).steps() == [4]


def test_no_restorable_checkpoint_is_an_error(tmp_path, mesh_2x4):
    ckpts = checkpoints.Checkpoints(tmp_path)
    ckpts.save(_state(3, mesh_2x4), {"step": 3})
    ckpts.close()
    _corrupt(tmp_path / "checkpoint_3")
    with pytest.raises(RuntimeError, match="checkpoint_3"):
        checkpoints.Checkpoints(tmp_path).restore_latest(_target(mesh_2x4))
    assert (tmp_path / "checkpoint_3").is_dir()  # a config error must not rename anything


def test_truncate_jsonl_drops_lines_after_the_checkpoint(tmp_path):
    path = tmp_path / metrics.METRICS_FILE
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 8)]
    path.write_text("\n".join(lines) + '\n{"step": 8, "lo')  # torn last line
    metrics.truncate_jsonl(path, 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_progress_line_and_durations():
    progress = metrics.Progress(total_steps=100, tokens_per_step=1000, every=10)
    assert progress.due(10) and progress.due(100) and not progress.due(11)
    line = progress.line(10, 2.5)
    for part in ("step 10/100", "loss 2.5000", "steps/s", "tokens/s", "ETA"):
        assert part in line
    assert "MFU" not in line and set(progress.window) == {"tokens_per_sec_per_device"}
    assert metrics.format_duration(3725) == "1h02m05s"
    assert metrics.format_duration(65) == "1m05s"


def test_progress_reports_mfu_on_a_known_device():
    assert metrics.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert metrics.peak_flops("TPU v5 lite") == 197e12
    assert metrics.peak_flops("cpu") is None
    progress = metrics.Progress(
        total_steps=100, tokens_per_step=1000, every=10, devices=4,
        flops_per_token=6e9, peak_flops_per_device=1e15,
    )  # fmt: skip
    line = progress.line(10, 2.5)
    rates = progress.window
    assert "MFU " in line and "/device)" in line
    assert rates["mfu"] == pytest.approx(rates["tokens_per_sec_per_device"] * 6e9 / 1e15)


def test_unfinished_save_is_reported_and_kept_aside(tmp_path, mesh_2x4, caplog):
    ckpts = checkpoints.Checkpoints(tmp_path)
    ckpts.save(_state(5, mesh_2x4), {"step": 5})
    ckpts.close()
    torn = tmp_path / "checkpoint_10.orbax-checkpoint-tmp"  # a save killed mid-write
    shutil.copytree(tmp_path / "checkpoint_5", torn)
    ckpts = checkpoints.Checkpoints(tmp_path)
    with caplog.at_level(logging.WARNING):
        _, data, _ = ckpts.restore_latest(_target(mesh_2x4))
    assert data == {"step": 5}
    assert any(str(torn) in r.getMessage() for r in caplog.records)
    assert (tmp_path / "checkpoint_10.partial" / "state").is_dir()
    assert ckpts.save(_state(10, mesh_2x4), {"step": 10})  # the step is redone normally
    ckpts.close()
    assert checkpoints.Checkpoints(tmp_path).steps() == [5, 10]


class _SONewStateBeforeGraftLag(NamedTuple):
    """SONew's state as checkpoints written before ``graft_lag`` existed hold it: orbax
    stores a NamedTuple by its field names, so this stands in for the class of that time."""

    count: jax.Array
    m: Any
    d: Any
    e: Any


SONEW_PARAMS = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), "b": jnp.arange(3.0)}
SONEW_SPECS = {"w": PartitionSpec("data", "model"), "b": PartitionSpec()}


def _sonew_states(tx, mesh) -> tuple[TrainState, TrainState]:
    """A state after two SONew steps, placed on ``mesh``, and the restore target for ``tx``."""
    opt_state = tx.init(SONEW_PARAMS)
    for scale in (1.0, -0.5):
        grads = jax.tree.map(lambda p, s=scale: s * jnp.cos(p) + 0.1, SONEW_PARAMS)
        _, opt_state = tx.update(grads, opt_state, SONEW_PARAMS)
    layout = train_state.derive_layout(SONEW_PARAMS, tx, SONEW_SPECS, mesh)
    state = TrainState(jnp.int32(2), SONEW_PARAMS, opt_state)
    return jax.device_put(state, layout.shardings), layout.abstract_with_shardings()


def test_sonew_state_from_before_graft_lag_restores(tmp_path, mesh_2x4):
    """The absolute damping's state (not lagged) keeps its four fields, so checkpoints from
    before graft_lag restore."""
    state, target = _sonew_states(sonew(0.1, band=1, damping="absolute"), mesh_2x4)
    sonew_state = state.opt_state[0]
    assert type(sonew_state) is ScaleBySONewState
    assert sonew_state._fields == ("count", "m", "d", "e")
    old_opt_state = (_SONewStateBeforeGraftLag(*sonew_state), *state.opt_state[1:])
    before = state._replace(opt_state=old_opt_state)
    ckpts = checkpoints.Checkpoints(tmp_path, async_save=False)
    ckpts.save(before, {"step": 2})
    ckpts.close()
    restored, data, _ = checkpoints.Checkpoints(tmp_path).restore_latest(target)
    assert data == {"step": 2}
    assert type(restored.opt_state[0]) is ScaleBySONewState
    _assert_same(restored, state)


@pytest.mark.parametrize(
    "kwargs, kind, field",
    [
        (dict(graft_lag=True, damping="absolute"), ScaleBySONewLagState, "ratio"),
        ({}, ScaleBySONewDampedState, "diag"),  # the default damping's statistics
    ],
)
def test_sonew_per_tensor_numbers_round_trip(tmp_path, mesh_2x4, kwargs, kind, field):
    """``graft_lag``'s state (its ratios) and the relative damping's (its statistics), each one
    array over the preconditioned tensors, restore into their own types."""
    state, target = _sonew_states(sonew(0.1, band=1, **kwargs), mesh_2x4)
    assert type(state.opt_state[0]) is kind
    ckpts = checkpoints.Checkpoints(tmp_path, async_save=False)
    ckpts.save(state, {"step": 2})
    ckpts.close()
    restored, _, _ = checkpoints.Checkpoints(tmp_path).restore_latest(target)
    scalars = getattr(restored.opt_state[0], field)
    assert type(restored.opt_state[0]) is kind
    assert scalars.shape == (1,) and float(scalars[0]) > 0  # "w"; "b" takes Adam's direction
    _assert_same(restored, state)


def leftovers(model_dir: pathlib.Path) -> list[str]:
    """Directories of saves that did not finish."""
    return sorted(
        p.name
        for p in model_dir.iterdir()
        if ".orbax-checkpoint-tmp" in p.name or ".partial" in p.name
    )


def test_failed_background_save_is_found_removed_and_retried(tmp_path, mesh_2x4, failing_saves):
    ckpts = checkpoints.Checkpoints(tmp_path, keep=1, retries=2, backoff_s=0.0)
    assert ckpts.save(_state(4, mesh_2x4), {"step": 4}, wait=True)
    failing_saves(lambda step: step == 8)
    assert ckpts.save(_state(8, mesh_2x4), {"step": 8})  # the write fails in the background
    deadline = time.monotonic() + 60
    while not ckpts.save_failed():  # found without waiting, once the write has ended
        assert time.monotonic() < deadline, "the failed write was not reported"
        time.sleep(0.01)
    assert ckpts.steps() == [4]  # kept: keep=1 deletes it only once a newer one is complete
    assert ckpts.save(_state(9, mesh_2x4), {"step": 9})  # the retry, at the next step
    ckpts.close()
    assert checkpoints.Checkpoints(tmp_path).steps() == [9]
    assert leftovers(tmp_path) == []


def test_save_that_fails_then_succeeds_on_a_retry(tmp_path, mesh_2x4, failing_saves, caplog):
    ckpts = checkpoints.Checkpoints(tmp_path, retries=3, backoff_s=0.0)
    writes = itertools.count()
    failing_saves(lambda step: next(writes) < 2)  # the first attempt's two JSON items
    with caplog.at_level(logging.WARNING):
        assert ckpts.save(_state(8, mesh_2x4), {"step": 8}, wait=True)
        ckpts.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("Retrying the save of step 8" in m for m in messages)
    assert not any("could not be removed" in m for m in messages)  # the failed one's were
    assert checkpoints.Checkpoints(tmp_path).steps() == [8]
    assert leftovers(tmp_path) == []


def test_save_that_keeps_failing_stops_and_leaves_the_previous_checkpoint(
    tmp_path, mesh_2x4, failing_saves
):
    ckpts = checkpoints.Checkpoints(tmp_path, keep=1, retries=2, backoff_s=0.0)
    ckpts.save(_state(4, mesh_2x4), {"step": 4})
    (tmp_path / "checkpoint_3.partial").mkdir()  # set aside by an earlier start
    failing_saves(lambda step: step > 4)
    with pytest.raises(
        checkpoints.SaveError, match=r"step 8 .*\(3 attempts\).*checkpoint_4"
    ) as error:
        ckpts.save(_state(8, mesh_2x4), {"step": 8}, wait=True)
    assert "ENOSPC" in str(error.value) or "No space left" in str(error.value)
    ckpts.close()
    assert checkpoints.Checkpoints(tmp_path).steps() == [4]
    failing_saves(lambda step: False)  # the disk has room again: a rerun
    rerun = checkpoints.Checkpoints(tmp_path, keep=1)
    assert rerun.restore_latest(_target(mesh_2x4)).data == {"step": 4}
    assert rerun.save(_state(8, mesh_2x4), {"step": 8}, wait=True)
    rerun.close()
    assert checkpoints.Checkpoints(tmp_path).steps() == [8]
    assert leftovers(tmp_path) == []  # no partial save of any attempt is left


def test_reader_falls_back_when_the_trainer_deletes_what_it_reads(tmp_path, mesh_2x4, monkeypatch):
    writer = checkpoints.Checkpoints(tmp_path, async_save=False)
    for step in (4, 8):
        writer.save(_state(step, mesh_2x4), {"step": step}, wait=True)
    reader = checkpoints.Checkpoints(tmp_path, async_save=False)
    read = checkpoints.Checkpoints._restore_params_intact
    # What the trainer does while each checkpoint is read: (deleted, saved).
    rotations = iter([(8, 12), (4, None), (None, None)])

    def rotated_while_read(self, step, target):
        deleted, saved = next(rotations)
        if deleted is not None:
            shutil.rmtree(tmp_path / f"checkpoint_{deleted}")
        if saved is not None:
            writer.save(_state(saved, mesh_2x4), {"step": saved}, wait=True)
        return read(self, step, target)

    monkeypatch.setattr(checkpoints.Checkpoints, "_restore_params_intact", rotated_while_read)
    params = _target(mesh_2x4).params
    step, restored = reader.restore_params(params)  # 8 and 4 vanish; 12 is listed again
    assert step == 12
    _assert_same(restored, _state(12, mesh_2x4).params)
    writer.close()
    reader.close()


def test_listing_while_a_checkpoint_vanishes_lists_again(tmp_path, mesh_2x4, monkeypatch):
    writer = checkpoints.Checkpoints(tmp_path, async_save=False)
    writer.save(_state(4, mesh_2x4), {"step": 4})
    writer.close()
    load = ocp.CheckpointManager._load_checkpoint_infos
    failures = iter([FileNotFoundError(tmp_path / "checkpoint_2" / "_CHECKPOINT_METADATA")])

    def vanishing(self, *args, **kwargs):
        for error in failures:
            raise error
        return load(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "_load_checkpoint_infos", vanishing)
    assert checkpoints.Checkpoints(tmp_path).steps() == [4]
