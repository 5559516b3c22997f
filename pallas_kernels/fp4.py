"""The kernels' MXFP4 conversion: e2m1 codes to f16 by bit moves (Hopper's tensor cores take no FP4).

``grouped_gemm`` converts each weight tile in registers and multiplies each 32-wide slice by
its scale before the wgmma (the format itself: ``block_scaled``). The conversion is a few bit
moves (``e2m1_f16``: sign to bit 15, the magnitude bits to f16's lowest exponent bits and top
mantissa bit, which is the e2m1 value times 2^-14, exact). Done per 16-bit element it costs
about 8 instructions a weight, which bound the first kernel (bench/RESULTS.md). So
``Fp4Weight`` stores each 32-block's codes in the kernel's order: a thread's 4-bit
WGMMA-layout load (8 codes, one 32-bit word) then holds exactly the 8 values its f16
WGMMA-layout registers need, with the two halves of each f16 pair 16 bits apart, and
``e2m1_f16_words`` makes a pair from a word with two shifts, a mask and a ``lop3``-able
and-or. In a block, the code of column ``8 i + 2 t + b`` (f16 register ``i`` of lane ``t`` of
a row, half ``b`` of it) sits at ``8 t + 4 b + i``.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax.experimental.mosaic.gpu import utils as mgpu_utils



def e2m1_f16(code: jnp.ndarray) -> jnp.ndarray:
    """f16 values ``e2m1 * 2^-block_scaled.F16_SHIFT`` of int4 codes, by bit moves only (Hopper has no e2m1
    conversion): exact, zero and the subnormal 0.5 included."""
    v = code.astype(jnp.int16)   # sign-extended: bit 3 is the sign, bits 0-2 the magnitude
    return jax.lax.bitcast_convert_type(((v & 8) << 12) | ((v & 7) << 9), jnp.float16)


def e2m1_f16_words(words: Sequence) -> list[list]:
    """Mosaic GPU code: 32-bit words of 8 codes in the kernel's order → the f16 pairs (as
    ``vector<2xf16>``), four per word: pair ``i`` from nibbles ``i`` (low half) and ``4 + i``."""
    i32 = ir.IntegerType.get_signless(32)
    f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
    c = lambda v: arith.constant(i32, v)  # noqa: E731

    def shifted(w, by):
        return arith.shli(w, c(by)) if by >= 0 else arith.shrui(w, c(-by))

    def pairs(word):
        w = mgpu_utils.bitcast(word, i32)
        return [mgpu_utils.bitcast(arith.ori(arith.andi(shifted(w, 12 - 4 * i), c(0x80008000 - (1 << 32))),
                                             arith.andi(shifted(w, 9 - 4 * i), c(0x0E000E00))), f16x2)
                for i in range(4)]
    return [pairs(w) for w in words]


