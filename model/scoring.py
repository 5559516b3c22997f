"""Per-token log-probabilities of whole sequences: the pure function behind batch scoring."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from model.batch import Batch
from model.config import ModelConfig
from model.forward import forward
from model.state import init_state


@partial(jax.jit, static_argnames=("cfg", "page_size"))
def token_logprobs(params: dict, cfg: ModelConfig, tokens: jnp.ndarray, lengths: jnp.ndarray,
                   engram_map: jnp.ndarray | None = None, page_size: int = 16) -> jnp.ndarray:
    """``[B, L - 1]`` fp32: ``log p(tokens[b, t + 1] | tokens[b, :t + 1])``; rows past a length are 0.

    ``tokens [B, L]`` holds right-padded sequences of ``lengths [B]``; each row is one request
    prefilled from an empty state in a single ragged forward.
    """
    b, length = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    live = pos < lengths[:, None]
    seq_ids = jnp.where(live, jnp.arange(b, dtype=jnp.int32)[:, None], -1)
    batch = Batch(tokens.reshape(-1), seq_ids.reshape(-1), pos.reshape(-1))
    state = init_state(cfg, b, length, page_size=page_size)
    logits, _ = forward(params, cfg, state, batch, engram_map)
    logp = jax.nn.log_softmax(logits.reshape(b, length, -1), axis=-1)[:, :-1]
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(live[:, 1:], picked, 0.0)
