"""DSpark speculative decoding in the engine is lossless: the same tokens as without it.

Random draft weights accept almost nothing, so the acceptance path is also driven by an
oracle draft (the plain run's own continuation, wrong at planted positions): then blocks are
accepted in part, rejected rows are rolled back, and every output must still match, greedy
and sampled, across chunked prefill, retraction, prefix hits, decoder replay, the overlap
scheduler, stop tokens, min/max tokens crossing inside a block, logprobs, top-k/top-p,
penalties (such requests decode plainly) and ``n`` > 1.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import serve.speculative
from checkpoints.init import init_params
from conftest import GOLDEN
from model.config import ModelConfig
from model.dspark import Proposal
from serve.engine import Engine, EngineConfig
from serve.programs import shared_programs

DSPARK = dict(speculative_algorithm="DSPARK", speculative_num_draft_tokens=3)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_json(GOLDEN / "v41_tiny")
    return cfg, init_params(cfg, seed=5, draft=True)


def _prompts(cfg, seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in lengths]


def _run(model, prompts, params, **kw):
    cfg, p = model
    base = dict(max_running=4, max_len=160, page_size=16, prefill_budget=40)
    engine = Engine(p, cfg, EngineConfig(**{**base, **kw}))
    return engine.generate(prompts, params, decode_text=False), engine


def _outputs(results):
    return [[c["output_ids"] for c in r["choices"]] if "choices" in r else r["output_ids"] for r in results]


@pytest.mark.parametrize("kw", [dict(), dict(decoder_replay="exact", overlap=False, num_pages=12)],
                         ids=["approx-replay-overlap", "exact-replay-retraction"])
def test_greedy_outputs_equal_without_dspark(model, kw):
    cfg = model[0]
    prompts = _prompts(cfg, 1, [5, 40, 17, 70, 9, 33])
    prompts.append(prompts[3][:64] + [7, 8, 9])   # a prefix hit on request 3's pages
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain, _ = _run(model, prompts, params, **kw)
    spec, engine = _run(model, prompts, params, **kw, **DSPARK)
    assert _outputs(spec) == _outputs(plain)
    assert engine.stats.verifies > 0
    if "num_pages" in kw:
        assert engine.scheduler.retractions > 0


def _oracle(cfg, results, prompts, max_len):
    """A draft that proposes what the plain run generated next (by token and position),
    wrong wherever the position is 3 mod 4."""
    table = np.zeros((cfg.vocab_size, max_len), np.int32)
    for prompt, r in zip(prompts, results):
        for out in ([c["output_ids"] for c in r["choices"]] if "choices" in r else [r["output_ids"]]):
            seq = prompt + out
            for p in range(len(prompt) - 1, len(seq) - 1):
                table[seq[p], p] = seq[p + 1]
    table = jnp.asarray(table)

    def propose(params, cfg, state, anchors, anchor_pos, slots, num_drafts, sample_slot):
        drafts, prev = [], anchors
        for i in range(num_drafts):
            at = jnp.clip(anchor_pos + i, 0, max_len - 1)
            prev = jnp.where(at % 4 == 3, (table[prev, at] + 1) % cfg.vocab_size, table[prev, at])
            drafts.append(prev)
        return Proposal(jnp.stack(drafts, 1), jnp.zeros((anchors.shape[0], num_drafts)))
    return propose


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_accepted_blocks_roll_back_losslessly(model, monkeypatch, temperature):
    cfg = model[0]
    prompts = _prompts(cfg, 2, [6, 30, 12, 45, 20, 9, 25])
    base = {"max_new_tokens": 21, "temperature": temperature, "seed": 3, "ignore_eos": True}
    params = [base, {**base, "logprobs": True, "top_logprobs": 2}, {**base, "n": 2, "max_new_tokens": 13},
              {**base, "min_new_tokens": 6, "ignore_eos": False, "stop_token_ids": []},
              {**base, "max_new_tokens": 12, "top_k": 20, "top_p": 0.9},
              {**base, "frequency_penalty": 0.5, "presence_penalty": 0.3},   # decodes plainly
              {**base, "max_new_tokens": 19}]
    plain, _ = _run(model, prompts, params)
    # a stop token taken from inside one plain output: both runs must stop there
    params[6] = {**params[6], "stop_token_ids": [plain[6]["output_ids"][9]]}
    plain, _ = _run(model, prompts, params)
    shared_programs().clear()   # the programs below trace the oracle
    monkeypatch.setattr(serve.speculative, "propose", _oracle(cfg, plain, prompts, 160))
    try:
        spec, engine = _run(model, prompts, params, **DSPARK)
    finally:
        shared_programs().clear()
    assert _outputs(spec) == _outputs(plain)
    flat = lambda rs: [c for r in rs for c in r.get("choices", [r])]   # noqa: E731
    for a, b in zip(flat(spec), flat(plain)):
        if "token_logprobs" in b:
            np.testing.assert_allclose(a["token_logprobs"], b["token_logprobs"], rtol=1e-4, atol=1e-5)
            assert [[t for t, _ in row] for row in a["top_logprobs"]] == [[t for t, _ in row] for row in b["top_logprobs"]]
        assert a["finish_reason"] == b["finish_reason"]
    assert spec[6]["finish_reason"] == "stop" and len(spec[6]["output_ids"]) == 10
    assert engine.stats.accepted / engine.stats.verifies > 1.8, engine.stats   # blocks were accepted in part


def _chi_square(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square statistic over the bins either sample uses."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    ka, kb = np.sqrt(b.sum() / a.sum()), np.sqrt(a.sum() / b.sum())
    return float(((ka * a - kb * b) ** 2 / (a + b)).sum()), int(keep.sum())


def test_sampled_token_frequencies_match_and_a_planted_bug_fails(model, monkeypatch):
    """Token frequencies over many seeds: DSpark against plain sampling, then the same with a
    planted bug (every draft accepted unchecked), which the same threshold must catch."""
    cfg = model[0]
    prompts = _prompts(cfg, 3, [8]) * 64
    # a temperature that makes the target's choices peaked enough for the test to have power
    params = [{"max_new_tokens": 6, "temperature": 0.4, "seed": s, "ignore_eos": True} for s in range(64)]

    def histogram(results):
        return np.bincount(np.concatenate([r["output_ids"][1:] for r in results]), minlength=cfg.vocab_size)

    plain = histogram(_run(model, prompts, params, max_running=8, prefill_budget=80)[0])
    spec = histogram(_run(model, prompts, params, max_running=8, prefill_budget=80, **DSPARK)[0])
    stat, bins = _chi_square(plain, spec)
    threshold = bins + 4 * np.sqrt(2 * bins)   # the chi-square's mean plus four of its deviations
    assert stat < threshold, (stat, threshold)

    def accept_all(spec_in, fed, sampled, positions, simulate):
        return jnp.maximum(spec_in.count - 1, 0).astype(jnp.int32)

    shared_programs().clear()
    monkeypatch.setattr(serve.speculative, "accepted", accept_all)
    try:
        buggy = histogram(_run(model, prompts, params, max_running=8, prefill_budget=80, **DSPARK)[0])
    finally:
        shared_programs().clear()
    stat, bins = _chi_square(plain, buggy)
    print(f"\nchi-square of the planted bug: {stat:.0f} over {bins} bins (threshold {bins + 4 * np.sqrt(2 * bins):.0f})")
    assert stat > bins + 4 * np.sqrt(2 * bins), (stat, bins)


def test_grammar_checks_drafts_before_they_are_fed():
    """A regex-constrained request on the default model (the real vocabulary the grammar needs):
    drafts the grammar refuses are dropped before the verify, and the output is the plain one."""
    import re

    from serve.default_model import default_config, default_params

    cfg = default_config()
    params = default_params(cfg, draft=True)
    base = dict(max_running=2, max_len=96, page_size=16, prefill_budget=64, decoder_replay="off")
    job = {"max_new_tokens": 10, "temperature": 0, "regex": "[a-z]{3,12}"}
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plain = Engine(params, cfg, EngineConfig(**base)).generate(prompts, job)
    engine = Engine(params, cfg, EngineConfig(**base, **DSPARK))
    spec = engine.generate(prompts, job)
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert all(re.fullmatch("[a-z]{3,12}", r["text"]) for r in spec), [r["text"] for r in spec]
    assert engine.stats.verifies > 0
