"""MegaMoE expert stage on the GPU: our Pallas kernels against XLA, Pallas and PyTorch peers.

The expert stage of one GPU's EP64 slice of V4.1-Flash: 6 local experts, hidden 5120,
intermediate 2304, bf16; gate+up GEMM, clamped SwiGLU, down GEMM, for T rows per expert
(balanced) or the same total skewed over the experts. Every implementation computes the
same function from the same data and is checked against an fp32 per-expert reference.

Implementations: ``megajax`` (block-aligned rows, fused gate/up+SwiGLU kernel then the down
kernel; best of a few block configs, each recorded, swapped-tile ones up to 256 rows per
expert, persistent ones from 128), ``xla_einsum`` (dense batched matmul
over rows padded to the largest expert), ``pallas_ragged_dot_mgpu``
(JAX's grouped GEMM, gate+up as one GEMM, SwiGLU in XLA), ``torch_bmm`` (padded like the
einsum), ``torch_grouped_mm`` and ``sglang_triton`` (SGLang's Triton fused MoE from its wheel,
``sglang_moe``: its own config pick and the nearest tuned one, launched eagerly). Roofline:
max(FLOPs / measured matmul rate, bytes / measured copy bandwidth), bytes = weights + rows in +
rows out.

Up to 256 rows per expert, ``T…_fp8w`` cases also run the kernels on fp8 e4m3 weights with
128 x 128 block scales (dequantised in-kernel), checked against the fp32 reference on the
dequantised weights, against their own roofline (half the weight bytes); ``T…_mxfp4w`` cases
the same with MXFP4 weights (e2m1, a UE8M0 scale per 32: V4.1's expert format; a quarter of
the bytes and 1/32 more). ``T…_w8a8`` cases have SGLang's Triton W8A8 block-fp8 as their peer
(checked against a reference with its own absmax / 448 row scales); no peer here takes fp8
weights with bf16 rows, or MXFP4, on Hopper (GPU_KERNELS.md §5), so those rows have none.

``--shared 16,256``: those sizes also run with the shared expert, its T rows (one per token)
as a 7th group: ``megajax_fused_shared`` is the model's form (routed stacks plus the shared
expert's own weights, run in the same two launches through ``shared=``, and the routing
weights applied in the gate/up epilogue), every other impl sees 7 stacked experts; the
roofline counts the 7 experts' weights.

``--trace`` records, for the best megajax config and the JAX peers of each case, every kernel's
GPU time from a profiler trace (``kernels_us``): where a call's time goes, free of launch gaps;
and ``timeline``: the GPU's span and busy time per call over nine calls, dispatched one by one
and three per dispatch (``gpu_common.gpu_timeline``); busy time is what a call costs inside
the model's one executable per step, where no host dispatch sits between calls.

    python bench/moe_gpu.py [--tokens 16,64,256,1024,4096] [--shared 16,256] [--trace] [--large-only]
                            [--plot results.png]
"""
from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from gpu_common import (batched, ceilings, gpu_kernels, gpu_timeline, rel_err, roofline_ms, run_info, time_jax,
                        time_jax_one_dispatch, time_torch, torch, write)

from mega.moe import aligned_layout  # noqa: E402
from pallas_kernels.block_scaled import Fp4Weight, Fp8Rows, QuantizedWeight, e4m3_rounded
from pallas_kernels.grouped_gemm import GemmConfig, grouped_matmul, grouped_swiglu, swiglu_f32

E, D, I = 6, 5120, 2304
INTERPRET = None  # --smoke: tiny shapes through the Mosaic GPU interpreter on CPU
TRACE = False     # --trace: also each kernel's GPU time, from a profiler trace
LIMIT = 10.0
SKEW = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
CONFIGS = [  # (gate/up config, down config); a pair shares its rows per CTA
    (GemmConfig(64, 64, 64, 4), GemmConfig(64, 128, 64, 4)),
    (GemmConfig(64, 128, 64, 4), GemmConfig(64, 256, 64, 4)),
    (GemmConfig(64, 128, 64, 4, 2), GemmConfig(64, 256, 64, 3, 2)),
    (GemmConfig(128, 64, 64, 3, 2), GemmConfig(128, 128, 64, 3, 2)),
]
# fp8 weights (tiles within a 128 x 128 scale block): the 64-wide one-warpgroup tiles need
# 80 KB of shared memory, so two CTAs (two dequantising warpgroups) share an SM; the split-n
# configs give each of two compute warpgroups half of every tile to dequantise
FP8_CONFIGS = [
    (GemmConfig(64, 128, 64, 4), GemmConfig(64, 128, 64, 4)),
    (GemmConfig(64, 64, 64, 4), GemmConfig(64, 64, 64, 4)),
    (GemmConfig(64, 64, 128, 3), GemmConfig(64, 64, 128, 3)),
    (GemmConfig(64, 128, 64, 4, 2, "n"), GemmConfig(64, 128, 64, 4, 2, "n")),
]
# decode sizes (up to 256 rows per expert): swapped tiles (``w x^T``), the rows as the wgmma's N,
# so a CTA of 16 or 32 rows streams weight tiles without 64-row activation tiles beside them
SWAP_CONFIGS = [
    (GemmConfig(16, 64, 64, 6, swap_ab=True), GemmConfig(16, 128, 64, 6, swap_ab=True)),
    (GemmConfig(16, 128, 64, 6, swap_ab=True), GemmConfig(16, 256, 64, 4, swap_ab=True)),
    (GemmConfig(16, 64, 128, 4, swap_ab=True), GemmConfig(16, 128, 128, 4, swap_ab=True)),
    (GemmConfig(32, 64, 64, 6, swap_ab=True), GemmConfig(32, 128, 64, 6, swap_ab=True)),
    (GemmConfig(64, 64, 64, 4, swap_ab=True), GemmConfig(64, 128, 64, 4, swap_ab=True)),
    (GemmConfig(128, 64, 64, 4, swap_ab=True), GemmConfig(128, 128, 64, 4, swap_ab=True)),
]
FP8_SWAP_CONFIGS = [  # the dequantised weight tile fed to the wgmma from registers (A operand)
    (GemmConfig(64, 64, 64, 4, swap_ab=True), GemmConfig(64, 128, 64, 4, swap_ab=True)),
    # 128-deep steps: half as many steps (each a barrier wait, a conversion and a wgmma wait in
    # series) per weight byte; 17-24% faster at 16-64 rows per expert (bench/RESULTS.md)
    (GemmConfig(16, 64, 128, 6, swap_ab=True), GemmConfig(16, 128, 128, 4, swap_ab=True)),
    (GemmConfig(64, 64, 128, 4, swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True)),
    # ... with shared memory for two CTAs per SM, whose steps overlap (16 rows: 7% faster again)
    (GemmConfig(16, 64, 128, 4, swap_ab=True), GemmConfig(16, 128, 128, 3, swap_ab=True)),
    (GemmConfig(32, 64, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 3, swap_ab=True)),
    (GemmConfig(64, 64, 128, 3, swap_ab=True), GemmConfig(64, 128, 128, 2, swap_ab=True)),
    # 128 rows (every weight tile converted half as often as with 64-row blocks): best at T256
    (GemmConfig(128, 64, 64, 4, swap_ab=True), GemmConfig(128, 128, 64, 3, swap_ab=True)),
    (GemmConfig(128, 64, 128, 3, swap_ab=True), GemmConfig(128, 128, 128, 2, swap_ab=True)),
    # warp specialised: each of two compute warpgroups converts its 64 weight rows of a tile
    # while the TMA warpgroup streams the next tiles
    (GemmConfig(16, 128, 64, 8, 2, "n", swap_ab=True), GemmConfig(16, 128, 64, 8, 2, "n", swap_ab=True)),
    (GemmConfig(32, 128, 64, 6, 2, "n", swap_ab=True), GemmConfig(32, 128, 64, 8, 2, "n", swap_ab=True)),
    (GemmConfig(64, 128, 64, 5, 2, "n", swap_ab=True), GemmConfig(64, 128, 64, 6, 2, "n", swap_ab=True)),
]
# MXFP4 weights (swapped, one compute warpgroup): a step is a quarter of bf16's bytes, so steps
# 128 or 256 deep; small tiles leave room for several CTAs per SM
MXFP4_CONFIGS = [
    (GemmConfig(16, 64, 128, 4, swap_ab=True), GemmConfig(16, 128, 128, 3, swap_ab=True)),
    (GemmConfig(16, 64, 128, 8, swap_ab=True), GemmConfig(16, 128, 128, 6, swap_ab=True)),
    (GemmConfig(16, 64, 256, 4, swap_ab=True), GemmConfig(16, 128, 256, 3, swap_ab=True)),
    (GemmConfig(32, 64, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 4, swap_ab=True)),
    (GemmConfig(64, 64, 128, 4, swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True)),
    (GemmConfig(64, 64, 256, 3, swap_ab=True), GemmConfig(64, 128, 256, 3, swap_ab=True)),
    (GemmConfig(128, 64, 64, 4, swap_ab=True), GemmConfig(128, 128, 64, 3, swap_ab=True)),
    (GemmConfig(128, 64, 128, 4, swap_ab=True), GemmConfig(128, 128, 128, 3, swap_ab=True)),
]
# W8A8 (fp8 weights, fp8 rows with a scale per 128 columns): both operands straight from
# shared memory, so no conversion; each accumulator is held twice (the step's product and the
# sum). Gate/up tiles 64 wide: ``h`` requantised by XLA in the call; 128 wide (one scale block):
# requantised in the gate/up epilogue (``fp8_out``)
W8A8_CONFIGS = [
    (GemmConfig(16, 64, 128, 6, swap_ab=True), GemmConfig(16, 128, 128, 4, swap_ab=True)),
    (GemmConfig(32, 64, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 3, swap_ab=True)),
    (GemmConfig(64, 64, 128, 4, swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True)),
    (GemmConfig(64, 64, 128, 6, swap_ab=True), GemmConfig(64, 64, 128, 6, swap_ab=True)),
    (GemmConfig(16, 128, 128, 4, swap_ab=True), GemmConfig(16, 128, 128, 4, swap_ab=True)),
    (GemmConfig(32, 128, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 3, swap_ab=True)),
    (GemmConfig(32, 128, 128, 6, swap_ab=True), GemmConfig(32, 128, 128, 4, swap_ab=True)),
    (GemmConfig(64, 128, 128, 3, swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True)),
    # warp specialised: two compute warpgroups of 64 weight rows each (h requantised by XLA);
    # from 256 rows per expert mega.moe's pair (gate/up only), then the down kernel's 128-row
    # blocks (5% faster balanced; ragged loads pad each expert to 128 rows, which skewed cases show)
    (GemmConfig(32, 128, 128, 4, 2, "n", swap_ab=True), GemmConfig(32, 128, 128, 4, 2, "n", swap_ab=True)),
    (GemmConfig(64, 128, 128, 4, 2, "n", swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True)),
    (GemmConfig(64, 128, 128, 4, 2, "n", swap_ab=True), GemmConfig(128, 128, 128, 3, 2, "n", swap_ab=True)),
]
# block-scaled weight formats beside bf16: (case suffix, quantiser, bytes per weight, configs)
QUANTIZED = {
    "fp8": ("_fp8w", QuantizedWeight.from_float, 1 + 4 / 128 ** 2, "fp8 e4m3 weights, 128x128 block scales"),
    "mxfp4": ("_mxfp4w", Fp4Weight.from_float, 0.5 + 1 / 32, "MXFP4 weights (e2m1, UE8M0 per 32)"),
    "w8a8": ("_w8a8", QuantizedWeight.from_float, 1 + 4 / 128 ** 2,
             "fp8 e4m3 weights (128x128 block scales) and rows (a scale per 128)"),
}
# compute-bound sizes (from 128 rows per expert): persistent CTAs, one per SM, each looping
# over output tiles (the next tile's loads and the last tile's store overlap the epilogue and
# the main loop)
LARGE_CONFIGS = [
    (GemmConfig(64, 128, 64, 4, 2, persistent=True), GemmConfig(64, 256, 64, 3, 2, persistent=True)),
    (GemmConfig(128, 64, 64, 3, 2, persistent=True), GemmConfig(128, 128, 64, 3, 2, persistent=True)),
    (GemmConfig(64, 144, 64, 3, 2, persistent=True), GemmConfig(64, 160, 64, 4, 2, persistent=True)),
    # grouped tile order (bands of 8 or 4 row blocks, row blocks fastest within a band)
    (GemmConfig(128, 64, 64, 3, 2, group_m=8), GemmConfig(128, 128, 64, 3, 2, group_m=8)),
    (GemmConfig(64, 128, 64, 4, 2, group_m=8), GemmConfig(64, 256, 64, 3, 2, group_m=8)),
    (GemmConfig(128, 64, 64, 3, 2, group_m=4), GemmConfig(128, 128, 64, 3, 2, group_m=4)),
    # 144-wide gate/up tiles (16 column blocks, not 18: the waves fill differently), in bands
    # of 8, and beside the 256-wide down tiles of mega.moe
    (GemmConfig(64, 144, 64, 3, 2, group_m=8), GemmConfig(64, 160, 64, 4, 2, group_m=8)),
    (GemmConfig(64, 144, 64, 3, 2, persistent=True, group_m=8),
     GemmConfig(64, 160, 64, 4, 2, persistent=True, group_m=8)),
    (GemmConfig(64, 144, 64, 3, 2, persistent=True), GemmConfig(64, 256, 64, 3, 2, group_m=8)),
]
# --sweep adds these (weight-streaming sizes): deeper pipelines, and smaller tiles whose shared
# memory lets two or more CTAs share an SM (gate/up's 18 column blocks x 6 experts = 108 CTAs
# leave 24 of 132 SMs idle, down's 120 leave 12)
SWEEP = [
    (GemmConfig(64, 128, 64, 5), GemmConfig(64, 256, 64, 5)),
    (GemmConfig(64, 128, 64, 4, 2, "n"), GemmConfig(64, 256, 64, 4, 2, "n")),
    (GemmConfig(64, 64, 64, 2), GemmConfig(64, 128, 64, 2)),
    (GemmConfig(64, 64, 128, 3), GemmConfig(64, 128, 128, 4)),
    (GemmConfig(64, 32, 128, 4), GemmConfig(64, 64, 128, 4)),
    (GemmConfig(64, 128, 128, 2), GemmConfig(64, 256, 128, 2)),
]


def counts_for(t: int, routing: str) -> np.ndarray:
    if routing == "balanced":
        return np.full(E, t)
    c = np.floor(SKEW[:E] / SKEW[:E].sum() * t * E).astype(int)
    c[0] += t * E - c.sum()
    return c


def absmax_rounded(x):
    """``x`` rounded as SGLang's W8A8 quantises rows: e4m3 with a scale of absmax / 448 per 128
    columns; fp32 (such scales leave the bf16 grid)."""
    m, k = x.shape
    blocks = x.astype(jnp.float32).reshape(m, k // 128, 128)
    scale = jnp.maximum(jnp.abs(blocks).max(axis=-1, keepdims=True), 1e-10) / 448.0
    return (e4m3_rounded(blocks / scale) * scale).reshape(m, k)


ROW_ROUNDING = {"bf16": lambda v: v, "w8a8": Fp8Rows.rounded, "w8a8_absmax": absmax_rounded}


@functools.partial(jax.jit, static_argnames=("counts", "rows"))
def reference(xs, w1, w3, w2, counts, rows="bf16"):
    """fp32 per-expert reference on rows grouped by expert (h rounded to bf16 as the model does;
    ``rows``: how x and h are also rounded to fp8 rows, as W8A8 does: ours, power-of-two scales,
    or SGLang's)."""
    rounded = ROW_ROUNDING[rows]
    xs = rounded(xs)
    outs, start = [], 0
    f32 = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    for e, c in enumerate(counts):
        x = xs[start:start + c].astype(jnp.float32)
        h = swiglu_f32(f32("td,id->ti", x, w1[e].astype(jnp.float32)),
                       f32("td,id->ti", x, w3[e].astype(jnp.float32)), LIMIT).astype(jnp.bfloat16)
        outs.append(f32("ti,di->td", rounded(h).astype(jnp.float32), w2[e].astype(jnp.float32)))
        start += c
    return jnp.concatenate(outs)


@functools.partial(jax.jit, static_argnames=("counts", "cap"))
def padded(xs, counts, cap):
    """Rows grouped by expert → [E, cap, ·] (zero rows after each expert's own)."""
    starts = np.cumsum((0,) + counts[:-1])
    return jnp.stack([jnp.pad(xs[s:s + c], ((0, cap - c), (0, 0))) for s, c in zip(starts, counts)])


def unpadded(y, counts):
    return jnp.concatenate([y[e, :c] for e, c in enumerate(counts)])


@functools.partial(jax.jit, static_argnames=("n", "rows"))
def aligned(xs, gs, n, rows):
    dest, block_expert, m_pad = aligned_layout(gs, n, rows, gs.shape[0])
    return jnp.zeros((m_pad, D), xs.dtype).at[dest].set(xs), dest, block_expert


def glu(hh):
    return swiglu_f32(hh[..., :I].astype(jnp.float32), hh[..., I:].astype(jnp.float32),
                      LIMIT).astype(jnp.bfloat16)


def configs_for(counts, configs, swapped, large=()):
    """The block configs timed for these counts: the swapped ones at decode sizes only, the
    ``large`` ones from 128 rows per expert."""
    pairs = (configs + (swapped if counts.sum() <= 256 * len(counts) else [])
             + (list(large) if counts.sum() >= 128 * len(counts) else []))
    return [(cu, cd) for cu, cd in pairs if I % cu.block_n == 0 and D % cd.block_n == 0]   # (--smoke's shapes)


def impls(xs, w1, w3, w2, counts):
    """name → (kind, callable, args, finish): ``finish`` (untimed) maps the callable's natural
    output layout to rows grouped by expert for the check."""
    n = int(counts.sum())
    gs = jnp.asarray(counts, jnp.int32)
    cap = int(counts.max())
    grouped = lambda y: y  # noqa: E731
    out = {}
    for cu, cd in configs_for(counts, CONFIGS, SWAP_CONFIGS, LARGE_CONFIGS):
        x_al, dest, block_expert = aligned(xs, gs, n, cu.rows)
        name = config_name("megajax", cu, cd)
        up = functools.partial(grouped_swiglu, limit=LIMIT, cfg=cu, interpret=INTERPRET)
        down = functools.partial(grouped_matmul, cfg=cd, interpret=INTERPRET)
        out[name] = ("jax", jax.jit(lambda x, a, b, c, be, up=up, down=down: down(up(x, a, b, be), c, be)),
                     (x_al, w1, w3, w2, block_expert), lambda y, dest=dest: y[dest])
        # stage timings (where the time goes): each kernel alone on the same data
        h = up(x_al, w1, w3, block_expert)
        out[name.replace("megajax", "stage:gate_up")] = ("jax", jax.jit(up), (x_al, w1, w3, block_expert), None)
        out[name.replace("megajax", "stage:down")] = ("jax", jax.jit(down), (h, w2, block_expert), None)

    w13 = jnp.concatenate([w1, w3], axis=1)  # [E, 2I, D]
    xp = padded(xs, tuple(int(c) for c in counts), cap)
    out["xla_einsum"] = ("jax", jax.jit(lambda xp, a, b: jnp.einsum(
        "eti,edi->etd", glu(jnp.einsum("etd,end->etn", xp, a)), b)), (xp, w13, w2),
        lambda y: unpadded(y, counts))

    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm
        kw = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1,
                  transpose_rhs=True)

        @jax.jit
        def pallas_rd(xs, w13, w2, gs):
            h = glu(rdm.ragged_dot(xs, w13, group_sizes=gs, **kw))
            return rdm.ragged_dot(h, w2, group_sizes=gs, **kw)
        out["pallas_ragged_dot_mgpu[128x128]"] = ("jax", pallas_rd, (xs, w13, w2, gs), grouped)
    except ImportError as e:
        print("ragged_dot_mgpu unavailable:", e)

    if torch is not None and torch.cuda.is_available():
        tx = torch.from_dlpack(xs)
        t13, t2 = torch.from_dlpack(w13), torch.from_dlpack(w2)
        txp = torch.from_dlpack(xp)
        offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")

        def tglu(hh):
            g, u = hh[..., :I].float().clamp(max=LIMIT), hh[..., I:].float().clamp(-LIMIT, LIMIT)
            return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)

        out["torch_bmm"] = ("torch", lambda: torch.bmm(tglu(torch.bmm(txp, t13.transpose(1, 2))),
                                                        t2.transpose(1, 2)), (),
                            lambda y: unpadded(jnp.asarray(y.float().cpu().numpy()), counts))
        out["torch_grouped_mm"] = ("torch", lambda: torch._grouped_mm(
            tglu(torch._grouped_mm(tx, t13.transpose(1, 2), offs=offs)), t2.transpose(1, 2), offs=offs),
            (), lambda y: y.float().cpu().numpy())
    out.update(sglang_impls(xs, w13, w2, counts))
    return out


_PEER_CHECKED: list = []   # the peer's self-check result, once a run


def sglang_impls(xs, w13, w2, counts):
    """SGLang's Triton fused MoE (``sglang_moe``) on the same rows and weights (bf16 arrays, or
    ``QuantizedWeight`` stacks for W8A8 block-fp8), launched eagerly (captured in a CUDA graph, as
    SGLang's decode steps run, the launches faulted at replay: bench/RESULTS.md); one entry per
    config (its own pick for the shape, the nearest tuned one)."""
    if torch is None or not torch.cuda.is_available():
        return {}
    try:
        import sglang_moe
        version = sglang_moe.load().version
    except Exception as e:   # the wheel not carried, or an import it needs: the run goes on without the peer
        print(f"sglang fused MoE unavailable: {type(e).__name__}: {e}", flush=True)
        return {}
    if not _PEER_CHECKED:   # its own process first: a faulting launch would poison this one's CUDA context
        try:
            check = subprocess.run([sys.executable, sglang_moe.__file__], capture_output=True, text=True, timeout=300)
            print(check.stdout + check.stderr[-3000:], flush=True)
            _PEER_CHECKED.append(check.returncode == 0)
        except subprocess.TimeoutExpired:
            print("sglang fused MoE self-check: no answer in 300 s", flush=True)
            _PEER_CHECKED.append(False)
    if not _PEER_CHECKED[0]:
        print("sglang fused MoE left out: its self-check failed (above)", flush=True)
        return {}

    def fp8(q):   # (dlpack carries no fp8: the bytes, viewed as e4m3 again)
        return torch.from_dlpack(jax.lax.bitcast_convert_type(q, jnp.uint8)).view(torch.float8_e4m3fn)

    quantized = isinstance(w13, QuantizedWeight)
    t13, t2 = (fp8(w.q) for w in (w13, w2)) if quantized else (torch.from_dlpack(w) for w in (w13, w2))
    scales = tuple(torch.from_dlpack(w.scale) for w in (w13, w2)) if quantized else None
    rows = torch.from_dlpack(xs)
    expert = torch.repeat_interleave(torch.arange(len(counts), device="cuda"),
                                     torch.as_tensor(np.asarray(counts), device="cuda"))
    out = {}
    for label, config in sglang_moe.configs(int(counts.sum()), len(counts), I, D, quantized).items():
        plan = (expert, sglang_moe.align(expert, config["BLOCK_SIZE_M"], len(counts)))
        call = functools.partial(sglang_moe.fused_experts, rows, t13, t2, plan, config, scales)
        shape = (f"{config['BLOCK_SIZE_M']}x{config['BLOCK_SIZE_N']}x{config['BLOCK_SIZE_K']}"
                 f" g{config.get('GROUP_SIZE_M', 1)} w{config.get('num_warps', 4)} s{config.get('num_stages', 3)}")
        out[f"sglang_triton {version}[{label}: {shape}]"] = ("torch", call, (),
                                                  lambda y: y.float().cpu().numpy())
    return out


def run_case(t, routing, ceil, rows, roof, weights="bf16", shared=False):
    counts = counts_for(t, routing)
    if shared:   # the shared expert as one more group of rows: t tokens, each once
        counts = np.append(counts, t)
    n, n_e = int(counts.sum()), len(counts)
    keys = jax.random.split(jax.random.key(t * 7 + len(routing) + shared), 4)  # fresh data per case
    xs = jax.random.normal(keys[0], (n, D), jnp.bfloat16)
    w1, w3 = (jax.random.normal(k, (n_e, I, D), jnp.bfloat16) * D ** -0.5 for k in keys[1:3])
    w2 = jax.random.normal(keys[3], (n_e, D, I), jnp.bfloat16) * I ** -0.5
    ref = np.asarray(reference(xs, w1, w3, w2, tuple(int(c) for c in counts)))
    case = {"tokens_per_expert": t, "routing": routing, "counts": counts.tolist(), "experts": E,
            "hidden": D, "intermediate": I, "dtype": "bf16", "shared_expert": shared}
    key = f"T{t}_{routing}" + ("_shared" if shared else "")
    flops = 2 * 3 * n * D * I
    roof[key] = roofline_ms(flops, 3 * n_e * I * D * 2 + 2 * n * D * 2, ceil)
    if shared:   # peers and megajax see E + 1 stacked experts; megajax_fused_shared the model's layout
        variants = impls(xs, w1, w3, w2, counts)
        variants.update(fused_shared_impls(xs, w1, w3, w2, counts))
        measure(key, case, variants, ref, rows, roof)
    elif weights == "bf16":
        measure(key, case, impls(xs, w1, w3, w2, counts), ref, rows, roof)
    elif t <= 256:  # quantised weights: the weight-streaming (decode) regime, against their own roofline
        suffix, quantize, per_weight, dtype = QUANTIZED[weights]
        q1, q3, q2 = (quantize(w) for w in (w1, w3, w2))
        weights_f32 = [q.dequantized() for q in (q1, q3, q2)]
        ref = np.asarray(reference(xs, *weights_f32, tuple(int(c) for c in counts),
                                   "w8a8" if weights == "w8a8" else "bf16"))
        roof[key + suffix] = roofline_ms(flops, 3 * E * I * D * per_weight + 2 * n * D * 2, ceil)
        measure(key + suffix, {**case, "dtype": dtype}, quantized_impls(weights, xs, q1, q3, q2, counts),
                ref, rows, roof)
        if weights == "w8a8":   # SGLang's rows carry absmax scales: checked against their own rounding
            peer_ref = np.asarray(reference(xs, *weights_f32, tuple(int(c) for c in counts), "w8a8_absmax"))
            w13 = QuantizedWeight.of(*(jnp.concatenate(pair, axis=1) for pair in ((q1.q, q3.q), (q1.scale, q3.scale))))
            measure(key + suffix, {**case, "dtype": dtype}, sglang_impls(xs, w13, q2, counts), peer_ref, rows, roof,
                    dispatch=False)


def fused_shared_impls(xs, w1, w3, w2, counts):
    """The model's form: routed stacks [E] plus the shared expert's own weights, passed as
    ``shared=`` so that its rows (block expert id E) run in the routed kernels' two launches,
    and each row's routing weight applied in the gate/up epilogue. The weights are powers of
    two, which commute exactly with the roundings, so dividing the output rows by them gives
    what the unweighted reference checks (a weight applied to the wrong row does not)."""
    n = int(counts.sum())
    out = {}
    for cu, cd in configs_for(counts, CONFIGS, SWAP_CONFIGS):
        x_al, dest, block_expert = aligned(xs, jnp.asarray(counts, jnp.int32), n, cu.rows)
        rw = 2.0 ** jax.random.randint(jax.random.key(cu.rows), (x_al.shape[0],), -2, 3).astype(jnp.float32)
        fn = jax.jit(lambda x, a, b, c, sa, sb, sc, be, rw, cu=cu, cd=cd: grouped_matmul(
            grouped_swiglu(x, a, b, be, limit=LIMIT, cfg=cu, shared=(sa, sb), row_scale=rw, interpret=INTERPRET),
            c, be, cfg=cd, shared=sc, interpret=INTERPRET))
        args = (x_al, w1[:-1], w3[:-1], w2[:-1], w1[-1], w3[-1], w2[-1], block_expert, rw)   # (sliced once, untimed)
        out[config_name("megajax_fused_shared", cu, cd)] = (
            "jax", fn, args, lambda y, dest=dest, rw=rw: y[dest].astype(jnp.float32) / rw[dest][:, None])
    return out


def config_name(prefix, cu, cd):
    split = (("" if cu.compute_wgs == 1 else f" split {cu.split}") + (" swap" if cu.swap_ab else "")
             + (" persistent" if cu.persistent else "") + (f" group {cu.group_m}" if cu.group_m else ""))
    down = "" if (cd.rows, cd.compute_wgs) == (cu.rows, cu.compute_wgs) else f" {cd.compute_wgs}wg {cd.rows} rows"
    return (f"{prefix}[{cu.compute_wgs}wg{split}:{cu.block_m}x{cu.block_n}x{cu.block_k}/{cu.stages},"
            f"{cd.block_n}x{cd.block_k}/{cd.stages}{down}]")


def quantized_impls(weights, xs, q1, q3, q2, counts):
    n = int(counts.sum())
    out = {}
    configs = {"fp8": configs_for(counts, FP8_CONFIGS, FP8_SWAP_CONFIGS), "mxfp4": MXFP4_CONFIGS,
               "w8a8": W8A8_CONFIGS}[weights]
    w8a8 = weights == "w8a8"
    for cu, cd in configs:
        block = max(cu.rows, cd.rows)   # (as mega.moe: each kernel's row blocks tile the layout's)
        x_al, dest, block_expert = aligned(xs, jnp.asarray(counts, jnp.int32), n, block)
        be_up, be_down = (jnp.repeat(block_expert, block // c.rows) for c in (cu, cd))
        fused = w8a8 and cu.quantizes_h   # h quantised in the gate/up epilogue
        fn = jax.jit(lambda x, a, b, c, be, be_d, cu=cu, cd=cd, fused=fused: grouped_matmul(
            (Fp8Rows.from_float if w8a8 and not fused else lambda h: h)(
                grouped_swiglu(x, a, b, be, limit=LIMIT, cfg=cu, interpret=INTERPRET, fp8_out=fused)), c, be_d,
            cfg=cd, interpret=INTERPRET))
        # the kernels compute in f16 with quantised weights: f16 rows in (the dispatch's gather
        # would write them so) keep a conversion pass out of the timed call, and h stays f16;
        # W8A8 takes the rows quantised (as the gather would write them)
        out[config_name("megajax" + QUANTIZED[weights][0], cu, cd)] = (
            "jax", fn, (Fp8Rows.from_float(x_al) if w8a8 else x_al.astype(jnp.float16), q1, q3, q2, be_up, be_down),
            lambda y, dest=dest: y[dest].astype(jnp.float32))
    return out


def measure(key, case, variants, ref, rows, roof, dispatch=True):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:  # compile this case's JAX variants side by side
        futures = {name: pool.submit(lambda f, a: f.lower(*a).compile(), fn, args)
                   for name, (kind, fn, args, _) in variants.items() if kind == "jax"}
    print(f"{key}: compiled {len(futures)} variants in {time.perf_counter() - t0:.1f} s", flush=True)
    for name, (kind, fn, args, finish) in variants.items():
        row = {"case": case, "key": key, "impl": name}
        try:
            if kind == "jax":
                fn = futures[name].result()
            if finish is not None:
                row["rel_err"] = rel_err(np.asarray(finish(fn(*args)), np.float32), ref)
            row["ms"] = time_jax(fn, *args) if kind == "jax" else time_torch(fn)
            row["ratio_roofline"] = row["ms"] / roof[key]
        except Exception as e:  # one failing variant must not lose the run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc(limit=2)
        rows.append(row)
        print(f"{key:>16} {name:<44} {row.get('ms', float('nan')):8.3f} ms  "
              f"err {row.get('rel_err', float('nan')):.1e}  {row.get('error', '')[:80]}", flush=True)
    if dispatch:
        one_dispatch(key, variants, rows)


def varied(rows, factor):
    """Distinct inputs of the same kind: the rows (or W8A8's row scales) times ``factor``."""
    return rows._replace(scale=rows.scale * factor) if isinstance(rows, Fp8Rows) else rows * factor


def one_dispatch(key, variants, rows):
    """The case's best megajax config and the JAX peers again, three calls (distinct rows, the
    same weights) per jitted dispatch: ``ms`` dispatches every call from the host, which can
    time the host rather than the GPU when a call is this short. With ``--trace`` each also
    records its kernels' GPU times (``kernels_us``), which no host or launch gap enters."""
    done = [r for r in rows if r["key"] == key and "ms" in r and not r["impl"].startswith("stage:")]
    ours = [r for r in done if r["impl"].startswith("megajax") and r.get("rel_err", 1) < 2e-2]
    picked = [min(ours, key=lambda r: r["ms"])] if ours else []
    picked += [r for r in done if not r["impl"].startswith("megajax") and variants[r["impl"]][0] == "jax"]
    for row in picked:
        _, fn, args, _ = variants[row["impl"]]
        try:
            sets = [(varied(args[0], 1 + i / 64), *args[1:]) for i in range(3)]
            row["ms_one_dispatch"] = time_jax_one_dispatch(fn, sets)
            if TRACE:
                row["kernels_us"] = gpu_kernels(fn, *args)
                many = batched(fn)
                row["timeline"] = {  # nine calls: host-dispatched one by one, or three per dispatch
                    "each": gpu_timeline(lambda: jax.block_until_ready([fn(*sets[i % 3]) for i in range(9)]), 9),
                    "one_dispatch": gpu_timeline(lambda: jax.block_until_ready([many(sets) for _ in range(3)]), 9)}
        except Exception as e:
            row["one_dispatch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        kernels = " + ".join(f"{us:.1f}" for _, us in row.get("kernels_us", []))
        spans = "; ".join(f"GPU {k}: span {v.get('gpu_span_ms', 0):.3f} busy {v.get('gpu_busy_ms', 0):.3f}"
                          for k, v in row.get("timeline", {}).items())
        print(f"{key:>16} {row['impl']:<44} {row.get('ms_one_dispatch', float('nan')):8.3f} ms, one dispatch"
              + (f"; kernels {kernels} us; {spans}" if kernels else ""), flush=True)


def summarize(rows, roof):
    """Best megajax config and best peer per case, with ratios."""
    summary = {}
    for key in roof:
        ok = [r for r in rows if r["key"] == key and "ms" in r and r.get("rel_err", 1) < 2e-2]
        ours = [r for r in ok if r["impl"].startswith("megajax")]
        peers = [r for r in ok if not r["impl"].startswith("megajax")]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["ms"])
        entry = {"megajax_ms": best["ms"], "megajax_impl": best["impl"], "roofline_ms": roof[key],
                 "ratio_roofline": best["ms"] / roof[key]}
        if peers:
            bp = min(peers, key=lambda r: r["ms"])
            entry.update(best_peer=bp["impl"], best_peer_ms=bp["ms"], ratio_best_peer=best["ms"] / bp["ms"])
        summary[key] = entry
    return summary


def plot(payload, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, routing in zip(axes, ("balanced", "skewed")):
        keys = [k for k in payload["roofline_ms"] if k.endswith(routing)]  # bf16 cases
        ts = [int(k[1:].split("_")[0]) for k in keys]
        ax.plot(ts, [payload["roofline_ms"][k] for k in keys], "k--", label="roofline")
        families = sorted({r["impl"].split("[")[0] for r in payload["rows"] if "rel_err" in r})
        for fam in families:
            best = []
            for k in keys:
                ms = [r["ms"] for r in payload["rows"] if r["key"] == k and "ms" in r
                      and r["impl"].split("[")[0] == fam and r.get("rel_err", 1) < 2e-2]
                best.append(min(ms) if ms else np.nan)
            ax.plot(ts, best, "o-", label=fam, lw=2.5 if fam == "megajax" else 1)
        ax.set(xscale="log", yscale="log", xlabel="tokens per expert", title=f"MoE expert stage, {routing}")
        ax.grid(True, which="both", alpha=.3)
    axes[0].set_ylabel("ms (lower is better)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{payload['device']} · commit {payload['commit']} · 6 experts, 5120→2304→5120 bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,256,1024,4096")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--skewed", default="16,256,4096", help="token counts also run with skewed routing")
    ap.add_argument("--weights", default="bf16,fp8,mxfp4,w8a8",
                    help="any of bf16, fp8, mxfp4, w8a8 (quantised rows up to 256 tokens)")
    ap.add_argument("--plot", help="write a PNG from the run (or from --from-json)")
    ap.add_argument("--from-json", help="only plot an earlier run's JSON")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted, on CPU")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP block configs")
    ap.add_argument("--large-only", action="store_true", help="time only the compute-bound sizes' configs "
                    "(LARGE_CONFIGS, from 128 rows per expert) beside the peers")
    ap.add_argument("--trace", action="store_true", help="also record the GPU time of each kernel of the "
                    "best megajax config and the JAX peers (profiler trace)")
    ap.add_argument("--shared", default="", help="token counts also run with the shared expert (its t rows as "
                    "a 7th group): fused into the routed launches, and every impl on 7 stacked experts")
    args = ap.parse_args()
    global E, D, I, INTERPRET, CONFIGS, SWAP_CONFIGS, FP8_SWAP_CONFIGS, MXFP4_CONFIGS, W8A8_CONFIGS, TRACE
    TRACE = args.trace
    if args.sweep:
        CONFIGS = CONFIGS + SWEEP
    if args.large_only:
        CONFIGS, SWAP_CONFIGS = [], []
    if args.smoke:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        E, D, I, INTERPRET = 3, 256, 128, InterpretGPUParams()
        CONFIGS, SWAP_CONFIGS, FP8_SWAP_CONFIGS = CONFIGS[:1], SWAP_CONFIGS[:1], FP8_SWAP_CONFIGS[:1]
        MXFP4_CONFIGS, W8A8_CONFIGS = MXFP4_CONFIGS[:1], W8A8_CONFIGS[:1]
    if args.from_json:
        import json
        plot(json.load(open(args.from_json)), args.plot)
        return
    info = run_info()
    ceil = ceilings(args.smoke)
    print("ceilings", ceil, flush=True)
    rows, roof = [], {}
    cases = [(t, r) for r in args.routing.split(",") for t in map(int, args.tokens.split(","))]
    cases += [(int(t), "skewed") for t in args.skewed.split(",") if args.skewed]
    shared_cases = [int(t) for t in args.shared.split(",") if t]
    # the quantised-weight cases last: a kernel fault spoils the process, not the rows before it
    weights = args.weights.split(",")
    if not set(weights) <= {"bf16", *QUANTIZED}:
        ap.error(f"--weights takes bf16, fp8, mxfp4 and w8a8, got {args.weights}")
    runs = [("bf16", True, (t, "balanced")) for t in shared_cases]
    runs += [(w, False, c) for w in ("bf16", *QUANTIZED) if w in weights for c in cases]
    for w, shared, (t, routing) in runs:
        run_case(t, routing, ceil, rows, roof, w, shared)
        payload = {**info, "benchmark": "moe_gpu", "ceilings": ceil, "rows": rows,
                   "roofline_ms": roof, "summary": summarize(rows, roof)}
        path = write("moe_gpu", payload)  # after every case: a killed run keeps what it measured
    if args.plot:
        plot(payload, args.plot)
    print(f"\nwrote {path}\n{'case':>16} {'megajax':>9} {'roofline':>9} {'x roof':>7} {'best peer':>28} {'x peer':>7}")
    for key, s in payload["summary"].items():
        print(f"{key:>16} {s['megajax_ms']:9.3f} {s['roofline_ms']:9.3f} {s['ratio_roofline']:7.2f} "
              f"{s.get('best_peer', '-'):>28} {s.get('ratio_best_peer', float('nan')):7.2f}")


if __name__ == "__main__":
    main()
