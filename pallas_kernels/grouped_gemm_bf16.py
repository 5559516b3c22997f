"""The grouped GEMMs' body for bf16 (or f16) weights: tiles straight from shared memory into
the wgmma, with no conversion.

One warpgroup per CTA keeps one step's wgmma in flight while the pipeline refills the slots
of the step before; warp specialised (``compute_wgs`` > 1) two wgmma warpgroups share a TMA
warpgroup's tiles, split by rows or by columns, optionally on a persistent grid.
"""
from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_gemm_kernel import GroupedGemm, TileAt


class Bf16Gemm(GroupedGemm):
    def main_loop(self, accs, w, scales, at: TileAt):
        def step(_, x, *w_smem):
            self.mma(accs, x, w_smem)
            # delay_release=1 refills the last step's slots when this step returns:
            # its wgmma must have read them (this one stays in flight)
            plgpu.wgmma_wait(1)
        self.pipeline(step, at, w)

    def ws_step(self, accs, x_smem, tiles, w, idx, wg, fp8, act):
        self.mma(accs, x_smem, tiles)
        plgpu.wgmma_wait(0)  # the producer refills the slot once this step returns
        return accs
