"""Whole-sequence passes from an empty state: per-token log-probs, and next-token logits.

Plain functions of static ``cfg`` and ``page_size``: callers jit them (serve/batch_scoring.py
compiles one program per padded shape through the engine's program cache)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from model.batch import Batch
from model.config import ModelConfig
from model.forward import forward
from model.state import init_state, state_dtype


def _prefill(params, cfg: ModelConfig, tokens, lengths, engram_map, page_size: int, logit_rows=None):
    """One ragged forward over right-padded rows ``tokens [B, L]`` of ``lengths [B]``, each its own request."""
    b, length = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    live = pos < lengths[:, None]
    seq_ids = jnp.where(live, jnp.arange(b, dtype=jnp.int32)[:, None], -1)
    batch = Batch(tokens.reshape(-1), seq_ids.reshape(-1), pos.reshape(-1))
    logits, _ = forward(params, cfg, init_state(cfg, b, length, page_size, state_dtype(params)), batch, engram_map,
                        logit_rows=logit_rows)
    return logits, live


def token_logprobs(params: dict, cfg: ModelConfig, tokens: jnp.ndarray, lengths: jnp.ndarray,
                   engram_map: jnp.ndarray | None = None, page_size: int = 16) -> jnp.ndarray:
    """``[B, L - 1]`` fp32: ``log p(tokens[b, t + 1] | tokens[b, :t + 1])``; rows past a length are 0."""
    b, length = tokens.shape
    logits, live = _prefill(params, cfg, tokens, lengths, engram_map, page_size)
    logp = jax.nn.log_softmax(logits.reshape(b, length, -1), axis=-1)[:, :-1]
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(live[:, 1:], picked, 0.0)


def last_logits(params: dict, cfg: ModelConfig, tokens: jnp.ndarray, lengths: jnp.ndarray,
                engram_map: jnp.ndarray | None = None, page_size: int = 16) -> jnp.ndarray:
    """``[B, V]`` fp32 next-token logits after each row's last token."""
    b, length = tokens.shape
    rows = jnp.arange(b, dtype=jnp.int32) * length + jnp.maximum(lengths - 1, 0)
    return _prefill(params, cfg, tokens, lengths, engram_map, page_size, rows)[0]
