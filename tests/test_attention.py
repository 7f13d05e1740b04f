"""Attention's implementations, grouped-query attention, the fused loss and remat, against
independent references.

Splash attention runs here in Pallas' interpreter (the same kernel code the TPU compiles; its TPU
lowering is tests/test_tpu_export.py's); cuDNN's kernel needs a GPU: there `benchmarks.attention`
checks it against the same reference, and the training comparison below, called on a GPU, trains
with it (the suite itself runs on simulated CPU devices).
"""

import dataclasses
import logging

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sonew_pax import loop, train
from sonew_pax.models import Transformer, TransformerConfig, attention, attention_choice, losses

# The backend's fast kernel and the dtype it runs in: cuDNN's on GPUs (bf16 only), splash elsewhere.
FAST, FAST_DTYPE = (
    ("cudnn", "bfloat16") if jax.default_backend() == "gpu" else ("splash", "float32")
)

TINY = TransformerConfig(
    vocab_size=61, d_model=32, num_layers=2, num_heads=4, head_dim=8, mlp_dim=64, max_len=128
)


def dense_attention(q, k, v, offset=0):
    """Causal softmax attention in float64 numpy, key/value heads repeated per query group."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bthd->bhqt", q, k) / np.sqrt(q.shape[-1])
    positions = offset + np.arange(q.shape[1])
    scores = np.where(np.arange(k.shape[1])[None, :] <= positions[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqt,bthd->bqhd", probs, v)


def random_qkv(seed, batch, length, heads, kv_heads, head_dim, key_length=None):
    keys = jax.random.split(jax.random.key(seed), 3)
    kv_shape = (batch, key_length or length, kv_heads, head_dim)
    return (
        jax.random.normal(keys[0], (batch, length, heads, head_dim)),
        jax.random.normal(keys[1], kv_shape),
        jax.random.normal(keys[2], kv_shape),
    )


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_reference_attention_is_causal_softmax_attention(kv_heads):
    """Against float64; the reference's scores are float32 by design."""
    q, k, v = random_qkv(0, 2, 9, 4, kv_heads, 8)
    np.testing.assert_allclose(
        attention.reference_attention(q, k, v), dense_attention(q, k, v), rtol=1e-5, atol=1e-6
    )


def test_reference_attention_from_an_offset_sees_the_earlier_keys():
    """Decoding: 3 queries at positions 5, 6, 7 over 8 cached keys."""
    q, k, v = random_qkv(1, 2, 3, 4, 2, 8, key_length=8)
    out = attention.reference_attention(q, k, v, query_offset=5)
    np.testing.assert_allclose(out, dense_attention(q, k, v, offset=5), rtol=1e-5, atol=1e-6)


def test_splash_attention_equals_the_reference_forward_and_backward():
    q, k, v = random_qkv(2, 2, 256, 4, 2, 32)
    cotangent = jax.random.normal(jax.random.key(3), q.shape)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cotangent), (0, 1, 2)))

    got = loss(attention.splash_attention)(q, k, v)
    want = loss(attention.reference_attention)(q, k, v)
    for x, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref)) < 1e-5


@pytest.mark.parametrize(
    ("implementation", "backend", "changes", "runs", "fallback"),
    [
        ("auto", "cpu", {}, "xla", False),
        ("auto", "gpu", {"dtype": "bfloat16"}, "cudnn", False),
        ("auto", "tpu", {}, "splash", False),
        ("auto", "gpu", {}, "xla", True),  # float32: cuDNN's kernel takes half precision
        ("cudnn", "gpu", {"dtype": "bfloat16", "head_dim": 12}, "xla", True),
        ("auto", "tpu", {"dropout_rate": 0.1}, "xla", True),
        ("xla", "gpu", {"dtype": "bfloat16"}, "xla", False),
    ],
)
def test_resolve_picks_the_platforms_kernel_or_says_why_not(
    implementation, backend, changes, runs, fallback
):
    config = dataclasses.replace(TINY, attention=implementation, **changes)
    choice = attention_choice(config, length=128, backend=backend)
    assert (choice.implementation, choice.fallback) == (runs, fallback)
    assert bool(choice.reason) == (fallback or implementation == "auto")


def test_splash_needs_whole_blocks_of_the_sequence():
    choice = attention_choice(dataclasses.replace(TINY, attention="splash"), length=100)
    assert choice.implementation == "xla" and "multiple of 128" in choice.reason


def test_unknown_settings_are_named():
    with pytest.raises(ValueError, match="attention must be one of"):
        TransformerConfig(attention="flash")
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        TransformerConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="remat must be one of"):
        TransformerConfig(remat="some")


def test_grouped_query_attention_is_multi_head_attention_with_shared_keys():
    """A model with 2 key/value heads computes what the 4-head model computes when each of its
    key and value kernels' heads is copied to the two query heads that read it."""
    gqa = dataclasses.replace(TINY, num_kv_heads=2, attention="xla")
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, TINY.vocab_size)
    params = Transformer(gqa).init(jax.random.key(1), tokens)["params"]
    params = jax.tree.map(lambda box: box.unbox(), params, is_leaf=lambda x: hasattr(x, "unbox"))
    assert params["layer_0"]["attn"]["key"].shape == (32, 2, 8)
    full = jax.tree.map(lambda x: x, params)
    for layer in ("layer_0", "layer_1"):
        for name in ("key", "value"):
            full[layer]["attn"][name] = jnp.repeat(params[layer]["attn"][name], 2, axis=1)
    mha = dataclasses.replace(TINY, attention="xla")
    np.testing.assert_allclose(
        Transformer(gqa).apply({"params": params}, tokens),
        Transformer(mha).apply({"params": full}, tokens),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_cross_entropy_equals_the_softmax_cross_entropy_of_the_logits(dtype):
    """Loss and both gradients against optax on float64 logits; several chunks, zero weights."""
    keys = jax.random.split(jax.random.key(4), 4)
    features = jax.random.normal(keys[0], (4, 24, 16)).astype(dtype)
    kernel = (0.5 * jax.random.normal(keys[1], (16, 37))).astype(dtype)
    targets = jax.random.randint(keys[2], (4, 24), 0, 37)
    weights = (jax.random.uniform(keys[3], (4, 24)) > 0.3).astype(jnp.float32)

    def fused(x, w):
        loss, _ = losses.fused_cross_entropy(x, w, targets, weights, chunk_tokens=32)
        return loss

    def reference(x, w):
        logits = x.astype(jnp.float64) @ w.astype(jnp.float64)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)

    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    with jax.enable_x64(True):
        want = jax.value_and_grad(reference, (0, 1))(features, kernel)
    got = jax.value_and_grad(fused, (0, 1))(features, kernel)
    assert abs(float(got[0]) - float(want[0])) <= tolerance * abs(float(want[0]))
    for x, ref in zip(got[1], want[1], strict=True):
        ref = np.asarray(ref)
        assert np.linalg.norm(np.asarray(x, np.float64) - ref) <= tolerance * np.linalg.norm(ref)
    _, weight_sum = losses.fused_cross_entropy(features, kernel, targets, weights)
    assert float(weight_sum) == float(weights.sum())


def test_one_pass_logsumexp_equals_the_float64_logsumexp():
    """Rows far from 0, of mixed scales, with -inf entries, and one of -inf only."""
    x = np.random.default_rng(0).normal(size=(5, 1000)) * np.array([[1], [30], [1], [1], [1]])
    x[0] += 1e4
    x[2] -= 1e4
    x[3, ::3] = -np.inf
    x[4] = -np.inf
    got = np.asarray(losses.logsumexp_one_pass(jnp.asarray(x, jnp.float32)))
    top = np.max(x[:4], axis=1, keepdims=True)
    want = top[:, 0] + np.log(np.sum(np.exp(x[:4] - top), axis=1))
    np.testing.assert_allclose(got[:4], want, rtol=1e-6)
    assert got[4] == -np.inf


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_policies_compute_the_same_gradient(scan_layers):
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, TINY.vocab_size)

    def gradient(remat):
        model = Transformer(dataclasses.replace(TINY, remat=remat, scan_layers=scan_layers))
        params = model.init(jax.random.key(6), tokens)["params"]
        return jax.jit(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, tokens) ** 2)))(
            params
        )

    want = gradient("none")
    for policy in ("dots", "full"):
        for x, ref in zip(jax.tree.leaves(gradient(policy)), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-7)


def test_training_with_the_fast_attention_follows_the_reference():
    """200 AdamW steps of a tiny model, each on a fresh batch of a text-like source (each token the
    last plus 1, 2 or 3: log 3 nats of entropy per token), the same batches for both forms: the
    mean loss of the last 20 steps with the backend's fast kernel is within 1% of the reference
    form's. Fresh batches keep the loss near the source's entropy, where 1% is a fair margin (a
    memorised batch's loss falls towards 0, where bf16's rounding alone is more than 1% of it)."""
    config = dataclasses.replace(TINY, max_len=128, dtype=FAST_DTYPE)
    tx = optax.adamw(3e-3)

    def batch_of(step):
        key = jax.random.fold_in(jax.random.key(7), step)
        tokens = jnp.cumsum(jax.random.randint(key, (4, 129), 1, 4), axis=1) % config.vocab_size
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": jnp.ones((4, 128))}

    def losses_of(implementation):
        model = Transformer(dataclasses.replace(config, attention=implementation))
        params = model.init(jax.random.key(8), batch_of(0)["inputs"])["params"]

        def loss_fn(p, batch):
            features, kernel = model.apply({"params": p}, batch["inputs"], fused_head=True)
            loss, count = losses.fused_cross_entropy(
                features, kernel, batch["targets"], batch["weights"]
            )
            return loss / count

        @jax.jit
        def step(carry, index):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, batch_of(index))
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        _, curve = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(200))
        return np.asarray(curve, np.float64)

    reference, fast = losses_of("xla"), losses_of(FAST)
    assert reference[-20:].mean() < 0.5 * reference[0]  # it learned
    np.testing.assert_allclose(fast[-20:].mean(), reference[-20:].mean(), rtol=0.01)
    np.testing.assert_allclose(fast, reference, rtol=0.02)  # and step by step


def test_the_trainer_says_at_start_when_attention_falls_back(caplog):
    """A run whose configuration the asked-for kernel cannot take logs the fallback as a
    warning when the trainer is built (shapes only: nothing compiles)."""
    gin.clear_config()
    try:
        train.parse_gin(
            ["runs/pretrain.gin", "models/tiny.gin", "optimizers/adamw.gin"],
            [
                'MODEL_DIR = "/unused"',
                "TRAIN_STEPS = 100000",
                "SEQ_LEN = 128",
                'TransformerConfig.attention = "splash"',
                "TransformerConfig.dropout_rate = 0.1",
            ],
            [],
        )
        with caplog.at_level(logging.INFO):
            loop.configured_trainer()
    finally:
        gin.clear_config()
    (record,) = [r for r in caplog.records if r.getMessage().startswith("Attention:")]
    assert record.levelno == logging.WARNING
    assert "attention dropout (0.1) is not supported by splash" in record.getMessage()
