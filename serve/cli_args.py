"""The command-line options ``serve``, ``serve.generate`` and ``serve.score`` share, defined once.

Names follow SGLang's ``ServerArgs`` where SGLang has the setting (``--model-path``,
``--max-running-requests``, ``--context-length``, ``--chunked-prefill-size``, ``--page-size``,
``--max-total-tokens``, ``--disable-radix-cache``, ``--disable-overlap-schedule``, ``--dtype``,
``--kv-cache-dtype``, ``--quantization``, ``--speculative-algorithm``, ``--speculative-num-draft-tokens``,
``--dp-size``, ``--ep-size``, ``--enable-balanced-routing``, ``--ep-num-redundant-experts``, ``--enable-eplb``,
``--eplb-rebalance-num-iterations``, ``--engram-placement``, ``--nnodes``, ``--node-rank``, ``--dist-init-addr``); the names megajax's CLIs had before stay as aliases.
``engine_config(args)`` is the one place options become an ``EngineConfig``.
"""
from __future__ import annotations

import argparse


def add_model(ap: argparse.ArgumentParser, required: bool) -> None:
    g = ap.add_argument_group("model")
    g.add_argument("--model-path", "--model", dest="model", required=required, metavar="DIR",
                   help="directory with config.json and safetensors (the release's V4.1 format or plain floats)"
                        + ("" if required else "; default: deepseek-v4.1-small, the embedded model trained "
                                             "here (random-tiny: the same architecture at width 256, random "
                                             "weights)"))
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="the model dtype of weights and activations (auto: bfloat16 on a GPU, where the Pallas "
                        "kernels take it, float32 elsewhere); a checkpoint's quantised experts stay quantised")
    g.add_argument("--quantization", choices=["none", "fp8", "mxfp4", "w8a8"], default="none",
                   help="quantise float expert weights at load (the MoE kernels convert them in registers). fp8: "
                        "e4m3 with one power-of-two scale per 128 x 128 block (sizes divisible by 128); mxfp4: "
                        "V4.1's expert format, e2m1 with a power-of-two scale per 32 (sizes divisible by 64); "
                        "w8a8: fp8 weights, and the rows into each expert GEMM in e4m3 with a scale per 128 "
                        "columns (SGLang's block-fp8 MoE)")


def add_offline_io(ap: argparse.ArgumentParser, line_in: str, line_out: str) -> None:
    from pathlib import Path

    io = ap.add_argument_group("input and output")
    io.add_argument("--input", required=True, type=Path, help=f"JSONL, one {line_in} per line")
    io.add_argument("--output", required=True, type=Path,
                    help=f"JSONL, one {line_out} per line, in input order; written when the job is complete")
    io.add_argument("--chunk", type=int, default=64, metavar="N",
                    help="lines a process finishes and records at a time: a rerun after a crash resumes "
                         "after its last recorded chunk (serve/offline_job.py)")


def add_distributed(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="processes in the job (one per host)")
    g.add_argument("--node-rank", type=int, default=0, metavar="R", help="this process's rank, 0 .. N-1")
    g.add_argument("--dist-init-addr", metavar="HOST:PORT", help="the coordinator (process 0) address")


def init_distributed(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` as the flags ask (nothing for one process); ValueError names
    a bad combination."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is not in 0 .. --nnodes {args.nnodes} - 1")
    if args.nnodes == 1:
        return
    if not args.dist_init_addr or ":" not in args.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (process 0's address)")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # a CPU mesh across processes needs it
    jax.distributed.initialize(args.dist_init_addr, args.nnodes, args.node_rank)


def add_engine(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("scheduling")
    g.add_argument("--max-running-requests", "--max-running", dest="max_running", type=int, metavar="N", default=8,
                   help="requests decoded together (the decode batch's rows)")
    g.add_argument("--context-length", "--max-len", dest="context_length", type=int, metavar="N", default=4096,
                   help="the longest prompt plus output")
    g.add_argument("--chunked-prefill-size", "--prefill-budget", dest="chunked_prefill_size", type=int,
                   help="tokens per step, its decodes included (default: 8192 on a GPU, 2048 elsewhere)")
    g.add_argument("--disable-overlap-schedule", "--no-overlap", dest="disable_overlap", action="store_true",
                   help="wait for each step before planning the next")
    g.add_argument("--decoder-replay", choices=["approx", "exact", "off"], default="approx",
                   help="prefix hits replay the sliding window's tokens (approx: the window, exact: the halo)")
    par = ap.add_argument_group("parallelism")
    par.add_argument("--dp-size", type=int, default=1, metavar="N",
                     help="data-parallel attention: the request slots and their KV split over N device groups")
    par.add_argument("--ep-size", type=int, default=1, metavar="N",
                     help="expert parallelism: the routed experts split over the N devices of each DP group, "
                          "tokens sent to their experts by all-to-all (dp x ep devices in all)")
    par.add_argument("--enable-balanced-routing", action="store_true",
                     help="benchmarks only: spread every step's tokens evenly over the experts instead of routing "
                          "them (CHANGES OUTPUTS), as the seed's balanced-routing runs")
    par.add_argument("--ep-num-redundant-experts", type=int, default=0, metavar="N",
                     help="N extra physical experts a MoE layer, copies of hot experts (with --ep-size > 1); "
                          "outputs unchanged")
    par.add_argument("--enable-eplb", action="store_true",
                     help="count each expert's routed tokens and re-place the experts (and their copies) to "
                          "balance the expert ranks, periodically; outputs unchanged")
    par.add_argument("--eplb-rebalance-num-iterations", type=int, default=1000, metavar="N",
                     help="steps between EPLB rebalances, each on the load counted since the last")
    par.add_argument("--engram-placement", choices=["device", "host"], default="device",
                     help="the Engram tables split by rows over the devices' memory, or over the host memory "
                          "beside them (looked up by the host, only the step's rows sent to the devices)")
    sp = ap.add_argument_group("speculative decoding")
    sp.add_argument("--speculative-algorithm", choices=["DSPARK"],
                    help="DSPARK: the model's block draft (its mtp.* layers) proposes, the model verifies")
    sp.add_argument("--speculative-num-draft-tokens", type=int, metavar="N",
                    help="drafts verified a step (default: the draft's block size, dspark_block_size)")
    sp.add_argument("--speculative-fixed-verify", action="store_true",
                    help="benchmarks: verify every draft each step, even past max_new_tokens")
    sp.add_argument("--speculative-accept-length", type=float, metavar="X",
                    help="benchmarks: simulate X tokens accepted a verify step (bonus included) instead of "
                         "checking the drafts; the output is then not the model's")
    m = ap.add_argument_group("memory")
    m.add_argument("--page-size", type=int, metavar="N", default=64, help="tokens a KV page holds")
    m.add_argument("--max-total-tokens", type=int,
                   help="KV pool size in tokens (default: max-running-requests full-length requests)")
    m.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    m.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                   help="fp8_e4m3: the KV state in the formats the model quantises it to, read by the kernels "
                        "directly (so the same outputs): the sliding-window KV as e4m3 values + UE8M0 scales, the "
                        "compressed pools as NVFP4 (e2m1 + an e4m3 scale per 16), 288 of 1,024 bf16 bytes a row")
    add_hicache(ap)
    c = ap.add_argument_group("compilation")
    c.add_argument("--max-compiled-programs", type=int,
                   help="step programs held compiled at once; the rest compile on demand, least recently used "
                        "evicted (default: as many as fit a quarter of vm.max_map_count and half the memory)")
    c.add_argument("--no-warmup", action="store_true", help="compile shapes on first use, not at start-up")


def add_hicache(ap: argparse.ArgumentParser) -> None:
    """The hierarchical cache's options (SGLang's names and defaults; serve/hicache.py)."""
    h = ap.add_argument_group("hierarchical cache")
    h.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="keep evicted prefix pages in host memory (L2) and, with a storage backend, in storage "
                        "shared by instances that survives restarts (L3)")
    h.add_argument("--hicache-ratio", type=float, default=2.0, metavar="X",
                   help="the host pool's size as a multiple of the device KV pool")
    h.add_argument("--hicache-size", type=float, default=0, metavar="GB",
                   help="the host pool's size in GB (overrides --hicache-ratio when set)")
    h.add_argument("--hicache-write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default="write_through",
                   help="when pages are copied down: on commit, on their second use, or on eviction")
    h.add_argument("--hicache-storage-backend", choices=["file"], help="the L3 backend (default: none)")
    h.add_argument("--hicache-storage-dir", metavar="DIR",
                   help="the file backend's directory, shareable by several instances (default: "
                        "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR or /tmp/hicache)")
    h.add_argument("--hicache-storage-size", type=float, metavar="GB",
                   help="bound of the storage directory; least recently used pages go first (default: unbounded)")
    h.add_argument("--hicache-storage-prefetch-policy", choices=["best_effort", "wait_complete", "timeout"],
                   default="best_effort", help="how long a request with a storage hit waits for its prefetch")
    h.add_argument("--hicache-storage-backend-extra-config", metavar="JSON",
                   help='prefetch settings as JSON: {"prefetch_threshold": 256, "prefetch_timeout_base": 1.0, '
                        '"prefetch_timeout_per_ki_token": 0.25}')


def hicache_config(args: argparse.Namespace):
    """The ``HiCacheConfig`` the hierarchical-cache options describe, or None (ValueError naming a bad one)."""
    import json
    import os

    from serve.hicache import HiCacheConfig

    if not args.enable_hierarchical_cache:
        return None
    extra = {}
    if args.hicache_storage_backend_extra_config:
        try:
            extra = json.loads(args.hicache_storage_backend_extra_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from None
        known = {"prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token"}
        if not isinstance(extra, dict) or set(extra) - known:
            raise ValueError(f"--hicache-storage-backend-extra-config takes an object with {sorted(known)}")
    directory = args.hicache_storage_dir or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/tmp/hicache")
    return HiCacheConfig(ratio=args.hicache_ratio, size_gb=args.hicache_size, write_policy=args.hicache_write_policy,
                         storage_backend=args.hicache_storage_backend, storage_dir=directory,
                         storage_size_gb=args.hicache_storage_size,
                         prefetch_policy=args.hicache_storage_prefetch_policy,
                         **extra)


def engine_config(args: argparse.Namespace):
    """The ``EngineConfig`` the options describe (ValueError naming a bad combination)."""
    from serve.engine import EngineConfig   # (here: --help stays fast, without JAX)

    pages = None if args.max_total_tokens is None else -(-args.max_total_tokens // args.page_size)
    return EngineConfig(max_running=args.max_running, max_len=args.context_length, page_size=args.page_size,
                        num_pages=pages, prefill_budget=args.chunked_prefill_size,
                        decoder_replay=args.decoder_replay, overlap=not args.disable_overlap,
                        prefix_cache=not args.disable_radix_cache, kv_cache_dtype=args.kv_cache_dtype,
                        quantization=args.quantization, max_programs=args.max_compiled_programs, dtype=args.dtype,
                        speculative_algorithm=args.speculative_algorithm,
                        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
                        speculative_fixed_verify=args.speculative_fixed_verify,
                        speculative_accept_length=args.speculative_accept_length, dp_size=args.dp_size,
                        ep_size=args.ep_size, balanced_routing=args.enable_balanced_routing,
                        ep_num_redundant_experts=args.ep_num_redundant_experts, enable_eplb=args.enable_eplb,
                        eplb_rebalance_num_iterations=args.eplb_rebalance_num_iterations,
                        engram_placement=args.engram_placement, hicache=hicache_config(args))
