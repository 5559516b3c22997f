"""Offline scoring CLI: ``python -m serve.score --model DIR --input IN.jsonl --output OUT.jsonl``.

Each input line is ``{"input_ids": [...]}``; each output line is ``{"token_logprobs":
[null, lp_1, ...]}``, the log-probability of every token given those before it. Inputs
are validated up front (a bad line is reported with its number and nothing runs), then
grouped into a few power-of-two length buckets, each jitted once, with a progress bar.
The job runs in recorded chunks, sharded over processes, resumable after a crash
(``serve/offline_job.py``); the output appears only when complete. The work is
a ``Scorer`` (serve/batch_scoring.py) on the ``LoadedModel`` the engine would build: no engine,
no KV pool.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serve.cli_args import add_distributed, add_model, add_offline_io, init_distributed
from serve.jsonl import InputError, read_objects


def read_inputs(path: Path, vocab_size: int, max_len: int) -> list[list[int]]:
    out = []
    for where, obj in read_objects(path):
        ids = obj.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise InputError(f'{where}: expected an object with a non-empty "input_ids" list')
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            raise InputError(f"{where}: input_ids must be integers in [0, {vocab_size})")
        if len(ids) > max_len:
            raise InputError(f"{where}: {len(ids)} tokens exceed --max-len {max_len}")
        out.append(ids)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.score", description=__doc__.splitlines()[0])
    add_model(ap, required=True)
    add_offline_io(ap, '{"input_ids": [...]}', '{"token_logprobs": [...]}')
    sc = ap.add_argument_group("scoring")
    sc.add_argument("--batch-size", type=int, default=8)
    sc.add_argument("--max-len", "--context-length", dest="max_len", type=int, default=4096,
                    help="the longest sequence (one forward, from an empty state)")
    add_distributed(ap)
    args = ap.parse_args(argv)
    if args.batch_size <= 0 or args.max_len <= 0:
        ap.error("--batch-size and --max-len must be positive")

    from tqdm import tqdm

    from checkpoints.hf import CheckpointError
    from model.config import ConfigError, ModelConfig
    from serve.batch_scoring import Scorer
    from serve.loaded_model import LoadedModel
    from serve.offline_job import OfflineJob

    try:
        init_distributed(args)
        cfg = ModelConfig.from_json(args.model)
        sequences = read_inputs(args.input, cfg.vocab_size, args.max_len)
        job = OfflineJob.for_this_process(args.output, sequences, args.chunk)
        model = LoadedModel.from_model_dir(args.model, args.dtype, args.quantization, progress=True)
    except (ConfigError, CheckpointError, InputError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scorer = Scorer(model)
    with tqdm(total=job.share, initial=job.resumed_from, desc="scoring", unit="seq", file=sys.stderr) as bar:
        for chunk in job.pending():
            job.record([{"token_logprobs": lp}
                        for lp in scorer.score([sequences[i] for i in chunk], args.batch_size, bar)])
    job.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
