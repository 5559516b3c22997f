"""The lightning indexer's scores on GPU: a Pallas kernel (Triton backend) and its jnp reference.

For each query row ``t`` and each entry ``e`` of its request (MODEL_SPEC §3.8)::

    score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[rows[slot[t], e]]) * scale     if e < visible[t]
                  -inf                                                            otherwise

Contract: ``q`` [T, H, d] bf16 and ``keys`` [P, d] bf16 (the FP4-quantised values, which bf16
holds exactly, so the products are exact and fp32 sums differ from the reference's only in
order), ``w`` [T, H] fp32, ``rows`` [B, N] int32 (the pool row of each request's entry ``e``),
``slot`` [T] int32 (the request of each row), ``visible`` [T] int32 (its visible entries,
at most N). H and d powers of two from 16 (the tensor cores' tiles), N a multiple of
``BLOCK_N``. Returns [T, N] fp32. ``index_scores_listed`` scores only the entries listed for
each row (the index layers past the candidate source score their candidate blocks alone).

Design: a program per (row, chunk of ``CHUNK`` x ``BLOCK_N`` entries), rows fastest, so the
programs that run together are a request's rows on the same keys and read them from L2 once
per request rather than once per row. A program loads its row's q once, then per block of
entries gathers the keys by their pool rows (the pool is paged, so rows are not contiguous),
runs one [BLOCK_N, d] x [d, H] dot, and reduces the ReLU'd products over heads with the row's
head weights; blocks past the row's visible entries skip the dot and store -inf. Unlike XLA's
per-row gather of the whole capacity, no [T, N, d] intermediate exists, and invisible entries
cost no key reads. (The pool holds the keys as bf16; SGLang stores FP4 records, 68 bytes an
entry against 256.)
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


def _block_scores(k, qt, wt, scale: float):
    """``[BLOCK_N]`` scores of a block of keys ``[BLOCK_N, d]`` against one row's q ``[H, d]``."""
    s = plt.dot(k, qt, trans_b=True)                  # [BLOCK_N, H] fp32
    return jnp.sum(jnp.maximum(s, 0.0) * scale * wt[None, :], axis=1)


def _check(q, keys, n: int, listed=None):
    h, d = q.shape[1:]
    width = n if listed is None else listed.shape[1]
    if not fits(h, d, width) or q.dtype != jnp.bfloat16 or keys.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q [T, H, d] and keys with H, d powers of two >= 16 and N (or the listed "
                         f"entries) a multiple of {BLOCK_N}; got q {q.shape} {q.dtype}, keys {keys.dtype}, N = {n}")


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def index_scores(q, w, keys, rows, slot, visible, *, scale: float, interpret: bool = False):
    """Every entry of each row's request (the module docstring)."""
    t, n = q.shape[0], rows.shape[1]
    _check(q, keys, n)

    def kernel(slot_ref, visible_ref, q_ref, w_ref, keys_ref, rows_ref, o_ref):
        row, chunk = pl.program_id(0), pl.program_id(1)
        seen, request = visible_ref[row], slot_ref[row]
        qt, wt = q_ref[row], w_ref[row]                   # [H, d], [H]

        @pl.loop(0, CHUNK)
        def _(j):
            e0 = (chunk * CHUNK + j) * BLOCK_N
            at = pl.ds(e0, BLOCK_N)

            @pl.when((e0 < n) & (e0 < seen))
            def _():
                score = _block_scores(keys_ref[rows_ref[request, at], :], qt, wt, scale)   # keys gathered
                entry = e0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_N,), 0)
                o_ref[row, at] = jnp.where(entry < seen, score, -jnp.inf)

            @pl.when((e0 < n) & (e0 >= seen))
            def _():
                o_ref[row, at] = jnp.full((BLOCK_N,), -jnp.inf, jnp.float32)

    return pl.pallas_call(
        kernel, grid=(t, -(-n // (CHUNK * BLOCK_N))), out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
    )(slot, visible, q, w, keys, rows)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def index_scores_listed(q, w, keys, rows, slot, visible, listed, *, scale: float, interpret: bool = False):
    """Only the entries ``listed [T, S]`` for each row (-1: none; the candidate blocks' entries
    past the candidate source), -inf elsewhere: the keys of the other entries are never read.
    A program per (row, chunk of listed entries); the scores are scattered into an output
    filled with -inf beforehand (a write of 4 bytes an entry, against a key row's 256 read)."""
    t, n = q.shape[0], rows.shape[1]
    _check(q, keys, n, listed)
    s_len = listed.shape[1]

    def kernel(slot_ref, visible_ref, q_ref, w_ref, keys_ref, rows_ref, listed_ref, _, o_ref):
        row, chunk = pl.program_id(0), pl.program_id(1)
        seen, request = visible_ref[row], slot_ref[row]
        qt, wt = q_ref[row], w_ref[row]

        @pl.loop(0, CHUNK)
        def _(j):
            e0 = (chunk * CHUNK + j) * BLOCK_N

            @pl.when(e0 < s_len)
            def _():
                entry = listed_ref[row, pl.ds(e0, BLOCK_N)]
                ok = (entry >= 0) & (entry < seen)
                score = _block_scores(keys_ref[rows_ref[request, jnp.where(ok, entry, 0)], :], qt, wt, scale)
                # masked lanes write nothing; their address is past the row (where the interpreter,
                # which emulates the mask, drops the write: at a real entry it could collide)
                plt.store(o_ref.at[row, jnp.where(ok, entry, n)], score, mask=ok)

    return pl.pallas_call(
        kernel, grid=(t, -(-s_len // (CHUNK * BLOCK_N))), out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        input_output_aliases={7: 0}, compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(slot, visible, q, w, keys, rows, listed, jnp.full((t, n), -jnp.inf, jnp.float32))


def index_scores_reference(q, w, keys, rows, slot, visible, listed=None, *, scale: float, exact_bf16: bool,
                           pass_bytes: int):
    """Both kernels in XLA: each row gathers its request's keys and scores them all (then masks
    them to ``listed``); rows are scored in passes of at most ``pass_bytes`` of per-row
    intermediates (keys [N, d] counted as fp32, scores [H, N]). ``exact_bf16``: q and the keys
    hold values bf16 represents exactly (the FP4 quantiser on), so the dots run on bf16
    operands with fp32 accumulation; else in fp32."""
    t, n = q.shape[0], rows.shape[1]

    def score(q_t, w_t, slot_t):   # one row against every entry of its request
        return scores_of_one(q_t, w_t, keys[rows[slot_t]], scale, exact_bf16)

    chunk = max(1, pass_bytes // (4 * n * (q.shape[2] + q.shape[1])))
    scores = (jax.vmap(score)(q, w, slot) if chunk >= t
              else jax.lax.map(lambda a: score(*a), (q, w, slot), batch_size=chunk))
    scores = jnp.where(jnp.arange(n)[None] < visible[:, None], scores, -jnp.inf)
    if listed is None:
        return scores
    at = jnp.where((listed >= 0) & (listed < n), listed, n)   # past the end: dropped
    mask = jnp.zeros((t, n), bool).at[jnp.arange(t)[:, None], at].set(True, mode="drop")
    return jnp.where(mask, scores, -jnp.inf)


def scores_of_one(q, w, keys, scale: float, exact_bf16: bool):
    """``[N]`` scores of one query (``q [H, d]``, head weights ``w [H]``) against ``keys [N, d]``."""
    if exact_bf16:
        s = jnp.einsum("hd,nd->hn", q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
    else:
        s = jnp.einsum("hd,nd->hn", q, keys.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    s = jax.nn.relu(s) * scale
    return jnp.einsum("h,hn->n", w, s, precision=jax.lax.Precision.HIGHEST)
