"""The grouped GEMMs' tiles on Hopper: one table per weight format, read by ``mega.moe`` and the benchmarks.

A table row ``Tiles(rows_per_expert, gate_up, down)`` covers batches of up to that many rows
per expert on average (``inclusive=False``: below it); the first row that covers a batch
applies. Measured on the H200 (bench/RESULTS.md, "MegaMoE expert stage"), the reasons:

* bf16: below 16 rows per expert the weight stream is the bound, and swapped 32-row tiles
  (rows as the wgmma's N; skewed loads put 2-3x the average on some experts) stream it best;
  above, one warpgroup per 64-row tile; from 128, two wgmma warpgroups fed by a TMA warpgroup,
  in bands of 8 row blocks (3-11% faster than ungrouped at 1024 and 4096 rows per expert).
* fp8 and MXFP4 weights: swapped tiles of weight rows at every size (the converted tile is the
  wgmma's register operand). fp8: up to 16 rows per expert W8A8's 32-row tiles (14-25%
  faster skewed than 16-row ones); up to 64, steps 128 deep; above, 128-row blocks 64 deep
  (each weight tile converted half as often: 19% faster at 256). MXFP4: the best of each size
  in one call; its steps are the deepest of 256, 128, 64 that divides K, up to the row's.
* W8A8: 32-row tiles up to 16 rows per expert, else 64 (each accumulator is held twice, the
  step's product and the sum); the gate/up tiles are 128 wide, one scale block of ``h``.
  From 256 rows per expert the gate/up tiles are warp specialised (4-6% faster); the down
  projection's would be 34% slower, so it keeps one warpgroup.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from pallas_kernels.grouped_gemm import GemmConfig


class Tiles(NamedTuple):
    rows_per_expert: float
    gate_up: GemmConfig
    down: GemmConfig
    inclusive: bool = True

    def covers(self, n_rows: int, n_experts: int) -> bool:
        bound = self.rows_per_expert * n_experts
        return n_rows < bound or (self.inclusive and n_rows == bound)


def _swapped(rows: int, up_k: int, down_k: int, up_stages: int = 4, down_stages: int = 3) -> tuple:
    """Swapped tiles of ``rows`` rows: 64 weight rows for gate/up, 128 for down."""
    return (GemmConfig(rows, 64, up_k, up_stages, swap_ab=True),
            GemmConfig(rows, 128, down_k, down_stages, swap_ab=True))


TILES: dict[str, tuple[Tiles, ...]] = {
    "bf16": (
        Tiles(16, *_swapped(32, 64, 64, 6, 6)),
        Tiles(128, GemmConfig(64, 64, 64, 4), GemmConfig(64, 128, 64, 4), inclusive=False),
        Tiles(math.inf, GemmConfig(64, 128, 64, 4, 2, group_m=8), GemmConfig(64, 256, 64, 3, 2, group_m=8)),
    ),
    "fp8": (
        Tiles(16, *_swapped(32, 128, 128)),
        Tiles(64, *_swapped(64, 128, 128)),
        Tiles(math.inf, *_swapped(128, 64, 64)),
    ),
    "mxfp4": (   # block_k: the deepest step allowed (see ``tiles``)
        Tiles(16, *_swapped(16, 256, 256)),
        Tiles(64, *_swapped(64, 128, 128)),
        Tiles(math.inf, *_swapped(128, 64, 64)),
    ),
    "w8a8": (
        Tiles(16, GemmConfig(32, 128, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 3, swap_ab=True)),
        Tiles(256, *_swapped(64, 128, 128), inclusive=False),
        Tiles(math.inf, GemmConfig(64, 128, 128, 4, 2, "n", swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True)),
    ),
}


def tiles(n_rows: int, n_experts: int, d: int, inter: int, fmt: str) -> tuple[GemmConfig, GemmConfig] | None:
    """(gate/up, down) configs for ``n_rows`` rows over ``n_experts`` experts of ``d`` x
    ``inter`` weights in ``fmt``, or None where the sizes do not divide into the tiles."""
    row = next(t for t in TILES[fmt] if t.covers(n_rows, n_experts))
    up, down = row.gate_up, row.down
    if fmt == "mxfp4":   # a small model's K may need shallower steps
        up, down = _deepest(up, d), _deepest(down, inter)
    fits = all(n % c.block_n == 0 and kk % c.block_k == 0 for c, n, kk in ((up, inter, d), (down, d, inter)))
    return (up, down) if fits else None


def _deepest(cfg: GemmConfig, k: int) -> GemmConfig:
    return dataclasses.replace(cfg, block_k=next((b for b in (256, 128, 64) if b <= cfg.block_k and k % b == 0), 64))
