"""MegaAttention: sparse multi-query attention with a per-head sink over gathered K=V rows.

Signature (one per ragged batch of query tokens)::

    attention(q [T, H, D], cos, sin [T, r/2], window_kv [Nw, D], window_idx [T, W],
              comp_kv [Nc, D] | None, comp_idx [T, K] | None, sink [H], scale) -> [T, H, D]

Each query reads its sliding window and its top-k compressed entries through row
indices into two pools (``-1`` marks an empty slot), so the same signature serves ragged
prefill, decode and speculative verification, and paged or ring storage. As in FlashMLA's
fused V4.1 kernel the op rotates the trailing RoPE slice of ``q`` itself and applies the
inverse rotation to the output (K = V carries its rotation; MODEL_SPEC §3.6). The sink
only enlarges the softmax denominator, so fully masked rows stay finite.
"""
from __future__ import annotations

import jax.numpy as jnp

from mega.primitives import HIGHEST, apply_rope


def attention(q: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, window_kv: jnp.ndarray,
              window_idx: jnp.ndarray, comp_kv: jnp.ndarray | None, comp_idx: jnp.ndarray | None,
              sink: jnp.ndarray, scale: float) -> jnp.ndarray:
    q = apply_rope(q, cos[:, None], sin[:, None])
    keys, idx = window_kv[jnp.maximum(window_idx, 0)], window_idx
    if comp_kv is not None:
        keys = jnp.concatenate([keys, comp_kv[jnp.maximum(comp_idx, 0)].astype(keys.dtype)], axis=1)
        idx = jnp.concatenate([idx, comp_idx], axis=1)
    keys = keys.astype(jnp.float32)
    logits = jnp.einsum("thd,tsd->ths", q.astype(jnp.float32), keys, precision=HIGHEST) * scale
    logits = jnp.where((idx >= 0)[:, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, :]
    m = jnp.maximum(logits.max(-1), sink)
    p = jnp.exp(logits - m[..., None])
    den = jnp.exp(sink - m) + p.sum(-1)
    out = jnp.einsum("ths,tsd->thd", p / den[..., None], keys, precision=HIGHEST)
    return apply_rope(out.astype(q.dtype), cos[:, None], sin[:, None], inverse=True)
