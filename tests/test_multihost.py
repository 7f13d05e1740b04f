"""Multi-process training on 127.0.0.1: 2 processes x 2 CPU devices against 1 process x 4.

One scenario, run once per session (module fixture), in separate interpreters:

- ``reference``: 1 process x 4 devices, 5 steps.
- ``multi``: 2 processes x 2 devices (``launch/local_multiprocess.sh``), 3 steps and one
  checkpoint, then a second launch that resumes from it to step 4 (and writes checkpoint 4).
- ``single``: a copy of ``multi``'s directory resumed by 1 process x 4 devices to step 5 (other
  device counts are the trainer tests' business; here the point is one process reading shards
  that two wrote).

Parameters and optimizer state are sharded over the ``data`` axis (the ``embed`` rule set to
"data", FSDP-style), so both processes hold and write real shards of every checkpoint. The
learning-rate schedule's length is pinned so that runs of different lengths share it, and its peak
is modest: the processes sum across gloo in another order than one process does, and at tiny.gin's
peak (1e-2) the optimizer amplifies those float32 rounding differences past 1e-5 within 4 steps
(about 2e-5 at step 4, 4e-5 at step 5, on tiny.gin's two-layer model). The model is tiny.gin's
narrowed to one layer: every kind of parameter, sharded over both processes, less to compile. A
shared persistent compilation cache keeps the resumed launches from compiling again.
"""

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from sonew_pax import distributed
from tests.flags import FAST_COMPILE, xla_flags

REPO = pathlib.Path(__file__).resolve().parent.parent
LAUNCHER = REPO / "launch" / "local_multiprocess.sh"
TOLERANCE = 1e-5
TRAIN_ARGS = (
    "--gin_file=tiny.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.SEQ_LEN=32",
    "--gin.TransformerConfig.d_model=32",
    "--gin.TransformerConfig.num_layers=1",
    "--gin.TransformerConfig.head_dim=8",
    "--gin.TransformerConfig.mlp_dim=64",
    "--gin.CHECKPOINT_PERIOD=100",
    "--gin.train.eval_data=None",
    "--gin.train.log_every=1",
    "--gin.learning_rate_schedule.total_steps=5",
    "--gin.learning_rate_schedule.warmup_steps=2",
    "--gin.learning_rate_schedule.peak_value=1e-3",
    "--gin.logical_axis_rules.overrides=[('embed', 'data')]",
)

pytestmark = pytest.mark.slow


def _env(cache_dir: pathlib.Path, devices: int | None = None) -> dict[str, str]:
    """The parent's environment for a training subprocess: CPU, a shared compilation cache, no
    inherited process-group variables, and ``devices`` simulated devices when given."""
    env = {k: v for k, v in os.environ.items() if k not in _PROCESS_GROUP_VARS}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHON=sys.executable,
    )
    # The launcher adds its processes' device count to XLA_FLAGS.
    env["XLA_FLAGS"] = FAST_COMPILE if devices is None else xla_flags(devices)
    return env


_PROCESS_GROUP_VARS = {
    "XLA_FLAGS",
    "MASTER_ADDR",
    "MASTER_PORT",
    *distributed.COORDINATOR_VARS,
    *distributed.PROCESS_COUNT_VARS,
    *distributed.PROCESS_INDEX_VARS,
}


def _train_command(model_dir: pathlib.Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sonew_pax.train",
        *TRAIN_ARGS,
        f'--gin.MODEL_DIR="{model_dir}"',
        f"--gin.TRAIN_STEPS={steps}",
    ]


def _run(command: list[str], env: dict[str, str], log: pathlib.Path) -> None:
    """Runs ``command`` next to ``log`` (outside the repository, as a user would); fails the
    test with the log's tail if it fails."""
    with log.open("w") as out:
        result = subprocess.run(
            command,
            cwd=log.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=400,
            check=False,
        )
    if result.returncode:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"{command[:4]} exited with {result.returncode}:\n{tail}")


def train_single(model_dir, steps, devices, cache, log):
    """One process with ``devices`` CPU devices."""
    _run(_train_command(model_dir, steps), _env(cache, devices), log)


def train_multi(model_dir, steps, cache, log):
    """Two processes with two CPU devices each, through the launcher."""
    env = _env(cache) | {
        "NUM_PROCESSES": "2",
        "DEVICES_PER_PROCESS": "2",
        "DISTRIBUTED_TIMEOUT_S": "120",
    }
    _run(["bash", str(LAUNCHER), *_train_command(model_dir, steps)], env, log)


def read_losses(model_dir: pathlib.Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a step logged twice is an error (two writers)."""
    losses: dict[int, float] = {}
    for line in (model_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["step"] not in losses, f"step {record['step']} logged twice"
        losses[record["step"]] = record["loss"]
    return losses


def checkpoint_steps(model_dir: pathlib.Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in model_dir.glob("checkpoint_*"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs the scenario of the module docstring; returns the three run directories."""
    root = tmp_path_factory.mktemp("multihost")
    cache = root / "jax_cache"
    dirs = {name: root / name for name in ("reference", "multi", "single")}
    train_single(dirs["reference"], 5, 4, cache, root / "reference.log")
    train_multi(dirs["multi"], 3, cache, root / "multi_1.log")
    dirs["after_first_launch"] = root / "after_first_launch"
    shutil.copytree(dirs["multi"], dirs["after_first_launch"])
    train_multi(dirs["multi"], 4, cache, root / "multi_2.log")
    shutil.copytree(dirs["multi"], dirs["single"])
    train_single(dirs["single"], 5, 4, cache, root / "single.log")
    dirs["logs"] = root
    return dirs


def test_two_processes_log_the_same_losses_as_one(runs):
    reference = read_losses(runs["reference"])
    multi = read_losses(runs["multi"])
    assert sorted(multi) == [1, 2, 3, 4]
    for step, loss in multi.items():
        assert loss == pytest.approx(reference[step], abs=TOLERANCE), step


def test_two_processes_write_one_checkpoint_and_resume_from_it(runs):
    assert checkpoint_steps(runs["after_first_launch"]) == [3]
    assert "Resumed" in (runs["logs"] / "multi_2.log").read_text()
    assert checkpoint_steps(runs["multi"]) == [3, 4]


def test_every_process_writes_its_shards(runs):
    state = runs["multi"] / "checkpoint_4" / "state"
    for process in (0, 1):
        shards = state / f"ocdbt.process_{process}"
        assert shards.is_dir() and any(p.is_file() for p in shards.rglob("*")), shards


def test_only_process_zero_writes_metrics(runs):
    read_losses(runs["multi"])  # one line per step: process 1 wrote none
    assert len(list((runs["multi"] / "train").glob("events.out.tfevents.*"))) <= 2
    log = (runs["logs"] / "multi_2.log").read_text()
    assert "[process 1]" in log and "[process 0]" in log


def test_checkpoint_of_two_processes_restores_in_one(runs):
    reference = read_losses(runs["reference"])
    single = read_losses(runs["single"])
    assert "Resumed" in (runs["logs"] / "single.log").read_text()
    assert sorted(single) == [1, 2, 3, 4, 5]
    assert single[5] == pytest.approx(reference[5], abs=TOLERANCE)


def test_a_missing_peer_fails_with_a_clear_message(tmp_path):
    env = _env(tmp_path / "cache", 1) | {
        "COORDINATOR_ADDRESS": "127.0.0.1:1",
        "PROCESS_COUNT": "2",
        "PROCESS_INDEX": "1",
        "DISTRIBUTED_TIMEOUT_S": "2",
    }
    result = subprocess.run(
        _train_command(tmp_path / "run", 1),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == distributed.TIMEOUT_EXIT_CODE, result.stderr[-2000:]
    assert "process 1 of 2 timed out after 2 s" in result.stderr
    assert "127.0.0.1:1" in result.stderr


def test_a_model_dir_in_use_stops_every_process(tmp_path):
    """Process 0 finds another live run's lock: both processes stop with the message, at once
    (process 1 is told, rather than left waiting for its peer in a collective)."""
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        now = time.time()
        lock = {"host": socket.gethostname(), "pid": holder.pid, "started": now, "heartbeat": now}
        (model_dir / "run.lock").write_text(json.dumps(lock))
        env = _env(tmp_path / "cache") | {
            "NUM_PROCESSES": "2",
            "DEVICES_PER_PROCESS": "2",
            "DISTRIBUTED_TIMEOUT_S": "120",
            "LOG_DIR": str(tmp_path / "logs"),
        }
        result = subprocess.run(
            ["bash", str(LAUNCHER), *_train_command(model_dir, 3)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode != 0
    logs = [(tmp_path / "logs" / f"process_{i}.log").read_text() for i in range(2)]
    assert f"is in use by another run: pid {holder.pid}" in logs[0], logs[0][-2000:]
    assert "held by another run (process 0 says)" in logs[1], logs[1][-2000:]


# --- how a process decides to start (no processes started) ----------------------------------


def test_flags_take_precedence_over_the_environment():
    environ = {"COORDINATOR_ADDRESS": "env:1", "PROCESS_COUNT": "8", "PROCESS_INDEX": "5"}
    group = distributed.resolve("flag:2", 4, 3, environ=environ, on_tpu=False)
    assert group == distributed.ProcessGroup("explicit", "flag:2", 4, 3)


def test_torchrun_style_environment():
    environ = {"MASTER_ADDR": "host0", "MASTER_PORT": "1234", "WORLD_SIZE": "2", "RANK": "1"}
    group = distributed.resolve(None, None, None, environ=environ, on_tpu=False)
    assert group == distributed.ProcessGroup("explicit", "host0:1234", 2, 1)


def test_slurm_without_a_coordinator_leaves_it_to_jax():
    environ = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}
    group = distributed.resolve(None, None, None, environ=environ, on_tpu=False)
    assert group == distributed.ProcessGroup("explicit", None, 4, 2)


def test_single_process_and_cloud_tpu():
    assert distributed.resolve(None, None, None, environ={}, on_tpu=False).mode == "single"
    assert distributed.resolve(None, 1, None, environ={}, on_tpu=False).mode == "single"
    assert distributed.resolve(None, None, None, environ={}, on_tpu=True).mode == "cloud_tpu"


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ((None, 2, None), {}, "no process index: pass --process_index"),
        ((None, 2, 0), {}, "no coordinator address: pass --coordinator_address"),
        (("h:1", 2, 2), {}, "process index 2 is not in [0, 2)"),
        ((None, None, None), {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ((None, 0, None), {}, "process count must be at least 1"),
    ],
)
def test_incomplete_process_groups_fail_with_what_to_set(flags, environ, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        distributed.resolve(*flags, environ=environ, on_tpu=False)


def _pci_device(root: pathlib.Path, name: str, vendor: str, device: str) -> None:
    (root / name).mkdir()
    (root / name / "vendor").write_text(vendor + "\n")
    (root / name / "device").write_text(device + "\n")


def test_tpu_chips_are_found_by_pci_id_not_by_vendor_alone(tmp_path):
    _pci_device(tmp_path, "0000:00:04.0", "0x1ae0", "0x0042")  # Google's virtual NIC
    _pci_device(tmp_path, "0000:00:05.0", "0x8086", "0x005e")
    assert not distributed.has_tpu_chips(tmp_path)
    _pci_device(tmp_path, "0000:00:06.0", "0x1ae0", "0x005e")  # a TPU v4 chip
    assert distributed.has_tpu_chips(tmp_path)
