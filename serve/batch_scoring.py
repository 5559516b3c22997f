"""Batched whole-sequence passes: power-of-two length buckets, one compiled forward per bucket,
held in the runner's program cache like the step programs (serve/programs.py)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.scoring import last_logits, token_logprobs


def bucket_length(n: int, smallest: int = 16) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


MAX_TOKENS = 4096  # tokens of one forward: 8 x 8,192 rows in one took 17.7 GB (bench/RESULTS.md)


def _bucketed(sequences: list[list[int]], batch_size: int):
    """``(members, tokens [rows, L], lengths)`` per padded batch, shortest sequences first; a
    batch holds ``batch_size`` rows, fewer where they would pass ``MAX_TOKENS``."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(bucket_length(len(sequences[i])), []).append(i)
    for length, members in groups.items():
        per_batch = min(batch_size, max(1, MAX_TOKENS // length))
        for k in range(0, len(members), per_batch):
            rows = members[k:k + per_batch]
            tokens = np.zeros((per_batch, length), np.int32)
            lengths = np.zeros((per_batch,), np.int32)
            for r, i in enumerate(rows):
                tokens[r, :len(sequences[i])] = sequences[i]
                lengths[r] = len(sequences[i])
            yield rows, jnp.asarray(tokens), jnp.asarray(lengths)


def _run(runner, fn, tokens, lengths):
    """``fn`` (model.scoring) on one padded batch, through the program held for its shape."""
    def program(params, tokens, lengths, engram_map, *, cfg):
        return fn(params, cfg, tokens, lengths, engram_map)

    return runner.programs.run((fn.__name__, runner.signature, tokens.shape), program,
                               (runner.params, tokens, lengths, runner.engram_map), dict(cfg=runner.cfg))


def score_sequences(runner, sequences: list[list[int]], batch_size: int, progress=None) -> list[list[float | None]]:
    """Log-probs of each sequence's tokens (the first is None), in input order."""
    results: list = [None] * len(sequences)
    for rows, tokens, lengths in _bucketed(sequences, batch_size):
        lp = np.asarray(_run(runner, token_logprobs, tokens, lengths))
        for r, i in enumerate(rows):
            results[i] = [None] + [float(v) for v in lp[r, :len(sequences[i]) - 1]]
        if progress is not None:
            progress.update(len(rows))
    return results


def next_token_logits(runner, sequences: list[list[int]], batch_size: int) -> np.ndarray:
    """``[len(sequences), V]`` logits after each sequence, in input order."""
    out = np.zeros((len(sequences), runner.cfg.vocab_size), np.float32)
    for rows, tokens, lengths in _bucketed(sequences, batch_size):
        logits = np.asarray(_run(runner, last_logits, tokens, lengths))
        out[rows] = logits[:len(rows)]
    return out
