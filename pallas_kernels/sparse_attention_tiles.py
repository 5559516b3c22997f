"""MegaAttention's tuning on Hopper: the frozen per-CTA choices and the launch rule, read by the
kernel, ``mega.attention`` (through the kernel's defaults) and ``bench/attention_gpu.py``.

Measured on the H200 (bench/RESULTS.md, "MegaAttention"), the reasons:

* ``block_kv = 64`` gathered rows per chunk: the WGMMA layout the fp8 dequantisation works in
  is 64 rows, and two 64-row K/V slots of 64 KB each are what shared memory holds beside q and
  the logit exchange (226 of 227 KB); 32-row chunks in four slots measured slower (they re-read q).
* Registers after ``setmaxnreg``: 24 for the producer, 240 for each compute warpgroup
  (2 x 240 + 24 <= 512 per thread slot): fewer made the compute warpgroups spill.
* Launch: with fewer query tokens than fill the SMs, a query's chunks split over CTAs
  (flash-decoding; ``launch`` below); with one split a persistent grid of one CTA per SM, for
  every pool kind: faster than one CTA per item for bf16 pools, and for the fp8 window at all
  but one size.
"""
from __future__ import annotations

from typing import NamedTuple

HEADS = 64        # wgmma M: one CTA item is 64 heads of one query token


class Tuning(NamedTuple):
    block_kv: int = 64        # gathered rows per chunk
    slots: int = 2            # K/V chunk slots: one filled while the other is computed on
    id_slots: int = 3         # row-id slots: one chunk ahead of the copies, which run one ahead of compute
    producer_regs: int = 24
    compute_regs: int = 240


TUNING = Tuning()


class Launch(NamedTuple):
    splits: int   # CTAs sharing one query's chunks (their partials combined by an XLA pass)
    ctas: int     # CTAs of the grid, each taking every ``ctas``-th (token, head group, split) item


def auto_splits(t_len: int, n_heads: int, chunks: int, n_sms: int) -> int:
    """Key splits per query that fill ``n_sms`` CTAs' worth of work when ``t_len`` queries do
    not: the CTA count rounded down, with ``chunks`` spread evenly (each split gets >= 1)."""
    if not chunks:
        return 1
    want = max(1, min(chunks, n_sms // max(1, t_len * n_heads // HEADS)))
    per = -(-chunks // want)
    return -(-chunks // per)


def launch(t_len: int, n_heads: int, chunks: int, n_sms: int, splits: int | None = None) -> Launch:
    """The launch for ``t_len`` queries of ``n_heads`` heads over ``chunks`` key chunks on
    ``n_sms`` SMs (0: unknown, e.g. interpreted: no split, one CTA per item); ``splits`` as
    given, or ``auto_splits``. Persistent (one CTA per SM) with one split and some chunk to
    read (a later item's q is loaded after its first chunk's copies)."""
    if splits is None:
        splits = auto_splits(t_len, n_heads, chunks, n_sms)
    items = n_heads // HEADS * splits * t_len
    persistent = splits == 1 and n_sms and chunks
    return Launch(splits, min(items, n_sms) if persistent else items)
