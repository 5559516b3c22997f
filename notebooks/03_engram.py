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
# # Engram: hashed n-gram memory
#
# Two V4.1 layers add rows of a huge table to the residual streams, addressed by hashes of
# the token's last 2, 3 and 4 ids over a *compressed* vocabulary (MODEL_SPEC §3.10). This
# notebook follows a text through the compression and the hash, sizes the tables at V4.1
# scale, and measures what a lookup costs with the table in device memory against host memory.

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from tokenizers import Tokenizer

from mega.engram import lookup_rows
from model.config import ModelConfig
from model.engram_hash import EngramHashTables, engram_hash, lookback_ids
from model.engram_vocab import compressed_token_map, tokenizer_path
from serve.default_model import random_config

tok = Tokenizer.from_file(str(tokenizer_path()))
comp = compressed_token_map()
print(f"{comp.size:,} token ids -> {comp.max() + 1:,} compressed classes")

# %% [markdown]
# ## The compressed vocabulary
# Case, accents, Unicode forms and runs of whitespace are folded, so spellings of one word
# share their n-gram rows.

# %%
for word in ["Hello", " hello", " Hello", " HELLO", " héllo", "hello"]:
    ids = tok.encode(word, add_special_tokens=False).ids
    print(f"{word!r:10} ids {ids} -> classes {comp[ids].tolist()}")

# %% [markdown]
# ## The hash
# Each token's look-back ids (itself and up to 3 before it; blocked at the start) are
# multiplied by per-layer odd constants, XOR-folded, and reduced modulo one prime per
# (n-gram size, head): one table row per column. Equal n-grams give equal rows wherever
# they occur; here with the embedded default model's config (2 Engram layers, n-grams up
# to 3, 2 heads: 4 columns per layer).

# %%
cfg = random_config()
tables = EngramHashTables.from_config(cfg)
text = "the cat sat on the mat. The cat sat on the hat."
ids = tok.encode(text, add_special_tokens=False).ids
c = jnp.asarray(comp[ids], jnp.int32)
n = len(ids)
look = lookback_ids(c, jnp.full((1, cfg.engram_max_ngram_size - 1), -1, jnp.int32), jnp.zeros(n, jnp.int32),
                    jnp.arange(n, dtype=jnp.int32), jnp.zeros(1, jnp.int32), cfg.engram_pad_id,
                    cfg.engram_max_ngram_size)
rows = np.asarray(engram_hash(look, tables))        # [tokens, engram layers, columns]
for t in range(n):
    print(f"{tok.decode([ids[t]])!r:8} layer {cfg.engram_layer_ids[0]} rows {rows[t, 0].tolist()}")

# %% [markdown]
# "the cat sat on the" comes back with a capital T, which the compression folds: the 2-gram
# columns of " cat" repeat (its 3-gram differs: "." before, the start before that), and from
# " sat" on every column repeats.
#
# ## Table sizes at V4.1 scale
# V4.1 hashes n-grams 2..4 with 8 heads each (24 columns) into 16M-sized prime moduli; the
# config derives the primes, and their sums must be the released row counts.

# %%
v41 = ModelConfig.from_dict({**cfg.to_dict(), "engram_vocab_size": 16_000_000, "engram_max_ngram_size": 4,
                             "engram_n_heads": 8, "engram_head_dim": 256,
                             "engram_num_embeddings": [384_006_168, 384_016_682]})
row_bytes = v41.engram_head_dim + v41.engram_head_dim // 32        # e4m3 row + one UE8M0 byte per 32
for layer, count in zip((1, 14), v41.engram_num_embeddings):
    print(f"layer {layer}: {count:,} rows x {row_bytes} B = {count * row_bytes / 2**30:.1f} GiB")
total = sum(v41.engram_num_embeddings) * row_bytes
per_token = 2 * v41.engram_n_cols * row_bytes
print(f"both tables {total / 2**30:.1f} GiB; a token reads {v41.engram_n_cols} rows a layer, "
      f"{per_token / 1024:.1f} KiB for both layers")

# %% [markdown]
# ## Device against host placement
#
# Memory: on the device the tables take 188.8 GiB: more than an H200 has, so they are
# sharded (8 GPUs: 23.6 GiB each, KV cache given up for them); on the host they take no
# GPU memory, and each step moves only its tokens' rows.
#
# Time: below, a lookup of `T` tokens x 24 rows from a 1M-row e4m3 table (a slice of the real
# one), as the two placements do it on this machine: **device**, the jitted gather and
# dequantisation (`mega.engram.lookup_rows`) over a table in device memory; **host**, a numpy
# gather from host memory, the rows sent to the device (`jax.device_put`) and dequantised
# there. On a CPU-only machine the "device" is host memory too, so the host path's extra cost
# here is its gather and copy; on a GPU the transfer goes over PCIe (bytes per step below at
# the 6.5 GB/s host-to-device rate measured on the H200 host, `bench/RESULTS.md`).

# %%
ROWS, COLS = 1 << 20, v41.engram_n_cols
rng = np.random.default_rng(0)
table_host = rng.integers(0, 0x7E, size=(ROWS, v41.engram_head_dim), dtype=np.uint8).view(jnp.float8_e4m3fn)
scale_host = np.full((ROWS, v41.engram_head_dim // 32), 127, np.uint8)      # UE8M0 exponent bytes: 2**0
table_dev, scale_dev = jax.device_put(table_host), jax.device_put(scale_host)
on_device = jax.jit(lookup_rows)
dequant = jax.jit(lambda rows, scales: lookup_rows(rows, scales, jnp.arange(rows.shape[0])[:, None]))


def timed(fn, repeat=20):
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


results = {"device": [], "host": []}
TOKENS = [8, 32, 128, 512, 2048]
for t in TOKENS:
    idx = rng.integers(0, ROWS, size=(t, COLS)).astype(np.int32)
    idx_dev = jax.device_put(idx)
    results["device"].append(timed(lambda: on_device(table_dev, scale_dev, idx_dev).block_until_ready()))

    def host_path():
        rows, scales = table_host[idx.reshape(-1)], scale_host[idx.reshape(-1)]
        return dequant(jax.device_put(rows), jax.device_put(scales)).block_until_ready()

    results["host"].append(timed(host_path))

bytes_per_step = np.array(TOKENS) * COLS * row_bytes
fig, a = plt.subplots(figsize=(6.5, 3.8))
a.loglog(TOKENS, results["device"], marker="o", label="device table (this machine)")
a.loglog(TOKENS, results["host"], marker="x", label="host table: gather + copy (this machine)")
a.loglog(TOKENS, bytes_per_step / 6.5e9 * 1e3, ls="--", label="PCIe at 6.5 GB/s: the rows alone")
a.set(xlabel="tokens in the step", ylabel="ms per Engram layer", title="one layer's lookup, 24 rows a token")
a.legend(fontsize=8)
fig.tight_layout()
plt.show()
for t, d, h in zip(TOKENS, results["device"], results["host"]):
    print(f"{t:5} tokens: device {d:.3f} ms, host {h:.3f} ms, {t * COLS * row_bytes / 1e6:.2f} MB of rows")

# %% [markdown]
# The host path's transfer is what a GPU pays: at decode sizes (8-256 tokens) it is tens of
# microseconds and hides behind the layers before the Engram layer, which is why host
# placement costs little throughput while giving back the 188.8 GiB to KV cache; at prefill
# sizes it grows to milliseconds, overlapped only with the layers before layer 1 for table 1.
