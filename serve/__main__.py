"""``python -m serve``: the OpenAI-compatible HTTP server (without --model: the embedded deepseek-v4.1-small)."""
from __future__ import annotations

import argparse
import logging
import sys

from serve.cli_args import add_distributed, add_engine, add_model, engine_config, init_distributed
from serve.disaggregation.config import BACKENDS, MODES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve", description=__doc__)
    add_model(ap, required=False)
    g = ap.add_argument_group("server")
    g.add_argument("--served-model-name", help="the model id clients send (default: the directory name)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--max-queued-requests", type=int, default=256, help="beyond it: 429 with Retry-After")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    g.add_argument("--max-request-bytes", type=int, default=16 << 20, metavar="N",
                   help="larger request bodies get 413 before they are read")
    g.add_argument("--enable-metrics", action="store_true",
                   help="Prometheus metrics at /metrics (SGLang's sglang: names)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g = ap.add_argument_group("prefill/decode disaggregation (behind sglang_router --pd-disaggregation)")
    g.add_argument("--disaggregation-mode", default="null", choices=MODES,
                   help="prefill: prefill requests and hand their state to a decode server; decode: decode them")
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=8998, metavar="PORT",
                   help="the prefill server's bootstrap server (decode: the port a router leaves null)")
    g.add_argument("--disaggregation-transfer-backend", default="jax-transfer", choices=BACKENDS)
    add_engine(ap)
    add_distributed(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("megajax")
    try:
        if args.nnodes > 1:
            from serve.multiprocess import check_supported

            check_supported(args)
        init_distributed(args)   # before anything, the imports below included, starts JAX's backend
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from aiohttp import web
    from tqdm import tqdm

    from checkpoints.hf import CheckpointError
    from model.config import ConfigError
    from serve.default_model import served_engine
    from serve.disaggregation.config import DisaggregationConfig
    from serve.disaggregation.worker import PdWorker
    from serve.server import QuietHttp2Probes, Server

    if args.disaggregation_mode == "decode" and args.disable_radix_cache:
        ap.error("--disaggregation-mode decode needs the radix cache (the received pages are a prefix hit)")
    try:
        engine, name = served_engine(args.model, engine_config(args), progress=True)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.nnodes > 1:   # one engine over every process's devices: process 0 serves, the others follow it
        from serve.multiprocess import channel_address

        if args.node_rank > 0:
            engine.follow(channel_address(args.dist_init_addr))
            return 0
        engine.lead(channel_address(args.dist_init_addr), args.nnodes - 1)
    if not args.no_warmup:
        with tqdm(total=len(engine.warmup_steps()), desc="compiling buckets", file=sys.stderr) as bar:
            engine.warmup(bar)
    name = args.served_model_name or name
    pd = None
    if args.disaggregation_mode != "null":
        try:
            pd = PdWorker(DisaggregationConfig.from_env(args.disaggregation_mode, args.disaggregation_bootstrap_port,
                                                        args.disaggregation_transfer_backend), engine, args.host)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    logging.getLogger("aiohttp.server").addFilter(QuietHttp2Probes())
    server = Server(engine, name, api_key=args.api_key, max_queue=args.max_queued_requests,
                    max_request_bytes=args.max_request_bytes, enable_metrics=args.enable_metrics, pd=pd)
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
