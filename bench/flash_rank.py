"""One rank of V4.1-Flash at full depth: its config, its real-format checkpoint, its step's roofline.

A rank of the seed's layouts computes its own requests' attention and the tokens routed to its
local experts; under balanced routing it receives as many (token, expert) pairs as it sends. So
one GPU runs one rank as the whole model with only the local experts (``n_routed_experts`` =
local + redundant, top-k unchanged, ``--enable-balanced-routing``): each token's k pairs land on
local experts, the pairs the rank would compute. The step time is the seed's per-GPU step less
the all-to-all. The Engram tables hold the rank's share of the rows (sharded over the mesh,
``--engram-placement device``); the draft's MoE keeps its top-3 over max(3, its local share).

Widths, ratios, sources, Engram layers and the draft are MODEL_SPEC §1's; ``depth=8`` is
``random-tiny``'s layer pattern at Flash widths (a compile-time probe), ``smoke`` the toy widths
(the scripts' CPU check). The checkpoint is written in the release's format (fp8 linears with
UE8M0 block scales, MXFP4 experts, e4m3 Engram rows) with ``save_random_checkpoint``, one
tensor at a time, and loaded by ``Engine.from_model_dir`` as ``python -m serve --model`` loads it.

``step_cost`` counts a step's bytes and FLOPs per part (weights, KV and indexer keys, attention,
linears): the roofline beside every measured step.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

FLASH_EXPERTS, FLASH_DRAFT_EXPERTS = 384, 128
FLASH_ENGRAM_VOCAB = 16_000_000   # its tables: 384,006,168 and 384,016,682 rows

WIDE = dict(hidden_size=5120, num_attention_heads=64, head_dim=512, q_lora_rank=1280, qk_rope_head_dim=64,
            sliding_window=128, index_n_heads=32, index_head_dim=128, index_topk=512, o_groups=8, o_lora_rank=1024,
            moe_intermediate_size=2304, num_experts_per_tok=6, engram_head_dim=256, engram_n_heads=8,
            engram_max_ngram_size=4, candidate_topk_blocks=2048, candidate_block_size=8, dspark_markov_rank=256)
TOY = dict(hidden_size=256, num_attention_heads=4, head_dim=64, q_lora_rank=64, qk_rope_head_dim=16,
           sliding_window=8, index_n_heads=2, index_head_dim=32, index_topk=16, o_groups=2, o_lora_rank=64,
           moe_intermediate_size=64, num_experts_per_tok=6, engram_head_dim=32, engram_n_heads=2,
           engram_max_ngram_size=3, candidate_topk_blocks=8, candidate_block_size=2, dspark_markov_rank=16)
PATTERNS = {
    40: dict(compress_ratios=[0, 0] + [2] * 18 + [1] * 20, kv_source_layer_ids=[2, 8, 14, 20],
             index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], candidate_source_layer_id=20,
             engram_layer_ids=[1, 14], dspark_target_layer_ids=[37, 38, 39]),
    8: dict(compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[2, 4, 5], index_source_layer_ids=[2, 4, 5, 7],
            candidate_source_layer_id=5, engram_layer_ids=[1, 4], dspark_target_layer_ids=[5, 6, 7]),
}


def rank_config(local_experts: int, ranks: int, depth: int = 40, smoke: bool = False):
    """The config of one rank of ``ranks`` (``local_experts`` routed experts a layer, redundant ones included)."""
    from model.config import ModelConfig

    raw = {**(TOY if smoke else WIDE), **PATTERNS[depth], "vocab_size": 129280, "num_hidden_layers": depth,
           "n_routed_experts": local_experts, "num_nextn_predict_layers": 3,
           "dspark_n_routed_experts": max(3, FLASH_DRAFT_EXPERTS // ranks), "dspark_num_experts_per_tok": 3,
           "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                            "original_max_position_embeddings": 65536}}
    # the rank's share of the table rows: a hash vocabulary of 1/ranks, whose primes set the rows
    engram = {"engram_layer_ids": raw.pop("engram_layer_ids"), "engram_vocab_size": 50 if smoke else FLASH_ENGRAM_VOCAB // ranks}
    primes = dataclasses.replace(ModelConfig.from_dict(raw | {"engram_layer_ids": []}), **engram).engram_primes
    return ModelConfig.from_dict(raw | engram | {"engram_num_embeddings": [sum(map(sum, p)) for p in primes]})


def checkpoint(cfg, directory: Path) -> dict:
    """Write the release-format checkpoint of ``cfg`` unless this machine has it; its files' bytes and write time."""
    import time

    from checkpoints.export import save_random_checkpoint
    from checkpoints.formats import V41

    written = sorted(directory.glob("*.safetensors"))
    config = directory / "config.json"
    if written and config.exists() and {k: v for k, v in json.loads(config.read_text()).items()
                                        if k in cfg.to_dict()} == json.loads(json.dumps(cfg.to_dict())):
        return {"bytes": sum(f.stat().st_size for f in written), "write_s": None}
    need, free = stored_bytes(cfg), shutil.disk_usage(directory.parent).free
    if need > free:
        raise SystemExit(f"the checkpoint of this rank takes about {need / 1e9:.0f} GB and {directory.parent} has "
                         f"{free / 1e9:.0f} GB free: set MEGAJAX_BENCH_CKPT to a larger disk, or spread the "
                         f"experts over more ranks")
    t0 = time.perf_counter()
    files = save_random_checkpoint(cfg, directory, V41, seed=0, draft=True)
    return {"bytes": sum(f.stat().st_size for f in files), "write_s": time.perf_counter() - t0}


def stored_bytes(cfg) -> int:
    """About what the release-format checkpoint of ``cfg`` takes (with its draft): MXFP4 experts
    (half a byte and a 32nd a parameter), fp8 linears and Engram rows, bf16 or fp32 for the rest."""
    import math

    from model.params import param_specs

    per_param = {"expert": 0.5 + 1 / 32, "linear": 1 + 1 / 1024, "shared": 1 + 1 / 1024, "table": 1 + 1 / 32,
                 "table_scale": 0, "plain": 2}
    return int(sum(math.prod(spec.shape) * per_param[spec.role] for spec in param_specs(cfg, draft=True)))


@dataclass(frozen=True)
class StepShape:
    """What a step computes: ``requests`` of ``rows`` rows each (new tokens, or the anchor and
    drafts of a verify) over ``context`` tokens of history, and whether the draft runs."""

    requests: int
    rows: int
    context: int
    drafts: int = 0   # the DSpark draft's block: drafts proposed a step (0: no draft)


def step_cost(cfg, params: dict, state, shape: StepShape) -> dict:
    """Bytes read and FLOPs of one step, by part. Weights are read once a step (the embedding and
    the Engram tables only at the rows looked up); each request reads its own window, selected
    compressed entries and the indexer keys it scores (a shared prefix is read once a request:
    the kernels do not batch requests over shared pages)."""
    import jax

    from model.state import pool_row_bytes

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))

    h, rows = cfg.hidden_size, shape.requests * shape.rows
    layers = params["layers"]
    table = [lp["engram"]["table"] for lp in layers if "engram" in lp]
    lookups = rows * cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1) * cfg.engram_head_dim * len(table)
    embed = params["embed"]
    weights = nbytes({k: v for k, v in params.items() if k not in ("mtp", "embed")}) - nbytes(table)
    weights += rows * h * embed.dtype.itemsize + lookups
    draft = (nbytes(params.get("mtp", {})) + shape.drafts * nbytes(params["lm_head"])) if shape.drafts else 0

    win_row = sum(a.shape[-1] * a.dtype.itemsize for a in jax.tree.leaves(state.window[0]))   # values, scales
    comp_row, idx_row = pool_row_bytes(state.comp_kv[0]), pool_row_bytes(state.index_k[0])
    ctx, kv, idx, attn_flops, idx_flops = shape.context, 0, 0, 0, 0
    per_entry = 2 * 2 * cfg.num_attention_heads * cfg.head_dim   # QK and PV over one entry, one row
    # a request's reads, each entry once: its window and new rows; of a compressed pool, the entries
    # selected (a decode's few rows, up to MegaAttention's 6 a request, select nearly the same ones;
    # a prefill's thousands of rows together cover the pool)
    for i, r in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]):
        pool = ctx // r if r else 0
        selected = min(pool, cfg.index_topk) if shape.rows <= 6 else pool
        kv += min(ctx, cfg.sliding_window + shape.rows - 1) * win_row + selected * comp_row
        attn_flops += rows * (min(cfg.sliding_window, ctx) + min(pool, cfg.index_topk)) * per_entry
        if i in cfg.index_source_layer_ids:
            keys = pool if i in cfg.kv_source_layer_ids else min(pool, cfg.candidate_topk_blocks
                                                                 * cfg.candidate_block_size)
            idx += keys * idx_row
            idx_flops += rows * keys * cfg.index_n_heads * cfg.index_head_dim * 2
    kv, idx = kv * shape.requests, idx * shape.requests

    # linears: every weight but the experts' once per row; the routed experts k of them a row
    def linear_params(tree):
        return sum(x.size for x in jax.tree.leaves(tree) if hasattr(x, "ndim") and x.ndim >= 2)

    dense = sum(linear_params({k: v for k, v in lp.items() if k not in ("moe", "engram")})
                + linear_params({k: v for k, v in lp["moe"].items() if k not in ("w1", "w2", "w3")})
                + linear_params({k: v for k, v in lp.get("engram", {}).items() if k not in ("table", "scale")})
                for lp in layers)
    expert = 3 * h * cfg.moe_intermediate_size
    linear_flops = 2 * rows * (dense + cfg.num_hidden_layers * cfg.num_experts_per_tok * expert + cfg.vocab_size * h)
    if shape.drafts:   # the draft's layers over its block (top-k of their experts a row), its heads once a slot
        mtp = params["mtp"]
        draft_dense = linear_params(mtp) - sum(linear_params({k: lp["moe"][k] for k in ("w1", "w2", "w3")})
                                               for lp in mtp["layers"])
        draft_experts = len(mtp["layers"]) * cfg.dspark_num_experts_per_tok * expert
        linear_flops += 2 * shape.requests * (cfg.dspark_block_size * (draft_dense + draft_experts)
                                              + shape.drafts * cfg.vocab_size * h)
    total_bytes = weights + draft + kv + idx
    flops = linear_flops + attn_flops + idx_flops
    return {"bytes": total_bytes, "flops": flops,
            "bytes_by_part": {"weights": weights, "draft_weights": draft, "kv": kv, "indexer_keys": idx},
            "flops_by_part": {"linears": linear_flops, "attention": attn_flops, "indexer": idx_flops}}


def roofline(cost: dict, ceil: dict) -> dict:
    """The step's bound at the measured bandwidth and matmul rate: the larger of its bytes and FLOPs times."""
    mem = cost["bytes"] / (ceil["bandwidth_GBps"] * 1e9) * 1e3
    compute = cost["flops"] / (ceil["matmul_TFLOPs"] * 1e12) * 1e3
    return {"ms": max(mem, compute), "memory_ms": mem, "compute_ms": compute}


def bench_main(script: str, name: str, variants: str, config, checkpoint_dir: Path, run, extra_args=()) -> None:
    """The command line both rank benchmarks share: the parent writes the checkpoint, measures the
    ceilings and runs each variant (``--variants``) in a child process of its own (``run(args,
    variant)`` yields ``(key, result)``; an int key is a measured step, given its roofline here),
    writing ``$OUT/<name>.json`` after each; a child cut by its time limit keeps what it printed.
    ``config(args)``: the model's config, written to ``checkpoint_dir``."""
    import argparse
    import os
    import sys
    import time

    from gpu_common import ceilings, out_dir, run_info, write

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU: toy widths, 8 layers, a short context")
    ap.add_argument("--depth", type=int, default=40, choices=(40, 8), help="40: Flash; 8: random-tiny's pattern")
    ap.add_argument("--context", type=int, default=131072, help="the shared prefix's tokens")
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=540, help="seconds per variant")
    ap.add_argument("--deadline", type=int, default=10 ** 6,
                    help="seconds the whole run may take (a device call's limit)")
    ap.add_argument("--name", default=name, help="JSON file name under $OUT")
    for flag, kw in extra_args:
        ap.add_argument(flag, **kw)
    args = ap.parse_args()
    start = time.monotonic()
    if args.smoke:
        args.depth, args.context = 8, min(args.context, 512)
    if args.child:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")   # to its log file
        for key, got in run(args, args.child):
            print("RESULT " + json.dumps({"key": key, **got}), flush=True)
        return
    os.environ.setdefault("MEGAJAX_KERNELS", "reference" if args.smoke else "pallas")
    child_env = dict(os.environ)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"   # this process's arrays must leave the GPU to the runs
    cfg = config(args)
    ckpt = checkpoint(cfg, checkpoint_dir)
    ceil = ceilings(args.smoke)
    print(f"checkpoint {ckpt}, ceilings {ceil} at {time.monotonic() - start:.0f} s", flush=True)
    payload = {**run_info(), "ceilings": ceil, "checkpoint": ckpt, "config": cfg.to_dict(), "routing": "balanced",
               "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, str, float, bool, type(None)))},
               "runs": {}}
    for variant in args.variants.split(","):
        runs = payload["runs"].setdefault(variant, {})
        left = args.deadline - (time.monotonic() - start) - 20
        if left < 60:
            runs["error"] = f"not run: {max(left, 0):.0f} s were left of --deadline {args.deadline}"
            write(args.name, payload)
            continue
        cmd = [sys.executable, script, *sys.argv[1:], "--child", variant]
        record = partial(_record, runs=runs, ceil=ceil, variant=variant, save=lambda: write(args.name, payload))
        log = out_dir() / f"{args.name}_{variant}.log"
        failed = _stream_child(cmd, child_env, min(args.timeout, left), record, log)
        if failed:
            runs["error"] = failed
            print(variant, "FAILED", failed[-1500:], flush=True)
        write(args.name, payload)


def _stream_child(cmd, env, timeout: float, on_result, log: Path) -> str | None:
    """Run ``cmd``, handing each RESULT line to ``on_result`` as it is printed (a child cut by its
    time limit keeps what it measured) and its stderr to ``log``; its failure, or None."""
    import subprocess
    import threading
    import time

    with open(log, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        t0 = time.monotonic()
        for line in p.stdout:
            if line.startswith("RESULT "):
                got = json.loads(line[len("RESULT "):])
                got["at_s"] = round(time.monotonic() - t0, 1)
                on_result(got)
        p.wait()
        timer.cancel()
    if time.monotonic() - t0 >= timeout:
        return f"timed out after {timeout:.0f} s"
    return p.returncode and log.read_text()[-3000:] or None


def _record(got: dict, runs: dict, ceil: dict, variant: str, save) -> None:
    key = got.pop("key")
    if isinstance(key, int):
        got["roofline"] = roofline(got["cost"], ceil)
        got["roofline_ratio"] = got["step_ms"] / got["roofline"]["ms"]
    runs[str(key)] = got
    print(variant, key, {k: got[k] for k in ("at_s", "step_ms", "tokens_per_s", "roofline_ratio", "s", "init_s")
                         if k in got}, flush=True)
    save()


def timed_passes(engine, prompts, passes: dict) -> tuple[dict, dict]:
    """Each pass (``name: sampling params``) run once to compile, once timed and once under the
    profiler, each time on fresh ``prompts()`` (new tokens: no pass hits what an earlier one
    cached beyond the shared prefix): ``(results, traced)`` for ``engine_gpu.decode_step``."""
    import dataclasses
    import time

    from engine_gpu import pass_totals
    from gpu_common import traced_events

    out, traced = {}, {}
    for name, sp in passes.items():
        t0 = time.perf_counter()
        engine.generate(prompts(), sp, decode_text=False)
        first = time.perf_counter() - t0
        steps0, v0, a0 = engine.stats.steps, engine.stats.verifies, engine.stats.accepted
        t0 = time.perf_counter()
        res = engine.generate(prompts(), sp, decode_text=False)
        s = time.perf_counter() - t0
        out[name] = {"s": s, "compile_s": first - s, "steps": engine.stats.steps - steps0,
                     "tokens": sum(len(r["output_ids"]) for r in res), "verifies": engine.stats.verifies - v0,
                     "accepted": engine.stats.accepted - a0,
                     "cached_tokens": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in res)}
        before = dataclasses.replace(engine.stats)
        batch = prompts()
        events = traced_events(lambda: engine.generate(batch, sp, decode_text=False))
        traced[name] = {**pass_totals(before, engine.stats, *events), "wall_s": s}
    return out, traced


def capacity(engine) -> dict:
    """Device memory after the weights and pools, and the tokens of KV its free part would hold."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    per_token = engine.runner.page_layout.bytes_per_token
    on_device = [x for x in jax.tree.leaves(engine.model.params)
                 if hasattr(x, "sharding") and x.sharding.memory_kind in (None, "device")]
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return {"bytes_limit": stats.get("bytes_limit"), "bytes_in_use": stats.get("bytes_in_use"),
            "device_param_bytes": sum(x.size * x.dtype.itemsize for x in on_device),
            "kv_bytes_per_token": per_token, "free_kv_tokens": int(free / per_token) if stats else None}
