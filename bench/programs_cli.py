"""Peak mappings and RSS of the offline CLIs as users run them, with default flags, on a
checkpoint: ``python bench/programs_cli.py --model DIR [--out FILE]``.

``serve.generate`` gets requests of every prompt-length bucket up to its context length
(chunked past the step budget) and enough of them to fill every decode bucket;
``serve.score`` gets sequences of every power-of-two length bucket to its ``--max-len``. Each
runs in its own process; a thread samples ``/proc/PID/maps``, and the peak RSS is the
child's ``ru_maxrss``.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from serve.programs import PeakMaps  # noqa: E402


def run(cmd: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = PeakMaps(proc.pid)
    err = proc.communicate()[1]
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"cmd": " ".join(cmd[1:]), "rc": proc.returncode, "s": round(time.perf_counter() - t0, 1),
            "peak_maps": peak.stop(), "peak_rss_mb": round(max(rss, before) / 1024),
            "stderr_tail": err[-400:] if proc.returncode else ""}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--max-len", type=int, default=4096, help="serve.generate's default context length")
    ap.add_argument("--only", choices=["generate", "score"])
    args = ap.parse_args()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lengths = [1, 5, 12, 20, 40, 70, 130, 260, 520, 1030, 1540, 2050, 3000, args.max_len - 17]
        gen = [{"input_ids": rng.integers(3, vocab, n).tolist(), "sampling_params": {"max_new_tokens": 8}}
               for n in lengths]
        gen += [{"input_ids": rng.integers(3, vocab, 9).tolist(),
                 "sampling_params": {"max_new_tokens": 24, "temperature": 0.7}} for _ in range(16)]
        (tmp / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
        score_lengths = [2 ** k for k in range(1, 13)]  # every bucket to the default --max-len 4096
        (tmp / "score.jsonl").write_text("".join(json.dumps({"input_ids": rng.integers(3, vocab, n).tolist()}) + "\n"
                                                 for n in score_lengths))
        py = sys.executable
        rows = []
        if args.only in (None, "generate"):
            rows.append(run([py, "-m", "serve.generate", "--model", args.model, "--input", str(tmp / "gen.jsonl"),
                             "--output", str(tmp / "gen.out")]) | {"prompt_lengths": lengths})
        if args.only in (None, "score"):
            rows.append(run([py, "-m", "serve.score", "--model", args.model, "--input", str(tmp / "score.jsonl"),
                             "--output", str(tmp / "score.out")]) | {"sequence_lengths": score_lengths})
    text = json.dumps({"bench": "programs_cli", "model": args.model, "runs": rows}, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
