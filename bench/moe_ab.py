"""A/B of the quantised expert kernels between source trees, in one GPU call (a probe).

Each tree (``name=path``: this one, or e.g. an archive of main) runs in its own process, on the
same data (fixed seeds), the gate/up + down kernels of each listed config, fp8 and MXFP4
weights with f16 rows, and W8A8 (``w8a8``: fp8 weights, ``Fp8Rows`` in, ``h`` requantised by
XLA between the kernels, as SGLang's block-fp8 MoE does, or by 128-wide gate/up tiles' epilogue),
at the V4.1-Flash expert shapes of ``moe_gpu.py``: each row checked against the fp32 reference on the dequantised weights (and
rows: W8A8's ``rel_err`` includes ``h``'s fp8 rounding, ``rel_err_h`` is the gate/up kernel's
alone), then GPU busy time per call (profiler trace over six calls, no host gaps) and each
kernel's µs.

    OUT=... python3 bench/moe_ab.py [--formats fp8,mxfp4,w8a8,w8a8-ws,w8a8-deep] main=../.probe/main new=.

(``--formats w8a8-ws@256,w8a8-ws@1024``: a format's configs at those tokens per expert only.)
"""
import json
import os
import subprocess
import sys

E, D, I, LIMIT = 6, 5120, 2304, 10.0
# (format, tokens per expert) → [(gate/up config, down config)] as GemmConfig arguments
CONFIGS = {
    ("fp8", 16): [((16, 64, 128, 6), (16, 128, 128, 4)), ((32, 64, 128, 4), (32, 128, 128, 3))],
    ("fp8", 64): [((64, 64, 128, 4), (64, 128, 128, 3)), ((64, 64, 128, 3), (64, 128, 128, 2))],
    ("fp8", 256): [((128, 64, 64, 4), (128, 128, 64, 3))],
    ("mxfp4", 16): [((16, 64, 256, 4), (16, 128, 256, 3)), ((16, 64, 128, 8), (16, 128, 128, 6))],
    ("mxfp4", 64): [((64, 64, 128, 4), (64, 128, 128, 3))],
    ("mxfp4", 256): [((128, 64, 64, 4), (128, 128, 64, 3))],
    # (W8A8 holds each accumulator twice, the step's product and the sum; gate/up tiles 128 wide
    # are one scale block of h, which their epilogue then quantises: ``fp8_out``)
    ("w8a8", 16): [((32, 64, 128, 4), (32, 128, 128, 3)), ((32, 128, 128, 4), (32, 128, 128, 3)),
                   ((16, 128, 128, 4), (16, 128, 128, 4)), ((32, 128, 128, 3), (32, 128, 128, 3))],
    ("w8a8", 64): [((64, 64, 128, 6), (64, 64, 128, 6)), ((32, 128, 128, 4), (32, 128, 128, 3)),
                   ((64, 128, 128, 3), (64, 128, 128, 3)), ((64, 128, 128, 2), (64, 64, 128, 6))],
    ("w8a8", 256): [((64, 64, 128, 4), (64, 128, 128, 3)), ((32, 128, 128, 4), (32, 128, 128, 3)),
                    ((64, 128, 128, 3), (64, 128, 128, 3)), ((64, 128, 128, 2), (64, 64, 128, 6))],
    # warp specialised (two compute warpgroups of 64 weight rows each, the rows shared): 128-wide
    # tiles without the register pressure; h requantised by XLA. At 16 and 64 rows the first
    # pair is mega.moe's (one warpgroup), timed beside them
    ("w8a8-ws", 16): [((32, 128, 128, 4), (32, 128, 128, 3)),
                      ((16, 128, 128, 4, 2, "n"), (16, 128, 128, 4, 2, "n")),
                      ((32, 128, 128, 4, 2, "n"), (32, 128, 128, 4, 2, "n"))],
    ("w8a8-ws", 64): [((64, 64, 128, 4), (64, 128, 128, 3)),
                      ((32, 128, 128, 4, 2, "n"), (32, 128, 128, 4, 2, "n")),
                      ((64, 128, 128, 4, 2, "n"), (64, 128, 128, 4, 2, "n"))],
    # from 256 rows: mega.moe's pair (warp-specialised gate/up, one warpgroup's down), then
    # warp-specialised down tiles of 128 rows (each warpgroup's fp8 wgmma 64 x 128: fewer
    # shared-memory bytes per product than N = 64; balanced loads, so no extra padding here)
    ("w8a8-ws", 256): [((64, 128, 128, 4, 2, "n"), (64, 128, 128, 3)),
                       ((64, 128, 128, 4, 2, "n"), (128, 128, 128, 3, 2, "n")),
                       ((64, 128, 128, 4, 2, "n"), (128, 128, 128, 4, 2, "n"))],
    # 256-deep steps (two scale blocks: the first promoted while the second's wgmmas run), both
    # kernels, then the gate/up kernel alone beside mega.moe's down
    ("w8a8-deep", 256): [((64, 128, 256, 2, 2, "n"), (64, 128, 256, 3)),
                         ((64, 128, 256, 2, 2, "n"), (64, 128, 128, 3))],
    ("w8a8-deep", 1024): [((64, 128, 256, 2, 2, "n"), (64, 128, 256, 3)),
                          ((64, 128, 256, 2, 2, "n"), (64, 128, 128, 3))],
    ("w8a8-ws", 1024): [((64, 128, 128, 4, 2, "n"), (64, 128, 128, 3)),
                        ((64, 128, 128, 4, 2, "n"), (128, 128, 128, 3, 2, "n")),
                        ((64, 128, 128, 4, 2, "n"), (128, 128, 128, 4, 2, "n")),
                        ((64, 128, 128, 4, 2, "n"), (128, 128, 128, 5, 2, "n"))],
}


def one_tree(formats: list[str]) -> list[dict]:
    """Every config of ``CONFIGS`` in ``formats``, with the packages first on ``sys.path``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from gpu_common import gpu_kernels, gpu_timeline, rel_err
    from moe_gpu import reference
    from pallas_kernels.block_scaled import Fp4Weight, QuantizedWeight
    from pallas_kernels import grouped_gemm as gg
    from pallas_kernels.grouped_gemm import GemmConfig, grouped_matmul, grouped_swiglu
    from pallas_kernels.block_scaled import Fp8Rows as w8a8_rows
    keys = jax.random.split(jax.random.key(0), 4)
    w1, w3 = (jax.random.normal(k, (E, I, D), jnp.bfloat16) * D ** -0.5 for k in keys[:2])
    w2 = jax.random.normal(keys[2], (E, D, I), jnp.bfloat16) * I ** -0.5
    quantizers = {"fp8": QuantizedWeight.from_float, "mxfp4": Fp4Weight.from_float, "w8a8": QuantizedWeight.from_float}
    rows = []
    for (group, t), pairs in CONFIGS.items():
        fmt = group.split("-")[0]   # ("w8a8-ws": W8A8's warp-specialised configs)
        if (group not in formats and f"{group}@{t}" not in formats) or (fmt == "w8a8" and w8a8_rows is None):
            continue
        qs = [quantizers[fmt](w) for w in (w1, w3, w2)]
        x = jax.random.normal(jax.random.fold_in(keys[3], t), (E * t, D), jnp.bfloat16)
        if fmt == "w8a8":
            x = w8a8_rows.from_float(x).dequantized(jnp.bfloat16)   # (exact: the rows as quantised)
            d1, d3 = (q.dequantized() for q in qs[:2])
            xe = x.astype(jnp.float32).reshape(E, t, D)
            hp = jax.lax.Precision.HIGHEST
            h_ref = np.asarray(gg.swiglu_f32(jnp.einsum("etd,eid->eti", xe, d1, precision=hp),
                                             jnp.einsum("etd,eid->eti", xe, d3, precision=hp), LIMIT))
        ref = np.asarray(reference(x, *(q.dequantized() for q in qs), (t,) * E))
        for up, down in pairs:
            cu, cd = GemmConfig(*up, swap_ab=True), GemmConfig(*down, swap_ab=True)
            block = max(cu.rows, cd.rows)          # (the two kernels' row blocks may differ)
            per = -(-t // block) * block           # rows per expert, block aligned (balanced)
            x_al = jnp.pad(x.reshape(E, t, D), ((0, 0), (0, per - t), (0, 0))).reshape(E * per, D)
            be = jnp.repeat(jnp.arange(E, dtype=jnp.int32), per // cu.rows)
            be_d = jnp.repeat(jnp.arange(E, dtype=jnp.int32), per // cd.rows)
            fused = fmt == "w8a8" and cu.quantizes_h
            if fmt == "w8a8":
                fn = jax.jit(lambda x, a, b, c, be, be_d, cu=cu, cd=cd, fused=fused: grouped_matmul(
                    grouped_swiglu(x, a, b, be, limit=LIMIT, cfg=cu, fp8_out=True) if fused
                    else w8a8_rows.from_float(grouped_swiglu(x, a, b, be, limit=LIMIT, cfg=cu)), c, be_d, cfg=cd))
                args = (w8a8_rows.from_float(x_al), *qs, be, be_d)
            else:
                fn = jax.jit(lambda x, a, b, c, be, be_d, cu=cu, cd=cd: grouped_matmul(
                    grouped_swiglu(x, a, b, be, limit=LIMIT, cfg=cu), c, be_d, cfg=cd))
                args = (x_al.astype(jnp.float16), *qs, be, be_d)
            row = {"format": group, "T": t, "up": up, "down": down}
            try:
                def valid(y, n):
                    return np.asarray(y, np.float32).reshape(E, per, n)[:, :t].reshape(E * t, n)
                y = valid(fn(*args), D)
                row["rel_err"] = rel_err(y, ref)
                if fmt == "w8a8":   # (fused: h after its fp8 rounding)
                    h = grouped_swiglu(args[0], qs[0], qs[1], be, limit=LIMIT, cfg=cu, fp8_out=fused)
                    row["rel_err_h"] = rel_err(valid(h.dequantized() if fused else h, I), h_ref.reshape(E * t, I))
                row["gpu"] = gpu_timeline(lambda: jax.block_until_ready([fn(*args) for _ in range(6)]), 6)
                row["kernels_us"] = [us for _, us in gpu_kernels(fn, *args)]
            except Exception as e:  # one failing config must not lose the others
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main():
    args = sys.argv[1:]
    formats = args.pop(args.index("--formats") + 1) if "--formats" in args else "fp8,mxfp4,w8a8,w8a8-ws"
    trees = dict(a.split("=", 1) for a in args if a != "--formats")
    out, rows = os.environ["OUT"], []
    for name, path in trees.items():
        root = os.path.abspath(path)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "bench")])}
        try:   # (TREE_TIMEOUT: a kernel that hangs loses its tree's rows, not the call's)
            r = subprocess.run([sys.executable, __file__, "--one", formats], capture_output=True, text=True, env=env,
                               timeout=float(os.environ.get("TREE_TIMEOUT", 540)))
            stdout, stderr = r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            out_bytes = e.stdout or b""   # (bytes, even with text=True)
            stdout = out_bytes if isinstance(out_bytes, str) else out_bytes.decode()
            stderr = f"timed out after {e.timeout} s"
        got = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        if not got or stderr.startswith("timed out"):
            got.append({"error": stderr[-2000:]})
        rows += [{"tree": name, **g} for g in got]
        for g in got:
            print(name, json.dumps(g), flush=True)
        json.dump({"commit": os.environ.get("MEGAJAX_COMMIT"), "trees": trees, "rows": rows},
                  open(os.path.join(out, "moe_ab.json"), "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one_tree(sys.argv[2].split(","))
    else:
        main()
