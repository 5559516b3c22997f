"""KV transfer rate of the disaggregation backends (serve/disaggregation/transfer.py), between two processes.

One process plays P (it ``offer``s page arrays under rooms), the other D (it ``fetch``es them by the
address P publishes), through the same ``KVTransfer`` objects the servers use; each size is pulled
``--reps`` times (fresh arrays, checked against what P sent) after one warm-up pull. Sizes are page
arrays of as many bytes as V4.1-Flash's pages (sent as bf16 ``[n, elems]``): 2,730 B a token, its four
KV sources' compressed KV in bf16 and indexer keys as FP4 records (``serve.kv_pages.PageLayout`` of the
Flash config), 64 tokens a page, so a row of the table is a prompt of n x 64 tokens. Ceiling measured
beside each size: one host memcpy of as many bytes. Peers: GPU_KERNELS §7 (jax.experimental.transfer 2.3
GiB/s on CUDA, cross-process device_put 155 GiB/s between two H200 processes).

    python bench/pd_transfer.py                    # writes $OUT/pd_transfer.json (bench_out/ without $OUT)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PAGE_TOKENS = 64
FLASH_BYTES_PER_TOKEN = 2730   # serve.kv_pages.PageLayout of V4.1-Flash in bf16 (bench/RESULTS.md)
PAGE_ELEMS = FLASH_BYTES_PER_TOKEN * PAGE_TOKENS // 2   # bf16


def host_copy_rate(nbytes: int, reps: int = 5) -> float:
    """GiB/s of one host memcpy of ``nbytes`` (the ceiling of a transfer through host memory)."""
    import numpy as np

    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 2**30


def prefill_side(backend: str, shapes: list[tuple[int, int]], reps: int, conn) -> None:
    import jax
    import jax.numpy as jnp

    from serve.disaggregation.transfer import make_transfer

    t = make_transfer(backend)
    conn.send(t.address())
    room = 0
    for shape in shapes:
        for rep in range(reps + 1):
            x = jax.random.normal(jax.random.key(room), shape, jnp.float32).astype(jnp.bfloat16)
            t.offer(room, x, ttl=600)
            conn.send((room, float(jnp.sum(x.astype(jnp.float32)))))
            room += 1
    conn.recv()   # D is done: the offers may go


def pull_times(backend: str, shapes: list[tuple[int, int]], reps: int) -> list[list[float]]:
    """Seconds of each of ``reps`` pulls (after one warm-up) of a fresh bf16 array of each shape, offered by
    a second process through ``backend``; every pull checked against what was sent."""
    import jax.numpy as jnp

    from serve.disaggregation.transfer import make_transfer

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=prefill_side, args=(backend, shapes, reps, there))
    p.start()
    t = make_transfer(backend)

    def recv():
        if not here.poll(300):
            raise RuntimeError(f"the offering process (exit code {p.exitcode}) sent nothing for 300 s")
        return here.recv()

    address = recv()
    out = []
    for shape in shapes:
        times = []
        for rep in range(reps + 1):
            room, total = recv()
            t0 = time.perf_counter()
            y = t.fetch(address, room, shape, "bfloat16")
            dt = time.perf_counter() - t0
            assert abs(float(jnp.sum(y.astype(jnp.float32))) - total) <= 1e-3 * max(abs(total), 1), "wrong bytes"
            if rep:
                times.append(dt)
        out.append(times)
    here.send("done")
    p.join(60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="jax-transfer")
    ap.add_argument("--pages", default="1,16,128,1024", help="page counts (64 tokens each)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import jax

    from gpu_common import run_info, write

    elems, pages = PAGE_ELEMS, [int(x) for x in args.pages.split(",")]
    rows = []
    for n, times in zip(pages, pull_times(args.backend, [(n, elems) for n in pages], args.reps)):
        nbytes = n * elems * 2
        best = min(times)
        rows.append({"pages": n, "tokens": n * PAGE_TOKENS, "bytes": nbytes, "best_s": best,
                     "median_s": sorted(times)[len(times) // 2], "GiB_per_s": nbytes / best / 2**30,
                     "host_copy_GiB_per_s": host_copy_rate(nbytes)})
        print(f"{n:6d} pages ({n * PAGE_TOKENS:7d} tokens, {nbytes / 2**20:8.1f} MiB): {best * 1e3:8.2f} ms, "
              f"{rows[-1]['GiB_per_s']:6.2f} GiB/s (a host memcpy: {rows[-1]['host_copy_GiB_per_s']:.1f})", flush=True)
    write("pd_transfer", {**run_info(), "backend": args.backend, "page_elems": elems, "page_tokens": PAGE_TOKENS,
                          "bytes_per_token": elems * 2 / PAGE_TOKENS, "device": str(jax.devices()[0]), "rows": rows,
                          "peers": {"jax.experimental.transfer on CUDA (GPU_KERNELS §7)": "2.3 GiB/s",
                                    "cross-process device_put, 2x H200 (GPU_KERNELS §7)": "155 GiB/s"}})


if __name__ == "__main__":
    main()
