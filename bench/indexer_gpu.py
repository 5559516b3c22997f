"""The lightning indexer's scoring on the GPU: the Pallas kernel against the XLA path it replaces,
at V4.1-Flash index shapes (64 heads x 128) and a 128K context, with the roofline in the same run.

Cases: decode (8, 64 and 256 requests x 4 rows: a token and 3 drafts) against a ratio-2 source
(65,536 entries a request) and a ratio-1 one (131,072); prefill (4K rows of one request, the
last 4K positions of its 128K) against ratio 2; and the layers past the candidate source,
which score 2,048 candidate blocks of 8 entries a row (random blocks here) of a ratio-1 pool
(decode 64 and 256 requests, prefill 4K rows). Keys are FP4-quantised values in bf16 (what the
pools hold today), pages shuffled. Each implementation goes through ``mega.indexer``'s two
paths (kernel and reference) with the model's arguments; the kernel is checked against the
reference on every case. Roofline: each request's visible keys read once, the scores written
once, the dots at the bf16 matmul rate.

    python3 bench/indexer_gpu.py              # on the GPU, writes $OUT/indexer_gpu.json
    python3 bench/indexer_gpu.py --smoke      # CPU: tiny shapes, the kernel interpreted
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ceilings, rel_err, roofline_ms, run_info, time_jax, write  # noqa: E402

from mega.indexer import INDEX_PASS_BYTES  # noqa: E402
from model import quant  # noqa: E402
from pallas_kernels.indexer import index_scores, index_scores_listed, index_scores_reference  # noqa: E402

HEADS, DIM, PER_PAGE = 64, 128, 32     # V4.1-Flash's indexer; a 64-token page at ratio 2
CANDIDATES, BLOCK = 2048, 8                 # candidate blocks a row past the candidate source
CASES = ([("decode", b, 4, n) for n in (65536, 131072) for b in (8, 64, 256)] + [("prefill", 1, 4096, 65536)]
         + [("decode-candidates", b, 4, 131072) for b in (64, 256)] + [("prefill-candidates", 1, 4096, 131072)])
SMOKE = [("decode", 2, 4, 256), ("prefill", 1, 64, 512), ("decode-candidates", 2, 4, 512)]


def make(kind: str, requests: int, rows: int, n: int, seed: int):
    """The model's arguments: queries and head weights, a shuffled paged pool, each row's request
    and visible entries (decode: the whole context; prefill: causal over the last ``rows``)."""
    rng = np.random.default_rng(seed)
    pages = n // PER_PAGE
    order = rng.permutation(requests * pages).reshape(requests, pages)
    entries = np.arange(n)
    table = jnp.asarray(order[:, entries // PER_PAGE] * PER_PAGE + entries % PER_PAGE, jnp.int32)
    t = requests * rows
    slot = jnp.asarray(np.repeat(np.arange(requests), rows), jnp.int32)
    visible = np.full(t, n) if kind.startswith("decode") else n - rows + 1 + np.arange(rows)
    listed = None
    if kind.endswith("candidates"):
        c = min(CANDIDATES, n // BLOCK // 4)
        blocks = np.stack([rng.permutation(n // BLOCK)[:c] for _ in range(t)])
        listed = jnp.asarray((blocks[:, :, None] * BLOCK + np.arange(BLOCK)).reshape(t, -1), jnp.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = quant.fp4_block32(jax.random.normal(k1, (t, HEADS, DIM), jnp.float32))
    keys = jax.jit(lambda k: quant.fp4_block32(jax.random.normal(k, (requests * n, DIM), jnp.float32)
                                               ).astype(jnp.bfloat16))(k2)
    w = jax.random.normal(k3, (t, HEADS), jnp.float32) * HEADS ** -0.5
    return q, w, keys, table, slot, jnp.asarray(visible, jnp.int32), listed


def cost(requests: int, rows: int, n: int, visible, listed) -> tuple[float, float]:
    """(FLOPs, bytes): the scored entries' dots; each request's scored keys once, q, w and the
    scores (written once, and the listed ones again)."""
    vis = np.asarray(visible)
    if listed is None:
        scored, keys = float(vis.sum()), requests * min(n, int(vis.max()))
    else:
        ls = np.asarray(listed).reshape(requests, rows, -1)
        scored = float(((ls >= 0) & (ls < vis.reshape(requests, rows)[:, :, None])).sum())
        keys = sum(len(np.unique(r[r >= 0])) for r in ls)
    t = requests * rows
    out = t * n * 4 + (0 if listed is None else scored * 4)
    return 2 * scored * HEADS * DIM, keys * DIM * 2 + t * (HEADS * DIM * 2 + HEADS * 4) + out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, the kernel interpreted")
    args = ap.parse_args()
    ceil = ceilings(smoke=args.smoke)
    info, rows_out = run_info(), []
    print(f"ceilings: {ceil}", flush=True)
    scale = DIM ** -0.5

    def pallas(q, w, k, r, s, v, listed):
        operands = (q.astype(jnp.bfloat16), w, k, r, s, v)
        if listed is None:
            return index_scores(*operands, scale=scale, interpret=args.smoke)
        return index_scores_listed(*operands, listed, scale=scale, interpret=args.smoke)
    kernel = jax.jit(pallas)
    xla = jax.jit(lambda q, w, k, r, s, v, listed: index_scores_reference(
        q, w, k, r, s, v, listed, scale=scale, exact_bf16=True, pass_bytes=INDEX_PASS_BYTES))
    for i, (kind, requests, rows, n) in enumerate(SMOKE if args.smoke else CASES):
        case = {"kind": kind, "requests": requests, "rows": requests * rows, "entries": n, "heads": HEADS,
                "head_dim": DIM}
        try:
            sets = [make(kind, requests, rows, n, seed) for seed in (i, i + 100)]
            flops, nbytes = cost(requests, rows, n, sets[0][5], sets[0][6])
            case.update(flops=flops, bytes=nbytes, roofline_ms=roofline_ms(flops, nbytes, ceil))
            want = np.asarray(xla(*sets[0]))
            got = np.asarray(kernel(*sets[0]))
            seen = np.isfinite(want)
            case["kernel_err"] = rel_err(got[seen], want[seen])
            case["kernel_masks_alike"] = bool((np.isneginf(got) == ~seen).all())
            del want, got
            for name, fn in (("pallas_indexer", kernel), ("xla", xla)):
                ms = time_jax(fn, *sets[0], inner=2 if args.smoke else 5, reps=3)
                rows_out.append({"case": case, "impl": name, "ms": ms, "x_roofline": ms / case["roofline_ms"]})
                print(f"{kind} {requests}x{rows} N={n}: {name} {ms:.3f} ms ({ms / case['roofline_ms']:.2f}x roofline "
                      f"{case['roofline_ms']:.3f}); kernel err {case['kernel_err']:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001  (one case's failure is recorded, the rest still run)
            rows_out.append({"case": case, "impl": "setup", "ms": None, "error": repr(e)})
            traceback.print_exc()
    write("indexer_gpu", {**info, "ceilings": ceil, "rows": rows_out,
                          "conditions": "FP4-exact bf16 keys, shuffled 32-entry pages, visible: decode all, "
                                        "prefill causal; wall clock per call, median of 3 x 5 back to back"})


if __name__ == "__main__":
    main()
