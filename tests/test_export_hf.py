"""Hugging Face export: the safetensors file and config.json `sonew_pax.models.llama` writes, the
architectures it refuses, ``transformers``' LlamaForCausalLM against our logits, and the
SentencePiece tokenizer files (`sonew_pax.export_hf`) against the run's token ids.

The transformers comparisons are skipped where torch or transformers is not installed. The model
tests need jax, flax, numpy, ml_dtypes and gin-config (imported by `sonew_pax.models`), not the
trainer's data or checkpoint packages; the tokenizer tests also need the project's data pipeline
(grain, sentencepiece) and are skipped without it. Run ``python -m pytest tests/test_export_hf.py``.
"""

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sonew_pax import safetensors_io
from sonew_pax.errors import ConfigError
from sonew_pax.models import Transformer, TransformerConfig, llama

TINY = TransformerConfig(
    vocab_size=64,
    d_model=32,
    num_layers=1,
    num_heads=4,
    head_dim=8,
    mlp_dim=48,
    max_len=16,
    mlp_activation="swiglu",
    tie_embeddings=True,
)
# Small-shaped: several layers, heads * head_dim != d_model, separate output, other rope base.
SMALL = TransformerConfig(
    vocab_size=256,
    d_model=96,
    num_layers=3,
    num_heads=3,
    head_dim=16,
    mlp_dim=160,
    max_len=64,
    mlp_activation="swiglu",
    tie_embeddings=False,
    rope_base=500000.0,
    norm_eps=1e-5,
)

# Grouped-query attention: 4 query heads reading 2 key/value heads.
GQA = TransformerConfig(**{**SMALL.__dict__, "num_heads": 4, "num_kv_heads": 2})


def random_params(config: TransformerConfig, seed: int = 0):
    """The model's parameters with every entry random: kernels N(0, 0.1^2), norm scales around 1,
    so that a transposed kernel, a permuted head or a scale read as ``1 + w`` would show."""

    def draw(key: jax.Array):
        init_key, noise_key = jax.random.split(key)
        params = Transformer(config).init(init_key, jnp.zeros((1, 1), jnp.int32))["params"]
        leaves, treedef = jax.tree.flatten(nn.unbox(params))
        keys = jax.random.split(noise_key, len(leaves))
        noisy = [
            (jax.random.normal(k, leaf.shape) * 0.1 + (leaf.ndim == 1)).astype(leaf.dtype)
            for k, leaf in zip(keys, leaves, strict=True)
        ]
        return jax.tree.unflatten(treedef, noisy)

    return jax.jit(draw)(jax.random.key(seed))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_export_files_parse_and_round_trip(tmp_path, param_dtype):
    config = TransformerConfig(**{**SMALL.__dict__, "param_dtype": param_dtype})
    params = random_params(config)
    llama.save(tmp_path, config, params, pad_id=0, eos_id=1)

    header = safetensors_io.read_header(tmp_path / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    d, hk, f = config.d_model, config.num_heads * config.head_dim, config.mlp_dim
    expected = {"model.embed_tokens.weight": [config.vocab_size, d], "model.norm.weight": [d]}
    expected["lm_head.weight"] = [config.vocab_size, d]
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        expected |= {
            f"{layer}.self_attn.q_proj.weight": [hk, d],
            f"{layer}.self_attn.k_proj.weight": [hk, d],
            f"{layer}.self_attn.v_proj.weight": [hk, d],
            f"{layer}.self_attn.o_proj.weight": [d, hk],
            f"{layer}.mlp.gate_proj.weight": [f, d],
            f"{layer}.mlp.up_proj.weight": [f, d],
            f"{layer}.mlp.down_proj.weight": [d, f],
            f"{layer}.input_layernorm.weight": [d],
            f"{layer}.post_attention_layernorm.weight": [d],
        }
    assert {name: entry["shape"] for name, entry in header.items()} == expected
    code = {"float32": "F32", "bfloat16": "BF16"}[param_dtype]
    assert {entry["dtype"] for entry in header.values()} == {code}

    tensors = safetensors_io.load(tmp_path / "model.safetensors")
    layer = params["layer_1"]
    # Independent of llama_tensors: element [out, in] of a Linear weight is kernel[in, out].
    query = np.asarray(layer["attn"]["query"])  # (embed, heads, kv)
    q_proj = tensors["model.layers.1.self_attn.q_proj.weight"]
    for h, k, e in [(0, 0, 0), (2, 15, 95), (1, 3, 40)]:
        assert q_proj[h * config.head_dim + k, e] == query[e, h, k]
    out = np.asarray(layer["attn"]["out"])  # (heads, kv, embed)
    assert (
        tensors["model.layers.1.self_attn.o_proj.weight"][7, 2 * config.head_dim + 5]
        == (out[2, 5, 7])
    )
    np.testing.assert_array_equal(
        tensors["model.layers.1.mlp.down_proj.weight"], np.asarray(layer["mlp"]["wo"]).T
    )
    np.testing.assert_array_equal(tensors["lm_head.weight"], np.asarray(params["output"]).T)
    np.testing.assert_array_equal(
        tensors["model.layers.1.input_layernorm.weight"], layer["attn_norm"]["scale"]
    )

    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    assert {key: hf_config[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "rope_theta", "tie_word_embeddings", "torch_dtype", "hidden_act",
    )} == {
        "vocab_size": 256, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 16,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": param_dtype, "hidden_act": "silu",
    }  # fmt: skip
    assert (hf_config["pad_token_id"], hf_config["eos_token_id"]) == (0, 1)


def test_grouped_query_attention_exports_its_key_value_heads(tmp_path):
    llama.save(tmp_path, GQA, random_params(GQA))
    header = safetensors_io.read_header(tmp_path / "model.safetensors")
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [2 * 16, 96]
    assert header["model.layers.0.self_attn.q_proj.weight"]["shape"] == [4 * 16, 96]
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert (hf_config["num_attention_heads"], hf_config["num_key_value_heads"]) == (4, 2)


def test_tied_embeddings_write_no_lm_head(tmp_path):
    llama.save(tmp_path, TINY, random_params(TINY))
    assert "lm_head.weight" not in safetensors_io.read_header(tmp_path / "model.safetensors")
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("option, value", [("mlp_activation", "gelu"), ("positions", "learned")])
def test_other_architectures_do_not_export(tmp_path, option, value):
    config = TransformerConfig(**{**TINY.__dict__, option: value})
    with pytest.raises(ConfigError, match=rf"TransformerConfig\.{option} = '{value}'"):
        llama.save(tmp_path, config, params={})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "config", [TINY, SMALL, GQA], ids=["tiny-tied", "small-untied", "grouped-query"]
)
def test_transformers_llama_gives_our_logits(tmp_path, config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = random_params(config)
    llama.save(tmp_path, config, params)
    tokens = np.asarray(
        jax.random.randint(jax.random.key(2), (2, config.max_len), 0, config.vocab_size)
    )
    with jax.default_matmul_precision("float32"):
        ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(tokens)))
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert theirs.shape == ours.shape
    assert np.max(np.abs(theirs - ours)) <= 1e-4


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def sentencepiece(request, tmp_path_factory):
    """A SentencePiece tokenizer of each kind trained on Shakespeare, and some of its text."""
    data = pytest.importorskip("sonew_pax.data")  # needs grain
    config = data.DataConfig(
        tokenizer="sentencepiece",
        vocab_size=512,
        spm_model_type=request.param,
        spm_sample_chars=200_000,
        cache_dir=str(tmp_path_factory.mktemp("spm")),
    )
    text = data.pipeline.sources.split_texts("shakespeare", "eval", 0.05)[0][:5000]
    return data.get_tokenizer(config), [line for line in text.split("\n") if line.strip()]


def test_sentencepiece_tokenizer_files(sentencepiece, tmp_path):
    from sonew_pax import export_hf

    tokenizer, _ = sentencepiece
    note = export_hf.write_tokenizer(tmp_path, tokenizer, max_len=128)
    config = json.loads((tmp_path / export_hf.TOKENIZER_CONFIG).read_text())
    expected = {"unigram": "T5Tokenizer", "bpe": "LlamaTokenizer"}[tokenizer.model_type]
    assert config["tokenizer_class"] == expected and expected in note
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == (
        "</s>",
        "<pad>",
        None,
    )
    copied = (tmp_path / export_hf.TOKENIZER_MODEL).read_bytes()
    assert copied == pathlib.Path(tokenizer.model_path).read_bytes()


def test_transformers_tokenizer_gives_the_runs_ids(sentencepiece, tmp_path):
    transformers = pytest.importorskip("transformers")
    from sonew_pax import export_hf

    tokenizer, lines = sentencepiece
    export_hf.write_tokenizer(tmp_path, tokenizer, max_len=128)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for line in lines:
        ids = theirs(line, add_special_tokens=False)["input_ids"]
        assert ids == tokenizer.encode(line).tolist(), line
