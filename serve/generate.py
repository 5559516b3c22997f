"""Offline generation CLI: ``python -m serve.generate --model DIR --input IN.jsonl --output OUT.jsonl``.

Each input line is ``{"input_ids": [...]}`` or ``{"text": "..."}`` with optional
``"sampling_params"`` (SGLang names). Each output line, in input order, is
``{"output_ids", "text", "finish_reason", "usage"}`` (``"choices"`` when ``n`` > 1).
Inputs are validated before anything runs; the output file appears only when complete.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serve.cli_args import add_dtype
from serve.jsonl import InputError, read_objects, write_jsonl


def read_requests(path: Path) -> list[tuple[list[int] | str, dict]]:
    out = []
    for where, obj in read_objects(path):
        if ("input_ids" in obj) == ("text" in obj):
            raise InputError(f'{where}: expected an object with exactly one of "input_ids" or "text"')
        prompt = obj.get("input_ids", obj.get("text"))
        if not prompt or not isinstance(prompt, (list, str)):
            raise InputError(f"{where}: the prompt is empty or of the wrong type")
        params = obj.get("sampling_params", {})
        if not isinstance(params, dict):
            raise InputError(f"{where}: sampling_params must be an object")
        out.append((prompt, params))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="directory with config.json and safetensors")
    ap.add_argument("--input", required=True, type=Path)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--decoder-replay", choices=["approx", "exact", "off"], default="approx")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--prefill-budget", type=int,
                    help="tokens per step, its decodes included (default: 8192 on a GPU, 2048 elsewhere)")
    ap.add_argument("--max-compiled-programs", type=int,
                    help="step programs held compiled at once (default: as many as the process's limits fit)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                    help="fp8_e4m3: the sliding-window KV as e4m3 + UE8M0 scales (same outputs)")
    ap.add_argument("--quantization", choices=["none", "fp8", "mxfp4", "w8a8"], default="none",
                    help="expert weights quantised at load: fp8 (e4m3, 128 x 128 block scales), mxfp4 (e2m1, "
                         "a power-of-two scale per 32) or w8a8 (fp8 weights and fp8 rows, a scale per 128)")
    add_dtype(ap)
    ap.add_argument("--no-warmup", action="store_true", help="compile shapes on first use, not at start-up")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from checkpoints.hf import CheckpointError
    from model.config import ConfigError
    from serve.engine import Engine, EngineConfig
    from serve.sampling import SamplingParams

    try:
        requests = read_requests(args.input)
        config = EngineConfig(max_running=args.max_running, max_len=args.max_len,
                              prefill_budget=args.prefill_budget, page_size=args.page_size,
                              decoder_replay=args.decoder_replay,
                              overlap=not args.no_overlap, kv_cache_dtype=args.kv_cache_dtype,
                              quantization=args.quantization, max_programs=args.max_compiled_programs,
                              dtype=args.dtype)
        engine = Engine.from_model_dir(args.model, config, progress=True)
        for n, (prompt, params) in enumerate(requests, 1):
            try:
                engine.prepare(prompt, params)
            except ValueError as e:
                raise InputError(f"{args.input}: request {n}: {e}") from None
    except (ConfigError, CheckpointError, InputError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.no_warmup:
        with tqdm(total=len(engine.warmup_steps()), desc="compiling buckets", file=sys.stderr) as bar:
            engine.warmup(bar)
    total = sum(SamplingParams.from_dict(sp).n for _, sp in requests)
    with tqdm(total=total, desc="generating", unit="req", file=sys.stderr) as bar:
        results = engine.generate([p for p, _ in requests], [sp for _, sp in requests], progress=bar)
    write_jsonl(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
