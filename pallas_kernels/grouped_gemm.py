"""Grouped (per-expert) GEMMs for MegaMoE as Mosaic GPU kernels for Hopper, with jnp references.

Contract:

* ``grouped_swiglu(x, w1, w3, block_expert)``: the gate and up projections of each expert and
  the clamped SwiGLU, fused, times each row's routing weight (``row_scale``) before the one
  rounding: the ``[rows, 2I]`` fp32 pre-activation never reaches HBM, only the ``h`` the down
  projection reads.
* ``grouped_matmul(h, w2, block_expert)``: the down projection.

Rows arrive grouped by expert and **block-aligned** (every expert's rows start at a multiple
of the CTA's rows, as SGLang's ``moe_align_block_size`` does), so a row block belongs to one
expert, read from ``block_expert`` (``-1``: an unused block, skipped). Stores are whole-tile TMA
copies; padding rows hold garbage the combine never reads. Weights keep the HF ``[E, out, in]``
layout (the tile is transposed in shared memory for the wgmma): checkpoints need no re-layout.
The shared expert rides along as one more expert id (a second weight stack, picked per row
block), so routed and shared experts take two launches in all, and at decode sizes its CTAs
fill SMs the routed grid leaves idle.

Design: one kernel body per operand format (the rows' and the weights'), each a main loop
plugged into the shared grid bodies and epilogue of ``grouped_gemm_kernel``:
``grouped_gemm_bf16`` (bf16 weights), ``grouped_gemm_fp8`` (fp8 block-scaled weights against
bf16 rows, converted in registers), ``grouped_gemm_mxfp4`` (V4.1's MXFP4 experts) and
``grouped_gemm_w8a8`` (fp8 rows against fp8 weights, nothing converted). Tiles per format and
size: ``grouped_gemm_tiles``.

Grid: one CTA per (row block, column block), column blocks fastest (Mosaic GPU makes the last
grid axis CUDA's x), so CTAs that run together share their row block's activation tile in L2
and, at decode sizes, cover every weight tile once; ``group_m`` orders them in bands of row
blocks instead (Triton's grouped order), which the prefill sizes take.

Why two launches and not one: the down GEMM needs every ``h`` column of a row block, which the
gate/up CTAs produce across the N grid, so one persistent kernel would need a grid-wide
dependency per row block; at decode sizes the cost is one launch, at prefill sizes ``h`` is
``I/D`` = 45% of the activations, read once. The record of what was measured and tried
(against cuBLAS, clusters, stream-K, persistent grids, ping-pong): bench/RESULTS.md, "MegaMoE".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.block_scaled import Fp4Weight, Fp8Rows, QuantizedWeight
from pallas_kernels.grouped_gemm_bf16 import Bf16Gemm
from pallas_kernels.grouped_gemm_fp8 import Fp8Gemm
from pallas_kernels.grouped_gemm_kernel import GroupedGemm
from pallas_kernels.grouped_gemm_mxfp4 import Mxfp4Gemm
from pallas_kernels.grouped_gemm_w8a8 import W8a8Gemm


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
    share fewer weight and activation tiles' worth of L2; 0: column blocks fastest over all rows."""
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


def swiglu_f32(gate, up, limit: float):
    """Clamped SwiGLU in fp32; written with ops the Mosaic GPU lowering supports."""
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.minimum(jnp.maximum(up, -limit), limit)
    return gate / (1.0 + jnp.exp(-gate)) * up


def _body(lhs, stacks) -> type[GroupedGemm]:
    """The kernel body for the operands' format: the rows', then the weights' (any MXFP4 weight
    makes the launch MXFP4, any fp8 weight fp8; the bodies refuse what they cannot mix)."""
    weights = [w for st in stacks for w in st]
    if isinstance(lhs, Fp8Rows):
        return W8a8Gemm
    if any(isinstance(w, Fp4Weight) for w in weights):
        return Mxfp4Gemm
    return Fp8Gemm if any(isinstance(w, QuantizedWeight) for w in weights) else Bf16Gemm


def _grouped_kernel(lhs, stacks, block_expert, epilogue, cfg, interpret, row_scale=None, fp8_out=False):
    return _body(lhs, stacks)(lhs, stacks, block_expert, epilogue, cfg, interpret, row_scale, fp8_out)()


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
