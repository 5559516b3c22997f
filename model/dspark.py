"""DSpark, V4.1's block draft (MODEL_SPEC §7), as pure functions over ``params["mtp"]``.

* ``write_context``: the draft's context from a target step. ``u = main_norm(main_proj(
  [aux_l for l in dspark_target_layer_ids]))``, where ``aux_l`` is the mean over the streams
  entering target layer ``l`` (``forward``'s ``taps``); each draft layer turns ``u`` into
  window KV with its own ``wkv``, ``kv_norm``, main RoPE and the FP8 quantiser, written into
  its ring (``ModelState.draft_window``) at the context positions.
* ``propose``: per request a block ``[anchor, noise x (B - 1)]`` at positions ``a .. a+B-1``
  through the three draft layers (mHC, sink attention, MoE with the draft's experts). Each
  block query sees the context below the anchor within its window and the whole block, both
  ways. The final collapse (with the last FFN pre-mix), the draft's norm and the shared
  ``lm_head`` give base logits per block slot, slot ``i`` predicting position ``a+i+1``.
  The Markov stage then runs in order: ``prev = anchor``; ``logits_i = base_i +
  markov_head(markov_embed[prev])``; ``d_i`` is sampled the way the target samples position
  ``a+i+1`` (its parameters and its noise, keyed by seed and position: ``serve.sampling``),
  so a draft that agrees with the target is the token the target itself would sample there;
  ``prev = d_i``. The confidence head, ``sigmoid(proj([hidden_i, markov_embed[prev_i]]))``,
  estimates each slot's chance of acceptance.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mega.attention import attention
from mega.mhc import Update, mhc_step
from mega.moe import MoeSpec
from mega.primitives import linear, rms_norm
from model import quant
from model.attention import output, queries, window_kv
from model.batch import StepInfo
from model.config import ModelConfig
from model.forward import hc_options
from model.rope import cos_sin, inv_freq
from sharding.expert_parallel import moe
from model.state import ModelState


class Proposal(NamedTuple):
    drafts: jnp.ndarray  # int32 [S, N]: the tokens proposed for positions a+1 .. a+N
    confidence: jnp.ndarray  # f32 [S, N]


def draft_moe_spec(cfg: ModelConfig) -> MoeSpec:
    return MoeSpec(cfg.dspark_num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.gate_temp,
                   cfg.norm_topk_prob, cfg.expert_activations == "fp8", cfg.expert_routing == "balanced")


def _main_rope(cfg: ModelConfig, positions: jnp.ndarray):
    return cos_sin(jnp.asarray(inv_freq(cfg, "main")), positions)


def context_kv(mtp: dict, cfg: ModelConfig, aux: jnp.ndarray, positions: jnp.ndarray) -> list[jnp.ndarray]:
    """Each draft layer's window KV ``[R, head_dim]`` of context rows ``aux [R, taps, D]``."""
    u = rms_norm(linear(aux.reshape(aux.shape[0], -1), mtp["main_proj"]).astype(aux.dtype), mtp["main_norm"],
                 cfg.rms_norm_eps)
    cos, sin = _main_rope(cfg, positions)
    return [quant.fp8_block32(window_kv(u, lp["attn"], cfg, cos, sin)) for lp in mtp["layers"]]


def write_context(mtp: dict, cfg: ModelConfig, rings: tuple, aux: jnp.ndarray, info: StepInfo) -> tuple:
    """The draft rings with the context of a step's rows (``info``: their slots and positions;
    each request's last ring-length rows are written, at ``pos % ring rows``)."""
    n_slots, ring = rings[0].shape[:2]
    keep = info.valid & (info.pos >= info.end - ring)
    at = (jnp.where(keep, info.slot, n_slots), info.pos % ring)
    return tuple(r.at[at].set(kv.astype(r.dtype), mode="drop")
                 for r, kv in zip(rings, context_kv(mtp, cfg, aux, info.pos)))


def _block_index(cfg: ModelConfig, state: ModelState, slots: jnp.ndarray, anchor_pos: jnp.ndarray, block: int):
    """``[S*B, W+B]`` rows of [rings (slots x ring rows) ; block rows (S*B)] each block query reads:
    its window's context below the anchor, then every row of its block (-1: none)."""
    w, ring, n_slots = cfg.sliding_window, state.ring_rows, state.batch_size
    s = slots.shape[0]
    slot = jnp.repeat(jnp.maximum(slots, 0), block)
    anchor = jnp.repeat(anchor_pos, block)
    pos = anchor + jnp.tile(jnp.arange(block, dtype=jnp.int32), s)
    src = pos[:, None] - jnp.arange(w, dtype=jnp.int32)[None, :]
    seen = (src < anchor[:, None]) & (src >= 0) & (src >= state.window_floor[slot][:, None])
    ctx = jnp.where(seen, slot[:, None] * ring + src % ring, -1)
    own = n_slots * ring + (jnp.arange(s * block, dtype=jnp.int32) // block * block)[:, None] + jnp.arange(block)
    live = jnp.repeat(slots >= 0, block)[:, None]
    return jnp.where(live, jnp.concatenate([ctx, own], axis=1), -1), pos


def draft_hidden(params: dict, cfg: ModelConfig, tokens: jnp.ndarray, pos: jnp.ndarray, contexts: list,
                 idx: jnp.ndarray) -> jnp.ndarray:
    """The draft's final hidden state ``[R, D]`` of block rows ``tokens [R]`` at ``pos [R]``: row
    ``r`` attends to rows ``idx[r]`` (-1: none) of ``[contexts[l] ; the block rows' own KV]``,
    where ``contexts[l] [C, head_dim]`` is draft layer ``l``'s context KV."""
    mtp, hd, hc = params["mtp"], cfg.head_dim, cfg.hc_mult
    cos, sin = _main_rope(cfg, pos)
    x0 = params["embed"][tokens]
    residual, update = jnp.repeat(x0[:, None, :], hc, axis=1), None
    pre = jnp.zeros((tokens.shape[0], hc), jnp.float32).at[:, 0].set(1.0)
    spec, opts = draft_moe_spec(cfg), hc_options(cfg)
    for lp, ctx in zip(mtp["layers"], contexts):
        residual, x, attn_mix = mhc_step(residual, update, lp["hc_attn"], pre, lp["attn_norm"], **opts)
        _, q = queries(x, lp["attn"], cfg)
        block_kv = quant.fp8_block32(window_kv(x, lp["attn"], cfg, cos, sin))
        pool = jnp.concatenate([ctx.reshape(-1, hd), block_kv.astype(ctx.dtype)])
        o = attention(q, cos, sin, pool, idx, None, None, lp["attn"]["sink"], hd ** -0.5)
        y = output(o, lp["attn"], cfg, x.dtype)
        residual, x, ffn_mix = mhc_step(residual, Update(y, attn_mix.post, attn_mix.comb), lp["hc_ffn"],
                                        attn_mix.pre, lp["ffn_norm"], **opts)
        update, pre = Update(moe(x, lp["moe"], spec), ffn_mix.post, ffn_mix.comb), ffn_mix.pre
    return mhc_step(residual, update, None, pre, mtp["norm"], **opts)[1]


def slot_head(params: dict, hidden: jnp.ndarray, prev: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """A block slot's logits ``[S, V]`` (the shared head plus the Markov head of the token before
    it, ``prev [S]``) and its confidence logit ``[S]``."""
    mtp = params["mtp"]
    m = mtp["markov_embed"][prev]
    logits = linear(hidden, params["lm_head"]) + linear(m, mtp["markov_head"])
    conf = linear(jnp.concatenate([hidden, m.astype(hidden.dtype)], -1), mtp["confidence"])[:, 0]
    return logits, conf


def propose(params: dict, cfg: ModelConfig, state: ModelState, anchors: jnp.ndarray, anchor_pos: jnp.ndarray,
            slots: jnp.ndarray, num_drafts: int, sample_slot) -> Proposal:
    """Drafts for requests in ``slots [S]`` (-1: padding) whose last token ``anchors [S]`` sits at
    ``anchor_pos [S]``. ``sample_slot(i, logits [S, V]) -> [S]`` samples block slot ``i`` (the
    token at ``anchor_pos + i + 1``) as the target would."""
    b, s = cfg.dspark_block_size, slots.shape[0]
    idx, pos = _block_index(cfg, state, slots, anchor_pos, b)
    tokens = jnp.where(jnp.arange(s * b) % b == 0, jnp.repeat(anchors, b), cfg.dspark_noise_token_id)
    hidden = draft_hidden(params, cfg, tokens, pos, list(state.draft_window), idx).reshape(s, b, -1)
    drafts, confidence, prev = [], [], anchors
    for i in range(num_drafts):
        logits, conf = slot_head(params, hidden[:, i], prev)
        prev = sample_slot(i, logits)
        drafts.append(prev)
        confidence.append(jnp.asarray(conf, jnp.float32))
    return Proposal(jnp.stack(drafts, 1).astype(jnp.int32), jax.nn.sigmoid(jnp.stack(confidence, 1)))
