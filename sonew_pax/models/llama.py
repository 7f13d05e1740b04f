"""The `Transformer` in Hugging Face's Llama layout (``LlamaForCausalLM``): config and weights.

A decoder with SwiGLU MLPs and rotary positions is a Llama model without biases, its
``num_key_value_heads`` the model's `kv_heads` (query head ``h`` reads key/value head
``h // (num_heads / kv_heads)`` in both); nothing else differs:

- RMSNorm: both compute ``w * x / sqrt(mean(x^2) + eps)`` in float32, with the learned ``w``
  itself (not ``1 + w``) and ``eps`` inside the root.
- Rotary positions: both rotate the pair ``(i, i + head_dim / 2)`` (the GPT-NeoX form Llama's
  ``rotate_half`` implements) by ``position * base^(-2i / head_dim)``, so query and key kernels
  need no permutation (Meta's original checkpoints interleave pairs; Hugging Face's converter
  permutes those, not these).
- Attention scales scores by ``1 / sqrt(head_dim)``; the output projection reads the heads in
  order, head-major, as a (heads, kv) kernel reshaped to heads * kv does.

Kernels are stored (in, out) here and as ``torch.nn.Linear`` weights (out, in) there. Gelu MLPs
and learned positions have no Llama counterpart: `check_exportable` names the option. `save`
writes what ``LlamaForCausalLM.from_pretrained`` reads; it needs neither torch nor transformers.
"""

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from sonew_pax import safetensors_io
from sonew_pax.errors import ConfigError
from sonew_pax.models.transformer import TransformerConfig, unstack_layers

# The settings a Llama model needs, and what each must be.
_REQUIRED = {"mlp_activation": "swiglu", "positions": "rotary"}


def check_exportable(config: TransformerConfig) -> None:
    """Raises `ConfigError` naming the first setting of ``config`` that Llama cannot express."""
    for name, wanted in _REQUIRED.items():
        value = getattr(config, name)
        if value != wanted:
            raise ConfigError(
                f"TransformerConfig.{name} = {value!r} has no Llama (LlamaForCausalLM) "
                f"counterpart; only models with {name} = {wanted!r} export"
            )


def llama_config(
    config: TransformerConfig, *, pad_id: int | None = None, eos_id: int | None = None
) -> dict[str, Any]:
    """The ``config.json`` of ``config`` as ``LlamaForCausalLM``.

    Args:
      config: an exportable configuration (`check_exportable`).
      pad_id: the tokenizer's padding id, if any.
      eos_id: the tokenizer's end-of-sequence id, if any. (Runs have no beginning-of-sequence id.)

    Returns:
      A JSON-serialisable dict; ``rope_theta`` appears both at the top level and in
      ``rope_parameters``, where older and newer ``transformers`` read it.
    """
    check_exportable(config)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "torch_dtype": config.param_dtype,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "eos_token_id": eos_id,
    }


def _linear(kernel: Any, inputs: int = 1) -> np.ndarray:
    """A kernel whose first ``inputs`` axes are its input as a ``torch.nn.Linear`` weight
    (outputs, inputs), each side flattened row-major (heads, then kv within a head)."""
    kernel = np.asarray(kernel)
    features = int(np.prod(kernel.shape[:inputs]))
    return np.ascontiguousarray(kernel.reshape(features, -1).T)


def llama_tensors(params: Mapping[str, Any], config: TransformerConfig) -> dict[str, np.ndarray]:
    """The parameters of a `Transformer` under ``LlamaForCausalLM``'s names and layouts.

    Args:
      params: the model's (unboxed) parameters, arrays of any kind numpy can read.
      config: an exportable configuration (`check_exportable`).

    Returns:
      name -> numpy array in the parameters' dtype; no ``lm_head.weight`` when embeddings are
      tied (``tie_word_embeddings`` says so).
    """
    check_exportable(config)
    params = unstack_layers(params, config)
    tensors = {"model.embed_tokens.weight": np.asarray(params["embedding"])}
    for i in range(config.num_layers):
        layer = params[f"layer_{i}"]
        attn, mlp = layer["attn"], layer["mlp"]
        prefix = f"model.layers.{i}"
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": _linear(attn["query"]),
            f"{prefix}.self_attn.k_proj.weight": _linear(attn["key"]),
            f"{prefix}.self_attn.v_proj.weight": _linear(attn["value"]),
            f"{prefix}.self_attn.o_proj.weight": _linear(attn["out"], inputs=2),
            f"{prefix}.mlp.gate_proj.weight": _linear(mlp["wi_gate"]),
            f"{prefix}.mlp.up_proj.weight": _linear(mlp["wi_up"]),
            f"{prefix}.mlp.down_proj.weight": _linear(mlp["wo"]),
            f"{prefix}.input_layernorm.weight": np.asarray(layer["attn_norm"]["scale"]),
            f"{prefix}.post_attention_layernorm.weight": np.asarray(layer["mlp_norm"]["scale"]),
        }
    tensors["model.norm.weight"] = np.asarray(params["final_norm"]["scale"])
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = _linear(params["output"])
    return tensors


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save(
    out_dir: str | os.PathLike,
    config: TransformerConfig,
    params: Mapping[str, Any],
    *,
    pad_id: int | None = None,
    eos_id: int | None = None,
) -> None:
    """Writes ``config.json`` and ``model.safetensors`` for ``LlamaForCausalLM`` into ``out_dir``.

    Args:
      out_dir: the directory (created if missing).
      config: an exportable configuration (`check_exportable`).
      params: the model's (unboxed) parameters.
      pad_id: see `llama_config`.
      eos_id: see `llama_config`.

    Raises:
      ConfigError: ``config`` does not export.
    """
    hf_config = llama_config(config, pad_id=pad_id, eos_id=eos_id)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    safetensors_io.save(llama_tensors(params, config), out / WEIGHTS_FILE, {"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
