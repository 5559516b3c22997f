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
# # DSpark: how many drafts a step the target accepts
#
# DSpark's draft (MODEL_SPEC §7) proposes a block of tokens from the target's own hidden
# states; the target verifies them in its next step and keeps the longest prefix that equals
# its own samples, plus one token of its own (so a step yields between 1 and drafts + 1 tokens,
# and outputs are exactly what the target alone would write: `serve/speculative.py`).
# The *accept length* is tokens per verify step, the bonus token included.
#
# Here, through the public engine (`serve.engine.Engine`, as `--speculative-algorithm DSPARK`
# runs it): accept length against the number of drafts, the temperature, and with the draft's
# Markov head (the term that makes slot i depend on the token chosen for slot i - 1) zeroed.
#
# The model is the embedded default, `deepseek-v4.1-small`, trained here with its draft
# (`models/deepseek-v4.1-small/MODEL_CARD.md`); the prompts are files of its corpus it was not
# trained on (the held-out side of `train.corpus`).

# %%
import sysconfig
from pathlib import Path

import jax
import matplotlib.pyplot as plt

from serve.default_model import SMALL_DIR, SMALL_NAME
from serve.engine import Engine, EngineConfig
from serve.loaded_model import LoadedModel
from train.corpus import held_out, source_files

model = LoadedModel.from_model_dir(SMALL_DIR)
cfg, params = model.cfg, model.params
print(SMALL_NAME, f"draft block {cfg.dspark_block_size}")
stdlib = Path(sysconfig.get_paths()["stdlib"])
unseen = [p for p in source_files(stdlib) if held_out(p.relative_to(stdlib).as_posix())]
PROMPTS = [p.read_text(errors="replace") for p in unseen[:4]]
PROMPT_TOKENS, NEW = 64, 24


def accept(engine, temperature):
    v0, a0 = engine.stats.verifies, engine.stats.accepted
    prompt_ids = [engine.encode(p)[:PROMPT_TOKENS] for p in PROMPTS]
    engine.generate(prompt_ids, {"max_new_tokens": NEW, "temperature": temperature, "seed": 1, "ignore_eos": True},
                    decode_text=False)
    return (engine.stats.accepted - a0) / max(engine.stats.verifies - v0, 1)


def engine(drafts, p=params):
    # every prompt prefilled in one step, no prefix cache (so no replay programs): few programs to compile
    return Engine(p, cfg, EngineConfig(max_running=len(PROMPTS), max_len=128, prefill_budget=len(PROMPTS) * PROMPT_TOKENS,
                                       prefix_cache=False, decoder_replay="off", speculative_algorithm="DSPARK",
                                       speculative_num_draft_tokens=drafts))


# %%
DRAFTS = [1, 4]
TEMPS = [0.0, 0.7]
by_drafts = {}
for d in DRAFTS:
    e = engine(d)
    by_drafts[d] = {t: accept(e, t) for t in TEMPS}
no_markov = {**params, "mtp": {**params["mtp"], "markov_head": jax.numpy.zeros_like(params["mtp"]["markov_head"])}}
e = engine(DRAFTS[-1], no_markov)
without = {t: accept(e, t) for t in TEMPS}

fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
for t in TEMPS:
    a.plot(DRAFTS, [by_drafts[d][t] for d in DRAFTS], marker="o", label=f"temperature {t:g}")
a.plot(DRAFTS, [d + 1 for d in DRAFTS], ls=":", color="gray", label="every draft accepted")
a.set(xlabel="drafts a step", ylabel="tokens per verify step", title="accept length")
a.legend(fontsize=8)
x = range(len(TEMPS))
b.bar([i - 0.2 for i in x], [by_drafts[DRAFTS[-1]][t] for t in TEMPS], 0.4, label="Markov head on")
b.bar([i + 0.2 for i in x], [without[t] for t in TEMPS], 0.4, label="Markov head zeroed")
b.set(xticks=list(x), xticklabels=[f"T={t:g}" for t in TEMPS], ylabel="tokens per verify step",
      title=f"{DRAFTS[-1]} drafts: the Markov head")
b.legend(fontsize=8)
fig.tight_layout()
plt.show()
for d in DRAFTS:
    print(f"{d} drafts:", {f"T={t:g}": round(v, 3) for t, v in by_drafts[d].items()})
print("Markov head zeroed:", {f"T={t:g}": round(v, 3) for t, v in without.items()})
