"""The grouped GEMMs' body for MXFP4 weights (``block_scaled.Fp4Weight``: e2m1 codes as int4, a
UE8M0 scale per 32; V4.1's expert format), swapped tiles, one compute warpgroup, in f16.

Each step's code tile is loaded in the 4-bit WGMMA layout, whose 32-bit words (codes stored in
the kernel's order) turn into the f16 WGMMA-layout registers by a few bit moves each
(``fp4.e2m1_f16_words``); each 32-wide slice, times its rows' block scales relative to the
matrix's largest (a pipelined f16 operand), goes to its own wgmma from registers, and the
largest multiplies the accumulator in the epilogue. Where the time goes: bench/RESULTS.md, "MegaMoE".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.block_scaled import BLOCK as FP4_BLOCK, Fp4Weight, from_kernel_order
from pallas_kernels.compat import transposed
from pallas_kernels.fp4 import e2m1_f16, e2m1_f16_words
from pallas_kernels.grouped_gemm_kernel import GroupedGemm, TileAt


class Mxfp4Gemm(GroupedGemm):
    def check(self, lhs, weights):
        if (not all(isinstance(w, Fp4Weight) for w in weights) or not self.cfg.swap_ab or self.cfg.compute_wgs > 1
                or self.bk % (2 * FP4_BLOCK)):
            raise NotImplementedError("MXFP4 weights: in every stack, swapped tiles (swap_ab), one compute "
                                      "warpgroup, block_k a multiple of 64")

    def converts_in_f16(self, weights):
        return True

    def extra_specs(self, ni, delay_release):
        """Each weight's 32-block scales: a step's slice is one TMA tile."""
        spec = plgpu.BlockSpec((self.bk // FP4_BLOCK, self.bn), lambda s: (s, ni), delay_release=delay_release)
        return [spec] * self.n_ops

    def largest_at(self, big, e, ni):
        return big[e]   # one largest scale per matrix

    def to_f16(self, codes):
        """A [bn, bk] code tile (4-bit WGMMA layout: a 32-bit word per 8 codes) → f16 in the
        WGMMA layout, whose register ``(m, 4 j + i, .., h, ..)`` is pair ``i`` of word
        ``(m, j, .., h, ..)`` (8-column register tiles, 32-column words)."""
        @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                           return_type=plgpu.ShapeDtypeStruct(self.tile, jnp.float16, layout=plgpu.Layout.WGMMA))
        def convert(ctx, codes):
            del ctx
            words = codes.registers
            out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(codes.shape), dtype=object)
            for idx, pairs in zip(np.ndindex(words.shape), e2m1_f16_words(list(words.flat))):
                for i, pair in enumerate(pairs):
                    out[(idx[0], 4 * idx[1] + i, *idx[2:])] = pair
            return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
        return convert(codes)

    def mma_step(self, accs, x_smem, w_tiles, s_tiles, wb_smem):
        """One step: each weight tile's codes become f16, each 32-wide slice is multiplied by its
        rows' relative scales, and a wgmma per slice takes it from registers with the rows'
        matching 32 columns; interpreted, the slices fill ``wb_smem`` and one wgmma reads it."""
        bn = self.bn
        for j, (acc, wt, st) in enumerate(zip(accs, w_tiles, s_tiles)):
            if self.a_in_registers:
                vals = self.to_f16(plgpu.load(wt, (), layout=plgpu.Layout.WGMMA_UPCAST_4X))
            else:
                vals = e2m1_f16(from_kernel_order(wt[...]))
            for c in range(self.bk // FP4_BLOCK):
                cols = pl.ds(c * FP4_BLOCK, FP4_BLOCK)
                sc = (plgpu.load(st.at[c], (), layout=plgpu.Layout.WGMMA.reduce(1)) if self.a_in_registers
                      else st[c])
                piece = vals[:, c * FP4_BLOCK:(c + 1) * FP4_BLOCK] * jax.lax.broadcast_in_dim(
                    sc, (bn, FP4_BLOCK), [0])
                if self.a_in_registers:
                    plgpu.wgmma(acc, piece, transposed(x_smem.at[:, cols]))
                else:
                    wb_smem[j, :, cols] = piece
            if not self.a_in_registers:
                plgpu.commit_smem()
                plgpu.wgmma(acc, wb_smem.at[j], x_smem)

    def main_loop(self, accs, w, scales, at: TileAt):
        n_ops = self.n_ops

        def run(wb_smem=None):
            def step(_, x, *tiles):
                plgpu.wgmma_wait(0)  # the last step's wgmmas have read their operands
                self.mma_step(accs, x, tiles[:n_ops], tiles[n_ops:], wb_smem)
            self.pipeline(step, at, w, *scales)
        if self.a_in_registers:
            run()
        else:
            pl.run_scoped(run, plgpu.SMEM((n_ops, *self.tile), jnp.float16))
