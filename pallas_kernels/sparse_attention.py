"""Sparse sink MQA for V4.1 on Hopper: a Pallas Mosaic GPU kernel and its pure-jnp reference.

Computes the middle of ``mega.attention.attention`` (after its query RoPE, before its inverse
RoPE; MODEL_SPEC §3.6): for each query token ``t`` and head ``h``::

    z_s = scale * q[t, h] . kv[s]          for the rows s gathered by idx[t, :] (-1: masked)
    o[t, h] = sum_s exp(z_s - M) kv[s] / (exp(sink[h] - M) + sum_s exp(z_s - M))

over one or more KV pools (window ring, compressed pages), K = V. Fully masked rows give 0.

Design (one CTA per (query token, group of 64 heads); 3 warpgroups)
--------------------------------------------------------------------
* MQA: all heads share every key row, so the 64 heads are the wgmma M dimension (as in
  FlashMLA); keys stream through in chunks of ``BLOCK_KV = 64`` gathered rows with an online
  softmax. The sink is folded in as the softmax's starting state (running max ``m = sink``,
  running sum ``l = 1``, ``acc = 0``), so it costs nothing per chunk and a fully masked row
  ends at ``acc / l = 0``.
* Gather. Hopper has no TMA gather, and wgmma wants its operands in 8-row swizzled tiles, so a
  single key row cannot be written into its tile by one copy. The producer warpgroup therefore
  issues one contiguous 1-D bulk copy per row (``cp.async.bulk``, 1 KB for D=512, no tensor
  map) into a plain row-major *staging* buffer, and each compute warpgroup re-lays its half of
  the chunk from staging into a swizzled tiled buffer through registers (load in the WGMMA
  layout, store tiled). That pass is also where fp8 pools are dequantised (below).
  Issuing a row copy costs its thread ~100 cycles (the id's shared-memory load, the
  barrier's expected-bytes arrival, the copy), so the producer's four warps each issue 16 of a
  chunk's 64 copies (``gather_warps``), and Pallas's automatic warpgroup barriers are off
  (one came before every copy): the kernel orders its shared memory itself with mbarriers
  and ``commit_smem``.
* The fp32 output accumulator [64, 512] needs 256 registers per thread in one warpgroup, so
  the two compute warpgroups split D: warpgroup w owns columns ``[w*D/2, (w+1)*D/2)`` of
  Q, of K = V and of the output. QK^T then yields only a partial logit tile per warpgroup
  (contraction over its half of D); the two halves are exchanged through 2 x 16 KB of shared
  memory and summed (fp32 addition commutes, so both warpgroups get bitwise the same logits,
  hence the same softmax). Each warpgroup then runs P @ V on its own D half: no redundant
  MMA work, and K/V tiles are only ever read by the warpgroup that re-laid them.
* FP8 pools (MODEL_SPEC §3.5: e4m3 values, one power-of-two fp32 scale per 32 channels;
  V4.1 keeps its window KV so): the producer bulk-copies each gathered row's 512 bytes into an
  fp8 staging buffer and, next to it, the 128-byte line of fp32 scales that holds the row's 16
  scales (Mosaic GPU's bulk copies move multiples of 128 bytes, a row's scales are 64: the
  scales are viewed as lines [N*16/32, 32], two rows per line at D=512, and the compute side
  picks the row's half by the parity of its id). The re-layout loads the fp8 piece in the WGMMA
  layout, converts e4m3 -> f16 -> f32, multiplies by the row's scale for the column's group
  (two per-row scale vectors per 64-column piece, selected by column), and stores bf16 into the
  same swizzled tiles: every later step is the bf16 kernel's. The products are exact (e4m3
  times a power of two fits bf16), so an fp8 pool gives the same result as the bf16 pool of
  its dequantised values. Gathered bytes per row: 512 + 128 instead of 1024.
* Small batches (flash-decoding): with fewer query tokens than SMs, ``splits`` CTAs share a
  token's key chunks; each starts from an empty softmax (split 0 from the sink), writes its
  normalised partial output with its running max and sum, and an XLA pass weights and sums
  the partials (a few hundred KB at decode sizes).
* Fused: gather + (fp8 dequant) + QK^T + mask + sink + online softmax + PV + normalisation +
  bf16 cast in one launch. Not fused (they stay in ``mega.attention`` / XLA): query RoPE,
  inverse output RoPE, the MXFP8 output cast (MODEL_SPEC §9 lists them in MegaAttention;
  they are elementwise passes over q/o, ~1/10 of the KV bytes at S=640).

Shared memory at H=64, D=512 (per CTA, limit 227 KB on H200): Q 2 x 32 KB (per warpgroup,
reused for its output tile) + staging 65 KB (rows padded by 16 B against bank conflicts) +
tiled K/V 2 x 32 KB + logit exchange 2 x 16 KB (swizzled) + 1 KB for two chunks' row ids and
the sink = 227 KB, 1 KB under the limit (every allocation is rounded up to 1 KB, hence the
sink sharing the ids buffer). The producer copies each chunk's 64 row ids into shared memory
and reads them from there (a scalar global load per row would serialise 64 DRAM latencies),
one chunk ahead in two slots, so that no id fetch waits between a staging release and the
next chunk's row copies; the compute warpgroups take the -1 mask from the same slot. Staging is
single-buffered, but it is released as soon as both warpgroups have pulled it into registers,
so the next chunk's row copies overlap the current chunk's QK^T / softmax / PV (staging and
the tiled buffer act as a 2-deep pipeline). Registers per compute thread: acc 128 (fp32
[64, 256]) + logits 32 + P 16 + re-layout 8 per 64-column piece.

With fp8 pools the staging is 64 x (512 + 16) bytes of e4m3 plus 64 x (32 + 4) fp32 scale
lines = 42 KB instead of 65 KB: fp8-only kernels use 203 KB. With both kinds of pool (the V4.1
layout) the two staging layouts share one 65 KB buffer (``plgpu.RefUnion``; a chunk is only
read through the view it was written through, and the staging release orders the chunks),
plus one barrier for the fp8 chunks (64 x 2 copies): 231,472 bytes against bf16-only's 231,464.

Contract: ``q`` [T, H, D] bf16 with H % 64 == 0, D % 128 == 0 and D <= 512 (the accumulator's
registers); ``pools`` a sequence of
  * bf16 pools ``(kv, idx)``: ``kv`` [N, D] bf16, or
  * fp8 pools ``Fp8Pool(kv, scale, idx)`` (or the plain tuple ``(kv, scale, idx)``): ``kv``
    [N, D] float8_e4m3fn, ``scale`` [N, D // 32] float32 powers of two
    (``model.quant.fp8_block32_parts`` makes both), D in (128, 256, 512); keep N a multiple
    of 128 // (D/8) (2 at D=512), or
    each call pads the scales by a copy;
each with ``idx`` [T, S] int32, entries in [-1, N) (masked slots fetch row 0, which keeps
P @ V finite: 0 * garbage could be NaN); ``sink`` [H] finite. Pools may mix kinds in any order.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src import config  # the (private) switch behind force_gpu_interpret_mode

from pallas_kernels.compat import transposed

HEADS = 64        # wgmma M: one CTA handles 64 heads of one token
BLOCK_KV = 64     # gathered rows per chunk (the WGMMA layout used for the re-layout is 64 rows)
LOG2E = math.log2(math.e)
NO_MAX = -1e30    # the running max of an empty softmax: finite, so exp2(NO_MAX - NO_MAX) = 1
# Staging rows are padded by 16 bytes so that reading a 64x64 block of them in the WGMMA
# layout (8 rows x 16 B per quarter-warp) hits 8 distinct bank groups instead of one.
STAGE_PAD = 8
# fp8 staging rows are padded by 16 bytes for the same reason (16 fp8 elements), and so are
# the staged scale lines (4 fp32), so that the strided column read of one scale group over 64
# rows (the WGMMA row layout) spreads over the banks.
STAGE_PAD_FP8 = 16
SCALE_PAD = 4
# Mosaic GPU's bulk copies (Lane semantics) move multiples of 128 bytes, and a row's scales are
# only D/32 * 4 = 64 bytes at D=512: the kernel sees the scales as lines of 128 bytes (32 fp32,
# the scales of 128 // (D/8) consecutive rows), copies the line holding the row and picks the
# row's part by its id in registers.
SCALE_LINE = 32


class Fp8Pool(NamedTuple):
    """An fp8 KV pool (MODEL_SPEC §3.5, FP8 block 32 UE8M0): row ``r`` of K = V is
    ``kv[r, c] * scale[r, c // 32]``. ``kv`` [N, D] float8_e4m3fn, ``scale`` [N, D // 32]
    float32 powers of two, ``idx`` [T, S] int32 in [-1, N). A plain 3-tuple
    ``(kv, scale, idx)`` is the same thing; a bf16 pool is the 2-tuple ``(kv, idx)``."""
    kv: jax.Array
    scale: jax.Array
    idx: jax.Array


def dequantize_fp8(kv, scale):
    """``kv[..., c] * scale[..., c // 32]`` in fp32 (exact: e4m3 times a power of two)."""
    *lead, d = kv.shape
    return (kv.astype(jnp.float32).reshape(*lead, d // 32, 32) * scale[..., None]).reshape(*lead, d)


def _split_pool(pool):
    """``(kv, idx)`` -> ``(kv, None, idx)``; ``(kv, scale, idx)`` / ``Fp8Pool`` as is."""
    if len(pool) == 2:
        return pool[0], None, pool[1]
    if len(pool) == 3:
        return tuple(pool)
    raise ValueError(f"a pool is (kv, idx) or (kv_fp8, kv_scale, idx), got {len(pool)} arrays")


def _pad_pools(pools, block):
    """Pad each pool's index list to a multiple of ``block`` with -1 (masked) slots."""
    out = []
    for pool in pools:
        kv, scale, idx = _split_pool(pool)
        s = idx.shape[1]
        pad = -s % block
        if pad:
            idx = jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        out.append((kv, scale, idx.astype(jnp.int32)))
    return out


def _gather_rows(pool):
    """fp32 rows of one pool gathered by its idx (masked slots read row 0), dequantised if fp8."""
    kv, scale, idx = _split_pool(pool)
    rows = jnp.maximum(idx, 0)
    if scale is None:
        return kv[rows].astype(jnp.float32)
    return dequantize_fp8(kv[rows], scale[rows])


def sparse_mqa_reference(q, pools, sink, scale):
    """Pure-jnp reference: fp32 logits and softmax of bf16 (or dequantised fp8) inputs, output
    cast to q.dtype. Takes the same pools as ``sparse_mqa``."""
    keys = jnp.concatenate([_gather_rows(p) for p in pools], 1)
    valid = jnp.concatenate([_split_pool(p)[2] >= 0 for p in pools], 1)
    hi = lax.Precision.HIGHEST
    logits = jnp.einsum("thd,tsd->ths", q.astype(jnp.float32), keys, precision=hi) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, :]
    m = jnp.maximum(logits.max(-1), sink)
    p = jnp.exp(logits - m[..., None])
    den = jnp.exp(sink - m) + p.sum(-1)
    out = jnp.einsum("ths,tsd->thd", p / den[..., None], keys, precision=hi)
    return out.astype(q.dtype)


def _mma(acc, a, b_ref, *, transpose_b, interpreting):
    """``acc + a @ b`` (``b = b_ref`` or its transpose) on the tensor cores; ``acc=None``: zero.

    ``a`` is a shared-memory ref or a register array. The compiled kernel runs wgmma, in place
    on the accumulator (``run_state``). The JAX 0.10 Mosaic GPU interpreter runs neither
    ``run_state`` nor wgmma with a transposed or register operand, so interpreted kernels do
    the same product as a plain fp32-accumulating dot of the same shared-memory contents:
    the data movement, barriers and softmax are still the kernel's own.
    """
    if interpreting:
        lhs = a if isinstance(a, jax.Array) else a[...]
        dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
        out = lax.dot_general(lhs, b_ref[...], dims, preferred_element_type=jnp.float32)
        return out if acc is None else acc + out
    b = transposed(b_ref) if transpose_b else b_ref
    if acc is None:
        def fresh(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]
        return pl.run_scoped(fresh, plgpu.ACC((a.shape[0], b.shape[1]), jnp.float32))

    def in_place(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(in_place)(plgpu.ACC.init(acc))


def _interpret_params(interpret):
    """``True`` -> default Mosaic GPU interpret params (a private module in JAX 0.10/0.11)."""
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        return InterpretGPUParams()
    return interpret or None


STAGES = ("row_copies", "relayout", "exchange", "mma")


def sparse_mqa(q, pools: Sequence, sink, scale: float, *, splits: int | None = None, interpret=False,
               gather_warps: int = 4, skip_stages=()):
    """Sparse sink MQA over gathered rows of ``pools`` (see the module docstring).

    ``pools``: bf16 pools ``(kv, idx)`` and/or fp8 pools ``Fp8Pool(kv_fp8, kv_scale, idx)``, e.g.
    ``sparse_mqa(q, [Fp8Pool(*fp8_block32_parts(window_kv), window_idx), (comp_kv, comp_idx)], sink, scale)``.

    ``splits`` > 1 divides each query's key chunks over that many CTAs (flash-decoding, for
    batches too small to fill the GPU); each writes its normalised partial output and its
    softmax statistics, and one XLA pass combines them. ``None``: ``auto_splits`` for this
    GPU's SM count (1 when interpreted).

    ``gather_warps`` (1, 2 or 4): how many warps of the producer warpgroup issue the row copies.

    ``skip_stages`` (a subset of ``STAGES``) is for stage-removal timing only and makes the
    result wrong: the per-row KV copies (the staging barrier is still completed), the re-layout
    into tiles, the exchange of partial logits, or both MMAs.
    """
    skip = frozenset(skip_stages)
    if not skip <= set(STAGES):
        raise ValueError(f"skip_stages must be a subset of {STAGES}, got {sorted(skip)}")
    if gather_warps not in (1, 2, 4):
        raise ValueError(f"gather_warps must be 1, 2 or 4, got {gather_warps}")
    t_len, n_heads, d = q.shape
    if n_heads % HEADS or d % 128 or d > 512 or q.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q with H % {HEADS} == 0 and D % 128 == 0, got {q.shape} {q.dtype}; D <= 512")
    pools = _pad_pools(pools, BLOCK_KV)
    n_groups = d // 32                            # fp8 scale groups per row
    for kv, kv_scale, idx in pools:
        want = jnp.bfloat16 if kv_scale is None else jnp.float8_e4m3fn
        if kv.shape[1] != d or kv.dtype != want or idx.shape[0] != t_len:
            raise ValueError(f"pool kv {kv.shape} {kv.dtype} / idx {idx.shape} do not match q {q.shape}")
        if kv_scale is not None and (kv_scale.shape != (kv.shape[0], n_groups) or kv_scale.dtype != jnp.float32):
            raise ValueError(f"fp8 pool scale {kv_scale.shape} {kv_scale.dtype}: want float32 {(kv.shape[0], n_groups)}")
        if kv_scale is not None and SCALE_LINE % n_groups:
            raise ValueError(f"fp8 pools need D in (128, 256, 512), got {d}")
    interpreting = bool(interpret) or config.pallas_tpu_interpret_mode_context_manager.value is not None
    if splits is None:
        n_sms = 0 if interpreting else getattr(jax.devices()[0], "core_count", 0)
        splits = auto_splits(t_len, n_heads, pools, n_sms)
    n_chunks = [idx.shape[1] // BLOCK_KV for _, _, idx in pools]
    chunk0 = [sum(n_chunks[:p]) for p in range(len(pools))]   # each pool's first global chunk
    per_split = -(-sum(n_chunks) // max(splits, 1))          # chunks per split (the last may have fewer)
    if splits < 1 or (splits - 1) * per_split >= max(1, sum(n_chunks)):
        raise ValueError(f"splits={splits}: each of them needs at least one of the "
                         f"{sum(n_chunks)} key chunks of {BLOCK_KV}")
    is_fp8 = [kv_scale is not None for _, kv_scale, _ in pools]
    rows_per_line = SCALE_LINE // n_groups        # rows whose scales share one 128-byte line
    # View each fp8 pool's scales as 128-byte lines [N / rows_per_line, 32] (free unless N is
    # not a multiple of rows_per_line: then one pad copy of the scales).
    lined = []
    for kv, kv_scale, idx in pools:
        if kv_scale is not None:
            pad = -kv_scale.shape[0] % rows_per_line
            if pad:
                kv_scale = jnp.pad(kv_scale, ((0, pad), (0, 0)), constant_values=1.0)
            kv_scale = kv_scale.reshape(-1, SCALE_LINE)
        lined.append((kv, kv_scale, idx))
    pools = lined
    any_bf16, any_fp8 = not all(is_fp8), any(is_fp8)
    dh = d // 2                                   # D columns per compute warpgroup
    qk_scale = float(scale) * LOG2E               # softmax runs in base 2 (exp2)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    # Register layouts: TILE is the wgmma accumulator layout, ROW a per-head vector (one value
    # per accumulator row), COL a per-key vector. The 0.10 interpreter has no layout_cast.
    TILE, ROW, COL = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    cast = (lambda x, layout: x) if interpreting else plgpu.layout_cast

    # Each pool's refs: (kv, idx) or (kv, scale, idx).
    ref_counts = [3 if f else 2 for f in is_fp8]

    def body(q_ref, sink_ref, *refs):
        o_ref = refs[-1]
        pool_refs, pos = [], 0
        for n in ref_counts:
            r = refs[pos:pos + n]
            pool_refs.append((r[0], r[1] if n == 3 else None, r[-1]))
            pos += n
        if splits > 1:
            o_ref, stats_ref = refs[-2:]
        t, hg, sp = lax.axis_index("t"), lax.axis_index("hg"), lax.axis_index("sp")
        heads = pl.ds(hg * HEADS, HEADS)

        def for_my_split(fn):
            """``fn(s, lo, hi, local)`` for this CTA's split ``s``: global chunks [lo, hi), and
            ``local[p]`` the part of pool p. One static branch per split: loops with traced
            bounds hang the JAX 0.10 Mosaic GPU interpreter."""
            for s in range(splits):
                lo, hi = s * per_split, min((s + 1) * per_split, sum(n_chunks))
                local = [(min(max(lo - c0, 0), nc), min(max(hi - c0, 0), nc)) for c0, nc in zip(chunk0, n_chunks)]
                if splits == 1:
                    fn(s, lo, hi, local)
                else:
                    pl.when(sp == s)(functools.partial(fn, s, lo, hi, local))

        def scoped(q_smem, stages, kt, xch, small, q_bar, ids_bar, full_bar, free_bar, sync_bar, full8_bar=None):
            wg = lax.axis_index("wg")
            stage, stage8, scales = stages
            ids_slot = lambda g: small.at[pl.ds(g % 2 * BLOCK_KV, BLOCK_KV)]  # noqa: E731

            def sync():  # both compute warpgroups meet here
                plgpu.barrier_arrive(sync_bar)
                plgpu.barrier_wait(sync_bar)

            def gather_rows(copy_row):
                """``copy_row(j)`` for the 64 rows of a chunk. Compiled, each of the producer's
                ``gather_warps`` warps issues its share: one issuing thread spends ~100 cycles a
                row (id load, barrier arrivals, copy), which bounded the whole kernel."""
                if interpreting or gather_warps == 1:   # no warp-level code in the 0.10 interpreter
                    pl.loop(0, BLOCK_KV)(copy_row)
                    return
                per_warp = BLOCK_KV // gather_warps

                @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
                def _per_warp():
                    w = lax.axis_index("warp")

                    @pl.when(w < gather_warps)
                    def _mine():
                        pl.loop(0, per_warp)(lambda i: copy_row(w * per_warp + i))

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")
                for w in range(2):
                    plgpu.copy_gmem_to_smem(q_ref.at[t, heads, pl.ds(w * dh, dh)], q_smem.at[w], q_bar)
                # The sink (as int32 bits) shares the small index buffer: every allocation is
                # rounded up to 1 KB, and we have no KB to spare.
                plgpu.copy_gmem_to_smem(sink_ref.at[heads], small.at[pl.ds(2 * BLOCK_KV, HEADS)], q_bar)

                def fetch_ids(p, c, g):
                    """Row ids of chunk ``c`` of pool ``p`` (global chunk ``g``) into slot g % 2."""
                    plgpu.copy_gmem_to_smem(pool_refs[p][2].at[t, pl.ds(c * BLOCK_KV, BLOCK_KV)],
                                            ids_slot(g), ids_bar.at[g % 2])

                @for_my_split
                def _produce(s, lo, hi, local):
                    live = [p for p, (a, b) in enumerate(local) if b > a]
                    if live:   # the first chunk's ids
                        fetch_ids(live[0], local[live[0]][0], lo)
                    for p in live:
                        kv_ref, scale_ref, _ = pool_refs[p]
                        end = local[p][1]
                        # the next chunk is the next pool's first if this pool ends inside the range
                        nxt = next((q for q in live if q > p), None) if chunk0[p] + end < hi else None

                        @pl.loop(*local[p])
                        def _chunk(c, p=p, end=end, kv_ref=kv_ref, scale_ref=scale_ref, nxt=nxt):
                            g = chunk0[p] + c
                            # The single staging buffer is free once both compute WGs have read
                            # the previous chunk into registers.
                            pl.when(g > lo)(lambda: plgpu.barrier_wait(free_bar))
                            # Row ids come through shared memory (a scalar load from global memory per
                            # row would put a DRAM round trip between consecutive row copies), one
                            # chunk ahead: the other slot's ids were read before that release.
                            plgpu.barrier_wait(ids_bar.at[g % 2])
                            pl.when(c + 1 < end)(lambda: fetch_ids(p, c + 1, g + 1))
                            if nxt is not None:
                                pl.when(c + 1 == end)(lambda: fetch_ids(nxt, 0, g + 1))
                            ids_ref = ids_slot(g)

                            if "row_copies" in skip:   # stage-removal timing: complete the barrier bare
                                for _ in range(2 * BLOCK_KV if scale_ref is not None else BLOCK_KV):
                                    plgpu.barrier_arrive(full_bar if scale_ref is None else full8_bar)
                                return

                            @gather_rows
                            def _row(j):
                                row = jnp.maximum(ids_ref[j], 0)
                                if scale_ref is None:
                                    plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(row, 1)], stage.at[pl.ds(j, 1), pl.ds(0, d)], full_bar,
                                                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
                                else:   # fp8: the row's D bytes and its D/32 scales, two arrivals per row
                                    # (lax.div: `//` lowers through sign(), which warp-level code lacks)
                                    plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(row, 1)], stage8.at[pl.ds(j, 1), pl.ds(0, d)], full8_bar,
                                                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
                                    plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(lax.div(row, rows_per_line), 1)],
                                                            scales.at[pl.ds(j, 1), pl.ds(0, SCALE_LINE)],
                                                            full8_bar, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
                    if live:  # observe the last release too (the interpreter checks every phase is seen)
                        plgpu.barrier_wait(free_bar)

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(232, action="increase")
                cols = pl.ds(wg * dh, dh)
                my_kt, my_xch, other_xch = kt.at[wg], xch.at[wg], xch.at[1 - wg]
                plgpu.barrier_wait(q_bar)
                sink_bits = cast(small[pl.ds(2 * BLOCK_KV, HEADS)], ROW)
                sink2 = lax.bitcast_convert_type(sink_bits, jnp.float32) * LOG2E

                def relayout_bf16():
                    for k in range(dh // 64):
                        piece = cast(stage[:, pl.ds(wg * dh + k * 64, 64)], TILE)
                        my_kt[:, pl.ds(k * 64, 64)] = piece

                def relayout_fp8(ids_ref):
                    # Dequantise on the way: e4m3 -> f16 -> f32 (exact), times the row's scale
                    # for the column's 32-group (a power of two: exact), -> bf16 (exact).
                    upper = cast(lax.broadcasted_iota(jnp.int32, (BLOCK_KV, 64), 1), TILE) >= 32
                    # which part of its staged scale line is each row's (masked rows: row 0's)
                    part = jnp.maximum(cast(ids_ref[...], ROW), 0) % rows_per_line

                    def column(c):   # a strided column of the staged scale lines, one value per row
                        if interpreting:
                            return scales[:, c]
                        # not "optimized": Mosaic GPU cannot prove a stride-36 read bank-conflict free
                        return plgpu.load(scales, (slice(None), c), layout=ROW, optimized=False)

                    def row_scales(g):   # scale group g of every staged row, [64] per row
                        out = column(g)
                        for r in range(1, rows_per_line):
                            out = jnp.where(part == r, column(r * n_groups + g), out)
                        return out

                    for k in range(dh // 64):
                        col0 = wg * dh + k * 64
                        g0 = wg * (dh // 32) + 2 * k
                        piece = cast(stage8[:, pl.ds(col0, 64)], TILE).astype(jnp.float32)
                        s_lo, s_hi = row_scales(g0), row_scales(g0 + 1)
                        sc = jnp.where(upper, lax.broadcast_in_dim(s_hi, piece.shape, [0]),
                                       lax.broadcast_in_dim(s_lo, piece.shape, [0]))
                        my_kt[:, pl.ds(k * 64, 64)] = (piece * sc).astype(jnp.bfloat16)

                @for_my_split
                def _consume(s, lo, hi, local):
                    # Split 0 starts from the sink; the others from an empty softmax, with a finite
                    # "-inf" so that a fully masked chunk keeps exp2(m - m_new) = 1.
                    carry = (
                        cast(jnp.zeros((HEADS, dh), jnp.float32), TILE),
                        sink2 if s == 0 else cast(jnp.full((HEADS,), NO_MAX, jnp.float32), ROW),  # max m
                        cast(jnp.full((HEADS,), 1.0 if s == 0 else 0.0, jnp.float32), ROW),       # sum l
                    )
                    # the producer walks the same pools and chunks in the same order
                    for (c_lo, c_hi), fp8, g0 in zip(local, is_fp8, chunk0):

                        def chunk(c, carry, fp8=fp8, g0=g0):
                            acc, m, l = carry
                            g = g0 + c
                            plgpu.barrier_wait(ids_bar.at[g % 2])
                            plgpu.barrier_wait(full8_bar if fp8 else full_bar)
                            ids_ref = ids_slot(g)
                            ids = cast(ids_ref[...], COL)
                            # Re-lay this warpgroup's half of the staged rows into swizzled tiles.
                            # With auto barriers off, this is what keeps a warp from re-laying
                            # into my_kt while another still waits on the previous chunk's PV.
                            plgpu.commit_smem()
                            if "relayout" not in skip:
                                relayout_fp8(ids_ref) if fp8 else relayout_bf16()
                            plgpu.barrier_arrive(free_bar)
                            plgpu.commit_smem()

                            if "mma" in skip:
                                s_part = cast(jnp.zeros((HEADS, BLOCK_KV), jnp.float32), TILE)
                            else:
                                s_part = _mma(None, q_smem.at[wg], my_kt, transpose_b=True, interpreting=interpreting)
                            if "exchange" in skip:
                                s = s_part * qk_scale
                            else:
                                sync()                      # the other WG has read my previous partial
                                my_xch[...] = s_part
                                sync()                      # both partials are written
                                s = (s_part + cast(other_xch[...], TILE)) * qk_scale
                            valid = lax.broadcast_in_dim(ids >= 0, s.shape, [1])
                            s = jnp.where(valid, s, -jnp.inf)
                            m_new = jnp.maximum(m, s.max(axis=1))
                            alpha = jnp.exp2(m - m_new)
                            prob = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                            l = l * alpha + prob.sum(axis=1)
                            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                            if "mma" not in skip:
                                acc = _mma(acc, prob.astype(jnp.bfloat16), my_kt, transpose_b=False, interpreting=interpreting)
                            return acc, m_new, l

                        carry = lax.fori_loop(c_lo, c_hi, chunk, carry)
                    acc, m, l = carry
                    # Only this warpgroup ever read its half of q_smem: reuse it for the output tile.
                    # (l = 0 only in a split whose rows are all masked, where acc = 0 too.)
                    out = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])
                    q_smem[wg] = out.astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    if splits == 1:
                        plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[t, heads, cols])
                    else:
                        plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[s, t, heads, cols])

                        @pl.when(wg == 0)   # m and l (the same in both warpgroups) into the spent id slots
                        def _stats():
                            small[pl.ds(0, HEADS)] = lax.bitcast_convert_type(m, jnp.int32)
                            small[pl.ds(HEADS, HEADS)] = lax.bitcast_convert_type(l, jnp.int32)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(small.at[pl.ds(0, 2 * HEADS)], stats_ref.at[s, t, hg])
                    plgpu.wait_smem_to_gmem(0)

        # Staging: bf16 rows for bf16 pools; fp8 rows + their scales for fp8 pools. With both
        # kinds of pool the two layouts share the same bytes (a chunk is only ever read through
        # the view it was written through, and the staging release orders the chunks).
        stage_bf16 = plgpu.SMEM((BLOCK_KV, d + STAGE_PAD), jnp.bfloat16)
        stage_fp8 = (plgpu.SMEM((BLOCK_KV, d + STAGE_PAD_FP8), jnp.float8_e4m3fn),
                     plgpu.SMEM((BLOCK_KV, SCALE_LINE + SCALE_PAD), jnp.float32))
        if not any_fp8:
            stages, unpack = stage_bf16, lambda s: (s, None, None)
        elif not any_bf16:
            stages, unpack = stage_fp8, lambda s: (None, *s)
        elif interpreting:   # no RefUnion in the 0.10 interpreter (nor any shared-memory limit)
            stages, unpack = (stage_bf16, stage_fp8), lambda s: (s[0], *s[1])
        else:
            stages, unpack = plgpu.RefUnion(stage_bf16, stage_fp8), lambda s: (s[0], *s[1])

        def scoped_unpacked(q_smem, stages_ref, *rest):
            return scoped(q_smem, unpack(stages_ref), *rest)

        pl.run_scoped(
            scoped_unpacked,
            plgpu.SMEM((2, HEADS, dh), jnp.bfloat16, transforms=tiled),       # q, then out, per WG
            stages,                                                           # staging rows
            plgpu.SMEM((2, BLOCK_KV, dh), jnp.bfloat16, transforms=tiled),    # K=V tiles per WG
            plgpu.SMEM((2, HEADS, BLOCK_KV), jnp.float32,                     # logit exchange,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
            plgpu.SMEM((2 * BLOCK_KV + HEADS,), jnp.int32),                   # 2 chunks' ids, sink bits
            plgpu.Barrier(num_arrivals=3),                                    # q + sink landed
            plgpu.Barrier(num_barriers=2),                                    # a chunk's ids landed
            plgpu.Barrier(num_arrivals=BLOCK_KV),                             # staging full (bf16)
            plgpu.Barrier(num_arrivals=2),                                    # staging free
            plgpu.Barrier(num_arrivals=2),                                    # WG exchange
            *([plgpu.Barrier(num_arrivals=2 * BLOCK_KV)] if any_fp8 else []),  # staging full (fp8)
            collective_axes="wg",
        )

    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if splits > 1:   # partial outputs, and (m, l) per head as int32 bits
        out_type = (jax.ShapeDtypeStruct((splits, *q.shape), q.dtype),
                    jax.ShapeDtypeStruct((splits, t_len, n_heads // HEADS, 2 * HEADS), jnp.int32))
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        # tokens last: Mosaic GPU launches the last grid axis as CUDA's x (up to 2^31 - 1
        # blocks); the others are limited to 65535
        grid=(n_heads // HEADS, splits, t_len),
        grid_names=("hg", "sp", "t"),
        num_threads=3,
        thread_name="wg",
        # reduction_scratch_bytes=0: the only reductions are along the WGMMA row (warp
        # shuffles), and the 2 KB default would push us over the shared memory limit.
        # unsafe_no_auto_barriers: Pallas would put a warpgroup barrier before every async copy
        # (64 a chunk in the producer) and around every shared-memory store; the kernel orders
        # its own accesses (mbarriers, commit_smem).
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                             unsafe_no_auto_barriers=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interpret_params(interpret),
    )
    flat = [a for pool in pools for a in pool if a is not None]
    out = kernel(q, lax.bitcast_convert_type(sink.astype(jnp.float32), jnp.int32), *flat)
    return out if splits == 1 else _combine_splits(*out)


def _combine_splits(parts, stats):
    """Softmax-weighted sum of the splits' normalised outputs: split s carries its running max
    m_s (base 2) and sum l_s, so its weight is l_s 2^(m_s - max m) over the sum of weights."""
    s, t, n_hg, _ = stats.shape
    stats = lax.bitcast_convert_type(stats, jnp.float32).reshape(s, t, n_hg, 2, HEADS)
    m, l = (stats[:, :, :, i].reshape(s, t, n_hg * HEADS) for i in range(2))
    w = l * jnp.exp2(m - m.max(0))
    out = jnp.einsum("sth,sthd->thd", w / w.sum(0), parts.astype(jnp.float32))
    return out.astype(parts.dtype)


def auto_splits(t_len: int, n_heads: int, pools: Sequence, n_sms: int) -> int:
    """Key splits per query that fill ``n_sms`` CTAs' worth of work when ``t_len`` queries do
    not: the CTA count rounded down, with chunks spread evenly (each split gets >= 1)."""
    chunks = sum(-(-_split_pool(p)[2].shape[1] // BLOCK_KV) for p in pools)
    if not chunks:
        return 1
    want = max(1, min(chunks, n_sms // max(1, t_len * n_heads // HEADS)))
    per = -(-chunks // want)
    return -(-chunks // per)
