"""Inline PTX for the Mosaic GPU kernels: what Pallas does not expose (named barriers, raw
mbarrier operations), called from ``plgpu.inline_mgpu`` bodies."""
from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils

# Named barriers 0 (the CTA's) and 1 to 3 (Mosaic GPU's warpgroup barriers) are taken.
FIRST_FREE_BARRIER = 8


def ptx(asm: str, *args):
    """Emit ``asm`` (operands ``$0``... bound to the 32-bit ``args``), never moved or dropped."""
    llvm.inline_asm(ir.Type.parse("!llvm.void"), list(args), asm, ",".join("r" * len(args)), has_side_effects=True)


def warpgroup_turns(first_id: int):
    """``(wait_turn, pass_turn)`` for compute warpgroups 0 and 1 that take turns, FlashAttention-3's
    ping-pong: warpgroup ``w`` waits on named barrier ``first_id + w`` (``bar.sync``, 256 threads)
    and passes the turn by arriving on the other's (``bar.arrive``). Each barrier completes when
    the one warpgroup waits and the other arrives, so the turns alternate strictly; warpgroup 1
    passes first, and warpgroup 0 ends by taking the turn it is left."""
    if first_id < FIRST_FREE_BARRIER or first_id + 1 > 15:
        raise ValueError(f"named barriers {first_id} and {first_id + 1}: ids {FIRST_FREE_BARRIER}-15 are free")

    def turn(op: str, mine: bool):
        @plgpu.inline_mgpu()
        def barrier(ctx):
            del ctx
            i32 = ir.IntegerType.get_signless(32)
            wg = mgpu_utils.warpgroup_idx(sync=False)
            if not mine:
                wg = arith.subi(arith.constant(i32, 1), wg)
            ptx(f"bar.{op} $0, 256;", arith.addi(wg, arith.constant(i32, first_id)))
        return barrier
    return turn("sync", True), turn("arrive", False)
