"""DSpark speculative decoding inside the engine's step (MODEL_SPEC §7).

A speculative request's decode chunk is ``[anchor, d_0 .. d_{L-2}]``: its last token and the
drafts the previous step proposed, fed as ordinary tokens. The step samples each of those
rows as it samples any token (``serve.sampling``: by the request's seed and the token's
position), then, here:

* **acceptance**: draft ``d_j`` stands while it equals the target's sample of the row before
  it; the first target sample that differs (or the last row's) is the bonus token. Each
  output token is therefore the target's own sample at its position given the accepted
  prefix, so outputs equal the non-speculative ones token for token, greedy or sampled, and
  their distribution is exactly the target's. (This is verification by coupling: the draft
  samples with the target's noise, keyed by seed and position, so that it agrees whenever
  it can; the coupling rejects a little more often than Leviathan-style rejection sampling,
  and in exchange composes with every sampling parameter, grammar and ban unchanged.)
* **rollback**: the request's length is cut to ``anchor + accepted + 1``. What the rejected
  rows wrote stays where nothing reads it (``model.state``: the rings keep ``spec_tokens``
  rows of slack, the ratio-2 tails a ring of groups, and compressed entries past the length
  are rewritten before any query can see them); the Engram look-back is recomputed from the
  accepted tokens.
* **proposal**: the draft runs on every speculative request that sampled this step (a
  verify, or a prompt's last chunk), anchored at its bonus token (``model.dspark.propose``),
  and the drafts go back to the host with the accepted counts.

A benchmark mode may replace the accepted count by a simulated one (``simulate``: a mean
accept length per step, bonus included), as SGLang's ``SGLANG_SIMULATE_ACC_LEN`` does.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.dspark import propose
from model.engram_hash import DEAD
from model.state import ModelState
from serve.sampling import SamplingArrays, sample


class SpecInput(NamedTuple):
    """The step's speculative requests, ``[Bs]`` each (padding: ``slot`` -1)."""

    slot: jnp.ndarray  # int32: the request's slot
    first: jnp.ndarray  # int32: its first logit row (its anchor's row)
    count: jnp.ndarray  # int32: its logit rows, 1 + the drafts it verifies


def accepted(spec: SpecInput, fed: jnp.ndarray, sampled: jnp.ndarray, positions: jnp.ndarray,
             simulate: float | None) -> jnp.ndarray:
    """``[Bs]`` drafts accepted: leading rows whose fed draft equals the previous row's sample
    (``fed``, ``sampled``, ``positions``: per logit row)."""
    n = fed.shape[0]
    j = jnp.arange(n, dtype=jnp.int32)[None, :] - spec.first[:, None]   # [Bs, S]: row j of the request
    inside = (j >= 1) & (j < spec.count[:, None])
    match = jnp.roll(sampled, 1)[None, :] == fed[None, :]   # row r's draft against row r-1's sample
    miss = inside & ~match
    k = jnp.where(miss.any(1), jnp.argmax(miss, 1) - spec.first, spec.count) - 1
    k = jnp.clip(k, 0, jnp.maximum(spec.count - 1, 0)).astype(jnp.int32)
    if simulate is None:
        return k
    pos = positions[jnp.clip(spec.first, 0, n - 1)]
    whole = int(simulate) - 1   # the bonus counts: simulate - 1 drafts on average
    coin = jax.vmap(lambda p: jax.random.uniform(jax.random.key(p)))(pos) < simulate - int(simulate)
    return jnp.minimum(whole + coin.astype(jnp.int32), jnp.maximum(spec.count - 1, 0)).astype(jnp.int32)


def _lookback(old: jnp.ndarray, fed_comp: jnp.ndarray, spec: SpecInput, k: jnp.ndarray, rows: int) -> jnp.ndarray:
    """``[Bs, n-1]`` Engram look-back after a verify cut at ``anchor + k``: the last ``n-1``
    compressed ids of ``old`` (before the anchor) followed by the chunk's accepted ones
    (``rows``: the most rows a chunk has)."""
    h = old.shape[1]
    seq = jnp.concatenate([old[jnp.maximum(spec.slot, 0)],
                           fed_comp[jnp.clip(spec.first[:, None] + jnp.arange(rows)[None, :], 0,
                                             fed_comp.shape[0] - 1)]], axis=1)   # [Bs, h + rows]
    take = k[:, None] + 1 + jnp.arange(h)[None, :]
    return jnp.take_along_axis(seq, take, axis=1)


def speculate(params: dict, cfg: ModelConfig, state: ModelState, old_hist: jnp.ndarray, fed: jnp.ndarray,
              positions: jnp.ndarray, sampled: jnp.ndarray, spec: SpecInput, sampling: SamplingArrays,
              engram_map, num_drafts: int, simulate: float | None):
    """``(state, bonus tokens [Bs], rows [Bs, 1 + num_drafts])``: acceptance, rollback and the
    next proposal for the step's speculative requests (per logit row: ``fed`` tokens, their
    ``positions``, the ``sampled`` tokens; ``old_hist``: the look-back before the step)."""
    n = fed.shape[0]
    k = accepted(spec, fed, sampled, positions, simulate)
    row = jnp.clip(spec.first + k, 0, n - 1)
    bonus, anchor_pos = sampled[row], positions[row] + 1
    live = spec.slot >= 0
    verified = live & (spec.count > 1)   # a prompt's last chunk needs no rollback
    cut = jnp.where(verified, spec.slot, state.batch_size)
    state = state.replace(seq_lens=state.seq_lens.at[cut].set(anchor_pos, mode="drop"))
    if old_hist.shape[1]:
        fed_comp = jnp.where(fed >= 0, engram_map[jnp.maximum(fed, 0)], DEAD)
        state = state.replace(engram_hist=state.engram_hist.at[cut].set(_lookback(old_hist, fed_comp, spec, k, num_drafts + 1),
                                                                         mode="drop"))
    mine = jax.tree.map(lambda a: a[jnp.clip(spec.first, 0, n - 1)], sampling)
    mine = mine._replace(repetition_penalty=jnp.ones_like(mine.repetition_penalty),
                         frequency_penalty=jnp.zeros_like(mine.frequency_penalty),
                         presence_penalty=jnp.zeros_like(mine.presence_penalty))
    v = cfg.vocab_size
    no_counts, no_prompt = jnp.zeros((k.shape[0], v), jnp.int32), jnp.zeros((k.shape[0], v), bool)

    def sample_slot(i, logits):   # block slot i: the token at anchor_pos + i + 1, sampled as the target would
        return sample(logits, mine._replace(step=anchor_pos + i + 1), no_counts, no_prompt).tokens

    drafts = propose(params, cfg, state, bonus, anchor_pos, jnp.where(live, spec.slot, -1), num_drafts,
                     sample_slot).drafts
    return state, bonus, jnp.concatenate([k[:, None], drafts], axis=1)
