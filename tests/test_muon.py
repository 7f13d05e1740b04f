"""The Muon baseline (`optimizers.muon`): which parameters it takes, as which matrices, and that
the trainer trains with it."""

import dataclasses

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sonew_pax import optimizers, partitioning
from sonew_pax.errors import ConfigError
from sonew_pax.models import Transformer, TransformerConfig
from sonew_pax.trainer import Trainer

CONFIG = TransformerConfig(
    vocab_size=64, d_model=16, num_layers=2, num_heads=2, head_dim=8, mlp_dim=32, max_len=16,
    mlp_activation="swiglu", tie_embeddings=False,
)  # fmt: skip


def _params(config):
    tokens = jnp.zeros((1, 8), jnp.int32)
    return nn.unbox(Transformer(config).init(jax.random.key(0), tokens)["params"])


@pytest.mark.parametrize("scan_layers", [False, True])
def test_hidden_kernels_are_muon_matrices_from_their_inputs(scan_layers):
    config = dataclasses.replace(CONFIG, scan_layers=scan_layers)
    params = _params(config)
    stacked = partitioning.LAYERS if scan_layers else None
    numbers = optimizers.muon_dimension_numbers(
        (lambda p: {k: int(k == stacked) for k in p}) if scan_layers else None
    )(params)
    layer = numbers[partitioning.LAYERS if scan_layers else "layer_0"]
    k = int(scan_layers)
    mdn = optax.contrib.MuonDimensionNumbers
    assert layer["attn"]["query"] == mdn((k,), (k + 1, k + 2))
    assert layer["attn"]["out"] == mdn((k, k + 1), (k + 2,))
    assert layer["mlp"]["wo"] == mdn((k,), (k + 1,))
    assert layer["attn_norm"]["scale"] is None
    assert numbers["embedding"] is None and numbers["output"] is None
    assert numbers["final_norm"]["scale"] is None


def test_a_head_shaped_kernel_steps_as_its_matrix():
    """Muon on a (embed, heads, kv) kernel is Muon on the (embed, heads * kv) matrix."""
    grads = jax.random.normal(jax.random.key(1), (3, 16, 2, 8))
    tx = optimizers.muon(1e-2)
    matrix_tx = optax.contrib.muon(1e-2, consistent_rms=0.2, weight_decay=0.1, adam_b2=0.95)

    def run(tx, params, grads):
        state = tx.init(params)
        for g in grads:
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
        return params

    kernel = {"layer_0": {"attn": {"query": jnp.ones((16, 2, 8))}}}
    got = run(tx, kernel, [{"layer_0": {"attn": {"query": g}}} for g in grads])
    want = run(matrix_tx, jnp.ones((16, 16)), [g.reshape(16, 16) for g in grads])
    np.testing.assert_allclose(
        got["layer_0"]["attn"]["query"].reshape(16, 16), want, rtol=1e-5, atol=1e-6
    )


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_bfloat16_newton_schulz_iterates_in_bfloat16_on_muons_matrices_alone():
    """``ns_dtype=bfloat16``: every product of the iteration takes bfloat16 operands, the momentum
    of Muon's matrices is kept in bfloat16, the AdamW branch's updates stay float32, and the step
    differs from the float32 iteration's by bfloat16's rounding through five iterations (a few
    percent: the iteration's own output is orthogonal only to within a factor 0.5-1.5)."""
    params = {
        "layer_0": {"mlp": {"wi": jnp.ones((16, 32))}, "attn_norm": {"scale": jnp.ones(16)}},
        "embedding": jnp.ones((64, 16)),
    }
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)

    def step(ns_dtype):
        tx = optimizers.muon(1e-2, ns_dtype=ns_dtype)
        state = tx.init(params)
        jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(grads, state)
        return tx.update(grads, state, params), jaxpr.jaxpr

    def operand_dtypes(jaxpr):  # of the iteration's products (its loop body's three)
        products = [e for e in _equations(jaxpr) if e.primitive.name == "dot_general"]
        assert len(products) >= 3
        return {v.aval.dtype for e in products for v in e.invars}

    (want, _), jaxpr = step(None)
    assert operand_dtypes(jaxpr) == {jnp.dtype(jnp.float32)}
    (got, state), jaxpr = step(jnp.bfloat16)
    assert operand_dtypes(jaxpr) == {jnp.dtype(jnp.bfloat16)}
    moments = {str(leaf.dtype) for leaf in jax.tree.leaves(state) if leaf.ndim == 2}
    assert "bfloat16" in moments  # Muon's matrix momentum
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(got))
    a, b = want["layer_0"]["mlp"]["wi"], got["layer_0"]["mlp"]["wi"]
    assert 0 < float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 0.1
    np.testing.assert_allclose(got["embedding"], want["embedding"], rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("ns_dtype", ["bf16", "int8", 3])
def test_an_ns_dtype_that_is_no_float_dtype_is_named(ns_dtype):
    with pytest.raises(ConfigError, match=f"muon.ns_dtype = {ns_dtype!r}: expected a float dtype"):
        optimizers.muon(1e-2, ns_dtype=ns_dtype)


def test_the_trainer_trains_with_muon_gin():
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(["configs/optimizers/muon.gin"], [])
        factory = gin.get_configurable(optimizers.make_optimizer)
        mesh = partitioning.make_mesh(data=1, model=1, devices=jax.devices()[:1])
        trainer = Trainer(
            Transformer(CONFIG),
            factory,
            optax.constant_schedule(3e-3),
            mesh,
            partitioning.logical_axis_rules(),
            (4, 16),
            seed=0,
        )
    finally:
        gin.clear_config()
    rng = np.random.default_rng(0)
    tokens = np.cumsum(rng.integers(1, 3, (4, 17)), axis=1) % CONFIG.vocab_size
    batch = {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "weights": np.ones((4, 16), np.float32),
    }
    state = trainer.init_state(0)
    losses = []
    for _ in range(30):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0]
