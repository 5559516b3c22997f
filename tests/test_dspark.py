"""The DSpark draft (model/dspark.py) against an independent numpy implementation of
MODEL_SPEC §7, on fresh random weights, context and anchors: its context KV, its block
forward (bidirectional block, context below the anchor within the window), the Markov stage
and the confidence head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.init import init_params
from conftest import GOLDEN
from model.batch import pack_requests, step_info
from model.config import ModelConfig
from model.dspark import propose, write_context
from model.state import init_state

# ---------------------------------------------------------------- numpy, from the spec's text


def _rms(x, w, eps):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope(x, pos, cfg, inverse=False):
    dim = cfg.qk_rope_head_dim
    f = float(cfg.rope_parameters["main"]["rope_theta"]) ** (-np.arange(0, dim, 2) / dim)
    ang = np.asarray(pos, np.float64)[..., None] * f
    c, s = np.cos(ang), np.sin(ang) * (-1 if inverse else 1)
    while c.ndim < x.ndim:
        c, s = c[..., None, :], s[..., None, :]
    out = x.copy()
    a, b = x[..., -dim::2], x[..., -dim + 1::2]
    out[..., -dim::2], out[..., -dim + 1::2] = a * c - b * s, a * s + b * c
    return out


def _fp8(x):
    b = x.reshape(*x.shape[:-1], -1, 32)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4) / 448))
    q = np.clip(b / scale, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * scale).reshape(x.shape)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _hc_mix(h, site, cfg):
    flat = _rms(h.reshape(h.shape[0], -1), None, cfg.rms_norm_eps)
    m = flat @ site["fn"].T
    b, s, e, n = site["base"], site["scale"], cfg.hc_eps, cfg.hc_mult
    pre = _sigmoid(m[:, :n] * s[0] + b[:n]) + e
    post = 2 * _sigmoid(m[:, n:2 * n] * s[1] + b[n:2 * n])
    z = (m[:, 2 * n:] * s[2] + b[2 * n:]).reshape(-1, n, n)
    c = np.exp(z - z.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + e
    c = c / (c.sum(-2, keepdims=True) + e)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdims=True) + e)
        c = c / (c.sum(-2, keepdims=True) + e)
    return pre, post, c


def _expand(y, h, post, comb):
    return post[..., None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb, h)


def _collapse(h, pre):
    return np.einsum("tk,tkd->td", pre, h)


def _moe(x, p, cfg):
    lim = cfg.swiglu_limit

    def expert(w1, w3, w2, v, weight):
        return w2 @ (weight * (1 / (1 + np.exp(-np.minimum(w1 @ v, lim)))) * np.minimum(w1 @ v, lim)
                     * np.clip(w3 @ v, -lim, lim))

    out = np.zeros_like(x)
    for t, v in enumerate(x):
        sc = np.sqrt(np.log1p(np.exp(p["gate"] @ v / cfg.gate_temp)))
        ids = np.argsort(-(sc + p["bias"]), kind="stable")[:cfg.dspark_num_experts_per_tok]
        w = cfg.routed_scaling_factor * sc[ids] / (sc[ids].sum() + 1e-20)
        out[t] = sum(expert(p["w1"][e], p["w3"][e], p["w2"][e], v, w[k]) for k, e in enumerate(ids))
        out[t] += expert(p["shared"]["w1"], p["shared"]["w3"], p["shared"]["w2"], v, 1.0)
    return out


def _attention(x, block_pos, anchor, ctx_kv, ctx_pos, p, cfg):
    """One request's block through a draft layer's attention; ``ctx_kv`` its context KV rows."""
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    r = _rms(x @ p["wq_a"].T, p["q_norm"], eps)
    q = _rope((r @ p["wq_b"].T).reshape(len(x), cfg.num_attention_heads, hd), block_pos, cfg)
    kv = _fp8(_rope(_rms(x @ p["wkv"].T, p["kv_norm"], eps), block_pos, cfg))
    o = np.zeros_like(q)
    for i, pos in enumerate(block_pos):
        seen = (ctx_pos < anchor) & (pos - ctx_pos < cfg.sliding_window)
        keys = np.concatenate([ctx_kv[seen], kv])
        for h in range(q.shape[1]):
            z = keys @ q[i, h] / np.sqrt(hd)
            mx = max(z.max(), p["sink"][h])
            e = np.exp(z - mx)
            o[i, h] = e @ keys / (np.exp(p["sink"][h] - mx) + e.sum())
    o = _rope(o, block_pos, cfg, inverse=True)
    g = cfg.o_groups
    y = np.einsum("tgi,gri->tgr", o.reshape(len(x), g, -1), p["wo_a"].reshape(g, cfg.o_lora_rank, -1))
    return y.reshape(len(x), -1) @ p["wo_b"].T


def _reference(params, cfg, aux, anchor_token, anchor, drafts):
    """Logits and confidence of each block slot for one request (``drafts``: the Markov
    stage's previous tokens, as the implementation chose them), and its context KV."""
    mtp, eps = params["mtp"], cfg.rms_norm_eps
    u = _rms(aux.reshape(len(aux), -1) @ mtp["main_proj"].T, mtp["main_norm"], eps)
    ctx_pos = np.arange(len(aux))
    ctx = [_fp8(_rope(_rms(u @ lp["attn"]["wkv"].T, lp["attn"]["kv_norm"], eps), ctx_pos, cfg))
           for lp in mtp["layers"]]
    b = cfg.dspark_block_size
    tokens = [anchor_token] + [cfg.dspark_noise_token_id] * (b - 1)
    block_pos = anchor + np.arange(b)
    e = params["embed"][tokens]
    h = np.repeat(e[:, None], cfg.hc_mult, 1)
    pre = np.zeros((b, cfg.hc_mult))
    pre[:, 0] = 1
    pending = None
    for lp, kv in zip(mtp["layers"], ctx):
        if pending is not None:
            h = _expand(*pending)
        pa, qa, ca = _hc_mix(h, lp["hc_attn"], cfg)
        y = _attention(_rms(_collapse(h, pre), lp["attn_norm"], eps), block_pos, anchor, kv, ctx_pos, lp["attn"], cfg)
        h = _expand(y, h, qa, ca)
        pf, qf, cf = _hc_mix(h, lp["hc_ffn"], cfg)
        pending = (_moe(_rms(_collapse(h, pa), lp["ffn_norm"], eps), lp["moe"], cfg), h, qf, cf)
        pre = pf
    hidden = _rms(_collapse(_expand(*pending), pre), mtp["norm"], eps)
    prev = [anchor_token] + list(drafts[:-1])
    m = mtp["markov_embed"][prev]
    logits = hidden[:len(prev)] @ params["lm_head"].T + m @ mtp["markov_head"].T
    conf = _sigmoid(np.concatenate([hidden[:len(prev)], m], -1) @ mtp["confidence"].T)[:, 0]
    return logits, conf, ctx


# ---------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def draft():
    cfg = ModelConfig.from_json(GOLDEN / "v41_tiny")
    return cfg, init_params(cfg, seed=11, draft=True)


def test_draft_matches_numpy_reference(draft):
    cfg, params = draft
    rng = np.random.default_rng(7)
    lengths = [3, 6, 13]   # context below the anchor: shorter than, and past, the window of 8
    n = len(cfg.dspark_target_layer_ids)
    aux = [rng.normal(size=(k, n, cfg.hidden_size)).astype(np.float32) for k in lengths]
    state = init_state(cfg, 4, 64, page_size=16, spec_tokens=cfg.dspark_block_size)
    info = step_info(cfg, state, pack_requests([(s, [0] * k, 0) for s, k in enumerate(lengths)]))
    rings = write_context(params["mtp"], cfg, state.draft_window, jnp.asarray(np.concatenate(aux)), info)
    state = state.replace(draft_window=rings)
    anchors = rng.integers(0, cfg.vocab_size, size=4).astype(np.int32)
    seen = []

    def greedy(i, logits):
        seen.append(np.asarray(logits))
        return jnp.argmax(logits, -1).astype(jnp.int32)

    slots = np.array([0, 1, 2, -1], np.int32)   # a padding entry too
    got = propose(params, cfg, state, jnp.asarray(anchors), jnp.asarray(np.array(lengths + [0], np.int32)),
                  jnp.asarray(slots), cfg.dspark_block_size, greedy)
    drafts, conf = np.asarray(got.drafts), np.asarray(got.confidence)
    logits = np.stack(seen, 1)   # [S, N, V]
    np64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    for s, k in enumerate(lengths):
        want, want_conf, ctx = _reference(np64, cfg, aux[s].astype(np.float64), int(anchors[s]), k, drafts[s])
        for layer, kv in enumerate(ctx):   # the context KV in the ring, at pos % ring rows
            ring = np.asarray(rings[layer][s])
            live = np.arange(max(0, k - ring.shape[0]), k)
            np.testing.assert_allclose(ring[live % ring.shape[0]], kv[live], rtol=2e-2, atol=1e-3)
        scale = np.abs(want).max()
        assert np.abs(logits[s] - want).max() < 1e-3 * scale, np.abs(logits[s] - want).max() / scale
        np.testing.assert_allclose(conf[s], want_conf, atol=1e-4)
        assert (drafts[s] == logits[s].argmax(-1)).all()
