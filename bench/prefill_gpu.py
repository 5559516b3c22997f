"""The seed's prefill benchmark on one GPU: one rank of DP4/EP4 at V4.1-Flash depth.

Model (``bench/flash_rank.py``): all 40 layers at Flash widths, 96 local + 8 redundant routed
experts a layer in MXFP4 (``--ranks 4``; ``--ranks 8`` halves them where the checkpoint does not
fit the disk: 91 GB at 4 ranks, 52 GB at 8), fp8 linears, the Engram rows of a 64-way split
(the rows a token gathers do not depend on the table's size; its memory does); random weights
in the release's format loaded by ``Engine.from_model_dir`` as ``python -m serve --model DIR
--enable-balanced-routing`` loads them. Variants, one process each: ``replay`` (decoder replay,
the served default), ``no_replay`` (``--decoder-replay off``: the blog's 1.56x is the ratio),
``host`` (replay, the Engram rows in pinned host memory).

Workload: a shared prefix of ``--context`` tokens (128K) prefilled once through the engine (its
steps' tokens/s over a context growing to 128K are reported), so every request carries 128K
tokens of context in the pools; then per step size T (4K to 64K new tokens a step): T / 4K
requests of the prefix plus 4K tokens of their own, one new token each, the chunk budget T, so
that their prefill is one step (after the prefix hit's window replay). Each pass compiled,
timed and traced (``flash_rank.timed_passes``); tokens/s per GPU is T over the pass, and its
roofline (``flash_rank.step_cost``: weights once, each request's window, pool and indexer keys,
the linears', attention's and indexer's FLOPs) is beside it.

    PYTHONUNBUFFERED=1 python3 bench/prefill_gpu.py --ranks 8      # GPU: $OUT/prefill_gpu.json
    python3 bench/prefill_gpu.py --smoke                            # CPU: toy widths, 8 layers
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import top_kernels  # noqa: E402
from flash_rank import StepShape, bench_main, capacity, rank_config, step_cost, timed_passes  # noqa: E402

CKPT = Path(os.environ.get("MEGAJAX_BENCH_CKPT", "/tmp/megajax_prefill_gpu"))
OWN_TOKENS, REDUNDANT = 4096, 32   # new tokens a request; redundant experts over the whole mesh
VARIANTS = {"replay": ("approx", "device"), "no_replay": ("off", "device"), "host": ("approx", "host")}


def config(args):
    local = 384 // args.ranks + REDUNDANT // args.ranks
    return rank_config(local, 64, depth=args.depth, smoke=args.smoke)


def run(args, variant: str):
    """One engine: the prefix, then each step size's prefill."""
    import numpy as np

    from serve.engine import Engine, EngineConfig

    own = 32 if args.smoke else OWN_TOKENS
    sizes = [int(t) for t in args.step_tokens.split(",")] if not args.smoke else [own, 2 * own]
    page = 16 if args.smoke else 64
    replay, placement = VARIANTS[variant]
    requests = max(sizes) // own
    t0 = time.perf_counter()
    engine = Engine.from_model_dir(CKPT, EngineConfig(
        max_running=requests, max_len=args.context + own + 64, page_size=page,
        num_pages=(args.context + requests * (own + 2 * page)) // page + 16, prefill_budget=max(sizes),
        dtype="bfloat16", balanced_routing=True, decoder_replay=replay, engram_placement=placement))
    init_s, t0 = time.perf_counter() - t0, time.perf_counter()
    engine.warmup(workload=[(t, True) for t in sizes])   # the sizes timed, compiled side by side (~100 s each at depth 40)
    yield "setup", {"init_s": init_s, "warmup_s": time.perf_counter() - t0, "kernel_paths": engine.kernel_paths,
                    "capacity": capacity(engine)}
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 129000, size=args.context).tolist()
    one = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1}
    steps0, t0 = engine.stats.steps, time.perf_counter()
    engine.generate([prefix], one, decode_text=False)
    yield "prefix", {"tokens": args.context, "s": time.perf_counter() - t0,
                     "compiles_s": list(engine.runner.programs.compile_log), "steps": engine.stats.steps - steps0}
    for tokens in sizes:
        def prompts():
            return [prefix + rng.integers(3, 129000, size=own).tolist() for _ in range(tokens // own)]

        out, traced = timed_passes(engine, prompts, {"prefill": one})
        shape = StepShape(tokens // own, own, args.context + own // 2)
        yield tokens, {**out["prefill"], "step_ms": out["prefill"]["s"] * 1e3,
                       "tokens_per_s": tokens / out["prefill"]["s"], "kernels": top_kernels(traced["prefill"]),
                       "host_ms": traced["prefill"]["host_s"] * 1e3,
                       "cost": step_cost(engine.model.cfg, engine.model.params, engine.runner.state.model, shape),
                       "programs": {**engine.runner.programs.info(),
                                     "compiles_s": list(engine.runner.programs.compile_log)}}


if __name__ == "__main__":
    bench_main(__file__, "prefill_gpu", ",".join(VARIANTS), config, CKPT, run,
               [("--ranks", {"type": int, "default": 4, "help": "the EP group the routed experts are spread over"}),
                ("--step-tokens", {"default": "4096,8192,16384,32768,65536", "help": "new tokens a step"})])
