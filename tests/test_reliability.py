"""Nothing lost, nothing silent: what a run refuses at start, and what it never loses.

One case of each kind (in process, 8 simulated devices, the test_trainer model):
- a run that diverges stops with an error naming the step, saves nothing after it, and leaves
  every checkpoint finite, restorable and unchanged; ``non_finite="skip"`` keeps the state and
  stops after ``max_skipped_steps``;
- a checkpoint whose bytes changed on disk is set aside and the previous one is used;
- settings that cannot work (TRAIN_STEPS, BATCH_SIZE vs the mesh, a misspelled macro) are refused
  before anything is written, and a MODEL_DIR holding another configuration's checkpoints is a
  config mismatch that names the differing arrays;
- one run per MODEL_DIR (`run_lock`), with stale locks taken over;
- metrics.jsonl stays strict JSON (``null`` for non-finite values);
- a checkpoint write that fails is retried at the next step (faults injected by conftest's
  ``failing_saves``), and a run whose saves keep failing stops, keeping its last checkpoint;
- a second Ctrl-C stops at once;
- a resume that would continue with another schedule, data source, tokenizer or batch size is
  a config mismatch naming it, unless allowed; each segment's config is kept;
- user errors in MODEL_DIR, SEQ_LEN, the vocabulary or the corpus are refused at start, named.
The command line's exit status for these is checked in test_cli.py; docs/reliability.md maps
every case to its test.
"""

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sonew_pax import (
    checkpoints,
    data,
    guard,
    inference,
    loop,
    metrics,
    resume,
    run_lock,
    signals,
    train,
)
from sonew_pax.errors import ConfigError, RunError
from tests.conftest import jax_config
from tests.test_checkpoints import leftovers
from tests.test_trainer import PERIOD, STEPS, configure
from tests.test_trainer import _clear_gin as _clear_gin  # the same autouse fixture here

# A learning rate that turns the tiny model's loss to NaN within a few steps, from any state.
DIVERGE = (
    "learning_rate_schedule.peak_value = 1e3",
    "learning_rate_schedule.decay = 'constant'",
    "learning_rate_schedule.warmup_steps = 0",
)
# A small corpus of one document, large enough for a few batches of the test model.
PLAY = b"To be, or not to be, that is the question. " * 40


@pytest.fixture(scope="module", autouse=True)
def _shared_compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the module's runs (what JAX_COMPILATION_CACHE_DIR
    does): a run of a config another test ran loads its train step instead of compiling it."""
    with (
        jax_config("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("cache"))),
        jax_config("jax_persistent_cache_min_compile_time_secs", 0),
    ):
        yield


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """A finished 12-step run with checkpoints at 6 and 12."""
    model_dir = tmp_path_factory.mktemp("healthy")
    configure(model_dir)
    loop.train(eval_data=None)
    gin.clear_config()
    return model_dir


def _copy_checkpoints(source, target) -> None:
    for path in source.glob("checkpoint_*"):
        shutil.copytree(path, target / path.name)


def _tree_digest(path) -> str:
    """A hash of every file's name and bytes under ``path``."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + file.read_bytes())
    return digest.hexdigest()


def _strict_records(model_dir) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (NaN, Infinity are errors)."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


def _all_finite_on_disk(checkpoint) -> bool:
    """Whether every array of ``checkpoint`` (read by orbax alone, no target) is finite."""
    state = ocp.StandardCheckpointer().restore(checkpoint / "state")
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state))


class PoisonedBatches:
    """The training iterator, with the ``weights`` of batches ``poisoned`` (0-based) set to NaN:
    those steps' loss and gradients are NaN, deterministically."""

    def __init__(self, poisoned, **kwargs):
        self._batches = data.make_train_iterator(**kwargs)
        self._poisoned = set(poisoned)
        self.tokenizer = self._batches.tokenizer

    def __next__(self):
        batch = dict(next(self._batches))
        if self._batches.get_state()["step"] - 1 in self._poisoned:
            batch["weights"] = np.full_like(batch["weights"], np.nan)
        return batch

    def get_state(self):
        return self._batches.get_state()

    def set_state(self, state):
        self._batches.set_state(state)


def test_diverged_run_stops_and_saves_nothing_after(tmp_path):
    configure(tmp_path, "CHECKPOINT_PERIOD = 2", "TRAIN_STEPS = 10")
    poisoned = lambda **kw: PoisonedBatches({4}, **kw)  # noqa: E731  the 5th step
    with pytest.raises(guard.NonFiniteError, match=r"step 5: non-finite loss nan") as error:
        loop.train(train_data=poisoned, eval_data=None)
    assert "checkpoint_4" in str(error.value)
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == [
        "checkpoint_2",
        "checkpoint_4",
    ]
    records = _strict_records(tmp_path)
    assert records[-1]["step"] == 5 and records[-1]["loss"] is None
    assert not (tmp_path / run_lock.LOCK_FILE).exists()


def test_resumed_run_that_diverges_leaves_the_checkpoints_as_they_were(healthy, tmp_path):
    _copy_checkpoints(healthy, tmp_path)
    before = {p.name: _tree_digest(p) for p in tmp_path.glob("checkpoint_*")}
    configure(tmp_path, *DIVERGE, "TRAIN_STEPS = 200", "CHECKPOINT_PERIOD = 100",
              "train.allow_resume_changes = ('learning_rate',)")  # fmt: skip
    with pytest.raises(guard.NonFiniteError, match=r"step \d+: non-finite"):
        loop.train(eval_data=None)
    assert {p.name: _tree_digest(p) for p in tmp_path.glob("checkpoint_*")} == before


def test_skip_policy_keeps_the_state_counts_and_stops_after_the_limit(tmp_path):
    configure(
        tmp_path,
        "CHECKPOINT_PERIOD = 3",
        "TRAIN_STEPS = 12",
        "train.non_finite = 'skip'",
        "train.max_skipped_steps = 2",
    )
    poisoned = lambda **kw: PoisonedBatches({2, 7}, **kw)  # noqa: E731  steps 3 and 8
    result = loop.train(train_data=poisoned, eval_data=None)
    assert result.step == 12
    records = {r["step"]: r for r in _strict_records(tmp_path)}
    assert [records[s]["skipped_steps"] for s in (2, 3, 7, 8, 12)] == [0, 1, 1, 2, 2]
    for step in range(1, 13):
        assert (records[step]["loss"] is None) == (step in (3, 8))
    for path in tmp_path.glob("checkpoint_*"):
        assert _all_finite_on_disk(path), path
    # The count is saved: a resumed run that meets one more bad step exceeds the limit.
    shutil.rmtree(tmp_path / "checkpoint_12")
    configure(tmp_path, "CHECKPOINT_PERIOD = 3", "TRAIN_STEPS = 12",
              "train.non_finite = 'skip'", "train.max_skipped_steps = 2")  # fmt: skip
    poisoned_again = lambda **kw: PoisonedBatches({9}, **kw)  # noqa: E731  step 10
    with pytest.raises(guard.NonFiniteError, match="3 steps skipped, more than"):
        loop.train(train_data=poisoned_again, eval_data=None)


def test_skipped_step_keeps_parameters_and_optimizer_state_bit_for_bit(tmp_path):
    configure(tmp_path, "train.non_finite = 'skip'", "CHECKPOINT_PERIOD = 1", "TRAIN_STEPS = 3",
              "learning_rate_schedule.warmup_steps = 0")  # fmt: skip
    poisoned = lambda **kw: PoisonedBatches({1}, **kw)  # noqa: E731  step 2
    loop.train(train_data=poisoned, eval_data=None)
    one, two = (
        ocp.StandardCheckpointer().restore(tmp_path / f"checkpoint_{s}" / "state") for s in (1, 2)
    )
    assert int(two["step"]) == 2
    for key in ("params", "opt_state"):
        for a, b in zip(jax.tree.leaves(one[key]), jax.tree.leaves(two[key]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _overwrite_4kib(checkpoint) -> None:
    """XORs 4 KiB in the middle of every data file of ``checkpoint``'s state (sizes unchanged)."""
    for file in (checkpoint / "state").rglob("*"):
        if file.is_file() and file.parent.name == "d" and file.stat().st_size > 8192:
            raw = bytearray(file.read_bytes())
            middle = len(raw) // 2
            raw[middle : middle + 4096] = bytes(b ^ 0x5A for b in raw[middle : middle + 4096])
            file.write_bytes(bytes(raw))


def _swap_in_other_arrays(checkpoint, other) -> None:
    """Bytes that still decode but are not the ones saved: ``other``'s arrays under
    ``checkpoint``'s manifest (what a checksum, and only a checksum, catches)."""
    shutil.rmtree(checkpoint / "state")
    shutil.copytree(other / "state", checkpoint / "state")


@pytest.mark.parametrize("damage", [_overwrite_4kib, _swap_in_other_arrays])
def test_changed_bytes_are_caught_and_the_previous_checkpoint_used(
    healthy, tmp_path, caplog, damage
):
    _copy_checkpoints(healthy, tmp_path)
    if damage is _swap_in_other_arrays:
        damage(tmp_path / f"checkpoint_{STEPS}", tmp_path / f"checkpoint_{PERIOD}")
    else:
        damage(tmp_path / f"checkpoint_{STEPS}")
    configure(tmp_path)
    with caplog.at_level("WARNING"):
        result = loop.train(eval_data=None)
    assert result.step == STEPS
    assert (tmp_path / f"checkpoint_{STEPS}.corrupt").is_dir()  # kept, renamed aside
    warnings = [r.getMessage() for r in caplog.records if f"checkpoint_{STEPS}" in r.getMessage()]
    assert warnings
    if damage is _swap_in_other_arrays:
        assert any("does not match its checksum" in w for w in warnings), warnings
    assert min(r["step"] for r in _strict_records(tmp_path)) == PERIOD + 1  # redone from 6


@pytest.mark.parametrize(
    "binding, message",
    [
        ("TRAIN_STEPS = 0", "TRAIN_STEPS"),
        ("TRAIN_STEPS = -5", "TRAIN_STEPS"),
        ("BATCH_SIZE = 7", r"BATCH_SIZE \(train.batch_size\) = 7 must be .* 2 batch shards"),
        ("train.non_finite = 'ignore'", "train.non_finite"),
        ("train.profile_steps = (0, 2)", "train.profile_steps"),
    ],
    ids=["train-steps-0", "train-steps-negative", "batch-vs-mesh", "policy", "profile-window"],
)
def test_settings_that_cannot_work_are_refused_before_any_file(tmp_path, binding, message):
    model_dir = tmp_path / "run"
    configure(model_dir, binding, "learning_rate_schedule.warmup_steps = 0")
    with pytest.raises(ConfigError, match=message):
        loop.train(eval_data=None)
    assert not model_dir.exists()


@pytest.mark.parametrize(
    "binding, suggestion",
    [("CHEKPOINT_PERIOD = 2", "CHECKPOINT_PERIOD"), ("TRAIN_STEP = 30", "TRAIN_STEPS")],
)
def test_misspelled_macro_is_refused(tmp_path, binding, suggestion):
    with pytest.raises(ConfigError, match=f"Did you mean {suggestion}"):
        configure(tmp_path, binding)


def test_macro_defined_and_used_by_bindings_is_accepted(tmp_path):
    configure(tmp_path, "MY_STEPS = 7", "TRAIN_STEPS = %MY_STEPS")
    assert gin.query_parameter("%MY_STEPS") == 7  # defined, used by TRAIN_STEPS: no error


@pytest.mark.parametrize(
    "extra, files, differing",
    [
        ((), ("tiny.gin", "optimizers/adamw.gin"), ("opt_state/", "make_optimizer.factory")),
        (("TransformerConfig.mlp_dim = 128",), ("tiny.gin",), ("params/", "mlp_dim = 64")),
        (
            ("sonew.stack_by_shape = False", "sonew.stack_dtype = None"),
            ("tiny.gin",),
            ("opt_state/", "sonew.stack_by_shape = True"),
        ),
    ],
    ids=["another-optimizer", "another-model", "another-state-layout"],
)
def test_checkpoints_of_another_configuration_are_a_config_mismatch(
    healthy, tmp_path, extra, files, differing
):
    _copy_checkpoints(healthy, tmp_path)
    shutil.copy(healthy / "config.gin", tmp_path / "config.gin")
    configure(tmp_path, *extra, files=files)
    with pytest.raises(checkpoints.ConfigMismatchError, match="config mismatch") as error:
        loop.train(eval_data=None)
    for text in differing:  # an array that differs, and a setting
        assert text in str(error.value)
    assert "corrupt" not in str(error.value)
    assert {p.name for p in tmp_path.glob("checkpoint_*")} == {
        f"checkpoint_{PERIOD}",
        f"checkpoint_{STEPS}",
    }


# --- one run per MODEL_DIR ---------------------------------------------------------------------


def _write_lock(model_dir, pid: int, host: str | None = None, age_s: float = 0.0) -> None:
    now = time.time() - age_s
    holder = run_lock.Holder(host or socket.gethostname(), pid, now, now)
    (model_dir / run_lock.LOCK_FILE).write_text(holder.to_json())


@pytest.fixture
def live_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


def test_second_run_in_a_model_dir_is_refused(tmp_path, live_process):
    _write_lock(tmp_path, live_process.pid)
    configure(tmp_path)
    with pytest.raises(run_lock.RunLockedError, match=f"pid {live_process.pid}"):
        loop.train(eval_data=None)
    assert [p.name for p in tmp_path.iterdir()] == [run_lock.LOCK_FILE]  # nothing written


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    _write_lock(tmp_path, int(dead.stdout))
    with run_lock.RunLock(tmp_path) as lock:
        held = run_lock.Holder.from_json(lock.path.read_text())
        assert held.pid == os.getpid()
    assert not (tmp_path / run_lock.LOCK_FILE).exists()  # released
    assert len(list(tmp_path.glob(f"{run_lock.LOCK_FILE}.stale-*"))) == 1  # the old one kept


@pytest.mark.parametrize(
    "age_s, taken", [(0.0, False), (3600.0, True)], ids=["fresh-heartbeat", "old-heartbeat"]
)
def test_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path, age_s, taken):
    _write_lock(tmp_path, 1, host="another-host", age_s=age_s)
    lock = run_lock.RunLock(tmp_path, stale_after_s=600)
    if taken:
        with lock:
            pass
    else:
        with pytest.raises(run_lock.RunLockedError, match="another-host"):
            lock.acquire()


def test_unreadable_lock_is_stale_once_old_and_heartbeat_refreshes(tmp_path):
    path = tmp_path / run_lock.LOCK_FILE
    path.write_text("{half a lo")  # as a starting run leaves it for a moment
    with pytest.raises(run_lock.RunLockedError, match="unknown holder"):
        run_lock.RunLock(tmp_path).acquire()
    old = time.time() - 2 * run_lock.UNREADABLE_GRACE_S
    os.utime(path, (old, old))  # as a crashed run leaves it
    with run_lock.RunLock(tmp_path, heartbeat_s=0.05) as lock:
        first = run_lock.Holder.from_json(lock.path.read_text()).heartbeat
        time.sleep(0.3)
        assert run_lock.Holder.from_json(lock.path.read_text()).heartbeat > first


def test_release_leaves_another_runs_lock(tmp_path, live_process):
    lock = run_lock.RunLock(tmp_path)
    lock.acquire()
    _write_lock(tmp_path, live_process.pid)  # taken over by another run meanwhile
    lock.release()
    assert run_lock.Holder.from_json(lock.path.read_text()).pid == live_process.pid


# --- metrics -----------------------------------------------------------------------------------


def test_metrics_jsonl_writes_null_for_non_finite_values(tmp_path):
    writer = metrics.MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"loss": float("nan"), "grad_norm": float("inf"), "learning_rate": 0.5})
    writer.close()
    (record,) = _strict_records(tmp_path)
    assert record == {"step": 1, "loss": None, "grad_norm": None, "learning_rate": 0.5}


def test_cli_log_keeps_orbax_errors_to_their_line():
    record = logging.LogRecord(
        "absl", logging.ERROR, "/venv/site-packages/orbax/checkpoint/future.py", 1,
        "save failed", (), (OSError, OSError(28, "No space left on device"), None),
    )  # fmt: skip
    assert train._own_info_only(record) and record.exc_info is None
    abandoned = logging.LogRecord(
        "asyncio", logging.ERROR, "/python/asyncio/base_events.py", 1,
        "_GatheringFuture exception was never retrieved", (), None,
    )  # fmt: skip
    assert not train._own_info_only(abandoned)


def test_cli_reports_a_run_error_in_one_line():
    message = "step 3: non-finite loss nan.\n  In call to configurable 'train' (<function>)"
    assert train._without_gin_context(message) == "step 3: non-finite loss nan."


# --- saves that fail ---------------------------------------------------------------------------


def test_failed_background_save_is_retried_at_the_next_step(tmp_path, failing_saves, caplog):
    configure(tmp_path)
    failing_saves(lambda step: step == PERIOD)
    with caplog.at_level("WARNING"):
        result = loop.train(eval_data=None)
    assert result.step == STEPS
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"save at step {PERIOD} failed" in m for m in messages)
    assert any(
        f"checkpoint_{PERIOD}.orbax-checkpoint-tmp, left by the failed" in m for m in messages
    )
    retry, last = checkpoints.Checkpoints(tmp_path).steps()
    assert PERIOD < retry < STEPS and last == STEPS  # the retry: this step's state, at once
    assert leftovers(tmp_path) == []


def test_save_that_keeps_failing_stops_the_run_and_keeps_the_last_checkpoint(
    tmp_path, failing_saves
):
    configure(tmp_path, "CHECKPOINT_PERIOD = 3", "train.keep_checkpoints = 1",
              "train.save_retries = 2", "train.save_retry_backoff_s = 0")  # fmt: skip
    failing_saves(lambda step: step > 3)  # the disk fills after the first checkpoint
    with pytest.raises(checkpoints.SaveError, match=r"\(3 attempts\).*checkpoint_3\b") as error:
        loop.train(eval_data=None)
    assert "No space left on device" in str(error.value)
    assert checkpoints.Checkpoints(tmp_path).steps() == [3]
    assert not (tmp_path / run_lock.LOCK_FILE).exists()
    failing_saves(lambda step: False)  # the disk has room again: the rerun resumes and ends
    assert loop.train(eval_data=None).step == STEPS
    assert checkpoints.Checkpoints(tmp_path).steps() == [STEPS]
    assert leftovers(tmp_path) == []


def test_second_ctrl_c_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    stop = signals.StopSignal()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs between bytecodes of this thread
        assert stop.received
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before


# --- resuming what a run cannot continue -------------------------------------------------------


class RetokenizedBatches(PoisonedBatches):
    """The training iterator, saying it reads through another tokenizer of the same size."""

    def get_state(self):
        return super().get_state() | {"tokenizer": "SentencePieceTokenizer(vocab_size=256)"}


@pytest.mark.parametrize(
    "bindings, train_data, change, setting",
    [
        (("TRAIN_STEPS = 24",), None, "learning_rate", "TRAIN_STEPS = 12 (checkpoints) / 24"),
        (("DataConfig.source = 'text_dir:{corpus}'",), None, "data_source", "text_dir:"),
        ((), lambda **kw: RetokenizedBatches((), **kw), "tokenizer", "SentencePieceTokenizer"),
    ],
    ids=["train-steps", "data-source", "tokenizer"],
)
def test_resume_that_would_continue_differently_is_refused_unless_allowed(
    healthy, tmp_path, bindings, train_data, change, setting
):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(PLAY)
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    _copy_checkpoints(healthy, model_dir)
    shutil.rmtree(model_dir / f"checkpoint_{STEPS}")  # resume from the middle of the run
    shutil.copy(healthy / "config.gin", model_dir / "config.gin")
    bindings = [b.format(corpus=corpus) for b in bindings]
    kwargs = {"eval_data": None} | ({"train_data": train_data} if train_data else {})
    configure(model_dir, *bindings)
    with pytest.raises(checkpoints.ConfigMismatchError, match=f"{change}: ") as error:
        loop.train(**kwargs)
    assert setting in str(error.value)
    assert f"train.allow_resume_changes = ('{change}',)" in str(error.value)
    assert sorted(p.name for p in model_dir.glob("checkpoint_*")) == [f"checkpoint_{PERIOD}"]
    assert (model_dir / "config.gin").read_text() == (healthy / "config.gin").read_text()

    configure(model_dir, *bindings, f"train.allow_resume_changes = ('{change}',)")
    result = loop.train(**kwargs)
    assert result.step == (24 if change == "learning_rate" else STEPS)
    history = (model_dir / resume.CONFIG_HISTORY_FILE).read_text()
    assert f"run segment from step {PERIOD}\n" in history  # the new segment, appended


def test_resume_with_another_batch_size_is_a_config_mismatch(healthy, tmp_path):
    _copy_checkpoints(healthy, tmp_path)
    configure(tmp_path, "BATCH_SIZE = 16")
    with pytest.raises(checkpoints.ConfigMismatchError, match="batch_size=8, this pipeline has 16"):
        loop.train(eval_data=None)


def test_config_history_keeps_each_segment(tmp_path):
    resume.record_config(tmp_path, 0, "A = 1\n")
    resume.record_config(tmp_path, 6, "A = 1\n")  # the same config resumed: nothing appended
    resume.record_config(tmp_path, 6, "A = 2\n")
    history = (tmp_path / resume.CONFIG_HISTORY_FILE).read_text()
    assert history.count("run segment from step") == 2
    assert history.endswith("step 6\nA = 2\n") and "step 0\nA = 1\n" in history
    assert (tmp_path / "config.gin").read_text() == "A = 2\n"


# --- inputs checked at start -------------------------------------------------------------------


def _corpus(root, files: dict[str, bytes]) -> str:
    """A text_dir corpus of ``files`` (name -> bytes) under ``root``; its source binding."""
    root.mkdir()
    for name, raw in files.items():
        (root / name).write_bytes(raw)
    return f"DataConfig.source = 'text_dir:{root}'"


@pytest.mark.parametrize(
    "case, message",
    [
        ("relative", r"MODEL_DIR must be an absolute path or a URI, got 'relative/run'"),
        ("parent-is-a-file", r"MODEL_DIR .*/file/run cannot be written: "),
        ("seq-len", r"SEQ_LEN \(train.seq_len\) = 256 exceeds .*max_len = 128"),
        ("vocab", r"vocab_size = 100 is smaller than the tokenizer's vocabulary \(256\)"),
        ("not-utf8", r"text_dir source: .*/b.txt is not UTF-8 text \(byte 3: "),
        ("tiny", r"has \d+ tokens, 1 example\(s\) .* fewer than one batch \(BATCH_SIZE 8\)"),
        ("empty", r"no \*.txt files under"),
        ("unknown-source", r"unknown data source 'shakespear'"),
    ],
)
def test_user_errors_are_refused_at_start_naming_the_cause(tmp_path, case, message):
    model_dir = tmp_path / "run"
    bindings = {
        "relative": ["MODEL_DIR = 'relative/run'"],
        "parent-is-a-file": [f"MODEL_DIR = '{tmp_path / 'file' / 'run'}'"],
        "seq-len": ["SEQ_LEN = 256"],
        "vocab": ["TransformerConfig.vocab_size = 100"],
        "not-utf8": [_corpus(tmp_path / "c1", {"a.txt": PLAY, "b.txt": b"abc\xff\xfe"})],
        "tiny": [_corpus(tmp_path / "c2", {"a.txt": b"twelve bytes"})],
        "empty": [_corpus(tmp_path / "c3", {})],
        "unknown-source": ["DataConfig.source = 'shakespear'"],
    }[case]
    (tmp_path / "file").write_text("")
    configure(model_dir, *bindings)
    with pytest.raises(RunError, match=message):
        loop.train(eval_data=None)
    assert not model_dir.exists() and not (tmp_path / "file").read_text()


def test_load_run_falls_back_when_the_newest_checkpoint_is_deleted_while_read(
    healthy, tmp_path, monkeypatch
):
    _copy_checkpoints(healthy, tmp_path)
    shutil.copy(healthy / "config.gin", tmp_path / "config.gin")
    read = checkpoints.Checkpoints._restore_params_intact

    def rotated_while_read(self, step, target):
        if step == STEPS:  # the trainer's keep limit deletes it under the reader
            shutil.rmtree(tmp_path / f"checkpoint_{STEPS}")
        return read(self, step, target)

    monkeypatch.setattr(checkpoints.Checkpoints, "_restore_params_intact", rotated_while_read)
    assert inference.load_run(str(tmp_path)).step == PERIOD


def test_cli_drops_tensorstores_reports_of_abandoned_writes_only():
    """tensorstore reports each write it completes after orbax abandoned a failed save as an
    unraisable "Event loop is closed" (hundreds of tracebacks); anything else still prints."""
    printed = []
    hook = train._without_abandoned_writes(printed.append)

    def unraisable(error):
        return types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None)

    hook(unraisable(RuntimeError("Event loop is closed")))
    assert printed == []
    for other in (RuntimeError("Event loop is running"), ValueError("Event loop is closed")):
        hook(unraisable(other))
    assert [str(u.exc_value) for u in printed] == ["Event loop is running", "Event loop is closed"]
    assert [u.exc_type for u in printed] == [RuntimeError, ValueError]
