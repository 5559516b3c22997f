"""Disaggregated decode's first step: the window rings rebuilt by replay on D, or sent by P.

D receives a prompt's whole pages and its first token. What it still lacks is a request slot's own
state: each layer's window ring (the last ``sliding_window`` tokens' KV), each ratio > 1 source's
pending group tail, the Engram look-back, and the partial last page's compressed entries. megajax
rebuilds them by encoder replay: D's first step for the request is a prefix hit that recomputes the
last window (and the partial page) before it decodes. The alternative is to send them. This
measures both, on the engine ``python -m serve`` builds from the same flags:

* ``replay``: a prefix hit's one-token step (pages cached, window replayed) against a plain decode
  step of the same request (medians over ``--prompts`` fresh prompts of ``--prompt-len`` tokens);
  its cost is the difference, the time a sent ring would save;
* ``send``: the slot's state bytes (read from the engine's state: rings, tails, Engram look-back)
  plus one page (the partial page), pulled between two processes through
  ``--disaggregation-transfer-backend`` as ``bench/pd_transfer.py`` pulls pages; a host memcpy of
  the same bytes is the ceiling.

    python bench/pd_rings.py                                 # CPU: the embedded small model
    python bench/pd_rings.py --model DIR --prompt-len 8192   # a GPU, a Flash-width checkpoint
Writes ``$OUT/pd_rings.json`` (``bench_out/`` without ``$OUT``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve.cli_args import add_engine, add_model, engine_config  # noqa: E402

SLOT_FIELDS = ("window", "tail_kv", "tail_gate", "draft_window", "seq_lens", "engram_hist", "window_floor",
               "cached_len")


def slot_bytes(state) -> int:
    """Bytes of one request slot's own state (every per-slot field's rows for one slot)."""
    import jax

    return sum(leaf.nbytes // state.batch_size for f in SLOT_FIELDS
               for leaf in jax.tree.leaves(getattr(state, f)))


def step_times(engine, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """``(hit step s, decode step s)`` of a cached prompt: one new token (the replay step), and the
    per-token time of ``decode_tokens`` more."""
    def run(n):
        t = time.perf_counter()
        out = engine.generate([prompt], {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                              decode_text=False)[0]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the repeat missed the prefix cache"
        return time.perf_counter() - t

    one = run(1)
    return one, (run(1 + decode_tokens) - one) / decode_tokens


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(ap, required=False)
    add_engine(ap)
    b = ap.add_argument_group("benchmark")
    b.add_argument("--prompt-len", type=int, default=1024)
    b.add_argument("--prompts", type=int, default=3)
    b.add_argument("--decode-tokens", type=int, default=16)
    b.add_argument("--backend", default="jax-transfer")
    b.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    args.context_length = max(args.context_length, args.prompt_len + args.decode_tokens + args.page_size + 1)

    from gpu_common import run_info, write
    from pd_transfer import host_copy_rate, pull_times
    from serve.default_model import served_engine

    engine, name = served_engine(args.model, engine_config(args))
    cfg, state = engine.cfg, engine.runner.state.model
    rng = np.random.default_rng(0)
    new = lambda: rng.integers(3, cfg.vocab_size - 1, size=args.prompt_len).tolist()  # noqa: E731
    warm = new()
    engine.generate([warm], {"max_new_tokens": 1, "temperature": 0}, decode_text=False)   # compiles
    step_times(engine, warm, args.decode_tokens)
    hits, decodes = [], []
    for _ in range(args.prompts):
        p = new()
        engine.generate([p], {"max_new_tokens": 1, "temperature": 0}, decode_text=False)   # caches its pages
        hit, dec = step_times(engine, p, args.decode_tokens)
        hits.append(hit)
        decodes.append(dec)
    hit, dec = statistics.median(hits), statistics.median(decodes)

    page = int(engine.runner.page_layout.bytes_per_token * args.page_size)
    nbytes = slot_bytes(state) + page
    elems = -(-nbytes // 2)
    times = pull_times(args.backend, [(1, elems)], args.reps)[0]
    send = min(times)
    result = {**run_info(), "model": name, "prompt_len": args.prompt_len, "page_size": args.page_size,
              "decoder_replay": args.decoder_replay, "window": cfg.sliding_window, "layers": cfg.num_hidden_layers,
              "head_dim": cfg.head_dim, "replay": {"hit_step_s": hit, "decode_step_s": dec, "extra_s": hit - dec,
                                                  "hit_steps": hits, "decode_steps": decodes},
              "send": {"backend": args.backend, "slot_bytes": nbytes - page, "partial_page_bytes": page,
                       "bytes": nbytes, "best_s": send, "median_s": statistics.median(times),
                       "host_copy_s": nbytes / host_copy_rate(nbytes) / 2**30}}
    print(f"{name}, prompt {args.prompt_len}: replay step {hit * 1e3:.1f} ms against a decode step {dec * 1e3:.1f} ms "
          f"(+{(hit - dec) * 1e3:.1f} ms); sending {nbytes / 2**20:.2f} MiB of slot state + partial page "
          f"through {args.backend}: {send * 1e3:.2f} ms (a host memcpy: {result['send']['host_copy_s'] * 1e3:.3f} ms)")
    print(f"wrote {write('pd_rings', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
