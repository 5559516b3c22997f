"""MegaAttention: sparse multi-query attention with a per-head sink over gathered K=V rows.

Signature (one per ragged batch of query tokens)::

    attention(q [T, H, D], cos, sin [T, r/2], window_kv [Nw, D] | (e4m3 [Nw, D], ue8m0 [Nw, D/32]),
              window_idx [T, W], comp_kv [Nc, D] | None, comp_idx [T, K] | None, sink [H], scale)
      -> [T, H, D]

Each query reads its sliding window and its top-k compressed entries through row
indices into two pools (``-1`` marks an empty slot), so the same signature serves ragged
prefill, decode and speculative verification, and paged or ring storage. As in FlashMLA's
fused V4.1 kernel the op rotates the trailing RoPE slice of ``q`` itself and applies the
inverse rotation to the output (K = V carries its rotation; MODEL_SPEC §3.6). The sink
only enlarges the softmax denominator, so fully masked rows stay finite.

On GPU (``mega.backend``) the middle of the op, gather + sink softmax + weighted sum, is
the Pallas kernel ``pallas_kernels.sparse_attention.sparse_mqa`` (bf16 activations, heads a
multiple of 64, head_dim a multiple of 128 up to 512, as V4.1's 64 x 512); elsewhere, and for
other shapes and dtypes, its pure-jnp reference. The window pool may come in its stored FP8
form (values and UE8M0 scale bytes, MODEL_SPEC §3.5), which the kernel reads as an fp8 pool.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mega import backend
from mega.primitives import apply_rope
from pallas_kernels.block_scaled import Fp8Pool
from pallas_kernels.sparse_attention import sparse_mqa, sparse_mqa_reference


def kernel_path(dtype, heads: int, head_dim: int, pool_dtypes) -> backend.Path:
    """Which implementation runs for queries of ``dtype`` and KV pools stored as ``pool_dtypes``."""
    why = backend.kernels_off()
    if why is None and jnp.dtype(dtype) != jnp.bfloat16:
        why = f"{jnp.dtype(dtype).name} activations; the kernel takes bfloat16"
    if why is None and any(jnp.dtype(p) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn))
                           for p in pool_dtypes):
        why = f"KV pools of {[jnp.dtype(p).name for p in pool_dtypes]}"
    if why is None and (heads % 64 or head_dim % 128 or head_dim > 512):
        why = f"{heads} heads x {head_dim}; the kernel takes heads in 64s and head_dim in 128s up to 512"
    if why is not None:
        return backend.Path.reference(why)
    fp8 = jnp.dtype(pool_dtypes[0]) == jnp.float8_e4m3fn
    return backend.Path(True, "pallas sparse MQA" + (" (fp8 window pool)" if fp8 else ""))


@jax.named_scope("mega_attention")  # prefixes its ops' names in HLO dumps and XProf
def attention(q: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, window_kv: jnp.ndarray | tuple,
              window_idx: jnp.ndarray, comp_kv: jnp.ndarray | None, comp_idx: jnp.ndarray | None,
              sink: jnp.ndarray, scale: float) -> jnp.ndarray:
    q = apply_rope(q, cos[:, None], sin[:, None])
    window = Fp8Pool(*window_kv, window_idx) if isinstance(window_kv, tuple) else (window_kv, window_idx)
    pools = [window] + ([(comp_kv, comp_idx)] if comp_kv is not None else [])
    _, h, d = q.shape
    if kernel_path(q.dtype, h, d, [p[0].dtype for p in pools]).kernel:
        out = sparse_mqa(q, pools, sink, scale, interpret=backend.interpret_params())
    else:
        out = sparse_mqa_reference(q, pools, sink, scale)
    return apply_rope(out, cos[:, None], sin[:, None], inverse=True)
