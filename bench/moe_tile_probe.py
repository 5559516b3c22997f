"""Tile probes for the MoE GEMMs: one wgmma over a fused gate|up weight tile against the
two-operand gate/up kernel, and the down GEMM's tile widths.

``grouped_swiglu`` streams a gate tile and an up tile per step into two wgmmas that read the
same activation tile; cuBLAS's GEMM for the XLA einsum (``nvjet ... 144x128``) runs one wide
tile and 2.9 waves at T256 where ours runs 1.64. This probe times, per GPU kernel (profiler
trace), at V4.1-Flash expert shapes (6 local experts, D 5120, I 2304, balanced rows):

* ``swiglu[cfg]``: ``grouped_swiglu(x, w1, w3)`` with ``mega.moe``'s config for the size,
  then persistent three- and four-stage variants (checked against the fp32 SwiGLU of the
  einsum's products);
* ``w13 matmul[cfg]``: ``grouped_matmul(x, w13)`` over the stacked ``[E, 2I, D]`` weight, one
  operand whose tile is ``block_n`` rows of it (the fused layout's GEMM, without the SwiGLU
  epilogue, writing 2I columns);
* ``einsum``: XLA's batched einsum over the same stacked weight (the peer's kernel);
* ``down[cfg]`` and ``down einsum``: the down projection ``[rows, I] x [E, D, I]`` at tile
  widths that divide D = 5120 (cuBLAS picks 168-176 wide tiles there);
* ``down one expert[cfg]``: the same GEMM with every row through expert 0, whose 24 MB weight
  stays in L2: what the kernel does without six experts' weights streaming from HBM (the
  condition of ``--pallas-matmul``'s dense GEMMs).

``--pallas-matmul`` instead asks whether Pallas can reach cuBLAS on these GEMMs at all: JAX's
own Hopper matmul (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``: persistent,
warp specialised, tiled epilogue, swizzled grid) at a few tilings, against ``jnp.dot``
(cuBLAS), both on the dense equivalents of the expert GEMMs (``M = E * tokens`` rows; one
weight ``[K, N]``, the layout that kernel reads): gate|up (K = D, N = 2I) and down (K = I,
N = D).

    python3 bench/moe_tile_probe.py         # on the H200, writes $OUT/moe_tile_probe.json
    python3 bench/moe_tile_probe.py --pallas-matmul   # writes $OUT/pallas_matmul_probe.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ceilings, gpu_kernels, rel_err, run_info, write  # noqa: E402

from pallas_kernels.grouped_gemm import GemmConfig, grouped_matmul, grouped_swiglu, swiglu_f32  # noqa: E402

E, D, I, LIMIT = 6, 5120, 2304, 10.0
SWIGLU = {t: GemmConfig(64, 128, 64, 4, 2, group_m=8) for t in (256, 1024, 4096)}   # mega.moe's
SWIGLU_PERSISTENT = [GemmConfig(64, 128, 64, 3, compute_wgs=2, persistent=True),
                     GemmConfig(64, 128, 64, 4, compute_wgs=2, persistent=True)]
W13 = [GemmConfig(64, 256, 64, 3, compute_wgs=2), GemmConfig(64, 256, 64, 4, compute_wgs=2, persistent=True),
       GemmConfig(64, 256, 128, 2, compute_wgs=2, persistent=True)]
DOWN = [GemmConfig(64, 256, 64, 3, compute_wgs=2), GemmConfig(64, 256, 64, 4, compute_wgs=2, persistent=True),
        GemmConfig(128, 128, 64, 3, compute_wgs=2), GemmConfig(64, 256, 128, 2, compute_wgs=2, persistent=True),
        GemmConfig(64, 128, 64, 4, compute_wgs=2, persistent=True)]


def name(c):
    return f"{c.block_m}x{c.block_n}x{c.block_k}/{c.stages}" + (" persistent" if c.persistent else "")


def main():
    info, rows = run_info(), []
    ceil = ceilings()
    k = jax.random.split(jax.random.key(0), 3)
    w1, w3 = (0.02 * jax.random.normal(kk, (E, I, D), jnp.bfloat16) for kk in k[:2])
    w13 = jnp.concatenate([w1, w3], axis=1)
    w2 = 0.02 * jax.random.normal(jax.random.fold_in(k[2], 1), (E, D, I), jnp.bfloat16)
    for t in (256, 1024, 4096):
        x = jax.random.normal(jax.random.fold_in(k[2], t), (E * t, D), jnp.bfloat16)
        flops = 2 * E * t * D * 2 * I
        roof_us = max(flops / ceil["matmul_TFLOPs"] / 1e6, 2 * E * 2 * I * D / ceil["bandwidth_GBps"] / 1e3)
        roof_down_us = max(flops / 2 / ceil["matmul_TFLOPs"] / 1e6, 2 * E * I * D / ceil["bandwidth_GBps"] / 1e3)
        want = jnp.einsum("etd,eid->eti", x.reshape(E, t, D), w13, preferred_element_type=jnp.float32)
        want = want.reshape(E * t, 2 * I)
        variants = [("einsum", jax.jit(lambda x, w: jnp.einsum("etd,eid->eti", x.reshape(E, t, D), w)), (x, w13), None)]
        want_h = swiglu_f32(want[:, :I], want[:, I:], LIMIT)
        for c in [SWIGLU[t]] + SWIGLU_PERSISTENT:
            be = jnp.repeat(jnp.arange(E, dtype=jnp.int32), t // c.rows)
            variants.append((f"swiglu[{name(c)}]", jax.jit(lambda x, a, b, be, c=c: grouped_swiglu(
                x, a, b, be, limit=LIMIT, cfg=c)), (x, w1, w3, be), want_h))
        for c in W13:
            be = jnp.repeat(jnp.arange(E, dtype=jnp.int32), t // c.rows)
            if (2 * I) % c.block_n or t % c.rows:
                continue
            variants.append((f"w13 matmul[{name(c)}]", jax.jit(lambda x, w, be, c=c: grouped_matmul(x, w, be, cfg=c)),
                             (x, w13, be), want))
        h = x[:, :I]
        down_want = jnp.einsum("eti,edi->etd", h.reshape(E, t, I), w2, preferred_element_type=jnp.float32)
        variants.append(("down einsum", jax.jit(lambda h, w: jnp.einsum("eti,edi->etd", h.reshape(E, t, I), w)),
                         (h, w2), None))
        for c in DOWN:
            be = jnp.repeat(jnp.arange(E, dtype=jnp.int32), t // c.rows)
            if D % c.block_n or t % c.rows:
                continue
            variants.append((f"down[{name(c)}]", jax.jit(lambda h, w, be, c=c: grouped_matmul(h, w, be, cfg=c)),
                             (h, w2, be), down_want.reshape(E * t, D)))
        # every row through expert 0 (its 24 MB weight stays in L2, as in --pallas-matmul's dense
        # GEMMs): separates the weight stream of six experts from the kernel's main loop
        c = DOWN[1]
        be0 = jnp.zeros((E * t // c.rows,), jnp.int32)
        variants.append((f"down one expert[{name(c)}]", jax.jit(lambda h, w, be, c=c: grouped_matmul(h, w, be, cfg=c)),
                         (h, w2[:1], be0), jnp.dot(h, w2[0].T, preferred_element_type=jnp.float32)))
        for impl, fn, args, ref in variants:
            row = {"case": {"tokens_per_expert": t, "E": E, "D": D, "I": I}, "impl": impl,
                   "roofline_us": roof_down_us if impl.startswith("down") else roof_us}
            try:
                if ref is not None:
                    row["rel_err"] = rel_err(fn(*args), ref)
                ks = gpu_kernels(fn, *args)
                row["kernels_us"] = ks
                row["us"] = sum(us for _, us in ks)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:500]
            rows.append(row)
            print(t, impl, row.get("us"), row.get("rel_err"), row.get("error", ""), flush=True)
    write("moe_tile_probe", {**info, "ceilings": ceil, "rows": rows})


def pallas_matmul():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    info, rows = run_info(), []
    ceil = ceilings()
    dims = hm.MatmulDimension
    tilings = [dict(tile_m=128, tile_n=128, wg_dimension=dims.N), dict(tile_m=128, tile_n=128, wg_dimension=dims.M),
               dict(tile_m=64, tile_n=256, wg_dimension=dims.M), dict(tile_m=128, tile_n=64, wg_dimension=dims.N)]
    key = jax.random.key(1)
    for t in (256, 1024, 4096):
        for gemm, k_, n_ in (("gate|up", D, 2 * I), ("down", I, D)):
            m_ = E * t
            a = jax.random.normal(jax.random.fold_in(key, t), (m_, k_), jnp.bfloat16)
            b = 0.02 * jax.random.normal(jax.random.fold_in(key, n_), (k_, n_), jnp.bfloat16)
            want = jnp.dot(a, b, preferred_element_type=jnp.float32)
            flops = 2 * m_ * k_ * n_
            variants = [("jnp.dot (cuBLAS)", jax.jit(jnp.dot), None)]
            for tl in tilings:
                for steps, width in ((4, 8), (3, 4)):
                    cfg = hm.TuningConfig(tile_k=64, max_concurrent_steps=steps, grid_tile_width=width, **tl)
                    label = f"hopper_matmul_mgpu[{tl['tile_m']}x{tl['tile_n']} wg {tl['wg_dimension']}, {steps} steps, width {width}]"
                    variants.append((label, jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg)), want))
            for impl, fn, ref in variants:
                row = {"case": {"tokens_per_expert": t, "gemm": gemm, "M": m_, "K": k_, "N": n_}, "impl": impl,
                       "roofline_us": flops / ceil["matmul_TFLOPs"] / 1e6}
                try:
                    if ref is not None:
                        row["rel_err"] = rel_err(fn(a, b), ref)
                    ks = gpu_kernels(fn, a, b)
                    row["kernels_us"] = ks
                    row["us"] = sum(us for _, us in ks)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:500]
                rows.append(row)
                print(t, gemm, impl, row.get("us"), row.get("rel_err"), row.get("error", ""), flush=True)
    write("pallas_matmul_probe", {**info, "ceilings": ceil, "rows": rows})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pallas-matmul", action="store_true", help="JAX's Hopper matmul against cuBLAS instead")
    pallas_matmul() if ap.parse_args().pallas_matmul else main()
