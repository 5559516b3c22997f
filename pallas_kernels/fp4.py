"""MXFP4 (OCP microscaling FP4): e2m1 values with one power-of-two (UE8M0) scale per 32.

V4.1's routed experts ship in this format (MODEL_SPEC §2). Hopper's tensor cores take no FP4,
so ``grouped_gemm`` converts the values in registers and multiplies each 32-wide slice by its
scale before the wgmma.

An e2m1 code is 4 bits: sign, then a 2-bit exponent E and a 1-bit mantissa m; its magnitude
is ``2^(E-1) (1 + m/2)`` for E > 0 and ``m/2`` for E = 0, i.e. ``E2M1`` below. Codes are kept
as ``jnp.int4`` whose bits are the code (HF checkpoints pack two per byte, low nibble first,
which ``jax.lax.bitcast_convert_type(packed, jnp.int4)`` unpacks in that order).

The conversion is a few bit moves (``e2m1_f16``: sign to bit 15, the magnitude bits to f16's
lowest exponent bits and top mantissa bit, which is the e2m1 value times 2^-14, exact). Done
per 16-bit element it costs about 8 instructions a weight, which bound the first kernel
(bench/RESULTS.md). So ``Fp4Weight`` stores each 32-block's codes in the kernel's order: a
thread's 4-bit WGMMA-layout load (8 codes, one 32-bit word) then holds exactly the 8 values its
f16 WGMMA-layout registers need, with the two halves of each f16 pair 16 bits apart, and
``e2m1_f16_words`` makes a pair from a word with two shifts, a mask and a ``lop3``-able
and-or. In a block, the code of column ``8 i + 2 t + b`` (f16 register ``i`` of lane ``t`` of
a row, half ``b`` of it) sits at ``8 t + 4 b + i``.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax.experimental.mosaic.gpu import utils as mgpu_utils

BLOCK = 32
FP4_MAX = 6.0
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# thresholds between neighbouring magnitudes; a tie goes to the even code (mantissa bit 0),
# so it rounds up (>=) where the upper code is even
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
# ``e2m1_f16`` moves E and m to f16's lowest exponent bits and its top mantissa bit, which gives
# the e2m1 value times 2^-14 (E = 0 lands on f16's subnormal 2^-14 * m/2, with the same factor)
F16_SHIFT = 14


def pow2_ceil_exponent(t: jnp.ndarray) -> jnp.ndarray:
    """``ceil(log2 t)`` (int32, clipped to [-126, 127]) for positive float32 ``t``, from its IEEE
    bits: exact where ``log2`` may not be."""
    bits = jax.lax.bitcast_convert_type(t.astype(jnp.float32), jnp.int32)
    return jnp.clip(((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32), -126, 127)


def pow2_from_exponent(e: jnp.ndarray) -> jnp.ndarray:
    """``2**(e - 127)`` (float32) of UE8M0 exponents in [1, 254], built from the IEEE bits: exp2
    is not exact on every backend."""
    return jax.lax.bitcast_convert_type(e.astype(jnp.int32) << 23, jnp.float32)


def scale_values(s: jnp.ndarray) -> jnp.ndarray:
    """float32 block scales from UE8M0 exponent bytes (uint8: ``2**(e - 127)``) or stored floats."""
    return pow2_from_exponent(s) if s.dtype == jnp.uint8 else s.astype(jnp.float32)


def pow2_ceil(t: jnp.ndarray) -> jnp.ndarray:
    """``2**ceil(log2 t)`` for positive float32 ``t`` (a UE8M0 scale)."""
    return pow2_from_exponent(pow2_ceil_exponent(t) + 127)


def e2m1_code(x: jnp.ndarray) -> jnp.ndarray:
    """int32 codes (sign << 3 | magnitude index) of float32 values already clamped to ±6,
    rounded to nearest, ties to even."""
    mag = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.int32)
    for bound, up in zip(_BOUNDS, _TIE_UP):
        code += (mag >= bound if up else mag > bound).astype(jnp.int32)
    return code | (jnp.signbit(x).astype(jnp.int32) << 3)


def e2m1_value(code: jnp.ndarray) -> jnp.ndarray:
    """float32 values of int codes."""
    code = code.astype(jnp.int32)
    value = jnp.asarray(E2M1)[code & 7]
    return jnp.where(code & 8 != 0, -value, value)


def e2m1_f16(code: jnp.ndarray) -> jnp.ndarray:
    """f16 values ``e2m1 * 2^-F16_SHIFT`` of int4 codes, by bit moves only (Hopper has no e2m1
    conversion): exact, zero and the subnormal 0.5 included."""
    v = code.astype(jnp.int16)   # sign-extended: bit 3 is the sign, bits 0-2 the magnitude
    return jax.lax.bitcast_convert_type(((v & 8) << 12) | ((v & 7) << 9), jnp.float16)


def to_kernel_order(codes: jnp.ndarray) -> jnp.ndarray:
    """Codes ``[..., K]`` in column order → the kernel's order within each 32-block."""
    *lead, k = codes.shape
    blocks = codes.reshape(*lead, k // BLOCK, 4, 4, 2)   # column 8 i + 2 t + b: (i, t, b)
    return jnp.moveaxis(blocks, -3, -1).reshape(codes.shape)   # → (t, b, i): 8 t + 4 b + i


def from_kernel_order(codes: jnp.ndarray) -> jnp.ndarray:
    """The inverse of ``to_kernel_order``."""
    *lead, k = codes.shape
    blocks = codes.reshape(*lead, k // BLOCK, 4, 2, 4)   # (t, b, i)
    return jnp.moveaxis(blocks, -1, -3).reshape(codes.shape)


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


class Fp4Weight(NamedTuple):
    """An MXFP4 weight stack ``[..., N, K]`` in the kernels' form: ``codes [..., N, K]`` int4,
    each 32-block in the kernel's order (``to_kernel_order``); ``scale [..., K / 32, N]`` f16,
    each block's power-of-two scale relative to its matrix's largest, times 2^F16_SHIFT
    (undoing ``e2m1_f16``'s factor), transposed so that a kernel step's slice is one TMA tile;
    and ``top [...]`` fp32, that largest scale. Then
    ``w[.., n, k] = e2m1(from_kernel_order(codes)[.., n, k]) * scale[.., k // 32, n] * 2^-14 * top``.
    It is derived once, when quantising or loading, so no call pays for it. Exact while a
    block's scale is at most 2^23 below its matrix's largest; blocks further below round in
    f16's subnormals, and below 2^-38 flush to zero."""
    codes: jax.Array
    scale: jax.Array
    top: jax.Array

    @property
    def shape(self):
        return self.codes.shape

    @classmethod
    def from_codes(cls, codes: jax.Array, exponents: jax.Array) -> "Fp4Weight":
        """From e2m1 codes ``[..., N, K]`` in column order and their blocks' UE8M0 exponents
        ``[..., N, K / 32]`` (scale ``2^(e - 127)``)."""
        e = exponents.astype(jnp.int32)
        top = e.max(axis=(-2, -1))
        rel = e - top[..., None, None] + F16_SHIFT
        rel = jnp.where(rel >= -24, jnp.ldexp(jnp.float32(1), jnp.maximum(rel, -24)), 0.0).astype(jnp.float16)
        return cls(to_kernel_order(codes.astype(jnp.int4)), jnp.swapaxes(rel, -1, -2),
                   jnp.ldexp(jnp.float32(1), top - 127))

    @classmethod
    def from_float(cls, w: jax.Array) -> "Fp4Weight":
        """Quantise ``[..., N, K]`` (K % 32 == 0): per 32 values the scale is the power of two at
        or above amax / 6 (MODEL_SPEC §3.5's FP4 block-32 rule), values round to e2m1."""
        codes, exponents = mxfp4_parts(w)
        return cls.from_codes(codes, exponents)

    @classmethod
    def from_packed(cls, packed: jax.Array, exponents: jax.Array) -> "Fp4Weight":
        """From a checkpoint's bytes: ``packed [..., N, K / 2]`` uint8 (two codes per byte, low
        nibble first, in column order) and ``exponents [..., N, K / 32]`` uint8 UE8M0."""
        codes = jax.lax.bitcast_convert_type(jnp.asarray(packed, jnp.uint8), jnp.int4)
        codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
        if codes.shape[-1] % BLOCK or exponents.shape != (*codes.shape[:-1], codes.shape[-1] // BLOCK):
            raise ValueError(f"MXFP4 scales {exponents.shape} do not match codes {codes.shape} (one per {BLOCK})")
        return cls.from_codes(codes, jnp.asarray(exponents, jnp.uint8))

    def packed(self) -> tuple[jax.Array, jax.Array]:
        """``from_packed``'s inputs back: packed codes ``[..., N, K / 2]`` uint8 and UE8M0 exponents
        ``[..., N, K / 32]`` uint8 (a block that flushed to zero gets exponent 1, 2^-126)."""
        codes = from_kernel_order(self.codes).astype(jnp.int32) & 15
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)
        rel = jnp.swapaxes(self.scale, -1, -2).astype(jnp.float32)
        top = pow2_ceil_exponent(self.top)[..., None, None] + 127
        e = jnp.where(rel > 0, pow2_ceil_exponent(jnp.where(rel > 0, rel, 1.0)) - F16_SHIFT + top, 1)
        return packed, jnp.clip(e, 1, 254).astype(jnp.uint8)

    def dequantized(self, dtype=jnp.float32):
        s = jnp.repeat(jnp.swapaxes(self.scale, -1, -2).astype(jnp.float32), BLOCK, axis=-1)
        w = e2m1_value(from_kernel_order(self.codes)) * s * (2.0 ** -F16_SHIFT) * self.top[..., None, None]
        return w.astype(dtype)


def mxfp4_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 quantisation of ``[..., K]`` (K % 32 == 0) in column order: int32 e2m1 codes and
    each 32-block's UE8M0 exponent (int32; the scale is the power of two at or above amax / 6,
    MODEL_SPEC §3.5's FP4 block-32 rule)."""
    *lead, k = x.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension divisible by {BLOCK}, got {x.shape}")
    b = x.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK)
    amax = jnp.maximum(jnp.abs(b).max(-1), FP4_MAX * 2.0 ** -126) * (1.0 / FP4_MAX)
    codes = e2m1_code(jnp.clip(b / pow2_ceil(amax)[..., None], -FP4_MAX, FP4_MAX)).reshape(x.shape)
    return codes, pow2_ceil_exponent(amax) + 127
