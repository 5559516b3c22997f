"""Grouped (per-expert) GEMMs for MegaMoE as Mosaic GPU kernels for Hopper, with jnp references.

Two kernels share one body:

* ``grouped_swiglu(x, w1, w3)``: the gate and up projections of each expert and the
  clamped SwiGLU, fused. Each CTA streams the matching gate and up weight tiles through one
  TMA pipeline into two wgmma accumulators and applies the SwiGLU (and each row's routing
  weight, ``row_scale``) on the registers, so the ``[rows, 2I]`` fp32 pre-activation never
  reaches HBM: only the bf16 ``h`` does, ready for the down projection.
* ``grouped_matmul(h, w2)``: the down projection.

Layout: rows arrive grouped by expert and **block-aligned** (every expert's rows start at a
multiple of the CTA's rows, as SGLang's ``moe_align_block_size`` does), so a row block belongs
to exactly one expert, read from ``block_expert`` (``-1``: unused block, skipped). Stores are
whole-tile TMA copies; padding rows hold garbage that the combine never reads. Weights keep
the HF ``[E, out, in]`` layout (the tile is transposed in shared memory for the wgmma), so
checkpoints need no re-layout.

The shared expert rides along as one more expert id (a second weight stack, picked per row
block), so routed and shared experts take two launches in all, and at decode sizes the
shared expert's CTAs fill SMs that the routed grid leaves idle.

fp8 weights (``QuantizedWeight``: e4m3 with one scale per 128 x 128 block, DeepSeek's
layout) stream at half the bytes; Hopper's wgmma has no mixed fp8 x bf16 form, so each step
converts the fp8 tile through registers before the wgmma, times its block's scale relative
to the largest in the tile's row of blocks (``QuantizedWeight.rel``, derived once at
quantisation: the CTA loads its row once; exact for power-of-two scales), and that largest
multiplies the fp32 accumulator in the epilogue. With fp8 weights in every stack it runs in
f16: one ``cvt.rn.f16x2.e4m3x2`` and one f16x2 multiply per pair of weights, where a bf16 tile
costs a conversion to f32 and back; the activations go in as f16 (pass them so, else the
kernel converts them: a pass over x). The output keeps the activations' dtype. With one
compute warpgroup that pass runs in series with the wgmma; warp specialised, the two compute
warpgroups split the tile's columns (``GemmConfig.split="n"``), so each dequantises half of
every weight tile while a TMA warpgroup streams the next (measured no faster than one
warpgroup on the H200: bench/RESULTS.md). With swapped tiles (``swap_ab``) the weight is the wgmma's A operand, which
Hopper reads from registers: the converted tile goes from registers straight into the wgmma,
with no bf16 copy through shared memory and no fence; warp specialised, two compute
warpgroups each convert their 64 weight rows of a tile while the TMA warpgroup streams the
next (the shape of JAX's ``hopper_mixed_type_matmul_mgpu``).
On the H200 (bench/RESULTS.md) the swapped fp8 kernels are bound by that chain per step (TMA
wait, conversion, wgmma, its wait), not by the weight stream: 128-deep steps and two CTAs per
SM take 16 rows per expert to 1.6x the fp8 roofline. Converting the next tile before waiting
for the last wgmma gave wrong results there: the compiler reuses the in-flight wgmma's
registers.

MXFP4 weights (``block_scaled.Fp4Weight``: e2m1 codes as int4, a UE8M0 scale per 32;
V4.1's expert format) run swapped, one compute warpgroup, in f16: each step's code tile is
loaded in the 4-bit WGMMA layout, whose 32-bit words (codes stored in the kernel's order)
turn into the f16 WGMMA-layout registers by a few bit moves each (``fp4.e2m1_f16_words``),
and each 32-wide slice, times its rows' block scales relative to the matrix's largest (a
pipelined f16 operand), goes to its own wgmma from registers. On the H200, at 16 rows per
expert, the two kernels take 52 µs of GPU time (fp8 61, bf16 104; 1.9x the MXFP4 roofline);
the conversion is about a quarter of it, and the 1.6 waves of a small grid most of the rest
(bench/RESULTS.md).

W8A8 (``Fp8Rows`` in, fp8 weights; SGLang's and DeepGEMM's block-fp8 MoE): the rows come
quantised, e4m3 with a power-of-two scale per row per 128 columns, so both wgmma operands are
fp8 in shared memory and nothing is converted. Swapped, one compute warpgroup: each step's
wgmmas go to fresh accumulators and are awaited; their product, times the rows' scales for
that 128-column block (loaded once per CTA) and the weight block's relative scale, adds into
fp32 sums carried through the pipeline (DeepGEMM's promotion). Both the sums and the step's
product are live, so one warpgroup's tiles stay small (64 weight rows x 64 rows, or 128 x 32).
Warp specialised (``split="n"``), each of two compute warpgroups promotes its own 64 weight rows
of a 128-wide tile against the shared rows (its own copy of the rows' scales). On the H200 that
gate/up kernel is 4-6% faster than one warpgroup's from 256 rows per expert, yet its tensor
cores are busy only 40% of the time (ncu, 1024 rows per expert): each step waits for its own
wgmmas before promoting them, and the warpgroups run in lockstep. Making them take turns
(FlashAttention-3's ping-pong on named barriers) was 7-10% slower (bench/RESULTS.md). With
``block_k`` 256 a step spans two scale blocks: its wgmmas go to two sets of accumulators, and
the first set is promoted while the second's wgmmas run (192 registers of the 232 a
warp-specialised compute warpgroup has). On the H200 that gate/up kernel is no faster than
with 128-deep steps (113-115 against 114-115 µs at 256 rows per expert, 379 against 375-379 at
1024), and the one-warpgroup down kernel 13% slower, so ``mega.moe`` keeps 128-deep steps. The
warp-specialised down kernel is 5% faster than one warpgroup's with 128-row tiles (an fp8 wgmma
N of 128; balanced loads) and 34% slower with 64. The output is bf16, or, with ``fp8_out`` and
128-wide tiles (one scale block of ``h``), ``Fp8Rows`` quantised in the epilogue: a row's amax
across the warpgroup, the scale from its bits, e4m3 stored through an f16 staging tile (8-bit
values have no transposed register layout). On the H200 that is 5-9% less GPU time than XLA's
requantisation at 16 rows per expert, and 9-23% more at 64 and 256 (the wider tiles hold twice
the weight rows per accumulator; bench/RESULTS.md).

Against cuBLAS (bench/RESULTS.md): JAX's own Hopper matmul at our 64 x 256 tiles matches it on
the dense equivalents of these GEMMs; our kernel at those tiles trails it by 5-12% with one
L2-resident expert, and six experts' weights streaming from HBM cost another 5-10%. A fused
``w13`` operand (one N = 256 wgmma for gate|up) gained 0-2%: the weights keep the HF layout.

Why two launches and not one: the down GEMM needs every ``h`` column of a row block, which
the gate/up CTAs produce across the N grid; a single persistent kernel would need a
grid-wide dependency per row block. At decode sizes the cost is one extra launch, at
prefill sizes ``h`` is ``I/D`` = 45% of the activations, read once.

Grid: one CTA per (row block, column block), column blocks fastest (Mosaic GPU makes the
last grid axis CUDA's x), so CTAs that run together share their row block's activation tile
in L2 and, at decode sizes, cover every weight tile once. At prefill sizes ``group_m`` orders
them in bands of row blocks instead (Triton's grouped order): the CTAs in flight then read
fewer distinct tiles, 3-11% faster at 1024-4096 rows per expert on the H200
(bench/RESULTS.md). ``GemmConfig.persistent`` instead
runs one warp-specialised CTA per SM over the tiles in the same order; on the H200 it was
within the call-to-call spread of the plain grid (bench/RESULTS.md), so ``mega.moe`` keeps
the plain grid. Splitting the part-empty last wave's tiles along K over all SMs (stream-K,
commit ``ea045bd``) kept the SMs busy 94% of the time instead of 79% at 256 rows per expert,
but the clock fell with the power drawn and the kernel was 3% slower, so it was reverted.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import transposed
from pallas_kernels.block_scaled import (BLOCK as FP4_BLOCK, Fp4Weight, Fp8Rows, QuantizedWeight, fp8_scale_exponent,
                                        from_kernel_order, pow2_from_exponent, scale_row)
from pallas_kernels.fp4 import e2m1_f16, e2m1_f16_words


@dataclass(frozen=True)
class GemmConfig:
    """A CTA's tile and pipeline; ``compute_wgs=2`` adds a TMA producer warpgroup and two
    wgmma consumers (warp specialised) that share each step's tiles: ``split="m"`` gives each
    its own ``block_m`` rows of a ``compute_wgs * block_m`` x ``block_n`` tile, ``split="n"``
    its own ``block_n // compute_wgs`` columns of a ``block_m`` x ``block_n`` tile (so each
    dequantises only its half of an fp8 weight tile: fp8 weights need it).

    ``swap_ab`` (decode sizes) computes the tile transposed, ``(w x^T)``: the weight tile is
    the wgmma's 64-row M operand and the ``block_m`` rows (8 to 256) its N, so a CTA of 16
    rows neither pads them to 64 nor streams 64-row activation tiles beside the weights. The
    ``[block_n, rows]`` accumulator is stored through a transposed shared-memory view, so the
    output stays ``[M, N]``. Warp specialised (``split="n"``), each compute warpgroup takes 64
    or more of the tile's weight rows (and, fp8, dequantises them) while a TMA warpgroup streams
    the next tiles.

    ``persistent`` (warp specialised only) launches one CTA per SM, each looping over output
    tiles: the TMA warpgroup runs on into the next tile's loads while the compute warpgroups
    run the epilogue, whose store overlaps the next tile's main loop, and no CTA pays a launch
    and a pipeline fill per tile.

    ``group_m`` > 0 orders the tiles in bands of that many row blocks, column blocks outer and
    row blocks inner within a band (Triton's grouped order), so the CTAs that run together
    share fewer weight and activation tiles' worth of L2; 0: column blocks fastest over all rows.

    (Clusters of two CTAs multicasting each activation tile were tried on the H200 and were no
    faster: bench/RESULTS.md, commit ``e9ca1d3``.)"""
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    compute_wgs: int = 1
    split: str = "m"
    swap_ab: bool = False
    persistent: bool = False
    group_m: int = 0

    def __post_init__(self):
        if self.split not in ("m", "n") or (self.split == "n" and self.block_n % self.compute_wgs):
            raise ValueError(f"split is 'm' or 'n' (then block_n divisible by compute_wgs): {self}")
        if self.swap_ab and ((self.compute_wgs > 1 and self.split != "n")
                             or self.block_n % (64 * self.compute_wgs) or self.block_m % 8 or self.block_m > 256):
            raise ValueError(f"swap_ab needs split 'n' if warp specialised, 64 weight rows per warpgroup "
                             f"(block_n) and block_m a multiple of 8 up to 256: {self}")
        if self.group_m < 0:
            raise ValueError(f"group_m is a number of row blocks, or 0: {self}")
        if self.persistent and self.compute_wgs == 1:
            raise ValueError(f"persistent needs warp specialisation (compute_wgs > 1): {self}")

    def tile_of(self, i, m_blocks: int, n_blocks: int):
        """(row block, column block) of the ``i``-th tile in the grid order."""
        if not self.group_m:
            return divmod(i, n_blocks)
        band, within = divmod(i, self.group_m * n_blocks)
        rows = jnp.minimum(self.group_m, m_blocks - band * self.group_m)   # the last band may be short
        return band * self.group_m + within % rows, within // rows

    @property
    def rows(self) -> int:
        """Rows per CTA: the block alignment the layout must use."""
        return self.block_m * (self.compute_wgs if self.split == "m" else 1)

    @property
    def cols(self) -> int:
        """Output columns per compute warpgroup."""
        return self.block_n // (self.compute_wgs if self.split == "n" else 1)

    @property
    def quantizes_h(self) -> bool:
        """Whether a W8A8 gate/up kernel with these tiles can write ``h`` as ``Fp8Rows``
        (``fp8_out``): swapped, one warpgroup, 128 wide, so a tile's columns are one scale block."""
        return self.swap_ab and self.compute_wgs == 1 and self.block_n == 128


def _one_expert(w):
    """A single expert's weight as a stack of one (each of a quantised weight's arrays)."""
    if isinstance(w, (QuantizedWeight, Fp4Weight)):
        return type(w)(*(a[None] for a in w))
    return w[None]


# Warp specialised, each compute warpgroup stores a bf16 output tile in [rows, 64] pieces
# (128-byte rows) through two swizzled shared-memory slots, as JAX's Hopper matmul does: the
# register -> shared stores are bank-conflict free, a piece's TMA store overlaps the next
# piece's, and two 8 KB slots (64 rows) instead of a whole 32 KB 64 x 256 tile leave room for
# a fourth stage.
EPI_COLS = 64


def swiglu_f32(gate, up, limit: float):
    """Clamped SwiGLU in fp32; written with ops the Mosaic GPU lowering supports."""
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.minimum(jnp.maximum(up, -limit), limit)
    return gate / (1.0 + jnp.exp(-gate)) * up


def _num_sms() -> int:
    """CTAs of a persistent grid: one per SM (off the GPU, where kernels are only interpreted or
    lowered, a few, so that each loops over several tiles)."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else 3


def _grouped_kernel(lhs, stacks, block_expert, epilogue: Callable, cfg: GemmConfig, interpret, row_scale=None,
                    fp8_out: bool = False):
    """``stacks``: tuples of per-operand expert stacks ``[E_s, N, K]`` (bf16, or fp8 as
    ``QuantizedWeight``); expert ids number the stacks' experts consecutively (the routed
    stack, then e.g. the shared expert as one more). ``row_scale [M]`` (fp32) multiplies each
    output row in the epilogue, before the rounding to the output dtype. ``fp8_out``: the
    output is ``Fp8Rows``, quantised in the epilogue (a CTA's tile is one 128-column block)."""
    m, k = lhs.shape
    n = stacks[0][0].shape[1]
    n_ops = len(stacks[0])
    rows, bm, bn, bk = cfg.rows, cfg.block_m, cfg.block_n, cfg.block_k
    if m % rows or n % bn or k % bk:
        raise ValueError(f"shapes (m={m}, n={n}, k={k}) must divide blocks ({rows}, {bn}, {bk})")
    if block_expert.shape != (m // rows,):
        raise ValueError(f"block_expert must have shape ({m // rows},), got {block_expert.shape}")
    if row_scale is not None and row_scale.shape != (m,):
        raise ValueError(f"row_scale must have shape ({m},), got {row_scale.shape}")
    weights = [w for st in stacks for w in st]
    fp4 = any(isinstance(w, Fp4Weight) for w in weights)
    if fp4 and (not all(isinstance(w, Fp4Weight) for w in weights) or not cfg.swap_ab or cfg.compute_wgs > 1
                or bk % (2 * FP4_BLOCK)):
        raise NotImplementedError("MXFP4 weights: in every stack, swapped tiles (swap_ab), one compute "
                                  "warpgroup, block_k a multiple of 64")
    quantized = fp4 or any(isinstance(w, QuantizedWeight) for w in weights)
    ws = cfg.compute_wgs > 1
    w8a8 = isinstance(lhs, Fp8Rows)
    if w8a8 and (not all(isinstance(w, QuantizedWeight) for w in weights) or not cfg.swap_ab
                 or bk not in (32, 64, 128, 256)):
        raise NotImplementedError("fp8 activations (Fp8Rows): fp8 weights in every stack, swapped tiles "
                                  "(swap_ab), block_k 32 to 256 (at most two scale blocks a step)")
    if quantized and not fp4 and ((ws and cfg.split != "n") or 128 % bn or (128 % bk and not w8a8)
                                  or n % 128 or k % 128):
        raise NotImplementedError("fp8 weights need tiles dividing 128, split='n' if warp specialised")
    if ws and len({w.dtype if not isinstance(w, QuantizedWeight) else "fp8" for w in weights}) > 1:
        # (its pipeline buffers are allocated once, from the first stack's tiles)
        raise NotImplementedError("warp-specialised tiles need every weight of one kind (fp8 or bf16)")
    if quantized and cfg.persistent:  # (deadlocks in the Mosaic GPU interpreter; cause not found)
        raise NotImplementedError("fp8 weights with persistent CTAs")
    if fp8_out and not cfg.quantizes_h:
        raise NotImplementedError("fp8 output (Fp8Rows): swapped tiles, one compute warpgroup, block_n 128 "
                                  "(a tile's columns are one scale block)")
    swap = cfg.swap_ab
    out_dtype = jnp.float8_e4m3fn if fp8_out else jnp.bfloat16 if w8a8 else lhs.dtype
    # Quantised weights in every stack: the wgmma runs in f16. An fp8 tile converts with one cvt
    # per pair and one multiply by its block's relative scale (exact for power-of-two scales);
    # the activations are f16 (exact for bf16 values within f16's range); MXFP4 tiles likewise,
    # a scale per 32 (``fp4_mma``); the largest scales multiply the fp32 accumulator in the
    # epilogue.
    # W8A8 (``Fp8Rows``): fp8 x fp8 wgmmas straight from shared memory, no conversion; each
    # step's product is scaled by its row's and its weight block's scales into an fp32 sum
    # (``w8a8_loop``).
    f16 = not w8a8 and quantized and all(isinstance(w, (QuantizedWeight, Fp4Weight)) for w in weights)
    if f16:
        lhs = lhs.astype(jnp.float16)
    tile_dtype = jnp.float16 if f16 else jnp.bfloat16   # of the converted fp8 weight tiles
    # The 0.10 Mosaic GPU interpreter cannot feed a transposed shared-memory view to wgmma,
    # so interpreted runs read the B operand pre-transposed to [in, out]: the weights
    # ([E, in, out]), or the rows ([K, M]) when swapped; the GPU reads both as they are.
    kn = interpret is not None and not swap
    x_km = interpret is not None and swap
    a_in_registers = swap and interpret is None  # dequantised fp8 weight tiles as wgmma's A
    if kn:
        stacks = tuple(tuple(w.swapped() if isinstance(w, QuantizedWeight) else jnp.swapaxes(w, 1, 2)
                             for w in st) for st in stacks)
    act_scale = None
    if w8a8:
        lhs, act_scale = lhs
        if act_scale.shape != (k // 128, m):
            raise ValueError(f"Fp8Rows scale must have shape ({k // 128}, {m}), got {act_scale.shape}")
    if x_km:
        lhs = lhs.T
    first = [sum(st[0].shape[0] for st in stacks[:i]) for i in range(len(stacks))]
    steps = k // bk
    tile = (bk, bn) if kn else (bn, bk)
    bc = cfg.cols
    acc_shapes = [plgpu.ACC((bc, rows) if swap else (bm, bc))] * n_ops
    n_q_max = max(sum(isinstance(w, QuantizedWeight) for w in st) for st in stacks)
    # kernel operands per stack: each weight, then the relative scales of its quantised weights
    # (fp8: a row per row of blocks, loaded once per CTA; MXFP4: the 32-block scales, a
    # pipelined operand), then their largest scales (the epilogue's factors)
    flat = []
    for st in stacks:
        flat += [w.codes if fp4 else w.q if isinstance(w, QuantizedWeight) else w for w in st]
        quant = [w for w in st if isinstance(w, (QuantizedWeight, Fp4Weight))]
        flat += [w.scale if fp4 else w.rel for w in quant] + [w.top if fp4 else w.largest for w in quant]

    def stacks_refs(w_gmem):
        """Per stack: (first expert id, experts, weights, scale rows, largest scales, the
        operand index of each quantised weight)."""
        out = []
        for lo, st in zip(first, stacks):
            q_ops = [i for i, w in enumerate(st) if isinstance(w, (QuantizedWeight, Fp4Weight))]
            n_q = len(q_ops)
            out.append((lo, st[0].shape[0], w_gmem[:n_ops], w_gmem[n_ops:n_ops + n_q],
                        w_gmem[n_ops + n_q:n_ops + 2 * n_q], q_ops))
            w_gmem = w_gmem[n_ops + 2 * n_q:]
        return out

    def per_stack(expert, w_gmem, run):
        """``run(weights, scale rows)`` with this expert's refs, under the stack that owns it."""
        for lo, n_e, refs, scales, *_ in stacks_refs(w_gmem):
            @pl.when((expert >= lo) & (expert < lo + n_e))
            def _(refs=refs, scales=scales, lo=lo):
                run(tuple(w.at[expert - lo] for w in refs), tuple(s.at[expert - lo] for s in scales))

    def tile_factors(expert, ni, w_gmem):
        """Per operand, the largest block scale of this tile's weights (fp8: of its row of
        blocks; MXFP4: of the expert's matrix), 1 for bf16 weights; None without quantised ones."""
        if not quantized:
            return None
        factors = [1.0] * n_ops
        for lo, n_e, _, _, largest, q_ops in stacks_refs(w_gmem):
            e = jnp.clip(expert - lo, 0, n_e - 1)
            for op, big in zip(q_ops, largest):
                factors[op] = jnp.where((expert >= lo) & (expert < lo + n_e),
                                        big[e] if fp4 else big[e, ni * bn // 128], factors[op])
        return factors

    def load_scales(scales, s_smem, barrier, ni, first=0):
        """This CTA's row of relative block scales of each fp8 weight, loaded once, each
        through barrier ``first + j``."""
        for j, sc in enumerate(scales):
            plgpu.copy_gmem_to_smem(sc.at[ni * bn // 128], s_smem.at[j], barrier.at[first + j])
            plgpu.barrier_wait(barrier.at[first + j])

    def dequantized(w_tiles, w, s_smem, wb_smem, step):
        """The step's weight tiles for the wgmma: bf16 tiles as they are, fp8 tiles times their
        block scale through registers (Hopper's wgmma has no fp8 x bf16). Swapped, the weight
        is the wgmma's A operand, which it reads from those registers (on the GPU: the 0.10
        interpreter takes no register operand); else they are stored into ``wb_smem``."""
        tiles, j = [], 0
        for wt, wq in zip(w_tiles, w):
            if wq.dtype == jnp.bfloat16:
                tiles.append(wt)
                continue
            # swapped: 4-byte shared-memory loads (the wgmma layout's would be 2-byte), then one
            # warp shuffle per register into the wgmma layout, still as fp8
            vals = (plgpu.layout_cast(plgpu.load(wt, (), layout=plgpu.Layout.WGMMA_UPCAST_2X), plgpu.Layout.WGMMA)
                    if a_in_registers else wt[...])
            s = s_smem[j, step * bk // 128]   # this step's block of the row
            if f16:
                converted = vals.astype(jnp.float16) * s.astype(jnp.float16)
            else:
                converted = (vals.astype(jnp.float32) * s).astype(jnp.bfloat16)
            if a_in_registers:
                tiles.append(converted)
            else:
                wb_smem[j] = converted
                tiles.append(wb_smem.at[j])
            j += 1
        if not a_in_registers:
            plgpu.commit_smem()
        return tiles

    def fp4_mma(accs, x_smem, w_tiles, s_tiles, wb_smem):
        """MXFP4 steps (swapped): each weight tile's codes become f16 by bit moves on whole
        32-bit words (``fp4.e2m1_f16_words``: the 4-bit WGMMA-layout load of codes in the
        kernel's order gives each thread the values of its f16 WGMMA-layout registers), each
        32-wide slice is multiplied by its rows' relative scales, and a wgmma per slice takes it
        from registers with the rows' matching 32 columns; interpreted, the slices fill
        ``wb_smem`` and one wgmma reads it."""
        for j, (acc, wt, st) in enumerate(zip(accs, w_tiles, s_tiles)):
            if a_in_registers:
                vals = fp4_to_f16(plgpu.load(wt, (), layout=plgpu.Layout.WGMMA_UPCAST_4X))
            else:
                vals = e2m1_f16(from_kernel_order(wt[...]))
            for c in range(bk // FP4_BLOCK):
                cols = pl.ds(c * FP4_BLOCK, FP4_BLOCK)
                sc = plgpu.load(st.at[c], (), layout=plgpu.Layout.WGMMA.reduce(1)) if a_in_registers else st[c]
                piece = vals[:, c * FP4_BLOCK:(c + 1) * FP4_BLOCK] * jax.lax.broadcast_in_dim(
                    sc, (bn, FP4_BLOCK), [0])
                if a_in_registers:
                    plgpu.wgmma(acc, piece, transposed(x_smem.at[:, cols]))
                else:
                    wb_smem[j, :, cols] = piece
            if not a_in_registers:
                plgpu.commit_smem()
                plgpu.wgmma(acc, wb_smem.at[j], x_smem)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(tile, jnp.float16, layout=plgpu.Layout.WGMMA))
    def fp4_to_f16(ctx, codes):
        """A [bn, bk] code tile (4-bit WGMMA layout: a 32-bit word per 8 codes) → f16 in the
        WGMMA layout, whose register ``(m, 4 j + i, .., h, ..)`` is pair ``i`` of word
        ``(m, j, .., h, ..)`` (8-column register tiles, 32-column words)."""
        del ctx
        words = codes.registers
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(codes.shape), dtype=object)
        for idx, pairs in zip(np.ndindex(words.shape), e2m1_f16_words(list(words.flat))):
            for i, pair in enumerate(pairs):
                out[(idx[0], 4 * idx[1] + i, *idx[2:])] = pair
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    def in_specs(mi, ni, delay_release):
        w_spec = plgpu.BlockSpec(tile, (lambda s: (s, ni)) if kn else (lambda s: (ni, s)),
                                 delay_release=delay_release)
        x_spec = (plgpu.BlockSpec((bk, rows), lambda s: (s, mi), delay_release=delay_release)
                  if x_km else plgpu.BlockSpec((rows, bk), lambda s: (mi, s), delay_release=delay_release))
        fp4_specs = [plgpu.BlockSpec((bk // FP4_BLOCK, bn), lambda s: (s, ni), delay_release=delay_release)]
        return [x_spec] + [w_spec] * n_ops + fp4_specs * n_ops * fp4

    def mma(accs, x_smem, w_smem):
        for acc, w in zip(accs, w_smem):
            if swap:
                plgpu.wgmma(acc, w, x_smem if x_km else transposed(x_smem))
            else:
                plgpu.wgmma(acc, x_smem, w if kn else transposed(w))

    def w8a8_step(sums, x_smem, w_smem, row_scales, w_scales, step):
        """W8A8: step ``step``'s wgmmas into fresh accumulators, one set per 128-column scale block
        the step spans (two when ``block_k`` is 256), then each set, once done, promoted into the
        ``sums`` (``w8a8_promoted``): the first set's promotion runs while the second's wgmmas do."""
        sets = max(1, bk // 128)
        width = bk // sets

        def run(*parts):
            for i in range(sets):
                cols = pl.ds(i * width, width)
                mma(parts[i * n_ops:(i + 1) * n_ops], x_smem.at[cols] if x_km else x_smem.at[:, cols],
                    [w.at[:, cols] for w in w_smem])
            out = sums
            for i in range(sets):   # (each wgmma is its own group: the later sets' may stay in flight)
                done = [plgpu.wgmma_accumulator_load(a, wait_n=n_ops * (sets - 1 - i))
                        for a in parts[i * n_ops:(i + 1) * n_ops]]
                out = w8a8_promoted(out, done, row_scales, w_scales, step * bk // 128 + i)
            return out
        return pl.run_scoped(run, *acc_shapes * sets)

    def w8a8_promoted(sums, parts, row_scales, w_scales, block):
        """W8A8: the ``sums`` plus a step's products times their rows' scales for this
        128-column ``block`` (a ``[K / 128, rows]`` shared-memory ref) and each weight's
        relative block scale (``w_scales``), as DeepGEMM's promotion does."""
        per_row = (row_scales[block] if interpret is not None else
                   plgpu.load(row_scales.at[block], (), layout=plgpu.Layout.WGMMA.reduce(0)))
        return tuple(acc + part * jax.lax.broadcast_in_dim(per_row * w_scales[j, block], part.shape, [1])
                     for j, (acc, part) in enumerate(zip(sums, parts)))

    def w8a8_zeros():
        zero = jnp.zeros((bc, rows), jnp.float32)
        return (zero if interpret is not None else plgpu.layout_cast(zero, plgpu.Layout.WGMMA),) * n_ops

    def quantized_rows(out, sc_smem):
        """The swapped ``[128, rows]`` output tile in e4m3 units of a power-of-two scale per row
        (``Fp8Rows``; the scales go to ``sc_smem``), rounded to bf16 first as the references
        round ``h`` before requantising it."""
        out = out.astype(jnp.bfloat16).astype(jnp.float32)
        e = fp8_scale_exponent(jnp.max(jnp.abs(out), axis=0))
        sc_smem[...] = pow2_from_exponent(e + 127)
        return out * jax.lax.broadcast_in_dim(pow2_from_exponent(127 - e), out.shape, [1])

    def store(vals, o_smem, o_gmem, s_smem=None, factors=None, fp8_refs=None):
        """The epilogue on the accumulated ``vals`` (``factors``: see ``tile_factors``);
        persistent, the store's wait moves to the next tile's epilogue (the store overlaps the
        next main loop) and the kernel's end. ``fp8_refs``: when the output is fp8, the
        shared and global refs of the tile's row scales and an f16 staging tile."""
        out = epilogue(*(a if f is None else a * f for a, f in zip(vals, factors or [None] * n_ops)))
        if s_smem is not None:  # this tile's row scales: one per row, per column when swapped
            sc = s_smem[...]
            if interpret is None:  # a vector of the accumulator layout's rows (columns)
                sc = plgpu.layout_cast(sc, plgpu.Layout.WGMMA.reduce(0 if swap else 1))
            out = out * jax.lax.broadcast_in_dim(sc, out.shape, [1 if swap else 0])
        if fp8_out:
            out = quantized_rows(out, fp8_refs[0])
        out = out.astype(o_smem.dtype)
        if cfg.persistent:  # the last tile's store has read o_smem
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if o_smem.ndim == 3:  # two swizzled [rows, 64] slots: the tile goes out in pieces
            for j in range(out.shape[1] // EPI_COLS):
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the piece before last has been read
                o_smem[j % 2] = out[:, j * EPI_COLS:(j + 1) * EPI_COLS]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[j % 2], o_gmem.at[:, pl.ds(j * EPI_COLS, EPI_COLS)])
        elif not swap:
            o_smem[...] = out
        elif x_km:  # the interpreter stores no transposed view
            o_smem.at[pl.ds(0, rows)][...] = out.T
        elif fp8_out:   # 8-bit values have no transposed layout: through f16 (exact for e4m3), in
            # tiles of 64 rows or more (the WGMMA layout's) of which the first ``rows`` go out
            staging = fp8_refs[2]
            transposed(staging.at[pl.ds(0, rows)])[...] = plgpu.layout_cast(out.astype(jnp.float16),
                                                                             plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            o_smem[...] = staging[...].astype(o_smem.dtype)
        else:       # the [cols, rows] accumulator, stored as rows through a transposed view
            transposed(o_smem)[...] = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
        if o_smem.ndim == 2:
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, o_gmem.shape[0])], o_gmem)  # (fp8_out: 64 rows or more)
            if fp8_out:
                plgpu.copy_smem_to_gmem(*fp8_refs[:2])
        if not cfg.persistent:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def fetch_row_scales(scale_gmem, first_row, s_smem, barrier):
        plgpu.copy_gmem_to_smem(scale_gmem.at[pl.ds(first_row, s_smem.shape[0])], s_smem, barrier)

    def fetch_act_scales(act_gmem, mi, s_smem, barrier):
        """W8A8: row block ``mi``'s scales, ``[K / 128, rows]``, into shared memory, awaited."""
        plgpu.copy_gmem_to_smem(act_gmem.at[:, pl.ds(mi * rows, rows)], s_smem, barrier)
        plgpu.barrier_wait(barrier)

    scaled = row_scale is not None

    def grid_tile():
        """This CTA's (row block, column block) on the plain grid, in the grid order."""
        return cfg.tile_of(jax.lax.axis_index("m") * (n // bn) + jax.lax.axis_index("n"), m // rows, n // bn)

    def simple_body(block_expert_gmem, lhs_gmem, *refs):
        scale_gmem, w_gmem = (refs[0] if scaled else None), refs[scaled + w8a8:-1 - fp8_out]
        act_gmem = refs[scaled] if w8a8 else None
        out_gmem, *out_scales_gmem = refs[-1 - fp8_out:]
        mi, ni = grid_tile()
        expert = block_expert_gmem[mi]

        def w8a8_loop(w, scales):
            """The W8A8 main loop; returns the tile's fp32 sums (times the epilogue's factors).
            Each step's wgmmas go to fresh accumulators and are awaited in the step: their
            product, scaled per row (the rows' scales of this 128-column block, loaded once per
            CTA) and by the weight block's relative scale, adds into the sums, as DeepGEMM's
            promotion does. Hopper's fp8 wgmma reads both operands K-major from shared memory."""
            n_q = len(scales)

            def body(w_scales, row_scales, barrier):
                load_scales(scales, w_scales, barrier, ni)
                fetch_act_scales(act_gmem, mi, row_scales, barrier.at[n_q])

                def step(idx, x, *rest):
                    *w_smem, sums = rest
                    return w8a8_step(sums, x, w_smem, row_scales, w_scales, idx[0])
                return plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs(mi, ni, 0),
                                           max_concurrent_steps=cfg.stages,
                                           init_carry=w8a8_zeros())(lhs_gmem, *w)
            return pl.run_scoped(body, plgpu.SMEM((n_q, scale_row(k // 128)), jnp.float32),
                                 plgpu.SMEM((k // 128, rows), jnp.float32),
                                 plgpu.Barrier(num_arrivals=1, num_barriers=n_q + 1))

        def run(accs, w, scales):
            if fp4:
                def fp4_pipeline(wb_smem=None):
                    def step(_, x, *tiles):
                        plgpu.wgmma_wait(0)  # the last step's wgmmas have read their operands
                        fp4_mma(accs, x, tiles[:n_ops], tiles[n_ops:], wb_smem)
                    plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs(mi, ni, 1),
                                        max_concurrent_steps=cfg.stages)(lhs_gmem, *w, *scales)
                if a_in_registers:
                    fp4_pipeline()
                else:
                    pl.run_scoped(fp4_pipeline, plgpu.SMEM((n_ops, *tile), jnp.float16))
                return
            if not scales:
                def step(_, x, *w_smem):
                    mma(accs, x, w_smem)
                    # delay_release=1 refills the last step's slots when this step returns:
                    # its wgmma must have read them (this one stays in flight)
                    plgpu.wgmma_wait(1)
                plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs(mi, ni, 1),
                                    max_concurrent_steps=cfg.stages)(lhs_gmem, *w)
                return

            def dequant(s_smem, barrier, wb_smem=None):
                load_scales(scales, s_smem, barrier, ni)

                def step(idx, x, *w_smem):
                    plgpu.wgmma_wait(0)  # the last step's wgmma has read its operands
                    mma(accs, x, dequantized(w_smem, w, s_smem, wb_smem, idx[0]))
                # delay_release=1 here too: step s's wgmma reads its x slot asynchronously
                # until step s+1's wgmma_wait, so the slot may only be refilled after that
                plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs(mi, ni, 1),
                                    max_concurrent_steps=cfg.stages)(lhs_gmem, *w)
            n_q = len(scales)
            pl.run_scoped(dequant, plgpu.SMEM((n_q, scale_row(k // 128)), jnp.float32),
                          plgpu.Barrier(num_arrivals=1, num_barriers=n_q),
                          *(() if a_in_registers else (plgpu.SMEM((n_q, *tile), tile_dtype),)))

        @pl.when(expert >= 0)
        def _():
            def finish(vals, s_smem, barrier):
                if scaled:
                    plgpu.barrier_wait(barrier)

                def scope(o_smem, *fp8_smem):
                    store(vals, o_smem, out_gmem.at[pl.ds(mi * rows, rows), pl.ds(ni * bn, bn)], s_smem,
                          tile_factors(expert, ni, w_gmem),
                          (fp8_smem[0], out_scales_gmem[0].at[ni, pl.ds(mi * rows, rows)], fp8_smem[1])
                          if fp8_out else None)
                o_rows = max(rows, 64) if fp8_out else rows
                pl.run_scoped(scope, plgpu.SMEM((o_rows, bn), out_dtype),
                              *((plgpu.SMEM((rows,), jnp.float32), plgpu.SMEM((o_rows, bn), jnp.float16))
                                if fp8_out else ()))

            def scope(accs, s_smem=None, barrier=None):
                # the row scales land while the main loop runs, in a buffer of their own (the
                # epilogue's o_smem reuses the pipeline's, which the last wgmma may still read)
                if scaled:
                    fetch_row_scales(scale_gmem, mi * rows, s_smem, barrier)
                if w8a8:   # (the sums are values: the epilogue runs under the stack's branch)
                    per_stack(expert, w_gmem, lambda w, sc: finish(w8a8_loop(w, sc), s_smem, barrier))
                    return
                per_stack(expert, w_gmem, lambda w, sc: run(accs, w, sc))
                finish([a[...] for a in accs], s_smem, barrier)

            def with_accs(f):   # (register and shared-memory allocations take separate scopes)
                return f(()) if w8a8 else pl.run_scoped(lambda *accs: f(accs), *acc_shapes)
            if scaled:
                pl.run_scoped(lambda s_smem, barrier: with_accs(lambda accs: scope(accs, s_smem, barrier)),
                              plgpu.SMEM((rows,), jnp.float32), plgpu.Barrier(num_arrivals=1))
            else:
                with_accs(scope)

    def warp_specialized_body(block_expert_gmem, lhs_gmem, *refs):
        scale_gmem, w_gmem, out_gmem = (refs[0] if scaled else None), refs[scaled + w8a8:-1], refs[-1]
        act_gmem = refs[scaled] if w8a8 else None
        wg = jax.lax.axis_index("wg")

        def pipeline(step, context, mi, ni):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(steps,), memory_registers=40, in_specs=in_specs(mi, ni, 0),
                wg_axis="wg", num_compute_wgs=cfg.compute_wgs, max_concurrent_steps=cfg.stages,
                compute_context=context)

        # this warpgroup's part of each step's tiles, and of the output tile
        my_rows, my_cols = (wg * bm, 0) if cfg.split == "m" else (0, wg * bc)

        def my_part(w_tile):
            return w_tile if cfg.split == "m" else (w_tile.at[:, pl.ds(my_cols, bc)] if kn
                                                    else w_tile.at[pl.ds(my_cols, bc)])

        unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body or tile)
        shapes = (lhs_gmem, *(w.at[0] for w in w_gmem[:n_ops]))  # every stack's tiles are alike

        @functools.partial(pl.run_scoped, allocs=pipeline(unused, unused, 0, 0).get_allocations(*shapes),
                           o_smem=plgpu.SMEM((cfg.compute_wgs, 2, bm, EPI_COLS), out_dtype, transforms=(
                               plgpu.TilingTransform((8, EPI_COLS)), plgpu.SwizzleTransform(128)))
                           if bc % EPI_COLS == 0 and out_dtype == jnp.bfloat16 and not swap
                           else plgpu.SMEM((cfg.compute_wgs, bm, bc), out_dtype),
                           fp8=(plgpu.SMEM((cfg.compute_wgs, n_q_max, scale_row(k // 128)), jnp.float32),
                                plgpu.Barrier(num_barriers=cfg.compute_wgs * n_q_max),
                                # the dequantised tiles, unless they go to the wgmma from registers
                                *(() if a_in_registers or w8a8 else (plgpu.SMEM(
                                    (cfg.compute_wgs, n_q_max, *((bk, bc) if kn else (bc, bk))), tile_dtype),)))
                           if n_q_max else None,
                           row_scales=(plgpu.SMEM((cfg.compute_wgs, bm), jnp.float32),
                                       plgpu.Barrier(num_barriers=cfg.compute_wgs)) if scaled else None,
                           # W8A8: each warpgroup's copy of the rows' scales, [K / 128, rows]
                           act=(plgpu.SMEM((cfg.compute_wgs, k // 128, rows), jnp.float32),
                                plgpu.Barrier(num_barriers=cfg.compute_wgs)) if w8a8 else None,
                           collective_axes="wg")
        def _(allocs, o_smem, fp8, row_scales, act):
            def tile(mi, ni):
                expert = block_expert_gmem[mi]

                def run(w, scales):
                    def step(idx, x_smem, *rest):
                        *w_smem, accs = rest
                        tiles = [my_part(t) for t in w_smem]
                        if w8a8:   # (``accs``: the fp32 sums, values)
                            return w8a8_step(accs, x_smem, tiles, act[0].at[wg], fp8[0].at[wg], idx[0])
                        if scales:
                            tiles = dequantized(tiles, w, fp8[0].at[wg], None if a_in_registers else fp8[2].at[wg],
                                                idx[0])
                        mma(accs, x_smem.at[pl.ds(my_rows, bm)] if cfg.split == "m" else x_smem, tiles)
                        plgpu.wgmma_wait(0)  # the producer refills the slot once this step returns
                        return accs

                    def context(body):
                        if scales:
                            load_scales(scales, fp8[0].at[wg], fp8[1], ni, first=wg * n_q_max)
                        if w8a8:
                            fetch_act_scales(act_gmem, mi, act[0].at[wg], act[1].at[wg])
                        s_smem = None
                        if scaled:
                            s_smem = row_scales[0].at[wg]
                            fetch_row_scales(scale_gmem, mi * rows + my_rows, s_smem, row_scales[1].at[wg])
                            plgpu.barrier_wait(row_scales[1].at[wg])

                        def finish(vals):
                            store(vals, o_smem.at[wg], out_gmem.at[pl.ds(mi * rows + my_rows, bm),
                                                                   pl.ds(ni * bn + my_cols, bc)], s_smem,
                                  tile_factors(expert, ni, w_gmem))
                        if w8a8:
                            finish(list(body(w8a8_zeros())))
                            return

                        def scope(*accs):
                            body(accs)
                            finish([a[...] for a in accs])
                        pl.run_scoped(scope, *acc_shapes)

                    pipeline(step, context, mi, ni)(lhs_gmem, *w, allocations=allocs)

                per_stack(expert, w_gmem, run)

            if cfg.persistent:  # this CTA's share of the tiles, in the grid order
                @plgpu.nd_loop((m // rows * (n // bn),), collective_axes="sm")
                def _(info):
                    tile(*cfg.tile_of(info.index[0], m // rows, n // bn))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            else:
                tile(*grid_tile())

    kernel = plgpu.kernel(
        warp_specialized_body if ws else simple_body,
        out_type=(jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((n // 128, m), jnp.float32))
        if fp8_out else jax.ShapeDtypeStruct((m, n), out_dtype),
        **({"grid": (min(_num_sms(), m // rows * (n // bn)),), "grid_names": ("sm",)} if cfg.persistent
           else {"grid": (m // rows, n // bn), "grid_names": ("m", "n")}),
        **({"num_threads": cfg.compute_wgs + 1, "thread_name": "wg"} if ws else {}),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": interpret} if interpret is not None else {}))
    out = kernel(block_expert, lhs, *((row_scale.astype(jnp.float32),) if scaled else ()),
                 *((act_scale,) if w8a8 else ()), *flat)
    return Fp8Rows(*out) if fp8_out else out


@functools.partial(jax.jit, static_argnames=("limit", "cfg", "interpret", "fp8_out"))
def grouped_swiglu(x, w1, w3, block_expert, *, limit: float, shared=None, row_scale=None,
                   cfg: GemmConfig = GemmConfig(), interpret=None, fp8_out: bool = False):
    """``h[r] = swiglu(x[r] @ w1[e]ᵀ, x[r] @ w3[e]ᵀ) · row_scale[r]`` with
    ``e = block_expert[r // cfg.rows]``: the routing weight multiplies the fp32 activation in
    the epilogue, before its one rounding, as §3.9 orders it (no pass over ``h`` between the
    two launches).

    x ``[M, D]`` bf16 (block-aligned rows), or ``Fp8Rows`` (W8A8: with fp8 weights, swapped
    tiles), w1/w3 ``[E, I, D]`` bf16 or ``QuantizedWeight`` (fp8: one compute warpgroup or
    ``split="n"``) or ``Fp4Weight``; ``shared = (w1 [I, D], w3 [I, D])`` makes expert id ``E``
    the shared expert. Returns ``[M, I]`` in x's dtype (bf16 for ``Fp8Rows``), or with
    ``fp8_out`` (swapped tiles 128 wide, one warpgroup) as ``Fp8Rows`` quantised in the
    epilogue, as ``Fp8Rows.from_float`` would quantise the bf16 ``h``, ready for the W8A8
    down projection with no pass between the launches.
    """
    stacks = ((w1, w3),) + (() if shared is None else (tuple(map(_one_expert, shared)),))
    return _grouped_kernel(x, stacks, block_expert,
                           lambda g, u: swiglu_f32(g, u, limit), cfg, interpret, row_scale, fp8_out)



@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def grouped_matmul(h, w2, block_expert, *, shared=None, cfg: GemmConfig = GemmConfig(),
                   interpret=None):
    """``out[r] = h[r] @ w2[e]ᵀ`` with ``e = block_expert[r // cfg.rows]``; w2 ``[E, D, I]``,
    ``shared`` ``[D, I]`` is expert ``E``."""
    stacks = ((w2,),) + (() if shared is None else ((_one_expert(shared),),))
    return _grouped_kernel(h, stacks, block_expert, lambda acc: acc, cfg, interpret)


def _per_row_weights(w, block_expert, rows, shared):
    w, shared = (v.dequantized() if isinstance(v, (QuantizedWeight, Fp4Weight)) else v for v in (w, shared))
    if shared is not None:
        w = jnp.concatenate([w, shared[None]])
    return w[jnp.maximum(jnp.repeat(block_expert, rows), 0)]


def grouped_swiglu_reference(x, w1, w3, block_expert, *, limit: float, rows: int, shared=None, row_scale=None):
    w1r, w3r = (_per_row_weights(w, block_expert, rows, sw)
                for w, sw in zip((w1, w3), shared or (None, None)))
    f32 = jnp.float32
    gate = jnp.einsum("md,mid->mi", x.astype(f32), w1r.astype(f32))
    up = jnp.einsum("md,mid->mi", x.astype(f32), w3r.astype(f32))
    h = swiglu_f32(gate, up, limit)
    return (h if row_scale is None else h * row_scale[:, None].astype(f32)).astype(x.dtype)


def grouped_matmul_reference(h, w2, block_expert, *, rows: int, shared=None):
    w2r = _per_row_weights(w2, block_expert, rows, shared)
    return jnp.einsum("mi,mdi->md", h.astype(jnp.float32), w2r.astype(jnp.float32)).astype(h.dtype)
