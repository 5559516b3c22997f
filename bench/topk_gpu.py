"""The indexer's top-k on the GPU: ``mega.topk.top_k_set`` (threshold search) against ``lax.top_k``.

Shapes ``[rows, entries]`` with k = 512 (the indexer's top-k; 64 for the candidate blocks):
decode steps of 32 and 256 query rows and prefill chunks of 4096 rows, over 1K to 16K visible
compressed entries (128K context at ratio 4 holds 32K). Scores are relu-like, as the indexer's
are: a third of them exactly 0. Each row is checked (same entry set as ``lax.top_k``) and timed
by wall clock and by GPU busy time per call (``gpu_common.gpu_timeline``).

    python3 bench/topk_gpu.py            # on the H200, writes $OUT/topk_gpu.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import gpu_timeline, run_info, time_jax, write  # noqa: E402

from mega.topk import top_k_set  # noqa: E402

CASES = [(32, 1024, 512), (32, 8192, 512), (32, 32768, 512), (256, 8192, 512), (32, 256, 64),
         (4096, 1024, 512), (4096, 8192, 512), (4096, 16384, 512)]


def main():
    rows = []
    impls = {"lax_top_k": jax.jit(lambda x, k: jax.lax.top_k(x, k), static_argnums=1),
             "top_k_set": jax.jit(top_k_set, static_argnums=1)}
    for b, n, k in CASES:
        x = jax.nn.relu(jax.random.normal(jax.random.key(n + b), (b, n)) + 0.4)
        want = np.sort(np.asarray(impls["lax_top_k"](x, k)[1]), -1)
        for name, fn in impls.items():
            row = {"case": {"rows": b, "entries": n, "k": k}, "impl": name}
            got = np.sort(np.asarray(fn(x, k)[1]), -1)
            row["same_set"] = bool((got == want).all())
            row["ms"] = time_jax(fn, x, k)
            row.update(gpu_timeline(lambda: jax.block_until_ready([fn(x, k) for _ in range(5)]), 5))
            rows.append(row)
            print(row, flush=True)
    write("topk_gpu", {**run_info(), "rows": rows})


if __name__ == "__main__":
    main()
