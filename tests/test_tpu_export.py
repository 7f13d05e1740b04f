"""The train step lowers for TPU, proven on CPU: `jax.export` for platform "tpu".

`loop.configured_trainer` builds the step a run's gin config gives (`train`'s own code
path), and `Trainer.export_train_step` lowers it from abstract inputs carrying their shardings:
nothing is allocated, nothing compiled. Covered: the tiny and 1b models x AdamW, tridiagonal
SONew and band-4 SONew on a 2x4 mesh (data=2, model=4), splash attention on that mesh, and
``runs/pretrain_1b_v4_32.gin`` (splash attention) on its 16 devices (in a subprocess, which
simulates 16 CPU devices). Each exported module must hold
no custom call a TPU cannot run (a Triton or CUDA kernel), and take the layout's shardings.

Run as a script (``python -m tests.test_tpu_export GIN_FILE...``) it prints, as JSON, what the
test checks of one export.
"""

import itertools
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Sequence

import gin
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax import loop, train, trainer
from sonew_pax.errors import ConfigError
from tests.flags import xla_flags

REPO = pathlib.Path(__file__).resolve().parent.parent
# Custom-call targets that XLA's TPU compiler implements: sharding annotations (the GSPMD form
# of shardings and shard_map's manual regions) and Pallas' Mosaic TPU kernels.
TPU_CUSTOM_CALLS = frozenset(
    {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "tpu_custom_call"}
)
# A custom call's target, in MLIR's pretty form (``@name`` or ``@"name"``) or generic form.
_CUSTOM_CALL = re.compile(
    r'stablehlo\.custom_call @(?:"([^"]+)"|([\w$.\-]+))|call_target_name = "([^"]+)"'
)
MODELS = ("tiny", "1b")
OPTIMIZERS = ("adamw", "sonew_tridiag", "sonew_band4")
# Batch and model sizes as the configs set them; sequences within tiny's max_len (128).
MESH_2X4 = ("SEQ_LEN = 128", "make_mesh.data = 2", "make_mesh.model = 4")
# TRAIN_STEPS as in docs/pods.md's v4-32 command (beyond the schedule's warmup).
REQUIRED = ('MODEL_DIR = "/unused"', "TRAIN_STEPS = 100000")
V4_32_DEVICES = 16


def custom_call_targets(module_text: str) -> set[str]:
    """The targets of every custom call in an MLIR module's text."""
    return {next(filter(None, groups)) for groups in _CUSTOM_CALL.findall(module_text)}


def non_tpu_custom_calls(module_text: str) -> list[str]:
    """The custom-call targets of a module that are not in `TPU_CUSTOM_CALLS`, sorted."""
    return sorted(custom_call_targets(module_text) - TPU_CUSTOM_CALLS)


def export_for_tpu(files: Sequence[str], bindings: Sequence[str]) -> dict:
    """Exports the train step of the gin config ``files`` + ``bindings`` for TPU; what the tests
    check of it: platforms, device count, the custom calls not in `TPU_CUSTOM_CALLS`, and the
    inputs and output state whose shardings differ from the trainer's layout (paths)."""
    gin.clear_config()
    try:
        train.parse_gin(files, bindings, [])
        step_fns = loop.configured_trainer()
        exported = step_fns.export_train_step(("tpu",))
    finally:
        gin.clear_config()
    layout = step_fns.layout
    batch_shardings = dict.fromkeys(trainer.BATCH_KEYS, step_fns.batch_sharding)
    inputs = _mismatches(
        (layout.abstract, step_fns.abstract_batch()),
        (layout.shardings, batch_shardings),
        exported.in_shardings_jax(step_fns.mesh),
    )
    # The outputs are (state, metrics): the state's leaves come first.
    outputs = _mismatches(
        layout.abstract, layout.shardings, exported.out_shardings_jax(step_fns.mesh)
    )
    return {
        "platforms": list(exported.platforms),
        "devices": exported.nr_devices,
        "non_tpu_custom_calls": non_tpu_custom_calls(exported.mlir_module()),
        "tpu_kernels": exported.mlir_module().count("tpu_custom_call"),
        "mismatched_shardings": inputs + outputs,
    }


def _mismatches(abstract, wanted, exported: Sequence) -> list[str]:
    """Paths of the leaves of ``abstract`` whose sharding among the first of ``exported`` (flat,
    as `jax.export` gives them) is not the one in ``wanted`` (a tree like ``abstract``'s)."""
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    return [
        jax.tree_util.keystr(path)
        for (path, leaf), want, got in zip(
            leaves, jax.tree.leaves(wanted), exported[: len(leaves)], strict=True
        )
        if not want.is_equivalent_to(got, leaf.ndim)
    ]


def assert_lowers_for_tpu(summary: dict, devices: int) -> None:
    assert summary["platforms"] == ["tpu"]
    assert summary["devices"] == devices
    assert summary["non_tpu_custom_calls"] == [], summary["non_tpu_custom_calls"]
    assert summary["mismatched_shardings"] == [], summary["mismatched_shardings"]


def test_the_check_flags_a_triton_kernel():
    """A Pallas kernel lowered for CUDA with Triton's parameters is the custom call a GPU host's
    SONew step would hold; jax.export keeps it only with its safety check disabled."""

    def double(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    kernel = pl.pallas_call(
        double,
        out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4),
    )
    triton = "__gpu$xla.gpu.triton"
    exported = jax.export.export(
        jax.jit(kernel),
        platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)],
    )(jax.ShapeDtypeStruct((16,), jnp.float32))
    assert non_tpu_custom_calls(exported.mlir_module()) == [triton]


def test_the_check_reads_both_forms_and_allows_tpus_own_calls():
    module = """
      %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{replicated}"}
      %1 = stablehlo.custom_call @"cu_threefry2x32"(%0) : (tensor<4xui32>) -> tensor<4xui32>
      %2 = "stablehlo.custom_call"(%1) {call_target_name = "triton_kernel_call"}
      %3 = stablehlo.custom_call @tpu_custom_call(%2) {backend_config = "..."}
    """
    assert custom_call_targets(module) == {
        "Sharding",
        "cu_threefry2x32",
        "triton_kernel_call",
        "tpu_custom_call",
    }
    assert non_tpu_custom_calls(module) == ["cu_threefry2x32", "triton_kernel_call"]


def test_configured_trainer_names_the_unbound_train_arguments():
    gin.clear_config()
    try:
        train.parse_gin(["models/tiny.gin"], [], [])
        with pytest.raises(ConfigError, match=r"binds no train\.batch_size, .*train\.seq_len"):
            loop.configured_trainer()
    finally:
        gin.clear_config()


def _fewer_layers(model: str, optimizer: str) -> tuple[str, ...]:
    """Band 4 steps each tensor on its own: two of the 1B's layers hold every tensor shape it has,
    for an eighth of the lowering (``test_v4_32_run_lowers_for_tpu_on_its_16_devices`` lowers all
    16 layers with the run's tridiagonal SONew)."""
    per_tensor_1b = (model, optimizer) == ("1b", "sonew_band4")
    return ("TransformerConfig.num_layers = 2",) if per_tensor_1b else ()


@pytest.mark.parametrize(("model", "optimizer"), list(itertools.product(MODELS, OPTIMIZERS)))
def test_train_step_lowers_for_tpu_on_a_2x4_mesh(model, optimizer):
    files = ["runs/pretrain.gin", f"models/{model}.gin", f"optimizers/{optimizer}.gin"]
    summary = export_for_tpu(files, [*REQUIRED, *MESH_2X4, *_fewer_layers(model, optimizer)])
    assert_lowers_for_tpu(summary, devices=8)


@pytest.mark.parametrize("optimizer", ["sonew_tridiag", "sonew_band4"])
def test_train_step_with_the_tpu_kernels_lowers_for_tpu_on_a_2x4_mesh(optimizer):
    """The 1B model's train step with the TPU kernels (opt-in) on each device's blocks."""
    files = ["runs/pretrain.gin", "models/1b.gin", f"optimizers/{optimizer}.gin"]
    kernel = (
        'sonew.implementation = "pallas"',
        "sonew.kernel_config = @KernelConfig()",
        'KernelConfig.platform = "tpu"',
        "KernelConfig.interpret = False",  # lowered for TPU from this CPU host
    )
    layers = _fewer_layers("1b", optimizer)
    summary = export_for_tpu(files, [*REQUIRED, *MESH_2X4, *kernel, *layers])
    assert_lowers_for_tpu(summary, devices=8)
    assert summary["tpu_kernels"] > 0


def test_splash_attention_lowers_for_tpu_on_a_2x4_mesh():
    """Splash attention's Mosaic kernels in the train step, each device on its own examples
    (data) and heads (model): forward and backward kernels under shard_map."""
    files = ["runs/pretrain.gin", "models/tiny.gin", "optimizers/sonew_tridiag.gin"]
    splash = ('TransformerConfig.attention = "splash"',)
    summary = export_for_tpu(files, [*REQUIRED, *MESH_2X4, *splash])
    assert_lowers_for_tpu(summary, devices=8)
    assert summary["tpu_kernels"] > 0


def test_v4_32_run_lowers_for_tpu_on_its_16_devices():
    """``runs/pretrain_1b_v4_32.gin`` as the launcher runs it (mesh data=16, FSDP, splash
    attention), in a process with 16 simulated devices (this one has 8)."""
    env = os.environ | {
        "XLA_FLAGS": xla_flags(V4_32_DEVICES),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-m", "tests.test_tpu_export", "runs/pretrain_1b_v4_32.gin"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert_lowers_for_tpu(summary, devices=V4_32_DEVICES)
    assert summary["tpu_kernels"] > 0  # splash attention


if __name__ == "__main__":
    print(json.dumps(export_for_tpu(sys.argv[1:], REQUIRED)))
