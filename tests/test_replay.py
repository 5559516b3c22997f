"""Decoder replay (exact halo and approximate) and encoder replay after a prefix hit."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPORT
from model.batch import pack_requests
from model.engram_hash import DEAD
from model.forward import forward_jit, halo_rows
from model.state import init_state

PROMPTS = ("c64", "c37", "c50_chunked")
DECODE = 6


def _prefill_then_decode(tiny, replay):
    """Prefill all but the last DECODE tokens of three prompts in one batch, then decode them."""
    prompts = [tiny.cases[n]["prompt_ids"] for n in PROMPTS]
    state = init_state(tiny.cfg, 3, 96, page_size=16)
    batch = pack_requests([(r, p[:-DECODE], 0) for r, p in enumerate(prompts)], pad_to=160)
    last = np.cumsum([len(p) - DECODE for p in prompts]) - 1
    logits, state = forward_jit(tiny.params, tiny.cfg, state, batch, tiny.emap,
                                logit_rows=jnp.asarray(last, jnp.int32), replay=replay)
    out = [np.asarray(logits)]
    for k in range(DECODE):
        batch = pack_requests([(r, [p[len(p) - DECODE + k]], len(p) - DECODE + k) for r, p in enumerate(prompts)])
        logits, state = forward_jit(tiny.params, tiny.cfg, state, batch, tiny.emap,
                                    logit_rows=jnp.arange(3, dtype=jnp.int32), replay=replay)
        out.append(np.asarray(logits))
    return np.stack(out), state


@pytest.fixture(scope="module")
def full_run(tiny):
    return _prefill_then_decode(tiny, None)


def test_exact_halo_replay_equals_full_forward(tiny, full_run):
    keep = halo_rows(tiny.cfg, multiple=1)
    got, state = _prefill_then_decode(tiny, (keep, 3 * keep))
    want, want_state = full_run
    np.testing.assert_allclose(got, want, atol=1e-4)
    for layer in range(tiny.cfg.num_hidden_layers):  # the rings decode reads are the same too
        got_w, want_w = (np.asarray(s.window[layer], np.float32) for s in (state, want_state))
        same = np.isclose(got_w, want_w, rtol=0, atol=1e-4)
        # but for a rare entry whose FP8 rounding a last-bit difference upstream flips (the two runs
        # batch their matmuls differently; seen on one CI machine): one e4m3 step, at most 12.5%
        assert same.mean() > 0.99, f"layer {layer}: {np.count_nonzero(~same)} ring entries differ"
        np.testing.assert_allclose(got_w[~same], want_w[~same], rtol=0.126)


def test_approximate_replay_deviation(tiny, full_run):
    w = tiny.cfg.sliding_window
    got, _ = _prefill_then_decode(tiny, (w, 3 * w))
    want, _ = full_run
    diff = np.abs(got - want)
    REPORT["decoder replay (approx, keep=W) vs full: prefill-last / decode"] = (
        f"{diff[0].max():.2e} / {diff[1:].max():.2e}, argmax agreement {(got.argmax(-1) == want.argmax(-1)).mean():.0%}")
    assert diff.max() > 1e-6, "with keep=W the late layers must see truncated windows"
    assert diff.max() < 0.5 and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def _prefix_hit_run(tiny, ids, hit, replay):
    """Slot 1 reuses slot 0's compressed pages for a ``hit``-token prefix and recomputes only
    its last ``replay`` tokens (through all layers) to rebuild the window rings; returns the
    logits of the suffix ``ids[hit:]`` and the pool entries of the shared pages before/after."""
    cfg = tiny.cfg
    state = init_state(cfg, 2, 64, page_size=16)
    _, state = forward_jit(tiny.params, cfg, state, pack_requests([(0, ids[:hit], 0)], pad_to=64), tiny.emap)
    table = np.asarray(state.page_table).copy()
    table[1, :hit // 16] = table[0, :hit // 16]
    start = hit - replay
    cmap = np.asarray(tiny.emap)
    n_hist = cfg.engram_max_ngram_size - 1
    hist = ([DEAD] * n_hist + [int(cmap[t]) for t in ids[:start]])[-n_hist:]
    state = state.replace(
        page_table=jnp.asarray(table), seq_lens=state.seq_lens.at[1].set(start),
        window_floor=state.window_floor.at[1].set(start), cached_len=state.cached_len.at[1].set(hit),
        engram_hist=state.engram_hist.at[1].set(jnp.asarray(hist, jnp.int32)))
    before = np.asarray(state.comp_kv[0])[:hit // 2].copy()
    logits, state = forward_jit(tiny.params, cfg, state, pack_requests([(1, ids[start:], start)], pad_to=64),
                                tiny.emap)
    return np.asarray(logits)[replay:len(ids) - start], before, np.asarray(state.comp_kv[0])[:hit // 2]


def test_encoder_replay_after_prefix_hit(tiny):
    ids, hit, w = tiny.cases["c64"]["prompt_ids"], 32, tiny.cfg.sliding_window
    cold, _ = tiny.run(ids, [len(ids)])
    # Replaying the whole prefix rebuilds exactly what a cold run holds: the mechanism is sound.
    got, before, after = _prefix_hit_run(tiny, ids, hit, replay=hit)
    np.testing.assert_allclose(got, cold[hit:], atol=1e-4)
    np.testing.assert_array_equal(after, before)  # cached entries are kept, not rewritten
    # Replaying W tokens is the documented approximation; it must beat having no window at all.
    got, _, _ = _prefix_hit_run(tiny, ids, hit, replay=w)
    blind, _, _ = _prefix_hit_run(tiny, ids, hit, replay=0)
    err, err_blind = np.abs(got - cold[hit:]), np.abs(blind - cold[hit:])
    REPORT["encoder replay (hit 32, replay W=8) vs cold: suffix logits"] = (
        f"{err.max():.2e} / {np.median(err):.2e} (no replay: {err_blind.max():.2e} / {np.median(err_blind):.2e})")
    assert np.median(err) < np.median(err_blind)
