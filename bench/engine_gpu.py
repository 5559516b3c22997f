"""The serving engine on the GPU: with the Pallas kernels against the same engine on the XLA path.

Model: V4.1-Flash widths (hidden 5120, 64 heads x 512, q_lora 1280, o_lora 1024 in 8 groups,
window 128, indexer 32 x 128 with top-512, experts 2304 wide, top-6, one shared expert) at
four layers (ratios 0, 2, 1, 1: a ratio-2 and a ratio-1 KV source, three index sources,
Engram on layer 1) and 16 routed experts instead of 384 so that one GPU holds it; random
weights, bf16. Modes, each in its own process (the kernel choice is made when a step is traced):

* ``reference``: ``MEGAJAX_KERNELS=reference``, every mega operator on its XLA reference;
* ``pallas``: ``MEGAJAX_KERNELS=pallas``, MegaAttention and MegaMoE on their kernels;
* ``pallas_fp8``: the same with ``kv_cache_dtype="fp8_e4m3"`` (the window ring stored in FP8);
* ``fp32``: the reference with the same weights in fp32: the ground truth of the checks.

Per mode: ``check``, greedy decoding of 4 prompts (350-650 tokens, 16 new tokens) with the
chosen tokens' log-probs (compared with ``fp32`` and with ``reference``: tokens equal up to the
first difference, and the log-prob gap over that common prefix, whose first entry, the
prefill's, does not depend on earlier tokens); ``prefill``, 8 prompts x 512 tokens with one
new token; ``decode``, 32 prompts x 128 tokens with 32 new tokens. Each workload runs once to
compile its buckets, then is timed (wall clock of ``Engine.generate``; the decode workload's
figure includes its prefill, so the per-token decode time is its time minus that of the
same workload with one new token, which is timed too).

    PYTHONUNBUFFERED=1 python3 bench/engine_gpu.py        # on the H200, writes $OUT/engine_gpu.json
    python3 bench/engine_gpu.py --smoke                   # CPU: toy widths, references only
    python3 bench/engine_gpu.py --modes pallas --profile  # + where the device time goes

``--profile`` runs the check workload once more under ``jax.profiler`` and sums the device
time of its kernels by the scope of the op they run (the mega operators, the indexer, the
compressor and the LM head carry ``jax.named_scope`` labels; the rest is "other").
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, run_info, write  # noqa: E402

MODES = ("reference", "pallas", "pallas_fp8", "fp32")


def config(smoke: bool):
    from model.config import ModelConfig

    wide = dict(hidden_size=5120, num_attention_heads=64, head_dim=512, q_lora_rank=1280, qk_rope_head_dim=64,
                sliding_window=128, index_n_heads=32, index_head_dim=128, index_topk=512, o_groups=8,
                o_lora_rank=1024, moe_intermediate_size=2304, num_experts_per_tok=6)
    toy = dict(hidden_size=256, num_attention_heads=4, head_dim=64, q_lora_rank=64, qk_rope_head_dim=16,
               sliding_window=8, index_n_heads=2, index_head_dim=32, index_topk=16, o_groups=2,
               o_lora_rank=64, moe_intermediate_size=64, num_experts_per_tok=2)
    return ModelConfig.from_dict({
        **(toy if smoke else wide), "vocab_size": 129280, "num_hidden_layers": 4, "compress_ratios": [0, 2, 1, 1],
        "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2, 3], "candidate_source_layer_id": 2,
        "candidate_topk_blocks": 64, "n_routed_experts": 16, "num_nextn_predict_layers": 1,
        "dspark_n_routed_experts": 16, "engram_layer_ids": [1], "engram_vocab_size": 50,
        "engram_num_embeddings": [240], "engram_max_ngram_size": 3, "engram_n_heads": 2,
        "engram_head_dim": 32 if smoke else 256})


def workloads(smoke: bool):
    import numpy as np

    rng = np.random.default_rng(0)
    scale = 16 if smoke else 1

    def prompts(n, length):
        return [rng.integers(3, 129000, size=length // scale).tolist() for _ in range(n)]
    # prefill steps of at most 2K and 4K tokens and decode steps of 4 and 32 rows: few shapes to compile
    check = [rng.integers(3, 129000, size=n // scale).tolist() for n in (350, 450, 550, 650)]
    decode = prompts(32, 128)
    return {"check": (check, 16), "prefill": (prompts(8, 512), 1), "decode": (decode, 32),
            "decode_prefill_only": (decode, 1)}


def run_mode(mode: str, smoke: bool, profiled: bool = False) -> dict:
    """One mode's checks and timings (call in a fresh process: the mode is fixed at trace time)."""
    # (the smoke run on CPU exercises the script only: references everywhere)
    os.environ["MEGAJAX_KERNELS"] = "pallas" if mode.startswith("pallas") and not smoke else "reference"
    import jax
    import jax.numpy as jnp

    from checkpoints.init import init_params
    from serve.engine import Engine, EngineConfig

    cfg = config(smoke)
    params = init_params(cfg, seed=0, dtype=jnp.float32 if mode == "fp32" else jnp.bfloat16)
    engine_cfg = EngineConfig(max_running=32, max_len=1024 // (16 if smoke else 1) + 128,
                              prefill_budget=4096 // (16 if smoke else 1),
                              kv_cache_dtype="fp8_e4m3" if mode == "pallas_fp8" else "auto")
    engine = Engine(params, cfg, engine_cfg)
    out = {"mode": mode, "kernels": os.environ["MEGAJAX_KERNELS"], "backend": jax.default_backend()}
    for name, (prompts, new) in workloads(smoke).items():
        sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True, "logprobs": name == "check"}
        t0 = time.perf_counter()
        res = engine.generate(prompts, sp, decode_text=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = engine.generate(prompts, sp, decode_text=False)
        out[name] = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "new_tokens": new,
                     "first_s": first, "s": time.perf_counter() - t0}
        if name == "check":
            out[name]["outputs"] = [{"ids": r["output_ids"], "logprobs": r["token_logprobs"]} for r in res]
        out[name]["compiled_shapes"] = engine.runner.compile_count
        print(mode, name, json.dumps({k: v for k, v in out[name].items() if k != "outputs"}), flush=True)
        if profiled and name == "check":
            out["profile"] = profile(engine, prompts, sp)
            print(mode, "profile", json.dumps(out["profile"]), flush=True)
    return out


SCOPES = ("attention", "indexer", "compressor", "mega_attention", "mega_moe", "mega_mhc", "engram", "lm_head")


def profile(engine, prompts, sp) -> dict:
    """Device time of ``engine.generate(prompts, sp)``, summed per scope and per kernel."""
    import jax

    trace_dir = f"/tmp/engine_profile_{os.getpid()}"
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        engine.generate(prompts, sp, decode_text=False)
    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
    by_scope, by_kernel = collections.Counter(), collections.Counter()
    for e in kernels:
        label = " ".join(str(v) for v in e.get("args", {}).values()) + " " + e["name"]
        # the innermost labelled scope (the name stack reads outer/inner/op)
        scope = next((p for p in reversed(re.split(r"[/\s]", label)) if p in SCOPES), "other")
        by_scope[scope] += e["dur"]
        by_kernel[e["name"][:120]] += e["dur"]
    total = sum(by_scope.values())
    return {"kernels": len(kernels), "device_us": total,
            "by_scope_us": dict(by_scope.most_common()), "top_kernels_us": dict(by_kernel.most_common(30)),
            "sample_args": [e.get("args") for e in kernels[:3]]}


def compare(ref: dict, got: dict) -> dict:
    """Tokens equal to the ground truth's up to the first difference; log-prob gaps over that prefix."""
    same, gaps = [], []
    for r, g in zip(ref["check"]["outputs"], got["check"]["outputs"]):
        n = next((i for i, (a, b) in enumerate(zip(r["ids"], g["ids"])) if a != b), len(r["ids"]))
        same.append(n)
        gaps += [abs(a - b) for a, b in zip(r["logprobs"][:n + 1], g["logprobs"][:n + 1])]
    return {"tokens_equal_prefix": same, "of": len(ref["check"]["outputs"][0]["ids"]),
            "max_logprob_gap": max(gaps), "mean_logprob_gap": sum(gaps) / len(gaps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # a child process: run one mode, print its JSON
    ap.add_argument("--timeout", type=int, default=240, help="seconds per mode")
    ap.add_argument("--name", default="engine_gpu", help="JSON file name under $OUT")
    ap.add_argument("--profile", action="store_true", help="per-scope device time of the check workload")
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args.mode, args.smoke, args.profile)))
        return
    results, errors = {}, {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--mode", mode] + ["--smoke"] * args.smoke + ["--profile"] * args.profile
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                errors[mode] = proc.stderr[-3000:]
            else:
                results[mode] = json.loads(lines[-1][len("RESULT "):])
        except subprocess.TimeoutExpired as e:
            errors[mode] = f"timed out after {args.timeout} s; stdout: {(e.stdout or b'')[-2000:]!r}"
        print(mode, "ok" if mode in results else "FAILED: " + errors[mode][-1500:], flush=True)
    payload = {**run_info(), "results": results, "errors": errors}
    for truth in ("fp32", "reference"):
        if truth in results:
            payload[f"vs_{truth}"] = {m: compare(results[truth], r) for m, r in results.items() if m != truth}
    print(json.dumps({k: v for k, v in payload.items() if k.startswith("vs_")}, indent=1))
    print("wrote", write(args.name + "_smoke" * args.smoke, payload))
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
