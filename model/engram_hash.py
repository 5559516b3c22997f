"""Engram n-gram hashing on the device, in 32-bit arithmetic (MODEL_SPEC §3.10).

The reference hashes with int64 products ``id * M`` XOR-ed together and reduced modulo
per-column primes. JAX runs 32-bit by default, and the hash must run inside the jitted
step (with overlap scheduling and speculative verification the newest ids exist only on
the device), so the 64-bit values are carried as four 16-bit limbs in uint32 lanes:

* products: schoolbook multiplication of 2 id limbs by 4 multiplier limbs, carrying the
  16-bit halves of each partial product into their columns (no column can overflow);
* XOR: limb-wise;
* modulo: the value is a sum of 8 bytes times ``2**(8b) mod p`` (host constants), each
  term below ``2**32`` because every prime is below ``2**24`` (checked).

Inputs are compressed ids with blocked look-backs already replaced by the pad id.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig

DEAD = -1  # look-back slot with no token (sequence start, or a dead image/pad token)


@dataclass(frozen=True)
class EngramHashTables:
    """Host constants of the hash: multiplier limbs, primes, byte weights and offsets."""

    mult_limbs: np.ndarray  # uint32 [L, N, 4]
    primes: np.ndarray  # uint32 [L, N-1, heads]
    byte_weights: np.ndarray  # uint32 [L, N-1, heads, 8]: 2**(8b) mod prime
    offsets: np.ndarray  # int32 [L, (N-1)*heads]
    pad_id: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "EngramHashTables":
        mult = cfg.engram_multipliers.astype(np.uint64)
        limbs = np.stack([(mult >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(4)], -1)
        primes = np.asarray(cfg.engram_primes, dtype=np.int64)
        if primes.size and primes.max() >= 2**24:
            raise ValueError("engram primes must be below 2**24 for the 32-bit hash")
        weights = np.array([[[[pow(2, 8 * b, int(p)) for b in range(8)] for p in heads] for heads in layer]
                            for layer in primes.tolist()], dtype=np.int64).reshape(primes.shape + (8,))
        return cls(limbs.astype(np.uint32), primes.astype(np.uint32), weights.astype(np.uint32),
                   cfg.engram_offsets.astype(np.int32), cfg.engram_pad_id)


def _mul_limbs(ids: jnp.ndarray, m: jnp.ndarray) -> list[jnp.ndarray]:
    """64-bit product of uint32 ``ids`` and multipliers given as 4 limbs, as 4 limbs."""
    a = (ids & 0xFFFF, ids >> 16)
    cols = [jnp.zeros_like(ids) for _ in range(5)]
    for i, ai in enumerate(a):
        for j in range(4 - i):
            p = ai * m[..., j]
            cols[i + j] = cols[i + j] + (p & 0xFFFF)
            cols[i + j + 1] = cols[i + j + 1] + (p >> 16)
    for k in range(4):
        cols[k + 1] = cols[k + 1] + (cols[k] >> 16)
        cols[k] = cols[k] & 0xFFFF
    return cols[:4]


def _mod_limbs(limbs: list[jnp.ndarray], prime: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    total = jnp.zeros_like(prime)
    for k, limb in enumerate(limbs):
        for half in range(2):
            byte = (limb >> (8 * half)) & 0xFF
            total = total + (byte * weights[..., 2 * k + half]) % prime
    return total % prime


def engram_hash(lookback: jnp.ndarray, tables: EngramHashTables) -> jnp.ndarray:
    """Table row ids ``[T, L, (N-1)*heads]`` (offsets added) from look-back ids ``[T, N]``.

    ``lookback[:, s]`` is the compressed id of the token ``s`` positions back (pad if blocked).
    """
    ids = lookback.astype(jnp.uint32)
    m = jnp.asarray(tables.mult_limbs)  # [L, N, 4]
    n_layers, n = m.shape[:2]
    products = [_mul_limbs(ids[:, None, s], m[None, :, s]) for s in range(n)]  # each 4 x [T, L]
    rolling = products[0]
    columns = []
    for i in range(1, n):
        rolling = [r ^ p for r, p in zip(rolling, products[i])]
        prime = jnp.asarray(tables.primes)[None, :, i - 1]  # [1, L, heads]
        weights = jnp.asarray(tables.byte_weights)[None, :, i - 1]  # [1, L, heads, 8]
        columns.append(_mod_limbs([r[..., None] for r in rolling], prime, weights))
    rows = jnp.concatenate(columns, axis=-1).astype(jnp.int32)
    return rows + jnp.asarray(tables.offsets)[None]


def lookback_ids(comp: jnp.ndarray, history: jnp.ndarray, seq_ids: jnp.ndarray, positions: jnp.ndarray,
                 starts: jnp.ndarray, pad_id: int, n: int) -> jnp.ndarray:
    """``[T, n]`` look-back compressed ids for a ragged batch.

    ``comp`` [T] compressed ids of this step's tokens; ``history`` [B, n-1] the last
    compressed ids of each request before this step (newest last, ``DEAD`` if none);
    ``starts`` [B] each request's first position in this step. A look-back is blocked at
    the sequence start or a dead token, and everything deeper stays blocked.
    """
    t = jnp.arange(comp.shape[0])
    b = jnp.maximum(seq_ids, 0)
    start = starts[b]
    out, blocked = [], jnp.zeros(comp.shape, bool)
    for s in range(n):
        src = positions - s
        in_step = src >= start
        hist_slot = jnp.clip(n - 1 - (start - src), 0, n - 2) if n > 1 else jnp.zeros_like(src)
        value = jnp.where(in_step, comp[jnp.clip(t - s, 0)], history[b, hist_slot])
        blocked = blocked | (src < 0) | (value == DEAD)
        out.append(jnp.where(blocked, pad_id, value))
    return jnp.stack(out, axis=-1)
