"""DSpark speculative decoding in the engine is lossless: the same tokens as without it.

Random draft weights accept almost nothing: the greedy runs here check the paths a rejected
block takes (chunked prefill, retraction, prefix hits, decoder replay, the overlap scheduler)
and a grammar's check of the drafts; ``test_speculative_acceptance.py`` drives acceptance with
an oracle draft and checks the sampled distribution.
"""
from __future__ import annotations

import pytest

from serve.engine import Engine, EngineConfig
from speculative_cases import DSPARK, outputs, random_prompts, run, tiny_with_draft


@pytest.fixture(scope="module")
def model():
    return tiny_with_draft()


@pytest.mark.parametrize("kw", [dict(), dict(decoder_replay="exact", overlap=False, num_pages=12)],
                         ids=["approx-replay-overlap", "exact-replay-retraction"])
def test_greedy_outputs_equal_without_dspark(model, kw):
    cfg = model[0]
    prompts = random_prompts(cfg, 1, [5, 40, 17, 70, 9, 33])
    prompts.append(prompts[3][:64] + [7, 8, 9])   # a prefix hit on request 3's pages
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain, plain_engine = run(model, prompts, params, **kw)
    spec, engine = run(model, prompts, params, **kw, **DSPARK)
    assert outputs(spec) == outputs(plain)
    assert engine.stats.verifies > 0
    # every speculative request verifies every step, overlap or not (a verify yields at least the
    # token a plain step would): were they to sit out the step in flight, it would take ~1.8x
    assert engine.stats.steps < 1.25 * plain_engine.stats.steps, (engine.stats.steps, plain_engine.stats.steps)
    if "num_pages" in kw:
        assert engine.scheduler.retractions > 0


def test_grammar_checks_drafts_before_they_are_fed():
    """A regex-constrained request on the default model (the real vocabulary the grammar needs):
    drafts the grammar refuses are dropped before the verify, and the output is the plain one."""
    import re

    from serve.default_model import random_config, random_params

    cfg = random_config()
    params = random_params(cfg, draft=True)
    base = dict(max_running=2, max_len=96, page_size=16, prefill_budget=64, decoder_replay="off")
    job = {"max_new_tokens": 10, "temperature": 0, "regex": "[a-z]{3,12}"}
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plain = Engine(params, cfg, EngineConfig(**base)).generate(prompts, job)
    engine = Engine(params, cfg, EngineConfig(**base, **DSPARK))
    spec = engine.generate(prompts, job)
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert all(re.fullmatch("[a-z]{3,12}", r["text"]) for r in spec), [r["text"] for r in spec]
    assert engine.stats.verifies > 0


def test_the_step_in_flight_lands_first_only_for_a_majority_that_needs_it():
    """Host only: with half or more of the decoding requests needing the step in flight (their
    drafts), the engine lands it before planning; one such request among plain ones does not
    take the overlap from the rest."""
    from serve.request import Request
    from serve.sampling import SamplingParams
    from serve.scheduler import Scheduler

    s = Scheduler(4, 4, 64, prefill_budget=256, window=8, max_len=128, prefix_cache=False)
    reqs = [Request(f"r{i}", [3, 4, 5], SamplingParams(max_new_tokens=4), 0) for i in range(4)]
    for r in reqs:
        s.submit(r)
    s.schedule()
    for r in reqs:   # prefilled; each has a step in flight
        r.computed, r.inflight = len(r.ids), 1
    assert not s.waiting_on_flight()   # plain requests plan on placeholders
    reqs[0].spec = True
    assert not s.waiting_on_flight()
    reqs[1].spec = True
    assert s.waiting_on_flight()
    reqs[0].inflight = reqs[1].inflight = 0
    assert not s.waiting_on_flight()
