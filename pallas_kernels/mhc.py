"""Mega-mHC's pass over the streams on GPU: a Pallas kernel (Triton backend) and its jnp reference.

For each row ``t`` of an mHC site (MODEL_SPEC §3.3; ``mega.mhc`` runs the whole step)::

    H'[t, k] = post[t, k] y[t] + sum_j comb[t, j, k] H[t, j]      fp32, stored in H's dtype
    c[t]     = sum_k pre[t, k] H'[t, k]                          the collapse, in H's dtype
    m[t]     = fn . (H'[t] / rms(H'[t]))                         the site's mix projection (H' flattened)

Contract: ``streams`` [T, hc, D] (bf16 on the GPU), ``update`` None (the first site: H' = H) or
``(y [T, D], post [T, hc] fp32, comb [T, hc, hc] fp32)``, ``pre`` [T, hc] fp32, ``fn`` None (the
final collapse: no new mix) or [M, hc D] fp32 with M <= ``MIX_ROWS``; D a multiple of the tiles'
``block_d``. Returns ``(H', c, m [T, M] fp32 | None)``; H' is ``streams`` itself without an
update. The kernel's sums differ from the reference's only in order (both project bf16 streams
through ``fn``'s three bf16 parts and apply the RMS factor after the dot).

Design: a program per (block of ``block_t`` rows, part of the channels); it walks its part's
``block_d``-channel chunks, reading the rows' streams and update once, writing H' and c, and
adding each chunk's sum of squares and projection to its partials, which the jitted wrapper sums
and scales. Parts: as many as fill ``TARGET_PROGRAMS`` with the row blocks (a decode step's few
rows spread over the SMs; prefill's row blocks alone fill them, one part each), so the partials
stay a few MB. The projection runs on the tensor cores: H' is bf16 when the streams are (the
reference projects the stored values too), and each fp32 slice of ``fn`` is split in registers
into three bf16 parts whose sum is its value to 24 bits, so three bf16 dots accumulating in fp32
give the fp32 products. Triton backend, as the indexer's: masked row edges, small dots, no
tiles to stage through shared memory.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MIX_ROWS = 32     # the projection's outputs padded to a dot's N (V4.1: 24)
TARGET_PROGRAMS = 264   # two waves of an H100's or H200's 132 SMs


class Tiles(NamedTuple):
    block_t: int = 64    # rows a program: the dots' M
    block_d: int = 32    # channels a chunk: four streams of [64, 32] fp32 held at once
    warps: int = 4
    stages: int = 2      # Triton's software pipelining of the chunk loop


# bench/mhc_gpu.py's sweep (H100, bench/RESULTS.md "Mega-mHC's tiles"): two pipeline stages, the
# next chunk's loads in flight under this one's dots, run the pass 2.1-2.8x faster than one from
# 256 rows up, level with or ahead of XLA's fusions at every size from 32 to 16K rows; more warps,
# wider chunks, taller or shorter blocks were slower.
TILES = Tiles()


def fits(hidden: int, mix_rows: int, tiles: Tiles = TILES) -> bool:
    return hidden % tiles.block_d == 0 and mix_rows <= MIX_ROWS


def parts_for(rows: int, chunks: int, tiles: Tiles = TILES) -> int:
    """Channel parts a row block splits into: the most, up to filling ``TARGET_PROGRAMS`` with the
    row blocks, that divide the chunks evenly."""
    want = max(1, TARGET_PROGRAMS // -(-rows // tiles.block_t))
    return max(p for p in range(1, chunks + 1) if chunks % p == 0 and p <= want)


def _split3(w):
    """fp32 ``w`` as three bf16 parts, ``hi + mid + lo == w`` to 24 bits (each residual exact)."""
    hi = w.astype(jnp.bfloat16)
    r = w - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    return hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "tiles"))
def mhc_pass(streams, update, pre, fn, *, eps: float, interpret: bool = False, tiles: Tiles = TILES):
    """The module docstring's pass, as one kernel launch and the sums of its partials."""
    t, hc, d = streams.shape
    dtype, expand, mix = streams.dtype, update is not None, fn is not None
    bt, bd = tiles.block_t, tiles.block_d
    if not fits(d, fn.shape[0] if mix else 0, tiles):
        raise ValueError(f"hidden {d} must be a multiple of {bd} and the mix at most {MIX_ROWS} rows")
    parts = parts_for(t, d // bd, tiles)
    walk = d // bd // parts

    def kernel(*refs):
        refs = list(refs)
        h_ref, pre_ref = refs.pop(0), refs.pop(0)
        y_ref, post_ref, comb_ref = (refs.pop(0) for _ in range(3)) if expand else (None,) * 3
        fn_ref = refs.pop(0) if mix else None
        c_ref = refs.pop(0)
        hnew_ref = refs.pop(0) if expand else None
        sq_ref, m_ref = (refs.pop(0), refs.pop(0)) if mix else (None, None)
        t0, part = pl.program_id(0) * bt, pl.program_id(1)
        rows = pl.ds(t0, bt)
        ok = (t0 + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0) < t)[:, None]
        fn_ok = jax.lax.broadcasted_iota(jnp.int32, (MIX_ROWS, 1), 0) < (fn_ref.shape[0] if mix else 0)

        def column(ref, i):   # a per-row coefficient, [bt, 1]
            return plt.load(ref.at[rows, pl.ds(i, 1)], mask=ok, other=0.0)
        pre = [column(pre_ref, k) for k in range(hc)]   # (loaded once, not per chunk)
        post = [column(post_ref, k) for k in range(hc)] if expand else None
        comb = [column(comb_ref, i) for i in range(hc * hc)] if expand else None

        def one_chunk(j, sums):
            d0 = (part * walk + j) * bd

            def at(k):   # stream k's channels of this chunk in a flattened [hc D] row
                return pl.ds(k * d + d0, bd)
            h = [plt.load(h_ref.at[rows, at(k)], mask=ok, other=0) for k in range(hc)]
            if expand:
                y = plt.load(y_ref.at[rows, pl.ds(d0, bd)], mask=ok, other=0).astype(jnp.float32)
                new = []
                for k in range(hc):
                    mixed = comb[k] * h[0].astype(jnp.float32)
                    for i in range(1, hc):
                        mixed = mixed + comb[i * hc + k] * h[i].astype(jnp.float32)
                    v = (post[k] * y + mixed).astype(dtype)
                    plt.store(hnew_ref.at[rows, at(k)], v, mask=ok)
                    new.append(v)
                h = new
            c = pre[0] * h[0].astype(jnp.float32)
            for k in range(1, hc):
                c = c + pre[k] * h[k].astype(jnp.float32)
            plt.store(c_ref.at[rows, pl.ds(d0, bd)], c.astype(dtype), mask=ok)
            if not mix:
                return sums
            sq, m = sums
            for k in range(hc):
                hk = h[k].astype(jnp.float32)
                sq = sq + jnp.sum(hk * hk, axis=1, keepdims=True)
                w = plt.load(fn_ref.at[pl.ds(0, MIX_ROWS), at(k)], mask=fn_ok, other=0.0)
                if dtype == jnp.bfloat16:   # tensor cores: exact bf16 rows against fn in three parts
                    for part_w in _split3(w):
                        m = m + plt.dot(h[k], part_w, trans_b=True)
                else:
                    m = m + plt.dot(hk, w, trans_b=True, precision=jax.lax.Precision.HIGHEST)
            return sq, m

        zeros = (jnp.zeros((bt, 1), jnp.float32), jnp.zeros((bt, MIX_ROWS), jnp.float32))
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
    params = plt.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages)
    got = list(pl.pallas_call(kernel, grid=(-(-t // bt), parts), out_shape=outs, compiler_params=params,
                              interpret=interpret)(*args))
    c = got.pop(0)
    new_streams = got.pop(0).reshape(t, hc, d) if expand else streams
    if not mix:
        return new_streams, c, None
    sq, m = got
    scale = jax.lax.rsqrt(sq.sum(1) / (hc * d) + eps)
    return new_streams, c, m.reshape(t, parts, MIX_ROWS).sum(1)[:, :fn.shape[0]] * scale[:, None]


def _mixed(weights, h):
    """``sum_j weights[:, j] h[:, j]`` over the streams of ``h [T, hc, D]`` (fp32), ``weights``
    [T, hc] (-> [T, D]) or [T, hc, hc] (-> [T, hc, D]), as broadcast products: one elementwise
    fusion (a batched dot of [hc, hc] blocks was a third of XLA's GPU pass, bench/RESULTS.md)."""
    w, hb = weights[..., None], (h if weights.ndim == 2 else h[:, :, None])
    out = w[:, 0] * hb[:, 0]
    for j in range(1, h.shape[1]):
        out = out + w[:, j] * hb[:, j]
    return out


def expand_reference(streams, update):
    """``H'`` in XLA: ``streams`` when there is no update."""
    if update is None:
        return streams
    y, post, comb = update
    mixed = _mixed(comb, streams.astype(jnp.float32))
    return (post[..., None] * y.astype(jnp.float32)[:, None, :] + mixed).astype(streams.dtype)


def mhc_pass_reference(streams, update, pre, fn, *, eps: float):
    """The pass in XLA, fp32 sums: the model's numerics off the GPU. bf16 streams are projected
    as the kernel projects them (``_split3``: exact bf16 products on the tensor cores, then the
    RMS factor); others by an fp32 ``HIGHEST`` dot of the normalised rows."""
    t, hc, d = streams.shape
    streams = expand_reference(streams, update)
    h = streams.astype(jnp.float32)
    c = _mixed(pre, h).astype(streams.dtype)
    if fn is None:
        return streams, c, None
    flat = h.reshape(t, hc * d)
    inv = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
    if streams.dtype == jnp.bfloat16:
        parts = jnp.concatenate(_split3(fn), axis=0)   # [3M, hc D]: one read of the rows
        m = jnp.einsum("ti,oi->to", streams.reshape(t, hc * d), parts, preferred_element_type=jnp.float32)
        return streams, c, m.reshape(t, 3, -1).sum(1) * inv
    return streams, c, jnp.einsum("ti,oi->to", flat * inv, fn, precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)
