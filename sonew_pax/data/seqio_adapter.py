"""Adapter from a seqio Task (or Mixture) to the token documents of this package's pipeline.

seqio and TensorFlow are an optional extra: ``pip install 'sonew_pax[seqio]'``. They are imported
only when a ``seqio:TASK`` source is used. The task's examples are read once, unshuffled, from the
requested split; the token ids of one feature (``"targets"`` by default) become the documents,
which are then packed and batched exactly like the text sources. The task's own vocabulary is the
tokenizer (the ``DataConfig.tokenizer`` setting does not apply).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

import numpy as np


def import_seqio() -> ModuleType:
    """Imports seqio, or raises ImportError saying how to install the optional extra."""
    try:
        return importlib.import_module("seqio")
    except ImportError as error:
        raise ImportError(
            "The seqio data source needs the optional extra: pip install 'sonew_pax[seqio]' "
            "(seqio and tensorflow-cpu)."
        ) from error


class SeqioTokenizer:
    """A seqio Vocabulary seen through this package's `Tokenizer` interface."""

    def __init__(self, vocabulary):
        """Wraps `vocabulary` (a ``seqio.Vocabulary``)."""
        self.vocabulary = vocabulary
        self.vocab_size = int(vocabulary.vocab_size)
        self.pad_id = int(vocabulary.pad_id)
        self.eos_id = int(vocabulary.eos_id)

    def encode(self, text: str) -> np.ndarray:
        """Returns the vocabulary's ids of `text` as int32."""
        return np.asarray(self.vocabulary.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Returns the text of `ids`; PAD and EOS are dropped."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if i not in (self.pad_id, self.eos_id)]
        return self.vocabulary.decode(ids)


def seqio_tokenizer(task_name: str, feature: str = "targets") -> SeqioTokenizer:
    """Returns the vocabulary of `feature` of a registered seqio task or mixture, as a tokenizer."""
    task = import_seqio().get_mixture_or_task(task_name)
    return SeqioTokenizer(task.output_features[feature].vocabulary)


def seqio_documents(task_name: str, split: str, feature: str = "targets") -> list[np.ndarray]:
    """Returns the token ids of `feature` of every example in `split` of a registered seqio task.

    A trailing EOS is removed (packing appends one to every document).
    """
    task = import_seqio().get_mixture_or_task(task_name)
    eos_id = int(task.output_features[feature].vocabulary.eos_id)
    dataset = task.get_dataset(
        sequence_length=None, split=split, shuffle=False, num_epochs=1, use_cached=False
    )
    documents = []
    for example in dataset.as_numpy_iterator():
        tokens = np.asarray(example[feature], dtype=np.int32).reshape(-1)
        if len(tokens) and tokens[-1] == eos_id:
            tokens = tokens[:-1]
        documents.append(tokens)
    return documents
