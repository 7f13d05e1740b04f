"""The command line, run as a user runs it (subprocesses, 8 simulated CPU devices, 2x4 mesh).

Resume is exact: a run killed with ``kill -9`` after a checkpoint, resumed by a run stopped by
SIGTERM, then resumed again, logs the same losses, bit for bit, as a run never interrupted. The
interrupted runs are started with a huge TRAIN_STEPS (so they are surely still running when
interrupted) and restarted with the reference's TRAIN_STEPS; the learning rate is constant, so
TRAIN_STEPS changes nothing else. A second run in the same MODEL_DIR is refused while the first
lives, and takes over its lock after ``kill -9``. Also: exit status 1 and nothing written for a
misspelled binding or macro, an unset macro, TRAIN_STEPS < 1 or a mesh that does not fit the
devices; a diverged run exits 1 naming the step, with only finite checkpoints and strict JSON
metrics. Compiled programs are shared through a persistent cache.
"""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sonew_pax import train
from tests.flags import xla_flags

STEPS = 30
PERIOD = 5
COMMON = [
    "--gin_file=tiny.gin",
    f"--gin.CHECKPOINT_PERIOD={PERIOD}",
    "--gin.EVAL_PERIOD=10",
    "--gin.BATCH_SIZE=8",
    "--gin.SEQ_LEN=16",
    "--gin.TransformerConfig.d_model=32",
    "--gin.TransformerConfig.num_layers=1",
    "--gin.TransformerConfig.num_heads=4",
    "--gin.TransformerConfig.head_dim=8",
    "--gin.TransformerConfig.mlp_dim=64",
    "--gin.make_eval_batches.max_batches=1",
    "--gin.make_mesh.data=2",
    "--gin.make_mesh.model=4",
    "--gin.learning_rate_schedule.decay='constant'",
    "--gin.learning_rate_schedule.warmup_steps=0",
    "--gin.train.log_every=5",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Environment of the subprocesses: 8 CPU devices and a shared compilation cache."""
    cache = tmp_path_factory.mktemp("jax_cache")
    return {
        **os.environ,
        "XLA_FLAGS": xla_flags(8),
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def command(model_dir, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "sonew_pax.train", *COMMON,
        f'--gin.MODEL_DIR="{model_dir}"', f"--gin.TRAIN_STEPS={steps}", *extra,
    ]  # fmt: skip


def run(model_dir, steps: int, env, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(model_dir, steps, *extra), env=env, capture_output=True, text=True, timeout=300
    )


def losses(model_dir) -> dict[int, float]:
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def wait_for(path, process, timeout=240.0) -> None:
    """Waits until ``path`` exists while ``process`` is still running."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    model_dir = tmp_path_factory.mktemp("reference")
    done = run(model_dir, STEPS, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 30/30 | loss" in done.stderr
    return losses(model_dir)


def test_second_run_in_the_same_model_dir_is_refused(tmp_path, env):
    process = subprocess.Popen(
        command(tmp_path, 10**6), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_for(tmp_path / "run.lock", process)
        second = run(tmp_path, STEPS, env)
    finally:
        process.kill()
        process.communicate()
    assert second.returncode == 1
    assert f"is in use by another run: pid {process.pid}" in second.stderr


def stopped_by(signum: int, tmp_path, env, after: int = PERIOD) -> tuple[int, str, float]:
    """Starts a long run, sends it ``signum`` once the checkpoint of step ``after`` exists and
    waits for it: its exit status, its stderr and the seconds from the signal to its exit."""
    process = subprocess.Popen(
        command(tmp_path, 10**6), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    wait_for(tmp_path / f"checkpoint_{after}", process)
    process.send_signal(signum)
    sent = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    return process.returncode, stderr, time.monotonic() - sent


def test_killed_then_stopped_run_resumes_exactly(reference, tmp_path, env):
    """A run killed with ``kill -9`` after its first checkpoint leaves its lock; the next run takes
    the lock over and resumes; SIGTERM stops that one at its current step with a checkpoint; the
    last run resumes from it. Every step's loss equals the uninterrupted run's, bit for bit."""
    process = subprocess.Popen(
        command(tmp_path, 10**6), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    wait_for(tmp_path / f"checkpoint_{PERIOD}", process)
    process.kill()  # SIGKILL: no handler runs, its lock stays
    process.communicate()
    assert process.returncode == -signal.SIGKILL

    status, stderr, seconds = stopped_by(signal.SIGTERM, tmp_path, env, after=2 * PERIOD)
    assert "Took over the lock of a run that is gone" in stderr
    assert "Resumed" in stderr
    assert status == train.EXIT_STOPPED, stderr[-3000:]  # not 0: not finished
    assert seconds < 15
    saved = max(int(p.name.split("_")[1]) for p in tmp_path.glob("checkpoint_*"))
    assert f"Stopped at step {saved}, checkpoint saved" in stderr
    assert "Finished" not in stderr
    assert max(losses(tmp_path)) == saved  # metrics logged up to the stop
    assert saved < STEPS, "the run went too far before SIGTERM to test resuming"

    done = run(tmp_path, STEPS, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"from step {saved}" in done.stderr
    assert losses(tmp_path) == reference


BAD_CONFIGURATIONS = {
    "misspelled-parameter": ("--gin.TransformerConfig.d_modle=64", "d_modle"),
    "misspelled-configurable": ("--gin.trian.seed=1", "trian"),
    "mesh-vs-devices": ("--gin.make_mesh.model=3", "model=3"),
    "dim-vs-mesh": ("--gin.make_mesh.data=1 --gin.make_mesh.model=8", "divisible by mesh axes"),
    "misspelled-macro": (
        "--gin.CHEKPOINT_PERIOD=2",
        "error: --gin.CHEKPOINT_PERIOD sets the macro",
    ),
    "train-steps-0": ("--gin.TRAIN_STEPS=0", "error: TRAIN_STEPS"),
}

# Runs each command line of a JSON list in a process forked from this one, which has imported
# sonew_pax.train (jax, flax, orbax: seconds a process) once; each child runs the module's
# entry point as ``python -m sonew_pax.train`` does and exits as that process would (its
# SystemExit unwinds to the interpreter). Prints [exit status, stderr] per command, as JSON.
FORKED_RUNS = """
import json, os, sys, tempfile
from sonew_pax import train
results = []
for argv in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(err.fileno(), 2)
            train.run(argv)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        results.append([os.waitstatus_to_exitcode(status), err.read()])
print(json.dumps(results))
"""


# User errors: one line naming the error, no traceback (the flag, what the line says).
USER_ERRORS = {
    "relative-model-dir": (
        '--gin.MODEL_DIR="relative/run"',
        "error: MODEL_DIR must be an absolute path",
    ),
    "empty-text-dir": (
        "--gin.DataConfig.source='text_dir:/nonexistent'",
        "error: text_dir source: no *.txt",
    ),
    "seq-len-vs-max-len": ("--gin.SEQ_LEN=4096", "error: SEQ_LEN (train.seq_len) = 4096 exceeds"),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, env):
    """Exit status, stderr and model directory of the runs of :data:`BAD_CONFIGURATIONS`,
    :data:`USER_ERRORS` and of ``"unset-macro"`` (``--gin_file=tiny.gin`` alone), each started
    as the command line starts it, in a process forked from one that imported the trainer."""
    root = tmp_path_factory.mktemp("bad")
    argvs = {
        name: command(root / name / "run", STEPS, *flag.split())[2:]
        for name, (flag, _) in (BAD_CONFIGURATIONS | USER_ERRORS).items()
    }
    argvs["unset-macro"] = ["sonew_pax.train", "--gin_file=tiny.gin"]
    done = subprocess.run(
        [sys.executable, "-c", FORKED_RUNS, json.dumps(list(argvs.values()))],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {
        name: (status, stderr, root / name / "run")
        for name, (status, stderr) in zip(argvs, results, strict=True)
    }


@pytest.mark.parametrize("name", list(BAD_CONFIGURATIONS))
def test_bad_configuration_fails_at_start(bad_runs, name):
    returncode, stderr, model_dir = bad_runs[name]
    assert returncode == 1, stderr[-3000:]
    assert BAD_CONFIGURATIONS[name][1] in stderr
    assert not model_dir.exists()  # nothing written


@pytest.mark.parametrize("name", list(USER_ERRORS))
def test_user_error_is_one_line_without_traceback(bad_runs, name):
    returncode, stderr, model_dir = bad_runs[name]
    assert returncode == 1, stderr[-3000:]
    assert USER_ERRORS[name][1] in stderr and "Traceback" not in stderr
    assert not model_dir.exists()


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def test_diverged_run_exits_with_an_error_and_keeps_only_finite_checkpoints(tmp_path, env):
    done = run(
        tmp_path, 60, env, "--gin.learning_rate_schedule.peak_value=1e3",
        "--gin.CHECKPOINT_PERIOD=2", "--gin.train.keep_checkpoints=2",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    match = re.search(r"error: step (\d+): non-finite", done.stderr)
    assert match, done.stderr[-3000:]
    failed = int(match.group(1))
    saved = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("checkpoint_*"))
    assert saved and max(saved) < failed
    for step in saved:  # finite, read by orbax alone
        state = ocp.StandardCheckpointer().restore(tmp_path / f"checkpoint_{step}" / "state")
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)), step
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=_not_json) for line in lines]
    assert records[-1]["step"] == failed and None in records[-1].values()


def test_unset_required_macro_names_it(bad_runs):
    returncode, stderr, _ = bad_runs["unset-macro"]
    assert returncode != 0
    assert "MODEL_DIR" in stderr


def test_ctrl_c_saves_like_sigterm(tmp_path, env):
    status, stderr, _ = stopped_by(signal.SIGINT, tmp_path, env)
    assert status == train.EXIT_STOPPED, stderr[-3000:]
    saved = max(int(p.name.split("_")[1]) for p in tmp_path.glob("checkpoint_*"))
    assert saved > PERIOD and f"Stopped at step {saved}, checkpoint saved" in stderr
    assert "Traceback" not in stderr


def _file_size_limit(limit: int):
    """``preexec_fn``: writes beyond ``limit`` bytes fail (EFBIG) instead of killing the process."""

    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_writes


def test_second_ctrl_c_stops_at_once_with_its_own_status(tmp_path, env):
    """A run whose saves fail (a 20 kB file-size limit) waits between retries; a second Ctrl-C
    then stops it at once."""
    process = subprocess.Popen(
        command(tmp_path / "run", 10**6, "--gin.train.save_retry_backoff_s=600"),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=_file_size_limit(20_000),
    )  # fmt: skip
    lines = []  # its stderr, read as it comes (a pipe: the file-size limit does not apply)
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("Retrying the save" in line for line in lines):
            assert process.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "no save was retried"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    finally:
        process.kill()
        process.wait()
    reader.join(timeout=10)
    text = "".join(lines)
    assert process.returncode == train.EXIT_INTERRUPTED, text[-3000:]
    assert "error: interrupted; the current step was not saved" in text
    assert "KeyboardInterrupt" not in text  # no traceback of it
    assert not (tmp_path / "run" / "run.lock").exists()
