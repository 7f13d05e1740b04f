"""The optimizer installs and imports without the trainer's dependencies."""

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Top-level modules of the [trainer] extra that the optimizer must not import.
TRAINER_MODULES = ("flax", "orbax", "gin", "grain", "tensorboardX", "sentencepiece")


def test_importing_the_optimizer_loads_no_trainer_module():
    """In a fresh interpreter, ``import sonew_pax.optim`` and building ``sonew`` import none of
    the trainer's dependencies (nor ``sonew_pax``'s trainer modules)."""
    code = (
        "import sys, sonew_pax.optim\n"
        "sonew_pax.optim.sonew(1e-3)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    env = {"JAX_PLATFORMS": "cpu", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    loaded = out.stdout.split()
    assert "sonew_pax.optim" in loaded
    unwanted = [m for m in loaded if m.split(".")[0] in TRAINER_MODULES]
    assert not unwanted, unwanted
    trainer = [m for m in loaded if m.startswith("sonew_pax.") and m.split(".")[1] != "optim"]
    assert not trainer, trainer


def test_the_trainer_dependencies_are_an_extra_that_test_pulls_in():
    """``pip install sonew_pax`` is the optimizer's three; ``.[test]`` (``make setup``) adds the
    trainer's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [r.split(">")[0].split("=")[0].split("[")[0] for r in project["dependencies"]]
    assert names == ["jax", "numpy", "optax"]
    extras = project["optional-dependencies"]
    trainer = {r.split(">")[0].split("[")[0] for r in extras["trainer"]}
    assert {"flax", "orbax-checkpoint", "gin-config", "grain", "tensorboardX"} <= trainer
    assert "sonew_pax[trainer]" in extras["test"]
