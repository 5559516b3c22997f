"""Mega-mHC's pass over the streams on GPU: a Pallas kernel (Triton backend) and its jnp reference.

For each row ``t`` of an mHC site (MODEL_SPEC §3.3; ``mega.mhc`` runs the whole step)::

    H'[t, k] = post[t, k] y[t] + sum_j comb[t, j, k] H[t, j]      fp32, stored in H's dtype
    c[t]     = sum_k pre[t, k] H'[t, k]                          the collapse, in H's dtype
    m[t]     = fn . (H'[t] / rms(H'[t]))                         the site's mix projection (H' flattened)

Contract: ``streams`` [T, hc, D] (bf16 on the GPU), ``update`` None (the first site: H' = H) or
``(y [T, D], post [T, hc] fp32, comb [T, hc, hc] fp32)``, ``pre`` [T, hc] fp32, ``fn`` None (the
final collapse: no new mix) or [M, hc D] fp32 with M <= ``MIX_ROWS``; D a multiple of ``BLOCK_D``.
Returns ``(H', c, m [T, M] fp32 | None)``; H' is ``streams`` itself without an update. The
kernel's sums differ from the reference's only in order (it scales the projection by the RMS
factor after the dot, not its input before).

Design: a program per (block of ``BLOCK_T`` rows, run of ``BLOCK_D``-channel chunks): one chunk
a program at decode sizes, so that a step's few rows still spread over the SMs, more from 1K
rows (``chunks_per_program``). A program reads its rows' four streams and the update once,
writes H' and c, and leaves its share of the sum of squares and of the projection (an fp32 dot
of its H' against its chunks of ``fn``, IEEE, not TF32) in partials that the jitted wrapper
sums and scales: one launch where XLA runs the expansion, the statistic, a skinny fp32 GEMM over
K = hc D (which some XLA flags hand to untuned cuBLAS, one CTA walking all of K) and the
collapse. The Triton backend, as the indexer's: masked row edges and a small dot, no tiles to
stage through shared memory.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK_T = 16      # rows a program (the fp32 dot's M)
BLOCK_D = 64      # channels a program: four streams of [16, 64] fp32 held at once
MIX_ROWS = 32     # the projection's outputs padded to a dot's N (V4.1: 24)
# The rows up to which the pass beats XLA's: at 32 (a decode step of 8 requests) its one launch
# is as busy as XLA's ten (H100, bench/RESULTS.md "Mega-mHC timed"); from 256 rows XLA's fusions
# are faster, the IEEE fp32 dot on CUDA cores and the fn slices each row block re-reads costing
# more than the passes they save.
MAX_ROWS = 32
_PARAMS = plt.CompilerParams(num_warps=4, num_stages=1)


def fits(hidden: int, mix_rows: int) -> bool:
    return hidden % BLOCK_D == 0 and mix_rows <= MIX_ROWS


def chunks_per_program(rows: int, chunks: int) -> int:
    """Channel chunks a program walks: one while rows are few (a decode step: every chunk its own
    program, to fill the SMs), more as rows grow, so that the per-program partials stay small
    (at 16K rows and one chunk a program they would be 168 MB a site)."""
    return max(c for c in range(1, chunks + 1) if chunks % c == 0 and c <= max(1, rows // 512))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def mhc_pass(streams, update, pre, fn, *, eps: float, interpret: bool = False):
    """The module docstring's pass, as one kernel launch and the sums of its partials."""
    t, hc, d = streams.shape
    dtype, expand, mix = streams.dtype, update is not None, fn is not None
    if not fits(d, fn.shape[0] if mix else 0):
        raise ValueError(f"hidden {d} must be a multiple of {BLOCK_D} and the mix at most {MIX_ROWS} rows")
    walk = chunks_per_program(t, d // BLOCK_D)
    parts = d // BLOCK_D // walk

    def kernel(*refs):
        refs = list(refs)
        h_ref, pre_ref = refs.pop(0), refs.pop(0)
        y_ref, post_ref, comb_ref = (refs.pop(0) for _ in range(3)) if expand else (None,) * 3
        fn_ref = refs.pop(0) if mix else None
        c_ref = refs.pop(0)
        hnew_ref = refs.pop(0) if expand else None
        sq_ref, m_ref = (refs.pop(0), refs.pop(0)) if mix else (None, None)
        t0, part = pl.program_id(0) * BLOCK_T, pl.program_id(1)
        rows = pl.ds(t0, BLOCK_T)
        ok = (t0 + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_T,), 0) < t)[:, None]
        fn_ok = jax.lax.broadcasted_iota(jnp.int32, (MIX_ROWS, 1), 0) < (fn_ref.shape[0] if mix else 0)

        def column(ref, i):   # a per-row coefficient, [BLOCK_T, 1]
            return plt.load(ref.at[rows, pl.ds(i, 1)], mask=ok, other=0.0)
        pre = [column(pre_ref, k) for k in range(hc)]   # (loaded once, not per chunk)
        post = [column(post_ref, k) for k in range(hc)] if expand else None
        comb = [column(comb_ref, i) for i in range(hc * hc)] if expand else None

        def one_chunk(j, sums):
            d0 = (part * walk + j) * BLOCK_D

            def at(k):   # stream k's channels of this chunk in a flattened [hc D] row
                return pl.ds(k * d + d0, BLOCK_D)
            h = [plt.load(h_ref.at[rows, at(k)], mask=ok, other=0).astype(jnp.float32) for k in range(hc)]
            if expand:
                y = plt.load(y_ref.at[rows, pl.ds(d0, BLOCK_D)], mask=ok, other=0).astype(jnp.float32)
                new = []
                for k in range(hc):
                    mixed = comb[k] * h[0]
                    for i in range(1, hc):
                        mixed = mixed + comb[i * hc + k] * h[i]
                    v = (post[k] * y + mixed).astype(dtype)
                    plt.store(hnew_ref.at[rows, at(k)], v, mask=ok)
                    new.append(v.astype(jnp.float32))
                h = new
            c = pre[0] * h[0]
            for k in range(1, hc):
                c = c + pre[k] * h[k]
            plt.store(c_ref.at[rows, pl.ds(d0, BLOCK_D)], c.astype(dtype), mask=ok)
            if not mix:
                return sums
            sq, m = sums
            for k in range(hc):
                sq = sq + jnp.sum(h[k] * h[k], axis=1, keepdims=True)
                w = plt.load(fn_ref.at[pl.ds(0, MIX_ROWS), at(k)], mask=fn_ok, other=0.0)
                m = m + plt.dot(h[k], w, trans_b=True, precision=jax.lax.Precision.HIGHEST)
            return sq, m

        zeros = (jnp.zeros((BLOCK_T, 1), jnp.float32), jnp.zeros((BLOCK_T, MIX_ROWS), jnp.float32))
        sums = jax.lax.fori_loop(0, walk, one_chunk, zeros if mix else ())
        if mix:
            plt.store(sq_ref.at[rows, pl.ds(part, 1)], sums[0], mask=ok)
            plt.store(m_ref.at[rows, pl.ds(part * MIX_ROWS, MIX_ROWS)], sums[1], mask=ok)

    args = [streams.reshape(t, hc * d), pre]
    outs = [jax.ShapeDtypeStruct((t, d), dtype)]
    if expand:
        y, post, comb = update
        args += [y, post, comb.reshape(t, hc * hc)]
        outs.append(jax.ShapeDtypeStruct((t, hc * d), dtype))
    if mix:
        args.append(fn)
        outs += [jax.ShapeDtypeStruct((t, parts), jnp.float32),
                 jax.ShapeDtypeStruct((t, parts * MIX_ROWS), jnp.float32)]
    got = list(pl.pallas_call(kernel, grid=(-(-t // BLOCK_T), parts), out_shape=outs, compiler_params=_PARAMS,
                              interpret=interpret)(*args))
    c = got.pop(0)
    new_streams = got.pop(0).reshape(t, hc, d) if expand else streams
    if not mix:
        return new_streams, c, None
    sq, m = got
    scale = jax.lax.rsqrt(sq.sum(1) / (hc * d) + eps)
    return new_streams, c, m.reshape(t, parts, MIX_ROWS).sum(1)[:, :fn.shape[0]] * scale[:, None]


def expand_reference(streams, update):
    """``H'`` in XLA: ``streams`` when there is no update."""
    if update is None:
        return streams
    y, post, comb = update
    mixed = jnp.einsum("tjk,tjd->tkd", comb, streams.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (post[..., None] * y.astype(jnp.float32)[:, None, :] + mixed).astype(streams.dtype)


def mhc_pass_reference(streams, update, pre, fn, *, eps: float):
    """The pass in XLA, fp32 throughout with ``HIGHEST`` dots: the model's numerics off the GPU."""
    highest = jax.lax.Precision.HIGHEST
    t, hc, d = streams.shape
    streams = expand_reference(streams, update)
    h = streams.astype(jnp.float32)
    c = jnp.einsum("tk,tkd->td", pre, h, precision=highest).astype(streams.dtype)
    if fn is None:
        return streams, c, None
    flat = h.reshape(t, hc * d)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
    return streams, c, jnp.einsum("ti,oi->to", flat, fn, precision=highest, preferred_element_type=jnp.float32)
