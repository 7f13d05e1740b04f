r"""Export a trained run to Hugging Face's Llama layout (``LlamaForCausalLM``).

    python -m sonew_pax.export_hf --model_dir=/tmp/run --out=/tmp/run-hf

Writes ``config.json`` and ``model.safetensors`` (float32 or bfloat16, as the run's parameters)
from the run's newest intact checkpoint (`sonew_pax.inference.load_run`), for models with SwiGLU
MLPs and rotary positions (`sonew_pax.models.llama` says why the rest of the architecture needs
no change, and names the option that keeps another model from exporting). Then::

    transformers.LlamaForCausalLM.from_pretrained("/tmp/run-hf")

Tokenizer: a SentencePiece run's model is copied as ``tokenizer.model`` with a
``tokenizer_config.json`` naming the Hugging Face tokenizer that gives SentencePiece's ids for it
(no BOS token, as in training): ``T5Tokenizer`` for a unigram model (the default; call it with
``add_special_tokens=False``, or it appends EOS), ``LlamaTokenizer`` for a BPE one. Hugging Face's
Llama tokenizer runs BPE only, so a unigram model under it would give other ids. A byte-level run
has no Hugging Face tokenizer file: its token ids are the UTF-8 bytes (``list(text.encode())``,
PAD = 0, EOS = 255), which the command says. Errors print one line ``error: ...``, exit status 1.
"""

import json
import pathlib
import shutil
import sys
from collections.abc import Sequence

from absl import app, flags

from sonew_pax import inference, train
from sonew_pax.data import ByteTokenizer, SentencePieceTokenizer, Tokenizer
from sonew_pax.errors import RunError
from sonew_pax.models import llama

TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"


# The Hugging Face tokenizer that reads a SentencePiece model of each kind as SentencePiece does:
# T5's applies the model's normalizer (NFKC, whitespace) and runs its unigram model; Llama's runs
# BPE and normalizes nothing (text those rules would change tokenizes differently).
_HF_TOKENIZERS = {
    "unigram": {"tokenizer_class": "T5Tokenizer", "extra_ids": 0},
    "bpe": {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": True,
    },
}
# What a user of each tokenizer must know to get the run's ids.
_USAGE = {"T5Tokenizer": " (call it with add_special_tokens=False: it appends EOS)"}


def sentencepiece_config(tokenizer: SentencePieceTokenizer, max_len: int) -> dict | None:
    """``tokenizer_config.json`` for the Hugging Face tokenizer that reads ``tokenizer``'s model
    as the run did (`_HF_TOKENIZERS`), without BOS, the special pieces under their ids' names;
    None for a model kind none reads so."""
    kind = _HF_TOKENIZERS.get(tokenizer.model_type)
    if kind is None:
        return None
    piece = tokenizer.id_to_piece
    return {
        **kind,
        "model_max_length": max_len,
        "bos_token": None,
        "eos_token": piece(tokenizer.eos_id),
        "pad_token": piece(tokenizer.pad_id),
        "unk_token": piece(tokenizer.unk_id),
    }


def write_tokenizer(out_dir: pathlib.Path, tokenizer: Tokenizer, max_len: int) -> str:
    """Writes the Hugging Face files of ``tokenizer`` into ``out_dir``; says what was written."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        shutil.copyfile(tokenizer.model_path, out_dir / TOKENIZER_MODEL)
        config = sentencepiece_config(tokenizer, max_len)
        if config is None:
            return (
                f"tokenizer: {TOKENIZER_MODEL} (SentencePiece, {tokenizer.model_type}); no "
                f"Hugging Face tokenizer reads this kind as SentencePiece does: use sentencepiece"
            )
        (out_dir / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        note = _USAGE.get(config["tokenizer_class"], "")
        return (
            f"tokenizer: {TOKENIZER_MODEL} (SentencePiece, {tokenizer.model_type}) and "
            f"{TOKENIZER_CONFIG} for {config['tokenizer_class']}{note}"
        )
    if isinstance(tokenizer, ByteTokenizer):
        return (
            "tokenizer: none written; the run is byte-level: token ids are the UTF-8 bytes "
            f"(list(text.encode())), PAD = {tokenizer.pad_id}, EOS = {tokenizer.eos_id}"
        )
    return f"tokenizer: none written for {type(tokenizer).__name__}"


def export(model_dir: str, out_dir: str) -> list[str]:
    """Exports the run in ``model_dir`` to ``out_dir`` (`llama.save`, then the tokenizer).

    Args:
      model_dir: the run directory.
      out_dir: the export directory (created if missing).

    Returns:
      Lines saying what was written.

    Raises:
      RunError: the run's model does not export (the option named; found before anything is
        restored), or the run does not restore.
    """
    llama.check_exportable(inference.read_run_config(model_dir)[0])
    run = inference.load_run(model_dir)
    tokenizer = run.tokenizer
    out = pathlib.Path(out_dir)
    llama.save(out, run.config, run.params, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
    return [
        f"Exported {model_dir} (step {run.step}) to {out} as LlamaForCausalLM: "
        f"{llama.CONFIG_FILE}, {llama.WEIGHTS_FILE}",
        write_tokenizer(out, tokenizer, run.config.max_len),
    ]


def define_flags() -> None:
    """The command's flags; defined only when it runs, so that `export` can be imported beside
    other commands that define ``--model_dir`` (the demo, `sonew_pax.sample`)."""
    flags.DEFINE_string("model_dir", None, "The run directory.", required=True)
    flags.DEFINE_string("out", None, "The export directory.", required=True)


def main(argv: Sequence[str]) -> None:
    """absl entry point: export, then print what was written."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    train.quiet_library_logs()
    try:
        lines = export(flags.FLAGS.model_dir, flags.FLAGS.out)
    except RunError as error:
        sys.exit(f"error: {error}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
