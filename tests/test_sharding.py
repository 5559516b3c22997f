"""The forward on a (data, expert) mesh of 8 CPU devices equals the one-device forward.

The mesh needs ``--xla_force_host_platform_device_count=8`` before JAX starts, so the check
runs in a child process (this file run as a script) and reports the largest logit
difference per mesh shape. Four requests of the golden fixture share one ragged batch (slots
spread over the data ranks), prefilled whole, then one decode step each.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def test_mesh_needs_its_devices():
    from sharding.mesh import MeshSpec

    with pytest.raises(ValueError, match="needs 8 devices"):
        MeshSpec(2, 4).build(devices=[object()] * 4)
    with pytest.raises(ValueError, match="at least 1"):
        MeshSpec(0, 2)


@pytest.fixture(scope="module")
def sharded_runs():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"dp{s[0]}-ep{s[1]}")
def test_sharded_forward_equals_one_device(sharded_runs, shape):
    got = sharded_runs[f"{shape[0]}x{shape[1]}"]
    assert got["devices"] == 8 and got["expert_shards"] == shape[1] and got["state_shards"] == shape[0]
    assert got["max_diff"] <= 1e-3 and got["argmax_equal"], got   # the golden parity tolerance


def _child() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from checkpoints.hf import load_params
    from model.batch import pack_requests
    from model.config import ModelConfig
    from model.engram_vocab import engram_map_for
    from model.forward import forward
    from model.state import init_state
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
    results = {}
    for dp, ep in SHAPES:
        mesh = MeshSpec(dp, ep).build()
        p, state = shard_params(params, cfg, mesh), shard_state(init_state(cfg, 8, 64, page_size=16), mesh)
        w1 = p["layers"][0]["moe"]["w1"]
        got = run(p, state)
        results[f"{dp}x{ep}"] = {
            "devices": len(mesh.devices.flat), "max_diff": float(np.abs(got - want).max()),
            "argmax_equal": bool((got.argmax(-1) == want.argmax(-1)).all()),
            "expert_shards": len({str(s.index) for s in w1.addressable_shards}),
            "state_shards": len({str(s.index) for s in state.comp_kv[0].addressable_shards})}
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(json.dumps(_child()))
