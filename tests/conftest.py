"""Test set-up: 8 simulated CPU devices, before JAX is imported anywhere."""

import os

from tests.flags import xla_flags

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib
import errno
import re

import jax
import pytest


@contextlib.contextmanager
def jax_config(name: str, value):
    """``jax.config`` option ``name`` set to ``value`` in the block, restored after."""
    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


@pytest.fixture
def x64():
    """Float64 for the duration of one test (math checked against dense float64 references)."""
    with jax_config("jax_enable_x64", True):
        yield


@pytest.fixture
def failing_saves(monkeypatch):
    """``fail(steps)``: from then on, orbax's background writes of the JSON items of the
    checkpoints of ``steps`` raise ENOSPC, as a full disk does (a callable: every step it
    accepts)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    write = json_checkpoint_handler.JsonCheckpointHandler._save_fn

    def fail(steps):
        async def failing(self, x, directory):
            step = int(re.search(r"checkpoint_(\d+)", str(directory)).group(1))
            if steps(step):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return await write(self, x, directory)

        monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", failing)

    return fail


# CPU-seconds of each module (user + sys, its subprocesses included), one process each, on the
# 2-core host. ``--dist loadfile`` hands the two workers whole modules in collection
# order (pyproject.toml turns off xdist's reordering by test count, which put costly modules of few
# tests last): the longest first, so the last modules to finish are short and neither worker waits
# long for the other. A module missing here runs after these.
MODULE_COST = {
    "test_kernels": 158,
    "test_sonew_sharded": 130,
    "test_cli": 90,
    "test_sonew_optax": 81,
    "test_lm_convergence_smoke": 59,
    "test_apply": 57,
    "test_multihost": 55,
    "test_benchmarks_smoke": 55,
    "test_stacked": 51,
    "test_tpu_kernel": 36,
    "test_damping": 33,
    "test_stack_by_shape": 32,
    "test_attention": 31,
    "test_autoencoder_smoke": 30,
    "test_crosscheck": 30,
    "test_trainer": 28,
    "test_reliability": 28,
    "test_scaling_smoke": 24,
    "test_sonew_math": 23,
    "test_models": 22,
    "test_tpu_export": 21,
    "test_optax_contract": 19,
    "test_graft_lag": 18,
    "test_command_buffers": 17,
    "test_sample": 17,
    "test_optax_contrib_suite": 15,
    "test_trainer_configs": 12,
    "test_muon": 11,
    "test_export_hf": 10,
    "test_checkpoints": 9,
    "test_data": 8,
    "test_partitioning": 7,
    "test_fma": 4,
    "test_adafactor": 4,
    "test_launch": 4,
    "test_paths": 4,
    "test_packaging": 3,
}


def pytest_collection_modifyitems(items):
    """Modules by :data:`MODULE_COST`, costliest first (the others after, in their order)."""
    cost = lambda item: MODULE_COST.get(item.path.stem, 0)  # noqa: E731
    items.sort(key=lambda item: -cost(item))  # stable: a module's tests keep their order
