"""Offline generation CLI: ``python -m serve.generate --model DIR --input IN.jsonl --output OUT.jsonl``.

Each input line is ``{"input_ids": [...]}`` or ``{"text": "..."}`` with optional
``"sampling_params"`` (SGLang names). Each output line, in input order, is
``{"output_ids", "text", "finish_reason", "usage"}`` (``"choices"`` when ``n`` > 1).
Inputs are validated before anything runs. The job runs in recorded chunks, sharded over
processes, resumable after a crash (``serve/offline_job.py``); the output appears only when complete.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serve.cli_args import add_distributed, add_engine, add_model, add_offline_io, engine_config, init_distributed
from serve.jsonl import InputError, read_objects


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
    add_model(ap, required=True)
    add_offline_io(ap, '{"input_ids": [...]} or {"text": ...}', '{"output_ids", "text", ...}')
    add_engine(ap)
    add_distributed(ap)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from checkpoints.hf import CheckpointError
    from model.config import ConfigError
    from serve.engine import Engine
    from serve.handle import RequestError
    from serve.offline_job import OfflineJob

    try:
        init_distributed(args)
        requests = read_requests(args.input)
        config = engine_config(args)
        engine = Engine.from_model_dir(args.model, config, progress=True)
        for n, (prompt, params) in enumerate(requests, 1):   # all validated before anything compiles
            try:
                engine.validate(prompt, params)
            except RequestError as e:
                raise InputError(f"{args.input}: request {n}: {e}") from None
        job = OfflineJob.for_this_process(args.output, requests, args.chunk)
    except (ConfigError, CheckpointError, InputError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.no_warmup:
        with tqdm(total=len(engine.warmup_steps()), desc="compiling buckets", file=sys.stderr) as bar:
            engine.warmup(bar)
    with tqdm(total=job.share, initial=job.resumed_from, desc="generating", unit="req", file=sys.stderr) as bar:
        for chunk in job.pending():
            handles = [engine.submit(*requests[i], stream=False) for i in chunk]
            job.record(engine.collect(handles))
            bar.update(len(chunk))
    job.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
