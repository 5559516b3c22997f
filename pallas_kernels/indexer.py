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
fp32. ``index_scores_listed`` scores only the entries listed for each row (the index layers
past the candidate source score their candidate blocks alone) and returns them in list order,
[T, S].

Design: a program per (group of a request's rows, chunk of ``CHUNK`` x ``BLOCK_N`` entries),
groups fastest. A group is up to ``group_rows(H)`` consecutive rows of one request (a decode
step's token and drafts; a prefill's rows four at a time at H = 32), so its q is one
``[G x H, d]`` operand: per block of entries the program gathers the request's keys by their
pool rows (the pool is paged), decodes them once, runs one ``[G x H, d] x [d, BLOCK_N]`` dot
on the tensor cores and reduces the ReLU'd products over heads with each row's weights.
Groups that run together read the same keys, from L2 after the first. Blocks past the
group's visible entries skip the dot and store -inf. No ``[T, N, d]`` intermediate exists, and
invisible entries cost no key reads. FP4 keys are read as stored, 68 bytes an entry at
d = 128 (against 256 in bf16), and decoded in registers into the two channel halves of bf16
values (exact), each half its own K-part of the dot.

Why the Triton backend (deprecated since JAX 0.11, still shipped in 0.12): a gather of arbitrary
pool rows is one load there, where Mosaic GPU needs hand-written ``cp.async`` (as
``sparse_attention`` has); if the lowering goes, that is the port.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.block_scaled import FP4, Fp4Keys, e2m1_scaled, stored_kind

BLOCK_N = 64      # entries per dot
CHUNK = 16        # blocks per program: q is loaded once per 1024 entries
GROUP_M = 128     # query rows x heads per dot (one request's rows share each key they read)


def fits(heads: int, head_dim: int, n: int, kind: str) -> bool:
    """Whether the kernels take ``heads`` x ``head_dim`` queries against ``n`` entries (or listed
    entries) a row, of keys stored as ``kind``: FP4 keys need whole 32-channel blocks in each
    half of the channels (a code byte holds a channel of each half)."""
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    return (kind in (FP4, "bfloat16") and pow2(heads) and pow2(head_dim) and n % BLOCK_N == 0 and n > 0
            and (kind != FP4 or head_dim % 64 == 0))


def _q_parts(q_ref, rows, fp4: bool) -> list:
    """Query rows ``rows`` (an index of ``q_ref``'s leading dims) as the dots' K-parts: whole, or
    for FP4 keys the two channel halves (loaded apart: Triton cannot slice a loaded tile)."""
    d = q_ref.shape[-1]
    if not fp4:
        return [q_ref[rows]]
    return [q_ref[(*rows, pl.ds(0, d // 2))], q_ref[(*rows, pl.ds(d // 2, d // 2))]]


def _key_parts(key_refs, r) -> list:
    """The keys at pool rows ``r`` ``[BLOCK_N]`` as bf16 K-parts of the dots: bf16 keys whole; FP4
    keys (``Fp4Keys``: byte j holds channel j low, j + d/2 high) decoded once into their two
    halves, each 32-channel block times its UE8M0 scale (exact in bf16)."""
    if len(key_refs) == 1:
        return [key_refs[0][r, :]]
    codes_ref, scale_ref = key_refs
    codes = codes_ref[r, :].astype(jnp.int32)                          # [BLOCK_N, d/2]
    per_half = codes.shape[1] // 32
    block = jax.lax.broadcasted_iota(jnp.int32, codes.shape, 1) // 32
    parts = []
    for half, code in enumerate((codes & 15, codes >> 4)):
        exponent = 0
        for b in range(per_half):
            exponent = jnp.where(block == b, scale_ref[r, half * per_half + b].astype(jnp.int32)[:, None], exponent)
        parts.append(e2m1_scaled(code, exponent).astype(jnp.bfloat16))
    return parts


def _dots(a_parts: list, b_parts: list) -> jax.Array:
    """``sum_i a_i @ b_i.T`` in fp32 (the K-parts of one product)."""
    out = 0.0
    for a, b in zip(a_parts, b_parts):
        out = out + plt.dot(a, b, trans_b=True)
    return out


def _check(q, keys, n: int, listed=None) -> tuple[list, bool]:
    """Refuse what the kernels cannot tile; the keys' arrays and whether they are FP4 records."""
    h, d = q.shape[1:]
    width, kind = n if listed is None else listed.shape[1], stored_kind(keys)
    if not fits(h, d, width, kind) or q.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q [T, H, d] with H, d powers of two >= 16 (d in 64s for FP4 keys), keys in "
                         f"bf16 or Fp4Keys, and N (or the listed entries) a multiple of {BLOCK_N}; got q {q.shape} "
                         f"{q.dtype}, keys {kind}, N = {n}")
    return jax.tree.leaves(keys), kind == FP4


def group_rows(heads: int) -> int:
    """Rows of one request a program scores together: ``group_rows x heads`` is the dots' M, 128."""
    return max(1, GROUP_M // heads)


def _groups(slot: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Runs of rows of one request (any order of runs), cut every ``size`` rows: each group's first
    row and length, ascending, then ``T`` and 0 for the unused ends of the ``[T]`` vectors."""
    t = slot.shape[0]
    i = jnp.arange(t, dtype=jnp.int32)
    run_start = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.ones((1,), bool), slot[1:] != slot[:-1]]), i, 0))
    group = jnp.cumsum((i - run_start) % size == 0) - 1
    return (jnp.full((t,), t, jnp.int32).at[group].min(i), jnp.zeros((t,), jnp.int32).at[group].add(1))


_PARAMS = plt.CompilerParams(num_warps=4, num_stages=2)


def _each_block(chunk, body) -> None:
    """``body(e0)`` for the first entry (or list position) of each block of ``chunk``."""
    @pl.loop(0, CHUNK)
    def _(j):
        body((chunk * CHUNK + j) * BLOCK_N)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def index_scores(q, w, keys, rows, slot, visible, *, scale: float, interpret: bool = False):
    """Every entry of each row's request (the module docstring); ``keys`` bf16 or ``Fp4Keys``."""
    t, h, d = q.shape
    n, g = rows.shape[1], group_rows(h)
    key_leaves, fp4 = _check(q, keys, n)
    firsts, counts = _groups(slot, g)
    def pad(a):   # a group's loads of G rows may end past T
        return jnp.concatenate([a, jnp.zeros((g,) + a.shape[1:], a.dtype)])

    def kernel(firsts_ref, counts_ref, slot_ref, visible_ref, q_ref, w_ref, rows_ref, *refs):
        *key_refs, o_ref = refs
        group, chunk = pl.program_id(0), pl.program_id(1)   # (read here: the interpreter takes them at top level)
        first, count = firsts_ref[group], counts_ref[group]

        @pl.when(count > 0)
        def _():
            member = jax.lax.broadcasted_iota(jnp.int32, (g,), 0) < count
            seen = jnp.where(member, visible_ref[pl.ds(first, g)], 0)
            most, request = jnp.max(seen), slot_ref[first]
            q_parts = _q_parts(q_ref, (pl.ds(first * h, g * h),), fp4)             # [G x H, d]: the dots' M
            wt = w_ref[pl.ds(first * h, g * h)]
            out_rows, mask = pl.ds(first, g), jnp.broadcast_to(member[:, None], (g, BLOCK_N))  # past T: masked

            def block(e0):
                at = pl.ds(e0, BLOCK_N)

                @pl.when((e0 < n) & (e0 < most))
                def _():
                    s = _dots(q_parts, _key_parts(key_refs, rows_ref[request, at]))   # keys gathered, decoded once
                    score = jnp.sum((jnp.maximum(s, 0.0) * wt[:, None]).reshape(g, h, BLOCK_N), axis=1)
                    entry = e0 + jax.lax.broadcasted_iota(jnp.int32, (g, BLOCK_N), 1)
                    plt.store(o_ref.at[out_rows, at], jnp.where(entry < seen[:, None], score, -jnp.inf), mask=mask)

                @pl.when((e0 < n) & (e0 >= most))
                def _():
                    plt.store(o_ref.at[out_rows, at], jnp.full((g, BLOCK_N), -jnp.inf, jnp.float32), mask=mask)
            _each_block(chunk, block)

    return pl.pallas_call(
        kernel, grid=(t, -(-n // (CHUNK * BLOCK_N))), out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
        compiler_params=_PARAMS, interpret=interpret,
    )(firsts, counts, slot, pad(visible), pad(q).reshape(-1, d), pad(w * scale).reshape(-1), rows, *key_leaves)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def index_scores_listed(q, w, keys, rows, slot, visible, listed, *, scale: float, interpret: bool = False):
    """The scores ``[T, S]`` of the entries ``listed [T, S]`` for each row, in list order (-1, or
    an entry past the row's visible ones: -inf): past the candidate source a row scores its
    candidate blocks' entries alone, and the keys of the others are never read. Rows list their
    own entries, so a program is a (row, chunk of its list)."""
    t, n, s_len = q.shape[0], rows.shape[1], listed.shape[1]
    key_leaves, fp4 = _check(q, keys, n, listed)

    def kernel(slot_ref, visible_ref, q_ref, w_ref, rows_ref, listed_ref, *refs):
        *key_refs, o_ref = refs
        row, chunk = pl.program_id(0), pl.program_id(1)
        seen, request, wt = visible_ref[row], slot_ref[row], w_ref[row]
        q_parts = _q_parts(q_ref, (row, slice(None)), fp4)

        def block(e0):
            @pl.when(e0 < s_len)
            def _():
                at = pl.ds(e0, BLOCK_N)
                entry = listed_ref[row, at]
                ok = (entry >= 0) & (entry < seen)
                s = _dots(_key_parts(key_refs, rows_ref[request, jnp.where(ok, entry, 0)]), q_parts)   # [BLOCK_N, H]
                o_ref[row, at] = jnp.where(ok, jnp.sum(jnp.maximum(s, 0.0) * wt[None, :], axis=1), -jnp.inf)
        _each_block(chunk, block)

    return pl.pallas_call(
        kernel, grid=(t, -(-s_len // (CHUNK * BLOCK_N))), out_shape=jax.ShapeDtypeStruct((t, s_len), jnp.float32),
        compiler_params=_PARAMS, interpret=interpret,
    )(slot, visible, q, w * scale, rows, listed, *key_leaves)


def index_scores_reference(q, w, keys, rows, slot, visible, listed=None, *, scale: float, exact_bf16: bool,
                           pass_bytes: int):
    """Both kernels in XLA: each row gathers its request's keys (with ``listed``, those of its
    listed entries alone) and scores them; rows are scored in passes of at most ``pass_bytes`` of
    per-row intermediates (keys [N or S, d] counted as fp32, scores [H, N or S]). ``exact_bf16``:
    q and the keys hold values bf16 represents exactly (the FP4 quantiser on), so the dots run
    on bf16 operands with fp32 accumulation; else in fp32."""
    t, n = q.shape[0], rows.shape[1]
    cols = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (t, n)) if listed is None else listed

    def score(q_t, w_t, slot_t, cols_t):   # one row against its entries
        at = rows[slot_t, jnp.clip(cols_t, 0, n - 1)]
        mine = keys.at_rows(at).dequantized() if isinstance(keys, Fp4Keys) else keys[at]
        return scores_of_one(q_t, w_t, mine, scale, exact_bf16)

    chunk = max(1, pass_bytes // (4 * cols.shape[1] * (q.shape[2] + q.shape[1])))
    scores = (jax.vmap(score)(q, w, slot, cols) if chunk >= t
              else jax.lax.map(lambda a: score(*a), (q, w, slot, cols), batch_size=chunk))
    return jnp.where((cols >= 0) & (cols < visible[:, None]), scores, -jnp.inf)


def scores_of_one(q, w, keys, scale: float, exact_bf16: bool):
    """``[N]`` scores of one query (``q [H, d]``, head weights ``w [H]``) against ``keys [N, d]``."""
    if exact_bf16:
        s = jnp.einsum("hd,nd->hn", q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
    else:
        s = jnp.einsum("hd,nd->hn", q, keys.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    s = jax.nn.relu(s) * scale
    return jnp.einsum("h,hn->n", w, s, precision=jax.lax.Precision.HIGHEST)
