"""The V4.1 forward over a ragged batch: ``forward(params, cfg, state, batch) -> (logits, state)``.

One function serves one-shot prefill, chunked prefill, decode and mixed batches: the
state carries everything that outlives a call (model/state.py) and the batch says which
slot each new token belongs to (model/batch.py). The loop follows MODEL_SPEC §3.1: the
Engram hashes are computed once, each layer runs [Engram] -> attention site -> FFN site,
and every site collapses the streams with the *previous* site's ``pre`` (mega.mhc).
Sublayer outputs are placed into the streams lazily, by the next mHC step or Engram.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mega.engram import engram
from mega.mhc import HcMix, Update, hc_expand, mhc_step
from mega.moe import MoeSpec, route
from mega.primitives import linear
from model.attention import Published, attention_sublayer
from model.batch import Batch, StepInfo, replay_rows, step_info
from model.config import ModelConfig
from model.engram_hash import DEAD, EngramHashTables, engram_hash, lookback_ids
from model.state import ModelState
from sharding import engram_tables
from sharding.expert_parallel import moe


class Trace(NamedTuple):
    """Per-layer intermediates for debugging and parity tests."""

    streams: jnp.ndarray  # [L, T, hc, D] streams each layer returns
    premix: jnp.ndarray  # [L, T, hc] the FFN-site pre each layer hands on
    engram_rows: jnp.ndarray | None  # [T, n_engram_layers, cols] table row ids
    selections: dict  # index-source layer -> Published (entries, scores, candidates)


def moe_spec(cfg: ModelConfig) -> MoeSpec:
    return MoeSpec(cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.gate_temp,
                   cfg.norm_topk_prob, cfg.expert_activations == "fp8", cfg.expert_routing == "balanced")


class Taps(NamedTuple):
    """DSpark's context from a target step (MODEL_SPEC §7): per computed row, the mean over the
    streams entering each of ``dspark_target_layer_ids``, and the rows' metadata."""

    aux: jnp.ndarray  # [R, n_taps, D]
    info: StepInfo


class Flow(NamedTuple):
    """What one layer hands the next: the streams, the pending sublayer update, the pre-mix the
    next site collapses with, the index sources' selections, the state and the rows' metadata
    (and, when asked, the DSpark taps so far)."""

    residual: jnp.ndarray  # [T, hc, D]
    update: Update | None
    pre: jnp.ndarray  # [T, hc]
    published: Published
    windows: tuple  # per layer: the window ring this step writes
    state: ModelState
    info: StepInfo
    hash_rows: jnp.ndarray | None  # [T, n_engram_layers, cols]
    taps: tuple | None = None  # [T, D] per target layer passed, or None: not collected


class Cut(NamedTuple):
    """A replay step between its two programs: the flow right after the last KV source's
    attention, its kept rows packed first (``model.batch.replay_rows``), and the attention's
    output there. ``take(rows)`` keeps the first ``rows``, so one trunk serves every replay
    bucket up to its size."""

    residual: jnp.ndarray  # [R, hc, D]
    y: jnp.ndarray  # [R, D]
    attn_mix: HcMix
    published: Published
    info: StepInfo
    hash_rows: jnp.ndarray | None
    row_src: jnp.ndarray  # [R] batch row of each kept row, -1 for padding
    engram_hist: jnp.ndarray  # [B, n-1] the look-back after this step
    taps: tuple | None = None

    def take(self, rows: int) -> "Cut":
        head = partial(jax.tree.map, lambda a: a[:rows])
        return self._replace(residual=self.residual[:rows], y=self.y[:rows], attn_mix=head(self.attn_mix),
                             published=head(self.published), info=self.info.head(rows),
                             hash_rows=head(self.hash_rows), row_src=self.row_src[:rows], taps=head(self.taps))

    def rows_of(self, batch_rows: jnp.ndarray) -> jnp.ndarray:
        """Where batch rows ``[S]`` (kept ones) sit among the cut's rows."""
        return jnp.argmax(self.row_src[None, :] == batch_rows[:, None], axis=1).astype(jnp.int32)


def forward(params: dict, cfg: ModelConfig, state: ModelState, batch: Batch, engram_map: jnp.ndarray | None = None,
            trace: bool = False, forced_selection: dict | None = None, logit_rows: jnp.ndarray | None = None,
            replay: tuple[int, int] | None = None, taps: bool = False):
    """Logits (fp32) and the updated state (and with ``taps`` the DSpark context, ``Taps``).

    * ``engram_map`` [V]: the compressed-vocabulary map (model.engram_vocab), required when
      the config has Engram layers.
    * ``logit_rows`` [S]: batch rows whose logits to return (default: every row).
    * ``replay = (keep, rows)``: decoder replay (MODEL_SPEC §5). After the last KV source's
      attention, only each request's last ``keep`` rows are computed, packed into ``rows``
      slots (a static bucket). ``keep = sliding_window`` is the approximate mode SGLang and
      vLLM ship; ``keep = halo_rows(cfg)`` is the exact one. ``logit_rows`` must be kept rows.
      It is ``forward_trunk`` then ``forward_tail``, which the engine runs as two programs.
    * ``trace``: also return a ``Trace``; ``forced_selection`` maps index-source layers to
      ``[T, N]`` entry masks that replace their top-k choice (to replay another
      implementation's tie-breaking).
    """
    if replay is not None:
        if trace or logit_rows is None:
            raise ValueError("decoder replay computes only the kept rows: pass logit_rows, and no trace")
        cut, state = forward_trunk(params, cfg, state, batch, engram_map, *replay, forced_selection, taps)
        return forward_tail(params, cfg, state, cut, cut.rows_of(logit_rows))
    f, engram_hist = _start(params, cfg, state, batch, engram_map, taps)
    streams, premixes, selections = [], [], {}
    forced_selection = forced_selection or {}
    for i, lp in enumerate(params["layers"]):
        f, y, attn_mix = _attention_site(lp, cfg, i, f, forced_selection.get(i))
        if i in cfg.index_source_layer_ids:
            selections[i] = f.published
        f = _ffn_site(lp, cfg, i, f, y, attn_mix)
        if trace:
            streams.append(hc_expand(f.residual, f.update))
            premixes.append(f.pre)
    out = _finish(params, cfg, f, engram_hist, logit_rows)
    if trace:
        return *out, Trace(jnp.stack(streams), jnp.stack(premixes), f.hash_rows, selections)
    return out


def forward_trunk(params: dict, cfg: ModelConfig, state: ModelState, batch: Batch, engram_map, keep: int,
                  rows: int, forced_selection: dict | None = None, taps: bool = False) -> tuple[Cut, ModelState]:
    """A replay step's layers up to the last KV source's attention on every row; then its
    requests' last ``keep`` rows gathered into ``rows`` (``forward``'s ``replay``)."""
    f, engram_hist = _start(params, cfg, state, batch, engram_map, taps)
    forced_selection = forced_selection or {}
    last = cfg.last_kv_source
    for i, lp in enumerate(params["layers"][:last + 1]):
        f, y, attn_mix = _attention_site(lp, cfg, i, f, forced_selection.get(i))
        if i < last:
            f = _ffn_site(lp, cfg, i, f, y, attn_mix)
    info, row_src = replay_rows(cfg, f.state, f.info, keep, rows)
    take = partial(jax.tree.map, lambda a: a[jnp.maximum(row_src, 0)])
    published = f.published._replace(scores=None, candidates=None)   # [T, N], for traces: not through the cut
    cut = Cut(take(f.residual), take(y), take(attn_mix), take(published), info, take(f.hash_rows), row_src,
              engram_hist, take(f.taps))
    return cut, f.state.replace(window=f.windows)


def forward_tail(params: dict, cfg: ModelConfig, state: ModelState, cut: Cut, logit_rows: jnp.ndarray):
    """The rest of a replay step on the cut's rows: ``(logits [S], state)`` (and ``Taps`` when
    the trunk collected them); ``logit_rows`` index the cut's rows (``Cut.rows_of``)."""
    last = cfg.last_kv_source
    f = Flow(cut.residual, None, cut.attn_mix.pre, cut.published, state.window, state, cut.info, cut.hash_rows,
             cut.taps)
    f = _ffn_site(params["layers"][last], cfg, last, f, cut.y, cut.attn_mix)
    for i, lp in enumerate(params["layers"][last + 1:], last + 1):
        f, y, attn_mix = _attention_site(lp, cfg, i, f, None)
        f = _ffn_site(lp, cfg, i, f, y, attn_mix)
    return _finish(params, cfg, f, cut.engram_hist, logit_rows)


def hc_options(cfg: ModelConfig) -> dict:
    """The mHC step's keyword options of ``cfg``."""
    return dict(eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)


def _start(params, cfg, state, batch, engram_map, taps: bool = False) -> tuple[Flow, jnp.ndarray]:
    """The flow into layer 0 and the Engram look-back after this step."""
    info = step_info(cfg, state, batch)
    hash_rows, engram_hist = None, state.engram_hist
    if cfg.engram_layer_ids:
        if engram_map is None:
            raise ValueError("this config has Engram layers: pass engram_map (model.engram_vocab.engram_map_for)")
        hash_rows, engram_hist = _engram_rows(cfg, state, batch, info, engram_map)
    x0 = params["embed"][batch.tokens]
    residual = jnp.repeat(x0[:, None, :], cfg.hc_mult, axis=1)
    pre = jnp.zeros((x0.shape[0], cfg.hc_mult), jnp.float32).at[:, 0].set(1.0)
    return Flow(residual, None, pre, Published(), state.window, state, info, hash_rows, () if taps else None), \
        engram_hist


def _attention_site(lp: dict, cfg: ModelConfig, i: int, f: Flow, forced):
    """[Engram] and the attention sublayer of layer ``i``: ``(flow, output, the site's mix)``."""
    residual, update = f.residual, f.update
    if f.taps is not None and i in cfg.dspark_target_layer_ids:   # before Engram (targets have none)
        residual, update = hc_expand(residual, update), None   # (expanded once: the site's pass then has none)
        f = f._replace(taps=f.taps + (residual.astype(jnp.float32).mean(1).astype(residual.dtype),))
    if i in cfg.engram_layer_ids:
        hash_ids = f.hash_rows[:, cfg.engram_layer_ids.index(i)]
        residual, update = hc_expand(residual, update), None
        residual = engram(residual, engram_tables.lookup(lp["engram"], hash_ids), lp["engram"], eps=cfg.rms_norm_eps)
    residual, x, attn_mix = mhc_step(residual, update, lp["hc_attn"], f.pre, lp["attn_norm"], **hc_options(cfg))
    y, ring, src_update, published = attention_sublayer(x, lp["attn"], i, cfg, f.info, f.state, f.published, forced)
    state = f.state
    if src_update is not None:  # later layers of the group read the updated pools
        state = _with_source(state, cfg.kv_source_layer_ids.index(i), src_update)
    windows = f.windows[:i] + (ring,) + f.windows[i + 1:]
    return f._replace(residual=residual, update=None, published=published, windows=windows, state=state), y, attn_mix


def _ffn_site(lp: dict, cfg: ModelConfig, i: int, f: Flow, y: jnp.ndarray, attn_mix: HcMix) -> Flow:
    residual, x, ffn_mix = mhc_step(f.residual, Update(y, attn_mix.post, attn_mix.comb), lp["hc_ffn"],
                                    attn_mix.pre, lp["ffn_norm"], **hc_options(cfg))
    spec, state = moe_spec(cfg), f.state
    if state.expert_load.size:   # the same routing as the MoE op's own, which XLA computes once
        _, ids = route(x, lp["moe"], spec)
        load = state.expert_load.at[f.info.slot[:, None], i, ids].add(f.info.valid[:, None].astype(jnp.int32))
        state = state.replace(expert_load=load)
    return f._replace(residual=residual, update=Update(moe(x, lp["moe"], spec), ffn_mix.post, ffn_mix.comb),
                      pre=ffn_mix.pre, state=state)


def _finish(params, cfg, f: Flow, engram_hist, logit_rows):
    """The final collapse and the LM head over ``logit_rows`` (default: every row)."""
    _, x, _ = mhc_step(f.residual, f.update, None, f.pre, params["norm"], **hc_options(cfg))
    if logit_rows is not None:
        x = x[logit_rows]
    with jax.named_scope("lm_head"):
        logits = linear(x, params["lm_head"])
    state = f.state.replace(seq_lens=f.info.ends, window=f.windows, engram_hist=engram_hist)
    if f.taps is None:
        return logits, state
    return logits, state, Taps(jnp.stack(f.taps, 1), f.info)


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


forward_jit = jax.jit(forward, static_argnames=("cfg", "trace", "replay", "taps"), donate_argnames=("state",))
