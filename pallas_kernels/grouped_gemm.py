"""Grouped (per-expert) GEMMs for MegaMoE as Mosaic GPU kernels for Hopper, with jnp references.

Two kernels share one body:

* ``grouped_swiglu(x, w1, w3)``: the gate and up projections of each expert and the
  clamped SwiGLU, fused. Each CTA streams the matching gate and up weight tiles through one
  TMA pipeline into two wgmma accumulators and applies the SwiGLU on the registers, so the
  ``[rows, 2I]`` fp32 pre-activation never reaches HBM: only the bf16 ``h`` does.
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

Why two launches and not one: the down GEMM needs every ``h`` column of a row block, which
the gate/up CTAs produce across the N grid; a single persistent kernel would need a
grid-wide dependency per row block. At decode sizes the cost is one extra launch, at
prefill sizes ``h`` is ``I/D`` = 45% of the activations, read once.

Grid: one CTA per (row block, column block), row blocks fastest, so CTAs that run together
share a weight tile in L2 at prefill sizes and cover every weight once at decode sizes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


@dataclass(frozen=True)
class GemmConfig:
    """Tiles per compute warpgroup; ``compute_wgs=2`` adds a TMA producer warpgroup and two
    wgmma consumers that share each weight tile over ``2 * block_m`` rows (warp specialised)."""
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    compute_wgs: int = 1

    @property
    def rows(self) -> int:
        """Rows per CTA: the block alignment the layout must use."""
        return self.block_m * self.compute_wgs


def _transposed(ref):
    """The ``[n, k]`` weight tile viewed as ``[k, n]`` (the API moved in JAX 0.11)."""
    if hasattr(plgpu, "transpose_ref") and jax.__version_info__ < (0, 11):
        return plgpu.transpose_ref(ref, (1, 0))
    return ref.transpose((1, 0))


def swiglu_f32(gate, up, limit: float):
    """Clamped SwiGLU in fp32; written with ops the Mosaic GPU lowering supports."""
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.minimum(jnp.maximum(up, -limit), limit)
    return gate / (1.0 + jnp.exp(-gate)) * up


def _grouped_kernel(lhs, stacks, block_expert, epilogue: Callable, cfg: GemmConfig, interpret):
    """``stacks``: tuples of per-operand expert stacks ``[E_s, N, K]``; expert ids number the
    stacks' experts consecutively (the routed stack, then e.g. the shared expert as one more)."""
    m, k = lhs.shape
    n = stacks[0][0].shape[1]
    n_ops = len(stacks[0])
    # The 0.10 Mosaic GPU interpreter cannot feed a transposed shared-memory view to wgmma,
    # so interpreted runs read weights pre-transposed to [E, in, out]; the GPU reads HF tiles.
    kn = interpret is not None
    if kn:
        stacks = tuple(tuple(jnp.swapaxes(w, 1, 2) for w in st) for st in stacks)
    first = [sum(st[0].shape[0] for st in stacks[:i]) for i in range(len(stacks))]
    rows, bm, bn, bk = cfg.rows, cfg.block_m, cfg.block_n, cfg.block_k
    if m % rows or n % bn or k % bk:
        raise ValueError(f"shapes (m={m}, n={n}, k={k}) must divide blocks ({rows}, {bn}, {bk})")
    if block_expert.shape != (m // rows,):
        raise ValueError(f"block_expert must have shape ({m // rows},), got {block_expert.shape}")
    acc_shapes = [plgpu.ACC((bm, bn))] * n_ops

    def per_stack(expert, w_gmem, run):
        """``run(weight refs of this expert)`` under the stack that owns ``expert``."""
        for lo, st in zip(first, stacks):
            refs, w_gmem = w_gmem[:n_ops], w_gmem[n_ops:]

            @pl.when((expert >= lo) & (expert < lo + st[0].shape[0]))
            def _(refs=refs, lo=lo):
                run(tuple(w.at[expert - lo] for w in refs))

    def in_specs(mi, ni, delay_release):
        w_spec = (plgpu.BlockSpec((bk, bn), lambda s: (s, ni), delay_release=delay_release) if kn
                  else plgpu.BlockSpec((bn, bk), lambda s: (ni, s), delay_release=delay_release))
        return [plgpu.BlockSpec((rows, bk), lambda s: (mi, s), delay_release=delay_release)] + [
            w_spec] * n_ops

    def mma(accs, x_smem, w_smem):
        for acc, w in zip(accs, w_smem):
            plgpu.wgmma(acc, x_smem, w if kn else _transposed(w))

    def store(accs, o_smem, o_gmem):
        o_smem[...] = epilogue(*(a[...] for a in accs)).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def simple_body(block_expert_gmem, lhs_gmem, *refs):
        w_gmem, out_gmem = refs[:-1], refs[-1]
        mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        expert = block_expert_gmem[mi]

        @pl.when(expert >= 0)
        def _():
            def scope(*accs):
                # delay_release=1: a slot is refilled only after the next step's wgmma is issued
                per_stack(expert, w_gmem, lambda w: plgpu.emit_pipeline(
                    lambda _, x, *w_smem: mma(accs, x, w_smem), grid=(k // bk,),
                    in_specs=in_specs(mi, ni, 1), max_concurrent_steps=cfg.stages)(lhs_gmem, *w))
                pl.run_scoped(lambda o_smem: store(accs, o_smem, out_gmem.at[
                    pl.ds(mi * rows, bm), pl.ds(ni * bn, bn)]), plgpu.SMEM((bm, bn), lhs.dtype))
            pl.run_scoped(scope, *acc_shapes)

    def warp_specialized_body(block_expert_gmem, lhs_gmem, *refs):
        w_gmem, out_gmem = refs[:-1], refs[-1]
        mi, ni, wg = (jax.lax.axis_index(a) for a in ("m", "n", "wg"))
        expert = block_expert_gmem[mi]

        def pipeline(step, context):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(k // bk,), memory_registers=40, in_specs=in_specs(mi, ni, 0),
                wg_axis="wg", num_compute_wgs=cfg.compute_wgs, max_concurrent_steps=cfg.stages,
                compute_context=context)

        def step(_, x_smem, *rest):
            *w_smem, accs = rest
            mma(accs, x_smem.at[pl.ds(wg * bm, bm)], w_smem)
            plgpu.wgmma_wait(0)  # the producer refills the slot once this step returns
            return accs

        unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)

        shapes = (lhs_gmem, *(w.at[0] for w in w_gmem[:n_ops]))  # every stack's tiles are alike

        @functools.partial(pl.run_scoped, allocs=pipeline(unused, unused).get_allocations(*shapes),
                           o_smem=plgpu.SMEM((cfg.compute_wgs, bm, bn), lhs.dtype),
                           collective_axes="wg")
        def _(allocs, o_smem):
            def context(run):
                def scope(*accs):
                    run(accs)
                    store(accs, o_smem.at[wg],
                          out_gmem.at[pl.ds(mi * rows + wg * bm, bm), pl.ds(ni * bn, bn)])
                pl.run_scoped(scope, *acc_shapes)

            per_stack(expert, w_gmem,
                      lambda w: pipeline(step, context)(lhs_gmem, *w, allocations=allocs))

    ws = cfg.compute_wgs > 1
    kernel = plgpu.kernel(
        warp_specialized_body if ws else simple_body,
        out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype), grid=(m // rows, n // bn),
        grid_names=("m", "n"), **({"num_threads": cfg.compute_wgs + 1, "thread_name": "wg"} if ws else {}),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": interpret} if interpret is not None else {}))
    return kernel(block_expert, lhs, *(w for st in stacks for w in st))


@functools.partial(jax.jit, static_argnames=("limit", "cfg", "interpret"))
def grouped_swiglu(x, w1, w3, block_expert, *, limit: float, shared=None,
                   cfg: GemmConfig = GemmConfig(), interpret=None):
    """``h[r] = swiglu(x[r] @ w1[e]ᵀ, x[r] @ w3[e]ᵀ)`` with ``e = block_expert[r // cfg.rows]``.

    x ``[M, D]`` bf16 (block-aligned rows), w1/w3 ``[E, I, D]``; ``shared = (w1 [I, D],
    w3 [I, D])`` makes expert id ``E`` the shared expert. Returns ``[M, I]`` in x's dtype.
    """
    stacks = ((w1, w3),) + (() if shared is None else (tuple(w[None] for w in shared),))
    return _grouped_kernel(x, stacks, block_expert,
                           lambda g, u: swiglu_f32(g, u, limit), cfg, interpret)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def grouped_matmul(h, w2, block_expert, *, shared=None, cfg: GemmConfig = GemmConfig(),
                   interpret=None):
    """``out[r] = h[r] @ w2[e]ᵀ`` with ``e = block_expert[r // cfg.rows]``; w2 ``[E, D, I]``,
    ``shared`` ``[D, I]`` is expert ``E``."""
    stacks = ((w2,),) + (() if shared is None else ((shared[None],),))
    return _grouped_kernel(h, stacks, block_expert, lambda acc: acc, cfg, interpret)


def _per_row_weights(w, block_expert, rows, shared):
    if shared is not None:
        w = jnp.concatenate([w, shared[None]])
    return w[jnp.maximum(jnp.repeat(block_expert, rows), 0)]


def grouped_swiglu_reference(x, w1, w3, block_expert, *, limit: float, rows: int, shared=None):
    w1r, w3r = (_per_row_weights(w, block_expert, rows, sw)
                for w, sw in zip((w1, w3), shared or (None, None)))
    f32 = jnp.float32
    gate = jnp.einsum("md,mid->mi", x.astype(f32), w1r.astype(f32))
    up = jnp.einsum("md,mid->mi", x.astype(f32), w3r.astype(f32))
    return swiglu_f32(gate, up, limit).astype(x.dtype)


def grouped_matmul_reference(h, w2, block_expert, *, rows: int, shared=None):
    w2r = _per_row_weights(w2, block_expert, rows, shared)
    return jnp.einsum("mi,mdi->md", h.astype(jnp.float32), w2r.astype(jnp.float32)).astype(h.dtype)
