"""Sparse sink MQA for V4.1 on Hopper: a Pallas Mosaic GPU kernel and its pure-jnp reference.

Computes the middle of ``mega.attention.attention`` (after its query RoPE, before its inverse
RoPE; MODEL_SPEC §3.6): for each query token ``t`` and head ``h``::

    z_s = scale * q[t, h] . kv[s]          for the rows s gathered by idx[t, :] (-1: masked)
    o[t, h] = sum_s exp(z_s - M) kv[s] / (exp(sink[h] - M) + sum_s exp(z_s - M))

over one or more KV pools (window ring, compressed pages), K = V. Fully masked rows give 0.

Design (one CTA per (query token, group of 64 heads), or persistent CTAs; 3 warpgroups)
--------------------------------------------------------------------------------------
* MQA: all heads share every key row, so the 64 heads are the wgmma M dimension (as in
  FlashMLA); keys stream through in chunks of ``BLOCK_KV = 64`` gathered rows with an online
  softmax. The sink is folded in as the softmax's starting state (running max ``m = sink``,
  running sum ``l = 1``, ``acc = 0``), so it costs nothing per chunk and a fully masked row
  ends at ``acc / l = 0``.
* Gather. Hopper has no TMA gather, and wgmma wants its operands in 8-row tiles with a
  128-byte swizzle. The producer warpgroup's 128 threads therefore copy the chunk in 16-byte
  ``cp.async`` pieces (Mosaic GPU code inlined through ``plgpu.inline_mgpu``), each piece
  straight to its swizzled place in the tile: nothing re-lays the rows afterwards (FlashMLA's
  Hopper sparse kernel gathers the same way). Eight consecutive threads take the eight
  pieces of a row's 128-byte line, so a warp's copy instruction reads four whole lines (the
  fewest L1 requests for 512 bytes), and the swizzle spreads the shared writes over all banks.
  Two threads per row (a warp's copy then touched 16 lines, 32 bytes of each) made the
  gather, not the MMAs, the bound: 13-17% slower on the H200 (bench/RESULTS.md).
* Two K/V slots. While the compute warpgroups work on chunk g in one slot, chunk g+1's rows
  land in the other. The producer, per chunk: waits for the slot to be released (the
  compute warpgroups arrive on its "free" barrier after their P @ V), issues the chunk's
  copies, and has each of its threads arrive on the slot's "full" mbarrier through
  ``cp.async.mbarrier.arrive.noinc``, an arrival that happens when that thread's copies
  have landed: the producer never waits for its own copies, and the compute warpgroups
  start on a chunk as soon as its last row is in (they fence it for the tensor cores).
  Each thread's place in the tile is computed once per chunk, and its four rows' source
  addresses once per row; its 32 copies are constant offsets from them. Row ids come through
  shared memory (a scalar global load per row would serialise DRAM round trips), fetched by
  TMA one chunk ahead into three slots: a slot is refilled only after both compute
  warpgroups have released the chunk that read it.
* The fp32 output accumulator [64, 512] needs 256 registers per thread in one warpgroup, so
  the two compute warpgroups split D: warpgroup w owns columns ``[w*D/2, (w+1)*D/2)`` of
  Q, of K = V and of the output (each K/V slot holds the two halves as separate tiles).
  QK^T then yields only a partial logit tile per warpgroup (contraction over its half of D);
  the two halves are exchanged through 2 x 16 KB of shared memory and summed (fp32 addition
  commutes, so both warpgroups get bitwise the same logits, hence the same softmax). Each
  warpgroup then runs P @ V on its own D half: no redundant MMA work.
* FP8 pools (MODEL_SPEC §3.5: e4m3 values, one power-of-two scale per 32 channels stored as
  its UE8M0 exponent byte; V4.1 keeps its window KV so): the producer copies each row's D
  fp8 bytes, split in halves, into a row-major fp8 view of the slot that lies inside the
  half-tile of the warpgroup that owns them (rows padded to D/2 + 16 bytes, which keeps the
  WGMMA-layout reads conflict free), and the row's D/32 scale bytes into that padding.
  Before its QK^T each compute warpgroup dequantises its half in place: it loads the fp8
  values and its scale bytes into registers, syncs its four warps, converts
  (e4m3 -> f32, times 2^(e - 127), -> bf16: exact, since e4m3 times a power of two fits
  bf16) and stores the bf16 tile over the same bytes. From there on the chunk is a bf16
  chunk, so an fp8 pool gives the same result as the bf16 pool of its dequantised values.
  Gathered bytes per row: D + D/32 instead of 2 D.
* Small batches (flash-decoding): with fewer query tokens than SMs, ``splits`` CTAs share a
  token's key chunks; each starts from an empty softmax (split 0 from the sink), writes its
  normalised partial output with its running max and sum, and an XLA pass weights and sums
  the partials (a few hundred KB at decode sizes).
* Persistent CTAs (``ctas``): with one split, a grid of one CTA per SM, each taking every
  ``ctas``-th (query token, head group) item. Chunk numbers, K/V slots, id slots and barrier
  phases run on from one item to the next, so the producer gathers the next item's first
  chunks while the compute warpgroups finish the last one, and it loads the next q into the
  output tiles' shared memory once their stores have read them (a "q free" barrier). Measured
  on the H200 against one CTA per item (bench/RESULTS.md, same call, GPU busy time): bf16
  pools 2.5-5% faster (decode 256 requests, prefill 4K and 16K). With an fp8 window pool the
  compute warpgroups spill more (ptxas: 236 bytes against 32 per item: the in-place
  dequantisation holds a half-chunk of fp8 values and scales beside the accumulator, and the
  loop adds its state); that made it 2-6% slower while the gather was the bound. Since the
  gather reads whole lines it is 1-4% faster at decode 128-256 and prefill 4K and 64K, level
  at decode 32-64 and 2% slower at prefill 16K (three calls). So ``ctas=None`` is persistent
  for every pool kind.
* Fused: gather + (fp8 dequant) + QK^T + mask + sink + online softmax + PV + normalisation +
  bf16 cast in one launch. Not fused (they stay in ``mega.attention`` / XLA): query RoPE,
  inverse output RoPE, the MXFP8 output cast (MODEL_SPEC §9 lists them in MegaAttention;
  they are elementwise passes over q/o, ~1/10 of the KV bytes at S=640).

Shared memory at H=64, D=512 (per CTA, limit 227 KB on H200): Q 2 x 32 KB (per warpgroup,
reused for its output tile) + K/V 2 slots x 2 halves x 32 KB + logit exchange 2 x 16 KB
(swizzled) + 1 KB for three chunks' row ids and the sink + 1 KB for the two "full"
mbarriers = 226 KB. The fp8 view of the slots is a ``plgpu.RefUnion`` member over the same
bytes (``Fp8View``: rows of D/2 + 16 bytes, each (slot, half) region of 64 rows inside its
own bf16 half-tile, so a warpgroup's in-place dequantisation never touches another region).
Registers per compute thread: acc 128 (fp32 [64, 256]) + logits 32 + P 16, or during an fp8
dequant the acc + 64 for the fp8 half + 16 scales.

Where the time goes (H200, stage removal, bench/RESULTS.md). Since the gather reads whole lines
(commit ``0e3db46``), leaving out the row copies saves 3% at prefill 4K and nothing at
decode-256; leaving out the logit exchange saves 21% and 11%, the MMAs 43% and 17%. So a chunk
is bound by the compute warpgroups' chain (QK^T, exchange, softmax, P @ V in lockstep), not by
the bytes: at decode-256 the kernel moves from DRAM what the roofline counts (Nsight Compute:
691 MB against 692) at 60% of the DRAM peak, with the tensor pipe busy 39% of the cycles. Having
each warpgroup compute the whole QK^T instead (no exchange, 1.5x the MMA work), alone or with
the warpgroups taking turns at it (FlashAttention-3's ping-pong), was within the spread (-5% to
+7% at prefill 4K by wall clock and profiler, +-1% at decode-256). Everything below was measured
with the old gather (two threads per row), which hid part of each chunk's cost behind the
copies, so its verdicts on schedules need retiming.

With the old gather: the row copies, the MMAs and the logit exchange added up almost exactly,
i.e. they barely overlapped. Per 64-key chunk the MMAs read 192 KB of shared memory (QK^T at
N=64 reads both operands from it: 16 MACs per byte, which is what the tensor cores consume at
the 128 B/clock shared-memory rate), the exchange moves 64 KB and the copies write 64 KB, so
shared-memory bandwidth, not the tensor cores, bounds a chunk; and both compute warpgroups run
QK^T, softmax and P @ V in lockstep, so the tensor cores idle during the softmax. FlashMLA's
split (each warpgroup computes the full-D QK^T and softmax of every other chunk and publishes
P, 8 KB, instead of exchanging fp32 partial logits) was tried and measured 1.3x slower
(bench/RESULTS.md): the softmax steps then form one chain that alternates between the
warpgroups through shared memory and barriers, and that chain, not the tensor cores, set the
pace. FlashMLA keeps the tensor cores busy through the chain by issuing a warpgroup's next QK^T
before it waits on the other's softmax; with whole-slot barriers that next chunk (two ahead)
waits for the slot both warpgroups' P @ V of the current chunk still read, and a whole gather
(FlashMLA frees and refills each D half of a slot on its own: see "Next" below). Timed at 4, 10
and 25 chunks per query, a CTA costs 3.15 us per chunk plus 4 us (prefill; 8-9 us at decode,
launch included), so a persistent grid that hid one token's prologue and epilogue behind the
previous token's chunks would save at most ~11% (prefill) to ~20% (decode); the persistent grid
above saves about 3% (it still waits for each item's q, and a chunk's cost is unchanged).
Overlapping one chunk's softmax with the next chunk's QK^T (FlashAttention-3's order) needs
that chunk landed a step earlier, i.e. a third 64 KB K/V slot, and the kernel already uses 226
of 227 KB; smaller chunks in more slots pay more than the overlap gains (branch
``split-d-pipe``, below). Keeping each chunk's P @ V in flight until the next chunk's QK^T (an
in-place accumulator) was measured no faster (bench/RESULTS.md): the wgmma wait between them is
not the cost. Nsight Compute agrees (bench/RESULTS.md): the tensor pipe is busy 33-34% of the
cycles at decode and prefill, and the compute warps' stall samples in the key loop sit at the
first exchange barrier (17%: the two warpgroups' QK^T share the tensor cores, so one waits for
the other's), on P @ V's and QK^T's completion (14% and 6.5%), and on the shared-memory loads
of the row ids and the zero word (11%). Reading those while QK^T runs, and a named barrier for
the exchange, moved the stalls without making a chunk shorter (branch ``ids-named-barrier``).

Next (on branches, not on main): FlashMLA's Hopper sparse prefill kernel
(``csrc/sm90/prefill/sparse``, the same problem at D = 512: 64 heads per CTA, 64-key blocks,
two K/V slots, 640 TFLOP/s on an H800) runs the split we tried without the chain stalling,
through four things our attempt lacked: (1) a one-way max dependency: warpgroup 0 uses its own
running max and publishes it, warpgroup 1 takes the larger of that and its own, and warpgroup
0 later rescales its P and output by the difference, so no softmax waits on a round trip; (2)
each warpgroup issues its own block's P @ V from registers right after its softmax, before any
wait on the other; only the peer's P (8 KB bf16) goes through shared memory; (3) warpgroup 0
issues the next even block's QK^T right behind its last P @ V; (4) each K/V slot's two D
halves have their own "full" and "free" barriers, so a half is refilled as soon as its readers
are done and the early QK^T starts on a half-landed block. Shared memory: q 64 KB + two slots
128 KB + two P tiles 16 KB, about 210 KB. A first version with (1) and (2) (branch
``seesaw-wip``) is correct in the interpreter and on the H200, and 1.2-1.7x slower than split
D (bench/RESULTS.md): without (3) and (4) each pair's hand-offs leave the tensor cores idle.
With (3) and (4) as well (branch ``seesaw2``) and its tiles indexed through a zero loaded in
each pair (static tile refs make all 64 wgmma descriptors of a QK^T loop-invariant, and LLVM
hoisted them into 128 registers: the PTX showed it), it runs level with split D at prefill and
8% behind at decode-256, and still spills 416 bytes per compute thread (bench/RESULTS.md).
Split D indexes q's tile the same way: its 16 descriptors were hoisted too (32 registers);
without them it does not spill. Branch ``split-d-pipe`` keeps split D and overlaps within
each warpgroup instead: 32-key chunks in four slots (the same 128 KB), chunk g+1's QK^T issued
before chunk g's exchange and softmax. The overlap gains 2.5%, but an N = 32 QK^T reads q from
shared memory twice as often per key (192 B/clock at the tensor peak, against 128), and the
branch is 3% slower than main at decode-256 and 2-5% at prefill 4K (bench/RESULTS.md).

Contract: ``q`` [T, H, D] bf16 with H % 64 == 0, D % 128 == 0 and D <= 512 (the accumulator's
registers); ``pools`` a sequence of
  * bf16 pools ``(kv, idx)``: ``kv`` [N, D] bf16, or
  * fp8 pools ``Fp8Pool(kv, scale, idx)`` (or the plain tuple ``(kv, scale, idx)``): ``kv``
    [N, D] float8_e4m3fn, ``scale`` [N, D // 32] uint8 UE8M0 exponents (the scale is
    2^(e - 127); ``ue8m0`` converts power-of-two fp32 scales such as
    ``model.quant.fp8_block32_parts`` makes);
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

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels.block_scaled import dequantize_fp8, pow2_from_exponent
from pallas_kernels.compat import transposed

HEADS = 64        # wgmma M: one CTA handles 64 heads of one token
BLOCK_KV = 64     # gathered rows per chunk (the WGMMA layout used by the fp8 dequant is 64 rows)
SLOTS = 2         # K/V tile slots: one being filled while the other is computed on
ID_SLOTS = 3      # row-id slots: one chunk ahead of the copies, which run one ahead of compute
LOG2E = math.log2(math.e)
NO_MAX = -1e30    # the running max of an empty softmax: finite, so exp2(NO_MAX - NO_MAX) = 1
# fp8 rows in a slot are D/2 + 16 bytes apart: reading a 64x64 block in the WGMMA layout
# (8 rows x 16 B per quarter-warp) then hits 8 distinct bank groups instead of one, and the
# 16 bytes hold the row's D/32 UE8M0 scale bytes.
FP8_PAD = 16
COPY = 16         # bytes per cp.async piece
WARPGROUP = 128   # threads
# Registers per thread after setmaxnreg (2 x compute + producer <= 512: 64K per SM over 3 x 128
# threads). The compute warpgroups spill (ptxas): at 4096 prefill tokens 32 bytes (bf16, persistent),
# 88 (fp8 window, one item per CTA) and 276 (fp8, persistent) with 232 registers; 12, 32 and 236
# with 240, which made the three 0.5%, 2.3% and 3.8% faster on the H200 (bench/RESULTS.md).
PRODUCER_REGS, COMPUTE_REGS = 24, 240


class Fp8View(NamedTuple):
    """Where the fp8 rows of a K/V slot live: a row-major view [rows, pitch] of the slots'
    bytes in which region (slot, half) starts at row ``slot * slot_rows + half * half_rows``.
    Each region starts and ends inside its own bf16 half-tile (``BLOCK_KV * dh`` bf16), so
    dequantising one half in place leaves every other region intact, and the view is no
    larger than the bf16 tiles."""
    pitch: int
    half_rows: int
    slot_rows: int
    rows: int

    @classmethod
    def for_half_width(cls, dh: int) -> "Fp8View":
        pitch, half_tile = dh + FP8_PAD, BLOCK_KV * dh * 2
        view = cls(pitch, -(-half_tile // pitch), -(-2 * half_tile // pitch), 2 * SLOTS * half_tile // pitch)
        for s in range(SLOTS):
            for h in range(2):
                start = s * view.slot_rows + h * view.half_rows
                k = 2 * s + h
                assert k * half_tile <= start * pitch and (start + BLOCK_KV) * pitch <= (k + 1) * half_tile, dh
                assert start + BLOCK_KV <= view.rows, dh
        return view


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


def _cp_async_gather(*, fp8: bool, d: int, half_rows: int = 0):
    """Mosaic GPU (per-thread) code for the producer warpgroup: copy one chunk's ``BLOCK_KV``
    gathered rows into a K/V slot in 16-byte ``cp.async`` pieces (the thread's noinc arrival
    that follows tracks them all).

    Called as ``gather(kv, ids, dst)`` (bf16: ``dst`` the slot's two [64, D/2] half-tiles,
    (8, 64)-tiled with a 128-byte swizzle) or ``gather(kv, ids, dst, scale)`` (fp8: ``dst`` the
    slot's rows of the fp8 view, [half_rows + 64, D/2 + FP8_PAD]). Thread ``8j + i`` copies
    pieces ``i, i + 8, ..`` of rows ``j, j + 16, ..`` (of an fp8 row at D = 128, with four
    pieces per half: ``4j + i``, rows ``j, j + 32``), so a warp's copy reads whole 128-byte
    lines; the thread's place in the tile is computed once (``(j + 16 r) % 8 = j % 8``, so one
    swizzle XOR serves all its rows) and each piece is a constant offset from it and its row.
    """
    dh = d // 2
    row_bytes = d if fp8 else 2 * d
    pieces = row_bytes // COPY                    # per row
    half_pieces = pieces // 2                     # per compute warpgroup's half of D
    tpr = min(8, half_pieces)                     # threads per row: a 128-byte line, or half an fp8 row
    step = WARPGROUP // tpr                       # rows per round of the warpgroup
    assert BLOCK_KV % step == 0 and half_pieces % tpr == 0
    pitch8 = dh + FP8_PAD
    n_scales = d // 32                            # UE8M0 bytes per row: 4, 8 or 16

    def gather(ctx, kv, ids, dst, *scale):
        del ctx
        i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
        c = lambda v, t=i32: arith.constant(t, v)  # noqa: E731
        add, mul = arith.addi, arith.muli
        tid = mgpu_utils.thread_idx()
        if isinstance(tid.type, ir.IndexType) or str(tid.type) == "index":
            tid = arith.index_cast(i32, tid)
        lane = arith.remui(tid, c(WARPGROUP))
        global_ptr = lambda ref: llvm.addrspacecast(  # noqa: E731
            llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))
        gep = lambda ptr, off: mgpu_utils.getelementptr(ptr, [off], i8)  # noqa: E731
        dst_ptr = mgpu_utils.memref_ptr(dst)

        def row_id(j):
            rid = memref.load(ids, [arith.index_cast(ir.IndexType.get(), j)])
            return arith.extui(i64, arith.maxsi(rid, c(0)))       # -1 (masked) reads row 0

        def copy(dst, src, size=COPY):
            nvvm.cp_async_shared_global(
                dst, src, size, nvvm.LoadCacheModifierKind.CG if size == COPY else nvvm.LoadCacheModifierKind.CA)

        j0, sub = arith.divui(lane, c(tpr)), arith.remui(lane, c(tpr))
        if fp8:   # row j of each half's row-major region, at pitch8
            base = gep(dst_ptr, add(mul(j0, c(pitch8)), mul(sub, c(COPY))))
        else:     # (8, 64) tiles, row-major over [64/8, dh/64]; 128B swizzle: 16B piece ^ (row % 8)
            r8 = arith.remui(j0, c(8))                     # (j0 + step r) % 8 = j0 % 8 (tpr = 8)
            base = gep(dst_ptr, add(add(mul(arith.divui(j0, c(8)), c(dh // 64 * 1024)), mul(r8, c(128))),
                                    mul(arith.xori(sub, r8), c(COPY))))
        for r in range(BLOCK_KV // step):
            j = add(j0, c(step * r))
            rid = row_id(j)
            src_row = gep(global_ptr(kv), add(mul(rid, c(row_bytes, i64)), arith.extui(i64, mul(sub, c(COPY)))))
            for i in range(pieces // tpr):
                h, q = divmod(tpr * i, half_pieces)
                if fp8:
                    static = (h * half_rows + step * r) * pitch8 + q * COPY
                else:
                    static = step * r // 8 * (dh // 64 * 1024) + h * BLOCK_KV * dh * 2 + q // 8 * 1024
                copy(gep(base, c(static)), gep(src_row, c(tpr * i * COPY, i64)))
            if fp8:   # the row's scale bytes into the padding of half `sub`, by its first two threads
                with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, sub, c(2))):
                    copy(gep(dst_ptr, add(mul(add(mul(sub, c(half_rows)), j), c(pitch8)), c(dh))),
                         gep(global_ptr(scale[0]), mul(rid, c(n_scales, i64))), n_scales)

    return gather


# Each slot's "full" barrier is a plain mbarrier that the producer's 128 threads arrive on
# through cp.async.mbarrier.arrive.noinc: a thread's arrival happens when its copies have
# landed, so the producer never waits for its own copies and the compute warpgroups start
# on a chunk the moment its last row is in. (Pallas barriers cannot be handed to inline
# Mosaic GPU code, hence these few lines of PTX.)
def _ptx(asm, *args):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), list(args), asm, ",".join("r" * len(args)), has_side_effects=True)


def _init_full_barriers(ctx, bars):
    """All threads: thread 0 initialises the slots' barriers for 128 arrivals and the zero word
    after them (see ``sparse_mqa``); then a CTA sync."""
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    tid = mgpu_utils.thread_idx()
    if isinstance(tid.type, ir.IndexType) or str(tid.type) == "index":
        tid = arith.index_cast(i32, tid)
    base = mgpu_utils.memref_ptr(bars)
    for k in range(SLOTS):
        ptr = mgpu_utils.getelementptr(base, [8 * k], ir.IntegerType.get_signless(8))
        _ptx(f"{{ .reg .pred p; setp.eq.u32 p, $1, 0; @p mbarrier.init.shared::cta.b64 [$0], {WARPGROUP}; }}", ptr, tid)
    ptr = mgpu_utils.getelementptr(base, [8 * SLOTS], ir.IntegerType.get_signless(8))   # the zero word
    _ptx("{ .reg .pred p; setp.eq.u32 p, $1, 0; @p st.shared.u32 [$0], 0; }", ptr, tid)
    _ptx("fence.mbarrier_init.release.cluster;")
    _ptx("bar.sync 0;")


def _arrive_on_landing(ctx, bar):
    """This thread arrives on ``bar`` once all its cp.async copies so far have landed."""
    del ctx
    _ptx("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", mgpu_utils.memref_ptr(bar))


def _wait_parity(parity: int):
    def wait(ctx, bar):
        del ctx
        _ptx("{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], "
             f"{parity}; @done bra DONE; bra WAIT; DONE: }}", mgpu_utils.memref_ptr(bar))
    return wait


STAGES = ("row_copies", "dequant", "exchange", "mma")


def sparse_mqa(q, pools: Sequence, sink, scale: float, *, splits: int | None = None, ctas: int | None = None,
               interpret=False, skip_stages=()):
    """Sparse sink MQA over gathered rows of ``pools`` (see the module docstring).

    ``pools``: bf16 pools ``(kv, idx)`` and/or fp8 pools ``Fp8Pool(kv_fp8, kv_ue8m0, idx)``, e.g.
    ``sparse_mqa(q, [Fp8Pool(kv8, ue8m0(s), window_idx), (comp_kv, comp_idx)], sink, scale)``.

    ``splits`` > 1 divides each query's key chunks over that many CTAs (flash-decoding, for
    batches too small to fill the GPU); each writes its normalised partial output and its
    softmax statistics, and one XLA pass combines them. ``None``: ``auto_splits`` for this
    GPU's SM count (1 when interpreted).

    ``ctas``: CTAs of the grid, each taking every ``ctas``-th (query token, head group, split)
    item in turn (persistent when fewer than the items; only with one split). ``None``: one per
    SM on the GPU with one split, else one per item (see the module docstring).

    ``skip_stages`` (a subset of ``STAGES``) is for stage-removal timing only and makes the
    result wrong: the row copies (the slot is still handed over), the in-place fp8
    dequantisation, the exchange of partial logits, or both MMAs.
    """
    skip = frozenset(skip_stages)
    if not skip <= set(STAGES):
        raise ValueError(f"skip_stages must be a subset of {STAGES}, got {sorted(skip)}")
    t_len, n_heads, d = q.shape
    if n_heads % HEADS or d % 128 or d > 512 or q.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q with H % {HEADS} == 0 and D % 128 == 0, got {q.shape} {q.dtype}; D <= 512")
    pools = _pad_pools(pools, BLOCK_KV)
    for kv, kv_scale, idx in pools:
        want = jnp.bfloat16 if kv_scale is None else jnp.float8_e4m3fn
        if kv.shape[0] < 1 or kv.shape[1] != d or kv.dtype != want or idx.shape[0] != t_len:
            raise ValueError(f"pool kv {kv.shape} {kv.dtype} / idx {idx.shape} do not match q {q.shape} "
                             "(or the pool is empty: masked slots read its row 0)")
        if kv_scale is not None and (kv_scale.shape != (kv.shape[0], d // 32) or kv_scale.dtype != jnp.uint8):
            raise ValueError(f"fp8 pool scale {kv_scale.shape} {kv_scale.dtype}: want uint8 UE8M0 "
                             f"{(kv.shape[0], d // 32)} (see ue8m0)")
    interpreting = bool(interpret) or config.pallas_tpu_interpret_mode_context_manager.value is not None
    n_sms = 0 if interpreting else getattr(jax.devices()[0], "core_count", 0)
    if splits is None:
        splits = auto_splits(t_len, n_heads, pools, n_sms)
    if t_len == 0:
        return jnp.zeros_like(q)
    n_chunks = [idx.shape[1] // BLOCK_KV for _, _, idx in pools]
    chunk0 = [sum(n_chunks[:p]) for p in range(len(pools))]   # each pool's first global chunk
    per_split = -(-sum(n_chunks) // max(splits, 1))          # chunks per split (the last may have fewer)
    if splits < 1 or (splits - 1) * per_split >= max(1, sum(n_chunks)):
        raise ValueError(f"splits={splits}: each of them needs at least one of the "
                         f"{sum(n_chunks)} key chunks of {BLOCK_KV}")
    n_items = n_heads // HEADS * splits * t_len
    if ctas is None:
        ctas = min(n_items, n_sms) if splits == 1 and n_sms and sum(n_chunks) else n_items
    # (a later item's q is loaded after its first chunk's copies: items without chunks get one CTA each)
    if not 1 <= ctas <= n_items or ((splits > 1 or not sum(n_chunks)) and ctas < n_items):
        raise ValueError(f"ctas={ctas}: from 1 to the {n_items} (query token, head group, split) items, "
                         "and all of them when splits > 1 or there is no key chunk")
    per_cta = -(-n_items // ctas)                             # items per CTA (the last ones may have one less)
    is_fp8 = [kv_scale is not None for _, kv_scale, _ in pools]
    any_fp8 = any(is_fp8)
    dh = d // 2                                   # D columns per compute warpgroup
    view = Fp8View.for_half_width(dh)
    qk_scale = float(scale) * LOG2E               # softmax runs in base 2 (exp2)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    # Register layouts: TILE is the wgmma accumulator layout, ROW a per-head vector (one value
    # per accumulator row), COL a per-key vector. The 0.10 interpreter has no layout_cast.
    TILE, ROW, COL = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    cast = (lambda x, layout: x) if interpreting else plgpu.layout_cast
    gather_bf16 = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(tiled)))(
        _cp_async_gather(fp8=False, d=d))
    gather_fp8 = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 4)(
        _cp_async_gather(fp8=True, d=d, half_rows=view.half_rows))
    init_full_barriers = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_init_full_barriers)
    arrive_on_landing = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_arrive_on_landing)
    wait_parity = [plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_wait_parity(k)) for k in (0, 1)]

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
        cta = lax.axis_index("c")

        def for_my_items(fn):
            """``fn(k, t, hg, sp)`` for this CTA's k-th item (query token ``t``, head group ``hg``,
            split ``sp``), items ``cta + k * ctas`` in order, tokens fastest (CTAs that run
            together share KV rows in L2). A static trip count with a guard: loops with traced
            bounds hang the JAX 0.10 Mosaic GPU interpreter."""
            @pl.loop(0, per_cta)
            def _(k):
                i = cta + k * ctas
                pl.when(i < n_items)(lambda: fn(k, i % t_len, i // (t_len * splits), i // t_len % splits))

        def for_my_split(sp, fn):
            """``fn(s, lo, hi, local)`` for split ``sp``: global chunks [lo, hi), and ``local[p]``
            the part of pool p. One static branch per split (traced loop bounds: see above)."""
            for s in range(splits):
                lo, hi = s * per_split, min((s + 1) * per_split, sum(n_chunks))
                local = [(min(max(lo - c0, 0), nc), min(max(hi - c0, 0), nc)) for c0, nc in zip(chunk0, n_chunks)]
                if splits == 1:
                    fn(s, lo, hi, local)
                else:
                    pl.when(sp == s)(functools.partial(fn, s, lo, hi, local))

        def scoped(q_smem, slots, xch, small, full, q_bar, ids_bar, free_bar, sync_bar, q_free, land_bar=None):
            """``full``: the slots' "full" barriers, plain mbarriers in an int32 buffer (compiled)
            or Pallas barriers (interpreted: no inline code). Chunk numbers run on across a CTA's
            items (item k's chunk g is ``k * n_total + g``; more than one item per CTA only with
            one split), so slots, id slots and barrier phases simply continue."""
            wg = lax.axis_index("wg")
            if not interpreting:
                init_full_barriers(full)
            full_at = lambda slot: full.at[pl.ds(2 * slot, 2)]  # noqa: E731  (8 bytes each)
            fp8_row = lambda slot, half: slot * view.slot_rows + half * view.half_rows  # noqa: E731
            kt, v8, s8 = slots      # bf16 K/V tiles; the fp8 view of the same bytes and its bytes as uint8
            ids_slot = lambda g: small.at[pl.ds(g % ID_SLOTS * BLOCK_KV, BLOCK_KV)]  # noqa: E731
            sink_at = pl.ds(ID_SLOTS * BLOCK_KV, HEADS)
            n_total = sum(n_chunks)

            def sync():  # both compute warpgroups meet here
                plgpu.barrier_arrive(sync_bar)
                plgpu.barrier_wait(sync_bar)

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

                def load_q(t, heads):
                    for w in range(2):
                        plgpu.copy_gmem_to_smem(q_ref.at[t, heads, pl.ds(w * dh, dh)], q_smem.at[w], q_bar)
                    # The sink (as int32 bits) shares the small index buffer: every allocation is
                    # rounded up to 1 KB.
                    plgpu.copy_gmem_to_smem(sink_ref.at[heads], small.at[sink_at], q_bar)

                def hand_over(g):
                    """Chunk ``g``'s copies are out: its slot is full when they have landed."""
                    if interpreting:   # (the copies were waited for)
                        plgpu.barrier_arrive(full.at[g % SLOTS])
                    else:
                        arrive_on_landing(full_at(g % SLOTS))

                def gather(kv_ref, scale_ref, ids_ref, slot):
                    if not interpreting:
                        if scale_ref is None:
                            gather_bf16(kv_ref, ids_ref, kt.at[slot])
                        else:
                            rows = pl.ds(fp8_row(slot, 0), view.half_rows + BLOCK_KV)
                            gather_fp8(kv_ref, ids_ref, v8.at[rows], scale_ref)
                        return
                    # The interpreter runs no inline Mosaic GPU code: one copy per row and half,
                    # then (fp8) one per row and half for the scale bytes, waiting after each round.
                    if scale_ref is None:
                        rounds = [(lambda row, w: kv_ref.at[pl.ds(row, 1), pl.ds(w * dh, dh)],
                                   lambda j, w: kt.at[slot, w, pl.ds(j, 1)])]
                    else:
                        rounds = [(lambda row, w: kv_ref.at[pl.ds(row, 1), pl.ds(w * dh, dh)],
                                   lambda j, w: v8.at[pl.ds(fp8_row(slot, w) + j, 1), pl.ds(0, dh)]),
                                  (lambda row, w: scale_ref.at[pl.ds(row, 1)],
                                   lambda j, w: s8.at[pl.ds(fp8_row(slot, w) + j, 1), pl.ds(dh, d // 32)])]
                    for src, dst in rounds:
                        @pl.loop(0, BLOCK_KV)
                        def _row(j, src=src, dst=dst):
                            row = jnp.maximum(ids_ref[j], 0)
                            for w in range(2):
                                plgpu.copy_gmem_to_smem(src(row, w), dst(j, w), land_bar)
                        plgpu.barrier_wait(land_bar)

                @for_my_items
                def _item(k, t, hg, sp):
                    heads = pl.ds(hg * HEADS, HEADS)
                    base = k * n_total   # this item's chunk numbers start here

                    def fetch_ids(p, c, g):
                        """Row ids of chunk ``c`` of pool ``p`` (chunk number ``g``) into their slot."""
                        plgpu.copy_gmem_to_smem(pool_refs[p][2].at[t, pl.ds(c * BLOCK_KV, BLOCK_KV)],
                                                ids_slot(g), ids_bar.at[g % ID_SLOTS])

                    pl.when(k == 0)(lambda: load_q(t, heads))

                    def produce(s, lo, hi, local):
                        live = [p for p, (a, b) in enumerate(local) if b > a]
                        if not live:
                            return
                        fetch_ids(live[0], local[live[0]][0], base + lo)   # the first chunk's ids
                        for p in live:
                            kv_ref, scale_ref, _ = pool_refs[p]
                            end = local[p][1]
                            # the next chunk is the next pool's first if this pool ends inside the range
                            nxt = next((q for q in live if q > p), None) if chunk0[p] + end < hi else None

                            @pl.loop(*local[p])
                            def _chunk(c, p=p, end=end, kv_ref=kv_ref, scale_ref=scale_ref, nxt=nxt):
                                g = base + chunk0[p] + c
                                # the slot's previous chunk (g - 2) is released after both PVs
                                pl.when(g >= lo + SLOTS)(lambda: plgpu.barrier_wait(free_bar.at[g % SLOTS]))
                                plgpu.barrier_wait(ids_bar.at[g % ID_SLOTS])
                                # the next chunk's id slot last served chunk g - 2: released too
                                pl.when(c + 1 < end)(lambda: fetch_ids(p, c + 1, g + 1))
                                if nxt is not None:
                                    pl.when(c + 1 == end)(lambda: fetch_ids(nxt, 0, g + 1))
                                if "row_copies" not in skip:
                                    gather(kv_ref, scale_ref, ids_slot(g), g % SLOTS)
                                hand_over(g)

                                # A later item's q goes where the last item's output tiles were
                                # stored from (and its sink over the last one's, read at its start):
                                # once those stores have read them, after this item's first chunk
                                # is on its way.
                                @pl.when((k > 0) & (g == base + lo))
                                def _():
                                    plgpu.barrier_wait(q_free)
                                    load_q(t, heads)

                        # Observe the last releases: the interpreter checks that every phase is
                        # seen, and compiled, this keeps the producer alive until its last copies
                        # have landed.
                        @pl.when(cta + (k + 1) * ctas >= n_items)   # my last item
                        def _():
                            for j in range(SLOTS):
                                g = base + hi - SLOTS + j
                                pl.when(g >= lo)(lambda g=g: plgpu.barrier_wait(free_bar.at[g % SLOTS]))

                    for_my_split(sp, produce)

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(COMPUTE_REGS, action="increase")
                cols = pl.ds(wg * dh, dh)

                def wait_full(g, lo):
                    """Chunk ``g`` (of a split starting at chunk ``lo``) has landed in its slot."""
                    if interpreting:
                        plgpu.barrier_wait(full.at[g % SLOTS])
                        return
                    # the slot's barrier completes once per chunk in it: phase (g - lo) // SLOTS
                    for parity in (0, 1):
                        pl.when(lax.div(g - lo, SLOTS) % 2 == parity)(lambda: wait_parity[parity](full_at(g % SLOTS)))
                    plgpu.commit_smem()   # fence: the tensor cores read what cp.async wrote

                def dequantize(slot):
                    """This warpgroup's fp8 half of the chunk -> bf16 tiles over the same bytes."""
                    rows = pl.ds(fp8_row(slot, wg), BLOCK_KV)
                    vals, scale_bytes, tile = v8.at[rows], s8.at[rows], kt.at[slot, wg]
                    n_groups = dh // 32

                    def group_scales(gi):   # scale of group gi of this half, one per row (ROW layout)
                        col = dh + wg * n_groups + gi
                        if interpreting:
                            e = scale_bytes[pl.ds(0, BLOCK_KV), col]
                        else:   # a strided column: not "optimized" (Mosaic cannot prove it conflict free)
                            e = plgpu.load(scale_bytes, (pl.ds(0, BLOCK_KV), col), layout=ROW, optimized=False)
                        return pow2_from_exponent(e)

                    pieces = [cast(vals[pl.ds(0, BLOCK_KV), pl.ds(k * 64, 64)], TILE) for k in range(dh // 64)]
                    scales = [group_scales(gi) for gi in range(n_groups)]
                    plgpu.commit_smem()   # all four warps have read the fp8 bytes before any is overwritten
                    upper = cast(lax.broadcasted_iota(jnp.int32, (BLOCK_KV, 64), 1), TILE) >= 32
                    for k, piece in enumerate(pieces):
                        lo_s, hi_s = (lax.broadcast_in_dim(s, piece.shape, [0]) for s in scales[2 * k:2 * k + 2])
                        tile[:, pl.ds(k * 64, 64)] = (piece.astype(jnp.float32) * jnp.where(upper, hi_s, lo_s)
                                                      ).astype(jnp.bfloat16)
                    plgpu.commit_smem()

                @for_my_items
                def _item(k, t, hg, sp):
                    heads = pl.ds(hg * HEADS, HEADS)
                    base = k * n_total
                    plgpu.barrier_wait(q_bar)
                    sink2 = lax.bitcast_convert_type(cast(small[sink_at], ROW), jnp.float32) * LOG2E

                    def consume(s, lo, hi, local):
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
                                g = base + g0 + c
                                slot = g % SLOTS
                                plgpu.barrier_wait(ids_bar.at[g % ID_SLOTS])
                                wait_full(g, lo)
                                ids = cast(ids_slot(g)[...], COL)
                                if fp8 and "dequant" not in skip:
                                    dequantize(slot)
                                my_kt = kt.at[slot, wg]
                                # q's tile through a zero loaded here: with a loop-invariant index,
                                # LLVM hoists all 16 wgmma descriptors of q (32 registers) out of the loop
                                my_q = q_smem.at[wg if interpreting else wg + full[2 * SLOTS]]
                                if "mma" in skip:
                                    s_part = cast(jnp.zeros((HEADS, BLOCK_KV), jnp.float32), TILE)
                                else:
                                    s_part = _mma(None, my_q, my_kt, transpose_b=True,
                                                  interpreting=interpreting)
                                if "exchange" in skip:
                                    s = s_part * qk_scale
                                else:
                                    sync()                      # the other WG has read my previous partial
                                    xch[wg] = s_part
                                    sync()                      # both partials are written
                                    s = (s_part + cast(xch[1 - wg], TILE)) * qk_scale
                                valid = lax.broadcast_in_dim(ids >= 0, s.shape, [1])
                                s = jnp.where(valid, s, -jnp.inf)
                                m_new = jnp.maximum(m, s.max(axis=1))
                                alpha = jnp.exp2(m - m_new)
                                prob = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                                l = l * alpha + prob.sum(axis=1)
                                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                                if "mma" not in skip:
                                    acc = _mma(acc, prob.astype(jnp.bfloat16), my_kt, transpose_b=False,
                                               interpreting=interpreting)
                                plgpu.barrier_arrive(free_bar.at[slot])   # the slot is ours no more
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

                            if "exchange" in skip:   # (no per-chunk meeting: the other may still read ids)
                                sync()

                            @pl.when(wg == 0)   # m and l (the same in both warpgroups) into spent id slots
                            def _stats():
                                small[pl.ds(0, HEADS)] = lax.bitcast_convert_type(m, jnp.int32)
                                small[pl.ds(HEADS, HEADS)] = lax.bitcast_convert_type(l, jnp.int32)
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(small.at[pl.ds(0, 2 * HEADS)], stats_ref.at[s, t, hg])

                    for_my_split(sp, consume)

                    @pl.when(cta + (k + 1) * ctas < n_items)   # a next item: its q may overwrite my tile
                    def _():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        plgpu.barrier_arrive(q_free)
                plgpu.wait_smem_to_gmem(0)

        # K/V slots: bf16 tiles, and for fp8 pools the fp8 view of the same bytes (plus the same
        # again as uint8, for the scale bytes). The 0.10 interpreter has no RefUnion (nor any
        # shared-memory limit): there the views are separate buffers, which only drops the aliasing.
        tiles = plgpu.SMEM((SLOTS, 2, BLOCK_KV, dh), jnp.bfloat16, transforms=tiled)
        fp8_view = lambda dtype: plgpu.SMEM((view.rows, view.pitch), dtype)  # noqa: E731
        if not any_fp8:
            slots, unpack = tiles, lambda s: (s, None, None)
        elif interpreting:
            slots, unpack = (tiles, fp8_view(jnp.float8_e4m3fn), fp8_view(jnp.uint8)), tuple
        else:
            slots, unpack = plgpu.RefUnion(tiles, fp8_view(jnp.float8_e4m3fn), fp8_view(jnp.uint8)), tuple

        def scoped_unpacked(q_smem, slots_ref, *rest):
            return scoped(q_smem, unpack(slots_ref), *rest)

        pl.run_scoped(
            scoped_unpacked,
            plgpu.SMEM((2, HEADS, dh), jnp.bfloat16, transforms=tiled),       # q, then out, per WG
            slots,                                                            # K/V slots
            plgpu.SMEM((2, HEADS, BLOCK_KV), jnp.float32,                     # logit exchange,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
            plgpu.SMEM((ID_SLOTS * BLOCK_KV + HEADS,), jnp.int32),            # 3 chunks' ids, sink bits
            # a slot is full: mbarriers for cp.async arrivals (8 bytes each; then a zero word), or
            # interpreted Pallas ones
            plgpu.Barrier(num_barriers=SLOTS) if interpreting else plgpu.SMEM((2 * SLOTS + 1,), jnp.int32),
            plgpu.Barrier(num_arrivals=3),                                    # q + sink landed
            plgpu.Barrier(num_barriers=ID_SLOTS),                             # a chunk's ids landed
            plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS),                # a slot is free
            plgpu.Barrier(num_arrivals=2),                                    # WG exchange
            plgpu.Barrier(num_arrivals=2),                                    # q tiles free (next item)
            # interpreted: the producer's row copies (two per row, or four for fp8 in two rounds)
            *([plgpu.Barrier(num_arrivals=2 * BLOCK_KV)] if interpreting else []),
            collective_axes="wg",
        )

    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if splits > 1:   # partial outputs, and (m, l) per head as int32 bits
        out_type = (jax.ShapeDtypeStruct((splits, *q.shape), q.dtype),
                    jax.ShapeDtypeStruct((splits, t_len, n_heads // HEADS, 2 * HEADS), jnp.int32))
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(ctas,),    # Mosaic GPU launches it as CUDA's x: up to 2^31 - 1 CTAs
        grid_names=("c",),
        num_threads=3,
        thread_name="wg",
        # reduction_scratch_bytes=0: the only reductions are along the WGMMA row (warp
        # shuffles), and the 2 KB default would push us over the shared memory limit.
        # unsafe_no_auto_barriers: Pallas would put a warpgroup barrier around every
        # shared-memory store; the kernel orders its own accesses (mbarriers, commit_smem).
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
