"""Loading a release-format V4.1 checkpoint at scale: GB/s and peak host RSS, against the disk and PCIe.

Checkpoint: V4.1-Flash shapes (hidden 5120, 64 heads x 512, q_lora 1280, o_lora 1024 in 8 groups,
indexer 32 x 128, experts 2304 wide, the release's KV and index sources at [2, 8, 14, 20] and
[2, 8, 14, 20, 24, 28, 32, 36], Engram on layers 1 and 14) at all 40 layers, with 6 routed experts
per layer instead of 384 and Engram tables of ~1M rows instead of 384M (``engram_vocab_size``
40,000); random weights, written by ``checkpoints.export`` in the release's format (fp8 linears
with 32 x 32 UE8M0 scales, MXFP4 experts, e4m3 Engram rows), 5 GB shards with an index. Steps,
each in its own process (the GPU's memory is one process's at a time):

1. ``write``: random bf16 params, exported; the shards are flushed and dropped from the page cache.
2. ``load``: the ceilings first: the disk (the shards read sequentially into one buffer, page
   cache dropped first) and host-to-device copies (``jax.device_put`` of a 1 GB buffer). Then
   ``checkpoints.hf.load_params`` as ``Engine.from_model_dir`` calls it (bf16), cold (page cache
   dropped) and warm (just read), each to the last leaf ready on the device, host RSS sampled
   every 20 ms; the peak is given above the process's RSS before the load. Then the usual
   PyTorch path as the peer: ``safetensors``' ``safe_open(..., device="cuda")``, each tensor
   fetched onto the GPU (no conversion: fp8 stays fp8 and the experts stay packed), warm.

    python3 bench/checkpoint_load.py            # on the H200, writes $OUT/checkpoint_load.json
    python3 bench/checkpoint_load.py --smoke    # CPU: 4 layers at toy widths
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, run_info, write  # noqa: E402

CHECKPOINT = Path(os.environ.get("MEGAJAX_BENCH_CKPT", "/tmp/megajax_checkpoint_load"))


def config(smoke: bool):
    from model.config import ModelConfig

    if smoke:
        shape = dict(hidden_size=256, num_attention_heads=4, head_dim=64, q_lora_rank=64, qk_rope_head_dim=16,
                     index_n_heads=2, index_head_dim=32, o_groups=2, o_lora_rank=64, moe_intermediate_size=64,
                     num_hidden_layers=4, compress_ratios=[0, 0, 2, 1], kv_source_layer_ids=[2, 3],
                     index_source_layer_ids=[2, 3], engram_layer_ids=[1], engram_vocab_size=50,
                     engram_head_dim=32, engram_n_heads=2, engram_max_ngram_size=3)
    else:
        shape = dict(hidden_size=5120, num_attention_heads=64, head_dim=512, q_lora_rank=1280, qk_rope_head_dim=64,
                     index_n_heads=32, index_head_dim=128, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2304,
                     num_hidden_layers=40, compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
                     kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                     engram_layer_ids=[1, 14], engram_vocab_size=40000, engram_head_dim=256, engram_n_heads=8,
                     engram_max_ngram_size=4)
    raw = {"vocab_size": 129280, "sliding_window": 128, "index_topk": 512, "n_routed_experts": 6,
           "num_experts_per_tok": 6, "candidate_topk_blocks": 64, "num_nextn_predict_layers": 0, **shape}
    # each Engram table's rows are the sum of its layer's primes (``ModelConfig.engram_primes``)
    no_engram = ModelConfig.from_dict({**raw, "engram_layer_ids": []})
    primes = dataclasses.replace(no_engram, engram_layer_ids=tuple(raw["engram_layer_ids"])).engram_primes
    return ModelConfig.from_dict({**raw, "engram_num_embeddings": [sum(map(sum, layer)) for layer in primes]})


def drop_cache(files) -> None:
    """Flush and drop the shards from the page cache, so the next read comes from the disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shards() -> list[Path]:
    return sorted(CHECKPOINT.glob("*.safetensors"))


def step_write(smoke: bool) -> dict:
    import jax.numpy as jnp

    from checkpoints.export import save_checkpoint
    from checkpoints.formats import V41
    from checkpoints.init import init_params

    cfg = config(smoke)
    t0 = time.perf_counter()
    params = init_params(cfg, seed=0, dtype=jnp.bfloat16)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    files = save_checkpoint(params, cfg, CHECKPOINT, V41, max_shard_bytes=(64 << 20) if smoke else (5 << 30))
    write_s = time.perf_counter() - t0
    drop_cache(files)
    return {"init_s": init_s, "write_s": write_s, "files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "layers": cfg.num_hidden_layers, "experts_per_layer": cfg.n_routed_experts,
            "engram_rows": list(cfg.engram_num_embeddings)}


def step_load(smoke: bool) -> dict:
    import jax
    import numpy as np

    from checkpoints.hf import load_params
    from checkpoints.safetensors_io import Shards
    from model.config import ModelConfig
    from serve.engine import EngineConfig
    from serve.programs import Peak, process_rss

    files = shards()
    total = sum(f.stat().st_size for f in files)
    out = {"bytes": total, "files": len(files)}
    jax.device_put(np.zeros(1, np.float32)).block_until_ready()   # the runtime up before any baseline

    buf = np.ones(1 << 30, np.uint8)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.device_put(buf).block_until_ready()
        times.append(time.perf_counter() - t0)
    out["h2d_GBps"] = buf.nbytes / sorted(times)[1] / 1e9
    del buf

    drop_cache(files)
    chunk = bytearray(64 << 20)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(chunk):
                pass
    out["disk_read_GBps"] = total / (time.perf_counter() - t0) / 1e9
    del chunk

    cfg = ModelConfig.from_json(CHECKPOINT)
    dtype = EngineConfig(dtype="bfloat16").model_dtype
    for run in ("cold", "warm"):
        if run == "cold":
            drop_cache(files)
        base = process_rss()
        peak = Peak(process_rss, 0.02)
        t0 = time.perf_counter()
        params = load_params(CHECKPOINT, cfg, dtype)
        jax.block_until_ready(params)
        s = time.perf_counter() - t0
        top = peak.stop()
        out[f"megajax_{run}"] = {"s": s, "GBps": total / s / 1e9, "rss_before_GB": base / 1e9,
                                 "peak_rss_above_GB": (top - base) / 1e9}
        del params
    with Shards(CHECKPOINT) as checkpoint:
        out["largest_tensor_GB"] = max(i.nbytes for i in checkpoint.tensors.values()) / 1e9
    out["peer_safetensors_torch"] = peer_torch(files, total)
    return out


def peer_torch(files, total: int) -> dict:
    """safetensors' PyTorch loader onto the GPU, warm (the page cache holds the shards now)."""
    try:
        import torch
        from safetensors import safe_open
    except ImportError as e:
        return {"skipped": f"not installed: {e}"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device for torch"}
    try:
        t0 = time.perf_counter()
        kept = []
        for f in files:
            with safe_open(str(f), framework="pt", device="cuda") as fh:
                kept += [fh.get_tensor(k) for k in fh.keys()]
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        return {"s": s, "GBps": total / s / 1e9, "tensors": len(kept)}
    except Exception as e:   # a safetensors without F8_E8M0, say: recorded, not fatal
        return {"error": repr(e)[:500]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--step", choices=["write", "load"], help=argparse.SUPPRESS)   # a child process
    ap.add_argument("--timeout", type=int, default=280, help="seconds per step")
    args = ap.parse_args()
    if args.step:
        fn = step_write if args.step == "write" else step_load
        print("RESULT " + json.dumps(fn(args.smoke)), flush=True)
        return
    results, errors = {}, {}
    for step in ("write", "load"):
        cmd = [sys.executable, __file__, "--step", step] + ["--smoke"] * args.smoke
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                results[step] = json.loads(lines[-1][len("RESULT "):])
            if proc.returncode:
                errors[step] = proc.stderr[-3000:]
        except subprocess.TimeoutExpired:
            errors[step] = f"timed out after {args.timeout} s"
        print(step, json.dumps(results.get(step)), errors.get(step, "")[-1500:], flush=True)
        if step in errors:
            break
    print("wrote", write("checkpoint_load" + "_smoke" * args.smoke, {**run_info(), "results": results,
                                                                     "errors": errors}))
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()   # (an exception exits non-zero with its traceback)
