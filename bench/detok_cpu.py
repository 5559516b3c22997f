"""Per-token detokenizing cost against the output's length: ``serve.detokenizer`` against the whole
re-decode every token that ``serve/request.py`` did before (the peer), with the DeepSeek-V4 tokenizer.

Tokens: a 10,000-token output made of mixed English, Chinese and emoji text (multi-byte
characters split across byte-level tokens). At each length n in (10, 100, 1,000, 10,000) the cost
of the token that makes the output n long: the median over 200 repeats (replayed from the same
state), in microseconds: the detokenizer's ``push`` alone, the engine's whole per-token text path
(``Request.check_stop`` with a stop string: push, the text grown, the stop looked for), and the peer.

    python3 bench/detok_cpu.py        # writes $OUT/detok_cpu.json (or /tmp)
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer  # noqa: E402

from model.engram_vocab import tokenizer_path  # noqa: E402
from serve.detokenizer import Detokenizer  # noqa: E402
from serve.request import Request  # noqa: E402
from serve.sampling import SamplingParams  # noqa: E402

TEXT = ("The model streams its answer token by token. 模型逐个令牌地流式输出答案。 Emoji too: 🤖🧠✨. "
        "Accents: naïve café, Ελληνικά, русский. ")


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_common import run_info, write

    tok = Tokenizer.from_file(str(tokenizer_path()))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    ids = []
    while len(ids) < 10_000:
        ids += tok.encode(TEXT, add_special_tokens=False).ids
    ids = ids[:10_000]
    rows = {}
    for n in (10, 100, 1_000, 10_000):
        d = Detokenizer(decode)
        for t in ids[:n - 1]:
            d.push(t)
        times = []
        for _ in range(200):
            probe = copy.copy(d)
            probe.ids = list(d.ids)
            t0 = time.perf_counter()
            probe.push(ids[n - 1])
            times.append(time.perf_counter() - t0)
        incremental = statistics.median(times) * 1e6
        times = []
        for _ in range(20 if n >= 1000 else 200):
            t0 = time.perf_counter()
            decode(ids[:n])
            times.append(time.perf_counter() - t0)
        whole = statistics.median(times) * 1e6
        # the engine's whole per-token text path: Request.check_stop (push, the text grown, a stop
        # string looked for in the new tail) on a request with one stop string
        req = Request("r", [1], SamplingParams(stop=("never seen",), max_new_tokens=100_000), 0)
        d = Detokenizer(decode)
        for t in ids[:n - 1]:
            req.output.append(t)
            req.check_stop(t, (), d)
        times = []
        for _ in range(200):
            probe, r = copy.copy(d), copy.copy(req)
            probe.ids, r.output = list(d.ids), list(req.output) + [ids[n - 1]]
            t0 = time.perf_counter()
            r.check_stop(ids[n - 1], (), probe)
            times.append(time.perf_counter() - t0)
        rows[n] = {"incremental_us": incremental, "check_stop_us": statistics.median(times) * 1e6,
                   "whole_redecode_us": whole}
        print(n, rows[n], flush=True)
    print("wrote", write("detok_cpu", {**run_info(), "tokens": len(ids), "per_token": rows}))


if __name__ == "__main__":
    main()
