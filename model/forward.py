"""The V4.1 forward over a ragged batch: ``forward(params, cfg, state, batch) -> (logits, state)``.

One function serves one-shot prefill, chunked prefill, decode and mixed batches: the
state carries everything that outlives a call (model/state.py) and the batch says which
slot each new token belongs to (model/batch.py). The loop follows MODEL_SPEC §3.1: the
Engram hashes are computed once, each layer runs [Engram] -> attention site -> FFN site,
and every site collapses the streams with the *previous* site's ``pre`` (mega.mhc).
Sublayer outputs are placed into the streams lazily, by the next mHC step or Engram.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mega.engram import engram
from mega.mhc import Update, hc_expand, mhc_step
from mega.moe import MoeSpec, moe
from mega.primitives import linear
from model.attention import Published, attention_sublayer
from model.batch import Batch, StepInfo, replay_rows, step_info
from model.config import ModelConfig
from model.engram_hash import DEAD, EngramHashTables, engram_hash, lookback_ids
from model.state import ModelState


class Trace(NamedTuple):
    """Per-layer intermediates for debugging and parity tests."""

    streams: jnp.ndarray  # [L, T, hc, D] streams each layer returns
    premix: jnp.ndarray  # [L, T, hc] the FFN-site pre each layer hands on
    engram_rows: jnp.ndarray | None  # [T, n_engram_layers, cols] table row ids
    selections: dict  # index-source layer -> Published (entries, scores, candidates)


def moe_spec(cfg: ModelConfig) -> MoeSpec:
    return MoeSpec(cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.gate_temp,
                   cfg.norm_topk_prob, cfg.expert_activations == "fp8")


def forward(params: dict, cfg: ModelConfig, state: ModelState, batch: Batch, engram_map: jnp.ndarray | None = None,
            trace: bool = False, forced_selection: dict | None = None, logit_rows: jnp.ndarray | None = None,
            replay: tuple[int, int] | None = None):
    """Logits (fp32) and the updated state.

    * ``engram_map`` [V]: the compressed-vocabulary map (model.engram_vocab), required when
      the config has Engram layers.
    * ``logit_rows`` [S]: batch rows whose logits to return (default: every row).
    * ``replay = (keep, rows)``: decoder replay (MODEL_SPEC §5). After the last KV source's
      attention, only each request's last ``keep`` rows are computed, packed into ``rows``
      slots (a static bucket). ``keep = sliding_window`` is the approximate mode SGLang and
      vLLM ship; ``keep = halo_rows(cfg)`` is the exact one. ``logit_rows`` must be kept rows.
    * ``trace``: also return a ``Trace``; ``forced_selection`` maps index-source layers to
      ``[T, N]`` entry masks that replace their top-k choice (to replay another
      implementation's tie-breaking).
    """
    if replay is not None and (trace or logit_rows is None):
        raise ValueError("decoder replay computes only the kept rows: pass logit_rows, and no trace")
    info = step_info(cfg, state, batch)
    row_src = None
    hash_rows, engram_hist = None, state.engram_hist
    if cfg.engram_layer_ids:
        if engram_map is None:
            raise ValueError("this config has Engram layers: pass engram_map (model.engram_vocab.engram_map_for)")
        hash_rows, engram_hist = _engram_rows(cfg, state, batch, info, engram_map)

    x0 = params["embed"][batch.tokens]
    residual = jnp.repeat(x0[:, None, :], cfg.hc_mult, axis=1)
    pre = jnp.zeros((x0.shape[0], cfg.hc_mult), jnp.float32).at[:, 0].set(1.0)
    update: Update | None = None
    published = Published()
    windows = list(state.window)
    hc = dict(eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)
    streams, premixes, selections = [], [], {}
    forced_selection = forced_selection or {}
    for i, lp in enumerate(params["layers"]):
        if i in cfg.engram_layer_ids:
            residual = engram(residual, update, hash_rows[:, cfg.engram_layer_ids.index(i)], lp["engram"],
                              eps=cfg.rms_norm_eps)
            update = None
        residual, x, attn_mix = mhc_step(residual, update, lp["hc_attn"], pre, lp["attn_norm"], **hc)
        y, windows[i], src_update, published = attention_sublayer(x, lp["attn"], i, cfg, info, state, published,
                                                                  forced_selection.get(i))
        if i in cfg.index_source_layer_ids:
            selections[i] = published
        if src_update is not None:  # later layers of the group read the updated pools
            state = _with_source(state, cfg.kv_source_layer_ids.index(i), src_update)
        if replay is not None and i == cfg.last_kv_source:  # from here on only the kept rows
            info, row_src = replay_rows(cfg, state, info, *replay)
            take = jnp.maximum(row_src, 0)
            residual, y, attn_mix = residual[take], y[take], jax.tree.map(lambda a: a[take], attn_mix)
            published = jax.tree.map(lambda a: a[take], published)
            hash_rows = None if hash_rows is None else hash_rows[take]
        residual, x, ffn_mix = mhc_step(residual, Update(y, attn_mix.post, attn_mix.comb), lp["hc_ffn"],
                                        attn_mix.pre, lp["ffn_norm"], **hc)
        update = Update(moe(x, lp["moe"], moe_spec(cfg)), ffn_mix.post, ffn_mix.comb)
        pre = ffn_mix.pre
        if trace:
            streams.append(hc_expand(residual, update))
            premixes.append(pre)
    residual, x, _ = mhc_step(residual, update, None, pre, params["norm"], **hc)
    if logit_rows is not None:
        if row_src is not None:  # batch row -> computed row
            where = jnp.full((batch.tokens.shape[0],), 0, jnp.int32)
            where = where.at[jnp.where(row_src >= 0, row_src, where.shape[0])].set(
                jnp.arange(row_src.shape[0], dtype=jnp.int32), mode="drop")
            logit_rows = where[logit_rows]
        x = x[logit_rows]
    with jax.named_scope("lm_head"):
        logits = linear(x, params["lm_head"])
    new_state = state.replace(seq_lens=info.ends, window=tuple(windows), engram_hist=engram_hist)
    if trace:
        return logits, new_state, Trace(jnp.stack(streams), jnp.stack(premixes), hash_rows, selections)
    return logits, new_state


def halo_rows(cfg: ModelConfig, multiple: int = 256) -> int:
    """Rows per request that keep decoder replay exact (vllm #57281): every dependency of the
    last token and of the trailing window caches through the replay depth (the last KV
    source's output path plus the later layers), rounded up to ``multiple``."""
    depth = cfg.num_hidden_layers - cfg.last_kv_source
    rows = cfg.sliding_window + (depth - 1) * (cfg.sliding_window - 1)
    return -(-rows // multiple) * multiple


def _with_source(state: ModelState, s: int, update) -> ModelState:
    def put(pools, value):
        return pools[:s] + (value,) + pools[s + 1:]

    return state.replace(comp_kv=put(state.comp_kv, update.comp_kv), index_k=put(state.index_k, update.index_k),
                         tail_kv=put(state.tail_kv, update.tail_kv), tail_gate=put(state.tail_gate, update.tail_gate))


def _engram_rows(cfg: ModelConfig, state: ModelState, batch: Batch, info: StepInfo, engram_map: jnp.ndarray):
    """Hash rows ``[T, n_engram_layers, cols]`` and the updated look-back history."""
    n = cfg.engram_max_ngram_size
    comp = jnp.where(info.valid, engram_map[batch.tokens], DEAD)
    tables = EngramHashTables.from_config(cfg)
    rows = engram_hash(lookback_ids(comp, state.engram_hist, batch.seq_ids, info.pos, state.seq_lens,
                                    tables.pad_id, n), tables)
    # New history: the last n-1 ids of each request, shifted by its new tokens, then overwritten.
    hist = state.engram_hist
    k = jnp.arange(n - 1)[None, :] + (info.ends - info.starts)[:, None]
    shifted = jnp.where(k < n - 1, jnp.take_along_axis(hist, jnp.minimum(k, n - 2), axis=1), DEAD)
    slot_in_hist = info.pos - (info.end - (n - 1))
    b = jnp.where(info.valid & (slot_in_hist >= 0), info.slot, hist.shape[0])
    return rows, shifted.at[b, slot_in_hist].set(comp, mode="drop")


forward_jit = jax.jit(forward, static_argnames=("cfg", "trace", "replay"), donate_argnames=("state",))
