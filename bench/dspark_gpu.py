"""DSpark decode steps on the GPU: the engine with and without speculative decoding.

Model: ``bench/engine_gpu.py``'s V4.1-Flash-width slice (4 layers, 16 routed experts) with its
DSpark draft (one draft layer at these widths, 16 experts, top-3), random bf16 weights,
written as a checkpoint and loaded through ``Engine.from_model_dir`` as ``python -m serve
--model DIR --speculative-algorithm DSPARK`` loads it, once per mode (a process of its own, its slots
the largest batch size; each size compiles its own decode programs). Per batch size B: B prompts of 128
tokens, greedy, ``ignore_eos``; a 1-token pass (the prefill) and a 49-token pass, each run
once to compile and then timed, then once more under the profiler; a step's time is (decode pass -
prefill pass) / its steps, and ``step_breakdown`` the same difference of the traced passes: host
time, waits and GPU time by kernel, per step.

* ``plain``: one token a request a step;
* ``dspark``: 3 drafts a step, fixed verification of the whole block, and the seed's accept
  length of 3.25 tokens a step simulated (random weights accept almost nothing), so the
  timed steps are what a trained draft's would be: a verify of 4 rows a request plus the draft;
  the draft alone is timed too (``time_draft``), for its share of the step and its roofline;
* ``dspark_sync``: the same with ``--disable-overlap-schedule``: under overlap a speculative
  request waits out the step in flight (its next drafts come from that step), so it verifies
  every other step; without overlap, every step.

Roofline beside each: the step's weight bytes (the checkpoint's size, read once a step) at
the device's bandwidth; the decode of this slice is bound by them.

    PYTHONUNBUFFERED=1 python3 bench/dspark_gpu.py                     # H200: $OUT/dspark_gpu.json
    python3 bench/dspark_gpu.py --smoke                                 # CPU: toy widths
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
from engine_gpu import config, decode_step  # noqa: E402
from flash_rank import timed_passes  # noqa: E402
from gpu_common import ceilings, run_info, write  # noqa: E402

CKPT = Path(os.environ.get("MEGAJAX_BENCH_CKPT", "/tmp/megajax_dspark_gpu"))
NEW_TOKENS = 49


def write_checkpoint(smoke: bool) -> int:
    """Writes the checkpoint unless an earlier run on this machine did; its size in bytes."""
    import jax.numpy as jnp

    from checkpoints.export import save_checkpoint
    from checkpoints.formats import BF16
    from checkpoints.init import init_params

    cfg = config(smoke)
    written = sorted(CKPT.glob("*.safetensors"))
    if (CKPT / "config.json").exists() and written and {k: v for k, v in json.loads((CKPT / "config.json").read_text()).items()
                                                     if k in cfg.to_dict()} == json.loads(json.dumps(cfg.to_dict())):
        return sum(f.stat().st_size for f in written)
    files = save_checkpoint(init_params(cfg, seed=0, dtype=jnp.bfloat16, draft=True), cfg, CKPT, BF16)
    return sum(f.stat().st_size for f in files)


def run(mode: str, batches: list[int], smoke: bool):
    """One engine of ``max(batches)`` slots (loaded and compiled once for the mode); yields each
    batch size's result."""
    from serve.engine import Engine, EngineConfig

    spec = dict(speculative_algorithm="DSPARK", speculative_num_draft_tokens=3, speculative_fixed_verify=True,
                speculative_accept_length=3.25) if mode.startswith("dspark") else {}
    if mode == "dspark_sync":
        spec["overlap"] = False
    t0 = time.perf_counter()
    engine = Engine.from_model_dir(CKPT, EngineConfig(max_running=max(batches), max_len=256, prefill_budget=4096,
                                                      prefix_cache=False, dtype="bfloat16", **spec))
    init_s = time.perf_counter() - t0
    for batch in batches:
        yield batch, {"init_s": init_s, "max_running": max(batches), **measure(engine, mode, batch, spec, smoke)}


def measure(engine, mode: str, batch: int, spec: dict, smoke: bool) -> dict:
    import numpy as np

    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, 129000, size=8 if smoke else 128).tolist() for _ in range(batch)]
    greedy = {"temperature": 0, "ignore_eos": True}
    passes, traced = timed_passes(engine, lambda: prompts, {"prefill": {**greedy, "max_new_tokens": 1},
                                                           "decode": {**greedy, "max_new_tokens": NEW_TOKENS}})
    out = {"kernel_paths": engine.kernel_paths, **passes}
    out["step_breakdown"] = decode_step(traced["prefill"], traced["decode"])
    pre, dec = out["prefill"], out["decode"]
    steps = dec["steps"] - pre["steps"]
    out["step_ms"] = (dec["s"] - pre["s"]) / steps * 1e3
    out["decode_tokens_per_s"] = (dec["tokens"] - pre["tokens"]) / (dec["s"] - pre["s"])
    out["accept_length"] = dec["accepted"] / max(dec["verifies"], 1)
    if mode == "dspark":
        out["draft"] = time_draft(engine, batch, spec["speculative_num_draft_tokens"])
        out["draft_share"] = out["draft"]["ms"] / out["step_ms"]
    return out


def time_draft(engine, batch: int, num_drafts: int, reps: int = 20) -> dict:
    """The draft alone (``model.dspark.propose``: its layers over the block, then the slot heads
    one by one, greedy) on a fresh state of the engine's shape, anchored past a 128-token context."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from model.dspark import propose
    from model.state import init_state, state_dtype

    m = engine.model
    state = init_state(m.cfg, batch, 256, 64, state_dtype(m.params), spec_tokens=num_drafts)
    state = state.replace(seq_lens=jnp.full((batch,), 128, jnp.int32))
    anchors = jnp.asarray(np.random.default_rng(1).integers(3, 129000, size=batch), jnp.int32)
    pos, slots = jnp.full((batch,), 128, jnp.int32), jnp.arange(batch, dtype=jnp.int32)
    step = jax.jit(lambda p, st, a: propose(p, m.cfg, st, a, pos, slots, num_drafts,
                                            lambda i, logits: jnp.argmax(logits, -1).astype(jnp.int32)).drafts)
    step(m.params, state, anchors).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        drafts = step(m.params, state, anchors)
    drafts.block_until_ready()
    ms = (time.perf_counter() - t0) / reps * 1e3
    leaves = jax.tree.leaves({"mtp": m.params["mtp"], "lm_head": m.params["lm_head"]})
    # its roofline reads the draft's weights once and the shared LM head once a slot
    head = m.params["lm_head"].size * m.params["lm_head"].dtype.itemsize
    weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves) + (num_drafts - 1) * head
    return {"ms": ms, "weight_bytes": weight_bytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batches", default="8,32,128,256")
    ap.add_argument("--modes", default="plain,dspark")
    ap.add_argument("--child", help=argparse.SUPPRESS)   # a mode: its runs in this process
    ap.add_argument("--timeout", type=int, default=480, help="seconds per mode (all its batch sizes)")
    ap.add_argument("--name", default="dspark_gpu", help="JSON file name under $OUT")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        for b, got in run(args.child, batches, args.smoke):
            print("RESULT " + json.dumps({"batch": b, **got}), flush=True)
        return
    os.environ.setdefault("MEGAJAX_KERNELS", "reference" if args.smoke else "pallas")
    child_env = dict(os.environ)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"   # this process's arrays must leave the GPU to the runs
    size = write_checkpoint(args.smoke)
    ceil = ceilings(args.smoke)
    payload = {**run_info(), "ceilings": ceil, "checkpoint_bytes": size, "new_tokens": NEW_TOKENS,
               "prompt_tokens": 128, "roofline_step_ms": size / (ceil["bandwidth_GBps"] * 1e9) * 1e3, "runs": {}}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode, "--batches", args.batches] + ["--smoke"] * args.smoke
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=child_env)
            stdout, failed = p.stdout, p.returncode and p.stderr[-2000:]
        except subprocess.TimeoutExpired as e:
            stdout, failed = (e.stdout or b"").decode(), f"timed out after {args.timeout} s"
        done = [json.loads(x[len("RESULT "):]) for x in stdout.splitlines() if x.startswith("RESULT ")]
        for got in done:
            payload["runs"][f"{mode}_{got['batch']}"] = got
            print(mode, got["batch"], {k: got.get(k) for k in ("step_ms", "decode_tokens_per_s", "accept_length")},
                  flush=True)
        if failed:
            payload["runs"][f"{mode}_error"] = failed
            print(mode, "FAILED after", [g["batch"] for g in done], failed[-1500:], flush=True)
        write(args.name, payload)


if __name__ == "__main__":
    main()
