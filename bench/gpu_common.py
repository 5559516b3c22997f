"""Shared pieces of the GPU benchmarks: run metadata, ceilings, timing, error, JSON output.

Timing method, the same for JAX and PyTorch: enqueue ``inner`` calls back to back, wait for
the device once, divide; repeat ``reps`` times and take the median. Back-to-back calls hide
the host's dispatch behind the device's work, as a serving loop does, and neither side pays a
per-call synchronisation.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    # appended, not prepended: a probe that put another tree's packages first (a branch against
    # main, each in its own process) keeps them (bench/RESULTS.md: a probe's "main" row once ran
    # the branch's kernel)
    sys.path.append(str(ROOT))

from provenance import commit  # noqa: E402  (beside this module on the scripts' path)

try:
    import torch
except ImportError:  # the CPU smoke run has no torch
    torch = None


GPU_STATE = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_state() -> dict | None:
    """The GPU's clocks, power, temperature and throttle reasons now (``nvidia-smi``), or None:
    the same cuBLAS kernel ran 18% slower late in a long call than in a short one, and clocks
    are one suspect."""
    state = {}
    for field in GPU_STATE.split(","):   # one at a time: a field this driver lacks drops alone
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                                 capture_output=True, text=True, check=True, timeout=20).stdout
            state[field] = out.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            continue
    return state or None


def run_info() -> dict:
    dev = jax.devices()[0]
    return {"commit": commit(), "device": getattr(dev, "device_kind", dev.platform),
            "jax_version": jax.__version__,
            "torch_version": getattr(torch, "__version__", None), "gpu_state_start": gpu_state()}


def time_jax(fn, *args, inner: int = 10, reps: int = 5) -> float:
    """Median milliseconds per call of a jitted ``fn``."""
    return time_jax_sets(fn, [args], inner=inner, reps=reps)


def time_jax_sets(fn, arg_sets, inner: int = 10, reps: int = 5) -> float:
    """Like ``time_jax``, cycling through several input sets so repeats do not run from L2."""
    for args in arg_sets:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(inner):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner * 1e3)
    return statistics.median(times)


@functools.cache  # (one compiled program per fn, however often it is timed or traced)
def batched(fn):
    """One jitted dispatch running ``fn`` on each of a list of argument sets, back to back."""
    return jax.jit(lambda sets: [fn(*args) for args in sets])


def time_jax_one_dispatch(fn, arg_sets, inner: int = 10, reps: int = 5) -> float:
    """Median milliseconds per call with every input set run by one jitted call, back to back.

    ``time_jax_sets`` dispatches each call from the host, so a call shorter than one dispatch
    (~0.05 ms) is timed by the host, not the GPU; here one dispatch carries ``len(arg_sets)``
    calls (distinct inputs, so XLA cannot merge them)."""
    many = batched(fn)
    jax.block_until_ready(many(arg_sets))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = many(arg_sets)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / (inner * len(arg_sets)) * 1e3)
    return statistics.median(times)


# the host side of XLA's GPU runtime that decides a step's dispatch cost: running the thunks,
# updating and launching the CUDA graphs (command buffers), and the device-to-host copies
HOST_EVENTS = ("ExecuteThunks", "command_buffer::update", "cuGraphLaunch", "MemcpyD2H", "np.asarray")


def traced_events(run) -> tuple[list[tuple[float, str, float]], dict[str, tuple[int, float]]]:
    """What ``run()`` (which must wait for its results) does, from a profiler trace: ``(start
    µs, kernel name, µs)`` of each GPU kernel it launches, in launch order (empty off the GPU),
    and of the host's events named in ``HOST_EVENTS`` (digits in their names dropped), the
    count and total µs by name."""
    import glob
    import gzip
    import re
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):  # (the form run on the GPU)
            run()
        events = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e["args"]["name"]}
    spans = [e for e in events if e.get("ph") == "X"]
    host: dict[str, tuple[int, float]] = {}
    for e in spans:
        if e["pid"] not in gpu and any(k in e["name"] for k in HOST_EVENTS):
            name = re.sub(r"\d+", "", e["name"]).strip()
            n, us = host.get(name, (0, 0.0))
            host[name] = (n + 1, us + e["dur"])
    return sorted((e["ts"], e["name"], e["dur"]) for e in spans if e["pid"] in gpu), host


def traced_kernels(run) -> list[tuple[float, str, float]]:
    """``traced_events``' GPU kernels alone."""
    return traced_events(run)[0]


def gpu_timeline(run, calls: int) -> dict:
    """GPU time per call of ``run()`` (which makes ``calls`` calls and waits for them), from a
    profiler trace: ``gpu_span_ms``, the first kernel's start to the last one's end (like CUDA
    events around the calls, ``time_torch``: an idle GPU waiting for the host counts), and
    ``gpu_busy_ms``, the kernels' summed time (what a call costs inside a larger step, with
    nothing waiting for the host between calls)."""
    run()
    kernels = traced_kernels(run)
    if not kernels:
        return {}
    span = max(t + d for t, _, d in kernels) - kernels[0][0]
    return {"gpu_span_ms": span / calls / 1e3, "gpu_busy_ms": sum(d for *_, d in kernels) / calls / 1e3}


def gpu_kernels(fn, *args, calls: int = 3) -> list[tuple[str, float]]:
    """``(kernel name, µs)`` of each GPU kernel that one call of ``fn`` runs, in launch order
    (the last of ``calls`` traced calls)."""
    jax.block_until_ready(fn(*args))
    kernels = traced_kernels(lambda: jax.block_until_ready([fn(*args) for _ in range(calls)]))
    if len(kernels) % calls:
        raise ValueError(f"{len(kernels)} kernels in {calls} calls: not one set per call")
    return [(name, dur) for _, name, dur in kernels[len(kernels) - len(kernels) // calls:]]


def time_torch(fn, inner: int = 10, reps: int = 5) -> float:
    """Median milliseconds per call, by CUDA events around ``inner`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def ceilings(smoke: bool = False) -> dict:
    """Measured HBM bandwidth (copy: bytes read + written) and bf16 matmul rate."""
    out = {}
    n = 1 << (20 if smoke else 30)  # 1 Gi bf16 elements: 2 GiB, far beyond L2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    out["jax_copy_GBps"] = 2 * 2 * n / time_jax(copy, x, inner=5, reps=5) / 1e6
    del x
    s = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(1), (s, s), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (s, s), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    out["jax_matmul_TFLOPs"] = 2 * s ** 3 / time_jax(mm, a, b, inner=5, reps=5) / 1e9
    del a, b
    if torch is not None and torch.cuda.is_available():
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        out["torch_copy_GBps"] = 2 * 2 * n / time_torch(lambda: dst.copy_(src), 5, 5) / 1e6
        del src, dst
        p = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        out["torch_matmul_TFLOPs"] = 2 * s ** 3 / time_torch(lambda: p @ q, 5, 5) / 1e9
    out["bandwidth_GBps"] = max(v for k, v in out.items() if k.endswith("GBps"))
    out["matmul_TFLOPs"] = max(v for k, v in out.items() if k.endswith("TFLOPs"))
    return out


def roofline_ms(flops: float, nbytes: float, ceil: dict) -> float:
    return max(flops / ceil["matmul_TFLOPs"] / 1e9, nbytes / ceil["bandwidth_GBps"] / 1e6)


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def out_dir() -> Path:
    """Where results go: ``$OUT`` on the device machine, ``bench_out/`` here."""
    path = Path(os.environ.get("OUT", ROOT / "bench_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write(name: str, payload: dict) -> Path:
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps({**payload, "gpu_state_end": gpu_state()}, indent=1))
    return path
