"""Time to first token of a long prompt from each cache tier, and the bytes a page stores per token.

The engine is built from ``python -m serve``'s own flags (``serve/cli_args.py``: the same parser,
``engine_config`` and ``Engine`` construction), with the hierarchical cache on and a file store in a
temporary directory unless the flags say otherwise. Per prompt (``--prompts`` of ``--prompt-len``
random tokens, after one unmeasured round that compiles every shape):

* ``cold``: the prompt's first run (nothing cached);
* ``l1``: its repeat, a device hit;
* ``l2``: its repeat after another prompt of the same length took the device pool (sized here to
  about one such prompt), so its pages come back from host memory;
* ``l3``: its repeat in a new engine on the same storage directory (empty device and host tiers:
  what a restarted server sees; in-process, so the compiled programs are reused), pages read from
  the files (prefetch policy ``wait_complete``), after that engine has served the unmeasured
  round's prompt from the files (its first use of the programs).

TTFT is the wall time of ``Engine.generate`` for one new token (greedy), the first token's latency
without the HTTP layer. Every hit is checked: its ``cached_tokens`` and the tier the pages came from
(``/metrics``' counters), and its token equal to the device hit's. Bytes per token: a page's
payload (each KV source's compressed KV and indexer keys) over its tokens, against a plain KV cache
of the same model (one K=V row of ``head_dim`` per layer per token, the model's MQA, in the same
dtype), and the storage file's size with its header.

    python bench/hicache_ttft.py --model random-tiny               # CPU: 8K tokens (default: serve's default model)
    python bench/hicache_ttft.py --model DIR --prompt-len 8192     # a GPU, e.g. bench/engine_gpu.py's checkpoint
Serve flags pass through (``--page-size``, ``--hicache-*``, ``--max-total-tokens`` ...). Writes JSON
to ``--output`` (default ``$OUT/hicache_ttft.json`` or ``bench/results/hicache_ttft.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from provenance import commit  # noqa: E402
from serve.cli_args import add_engine, add_model, engine_config  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(ap, required=False)
    add_engine(ap)
    b = ap.add_argument_group("benchmark")
    b.add_argument("--prompt-len", type=int, default=8192)
    b.add_argument("--prompts", type=int, default=3, help="prompts measured (medians reported)")
    b.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    args.enable_hierarchical_cache = True
    args.hicache_storage_backend = args.hicache_storage_backend or "file"
    args.hicache_storage_prefetch_policy = "wait_complete"
    if args.hicache_storage_dir is None:
        args.hicache_storage_dir = tempfile.mkdtemp(prefix="hicache-bench-")
    if args.context_length < args.prompt_len + args.page_size:
        args.context_length = args.prompt_len + args.page_size
    if args.max_total_tokens is None:   # about one prompt: the next one pushes it out of the device
        args.max_total_tokens = args.prompt_len + 2 * args.page_size
    return args


def build(args):
    """The engine as ``python -m serve`` builds it from these flags."""
    from serve.default_model import served_engine

    return served_engine(args.model, engine_config(args))[0]


def ttft(engine, prompt) -> tuple[float, dict]:
    before = engine.load()["hicache"]["hit_tokens"]
    t = time.perf_counter()
    out = engine.generate([prompt], {"max_new_tokens": 1, "temperature": 0}, decode_text=False)[0]
    dt = time.perf_counter() - t
    after = engine.load()["hicache"]["hit_tokens"]
    tiers = {k: after[k] - before[k] for k in after}
    return dt, {"cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"], "tiers": tiers,
                "token": out["output_ids"][0]}


def device_and_host(engine, prompt, other) -> dict:
    """``cold``, ``l1`` and ``l2`` of ``prompt`` (``other`` pushes it out of the device pool)."""
    row = {"cold": ttft(engine, prompt), "l1": ttft(engine, prompt)}
    ttft(engine, other)
    row["l2"] = ttft(engine, prompt)
    return row


def checked(row: dict) -> dict:
    hit = row["l1"][1]["cached_tokens"]
    expect = {"l1": "device", "l2": "host", "l3": "storage"}
    for name, tier in expect.items():
        info = row[name][1]
        assert info["cached_tokens"] == hit > 0 and info["tiers"][tier] == hit, (name, info, hit)
        assert info["token"] == row["l1"][1]["token"], (name, "token differs from the device hit's")
    return {k: {"s": v[0], **v[1]} for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    args = parse(argv)
    engine = build(args)
    cfg, layout = engine.cfg, engine.runner.page_layout
    rng = np.random.default_rng(0)
    new = lambda: rng.integers(3, cfg.vocab_size - 1, size=args.prompt_len).tolist()  # noqa: E731
    t = time.perf_counter()
    warm = new()
    device_and_host(engine, warm, new())   # compiles every shape
    compile_s = time.perf_counter() - t
    prompts = [new() for _ in range(args.prompts)]
    rows = [device_and_host(engine, p, new()) for p in prompts]
    engine.hicache.drain()
    restarted = build(args)   # in-process, so the compiled programs are reused
    ttft(restarted, warm)   # the restarted engine's first use of its programs is not the storage's cost
    for row, p in zip(rows, prompts):
        row["l3"] = ttft(restarted, p)
    restarted.hicache.close()
    rows = [checked(r) for r in rows]
    median = {k: statistics.median(r[k]["s"] for r in rows) for k in ("cold", "l1", "l2", "l3")}
    itemsize = layout.np_dtype.itemsize
    plain = cfg.num_hidden_layers * cfg.head_dim * itemsize
    files = list(Path(args.hicache_storage_dir).glob("*.page"))
    file_bytes = statistics.median(f.stat().st_size for f in files) if files else None
    import jax

    result = {
        "commit": commit(), "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        "model": args.model or "deepseek-v4.1-small", "prompt_len": args.prompt_len, "page_size": args.page_size,
        "chunked_prefill_size": engine.config.step_tokens, "decoder_replay": args.decoder_replay,
        "dtype": layout.dtype, "device_pool_tokens": engine.config.pages * args.page_size,
        "host_pool_pages": engine.hicache.host.capacity, "compile_round_s": compile_s,
        "ttft_s_median": median, "runs": rows,
        "bytes_per_token": {"page": layout.bytes_per_token,
                            "storage_file": None if file_bytes is None else file_bytes / args.page_size,
                            "plain_kv_cache": plain, "ratio_plain_over_page": plain / layout.bytes_per_token},
        "shapes": {"layers": cfg.num_hidden_layers, "head_dim": cfg.head_dim, "index_head_dim": cfg.index_head_dim,
                   "kv_source_ratios": list(layout.ratios), "window": cfg.sliding_window},
    }
    out = args.output or Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "hicache_ttft.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"ttft_s_median": median, "bytes_per_token": result["bytes_per_token"]}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
