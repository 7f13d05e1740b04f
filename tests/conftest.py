"""Test set-up: 8 simulated CPU devices, before JAX is imported anywhere."""

import os

from tests.flags import xla_flags

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib

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
