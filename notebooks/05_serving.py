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
# # Serving: latency against arrival rate and prefix-cache hits
#
# `bench/serving_eval.py` puts one megajax worker behind the SGLang model gateway and drives it
# with SGLang's own client, `bench_serving`, over a grid: Poisson arrival rates crossed with the
# share of each prompt that a group of requests shares (a system prompt), and prompt/output
# lengths. Each point records what the client saw (TTFT, inter-token latency, end-to-end latency,
# throughput, requests lost) and what the worker served from its prefix cache
# (`sglang:cached_tokens_total` over `sglang:prompt_tokens_total` from its `/metrics`).
#
# This notebook reads the newest grid in `bench/results/` (run `python bench/serving_eval.py` for a
# new one) and looks at three questions: how TTFT and ITL grow with the arrival rate, how much the
# prefix cache moves them, and how much of the designed sharing the server actually gets.

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt

results = Path("..") / "bench" / "results"
path = max(results.glob("serving_eval_*.json"), key=lambda p: p.stat().st_mtime)
report = json.loads(path.read_text())
points = report["points"]
print(path.name, "|", report["device"])
print("commit", report["commit"], "| client: sglang", report["versions"]["sglang (client)"],
      "| gateway: sglang-router", report["versions"]["sglang-router"])
print(len(points), "points,", report["num_prompts"], "requests each;",
      "lost:", sum(p["lost"] for p in points))

# %% [markdown]
# ## Latency against the arrival rate
#
# One colour per hit rate; the median solid, the p99 dashed. TTFT is dominated by queueing for a
# prefill slot once the rate nears what the device can prefill; a prefix hit shortens each prefill
# to the replayed window and the unshared tail. ITL's median is one decode step; its p99 is a decode
# step that waited behind another request's prefill, which hits make rarer.

# %%
groups = {}
for p in sorted(points, key=lambda p: p["rate"]):
    groups.setdefault((p["hit_rate"], p["input_len"], p["output_len"]), []).append(p)

fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, metric, label in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "ITL (ms)")):
    for i, ((hit, n_in, n_out), group) in enumerate(sorted(groups.items())):
        rates = [p["rate"] for p in group]
        ax.plot(rates, [p["summary"][f"median_{metric}_ms"] for p in group], "o-", color=f"C{i}",
                label=f"hit {hit:g}, {n_in}:{n_out}")
        ax.plot(rates, [p["summary"][f"p99_{metric}_ms"] for p in group], "o--", color=f"C{i}", alpha=0.6)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel(label)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
fig.suptitle("median (solid) and p99 (dashed)")
fig.tight_layout()

# %% [markdown]
# ## What the prefix cache buys at each rate
#
# The TTFT of each hit rate over the TTFT with no shared prefix, at the same rate and lengths.

# %%
base = {(p["rate"], p["input_len"], p["output_len"]): p["summary"]["median_ttft_ms"]
        for p in points if p["hit_rate"] == 0}
print(f"{'hit':>5} {'rate':>6} {'TTFT p50 ms':>12} {'vs no sharing':>14}")
for p in sorted(points, key=lambda p: (p["hit_rate"], p["rate"])):
    ref = base.get((p["rate"], p["input_len"], p["output_len"]))
    ttft = p["summary"]["median_ttft_ms"]
    print(f"{p['hit_rate']:5g} {p['rate']:6g} {ttft:12.0f} {(ref / ttft if ref else float('nan')):13.1f}x")

# %% [markdown]
# ## Designed against served sharing
#
# A group's first request cannot hit: the designed share is `hit x (k - 1) / k` for groups of `k`.
# The server also matches whole pages only, and a request that arrives while the first of its
# group is still prefilling finds nothing cached yet, so the served share falls as the rate rises.
# (The served share also counts `bench_serving`'s warm-up request, a repeat of the first prompt.)

# %%
fig, ax = plt.subplots(figsize=(6, 4))
for i, hit in enumerate(sorted({p["hit_rate"] for p in points})):
    group = sorted((p for p in points if p["hit_rate"] == hit), key=lambda p: p["rate"])
    ax.plot([p["rate"] for p in group], [p["served_cached_share"] for p in group], "o-", color=f"C{i}",
            label=f"hit {hit:g}: served")
    ax.axhline(group[0]["designed_cached_share"], color=f"C{i}", ls=":", alpha=0.7)
ax.set_xlabel("arrival rate (requests/s)")
ax.set_ylabel("prompt tokens served from cache")
ax.set_title("served (points) against designed (dotted)")
ax.legend(fontsize=8)
fig.tight_layout()
