"""MegaAttention: sparse multi-query attention with a per-head sink over gathered K=V rows.

Signature (one per ragged batch of query tokens)::

    attention(q [T, H, D], cos, sin [T, r/2], window_kv [Nw, D] | (e4m3 [Nw, D], ue8m0 [Nw, D/32]),
              window_idx [T, W], comp_kv [Nc, D] | Nvfp4Rows | None, comp_idx [T, K] | None, sink [H],
              scale) -> [T, H, D]

Each query reads its sliding window and its top-k compressed entries through row
indices into two pools (``-1`` marks an empty slot), so the same signature serves ragged
prefill, decode and speculative verification, and paged or ring storage. As in FlashMLA's
fused V4.1 kernel the op rotates the trailing RoPE slice of ``q`` itself and applies the
inverse rotation to the output (K = V carries its rotation; MODEL_SPEC §3.6). The sink
only enlarges the softmax denominator, so fully masked rows stay finite.

On GPU (``mega.backend``) the middle of the op, gather + sink softmax + weighted sum, is
the Pallas kernel ``pallas_kernels.sparse_attention.sparse_mqa`` (bf16 activations, heads a
multiple of 64, head_dim a multiple of 128 up to 512, as V4.1's 64 x 512); elsewhere, and for
other shapes and dtypes, its pure-jnp reference. The pools may come in their stored forms
(MODEL_SPEC §3.5): the window as FP8 values and UE8M0 scale bytes, the compressed entries as
NVFP4 records (``Nvfp4Rows``), which the kernel reads and dequantises itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mega import backend
from mega.primitives import apply_rope
from pallas_kernels.block_scaled import FP8, NVFP4, Fp8Pool, Nvfp4Pool, Nvfp4Rows
from pallas_kernels.sparse_attention import BF16, pool_kind, sparse_mqa, sparse_mqa_reference


KERNEL_POOLS = (BF16, FP8, NVFP4)   # the pool kinds (``block_scaled.stored_kind``) the kernel reads


def kernel_path(dtype, heads: int, head_dim: int, pool_kinds) -> backend.Path:
    """Which implementation runs for queries of ``dtype`` over KV pools of ``pool_kinds``
    (``block_scaled.stored_kind``: the window's, then the compressed entries')."""
    why = backend.kernels_off()
    if why is None and jnp.dtype(dtype) != jnp.bfloat16:
        why = f"{jnp.dtype(dtype).name} activations; the kernel takes bfloat16"
    if why is None and any(k not in KERNEL_POOLS for k in pool_kinds):
        why = f"KV pools of {list(pool_kinds)}"
    if why is None and (heads % 64 or head_dim % 128 or head_dim > 512):
        why = f"{heads} heads x {head_dim}; the kernel takes heads in 64s and head_dim in 128s up to 512"
    if why is None and NVFP4 in pool_kinds and head_dim % 256:
        why = f"NVFP4 pools at head_dim {head_dim}; the kernel reads them at 256 or 512"
    if why is not None:
        return backend.Path.reference(why)
    stored = {FP8: "fp8", NVFP4: "NVFP4"}
    kinds = [f"{stored[k]} {name}" for k, name in zip(pool_kinds, ("window", "compressed")) if k in stored]
    return backend.Path(True, "pallas sparse MQA" + (f" ({', '.join(kinds)} pool{'s' * (len(kinds) > 1)})"
                                                      if kinds else ""))


@jax.named_scope("mega_attention")  # prefixes its ops' names in HLO dumps and XProf
def attention(q: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, window_kv: jnp.ndarray | tuple,
              window_idx: jnp.ndarray, comp_kv: jnp.ndarray | Nvfp4Rows | None, comp_idx: jnp.ndarray | None,
              sink: jnp.ndarray, scale: float) -> jnp.ndarray:
    q = apply_rope(q, cos[:, None], sin[:, None])
    pools = [Fp8Pool(*window_kv, window_idx) if isinstance(window_kv, tuple) else (window_kv, window_idx)]
    if comp_kv is not None:
        pools.append(Nvfp4Pool(*comp_kv, comp_idx) if isinstance(comp_kv, Nvfp4Rows) else (comp_kv, comp_idx))
    _, h, d = q.shape
    if kernel_path(q.dtype, h, d, [pool_kind(p) for p in pools]).kernel:
        out = sparse_mqa(q, pools, sink, scale, interpret=backend.interpret_params())
    else:
        out = sparse_mqa_reference(q, pools, sink, scale)
    return apply_rope(out, cos[:, None], sin[:, None], inverse=True)
