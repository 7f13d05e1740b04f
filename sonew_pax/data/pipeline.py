"""The grain pipeline: packed examples → this process's shard of the global batch, resumable.

Order. The packed training examples are shuffled by ``grain.MapDataset.shuffle`` and repeated
forever; each epoch is reshuffled with its own seed (grain derives it from the seed and the epoch).
The global stream is cut into global batches of ``batch_size`` consecutive examples: global
batch ``s`` is stream examples ``[s * B, (s + 1) * B)``, so it depends only on ``(seed, s)``.
Process ``p`` of ``P`` reads rows ``[p * B / P, (p + 1) * B / P)`` of it, and only those, so
the P local batches concatenated in process order are the global batch whatever P is.

Position. The iterator's state is the next step (plus the seed and global batch size, checked on
restore). It is independent of the process count, so a checkpoint resumes on another topology.
It also names what is read (``source``) and how it is tokenized (``tokenizer``,
`tokenizers.identity`), so that a run resumed on other data can be told (`sonew_pax.loop`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

import gin
import grain
import numpy as np
from absl import logging

from sonew_pax.data import corpus, packing, seqio_adapter, sources, tokenizers
from sonew_pax.errors import ConfigError

Batch = dict[str, np.ndarray]


@gin.configurable(module="sonew_pax.data")
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read and how to tokenize it; shared by the train iterator and the eval batches.

    Attributes:
      source: a source spec (see `sonew_pax.data.sources`), or ``"seqio:TASK"``.
      tokenizer: ``"byte"`` (vocab 256) or ``"sentencepiece"`` (trained on the train split).
      vocab_size: the SentencePiece vocabulary size (ignored for bytes and seqio).
      spm_model_type: ``"unigram"`` or ``"bpe"``.
      spm_sample_chars: size of the deterministic text sample SentencePiece is trained on.
      cache_dir: where trained SentencePiece models and the streams they encode are cached; None
        → `default_cache_dir()`.
      eval_fraction: the held-out tail of every document (text sources).
      seqio_train_split, seqio_eval_split, seqio_feature: what a seqio task is read from.
    """

    source: str = "shakespeare"
    tokenizer: str = "byte"
    vocab_size: int = 1024
    spm_model_type: str = "unigram"
    spm_sample_chars: int = 1_000_000
    cache_dir: str | None = None
    eval_fraction: float = 0.05
    seqio_train_split: str = "train"
    seqio_eval_split: str = "validation"
    seqio_feature: str = "targets"

    @property
    def seqio_task(self) -> str | None:
        """The task name when the source is ``seqio:TASK``, else None."""
        kind, _, name = self.source.partition(":")
        return name if kind == "seqio" else None


def _split_name(config: DataConfig, split: str) -> str:
    """Maps ``"train"``/``"eval"`` to the seqio split names of `config`."""
    return config.seqio_train_split if split == "train" else config.seqio_eval_split


@functools.lru_cache(maxsize=8)
def get_tokenizer(config: DataConfig) -> tokenizers.Tokenizer:
    """Returns the tokenizer of `config` (training and caching a SentencePiece model if needed)."""
    if config.seqio_task is not None:
        return seqio_adapter.seqio_tokenizer(config.seqio_task, config.seqio_feature)
    if config.tokenizer == "byte":
        return tokenizers.ByteTokenizer()
    if config.tokenizer == "sentencepiece":
        path = tokenizers.train_sentencepiece(
            sources.split_texts(config.source, "train", config.eval_fraction),
            config.cache_dir or tokenizers.default_cache_dir(),
            vocab_size=config.vocab_size,
            model_type=config.spm_model_type,
            max_chars=config.spm_sample_chars,
        )
        return tokenizers.SentencePieceTokenizer(path)
    raise ConfigError(
        f"unknown tokenizer {config.tokenizer!r} (DataConfig.tokenizer); expected 'byte' or "
        "'sentencepiece'"
    )


@functools.lru_cache(maxsize=8)
def token_stream(config: DataConfig, split: str) -> np.ndarray:
    """Returns the ``"train"`` or ``"eval"`` split of `config` as one EOS-separated token stream.

    A SentencePiece stream of a text source is encoded once and cached in ``config.cache_dir``
    (`cached_stream`); bytes are encoded on the fly.
    """
    tokenizer = get_tokenizer(config)
    if config.seqio_task is not None:
        documents = seqio_adapter.seqio_documents(
            config.seqio_task, _split_name(config, split), config.seqio_feature
        )
        stream = packing.concat_with_eos(documents, tokenizer.eos_id)
    else:
        texts = sources.split_texts(config.source, split, config.eval_fraction)
        if isinstance(tokenizer, tokenizers.SentencePieceTokenizer):
            cache = pathlib.Path(config.cache_dir or tokenizers.default_cache_dir())
            stream = cached_stream(texts, tokenizer, cache)
        else:
            stream = packing.concat_with_eos(tokenizer.encode_many(texts), tokenizer.eos_id)
    stream.flags.writeable = False
    return stream


def cached_stream(
    texts: list[str], tokenizer: tokenizers.SentencePieceTokenizer, cache_dir: pathlib.Path
) -> np.ndarray:
    """The EOS-separated stream of ``texts`` encoded by ``tokenizer``, read from ``cache_dir`` or
    encoded (on all cores) and written there.

    The file is named by a hash of the tokenizer's model and the texts, so it is reused only for
    the same text and vocabulary, and written atomically (concurrent processes may race safely).
    """
    digest = hashlib.sha256(tokenizer.fingerprint())
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
    path = cache_dir / "tokens" / f"stream-{digest.hexdigest()[:24]}.npy"
    if path.is_file():
        return np.load(path)
    stream = packing.concat_with_eos(tokenizer.encode_many(texts), tokenizer.eos_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as handle:
        np.save(handle, stream)
    os.replace(handle.name, path)
    return stream


def local_batch_size(batch_size: int, process_count: int) -> int:
    """Returns ``batch_size // process_count``, or raises if it does not divide."""
    if batch_size < 1 or process_count < 1 or batch_size % process_count:
        raise ValueError(
            f"global batch_size={batch_size} must be a positive multiple of "
            f"process_count={process_count}"
        )
    return batch_size // process_count


def grain_seed(seed: int) -> int:
    """Maps any integer seed to grain's 32-bit shuffle seed (well mixed, so seeds s and s+1 do not
    share epochs: grain reseeds epoch e with ``seed + e``)."""
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


def train_batches(
    examples: grain.MapDataset | packing.PackedExamples,
    *,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """Returns the endless MapDataset whose item ``s`` is this process's part of global batch s.

    Args:
      examples: the packed training examples (any random-access source).
      batch_size: the global batch size, a multiple of `process_count`.
      seed: the shuffle seed.
      process_index, process_count: this process and the number of processes.
    """
    local = local_batch_size(batch_size, process_count)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    if len(examples) == 0:
        raise ValueError("the training split is empty: no examples to batch")
    stream = grain.MapDataset.source(examples).shuffle(seed=grain_seed(seed)).repeat()
    return stream.batch(local, drop_remainder=True)[process_index::process_count]


def eval_batches(
    examples: packing.PackedExamples,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """Returns the finite MapDataset of this process's parts of the eval batches, in order.

    The examples are taken in order; the last global batch is completed with all-padding examples
    of weight 0, so every process gets the same number of batches and every example counts once.
    """
    local = local_batch_size(batch_size, process_count)
    if len(examples) == 0:
        raise corpus.CorpusError("the held-out split is empty (is DataConfig.eval_fraction 0?)")
    count = -(-len(examples) // batch_size) * batch_size
    blank = packing.empty_example(examples.seq_len, examples.pad_id)
    padded = grain.MapDataset.range(count).map(
        lambda i: examples[i] if i < len(examples) else blank
    )
    return padded.batch(local)[process_index::process_count]


def check_enough_data(source: str, tokens: int, examples: int, batch_size: int) -> None:
    """Logs the size of the training split and refuses one smaller than a global batch.

    Args:
      source: the source spec, for the messages.
      tokens: tokens in the training split (EOS included).
      examples: packed examples they make.
      batch_size: the global batch size.

    Raises:
      CorpusError: fewer examples than ``batch_size``: every batch would hold the same
        (padded) examples for the whole run.
    """
    logging.info("Training split of %s: %d tokens, %d examples.", source, tokens, examples)
    if examples < batch_size:
        raise corpus.CorpusError(
            f"the training split of {source!r} has {tokens} tokens, {examples} example(s) of "
            f"SEQ_LEN: fewer than one batch (BATCH_SIZE {batch_size}), so every batch would "
            "repeat them for the whole run. Add text, or lower BATCH_SIZE or SEQ_LEN."
        )


class TrainIterator(Iterator[Batch]):
    """Iterates over this process's training batches; its position can be saved and restored.

    ``get_state()`` returns ``{"step", "seed", "batch_size", "source", "tokenizer"}``
    (JSON-serialisable); ``set_state`` moves to that step, checking that seed and global batch
    size match (``source`` and ``tokenizer`` say what the batches are; the caller compares
    them). Batches are read ahead by grain threads (`prefetch` batches); the position counts
    only batches already returned.
    """

    def __init__(
        self,
        batches: grain.MapDataset,
        *,
        seed: int,
        batch_size: int,
        tokenizer: tokenizers.Tokenizer,
        source: str,
        prefetch: int = 2,
    ):
        """Wraps `batches` (from `train_batches`, of the source spec `source`) at step 0."""
        self.tokenizer = tokenizer
        self._identity = {"source": source, "tokenizer": tokenizers.identity(tokenizer)}
        self._batches = batches
        self._seed = seed
        self._batch_size = batch_size
        self._read_options = grain.ReadOptions(
            num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch
        )
        self._step = 0
        self._iterator = self._iterate_from(0)

    def _iterate_from(self, step: int) -> Iterator[Batch]:
        return iter(self._batches[step:].to_iter_dataset(self._read_options))

    @property
    def step(self) -> int:
        """The step of the next batch."""
        return self._step

    def __next__(self) -> Batch:
        batch = next(self._iterator)
        self._step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        """Returns the position as a JSON-serialisable dict."""
        position = {"step": self._step, "seed": self._seed, "batch_size": self._batch_size}
        return position | self._identity

    def set_state(self, state: dict[str, Any]) -> None:
        """Moves to the position in `state` (from `get_state`, possibly of another process count).

        Raises:
          ValueError: when the state was written with another seed or global batch size.
        """
        for key, mine in (("seed", self._seed), ("batch_size", self._batch_size)):
            if int(state[key]) != mine:
                raise ValueError(f"data state has {key}={state[key]}, this pipeline has {mine}")
        self._step = int(state["step"])
        self._iterator = self._iterate_from(self._step)


@gin.configurable(module="sonew_pax.data")
def make_train_iterator(
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    config: DataConfig | None = None,
    prefetch: int = 2,
) -> TrainIterator:
    """Returns the endless, resumable training iterator of this process.

    Each item is ``{"inputs": int32[B_local, seq_len], "targets": int32[B_local, seq_len],
    "weights": float32[B_local, seq_len]}`` with ``B_local = batch_size // process_count``.

    Args:
      seq_len: tokens per example.
      batch_size: the global batch size (all processes together).
      seed: the shuffle seed; the batch at step s depends only on (seed, s).
      process_index, process_count: e.g. ``jax.process_index(), jax.process_count()``.
      config: source and tokenizer; None → ``DataConfig()`` (gin-configured).
      prefetch: batches read ahead in a background thread (0: read synchronously).
    """
    config = config or DataConfig()
    tokenizer = get_tokenizer(config)
    stream = token_stream(config, "train")
    examples = packing.PackedExamples(stream, seq_len, tokenizer.pad_id)
    check_enough_data(config.source, len(stream), len(examples), batch_size)
    batches = train_batches(
        examples,
        batch_size=batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    return TrainIterator(
        batches,
        seed=seed,
        batch_size=batch_size,
        tokenizer=tokenizer,
        source=config.source,
        prefetch=prefetch,
    )


@gin.configurable(module="sonew_pax.data")
def make_eval_batches(
    *,
    seq_len: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    config: DataConfig | None = None,
    max_batches: int | None = None,
) -> list[Batch]:
    """Returns this process's held-out batches: a finite, deterministic list (same on every call).

    Same dict format as `make_train_iterator`. All processes get the same number of batches;
    padding rows have weight 0, so a weighted mean of the loss is the exact held-out loss.

    Args:
      seq_len: tokens per example.
      batch_size: the global eval batch size.
      process_index, process_count: this process and the number of processes.
      config: source and tokenizer; None → ``DataConfig()`` (gin-configured).
      max_batches: keep only the first global batches (None: the whole held-out split).
    """
    config = config or DataConfig()
    tokenizer = get_tokenizer(config)
    examples = packing.PackedExamples(token_stream(config, "eval"), seq_len, tokenizer.pad_id)
    batches = eval_batches(
        examples, batch_size=batch_size, process_index=process_index, process_count=process_count
    )
    if max_batches is not None:
        batches = batches[:max_batches]
    return list(batches)
