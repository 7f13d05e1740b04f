"""Cloud model directories: a gs:// MODEL_DIR stays a URI through the trainer's path handling and
its files go through epath (to a fake GCS on local disk here: no network), and a missing cloud
backend fails early with a message naming the path and the package to install."""

import json
import os
import pathlib

import fsspec
import jax
import jax.numpy as jnp
import pytest
from etils.epath import backend as epath_backend
from etils.epath import gpath
from orbax.checkpoint._src.path import gcs_utils

from sonew_pax import checkpoint_layout, checkpoints, loop, metrics, paths
from sonew_pax.train_state import TrainState

RUN = "gs://bucket/run"


class FakeGcs:
    """An fsspec-like filesystem keeping ``gs://BUCKET/KEY`` at ``root/BUCKET/KEY``.

    Stands in for gcsfs behind epath's fsspec backend; like an object store, writing a file needs
    no parent directory to exist first.
    """

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.local = fsspec.filesystem("file", auto_mkdir=True)

    def _local(self, path) -> str:
        path = os.fspath(path)
        assert path.startswith("gs://"), f"not a gs:// path: {path!r}"
        return str(self.root / path.removeprefix("gs://"))

    def glob(self, pattern, **kwargs):
        root = str(self.root) + "/"
        return [p.removeprefix(root) for p in self.local.glob(self._local(pattern), **kwargs)]

    def rename(self, path, dst, **kwargs):
        return self.local.mv(self._local(path), self._local(dst), **kwargs)

    def __getattr__(self, name):
        method = getattr(self.local, name)
        return lambda path, *args, **kwargs: method(self._local(path), *args, **kwargs)


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
    """gs:// through epath's fsspec backend onto ``tmp_path/gcs``; cwd is an empty directory so
    that a mangled local ``gs:/...`` path would show up there."""
    root = tmp_path / "gcs"
    root.mkdir()
    fake = FakeGcs(root)
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
    monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: fake)
    monkeypatch.setattr(paths, "_installed", lambda package: True)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield root
    assert not list(cwd.iterdir()), "something was written to a local path"


@pytest.mark.parametrize("uri", [RUN, "s3://bucket/run", "az://container/run"])
def test_cloud_model_dir_stays_a_uri(uri):
    assert str(pathlib.Path(uri)) != uri  # what the trainer did before: gs:/bucket/run
    assert str(paths.as_path(uri)) == uri
    assert paths.is_cloud(uri) and not paths.is_cloud("/tmp/run")
    assert str(checkpoints.checkpoint_dir(uri, 7)) == f"{uri}/checkpoint_7"
    assert str(paths.as_path(uri) / metrics.METRICS_FILE) == f"{uri}/metrics.jsonl"


def test_local_model_dir_unchanged(tmp_path):
    assert os.fspath(paths.model_dir(tmp_path)) == os.fspath(tmp_path)
    assert os.fspath(paths.model_dir("relative/run")) == "relative/run"


def test_missing_backend_fails_before_training(monkeypatch):
    monkeypatch.setattr(paths, "_installed", lambda package: package == "fsspec")

    def no_data(**kwargs):
        raise AssertionError("training started")

    with pytest.raises(paths.MissingBackendError) as error:
        loop.train(
            model_dir=RUN,
            train_steps=1,
            batch_size=8,
            seq_len=8,
            checkpoint_period=1,
            eval_period=0,
            seed=0,
            model_config=None,
            learning_rate=None,
            train_data=no_data,
        )
    message = str(error.value)
    assert RUN in message and "pip install gcsfs google-cloud-storage" in message
    with pytest.raises(paths.MissingBackendError, match=r"s3://bucket/run.*pip install s3fs"):
        checkpoints.Checkpoints("s3://bucket/run")
    with pytest.raises(paths.MissingBackendError, match="pip install gcsfs"):
        metrics.MetricsWriter(RUN, enabled=True)
    metrics.MetricsWriter(RUN, enabled=False)  # other processes write nothing, check nothing


def test_tensorflow_serves_gs(monkeypatch):
    installed = {"tensorflow", "google.cloud.storage"}
    monkeypatch.setattr(paths, "_installed", lambda module: module in installed)
    monkeypatch.delenv("EPATH_USE_TF", raising=False)
    paths.check_backend(RUN)  # epath uses tf.io.gfile then
    monkeypatch.setenv("EPATH_USE_TF", "0")
    with pytest.raises(paths.MissingBackendError, match="fsspec and gcsfs are not installed"):
        paths.check_backend(RUN)
    monkeypatch.delenv("EPATH_USE_TF")
    installed.remove("google.cloud.storage")
    with pytest.raises(paths.MissingBackendError, match="pip install google-cloud-storage"):
        paths.check_backend(RUN)


def test_installed_handles_missing_parent_packages():
    assert paths._installed("json")
    assert not paths._installed("no_such_package_here.storage")


def test_unsupported_scheme_is_an_error():
    with pytest.raises(ValueError, match=r"unsupported URI scheme gcs://"):
        paths.model_dir("gcs://bucket/run")


def test_metrics_on_gcs_upload_whole_files(fake_gcs):
    writer = metrics.MetricsWriter(RUN, enabled=True, upload_every_s=3600)
    for step in (1, 2, 3):
        writer.write(step, {"loss": 1.0 / step, "eval_loss": 2.0})
    writer.flush(force=False)  # too soon after the start: nothing uploaded yet
    run = fake_gcs / "bucket" / "run"
    assert not (run / metrics.METRICS_FILE).exists()
    writer.flush()
    lines = (run / metrics.METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    for name in ("train", "eval"):
        (event_file,) = (run / name).glob("events.out.tfevents.*")
        assert event_file.stat().st_size > 0
    writer.close()

    resumed = metrics.MetricsWriter(RUN, enabled=True, resume_step=2)
    resumed.write(3, {"loss": 0.5})
    resumed.close()
    lines = (run / metrics.METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert json.loads(lines[-1])["loss"] == 0.5


def test_write_text_atomic(tmp_path, fake_gcs):
    local = paths.as_path(tmp_path / "config.gin")
    local.write_text("old")
    paths.write_text_atomic(local, "new")
    assert local.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["config.gin", "cwd", "gcs"]  # no temporary file left
    paths.write_text_atomic(paths.as_path(RUN) / "config.gin", "cloud")
    assert (fake_gcs / "bucket" / "run" / "config.gin").read_text() == "cloud"


def test_unfinished_cloud_saves_set_aside(fake_gcs, monkeypatch):
    run = fake_gcs / "bucket" / "run"
    committed = {"commit_timestamp_nsecs": 1}
    layout = {
        "checkpoint_3": {"state/x": "partial"},  # killed mid-save: no commit file, no commit time
        # written through gcsfuse: renamed, no commit file, a commit time
        "checkpoint_4": {checkpoint_layout.STEP_METADATA_FILE: json.dumps(committed)},
        "checkpoint_5": {checkpoint_layout.COMMIT_FILE: "ok"},
    }
    for name, files in layout.items():
        for file, text in files.items():
            (run / name / file).parent.mkdir(parents=True, exist_ok=True)
            (run / name / file).write_text(text)
    found = [p.name for p in checkpoints.unfinished_saves(RUN)]
    assert found == ["checkpoint_3", "checkpoint_4"]
    # The orbax manager itself on the fake bucket (its hierarchical-namespace probe needs GCS).
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    ckpts = checkpoints.Checkpoints(RUN)
    assert str(ckpts.model_dir) == RUN
    assert ckpts.steps() == [5]
    ckpts._set_aside_partial_saves()
    ckpts._manager.reload()
    assert ckpts.steps() == [4, 5]
    ckpts.close()
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint_3.partial",
        "checkpoint_4",
        "checkpoint_5",
    ]
    assert (run / "checkpoint_3.partial" / "state" / "x").read_text() == "partial"
    assert (run / "checkpoint_4" / checkpoint_layout.COMMIT_FILE).exists()
    assert checkpoints.unfinished_saves(RUN) == []


def test_local_checkpoints_record_their_commit(tmp_path):
    """What `was_committed` relies on: orbax records the commit time in complete checkpoints."""
    state = TrainState(jnp.int32(2), {"w": jnp.ones(4)}, (jnp.zeros(4),))
    ckpts = checkpoints.Checkpoints(tmp_path, async_save=False)
    ckpts.save(jax.device_put(state), {"step": 2})
    ckpts.close()
    assert checkpoints.was_committed(paths.as_path(checkpoints.checkpoint_dir(tmp_path, 2)))
    assert checkpoints.unfinished_saves(tmp_path) == []


def test_tpu_pod_without_gcsfuse_trains_into_gs():
    from tests.test_launch import TPU_ENV, run_script

    result = run_script("tpu_pod.sh", "all", env=TPU_ENV | {"DRY_RUN": "1", "GCSFUSE": "0"})
    assert result.returncode == 0, result.stderr
    setup = next(line for line in result.stdout.splitlines() if "pip install" in line)
    assert "sonew_pax[trainer,gcs]" in setup and "gcsfuse" not in setup
    assert 'MODEL_DIR=\\\\\\"gs://b/run\\\\\\"' in result.stdout.splitlines()[-1]
    bad = run_script("tpu_pod.sh", env=TPU_ENV | {"DRY_RUN": "1", "GCSFUSE": "yes"})
    assert bad.returncode == 2 and "GCSFUSE must be 0 or 1" in bad.stderr
