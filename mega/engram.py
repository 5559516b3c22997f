"""Engram: gated injection of n-gram table rows into the hyper-connection streams (§3.10).

``lookup_rows`` gathers the hashed rows and ``dequantised`` turns them into floats (fp8 tables
with their per-32 scales; float tables as stored); the caller looks them up where its table lives
(``sharding.engram_tables``). The op projects them with ``wkv`` into one key per stream plus
a shared value, and adds ``g_k * v`` to each stream with the signed-sqrt sigmoid gate.
The injection sits between the previous sublayer's expand and the next site's mix, so the
caller applies the pending update first (``hc_expand``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mega.primitives import linear
from pallas_kernels.block_scaled import scale_values


def lookup_rows(table: jnp.ndarray, scale: jnp.ndarray, hash_ids: jnp.ndarray) -> jnp.ndarray:
    """``[T, cols * head_dim]`` float32 rows for ``hash_ids [T, cols]`` (an e4m3 table's scales:
    UE8M0 bytes, as the release stores them, or floats)."""
    return dequantised(table[hash_ids], scale[hash_ids])


def dequantised(rows: jnp.ndarray, scales: jnp.ndarray) -> jnp.ndarray:
    """``[T, cols * head_dim]`` float32 of gathered rows ``[T, cols, head_dim]`` and their scales
    (read only for e4m3 rows)."""
    if rows.dtype == jnp.float8_e4m3fn:
        block = rows.shape[-1] // scales.shape[-1]
        rows = (rows.astype(jnp.float32).reshape(*rows.shape[:-1], -1, block)
                * scale_values(scales)[..., None]).reshape(rows.shape)
    return rows.astype(jnp.float32).reshape(rows.shape[0], -1)


@jax.named_scope("engram")  # prefixes its ops' names in HLO dumps and XProf
def engram(residual: jnp.ndarray, rows: jnp.ndarray, p: dict, *, eps: float) -> jnp.ndarray:
    """Streams ``[T, hc, D]`` after the Engram injection of ``rows`` (``lookup_rows`` of the
    tokens' hashed ids in ``p``'s table)."""
    t, hc, d = residual.shape
    # With a bf16 wkv and a bf16 table, or an e4m3 one with its power-of-two (UE8M0) scales,
    # every operand is exact in bf16: the projection then runs on bf16 operands with fp32
    # accumulation (the tensor cores, not fp32 FMAs: on the H200, a 4096-token step's projection
    # took 4.2 ms in fp32 and about 0.34 ms so) and differs from the fp32 product only in
    # summation order.
    exact = p["wkv"].dtype == jnp.bfloat16 and p["table"].dtype in (jnp.bfloat16, jnp.float8_e4m3fn)
    kv = linear(rows.astype(jnp.bfloat16) if exact else rows, p["wkv"])
    key, value = kv[:, :hc * d].reshape(t, hc, d), kv[:, hc * d:]
    omega = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)
    h = residual.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(h * h, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(h * omega * key, -1) * rstd * d ** -0.5
    gate = jax.nn.sigmoid(jnp.where(jnp.signbit(dot), -1.0, 1.0) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
    return (h + gate[..., None] * value[:, None, :]).astype(residual.dtype)
