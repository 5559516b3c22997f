"""The expert-parallel machinery on one GPU: what dispatch and combine add to an MoE site.

One MoE layer of ``engine_gpu.config`` (hidden 5120, intermediate 2304, 16 routed experts,
top-6, one shared expert; random bf16 weights as ``checkpoints.init`` draws them), for T
tokens at decode and prefill sizes. Two paths compute the same function:

* ``local``: ``mega.moe.moe``, what a one-device engine runs;
* ``exchanged``: ``sharding.expert_parallel.exchanged_moe`` under a 1 x 1 (data, expert) mesh:
  the send buffers by owner rank, the all-to-alls (of one rank: copies), the one-expert rows
  through ``routed_experts`` and the combine, i.e. an EP group of 1 paying the machinery.

Each is checked against the other on fresh random tokens (relative error), then timed
(median of 5 x 10 calls). Beside them: the MoE stage's roofline (the expert weights the
tokens touch, read once, plus rows in and out, at the measured bandwidth; or its FLOPs at the
measured matmul rate) and the machinery's share, (exchanged - local) / local.

    python3 bench/ep_dispatch_gpu.py              # H100/H200: $OUT/ep_dispatch_gpu.json
    python3 bench/ep_dispatch_gpu.py --smoke      # CPU: toy widths
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import config  # noqa: E402
from gpu_common import ceilings, rel_err, roofline_ms, run_info, time_jax, write  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", default="8,32,128,256,2048,8192")
    args = ap.parse_args()
    os.environ.setdefault("MEGAJAX_KERNELS", "reference" if args.smoke else "pallas")
    import jax
    import jax.numpy as jnp

    from checkpoints.init import init_params
    from mega.moe import moe
    from model.forward import moe_spec
    from sharding.expert_parallel import exchanged_moe
    from sharding.mesh import MeshSpec

    cfg = config(args.smoke)
    p = init_params(cfg, seed=0, dtype=jnp.bfloat16)["layers"][0]["moe"]
    spec = moe_spec(cfg)
    mesh = MeshSpec(1, 1).build(jax.devices()[:1])
    local = jax.jit(lambda x, q: moe(x, q, spec))
    exchanged = jax.jit(lambda x, q: exchanged_moe(x, q, spec))   # traced and run under ``mesh``

    ceil = ceilings(args.smoke)
    d, inter, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    expert_bytes = 3 * d * inter * 2
    payload = {**run_info(), "ceilings": ceil, "shape": {"hidden": d, "intermediate": inter, "experts": e,
                                                         "top_k": k, "shared": cfg.n_shared_experts}, "cases": {}}
    for t in map(int, args.tokens.split(",")):
        x = jax.random.normal(jax.random.key(t), (t, d), jnp.bfloat16)
        with jax.set_mesh(mesh):
            want, got = local(x, p), exchanged(x, p)
            times = {"local_ms": time_jax(local, x, p), "exchanged_ms": time_jax(exchanged, x, p)}
        touched = min(e, t * k) + cfg.n_shared_experts
        roof = roofline_ms(2 * 3 * d * inter * t * (k + cfg.n_shared_experts), touched * expert_bytes + 2 * t * d * 2,
                           ceil)
        case = {"rel_err": rel_err(got.astype(jnp.float32), want.astype(jnp.float32)), **times, "roofline_ms": roof}
        case["machinery_share"] = (case["exchanged_ms"] - case["local_ms"]) / case["local_ms"]
        payload["cases"][f"T{t}"] = case
        print(t, case, flush=True)
        write("ep_dispatch_gpu", payload)


if __name__ == "__main__":
    main()
