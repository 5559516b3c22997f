"""Engine throughput and host overhead on the tiny fixture model (CPU), overlap on and off.

For each mode the same workload runs twice (the first pass compiles); the second is timed.
Per step we record the dispatch time and, from a watcher thread, when the device finished
the step, so the device's idle time between steps is measured, not inferred:
``idle(N) = max(0, dispatch(N+1) - done(N))``. Host time per step is the engine's own
planning + padding + output-processing time (``StepStats.host_s``).

    python bench/engine_cpu.py [--out bench/results/engine_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoints.hf import load_params  # noqa: E402
from provenance import commit  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402

TINY = ROOT.parent / "shared" / "golden" / "v41_tiny"


def workload(seed: int = 0, n: int = 24):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 512, size=int(rng.integers(8, 90))).tolist(),
             {"max_new_tokens": int(rng.integers(8, 33)), "temperature": 0.8, "seed": i, "ignore_eos": True})
            for i in range(n)]


def run(params, cfg, overlap: bool, replay: str):
    engine = Engine(params, cfg, EngineConfig(max_running=8, max_len=160, page_size=16, prefill_budget=128,
                                              decoder_replay=replay, overlap=overlap, prefix_cache=True))
    jobs = workload()
    engine.generate([p for p, _ in jobs], [s for _, s in jobs], decode_text=False)  # compile pass
    engine = Engine(params, cfg, EngineConfig(max_running=8, max_len=160, page_size=16, prefill_budget=128,
                                              decoder_replay=replay, overlap=overlap, prefix_cache=True))
    dispatched, done = [], {}
    real_step = engine.runner.step

    def timed_step(inp, rows):
        out = real_step(inp, rows)
        k = len(dispatched)
        dispatched.append(time.perf_counter())
        threading.Thread(target=lambda: (jax.block_until_ready(out), done.__setitem__(k, time.perf_counter())),
                         daemon=True).start()
        return out

    engine.runner.step = timed_step
    t0 = time.perf_counter()
    res = engine.generate([p for p, _ in jobs], [s for _, s in jobs], decode_text=False)
    wall = time.perf_counter() - t0
    time.sleep(0.2)
    gaps = [max(0.0, dispatched[k + 1] - done[k]) for k in range(len(dispatched) - 1) if k in done]
    out_tokens = sum(len(r["output_ids"]) for r in res)
    st = engine.stats
    return {"overlap": overlap, "decoder_replay": replay, "wall_s": wall, "steps": st.steps,
            "output_tokens": out_tokens, "output_tok_per_s": out_tokens / wall,
            "all_tok_per_s": st.tokens / wall, "host_ms_per_step": 1e3 * st.host_s / st.steps,
            "wait_ms_per_step": 1e3 * st.wait_s / st.steps,
            "device_idle_ms_per_step": 1e3 * float(np.mean(gaps)), "outputs": [r["output_ids"] for r in res]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine_cpu.json")
    args = ap.parse_args()
    cfg = ModelConfig.from_json(TINY)
    params = load_params(TINY, cfg)
    rows = [run(params, cfg, overlap, "approx") for overlap in (False, True)]
    same = rows[0].pop("outputs") == rows[1].pop("outputs")
    result = {"commit": commit(), "device": f"CPU ({platform.processor() or platform.machine()}), jax {jax.__version__}",
              "model": "v41_tiny (fixture)", "workload": "24 requests, prompts 8-90 tokens, 8-32 new tokens, "
                                                         "max_running 8, prefill budget 128",
              "outputs_identical": same, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
