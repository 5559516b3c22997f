"""Sparse sink MQA for V4.1 on Hopper: a Pallas Mosaic GPU kernel and its pure-jnp reference.

Computes the middle of ``mega.attention.attention`` (after its query RoPE, before its inverse
RoPE; MODEL_SPEC §3.6): for each query token ``t`` and head ``h``::

    z_s = scale * q[t, h] . kv[s]          for the rows s gathered by idx[t, :] (-1: masked)
    o[t, h] = sum_s exp(z_s - M) kv[s] / (exp(sink[h] - M) + sum_s exp(z_s - M))

over one or more KV pools (window ring, compressed pages), K = V. Fully masked rows give 0.

Contract: ``q`` [T, H, D] bf16 with H % 64 == 0, D % 128 == 0 and D <= 512 (the accumulator's
registers); ``pools`` a sequence of
  * bf16 pools ``(kv, idx)``: ``kv`` [N, D] bf16, or
  * fp8 pools ``Fp8Pool(kv, scale, idx)`` (or the plain tuple ``(kv, scale, idx)``): ``kv``
    [N, D] float8_e4m3fn, ``scale`` [N, D // 32] uint8 UE8M0 exponents (the scale is
    2^(e - 127); ``block_scaled.ue8m0`` converts power-of-two fp32 scales);
  * NVFP4 pools ``Nvfp4Pool(codes, scale, idx)`` (``block_scaled.Nvfp4Rows``' records; D % 256
    == 0): ``codes`` [N, D // 2] uint8, ``scale`` [N, D // 16] float8_e4m3fn;
each with ``idx`` [T, S] int32, entries in [-1, N) (masked slots fetch row 0, which keeps
P @ V finite: 0 * garbage could be NaN); ``sink`` [H] finite. Pools may mix kinds in any order.
Tuning and launch: ``sparse_attention_tiles``.

Design: one CTA item per (query token, group of 64 heads[, key split]); three warpgroups
-------------------------------------------------------------------------------------
(In the code: ``_Plan`` holds a launch's static choices, ``_for_my_items`` and ``_for_my_split``
deal the items and their chunks, ``_producer`` and ``_compute`` (with ``_dequantize``) are the
warpgroups, ``_Scratch`` lays out shared memory, ``_body`` starts the three warpgroups.)
* MQA: all heads share every key row, so the 64 heads are the wgmma M dimension (as in
  FlashMLA); keys stream through in chunks of ``block_kv`` gathered rows with an online
  softmax. The sink is the softmax's starting state (running max ``m = sink``, sum ``l = 1``,
  ``acc = 0``): free per chunk, and a fully masked row ends at ``acc / l = 0``.
* Gather: Hopper has no TMA gather, and wgmma wants 8-row tiles with a 128-byte swizzle. The
  producer warpgroup's 128 threads copy each chunk in 16-byte ``cp.async`` pieces (Mosaic GPU
  code inlined through ``plgpu.inline_mgpu``), each piece straight to its swizzled place, eight
  consecutive threads per 128-byte line, so a warp's copy reads four whole lines (the fewest L1
  requests) and the swizzle spreads the shared writes over all banks.
* Two K/V slots: while the compute warpgroups work on chunk g in one, chunk g+1 lands in the
  other. Each producer thread arrives on the slot's "full" mbarrier through
  ``cp.async.mbarrier.arrive.noinc`` (an arrival when its copies have landed), so the producer
  never waits on its own copies; the compute warpgroups release a slot on its "free" barrier
  after their P @ V. Row ids come through shared memory, fetched by TMA one chunk ahead into
  three slots (a scalar global load per row would serialise DRAM round trips).
* Split D: the fp32 accumulator [64, 512] needs 256 registers per thread, so the two compute
  warpgroups own half of D each (of Q, of K = V and of the output). QK^T yields partial logits
  per warpgroup; the halves are exchanged through shared memory and summed (bitwise the same
  logits in both, hence the same softmax), and each runs P @ V on its own half.
* FP8 pools (MODEL_SPEC §3.5; V4.1 keeps its window KV so): the producer copies each row's D
  fp8 bytes, in halves, into a row-major fp8 view inside the owning warpgroup's half-tile (rows
  padded to D/2 + 16 bytes: conflict-free WGMMA-layout reads, and the padding holds the row's
  D/32 scale bytes). Each compute warpgroup dequantises its half in place before its QK^T
  (e4m3 times 2^(e - 127) is exact in bf16), so an fp8 pool gives bitwise the result of the
  bf16 pool of its dequantised values, for D + D/32 gathered bytes a row instead of 2 D.
* NVFP4 pools (V4.1's compressed KV) take the same view: a half's D/4 code bytes (channel j of
  the half in the low nibble, j + D/4 in the high, so each nibble decodes to a contiguous run)
  and its D/32 e4m3 scale bytes in the padding; the compute warpgroup builds each e2m1 value and
  scale from their bits (e2m1 times e4m3 is exact in bf16): D/2 + D/16 bytes a row.
* Small batches (flash-decoding): ``splits`` CTAs share a query's chunks, each starting from
  an empty softmax (split 0 from the sink) and writing its normalised partial with its running
  max and sum; an XLA pass weights and sums them.
* Persistent grid (``ctas`` below the items): each CTA takes every ``ctas``-th item; chunk
  numbers, slots, id slots and barrier phases run on across items, so the producer gathers the
  next item's first chunks (and loads its q once the output tiles are stored) while the compute
  warpgroups finish the last.
* Fused: gather, fp8 dequantisation, QK^T, mask, sink, online softmax, P @ V, normalisation,
  bf16 cast. Not fused (``mega.attention`` / XLA): query RoPE, inverse output RoPE, the MXFP8
  output cast (elementwise passes over q and o, ~1/10 of the KV bytes at S = 640).

Shared memory at H = 64, D = 512 (227 KB on the H200): q 2 x 32 KB (per warpgroup, reused
for its output tile) + K/V 2 slots x 2 halves x 32 KB + logit exchange 2 x 16 KB + 1 KB of
row ids and sink + 1 KB of barriers = 226 KB. The fp8 view is a ``plgpu.RefUnion`` member over
the slots' bytes (``Fp8View``). Registers per compute thread: acc 128 + logits 32 + P 16, or
during an fp8 dequantisation acc + 64 for the fp8 half + 16 scales.

Where the time goes (H200, bench/RESULTS.md "MegaAttention", which also records the schedules
tried): a chunk is bound by the compute warpgroups' chain (QK^T, exchange, softmax, P @ V in
lockstep), not by bytes: at decode-256 the kernel moves what the roofline counts at 60% of the
DRAM peak with the tensor pipe busy 39% of the cycles; removing the exchange saves 21% (prefill
4K), the MMAs 43%, the row copies 3%. A third K/V slot, which would overlap one chunk's softmax
with the next QK^T, does not fit; FlashMLA's alternating-warpgroup schedule (seesaw), 32-key
chunks in four slots, P @ V kept in flight and ping-pong were each measured level or slower.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src import config  # the (private) switch behind force_gpu_interpret_mode

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels.block_scaled import (FP8, NVFP4, NVFP4_BLOCK, Nvfp4Pool, Nvfp4Rows, dequantize_fp8,
                                        e2m1_scaled, e4m3_from_bits, pow2_from_exponent)
from pallas_kernels.compat import transposed
from pallas_kernels.sparse_attention_tiles import HEADS, TUNING, launch

BLOCK_KV, SLOTS, ID_SLOTS = TUNING.block_kv, TUNING.slots, TUNING.id_slots
LOG2E = math.log2(math.e)
NO_MAX = -1e30    # the running max of an empty softmax: finite, so exp2(NO_MAX - NO_MAX) = 1
# fp8 rows in a slot are D/2 + 16 bytes apart: reading a 64x64 block in the WGMMA layout
# (8 rows x 16 B per quarter-warp) then hits 8 distinct bank groups instead of one, and the
# 16 bytes hold the row's D/32 UE8M0 scale bytes (an NVFP4 row's: its half's D/32 e4m3 bytes).
FP8_PAD = 16
COPY = 16         # bytes per cp.async piece
WARPGROUP = 128   # threads
PRODUCER_REGS, COMPUTE_REGS = TUNING.producer_regs, TUNING.compute_regs


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


BF16 = "bfloat16"   # a plain pool's kind: its dtype's name (``block_scaled.stored_kind``)


class Pool(NamedTuple):
    kind: str
    kv: jax.Array            # values (bf16, e4m3) or NVFP4 code bytes
    scale: jax.Array | None  # UE8M0 bytes (fp8) or e4m3 scales (NVFP4)
    idx: jax.Array


def _split_pool(pool) -> Pool:
    """``(kv, idx)``, ``Fp8Pool`` / ``(kv, scale, idx)`` or ``Nvfp4Pool`` as a ``Pool``."""
    if isinstance(pool, Nvfp4Pool):
        return Pool(NVFP4, *pool)
    if len(pool) == 2:
        return Pool(BF16, pool[0], None, pool[1])
    if len(pool) == 3:
        return Pool(FP8, *pool)
    raise ValueError(f"a pool is (kv, idx), (kv_fp8, kv_scale, idx) or an Nvfp4Pool, got {len(pool)} arrays")


def pool_kind(pool) -> str:
    """``FP8``, ``NVFP4`` or a plain pool's dtype name (the kernel's: ``BF16``), as ``block_scaled.stored_kind``
    names the pool it was read from."""
    p = _split_pool(pool)
    return jnp.dtype(p.kv.dtype).name if p.kind == BF16 else p.kind


def _pad_pools(pools, block) -> list[Pool]:
    """Pad each pool's index list to a multiple of ``block`` with -1 (masked) slots."""
    out = []
    for pool in map(_split_pool, pools):
        pad = -pool.idx.shape[1] % block
        idx = jnp.pad(pool.idx, ((0, 0), (0, pad)), constant_values=-1) if pad else pool.idx
        out.append(pool._replace(idx=idx.astype(jnp.int32)))
    return out


def _operands(pool: Pool) -> tuple:
    """The kernel's arrays of a pool: an NVFP4 pool's e4m3 scales go in as their bytes (the
    kernel reads them through its uint8 view)."""
    if pool.kind == NVFP4:
        return pool.kv, lax.bitcast_convert_type(pool.scale, jnp.uint8), pool.idx
    return tuple(a for a in pool[1:] if a is not None)


def _gather_rows(pool):
    """fp32 rows of one pool gathered by its idx (masked slots read row 0), dequantised."""
    kind, kv, scale, idx = _split_pool(pool)
    rows = jnp.maximum(idx, 0)
    if kind == NVFP4:
        return Nvfp4Rows(kv[rows], scale[rows]).dequantized()
    if kind == FP8:
        return dequantize_fp8(kv[rows], scale[rows])
    return kv[rows].astype(jnp.float32)


def sparse_mqa_reference(q, pools, sink, scale):
    """Pure-jnp reference: fp32 logits and softmax of bf16 (or dequantised) inputs, output cast
    to q.dtype. Takes the same pools as ``sparse_mqa``."""
    keys = jnp.concatenate([_gather_rows(p) for p in pools], 1)
    valid = jnp.concatenate([_split_pool(p).idx >= 0 for p in pools], 1)
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


def _cp_async_gather(*, kind: str, d: int, half_rows: int = 0):
    """Mosaic GPU (per-thread) code for the producer warpgroup: copy one chunk's ``BLOCK_KV``
    gathered rows into a K/V slot in 16-byte ``cp.async`` pieces (the thread's noinc arrival
    that follows tracks them all).

    Called as ``gather(kv, ids, dst)`` (bf16: ``dst`` the slot's two [64, D/2] half-tiles,
    (8, 64)-tiled with a 128-byte swizzle) or ``gather(kv, ids, dst, scale)`` (fp8 and NVFP4:
    ``dst`` the slot's rows of the fp8 view, [half_rows + 64, D/2 + FP8_PAD], each half's bytes
    of a row at the start of its view row and the half's scale bytes at D/2). Thread ``8j + i`` copies
    pieces ``i, i + 8, ..`` of rows ``j, j + 16, ..`` (of an fp8 row at D = 128, with four
    pieces per half: ``4j + i``, rows ``j, j + 32``), so a warp's copy reads whole 128-byte
    lines; the thread's place in the tile is computed once (``(j + 16 r) % 8 = j % 8``, so one
    swizzle XOR serves all its rows) and each piece is a constant offset from it and its row.
    """
    dh = d // 2
    row_bytes = {BF16: 2 * d, FP8: d, NVFP4: d // 2}[kind]
    viewed = kind != BF16
    pieces = row_bytes // COPY                    # per row
    half_pieces = pieces // 2                     # per compute warpgroup's half of D
    tpr = min(8, half_pieces)                     # threads per row: a 128-byte line, or a shorter half row
    step = WARPGROUP // tpr                       # rows per round of the warpgroup
    assert BLOCK_KV % step == 0 and half_pieces % tpr == 0
    pitch8 = dh + FP8_PAD
    n_scales = d // 32       # scale bytes a half: fp8 the row's UE8M0 bytes (4 to 16), NVFP4 its half's e4m3

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
        if viewed:   # row j of each half's row-major region, at pitch8
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
                if viewed:
                    static = (h * half_rows + step * r) * pitch8 + q * COPY
                else:
                    static = step * r // 8 * (dh // 64 * 1024) + h * BLOCK_KV * dh * 2 + q // 8 * 1024
                copy(gep(base, c(static)), gep(src_row, c(tpr * i * COPY, i64)))
            if viewed:   # scale bytes into the padding of half `sub`, by the row's first two threads
                src = (mul(rid, c(n_scales, i64)) if kind == FP8   # fp8: the row's, in both halves
                       else add(mul(rid, c(2 * n_scales, i64)), arith.extui(i64, mul(sub, c(n_scales)))))
                with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, sub, c(2))):
                    copy(gep(dst_ptr, add(mul(add(mul(sub, c(half_rows)), j), c(pitch8)), c(dh))),
                         gep(global_ptr(scale[0]), src), n_scales)

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
    after them (``_Scratch.full``); then a CTA sync."""
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
# Register layouts: TILE is the wgmma accumulator layout, ROW a per-head vector (one value per
# accumulator row), COL a per-key vector.
TILE, ROW, COL = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # q, out and K/V tiles in shared memory


class _Plan(NamedTuple):
    """A launch's static choices: the pools' kinds and key chunks, the splits and CTAs the (query
    token, head group, split) items are dealt over, the softmax scale, interpreted or compiled,
    and the stages left out. The producer and the compute warpgroups walk it alike."""
    t_len: int
    n_heads: int
    d: int
    kinds: tuple[str, ...]      # each pool's kind
    n_chunks: tuple[int, ...]   # each pool's key chunks of BLOCK_KV
    splits: int
    ctas: int
    qk_scale: float             # scale * log2(e): the softmax runs in base 2 (exp2)
    interpreting: bool
    skip: frozenset

    @property
    def dh(self) -> int:        # D columns per compute warpgroup
        return self.d // 2

    @property
    def view(self) -> Fp8View:
        return Fp8View.for_half_width(self.dh)

    @property
    def n_total(self) -> int:   # key chunks a query reads
        return sum(self.n_chunks)

    @property
    def chunk0(self) -> list[int]:   # each pool's first global chunk
        return [sum(self.n_chunks[:p]) for p in range(len(self.n_chunks))]

    @property
    def per_split(self) -> int:   # chunks per split (the last may have fewer)
        return -(-self.n_total // max(self.splits, 1))

    @property
    def n_items(self) -> int:
        return self.n_heads // HEADS * self.splits * self.t_len

    @property
    def per_cta(self) -> int:     # items per CTA (the last ones may have one less)
        return -(-self.n_items // self.ctas)

    @property
    def viewed(self) -> bool:     # the fp8 view over the K/V slots is needed
        return any(kind != BF16 for kind in self.kinds)

    def cast(self, x, layout):
        """``plgpu.layout_cast``, which the 0.10 interpreter lacks."""
        return x if self.interpreting else plgpu.layout_cast(x, layout)


class _InlineOps(NamedTuple):
    """The kernel's inline Mosaic GPU code (built always, called only compiled: the interpreter
    runs none)."""
    gather_bf16: Callable
    gather_viewed: dict
    init_full_barriers: Callable
    arrive_on_landing: Callable
    wait_parity: list

    @classmethod
    def make(cls, plan: _Plan) -> "_InlineOps":
        one_ref = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
        return cls(
            plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(TILED)))(
                _cp_async_gather(kind=BF16, d=plan.d)),
            {kind: plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 4)(
                _cp_async_gather(kind=kind, d=plan.d, half_rows=plan.view.half_rows)) for kind in (FP8, NVFP4)},
            one_ref(_init_full_barriers), one_ref(_arrive_on_landing),
            [one_ref(_wait_parity(k)) for k in (0, 1)])


class _Refs(NamedTuple):
    """The kernel's global-memory operands."""
    q: object
    sink: object
    pools: list            # (kv, scale or None, idx) each
    out: object
    stats: object          # the splits' (m, l); None with one split


class _Scratch(NamedTuple):
    """Shared memory and barriers (``_scratch``)."""
    q_smem: object         # q, then the output tile, per compute warpgroup
    kt: object             # K/V slots as bf16 tiles
    v8: object             # ... their fp8 view (None without one)
    s8: object             # ... and the same bytes as uint8
    xch: object            # the logit exchange
    small: object          # ID_SLOTS chunks' row ids, then the sink's bits
    full: object           # a slot is full: plain mbarriers (compiled, then a zero word) or Pallas barriers
    q_bar: object          # q and sink landed
    ids_bar: object        # a chunk's ids landed
    free_bar: object       # a slot is free
    sync_bar: object       # the compute warpgroups' meeting
    q_free: object         # the q tiles are free (the next item's q may land)
    land_bar: object = None   # interpreted: the producer's row copies

    @staticmethod
    def allocations(plan: "_Plan") -> list:
        """What ``pl.run_scoped`` allocates, in the order ``of`` takes it. The K/V slots are bf16
        tiles, and for fp8 or NVFP4 pools also the fp8 view of the same bytes (plus the same again
        as uint8, for the scale bytes). The 0.10 interpreter has no RefUnion (nor any shared-memory
        limit): there the views are separate buffers, which only drops the aliasing."""
        view, interpreting = plan.view, plan.interpreting
        tiles = plgpu.SMEM((SLOTS, 2, BLOCK_KV, plan.dh), jnp.bfloat16, transforms=TILED)
        fp8_view = lambda dtype: plgpu.SMEM((view.rows, view.pitch), dtype)  # noqa: E731
        if not plan.viewed:
            slots = tiles
        elif interpreting:
            slots = (tiles, fp8_view(jnp.float8_e4m3fn), fp8_view(jnp.uint8))
        else:
            slots = plgpu.RefUnion(tiles, fp8_view(jnp.float8_e4m3fn), fp8_view(jnp.uint8))
        return [
            plgpu.SMEM((2, HEADS, plan.dh), jnp.bfloat16, transforms=TILED),   # q, then out, per WG
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
        ]

    @classmethod
    def of(cls, plan: "_Plan", q_smem, slots, xch, small, full, *bars) -> "_Scratch":
        """The refs ``allocations`` gave, by name."""
        kt, v8, s8 = tuple(slots) if plan.viewed else (slots, None, None)
        return cls(q_smem, kt, v8, s8, xch, small, full, *bars)

    def full_at(self, slot):   # (8 bytes each)
        return self.full.at[pl.ds(2 * slot, 2)]

    def zero(self):
        """The zero word after the full barriers, loaded (compiled only)."""
        return self.full[2 * SLOTS]

    def ids_slot(self, g):
        return self.small.at[pl.ds(g % ID_SLOTS * BLOCK_KV, BLOCK_KV)]


SINK_AT = pl.ds(ID_SLOTS * BLOCK_KV, HEADS)   # the sink's place in ``_Scratch.small``


def _fp8_row(view: Fp8View, slot, half):
    return slot * view.slot_rows + half * view.half_rows


def _for_my_items(plan: _Plan, cta, fn):
    """``fn(k, t, hg, sp)`` for this CTA's k-th item (query token ``t``, head group ``hg``,
    split ``sp``), items ``cta + k * ctas`` in order, tokens fastest (CTAs that run
    together share KV rows in L2). A static trip count with a guard: loops with traced
    bounds hang the JAX 0.10 Mosaic GPU interpreter. Chunk numbers run on across a CTA's items
    (item k's chunk g is ``k * n_total + g``; more than one item per CTA only with one split),
    so slots, id slots and barrier phases simply continue."""
    t_len, splits = plan.t_len, plan.splits

    @pl.loop(0, plan.per_cta)
    def _(k):
        i = cta + k * plan.ctas
        pl.when(i < plan.n_items)(lambda: fn(k, i % t_len, i // (t_len * splits), i // t_len % splits))


def _for_my_split(plan: _Plan, sp, fn):
    """``fn(s, lo, hi, local)`` for split ``sp``: global chunks [lo, hi), and ``local[p]``
    the part of pool p. One static branch per split (traced loop bounds: see above)."""
    for s in range(plan.splits):
        lo, hi = s * plan.per_split, min((s + 1) * plan.per_split, plan.n_total)
        local = [(min(max(lo - c0, 0), nc), min(max(hi - c0, 0), nc)) for c0, nc in zip(plan.chunk0, plan.n_chunks)]
        if plan.splits == 1:
            fn(s, lo, hi, local)
        else:
            pl.when(sp == s)(functools.partial(fn, s, lo, hi, local))


def _producer(plan: _Plan, ops: _InlineOps, refs: _Refs, sc: _Scratch, cta):
    """The producer warpgroup: each item's q and sink, then its chunks' row ids and rows into
    the K/V slots, one chunk ahead of the compute warpgroups."""
    plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
    dh, d, view, interpreting = plan.dh, plan.d, plan.view, plan.interpreting

    def load_q(t, heads):
        for w in range(2):
            plgpu.copy_gmem_to_smem(refs.q.at[t, heads, pl.ds(w * dh, dh)], sc.q_smem.at[w], sc.q_bar)
        # The sink (as int32 bits) shares the small index buffer: every allocation is
        # rounded up to 1 KB.
        plgpu.copy_gmem_to_smem(refs.sink.at[heads], sc.small.at[SINK_AT], sc.q_bar)

    def hand_over(g):
        """Chunk ``g``'s copies are out: its slot is full when they have landed."""
        if interpreting:   # (the copies were waited for)
            plgpu.barrier_arrive(sc.full.at[g % SLOTS])
        else:
            ops.arrive_on_landing(sc.full_at(g % SLOTS))

    def gather(kind, kv_ref, scale_ref, ids_ref, slot):
        if not interpreting:
            if kind == BF16:
                ops.gather_bf16(kv_ref, ids_ref, sc.kt.at[slot])
            else:
                rows = pl.ds(_fp8_row(view, slot, 0), view.half_rows + BLOCK_KV)
                ops.gather_viewed[kind](kv_ref, ids_ref, sc.v8.at[rows], scale_ref)
            return
        # The interpreter runs no inline Mosaic GPU code: one copy per row and half,
        # then (fp8, NVFP4) one per row and half for the scale bytes, waiting after each round.
        view_row = lambda j, w: pl.ds(_fp8_row(view, slot, w) + j, 1)  # noqa: E731
        if kind == BF16:
            rounds = [(lambda row, w: kv_ref.at[pl.ds(row, 1), pl.ds(w * dh, dh)],
                       lambda j, w: sc.kt.at[slot, w, pl.ds(j, 1)])]
        elif kind == FP8:
            rounds = [(lambda row, w: kv_ref.at[pl.ds(row, 1), pl.ds(w * dh, dh)],
                       lambda j, w: sc.v8.at[view_row(j, w), pl.ds(0, dh)]),
                      (lambda row, w: scale_ref.at[pl.ds(row, 1)],
                       lambda j, w: sc.s8.at[view_row(j, w), pl.ds(dh, d // 32)])]
        else:
            rounds = [(lambda row, w: kv_ref.at[pl.ds(row, 1), pl.ds(w * dh // 2, dh // 2)],
                       lambda j, w: sc.s8.at[view_row(j, w), pl.ds(0, dh // 2)]),
                      (lambda row, w: scale_ref.at[pl.ds(row, 1), pl.ds(w * d // 32, d // 32)],
                       lambda j, w: sc.s8.at[view_row(j, w), pl.ds(dh, d // 32)])]
        for src, dst in rounds:
            @pl.loop(0, BLOCK_KV)
            def _row(j, src=src, dst=dst):
                row = jnp.maximum(ids_ref[j], 0)
                for w in range(2):
                    plgpu.copy_gmem_to_smem(src(row, w), dst(j, w), sc.land_bar)
            plgpu.barrier_wait(sc.land_bar)

    @functools.partial(_for_my_items, plan, cta)
    def _item(k, t, hg, sp):
        heads = pl.ds(hg * HEADS, HEADS)
        base = k * plan.n_total   # this item's chunk numbers start here

        def fetch_ids(p, c, g):
            """Row ids of chunk ``c`` of pool ``p`` (chunk number ``g``) into their slot."""
            plgpu.copy_gmem_to_smem(refs.pools[p][2].at[t, pl.ds(c * BLOCK_KV, BLOCK_KV)],
                                    sc.ids_slot(g), sc.ids_bar.at[g % ID_SLOTS])

        pl.when(k == 0)(lambda: load_q(t, heads))

        def produce(s, lo, hi, local):
            live = [p for p, (a, b) in enumerate(local) if b > a]
            if not live:
                return
            fetch_ids(live[0], local[live[0]][0], base + lo)   # the first chunk's ids
            for p in live:
                kv_ref, scale_ref, _ = refs.pools[p]
                kind = plan.kinds[p]
                end = local[p][1]
                # the next chunk is the next pool's first if this pool ends inside the range
                nxt = next((q for q in live if q > p), None) if plan.chunk0[p] + end < hi else None

                @pl.loop(*local[p])
                def _chunk(c, p=p, end=end, kv_ref=kv_ref, scale_ref=scale_ref, nxt=nxt, kind=kind):
                    g = base + plan.chunk0[p] + c
                    # the slot's previous chunk (g - 2) is released after both PVs
                    pl.when(g >= lo + SLOTS)(lambda: plgpu.barrier_wait(sc.free_bar.at[g % SLOTS]))
                    plgpu.barrier_wait(sc.ids_bar.at[g % ID_SLOTS])
                    # the next chunk's id slot last served chunk g - 2: released too
                    pl.when(c + 1 < end)(lambda: fetch_ids(p, c + 1, g + 1))
                    if nxt is not None:
                        pl.when(c + 1 == end)(lambda: fetch_ids(nxt, 0, g + 1))
                    if "row_copies" not in plan.skip:
                        gather(kind, kv_ref, scale_ref, sc.ids_slot(g), g % SLOTS)
                    hand_over(g)

                    # A later item's q goes where the last item's output tiles were
                    # stored from (and its sink over the last one's, read at its start):
                    # once those stores have read them, after this item's first chunk
                    # is on its way.
                    @pl.when((k > 0) & (g == base + lo))
                    def _():
                        plgpu.barrier_wait(sc.q_free)
                        load_q(t, heads)

            # Observe the last releases: the interpreter checks that every phase is
            # seen, and compiled, this keeps the producer alive until its last copies
            # have landed.
            @pl.when(cta + (k + 1) * plan.ctas >= plan.n_items)   # my last item
            def _():
                for j in range(SLOTS):
                    g = base + hi - SLOTS + j
                    pl.when(g >= lo)(lambda g=g: plgpu.barrier_wait(sc.free_bar.at[g % SLOTS]))

        _for_my_split(plan, sp, produce)


def _dequantize(plan: _Plan, sc: _Scratch, kind: str, slot, wg):
    """This warpgroup's fp8 or NVFP4 half of the chunk -> bf16 tiles over the same bytes."""
    dh, interpreting, cast = plan.dh, plan.interpreting, plan.cast
    rows = pl.ds(_fp8_row(plan.view, slot, wg), BLOCK_KV)
    vals, raw, tile = sc.v8.at[rows], sc.s8.at[rows], sc.kt.at[slot, wg]
    col = cast(lax.broadcasted_iota(jnp.int32, (BLOCK_KV, 64), 1), TILE)

    def scale_byte(c):   # a byte of each row (ROW layout)
        if interpreting:
            return raw[pl.ds(0, BLOCK_KV), c]
        # a strided column: not "optimized" (Mosaic cannot prove it conflict free)
        return plgpu.load(raw, (pl.ds(0, BLOCK_KV), c), layout=ROW, optimized=False)

    def scaled(values, scales):
        """[64, 64] values times their column group's per-row scale (equal groups)."""
        group = 64 // len(scales)
        s = lax.broadcast_in_dim(scales[-1], values.shape, [0])
        for i in reversed(range(len(scales) - 1)):
            s = jnp.where(col < group * (i + 1), lax.broadcast_in_dim(scales[i], values.shape, [0]), s)
        return (values * s).astype(jnp.bfloat16)

    if kind == FP8:   # the row's UE8M0 bytes, this half's from wg * dh / 32 on
        pieces = [cast(vals[pl.ds(0, BLOCK_KV), pl.ds(k * 64, 64)], TILE) for k in range(dh // 64)]
        scales = [pow2_from_exponent(scale_byte(dh + wg * dh // 32 + i)) for i in range(dh // 32)]
        plgpu.commit_smem()   # all four warps have read the bytes before any is overwritten
        for k, piece in enumerate(pieces):
            tile[:, pl.ds(k * 64, 64)] = scaled(piece.astype(jnp.float32), scales[2 * k:2 * k + 2])
    else:             # code byte j: channels j (low nibble) and j + dh / 2 (high)
        pieces = [cast(raw[pl.ds(0, BLOCK_KV), pl.ds(k * 64, 64)], TILE) for k in range(dh // 128)]
        scales = [e4m3_from_bits(scale_byte(dh + i).astype(jnp.int32))
                  for i in range(dh // NVFP4_BLOCK)]
        plgpu.commit_smem()
        for k, piece in enumerate(pieces):
            c = piece.astype(jnp.int32)
            for at, code in ((k * 64, c & 15), (dh // 2 + k * 64, c >> 4)):
                g = at // NVFP4_BLOCK
                tile[:, pl.ds(at, 64)] = scaled(e2m1_scaled(code, 127), scales[g:g + 4])
    plgpu.commit_smem()


def _compute(plan: _Plan, ops: _InlineOps, refs: _Refs, sc: _Scratch, cta, wg):
    """A compute warpgroup: per item, its half of D through QK^T, the logit exchange, the
    online softmax and P @ V over every chunk, then its output tile (or split partial)."""
    plgpu.set_max_registers(COMPUTE_REGS, action="increase")
    dh, interpreting, cast, skip = plan.dh, plan.interpreting, plan.cast, plan.skip
    cols = pl.ds(wg * dh, dh)

    def sync():  # both compute warpgroups meet here
        plgpu.barrier_arrive(sc.sync_bar)
        plgpu.barrier_wait(sc.sync_bar)

    def wait_full(g, lo):
        """Chunk ``g`` (of a split starting at chunk ``lo``) has landed in its slot."""
        if interpreting:
            plgpu.barrier_wait(sc.full.at[g % SLOTS])
            return
        # the slot's barrier completes once per chunk in it: phase (g - lo) // SLOTS
        for parity in (0, 1):
            pl.when(lax.div(g - lo, SLOTS) % 2 == parity)(lambda: ops.wait_parity[parity](sc.full_at(g % SLOTS)))
        plgpu.commit_smem()   # fence: the tensor cores read what cp.async wrote

    @functools.partial(_for_my_items, plan, cta)
    def _item(k, t, hg, sp):
        heads = pl.ds(hg * HEADS, HEADS)
        base = k * plan.n_total
        plgpu.barrier_wait(sc.q_bar)
        sink2 = lax.bitcast_convert_type(cast(sc.small[SINK_AT], ROW), jnp.float32) * LOG2E

        def consume(s, lo, hi, local):
            # Split 0 starts from the sink; the others from an empty softmax, with a finite
            # "-inf" so that a fully masked chunk keeps exp2(m - m_new) = 1.
            carry = (
                cast(jnp.zeros((HEADS, dh), jnp.float32), TILE),
                sink2 if s == 0 else cast(jnp.full((HEADS,), NO_MAX, jnp.float32), ROW),  # max m
                cast(jnp.full((HEADS,), 1.0 if s == 0 else 0.0, jnp.float32), ROW),       # sum l
            )
            # the producer walks the same pools and chunks in the same order
            for (c_lo, c_hi), kind, g0 in zip(local, plan.kinds, plan.chunk0):

                def chunk(c, carry, kind=kind, g0=g0):
                    acc, m, l = carry
                    g = base + g0 + c
                    slot = g % SLOTS
                    plgpu.barrier_wait(sc.ids_bar.at[g % ID_SLOTS])
                    wait_full(g, lo)
                    ids = cast(sc.ids_slot(g)[...], COL)
                    if kind != BF16 and "dequant" not in skip:
                        _dequantize(plan, sc, kind, slot, wg)
                    my_kt = sc.kt.at[slot, wg]
                    # q's tile through a zero loaded here: with a loop-invariant index,
                    # LLVM hoists all 16 wgmma descriptors of q (32 registers) out of the loop
                    my_q = sc.q_smem.at[wg if interpreting else wg + sc.zero()]
                    if "mma" in skip:
                        s_part = cast(jnp.zeros((HEADS, BLOCK_KV), jnp.float32), TILE)
                    else:
                        s_part = _mma(None, my_q, my_kt, transpose_b=True, interpreting=interpreting)
                    if "exchange" in skip:
                        s = s_part * plan.qk_scale
                    else:
                        sync()                      # the other WG has read my previous partial
                        sc.xch[wg] = s_part
                        sync()                      # both partials are written
                        s = (s_part + cast(sc.xch[1 - wg], TILE)) * plan.qk_scale
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
                    plgpu.barrier_arrive(sc.free_bar.at[slot])   # the slot is ours no more
                    return acc, m_new, l

                carry = lax.fori_loop(c_lo, c_hi, chunk, carry)
            acc, m, l = carry
            # Only this warpgroup ever read its half of q_smem: reuse it for the output tile.
            # (l = 0 only in a split whose rows are all masked, where acc = 0 too.)
            out = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])
            sc.q_smem[wg] = out.astype(jnp.bfloat16)
            plgpu.commit_smem()
            if plan.splits == 1:
                plgpu.copy_smem_to_gmem(sc.q_smem.at[wg], refs.out.at[t, heads, cols])
            else:
                plgpu.copy_smem_to_gmem(sc.q_smem.at[wg], refs.out.at[s, t, heads, cols])

                if "exchange" in skip:   # (no per-chunk meeting: the other may still read ids)
                    sync()

                @pl.when(wg == 0)   # m and l (the same in both warpgroups) into spent id slots
                def _stats():
                    sc.small[pl.ds(0, HEADS)] = lax.bitcast_convert_type(m, jnp.int32)
                    sc.small[pl.ds(HEADS, HEADS)] = lax.bitcast_convert_type(l, jnp.int32)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(sc.small.at[pl.ds(0, 2 * HEADS)], refs.stats.at[s, t, hg])

        _for_my_split(plan, sp, consume)

        @pl.when(cta + (k + 1) * plan.ctas < plan.n_items)   # a next item: its q may overwrite my tile
        def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(sc.q_free)
    plgpu.wait_smem_to_gmem(0)


def _body(plan: _Plan):
    """The kernel body: three warpgroups, the producer (``wg`` 2) and two compute ones."""
    ops = _InlineOps.make(plan)

    def body(q_ref, sink_ref, *refs):
        pool_refs, pos = [], 0
        for kind in plan.kinds:   # each pool's refs: (kv, idx) or (kv, scale, idx)
            r = refs[pos:pos + (2 if kind == BF16 else 3)]
            pool_refs.append((r[0], r[1] if len(r) == 3 else None, r[-1]))
            pos += len(r)
        out, stats = (refs[-2:] if plan.splits > 1 else (refs[-1], None))
        gm = _Refs(q_ref, sink_ref, pool_refs, out, stats)
        cta = lax.axis_index("c")

        def scoped(*scratch):
            sc = _Scratch.of(plan, *scratch)
            wg = lax.axis_index("wg")
            if not plan.interpreting:
                ops.init_full_barriers(sc.full)
            pl.when(wg == 2)(lambda: _producer(plan, ops, gm, sc, cta))
            pl.when(wg < 2)(lambda: _compute(plan, ops, gm, sc, cta, wg))

        pl.run_scoped(scoped, *_Scratch.allocations(plan), collective_axes="wg")
    return body


# jitted: a program calling it at each of 40 layers with one shape lowers the kernel once
@functools.partial(jax.jit, static_argnames=("scale", "splits", "ctas", "interpret", "skip_stages"))
def sparse_mqa(q, pools: Sequence, sink, scale: float, *, splits: int | None = None, ctas: int | None = None,
               interpret=False, skip_stages=()):
    """Sparse sink MQA over gathered rows of ``pools`` (see the module docstring).

    ``pools``: bf16 pools ``(kv, idx)``, fp8 pools ``Fp8Pool(kv_fp8, kv_ue8m0, idx)`` and NVFP4
    pools ``Nvfp4Pool(codes, scale, idx)`` in any mix, e.g. V4.1's stored window and compressed
    entries, ``sparse_mqa(q, [Fp8Pool(kv8, ue8m0(s), window_idx), Nvfp4Pool(*comp, comp_idx)],
    sink, scale)``.

    ``splits`` > 1 divides each query's key chunks over that many CTAs (flash-decoding, for
    batches too small to fill the GPU); each writes its normalised partial output and its
    softmax statistics, and one XLA pass combines them.

    ``ctas``: CTAs of the grid, each taking every ``ctas``-th (query token, head group, split)
    item in turn (persistent when fewer than the items; only with one split).

    ``None`` for either: ``sparse_attention_tiles.launch`` for this GPU's SM count.

    ``skip_stages`` (a subset of ``STAGES``) is for stage-removal timing only and makes the
    result wrong: the row copies (the slot is still handed over), the in-place fp8 or NVFP4
    dequantisation, the exchange of partial logits, or both MMAs.
    """
    skip = frozenset(skip_stages)
    if not skip <= set(STAGES):
        raise ValueError(f"skip_stages must be a subset of {STAGES}, got {sorted(skip)}")
    t_len, n_heads, d = q.shape
    if n_heads % HEADS or d % 128 or d > 512 or q.dtype != jnp.bfloat16:
        raise ValueError(f"need bf16 q with H % {HEADS} == 0 and D % 128 == 0, got {q.shape} {q.dtype}; D <= 512")
    pools = _pad_pools(pools, BLOCK_KV)
    _check_pools(pools, q)
    interpreting = bool(interpret) or config.pallas_tpu_interpret_mode_context_manager.value is not None
    n_sms = 0 if interpreting else getattr(jax.devices()[0], "core_count", 0)
    n_chunks = tuple(pool.idx.shape[1] // BLOCK_KV for pool in pools)
    chosen = launch(t_len, n_heads, sum(n_chunks), n_sms, splits)
    if t_len == 0:
        return jnp.zeros_like(q)
    plan = _Plan(t_len=t_len, n_heads=n_heads, d=d, kinds=tuple(pool.kind for pool in pools), n_chunks=n_chunks,
                 splits=chosen.splits, ctas=chosen.ctas if ctas is None else ctas,
                 qk_scale=float(scale) * LOG2E, interpreting=interpreting, skip=skip)
    splits, ctas = plan.splits, plan.ctas
    if splits < 1 or (splits - 1) * plan.per_split >= max(1, plan.n_total):
        raise ValueError(f"splits={splits}: each of them needs at least one of the "
                         f"{plan.n_total} key chunks of {BLOCK_KV}")
    # (a later item's q is loaded after its first chunk's copies: items without chunks get one CTA each)
    if not 1 <= ctas <= plan.n_items or ((splits > 1 or not plan.n_total) and ctas < plan.n_items):
        raise ValueError(f"ctas={ctas}: from 1 to the {plan.n_items} (query token, head group, split) items, "
                         "and all of them when splits > 1 or there is no key chunk")

    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if splits > 1:   # partial outputs, and (m, l) per head as int32 bits
        out_type = (jax.ShapeDtypeStruct((splits, *q.shape), q.dtype),
                    jax.ShapeDtypeStruct((splits, t_len, n_heads // HEADS, 2 * HEADS), jnp.int32))
    kernel = plgpu.kernel(
        _body(plan),
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
    flat = [a for pool in pools for a in _operands(pool)]
    out = kernel(q, lax.bitcast_convert_type(sink.astype(jnp.float32), jnp.int32), *flat)
    return out if splits == 1 else _combine_splits(*out)


def _check_pools(pools: list[Pool], q) -> None:
    """ValueError where a pool's arrays do not match ``q`` or their kind."""
    t_len, d = q.shape[0], q.shape[2]
    for kind, kv, kv_scale, idx in pools:
        width, want = {BF16: (d, jnp.bfloat16), FP8: (d, jnp.float8_e4m3fn), NVFP4: (d // 2, jnp.uint8)}[kind]
        if kv.shape[0] < 1 or kv.shape[1] != width or kv.dtype != want or idx.shape[0] != t_len:
            raise ValueError(f"{kind} pool kv {kv.shape} {kv.dtype} / idx {idx.shape} do not match q {q.shape} "
                             "(or the pool is empty: masked slots read its row 0)")
        scale_want = {BF16: None, FP8: ((kv.shape[0], d // 32), jnp.uint8),
                      NVFP4: ((kv.shape[0], d // NVFP4_BLOCK), jnp.float8_e4m3fn)}[kind]
        if kv_scale is not None and (kv_scale.shape, kv_scale.dtype) != scale_want:
            raise ValueError(f"{kind} pool scale {kv_scale.shape} {kv_scale.dtype}: want {scale_want}")
        if kind == NVFP4 and d % 256:
            raise ValueError(f"NVFP4 pools need D in 256s (a half's codes in 64-byte runs), got {d}")


def _combine_splits(parts, stats):
    """Softmax-weighted sum of the splits' normalised outputs: split s carries its running max
    m_s (base 2) and sum l_s, so its weight is l_s 2^(m_s - max m) over the sum of weights."""
    s, t, n_hg, _ = stats.shape
    stats = lax.bitcast_convert_type(stats, jnp.float32).reshape(s, t, n_hg, 2, HEADS)
    m, l = (stats[:, :, :, i].reshape(s, t, n_hg * HEADS) for i in range(2))
    w = l * jnp.exp2(m - m.max(0))
    out = jnp.einsum("sth,sthd->thd", w / w.sum(0), parts.astype(jnp.float32))
    return out.astype(parts.dtype)
