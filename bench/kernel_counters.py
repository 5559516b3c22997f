"""Hardware counters of our kernels under Nsight Compute: where a kernel's
cycles go (tensor-pipe activity, warp stall reasons, shared-memory and DRAM traffic), where
the timing benches can only remove stages and take differences.

Each case builds its inputs, runs its functions twice (compilation, warm-up), then once more
between ``cuProfilerStart`` and ``cuProfilerStop``, so that ``ncu --profile-from-start off``
profiles exactly that call's kernels:

- ``attn-decode-256``, ``attn-prefill-4096``: ``sparse_mqa`` at ``attention_gpu.py``'s shapes
  (bf16 pools, the automatic grid);
- ``moe-256``, ``moe-1024``: the bf16 expert stage at ``moe_gpu.py``'s shapes (6 experts,
  balanced), ``mega.moe``'s kernels at the configs it picks for that size; ``moe-w8a8-1024``:
  the W8A8 kernels there (fp8 weights and rows).

On the device (Firecracker machines; ``--clock-control none`` leaves the clocks alone):

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_autotune_level=0 \\
        ncu --profile-from-start off --set full --clock-control none -f -o $OUT/counters \\
        python3 bench/kernel_counters.py
    python3 bench/kernel_counters.py --export $OUT/counters.ncu-rep   # gzipped pages + JSON summary

The platform allocator gives each buffer its own allocation: ncu saves and restores the memory
a replayed kernel can write, and XLA's default pool is most of the GPU. With XLA's autotuning
on, the process segfaulted under ncu before the first profiled kernel of a case with XLA
fusions (JAX 0.11.2, ncu 2025.3.1). With it off an XLA einsum runs untuned Triton GEMMs, not
cuBLAS, so the peers are not profiled here: ``moe_gpu.py`` times them.
``--smoke``: tiny shapes in the Mosaic GPU interpreter, no profiler (CPU).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import functools
import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_gpu  # noqa: E402
from gpu_common import run_info  # noqa: E402

from pallas_kernels.block_scaled import Fp8Rows, QuantizedWeight  # noqa: E402
from pallas_kernels.grouped_gemm import grouped_matmul, grouped_swiglu  # noqa: E402
from pallas_kernels.sparse_attention import sparse_mqa  # noqa: E402
from mega.moe import aligned_layout  # noqa: E402
from pallas_kernels.grouped_gemm_tiles import tiles  # noqa: E402

CASES = ("attn-decode-256", "attn-prefill-4096", "moe-256", "moe-1024", "moe-w8a8-1024")
LIMIT = 10.0   # SwiGLU clamp, as moe_gpu.py


def _profiler():
    """(start, stop) of the CUDA profiler range, or no-ops where there is no CUDA driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return (lambda: None), (lambda: None)
    return cuda.cuProfilerStart, cuda.cuProfilerStop


def attention_case(kind, n, smoke):
    h, d, win, topk, pool = (64, 128, 64, 64, 512) if smoke else (64, 512, 128, 512, 32768)
    _, (wkv, ckv), draw, _ = attention_gpu.make_case(kind, n, h, d, win, topk, pool, np.random.default_rng(0))
    q, w, c = draw(1)
    sink = jnp.asarray(np.random.default_rng(1).standard_normal(h), jnp.float32)
    fn = jax.jit(lambda q, w, c, a, b: sparse_mqa(q, [(a, w), (b, c)], sink, d ** -0.5))
    return {"sparse_mqa": (fn, (q, w, c, wkv, ckv))}


def moe_case(t, smoke, w8a8=False):
    interpret = None
    if smoke:   # the grouped kernels read their operands differently when interpreted: say so
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret = InterpretGPUParams()
    e, d, i = (2, 256, 128) if smoke else (6, 5120, 2304)
    keys = jax.random.split(jax.random.key(t), 4)
    xs = jax.random.normal(keys[0], (e * t, d), jnp.bfloat16)
    w1, w3 = (jax.random.normal(k, (e, i, d), jnp.bfloat16) * d ** -0.5 for k in keys[1:3])
    w2 = jax.random.normal(keys[3], (e, d, i), jnp.bfloat16) * i ** -0.5
    up_cfg, down_cfg = tiles(e * t, e, d, i, "w8a8" if w8a8 else "bf16")   # what mega.moe runs
    gs = jnp.full((e,), t, jnp.int32)
    dest, block_expert, m_pad = aligned_layout(gs, e * t, up_cfg.rows, e)
    x_al = jnp.zeros((m_pad, d), xs.dtype).at[dest].set(xs)
    up = functools.partial(grouped_swiglu, limit=LIMIT, cfg=up_cfg, interpret=interpret)
    down = functools.partial(grouped_matmul, cfg=down_cfg, interpret=interpret)
    if w8a8:   # h quantised by the gate/up epilogue where its config can, else by XLA (as mega.moe)
        fused = up_cfg.quantizes_h
        quantized = [QuantizedWeight.from_float(w) for w in (w1, w3, w2)]
        ours = jax.jit(lambda x, a, b, c, be: down(
            up(x, a, b, be, fp8_out=True) if fused else Fp8Rows.from_float(up(x, a, b, be)), c, be))
        return {"megajax_w8a8": (ours, (Fp8Rows.from_float(x_al), *quantized, block_expert))}
    return {"megajax": (jax.jit(lambda x, a, b, c, be: down(up(x, a, b, be), c, be)), (x_al, w1, w3, w2, block_expert))}


def run(cases, smoke):
    start, stop = _profiler()
    for name in cases:
        kind, *rest = name.split("-")
        size = int(rest[-1]) if not smoke else {"decode": 2, "prefill": 8}.get(rest[0], 64)
        fns = attention_case(rest[0], size, smoke) if kind == "attn" else moe_case(size, smoke, rest[0] == "w8a8")
        for impl, (fn, args) in fns.items():
            for _ in range(2):
                jax.block_until_ready(fn(*args))
            start()
            jax.block_until_ready(fn(*args))
            stop()
            print(f"profiled {name} {impl}", flush=True)


PAGES = {"raw.csv": ["--page", "raw", "--csv"], "details.txt": ["--page", "details"],
         "source.csv": ["--page", "source", "--csv", "--print-source", "sass"]}
METRICS = {   # summary name -> raw metric (ncu 2025.3 on sm90)
    "ms": "gpu__time_duration.sum",
    "sm_clock_ghz": "gpc__cycles_elapsed.avg.per_second",
    "tensor_active_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "issue_active_pct": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "shared_wavefronts_pct": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
}
# ncu scales each metric to its own unit: back to bytes, and durations to ms (the reports up to
# commit cd1e291 kept ncu's usecond under "ms")
UNITS = {"Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
         "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}
SAMPLES = "Warp Stall Sampling (All Samples)"


def export(report: Path):
    """The report's raw metrics, details and per-instruction (SASS) pages as gzipped CSV/text,
    and their summary (``summarize``) as JSON beside them."""
    pages = {}
    for suffix, opts in PAGES.items():
        out = subprocess.run(["ncu", "--import", str(report), *opts], capture_output=True, text=True)
        pages[suffix] = out.stdout
        path = report.with_name(report.stem + "_" + suffix + ".gz")
        with gzip.open(path, "wt") as f:
            f.write(out.stdout)
        print(f"{path.name}: {len(out.stdout)} chars, rc {out.returncode} {out.stderr[-500:]}", flush=True)
    path = report.with_name(report.stem + ".json")
    path.write_text(json.dumps({**run_info(), "kernels": summarize(pages["raw.csv"], pages["source.csv"])}, indent=1))
    print(f"wrote {path}")


def summarize(raw_csv: str, source_csv: str, top: int = 8) -> list[dict]:
    """One entry per profiled kernel, in launch order: ``METRICS``, the share of the SMs' elapsed
    cycles they were active (a part-empty last wave shows here), and from the warp-state samples
    the share of each stall reason and the ``top`` instructions by samples."""
    raw = list(csv.reader(io.StringIO(raw_csv)))
    units = dict(zip(raw[0], raw[1]))
    kernels = []
    for row in raw[2:]:   # (a header row, a units row)
        m = dict(zip(raw[0], row))
        num = lambda k: float(m[k].replace(",", "")) * UNITS.get(units.get(k, ""), 1)  # noqa: E731
        kernels.append({"name": m["Kernel Name"], **{k: num(v) for k, v in METRICS.items()},
                        "sm_active_pct": 100 * num("sm__cycles_active.avg") / num("sm__cycles_elapsed.avg")})
    sections, header = [], None
    for row in csv.reader(io.StringIO(source_csv)):
        if row[:1] == ["Kernel Name"]:
            sections.append([])
        elif row[:1] == ["Address"]:
            header = row
        elif sections and header and len(row) == len(header):
            sections[-1].append(dict(zip(header, row)))
    for kernel, insts in zip(kernels, sections):
        count = lambda i, k: float(i[k]) if i[k] not in ("", "-") else 0.0  # noqa: E731
        total = sum(count(i, SAMPLES) for i in insts) or 1.0
        reasons = [k for k in insts[0] if k.startswith("stall_") and "Not Issued" not in k] if insts else []
        shares = {r[6:]: round(100 * sum(count(i, r) for i in insts) / total, 1) for r in reasons}
        kernel["stall_pct"] = {r: v for r, v in sorted(shares.items(), key=lambda x: -x[1]) if v >= 0.5}
        kernel["top_instructions"] = [
            {"index": j, "sass": i["Source"].strip(), "samples_pct": round(100 * count(i, SAMPLES) / total, 1),
             "executed": int(count(i, "Instructions Executed")),
             "reasons": {r[6:]: int(count(i, r)) for r in reasons if count(i, r) >= 0.1 * count(i, SAMPLES) > 0}}
            for j, i in sorted(enumerate(insts), key=lambda x: -count(x[1], SAMPLES))[:top]]
    return kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--export", type=Path, help="write the CSV pages of this ncu report and their summary, then exit")
    ap.add_argument("--summarize", type=Path, nargs=2, metavar=("RAW_CSV_GZ", "SOURCE_CSV_GZ"),
                    help="print the summary of exported pages as JSON, then exit")
    args = ap.parse_args()
    if args.export:
        export(args.export)
        return
    if args.summarize:
        print(json.dumps(summarize(*(gzip.open(p, "rt").read() for p in args.summarize)), indent=1))
        return
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        sys.exit(f"unknown case(s) {sorted(unknown)}; known: {', '.join(CASES)}")
    if args.smoke:
        os.environ["MEGAJAX_KERNELS"] = "interpret"   # (mega.moe's configs are picked for its kernels only)
        from jax._src.pallas.mosaic_gpu.interpret import params as ip
        ip.set_gpu_interpret_mode(ip.InterpretGPUParams())
    print(run_info(), flush=True)
    run(cases, args.smoke)


if __name__ == "__main__":
    main()
