"""Small shared math of the reference paths: linear layers, RMSNorm and the RoPE rotation."""
from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def linear(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """``x @ w.T`` for an HF-layout ``[out, in]`` weight, accumulated in fp32."""
    return jnp.einsum("...i,oi->...o", x, w, precision=HIGHEST, preferred_element_type=jnp.float32)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray | None, eps: float) -> jnp.ndarray:
    """``weight * (x * rsqrt(mean(x**2) + eps))`` over the last axis; unweighted when ``weight`` is None.

    The statistic is fp32 and the normalised value is cast back before the weight, as in the reference;
    the weight multiplies in fp32 (the released norms are bf16 but used in fp32).
    """
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else (weight.astype(jnp.float32) * y).astype(x.dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, inverse: bool = False) -> jnp.ndarray:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` as interleaved pairs.

    ``cos``/``sin`` broadcast against ``x[..., :half]``'s leading axes; pass ``[T, 1, half]``
    for ``x`` of shape ``[T, H, D]``.
    """
    if inverse:
        sin = -sin
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)
