"""What a whole-model program costs to build at Flash widths, by depth and XLA flags: seconds to
trace, to lower (Pallas kernels included) and to compile the forward of one DP64/EP64 rank
(``flash_rank.rank_config``: 6 MXFP4 experts a layer, bf16 elsewhere) for a decode-sized step.

Why: at 40 layers the engine's first program did not compile within a device call (RESULTS,
"The seed's decode benchmark at Flash depth"). This separates Python's share (tracing, lowering)
from XLA's, and asks what XLA's autotuning adds. Shapes
only (no weights): each variant is a child process with its own ``XLA_FLAGS`` and a time limit.

    python3 bench/compile_gpu.py                       # GPU: $OUT/compile_gpu.json
    python3 bench/compile_gpu.py --smoke               # CPU: toy widths
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import run_info, write  # noqa: E402

FLAGS = {"default": "", "no-autotune": "--xla_gpu_autotune_level=0"}   # (JAX 0.11's XLA has no parallel-LLVM flag)


def child(depth: int, tokens: int, smoke: bool) -> dict:
    """Build the program once; its stage seconds, module size and custom calls by target."""
    import re
    from collections import Counter

    import jax
    import jax.numpy as jnp

    from flash_rank import rank_config
    from model.batch import Batch
    from model.forward import forward_jit
    from model.params import abstract_params, cast_params, with_quantized_experts
    from model.state import init_state

    cfg = rank_config(6, 64, depth=depth, smoke=smoke)
    params = jax.eval_shape(lambda p: cast_params(with_quantized_experts(p, "mxfp4"), jnp.bfloat16),
                            abstract_params(cfg, jnp.float32))
    state = jax.eval_shape(lambda: init_state(cfg, 64, 8192, dtype=jnp.bfloat16))
    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    t0 = time.perf_counter()
    engram_map = jax.ShapeDtypeStruct((cfg.vocab_size,), jnp.int32)
    traced = forward_jit.trace(params, cfg, state, Batch(ids, ids, ids), engram_map)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    text = lowered.as_text()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "module_mb": len(text) / 1e6,
            "custom_calls": dict(Counter(re.findall(r"custom_call @([A-Za-z_0-9$.]+)", text)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="8:no-autotune,40:no-autotune,40:default",
                    help=f"depth:flags pairs, flags one of {list(FLAGS)}")
    ap.add_argument("--tokens", type=int, default=256, help="the step's rows (64 requests x 4)")
    ap.add_argument("--limit", type=int, default=240, help="seconds a variant may take")
    ap.add_argument("--smoke", action="store_true", help="toy widths (CPU)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.tokens, args.smoke)), flush=True)
        return
    rows = []
    for variant in args.variants.split(","):
        depth, name = variant.split(":")
        depth = int(depth)
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAGS[name]}".strip(),
               "MEGAJAX_KERNELS": "reference" if args.smoke else "pallas"}
        cmd = [sys.executable, __file__, "--child", str(depth), "--tokens", str(args.tokens)] + ["--smoke"] * args.smoke
        row = {"depth": depth, "flags": name, "xla_flags": env["XLA_FLAGS"], "tokens": args.tokens}
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.limit)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            row.update(json.loads(lines[-1]) if lines else {"error": done.stderr[-2000:]})
        except subprocess.TimeoutExpired:
            row["error"] = f"not built within {args.limit} s"
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        write("compile_gpu", {**run_info(), "rows": rows,
                              "conditions": "forward_jit of one DP64/EP64 rank (6 MXFP4 experts a layer), abstract "
                                            "bf16 params, 64 slots x 8K, one step of --tokens rows; a child process "
                                            "a variant, cold (no compile cache)"})


if __name__ == "__main__":
    main()
