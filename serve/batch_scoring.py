"""Batched scoring of whole sequences: power-of-two length buckets, one jitted forward per bucket."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.scoring import token_logprobs


def bucket_length(n: int, smallest: int = 16) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


def score_sequences(params, cfg, sequences: list[list[int]], engram_map, batch_size: int, progress=None
                    ) -> list[list[float | None]]:
    """Log-probs of each sequence, batched by length bucket, in input order."""
    results: list = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(bucket_length(len(sequences[i])), []).append(i)
    for length, members in groups.items():
        for k in range(0, len(members), batch_size):
            rows = members[k:k + batch_size]
            tokens = np.zeros((batch_size, length), np.int32)
            lengths = np.zeros((batch_size,), np.int32)
            for r, i in enumerate(rows):
                tokens[r, :len(sequences[i])] = sequences[i]
                lengths[r] = len(sequences[i])
            lp = np.asarray(token_logprobs(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), engram_map))
            for r, i in enumerate(rows):
                results[i] = [None] + [float(v) for v in lp[r, :len(sequences[i]) - 1]]
            if progress is not None:
                progress.update(len(rows))
    return results
