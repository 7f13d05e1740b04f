"""Cross-entropy of a language model's output projection without float32 logits in memory.

The plain loss computes logits ``[batch, length, vocab]`` in float32, keeps them for the backward
pass, and multiplies their float32 gradient back through the projection (two float32 matrix
products). `fused_cross_entropy` instead takes the final features and the projection, and in its
forward pass, a chunk of positions at a time, computes the chunk's logits, their log-sum-exp and
the gradient of the loss with respect to them, ``softmax(logits) - onehot(target)``, stored in the
compute dtype. The backward pass scales that gradient by each token's weight and cotangent and
runs the two matrix products in the compute dtype with float32 accumulation, as every other layer
of the model does. Memory: one chunk of float32 logits at a time and one compute-dtype gradient
of the logits, instead of float32 logits, their softmax and their gradient. Passes over a chunk's
float32 logits: written by the matrix product, read by a one-pass log-sum-exp
(`logsumexp_one_pass`), read by the gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Positions per chunk of the forward pass (batch times chunk length): bounds the float32 logits
# alive at once to CHUNK_TOKENS * vocab * 4 bytes.
CHUNK_TOKENS = 8192


def _chunk_length(batch: int, length: int, chunk_tokens: int) -> int:
    """The largest divisor of ``length`` whose chunk of ``batch`` rows holds at most
    ``chunk_tokens`` positions (at least 1)."""
    fitting = [c for c in range(1, length + 1) if length % c == 0 and batch * c <= chunk_tokens]
    return max(fitting, default=1)


def _to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``[batch, length, ...]`` -> ``[length / chunk, batch, chunk, ...]``."""
    batch, length = x.shape[:2]
    x = x.reshape(batch, length // chunk, chunk, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1)


def _from_chunks(x: jax.Array) -> jax.Array:
    """Inverse of `_to_chunks`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _combine_exp_sums(a, b):
    """Merges two partial sums ``(max m, sum of exp(x - m))`` of exponentials into one."""
    (m_a, s_a), (m_b, s_b) = a, b
    m = jnp.maximum(m_a, m_b)
    shift = jnp.where(jnp.isneginf(m), 0.0, m)  # both empty: exp(-inf - 0) = 0, not nan
    return m, s_a * jnp.exp(m_a - shift) + s_b * jnp.exp(m_b - shift)


def logsumexp_one_pass(x: jax.Array) -> jax.Array:
    """``log(sum(exp(x)))`` over the last axis of a float32 ``x``, in one read of ``x``.

    ``jax.nn.logsumexp`` reduces twice (the max, then the sum of shifted exponentials), and on the
    float32 logits of a large vocabulary each reduction is a pass over memory. One variadic
    reduction carries both: each partial result is ``(m, sum of exp(x - m))`` and merging two
    rescales the smaller one's sum (the online softmax). Each element costs two exponentials
    instead of one, which a memory-bound pass hides; under a sharded last axis the partial pairs
    (one per row and shard) are gathered, not the rows.
    """
    m, s = jax.lax.reduce(
        (x, jnp.ones_like(x)),
        (jnp.array(-jnp.inf, x.dtype), jnp.array(0, x.dtype)),
        _combine_exp_sums,
        (x.ndim - 1,),
    )
    return m + jnp.log(s)


def _chunk_forward(kernel: jax.Array, chunk: tuple[jax.Array, jax.Array]):
    """One chunk's per-token losses ``logsumexp - logit[target]`` (float32) and the gradient of
    each token's loss with respect to its logits, ``softmax - onehot`` (in the features' dtype)."""
    features, targets = chunk
    logits = jnp.einsum("bcd,dv->bcv", features, kernel, preferred_element_type=jnp.float32)
    lse = logsumexp_one_pass(logits)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
    return lse - target_logits, (probs - onehot).astype(features.dtype)


def _losses_and_logit_grads(features, kernel, targets, chunk_tokens):
    """Per-token losses ``[batch, length]`` and the logits' gradient, chunked as `_to_chunks`."""
    chunk = _chunk_length(*targets.shape, chunk_tokens)
    losses, logit_grads = jax.lax.map(
        functools.partial(_chunk_forward, kernel),
        (_to_chunks(features, chunk), _to_chunks(targets, chunk)),
    )
    return _from_chunks(losses), logit_grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _weighted_loss_sum(features, kernel, targets, weights, chunk_tokens):
    losses, _ = _losses_and_logit_grads(features, kernel, targets, chunk_tokens)
    return jnp.sum(losses * weights)


def _weighted_loss_sum_fwd(features, kernel, targets, weights, chunk_tokens):
    losses, logit_grads = _losses_and_logit_grads(features, kernel, targets, chunk_tokens)
    return jnp.sum(losses * weights), (features, kernel, weights, logit_grads)


def _weighted_loss_sum_bwd(chunk_tokens, residuals, cotangent):
    """d/d features = (c G) Wᵀ and d/d kernel = featuresᵀ (c G), with ``G`` the stored logits'
    gradient and ``c`` each token's weight times the cotangent, applied to the smaller operand."""
    del chunk_tokens
    features, kernel, weights, logit_grads = residuals
    chunk = logit_grads.shape[2]
    scale = _to_chunks(cotangent * weights, chunk)[..., None]
    # Contracting dimensions spelled out in the stored order: from einsum's "nbcd,nbcv->dv" the
    # GPU compiler received them as (c, n, b) and transposed the whole logits' gradient to match.
    d_features = jax.lax.dot_general(
        logit_grads, kernel, (((3,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    d_features = _from_chunks(scale * d_features).astype(features.dtype)
    scaled = (scale * _to_chunks(features, chunk)).astype(features.dtype)
    d_kernel = jax.lax.dot_general(
        scaled, logit_grads, (((0, 1, 2), (0, 1, 2)), ((), ())), preferred_element_type=jnp.float32
    )
    return d_features, d_kernel.astype(kernel.dtype), None, None


_weighted_loss_sum.defvjp(_weighted_loss_sum_fwd, _weighted_loss_sum_bwd)


def fused_cross_entropy(
    features: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[jax.Array, jax.Array]:
    """Sum over tokens of ``weights * -log softmax(features @ kernel)[target]``, and of weights.

    The same function as the softmax cross-entropy of float32 logits ``features @ kernel``
    (the model's ``fused_head`` outputs), computed ``chunk_tokens`` positions at a time; its
    gradient is the exact one up to rounding the logits' gradient to the features' dtype.

    Args:
      features: final features ``[batch, length, embed]`` in the compute dtype.
      kernel: the output projection ``[embed, vocab]``, same dtype.
      targets: token ids ``[batch, length]``.
      weights: ``[batch, length]``; 0 for padding (no gradient flows to it).
      chunk_tokens: positions whose float32 logits are alive at once.

    Returns:
      ``(loss sum, weight sum)``, float32 scalars.
    """
    weights = weights.astype(jnp.float32)
    loss_sum = _weighted_loss_sum(features, kernel, targets, weights, chunk_tokens)
    return loss_sum, jnp.sum(weights)
