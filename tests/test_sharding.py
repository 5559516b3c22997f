"""On a (data, expert) mesh of 8 CPU devices, the expert-parallel MoE equals the one-device
MoE, and the forward (request state over ``data``, MoE sites expert-parallel) equals the
one-device forward within the golden parity tolerances.

The mesh needs ``--xla_force_host_platform_device_count=8`` before JAX starts, so the checks
run in a child process (this file run as a script) that reports per mesh shape. The MoE is
checked alone on random inputs (no near-ties: within float rounding). The forward runs four
requests of the golden fixture in one ragged batch (slots spread over the data ranks),
prefilled whole, then one decode step each; the expert GEMMs group their rows differently
per rank, so the logits move by float rounding, which the fixture's near-ties (router gaps of
1e-3, the Engram gate's square root at 0) can turn into a flipped choice: as in the parity
tests, a shape whose logits differ must then equal the one-device forward with its weights
moved by float noise (``conftest.noisy``), which shows the difference is such a flip. The
engine (``--dp-size``/``--ep-size``) on the two extreme meshes generates the one-device engine's
tokens, and so does one on dp2 x ep4 with redundant experts re-placed by EPLB as it runs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cpu_env

SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]
ENGINE_SHAPES = [(1, 8), (8, 1)]   # and (2, 4) with redundant experts below: each engine compiles its own programs


def test_mesh_needs_its_devices():
    from sharding.mesh import MeshSpec

    with pytest.raises(ValueError, match="needs 8 devices"):
        MeshSpec(2, 4).build(devices=[object()] * 4)
    with pytest.raises(ValueError, match="at least 1"):
        MeshSpec(0, 2)


def _in_child(part: str) -> dict:
    env = cpu_env(8)
    out = subprocess.run([sys.executable, __file__, part], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded_runs():
    return _in_child("forward")


@pytest.fixture(scope="module")
def engine_runs():   # a fresh process: the forward's programs would crowd the engine's program budget
    return _in_child("engine")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"dp{s[0]}-ep{s[1]}")
def test_sharded_forward_equals_one_device(sharded_runs, shape):
    got = sharded_runs[f"{shape[0]}x{shape[1]}"]
    assert got["devices"] == 8 and got["expert_shards"] == shape[1] and got["state_shards"] == shape[0]
    assert got["moe_max_diff"] <= 1e-5, got
    assert got["agree"] or got["flip_draw"] is not None, got
    # an EP group of several ranks exchanges its pairs: two all-to-alls (x, ids, weights; back) per MoE site
    assert (got["all_to_alls"] > 0) == (shape[1] > 1), got


@pytest.mark.parametrize("shape", ENGINE_SHAPES, ids=lambda s: f"dp{s[0]}-ep{s[1]}")
def test_sharded_engine_generates_the_one_device_tokens(engine_runs, shape):
    """``EngineConfig(dp_size, ep_size)`` (``--dp-size``/``--ep-size``): ``random-tiny``'s engine,
    greedy, on a mixed batch (prompts of 5-90 tokens, a prefill chunked beside decodes)."""
    got = engine_runs[f"{shape[0]}x{shape[1]}"]
    assert got["tokens"] == engine_runs["one_device"], got
    # (the programs' all-to-alls are no sign of EP here: XLA's partitioner adds its own for the
    # data-split pools; the forward test above shows the MoE dispatch under the same mesh)
    assert got["expert_shards"] == shape[1] and got["state_shards"] == shape[0], got
    assert got["table_shards"] == shape[0] * shape[1], got   # no device holds a whole Engram table
    # DP attention: the scheduler spread the four requests over the ranks (shortest queue)
    assert len(got["per_rank"]) == shape[0] and sum(got["per_rank"]) == 4, got
    assert max(got["per_rank"]) - min(got["per_rank"]) <= 1, got
    assert got["load_ranks"] == list(range(shape[0])), got   # /get_load reports each rank


def test_redundant_experts_eplb_and_host_engram_keep_the_one_device_tokens(engine_runs):
    """``--ep-num-redundant-experts 4 --enable-eplb --engram-placement host`` on dp2 x ep4: 12
    physical experts of 8, three a device, re-placed every 3 steps from the load the steps
    counted; the Engram tables in host memory."""
    got = engine_runs["eplb"]
    assert got["tokens"] == engine_runs["one_device"], got
    assert got["table_memory"] == "pinned_host", got
    assert got["physical"] == 12 and got["per_device"] == 3 and sorted(set(got["placement"])) == list(range(8))
    assert got["rebalances"] >= 2 and got["moved"] > 0, got   # the placement left the trivial one
    assert got["balance"]["after"] <= got["balance"]["before"], got
    assert got["scorer_max_diff"] < 1e-3, got   # scoring outside the mesh reads the physical stacks right


def test_host_engram_on_one_device_keeps_its_tokens(engine_runs):
    """``--engram-placement host --quantization mxfp4`` on one device."""
    got = engine_runs["host_one_device"]
    assert got["tokens"] == engine_runs["mxfp4_one_device"] and got["table_memory"] == "pinned_host", got


@pytest.fixture(scope="module")
def lookups():
    return _in_child("lookup")


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_split_tables_look_up_the_whole_tables_rows(lookups, placement, dtype):
    """An Engram table split by rows over 8 devices (in their memory or the host's), e4m3 with
    UE8M0 scale bytes or bf16, gives exactly ``mega.engram.lookup_rows`` of the whole table."""
    got = lookups[f"{placement}/{dtype}"]
    assert got["max_diff"] == 0.0 and got["memory"] == ("pinned_host" if placement == "host" else "device"), got


def test_mesh_sizes_are_checked():
    from serve.engine import EngineConfig

    with pytest.raises(ValueError, match="must divide over --dp-size 3"):
        EngineConfig(max_running=8, dp_size=3)
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(ep_size=0)
    assert EngineConfig(max_running=8, max_len=64, page_size=16, num_pages=7, dp_size=2).pages == 8


def test_balanced_routing_is_a_flag_of_the_engine():
    import argparse

    from serve.cli_args import add_engine, add_model, engine_config
    from serve.default_model import random_config, random_params
    from serve.engine import Engine

    ap = argparse.ArgumentParser()
    add_model(ap, required=False)
    add_engine(ap)
    config = engine_config(ap.parse_args(["--enable-balanced-routing", "--max-running-requests", "2"]))
    assert config.balanced_routing and not engine_config(ap.parse_args([])).balanced_routing
    from model.dspark import draft_moe_spec
    from model.forward import moe_spec

    cfg = random_config()
    served = Engine(random_params(cfg), cfg, config).cfg
    assert moe_spec(served).balanced and draft_moe_spec(served).balanced and not moe_spec(cfg).balanced


def _child() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import NOISE_DRAWS, agree, noisy

    from checkpoints.hf import load_params
    from mega.moe import MoeSpec
    from mega.moe import moe as local_moe
    from model.batch import pack_requests
    from model.config import ModelConfig
    from model.engram_vocab import engram_map_for
    from model.forward import forward
    from model.state import init_state
    from sharding.expert_parallel import moe as ep_moe
    from sharding.mesh import MeshSpec
    from sharding.specs import shard_params, shard_state

    golden = Path(__file__).resolve().parents[2] / "shared" / "golden" / "v41_tiny"
    cfg = ModelConfig.from_json(golden)
    params = load_params(golden, cfg)
    emap = jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
    cases = {c["name"]: c["prompt_ids"] for c in json.loads((golden / "cases.json").read_text())["cases"]}
    prompts = {0: cases["c19"], 3: cases["c37"][:30], 5: cases["c5"], 6: cases["c64"][:40]}
    prefill = pack_requests([(s, p[:-1], 0) for s, p in prompts.items()], pad_to=96)
    decode = pack_requests([(s, p[-1:], len(p) - 1) for s, p in prompts.items()], pad_to=8)
    step = jax.jit(forward, static_argnames=("cfg",))

    def run(p, state):
        a, state = step(p, cfg, state, prefill, emap)
        b, _ = step(p, cfg, state, decode, emap)
        return np.concatenate([np.asarray(a), np.asarray(b)])

    want = run(params, init_state(cfg, 8, 64, page_size=16))
    rng = np.random.default_rng(0)
    moe_p = {k: jnp.asarray(rng.normal(size=v.shape) * 0.1, jnp.float32) for k, v in params["layers"][0]["moe"].items()
             if k != "shared"}
    x = jnp.asarray(rng.normal(size=(40, cfg.hidden_size)), jnp.float32)
    spec = MoeSpec(cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
    moe_want = local_moe(x, moe_p, spec)
    results = {}
    for dp, ep in SHAPES:
        mesh = MeshSpec(dp, ep).build()
        p, state = shard_params(params, cfg, mesh), shard_state(init_state(cfg, 8, 64, page_size=16), mesh)
        w1 = p["layers"][0]["moe"]["w1"]
        with jax.set_mesh(mesh):   # the MoE sites dispatch expert-parallel (sharding.expert_parallel)
            moe_got = jax.jit(ep_moe, static_argnames="spec")(x, moe_p, spec)
            hlo = step.lower(p, cfg, state, decode, emap).as_text()
            got = run(p, state)
        ok = bool(agree(got, want))
        flip = None if ok else next((d for d in range(1, 2 * NOISE_DRAWS + 1)
                                     if agree(got, run(noisy(params, d), init_state(cfg, 8, 64, page_size=16)))), None)
        results[f"{dp}x{ep}"] = {
            "devices": len(mesh.devices.flat), "max_diff": float(np.abs(got - want).max()), "agree": ok,
            "flip_draw": flip, "moe_max_diff": float(np.abs(np.asarray(moe_got) - np.asarray(moe_want)).max()),
            "expert_shards": len({str(s.index) for s in w1.addressable_shards}),
            "state_shards": len({str(s.index) for s in state.comp_kv[0].addressable_shards}),
            "all_to_alls": hlo.count("all_to_all")}
    return results


def _engine_runs() -> dict:
    import numpy as np

    from serve.default_model import random_config, random_params
    from serve.engine import Engine, EngineConfig
    from sharding.expert_placement import trivial

    cfg = random_config()
    params = random_params(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (5, 40, 17, 90)]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    def run(dp, ep, **placement):
        e = Engine(params, cfg, EngineConfig(max_running=8, max_len=128, page_size=16, dp_size=dp, ep_size=ep,
                                             decoder_replay="off", **placement))
        return e, [r["output_ids"] for r in e.generate(prompts, sp, decode_text=False)]

    one, out = run(1, 1), {}
    out["one_device"] = one[1]
    probe = [prompts[1]]   # the scorer's last logits, on the placement a rebalance left
    want_logits = np.asarray(one[0].last_logits(probe))
    e, tokens = run(2, 4, ep_num_redundant_experts=4, enable_eplb=True, eplb_rebalance_num_iterations=3,
                    engram_placement="host")
    w1 = e.model.params["layers"][0]["moe"]["w1"]
    table = e.model.params["layers"][cfg.engram_layer_ids[0]]["engram"]["table"].rows
    out["eplb"] = {"tokens": tokens, "rebalances": e.balancer.rebalances, "balance": vars(e.balancer.balance),
                   "physical": w1.shape[0], "per_device": {s.data.shape[0] for s in w1.addressable_shards}.pop(),
                   "placement": e.model.params["layers"][0]["moe"]["placement"].phy2log.tolist(),
                   "moved": sum(not np.array_equal(p, trivial(cfg.n_routed_experts, 12)) for p in e.balancer.placement),
                   "scorer_max_diff": float(np.abs(np.asarray(e.last_logits(probe)) - want_logits).max()),
                   "table_memory": table.sharding.memory_kind}
    # one device: a 1 x 1 mesh, with MXFP4 experts (int4 codes on a mesh: serve.programs)
    out["mxfp4_one_device"] = run(1, 1, quantization="mxfp4")[1]
    e, tokens = run(1, 1, engram_placement="host", quantization="mxfp4")
    table = e.model.params["layers"][cfg.engram_layer_ids[0]]["engram"]["table"].rows
    out["host_one_device"] = {"tokens": tokens, "table_memory": table.sharding.memory_kind}
    for dp, ep in ENGINE_SHAPES:
        e, tokens = run(dp, ep)
        w1 = e.model.params["layers"][0]["moe"]["w1"]
        out[f"{dp}x{ep}"] = {
            "tokens": tokens, "expert_shards": len({str(s.index) for s in w1.addressable_shards}),
            "state_shards": len({str(s.index) for s in e.runner.state.model.seq_lens.addressable_shards}),
            "per_rank": [r.radix.stats["requests"] for r in e.scheduler.ranks],
            "table_shards": len({str(s.index) for s in
                                 e.model.params["layers"][cfg.engram_layer_ids[0]]["engram"]["table"].rows.addressable_shards}),
            "load_ranks": [r["dp_rank"] for r in e.rank_loads()]}
    return out


def _lookups() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mega.engram import lookup_rows
    from sharding import engram_tables
    from sharding.mesh import MeshSpec

    class Cfg:   # the one field split reads
        engram_layer_ids = (0,)

    rng = np.random.default_rng(0)
    mesh = MeshSpec(2, 4).build()
    ids = jnp.asarray(rng.integers(0, 301, size=(40, 3)), jnp.int32)
    out = {}
    for dtype in ("float8_e4m3fn", "bfloat16"):
        table = jnp.asarray(rng.normal(size=(301, 64)), dtype)   # 301 rows: padded to 304 over 8
        scale = jnp.asarray(rng.integers(120, 131, size=(301, 2)), jnp.uint8)
        want = np.asarray(lookup_rows(table, scale, ids))
        for placement in engram_tables.PLACEMENTS:
            p = engram_tables.split({"layers": [{"engram": {"table": table, "scale": scale}}]}, Cfg, mesh, placement)
            g = p["layers"][0]["engram"]
            got = np.asarray(jax.jit(engram_tables.lookup)(g, ids))
            out[f"{placement}/{dtype}"] = {"max_diff": float(np.abs(got - want).max()),
                                           "memory": g["table"].rows.sharding.memory_kind}
    return out


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
    print(json.dumps({"forward": _child, "engine": _engine_runs, "lookup": _lookups}[sys.argv[1]]()))
