"""Reading a checkpoint by shard: over a (data, expert) mesh each process reads only the experts
its devices hold, each once, and every parameter comes out as the global array the engine's
placement asks for, equal to the whole checkpoint's.

The meshes need ``--xla_force_host_platform_device_count`` before JAX starts, so the checks run
in child processes (this file run as a script): one process of 8 CPU devices, and two processes
of 4 under ``jax.distributed`` forming one 8-device mesh (CPU collectives over gloo).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]
EXPERT = re.compile(r"^(?:model\.)?layers\.0\.ffn\.experts\.(\d+)\.w1\.weight$")


def _child(*args: str, devices: int) -> subprocess.Popen:
    env = {**cpu_env(devices), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("dp,ep", [(1, 8), (2, 4), (8, 1)])
def test_one_process_reads_each_expert_once(dp, ep):
    got = _report(_child("one", str(dp), str(ep), devices=8))
    assert got["experts_read"] == list(range(8)), "every expert of layer 0, once each"
    assert got["reads_per_tensor"] == 1
    assert got["shardings_as_placed"] and got["max_diff"] == 0.0, got


def test_two_processes_read_their_own_experts():
    from conftest import free_port

    addr = f"127.0.0.1:{free_port()}"
    got = [_report(p) for p in [_child("two", str(r), addr, devices=4) for r in range(2)]]
    assert got[0]["experts_read"] == [0, 1, 2, 3] and got[1]["experts_read"] == [4, 5, 6, 7], got
    for g in got:
        assert g["devices"] == 8 and g["local_devices"] == 4
        assert g["reads_per_tensor"] == 1 and g["shardings_as_placed"] and g["max_diff"] == 0.0, g
        assert g["read_all_unstacked"], "what is not an expert stack is read by every process"


def _load_and_check(mesh) -> dict:
    """Load the tiny release-format checkpoint by shard onto ``mesh`` (recording what is read) and
    compare each addressable shard with the same slice of a whole load."""
    from collections import Counter

    import jax
    import numpy as np

    from checkpoints import safetensors_io
    from checkpoints.hf import load_params
    from model.config import ModelConfig
    from sharding.specs import param_partition, param_placement

    tiny = ROOT.parent / "shared" / "golden" / "v41_tiny"   # (conftest's GOLDEN; not imported in a child)
    cfg = ModelConfig.from_json(tiny)
    reads: Counter = Counter()
    read = safetensors_io.Shards.read

    def counted(self, name):
        reads[name] += 1
        return read(self, name)

    safetensors_io.Shards.read = counted
    sharded = load_params(tiny, cfg, placement=param_placement(mesh))
    safetensors_io.Shards.read = read
    with jax.default_device(jax.local_devices()[0]):
        whole = load_params(tiny, cfg)
    specs = param_partition(cfg, whole)
    placed = all(x.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, s), x.ndim)
                 for x, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(specs)))
    diff = max(float(np.max(np.abs(np.asarray(shard.data, np.float32) - np.asarray(w[shard.index], np.float32))))
               for x, w in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole)) for shard in x.addressable_shards)
    names = set(safetensors_io.Shards(tiny).tensors)
    unstacked = {n for n in names if ".experts." not in n}
    return {"experts_read": sorted(int(m.group(1)) for n in reads if (m := EXPERT.match(n))),
            "reads_per_tensor": max(reads.values()), "read_all_unstacked": unstacked <= set(reads),
            "shardings_as_placed": placed, "max_diff": diff, "devices": len(jax.devices()),
            "local_devices": len(jax.local_devices())}


if __name__ == "__main__":
    import jax

    from sharding.mesh import MeshSpec

    if sys.argv[1] == "one":
        mesh = MeshSpec(int(sys.argv[2]), int(sys.argv[3])).build()
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(sys.argv[3], 2, int(sys.argv[2]))
        mesh = MeshSpec(1, 8).build()   # process r holds experts 4r .. 4r + 3
    print(json.dumps(_load_and_check(mesh)))
