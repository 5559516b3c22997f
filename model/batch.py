"""A ragged batch of new tokens and the per-step metadata every layer shares.

Contract: the tokens of one request slot are contiguous and in order, and their
positions continue that slot's ``seq_lens`` (``positions[t] = seq_lens[slot] + i``).
Padding tokens carry ``seq_ids == -1``; they read clamped rows and write nothing.

A ``StepInfo`` describes the rows a group of layers computes: all rows of the batch, or,
under decoder replay (MODEL_SPEC §5), only each request's last ``keep`` rows. A query's
window key at position ``q`` comes from this step's rows when ``q`` was computed in
this row set, from the ring when ``q`` precedes the step (and is not below the ring's
``window_floor``), and is missing otherwise.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
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
    valid: jnp.ndarray  # bool [R]
    slot: jnp.ndarray  # int32 [R], clamped to a real slot
    pos: jnp.ndarray  # int32 [R]
    start: jnp.ndarray  # int32 [R], first position of the row's request in this step
    end: jnp.ndarray  # int32 [R], the request's length after this step
    cached: jnp.ndarray  # int32 [R], tokens of the row's request whose compressed entries exist
    starts: jnp.ndarray  # int32 [B]
    ends: jnp.ndarray  # int32 [B]
    window_idx: jnp.ndarray  # int32 [R, W] rows of [rings (B x ring rows) ; computed rows (R)], -1 if missing
    rope: dict  # "main" / "compress": (cos, sin) [R, rope_dim // 2]

    def head(self, rows: int) -> "StepInfo":
        """The first ``rows`` rows (the request-indexed fields unchanged)."""
        per_row = self._replace(starts=None, ends=None)
        return jax.tree.map(lambda a: a[:rows], per_row)._replace(starts=self.starts, ends=self.ends)


def _info(cfg: ModelConfig, state: ModelState, valid, slot, pos, starts, ends, computed_from) -> StepInfo:
    """Metadata of ``R`` computed rows; ``computed_from`` [R] is the first step position computed
    in this row set for the row's request (rows of a request are contiguous and in order)."""
    w, ring, n_slots = cfg.sliding_window, state.ring_rows, state.batch_size
    back = jnp.arange(w, dtype=jnp.int32)
    src = pos[:, None] - back[None, :]
    r = jnp.arange(pos.shape[0], dtype=jnp.int32)[:, None]
    start = starts[slot]
    from_step = jnp.where(src >= computed_from[:, None], n_slots * ring + r - back[None, :], -1)
    from_ring = jnp.where(src >= state.window_floor[slot][:, None], slot[:, None] * ring + src % ring, -1)
    idx = jnp.where(src >= start[:, None], from_step, from_ring)
    window_idx = jnp.where((src >= 0) & valid[:, None], idx, -1)
    rope = {kind: cos_sin(jnp.asarray(inv_freq(cfg, kind)), pos) for kind in ("main", "compress")}
    return StepInfo(valid, slot, pos, start, ends[slot], state.cached_len[slot], starts, ends, window_idx, rope)


def step_info(cfg: ModelConfig, state: ModelState, batch: Batch) -> StepInfo:
    valid = batch.seq_ids >= 0
    slot = jnp.maximum(batch.seq_ids, 0)
    new_lens = jnp.zeros((state.batch_size,), jnp.int32).at[slot].add(valid.astype(jnp.int32))
    starts = state.seq_lens
    ends = starts + new_lens
    return _info(cfg, state, valid, slot, batch.positions, starts, ends, starts[slot])


def replay_rows(cfg: ModelConfig, state: ModelState, full: StepInfo, keep: int, rows: int
                ) -> tuple[StepInfo, jnp.ndarray]:
    """The last ``keep`` rows of every request, packed into ``rows`` slots: ``(info, source row [rows])``.

    Source rows are -1 for padding; ``rows`` must hold every kept row (the caller's bucket).
    The packing is a prefix: the first ``r`` of ``rows`` slots are the packing into ``r``.
    """
    kept = full.valid & (full.pos >= full.end - keep)
    order = jnp.argsort(~kept, stable=True)[:rows]  # kept rows first, in batch order
    order = jnp.pad(order, (0, rows - order.shape[0]))  # more slots than rows: padding
    ok = kept[order] & (jnp.arange(rows) < kept.shape[0])
    src = jnp.where(ok, order, -1)
    slot, pos = full.slot[order], full.pos[order]
    computed_from = jnp.maximum(full.starts, full.ends - keep)[slot]
    return _info(cfg, state, ok, slot, pos, full.starts, full.ends, computed_from), src


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
