"""The grouped GEMMs' body for fp8 weights (``QuantizedWeight``: e4m3 with one power-of-two scale
per 128 x 128 block, DeepSeek's layout) against bf16 rows.

The weights stream at half the bytes; Hopper's wgmma has no mixed fp8 x bf16 form, so each
step converts the fp8 tile through registers before its wgmma, times its block's scale
relative to the largest in the tile's row of blocks (``QuantizedWeight.rel``, loaded once per
CTA), and that largest multiplies the fp32 accumulator in the epilogue (exact for power-of-two
scales). With fp8 weights in every stack the wgmma runs in f16 (the rows go in as f16): one
``cvt.rn.f16x2.e4m3x2`` and one f16x2 multiply per pair of weights. Swapped (``swap_ab``, the
decode sizes), the converted tile is the wgmma's A operand straight from registers, with no
copy through shared memory and no fence; warp specialised, each of two compute warpgroups
converts its 64 weight rows while the TMA warpgroup streams the next tiles (the shape of
JAX's ``hopper_mixed_type_matmul_mgpu``). A step converts only after the last step's wgmma is
done: converting earlier gave wrong results on the H200 (the compiler reuses the in-flight
wgmma's registers), so the swapped kernels are bound by that chain per step, not by the weight
stream. Why the tiles are what they are: ``grouped_gemm_tiles``.
A stack without fp8 weights beside one with them (a bf16 shared expert) runs the bf16 loop.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.block_scaled import Fp4Weight, QuantizedWeight, scale_row
from pallas_kernels.grouped_gemm_bf16 import Bf16Gemm
from pallas_kernels.grouped_gemm_kernel import TileAt


class Fp8Gemm(Bf16Gemm):
    def check(self, lhs, weights):
        self.check_fp8_tiles(steps_in_blocks=True)

    def converts_in_f16(self, weights):
        return all(isinstance(w, (QuantizedWeight, Fp4Weight)) for w in weights)

    def dequantized(self, w_tiles, w, s_smem, wb_smem, step):
        """The step's weight tiles for the wgmma: bf16 tiles as they are, fp8 tiles times their
        block scale through registers. Swapped, the weight is the wgmma's A operand, which it
        reads from those registers (on the GPU: the 0.10 interpreter takes no register operand);
        else they are stored into ``wb_smem``."""
        tiles, j = [], 0
        for wt, wq in zip(w_tiles, w):
            if wq.dtype == jnp.bfloat16:
                tiles.append(wt)
                continue
            # swapped: 4-byte shared-memory loads (the wgmma layout's would be 2-byte), then one
            # warp shuffle per register into the wgmma layout, still as fp8
            vals = (plgpu.layout_cast(plgpu.load(wt, (), layout=plgpu.Layout.WGMMA_UPCAST_2X), plgpu.Layout.WGMMA)
                    if self.a_in_registers else wt[...])
            s = s_smem[j, step * self.bk // 128]   # this step's block of the row
            if self.f16:
                converted = vals.astype(jnp.float16) * s.astype(jnp.float16)
            else:
                converted = (vals.astype(jnp.float32) * s).astype(jnp.bfloat16)
            if self.a_in_registers:
                tiles.append(converted)
            else:
                wb_smem[j] = converted
                tiles.append(wb_smem.at[j])
            j += 1
        if not self.a_in_registers:
            plgpu.commit_smem()
        return tiles

    def main_loop(self, accs, w, scales, at: TileAt):
        if not scales:
            return super().main_loop(accs, w, scales, at)

        def dequant(s_smem, barrier, wb_smem=None):
            self.load_scales(scales, s_smem, barrier, at.ni)

            def step(idx, x, *w_smem):
                plgpu.wgmma_wait(0)  # the last step's wgmma has read its operands
                self.mma(accs, x, self.dequantized(w_smem, w, s_smem, wb_smem, idx[0]))
            # delay_release=1 here too: step s's wgmma reads its x slot asynchronously
            # until step s+1's wgmma_wait, so the slot may only be refilled after that
            self.pipeline(step, at, w)
        n_q = len(scales)
        pl.run_scoped(dequant, plgpu.SMEM((n_q, scale_row(self.k // 128)), jnp.float32),
                      plgpu.Barrier(num_arrivals=1, num_barriers=n_q),
                      *(() if self.a_in_registers else (plgpu.SMEM((n_q, *self.tile), self.tile_dtype),)))

    def ws_prologue(self, scales, at: TileAt, wg, fp8, act):
        self.load_scales(scales, fp8[0].at[wg], fp8[1], at.ni, first=wg * self.n_q_max)

    def ws_step(self, accs, x_smem, tiles, w, idx, wg, fp8, act):
        tiles = self.dequantized(tiles, w, fp8[0].at[wg], None if self.a_in_registers else fp8[2].at[wg], idx)
        return super().ws_step(accs, x_smem, tiles, w, idx, wg, fp8, act)

    def ws_weight_scratch(self):
        """The scale rows, and each compute warpgroup's converted tiles unless they go to the
        wgmma from registers."""
        cfg, n_q = self.cfg, self.n_q_max
        return (*self.scale_rows_scratch(),
                *(() if self.a_in_registers else (plgpu.SMEM(
                    (cfg.compute_wgs, n_q, *((self.bk, self.bc) if self.kn else (self.bc, self.bk))),
                    self.tile_dtype),)))
