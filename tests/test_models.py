"""The decoder-only transformer: shapes, dtypes, causality, logical names, shipped sizes, and
cached decoding against the full forward pass."""

import pathlib

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks.train_step import random_batch
from sonew_pax.models import (
    Transformer,
    TransformerConfig,
    count_params,
    flops_per_token,
    init_cache,
    rotary_embedding,
    unstack_layers,
)
from sonew_pax.models.transformer import embed_tokens
from sonew_pax.partitioning import LAYERS

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs" / "models"
# Shipped model configs and their nominal sizes (the file names promise these).
NOMINAL_PARAMS = {"tiny": 0.43e6, "small": 25e6, "base": 125e6, "350m": 350e6, "1b": 1e9}
LOGICAL_NAMES = {"vocab", "embed", "mlp", "heads", "kv", "length"}

SMALL = dict(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, head_dim=8, mlp_dim=48, max_len=16
)
VARIANTS = [
    dict(),
    dict(mlp_activation="swiglu", positions="learned", tie_embeddings=False),
    dict(dtype="bfloat16", mlp_activation="swiglu"),
]


def _tokens(batch=2, length=12, vocab=64, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab, dtype=jnp.int32)


def _init(config, tokens):
    model = Transformer(config)
    return model, model.init(jax.random.key(0), tokens)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_forward_shape_and_dtypes(overrides):
    config = TransformerConfig(**SMALL, **overrides)
    tokens = _tokens()
    model, variables = _init(config, tokens)
    logits = model.apply(variables, tokens)
    assert logits.shape == (2, 12, config.vocab_size)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(variables)}
    assert dtypes == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    "overrides",
    [*VARIANTS[:2], dict(num_kv_heads=2)],
    ids=["gelu-rotary-tied", "swiglu-learned", "grouped-query"],
)
def test_cached_decoding_matches_the_full_forward_pass(overrides):
    """A prompt run into the cache, then one token at a time: the same logits as one pass over
    the whole sequence, and the cache's index at the end of it."""
    config = TransformerConfig(**SMALL, **overrides)
    tokens = _tokens(length=SMALL["max_len"])
    model, variables = _init(config, tokens)
    full = model.apply(variables, tokens)

    @jax.jit
    def step(cache, chunk):
        logits, mutated = model.apply(
            {**variables, "cache": cache}, chunk, decode=True, mutable=["cache"]
        )
        return mutated["cache"], logits

    cache = init_cache(config, *tokens.shape)
    cache, prefill = step(cache, tokens[:, :5])
    pieces = [prefill]
    for position in range(5, tokens.shape[1]):
        cache, logits = step(cache, tokens[:, position : position + 1])
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=0, atol=1e-5)
    assert int(cache["index"]) == tokens.shape[1]


@pytest.mark.parametrize("overrides", VARIANTS[:2], ids=["gelu-rotary-tied", "swiglu-learned"])
def test_scanned_layers_are_the_same_model_stacked(overrides):
    """With ``scan_layers`` each block parameter is stacked on a leading "layers" axis, and the
    model computes what the unscanned one does with those parameters unstacked: the forward pass,
    and cached decoding."""
    config = TransformerConfig(**SMALL, **overrides)
    scanned = TransformerConfig(**SMALL, **overrides, scan_layers=True)
    tokens = _tokens(length=SMALL["max_len"])
    model, variables = _init(scanned, tokens)
    names = nn.get_partition_spec(variables)["params"][LAYERS]
    for spec in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
        assert spec[0] == LAYERS
    params = nn.unbox(variables)["params"]
    assert params[LAYERS]["mlp"]["wo"].shape == (SMALL["num_layers"], 48, 32)
    full = model.apply({"params": params}, tokens)
    unscanned = Transformer(config).apply({"params": unstack_layers(params, config)}, tokens)
    np.testing.assert_allclose(full, unscanned, rtol=0, atol=1e-5)
    cache = init_cache(scanned, *tokens.shape)
    assert cache[LAYERS]["attn"]["key"].shape[0] == SMALL["num_layers"]
    prefill, mutated = model.apply(
        {"params": params, "cache": cache}, tokens[:, :5], decode=True, mutable=["cache"]
    )
    last, _ = model.apply(
        {"params": params, **mutated}, tokens[:, 5:6], decode=True, mutable=["cache"]
    )
    np.testing.assert_allclose(prefill, full[:, :5], rtol=0, atol=1e-5)
    np.testing.assert_allclose(last, full[:, 5:6], rtol=0, atol=1e-5)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_causal(positions):
    config = TransformerConfig(**SMALL, positions=positions)
    tokens = _tokens()
    model, variables = _init(config, tokens)
    t = 7
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % config.vocab_size)
    before, after = model.apply(variables, tokens), model.apply(variables, changed)
    np.testing.assert_array_equal(np.asarray(before[:, :t]), np.asarray(after[:, :t]))
    assert not np.allclose(np.asarray(before[:, t:]), np.asarray(after[:, t:]))


@pytest.mark.parametrize("overrides", VARIANTS[:2])
def test_every_param_has_logical_names(overrides):
    config = TransformerConfig(**SMALL, **overrides)
    variables = jax.eval_shape(Transformer(config).init, jax.random.key(0), _tokens())
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(variables["params"], is_leaf=is_box)
    assert len(leaves) == count_expected_tensors(config)
    for path, leaf in leaves:
        assert is_box(leaf), jax.tree_util.keystr(path)
        assert len(leaf.names) == len(leaf.value.shape), jax.tree_util.keystr(path)
        assert set(leaf.names) <= LOGICAL_NAMES, (jax.tree_util.keystr(path), leaf.names)


def count_expected_tensors(config):
    per_layer = 2 + 4 + (3 if config.mlp_activation == "swiglu" else 2)
    extra = (config.positions == "learned") + (not config.tie_embeddings)
    return 2 + extra + config.num_layers * per_layer


def test_kernel_layouts():
    config = TransformerConfig(**SMALL, tie_embeddings=False)
    params = jax.eval_shape(Transformer(config).init, jax.random.key(0), _tokens())["params"]
    layer = params["layer_0"]
    assert layer["attn"]["query"].names == ("embed", "heads", "kv")
    assert layer["attn"]["query"].value.shape == (32, 4, 8)
    assert layer["attn"]["out"].names == ("heads", "kv", "embed")
    assert layer["mlp"]["wi"].names == ("embed", "mlp")
    assert layer["mlp"]["wo"].names == ("mlp", "embed")
    assert layer["attn_norm"]["scale"].names == ("embed",)
    assert params["embedding"].names == ("vocab", "embed")
    assert params["output"].names == ("embed", "vocab")


def _load_gin_config(path):
    gin.clear_config()
    try:
        gin.parse_config_file(str(path))
        return TransformerConfig(**gin.get_bindings("TransformerConfig"))
    finally:
        gin.clear_config()


@pytest.mark.parametrize("name", sorted(NOMINAL_PARAMS))
def test_shipped_config_sizes(name):
    config = _load_gin_config(CONFIGS / f"{name}.gin")
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    variables = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens)
    n = count_params(variables)
    assert abs(n - NOMINAL_PARAMS[name]) <= 0.15 * NOMINAL_PARAMS[name], (name, n)
    assert config.max_len >= 128


def test_gin_macro_builds_config():
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [str(CONFIGS / "tiny.gin")], ["TransformerConfig.dropout_rate = 0.1"]
        )
        config = gin.query_parameter("%MODEL_CONFIG").scoped_configurable_fn()
    finally:
        gin.clear_config()
    assert isinstance(config, TransformerConfig)
    assert (config.vocab_size, config.dropout_rate) == (256, 0.1)
    assert TransformerConfig().dropout_rate == 0.0  # direct construction is not gin-affected


def test_bfloat16_compute_close_to_float32():
    tokens = _tokens()
    model32, variables = _init(TransformerConfig(**SMALL), tokens)
    logits32 = model32.apply(variables, tokens)
    logits16 = Transformer(TransformerConfig(**SMALL, dtype="bfloat16")).apply(variables, tokens)
    np.testing.assert_allclose(np.asarray(logits16), np.asarray(logits32), atol=0.05)


def test_embedding_gradient_sums_repeated_tokens_in_float32():
    """The lookup's gradient in a bfloat16 model is the float64 scatter-add of its cotangents to
    float32 rounding, on ids where the commonest repeats about 1,500 times (Zipf, 16 x 1024);
    gathering bfloat16 rows, as before, summed them in bfloat16 (about 2% off)."""
    vocab, width = 32000, 64
    tokens = jnp.asarray(random_batch(vocab, 16, 1024, "zipf")["inputs"])
    table = 0.02 * jax.random.normal(jax.random.key(0), (vocab, width), jnp.float32)
    cotangent = jax.random.normal(jax.random.key(1), (*tokens.shape, width), jnp.bfloat16)
    rows, pullback = jax.vjp(lambda t: embed_tokens(t, tokens, jnp.bfloat16), table)
    assert rows.dtype == jnp.bfloat16
    assert (rows == table.astype(jnp.bfloat16)[tokens]).all()  # the values of casting first
    (grad,) = pullback(cotangent)
    expected = np.zeros((vocab, width))
    updates = np.asarray(cotangent, np.float64).reshape(-1, width)
    np.add.at(expected, np.asarray(tokens).ravel(), updates)
    error = np.linalg.norm(np.asarray(grad, np.float64) - expected) / np.linalg.norm(expected)
    assert grad.dtype == jnp.float32 and error < 1e-6, error


def test_dropout_only_when_not_deterministic():
    config = TransformerConfig(**SMALL, dropout_rate=0.5)
    tokens = _tokens()
    model, variables = _init(config, tokens)
    np.testing.assert_array_equal(model.apply(variables, tokens), model.apply(variables, tokens))
    a = model.apply(variables, tokens, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b = model.apply(variables, tokens, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(np.asarray(a), np.asarray(b))


def test_rotary_scores_depend_on_offset_only():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    length = 10
    rq = rotary_embedding(jnp.tile(q, (1, length, 1, 1)), 10000.0)[0, :, 0]
    rk = rotary_embedding(jnp.tile(k, (1, length, 1, 1)), 10000.0)[0, :, 0]
    scores = rq @ rk.T
    np.testing.assert_allclose(scores[5, 2], scores[7, 4], rtol=1e-5)
    np.testing.assert_allclose(scores[3, 3], jnp.vdot(q, k), rtol=1e-5)


def test_tiny_model_learns_a_batch():
    config = TransformerConfig(**SMALL)
    tokens = _tokens(batch=4, length=16)
    model, variables = _init(config, tokens)
    tx = optax.adam(3e-3)

    def loss_fn(params):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    params = nn.meta.unbox(variables["params"])
    opt_state = tx.init(params)
    first = None
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state)
        first = loss if first is None else first
    assert float(loss) < 0.5 * float(first)


@pytest.mark.parametrize(
    "bad",
    [
        dict(mlp_activation="relu"),
        dict(positions="alibi"),
        dict(dtype="float16"),
        dict(num_heads=0),
        dict(head_dim=7),
        dict(dropout_rate=1.0),
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        TransformerConfig(**{**SMALL, **bad})


def test_sequence_longer_than_max_len_fails():
    config = TransformerConfig(**SMALL, positions="learned")
    with pytest.raises(ValueError, match="max_len 16"):
        jax.eval_shape(Transformer(config).init, jax.random.key(0), _tokens(length=17))


@pytest.mark.parametrize("activation, kernels", [("gelu", 2), ("swiglu", 3)])
def test_flops_per_token_counts_the_matmuls_and_attention(activation, kernels):
    cfg = TransformerConfig(
        vocab_size=100, d_model=16, num_layers=3, num_heads=2, head_dim=8, mlp_dim=64,
        mlp_activation=activation,
    )  # fmt: skip
    weights = 3 * (4 * 16 * 2 * 8 + kernels * 16 * 64) + 16 * 100
    assert flops_per_token(cfg, seq_len=32) == 6 * weights + 12 * 3 * 2 * 8 * 32
