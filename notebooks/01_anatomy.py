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
# # The anatomy of a V4.1 forward
#
# What each layer of a DeepSeek-V4.1 does, one forward step watched from the inside, and the
# proof that it is the reference model: megajax's logits against the Hugging Face
# implementation's on the golden fixture (`../shared/golden/v41_tiny`, a random V4.1 at toy
# width with the 512-token vocabulary its fixtures were made with).
#
# Everything here is the public API: `model.config.ModelConfig`, `checkpoints.hf.load_params`,
# `model.forward.forward` (with `trace=True`), `model.state.init_state`, `model.batch.pack_requests`.

# %%
import json
from pathlib import Path

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from checkpoints.hf import load_params
from model.batch import pack_requests
from model.config import ModelConfig
from model.engram_vocab import engram_map_for
from model.forward import forward_jit
from model.state import init_state

GOLDEN = Path.cwd().resolve().parents[1] / "shared" / "golden" / "v41_tiny"
cfg = ModelConfig.from_json(GOLDEN)
params = load_params(GOLDEN, cfg)
emap = jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
print(f"{cfg.num_hidden_layers} layers, width {cfg.hidden_size}, {cfg.hc_mult} residual streams, "
      f"{cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}), window {cfg.sliding_window}")

# %% [markdown]
# ## Layer roles
#
# Every layer attends over its own sliding window. Layers with a compress ratio also read a
# compressed KV pool, written by a *KV source* layer and shared by the layers after it; their
# sparse selection (the indexer's top-k) comes from an *index source*. Engram layers add rows
# of a hashed n-gram table to the residual streams before their attention.

# %%
rows = []
for i in range(cfg.num_hidden_layers):
    rows.append({
        "layer": i,
        "compress ratio": cfg.compress_ratios[i],
        "reads KV of": cfg.kv_source_of(i),
        "top-k from": cfg.index_source_of(i),
        "KV source": i in cfg.kv_source_layer_ids,
        "index source": i in cfg.index_source_layer_ids,
        "Engram": i in cfg.engram_layer_ids,
        "DSpark tap": i in (cfg.dspark_target_layer_ids or ()),
    })
print(" | ".join(rows[0]))
for r in rows:
    print(" | ".join(str("-" if v is None else v) for v in r.values()))

# %% [markdown]
# ## One forward step, watched
#
# A 19-token prompt in one prefill step. `trace=True` returns each layer's four residual
# streams, the pre-mix weights (how the FFN site collapses the streams), the Engram table rows
# each token hashes to, and each index source's selection.

# %%
cases = {c["name"]: c for c in json.loads((GOLDEN / "cases.json").read_text())["cases"]}
ids = cases["c19"]["prompt_ids"]
state = init_state(cfg, 1, 64, page_size=16)
logits, state, trace = forward_jit(params, cfg, state, pack_requests([(0, ids, 0)]), emap, trace=True)
n = len(ids)
streams = np.asarray(trace.streams)[:, :n]          # [layers, tokens, streams, width]
premix = np.asarray(trace.premix)[:, :n]            # [layers, tokens, streams]

fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
norms = np.linalg.norm(streams, axis=-1).mean(1)     # [layers, streams]
for s in range(cfg.hc_mult):
    a.plot(norms[:, s], marker="o", label=f"stream {s}")
a.set(xlabel="after layer", ylabel="mean L2 norm", title="the four residual streams")
a.legend(fontsize=8)
im = b.imshow(premix.mean(1).T, aspect="auto", cmap="viridis")
b.set(xlabel="layer", ylabel="stream", title="FFN-site pre-mix weight (mean over tokens)",
      yticks=range(cfg.hc_mult))
fig.colorbar(im, ax=b)
fig.tight_layout()
plt.show()

# %% [markdown]
# The Engram rows: each of the Engram layers hashes the token's 2- and 3-gram (over the
# compressed vocabulary) into its table, one row per head and n-gram order.

# %%
rows_ids = np.asarray(trace.engram_rows)[:n]        # [tokens, engram layers, columns]
print("Engram row ids of the first 6 tokens, layer", cfg.engram_layer_ids[0])
print(rows_ids[:6, 0])
for layer, pub in trace.selections.items():
    picked = (np.asarray(pub.entries)[:n] >= 0).sum(1)
    print(f"index source {layer}: compressed entries each token selects: {picked.tolist()}")

# %% [markdown]
# ## Parity with the Hugging Face reference
#
# The fixture holds the reference's logits for the same prompt run whole, and as a prefill
# followed by single-token decode steps. megajax must match both within 1e-3 with the same
# argmax at every row (the CI asserts this; here we look at the error).

# %%
ref_full = np.load(GOLDEN / cases["c19"]["full_logits"])
ours = np.asarray(logits)[:n]
err = np.abs(ours - ref_full).max(1)
print(f"max |logit diff| {err.max():.2e}, argmax equal at {np.mean(ours.argmax(1) == ref_full.argmax(1)):.0%} of rows")

p = cases["c19"]["decode"]["prefill"]
state = init_state(cfg, 1, 64, page_size=16)
out, state = forward_jit(params, cfg, state, pack_requests([(0, ids[:p], 0)]), emap)
dec = [np.asarray(out)[:p]]
for t in range(p, n):
    out, state = forward_jit(params, cfg, state, pack_requests([(0, ids[t:t + 1], t)]), emap)
    dec.append(np.asarray(out))
dec = np.concatenate(dec)
ref_dec = np.load(GOLDEN / cases["c19"]["decode"]["logits"])
plt.figure(figsize=(6, 3))
plt.semilogy(err, marker="o", label="one-shot prefill")
plt.semilogy(np.abs(dec - ref_dec).max(1), marker="x", label=f"prefill {p} + decode steps")
plt.axhline(1e-3, color="k", lw=1, ls="--", label="tolerance")
plt.xlabel("token")
plt.ylabel("max |logit diff| vs HF")
plt.legend(fontsize=8)
plt.tight_layout()
plt.show()
assert err.max() <= 1e-3 and np.abs(dec - ref_dec).max() <= 1e-3
