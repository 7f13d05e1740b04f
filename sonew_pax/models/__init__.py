"""Flax decoder-only transformer with logical axis names on every parameter and activation, and
its key/value cache for decoding."""

from sonew_pax.models import llama
from sonew_pax.models.transformer import (
    CausalSelfAttention,
    DecoderBlock,
    Mlp,
    RMSNorm,
    Transformer,
    TransformerConfig,
    count_params,
    flops_per_token,
    init_cache,
    rotary_embedding,
    unstack_layers,
)

__all__ = [
    "CausalSelfAttention",
    "DecoderBlock",
    "Mlp",
    "RMSNorm",
    "Transformer",
    "TransformerConfig",
    "count_params",
    "flops_per_token",
    "init_cache",
    "llama",
    "rotary_embedding",
    "unstack_layers",
]
