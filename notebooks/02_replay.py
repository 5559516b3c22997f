# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Decoder and encoder replay: what they save, what they cost in accuracy
#
# **Decoder replay** (MODEL_SPEC §5): after the last KV source's attention, a prefill computes
# only each request's last rows, since later layers keep nothing but their sliding windows.
# `approx` keeps one window of rows (what SGLang and vLLM ship): the later layers' window
# caches are then written from rows whose own windows were cut short. `exact` keeps the halo
# (`model.forward.halo_rows`) that makes every cached row exact.
#
# **Encoder replay**: on a prefix hit the engine restores the prefix's global state
# (compressed KV, indexer keys) and recomputes only the last `window` tokens before the hit's
# end, to rebuild the window rings.
#
# Model: the golden fixture `v41_tiny` (a random V4.1 at toy width, window 8). Errors are the
# max |logit difference| against the plain forward over the decode steps that follow.

# %%
from pathlib import Path

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from checkpoints.hf import load_params
from model.batch import pack_requests
from model.config import ModelConfig
from model.engram_vocab import engram_map_for
from model.forward import forward_jit, halo_rows
from model.state import init_state
from serve.engine import Engine, EngineConfig

GOLDEN = Path.cwd().resolve().parents[1] / "shared" / "golden" / "v41_tiny"
cfg = ModelConfig.from_json(GOLDEN)
params = load_params(GOLDEN, cfg)
emap = jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
W, HALO = cfg.sliding_window, halo_rows(cfg, multiple=1)
print(f"window {W}, last KV source: layer {cfg.last_kv_source} of {cfg.num_hidden_layers}, exact halo {HALO} rows")

# %%
PAD, DECODE = 128, 8
LENGTHS = [16, 24, 32, 48, 64, 96, 120]
rng = np.random.default_rng(0)
text = rng.integers(3, cfg.vocab_size, size=PAD + DECODE).tolist()


def prefill_then_decode(n, replay):
    """Logits of the prefill's last row and of DECODE steps fed the text's next tokens."""
    state = init_state(cfg, 1, PAD + DECODE + 8, page_size=16)
    logits, state = forward_jit(params, cfg, state, pack_requests([(0, text[:n], 0)], pad_to=PAD), emap,
                                logit_rows=jnp.asarray([n - 1], jnp.int32), replay=replay)
    out = [np.asarray(logits)[0]]
    for k in range(DECODE):
        logits, state = forward_jit(params, cfg, state, pack_requests([(0, [text[n + k]], n + k)]), emap,
                                    logit_rows=jnp.asarray([0], jnp.int32), replay=replay)
        out.append(np.asarray(logits)[0])
    return np.stack(out)


err = {"approx": [], "exact": []}
for n in LENGTHS:
    full = prefill_then_decode(n, None)
    err["approx"].append(np.abs(prefill_then_decode(n, (W, W)) - full).max())
    err["exact"].append(np.abs(prefill_then_decode(n, (HALO, HALO)) - full).max())


def work(n, keep):
    """Sublayer-rows a prefill of n tokens computes, as a share of the plain forward's."""
    last, layers = cfg.last_kv_source, cfg.num_hidden_layers
    k = min(keep, n)
    attention = (last + 1) * n + (layers - last - 1) * k
    ffn = last * n + (layers - last) * k
    return (attention + ffn) / (2 * layers * n)


fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
a.semilogy(LENGTHS, np.maximum(err["approx"], 1e-7), marker="o", label=f"approx (keep {W})")
a.semilogy(LENGTHS, np.maximum(err["exact"], 1e-7), marker="x", label=f"exact (keep {HALO})")
a.set(xlabel="prompt tokens", ylabel="max |logit diff| vs plain forward", title="decoder replay: error")
a.legend(fontsize=8)
long = np.arange(16, 8193, 16)
b.plot(long, [1 - work(n, W) for n in long], label="approx")
b.plot(long, [1 - work(n, HALO) for n in long], label="exact")
b.set(xscale="log", xlabel="prompt tokens", ylabel="share of sublayer rows skipped", title="decoder replay: work saved")
b.legend(fontsize=8)
fig.tight_layout()
plt.show()
print({n: f"{1 - work(n, W):.0%}" for n in (128, 1024, 8192)}, "of the sublayer rows skipped by approx")

# %% [markdown]
# Exact replay stays at float noise; approx drifts by an amount that depends on the model
# (random weights here: a trained model's attention is not uniform over the window) and
# stops growing with the prompt, since only the last window's caches are affected.
#
# ## Encoder replay after a prefix hit
#
# One engine with the radix cache, one without. Each prompt is a shared prefix plus a
# different suffix; the cached engine sees the prefix first, so the second request is a hit.
# We compare the greedy tokens' log-probs.

# %%
cached = Engine(params, cfg, EngineConfig(max_running=2, max_len=256, page_size=16, prefill_budget=128))
plain = Engine(params, cfg, EngineConfig(max_running=2, max_len=256, page_size=16, prefill_budget=128,
                                         prefix_cache=False))
sp = {"max_new_tokens": DECODE, "temperature": 0, "logprobs": True, "ignore_eos": True}
hits, gaps = [], []
for n in (16, 32, 64, 96):
    prefix, suffix = text[:n], rng.integers(3, cfg.vocab_size, size=8).tolist()
    cached.generate([prefix + [5]], {**sp, "max_new_tokens": 1}, decode_text=False)
    got = cached.generate([prefix + suffix], sp, decode_text=False)[0]
    want = plain.generate([prefix + suffix], sp, decode_text=False)[0]
    hits.append(got["usage"]["prompt_tokens_details"]["cached_tokens"])
    same = got["output_ids"] == want["output_ids"]
    gaps.append(np.abs(np.subtract(got["token_logprobs"], want["token_logprobs"])).max() if same else np.nan)
    print(f"prefix {n}: cached tokens {hits[-1]}, greedy tokens equal: {same}, max |logprob diff| {gaps[-1]:.2e}")

# %% [markdown]
# Encoder replay is approximate at every layer, not only past the last KV source: each
# layer's ring is rebuilt from `window` rows whose own windows were cut short, so its error
# is larger than decoder replay's, and with random weights (near-flat distributions) greedy
# choices flip. SGLang keeps the sliding-window KV of a cached prefix's last window instead
# of rebuilding it; that costs `window` rows of KV per layer per cached prefix, and is the
# alternative to measure against once a trained model makes the flips meaningful.
