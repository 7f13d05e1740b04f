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
