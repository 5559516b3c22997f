"""RoPE for V4.1: two frequency tables and an interleaved-pair rotation of the trailing slice.

``main`` (ratio-0 layers) is plain RoPE; ``compress`` (every layer with a compressed
branch) is YaRN over a larger base with ``attention_factor`` 1.0, so cos/sin are not
rescaled. Only the trailing ``rope_dim`` channels rotate, as adjacent (even, odd) pairs
(MODEL_SPEC §3.4). Tables are computed in float32 on the host exactly as the reference;
the rotation itself is ``mega.primitives.apply_rope`` (the attention op fuses it).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig


def inv_freq(cfg: ModelConfig, kind: str) -> np.ndarray:
    """``[rope_dim // 2]`` float32 inverse frequencies of the ``main`` or ``compress`` table."""
    params = cfg.rope_parameters[kind]
    dim = cfg.rope_dim
    base = float(params["rope_theta"])
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if params.get("rope_type", "default") == "default":
        return extrapolation
    if params["rope_type"] != "yarn":
        raise ValueError(f"unsupported rope_type {params['rope_type']!r} for the {kind} table")
    factor = float(params["factor"])
    original = float(params["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(correction_dim(float(params.get("beta_fast", 32)))), 0)
    hi = min(math.ceil(correction_dim(float(params.get("beta_slow", 1)))), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(lo)) / np.float32(hi - lo), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def cos_sin(freqs: jnp.ndarray, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin ``[..., rope_dim // 2]`` at integer ``positions`` (float32 products, like the reference)."""
    angles = positions.astype(jnp.float32)[..., None] * freqs.astype(jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)
