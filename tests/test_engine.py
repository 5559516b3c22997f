"""The engine against the plain forward: continuous batching, overlap, buckets, memory, prefix cache."""
from __future__ import annotations

import asyncio
import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import GOLDEN, REPORT
from model.batch import pack_requests
from model.forward import forward_jit
from model.state import init_state
from pallas_kernels.block_scaled import Nvfp4Rows
from serve.engine import Engine, EngineConfig
from serve.handle import RequestError

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _engine(tiny, **kw):
    base = dict(max_running=4, max_len=128, page_size=16, prefill_budget=32, decoder_replay="off",
                prefix_cache=False)
    return Engine(tiny.params, tiny.cfg, EngineConfig(**{**base, **kw}))


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny.cases[n]["prompt_ids"][:k] for n, k in (("c64", 40), ("c37", 21), ("c19", 19), ("c5", 5),
                                                         ("c50_chunked", 33))]


def _greedy_reference(tiny, prompt, n):
    state = init_state(tiny.cfg, 1, 128, page_size=16)
    logits, state = forward_jit(tiny.params, tiny.cfg, state, pack_requests([(0, prompt, 0)], pad_to=128), tiny.emap)
    out = [int(np.asarray(logits)[len(prompt) - 1].argmax())]
    for _ in range(n - 1):
        batch = pack_requests([(0, [out[-1]], len(prompt) + len(out) - 1)])
        logits, state = forward_jit(tiny.params, tiny.cfg, state, batch, tiny.emap)
        out.append(int(np.asarray(logits)[0].argmax()))
    return out


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    return [_greedy_reference(tiny, p, GREEDY["max_new_tokens"]) for p in prompts]


def _staggered(engine, prompts, params=GREEDY):
    """Two requests first, the rest arriving while those decode."""
    rids = [engine.submit(p, params, stream=False).rids[0] for p in prompts[:2]]
    for _ in range(3):
        engine.step()
    rids += [engine.submit(p, params, stream=False).rids[0] for p in prompts[2:]]
    engine.run_until_idle()
    return [engine._requests[r] for r in rids]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_equals_plain_forward(tiny, prompts, reference, overlap):
    engine = _engine(tiny, overlap=overlap)
    reqs = _staggered(engine, prompts)
    assert [r.output for r in reqs] == reference
    assert all(r.finish_reason == "length" for r in reqs)
    assert engine.scheduler.used_pages == 0 and engine.scheduler.free_slots == 4  # nothing leaks


def test_mixed_workload_compiles_within_buckets(tiny):
    engine = _engine(tiny, decoder_replay="approx", prefix_cache=True)
    rng = np.random.default_rng(0)
    for step in range(60):
        if step % 4 == 0:
            n = int(rng.integers(3, 70))
            engine.submit(rng.integers(3, 512, size=n).tolist(),
                          {"max_new_tokens": int(rng.integers(1, 12)), "temperature": 0.7, "seed": step}, stream=False)
        if engine.has_work:
            engine.step()
    engine.run_until_idle()
    programs = engine.buckets.programs()
    REPORT["engine: compiled programs in a 60-step mixed workload"] = (
        f"{engine.runner.compile_count} of {len(programs)} bucket programs over {engine.stats.steps} steps")
    assert engine.runner.compile_count <= len(programs) < engine.stats.steps
    assert engine.scheduler.used_pages == 0


def test_step_input_travels_as_one_buffer():
    """pack_input/unpack_input rebuild every field exactly (bool, int32, uint32, float32 bits:
    NaN, -0.0, subnormals), each from its own place (every field holds its own random values);
    the ban mask stays apart; 8-byte and device arrays are refused."""
    import jax

    from model.batch import Batch
    from serve.runner import SlotReset, StepInput, pack_input, unpack_input
    from serve.sampling import SamplingArrays

    rng = np.random.default_rng(0)

    def ints(*shape):
        return rng.integers(-2**31, 2**31, shape).astype(np.int32)

    def bools(n):
        return rng.random(n) < 0.5

    def floats(n):
        x = np.concatenate([[np.nan, -0.0, np.inf, 1e-45], rng.standard_normal(n - 4)]).astype(np.float32)
        return rng.permutation(x)

    s, t, b = 6, 5, 3  # sampled rows, tokens, slots
    samp = SamplingArrays(floats(s), floats(s), ints(s), floats(s), floats(s), floats(s), floats(s),
                          ints(s).view(np.uint32), ints(s))
    inp = StepInput(Batch(ints(t), ints(t), ints(t)), bools(t), bools(t), ints(s), ints(s), samp,
                    jnp.zeros((s, 7), bool), ints(b, 4), SlotReset(bools(b), ints(b), ints(b), ints(b), ints(b, 2)))
    buffer, ban, layout = pack_input(inp)
    assert buffer.dtype == np.int32 and buffer.ndim == 1 and ban is inp.ban
    hash(layout)
    got = jax.jit(unpack_input, static_argnums=2)(buffer, ban, layout)
    for sent, back in zip(jax.tree.leaves(inp), jax.tree.leaves(got), strict=True):
        sent, back = np.asarray(sent), np.asarray(back)
        assert sent.dtype == back.dtype and sent.shape == back.shape
        assert sent.tobytes() == back.tobytes()
    with pytest.raises(TypeError, match="4-byte"):
        pack_input(inp._replace(logit_rows=np.arange(s)))  # int64
    with pytest.raises(TypeError, match="numpy"):
        pack_input(inp._replace(logit_rows=jnp.arange(s)))  # would wait for the device


def test_step_programs_have_no_loops(tiny, prompts, monkeypatch):
    """No while/scan in the step programs (prefill, decode, replay) of the code that both kernel
    modes share (model, sampler; traced here on the reference path, as for the GPU): on the GPU
    XLA runs a loop from the host, one launch at a time outside the step's CUDA graphs, which it
    splits. (Elsewhere the mHC Sinkhorn iterations stay a loop: ``backend.on_gpu``.)
    (mega.moe's Pallas dispatch: test_pallas_moe; conds are fine: the command buffers take them.)"""
    import functools

    import jax
    from jax.extend import core as jcore

    from mega import backend
    from serve.programs import ProgramCache

    seen, run = {}, ProgramCache.run

    def spy(self, key, fn, args, statics=None, donate=()):
        avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, args)
        seen.setdefault((fn.__name__, key[2:]), (fn, avals, statics))
        return run(self, key, fn, args, statics, donate)

    def loops(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("while", "scan"):
                yield str(eqn.source_info.name_stack)
            for sub in jax.tree.leaves(list(eqn.params.values()), is_leaf=lambda x: isinstance(x, jcore.ClosedJaxpr)):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    yield from loops(getattr(sub, "jaxpr", sub))

    monkeypatch.setattr(ProgramCache, "run", spy)
    engine = _engine(tiny, decoder_replay="approx")
    for p in prompts[:2]:
        engine.submit(p, {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "seed": 1}, stream=False)
    engine.run_until_idle()
    assert {name for name, _ in seen} == {"plain_step", "trunk_step", "tail_step"}  # replay and plain steps
    monkeypatch.setattr(backend, "on_gpu", lambda: True)  # the programs as traced for the GPU
    monkeypatch.setenv("MEGAJAX_KERNELS", "reference")
    jax.clear_caches()   # (retraced, not the CPU's traces)
    for fn, avals, statics in seen.values():
        found = list(loops(jax.make_jaxpr(functools.partial(fn, **statics))(*avals).jaxpr))
        assert not found, found


def test_abort_frees_everything(tiny, prompts):
    engine = _engine(tiny)
    rids = [engine.submit(p, {"max_new_tokens": 50, "ignore_eos": True}, stream=False).rids[0] for p in prompts]
    for _ in range(4):
        engine.step()
    for r in rids:
        engine.abort(r)
    engine.run_until_idle()
    s = engine.scheduler
    assert all(engine._requests[r].finish_reason == "abort" for r in rids)
    assert not s.running and not s.waiting and len(s.ranks[0].pool.free) == s.ranks[0].pool.num_pages and s.free_slots == 4


def test_abort_takes_the_exact_id_or_its_samples(tiny, prompts):
    engine = _engine(tiny)
    params = {"max_new_tokens": 50, "ignore_eos": True}
    engine.submit(prompts[0], params, rid="a", stream=False)
    engine.submit(prompts[1], params, rid="a-1", stream=False)   # not a sample of "a"
    fan = engine.submit(prompts[2], {**params, "n": 2, "temperature": 1.0, "seed": 3}, rid="b", stream=False).rids
    with pytest.raises(RequestError, match="already in use") as refused:
        engine.submit(prompts[0], params, rid="a", stream=False)
    assert refused.value.param == "rid" and refused.value.status == 400
    engine.abort("a")
    engine.abort("b")
    assert engine._requests["a"].finish_reason == "abort" and engine._requests["a-1"].finish_reason is None
    assert fan == ["b-0", "b-1"] and all(engine._requests[r].finish_reason == "abort" for r in fan)
    engine.abort("a-1")
    engine.run_until_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_page_exhaustion_queues_and_retracts(tiny, prompts, overlap):
    # 5 pages of 16 tokens cannot hold the batch at once: requests wait, or are retracted and recomputed.
    params = {"max_new_tokens": 30, "temperature": 0.8, "seed": 5, "repetition_penalty": 1.3,
              "frequency_penalty": 0.5, "ignore_eos": True}
    roomy = _staggered(_engine(tiny, overlap=overlap), prompts[:3], params)
    engine = _engine(tiny, num_pages=5, overlap=overlap)
    tight = _staggered(engine, prompts[:3], params)
    assert engine.scheduler.retractions > 0
    assert [r.output for r in tight] == [r.output for r in roomy]  # penalties and seeds survive recomputation
    assert len(engine.scheduler.ranks[0].pool.free) == 5


def test_seeds_reproduce_across_batches(tiny, prompts):
    params = {"max_new_tokens": 6, "temperature": 0.9, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    alone = _engine(tiny).generate([prompts[0]], params, decode_text=False)[0]["output_ids"]
    batched = _engine(tiny, overlap=False).generate(prompts[:3], params, decode_text=False)[0]["output_ids"]
    assert alone == batched
    for seed in (None, 99):
        n2 = _engine(tiny).generate([prompts[0]], {**params, "seed": seed, "n": 2}, decode_text=False)[0]
        assert len(n2["choices"]) == 2 and n2["choices"][0]["output_ids"] != n2["choices"][1]["output_ids"]


def test_stop_conditions(tiny, prompts, reference):
    engine = _engine(tiny)
    ref = reference[0]
    stop_tok = ref[3]
    res = engine.generate([prompts[0]] * 3, [
        {**GREEDY, "stop_token_ids": [stop_tok]},
        {**GREEDY, "stop_token_ids": [stop_tok], "min_new_tokens": ref.index(stop_tok) + 2},
        {**GREEDY, "max_new_tokens": 2}])
    assert res[0]["output_ids"] == ref[:ref.index(stop_tok) + 1] and res[0]["finish_reason"] == "stop"
    assert res[0]["matched_stop"] == stop_tok
    assert stop_tok not in res[1]["output_ids"][:ref.index(stop_tok) + 2]  # banned until min_new_tokens
    assert res[2]["output_ids"] == ref[:2] and res[2]["finish_reason"] == "length"
    text = engine.decode(ref)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    got = engine.generate([prompts[0]], {**GREEDY, "stop": [stop]})[0]
    assert got["finish_reason"] == "stop" and got["text"] == text[:text.find(stop)]


def test_logprobs_are_returned(tiny, prompts):
    res = _engine(tiny).generate([prompts[1]], {**GREEDY, "logprobs": True, "top_logprobs": 3})[0]
    assert len(res["token_logprobs"]) == 8 and all(len(t) == 3 for t in res["top_logprobs"])
    for lp, top in zip(res["token_logprobs"], res["top_logprobs"]):
        assert top[0][1] >= top[1][1] >= top[2][1] and abs(lp - top[0][1]) < 1e-5  # greedy picks the top one


def test_stored_kv_cache_gives_the_same_tokens(tiny, prompts, reference):
    """``kv_cache_dtype="fp8_e4m3"`` stores the window ring as e4m3 + UE8M0 bytes and the compressed
    pools as NVFP4 records: the KV the model fake-quantises anyway, so greedy decoding is unchanged
    (prefix cache on too)."""
    engine = _engine(tiny, kv_cache_dtype="fp8_e4m3", prefix_cache=True)
    assert engine.runner.state.model.window[0].values.dtype == jnp.float8_e4m3fn
    assert all(isinstance(p, Nvfp4Rows) for p in engine.runner.state.model.comp_kv)
    assert engine.runner.page_layout.formats == ("nvfp4", "fp4")
    assert [r.output for r in _staggered(engine, prompts)] == reference
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


def test_prefix_cache_multi_turn(tiny, prompts):
    engine = _engine(tiny, prefix_cache=True)
    first = engine.generate([prompts[0]], GREEDY, decode_text=False)[0]
    turn2 = prompts[0] + first["output_ids"] + prompts[1][:9]
    hit = engine.generate([turn2], GREEDY, decode_text=False)[0]
    cold = _engine(tiny).generate([turn2], GREEDY, decode_text=False)[0]
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 3 full pages of 16
    assert engine.scheduler.ranks[0].radix.stats["cached_tokens"] == 48
    same = np.mean([a == b for a, b in zip(hit["output_ids"], cold["output_ids"])])
    REPORT["prefix hit vs cold (multi-turn, greedy tokens equal)"] = f"{same:.0%}"
    assert hit["output_ids"][0] == cold["output_ids"][0]


def test_prefix_cache_eviction_keeps_serving(tiny):
    engine = _engine(tiny, prefix_cache=True, num_pages=8)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, size=40).tolist() for _ in range(6)]
    res = engine.generate(prompts + prompts[:2], {**GREEDY, "max_new_tokens": 4}, decode_text=False)
    assert all(r["finish_reason"] == "length" for r in res)
    assert engine.scheduler.ranks[0].radix.cached_pages <= 8


def test_generate_cli(tmp_path, tiny, prompts, reference):
    from serve import generate

    lines = [{"input_ids": prompts[0], "sampling_params": GREEDY}, {"input_ids": prompts[3], "sampling_params": GREEDY}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = generate.main(["--model", str(GOLDEN / "v41_tiny"), "--input", str(tmp_path / "in.jsonl"), "--output",
                        str(tmp_path / "out.jsonl"), "--decoder-replay", "off", "--max-len", "128",
                        "--max-running", "4", "--page-size", "16", "--prefill-budget", "32", "--no-warmup",
                        "--kv-cache-dtype", "fp8_e4m3"])   # (same tokens: the stored KV is the model's own)
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in rows] == [reference[0], reference[3]]
    assert rows[0]["usage"]["prompt_tokens"] == len(prompts[0])
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1], "sampling_params": {"top_p": 7}}\n')
    rc = generate.main(["--model", str(GOLDEN / "v41_tiny"), "--input", str(tmp_path / "bad.jsonl"), "--output",
                        str(tmp_path / "bad_out.jsonl")])
    assert rc == 2 and not (tmp_path / "bad_out.jsonl").exists()


def test_async_stream_and_disconnect(tiny, prompts, reference):
    engine = _engine(tiny)
    engine.start()

    async def main():
        deltas = [d async for i, d in engine.submit(prompts[0], GREEDY).deltas()]
        ids = [t for d in deltas for t in d["output_ids"]]
        assert ids == reference[0] and deltas[-1]["finish_reason"] == "length" and "usage" in deltas[-1]
        assert "".join(d["text"] for d in deltas) == engine.decode(reference[0])
        gen = engine.submit(prompts[1], {**GREEDY, "max_new_tokens": 60}).deltas()
        await gen.__anext__()
        await gen.aclose()  # the client goes away: its request is aborted and its memory freed

    asyncio.run(main())
    for _ in range(200):
        if not engine.has_work:
            break
        time.sleep(0.05)
    engine.stop()
    assert engine.scheduler.used_pages == 0 and engine.scheduler.free_slots == 4


def test_streamed_fan_out_ends_each_sample_exactly_once(tiny, prompts):
    """More samples than slots, overlapped steps: a sample whose stop the host saw while its
    next step was in flight must not end twice (the handle would stop reading early)."""
    engine = _engine(tiny)
    engine.start()
    n = 10

    async def main():
        ends, ids = [], {}
        async for i, d in engine.submit(prompts[3], {"max_new_tokens": 5, "n": n, "temperature": 1.0,
                                                    "seed": 3}).deltas():
            assert i not in ends, f"sample {i} had news after its end"
            ids.setdefault(i, []).extend(d["output_ids"])
            if d["finish_reason"] is not None:
                ends.append(i)
        return ends, ids

    ends, ids = asyncio.run(main())
    engine.stop()
    assert sorted(ends) == list(range(n)) and all(len(v) == 5 for v in ids.values())


def test_stable_text_holds_back_stop_prefixes():
    from serve.request import Request
    from serve.sampling import SamplingParams

    req = Request("r", [1], SamplingParams(stop=("Observation:",)), 0)
    req.text = "Thought\nObservation"
    assert req.text[:req.stable_len()] == "Thought\n"
    req.finish_reason = "length"
    assert req.stable_len() == len(req.text)


def test_stop_strings_before_min_new_tokens_do_not_count():
    from serve.detokenizer import Detokenizer
    from serve.request import Request
    from serve.sampling import SamplingParams

    req = Request("r", [1], SamplingParams(stop=("ab",), min_new_tokens=2, max_new_tokens=10), 0)
    words = {1: "ab", 2: "cd", 3: "ab"}
    detok = Detokenizer(lambda ids: "".join(words[i] for i in ids))
    for tok in (1, 2, 3):
        req.output.append(tok)
        req.check_stop(tok, (), detok)
        if req.finished:
            break
    assert req.output == [1, 2, 3] and req.finish_reason == "stop" and req.text == "abcd"
