"""Top-k without sorting whole rows, and per-row thresholds from a search over float bit patterns.

XLA runs ``lax.top_k`` on the GPU with a selection kernel up to k = 16 and above that with a
full segmented radix sort (cub). The sampler's top-20 logprobs over a 129K vocabulary cost
0.83 ms of a 3.9 ms decode step that way (bench/RESULTS.md). :func:`top_k` gives the same
answer by a two-level selection: split the row into groups of 128, pick the k groups with the
largest maxima, then the top k of those k * 128 candidates. Both sorts are small.

Why it is exact: order entries by (value descending, index ascending), as ``lax.top_k`` does.
If entry e is among the top k, every group ranked above e's group (by its maximum, ties to
the lower group) holds its maximum, an entry ranked above e; there are at most k - 1 of
those, so e's group is among the top k groups. The chosen groups are put back in index
order, so ties among the candidates still go to the lower index. Values are compared as
int32 keys with the float32 total order (-0 below +0, as XLA's sorts order them: the CPU's
``lax.top_k`` and the GPU's above k = 16; the GPU's selection kernel may tie them).

Above k = ``GROUP`` (the indexer's top 512 of a long context's entries, where the two levels
would keep most of the row) it selects by a threshold instead (``_top_k_over_threshold``: why
that is exact is in its docstring): a pass for group maxima, a small sort of them, two prefix
sums and a compaction of at most (k - 1) x group candidates, whose top k is the answer.

The sampler's top-k/top-p thresholds use :func:`largest_threshold` over :func:`ordered_key`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from mega import backend

GROUP = 128  # entries per group in top_k's first level


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


def top_k(x: jax.Array, k: int, grouped: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` along the last axis of a float array without NaNs: the same values
    and int32 indices in the same order (see the module docstring). ``grouped``: select without
    sorting whole rows (``None``: on the GPU, whose ``lax.top_k`` sorts; the CPU's does not):
    two levels up to ``GROUP`` (the sampler's top logprobs), above that by a threshold (the
    indexer's top 512 of up to 131K entries)."""
    n = x.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"k must be in 0..{n}, got {k}")
    if grouped is None:
        grouped = backend.on_gpu()
    if not grouped or k == 0 or x.size == 0 or x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return lax.top_k(x, k)   # (other dtypes: no exact f32 key)
    keys = lax.bitcast_convert_type(ordered_key(x, merge_zeros=False) ^ jnp.uint32(0x80000000), jnp.int32)
    if k > GROUP:
        # groups of ~sqrt(n / k) balance the two sorts: n / g maxima and (k - 1) g candidates
        group = 1 << max(1, round(math.log2(n / k) / 2))
        if n // group + (k - 1) * group > n // 2:   # no cheaper than sorting the row
            return lax.top_k(x, k)
        return _top_k_over_threshold(x, keys, k, group)
    if n <= 2 * k * GROUP:   # the candidates would be most of the row
        return lax.top_k(x, k)
    groups = _grouped(keys, GROUP)
    chosen = jnp.sort(lax.top_k(groups.max(-1), k)[1], axis=-1)
    cand = jnp.take_along_axis(groups, chosen[..., None], axis=-2).reshape(*keys.shape[:-1], k * GROUP)
    pos = lax.top_k(cand, k)[1]
    idx = jnp.take_along_axis(chosen, pos // GROUP, axis=-1) * GROUP + pos % GROUP
    return jnp.take_along_axis(x, idx, axis=-1), idx


def _grouped(keys: jax.Array, group: int) -> jax.Array:
    """``keys [..., n]`` as ``[..., n / group, group]``, padded with the smallest int32: padding
    sorts last, and ties go to the lower (real) index."""
    pad = [(0, 0)] * (keys.ndim - 1) + [(0, -keys.shape[-1] % group)]
    return jnp.pad(keys, pad, constant_values=jnp.iinfo(jnp.int32).min).reshape(*keys.shape[:-1], -1, group)


def _top_k_over_threshold(x: jax.Array, keys: jax.Array, k: int, group: int) -> tuple[jax.Array, jax.Array]:
    """Top k by a threshold. ``t``, the k-th largest of the rows' ``group``-entry maxima, is at
    most the k-th largest key (the k groups at or above it hold k keys at least t). So the top
    k are the keys above t, or, if fewer than k are, those and the first keys equal to t. Keys
    above t lie in the at most k - 1 groups whose maximum is above t: at most (k - 1) x group
    candidates, packed in index order into as many slots, whose top k (ties to the lower index,
    as ``lax.top_k``) is the answer. Two sorts of about sqrt(n k) entries a row instead of n."""
    shape, n = x.shape, x.shape[-1]
    x, keys = x.reshape(-1, n), keys.reshape(-1, n)
    t = lax.top_k(_grouped(keys, group).max(-1), k)[0][:, -1:]
    above, level = keys > t, keys == t
    cand = above | (level & (jnp.cumsum(level, -1, dtype=jnp.int32) <= k - above.sum(-1, keepdims=True)))
    slots = max((k - 1) * group, k)
    at = jnp.where(cand, jnp.cumsum(cand, -1, dtype=jnp.int32) - 1, slots)   # past the slots: not a candidate
    ids = jnp.full((keys.shape[0], slots), n, jnp.int32).at[jnp.arange(keys.shape[0])[:, None], at].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), keys.shape), mode="drop")
    packed = jnp.take_along_axis(jnp.pad(keys, ((0, 0), (0, 1)), constant_values=jnp.iinfo(jnp.int32).min), ids, -1)
    idx = jnp.take_along_axis(ids, lax.top_k(packed, k)[1], axis=-1)
    return jnp.take_along_axis(x, idx, axis=-1).reshape(*shape[:-1], k), idx.reshape(*shape[:-1], k)
