"""The training recipe: the draft trains on what it runs at serve time, runs resume exactly, the
corpus split and the n-gram baselines are what they say, and the CLI's stages chain."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.init import init_params
from model.batch import pack_requests
from model import quant
from model.config import ModelConfig
from model.dspark import propose, write_context
from model.engram_vocab import engram_map_for
from model.forward import forward
from model.state import init_state
from pallas_kernels.block_scaled import Fp8Rows
from train import corpus, draft, loop, target
from train.data import batches

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"


@pytest.fixture(scope="module")
def tiny_model():
    cfg = ModelConfig.from_json(GOLDEN / "v41_tiny")
    params = init_params(cfg, seed=5, draft=True)
    emap = (jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
            if cfg.engram_layer_ids else None)
    return cfg, params, emap


@pytest.mark.parametrize("quantiser", [quant.fp8_block32, quant.fp4_block32, quant.nvfp4_block16, Fp8Rows.rounded])
def test_quantisers_train_straight_through(quantiser):
    """A fake-quantiser's gradient is its cotangent, however small (an fp8 cast alone would
    flush it), and its values are the rounding's."""
    x = jax.random.normal(jax.random.key(0), (4, 128)) * 3
    ct = jax.random.normal(jax.random.key(1), (4, 128)) * 1e-6
    y, vjp = jax.vjp(quantiser, x)
    np.testing.assert_array_equal(np.asarray(vjp(ct)[0]), np.asarray(ct))
    assert not np.array_equal(np.asarray(y), np.asarray(x))
    assert float(jnp.abs(y - x).max()) < 0.2 * float(jnp.abs(x).max())


def test_training_blocks_are_the_served_proposal(tiny_model):
    """The draft's training logits for a block equal ``propose``'s at serve time, given the
    context the engine writes (the target's step over the tokens below the anchor) and the text's
    tokens as the draft's own previous choices; slot 0 is taught the target's distribution for
    the token after the anchor."""
    cfg, params, emap = tiny_model
    mtp = params["mtp"]
    backbone = {k: v for k, v in params.items() if k != "mtp"}
    rng = np.random.default_rng(0)
    n, b = 40, cfg.dspark_block_size
    tokens = rng.integers(2, cfg.vocab_size, size=(1, n + 1)).astype(np.int32)
    anchors = np.array([[3, n - b]], np.int32)   # context shorter than, and past, the window
    logits, conf, t_logits = jax.jit(lambda m, p, t, x: draft.block_logits(m, p, cfg, emap, t, x))(
        mtp, backbone, jnp.asarray(tokens), jnp.asarray(anchors))
    a = anchors[0]
    step = jax.jit(lambda p, st, batch: forward(p, cfg, st, batch, emap, taps=True))   # compiled: eager is slower
    # both anchors as two requests of one engine step: slot j holds the text below anchor j
    state = init_state(cfg, 2, 64, page_size=16, spec_tokens=b)
    _, state, taps = step(params, state, pack_requests([(j, list(tokens[0, :x]), 0) for j, x in enumerate(a)]))
    state = state.replace(draft_window=write_context(mtp, cfg, state.draft_window, taps.aux, taps.info))

    def served(p, st):
        seen = []

        def text(i, slot_logits):   # the draft "chooses" the text's token, and its logits are kept
            seen.append(slot_logits)
            return jnp.asarray(tokens[0, a + i + 1])

        propose(p, cfg, st, jnp.asarray(tokens[0, a]), jnp.asarray(a), jnp.asarray([0, 1], jnp.int32), b, text)
        return jnp.stack(seen, 1)

    np.testing.assert_allclose(np.asarray(logits), np.asarray(jax.jit(served)(params, state)), rtol=2e-3, atol=2e-3)
    fresh = init_state(cfg, 2, 64, page_size=16)
    t_out = step(params, fresh, pack_requests([(j, list(tokens[0, :x + 1]), 0) for j, x in enumerate(a)]))[0]
    np.testing.assert_allclose(np.asarray(t_logits[:, 0]), np.asarray(t_out[np.cumsum(a + 1) - 1]), rtol=1e-3,
                               atol=1e-3)


def test_draft_loss_trains_only_the_draft(tiny_model):
    cfg, params, emap = tiny_model
    mtp = params["mtp"]
    backbone = {k: v for k, v in params.items() if k != "mtp"}
    rng = np.random.default_rng(1)
    tokens, anchors = draft.anchored(rng.integers(2, cfg.vocab_size, size=(2, 33)).astype(np.int32), 4,
                                     cfg.dspark_block_size, rng)
    assert anchors.min() >= 1 and anchors.max() <= 32 - cfg.dspark_block_size
    (value, metrics), grads = jax.jit(jax.value_and_grad(draft.loss_fn(cfg, emap), has_aux=True))(
        mtp, backbone, (jnp.asarray(tokens), jnp.asarray(anchors)))
    assert np.isfinite(float(value)) and 0 <= float(metrics["greedy_accept"]) <= cfg.dspark_block_size
    norms = {k: float(optax_norm(g)) for k, g in grads.items()}
    assert norms["main_proj"] > 0 and norms["markov_head"] > 0 and norms["confidence"] > 0, norms


def optax_norm(tree) -> jnp.ndarray:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def test_a_resumed_run_equals_an_uninterrupted_one(tiny_model, tmp_path):
    cfg, params, emap = tiny_model
    backbone = {k: v for k, v in params.items() if k != "mtp"}
    ids = np.tile(np.random.default_rng(2).integers(2, cfg.vocab_size, size=8), 75).astype(np.int32)  # learnable
    data = batches(ids, 32, 2, seed=0)
    sched = loop.Schedule(steps=4, lr=1e-2, warmup=1, log_every=1, ckpt_every=100)
    loss = target.loss_fn(cfg, emap)
    whole, _ = loop.run(tmp_path / "whole", backbone, loss, data, sched)
    loop.run(tmp_path / "split", backbone, loss, data, sched.__class__(**{**sched.__dict__, "steps": 2}))
    resumed, step = loop.run(tmp_path / "split", backbone, loss, data, sched)
    assert step == 4
    for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    log = loop.read_log(tmp_path / "whole")
    assert [r["step"] for r in log] == [1, 2, 3, 4] and log[-1]["loss"] < log[0]["loss"]
    assert not any(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(backbone)) if x.size > 1 and x.ndim > 1)


def test_corpus_split_is_by_file_and_stable(tmp_path):
    for i in range(60):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe\x00")

    class Tok:
        def encode_batch(self, texts):
            return [type("E", (), {"ids": [ord(c) for c in t]}) for t in texts]

    c = corpus.build(Tok(), 1, root=tmp_path, fraction=0.2)
    held = {p.name for p in corpus.source_files(tmp_path) if corpus.held_out(p.name, 0.2)}
    assert c.stats["skipped_not_utf8"] == 1 and c.stats["files"] == 60 and c.stats["heldout_files"] == len(held) - (
        "bad.py" in held)
    assert 0 < len(held) < 30
    assert c.train.size + c.heldout.size == sum(len(f"x = {i}\n") + 1 for i in range(60))
    assert corpus.build(Tok(), 1, root=tmp_path, fraction=0.2).heldout.tolist() == c.heldout.tolist()


def test_bigram_baseline_beats_unigram_on_structured_text():
    rng = np.random.default_rng(3)
    seq = np.cumsum(rng.integers(1, 3, size=20000)) % 50   # each token predicts the next well
    out = target.ngram_perplexities(seq[:15000], seq[15000:], 50)
    assert out["bigram"] < out["unigram"] / 5 and out["unigram"] > 30


def test_cli_stages_chain_into_a_v41_checkpoint(tmp_path, monkeypatch):
    from checkpoints.hf import load_params
    from train import recipe
    from train.__main__ import main

    monkeypatch.setattr(recipe, "DRAFT_ANCHORS", 2)
    run, out = tmp_path / "run", tmp_path / "model"
    common = ["--run", str(run), "--steps", "1", "--batch", "1", "--seq-len", "32", "--max-files", "2"]
    assert main(["target", *common]) == 0
    assert main(["draft", *common]) == 0
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["expert_dtype"] == "fp4"
    assert config["hidden_size"] == recipe.small_config().hidden_size
    loaded = load_params(out)
    assert "mtp" in loaded and loop.read_log(run / "draft")[-1]["step"] == 1

    # the card measures the exported checkpoint (held-out stand-in: the corpus's last tokens)
    from train import card
    from train.__main__ import corpus as run_corpus

    train_ids, _, stats = run_corpus(run, None)
    got = card.write(run, out, stats, train_ids, train_ids[-130:], prompts=2, prompt_len=8, new_tokens=4)
    assert got["heldout"]["scored_tokens"] == 64   # the scored half, in windows of 32 + 1
    assert 1 < got["heldout"]["perplexity"] < 10 * cfg_vocab(out) and got["heldout"]["bigram"] > 1
    assert all(1 <= got["dspark"][t]["accept_length"] <= 4 for t in ("0", "0.7"))
    text = (out / "MODEL_CARD.md").read_text()
    assert f"{got['heldout']['perplexity']:.2f}" in text and (out / "loss.png").stat().st_size > 10_000
    assert json.loads((out / "card.json").read_text())["target"]["steps"] == 1
    with pytest.raises(ValueError, match="held-out"):
        card.write(run, out, stats, train_ids, train_ids[:2])


def cfg_vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]
