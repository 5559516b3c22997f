"""Engram tables in device memory against host memory (``--engram-placement``), on one GPU.

One Engram layer at V4.1-Flash widths (24 hash columns of 256-wide e4m3 rows with their UE8M0
scale bytes), its table cut to ``--rows`` rows (default 4 Mi: 1 GiB, hashed ids uniform over
it), placed by ``sharding.engram_tables.split`` on a 1 x 1 mesh as the engine places it, and
looked up through ``engram_tables.lookup``, the model's own path:

* ``device_ms`` / ``host_ms``: the lookup alone (device: a gather from HBM; host: the ids to
  the host, a gather by XLA's host compute, the e4m3 rows back over PCIe), beside their floors:
  the rows' bytes at the measured HBM bandwidth, and at the measured host-to-device bandwidth
  of a pinned buffer;
* overlap: a step of ``--layers`` bf16 [T, 4096] x [4096, 4096] matmuls (standing for the layers
  before the first Engram layer) whose output is then added to the looked-up rows. ``hidden`` is
  the share of the host lookup's time the step hides: (layers + lookup - step) / lookup, 1.0 when
  the lookup runs entirely beside the layers, 0 when the step waits for it.

Each placement's rows are checked against ``mega.engram.lookup_rows`` of the whole table.

    python3 bench/engram_placement_gpu.py              # H100/H200: $OUT/engram_placement_gpu.json
    python3 bench/engram_placement_gpu.py --smoke      # CPU: toy sizes
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ceilings, rel_err, run_info, time_jax, write  # noqa: E402

COLS, HEAD_DIM, WIDTH = 24, 256, 4096


class _OneLayer:   # the config fields engram_tables.split reads
    engram_layer_ids = (0,)


def h2d_GBps(nbytes: int) -> float:
    """Host-to-device bandwidth from a pinned host buffer (the PCIe ceiling of a host lookup)."""
    import jax
    import numpy as np

    dev = jax.devices()[0]
    host = jax.device_put(np.ones(nbytes, np.uint8), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    to_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    jax.device_put(host, to_dev).block_until_ready()
    t0, reps = time.perf_counter(), 5
    for _ in range(reps):
        jax.device_put(host, to_dev).block_until_ready()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=int, help="table rows (default 4 Mi; smoke 4 Ki)")
    ap.add_argument("--tokens", default="64,1024,8192")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mega.engram import lookup_rows
    from sharding import engram_tables
    from sharding.mesh import MeshSpec

    rows = args.rows or (1 << 12 if args.smoke else 1 << 22)
    width = 256 if args.smoke else WIDTH
    rng = np.random.default_rng(0)
    # random finite e4m3 bytes (0x7f and 0xff are NaN), drawn as bytes: a 1 GiB table in seconds
    bits = rng.integers(0, 0x7F, size=(rows, HEAD_DIM), dtype=np.uint8) | (rng.integers(0, 2, (rows, HEAD_DIM),
                                                                                        dtype=np.uint8) << 7)
    table = bits.view(jnp.float8_e4m3fn)
    scale = rng.integers(120, 131, size=(rows, HEAD_DIM // 32)).astype(np.uint8)
    mesh = MeshSpec(1, 1).build(jax.devices()[:1])
    placed = {p: engram_tables.split({"layers": [{"engram": {"table": table, "scale": scale}}]}, _OneLayer, mesh,
                                     p)["layers"][0]["engram"] for p in engram_tables.PLACEMENTS}
    whole = {"table": jnp.asarray(table), "scale": jnp.asarray(scale)}
    ceil = ceilings(args.smoke)
    ceil["h2d_GBps"] = h2d_GBps(64 << (10 if args.smoke else 20))
    lookup = jax.jit(engram_tables.lookup)
    w = jax.random.normal(jax.random.key(1), (width, width), jnp.bfloat16) * width ** -0.5

    def step(g, ids, x):   # the layers before the first Engram layer, then the injection's input
        for _ in range(args.layers):
            x = jnp.tanh(x @ w)
        looked = engram_tables.lookup(g, ids)
        return x.astype(jnp.float32).sum() + looked.sum()

    step = jax.jit(step)
    layers_only = jax.jit(lambda x: [x := jnp.tanh(x @ w) for _ in range(args.layers)][-1])
    payload = {**run_info(), "ceilings": ceil, "shape": {"rows": rows, "cols": COLS, "head_dim": HEAD_DIM,
                                                         "layers": args.layers, "width": width},
               "table_bytes": table.nbytes + scale.nbytes, "cases": {}}
    for t in map(int, args.tokens.split(",")):
        ids = jnp.asarray(rng.integers(0, rows, size=(t, COLS)), jnp.int32)
        x = jax.random.normal(jax.random.key(t), (t, width), jnp.bfloat16)
        want = lookup_rows(whole["table"], whole["scale"], ids)
        moved = t * COLS * (HEAD_DIM + HEAD_DIM // 32)   # e4m3 rows and their scale bytes
        case = {"bytes_moved": moved, "device_floor_ms": moved / ceil["bandwidth_GBps"] / 1e6,
                "host_floor_ms": moved / ceil["h2d_GBps"] / 1e6, "layers_ms": time_jax(layers_only, x)}
        for p, g in placed.items():
            case[f"{p}_rel_err"] = rel_err(lookup(g, ids), want)
            case[f"{p}_ms"] = time_jax(lookup, g, ids)
            case[f"{p}_step_ms"] = time_jax(step, g, ids, x)
        case["hidden"] = (case["layers_ms"] + case["host_ms"] - case["host_step_ms"]) / case["host_ms"]
        payload["cases"][f"T{t}"] = case
        print(t, {k: round(v, 4) if isinstance(v, float) else v for k, v in case.items()}, flush=True)
        write("engram_placement_gpu", payload)


if __name__ == "__main__":
    main()
