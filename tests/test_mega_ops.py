"""Each mega/ operator against a direct numpy (float64) implementation of MODEL_SPEC, on fresh random inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mega.attention import attention
from mega.engram import engram, lookup_rows
from mega.mhc import Update, mhc_step
import mega.moe
from mega.moe import EXPERT_WEIGHTS, MoeSpec, QuantizedWeight, moe, quantize_experts
from pallas_kernels.block_scaled import Fp4Weight


def rope_np(x, cos, sin, inverse=False):
    x = np.array(x, np.float64)
    half = cos.shape[-1]
    s = -sin if inverse else sin
    a, b = x[..., -2 * half::2].copy(), x[..., -2 * half + 1::2].copy()
    x[..., -2 * half::2] = a * cos - b * s
    x[..., -2 * half + 1::2] = a * s + b * cos
    return x


def silu(v):
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    t, h, d, half, w, k = 7, 4, 64, 8, 5, 6
    q = rng.normal(size=(t, h, d)).astype(np.float32)
    ang = rng.uniform(0, 6, size=(t, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    wkv = rng.normal(size=(20, d)).astype(np.float32)
    ckv = rng.normal(size=(9, d)).astype(np.float32)
    widx = rng.integers(-1, 20, size=(t, w)).astype(np.int32)
    cidx = rng.integers(-1, 9, size=(t, k)).astype(np.int32)
    widx[0], cidx[0] = -1, -1  # a fully masked row: only the sink
    sink = rng.normal(size=h).astype(np.float32)
    scale = d ** -0.5
    got = np.asarray(attention(jnp.asarray(q), jnp.asarray(cos), jnp.asarray(sin), jnp.asarray(wkv),
                               jnp.asarray(widx), jnp.asarray(ckv), jnp.asarray(cidx), jnp.asarray(sink), scale))
    want = np.zeros((t, h, d))
    qr = rope_np(q, cos[:, None], sin[:, None])
    for i in range(t):
        keys = [wkv[j] for j in widx[i] if j >= 0] + [ckv[j] for j in cidx[i] if j >= 0]
        keys = np.array(keys, np.float64).reshape(-1, d)
        for hh in range(h):
            z = keys @ qr[i, hh] * scale
            m = max(z.max(initial=-np.inf), sink[hh])
            p = np.exp(z - m)
            want[i, hh] = (p / (np.exp(sink[hh] - m) + p.sum())) @ keys if len(keys) else 0
    want = rope_np(want, cos[:, None], sin[:, None], inverse=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.abs(got[0]).max() == 0  # nothing to read: the sink absorbs all weight


def _moe_params(rng, d, inter, e):
    p = {"gate": rng.normal(size=(e, d)) / np.sqrt(d), "bias": rng.normal(size=e) * 0.1,
         "bias_vl": np.zeros(e), "w1": rng.normal(size=(e, inter, d)) / np.sqrt(d),
         "w3": rng.normal(size=(e, inter, d)) / np.sqrt(d), "w2": rng.normal(size=(e, d, inter)) / np.sqrt(inter),
         "shared": {"w1": rng.normal(size=(inter, d)) / np.sqrt(d), "w3": rng.normal(size=(inter, d)) / np.sqrt(d),
                    "w2": rng.normal(size=(d, inter)) / np.sqrt(inter)}}
    return jax.tree.map(lambda v: np.asarray(v, np.float32), p)


def _moe_np(x, p, k, routed_scale, limit):
    def expert(v, w1, w3, w2, weight):
        g, u = np.minimum(w1 @ v, limit), np.clip(w3 @ v, -limit, limit)
        return w2 @ (weight * silu(g) * u)

    want = np.zeros(x.shape)
    for i in range(x.shape[0]):
        xi = x[i].astype(np.float64)
        sc = np.sqrt(np.log1p(np.exp(p["gate"] @ xi)))
        ids = np.argsort(-(sc + p["bias"]), kind="stable")[:k]
        wts = routed_scale * sc[ids] / (sc[ids].sum() + 1e-20)
        for j, wt in zip(ids, wts):
            want[i] += expert(xi, p["w1"][j], p["w3"][j], p["w2"][j], wt)
        want[i] += expert(xi, p["shared"]["w1"], p["shared"]["w3"], p["shared"]["w2"], 1.0)
    return want


def test_balanced_routing_spreads_pairs_evenly():
    """``--enable-balanced-routing`` (a benchmark mode): each expert gets T*k/E pairs, a token's k
    experts differ, and their weights are the router's scores of them, normalised and scaled."""
    rng = np.random.default_rng(11)
    t, d, e, k = 24, 32, 8, 3
    p = jax.tree.map(jnp.asarray, _moe_params(rng, d, 16, e))
    x = jnp.asarray(rng.normal(size=(t, d)).astype(np.float32))
    w, ids = mega.moe.route(x, p, MoeSpec(top_k=k, routed_scale=1.5, swiglu_limit=0.0, balanced=True))
    ids = np.asarray(ids)
    assert np.bincount(ids.reshape(-1), minlength=e).tolist() == [t * k // e] * e
    assert all(len(set(row)) == k for row in ids)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.5, rtol=1e-5)
    routed = np.asarray(mega.moe.route(x, p, MoeSpec(top_k=k, routed_scale=1.5, swiglu_limit=0.0))[1])
    assert not (np.sort(routed, -1) == np.sort(ids, -1)).all()   # not what the router would choose


@pytest.mark.parametrize("skew", [False, True])
def test_moe_matches_numpy(skew):
    rng = np.random.default_rng(3 + skew)
    t, d, inter, e, k, limit = 23, 32, 16, 6, 2, 2.0
    x = rng.normal(size=(t, d)).astype(np.float32)
    p = _moe_params(rng, d, inter, e)
    if skew:  # one expert takes nearly every token, two get none: ragged, uneven groups
        p["bias"] = np.array([5.0, 0.0, 0.0, 0.0, -9.0, -9.0], np.float32)
    spec = MoeSpec(top_k=k, routed_scale=1.5, swiglu_limit=limit)
    got = np.asarray(moe(jnp.asarray(x), jax.tree.map(jnp.asarray, p), spec))
    np.testing.assert_allclose(got, _moe_np(x, p, k, 1.5, limit), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt,kind", [("fp8", QuantizedWeight), ("mxfp4", Fp4Weight)])
def test_moe_with_quantized_experts(fmt, kind, monkeypatch):
    """fp8 or MXFP4 expert stacks (``quantize_experts``): the reference path computes with their
    dequantised values, and the interpreted Pallas kernels (swapped tiles converted in the
    kernel, the shared expert fused in) agree with it."""
    rng = np.random.default_rng(11)
    t, d, inter, e, k, limit = 20, 128, 128, 4, 2, 2.0
    x = rng.normal(size=(t, d)).astype(np.float32)
    p = _moe_params(rng, d, inter, e)
    q = quantize_experts(jax.tree.map(jnp.asarray, p), fmt)
    assert all(isinstance(w, kind) for w in [q[n] for n in EXPERT_WEIGHTS] + list(q["shared"].values()))
    deq = {**p, **{n: np.asarray(q[n].dequantized()) for n in EXPERT_WEIGHTS},
           "shared": {n: np.asarray(w.dequantized()) for n, w in q["shared"].items()}}
    spec = MoeSpec(top_k=k, routed_scale=1.5, swiglu_limit=limit)
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x), q, spec)), _moe_np(x, deq, k, 1.5, limit),
                               rtol=1e-4, atol=1e-4)
    xb = jnp.asarray(x, jnp.bfloat16)
    ref = np.asarray(moe(xb, q, spec), np.float32)
    monkeypatch.setenv("MEGAJAX_KERNELS", "interpret")
    assert mega.moe.plan(xb.dtype, q, spec, t * k).path.kernel   # the kernels do run
    got = np.asarray(moe(xb, q, spec), np.float32)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("fmt,block", [("fp8", "128 x 128"), ("mxfp4", "64 x 64")])
def test_quantized_experts_need_whole_blocks(fmt, block):
    p = _moe_params(np.random.default_rng(0), 32, 16, 2)
    with pytest.raises(ValueError, match=f"divisible by {block}"):
        quantize_experts(jax.tree.map(jnp.asarray, p), fmt)


def _mix_np(h, fn, base, scale, eps, hc_eps, iters):
    flat = h.reshape(h.shape[0], -1)
    flat = flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + eps)
    m = flat @ fn.T
    hc = h.shape[1]
    sig = lambda v: 1 / (1 + np.exp(-v))
    pre = sig(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * sig(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    c = np.exp(logits - logits.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + hc_eps
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        c = c / (c.sum(-2, keepdims=True) + hc_eps)
    return pre, post, c


def test_mhc_step_matches_numpy():
    rng = np.random.default_rng(5)
    t, hc, d, eps, hc_eps, iters = 5, 4, 16, 1e-20, 1e-6, 20
    h = rng.normal(size=(t, hc, d)).astype(np.float32)
    y = rng.normal(size=(t, d)).astype(np.float32)
    post0 = rng.uniform(0, 2, size=(t, hc)).astype(np.float32)
    comb0 = rng.uniform(0, 1, size=(t, hc, hc)).astype(np.float32)
    prev = rng.uniform(0, 1, size=(t, hc)).astype(np.float32)
    site = {"fn": (rng.normal(size=(24, hc * d)) / 8).astype(np.float32),
            "base": (0.3 * rng.normal(size=24)).astype(np.float32),
            "scale": (1 + 0.2 * rng.normal(size=3)).astype(np.float32)}
    norm_w = (1 + 0.1 * rng.normal(size=d)).astype(np.float32)
    new_h, x, mix = mhc_step(jnp.asarray(h), Update(jnp.asarray(y), jnp.asarray(post0), jnp.asarray(comb0)),
                             {k: jnp.asarray(v) for k, v in site.items()}, jnp.asarray(prev), jnp.asarray(norm_w),
                             eps=eps, hc_eps=hc_eps, iters=iters)
    want_h = post0[..., None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb0, h)
    pre, post, comb = _mix_np(want_h.astype(np.float64), site["fn"], site["base"], site["scale"], eps, hc_eps, iters)
    col = (prev[..., None] * want_h).sum(1)
    want_x = norm_w * col / np.sqrt((col ** 2).mean(-1, keepdims=True) + eps)
    np.testing.assert_allclose(np.asarray(new_h), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(x), want_x, rtol=1e-4, atol=1e-5)
    for got, want in ((mix.pre, pre), (mix.post, post), (mix.comb, comb)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mix.comb).sum(-2), 1.0, atol=1e-4)  # Sinkhorn: doubly stochastic


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])   # the model's: wkv and a float table
def test_engram_matches_numpy(fp8, dtype):
    """In a bf16 model the projection runs on bf16 operands (its inputs are exact in bf16), in
    an fp32 one in fp32; either way it matches float64 of the stored values."""
    rng = np.random.default_rng(7 + fp8)
    t, hc, d, rows, hd, cols, eps = 6, 4, 16, 50, 64, 3, 1e-20
    h = rng.normal(size=(t, hc, d)).astype(np.float32)
    table = rng.normal(size=(rows, hd)).astype(dtype)
    scale = np.exp2(rng.integers(-3, 3, size=(rows, hd // 32))).astype(np.float32)
    if fp8:
        table = table.astype(ml_dtypes.float8_e4m3fn)
    p = {"table": table, "scale": scale, "wkv": (rng.normal(size=(d * (hc + 1), cols * hd)) / 8).astype(dtype),
         "q_weight": (1 + 0.2 * rng.normal(size=(hc, d))).astype(np.float32),
         "k_weight": (1 + 0.2 * rng.normal(size=(hc, d))).astype(np.float32)}
    ids = rng.integers(0, rows, size=(t, cols)).astype(np.int32)
    pj = {k: jnp.asarray(v) for k, v in p.items()}
    got = np.asarray(engram(jnp.asarray(h), lookup_rows(pj["table"], pj["scale"], jnp.asarray(ids)), pj, eps=eps))
    vals = table.astype(np.float64)
    if fp8:
        vals = (vals.reshape(rows, -1, 32) * scale[..., None]).reshape(rows, hd)
    kv = vals[ids].reshape(t, -1) @ p["wkv"].T.astype(np.float64)   # (of the stored, possibly bf16, values)
    key, value = kv[:, :hc * d].reshape(t, hc, d), kv[:, hc * d:]
    omega = p["q_weight"] * p["k_weight"]
    hh = h.astype(np.float64)
    dot = (hh * omega * key).sum(-1) / np.sqrt((hh ** 2).mean(-1) + eps) / np.sqrt((key ** 2).mean(-1) + eps) / np.sqrt(d)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    np.testing.assert_allclose(got, hh + gate[..., None] * value[:, None, :], rtol=1e-4, atol=1e-4)
    # and the projection runs on bf16 operands only where all of them are exact in bf16
    hlo = jax.jit(lambda h, i, q: engram(h, lookup_rows(q["table"], q["scale"], i), q, eps=eps)).lower(
        jnp.asarray(h), jnp.asarray(ids), pj).as_text()
    operand = "bf16" if dtype == ml_dtypes.bfloat16 else "f32"
    assert f"(tensor<{t}x{cols * hd}x{operand}>, tensor<{d * (hc + 1)}x{cols * hd}x{operand}>)" in hlo
