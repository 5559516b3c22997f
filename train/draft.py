"""Stage two: the DSpark draft (``params["mtp"]``) on the frozen target, with a block objective.

Per sequence, ``K`` anchors ``a`` are drawn (``anchored``). The target's forward over the
sequence gives the DSpark taps at every position and its own next-token distributions; each
draft layer turns the taps into context KV (``model.dspark.context_kv``), and a block
``[token a, noise x (B - 1)]`` at positions ``a .. a+B-1`` runs through the draft exactly as
``model.dspark.propose`` runs it at serve time (context below ``a`` within the window, the block
both ways: the same ``draft_hidden`` and ``slot_head``). Slot ``i`` is taught the target's
distribution at position ``a+i+1`` (soft cross-entropy: acceptance is agreement with the
target, not with the text), with the Markov head fed the text's token at ``a+i``, which is
what the draft feeds itself whenever the slots before were accepted. Slot losses decay by
``exp(-i / decay)`` (a later slot only counts if the earlier ones were accepted). The
confidence head learns, by logistic loss, whether the slot's greedy token is the target's.

``greedy_accept`` (a metric) is the mean accepted length a block would get under greedy
verification: the sum over slots of the product of agreements up to each.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from model.config import ModelConfig
from model.dspark import context_kv, draft_hidden, slot_head
from model.forward import forward
from train.target import fresh_state, packed


def anchored(tokens: np.ndarray, k: int, block: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, anchors [B, k])``: ``k`` distinct anchors per sequence in ``[1, L - block]``."""
    n = tokens.shape[1] - 1
    anchors = np.stack([np.sort(rng.choice(np.arange(1, n - block + 1), k, replace=False))
                        for _ in range(tokens.shape[0])])
    return tokens, anchors.astype(np.int32)


def _block_index(cfg: ModelConfig, seq_len: int, anchors: jnp.ndarray, block: int):
    """``[N*B, W+B]`` rows of ``[context (B_seq x seq_len rows) ; block rows]`` each block query
    reads, and the block rows' positions (N = every anchor of every sequence)."""
    w = cfg.sliding_window
    n_seq, k = anchors.shape
    seq = jnp.repeat(jnp.arange(n_seq, dtype=jnp.int32), k * block)
    anchor = jnp.repeat(anchors.reshape(-1), block)
    pos = anchor + jnp.tile(jnp.arange(block, dtype=jnp.int32), n_seq * k)
    src = pos[:, None] - jnp.arange(w, dtype=jnp.int32)[None, :]
    ctx = jnp.where((src < anchor[:, None]) & (src >= 0), seq[:, None] * seq_len + src, -1)
    own = n_seq * seq_len + (jnp.arange(pos.shape[0], dtype=jnp.int32) // block * block)[:, None] + jnp.arange(block)
    return jnp.concatenate([ctx, own], axis=1), pos


def block_logits(mtp: dict, target: dict, cfg: ModelConfig, engram_map, tokens: jnp.ndarray,
                 anchors: jnp.ndarray):
    """Per block slot ``[N, B, ...]``: the draft's logits (its Markov head fed the text), its
    confidence logit, and the target's logits for the same position (no gradient)."""
    b = cfg.dspark_block_size
    n_seq, n = tokens.shape[0], tokens.shape[1] - 1
    # the target's distribution for the token after each block slot: rows a+i of the packed step
    rows = (jnp.arange(n_seq, dtype=jnp.int32)[:, None, None] * n + anchors[:, :, None]
            + jnp.arange(b, dtype=jnp.int32)).reshape(-1)
    t_logits, _, taps = forward(target, cfg, fresh_state(cfg, n_seq, n), packed(tokens), engram_map,
                                logit_rows=rows, taps=True)
    t_logits, aux = jax.lax.stop_gradient((t_logits, taps.aux))
    contexts = context_kv(mtp, cfg, aux, taps.info.pos)
    idx, pos = _block_index(cfg, n, anchors, b)
    seq_tok = jnp.take_along_axis(tokens, pos.reshape(n_seq, -1), axis=1).reshape(-1)
    block_tok = jnp.where(jnp.arange(pos.shape[0]) % b == 0, seq_tok, cfg.dspark_noise_token_id)
    params = {**target, "mtp": mtp}
    hidden = draft_hidden(params, cfg, block_tok, pos, contexts, idx).reshape(-1, b, cfg.hidden_size)
    prev = seq_tok.reshape(-1, b)   # the text's token at a+i, before slot i's prediction
    slots = [slot_head(params, hidden[:, i], prev[:, i]) for i in range(b)]
    return (jnp.stack([x[0] for x in slots], 1), jnp.stack([x[1] for x in slots], 1),
            t_logits.reshape(-1, b, t_logits.shape[-1]))


def loss_fn(cfg: ModelConfig, engram_map, decay: float = 2.0):
    def loss(mtp, target, batch):
        tokens, anchors = batch
        logits, conf, t_logits = block_logits(mtp, target, cfg, engram_map, tokens, anchors)
        ce = optax.softmax_cross_entropy(logits, jax.nn.softmax(t_logits))
        agree = jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)
        w = jnp.exp(-jnp.arange(ce.shape[1], dtype=jnp.float32) / decay)
        block = (ce * w).sum(1).mean() / w.sum()
        confidence = optax.sigmoid_binary_cross_entropy(conf, agree.astype(jnp.float32)).mean()
        metrics = {"block_ce": block, "confidence_bce": confidence,
                   "greedy_accept": jnp.cumprod(agree, axis=1).sum(1).mean(),
                   "slot0_agree": agree[:, 0].mean()}
        return block + confidence, metrics
    return loss
