"""Sampling: greedy decoding against the full forward pass, restoring a run trained on a 2x4 mesh
onto one device (read-only, a corrupt newest checkpoint skipped), the command line's errors, and
the run's Hugging Face export (its parameters, its tokenizer note)."""

import os
import shutil
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sonew_pax import demo, export_hf, inference, loop, safetensors_io
from sonew_pax.data import ByteTokenizer
from sonew_pax.errors import ConfigError, RunError
from sonew_pax.models import Transformer, TransformerConfig, llama
from tests.test_trainer import configure

CONFIG = TransformerConfig(
    vocab_size=64, d_model=32, num_layers=1, num_heads=4, head_dim=8, mlp_dim=48, max_len=16
)
STEPS = 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step tiny run (SwiGLU, so that it exports) on the 2x4 mesh, checkpoints at steps 1
    and 2 (AdamW: the cheapest train step to compile)."""
    model_dir = tmp_path_factory.mktemp("run")
    configure(
        model_dir,
        f"TRAIN_STEPS = {STEPS}",
        "make_optimizer.factory = @adamw",
        "TransformerConfig.mlp_activation = 'swiglu'",
        "CHECKPOINT_PERIOD = 1",
        "learning_rate_schedule.warmup_steps = 1",
    )
    loop.train(eval_data=None, compilation_cache_dir="")
    gin.clear_config()
    return model_dir


def _generate(params, prompt, seed, **settings):
    return inference.generate(
        params,
        prompt,
        jax.random.key(seed),
        config=CONFIG,
        vocab_size=CONFIG.vocab_size,
        max_new_tokens=8,
        **settings,
    )


def test_greedy_decoding_is_the_argmax_of_the_full_forward_pass():
    prompt = jax.random.randint(jax.random.key(1), (3, 5), 0, CONFIG.vocab_size, jnp.int32)
    model = Transformer(CONFIG)
    params = jax.jit(model.init)(jax.random.key(0), prompt)["params"]
    greedy = _generate(params, prompt, 0, temperature=0.0, top_k=None)
    # Every drawn token is the argmax of the full pass over the prompt and the tokens before it.
    tokens = jnp.concatenate([prompt, greedy[:, :-1]], axis=1)
    logits = jax.jit(model.apply)({"params": params}, tokens)
    np.testing.assert_array_equal(greedy, jnp.argmax(logits[:, prompt.shape[1] - 1 :], axis=-1))
    # top_k = 1 draws the same at any seed; wider draws depend on the seed.
    np.testing.assert_array_equal(_generate(params, prompt, 7, temperature=1.0, top_k=1), greedy)
    first, second = (_generate(params, prompt, s, temperature=1.0, top_k=2) for s in (0, 1))
    assert not np.array_equal(first, second)


def test_load_run_restores_the_run_on_one_device(run_dir):
    run = inference.load_run(str(run_dir))
    assert run.step == STEPS
    assert run.config.d_model == 32 and run.config.num_layers == 1  # the run's own bindings
    assert isinstance(run.tokenizer, ByteTokenizer)
    device = jax.local_devices()[0]
    assert all(leaf.sharding.device_set == {device} for leaf in jax.tree.leaves(run.params))
    texts = inference.sample(run, "ROMEO:", num_samples=2, max_new_tokens=20, temperature=0.0)
    assert len(texts) == 2 and texts[0] == texts[1]  # greedy: both rows draw the same
    with pytest.raises(ConfigError, match="max_len"):
        inference.sample(run, "x" * 120, max_new_tokens=20)


def test_demo_prints_two_samples(run_dir):
    text = demo.samples(run_dir)
    assert f"at step {STEPS}" in text and "python -m sonew_pax.sample" in text
    assert text.count(f"\n{demo.PROMPT}") == 2 and "--- sample 2 ---" in text


def test_a_corrupt_newest_checkpoint_is_skipped_and_left_in_place(run_dir, tmp_path, caplog):
    shutil.copytree(run_dir, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / f"checkpoint_{STEPS}"
    for file in (newest / "state").rglob("*"):
        if file.is_file() and file.parent.name == "d":  # the array data files
            file.write_bytes(file.read_bytes()[:7])
    assert inference.load_run(str(tmp_path)).step == STEPS - 1
    assert newest.is_dir() and not list(tmp_path.glob("*.corrupt"))
    assert any(str(newest) in record.getMessage() for record in caplog.records)


def test_missing_config_or_checkpoint_is_one_error_line(run_dir, tmp_path):
    with pytest.raises(RunError, match=r"config\.gin does not exist"):
        inference.load_run(str(tmp_path))
    shutil.copy(run_dir / "config.gin", tmp_path)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "sonew_pax.sample", f"--model_dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: no checkpoint in {tmp_path}"


def test_export_writes_the_runs_parameters(run_dir, tmp_path):
    lines = export_hf.export(str(run_dir), str(tmp_path))
    assert "byte-level" in lines[-1] and not (tmp_path / export_hf.TOKENIZER_MODEL).exists()
    run = inference.load_run(str(run_dir))
    tensors = safetensors_io.load(tmp_path / llama.WEIGHTS_FILE)
    expected = llama.llama_tensors(run.params, run.config)
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value)
