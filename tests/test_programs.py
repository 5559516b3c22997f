"""The compiled-program budget: what fits, the errors that name what to change, LRU eviction
that frees the mappings, and an engine under a small cap giving the same outputs."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from serve.engine import Engine, EngineConfig
from serve.programs import BudgetError, ProgramBudget, ProgramCache, process_maps, shared_programs


def test_budget_fits_the_map_limit_and_memory():
    b = ProgramBudget(map_limit=65530, memory=8 << 30, base_maps=1400, map_cost=1000, rss_cost=80 << 20)
    assert b.fit() == (16382 - 1400) // 1000 == 14      # the map limit binds, not 4 GB / 80 MB = 51
    assert b.capacity() == 14
    b.cap(8)
    assert b.capacity() == 8
    b.check()
    b.cap(20)
    with pytest.raises(BudgetError, match="lower --max-compiled-programs"):
        b.check()
    with pytest.raises(BudgetError, match="--max-compiled-programs 3 is below"):
        b.cap(3)
    small = ProgramBudget(map_limit=8000, memory=None, base_maps=1400, map_cost=1000)
    with pytest.raises(BudgetError, match="raise vm.max_map_count"):
        small.check()
    assert ProgramBudget(map_limit=None, memory=None).capacity() is None   # nothing measured, no cap: unbounded


def test_cache_evicts_least_recently_used_and_frees_the_mappings():
    cache = ProgramCache(ProgramBudget.detect())
    cache.budget.cap(4)

    def scaled(x, *, k):
        return jnp.sin(x * k) + jnp.cos(x / k)   # a few fusions: a few mappings each

    x = jnp.arange(8.0)
    for k in range(4):
        cache.run(("scaled", k), scaled, (x,), dict(k=k + 1))
    maps_full = process_maps()
    cache.run(("scaled", 0), scaled, (x,), dict(k=1))       # a hit: 0 becomes the most recent
    for k in range(4, 24):
        np.testing.assert_allclose(cache.run(("scaled", k), scaled, (x,), dict(k=k + 1)),
                                   np.sin(np.arange(8.0) * (k + 1)) + np.cos(np.arange(8.0) / (k + 1)),
                                   rtol=1e-5, atol=1e-6)
        if k == 4:   # 1 was the least recently used, not 0
            assert [key[1] for key in cache.held()] == [2, 3, 0, 4]
    assert cache.compiles == 24 and cache.evictions == 20 and [key[1] for key in cache.held()] == [20, 21, 22, 23]
    if maps_full is not None:   # 20 more programs compiled, none accumulated
        assert process_maps() - maps_full < 2 * cache.budget.map_cost + 50, (process_maps(), maps_full)


def test_engine_under_a_small_cap_recompiles_with_the_same_outputs(tiny):
    prompts = [tiny.cases[n]["prompt_ids"][:k] for n, k in (("c64", 60), ("c37", 21), ("c5", 5), ("c19", 12))]
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    base = dict(max_running=4, max_len=128, page_size=16, prefill_budget=64, decoder_replay="approx",
                prefix_cache=False)

    def run(max_programs, one_by_one):
        engine = Engine(tiny.params, tiny.cfg, EngineConfig(**base, max_programs=max_programs))
        if one_by_one:   # every prefill bucket, then decode: more programs than the cap holds
            return engine, [engine.generate([p], greedy, decode_text=False)[0]["output_ids"] for p in prompts]
        return engine, [o["output_ids"] for o in engine.generate(prompts, greedy, decode_text=False)]

    _, want = run(None, True)
    shared_programs().clear()
    engine, got = run(4, True)
    info = engine.program_info()
    assert got == want
    assert info["capacity"] == 4 and info["held"] <= 4 and info["evictions"] > 0
    assert engine.runner.compile_count > 4                   # compiled on demand beyond what it holds
    _, batched = run(None, False)                            # the cap is the engine's: None lifts it
    assert shared_programs().budget.max_programs is None and batched == want


def test_warmup_compiles_the_steps_ahead_several_at_a_time(tiny, monkeypatch):
    """On a GPU host (compiles in threads) the engine compiles nothing at its start, and
    ``warmup(workload=...)`` builds the programs its steps run first side by side, so running the
    steps compiles only the replay tails; the engine's outputs do not change."""
    import serve.engine

    prompts = [tiny.cases[n]["prompt_ids"][:k] for n, k in (("c64", 60), ("c37", 21))]
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    config = EngineConfig(max_running=2, max_len=128, page_size=16, prefill_budget=64, decoder_replay="approx",
                          prefix_cache=False)
    shared_programs().clear()
    want = [o["output_ids"] for o in Engine(tiny.params, tiny.cfg, config).generate(prompts, greedy, decode_text=False)]
    shared_programs().clear()
    threads = []
    monkeypatch.setattr(serve.engine, "compile_threads", lambda: threads.append(3) or 3)
    programs = shared_programs()
    before = programs.compiles
    engine = Engine(tiny.params, tiny.cfg, config)
    assert programs.compiles == before and not programs.held()
    steps = engine.warmup(workload=[(1, False), (2, False), (64, True)])   # two decode steps and a prefill (trunk + tail)
    # three programs ahead, the replay tail at its run
    assert threads and steps == 3 and programs.compiles - before == 4
    labels = [label for label, _ in list(programs.compile_log)[-4:]]
    assert labels[:2] == ["step tokens=1", "step tokens=2"] and labels[2].startswith("trunk tokens=64")
    assert labels[3].startswith("tail")
    got = [o["output_ids"] for o in engine.generate(prompts, greedy, decode_text=False)]
    assert got == want
