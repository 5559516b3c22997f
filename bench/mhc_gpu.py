"""Mega-mHC on the GPU: one site's step (``mega.mhc.mhc_step``) with the Pallas pass against XLA's.

V4.1-Flash widths: 4 streams of 5,120 in bf16, a 24-row mix, 20 Sinkhorn iterations; rows of a
decode step (8, 64, 256 requests x 4) and of prefill (4K, 16K tokens). Both paths run the same
operator, as the model calls it (the kernel path's choice forced by ``MEGAJAX_KERNELS``), and
are checked against each other (the streams and the next input to bf16 rounding, the
coefficients to 2e-3). Timed per call and as GPU busy time (``gpu_common.gpu_timeline``: what a
call costs inside the model's one executable, where no host dispatch sits between calls), with
the stage removed, XLA's launches counted, and the roofline: the streams read and written
once, the update and the next input once, the mix weights once. Beside them the pass alone
(``pallas_kernels.mhc.mhc_pass``) at each of ``SWEEP``'s tile choices, checked against its
reference, to pick ``TILES``.

    python3 bench/mhc_gpu.py            # on the GPU, writes $OUT/mhc_gpu.json
    python3 bench/mhc_gpu.py --smoke    # CPU: small shapes, the kernel interpreted
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (ceilings, gpu_kernels, gpu_timeline, rel_err, roofline_ms, run_info,  # noqa: E402
                        time_jax, write)

import mega.mhc  # noqa: E402
from pallas_kernels.mhc import TILES, Tiles, mhc_pass, mhc_pass_reference  # noqa: E402

SWEEP = [TILES, Tiles(stages=1), Tiles(warps=8), Tiles(block_t=128, warps=8), Tiles(block_t=32, block_d=64),
         Tiles(block_d=64, warps=8), Tiles(block_t=16, block_d=64)]

HC, MIX = 4, 24


def inputs(t: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    comb = rng.random((t, HC, HC)) + 0.1
    streams = jnp.asarray(rng.normal(size=(t, HC, d)), jnp.bfloat16)
    update = mega.mhc.Update(jnp.asarray(rng.normal(size=(t, d)), jnp.bfloat16),
                             jnp.asarray(2 * rng.random((t, HC)), jnp.float32),
                             jnp.asarray(comb / comb.sum(1, keepdims=True), jnp.float32))
    site = {"fn": jnp.asarray(rng.normal(size=(MIX, HC * d)) * (HC * d) ** -0.5, jnp.float32),
            "base": jnp.asarray(rng.normal(size=MIX), jnp.float32),
            "scale": jnp.asarray(rng.random(3) + 0.5, jnp.float32)}
    pre = jnp.asarray(rng.random((t, HC)) + 1e-6, jnp.float32)
    norm = jnp.asarray(rng.random(d) + 0.5, jnp.bfloat16)
    return streams, update, site, pre, norm


def step(mode: str):
    """``mhc_step`` jitted with the kernel choice ``mode`` made at its trace."""
    def run(streams, update, site, pre, norm):
        return mega.mhc.mhc_step(streams, update, site, pre, norm, eps=1e-6, hc_eps=1e-6, iters=20)
    traced = jax.jit(run)

    def call(*args):
        os.environ["MEGAJAX_KERNELS"] = mode
        return traced(*args)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    d = 256 if args.smoke else 5120
    sizes = [32, 40] if args.smoke else [32, 256, 1024, 4096, 16384]
    kernel_mode = "interpret" if args.smoke else "pallas"
    info, ceil, rows = run_info(), ceilings(args.smoke), []
    for t in sizes:
        data = inputs(t, d, t)
        nbytes = t * HC * d * 2 * 2 + t * d * 2 * 2 + MIX * HC * d * 4
        case = {"rows": t, "streams": HC, "hidden": d, "mix": MIX, "roofline_ms": roofline_ms(0, nbytes, ceil),
                "bytes": nbytes}
        outs = {}
        for name, mode in (("pallas_mhc_pass", kernel_mode), ("xla", "reference")):
            fn = step(mode)
            outs[name] = jax.block_until_ready(fn(*data))
            row = {"case": case, "impl": name, "ms": time_jax(fn, *data)}
            row.update(gpu_timeline(lambda: jax.block_until_ready([fn(*data) for _ in range(5)]), 5))
            row["kernels_us"] = gpu_kernels(fn, *data)   # (none off the GPU)
            row["x_roofline"] = row["ms"] / case["roofline_ms"]
            rows.append(row)
        op_rows = rows[-2:]   # the operator, kernel and XLA
        for tiles in SWEEP if not args.smoke else SWEEP[:2]:
            streams, update, site, pre, _ = data
            fn = jax.jit(lambda s, u, p, f, tiles=tiles: mhc_pass(s, u, p, f, eps=1e-6, tiles=tiles,
                                                                 interpret=args.smoke))
            pass_args = (streams, tuple(update), pre, site["fn"])
            row = {"case": case, "impl": f"pass{list(tiles)}", "tiles": tiles._asdict()}
            try:
                got = jax.block_until_ready(fn(*pass_args))
                want = mhc_pass_reference(*pass_args, eps=1e-6)
                own = mhc_pass_reference(got[0], None, pre, site["fn"], eps=1e-6)   # the projection of its own streams
                row["err"] = {"streams": rel_err(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)),
                              "collapse": rel_err(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32)),
                              "projection": rel_err(np.asarray(got[2]), np.asarray(own[2]))}
                row["ms"] = time_jax(fn, *pass_args)
                row.update(gpu_timeline(lambda: jax.block_until_ready([fn(*pass_args) for _ in range(5)]), 5))
                row["x_roofline"] = row["ms"] / case["roofline_ms"]
            except Exception as e:  # noqa: BLE001  (a tile choice that does not compile: its row says so)
                row["error"] = repr(e)[:1000]
            rows.append(row)
            print(t, row["impl"], f"{row.get('ms', float('nan')):.4f} ms",
                  f"busy {row.get('gpu_busy_ms', float('nan')):.4f}", row.get("err", row.get("error")), flush=True)
        got, want = outs["pallas_mhc_pass"], outs["xla"]
        op_rows[0]["err"] = {"streams": rel_err(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)),
                           "input": rel_err(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32)),
                           "coefficients": max(rel_err(g, w) for g, w in zip(got[2], want[2]))}
        for row in op_rows:
            print(t, row["impl"], f"{row['ms']:.4f} ms", f"busy {row.get('gpu_busy_ms', float('nan')):.4f}",
                  f"{row['x_roofline']:.2f}x roofline", f"{len(row['kernels_us'])} launches", row.get("err", ""),
                  flush=True)
        write("mhc_gpu", {**info, "ceilings": ceil, "rows": rows})


if __name__ == "__main__":
    main()
