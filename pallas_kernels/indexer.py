"""The lightning indexer's scores on GPU: a Pallas kernel (Triton backend) and its jnp reference.

For each query row ``t`` and each entry ``e`` of its request (MODEL_SPEC §3.8)::

    score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[rows[slot[t], e]]) * scale     if e < visible[t]
                  -inf                                                            otherwise

Contract: ``q`` [T, H, d] bf16 and ``keys`` [P, d] bf16 (the FP4-quantised values, which bf16
holds exactly, so the products are exact and fp32 sums differ from the reference's only in
order), ``w`` [T, H] fp32, ``rows`` [B, N] int32 (the pool row of each request's entry ``e``),
``slot`` [T] int32 (the request of each row), ``visible`` [T] int32 (its visible entries,
at most N). H and d powers of two from 16 (the tensor cores' tiles), N a multiple of
``BLOCK_N``. Returns [T, N] fp32.

Design: a program per (row, chunk of ``CHUNK`` x ``BLOCK_N`` entries), rows fastest, so the
programs that run together are a request's rows on the same keys and read them from L2 once
per request rather than once per row. A program loads its row's q once, then per block of
entries gathers the keys by their pool rows (the pool is paged, so rows are not contiguous),
runs one [BLOCK_N, d] x [d, H] dot, and reduces the ReLU'd products over heads with the row's
head weights; blocks past the row's visible entries skip the dot and store -inf. Unlike XLA's
per-row gather of the whole capacity, no [T, N, d] intermediate exists, and invisible entries
cost no key reads. (Today's pool holds the keys as bf16: the FP4 records SGLang stores, 68
bytes an entry against 256, are issue 40's next step.)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK_N = 64      # entries per dot
CHUNK = 16        # blocks per program: q is loaded once per 1024 entries


def fits(heads: int, head_dim: int, n: int) -> bool:
    """Whether the kernel takes ``heads`` x ``head_dim`` queries against ``n`` entries a request."""
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    return pow2(heads) and pow2(head_dim) and n % BLOCK_N == 0 and n > 0


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def index_scores(q, w, keys, rows, slot, visible, *, scale: float, interpret: bool = False):
    t, h, d = q.shape
    n = rows.shape[1]
    if not fits(h, d, n) or q.dtype != jnp.bfloat16 or keys.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q [T, H, d] and keys with H, d powers of two >= 16 and N % {BLOCK_N} == 0; "
                         f"got q {q.shape} {q.dtype}, keys {keys.dtype}, N = {n}")
    per_program = CHUNK * BLOCK_N

    def kernel(slot_ref, visible_ref, q_ref, w_ref, keys_ref, rows_ref, o_ref):
        row, chunk = pl.program_id(0), pl.program_id(1)
        seen = visible_ref[row]
        request = slot_ref[row]
        qt = q_ref[row]                                   # [H, d]
        wt = w_ref[row]                                   # [H]

        @pl.loop(0, CHUNK)
        def _(j):
            e0 = (chunk * CHUNK + j) * BLOCK_N
            at = pl.ds(e0, BLOCK_N)

            @pl.when((e0 < n) & (e0 < seen))
            def _():
                k = keys_ref[rows_ref[request, at], :]    # [BLOCK_N, d], gathered
                s = plt.dot(k, qt, trans_b=True)          # [BLOCK_N, H] fp32
                score = jnp.sum(jnp.maximum(s, 0.0) * scale * wt[None, :], axis=1)
                entry = e0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_N,), 0)
                o_ref[row, at] = jnp.where(entry < seen, score, -jnp.inf)

            @pl.when((e0 < n) & (e0 >= seen))
            def _():
                o_ref[row, at] = jnp.full((BLOCK_N,), -jnp.inf, jnp.float32)

    return pl.pallas_call(
        kernel, grid=(t, -(-n // per_program)), out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
    )(slot, visible, q, w, keys, rows)


def index_scores_reference(q, w, keys, rows, slot, visible, *, scale: float, exact_bf16: bool,
                           pass_bytes: int):
    """The same in XLA: each row gathers its request's keys; rows are scored in passes of at
    most ``pass_bytes`` of per-row intermediates (keys [N, d] counted as fp32, scores [H, N]).
    ``exact_bf16``: q and the keys hold values bf16 represents exactly (the FP4 quantiser on),
    so the dots run on bf16 operands with fp32 accumulation; else in fp32."""
    t, n = q.shape[0], rows.shape[1]

    def score(q_t, w_t, slot_t):   # one row against every entry of its request
        return scores_of_one(q_t, w_t, keys[rows[slot_t]], scale, exact_bf16)

    chunk = max(1, pass_bytes // (4 * n * (q.shape[2] + q.shape[1])))
    scores = (jax.vmap(score)(q, w, slot) if chunk >= t
              else jax.lax.map(lambda a: score(*a), (q, w, slot), batch_size=chunk))
    return jnp.where(jnp.arange(n)[None] < visible[:, None], scores, -jnp.inf)


def scores_of_one(q, w, keys, scale: float, exact_bf16: bool):
    """``[N]`` scores of one query (``q [H, d]``, head weights ``w [H]``) against ``keys [N, d]``."""
    if exact_bf16:
        s = jnp.einsum("hd,nd->hn", q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
    else:
        s = jnp.einsum("hd,nd->hn", q, keys.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    s = jax.nn.relu(s) * scale
    return jnp.einsum("h,hn->n", w, s, precision=jax.lax.Precision.HIGHEST)
