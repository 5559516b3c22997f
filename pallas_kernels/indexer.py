"""The lightning indexer's scores on GPU: a Pallas kernel (Triton backend) and its jnp reference.

For each query row ``t`` and each entry ``e`` of its request (MODEL_SPEC §3.8)::

    score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[rows[slot[t], e]]) * scale     if e < visible[t]
                  -inf                                                            otherwise

Contract: ``q`` [T, H, d] bf16 (FP4-quantised values, which bf16 holds exactly, so the
products are exact and fp32 sums differ from the reference's only in order), ``keys`` the
pool as stored: ``Fp4Keys`` of P rows (the model's), or [P, d] bf16 values, ``w`` [T, H]
fp32, ``rows`` [B, N] int32 (the pool row of each request's entry ``e``), ``slot`` [T] int32
(the request of each row), ``visible`` [T] int32 (its visible entries, at most N). H and d
powers of two from 16 (the tensor cores' tiles), N a multiple of ``BLOCK_N``. Returns [T, N]
fp32. ``index_scores_listed`` scores only the entries listed for
each row (the index layers past the candidate source score their candidate blocks alone).

Design: a program per (row, chunk of ``CHUNK`` x ``BLOCK_N`` entries), rows fastest, so the
programs that run together are a request's rows on the same keys and read them from L2 once
per request rather than once per row. A program loads its row's q once, then per block of
entries gathers the keys by their pool rows (the pool is paged, so rows are not contiguous),
runs one [BLOCK_N, d] x [d, H] dot, and reduces the ReLU'd products over heads with the row's
head weights; blocks past the row's visible entries skip the dot and store -inf. Unlike XLA's
per-row gather of the whole capacity, no [T, N, d] intermediate exists, and invisible entries
cost no key reads. FP4 keys are read as stored, 68 bytes an entry at d = 128 (against 256 in
bf16): each 32 code bytes become two 32-channel blocks of bf16 values (exact), each block its own
dot, scaled by its UE8M0 exponent.

Why the Triton backend (deprecated since JAX 0.11, still shipped in 0.12): a gather of arbitrary
pool rows is one load there, where Mosaic GPU needs hand-written ``cp.async`` (as
``sparse_attention`` has); if the lowering goes, that is the port.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.block_scaled import Fp4Keys, pow2_from_exponent, stored_kind

BLOCK_N = 64      # entries per dot
CHUNK = 16        # blocks per program: q is loaded once per 1024 entries


def fits(heads: int, head_dim: int, n: int, kind: str) -> bool:
    """Whether the kernels take ``heads`` x ``head_dim`` queries against ``n`` entries (or listed
    entries) a row, of keys stored as ``kind``: FP4 keys need whole 32-channel blocks in each
    half of the channels (a code byte holds a channel of each half)."""
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    return (kind in ("fp4", "bfloat16") and pow2(heads) and pow2(head_dim) and n % BLOCK_N == 0 and n > 0
            and (kind != "fp4" or head_dim % 64 == 0))


def _e2m1(code: jax.Array) -> jax.Array:
    """float32 values of int32 e2m1 codes (``block_scaled.E2M1``'s table as arithmetic: Triton
    has no gather from a constant table)."""
    mag, m = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    value = jnp.where(mag == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.where(mag == 1, 1.0, jnp.where(mag == 2, 2.0, 4.0)))
    return jnp.where((code & 8) != 0, -value, value)


def _q_parts(q_ref, row, fp4: bool) -> list:
    """The row's q as the dots take it: whole ``[H, d]``, or FP4 keys' 32-channel blocks."""
    if not fp4:
        return [q_ref[row]]
    return [q_ref[row, :, pl.ds(32 * j, 32)] for j in range(q_ref.shape[2] // 32)]


def _block_scores(key_refs, r, q_parts, wt, scale: float):
    """``[BLOCK_N]`` scores of the keys at pool rows ``r`` against one row's q. bf16 keys: one
    ``[BLOCK_N, d] x [d, H]`` dot. FP4 keys (``Fp4Keys``: byte j holds channels j and j + d/2):
    each 32 bytes decode to two 32-channel blocks, each its own dot, scaled by its exponent."""
    if len(key_refs) == 1:
        s = plt.dot(key_refs[0][r, :], q_parts[0], trans_b=True)            # [BLOCK_N, H] fp32
    else:
        codes_ref, scale_ref = key_refs
        blocks, s = codes_ref.shape[1] // 32, 0.0
        for b in range(blocks):
            c = codes_ref[r, pl.ds(32 * b, 32)].astype(jnp.int32)
            for j, code in ((b, c & 15), (blocks + b, c >> 4)):
                part = plt.dot(_e2m1(code).astype(jnp.bfloat16), q_parts[j], trans_b=True)
                s = s + part * pow2_from_exponent(scale_ref[r, j])[:, None]
    return jnp.sum(jnp.maximum(s, 0.0) * scale * wt[None, :], axis=1)


def _check(q, keys, n: int, listed=None) -> tuple[list, bool]:
    """Refuse what the kernels cannot tile; the keys' arrays and whether they are FP4 records."""
    h, d = q.shape[1:]
    width, kind = n if listed is None else listed.shape[1], stored_kind(keys)
    if not fits(h, d, width, kind) or q.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q [T, H, d] with H, d powers of two >= 16 (d in 64s for FP4 keys), keys in "
                         f"bf16 or Fp4Keys, and N (or the listed entries) a multiple of {BLOCK_N}; got q {q.shape} "
                         f"{q.dtype}, keys {kind}, N = {n}")
    return jax.tree.leaves(keys), kind == "fp4"


_PARAMS = plt.CompilerParams(num_warps=4, num_stages=2)


class _Program(NamedTuple):
    """What a program knows of its row: its chunk of blocks, its visible entries, its request, its
    q (as the dots take it) and head weights."""
    row: jax.Array
    chunk: jax.Array
    seen: jax.Array
    request: jax.Array
    q_parts: list
    wt: jax.Array

    @classmethod
    def load(cls, slot_ref, visible_ref, q_ref, w_ref, fp4: bool) -> "_Program":
        row, chunk = pl.program_id(0), pl.program_id(1)
        return cls(row, chunk, visible_ref[row], slot_ref[row], _q_parts(q_ref, row, fp4), w_ref[row])

    def each_block(self, body) -> None:
        """``body(e0)`` for the first entry (or list position) of each of the chunk's blocks."""
        @pl.loop(0, CHUNK)
        def _(j):
            body((self.chunk * CHUNK + j) * BLOCK_N)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def index_scores(q, w, keys, rows, slot, visible, *, scale: float, interpret: bool = False):
    """Every entry of each row's request (the module docstring); ``keys`` bf16 or ``Fp4Keys``."""
    t, n = q.shape[0], rows.shape[1]
    key_leaves, fp4 = _check(q, keys, n)

    def kernel(slot_ref, visible_ref, q_ref, w_ref, rows_ref, *refs):
        *key_refs, o_ref = refs
        p = _Program.load(slot_ref, visible_ref, q_ref, w_ref, fp4)

        def block(e0):
            at = pl.ds(e0, BLOCK_N)

            @pl.when((e0 < n) & (e0 < p.seen))
            def _():
                score = _block_scores(key_refs, rows_ref[p.request, at], p.q_parts, p.wt, scale)   # keys gathered
                entry = e0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_N,), 0)
                o_ref[p.row, at] = jnp.where(entry < p.seen, score, -jnp.inf)

            @pl.when((e0 < n) & (e0 >= p.seen))
            def _():
                o_ref[p.row, at] = jnp.full((BLOCK_N,), -jnp.inf, jnp.float32)
        p.each_block(block)

    return pl.pallas_call(
        kernel, grid=(t, -(-n // (CHUNK * BLOCK_N))), out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        compiler_params=_PARAMS, interpret=interpret,
    )(slot, visible, q, w, rows, *key_leaves)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def index_scores_listed(q, w, keys, rows, slot, visible, listed, *, scale: float, interpret: bool = False):
    """Only the entries ``listed [T, S]`` for each row (-1: none; the candidate blocks' entries
    past the candidate source), -inf elsewhere: the keys of the other entries are never read.
    A program per (row, chunk of listed entries); the scores are scattered into an output
    filled with -inf beforehand (a write of 4 bytes an entry, against a key row's 68 or 256 read)."""
    t, n, s_len = q.shape[0], rows.shape[1], listed.shape[1]
    key_leaves, fp4 = _check(q, keys, n, listed)

    def kernel(slot_ref, visible_ref, q_ref, w_ref, rows_ref, listed_ref, _, *refs):
        *key_refs, o_ref = refs
        p = _Program.load(slot_ref, visible_ref, q_ref, w_ref, fp4)

        def block(e0):
            @pl.when(e0 < s_len)
            def _():
                entry = listed_ref[p.row, pl.ds(e0, BLOCK_N)]
                ok = (entry >= 0) & (entry < p.seen)
                score = _block_scores(key_refs, rows_ref[p.request, jnp.where(ok, entry, 0)], p.q_parts, p.wt, scale)
                # masked lanes write nothing; their address is past the row (where the interpreter,
                # which emulates the mask, drops the write: at a real entry it could collide)
                plt.store(o_ref.at[p.row, jnp.where(ok, entry, n)], score, mask=ok)
        p.each_block(block)

    return pl.pallas_call(
        kernel, grid=(t, -(-s_len // (CHUNK * BLOCK_N))), out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        input_output_aliases={6: 0}, compiler_params=_PARAMS, interpret=interpret,
    )(slot, visible, q, w, rows, listed, jnp.full((t, n), -jnp.inf, jnp.float32), *key_leaves)


def index_scores_reference(q, w, keys, rows, slot, visible, listed=None, *, scale: float, exact_bf16: bool,
                           pass_bytes: int):
    """Both kernels in XLA: each row gathers its request's keys and scores them all (then masks
    them to ``listed``); rows are scored in passes of at most ``pass_bytes`` of per-row
    intermediates (keys [N, d] counted as fp32, scores [H, N]). ``exact_bf16``: q and the keys
    hold values bf16 represents exactly (the FP4 quantiser on), so the dots run on bf16
    operands with fp32 accumulation; else in fp32."""
    t, n = q.shape[0], rows.shape[1]

    def score(q_t, w_t, slot_t):   # one row against every entry of its request
        mine = keys.at_rows(rows[slot_t]).dequantized() if isinstance(keys, Fp4Keys) else keys[rows[slot_t]]
        return scores_of_one(q_t, w_t, mine, scale, exact_bf16)

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
