"""The grouped GEMMs' body for W8A8: ``Fp8Rows`` in (e4m3 rows, a power-of-two scale per row per
128 columns), fp8 weights (SGLang's and DeepGEMM's block-fp8 MoE), swapped tiles.

Both wgmma operands are fp8 in shared memory and nothing is converted. Each step's wgmmas go
to fresh accumulators and are awaited; their product, times the rows' scales for that
128-column block (loaded once per CTA) and the weight block's relative scale, adds into fp32
sums carried through the pipeline as values (DeepGEMM's promotion). Both the sums and the
step's product are live, so one warpgroup's tiles stay small (64 weight rows x 64 rows, or
128 x 32). Warp specialised (``split="n"``), each of two compute warpgroups promotes its own
64 weight rows of a 128-wide tile against the shared rows (its own copy of the rows' scales).
With ``block_k`` 256 a step spans two scale blocks: its wgmmas go to two sets of accumulators,
and the first set is promoted while the second's wgmmas run. Each warpgroup waits for its own
step's wgmmas before promoting them (the warpgroups taking turns, FlashAttention-3's ping-pong,
measured slower). The output is bf16, or with
``fp8_out`` (128-wide tiles: one scale block of ``h``) ``Fp8Rows`` quantised in the epilogue.
Why the tiles are what they are: ``grouped_gemm_tiles``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.block_scaled import QuantizedWeight, scale_row
from pallas_kernels.grouped_gemm_kernel import GroupedGemm, TileAt


class W8a8Gemm(GroupedGemm):
    value_sums = True

    def check(self, lhs, weights):
        if (not all(isinstance(w, QuantizedWeight) for w in weights) or not self.cfg.swap_ab
                or self.bk not in (32, 64, 128, 256)):
            raise NotImplementedError("fp8 activations (Fp8Rows): fp8 weights in every stack, swapped tiles "
                                      "(swap_ab), block_k 32 to 256 (at most two scale blocks a step)")
        self.check_fp8_tiles(steps_in_blocks=False)   # (a 256-deep step spans two blocks: two sets)

    def accumulated_dtype(self, lhs):
        return jnp.bfloat16

    def split_rows(self, lhs):
        q, scale = lhs
        if scale.shape != (self.k // 128, self.m):
            raise ValueError(f"Fp8Rows scale must have shape ({self.k // 128}, {self.m}), got {scale.shape}")
        return q, (scale,)

    def zero_sums(self):
        zero = jnp.zeros((self.bc, self.rows), jnp.float32)
        return (zero if self.interpret is not None else plgpu.layout_cast(zero, plgpu.Layout.WGMMA),) * self.n_ops

    def promoted(self, sums, parts, row_scales, w_scales, block):
        """The ``sums`` plus a step's products times their rows' scales for this 128-column
        ``block`` (a ``[K / 128, rows]`` shared-memory ref) and each weight's relative block
        scale (``w_scales``), as DeepGEMM's promotion does."""
        per_row = (row_scales[block] if self.interpret is not None else
                   plgpu.load(row_scales.at[block], (), layout=plgpu.Layout.WGMMA.reduce(0)))
        return tuple(acc + part * jax.lax.broadcast_in_dim(per_row * w_scales[j, block], part.shape, [1])
                     for j, (acc, part) in enumerate(zip(sums, parts)))

    def step(self, sums, x_smem, w_smem, row_scales, w_scales, step):
        """Step ``step``'s wgmmas into fresh accumulators, one set per 128-column scale block the
        step spans (two when ``block_k`` is 256), then each set, once done, promoted into the
        ``sums``: the first set's promotion runs while the second's wgmmas do."""
        n_ops, bk = self.n_ops, self.bk
        sets = max(1, bk // 128)
        width = bk // sets

        def run(*parts):
            for i in range(sets):
                cols = pl.ds(i * width, width)
                self.mma(parts[i * n_ops:(i + 1) * n_ops], x_smem.at[cols] if self.x_km else x_smem.at[:, cols],
                         [w.at[:, cols] for w in w_smem])
            out = sums
            for i in range(sets):   # (each wgmma is its own group: the later sets' may stay in flight)
                done = [plgpu.wgmma_accumulator_load(a, wait_n=n_ops * (sets - 1 - i))
                        for a in parts[i * n_ops:(i + 1) * n_ops]]
                out = self.promoted(out, done, row_scales, w_scales, step * bk // 128 + i)
            return out
        return pl.run_scoped(run, *self.acc_shapes * sets)

    def fetch_act_scales(self, act_gmem, mi, s_smem, barrier):
        """Row block ``mi``'s scales, ``[K / 128, rows]``, into shared memory, awaited."""
        plgpu.copy_gmem_to_smem(act_gmem.at[:, pl.ds(mi * self.rows, self.rows)], s_smem, barrier)
        plgpu.barrier_wait(barrier)

    def main_loop(self, accs, w, scales, at: TileAt):
        """The tile's fp32 sums (times the epilogue's factors). Hopper's fp8 wgmma reads both
        operands K-major from shared memory."""
        n_q = len(scales)

        def body(w_scales, row_scales, barrier):
            self.load_scales(scales, w_scales, barrier, at.ni)
            self.fetch_act_scales(at.act, at.mi, row_scales, barrier.at[n_q])

            def step(idx, x, *rest):
                *w_smem, sums = rest
                return self.step(sums, x, w_smem, row_scales, w_scales, idx[0])
            return self.pipeline(step, at, w, delay_release=0, init_carry=self.zero_sums())
        return pl.run_scoped(body, plgpu.SMEM((n_q, scale_row(self.k // 128)), jnp.float32),
                             plgpu.SMEM((self.k // 128, self.rows), jnp.float32),
                             plgpu.Barrier(num_arrivals=1, num_barriers=n_q + 1))

    def ws_prologue(self, scales, at: TileAt, wg, fp8, act):
        self.load_scales(scales, fp8[0].at[wg], fp8[1], at.ni, first=wg * self.n_q_max)
        self.fetch_act_scales(at.act, at.mi, act[0].at[wg], act[1].at[wg])

    def ws_step(self, sums, x_smem, tiles, w, idx, wg, fp8, act):
        return self.step(sums, x_smem, tiles, act[0].at[wg], fp8[0].at[wg], idx)

    def ws_weight_scratch(self):
        return self.scale_rows_scratch()

    def ws_act_scratch(self):
        """Each compute warpgroup's copy of the rows' scales, ``[K / 128, rows]``."""
        cfg = self.cfg
        return (plgpu.SMEM((cfg.compute_wgs, self.k // 128, self.rows), jnp.float32),
                plgpu.Barrier(num_barriers=cfg.compute_wgs))
