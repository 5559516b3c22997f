"""DSpark's acceptance is lossless: an oracle draft (the plain run's own continuation, wrong
at planted positions) has blocks accepted in part and rejected rows rolled back, and every
output must still match, greedy and sampled, across stop tokens, min/max tokens crossing
inside a block, logprobs, top-k/top-p, penalties (such requests decode plainly) and ``n`` > 1;
sampled token frequencies match plain sampling's, and a planted bug fails the same test.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import serve.speculative
from model.dspark import Proposal
from serve.programs import shared_programs
from speculative_cases import DSPARK, outputs, random_prompts, run, tiny_with_draft


@pytest.fixture(scope="module")
def model():
    return tiny_with_draft()


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
    prompts = random_prompts(cfg, 2, [6, 30, 12, 45, 20, 9, 25])
    base = {"max_new_tokens": 21, "temperature": temperature, "seed": 3, "ignore_eos": True}
    params = [base, {**base, "logprobs": True, "top_logprobs": 2}, {**base, "n": 2, "max_new_tokens": 13},
              {**base, "min_new_tokens": 6, "ignore_eos": False, "stop_token_ids": []},
              {**base, "max_new_tokens": 12, "top_k": 20, "top_p": 0.9},
              {**base, "frequency_penalty": 0.5, "presence_penalty": 0.3},   # decodes plainly
              {**base, "max_new_tokens": 19}]
    plain, _ = run(model, prompts, params)
    # a stop token taken from inside one plain output: both runs must stop there
    params[6] = {**params[6], "stop_token_ids": [plain[6]["output_ids"][9]]}
    plain, _ = run(model, prompts, params)
    shared_programs().clear()   # the programs below trace the oracle
    monkeypatch.setattr(serve.speculative, "propose", _oracle(cfg, plain, prompts, 160))
    try:
        spec, engine = run(model, prompts, params, **DSPARK)
    finally:
        shared_programs().clear()
    assert outputs(spec) == outputs(plain)
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
    prompts = random_prompts(cfg, 3, [8]) * 64
    # a temperature that makes the target's choices peaked enough for the test to have power
    params = [{"max_new_tokens": 6, "temperature": 0.4, "seed": s, "ignore_eos": True} for s in range(64)]

    def histogram(results):
        return np.bincount(np.concatenate([r["output_ids"][1:] for r in results]), minlength=cfg.vocab_size)

    plain = histogram(run(model, prompts, params, max_running=8, prefill_budget=80)[0])
    spec = histogram(run(model, prompts, params, max_running=8, prefill_budget=80, **DSPARK)[0])
    stat, bins = _chi_square(plain, spec)
    threshold = bins + 4 * np.sqrt(2 * bins)   # the chi-square's mean plus four of its deviations
    assert stat < threshold, (stat, threshold)

    def accept_all(spec_in, fed, sampled, positions, simulate):
        return jnp.maximum(spec_in.count - 1, 0).astype(jnp.int32)

    shared_programs().clear()
    monkeypatch.setattr(serve.speculative, "accepted", accept_all)
    try:
        buggy = histogram(run(model, prompts, params, max_running=8, prefill_budget=80, **DSPARK)[0])
    finally:
        shared_programs().clear()
    stat, bins = _chi_square(plain, buggy)
    print(f"\nchi-square of the planted bug: {stat:.0f} over {bins} bins (threshold {bins + 4 * np.sqrt(2 * bins):.0f})")
    assert stat > bins + 4 * np.sqrt(2 * bins), (stat, bins)
