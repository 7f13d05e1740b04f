"""Data: embedded corpus, tokenizers, packing and a resumable, per-process grain pipeline.

Entry points the trainer calls (gin-configurable; each process calls them with its own index)::

    it = make_train_iterator(seq_len=L, batch_size=B, seed=SEED,
                             process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(it)            # {"inputs": int32[B/P, L], "targets": int32[B/P, L],
                                #  "weights": float32[B/P, L]}   (numpy)
    state = it.get_state()      # {"step": int, "seed": int, "batch_size": int}; JSON-serialisable
    it.set_state(state)         # resume at exactly the next batch (any process count)
    evals = make_eval_batches(seq_len=L, batch_size=B, process_index=..., process_count=...)
    vocab = it.tokenizer.vocab_size

Gin names (all also reachable with the ``sonew_pax.data.`` prefix):

* ``DataConfig.source``: ``"shakespeare"`` (default), ``"kjv"``, ``"shakespeare+kjv"``,
  ``"text_dir:PATH"``, ``"array_record:PATTERN"``, ``"seqio:TASK"``.
* ``DataConfig.tokenizer``: ``"byte"`` (default; vocab 256, PAD=0, EOS=255) or
  ``"sentencepiece"`` (PAD=0, EOS=1, UNK=2), with ``DataConfig.vocab_size`` (1024),
  ``DataConfig.spm_model_type`` ("unigram"), ``DataConfig.spm_sample_chars`` (1e6),
  ``DataConfig.cache_dir`` (None → $SONEW_PAX_CACHE or ~/.cache/sonew_pax).
* ``DataConfig.eval_fraction`` (0.05): held-out tail of every document.
* ``DataConfig.seqio_train_split`` / ``seqio_eval_split`` / ``seqio_feature``
  ("train" / "validation" / "targets").
* ``make_train_iterator.seq_len`` / ``batch_size`` / ``seed`` / ``prefetch``, and
  ``make_eval_batches.seq_len`` / ``batch_size`` / ``max_batches``, when the caller leaves them
  to gin.

Packing concatenates documents with EOS and cuts windows of L+1 tokens at stride L (targets are
inputs shifted by one); see `sonew_pax.data.packing`. The order of training batches depends only
on (seed, step); see `sonew_pax.data.pipeline`.
"""

from sonew_pax.data.corpus import MissingCorpusError
from sonew_pax.data.packing import PackedExamples, concat_with_eos
from sonew_pax.data.pipeline import (
    DataConfig,
    TrainIterator,
    eval_batches,
    get_tokenizer,
    make_eval_batches,
    make_train_iterator,
    train_batches,
)
from sonew_pax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "MissingCorpusError",
    "PackedExamples",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TrainIterator",
    "concat_with_eos",
    "eval_batches",
    "get_tokenizer",
    "make_eval_batches",
    "make_train_iterator",
    "train_batches",
]
