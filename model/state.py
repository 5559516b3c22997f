"""Explicit cache state of the V4.1 forward, laid out per layer kind (MODEL_SPEC §4).

The state holds ``B`` request slots. Per layer kind:

* every backbone layer: a window ring ``[B, W, head_dim]``; the key at position ``p``
  lives in slot ``p % W``;
* every KV source: a pool of compressed-KV rows and one of indexer-key rows, addressed
  through the page table (prefix-cacheable, so paged), and for ratio > 1 the pending
  group tail ``(k, gate)`` of up to ``ratio - 1`` projected tokens, in a ring of
  ``tail_groups`` groups (group ``n`` in slot ``n % tail_groups``);
* with speculative decoding (``spec_tokens`` > 0, MODEL_SPEC §4): the rings keep
  ``spec_tokens`` rows beyond the window and the tails one group per ``ratio`` of them more,
  so what a rejected draft wrote never overwrites what the accepted tokens still need:
  rolling a request back is setting its length (and its Engram look-back); and each DSpark
  draft layer has a window ring of the context KV (``draft_window``);
* per request: the number of tokens processed, the Engram look-back (the last
  ``max_ngram - 1`` compressed ids, ``DEAD`` where there is none), the first position whose
  window KV the ring holds (``window_floor``: after a prefix hit, encoder replay rebuilds
  the ring from there) and how many tokens already have their compressed entries
  (``cached_len``: replayed tokens keep the cached entries instead of rewriting them);
* for EPLB (``expert_load``), the routed (token, expert) pairs of each slot's tokens per layer
  and logical expert since the engine last read and zeroed them; a step counts only when the
  state has them, so a server without EPLB runs the same program.

Pages are counted in tokens: page ``j`` of a request covers its tokens
``[j * page_size, (j + 1) * page_size)``, i.e. ``page_size // ratio`` entries of a
ratio-``r`` source, so an even page size never splits a ratio-2 group. ``init_state``
gives each slot its own contiguous pages; the engine will hand pages out itself.

The rings and the compressed-KV pools take the model's activation ``dtype``
(``state_dtype(params)``): they hold fake-quantised values (FP8 and NVFP4 grids), which bf16
represents exactly, so a bf16 model keeps its KV in bf16 (half the bytes of fp32, and the dtype
the attention kernel reads), and training differentiates through them. With ``quantized_kv``
(the server's ``--kv-cache-dtype fp8_e4m3``) they keep the quantisers' stored forms instead,
which MegaAttention reads directly: a ring is an ``Fp8Ring`` (e4m3 values and UE8M0 scale
bytes, 528 bytes a row at head_dim 512 against 1,024 in bf16) and a compressed pool
``Nvfp4Rows`` (288 bytes a row); the values they give back are the same, bit for bit. The
indexer keys are always stored as the FP4 records they are (``Fp4Keys``, 68 bytes a 128-channel
row); where the FP4 quantiser passes them through (``index_head_dim`` not in 32s), as ``dtype``
values.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model import quant
from model.config import ModelConfig
from model.engram_hash import DEAD
from pallas_kernels.block_scaled import FP8, Fp4Keys, Nvfp4Rows


class Fp8Ring(NamedTuple):
    """A window ring in fp8: ``values`` [B, W, head_dim] float8_e4m3fn and ``scale``
    [B, W, head_dim / 32] uint8 UE8M0 exponents (``model.quant.fp8_block32_stored``)."""
    values: jnp.ndarray
    scale: jnp.ndarray
    KIND = FP8


@partial(jax.tree_util.register_dataclass,
         data_fields=["seq_lens", "window", "comp_kv", "index_k", "tail_kv", "tail_gate", "page_table",
                      "engram_hist", "window_floor", "cached_len", "draft_window", "expert_load"],
         meta_fields=["page_size"])
@dataclass(frozen=True)
class ModelState:
    seq_lens: jnp.ndarray  # int32 [B]
    window: tuple  # per backbone layer: [B, ring_rows, head_dim], or an Fp8Ring
    comp_kv: tuple  # per KV source: pages * page_size // ratio rows (comp_pool: Nvfp4Rows, or dtype values)
    index_k: tuple  # per KV source: pages * page_size // ratio rows (index_pool: Fp4Keys, or dtype values)
    tail_kv: tuple  # per KV source: [B, tail_groups, ratio - 1, head_dim] fp32
    tail_gate: tuple  # per KV source: [B, tail_groups, ratio - 1, head_dim] fp32
    page_table: jnp.ndarray  # int32 [B, pages per request]
    engram_hist: jnp.ndarray  # int32 [B, max_ngram - 1]
    window_floor: jnp.ndarray  # int32 [B]
    cached_len: jnp.ndarray  # int32 [B]
    draft_window: tuple  # per DSpark draft layer: [B, ring_rows, head_dim] (empty without speculation)
    expert_load: jnp.ndarray  # int32 [B, layers, E], or [B, 0, 0] when not counted
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def capacity(self) -> int:
        """Tokens one slot can hold."""
        return self.page_table.shape[1] * self.page_size

    @property
    def ring_rows(self) -> int:
        """Rows of a window ring: the window, plus the speculative slack."""
        ring = self.window[0]
        return (ring.values if isinstance(ring, Fp8Ring) else ring).shape[1]

    def replace(self, **kw) -> "ModelState":
        return dataclasses.replace(self, **kw)


def state_dtype(params: dict):
    """The dtype of a model's KV rings and pools: its activations' (the embedding's)."""
    return params["embed"].dtype


def tail_groups(ratio: int, spec_tokens: int) -> int:
    """Groups a ratio-``ratio`` tail ring holds: one, or with ``spec_tokens`` drafts verified past
    an accepted token, every group a verify step's tokens touch."""
    return 1 if not spec_tokens else 1 + -(-(spec_tokens + 1) // ratio)


def init_state(cfg: ModelConfig, batch_size: int, max_len: int, page_size: int = 64,
               dtype=jnp.float32, quantized_kv: bool = False, spec_tokens: int = 0,
               expert_load: bool = False, num_pages: int | None = None) -> ModelState:
    """``num_pages``: the pools' pages (default: each slot its own ``max_len`` worth, in order)."""
    ratios = [cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids]
    if page_size <= 0 or any(page_size % r for r in ratios):
        raise ValueError(f"page_size {page_size} must be a positive multiple of every compress ratio {ratios}")
    pages = -(-max_len // page_size)
    n_pages = batch_size * pages if num_pages is None else num_pages
    w, hd = cfg.sliding_window + spec_tokens, cfg.head_dim
    if quantized_kv and hd % 32:
        raise ValueError(f"quantized_kv needs head_dim divisible by the 32-channel scale block, got {hd}")

    return ModelState(
        seq_lens=jnp.zeros((batch_size,), jnp.int32),
        window=tuple(window_ring(cfg, batch_size, w, dtype, quantized_kv) for _ in range(cfg.num_hidden_layers)),
        comp_kv=tuple(comp_pool(cfg, n_pages * page_size // r, dtype, quantized_kv) for r in ratios),
        index_k=tuple(index_pool(cfg, n_pages * page_size // r, dtype) for r in ratios),
        tail_kv=tuple(jnp.zeros((batch_size, tail_groups(r, spec_tokens), r - 1, hd), jnp.float32) for r in ratios),
        tail_gate=tuple(jnp.zeros((batch_size, tail_groups(r, spec_tokens), r - 1, hd), jnp.float32)
                        for r in ratios),
        page_table=jnp.arange(batch_size * pages, dtype=jnp.int32).reshape(batch_size, pages) % n_pages,
        engram_hist=jnp.full((batch_size, max(cfg.engram_max_ngram_size - 1, 0)), DEAD, jnp.int32),
        window_floor=jnp.zeros((batch_size,), jnp.int32),
        cached_len=jnp.zeros((batch_size,), jnp.int32),
        draft_window=tuple(jnp.zeros((batch_size, w, hd), dtype)
                           for _ in range(cfg.num_nextn_predict_layers if spec_tokens else 0)),
        expert_load=jnp.zeros((batch_size, cfg.num_hidden_layers, cfg.n_routed_experts) if expert_load
                              else (batch_size, 0, 0), jnp.int32),
        page_size=page_size,
    )


def window_ring(cfg: ModelConfig, batch_size: int, rows: int, dtype, quantized: bool = False):
    """A layer's window ring of ``rows`` rows a slot: an ``Fp8Ring`` when ``quantized``, else ``dtype`` values."""
    hd = cfg.head_dim
    if quantized:
        return Fp8Ring(jnp.zeros((batch_size, rows, hd), jnp.float8_e4m3fn),
                       jnp.full((batch_size, rows, hd // 32), 127, jnp.uint8))   # scale 1
    return jnp.zeros((batch_size, rows, hd), dtype)


def comp_pool(cfg: ModelConfig, rows: int, dtype, quantized: bool = False):
    """A compressed-KV pool of ``rows`` rows: the NVFP4 records (``Nvfp4Rows``) when ``quantized``,
    else the NVFP4-quantised values in ``dtype``."""
    if quantized:
        return Nvfp4Rows.zeros(rows, cfg.head_dim)
    return jnp.zeros((rows, cfg.head_dim), dtype)


def index_pool(cfg: ModelConfig, rows: int, dtype):
    """An indexer-key pool of ``rows`` rows: the FP4 records the keys are (``Fp4Keys``), or, where
    the FP4 quantiser passes the keys through (MODEL_SPEC §11.3), ``dtype`` values."""
    if quant.fp4_block32_active(cfg.index_head_dim):
        return Fp4Keys.zeros(rows, cfg.index_head_dim)
    return jnp.zeros((rows, cfg.index_head_dim), dtype)


def pool_row_bytes(pool) -> int:
    """Bytes a row of a pool takes (an array, or a tuple of arrays of rows)."""
    return sum(a.shape[1] * a.dtype.itemsize for a in jax.tree.leaves(pool))


def entry_rows(state: ModelState, ratio: int, slot: jnp.ndarray, entry: jnp.ndarray) -> jnp.ndarray:
    """Pool rows of compressed entries ``entry`` ([T] or [T, N]) of requests ``slot`` [T]."""
    per_page = state.page_size // ratio
    page_idx = jnp.minimum(entry // per_page, state.page_table.shape[1] - 1).reshape(slot.shape[0], -1)
    page = jnp.take_along_axis(state.page_table[slot], page_idx, axis=1).reshape(entry.shape)
    return page * per_page + entry % per_page
