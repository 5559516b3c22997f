"""Block-scaled number formats: their types, quantisers and the one power-of-two scale rule.

The model's fake-quantisers (``model.quant``), the checkpoint codecs (``checkpoints.formats``)
and the kernels all read and write these; nothing here is kernel code.

* MXFP4 (OCP microscaling FP4; V4.1's routed experts, MODEL_SPEC §2): e2m1 values with one
  UE8M0 scale per 32. ``mxfp4_parts`` quantises; ``Fp4Weight`` is the kernels' form.
* FP8 weights in 128 x 128 blocks (DeepSeek's block-scaled linears): ``QuantizedWeight``.
* FP8 activation rows, one scale per row per 128 columns (the W8A8 kernels' input):
  ``Fp8Rows``.
* FP8 KV rows, one UE8M0 scale per 32 channels (the window KV, MODEL_SPEC §3.5): ``Fp8Pool``.
* FP4 rows as pools store them (``Fp4Rows``): one UE8M0 scale per 32 channels (the indexer's
  keys, ``Fp4Keys``), or NVFP4, one e4m3 scale per 16 (the compressed KV, ``Nvfp4Rows``); a
  pool of the latter read by MegaAttention is an ``Nvfp4Pool``.

The scale rule (``scale_exponent``): a block's scale is the smallest power of two ``2**e`` with
``amax / 2**e <= `` the format's largest value, ``e`` computed from the IEEE bits, so XLA, the
kernels' epilogues and NumPy agree bit for bit where a division or ``log2`` may round. A UE8M0
byte stores ``e + 127``.

An e2m1 code is 4 bits: sign, then a 2-bit exponent E and a 1-bit mantissa m; its magnitude
is ``2^(E-1) (1 + m/2)`` for E > 0 and ``m/2`` for E = 0 (``E2M1``). Codes are kept as
``jnp.int4`` whose bits are the code (HF checkpoints pack two per byte, low nibble first,
which ``jax.lax.bitcast_convert_type(packed, jnp.int4)`` unpacks in that order).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.qat import straight_through

FP4, FP8, NVFP4 = "fp4", "fp8", "nvfp4"   # the stored formats' kinds (``stored_kind``)

FP8_MAX = 448.0   # e4m3fn's largest finite value
BLOCK = 32   # MX block: values per UE8M0 scale
FP4_MAX = 6.0
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# thresholds between neighbouring magnitudes; a tie goes to the even code (mantissa bit 0),
# so it rounds up (>=) where the upper code is even
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
# ``fp4.e2m1_f16`` (the kernels' conversion) moves E and m to f16's lowest exponent bits and
# its top mantissa bit, which gives the e2m1 value times 2^-14 (E = 0 lands on f16's subnormal
# 2^-14 * m/2, with the same factor)
F16_SHIFT = 14


def scale_exponent(amax: jnp.ndarray, fmt_max: float) -> jnp.ndarray:
    """``ceil(log2(amax / fmt_max))`` (int32) for positive normal float32 ``amax``: the exponent
    of the smallest power-of-two scale that takes ``amax`` to at most ``fmt_max``, from the IEEE
    bits (no division, no ``log2``)."""
    top = int(np.float32(fmt_max).view(np.int32))
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    return (((bits >> 23) & 0xFF) - ((top >> 23) & 0xFF)
            + ((bits & 0x7FFFFF) > (top & 0x7FFFFF)).astype(jnp.int32))


def pow2_ceil_exponent(t: jnp.ndarray) -> jnp.ndarray:
    """``ceil(log2 t)`` (int32, clipped to [-126, 127]) for positive float32 ``t``."""
    return jnp.clip(scale_exponent(t, 1.0), -126, 127)


def pow2_from_exponent(e: jnp.ndarray) -> jnp.ndarray:
    """``2**(e - 127)`` (float32) of UE8M0 exponents in [1, 254], built from the IEEE bits: exp2
    is not exact on every backend."""
    return jax.lax.bitcast_convert_type(e.astype(jnp.int32) << 23, jnp.float32)


def pow2_scale(amax: jnp.ndarray, fmt_max: float) -> jnp.ndarray:
    """The power-of-two scale (float32) of ``scale_exponent``."""
    return pow2_from_exponent(scale_exponent(amax, fmt_max) + 127)


def fp8_scale_exponent(amax: jnp.ndarray) -> jnp.ndarray:
    """``scale_exponent`` of e4m3 blocks (an all-zero block gets a tiny scale, not 0)."""
    return scale_exponent(jnp.maximum(amax, 1e-30), FP8_MAX)


def fp8_scale(amax: jnp.ndarray) -> jnp.ndarray:
    return pow2_from_exponent(fp8_scale_exponent(amax) + 127)


def ue8m0(scale: jnp.ndarray) -> jnp.ndarray:
    """Power-of-two fp32 scales -> their UE8M0 exponent bytes (``2**(e - 127)``)."""
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF).astype(jnp.uint8)


def scale_values(s: jnp.ndarray) -> jnp.ndarray:
    """float32 block scales from UE8M0 exponent bytes (uint8: ``2**(e - 127)``) or stored floats
    (e4m3 ones included)."""
    return pow2_from_exponent(s) if s.dtype == jnp.uint8 else s.astype(jnp.float32)


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


def e2m1_scaled(code: jax.Array, exponent: jax.Array) -> jax.Array:
    """``e2m1_value(code) * 2**(exponent - 127)`` (a UE8M0 scale) for kernels, built as IEEE bits
    (Triton has no gather from a constant table, and bits take fewer instructions than
    arithmetic): magnitude codes 2-7 are ``2**(e - 1) * (1 + m/2)``, whose exponent and mantissa
    bits are the code's three bits shifted in; code 1 is 0.5; 0 is 0. Exact for exponents in
    [2, 252] (the keys' scales)."""
    em = code & 7
    bits = ((exponent - 1) << 23) + jnp.where(em >= 2, em << 22, 0)
    bits = jnp.where(em == 0, 0, bits) | ((code & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def mxfp4_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 quantisation of ``[..., K]`` (K % 32 == 0) in column order: int32 e2m1 codes and
    each 32-block's UE8M0 exponent (int32; the scale is the power of two at or above amax / 6,
    MODEL_SPEC §3.5's FP4 block-32 rule)."""
    *lead, k = x.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension divisible by {BLOCK}, got {x.shape}")
    b = x.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK)
    e = scale_exponent(jnp.maximum(jnp.abs(b).max(-1), FP4_MAX * 2.0 ** -126), FP4_MAX)
    codes = e2m1_code(jnp.clip(b / pow2_from_exponent(e + 127)[..., None], -FP4_MAX, FP4_MAX)).reshape(x.shape)
    return codes, e + 127


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


class Fp4Weight(NamedTuple):
    """An MXFP4 weight stack ``[..., N, K]`` in the kernels' form: ``codes [..., N, K]`` int4,
    each 32-block in the kernel's order (``to_kernel_order``); ``scale [..., K / 32, N]`` f16,
    each block's power-of-two scale relative to its matrix's largest, times 2^F16_SHIFT
    (undoing ``fp4.e2m1_f16``'s factor), transposed so that a kernel step's slice is one TMA tile;
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


def e4m3_rounded(v: jnp.ndarray) -> jnp.ndarray:
    """float32 ``v`` (within +-448) rounded to e4m3fn's grid, as float32: 3 mantissa bits from
    2^-6 up (``reduce_precision`` with a wider exponent, which XLA on the GPU keeps where it
    drops a convert to fp8 and back), a fixed 2^-9 step below."""
    return jnp.where(jnp.abs(v) < 2.0 ** -6, jnp.round(v * 2.0 ** 9) * 2.0 ** -9,
                     jax.lax.reduce_precision(v, exponent_bits=5, mantissa_bits=3))


def scale_row(n: int) -> int:
    """Length of a scale row of ``n`` entries padded to 128 bytes, since a TMA copy into
    shared memory must start at a 128-byte-aligned address (rows of several weights sit side
    by side)."""
    return n + -n % 32


class QuantizedWeight(NamedTuple):
    """An fp8 e4m3 expert stack ``q [E, N, K]`` with one power-of-two fp32 scale per 128 x 128
    block, ``scale [E, N / 128, K / 128]`` (DeepSeek's block-scaled layout): ``w = q * scale``.

    The kernels read the scales in a form derived once (``of``), so that no call pays for it:
    ``rel [E, N / 128, scale_row(K / 128)]``, each block's scale over the largest in its row
    of blocks, and that largest, ``largest [E, N / 128]``. A CTA's tile lies in one row of
    blocks (tiles divide 128) and spans all of K, so it loads that row once and its epilogue
    multiplies by that largest."""
    q: jax.Array
    scale: jax.Array
    rel: jax.Array
    largest: jax.Array

    @property
    def shape(self):
        return self.q.shape

    @classmethod
    def of(cls, q: jax.Array, scale: jax.Array) -> "QuantizedWeight":
        largest = scale.max(axis=-1)
        kb = scale.shape[-1]
        rel = jnp.pad(scale / largest[..., None], [(0, 0)] * (scale.ndim - 1) + [(0, scale_row(kb) - kb)])
        return cls(q, scale, rel, largest)

    @classmethod
    def from_float(cls, w: jax.Array) -> "QuantizedWeight":
        """Block-quantise ``[..., N, K]`` weights: power-of-two scale per 128 x 128 block."""
        *lead, n, k = w.shape
        blocks = w.astype(jnp.float32).reshape(*lead, n // 128, 128, k // 128, 128)
        scale = fp8_scale(jnp.abs(blocks).max(axis=(-3, -1)))
        full = jnp.repeat(jnp.repeat(scale, 128, axis=-2), 128, axis=-1)
        return cls.of((w / full).astype(jnp.float8_e4m3fn), scale)

    def dequantized(self, dtype=jnp.float32):
        s = jnp.repeat(jnp.repeat(self.scale, 128, axis=-2), 128, axis=-1)
        return (self.q.astype(jnp.float32) * s).astype(dtype)

    def swapped(self):
        return self._replace(q=jnp.swapaxes(self.q, 1, 2))


class Fp8Rows(NamedTuple):
    """Activation rows in fp8 for the W8A8 kernels (the block-fp8 MoE of DeepGEMM and SGLang):
    e4m3 ``q [M, K]`` with one power-of-two scale per row per 128 columns, kept transposed,
    ``scale [K / 128, M]``, so that a CTA's rows of it are one TMA box."""
    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.q.shape

    @classmethod
    def from_float(cls, x: jax.Array) -> "Fp8Rows":
        m, k = x.shape
        blocks = x.astype(jnp.float32).reshape(m, k // 128, 128)
        scale = fp8_scale(jnp.abs(blocks).max(axis=-1))
        return cls((blocks / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(m, k), scale.T)

    def dequantized(self, dtype=jnp.float32):
        m, k = self.q.shape
        blocks = self.q.astype(jnp.float32).reshape(m, k // 128, 128) * self.scale.T[..., None]
        return blocks.reshape(m, k).astype(dtype)

    @staticmethod
    @straight_through
    def rounded(x: jax.Array) -> jax.Array:
        """``from_float(x).dequantized(x.dtype)`` for the references, without an fp8 array (XLA
        on the GPU drops a convert to fp8 and back inside a fusion): ``e4m3_rounded``."""
        m, k = x.shape
        blocks = x.astype(jnp.float32).reshape(m, k // 128, 128)
        scale = fp8_scale(jnp.abs(blocks).max(axis=-1))[..., None]
        return (e4m3_rounded(blocks / scale) * scale).reshape(m, k).astype(x.dtype)


class Fp8Pool(NamedTuple):
    """An fp8 KV pool (MODEL_SPEC §3.5, FP8 block 32 UE8M0): row ``r`` of K = V is
    ``kv[r, c] * 2**(scale[r, c // 32] - 127)``. ``kv`` [N, D] float8_e4m3fn, ``scale``
    [N, D // 32] uint8 exponents, ``idx`` [T, S] int32 in [-1, N). A plain 3-tuple
    ``(kv, scale, idx)`` is the same thing; a bf16 pool is the 2-tuple ``(kv, idx)``."""
    kv: jax.Array
    scale: jax.Array
    idx: jax.Array


class Nvfp4Pool(NamedTuple):
    """An NVFP4 KV pool (MODEL_SPEC §3.5's compressed KV) as MegaAttention reads it: row ``r`` of
    K = V is ``Nvfp4Rows(codes, scale)``'s row ``r``; ``codes`` [N, D / 2] uint8, ``scale``
    [N, D / 16] float8_e4m3fn, ``idx`` [T, S] int32 in [-1, N)."""
    codes: jax.Array
    scale: jax.Array
    idx: jax.Array


def pack_halves(codes: jax.Array, parts: int = 1) -> jax.Array:
    """e2m1 codes ``[..., d]`` -> bytes ``[..., d / 2]``: the channels cut into ``parts`` equal
    slices, each packed as its first half's codes in the low nibbles and its second half's in the
    high ones, so that every slice is one contiguous run of bytes and a kernel decodes each nibble
    into a contiguous run of channels (no interleave)."""
    *lead, d = codes.shape
    c = (codes.astype(jnp.int32) & 15).reshape(*lead, parts, 2, d // (2 * parts))
    return (c[..., 0, :] | (c[..., 1, :] << 4)).astype(jnp.uint8).reshape(*lead, d // 2)


def unpack_halves(packed: jax.Array, parts: int = 1) -> jax.Array:
    """The inverse of ``pack_halves``: int32 codes ``[..., 2 n]``."""
    *lead, n = packed.shape
    b = packed.astype(jnp.int32).reshape(*lead, parts, 1, n // parts)
    return jnp.concatenate([b & 15, b >> 4], axis=-2).reshape(*lead, 2 * n)


class Fp4Rows(NamedTuple):
    """Rows of block-scaled FP4 as a pool stores them: ``codes [..., d / 2]`` uint8
    (``pack_halves`` in ``PARTS`` slices) and one scale per ``BLOCK`` channels, ``scale``.
    The formats subclass it (``Fp4Keys``, ``Nvfp4Rows``)."""
    codes: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The values' shape: ``[..., d]``."""
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        values = e2m1_value(unpack_halves(self.codes, self.PARTS))
        return (values * jnp.repeat(scale_values(self.scale), self.BLOCK, axis=-1)).astype(dtype)

    def at_rows(self, rows: jax.Array):
        return type(self)(self.codes[rows], self.scale[rows])

    def set_rows(self, rows: jax.Array, x: jax.Array):
        """``x`` ([n, d]) quantised (``from_float``) and stored at ``rows`` (out of range: dropped)."""
        new = self.from_float(x)
        return type(self)(self.codes.at[rows].set(new.codes, mode="drop"),
                          self.scale.at[rows].set(new.scale, mode="drop"))


class Fp4Keys(Fp4Rows):
    """Rows of FP4 block-32 values (MODEL_SPEC §3.5's indexer keys; 68 bytes a row at 128
    channels, against 256 in bf16): byte ``j`` of ``codes`` holds channel ``j``'s e2m1 code in its
    low nibble and channel ``j + d / 2``'s in its high (``pack_halves``, one slice); ``scale
    [..., d / 32]`` uint8 UE8M0 exponents. Storing a row already on the grid
    (``model.quant.fp4_block32``'s output) loses nothing: its values come back bit for bit."""
    __slots__ = ()
    KIND = FP4
    PARTS, BLOCK = 1, BLOCK

    @classmethod
    def zeros(cls, rows: int, width: int) -> "Fp4Keys":
        return cls(jnp.zeros((rows, width // 2), jnp.uint8), jnp.full((rows, width // BLOCK), 127, jnp.uint8))

    @classmethod
    def from_float(cls, x: jax.Array) -> "Fp4Keys":
        codes, exponents = mxfp4_parts(x)
        return cls(pack_halves(codes), exponents.astype(jnp.uint8))


NVFP4_BLOCK = 16   # NVFP4: values per e4m3 scale


def nvfp4_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4 quantisation of ``[..., K]`` (K % 16 == 0; MODEL_SPEC §3.5's compressed-KV rule):
    int32 e2m1 codes and each 16-block's scale ``e4m3(max(amax, 6 * 2^-9) / 6)`` as float32."""
    *lead, k = x.shape
    b = x.astype(jnp.float32).reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK)
    # (held at e4m3's largest, 448: a stored scale past it would be NaN)
    scale = e4m3_rounded(jnp.minimum(jnp.maximum(jnp.abs(b).max(-1), FP4_MAX * 2.0 ** -9) / FP4_MAX, FP8_MAX))
    codes = e2m1_code(jnp.clip(b / scale[..., None], -FP4_MAX, FP4_MAX)).reshape(x.shape)
    return codes, scale


class Nvfp4Rows(Fp4Rows):
    """Rows of NVFP4 values (MODEL_SPEC §3.5's compressed KV: 288 bytes a 512-channel row, the
    256 + 32 of vLLM's and SGLang's records, against 1,024 in bf16): ``codes [..., d / 2]`` uint8
    packed in two slices (``pack_halves``: each half of the channels, which one compute warpgroup
    of MegaAttention owns, is one run of bytes); ``scale [..., d / 16]`` float8_e4m3fn. The values
    come back as ``model.quant.nvfp4_block16`` gives them, bit for bit."""
    __slots__ = ()
    KIND = NVFP4
    PARTS, BLOCK = 2, NVFP4_BLOCK

    @classmethod
    def zeros(cls, rows: int, width: int) -> "Nvfp4Rows":
        return cls(jnp.zeros((rows, width // 2), jnp.uint8), jnp.zeros((rows, width // NVFP4_BLOCK), jnp.float8_e4m3fn))

    @classmethod
    def from_float(cls, x: jax.Array) -> "Nvfp4Rows":
        if x.shape[-1] % (2 * NVFP4_BLOCK):
            raise ValueError(f"NVFP4 rows need channels in 32s (two halves of whole blocks), got {x.shape}")
        codes, scale = nvfp4_parts(x)
        return cls(pack_halves(codes, cls.PARTS), scale.astype(jnp.float8_e4m3fn))


def e4m3_from_bits(b: jax.Array) -> jax.Array:
    """float32 values of e4m3fn bytes held as int32 (no NaN), from the IEEE bits, for kernels
    that hold the bytes as integers: ``2^(E - 7) (1 + m/8)``, or ``2^-6 m/8`` for E = 0 (the
    E = 1 value less 2^-6)."""
    e, m = (b >> 3) & 15, b & 7
    v = jax.lax.bitcast_convert_type(((jnp.maximum(e, 1) + 120) << 23) | (m << 20), jnp.float32)
    v = jnp.where(e == 0, v - 2.0 ** -6, v)
    return jnp.where((b & 128) != 0, -v, v)


def stored_kind(pool) -> str:
    """How a pool stores its rows: its stored format's ``KIND`` (``Fp4Keys``: ``FP4``,
    ``Nvfp4Rows``: ``NVFP4``, ``model.state.Fp8Ring``: ``FP8``) or its values' dtype name."""
    return getattr(type(pool), "KIND", None) or jnp.dtype(pool.dtype).name


def dequantize_fp8(kv, scale):
    """``kv[..., c] * 2**(scale[..., c // 32] - 127)`` in fp32 (exact: e4m3 times a power of two)."""
    *lead, d = kv.shape
    s = pow2_from_exponent(scale)
    return (kv.astype(jnp.float32).reshape(*lead, d // 32, 32) * s[..., None]).reshape(*lead, d)
