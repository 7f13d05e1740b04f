"""Tokenizers: byte-level (the default) and a SentencePiece vocabulary trained on the corpus.

Every tokenizer has ``vocab_size``, ``pad_id``, ``eos_id``, ``encode(str) -> int32 array`` and
``decode(ids) -> str``. ``pad_id`` only ever appears as padding (it gets weight 0); ``eos_id`` ends
every document when documents are packed together.

Byte ids: the vocabulary is exactly the 256 byte values, so ``vocab_size == 256``. Two byte values
are reserved: ``PAD = 0`` (the NUL byte, removed from text before encoding) and ``EOS = 255``
(0xFF never occurs in UTF-8, so it cannot collide with text).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2


class Tokenizer(Protocol):
    """What the packing and the trainer need from a tokenizer."""

    vocab_size: int
    pad_id: int
    eos_id: int

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Returns :meth:`encode` of every text."""
        ...

    def encode(self, text: str) -> np.ndarray:
        """Returns the int32 token ids of `text` (no EOS appended)."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Returns the text of `ids`; PAD and EOS ids are dropped."""
        ...


def identity(tokenizer: Tokenizer) -> str:
    """What ``tokenizer`` encodes, in a short line that differs between tokenizers that encode
    differently: its kind and vocabulary size, and a hash of its model when it has one
    (``fingerprint()``, as SentencePiece has)."""
    name = f"{type(tokenizer).__name__}(vocab_size={tokenizer.vocab_size})"
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if fingerprint is None:
        return name
    return f"{name} sha256:{hashlib.sha256(fingerprint()).hexdigest()[:16]}"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, PAD = 0 (NUL), EOS = 255 (never valid UTF-8)."""

    vocab_size = 256
    pad_id = 0
    eos_id = 255

    def encode(self, text: str) -> np.ndarray:
        """Returns the UTF-8 bytes of `text` (NUL characters removed) as int32 ids."""
        data = text.replace("\0", "").encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` of every text."""
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Returns the text of byte ids; PAD/EOS are dropped, invalid UTF-8 is replaced."""
        data = np.asarray(ids, dtype=np.int64)
        data = data[(data != self.pad_id) & (data != self.eos_id)]
        return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model: PAD = 0, EOS = 1, UNK = 2, no BOS; byte fallback for rare chars."""

    pad_id = 0
    eos_id = 1
    unk_id = 2

    def __init__(self, model_path: str | os.PathLike):
        """Loads the model file at `model_path`."""
        self.model_path = str(model_path)
        self._processor = spm.SentencePieceProcessor(model_file=self.model_path)
        self.vocab_size = int(self._processor.get_piece_size())

    def encode(self, text: str) -> np.ndarray:
        """Returns the piece ids of `text` as int32."""
        return np.asarray(self._processor.encode(text), dtype=np.int32)

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` of every text, on all CPU cores."""
        ids = self._processor.encode(list(texts), num_threads=os.cpu_count() or 1)
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def fingerprint(self) -> bytes:
        """The model's bytes: what its encoding depends on."""
        return self._processor.serialized_model_proto()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Returns the text of piece ids; PAD and EOS are dropped."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if i not in (self.pad_id, self.eos_id)]
        return self._processor.decode(ids)

    def id_to_piece(self, piece_id: int) -> str:
        """Returns the piece of `piece_id` (e.g. ``"</s>"`` for EOS)."""
        return self._processor.id_to_piece(piece_id)

    @property
    def model_type(self) -> str:
        """The model's algorithm: ``"unigram"``, ``"bpe"``, ``"word"`` or ``"char"``."""
        proto = sentencepiece_model_pb2.ModelProto.FromString(
            self._processor.serialized_model_proto()
        )
        return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(
            proto.trainer_spec.model_type
        ).lower()


def training_sample(documents: Sequence[str], max_chars: int) -> list[str]:
    """Returns a deterministic sample of the non-empty lines of `documents`, about `max_chars` long.

    Every k-th line is kept, with k the smallest stride that brings the total under `max_chars`,
    so the sample covers the whole corpus evenly without any randomness.
    """
    lines = [line for doc in documents for line in doc.split("\n") if line.strip()]
    total = sum(len(line) for line in lines)
    stride = max(1, -(-total // max_chars))
    return lines[::stride]


def train_sentencepiece(
    documents: Sequence[str],
    cache_dir: str | os.PathLike,
    *,
    vocab_size: int = 1024,
    model_type: str = "unigram",
    max_chars: int = 1_000_000,
) -> pathlib.Path:
    """Trains a SentencePiece model on `documents` and returns its path, reusing a cached one.

    The file name holds a hash of the training sample and the options, so a cached model is reused
    only for identical inputs. Training is single-threaded on a deterministic sample, so the same
    inputs give the same model bytes on every host (about a second for 1 MB of text). The file is
    written atomically, so concurrent processes may race safely.

    Args:
      documents: training text (use the train split only).
      cache_dir: directory for the ``.model`` file; created if missing.
      vocab_size: number of pieces, including PAD/EOS/UNK and the 256 byte-fallback pieces; a
        soft limit (a corpus too small for it gives fewer pieces, see the tokenizer's vocab_size).
      model_type: ``"unigram"`` or ``"bpe"``.
      max_chars: size of the training sample.
    """
    sample = training_sample(documents, max_chars)
    options = dict(
        model_type=model_type,
        vocab_size=vocab_size,
        pad_id=SentencePieceTokenizer.pad_id,
        eos_id=SentencePieceTokenizer.eos_id,
        unk_id=SentencePieceTokenizer.unk_id,
        bos_id=-1,
        byte_fallback=True,
        hard_vocab_limit=False,
        character_coverage=1.0,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    digest = hashlib.sha256(repr(sorted(options.items())).encode())
    for line in sample:
        digest.update(line.encode("utf-8") + b"\n")
    cache = pathlib.Path(cache_dir)
    path = cache / f"spm-{model_type}-{vocab_size}-{digest.hexdigest()[:16]}.model"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".tmp", delete=False) as handle:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample), model_writer=handle, **options
        )
    os.replace(handle.name, path)
    return path


def default_cache_dir() -> pathlib.Path:
    """``$SONEW_PAX_CACHE`` if set, else ``~/.cache/sonew_pax``."""
    return pathlib.Path(
        os.environ.get("SONEW_PAX_CACHE", pathlib.Path.home() / ".cache" / "sonew_pax")
    )
