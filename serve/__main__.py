"""``python -m serve``: the OpenAI-compatible HTTP server (the embedded default model without --model)."""
from __future__ import annotations

import argparse
import logging
import sys

from serve.cli_args import add_dtype


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve", description=__doc__)
    ap.add_argument("--model", help="directory with config.json and safetensors (default: embedded tiny model)")
    ap.add_argument("--served-model-name", help="the model id clients send (default: the directory name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-running-requests", type=int, default=8)
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--chunked-prefill-size", type=int,
                    help="tokens per step, its decodes included (default: 8192 on a GPU, 2048 elsewhere)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--decoder-replay", choices=["approx", "exact", "off"], default="approx")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                    help="fp8_e4m3: keep the sliding-window KV as e4m3 values + UE8M0 scales (the model's own "
                         "FP8 window format, so the same outputs; 528 bytes a row at head_dim 512); the compressed "
                         "pools keep the model dtype")
    ap.add_argument("--quantization", choices=["none", "fp8", "mxfp4", "w8a8"], default="none",
                    help="quantise the routed and shared expert weights at load (the MoE kernels convert them in "
                         "registers). fp8: e4m3 with one power-of-two scale per 128 x 128 block, half the expert "
                         "memory; needs hidden and expert sizes divisible by 128. mxfp4: V4.1's expert format, e2m1 "
                         "with one power-of-two scale per 32, 27%% of it; needs sizes divisible by 64. w8a8: fp8 "
                         "weights as fp8, and the rows into each expert GEMM in e4m3 with a power-of-two scale per "
                         "128 columns (SGLang's block-fp8 MoE): fp8 x fp8 tensor-core GEMMs")
    add_dtype(ap)
    ap.add_argument("--max-queued-requests", type=int, default=256)
    ap.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    ap.add_argument("--max-compiled-programs", type=int,
                    help="step programs held compiled at once; the rest compile on demand, least recently used "
                         "evicted (default: as many as fit a quarter of vm.max_map_count and half the memory)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("megajax")

    from pathlib import Path

    from aiohttp import web
    from tqdm import tqdm

    from checkpoints.hf import CheckpointError
    from model.config import ConfigError
    from serve.engine import Engine, EngineConfig
    from serve.server import Server

    try:
        config = EngineConfig(max_running=args.max_running_requests, max_len=args.context_length,
                              page_size=args.page_size, prefill_budget=args.chunked_prefill_size,
                              decoder_replay=args.decoder_replay, overlap=not args.disable_overlap_schedule,
                              prefix_cache=not args.disable_radix_cache, kv_cache_dtype=args.kv_cache_dtype,
                              quantization=args.quantization, max_programs=args.max_compiled_programs,
                              dtype=args.dtype)
        if args.model:
            engine = Engine.from_model_dir(args.model, config, progress=True)
            name = args.served_model_name or Path(args.model).resolve().name
        else:
            from serve.default_model import NAME, default_config, default_params

            cfg = default_config()
            engine = Engine(default_params(cfg), cfg, config)
            name = args.served_model_name or NAME
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.no_warmup:
        with tqdm(total=len(engine.warmup_steps()), desc="compiling buckets", file=sys.stderr) as bar:
            engine.warmup(bar)
    server = Server(engine, name, api_key=args.api_key, max_queue=args.max_queued_requests)
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
