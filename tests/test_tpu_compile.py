"""The v4-32 run's train step compiles for its 16 TPU v4 chips on this host, and fits.

``benchmarks.tpu_compile --train_step`` compiles ``runs/pretrain_1b_v4_32.gin``'s step (SONew
tridiagonal on the XLA path, FSDP over 16 chips, splash attention) for the topology without a
TPU, through libtpu. CI installs no libtpu (over 100 MB), so there the test is skipped; with
``pip install 'jax[tpu]'`` it runs one layer of the 1B model (minutes on two cores).
"""

import pytest

pytest.importorskip("libtpu", reason="compiling for a TPU topology needs libtpu (jax[tpu])")

from benchmarks import lm_shapes, tpu_compile

V4_32 = "runs/pretrain_1b_v4_32.gin"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_v4_32_train_step_compiles_for_16_v4_chips_and_fits_their_hbm():
    devices = tpu_compile.topology_devices("v4:2x2x4")
    assert len(devices) == 16  # one device per chip (megacore), as JAX runs a v4-32
    row = tpu_compile.compile_train_step([V4_32], ["TransformerConfig.num_layers = 1"], devices)
    assert row["layers"] == 1
    # Each chip holds 1/16 of the state (FSDP): float32 parameters, AdamW's grafting moments and
    # SONew's three arrays, about 5 copies of the parameters in all.
    assert 0 < row["argument_gib"] * 2**30 < 6 * 4 * row["params"] / 16
    assert row["alias_gib"] > 0.9 * row["output_gib"]  # the state is updated in place
    assert row["total_gib"] < tpu_compile.HBM_GIB[devices[0].device_kind]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stacked_by_shape_moves_no_more_than_per_tensor_on_a_tpu():
    """The XLA update of an LM set stacked by shape (a loop over each stack's tensors, the stack
    row-major, each parameter's graft scale fused into its apply) moves no more HBM bytes than
    the same update per tensor, compiled for a TPU v5e."""
    device = tpu_compile.topology_device("v5e:2x2")
    shapes = lm_shapes.lm_shapes(scale=0.25, layers=4)
    moved = {
        name: tpu_compile.compile_update(name, shapes, device)["hbm_b_per_param"]
        for name in ("sonew_tridiag", "sonew_tridiag_by_shape")
    }
    assert moved["sonew_tridiag_by_shape"] <= moved["sonew_tridiag"]
