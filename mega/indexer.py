"""The lightning indexer's scores: each query row against every entry of its request.

Signature (one per ragged batch of query rows; MODEL_SPEC §3.8)::

    index_scores(q [T, H, d] fp32, w [T, H] fp32, keys Fp4Keys | [P, d], rows [B, N] int32, slot [T] int32,
                 visible [T] int32, listed [T, S] int32 | None, exact_bf16) -> [T, N] or [T, S] fp32

``score[t, e] = sum_h w[t, h] relu(q[t, h] . keys[rows[slot[t], e]]) / sqrt(d)`` for the
``visible[t]`` first entries of the row's request, -inf for the others. With ``listed`` (the
candidate blocks' entries, -1: none) only the listed entries are scored, and the result is in
list order. ``rows`` maps each request's entries to pool rows (the pool is paged);
``exact_bf16`` says that q and the keys hold FP4-quantised values, which bf16 represents exactly.

On GPU (``mega.backend``) it is the Pallas kernel ``pallas_kernels.indexer`` (FP4 or bf16 keys,
the FP4 quantiser on, heads and head_dim powers of two from 16, N a multiple of its 64-entry
blocks, as V4.1's 32 x 128 at any 64-aligned context); elsewhere its reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mega import backend
from pallas_kernels.block_scaled import Fp4Keys, stored_kind
from pallas_kernels.indexer import (fits, index_scores as index_scores_kernel, index_scores_listed,
                                    index_scores_reference)

# Bytes the reference's per-row intermediates may take in one pass: each scored row gathers
# its request's keys ([N, d], counted as fp32) and keeps per-head scores ([H, N] fp32) up to the
# head sum. Past this (long contexts times prefill-sized steps: 128K context scores 409 rows a
# pass) the rows are scored in chunks, so memory stays bounded; the chunks are a loop, which a
# GPU runs from the host, so decode-sized steps stay below it.
INDEX_PASS_BYTES = 8 << 30


def kernel_path(heads: int, head_dim: int, n: int, kind: str, exact_bf16: bool) -> backend.Path:
    """Which implementation scores ``heads`` x ``head_dim`` queries against ``n`` entries (or listed
    entries) a row, of keys stored as ``kind`` (``block_scaled.stored_kind``)."""
    why = backend.kernels_off()
    if why is None and not exact_bf16:
        why = f"index head_dim {head_dim} is not FP4-quantised (bf16 operands would round)"
    if why is None and not fits(heads, head_dim, n, kind):
        why = (f"{heads} heads x {head_dim} of {kind} keys against {n} entries; the kernel takes powers of two "
               f"from 16 (head_dim in 64s for FP4 keys), FP4 or bfloat16 keys, entries in 64s")
    return backend.Path.reference(why) if why else backend.Path(True, f"pallas indexer ({kind} keys)")


@jax.named_scope("mega_indexer")  # prefixes its ops' names in HLO dumps and XProf
def index_scores(q: jnp.ndarray, w: jnp.ndarray, keys: Fp4Keys | jnp.ndarray, rows: jnp.ndarray, slot: jnp.ndarray,
                 visible: jnp.ndarray, listed: jnp.ndarray | None, exact_bf16: bool) -> jnp.ndarray:
    _, h, d = q.shape
    scale = d ** -0.5
    width = rows.shape[1] if listed is None else listed.shape[1]
    if kernel_path(h, d, width, stored_kind(keys), exact_bf16).kernel:
        args = (q.astype(jnp.bfloat16), w, keys, rows, slot, visible)
        if listed is None:
            return index_scores_kernel(*args, scale=scale, interpret=backend.interpreting())
        return index_scores_listed(*args, listed, scale=scale, interpret=backend.interpreting())
    return index_scores_reference(q, w, keys, rows, slot, visible, listed, scale=scale, exact_bf16=exact_bf16,
                                  pass_bytes=INDEX_PASS_BYTES)
