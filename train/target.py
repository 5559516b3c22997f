"""Stage one: the V4.1 backbone as a next-token language model.

A batch ``[B, L + 1]`` is B fresh sequences in one packed prefill step of ``model.forward``
(each its own slot of a fresh ``ModelState``), so training runs the served forward: mHC, the
KV sources' compressed attention with the indexer's top-k, MoE and Engram. Everything is in
float32, so every ``mega`` operator takes its differentiable jnp reference. The indexer's
selection is discrete (no gradient reaches the indexer through top-k), as in the released model's
main loss; its keys still learn through the compressed attention they share nothing with, so the
indexer here keeps its initialisation's ranking quality (say so in the card).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from model.batch import Batch
from model.config import ModelConfig
from model.forward import forward
from model.state import init_state

PAGE = 16


def packed(tokens: jnp.ndarray) -> Batch:
    """Inputs ``tokens[:, :-1]`` as one step: sequence b in slot b from position 0."""
    b, n = tokens.shape[0], tokens.shape[1] - 1
    return Batch(tokens[:, :-1].reshape(-1), jnp.repeat(jnp.arange(b, dtype=jnp.int32), n),
                 jnp.tile(jnp.arange(n, dtype=jnp.int32), b))


def fresh_state(cfg: ModelConfig, batch: int, seq_len: int):
    return init_state(cfg, batch, seq_len, page_size=PAGE)


def nll(params: dict, cfg: ModelConfig, tokens: jnp.ndarray, engram_map, taps: bool = False):
    """Per-token negative log-likelihood ``[B * L]`` of ``tokens[:, 1:]`` (and with ``taps`` the
    forward's DSpark taps)."""
    out = forward(params, cfg, fresh_state(cfg, tokens.shape[0], tokens.shape[1] - 1), packed(tokens), engram_map,
                  taps=taps)
    losses = optax.softmax_cross_entropy_with_integer_labels(out[0], tokens[:, 1:].reshape(-1))
    return (losses, out[2]) if taps else losses


def loss_fn(cfg: ModelConfig, engram_map):
    def loss(params, frozen, tokens):
        return nll(params, cfg, tokens, engram_map).mean(), {}
    return loss


def scored(heldout: np.ndarray) -> np.ndarray:
    return heldout[heldout.size // 2:]


def ngram_perplexities(train: np.ndarray, heldout: np.ndarray, vocab: int) -> dict[str, float]:
    """The card's baselines on ``scored(heldout)``: an add-one unigram, and a bigram interpolated
    with it (its weight fitted on the other half)."""
    uni = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    uni /= uni.sum()
    pairs = train[:-1].astype(np.int64) * vocab + train[1:]
    keys, counts = np.unique(pairs, return_counts=True)
    prev_count = np.bincount(train[:-1], minlength=vocab).astype(np.float64)

    def bigram(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        k = a.astype(np.int64) * vocab + b
        at = np.clip(np.searchsorted(keys, k), 0, keys.size - 1)
        c = np.where(keys[at] == k, counts[at], 0)
        return np.where(prev_count[a] > 0, c / np.maximum(prev_count[a], 1), 0.0)

    fit, score = heldout[:heldout.size // 2], scored(heldout)
    best = max(np.linspace(0.05, 0.95, 19),
               key=lambda lam: np.log(lam * bigram(fit[:-1], fit[1:]) + (1 - lam) * uni[fit[1:]]).mean())
    p_bi = best * bigram(score[:-1], score[1:]) + (1 - best) * uni[score[1:]]
    return {"unigram": float(np.exp(-np.log(uni[score[1:]]).mean())), "bigram": float(np.exp(-np.log(p_bi).mean())),
            "bigram_weight": float(best)}
