"""The V4.1 attention sublayer: projections, compressor, indexer and the sparse-attention call.

Per layer (MODEL_SPEC §3.6-3.8):

* ``q = wq_b(q_norm(wq_a x))``, ``kv = FP8(RoPE(kv_norm(wkv x)))``; the step's ``kv`` goes to
  the window ring and serves the window keys of the step's own queries.
* KV sources pool their tokens into compressed entries (ratio 2: per-channel softmax gate
  over a token pair, with the pending tail carried in the state; ratio 1: one entry per
  token), publish indexer keys from the pre-RoPE latent, and store ``NVFP4(RoPE(latent))``
  (its records, or its values: ``model.state``).
* Index sources score every visible entry of their KV source, the candidate source
  publishes its block mask, and the top-k choice (as pool rows) serves every layer up to
  the next index source.
* ``mega.attention`` reads window and selected compressed rows; the grouped ``wo_a`` and
  ``wo_b`` project the result back.

Everything published inside one forward lives in ``Published``; everything that outlives
it lives in ``ModelState``.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mega.attention import attention
from mega.indexer import index_scores
from mega.primitives import HIGHEST, apply_rope, linear, rms_norm
from mega.topk import top_k
from model import quant
from model.batch import StepInfo
from model.config import ModelConfig
from model.rope import cos_sin, inv_freq
from model.state import Fp8Ring, ModelState, entry_rows
from pallas_kernels.block_scaled import Fp4Keys, Fp4Rows, Nvfp4Rows


class Published(NamedTuple):
    """Per-forward state shared between layers (never cached)."""

    comp_idx: jnp.ndarray | None = None  # [T, K] pool rows selected by the last index source
    candidates: jnp.ndarray | None = None  # [T, N] entry mask of the candidate source
    candidate_entries: jnp.ndarray | None = None  # [T, candidate_width] the same entries listed (-1: none)
    entries: jnp.ndarray | None = None  # [T, K] the selected entry numbers (-1: none), for traces
    scores: jnp.ndarray | None = None  # [T, N] the index scores (-inf where unscored), for traces


class SourceUpdate(NamedTuple):
    comp_kv: Nvfp4Rows | jnp.ndarray
    index_k: Fp4Keys | jnp.ndarray
    tail_kv: jnp.ndarray
    tail_gate: jnp.ndarray


def _drop_rows(rows: jnp.ndarray, keep: jnp.ndarray, n_rows: int) -> jnp.ndarray:
    return jnp.where(keep, rows, n_rows)  # out of range: dropped by scatter mode="drop"


def _store(pool, rows: jnp.ndarray, x: jnp.ndarray):
    """``x`` into a pool's ``rows`` (out of range: dropped): as its FP4 records (``Fp4Rows``
    quantise), or as values in its dtype."""
    if isinstance(pool, Fp4Rows):
        return pool.set_rows(rows, x)
    return pool.at[rows].set(x.astype(pool.dtype), mode="drop")


@jax.named_scope("compressor")  # prefixes its ops' names in HLO dumps and XProf
def compress(x: jnp.ndarray, p: dict, ratio: int, info: StepInfo, tail_kv: jnp.ndarray, tail_gate: jnp.ndarray,
             eps: float) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """``(latent [T, D], completes [T], new tail_kv, new tail_gate)``.

    Token ``t`` completes group ``pos // ratio`` when ``pos % ratio == ratio - 1``; its latent
    pools the group's members from this step or from the pending tail.
    """
    # fp32 projections (MODEL_SPEC §3.7) of operands in the model dtype: a bf16 model's
    # products are exact in its bf16 GEMMs' fp32 accumulators (tensor cores, not fp32 FMAs)
    k = linear(x, p["wkv"])
    completes = info.valid & (info.pos % ratio == ratio - 1)
    if ratio == 1:
        return rms_norm(k.astype(x.dtype), p["norm"], eps), completes, tail_kv, tail_gate
    g = linear(x, p["wgate"])
    t = jnp.arange(x.shape[0])
    groups = tail_kv.shape[1]   # the tail ring (model.state.tail_groups)
    members_k, members_g = [], []
    for j in range(ratio):
        q = info.pos - (ratio - 1) + j
        from_step = q >= info.start
        at = (info.slot, (jnp.maximum(q, 0) // ratio) % groups, jnp.clip(q % ratio, 0, ratio - 2))
        src = jnp.clip(t - (ratio - 1) + j, 0)
        members_k.append(jnp.where(from_step[:, None], k[src], tail_kv[at]))
        members_g.append(jnp.where(from_step[:, None], g[src], tail_gate[at]))
    weights = jax.nn.softmax(jnp.stack(members_g), axis=0)
    latent = rms_norm((weights * jnp.stack(members_k)).sum(0).astype(x.dtype), p["norm"], eps)
    # The leading members of the request's last ``groups`` groups go to the tail ring: the
    # unfinished last group's, and under speculation those a rollback may cut back to.
    kept = info.valid & (info.pos % ratio < ratio - 1) & (info.pos // ratio > (info.end - 1) // ratio - groups)
    at = (_drop_rows(info.slot, kept, tail_kv.shape[0]), (info.pos // ratio) % groups, info.pos % ratio)
    return latent, completes, tail_kv.at[at].set(k, mode="drop"), tail_gate.at[at].set(g, mode="drop")


def _compress_rope(cfg: ModelConfig, positions: jnp.ndarray):
    return cos_sin(jnp.asarray(inv_freq(cfg, "compress")), positions)


def index_keys(latent: jnp.ndarray, p: dict, positions: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    k = rms_norm(linear(latent, p["wk"]).astype(latent.dtype), p["k_norm"], cfg.rms_norm_eps)
    cos, sin = _compress_rope(cfg, positions)
    return quant.fp4_block32(apply_rope(k, cos, sin))


def index_queries(r: jnp.ndarray, x: jnp.ndarray, p: dict, info: StepInfo, cfg: ModelConfig):
    """The indexer's queries ``[T, H, d]`` (RoPE, FP4) and head weights ``[T, H]``, in fp32."""
    t = r.shape[0]
    q = linear(r, p["wq_b"]).astype(r.dtype).reshape(t, cfg.index_n_heads, cfg.index_head_dim)
    cos, sin = info.rope["compress"]
    q = quant.fp4_block32(apply_rope(q, cos[:, None], sin[:, None]))
    w = linear(x, p["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    return q.astype(jnp.float32), w


def candidate_width(cfg: ModelConfig, n: int) -> int:
    """Entries listed a row past the candidate source, of a pool of ``n`` entries a request."""
    bs = cfg.candidate_block_size
    return min(cfg.candidate_topk_blocks, -(-n // bs)) * bs


def candidate_blocks(scores: jnp.ndarray, visible: jnp.ndarray, cfg: ModelConfig
                     ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The top blocks per query, the newest visible block pinned (§3.8): their entries as a mask
    ``[T, N]`` and as a list ``[T, C * block]`` in ascending order (-1: none)."""
    t, n = scores.shape
    bs = cfg.candidate_block_size
    n_blocks = -(-n // bs)
    padded = jnp.pad(scores, ((0, 0), (0, n_blocks * bs - n)), constant_values=-jnp.inf)
    block = padded.reshape(t, n_blocks, bs).max(-1)
    newest = (visible - 1) // bs  # -1 when nothing is visible: pins nothing
    block = jnp.where(jnp.arange(n_blocks)[None] == newest[:, None], jnp.inf, block)
    vals, ids = jax.lax.top_k(block, candidate_width(cfg, n) // bs)
    keep = jnp.zeros((t, n_blocks), bool).at[jnp.arange(t)[:, None], ids].set(vals > -jnp.inf)
    ids = jnp.sort(jnp.where(vals > -jnp.inf, ids, n_blocks), axis=1)   # ascending: the list's ties go as the entries'
    entries = ids[:, :, None] * bs + jnp.arange(bs)
    listed = jnp.where((ids < n_blocks)[:, :, None] & (entries < n), entries, -1).reshape(t, -1)
    return jnp.repeat(keep, bs, axis=1)[:, :n], listed


@jax.named_scope("attention")  # prefixes its ops' names in HLO dumps and XProf
def attention_sublayer(x: jnp.ndarray, p: dict, layer: int, cfg: ModelConfig, info: StepInfo,
                       state: ModelState, published: Published, forced: jnp.ndarray | None = None
                       ) -> tuple[jnp.ndarray, jnp.ndarray, SourceUpdate | None, Published]:
    """Returns ``(output [T, D], new window ring, source update or None, published)``.

    ``forced`` ([T, N] bool, index sources only) replaces the top-k choice by a given entry set.
    """
    hd = cfg.head_dim
    ratio = cfg.compress_ratios[layer]
    cos, sin = info.rope["compress" if ratio else "main"]
    r, q = queries(x, p, cfg)
    window_pool, new_ring = _window(window_kv(x, p, cfg, cos, sin), state.window[layer], info)

    update, comp_kv, comp_idx = None, None, None
    if ratio:
        src = cfg.kv_source_of(layer)
        s = cfg.kv_source_layer_ids.index(src)
        pool_kv, pool_k = state.comp_kv[s], state.index_k[s]
        if layer == src:
            latent, completes, tail_kv, tail_gate = compress(
                x, p["compressor"], ratio, info, state.tail_kv[s], state.tail_gate[s], cfg.rms_norm_eps)
            entry = info.pos // ratio
            fresh = completes & (info.pos >= info.cached)  # replayed tokens keep their cached entries
            rows = _drop_rows(entry_rows(state, ratio, info.slot, entry), fresh, pool_kv.shape[0])
            entry_pos = entry * ratio
            pool_k = _store(pool_k, rows, index_keys(latent, p["indexer"], entry_pos, cfg))
            c_cos, c_sin = _compress_rope(cfg, entry_pos)
            rotated = apply_rope(latent, c_cos, c_sin)
            # a stored pool quantises the rotated latent itself: re-quantising NVFP4 values is not
            # exact where their block scale is subnormal in e4m3
            pool_kv = _store(pool_kv, rows, rotated if isinstance(pool_kv, Fp4Rows) else quant.nvfp4_block16(rotated))
            update = SourceUpdate(pool_kv, pool_k, tail_kv, tail_gate)
        if layer in cfg.index_source_layer_ids:
            published = _index(x, r, p["indexer"], layer, ratio, pool_k, cfg, info, state, published, forced)
        comp_kv, comp_idx = pool_kv, published.comp_idx

    o = attention(q, cos, sin, window_pool, info.window_idx, comp_kv, comp_idx, p["sink"], hd ** -0.5)
    return output(o, p, cfg, x.dtype), new_ring, update, published


def queries(x: jnp.ndarray, p: dict, cfg: ModelConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(r, q)``: the low-rank query latent ``q_norm(wq_a x)`` (the indexer reads it too) and
    the heads ``wq_b r`` as ``[T, H, head_dim]``, before RoPE (``mega.attention`` rotates)."""
    r = rms_norm(linear(x, p["wq_a"]).astype(x.dtype), p["q_norm"], cfg.rms_norm_eps)
    return r, linear(r, p["wq_b"]).astype(x.dtype).reshape(x.shape[0], cfg.num_attention_heads, cfg.head_dim)


def window_kv(x: jnp.ndarray, p: dict, cfg: ModelConfig, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """The window's K = V, ``RoPE(kv_norm(wkv x))``, before its FP8 quantiser."""
    return apply_rope(rms_norm(linear(x, p["wkv"]).astype(x.dtype), p["kv_norm"], cfg.rms_norm_eps), cos, sin)


def output(o: jnp.ndarray, p: dict, cfg: ModelConfig, dtype) -> jnp.ndarray:
    """The grouped ``wo_a`` (one block per group of heads) then ``wo_b``: ``[T, H, hd] -> [T, D]``."""
    t, g = o.shape[0], cfg.o_groups
    wo_a = p["wo_a"].reshape(g, cfg.o_lora_rank, -1)
    y = jnp.einsum("tgi,gri->tgr", o.reshape(t, g, -1), wo_a, precision=HIGHEST,
                   preferred_element_type=jnp.float32).astype(dtype)
    return linear(y.reshape(t, -1), p["wo_b"]).astype(dtype)


def _window(kv: jnp.ndarray, ring, info: StepInfo):
    """``(window pool, new ring)``: the step's window KV, FP8-quantised (MODEL_SPEC §3.5), is
    appended to the ring's rows to serve the step's own queries and written into the ring at
    ``pos % W``. An ``Fp8Ring`` keeps (and the pool carries) the quantiser's stored form, the
    pair (e4m3 values, UE8M0 bytes); a plain ring its dequantised values."""
    stored = isinstance(ring, Fp8Ring)
    rows = quant.fp8_block32_stored(kv) if stored else (quant.fp8_block32(kv),)
    rings = tuple(ring) if stored else (ring,)
    n_slots, w = rings[0].shape[:2]
    keep = info.valid & (info.pos >= info.end - w)
    at = (_drop_rows(info.slot, keep, n_slots), info.pos % w)
    pool = tuple(jnp.concatenate([r.reshape(n_slots * w, -1), x.astype(r.dtype)]) for r, x in zip(rings, rows))
    new = tuple(r.at[at].set(x.astype(r.dtype), mode="drop") for r, x in zip(rings, rows))
    return (pool, Fp8Ring(*new)) if stored else (pool[0], new[0])


@jax.named_scope("indexer")  # prefixes its ops' names in HLO dumps and XProf
def _index(x, r, p, layer, ratio, pool_k, cfg, info, state, published, forced) -> Published:
    n, b = state.capacity // ratio, state.batch_size
    entries = jnp.arange(n, dtype=jnp.int32)
    q, w = index_queries(r, x, p, info, cfg)
    rows = entry_rows(state, ratio, jnp.arange(b, dtype=jnp.int32), jnp.broadcast_to(entries, (b, n)))
    visible = (info.pos + 1) // ratio
    cand, listed = published.candidates, published.candidate_entries   # past the candidate source: scored alone
    scores = index_scores(q, w, pool_k, rows, info.slot, visible, listed, quant.fp4_block32_active(cfg.index_head_dim))
    k, entry_of = min(cfg.index_topk, n), None
    chosen = scores
    if listed is not None:   # select over the list (ascending: ties go as they would over every entry)
        width = max(k, listed.shape[1])
        chosen = jnp.pad(scores, ((0, 0), (0, width - listed.shape[1])), constant_values=-jnp.inf)
        entry_of = jnp.pad(listed, ((0, 0), (0, width - listed.shape[1])), constant_values=-1)
        scores = jnp.full((scores.shape[0], n), -jnp.inf).at[   # every entry's score, for traces
            jnp.arange(scores.shape[0])[:, None], jnp.where(listed >= 0, listed, n)].set(scores, mode="drop")
    if layer == cfg.candidate_source_layer_id:
        cand, listed = candidate_blocks(scores, visible, cfg)
    if forced is not None:
        chosen, entry_of = jnp.where(forced[:, :n] & (entries[None] < visible[:, None]), 0.0, -jnp.inf), None
    vals, ids = top_k(chosen, k)
    if entry_of is not None:
        ids = jnp.take_along_axis(entry_of, ids, axis=1)
    ok = vals > -jnp.inf
    comp_idx = jnp.where(ok, entry_rows(state, ratio, info.slot, jnp.maximum(ids, 0)), -1)
    return Published(comp_idx, cand, listed, jnp.where(ok, ids, -1), scores)
