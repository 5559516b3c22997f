"""The lightning indexer's scoring on the GPU: the Pallas kernel against the XLA path it replaces,
at V4.1-Flash index shapes (32 heads x 128) and a 128K context, with the roofline in the same run.

Cases: decode (8, 64 and 256 requests x 4 rows: a token and 3 drafts) against a ratio-2 source
(65,536 entries a request) and a ratio-1 one (131,072); prefill (4K rows of one request, the
last 4K positions of its 128K) against ratio 2; and the layers past the candidate source,
which score 2,048 candidate blocks of 8 entries a row (random blocks here) of a ratio-1 pool
(decode 64 and 256 requests, prefill 4K rows). Keys as the model stores them (FP4 records, 68
bytes an entry) and, for comparison, the same values in bf16; pages shuffled. The implementations
are ``mega.indexer``'s two (the kernels of ``pallas_kernels.indexer`` and their XLA reference),
called as the operator calls them; the kernels are checked against the reference on every case.
Roofline: each request's scored keys read once, the scores written once, the dots at the bf16
matmul rate. Beside the scoring, the selection on its output: the model's (``mega.topk.top_k``
of 512 over each row's scores, its answer checked against ``lax.top_k``'s) and ``lax.top_k``'s
(a sort of whole rows on the GPU), and on the candidate source's shape the top 2,048 blocks of
8, against one read of the scores.

    python3 bench/indexer_gpu.py              # on the GPU, writes $OUT/indexer_gpu.json
    python3 bench/indexer_gpu.py --smoke      # CPU: tiny shapes, the kernel interpreted
"""
from __future__ import annotations

import argparse
import sys
import traceback
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ceilings, rel_err, roofline_ms, run_info, time_jax, write  # noqa: E402

from flash_rank import rank_config  # noqa: E402
from mega.indexer import INDEX_PASS_BYTES  # noqa: E402
from mega.topk import top_k  # noqa: E402
from model.attention import candidate_blocks  # noqa: E402
from model import quant  # noqa: E402
from model.state import pool_row_bytes  # noqa: E402
from pallas_kernels.block_scaled import Fp4Keys  # noqa: E402
from pallas_kernels.indexer import index_scores, index_scores_listed, index_scores_reference  # noqa: E402

HEADS, DIM, PER_PAGE = 32, 128, 32     # V4.1-Flash's indexer; a 64-token page at ratio 2
CANDIDATES, BLOCK = 2048, 8                 # candidate blocks a row past the candidate source
TOPK = 512                                  # entries each row selects
SOURCE = rank_config(6, 64)                 # the candidate source's block size and count (V4.1-Flash)
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
    keys = {"fp4": jax.jit(lambda k: Fp4Keys.from_float(jax.random.normal(k, (requests * n, DIM), jnp.float32)))(k2)}
    keys["bf16"] = jax.jit(lambda k: k.dequantized(jnp.bfloat16))(keys["fp4"])
    w = jax.random.normal(k3, (t, HEADS), jnp.float32) * HEADS ** -0.5
    return q, w, keys, table, slot, jnp.asarray(visible, jnp.int32), listed


def cost(requests: int, rows: int, n: int, visible, listed, key_bytes: int) -> tuple[float, float]:
    """(FLOPs, bytes): the scored entries' dots; each request's scored keys once (``key_bytes`` a
    key), q, w and the scores (every entry's, or the list's in list order)."""
    vis = np.asarray(visible)
    if listed is None:
        scored, keys = float(vis.sum()), requests * min(n, int(vis.max()))
    else:
        ls = np.asarray(listed).reshape(requests, rows, -1)
        scored = float(((ls >= 0) & (ls < vis.reshape(requests, rows)[:, :, None])).sum())
        keys = sum(len(np.unique(r[r >= 0])) for r in ls)
    t = requests * rows
    out = t * (n if listed is None else np.asarray(listed).shape[1]) * 4
    return 2 * scored * HEADS * DIM, keys * key_bytes + t * (HEADS * DIM * 2 + HEADS * 4) + out


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
            q, w, keys, table, slot, visible, listed = make(kind, requests, rows, n, i)
            key_bytes = {"fp4": pool_row_bytes(keys["fp4"]), "bf16": DIM * 2}
            roof = {}
            for fmt, kb in key_bytes.items():
                flops, nbytes = cost(requests, rows, n, visible, listed, kb)
                roof[fmt] = roofline_ms(flops, nbytes, ceil)
                case[f"roofline_{fmt}_keys"] = {"flops": flops, "bytes": nbytes, "ms": roof[fmt]}
            want = np.asarray(xla(q, w, keys["fp4"], table, slot, visible, listed))
            seen = np.isfinite(want)
            impls = {"pallas_indexer[fp4 keys]": (kernel, "fp4"), "pallas_indexer[bf16 keys]": (kernel, "bf16"),
                     "xla[fp4 keys]": (xla, "fp4")}
            for name, (fn, fmt) in impls.items():
                args_ = (q, w, keys[fmt], table, slot, visible, listed)
                row = {"case": case, "impl": name}
                if fn is kernel:
                    got = np.asarray(fn(*args_))
                    row["err"] = rel_err(got[seen], want[seen])
                    row["masks_alike"] = bool((np.isneginf(got) == ~seen).all())
                    del got
                row["ms"] = time_jax(fn, *args_, inner=2 if args.smoke else 5, reps=3)
                row["x_roofline"] = row["ms"] / roof[fmt]
                rows_out.append(row)
                print(f"{kind} {requests}x{rows} N={n}: {name} {row['ms']:.3f} ms ({row['x_roofline']:.2f}x "
                      f"roofline {roof[fmt]:.3f}); err {row.get('err', 0):.2e}", flush=True)
            # the selection the model runs on these scores: over each row's scores (every entry, or the
            # list), and at the candidate source the top blocks; its floor: the scores read once
            scores = jnp.asarray(want)
            floor = roofline_ms(0, scores.size * 4, ceil)
            k = min(TOPK, scores.shape[1])
            lax_top = jax.jit(lambda s: jax.lax.top_k(s, k))
            select = {f"select[lax.top_k {TOPK}]": (lax_top, (scores,)),
                      f"select[mega.topk.top_k {TOPK}]": (jax.jit(lambda s: top_k(s, k, not args.smoke)), (scores,))}
            if kind == "decode" and n == max(c[3] for c in (SMOKE if args.smoke else CASES) if c[0] == "decode"):
                select["select[candidate_blocks]"] = (jax.jit(partial(candidate_blocks, cfg=SOURCE)),
                                                      (scores, visible))
            want_ids = np.asarray(lax_top(scores)[1])
            for name, (fn, args_) in select.items():
                row = {"case": case, "impl": name, "ms": time_jax(fn, *args_, inner=2 if args.smoke else 5, reps=3)}
                if name.startswith("select[mega"):
                    row["same_as_lax"] = bool((np.asarray(fn(*args_)[1]) == want_ids).all())
                row["x_roofline"] = row["ms"] / floor
                rows_out.append(row)
                print(f"{kind} {requests}x{rows} N={n}: {name} {row['ms']:.3f} ms ({row['x_roofline']:.2f}x its "
                      f"read of the scores, {floor:.3f})", flush=True)
        except Exception as e:  # noqa: BLE001  (one case's failure is recorded, the rest still run)
            rows_out.append({"case": case, "impl": "setup", "ms": None, "error": repr(e)})
            traceback.print_exc()
        write("indexer_gpu", {**info, "ceilings": ceil, "rows": rows_out,   # after each case: a cut run keeps its rows
                              "conditions": "keys as the model stores them (Fp4Keys) and the same values in bf16, "
                                            "shuffled 32-entry pages, visible: decode all, prefill causal; wall clock "
                                            "per call, median of 3 x 5 back to back; errors against the XLA path"})


if __name__ == "__main__":
    main()
