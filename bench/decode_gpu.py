"""The seed's decode benchmark on one GPU: one rank of DP64/EP64 at V4.1-Flash depth.

Model (``bench/flash_rank.py``): all 40 layers at Flash widths, 6 routed experts a layer (384 over
64 ranks), the DSpark draft (3 layers, 3 of its 128 experts a rank, top-3), the rank's share of
the Engram rows; random weights in the release's format, loaded by ``Engine.from_model_dir``.
The engine is the served one (``python -m serve --model DIR --enable-balanced-routing
--speculative-algorithm DSPARK --speculative-num-draft-tokens 3`` plus the benchmark's fixed
verification with the seed's simulated accept length of 3.25), one process per Engram
placement (``device``: the rank's table rows in GPU memory; ``host``: in pinned host memory).
Decoder replay is off: it changes only the prefill pass the step is measured against, and its
two programs a prefill shape cost compile time.

Before the workload, ``Engine.warmup`` compiles the programs it runs first several at a time.
Workload: a shared prefix of ``--context`` tokens (128K) prefilled once through the engine, so it
sits in the radix cache as any served prefix would (its prefill time is reported), then per
batch size B (8 to 256): B requests of the prefix plus 8 tokens of their own, greedy,
``ignore_eos``. A 1-token pass (the prefix hit and its window replay) and a 49-token pass
(``flash_rank.timed_passes``: compiled, timed, traced); a decode step is their difference over
the extra steps (``step_ms``), tokens/s per GPU the extra tokens over that time, and
``step_breakdown`` the same difference of the traced passes (host work, device wait, kernels).

Beside each step: its roofline (``flash_rank.step_cost`` at the measured ceilings: weights once,
each request's window, selected entries and scored indexer keys over its context) and the KV
capacity left (device memory free after the weights and pools, in tokens of KV).

    PYTHONUNBUFFERED=1 python3 bench/decode_gpu.py                  # GPU: $OUT/decode_gpu.json
    python3 bench/decode_gpu.py --smoke                             # CPU: toy widths, 8 layers
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import decode_step  # noqa: E402
from flash_rank import StepShape, bench_main, capacity, rank_config, step_cost, timed_passes  # noqa: E402

CKPT = Path(os.environ.get("MEGAJAX_BENCH_CKPT", "/tmp/megajax_decode_gpu"))
RANKS, LOCAL_EXPERTS = 64, 6
DRAFTS, ACCEPT, NEW_TOKENS, OWN_TOKENS = 3, 3.25, 49, 8


def config(args):
    return rank_config(LOCAL_EXPERTS, RANKS, depth=args.depth, smoke=args.smoke)


def run(args, placement: str):
    """One engine (its Engram rows on ``placement``): the prefix, then each batch size's step."""
    import numpy as np

    from serve.engine import Engine, EngineConfig

    batches = [int(b) for b in args.batches.split(",")]
    page = 16 if args.smoke else 64
    per_request = -(-(OWN_TOKENS + NEW_TOKENS + 2 * DRAFTS + 2) // page) + 1
    t0 = time.perf_counter()
    engine = Engine.from_model_dir(CKPT, EngineConfig(
        max_running=max(batches), max_len=args.context + 256, page_size=page,
        num_pages=args.context // page + max(batches) * per_request + 16,
        prefill_budget=max(256, 2 * max(batches)) if args.smoke else 8192,   # (it must exceed max_running)
        dtype="bfloat16", balanced_routing=True, decoder_replay="off", speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=DRAFTS, speculative_fixed_verify=True, speculative_accept_length=ACCEPT,
        engram_placement=placement))
    init_s = time.perf_counter() - t0
    # the steps the workload runs, compiled side by side (a Flash-depth program takes ~100 s): each
    # batch's decode step and its requests' own tokens, the prefix's prefill chunk, full chunks of the budget
    t0 = time.perf_counter()
    budget = engine.config.step_tokens
    engine.warmup(workload=[(b * (1 + DRAFTS), False) for b in batches] + [(min(b * OWN_TOKENS, budget), True)
                                                                        for b in batches]
                  + [(min(args.context, budget), True), (budget, True)])
    yield "setup", {"init_s": init_s, "warmup_s": time.perf_counter() - t0, "kernel_paths": engine.kernel_paths,
                    "capacity": capacity(engine)}
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 129000, size=args.context).tolist()
    greedy = {"temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    engine.generate([prefix], {**greedy, "max_new_tokens": 1}, decode_text=False)
    yield "prefix", {"tokens": args.context, "s": time.perf_counter() - t0,
                     "compiles_s": list(engine.runner.programs.compile_log)}
    for batch in batches:
        def prompts():
            return [prefix + rng.integers(3, 129000, size=OWN_TOKENS).tolist() for _ in range(batch)]

        out, traced = timed_passes(engine, prompts, {"prefill": {**greedy, "max_new_tokens": 1},
                                                     "decode": {**greedy, "max_new_tokens": NEW_TOKENS}})
        pre, dec = out["prefill"], out["decode"]
        shape = StepShape(batch, 1 + DRAFTS, args.context + OWN_TOKENS + NEW_TOKENS // 2, DRAFTS)
        yield batch, {**out, "step_ms": (dec["s"] - pre["s"]) / (dec["steps"] - pre["steps"]) * 1e3,
                      "tokens_per_s": (dec["tokens"] - pre["tokens"]) / (dec["s"] - pre["s"]),
                      "accept_length": dec["accepted"] / max(dec["verifies"], 1),
                      "step_breakdown": decode_step(traced["prefill"], traced["decode"]),
                      "cost": step_cost(engine.model.cfg, engine.model.params, engine.runner.state.model, shape),
                      "programs": {**engine.runner.programs.info(),
                                     "compiles_s": list(engine.runner.programs.compile_log)}}


if __name__ == "__main__":
    bench_main(__file__, "decode_gpu", "device,host", config, CKPT, run,
               [("--batches", {"default": "8,32,128,256", "help": "requests a step"})])
