"""A V4.1 KV page as the host and storage tiers hold it (serve/hicache.py): its contents, its key, its copies.

What a page holds. Only the *global* state of its ``page_size`` tokens: for every KV source, its
``page_size // ratio`` compressed-KV rows and as many indexer-key rows, as the pools store them (the
keys as FP4 records; the KV rows as NVFP4 ones under ``--kv-cache-dtype fp8_e4m3``), their bytes laid end to end (``PageLayout``: the sources' KV rows, then their key
rows). The window rings are never stored: a hit restarts ``window`` tokens before its end and encoder
replay rebuilds them (MODEL_SPEC §6), as for a device hit. The ratio-2 pending pair at a page's end is
part of the format in principle, but it is always empty: page sizes are even (``EngineConfig``), so a
page boundary closes every ratio-2 group and no token of a cached page waits for a partner; the replay
regenerates the tails in any case.

A page's key is a chained SHA-256: ``key_j = H(key_{j-1} || tokens of page j)`` from ``key_{-1} =
H(model identity)``, so it names the page's whole prefix (two prompts share a key only if they share
every token before it) and pages of another model, page size or KV dtype never match
(``model_identity``).

The copies are jitted gathers and scatters of whole pages between the device pools and ``[n,
page_bytes]`` uint8 arrays, padded to a power of two of pages so a handful of programs serve every
count (a padded scatter row lands out of range and is dropped).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.state import comp_pool, index_pool, pool_row_bytes
from pallas_kernels.block_scaled import stored_kind


@dataclass(frozen=True)
class PageLayout:
    """The pool arrays a page spans, as bytes: ``(rows a page, bytes a row)`` for each array of each
    source's compressed KV, then of its indexer keys (an FP4 pool is two arrays, codes and scales:
    ``model.state.comp_pool``, ``index_pool``). A page is their rows' bytes end to end (uint8).
    ``formats``: how the two pools store their rows (``block_scaled.stored_kind``)."""
    page_size: int
    ratios: tuple[int, ...]  # per KV source
    parts: tuple[tuple[int, int], ...]
    formats: tuple[str, str]

    @classmethod
    def of(cls, cfg: ModelConfig, page_size: int, dtype, quantized_kv: bool = False) -> "PageLayout":
        ratios = tuple(cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)
        if any(page_size % r for r in ratios):
            raise ValueError(f"page_size {page_size} must be a multiple of every compress ratio {ratios}")
        pools = jax.eval_shape(lambda: (comp_pool(cfg, 1, dtype, quantized_kv), index_pool(cfg, 1, dtype)))
        kv, keys = ([pool_row_bytes(a) for a in jax.tree.leaves(p)] for p in pools)
        rows = [page_size // r for r in ratios]
        return cls(page_size, ratios, tuple((n, b) for part in (kv, keys) for n in rows for b in part),
                   tuple(stored_kind(p) for p in pools))

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(np.uint8)

    @property
    def page_bytes(self) -> int:
        return sum(n * b for n, b in self.parts)

    @property
    def bytes_per_token(self) -> float:
        return self.page_bytes / self.page_size


def model_identity(cfg: ModelConfig, params: dict, layout: PageLayout, quantization: str) -> bytes:
    """What must agree for two engines' pages to be interchangeable: the config, the page layout
    (size, the pools' dtype, formats and bytes), the expert quantisation (it changes every later layer's KV) and the weights, which
    the first 64 values of every tensor stand for (two fine-tunes of one base differ somewhere in
    most tensors, not in the embedding alone). A tensor in host memory (``--engram-placement host``)
    counts by its shape and dtype: XLA cannot index it outside a program."""
    h = hashlib.sha256()
    for part in (repr(cfg), jnp.dtype(params["embed"].dtype).name, quantization, layout):
        h.update(repr(part).encode() + b"\0")
    for leaf in jax.tree.leaves(params):
        if getattr(getattr(leaf, "sharding", None), "memory_kind", None) == "pinned_host":
            h.update(repr((leaf.shape, leaf.dtype.name)).encode())
            continue
        # read from the first device's shard, which holds the tensor's first row (split tensors are
        # split on their first axis): no program over the mesh, which other processes would have to join
        local = leaf.addressable_shards[0].data if isinstance(leaf, jax.Array) else leaf
        h.update(np.asarray(local[(0,) * (local.ndim - 1)][:64] if local.ndim else local).tobytes())
    return h.digest()


def page_keys(identity: bytes, tokens: Sequence[int], page_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The chained keys of the whole pages of ``tokens`` (module docstring); ``known``: the keys of its
    first pages, computed before (a request's tokens only grow), which the chain continues from."""
    n = len(tokens) // page_size
    if len(known) >= n:
        return list(known[:n])
    out = list(known)
    key = out[-1] if out else hashlib.sha256(identity).digest()
    toks = np.asarray(tokens[len(out) * page_size:n * page_size], np.int64)
    for j in range(n - len(out)):
        key = hashlib.sha256(key + toks[j * page_size:(j + 1) * page_size].tobytes()).digest()
        out.append(key)
    return out


def _padded(pages: Sequence[int], fill: int) -> np.ndarray:
    n = 1 << max(len(pages) - 1, 0).bit_length()
    return np.asarray(list(pages) + [fill] * (n - len(pages)), np.int32)


def _rows(pages: jax.Array, per: int) -> jax.Array:
    return (pages[:, None] * per + jnp.arange(per)).reshape(-1)


def _as_bytes(rows: jax.Array) -> jax.Array:
    """``[n, w]`` of any dtype → ``[n, w * itemsize]`` uint8 (its bytes, in memory order)."""
    if rows.dtype == jnp.uint8:
        return rows
    return jax.lax.bitcast_convert_type(rows, jnp.uint8).reshape(rows.shape[0], -1)


def _from_bytes(data: jax.Array, dtype) -> jax.Array:
    """The inverse of ``_as_bytes``."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(data, dtype) if data.dtype != dtype else data
    return jax.lax.bitcast_convert_type(data.reshape(data.shape[0], -1, size), dtype)


@partial(jax.jit, static_argnames="layout")
def _gather(pools: tuple, pages: jax.Array, layout: PageLayout) -> jax.Array:
    parts = [_as_bytes(pool[_rows(pages, n)]).reshape(pages.shape[0], n * b)
             for pool, (n, b) in zip(pools, layout.parts)]
    return jnp.concatenate(parts, axis=1)


@partial(jax.jit, static_argnames="layout", donate_argnums=0)
def _scatter(pools: tuple, pages: jax.Array, data: jax.Array, layout: PageLayout) -> tuple:
    out, at = [], 0
    for pool, (n, b) in zip(pools, layout.parts):
        rows = _from_bytes(data[:, at:at + n * b].reshape(-1, b), pool.dtype)
        out.append(pool.at[_rows(pages, n)].set(rows, mode="drop"))
        at += n * b
    return tuple(out)


def read_pages(comp_kv: tuple, index_k: tuple, pages: Sequence[int], layout: PageLayout) -> jax.Array:
    """``[n, page_bytes]`` uint8 on the device, dispatched (not waited for): row i is ``pages[i]``,
    and the rows past ``len(pages)`` pad ``n`` to a power of two (left unsliced: a slice would be a
    program for every count)."""
    return _gather(tuple(jax.tree.leaves((comp_kv, index_k))), jnp.asarray(_padded(pages, 0)), layout)


def write_pages(comp_kv: tuple, index_k: tuple, pages: Sequence[int], data: np.ndarray,
                layout: PageLayout) -> tuple[tuple, tuple]:
    """The pools with ``data`` (``[len(pages), page_bytes]``) written into ``pages``; the old pools
    are donated."""
    idx = _padded(pages, comp_kv[0].shape[0] * layout.ratios[0] // layout.page_size)   # past the pool: dropped
    rows = np.zeros((len(idx), layout.page_bytes), np.uint8)
    rows[:len(pages)] = data
    leaves, tree = jax.tree.flatten((comp_kv, index_k))
    out = _scatter(tuple(leaves), jnp.asarray(idx), jnp.asarray(rows), layout)
    return jax.tree.unflatten(tree, out)
