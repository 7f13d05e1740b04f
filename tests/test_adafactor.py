"""The SONew paper's Adafactor baseline (`optimizers.adafactor_unfactored`) against a float64
NumPy loop written from its definition, and Adam's decay (`optimizers.adam_decay_rate`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sonew_pax import optimizers

SHAPES = {"kernel": (6, 5), "scale": (5,)}  # a matrix (decayed) and a vector (not)
HP = {"b1": 0.9, "b2": 0.95, "eps": 1e-12, "clipping_threshold": 1.0, "weight_decay": 0.1}


def schedule(count):
    """A learning rate that changes every step, so its step index is checked too."""
    return 1e-2 * (count + 1.0) / 4.0


def reference(params, grads, b1, b2, eps, clipping_threshold, weight_decay):
    """The parameters after one update per gradient in ``grads``, in float64: Adam's
    bias-corrected second moment of ``g^2 + eps``, the update ``g / sqrt(v)`` clipped to a root
    mean square of ``clipping_threshold``, its momentum without bias correction, plus weight
    decay on matrices, times the learning rate."""
    params = {k: np.asarray(p, np.float64) for k, p in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    m = {k: np.zeros_like(p) for k, p in params.items()}
    for t, grad in enumerate(grads):
        for k, p in params.items():
            g = np.asarray(grad[k], np.float64)
            v[k] = b2 * v[k] + (1 - b2) * (g * g + eps)
            u = g / np.sqrt(v[k] / (1 - b2 ** (t + 1)))
            u = u / max(1.0, np.sqrt(np.mean(u * u)) / clipping_threshold)
            m[k] = b1 * m[k] + (1 - b1) * u
            decay = weight_decay * p if p.ndim >= 2 else 0.0
            params[k] = p - schedule(t) * (m[k] + decay)
    return params


def test_adafactor_unfactored_matches_a_float64_loop():
    keys = iter(jax.random.split(jax.random.key(0), 16))
    params = {k: jax.random.normal(next(keys), s) for k, s in SHAPES.items()}
    # Gradients that grow and shrink: some updates are clipped, some are not.
    grads = [
        {k: scale * jax.random.normal(next(keys), s) for k, s in SHAPES.items()}
        for scale in (1.0, 3.0, 0.2, 2.0, 0.5)
    ]
    tx = optimizers.adafactor_unfactored(schedule, **HP)
    state, got = tx.init(params), params
    for grad in grads:
        updates, state = jax.jit(tx.update)(grad, state, got)
        got = optax.apply_updates(got, updates)
    want = reference(params, grads, **HP)
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=2e-5, atol=1e-6)


def test_adafactor_unfactored_keeps_a_full_second_moment():
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    (rms_state, *_) = optimizers.adafactor_unfactored(schedule).init(params)
    assert {k: v.shape for k, v in rms_state.v.items()} == SHAPES


def test_adam_decay_rate_is_bias_corrected_ema():
    b2, v, g2 = 0.9, 0.0, [1.0, 4.0, 9.0]
    for step, x in enumerate(g2):
        decay = float(optimizers.adam_decay_rate(step, b2))
        v = decay * v + (1 - decay) * x
    ema = sum((1 - b2) * b2 ** (len(g2) - 1 - i) * x for i, x in enumerate(g2))
    assert v == pytest.approx(ema / (1 - b2 ** len(g2)), rel=1e-6)
