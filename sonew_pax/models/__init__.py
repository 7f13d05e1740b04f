"""Flax decoder-only transformer with logical axis names on every parameter and activation, and
its key/value cache for decoding."""

from sonew_pax.models import attention, llama, losses
from sonew_pax.models.transformer import (
    REMAT_POLICIES,
    CausalSelfAttention,
    DecoderBlock,
    Mlp,
    RMSNorm,
    Transformer,
    TransformerConfig,
    attention_choice,
    count_params,
    flops_per_token,
    init_cache,
    rotary_embedding,
    unstack_layers,
)

__all__ = [
    "REMAT_POLICIES",
    "CausalSelfAttention",
    "DecoderBlock",
    "Mlp",
    "RMSNorm",
    "Transformer",
    "TransformerConfig",
    "attention",
    "attention_choice",
    "count_params",
    "flops_per_token",
    "init_cache",
    "llama",
    "losses",
    "rotary_embedding",
    "unstack_layers",
]
