"""A ragged batch of new tokens and the per-step metadata every layer shares.

Contract: the tokens of one request slot are contiguous and in order, and their
positions continue that slot's ``seq_lens`` (``positions[t] = seq_lens[slot] + i``).
Padding tokens carry ``seq_ids == -1``; they read clamped rows and write nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.rope import cos_sin, inv_freq
from model.state import ModelState


class Batch(NamedTuple):
    tokens: jnp.ndarray  # int32 [T]
    seq_ids: jnp.ndarray  # int32 [T], slot of each token, -1 for padding
    positions: jnp.ndarray  # int32 [T], absolute positions


class StepInfo(NamedTuple):
    valid: jnp.ndarray  # bool [T]
    slot: jnp.ndarray  # int32 [T], clamped to a real slot
    pos: jnp.ndarray  # int32 [T]
    start: jnp.ndarray  # int32 [T], first position of the token's request in this step
    end: jnp.ndarray  # int32 [T], the request's length after this step
    starts: jnp.ndarray  # int32 [B]
    ends: jnp.ndarray  # int32 [B]
    window_idx: jnp.ndarray  # int32 [T, W] rows of [ring (B*W) ; step kv (T)], -1 if empty
    rope: dict  # "main" / "compress": (cos, sin) [T, rope_dim // 2]


def step_info(cfg: ModelConfig, state: ModelState, batch: Batch) -> StepInfo:
    valid = batch.seq_ids >= 0
    slot = jnp.maximum(batch.seq_ids, 0)
    n_slots = state.batch_size
    new_lens = jnp.zeros((n_slots,), jnp.int32).at[slot].add(valid.astype(jnp.int32))
    starts = state.seq_lens
    ends = starts + new_lens
    pos = batch.positions
    w = cfg.sliding_window
    back = jnp.arange(w, dtype=jnp.int32)
    src = pos[:, None] - back[None, :]
    t = jnp.arange(pos.shape[0], dtype=jnp.int32)[:, None]
    in_step = src >= starts[slot][:, None]
    idx = jnp.where(in_step, n_slots * w + t - back[None, :], slot[:, None] * w + src % w)
    window_idx = jnp.where((src >= 0) & valid[:, None], idx, -1)
    rope = {kind: cos_sin(jnp.asarray(inv_freq(cfg, kind)), pos) for kind in ("main", "compress")}
    return StepInfo(valid, slot, pos, starts[slot], ends[slot], starts, ends, window_idx, rope)


def pack_requests(requests: list[tuple[int, list[int], int]], pad_to: int | None = None) -> Batch:
    """Host helper: ``[(slot, new token ids, first position)]`` -> a padded ``Batch``."""
    tokens, seq_ids, positions = [], [], []
    for slot, ids, start in requests:
        tokens += list(ids)
        seq_ids += [slot] * len(ids)
        positions += list(range(start, start + len(ids)))
    n = len(tokens) if pad_to is None else pad_to
    if n < len(tokens):
        raise ValueError(f"{len(tokens)} tokens do not fit a batch of {n}")
    pad = n - len(tokens)
    return Batch(np.asarray(tokens + [0] * pad, np.int32), np.asarray(seq_ids + [-1] * pad, np.int32),
                 np.asarray(positions + [0] * pad, np.int32))
