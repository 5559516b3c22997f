"""What the grouped GEMM kernels of every operand format share: the operands' layout, the
per-stack weight refs, the pipeline's block specs, the epilogue and the two grid bodies (one
compute warpgroup per CTA, or warp specialised). A format's main loop plugs into them
(``grouped_gemm_{bf16,fp8,mxfp4,w8a8}.py``); ``grouped_gemm.py`` picks the format.

A format subclass provides ``main_loop`` (one warpgroup: the tile's K loop into ``accs``, or
returning the fp32 sums when ``value_sums``) and, if it runs warp specialised, ``ws_step``,
``ws_prologue`` and its scratch (``ws_weight_scratch``, ``ws_act_scratch``).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.block_scaled import (Fp4Weight, Fp8Rows, QuantizedWeight, fp8_scale_exponent, pow2_from_exponent,
                                        scale_row)
from pallas_kernels.compat import transposed

# Warp specialised, each compute warpgroup stores a bf16 output tile in [rows, 64] pieces
# (128-byte rows) through two swizzled shared-memory slots, as JAX's Hopper matmul does: the
# register -> shared stores are bank-conflict free, a piece's TMA store overlaps the next
# piece's, and two 8 KB slots (64 rows) instead of a whole 32 KB 64 x 256 tile leave room for
# a fourth stage.
EPI_COLS = 64


def _num_sms() -> int:
    """CTAs of a persistent grid: one per SM (off the GPU, where kernels are only interpreted or
    lowered, a few, so that each loops over several tiles)."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else 3


def _scaled(w) -> bool:
    return isinstance(w, (QuantizedWeight, Fp4Weight))


class TileAt(NamedTuple):
    """Where a CTA's output tile lies, and the global refs its main loop reads."""
    mi: jax.Array      # row block
    ni: jax.Array      # column block
    lhs: object        # the rows' global ref
    act: object        # W8A8: the rows' scales' global ref, else None


class GroupedGemm:
    """One launch of a grouped GEMM: ``stacks`` are tuples of per-operand expert stacks
    ``[E_s, N, K]``; expert ids number the stacks' experts consecutively (the routed stack, then
    e.g. the shared expert as one more). ``row_scale [M]`` (fp32) multiplies each output row in
    the epilogue, before the rounding to the output dtype. ``fp8_out``: the output is
    ``Fp8Rows``, quantised in the epilogue (a CTA's tile is one 128-column block)."""

    value_sums = False   # the main loop returns its sums as values (the epilogue runs under the stack's branch)

    def __init__(self, lhs, stacks, block_expert, epilogue: Callable, cfg, interpret, row_scale=None,
                 fp8_out: bool = False):
        m, k = lhs.shape
        n = stacks[0][0].shape[1]
        self.n_ops = len(stacks[0])
        self.rows, self.bm, self.bn, self.bk = cfg.rows, cfg.block_m, cfg.block_n, cfg.block_k
        if m % self.rows or n % self.bn or k % self.bk:
            raise ValueError(f"shapes (m={m}, n={n}, k={k}) must divide blocks ({self.rows}, {self.bn}, {self.bk})")
        if block_expert.shape != (m // self.rows,):
            raise ValueError(f"block_expert must have shape ({m // self.rows},), got {block_expert.shape}")
        if row_scale is not None and row_scale.shape != (m,):
            raise ValueError(f"row_scale must have shape ({m},), got {row_scale.shape}")
        self.m, self.n, self.k, self.cfg, self.interpret = m, n, k, cfg, interpret
        self.epilogue, self.row_scale, self.fp8_out, self.block_expert = epilogue, row_scale, fp8_out, block_expert
        weights = [w for st in stacks for w in st]
        self.quantized = any(map(_scaled, weights))
        self.ws = cfg.compute_wgs > 1
        self.check(lhs, weights)
        if self.ws and len({w.dtype if not isinstance(w, QuantizedWeight) else "fp8" for w in weights}) > 1:
            # (its pipeline buffers are allocated once, from the first stack's tiles)
            raise NotImplementedError("warp-specialised tiles need every weight of one kind (fp8 or bf16)")
        if self.quantized and cfg.persistent:  # (deadlocks in the Mosaic GPU interpreter; cause not found)
            raise NotImplementedError("fp8 weights with persistent CTAs")
        if fp8_out and not cfg.quantizes_h:
            raise NotImplementedError("fp8 output (Fp8Rows): swapped tiles, one compute warpgroup, block_n 128 "
                                      "(a tile's columns are one scale block)")
        self.swap = cfg.swap_ab
        self.out_dtype = jnp.float8_e4m3fn if fp8_out else self.accumulated_dtype(lhs)
        self.f16 = self.converts_in_f16(weights)
        if self.f16:
            lhs = lhs.astype(jnp.float16)
        self.tile_dtype = jnp.float16 if self.f16 else jnp.bfloat16   # of the converted fp8 weight tiles
        # The 0.10 Mosaic GPU interpreter cannot feed a transposed shared-memory view to wgmma,
        # so interpreted runs read the B operand pre-transposed to [in, out]: the weights
        # ([E, in, out]), or the rows ([K, M]) when swapped; the GPU reads both as they are.
        self.kn = interpret is not None and not self.swap
        self.x_km = interpret is not None and self.swap
        self.a_in_registers = self.swap and interpret is None  # converted weight tiles as wgmma's A
        if self.kn:
            stacks = tuple(tuple(w.swapped() if isinstance(w, QuantizedWeight) else jnp.swapaxes(w, 1, 2)
                                 for w in st) for st in stacks)
        lhs, self.act_operands = self.split_rows(lhs)
        self.lhs = lhs.T if self.x_km else lhs
        self.stacks = stacks
        self.first = [sum(st[0].shape[0] for st in stacks[:i]) for i in range(len(stacks))]
        self.steps = k // self.bk
        self.tile = (self.bk, self.bn) if self.kn else (self.bn, self.bk)
        self.bc = cfg.cols
        self.acc_shapes = [plgpu.ACC((self.bc, self.rows) if self.swap else (self.bm, self.bc))] * self.n_ops
        self.n_q_max = max(sum(isinstance(w, QuantizedWeight) for w in st) for st in stacks)
        self.scaled = row_scale is not None

    # ---------------------------------------------------------------- the format's hooks
    def check(self, lhs, weights) -> None:
        """Refuse operands or tiles this format's body cannot run."""

    def check_fp8_tiles(self, steps_in_blocks: bool) -> None:
        """fp8 weights' tiles lie in one row of 128 x 128 scale blocks (and, ``steps_in_blocks``,
        each step in one column of them); warp specialised, the warpgroups split the columns."""
        if ((self.ws and self.cfg.split != "n") or 128 % self.bn or (steps_in_blocks and 128 % self.bk)
                or self.n % 128 or self.k % 128):
            raise NotImplementedError("fp8 weights need tiles dividing 128, split='n' if warp specialised")

    def accumulated_dtype(self, lhs):
        """The output's dtype (without ``fp8_out``)."""
        return lhs.dtype

    def converts_in_f16(self, weights) -> bool:
        """Whether the wgmma runs in f16 (the rows converted to f16 before the launch)."""
        return False

    def split_rows(self, lhs):
        """The rows' main operand and any operands beside it (W8A8: their scales)."""
        return lhs, ()

    def extra_specs(self, ni, delay_release) -> list:
        """Block specs of pipelined operands after the weights (MXFP4: their scales)."""
        return []

    def largest_at(self, big, e, ni):
        """The epilogue's factor of a quantised weight: its tile's largest block scale."""
        return big[e, ni * self.bn // 128]

    def main_loop(self, accs, w, scales, at: TileAt):
        raise NotImplementedError

    def ws_prologue(self, scales, at: TileAt, wg, fp8, act) -> None:
        """Warp specialised: what each compute warpgroup loads before the K loop."""

    def ws_step(self, accs, x_smem, tiles, w, idx, wg, fp8, act):
        raise NotImplementedError(f"{type(self).__name__}: no warp-specialised body")

    def zero_sums(self):
        """``value_sums`` bodies: the sums a tile's K loop starts from."""
        raise NotImplementedError

    def ws_weight_scratch(self):
        return None

    def scale_rows_scratch(self):
        """Warp specialised: each compute warpgroup's scale rows of the quantised weights, and
        their barriers."""
        cfg, n_q = self.cfg, self.n_q_max
        return (plgpu.SMEM((cfg.compute_wgs, n_q, scale_row(self.k // 128)), jnp.float32),
                plgpu.Barrier(num_barriers=cfg.compute_wgs * n_q))

    def ws_act_scratch(self):
        return None

    # ---------------------------------------------------------------- shared helpers
    def flat_weights(self) -> list:
        """The kernel's weight operands per stack: each weight, then the relative scales of its
        quantised weights (fp8: a row per row of blocks, loaded once per CTA; MXFP4: the
        32-block scales, a pipelined operand), then their largest scales (the epilogue's factors)."""
        flat = []
        for st in self.stacks:
            flat += [w.codes if isinstance(w, Fp4Weight) else w.q if isinstance(w, QuantizedWeight) else w
                     for w in st]
            quant = [w for w in st if _scaled(w)]
            flat += [w.scale if isinstance(w, Fp4Weight) else w.rel for w in quant]
            flat += [w.top if isinstance(w, Fp4Weight) else w.largest for w in quant]
        return flat

    def stacks_refs(self, w_gmem):
        """Per stack: (first expert id, experts, weights, scale rows, largest scales, the
        operand index of each quantised weight)."""
        out, n_ops = [], self.n_ops
        for lo, st in zip(self.first, self.stacks):
            q_ops = [i for i, w in enumerate(st) if _scaled(w)]
            n_q = len(q_ops)
            out.append((lo, st[0].shape[0], w_gmem[:n_ops], w_gmem[n_ops:n_ops + n_q],
                        w_gmem[n_ops + n_q:n_ops + 2 * n_q], q_ops))
            w_gmem = w_gmem[n_ops + 2 * n_q:]
        return out

    def per_stack(self, expert, w_gmem, run):
        """``run(weights, scale rows)`` with this expert's refs, under the stack that owns it."""
        for lo, n_e, refs, scales, *_ in self.stacks_refs(w_gmem):
            @pl.when((expert >= lo) & (expert < lo + n_e))
            def _(refs=refs, scales=scales, lo=lo):
                run(tuple(w.at[expert - lo] for w in refs), tuple(s.at[expert - lo] for s in scales))

    def tile_factors(self, expert, ni, w_gmem):
        """Per operand, the largest block scale of this tile's weights (``largest_at``), 1 for
        bf16 weights; None without quantised ones."""
        if not self.quantized:
            return None
        factors = [1.0] * self.n_ops
        for lo, n_e, _, _, largest, q_ops in self.stacks_refs(w_gmem):
            e = jnp.clip(expert - lo, 0, n_e - 1)
            for op, big in zip(q_ops, largest):
                factors[op] = jnp.where((expert >= lo) & (expert < lo + n_e), self.largest_at(big, e, ni),
                                        factors[op])
        return factors

    def load_scales(self, scales, s_smem, barrier, ni, first=0):
        """This CTA's row of relative block scales of each fp8 weight, loaded once, each
        through barrier ``first + j``."""
        for j, sc in enumerate(scales):
            plgpu.copy_gmem_to_smem(sc.at[ni * self.bn // 128], s_smem.at[j], barrier.at[first + j])
            plgpu.barrier_wait(barrier.at[first + j])

    def in_specs(self, mi, ni, delay_release):
        bk, rows = self.bk, self.rows
        w_spec = plgpu.BlockSpec(self.tile, (lambda s: (s, ni)) if self.kn else (lambda s: (ni, s)),
                                 delay_release=delay_release)
        x_spec = (plgpu.BlockSpec((bk, rows), lambda s: (s, mi), delay_release=delay_release)
                  if self.x_km else plgpu.BlockSpec((rows, bk), lambda s: (mi, s), delay_release=delay_release))
        return [x_spec] + [w_spec] * self.n_ops + self.extra_specs(ni, delay_release)

    def mma(self, accs, x_smem, w_smem):
        for acc, w in zip(accs, w_smem):
            if self.swap:
                plgpu.wgmma(acc, w, x_smem if self.x_km else transposed(x_smem))
            else:
                plgpu.wgmma(acc, x_smem, w if self.kn else transposed(w))

    def pipeline(self, step, at: TileAt, w, *operands, delay_release=1, **kw):
        """The tile's K loop over the rows' and the weights' (and ``operands``') tiles."""
        return plgpu.emit_pipeline(step, grid=(self.steps,), in_specs=self.in_specs(at.mi, at.ni, delay_release),
                                   max_concurrent_steps=self.cfg.stages, **kw)(at.lhs, *w, *operands)

    def quantized_rows(self, out, sc_smem):
        """The swapped ``[128, rows]`` output tile in e4m3 units of a power-of-two scale per row
        (``Fp8Rows``; the scales go to ``sc_smem``), rounded to bf16 first as the references
        round ``h`` before requantising it."""
        out = out.astype(jnp.bfloat16).astype(jnp.float32)
        e = fp8_scale_exponent(jnp.max(jnp.abs(out), axis=0))
        sc_smem[...] = pow2_from_exponent(e + 127)
        return out * jax.lax.broadcast_in_dim(pow2_from_exponent(127 - e), out.shape, [1])

    def store(self, vals, o_smem, o_gmem, s_smem=None, factors=None, fp8_refs=None):
        """The epilogue on the accumulated ``vals`` (``factors``: see ``tile_factors``);
        persistent, the store's wait moves to the next tile's epilogue (the store overlaps the
        next main loop) and the kernel's end. ``fp8_refs``: when the output is fp8, the
        shared and global refs of the tile's row scales and an f16 staging tile."""
        swap, cfg, rows = self.swap, self.cfg, self.rows
        out = self.epilogue(*(a if f is None else a * f for a, f in zip(vals, factors or [None] * self.n_ops)))
        if s_smem is not None:  # this tile's row scales: one per row, per column when swapped
            sc = s_smem[...]
            if self.interpret is None:  # a vector of the accumulator layout's rows (columns)
                sc = plgpu.layout_cast(sc, plgpu.Layout.WGMMA.reduce(0 if swap else 1))
            out = out * jax.lax.broadcast_in_dim(sc, out.shape, [1 if swap else 0])
        if self.fp8_out:
            out = self.quantized_rows(out, fp8_refs[0])
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
        elif self.x_km:  # the interpreter stores no transposed view
            o_smem.at[pl.ds(0, rows)][...] = out.T
        elif self.fp8_out:   # 8-bit values have no transposed layout: through f16 (exact for e4m3), in
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
            if self.fp8_out:
                plgpu.copy_smem_to_gmem(*fp8_refs[:2])
        if not cfg.persistent:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def fetch_row_scales(self, scale_gmem, first_row, s_smem, barrier):
        plgpu.copy_gmem_to_smem(scale_gmem.at[pl.ds(first_row, s_smem.shape[0])], s_smem, barrier)

    def grid_tile(self):
        """This CTA's (row block, column block) on the plain grid, in the grid order."""
        m_blocks, n_blocks = self.m // self.rows, self.n // self.bn
        return self.cfg.tile_of(jax.lax.axis_index("m") * n_blocks + jax.lax.axis_index("n"), m_blocks, n_blocks)

    # ---------------------------------------------------------------- the two grid bodies
    def simple_body(self, block_expert_gmem, lhs_gmem, *refs):
        """One compute warpgroup per CTA, one output tile per CTA."""
        scaled, n_act, fp8_out, rows, bn = self.scaled, len(self.act_operands), self.fp8_out, self.rows, self.bn
        scale_gmem, w_gmem = (refs[0] if scaled else None), refs[scaled + n_act:-1 - fp8_out]
        act_gmem = refs[scaled] if n_act else None
        out_gmem, *out_scales_gmem = refs[-1 - fp8_out:]
        mi, ni = self.grid_tile()
        expert = block_expert_gmem[mi]
        at = TileAt(mi, ni, lhs_gmem, act_gmem)

        @pl.when(expert >= 0)
        def _():
            def finish(vals, s_smem, barrier):
                if scaled:
                    plgpu.barrier_wait(barrier)

                def scope(o_smem, *fp8_smem):
                    self.store(vals, o_smem, out_gmem.at[pl.ds(mi * rows, rows), pl.ds(ni * bn, bn)], s_smem,
                               self.tile_factors(expert, ni, w_gmem),
                               (fp8_smem[0], out_scales_gmem[0].at[ni, pl.ds(mi * rows, rows)], fp8_smem[1])
                               if fp8_out else None)
                o_rows = max(rows, 64) if fp8_out else rows
                pl.run_scoped(scope, plgpu.SMEM((o_rows, bn), self.out_dtype),
                              *((plgpu.SMEM((rows,), jnp.float32), plgpu.SMEM((o_rows, bn), jnp.float16))
                                if fp8_out else ()))

            def scope(accs, s_smem=None, barrier=None):
                # the row scales land while the main loop runs, in a buffer of their own (the
                # epilogue's o_smem reuses the pipeline's, which the last wgmma may still read)
                if scaled:
                    self.fetch_row_scales(scale_gmem, mi * rows, s_smem, barrier)
                if self.value_sums:
                    self.per_stack(expert, w_gmem, lambda w, sc: finish(self.main_loop(None, w, sc, at), s_smem,
                                                                        barrier))
                    return
                self.per_stack(expert, w_gmem, lambda w, sc: self.main_loop(accs, w, sc, at))
                finish([a[...] for a in accs], s_smem, barrier)

            def with_accs(f):   # (register and shared-memory allocations take separate scopes)
                return f(()) if self.value_sums else pl.run_scoped(lambda *accs: f(accs), *self.acc_shapes)
            if scaled:
                pl.run_scoped(lambda s_smem, barrier: with_accs(lambda accs: scope(accs, s_smem, barrier)),
                              plgpu.SMEM((rows,), jnp.float32), plgpu.Barrier(num_arrivals=1))
            else:
                with_accs(scope)

    def warp_specialized_body(self, block_expert_gmem, lhs_gmem, *refs):
        """Warp specialised: a TMA warpgroup feeds ``compute_wgs`` wgmma warpgroups, each with its
        part of the tile (``split``); persistent, each CTA loops over its share of the tiles."""
        cfg, scaled, n_act, n_ops = self.cfg, self.scaled, len(self.act_operands), self.n_ops
        bm, bc, rows, bn, m, n = self.bm, self.bc, self.rows, self.bn, self.m, self.n
        scale_gmem, w_gmem, out_gmem = (refs[0] if scaled else None), refs[scaled + n_act:-1], refs[-1]
        act_gmem = refs[scaled] if n_act else None
        wg = jax.lax.axis_index("wg")

        def pipeline(step, context, mi, ni):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(self.steps,), memory_registers=40, in_specs=self.in_specs(mi, ni, 0),
                wg_axis="wg", num_compute_wgs=cfg.compute_wgs, max_concurrent_steps=cfg.stages,
                compute_context=context)

        # this warpgroup's part of each step's tiles, and of the output tile
        my_rows, my_cols = (wg * bm, 0) if cfg.split == "m" else (0, wg * bc)

        def my_part(w_tile):
            return w_tile if cfg.split == "m" else (w_tile.at[:, pl.ds(my_cols, bc)] if self.kn
                                                    else w_tile.at[pl.ds(my_cols, bc)])

        unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body or tile)
        shapes = (lhs_gmem, *(w.at[0] for w in w_gmem[:n_ops]))  # every stack's tiles are alike

        @functools.partial(pl.run_scoped, allocs=pipeline(unused, unused, 0, 0).get_allocations(*shapes),
                           o_smem=plgpu.SMEM((cfg.compute_wgs, 2, bm, EPI_COLS), self.out_dtype, transforms=(
                               plgpu.TilingTransform((8, EPI_COLS)), plgpu.SwizzleTransform(128)))
                           if bc % EPI_COLS == 0 and self.out_dtype == jnp.bfloat16 and not self.swap
                           else plgpu.SMEM((cfg.compute_wgs, bm, bc), self.out_dtype),
                           fp8=self.ws_weight_scratch(),
                           row_scales=(plgpu.SMEM((cfg.compute_wgs, bm), jnp.float32),
                                       plgpu.Barrier(num_barriers=cfg.compute_wgs)) if scaled else None,
                           act=self.ws_act_scratch(),
                           collective_axes="wg")
        def _(allocs, o_smem, fp8, row_scales, act):
            def tile(mi, ni):
                expert = block_expert_gmem[mi]
                at = TileAt(mi, ni, lhs_gmem, act_gmem)

                def run(w, scales):
                    def step(idx, x_smem, *rest):
                        *w_smem, accs = rest
                        x_mine = x_smem.at[pl.ds(my_rows, bm)] if cfg.split == "m" else x_smem
                        return self.ws_step(accs, x_mine, [my_part(t) for t in w_smem], w, idx[0], wg, fp8, act)

                    def context(body):
                        self.ws_prologue(scales, at, wg, fp8, act)
                        s_smem = None
                        if scaled:
                            s_smem = row_scales[0].at[wg]
                            self.fetch_row_scales(scale_gmem, mi * rows + my_rows, s_smem, row_scales[1].at[wg])
                            plgpu.barrier_wait(row_scales[1].at[wg])

                        def finish(vals):
                            self.store(vals, o_smem.at[wg], out_gmem.at[pl.ds(mi * rows + my_rows, bm),
                                                                        pl.ds(ni * bn + my_cols, bc)], s_smem,
                                       self.tile_factors(expert, ni, w_gmem))
                        if self.value_sums:
                            finish(list(body(self.zero_sums())))
                            return

                        def scope(*accs):
                            body(accs)
                            finish([a[...] for a in accs])
                        pl.run_scoped(scope, *self.acc_shapes)

                    pipeline(step, context, mi, ni)(lhs_gmem, *w, allocations=allocs)

                self.per_stack(expert, w_gmem, run)

            if cfg.persistent:  # this CTA's share of the tiles, in the grid order
                @plgpu.nd_loop((m // rows * (n // bn),), collective_axes="sm")
                def _(info):
                    tile(*cfg.tile_of(info.index[0], m // rows, n // bn))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            else:
                tile(*self.grid_tile())

    def __call__(self):
        cfg, m, n, rows, bn = self.cfg, self.m, self.n, self.rows, self.bn
        kernel = plgpu.kernel(
            self.warp_specialized_body if self.ws else self.simple_body,
            out_type=(jax.ShapeDtypeStruct((m, n), self.out_dtype), jax.ShapeDtypeStruct((n // 128, m), jnp.float32))
            if self.fp8_out else jax.ShapeDtypeStruct((m, n), self.out_dtype),
            **({"grid": (min(_num_sms(), m // rows * (n // bn)),), "grid_names": ("sm",)} if cfg.persistent
               else {"grid": (m // rows, n // bn), "grid_names": ("m", "n")}),
            **({"num_threads": cfg.compute_wgs + 1, "thread_name": "wg"} if self.ws else {}),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
            **({"interpret": self.interpret} if self.interpret is not None else {}))
        out = kernel(self.block_expert, self.lhs, *((self.row_scale.astype(jnp.float32),) if self.scaled else ()),
                     *self.act_operands, *self.flat_weights())
        return Fp8Rows(*out) if self.fp8_out else out
