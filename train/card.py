"""The model card of a trained checkpoint, measured on the checkpoint as the server loads it.

``python -m train card --run DIR --model CKPT`` reads the run's corpus (``corpus.npz``) and its
stages' logs (``target/log.jsonl``, ``draft/log.jsonl`` and their ``schedule.json``: what a
device call brings back; the optimiser checkpoints need not come), then writes beside the
weights ``card.json``, ``loss.png`` and ``MODEL_CARD.md``:

* held-out perplexity through the engine's ``serve.batch_scoring.Scorer`` on the release-format
  checkpoint (fp8 linears, MXFP4 experts: what is served, not the float32 training weights), beside the
  add-one unigram and interpolated bigram baselines on the same held-out stream;
* DSpark's accept length (tokens a verify step yields, bonus included: the engine's
  ``spec_accept_length``) through ``serve.engine.Engine`` on held-out prompts, at temperature
  0 and 0.7;
* greedy continuations of a few prompts, as a sample of what it writes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from train import loop, target

PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n")
TEMPERATURES = (0.0, 0.7)


def heldout_perplexity(engine, heldout: np.ndarray, seq_len: int, max_tokens: int | None) -> dict:
    held = target.scored(heldout)[:max_tokens]
    windows = [held[i:i + seq_len + 1].tolist() for i in range(0, held.size - 1, seq_len)]
    windows = [w for w in windows if len(w) > 1]
    lps = engine.scorer.score(windows)   # the scorer on the weights the engine serves
    nll = -np.concatenate([np.asarray(lp[1:]) for lp in lps])
    return {"perplexity": float(np.exp(nll.mean())), "scored_tokens": int(nll.size)}


def accept_lengths(engine, heldout: np.ndarray, prompts: int, prompt_len: int, new_tokens: int) -> dict:
    """The engine's mean accept length per verify step at each of ``TEMPERATURES``."""
    held = target.scored(heldout)
    stride = max(1, (held.size - prompt_len) // prompts)
    ids = [held[i * stride:i * stride + prompt_len].tolist() for i in range(prompts)]
    out = {}
    for t in TEMPERATURES:
        v0, a0 = engine.stats.verifies, engine.stats.accepted
        engine.generate(ids, {"max_new_tokens": new_tokens, "temperature": t, "seed": 0, "ignore_eos": True},
                        decode_text=False)
        v, a = engine.stats.verifies - v0, engine.stats.accepted - a0
        out[f"{t:g}"] = {"accept_length": a / max(v, 1), "verify_steps": v, "tokens": a}
    out["samples"] = [{"prompt": p, "completion": r["text"]} for p, r in zip(PROMPTS, engine.generate(
        list(PROMPTS), {"max_new_tokens": new_tokens, "temperature": 0}))]
    return out


def _stage(run: Path, name: str) -> dict:
    log = loop.read_log(run / name)
    schedule = json.loads((run / name / "schedule.json").read_text())
    return {"steps": log[-1]["step"], "tokens": log[-1]["tokens"], "seconds": log[-1]["seconds"],
            "schedule": {k: schedule[k] for k in loop.Schedule.__dataclass_fields__},
            "batch": schedule["batch"], "seq_len": schedule["seq_len"], "last": log[-1], "log": log}


def plot(card: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = card["target"]["log"]
    a.plot([r["step"] for r in t], [r["loss"] for r in t], label="target, train batches")
    for name in ("unigram", "bigram"):
        a.axhline(np.log(card["heldout"][name]), ls="--", lw=1, label=f"{name} baseline, held out")
    a.axhline(np.log(card["heldout"]["perplexity"]), color="k", lw=1, label="checkpoint as served, held out")
    a.set(xlabel="step", ylabel="next-token loss (nats)", title="target")
    a.legend(fontsize=8)
    d = card["draft"]["log"]
    b.plot([r["step"] for r in d], [r["block_ce"] for r in d], label="block cross-entropy")
    b.set(xlabel="step", ylabel="nats", title="DSpark draft")
    b2 = b.twinx()
    b2.plot([r["step"] for r in d], [r["greedy_accept"] for r in d], color="C1", label="greedy accepted drafts")
    b2.set_ylabel("drafts accepted per block (greedy)")
    b.legend(loc="upper left", fontsize=8)
    b2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def card_seq_len(run: Path) -> int:
    return json.loads((run / "target" / "schedule.json").read_text())["seq_len"]


def _brief(stage: dict) -> dict:
    return {k: v for k, v in stage.items() if k != "log"}


def write(run: Path, model_dir: Path, corpus_stats: dict, train_ids: np.ndarray, heldout: np.ndarray,
          max_heldout_tokens: int | None = None, prompts: int = 8, prompt_len: int = 96, new_tokens: int = 48) -> dict:
    if target.scored(heldout).size < 2:
        raise ValueError("the run's corpus holds too few held-out tokens to score (a corpus of more files)")
    from serve.engine import Engine, EngineConfig

    cfg = json.loads((model_dir / "config.json").read_text())
    engine = Engine.from_model_dir(model_dir, EngineConfig(max_running=prompts, max_len=prompt_len + new_tokens + 16,
                                                           prefix_cache=False, speculative_algorithm="DSPARK"))
    card = {"corpus": corpus_stats, "target": _stage(run, "target"), "draft": _stage(run, "draft"),
            "heldout": {**heldout_perplexity(engine, heldout, card_seq_len(run), max_heldout_tokens),
                        **target.ngram_perplexities(train_ids, heldout, cfg["vocab_size"])},
            "dspark": accept_lengths(engine, heldout, prompts, prompt_len, new_tokens),
            "checkpoint_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
            "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                           "num_experts_per_tok", "sliding_window", "dspark_block_size")}}
    plot(card, model_dir / "loss.png")
    (model_dir / "card.json").write_text(json.dumps({**card, "target": _brief(card["target"]),
                                                     "draft": _brief(card["draft"])}, indent=1))
    (model_dir / "MODEL_CARD.md").write_text(markdown(card))
    return card


def markdown(card: dict) -> str:
    c, t, d, h, s = card["corpus"], card["target"], card["draft"], card["heldout"], card["dspark"]
    acc = " / ".join(f"{s[f'{x:g}']['accept_length']:.2f}" for x in TEMPERATURES)
    samples = "\n\n".join(f"```python\n{x['prompt']}{x['completion']}\n```" for x in s["samples"])
    return f"""# megajax V4.1-small

A DeepSeek-V4.1 of width {card['config']['hidden_size']} trained here ({card['config']['num_hidden_layers']} layers,
{card['config']['n_routed_experts']} routed experts, top-{card['config']['num_experts_per_tok']}, every V4.1 mechanism
on), with its DSpark draft (block {card['config']['dspark_block_size']}); stored in the released V4.1 format,
{card['checkpoint_bytes'] / 1e6:.1f} MB. Made by `python -m train` (`train/`); measured by `python -m train card`.

## Data
{c['name']}: {c['files']} files, {c['bytes'] / 1e6:.1f} MB, {c['train_tokens']:,} training tokens with the DeepSeek-V4
tokenizer; {c['heldout_files']} files ({c['heldout_tokens']:,} tokens) held out by a hash of their path. Licence:
{c['licence']}.

## Training
- Target: {t['steps']:,} steps of {t['batch']} x {t['seq_len']} tokens ({t['tokens'] / 1e6:.1f}M tokens,
  {t['seconds'] / 60:.1f} min), AdamW peak {t['schedule']['lr']:g}, cosine; last train loss {t['last']['loss']:.3f}.
- Draft: {d['steps']:,} steps on the frozen target, DeepSpec's block objective ({d['seconds'] / 60:.1f} min); last
  block cross-entropy {d['last']['block_ce']:.3f}, greedy accepted drafts a block {d['last']['greedy_accept']:.2f}.

![loss curves](loss.png)

## Measured on the checkpoint as served

| held-out perplexity | this model | bigram | unigram |
|---|---|---|---|
| {h['scored_tokens']:,} tokens | {h['perplexity']:.2f} | {h['bigram']:.2f} | {h['unigram']:.2f} |

DSpark accept length (tokens a verify step yields, the bonus token included) on held-out prompts,
temperature 0 / 0.7: **{acc}**.

## What it can and cannot do
It continues Python source in the style of the standard library: indentation, imports, docstrings,
common identifiers. It has read no prose, dialogue or instructions: chat requests get Python-flavoured
text, not answers; it cannot follow instructions, reason or call tools, and its facts are noise. It is
for exercising the serving stack (streaming, DSpark acceptance, structured outputs) on a model whose
output is not random.

Greedy continuations:

{samples}
"""
