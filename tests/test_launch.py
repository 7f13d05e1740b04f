"""Launch scripts, Docker images and the v4-32 run config, checked without a cluster or Docker.

- Every script parses (``bash -n``) and passes shellcheck; each fails early, naming the missing
  variable; ``--dry_run`` (TPU) or ``DRY_RUN=1`` shows the commands the TPU and SLURM launchers
  would run, running none.
- ``local_multiprocess.sh`` starts its processes with the process-group variables and stops the
  others when one fails.
- The Dockerfiles pass hadolint and keep the essentials (pinned base and jax, non-root, ...).
- ``configs/runs/pretrain_1b_v4_32.gin``: its memory estimate matches the real parameter and
  optimizer-state counts (``jax.eval_shape``, nothing allocated) and fits a v4 chip.
"""

import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import pytest

from sonew_pax import optimizers, train, train_state
from sonew_pax.models import Transformer

REPO = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh")) + sorted(LAUNCH.glob("*.sbatch"))
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))
BIN = pathlib.Path(sys.executable).parent
GIB = 2**30
V4_HBM_GIB = 32


def _tool(name: str) -> str:
    """Path of a linter installed by the test extra (next to this Python, or on PATH)."""
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return path


def run_script(script: str, *args: str, env: dict[str, str] | None = None, path_prefix: str = ""):
    """Runs ``bash launch/<script> args`` with only ``env`` (plus PATH/HOME) set."""
    base = {"PATH": path_prefix + os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        cwd=REPO,
        env=base | (env or {}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_launch_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"tpu_pod.sh", "slurm_gpu.sbatch", "local_multiprocess.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    result = subprocess.run(
        [_tool("shellcheck"), "-x", str(script)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout


TPU_ENV = {"PROJECT": "p", "ZONE": "us-central2-b", "TPU_NAME": "pod", "MODEL_DIR": "gs://b/run"}
SLURM_ENV = {
    "MODEL_DIR": "/shared/run",
    "GIN_FILE": "tiny.gin",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node-[1-2]",
    "VENV": str(BIN.parent),
}


@pytest.mark.parametrize(
    ("script", "env", "missing"),
    [
        ("tpu_pod.sh", TPU_ENV, "PROJECT"),
        ("tpu_pod.sh", TPU_ENV, "ZONE"),
        ("tpu_pod.sh", TPU_ENV, "TPU_NAME"),
        ("tpu_pod.sh", TPU_ENV, "MODEL_DIR"),
        ("slurm_gpu.sbatch", SLURM_ENV, "MODEL_DIR"),
        ("slurm_gpu.sbatch", SLURM_ENV, "GIN_FILE"),
        ("slurm_gpu.sbatch", SLURM_ENV, "SLURM_JOB_ID"),
        ("local_multiprocess.sh", {"NUM_PROCESSES": "2"}, "NUM_PROCESSES"),
    ],
)
def test_missing_variable_fails_early_naming_it(script, env, missing):
    env = {k: v for k, v in env.items() if k != missing} | {"DRY_RUN": "1"}
    result = (
        run_script(script, "true", env=env)
        if script.endswith("multiprocess.sh")
        else (run_script(script, env=env))
    )
    assert result.returncode == 2
    assert f"error: {missing} is not set" in result.stderr
    assert f"see the header of launch/{script}" in result.stderr
    assert "gcloud" not in result.stdout and "srun" not in result.stdout


def test_tpu_pod_needs_a_gcs_model_dir():
    result = run_script("tpu_pod.sh", env=TPU_ENV | {"MODEL_DIR": "/tmp/run", "DRY_RUN": "1"})
    assert result.returncode == 2 and "MODEL_DIR must be gs://BUCKET/PATH" in result.stderr


def _recording_tools(directory: pathlib.Path, names: tuple[str, ...]) -> pathlib.Path:
    """Stand-ins for the commands ``names`` in ``directory`` that append their command line to
    ``directory/ran``: the file exists only if one of them ran."""
    for name in names:
        tool = directory / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{directory}/ran"\n')
        tool.chmod(0o755)
    return directory / "ran"


def _printed_argv(line: str) -> list[str]:
    """The arguments of a command a dry run printed (``+`` then ``printf %q`` words), as bash
    reads them back."""
    words = line.removeprefix("+ ")
    script = 'eval "argv=($1)"; printf "%s\\0" "${argv[@]}"'
    read = subprocess.run(["bash", "-c", script, "-", words], capture_output=True, check=True)
    return read.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize(
    ("option", "env"), [(["--dry_run"], {}), ([], {"DRY_RUN": "1"})], ids=["flag", "env"]
)
def test_tpu_pod_dry_run_prints_every_command_and_runs_none(tmp_path, option, env):
    ran = _recording_tools(tmp_path, ("gcloud", "git", "mktemp"))
    result = run_script(
        "tpu_pod.sh",
        *option,
        "all",
        "--",
        "--gin.TRAIN_STEPS=10",
        env=TPU_ENV | env,
        path_prefix=f"{tmp_path}{os.pathsep}",
    )
    assert result.returncode == 0, result.stderr
    assert not ran.exists(), ran.read_text()
    lines = result.stdout.splitlines()
    assert all(line.startswith("+ ") for line in lines), lines
    create, archive, scp, setup, train_ = map(_printed_argv, lines)
    gcloud = ["gcloud", "compute", "tpus", "--project=p", "--zone=us-central2-b", "tpu-vm"]
    assert create[:8] == [*gcloud, "create", "pod"] and "--accelerator-type=v4-32" in create
    assert archive[:2] == ["git", "archive"] and archive[-1] == "HEAD"
    tarball = next(arg.removeprefix("--output=") for arg in archive if arg.startswith("--output="))
    assert scp == [*gcloud, "scp", tarball, "pod:sonew_pax.tar.gz", "--worker=all"]
    for ssh in (setup, train_):
        assert ssh[:9] == [*gcloud, "ssh", "pod", "--worker=all"] and len(ssh) == 10
    assert "jax[tpu]==0.10.2" in setup[9] and "gcsfuse --implicit-dirs b /mnt/gcs/b" in setup[9]
    assert train_[9] == (
        "--command=cd sonew_pax && .venv/bin/python -m sonew_pax.train "
        '--gin_file=runs/pretrain_1b_v4_32.gin --gin.MODEL_DIR=\\"/mnt/gcs/b/run\\" '
        "--gin.TRAIN_STEPS=10"
    )


def test_tpu_pod_queued_spot_resource():
    env = TPU_ENV | {"DRY_RUN": "1", "QUEUED": "1", "SPOT": "1"}
    created = run_script("tpu_pod.sh", "create", env=env)
    assert created.returncode == 0, created.stderr
    assert "queued-resources create pod --node-id=pod" in created.stdout
    assert "--spot" in created.stdout
    deleted = run_script("tpu_pod.sh", "delete", env=env)
    assert "queued-resources delete pod --force" in deleted.stdout


def test_tpu_pod_rejects_an_unknown_step():
    result = run_script("tpu_pod.sh", "launch", env=TPU_ENV)
    assert result.returncode == 2 and "unknown step 'launch'" in result.stderr


def test_slurm_dry_run_sets_the_coordinator_from_the_first_node(tmp_path):
    # A long node list: a reader that stops after the first line would SIGPIPE scontrol.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho node-1\nseq -f 'node-%g' 2 100000\n")
    scontrol.chmod(0o755)
    result = run_script(
        "slurm_gpu.sbatch",
        "--gin.TRAIN_STEPS=5",
        env=SLURM_ENV | {"DRY_RUN": "1"},
        path_prefix=f"{tmp_path}:",
    )
    assert result.returncode == 0, result.stderr
    assert "coordinator node-1:24242" in result.stdout
    assert "srun --kill-on-bad-exit=1" in result.stdout
    assert "-m sonew_pax.train --gin_file=tiny.gin" in result.stdout
    assert "--gin.TRAIN_STEPS=5" in result.stdout


def test_slurm_without_a_venv_fails_early():
    result = run_script("slurm_gpu.sbatch", env=SLURM_ENV | {"VENV": "/nonexistent"})
    assert result.returncode == 2 and "no python in VENV=/nonexistent" in result.stderr


def test_local_multiprocess_gives_each_process_its_index():
    code = (
        "import os; print('index', os.environ['PROCESS_INDEX'], 'of', "
        "os.environ['PROCESS_COUNT'], os.environ['COORDINATOR_ADDRESS'], "
        "os.environ['XLA_FLAGS'])"
    )
    env = {"NUM_PROCESSES": "3", "DEVICES_PER_PROCESS": "2", "PYTHON": sys.executable}
    result = run_script("local_multiprocess.sh", sys.executable, "-c", code, env=env)
    assert result.returncode == 0, result.stderr
    for index in range(3):
        assert re.search(
            rf"\[process {index}\] index {index} of 3 127\.0\.0\.1:\d+ "
            r"--xla_force_host_platform_device_count=2",
            result.stdout,
        )


def test_local_multiprocess_stops_the_others_when_one_fails(tmp_path):
    code = "import os, sys, time; time.sleep(60 * int(os.environ['PROCESS_INDEX'])); sys.exit(7)"
    env = {"NUM_PROCESSES": "2", "LOG_DIR": str(tmp_path), "PYTHON": sys.executable}
    result = run_script("local_multiprocess.sh", sys.executable, "-c", code, env=env)
    assert result.returncode == 7
    assert "stopping the others" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["process_0.log", "process_1.log"]


# --- Docker ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("name", "jax_extra"), [("Dockerfile.tpu", "tpu"), ("Dockerfile.gpu", "cuda12")]
)
def test_dockerfile_essentials(name, jax_extra):
    text = (REPO / "docker" / name).read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", base), f"base image {base} is not pinned to a tag"
    assert "latest" not in base
    assert re.search(r"^ARG JAX_VERSION=\d+\.\d+\.\d+$", text, re.M)
    assert f'"jax[{jax_extra}]==${{JAX_VERSION}}" -e ".[' in text
    assert re.search(r'-e "\.\[[\w,]*trainer', text), "the image must install the [trainer] extra"
    assert all("--no-cache-dir" in line for line in text.splitlines() if "pip install" in line)
    assert re.search(r"^WORKDIR /\S+", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["python", "-m", "sonew_pax.train"]' in text
    copied = set(re.findall(r"^COPY (.+) \S+$", text, re.M))
    assert " ".join(copied).split() and all((REPO / p).exists() for c in copied for p in c.split())


def test_dockerignore_keeps_the_context_small_but_complete():
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "runs"} <= ignored
    assert not {"sonew_pax", "configs", "pyproject.toml", "README.md"} & ignored


# --- the v4-32 run config -------------------------------------------------------------------

RUN_CONFIG = "runs/pretrain_1b_v4_32.gin"


def _comment_numbers(text: str) -> dict[str, float]:
    """``#   name:   1,234.5 ...`` lines of the memory block -> {name: number}."""
    block = text.split("Memory per chip", 1)[1].split("\n#\n", 1)[0]
    pattern = r"^#\s+([A-Za-z][\w +()/-]*?):\s+([\d,]+(?:\.\d+)?)"
    return {m[1]: float(m[2].replace(",", "")) for m in re.finditer(pattern, block, re.M)}


def activation_bytes(cfg, tokens: int, sequences: int, seq_len: int) -> int:
    """Activations per chip by the formula in the config's comments (bf16, no remat)."""
    per_layer = (
        6 * tokens * cfg.d_model
        + 4 * tokens * cfg.num_heads * cfg.head_dim
        + 2 * sequences * cfg.num_heads * seq_len**2
        + 3 * tokens * cfg.mlp_dim
    )
    return 2 * per_layer * cfg.num_layers + 2 * tokens * cfg.vocab_size * 4


@pytest.fixture
def run_config():
    """The v4-32 run config parsed by gin (cleared afterwards)."""
    gin.clear_config()
    train.parse_gin([RUN_CONFIG], ['MODEL_DIR = "/tmp/unused"', "TRAIN_STEPS = 100000"], [])
    yield
    gin.clear_config()


def _bytes(tree) -> int:
    return sum(
        math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "shape")
    )


def test_v4_32_memory_estimate_matches_the_real_model(run_config):
    text = (REPO / "configs" / RUN_CONFIG).read_text()
    stated = _comment_numbers(text)
    cfg = gin.query_parameter("%MODEL_CONFIG").scoped_configurable_fn()
    data, model = gin.query_parameter("make_mesh.data"), gin.query_parameter("make_mesh.model")
    batch, seq_len = gin.query_parameter("%BATCH_SIZE"), gin.query_parameter("%SEQ_LEN")
    chips = data * model
    assert chips == 16 and batch % data == 0
    assert gin.query_parameter("sonew.band") == 1

    example = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    params = train_state.strip_boxes(train_state.abstract_boxed_params(Transformer(cfg), example))
    tx = optimizers.make_optimizer(optimizers.learning_rate_schedule())
    opt_state = jax.eval_shape(tx.init, params)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    param_bytes, state_bytes = _bytes(params), _bytes(opt_state)
    assert stated["parameters"] == count
    assert state_bytes / param_bytes == pytest.approx(2.5, rel=0.01)  # m, d in fp32, e in bf16

    sequences = batch // data
    expected_gib = {
        "params + grads": 2 * param_bytes / chips / GIB,
        "SONew state": state_bytes / chips / GIB,
        "gathered bf16 weights": count * 2 / GIB,
        "activations": activation_bytes(cfg, sequences * seq_len, sequences, seq_len) / GIB,
    }
    expected_gib["total"] = sum(expected_gib.values())
    for name, value in expected_gib.items():
        assert stated[name] == pytest.approx(value, abs=0.01), name
    assert expected_gib["total"] < 0.75 * V4_HBM_GIB


@pytest.mark.parametrize(("accelerator", "devices"), [("v4-32", 16), ("v5litepod-8", 8)])
def test_tpu_pod_check_trains_on_the_slice_then_on_a_cpu_mesh_and_compares(accelerator, devices):
    """``check``: the shrunk run on every worker, the same run on worker 0's CPU simulating the
    slice's devices with reference attention, then crosscheck of the two MODEL_DIRs; the CPU
    run's flags parse against the run config as given (every binding and macro exists)."""
    env = TPU_ENV | {"DRY_RUN": "1", "ACCELERATOR_TYPE": accelerator}
    result = run_script("tpu_pod.sh", "check", env=env)
    assert result.returncode == 0, result.stderr
    on_slice, on_cpu = (_printed_argv(line)[-1].removeprefix("--command=")
                        for line in result.stdout.splitlines())  # fmt: skip
    assert "--worker=all" in result.stdout.splitlines()[0]
    assert "--worker=0" in result.stdout.splitlines()[1]
    words = shlex.split(on_cpu)
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}" in words
    assert "JAX_PLATFORMS=cpu" in words and "--process_count=1" in words
    train_flags = words[words.index("sonew_pax.train") + 1 : words.index("&&", 3)]
    checked = words[words.index("sonew_pax.crosscheck") + 1 :]
    prefix = '--gin.MODEL_DIR="'
    model_dirs = [f[len(prefix) : -1] for f in train_flags if f.startswith(prefix)]
    assert model_dirs[0].startswith("/mnt/gcs/b/run/crosscheck-") and model_dirs[0].endswith("/cpu")
    assert checked[:2] == [model_dirs[0].removesuffix("/cpu") + "/tpu", model_dirs[0]]
    assert f'--gin.MODEL_DIR="{checked[0]}"' in shlex.split(on_slice)
    args = train.rewrite_gin_args([f for f in train_flags if not f.startswith("--process_count")])
    files = [a.removeprefix("--gin_file=") for a in args if a.startswith("--gin_file=")]
    bindings = [a.removeprefix("--gin_bindings=") for a in args if a.startswith("--gin_bindings=")]
    gin.clear_config()
    try:
        train.parse_gin(files, bindings, ["."])
        assert gin.query_parameter("TransformerConfig.num_layers") == 2
        assert gin.query_parameter("TransformerConfig.attention") == "xla"
        assert gin.query_parameter("%BATCH_SIZE") == 2 * devices
    finally:
        gin.clear_config()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"ACCELERATOR_TYPE": "v4-foo"}, "cannot read the size of ACCELERATOR_TYPE 'v4-foo'"),
        ({"CHECK_DEVICES": "0"}, "CHECK_DEVICES must be a positive integer, got '0'"),
        ({"CHECK_STEPS": "x"}, "CHECK_STEPS must be a positive integer, got 'x'"),
    ],
)
def test_tpu_pod_check_refuses_a_device_count_or_step_count_it_cannot_use(setting, message):
    result = run_script("tpu_pod.sh", "check", env=TPU_ENV | {"DRY_RUN": "1"} | setting)
    assert result.returncode == 2 and message in result.stderr
    assert "sonew_pax.train" not in result.stdout
