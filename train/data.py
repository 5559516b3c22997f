"""Training batches as a grain ``MapDataset``: random access by step, so a resumed run reads on
from the step its checkpoint holds, with no iterator state to save.

The token stream is cut into windows of ``seq_len + 1`` tokens at stride ``seq_len`` (the input
and its next-token labels); the windows are shuffled per epoch by ``seed`` and batched, and the
epochs repeat without end.
"""
from __future__ import annotations

import grain
import numpy as np


def windows(tokens: np.ndarray, seq_len: int) -> int:
    return (tokens.size - 1) // seq_len


def batches(tokens: np.ndarray, seq_len: int, batch: int, seed: int = 0) -> grain.MapDataset:
    """``ds[step]``: int32 ``[batch, seq_len + 1]``."""
    n = windows(tokens, seq_len)
    if n < batch:
        raise ValueError(f"{tokens.size} tokens make {n} windows of {seq_len + 1}, fewer than a batch of {batch}")

    def window(i: int) -> np.ndarray:
        return tokens[i * seq_len:(i + 1) * seq_len + 1]

    return grain.MapDataset.range(n).shuffle(seed=seed).map(window).batch(batch, drop_remainder=True).repeat(None)
