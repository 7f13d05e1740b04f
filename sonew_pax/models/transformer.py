"""Decoder-only transformer in flax.linen whose parameters and activations carry logical axis names.

Every parameter is created through `nn.with_logical_partitioning`, so `model.init` returns
`nn.LogicallyPartitioned` boxes naming each dimension with one of the logical axes

    "vocab"   vocabulary              "embed"   model width (d_model)
    "mlp"     MLP hidden width        "heads"   attention heads
    "kv"      per-head width          "length"  sequence position (learned positions only)

and `sonew_pax.partitioning` maps those names onto the device mesh. Activations are constrained
with `nn.with_logical_constraint` using "batch", "length", "embed", "heads", "kv", "mlp" and
"vocab"; the constraints are no-ops unless a mesh and logical axis rules are active.

By default the layers are a plain Python loop, so each layer's parameters are separate tensors
(`layer_<i>/...`). With `scan_layers` they are one `nn.scan` over the layers (as MaxText's and
T5X's `scan_layers`): each parameter of a block is stacked over the layers on a leading "layers"
axis (`layers/...`, `partitioning.LAYERS`), and the forward pass, its gradient and the optimizer's
update are traced and compiled once for all layers instead of once per layer. The trainer gives
SONew the stacked axes (`stacked_axes`, from `partitioning.stacked_axes`), so each layer keeps its
own chain; `unstack_layers` turns scanned parameters into the per-layer layout.
Architecture: token embedding (+ learned positions, or rotary positions inside attention), pre-norm
residual blocks of RMSNorm → causal self-attention and RMSNorm → MLP (gelu or swiglu), final
RMSNorm, then logits in float32 from the tied embedding or a separate output kernel.

Decoding: ``apply(..., decode=True, mutable=["cache"])`` reads and extends a key/value cache in
the flax "cache" collection (`init_cache` makes an empty one), so that a prompt is run once and
each new token costs one position's work. Both modes attend with the same causal mask over the
same positions; the training path is unchanged by it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from sonew_pax import partitioning
from sonew_pax.models import attention

_ACTIVATIONS = ("gelu", "swiglu")
_POSITIONS = ("rotary", "learned")
_DTYPES = ("float32", "bfloat16")
# Rematerialisation of each decoder block's activations in the backward pass (`REMAT_POLICIES`).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the decoder-only `Transformer`.

    Registered with gin as `TransformerConfig` (module `sonew_pax.models`); the shipped model
    configs in `configs/models/` bind its fields and define `MODEL_CONFIG = @TransformerConfig()`.

    Attributes:
      vocab_size: number of token ids (256 for bytes, 32000 for the default sentencepiece model).
      d_model: residual stream width ("embed" axis).
      num_layers: number of decoder blocks.
      num_heads: attention heads ("heads" axis).
      num_kv_heads: key/value heads (grouped-query attention; each serves
        ``num_heads / num_kv_heads`` query heads); None: ``num_heads`` (multi-head attention).
      head_dim: width of each head ("kv" axis); even when `positions == "rotary"`.
      mlp_dim: MLP hidden width ("mlp" axis).
      max_len: longest sequence the model accepts (size of the learned position table).
      mlp_activation: "gelu" (one input kernel) or "swiglu" (gate and up kernels).
      positions: "rotary" (RoPE on queries and keys) or "learned" (added position embedding).
      tie_embeddings: compute logits with the transposed token embedding instead of a separate
        (embed, vocab) output kernel.
      dtype: compute dtype, "float32" or "bfloat16"; norms, softmax and logits stay float32.
      param_dtype: storage dtype of the parameters.
      dropout_rate: dropout on attention probabilities and on each residual branch.
      init_std: standard deviation of the normal initialisers; the two projections that write
        into the residual stream (attention out, MLP out) use init_std / sqrt(2 * num_layers),
        as in GPT-2.
      rope_base: wavelength base of the rotary frequencies.
      norm_eps: epsilon of RMSNorm.
      scan_layers: run the decoder blocks as one `nn.scan`, their parameters stacked on a
        leading "layers" axis (faster to compile; the same function of the same numbers).
      attention: how attention is computed (`attention.IMPLEMENTATIONS`): "auto" (the
        platform's fused kernel, cuDNN flash attention on GPUs and splash attention on TPUs,
        where the configuration allows; else the reference form), "xla" (the reference einsums,
        any platform), "cudnn" or "splash". `attention_choice` says what runs and why.
      remat: what each decoder block keeps for the backward pass (`REMAT_POLICIES`): "none"
        (every activation), "dots" (the weight matmuls' outputs; the rest is recomputed) or
        "full" (only the block's input; the whole block is recomputed). Less memory for more
        compute, for models or batches that do not fit otherwise.
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int = 32
    mlp_dim: int = 512
    max_len: int = 128
    mlp_activation: str = "gelu"
    positions: str = "rotary"
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    dropout_rate: float = 0.0
    init_std: float = 0.02
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    scan_layers: bool = False
    attention: str = "auto"
    remat: str = "none"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "head_dim",
            "mlp_dim",
            "max_len",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"TransformerConfig.{name} must be >= 1, got {value}")
        _check_choice("mlp_activation", self.mlp_activation, _ACTIVATIONS)
        _check_choice("positions", self.positions, _POSITIONS)
        _check_choice("dtype", self.dtype, _DTYPES)
        _check_choice("param_dtype", self.param_dtype, _DTYPES)
        _check_choice("attention", self.attention, attention.IMPLEMENTATIONS)
        _check_choice("remat", self.remat, tuple(REMAT_POLICIES))
        if self.num_kv_heads is not None and (
            self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads
        ):
            raise ValueError(
                f"TransformerConfig.num_kv_heads must divide num_heads ({self.num_heads}), "
                f"got {self.num_kv_heads}"
            )
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `num_kv_heads`, or `num_heads` when that is None."""
        return self.num_kv_heads or self.num_heads


def attention_choice(
    config: TransformerConfig, length: int | None = None, backend: str | None = None
) -> attention.Choice:
    """The attention implementation `config` runs on ``backend`` (default: this process's) for
    sequences of ``length``, and why (`attention.resolve`)."""
    return attention.resolve(
        config.attention,
        dtype=config.dtype,
        head_dim=config.head_dim,
        dropout_rate=config.dropout_rate,
        length=length,
        backend=backend,
    )


gin.external_configurable(TransformerConfig, module="sonew_pax.models")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"TransformerConfig.{name} must be one of {choices}, got {value!r}")


def count_params(params) -> int:
    """Number of scalar parameters in a pytree of arrays, ShapeDtypeStructs or logical boxes."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Training FLOPs per token as model FLOPs utilisation (MFU) counts them (PaLM, Appendix B).

    ``6 N + 12 L H Q T``: forward and backward multiply-adds with the ``N`` weights a token goes
    through, and attention's scores and weighted sums over the ``T = seq_len`` positions (``L``
    layers, ``H`` heads of width ``Q``; causal masking is not discounted). ``N`` counts, per
    layer, the query and output projections (``2 d H Q``), the key and value projections
    (``2 d K Q`` for ``K`` key/value heads) and the MLP (``2 d F``, ``3 d F`` with
    SwiGLU), plus the logits projection (``d V``); the embedding lookup and the norms do no
    matrix multiplication.
    """
    cfg = config
    mlp_kernels = 3 if cfg.mlp_activation == "swiglu" else 2
    attention_kernels = 2 * (cfg.num_heads + cfg.kv_heads) * cfg.head_dim
    per_layer = cfg.d_model * (attention_kernels + mlp_kernels * cfg.mlp_dim)
    weights = cfg.num_layers * per_layer + cfg.d_model * cfg.vocab_size
    scores_and_sums = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return float(6 * weights + scores_and_sums)


def _normal(std: float):
    return nn.initializers.normal(stddev=std)


def _param(module: nn.Module, name: str, names: tuple[str, ...], shape, init):
    """Creates a parameter boxed with its logical axis names."""
    cfg = module.config
    return module.param(
        name, nn.with_logical_partitioning(init, names), shape, jnp.dtype(cfg.param_dtype)
    )


def embed_tokens(table: jax.Array, tokens: jax.Array, dtype: Any) -> jax.Array:
    """The rows of ``table`` [vocab, d_model] at ``tokens``, in the compute ``dtype``.

    Gathered from the table in its own dtype (float32), then cast: the same values as casting
    the table first, but the gradient, a scatter-add of every position's cotangent into its
    token's row, then sums in float32. In bfloat16 a common token's row would sum its thousands
    of repeats in a batch with 8-bit mantissas: on a batch of text-like ids (Zipf, 16 x 1024)
    that row came out 4% off and the whole gradient 2%.
    """
    return jnp.take(table, tokens, axis=0).astype(dtype)


def rotary_embedding(x: jax.Array, base: float, offset: jax.Array | int = 0) -> jax.Array:
    """Rotates the halves of the last axis of `x` [batch, length, heads, head_dim] by position.

    Position p rotates the pair (x[..., i], x[..., i + head_dim/2]) by the angle
    p * base^(-2i/head_dim) (the GPT-NeoX / LLaMA form of RoPE). Computed in float32.

    Args:
      x: queries or keys.
      base: wavelength base of the frequencies.
      offset: position of ``x[:, 0]`` (a traced scalar when decoding from a cache).

    Returns:
      The rotated ``x``, in its dtype.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    positions = offset + jnp.arange(x.shape[1], dtype=jnp.int32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned ("embed",) scale, computed in float32."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        scale = _param(self, "scale", ("embed",), (x.shape[-1],), nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + cfg.norm_eps)
        return (y * scale.astype(jnp.float32)).astype(jnp.dtype(cfg.dtype))


def _cached(module: nn.Module, name: str, new: jax.Array, offset: jax.Array) -> jax.Array:
    """Writes ``new`` [batch, length, heads, kv] into the cache variable ``name`` at position
    ``offset`` and returns the whole cache (created with ``new``'s shape by `init_cache`)."""
    cache = module.variable("cache", name, jnp.zeros, new.shape, new.dtype)
    cache.value = jax.lax.dynamic_update_slice_in_dim(cache.value, new, offset, axis=1)
    return cache.value


class CausalSelfAttention(nn.Module):
    """Causal self-attention; kernels (embed, heads, kv) and (heads, kv, embed).

    Queries have ``num_heads`` heads, keys and values ``kv_heads`` (grouped-query attention when
    fewer). A whole sequence attends through the configuration's implementation
    (`attention_choice`). With ``decode``, the keys and values of ``x`` (positions
    ``offset, offset + 1, ...``) are written into the "cache" collection's ``key`` and ``value``
    [batch, cache length, kv_heads, kv], and the queries attend to every cached position up to
    their own, in the reference form.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        deterministic: bool,
        decode: bool = False,
        offset: jax.Array | int = 0,
    ) -> jax.Array:
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        init = _normal(cfg.init_std)
        heads_axes = ("batch", "length", "heads", "kv")

        def project(name: str, heads: int) -> jax.Array:
            shape = (cfg.d_model, heads, cfg.head_dim)
            kernel = _param(self, name, ("embed", "heads", "kv"), shape, init).astype(dtype)
            return nn.with_logical_constraint(jnp.einsum("bld,dhk->blhk", x, kernel), heads_axes)

        q = project("query", cfg.num_heads)
        k, v = project("key", cfg.kv_heads), project("value", cfg.kv_heads)
        if cfg.positions == "rotary":
            q = rotary_embedding(q, cfg.rope_base, offset)
            k = rotary_embedding(k, cfg.rope_base, offset)
        dropout = None
        if cfg.dropout_rate > 0 and not deterministic:
            dropout = functools.partial(nn.Dropout(cfg.dropout_rate), deterministic=False)
        if decode:
            k, v = _cached(self, "key", k, offset), _cached(self, "value", v, offset)
            attended = attention.reference_attention(q, k, v, query_offset=offset, dropout=dropout)
        else:
            implementation = attention_choice(cfg, x.shape[1]).implementation
            spec = nn.logical_to_mesh_axes(heads_axes)
            attended = attention.causal_attention(
                q, k, v, implementation, spec=spec, dropout=dropout
            )
        attended = nn.with_logical_constraint(attended, heads_axes)
        out_init = _normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
        out_kernel = _param(
            self,
            "out",
            ("heads", "kv", "embed"),
            (cfg.num_heads, cfg.head_dim, cfg.d_model),
            out_init,
        ).astype(dtype)
        out = jnp.einsum("blhk,hkd->bld", attended, out_kernel)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class Mlp(nn.Module):
    """Position-wise MLP: gelu(x Wi) Wo, or (silu(x Wg) * x Wu) Wo for swiglu."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        init = _normal(cfg.init_std)
        hidden_axes = ("batch", "length", "mlp")

        def up(name):
            kernel = _param(self, name, ("embed", "mlp"), (cfg.d_model, cfg.mlp_dim), init)
            return nn.with_logical_constraint(x @ kernel.astype(dtype), hidden_axes)

        if cfg.mlp_activation == "swiglu":
            hidden = nn.silu(up("wi_gate")) * up("wi_up")
        else:
            hidden = nn.gelu(up("wi"))
        out_init = _normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
        wo = _param(self, "wo", ("mlp", "embed"), (cfg.mlp_dim, cfg.d_model), out_init)
        return nn.with_logical_constraint(hidden @ wo.astype(dtype), ("batch", "length", "embed"))


class DecoderBlock(nn.Module):
    """Pre-norm residual block: x + Attn(Norm(x)), then x + Mlp(Norm(x))."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        deterministic: bool,
        decode: bool = False,
        offset: jax.Array | int = 0,
    ) -> jax.Array:
        cfg = self.config
        drop = nn.Dropout(cfg.dropout_rate)
        attended = CausalSelfAttention(cfg, name="attn")(
            RMSNorm(cfg, name="attn_norm")(x), deterministic, decode, offset
        )
        x = x + drop(attended, deterministic=deterministic)
        x = x + drop(
            Mlp(cfg, name="mlp")(RMSNorm(cfg, name="mlp_norm")(x)), deterministic=deterministic
        )
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class Transformer(nn.Module):
    """Decoder-only language model: `apply({"params": p}, tokens[B, L] int32) -> logits[B, L, V]`.

    Logits are float32 whatever the compute dtype. Parameters (all `nn.LogicallyPartitioned`):
    `embedding` (vocab, embed); `pos_embedding` (length, embed) when positions are learned;
    `layer_<i>/{attn_norm,mlp_norm}/scale` (embed,); `layer_<i>/attn/{query,key,value}`
    (embed, heads, kv) and `layer_<i>/attn/out` (heads, kv, embed); `layer_<i>/mlp/wi` or
    `wi_gate` and `wi_up` (embed, mlp) and `layer_<i>/mlp/wo` (mlp, embed); `final_norm/scale`
    (embed,); `output` (embed, vocab) unless embeddings are tied. With `scan_layers` each
    `layer_<i>/X` is one `layers/X` for all layers, stacked on a leading "layers" axis. Dropout
    (when `dropout_rate > 0` and `deterministic=False`) draws from the "dropout" RNG stream.

    With ``decode=True`` (and ``mutable=["cache"]``), ``tokens`` continue the sequence held in
    the "cache" collection (`init_cache`): they take the positions from its ``index`` on, their
    keys and values are added to it, and ``index`` advances by their number. The caller keeps
    ``index`` plus the tokens' number within the cache's length.

    With ``fused_head=True`` the model stops before the logits and returns the final features
    [B, L, embed] and the output projection [embed, vocab] (the transposed embedding when tied),
    both in the compute dtype, so that a loss can fuse the projection with the softmax
    (`sonew_pax.models.losses.fused_cross_entropy`) instead of materialising float32 logits.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        deterministic: bool = True,
        decode: bool = False,
        fused_head: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        length = tokens.shape[1]
        if length > cfg.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len {cfg.max_len}")
        offset = 0
        if decode:
            index = self.variable("cache", "index", jnp.zeros, (), jnp.int32)
            offset = index.value
            index.value = offset + length
        init = _normal(cfg.init_std)
        embedding = _param(
            self, "embedding", ("vocab", "embed"), (cfg.vocab_size, cfg.d_model), init
        )
        x = embed_tokens(embedding, tokens, dtype)
        if cfg.positions == "learned":
            table = _param(
                self, "pos_embedding", ("length", "embed"), (cfg.max_len, cfg.d_model), init
            )
            positions = jax.lax.dynamic_slice_in_dim(table, offset, length)
            x = x + positions.astype(dtype)[None]
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        block_class = DecoderBlock
        if REMAT_POLICIES[cfg.remat] is not None and not decode:
            # Arguments counted from self: deterministic (2) and decode (3) are Python bools.
            block_class = nn.remat(
                DecoderBlock,
                policy=REMAT_POLICIES[cfg.remat],
                prevent_cse=not cfg.scan_layers,
                static_argnums=(2, 3),
            )
        if cfg.scan_layers:

            def body(block: nn.Module, x: jax.Array, offset: Any):
                return block(x, deterministic, decode, offset), None

            blocks = nn.scan(
                body,
                variable_axes={"params": 0, "cache": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: partitioning.LAYERS},
            )
            x, _ = blocks(block_class(cfg, name=partitioning.LAYERS), x, offset)
        else:
            for i in range(cfg.num_layers):
                x = block_class(cfg, name=f"layer_{i}")(x, deterministic, decode, offset)
        x = RMSNorm(cfg, name="final_norm")(x)
        if cfg.tie_embeddings:
            kernel = embedding.T
        else:
            kernel = _param(self, "output", ("embed", "vocab"), (cfg.d_model, cfg.vocab_size), init)
        kernel = kernel.astype(dtype)
        if fused_head:
            return x, kernel
        logits = jnp.einsum("bld,dv->blv", x, kernel, preferred_element_type=jnp.float32)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


Cache = dict[str, Any]


def unstack_layers(params: Any, config: TransformerConfig) -> Any:
    """Scanned parameters (``scan_layers``) in the per-layer layout (``layer_<i>/...``), as the
    unscanned model names them; other parameters are returned unchanged."""
    if partitioning.LAYERS not in params:
        return params
    rest = {k: v for k, v in params.items() if k != partitioning.LAYERS}
    for i in range(config.num_layers):
        rest[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], params[partitioning.LAYERS])
    return rest


def init_cache(config: TransformerConfig, batch_size: int, length: int) -> Cache:
    """An empty decoding cache (the "cache" collection) for `Transformer` with ``decode=True``.

    Args:
      config: the model's configuration.
      batch_size: sequences decoded together.
      length: positions the cache holds (prompt and generated tokens); at most ``max_len``.

    Returns:
      ``index`` (0) and each layer's zeroed ``attn/key`` and ``attn/value``
      [batch_size, length, heads, kv] in the compute dtype.
    """
    tokens = jax.ShapeDtypeStruct((batch_size, length), jnp.int32)

    def variables(tokens: jax.Array) -> Cache:
        return Transformer(config).init(jax.random.key(0), tokens, decode=True)["cache"]

    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(variables, tokens))
