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
  layout, store tiled). That pass is also where the fp8 variant will dequantise.
* The fp32 output accumulator [64, 512] needs 256 registers per thread in one warpgroup, so
  the two compute warpgroups split D: warpgroup w owns columns ``[w*D/2, (w+1)*D/2)`` of
  Q, of K = V and of the output. QK^T then yields only a partial logit tile per warpgroup
  (contraction over its half of D); the two halves are exchanged through 2 x 16 KB of shared
  memory and summed (fp32 addition commutes, so both warpgroups get bitwise the same logits,
  hence the same softmax). Each warpgroup then runs P @ V on its own D half: no redundant
  MMA work, and K/V tiles are only ever read by the warpgroup that re-laid them.
* Fused: gather + QK^T + mask + sink + online softmax + PV + normalisation +
  bf16 cast in one launch (fp8 KV is not done yet; its dequant belongs in the re-layout). Not fused (they stay in ``mega.attention`` / XLA): query RoPE,
  inverse output RoPE, the MXFP8 output cast (MODEL_SPEC §9 lists them in MegaAttention;
  they are elementwise passes over q/o, ~1/10 of the KV bytes at S=640).

Shared memory at H=64, D=512 (per CTA, limit 227 KB on H200): Q 2 x 32 KB (per warpgroup,
reused for its output tile) + staging 65 KB (rows padded by 16 B against bank conflicts) +
tiled K/V 2 x 32 KB + logit exchange 2 x 16 KB (swizzled) + 1 KB for the chunk's row ids and
the sink = 227 KB, 1 KB under the limit (every allocation is rounded up to 1 KB, hence the
sink sharing the ids buffer). The producer copies each chunk's 64 row ids into shared memory
first and reads them from there (a scalar global load per row would serialise 64 DRAM
latencies), and the compute warpgroups take the -1 mask from the same buffer. Staging is
single-buffered, but it is released as soon as both warpgroups have pulled it into registers,
so the next chunk's row copies overlap the current chunk's QK^T / softmax / PV (staging and
the tiled buffer act as a 2-deep pipeline). Registers per compute thread: acc 128 (fp32
[64, 256]) + logits 32 + P 16 + re-layout 8 per 64-column piece.

Contract: ``q`` [T, H, D] bf16 with H % 64 == 0, D % 128 == 0 and D <= 512 (the accumulator's registers); each pool ``kv`` [N, D]
bf16, ``idx`` [T, S] int32 with entries in [-1, N) (masked slots fetch row 0, which keeps
P @ V finite: 0 * garbage could be NaN); ``sink`` [H] finite.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src import config  # the (private) switch behind force_gpu_interpret_mode

HEADS = 64        # wgmma M: one CTA handles 64 heads of one token
BLOCK_KV = 64     # gathered rows per chunk (the WGMMA layout used for the re-layout is 64 rows)
LOG2E = math.log2(math.e)
# Staging rows are padded by 16 bytes so that reading a 64x64 block of them in the WGMMA
# layout (8 rows x 16 B per quarter-warp) hits 8 distinct bank groups instead of one.
STAGE_PAD = 8


def _pad_pools(pools, block):
    """Pad each pool's index list to a multiple of ``block`` with -1 (masked) slots."""
    out = []
    for kv, idx in pools:
        s = idx.shape[1]
        pad = -s % block
        if pad:
            idx = jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        out.append((kv, idx.astype(jnp.int32)))
    return out


def sparse_mqa_reference(q, pools, sink, scale, **_):
    """Pure-jnp reference: fp32 logits and softmax of bf16 inputs, output cast to q.dtype."""
    keys = jnp.concatenate([kv[jnp.maximum(idx, 0)].astype(jnp.float32) for kv, idx in pools], 1)
    valid = jnp.concatenate([idx >= 0 for _, idx in pools], 1)
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
    b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref
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


def sparse_mqa(q, pools: Sequence, sink, scale: float, *, interpret=False):
    """Sparse sink MQA over gathered rows of ``pools`` (see the module docstring)."""
    t_len, n_heads, d = q.shape
    if n_heads % HEADS or d % 128 or d > 512 or q.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q with H % {HEADS} == 0 and D % 128 == 0, got {q.shape} {q.dtype}; D <= 512")
    pools = _pad_pools(pools, BLOCK_KV)
    for kv, idx in pools:
        if kv.shape[1] != d or kv.dtype != jnp.bfloat16 or idx.shape[0] != t_len:
            raise ValueError(f"pool kv {kv.shape} {kv.dtype} / idx {idx.shape} do not match q {q.shape}")
    n_chunks = [idx.shape[1] // BLOCK_KV for _, idx in pools]
    dh = d // 2                                   # D columns per compute warpgroup
    qk_scale = float(scale) * LOG2E               # softmax runs in base 2 (exp2)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    interpreting = bool(interpret) or config.pallas_tpu_interpret_mode_context_manager.value is not None
    # Register layouts: TILE is the wgmma accumulator layout, ROW a per-head vector (one value
    # per accumulator row), COL a per-key vector. The 0.10 interpreter has no layout_cast.
    TILE, ROW, COL = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    cast = (lambda x, layout: x) if interpreting else plgpu.layout_cast

    def body(q_ref, sink_ref, *refs):
        pool_refs, o_ref = refs[:-1], refs[-1]
        t, hg = lax.axis_index("t"), lax.axis_index("hg")
        heads = pl.ds(hg * HEADS, HEADS)

        def scoped(q_smem, stage, kt, xch, small, q_bar, ids_bar, full_bar, free_bar, sync_bar):
            wg = lax.axis_index("wg")

            def sync():  # both compute warpgroups meet here
                plgpu.barrier_arrive(sync_bar)
                plgpu.barrier_wait(sync_bar)

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")
                for w in range(2):
                    plgpu.copy_gmem_to_smem(q_ref.at[t, heads, pl.ds(w * dh, dh)], q_smem.at[w], q_bar)
                # The sink (as int32 bits) shares the small index buffer: every allocation is
                # rounded up to 1 KB, and we have no KB to spare.
                plgpu.copy_gmem_to_smem(sink_ref.at[heads], small.at[pl.ds(BLOCK_KV, HEADS)], q_bar)
                step = 0
                for p, nc in enumerate(n_chunks):
                    kv_ref, idx_ref = pool_refs[2 * p], pool_refs[2 * p + 1]

                    @pl.loop(0, nc)
                    def _chunk(c, kv_ref=kv_ref, idx_ref=idx_ref, first=step == 0):
                        # The single staging buffer is free once both compute WGs have read
                        # the previous chunk into registers.
                        if first:
                            pl.when(c > 0)(lambda: plgpu.barrier_wait(free_bar))
                        else:
                            plgpu.barrier_wait(free_bar)

                        chunk_ids = pl.ds(c * BLOCK_KV, BLOCK_KV)
                        # Row ids come through shared memory: a scalar load from global memory per
                        # row would put a DRAM round trip between consecutive row copies.
                        plgpu.copy_gmem_to_smem(idx_ref.at[t, chunk_ids], small.at[pl.ds(0, BLOCK_KV)], ids_bar)
                        plgpu.barrier_wait(ids_bar)

                        @pl.loop(0, BLOCK_KV)
                        def _row(j):
                            row = jnp.maximum(small[j], 0)
                            plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(row, 1)], stage.at[pl.ds(j, 1), pl.ds(0, d)], full_bar,
                                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
                    step += nc
                if step:  # observe the last release too (the interpreter checks every phase is seen)
                    plgpu.barrier_wait(free_bar)

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(232, action="increase")
                cols = pl.ds(wg * dh, dh)
                my_kt, my_xch, other_xch = kt.at[wg], xch.at[wg], xch.at[1 - wg]
                plgpu.barrier_wait(q_bar)
                sink_bits = cast(small[pl.ds(BLOCK_KV, HEADS)], ROW)
                sink2 = lax.bitcast_convert_type(sink_bits, jnp.float32) * LOG2E
                carry = (
                    cast(jnp.zeros((HEADS, dh), jnp.float32), TILE),
                    sink2,                                                   # running max m
                    cast(jnp.ones((HEADS,), jnp.float32), ROW),  # sum l
                )
                for nc in n_chunks:   # the producer walks the same pools and chunks in the same order

                    def chunk(c, carry):
                        acc, m, l = carry
                        plgpu.barrier_wait(ids_bar)
                        plgpu.barrier_wait(full_bar)
                        ids = cast(small[pl.ds(0, BLOCK_KV)], COL)
                        # Re-lay this warpgroup's half of the staged rows into swizzled tiles.
                        for k in range(dh // 64):
                            piece = cast(stage[:, pl.ds(wg * dh + k * 64, 64)], TILE)
                            my_kt[:, pl.ds(k * 64, 64)] = piece
                        plgpu.barrier_arrive(free_bar)
                        plgpu.commit_smem()

                        s_part = _mma(None, q_smem.at[wg], my_kt, transpose_b=True, interpreting=interpreting)
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

                        acc = _mma(acc, prob.astype(jnp.bfloat16), my_kt, transpose_b=False, interpreting=interpreting)
                        return acc, m_new, l

                    carry = lax.fori_loop(0, nc, chunk, carry)
                acc, _, l = carry
                # Only this warpgroup ever read its half of q_smem: reuse it for the output tile.
                out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
                q_smem[wg] = out.astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[t, heads, cols])
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((2, HEADS, dh), jnp.bfloat16, transforms=tiled),       # q, then out, per WG
            plgpu.SMEM((BLOCK_KV, d + STAGE_PAD), jnp.bfloat16),              # staging rows
            plgpu.SMEM((2, BLOCK_KV, dh), jnp.bfloat16, transforms=tiled),    # K=V tiles per WG
            plgpu.SMEM((2, HEADS, BLOCK_KV), jnp.float32,                     # logit exchange,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
            plgpu.SMEM((BLOCK_KV + HEADS,), jnp.int32),                       # chunk's indices, sink bits
            plgpu.Barrier(num_arrivals=3),                                    # q + sink landed
            plgpu.Barrier(),                                                  # chunk's ids landed
            plgpu.Barrier(num_arrivals=BLOCK_KV),                             # staging full
            plgpu.Barrier(num_arrivals=2),                                    # staging free
            plgpu.Barrier(num_arrivals=2),                                    # WG exchange
            collective_axes="wg",
        )

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(t_len, n_heads // HEADS),
        grid_names=("t", "hg"),
        num_threads=3,
        thread_name="wg",
        # reduction_scratch_bytes=0: the only reductions are along the WGMMA row (warp
        # shuffles), and the 2 KB default would push us over the shared memory limit.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interpret_params(interpret),
    )
    flat = [a for pool in pools for a in pool]
    return kernel(q, lax.bitcast_convert_type(sink.astype(jnp.float32), jnp.int32), *flat)
