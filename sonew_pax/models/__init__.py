"""Flax decoder-only transformer with logical axis names on every parameter and activation."""

from sonew_pax.models.transformer import (
    CausalSelfAttention,
    DecoderBlock,
    Mlp,
    RMSNorm,
    Transformer,
    TransformerConfig,
    count_params,
    flops_per_token,
    rotary_embedding,
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
    "rotary_embedding",
]
