"""Batched whole-sequence passes over a ``LoadedModel``: power-of-two length buckets, one
compiled forward per bucket, held in a program cache (serve/programs.py: the engine's, when it
scores for ``/v1/score``). No KV pool: each sequence runs whole from an empty state."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.scoring import last_logits, token_logprobs
from serve.loaded_model import LoadedModel
from serve.programs import ProgramCache, shared_programs
from serve.runner import Signature


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


class Scorer:
    def __init__(self, model: LoadedModel, programs: ProgramCache | None = None):
        self.model, self.programs = model, programs or shared_programs()
        self.signature = Signature.of(model.cfg, 0, model.params, model.engram_map)

    def _run(self, fn, tokens, lengths):
        """``fn`` (model.scoring) on one padded batch, through the program held for its shape."""
        def program(params, tokens, lengths, engram_map, *, cfg):
            return fn(params, cfg, tokens, lengths, engram_map)

        m = self.model
        return self.programs.run((fn.__name__, self.signature, tokens.shape), program,
                                 (m.params, tokens, lengths, m.engram_map), dict(cfg=m.cfg))

    def score(self, sequences: list[list[int]], batch_size: int = 8, progress=None) -> list[list[float | None]]:
        """Log-probs of each sequence's tokens (the first is None), in input order."""
        results: list = [None] * len(sequences)
        for rows, tokens, lengths in _bucketed(sequences, batch_size):
            lp = np.asarray(self._run(token_logprobs, tokens, lengths))
            for r, i in enumerate(rows):
                results[i] = [None] + [float(v) for v in lp[r, :len(sequences[i]) - 1]]
            if progress is not None:
                progress.update(len(rows))
        return results

    def last_logits(self, sequences: list[list[int]], batch_size: int = 8) -> np.ndarray:
        """``[len(sequences), V]`` logits after each sequence, in input order."""
        out = np.zeros((len(sequences), self.model.cfg.vocab_size), np.float32)
        for rows, tokens, lengths in _bucketed(sequences, batch_size):
            logits = np.asarray(self._run(last_logits, tokens, lengths))
            out[rows] = logits[:len(rows)]
        return out
