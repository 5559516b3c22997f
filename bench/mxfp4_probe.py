"""Where the MXFP4 kernels' time goes (GPU): the gate/up and the down kernel at T16 and T256,
each timed alone (GPU busy time from a profiler trace), with the word conversion
(``e2m1_f16_words``) and with it replaced by one xor per word (stage removal: wrong outputs by
design), each variant in its own process with its ptxas report.

    OUT=... python3 bench/mxfp4_probe.py   # $OUT/mxfp4_probe.json and $OUT/<variant>_<T>/*.ptxas
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
E, D, I = 6, 5120, 2304
CONFIG = {16: (16, 256), 256: (128, 64)}   # tokens per expert -> (rows per CTA, step depth), as mega.moe


def xor_words(words):
    """Stand-in for ``e2m1_f16_words``: one xor per word, no conversion."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    i32, f16x2 = ir.IntegerType.get_signless(32), ir.VectorType.get((2,), ir.F16Type.get())
    return [[mgpu_utils.bitcast(arith.xori(mgpu_utils.bitcast(w, i32), arith.constant(i32, 0x3C003C00)), f16x2)] * 4
            for w in words]


def one(variant: str, t: int) -> dict:
    import jax
    import jax.numpy as jnp
    from gpu_common import gpu_timeline
    from pallas_kernels import grouped_gemm as gg
    from pallas_kernels.block_scaled import Fp4Weight
    if variant == "no-convert":
        gg.e2m1_f16_words = xor_words
    keys = jax.random.split(jax.random.key(0), 4)
    w1, w3 = (Fp4Weight.from_float(jax.random.normal(k, (E, I, D)) * D ** -0.5) for k in keys[:2])
    w2 = Fp4Weight.from_float(jax.random.normal(keys[2], (E, D, I)) * I ** -0.5)
    rows, bk = CONFIG[t]
    up_cfg = gg.GemmConfig(rows, 64, bk, 4, swap_ab=True)
    down_cfg = gg.GemmConfig(rows, 128, bk, 3, swap_ab=True)
    m = E * max(t, rows)
    x = jax.random.normal(keys[3], (m, D), jnp.float16)
    be = jnp.repeat(jnp.arange(E, dtype=jnp.int32), m // E // rows)
    up = jax.jit(lambda x: gg.grouped_swiglu(x, w1, w3, be, limit=10.0, cfg=up_cfg))
    down = jax.jit(lambda h: gg.grouped_matmul(h, w2, be, cfg=down_cfg))
    h = jax.block_until_ready(up(x))
    return {name: gpu_timeline(lambda: jax.block_until_ready([fn(a) for _ in range(6)]), 6)
            for name, fn, a in (("up", up, x), ("down", down, h))}


def main():
    out, rows = os.environ["OUT"], []
    for t in CONFIG:
        for variant in ("full", "no-convert"):
            dump = os.path.join(out, f"{variant}_{t}")
            os.makedirs(dump, exist_ok=True)
            env = {**os.environ, "MOSAIC_GPU_DUMP_TO": dump, "MOSAIC_GPU_DUMP_PTXAS": "1",
                   "JAX_ENABLE_COMPILATION_CACHE": "false"}
            r = subprocess.run([sys.executable, __file__, variant, str(t)], capture_output=True, text=True,
                               timeout=200, env=env)
            lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
            row = {"variant": variant, "T": t, **(json.loads(lines[-1]) if lines else {"error": r.stderr[-1500:]})}
            for f in os.listdir(dump):   # keep the ptxas reports only
                if not f.endswith(".ptxas"):
                    os.remove(os.path.join(dump, f))
            row["ptxas"] = [x.strip() for f in sorted(os.listdir(dump)) if f.endswith(".ptxas")
                            for x in open(os.path.join(dump, f)) if "spill" in x or "Used" in x]
            print(json.dumps(row), flush=True)
            rows.append(row)
    json.dump({"commit": os.environ.get("MEGAJAX_COMMIT"), "rows": rows},
              open(os.path.join(out, "mxfp4_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        print(json.dumps(one(sys.argv[1], int(sys.argv[2]))), flush=True)
    else:
        main()
