"""The sampler's top logprobs on the GPU: ``mega.topk.top_k`` (two-level selection) against ``lax.top_k``.

Shapes ``[rows, 129280]`` (V4.1's vocabulary) at k = 20 (the engine's top-logprobs width; XLA
sorts whole rows above k = 16) and k = 8, 16 (XLA's selection kernel), for 1, 32 and 256
rows. Each case is checked (the same values and indices as ``lax.top_k``) and timed by wall
clock and by GPU busy time per call (``gpu_common.gpu_timeline``).

    python3 bench/topk_gpu.py            # on the H200, writes $OUT/topk_gpu.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import gpu_timeline, run_info, time_jax, write  # noqa: E402

from mega.topk import top_k  # noqa: E402

VOCAB = 129280
CASES = [(rows, k) for rows in (1, 32, 256) for k in (8, 16, 20)]


def main():
    info, rows = run_info(), []
    impls = {"lax_top_k": jax.jit(jax.lax.top_k, static_argnums=1), "mega_top_k": jax.jit(lambda x, k: top_k(x, k, True), static_argnums=1)}
    for b, k in CASES:
        x = jax.nn.log_softmax(3 * jax.random.normal(jax.random.key(b * 100 + k), (b, VOCAB)), -1)
        want = [np.asarray(a) for a in impls["lax_top_k"](x, k)]
        for name, fn in impls.items():
            row = {"case": {"rows": b, "vocab": VOCAB, "k": k}, "impl": name}
            got = [np.asarray(a) for a in fn(x, k)]
            row["exact"] = all((g == w).all() for g, w in zip(got, want))
            row["ms"] = time_jax(fn, x, k)
            row.update(gpu_timeline(lambda: jax.block_until_ready([fn(x, k) for _ in range(5)]), 5))
            rows.append(row)
            print(row, flush=True)
    write("topk_gpu", {**info, "rows": rows})


if __name__ == "__main__":
    main()
