"""Offline scoring CLI: ``python -m serve.score --model DIR --input IN.jsonl --output OUT.jsonl``.

Each input line is ``{"input_ids": [...]}``; each output line is ``{"token_logprobs":
[null, lp_1, ...]}``, the log-probability of every token given those before it. Inputs
are validated up front (a bad line is reported with its number and nothing runs), then
grouped into a few power-of-two length buckets, each jitted once, with a progress bar.
The output is written to a temporary file and renamed only when complete.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np


class InputError(ValueError):
    pass


def read_inputs(path: Path, vocab_size: int, max_len: int) -> list[list[int]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        ids = obj.get("input_ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list) or not ids:
            raise InputError(f'{path}:{n}: expected an object with a non-empty "input_ids" list')
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            raise InputError(f"{path}:{n}: input_ids must be integers in [0, {vocab_size})")
        if len(ids) > max_len:
            raise InputError(f"{path}:{n}: {len(ids)} tokens exceed --max-len {max_len}")
        out.append(ids)
    return out


def bucket_length(n: int, smallest: int = 16) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


def score_sequences(params, cfg, sequences: list[list[int]], engram_map, batch_size: int, progress=None
                    ) -> list[list[float | None]]:
    """Log-probs of each sequence, batched by length bucket, in input order."""
    import jax.numpy as jnp

    from model.scoring import token_logprobs

    results: list = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(bucket_length(len(sequences[i])), []).append(i)
    for length, members in groups.items():
        for k in range(0, len(members), batch_size):
            rows = members[k:k + batch_size]
            tokens = np.zeros((batch_size, length), np.int32)
            lengths = np.zeros((batch_size,), np.int32)
            for r, i in enumerate(rows):
                tokens[r, :len(sequences[i])] = sequences[i]
                lengths[r] = len(sequences[i])
            lp = np.asarray(token_logprobs(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), engram_map))
            for r, i in enumerate(rows):
                results[i] = [None] + [float(v) for v in lp[r, :len(sequences[i]) - 1]]
            if progress is not None:
                progress.update(len(rows))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.score", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="directory with config.json and safetensors")
    ap.add_argument("--input", required=True, type=Path, help='JSONL, one {"input_ids": [...]} per line')
    ap.add_argument("--output", required=True, type=Path, help='JSONL, one {"token_logprobs": [...]} per line')
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=8192)
    args = ap.parse_args(argv)
    if args.batch_size <= 0 or args.max_len <= 0:
        ap.error("--batch-size and --max-len must be positive")

    from tqdm import tqdm

    from checkpoints.hf import CheckpointError, load_params
    from model.config import ConfigError, ModelConfig
    from model.engram_vocab import engram_map_for

    try:
        cfg = ModelConfig.from_json(args.model)
        sequences = read_inputs(args.input, cfg.vocab_size, args.max_len)
        params = load_params(args.model, cfg)
    except (ConfigError, CheckpointError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emap = None
    if cfg.engram_layer_ids:
        import jax.numpy as jnp

        emap = jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
    with tqdm(total=len(sequences), desc="scoring", unit="seq", file=sys.stderr) as bar:
        results = score_sequences(params, cfg, sequences, emap, args.batch_size, bar)
    write_jsonl(args.output, [{"token_logprobs": lp} for lp in results])
    return 0


def write_jsonl(path: Path, rows: list) -> None:
    """Write ``rows`` atomically: a temporary file renamed only once complete."""
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


if __name__ == "__main__":
    sys.exit(main())
