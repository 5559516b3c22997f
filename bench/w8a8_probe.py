"""W8A8 kernels one at a time on the GPU, each against an fp32 einsum on the same quantised
operands (a probe): the gate/up and the down kernel at V4.1-Flash shapes, and the down kernel
at smaller K, with rows whose 128-column blocks span scales 2^-6..2^2 (so a block or row
mix-up shows); also whether ``Fp8Rows.from_float`` gives the same bytes on the GPU as on the CPU.

    OUT=... python3 bench/w8a8_probe.py   # $OUT/w8a8_probe.json
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from gpu_common import rel_err
from pallas_kernels.block_scaled import Fp8Rows, QuantizedWeight
from pallas_kernels.grouped_gemm import GemmConfig, grouped_matmul, grouped_swiglu, swiglu_f32

E, D, I, T = 6, 5120, 2304, 16
HI = jax.lax.Precision.HIGHEST


def spread_rows(key, m, k):
    x = jax.random.normal(key, (m, k // 128, 128)) * 2.0 ** jax.random.randint(jax.random.fold_in(key, 1),
                                                                                (m, k // 128, 1), -6, 3)
    return x.reshape(m, k)


def main():
    keys = jax.random.split(jax.random.key(0), 6)
    rows = []
    cpu = jax.devices("cpu")[0]
    x = spread_rows(keys[0], E * T, D)
    on_gpu = Fp8Rows.from_float(x)
    with jax.default_device(cpu):
        on_cpu = Fp8Rows.from_float(jax.device_put(x, cpu))
    rows.append({"check": "from_float GPU == CPU",
                 "q_equal": bool((np.asarray(on_gpu.q, np.float32) == np.asarray(on_cpu.q, np.float32)).all()),
                 "scale_equal": bool((np.asarray(on_gpu.scale) == np.asarray(on_cpu.scale)).all())})
    w1, w3 = (QuantizedWeight.from_float(jax.random.normal(k, (E, I, D)) * D ** -0.5) for k in keys[1:3])
    be = jnp.repeat(jnp.arange(E, dtype=jnp.int32), 1)
    xd = on_gpu.dequantized().reshape(E, T, D)
    want_h = swiglu_f32(jnp.einsum("etd,eid->eti", xd, w1.dequantized(), precision=HI),
                        jnp.einsum("etd,eid->eti", xd, w3.dequantized(), precision=HI), 10.0).reshape(E * T, I)
    for up in ((16, 64, 128, 6), (16, 128, 128, 4), (16, 64, 64, 6)):
        cfg = GemmConfig(*up, swap_ab=True)
        got = grouped_swiglu(on_gpu, w1, w3, be, limit=10.0, cfg=cfg)
        rows.append({"kernel": "gate/up", "cfg": up, "K": D, "rel_err": rel_err(np.asarray(got, np.float32),
                                                                                 np.asarray(want_h))})
    for k in (I, 1024, 256, 128):
        w2 = QuantizedWeight.from_float(jax.random.normal(keys[3], (E, D, k)) * k ** -0.5)
        h = Fp8Rows.from_float(spread_rows(keys[4], E * T, k))
        want = jnp.einsum("eti,edi->etd", h.dequantized().reshape(E, T, k), w2.dequantized(), precision=HI)
        for down in ((16, 128, 128, 4), (16, 64, 128, 4), (16, 128, 64, 4)):
            cfg = GemmConfig(*down, swap_ab=True)
            try:
                got = grouped_matmul(h, w2, be, cfg=cfg)
                err = rel_err(np.asarray(got, np.float32), np.asarray(want.reshape(E * T, D)))
            except Exception as e:  # one failing config must not lose the others
                err = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append({"kernel": "down", "cfg": down, "K": k, "rel_err": err})
    for r in rows:
        print(json.dumps(r), flush=True)
    json.dump({"commit": os.environ.get("MEGAJAX_COMMIT"), "rows": rows},
              open(os.path.join(os.environ["OUT"], "w8a8_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
