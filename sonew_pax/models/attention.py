"""Causal dot-product attention through one function, on the platform's fastest kernel.

`causal_attention` computes ``softmax(q kᵀ / sqrt(head_dim) + causal mask) v`` for queries
``[batch, length, heads, head_dim]`` and keys and values ``[batch, length, kv_heads, head_dim]``
(grouped-query attention: each group of ``heads / kv_heads`` query heads reads one key/value head)
with one of these implementations:

    "xla"    the reference form: scores ``[batch, heads, length, length]`` in float32 as einsums,
             mask, softmax, weighted sum. Any platform, dtype, head size and dropout.
    "cudnn"  cuDNN's fused flash attention (`jax.nn.dot_product_attention`): never writes the
             score matrix to memory. NVIDIA GPUs; bfloat16 or float16 inputs; head_dim a multiple
             of 8 up to 128; no attention dropout.
    "splash" the Pallas Mosaic splash-attention kernel that JAX ships (the kernel MaxText uses on
             TPUs), under `jax.shard_map` over the mesh's batch and head shardings so each device
             runs it on its own block; causal blocks above the diagonal are skipped. TPUs (other
             platforms run it in Pallas' interpreter: slow, for tests); length a multiple of 128;
             no attention dropout.
    "auto"   the fast kernel of the backend (`jax.default_backend()`) when the configuration
             allows it, else "xla"; `resolve` says which and why.

The choice is made once per configuration by `resolve`, a pure function of the configuration and
the platform: the model calls it when traced, and the trainer logs its reason once at start, so a
run never falls back silently.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

Implementation = Literal["auto", "xla", "cudnn", "splash"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "xla", "cudnn", "splash")
# The fast kernel of each backend, as `jax.default_backend()` names it.
FAST_KERNELS = {"gpu": "cudnn", "cuda": "cudnn", "tpu": "splash"}
# cuDNN's fused attention: half-precision inputs, head sizes in multiples of 8 up to 128.
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = 128
# Splash attention tiles the sequence in blocks of this many positions (its default block sizes).
SPLASH_BLOCK = 128


class Choice(NamedTuple):
    """The implementation a configuration runs, why (empty when it is the one asked for), and
    whether it falls back to the reference form from a fast kernel that cannot run it."""

    implementation: str
    reason: str
    fallback: bool = False


def _unsupported(
    implementation: str, dtype: str, head_dim: int, length: int | None, dropout_rate: float
) -> str | None:
    """Why ``implementation`` cannot run this configuration, or None if it can."""
    if implementation == "xla":
        return None
    if dropout_rate > 0:
        return f"attention dropout ({dropout_rate}) is not supported by {implementation}"
    if implementation == "cudnn":
        if dtype not in _CUDNN_DTYPES:
            return f"cudnn needs a bfloat16 or float16 compute dtype, not {dtype}"
        if head_dim % 8 or head_dim > _CUDNN_MAX_HEAD_DIM:
            return f"cudnn needs head_dim a multiple of 8 up to 128, not {head_dim}"
    if implementation == "splash" and length is not None and length % SPLASH_BLOCK:
        return f"splash needs a sequence length that is a multiple of {SPLASH_BLOCK}, not {length}"
    return None


def resolve(
    implementation: str,
    *,
    dtype: str,
    head_dim: int,
    dropout_rate: float,
    length: int | None = None,
    backend: str | None = None,
) -> Choice:
    """The implementation that runs ``implementation`` for this configuration on ``backend``.

    "auto" picks the backend's fast kernel ("cudnn" on GPUs, "splash" on TPUs) when the
    configuration allows it and "xla" otherwise; a named fast kernel that the configuration
    cannot use (dropout, dtype, head size, length) becomes "xla". Either way the reason is in
    the result, for the trainer to log.

    Args:
      implementation: one of `IMPLEMENTATIONS`.
      dtype: the compute dtype's name.
      head_dim: width of each head.
      dropout_rate: dropout on the attention probabilities.
      length: the sequence length, when known (splash tiles it in blocks of `SPLASH_BLOCK`).
      backend: the platform, as `jax.default_backend()` names it (default: this process's).

    Returns:
      The `Choice`.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    backend = backend or jax.default_backend()
    wanted = FAST_KERNELS.get(backend, "xla") if implementation == "auto" else implementation
    why_not = _unsupported(wanted, dtype, head_dim, length, dropout_rate)
    if why_not:
        return Choice("xla", f"{why_not}; using the reference form (xla)", fallback=True)
    if implementation == "auto":
        return Choice(wanted, f"auto picked {wanted} on {backend}")
    return Choice(wanted, "")


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    query_offset: jax.Array | int = 0,
    dropout=None,
) -> jax.Array:
    """``softmax(q kᵀ / sqrt(head_dim), causal) v`` as einsums over float32 scores.

    Query ``i`` sits at position ``query_offset + i`` and attends to keys ``0 ..`` its position
    (decoding from a cache passes the cache's offset). Grouped heads are contracted in place
    (queries viewed as ``[batch, length, kv_heads, group, head_dim]``), so keys and values are
    never repeated.

    Args:
      q: queries ``[batch, length, heads, head_dim]``.
      k: keys ``[batch, key length, kv_heads, head_dim]``.
      v: values, like ``k``.
      query_offset: position of the first query.
      dropout: None, or a function applied to the probabilities (attention dropout).

    Returns:
      ``[batch, length, heads, head_dim]`` in ``q``'s dtype.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bqhgk,bthk->bhgqt", q, k, preferred_element_type=jnp.float32)
    query_positions = query_offset + jnp.arange(length)
    causal = jnp.arange(k.shape[1])[None, :] <= query_positions[:, None]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    if dropout is not None:
        probs = dropout(probs)
    out = jnp.einsum("bhgqt,bthk->bqhgk", probs, v)
    return out.reshape(batch, length, heads, head_dim)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention through cuDNN's fused flash-attention kernel (GPUs)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _splash_kernel(heads: int, length: int, interpret: bool):
    """Splash attention's causal multi-head kernel for one example ``[heads, length, head_dim]``.

    Built anew for each trace: a kernel object holds its mask's block tables, which a trace
    turns into constants of that trace alone (reused in another, `jax.export` fails).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * heads)
    return splash.make_splash_mha(
        mask,
        head_shards=1,
        q_seq_shards=1,
        block_sizes=splash.BlockSizes.get_default(),
        interpret=interpret,
    )


def _splash_block(q: jax.Array, k: jax.Array, v: jax.Array, interpret: bool) -> jax.Array:
    """Splash attention on one device's block ``[batch, length, heads, head_dim]``."""
    _, length, heads, head_dim = q.shape
    kernel = _splash_kernel(heads, length, interpret)
    q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    out = jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v))
    return heads_first(out).astype(q.dtype)


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`_splash_block` compiled as a Mosaic kernel for TPUs and run in Pallas' interpreter on any
    other platform; the branch is chosen where the program is lowered, so a CPU host exporting
    for TPU gets the kernel."""
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        tpu=functools.partial(_splash_block, interpret=False),
        default=functools.partial(_splash_block, interpret=True),
    )


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    spec: jax.sharding.PartitionSpec | None = None,
) -> jax.Array:
    """Causal attention through Pallas' splash-attention kernel (TPUs; elsewhere interpreted,
    slowly, for tests).

    A Mosaic kernel cannot be partitioned by the compiler, so under a mesh of several devices
    (`jax.set_mesh`) it runs in `jax.shard_map` with ``spec``, the activations'
    ``[batch, length, heads, head_dim]`` sharding: each device attends over its own examples and
    heads.

    Args:
      q: queries ``[batch, length, heads, head_dim]``.
      k: keys ``[batch, length, kv_heads, head_dim]``.
      v: values, like ``k``.
      spec: the sharding of ``q``, ``k`` and ``v`` over the current mesh (length unsharded);
        None: replicated.

    Returns:
      ``[batch, length, heads, head_dim]`` in ``q``'s dtype.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _splash_local(q, k, v)
    spec = spec if spec is not None else jax.sharding.PartitionSpec()
    if len(spec) > 1 and spec[1] is not None:
        raise ValueError(f"splash attention needs the length axis unsharded, got spec {spec}")
    # Pallas kernels do not declare how their outputs vary over the mesh: unchecked.
    specs = (spec, spec, spec)
    return jax.shard_map(_splash_local, in_specs=specs, out_specs=spec, check_vma=False)(q, k, v)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    implementation: str,
    *,
    spec: jax.sharding.PartitionSpec | None = None,
    dropout=None,
) -> jax.Array:
    """Causal self-attention of a whole sequence by a resolved ``implementation`` (`resolve`).

    Args:
      q: queries ``[batch, length, heads, head_dim]``.
      k: keys ``[batch, length, kv_heads, head_dim]``; ``heads`` a multiple of ``kv_heads``.
      v: values, like ``k``.
      implementation: "xla", "cudnn" or "splash".
      spec: the activations' sharding over the current mesh (used by "splash").
      dropout: None, or a function applied to the probabilities ("xla" only).

    Returns:
      ``[batch, length, heads, head_dim]`` in ``q``'s dtype.
    """
    if implementation == "cudnn":
        return cudnn_attention(q, k, v)
    if implementation == "splash":
        return splash_attention(q, k, v, spec=spec)
    if implementation != "xla":
        raise ValueError(f"not a resolved implementation: {implementation!r}")
    return reference_attention(q, k, v, dropout=dropout)
