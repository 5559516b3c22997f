"""The fake-quantisers V4.1 applies in its forward pass (QAT; MODEL_SPEC §3.5).

They are part of the model: the window KV is FP8 (block 32, UE8M0 scales), the
compressed KV is NVFP4 (block 16, E4M3 scales) and the indexer queries and keys are
FP4 (block 32, UE8M0). Each function returns the dequantised values, which is exactly
what a serving path storing the real bytes plus scales reads back; training differentiates
each straight through (``pallas_kernels.qat``). A trailing
dimension that the block does not divide is left unquantised, as in the reference.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.block_scaled import (FP8_MAX, NVFP4_BLOCK, e2m1_value, mxfp4_parts, nvfp4_parts,
                                        pow2_from_exponent, pow2_scale, ue8m0)
from pallas_kernels.qat import straight_through

def _blocks(x: jnp.ndarray, block: int) -> jnp.ndarray:
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_block32_parts(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The stored form of the window-KV quantiser: e4m3 values ``[..., D]`` and one
    power-of-two fp32 scale per 32 channels ``[..., D / 32]`` (what fp8 KV kernels read)."""
    b = _blocks(x, 32)
    scale = pow2_scale(jnp.maximum(jnp.abs(b).max(-1, keepdims=True), 1e-4), FP8_MAX)
    q = jnp.clip(b / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), scale[..., 0]


def fp8_block32_stored(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """What an fp8 KV store keeps (MODEL_SPEC §3.5): e4m3 values and each scale's UE8M0
    exponent byte ``[..., D / 32]`` (the scale is ``2**(e - 127)``)."""
    q, scale = fp8_block32_parts(x)
    return q, ue8m0(scale)


@straight_through
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


@straight_through
def fp4_block32(x: jnp.ndarray) -> jnp.ndarray:
    """Indexer q/k quantiser: e2m1 with one power-of-two scale per 32 channels (MXFP4)."""
    if not fp4_block32_active(x.shape[-1]):
        return x
    codes, exponents = mxfp4_parts(x)
    scale = jnp.repeat(pow2_from_exponent(exponents), 32, axis=-1)
    return (e2m1_value(codes) * scale).astype(x.dtype)


@straight_through
def nvfp4_block16(x: jnp.ndarray) -> jnp.ndarray:
    """Compressed-KV quantiser: e2m1 with one e4m3 scale per 16 channels."""
    if x.shape[-1] % NVFP4_BLOCK:
        return x
    codes, scale = nvfp4_parts(x)
    return (e2m1_value(codes) * jnp.repeat(scale, NVFP4_BLOCK, axis=-1)).astype(x.dtype)
