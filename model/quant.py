"""The fake-quantisers V4.1 applies in its forward pass (QAT; MODEL_SPEC §3.5).

They are part of the model: the window KV is FP8 (block 32, UE8M0 scales), the
compressed KV is NVFP4 (block 16, E4M3 scales) and the indexer queries and keys are
FP4 (block 32, UE8M0). Each function returns the dequantised values, which is exactly
what a serving path storing the real bytes plus scales reads back. A trailing
dimension that the block does not divide is left unquantised, as in the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention import ue8m0

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes, and the thresholds between neighbours: ties round to the even code,
# so a tie at an odd/even boundary goes up (>=) when the upper code is even.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def pow2_ceil(t: jnp.ndarray) -> jnp.ndarray:
    """``2**ceil(log2 t)`` for positive float32 ``t``, from the IEEE bits (the UE8M0 scale)."""
    bits = jax.lax.bitcast_convert_type(t.astype(jnp.float32), jnp.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    # Build 2**k from its exponent bits: exp2 is not exact on every backend.
    return jax.lax.bitcast_convert_type((jnp.clip(k, -126, 127) + 127) << 23, jnp.float32)


def e2m1_round(q: jnp.ndarray) -> jnp.ndarray:
    """Round pre-clamped float32 values to the e2m1 grid, ties to even."""
    mag = jnp.abs(q)
    code = jnp.zeros(q.shape, jnp.int32)
    for bound, up in zip(_E2M1_BOUNDS, _TIE_UP):
        b = jnp.float32(bound)
        code += (mag >= b if up else mag > b).astype(jnp.int32)
    value = jnp.asarray(_E2M1)[code]
    return jnp.where(jnp.signbit(q), -value, value)


def _blocks(x: jnp.ndarray, block: int) -> jnp.ndarray:
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_block32_parts(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The stored form of the window-KV quantiser: e4m3 values ``[..., D]`` and one
    power-of-two fp32 scale per 32 channels ``[..., D / 32]`` (what fp8 KV kernels read)."""
    b = _blocks(x, 32)
    scale = pow2_ceil(jnp.maximum(jnp.abs(b).max(-1, keepdims=True), 1e-4) * (1.0 / FP8_MAX))
    q = jnp.clip(b / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), scale[..., 0]


def fp8_block32_stored(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """What an fp8 KV store keeps (MODEL_SPEC §3.5): e4m3 values and each scale's UE8M0
    exponent byte ``[..., D / 32]`` (the scale is ``2**(e - 127)``)."""
    q, scale = fp8_block32_parts(x)
    return q, ue8m0(scale)


def fp8_block32(x: jnp.ndarray) -> jnp.ndarray:
    """Window-KV quantiser: e4m3 with one power-of-two scale per 32 channels."""
    if x.shape[-1] % 32:
        return x
    q, scale = fp8_block32_parts(x)
    return (_blocks(q, 32) * scale[..., None]).reshape(x.shape).astype(x.dtype)


def fp4_block32_active(dim: int) -> bool:
    """Whether ``fp4_block32`` quantises vectors of ``dim`` channels (it passes others through:
    MODEL_SPEC §11.3)."""
    return dim % 32 == 0


def fp4_block32(x: jnp.ndarray) -> jnp.ndarray:
    """Indexer q/k quantiser: e2m1 with one power-of-two scale per 32 channels."""
    if not fp4_block32_active(x.shape[-1]):
        return x
    b = _blocks(x, 32)
    scale = pow2_ceil(jnp.maximum(jnp.abs(b).max(-1, keepdims=True), FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
    q = e2m1_round(jnp.clip(b / scale, -FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)


def nvfp4_block16(x: jnp.ndarray) -> jnp.ndarray:
    """Compressed-KV quantiser: e2m1 with one e4m3 scale per 16 channels."""
    if x.shape[-1] % 16:
        return x
    b = _blocks(x, 16)
    amax = jnp.maximum(jnp.abs(b).max(-1, keepdims=True), FP4_MAX * 2.0**-9)
    scale = (amax / FP4_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    q = e2m1_round(jnp.clip(b / scale, -FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)
