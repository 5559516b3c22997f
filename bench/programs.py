"""What each compiled program costs, and the process's peak through warm-up and a workload
that walks every bucket: ``python bench/programs.py [--out FILE]`` (CPU or GPU).

It builds the engine as ``python -m serve`` does (embedded default model, default
``EngineConfig``) and warms it up one step at a time, recording per step the programs it
compiled, the mappings, RSS and seconds they added (steps that evicted are marked: their
deltas are net). The same prefill buckets as one whole-forward program (decoder replay off)
show what every program cost before replay was split into trunk and tail. Then a workload:
every prompt length bucket up to the context length, batch sizes 1 to max-running, with
the peak mappings (sampled by a thread) and peak RSS.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024


def measure_steps(engine, steps) -> list[dict]:
    import numpy as np

    from serve.programs import process_maps, process_rss

    rows, cache = [], engine.runner.programs
    for t, r in steps:
        c0, e0, m0, rss0, t0 = cache.compiles, cache.evictions, process_maps(), process_rss(), time.perf_counter()
        engine.runner.step(engine.runner.empty_input(t), r)
        np.asarray(engine.runner.state.last_token)
        rows.append({"tokens": t, "replay_rows": r, "programs": engine.buckets.programs_of(t, r),
                     "compiled": cache.compiles - c0, "evicted": cache.evictions - e0,
                     "maps": (process_maps() or 0) - (m0 or 0), "rss_mb": round((process_rss() - rss0) / 2**20, 1),
                     "s": round(time.perf_counter() - t0, 2)})
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plain-prefill", type=int, nargs="*", default=[16, 512, 2048],
                    help="prefill buckets to also compile as one whole-forward program (replay off)")
    args = ap.parse_args()

    import jax

    from provenance import commit
    from serve.default_model import SMALL_DIR
    from serve.engine import Engine, EngineConfig
    from serve.loaded_model import LoadedModel
    from serve.programs import PeakMaps, process_maps, shared_programs

    peak = PeakMaps(every=0.05)
    t0 = time.perf_counter()
    model = LoadedModel.from_model_dir(SMALL_DIR)   # the embedded default, as `python -m serve` loads it
    cfg, params = model.cfg, model.params
    engine = Engine(params, cfg, EngineConfig())  # as `python -m serve`
    built_s = time.perf_counter() - t0
    warm = measure_steps(engine, engine.warmup_steps())
    warm_s = time.perf_counter() - t0
    after_warmup = {"maps": process_maps(), "peak_maps": peak.peak, "peak_rss_mb": round(_hwm_mb())}

    rng = __import__("numpy").random.default_rng(0)
    c = engine.config
    lengths = [n for n in (1, 5, 12, 20, 40, 70, 130, 260, 520, 1030, 1540, 2050, 3000, c.max_len - 17)]
    t1 = time.perf_counter()
    for n in lengths:  # every prefill bucket, chunked past the step budget
        engine.generate([rng.integers(3, cfg.vocab_size, n).tolist()], {"max_new_tokens": 8}, decode_text=False)
    for b in range(1, c.max_running + 1):  # every decode bucket
        engine.generate([rng.integers(3, cfg.vocab_size, 9).tolist() for _ in range(b)],
                        {"max_new_tokens": 4, "temperature": 0.7}, decode_text=False)
    workload = {"s": round(time.perf_counter() - t1, 1), "prompt_lengths": lengths,
                "batch_sizes": list(range(1, c.max_running + 1)), "peak_maps": peak.peak,
                "peak_rss_mb": round(_hwm_mb()), "programs": engine.program_info()}

    shared_programs().clear()  # the programs before the split: a whole forward per prefill bucket
    plain = Engine(params, cfg, EngineConfig(decoder_replay="off", max_programs=8))
    before = measure_steps(plain, [(t, None) for t in args.plain_prefill if t in plain.buckets.prefill])
    peak.stop()
    result = {"bench": "programs", "commit": commit(), "device": str(jax.devices()[0].device_kind),
              "platform": platform.platform(), "jax": jax.__version__,
              "model": "embedded default (serve.default_model.SMALL_DIR)", "engine_config": {**c.__dict__,
                                                                                   "step_tokens": c.step_tokens},
              "buckets": engine.buckets.__dict__, "bucket_programs": len(engine.buckets.programs()),
              "engine_built_s": round(built_s, 1), "warmup_s": round(warm_s, 1), "warmup_steps": warm,
              "after_warmup": after_warmup, "workload": workload, "whole_forward_prefill": before}
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: result[k] for k in ("warmup_s", "after_warmup", "bucket_programs")}))
    print(json.dumps(workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
