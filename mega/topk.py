"""Per-row thresholds and exact top-k sets found by a search over float bit patterns, not a sort.

XLA lowers ``lax.top_k`` at the indexer's k = 512 to a segmented radix sort on the GPU (two cub
kernels, 0.83 ms of a 3.9 ms decode step in bench/RESULTS.md). The indexer needs the chosen
set, not its order. :func:`top_k_set` is the candidate replacement (the model calls it only
once ``bench/topk_gpu.py`` has timed it on the GPU). It finds each row's k-th largest value
by a radix search over the uint32 keys that order float32 values (:func:`largest_threshold`:
8 rounds, each fixing 4 bits by counting against 15 candidates in one fused
compare-and-reduce), breaks ties at it towards lower indices as ``lax.top_k`` does, and
compacts the chosen entries in index order with a cumsum. The sampler's top-k/top-p
thresholds use the same search.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def ordered_key(x: jax.Array, merge_zeros: bool = True) -> jax.Array:
    """float32 -> uint32 with the same order; -0 below +0 unless merged (the sort order of
    ``lax.top_k``)."""
    x = x.astype(jnp.float32)
    u = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x) if merge_zeros else x, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def largest_threshold(keys: jax.Array, weights: jax.Array | None, target: jax.Array) -> jax.Array:
    """Per row of ``keys [B, N]``, the largest t with sum(weights[keys >= t]) >= target (a count
    if weights is None).

    The sum is monotone in t, so 4 bits of t are fixed per round by testing 15 candidates at once.
    """
    t = jnp.zeros(keys.shape[:1], jnp.uint32)
    digits = jnp.arange(1, 16, dtype=jnp.uint32)
    for shift in range(28, -1, -4):  # static: 8 rounds
        cand = t[:, None] | (digits << shift)[None, :]  # [B, 15], increasing
        ge = keys[:, :, None] >= cand[:, None, :]  # [B, N, 15], fused into the reduction
        mass = ge.sum(1) if weights is None else jnp.where(ge, weights[:, :, None], 0.0).sum(1)
        t = t | ((mass >= target[:, None]).sum(1).astype(jnp.uint32) << shift)
    return t


def top_k_set(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``(values, indices)``, each ``[B, k]``: the same entries of ``x [B, N]`` (float, k <= N)
    as ``lax.top_k`` picks, ties included (the lower index first), in increasing index order."""
    b, n = x.shape
    if not 0 < k <= n:
        raise ValueError(f"k must be in 1..{n}, got {k}")
    keys = ordered_key(x, merge_zeros=False)
    kth = largest_threshold(keys, None, jnp.full((b,), k, jnp.int32))[:, None]
    above, tied = keys > kth, keys == kth
    room = k - above.sum(-1, keepdims=True)  # how many of the tied entries are taken
    take = above | (tied & (jnp.cumsum(tied, -1) <= room))
    slot = jnp.where(take, jnp.cumsum(take, -1) - 1, k)  # k: dropped
    ids = jnp.zeros((b, k), jnp.int32).at[jnp.arange(b)[:, None], slot].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), mode="drop")
    return jnp.take_along_axis(x, ids, -1), ids
