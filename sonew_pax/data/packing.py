"""Packing of tokenized documents into fixed-length language-model examples.

Documents are concatenated, each followed by EOS, into one token stream. Example ``i`` covers the
stream window ``[i * L, i * L + L + 1)``: ``inputs`` are its first L tokens and ``targets`` its last
L (the same window shifted by one), so every token after the first is a target exactly once.
The last window is padded with PAD; ``weights`` is 1.0 where the target is a real token, else 0.0.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def concat_with_eos(documents: Iterable[np.ndarray], eos_id: int) -> np.ndarray:
    """Returns one int32 stream: every document followed by `eos_id` (empty documents skipped)."""
    pieces = []
    for doc in documents:
        if len(doc):
            pieces.extend((np.asarray(doc, dtype=np.int32), np.array([eos_id], dtype=np.int32)))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


class PackedExamples:
    """A random-access source of packed examples over one token stream (a grain data source).

    ``examples[i]`` is ``{"inputs": int32[L], "targets": int32[L], "weights": float32[L]}``.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, pad_id: int):
        """Packs `stream` (int32 tokens, EOS already inserted) into examples of length `seq_len`."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.pad_id = pad_id
        self._stream = np.asarray(stream, dtype=np.int32)
        self._length = max(0, -(-(len(self._stream) - 1) // seq_len))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < self._length:
            raise IndexError(f"example {index} out of range [0, {self._length})")
        start = index * self.seq_len
        window = self._stream[start : start + self.seq_len + 1]
        valid = len(window) - 1
        tokens = np.full((self.seq_len + 1,), self.pad_id, dtype=np.int32)
        tokens[: len(window)] = window
        weights = np.zeros((self.seq_len,), dtype=np.float32)
        weights[:valid] = 1.0
        return {"inputs": tokens[:-1], "targets": tokens[1:], "weights": weights}

    def __repr__(self) -> str:
        return f"PackedExamples(n={self._length}, seq_len={self.seq_len})"


def empty_example(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """An all-padding example with zero weights (fills the last, partial eval batch)."""
    tokens = np.full((seq_len,), pad_id, dtype=np.int32)
    return {"inputs": tokens, "targets": tokens.copy(), "weights": np.zeros((seq_len,), np.float32)}
