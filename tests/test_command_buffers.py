"""SONew's update under XLA's concurrent command-buffer scheduling equals its update without it.

With ``XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` XLA may run independent
kernels of an update at the same time (the opt-in schedule of ``KernelConfig(concurrent=True)``,
whose bands >= 2 walk longer chunks). Every tensor's step
kernel overwrites the state that a halo kernel read just before, in place, so the result is only
right if XLA orders the two by their buffers. Two subprocesses run the same jitted, donated updates
(bands 1 and 4, the fused apply, several tensors of one shape that share launches, a tensor of
several row chunks), one under the flags, and their results must be equal bit for bit. On a GPU the
kernels run concurrently; on the CPU (the XLA path) the flags do nothing, and the test checks that
this jax's XLA accepts them. A third process asks for the same schedule for its update's executable
alone (``kernels.CONCURRENT_OPTIONS`` as its compile options, no flags).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CONCURRENT = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_graph_min_graph_size=1"
# In every process: XLA chooses among kernels by autotuning in each process, and a different
# choice can change a rounding (a GPU run of this test once found band 1's tall tensor 1 ulp apart
# in some elements between two processes); with it, serial, flagged and scoped processes agree.
DETERMINISTIC = "--xla_gpu_deterministic_ops=true"

# Writes the parameters after 3 updates of each band to the .npz file named by argv[1], the
# updates compiled with kernels.CONCURRENT_OPTIONS if argv[2] is "scoped".
UPDATES = """
import functools
import sys
import jax
import jax.numpy as jnp
import numpy as np
from sonew_pax import optim
from sonew_pax.optim import kernels

# The concurrent configuration's kernels in every process, launched one after another or at once.
config = optim.KernelConfig(concurrent=True)
options = kernels.CONCURRENT_OPTIONS if sys.argv[2] == "scoped" else None
jit = functools.partial(jax.jit, compiler_options=options)
shapes = {f"w{k}": (96, 64) for k in range(3)} | {"tall": (600, 32), "bias": (48,)}
rng = np.random.default_rng(0)
out = {}
for band in (1, 4):
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    tx = optim.sonew(1e-2, band=band, graft_lag=True, weight_decay=0.1, kernel_config=config)
    state = tx.init(params)
    step = jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
    for _ in range(3):
        grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
        params, state = step(params, state, grads)
    out |= {f"band{band}/{k}": np.asarray(v) for k, v in params.items()}
np.savez(sys.argv[1], **out)
"""


def _updates(path: Path, extra_flags: str, jit: str = "serial") -> dict[str, np.ndarray]:
    """The parameters :data:`UPDATES` writes, run in a subprocess with :data:`DETERMINISTIC` and
    ``extra_flags`` added to this process's ``XLA_FLAGS`` (``jit="scoped"``: compiled with
    ``kernels.CONCURRENT_OPTIONS``)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DETERMINISTIC} {extra_flags}".strip()
    done = subprocess.run(
        [sys.executable, "-c", UPDATES, str(path), jit],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(path) as f:
        return dict(f)


def test_concurrent_scheduling_changes_no_bit(tmp_path):
    serial = _updates(tmp_path / "serial.npz", "")
    concurrent = _updates(tmp_path / "concurrent.npz", CONCURRENT)
    scoped = _updates(tmp_path / "scoped.npz", "", jit="scoped")
    assert serial.keys() == concurrent.keys() == scoped.keys() and len(serial) == 10
    for name, value in serial.items():
        assert np.all(np.isfinite(value)), name
        np.testing.assert_array_equal(concurrent[name], value, err_msg=name)
        np.testing.assert_array_equal(scoped[name], value, err_msg=name)
