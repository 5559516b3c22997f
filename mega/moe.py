"""MegaMoE: routing, dispatch, expert GEMMs, clamped SwiGLU and combine, plus the shared expert.

Signature: ``moe(x [T, D], p, cfg) -> y [T, D]`` over a flat ragged batch of tokens. ``p``
holds the router (``gate [E, D]``, ``bias``, ``bias_vl``), the routed experts stacked as
``w1``/``w3 [E, I, D]`` and ``w2 [E, D, I]`` (HF ``[out, in]`` layout) and the ``shared``
expert. The reference path sorts the (token, expert) pairs by expert and runs the grouped
GEMMs with ``lax.ragged_dot``, which is the dispatch shape the Pallas kernel keeps.

Expert weights (routed and shared) are bf16 arrays, fp8 ``QuantizedWeight`` stacks (e4m3
with one power-of-two scale per 128 x 128 block) or MXFP4 ``Fp4Weight`` stacks (e2m1 with one
UE8M0 scale per 32: V4.1's expert format); ``quantize_experts`` makes either. The Pallas
kernels convert the tiles in registers, the reference dequantises them first.
``MoeSpec.fp8_activations`` (W8A8, SGLang's block-fp8 MoE) also quantises the rows going into
each expert GEMM to e4m3 with a power-of-two scale per 128 columns (``Fp8Rows``): the kernels
then run fp8 x fp8 wgmmas with fp8 weights, and the reference (any other weights) rounds the
rows the same way. XLA quantises the gathered rows before the first launch; ``h`` is
requantised in the gate/up kernel's epilogue up to 16 rows per expert, else by XLA between
the launches.

Routing (§3.9): ``sqrt(softplus(W x / temp))`` in fp32, top-k on the biased scores, weights
from the unbiased scores normalised over the chosen k (``+1e-20``) and scaled. The routing
weight multiplies the SwiGLU activation before the down projection (it matters once h is
rounded or requantised between the GEMMs), so the combine is a plain sum.

On GPU (``mega.backend``) the expert stage runs the Pallas grouped kernels of
``pallas_kernels.grouped_gemm`` over block-aligned rows (the routing weights applied in the
gate/up kernel's epilogue, the shared expert riding in the same two launches); routing, the
sort and the combine are XLA fusions around them (small next to the weight stream at decode
sizes, and one read of the rows at prefill sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mega import backend
from mega.primitives import HIGHEST, linear
from pallas_kernels.block_scaled import Fp4Weight, Fp8Rows, QuantizedWeight
from pallas_kernels.grouped_gemm import grouped_matmul, grouped_swiglu
from pallas_kernels.grouped_gemm_tiles import tiles

EXPERT_WEIGHTS = ("w1", "w3", "w2")
# block-scaled expert formats: their weight type, and the block sizes their dimensions need
# (fp8: 128 x 128 blocks on both; MXFP4: 32 along the input, the kernels' 64-row tiles)
FORMATS = {"fp8": (QuantizedWeight, 128, 128), "mxfp4": (Fp4Weight, 64, 64)}


@dataclass(frozen=True)
class MoeSpec:
    top_k: int
    routed_scale: float
    swiglu_limit: float
    gate_temp: float = 1.0
    norm_topk: bool = True
    fp8_activations: bool = False
    balanced: bool = False   # a benchmark mode: experts dealt round-robin, not routed (changes outputs)


def route(x: jnp.ndarray, p: dict, spec: MoeSpec, image_mask: jnp.ndarray | None = None
          ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(weights [T, k] fp32, expert ids [T, k] int32)``."""
    # fp32 sums of exact products: bf16 rows against a bf16 gate run on the tensor cores
    common = jnp.promote_types(x.dtype, p["gate"].dtype)
    scores = jnp.sqrt(jax.nn.softplus(linear(x.astype(common), p["gate"].astype(common)) / spec.gate_temp))
    bias = p["bias"].astype(jnp.float32)[None]
    if image_mask is not None:
        bias = jnp.where(image_mask[:, None], p["bias_vl"].astype(jnp.float32)[None], bias)
    if spec.balanced:   # token t takes experts (t*k .. t*k+k-1) mod E: expert counts differ by at most one
        pairs = jnp.arange(x.shape[0] * spec.top_k, dtype=jnp.int32).reshape(-1, spec.top_k)
        ids = pairs % scores.shape[-1]
    else:
        _, ids = jax.lax.top_k(scores + bias, spec.top_k)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if spec.norm_topk and spec.top_k > 1:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * spec.routed_scale, ids.astype(jnp.int32)


def swiglu(gate: jnp.ndarray, up: jnp.ndarray, limit: float) -> jnp.ndarray:
    """Clamped SwiGLU: the gate is clamped from above, the up projection on both sides."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def _dense(w, dtype) -> jnp.ndarray:
    """An expert weight as an array (quantised stacks dequantised) for the XLA paths."""
    return w.dequantized(dtype) if isinstance(w, (QuantizedWeight, Fp4Weight)) else w


def _format(ws) -> str | None:
    """The kernels' format for expert weights ``ws``: "mxfp4" (all MXFP4: its kernels take no
    other kind beside it), "fp8" (any fp8, the rest bf16), "bf16", or None (MXFP4 mixed with
    other kinds: only the reference runs that)."""
    if any(isinstance(w, Fp4Weight) for w in ws):
        return "mxfp4" if all(isinstance(w, Fp4Weight) for w in ws) else None
    return "fp8" if any(isinstance(w, QuantizedWeight) for w in ws) else "bf16"


def quantize_experts(p: dict, fmt: str = "fp8") -> dict:
    """An MoE parameter dict with its routed and shared expert weights quantised: ``fmt`` "fp8"
    (``QuantizedWeight``: e4m3, one power-of-two scale per 128 x 128 block) or "mxfp4"
    (``Fp4Weight``: e2m1, one power-of-two scale per 32); weights already in ``fmt`` are kept.
    ValueError if a dimension does not divide into the format's blocks, or a weight is quantised
    in another format."""
    kind, rows, cols = FORMATS[fmt]

    def quantized(w):
        if isinstance(w, kind):
            return w
        if isinstance(w, (QuantizedWeight, Fp4Weight)):
            have = next(k for k, f in FORMATS.items() if isinstance(w, f[0]))
            raise ValueError(f"these expert weights are {have} already (as the checkpoint stores them); "
                             f"they are not converted to {fmt}")
        if w.shape[-2] % rows or w.shape[-1] % cols:
            raise ValueError(f"{fmt} expert weights need dimensions divisible by {rows} x {cols}, "
                             f"got {tuple(w.shape)}")
        return kind.from_float(w)
    out = {**p, **{k: quantized(p[k]) for k in EXPERT_WEIGHTS}}
    if "shared" in p:
        out["shared"] = {k: quantized(p["shared"][k]) for k in EXPERT_WEIGHTS}
    return out


def _rounded(x: jnp.ndarray, fp8: bool) -> jnp.ndarray:
    """Rows as the expert GEMMs see them: with fp8 activations (W8A8), e4m3 with a power-of-two
    scale per 128 columns (exact in bf16), else as they are."""
    return Fp8Rows.rounded(x) if fp8 else x


def shared_expert(x: jnp.ndarray, p: dict, limit: float, fp8_rows: bool = False) -> jnp.ndarray:
    w1, w3, w2 = (_dense(p[k], x.dtype) for k in EXPERT_WEIGHTS)
    x = _rounded(x, fp8_rows)
    h = swiglu(linear(x, w1), linear(x, w3), limit)
    return linear(_rounded(h.astype(x.dtype), fp8_rows), w2)


def aligned_layout(group_sizes: jnp.ndarray, n: int, block_rows: int, n_experts: int):
    """Rows grouped by expert → block-aligned rows (each expert starts at a multiple of block_rows).

    Returns ``(dest [n], block_expert [m_pad // block_rows], m_pad)``: the aligned row of each
    grouped row, the expert of each row block (``-1`` past the end) and the static row
    count, bounded by the at most ``min(E, n)`` non-empty experts each wasting < block_rows rows.
    """
    m_pad = -(-(n + min(n_experts, n) * (block_rows - 1)) // block_rows) * block_rows
    padded = (group_sizes + block_rows - 1) // block_rows * block_rows
    start, end = jnp.cumsum(group_sizes) - group_sizes, jnp.cumsum(padded)
    expert = jnp.repeat(jnp.arange(n_experts), group_sizes, total_repeat_length=n)
    dest = (end - padded)[expert] + jnp.arange(n) - start[expert]
    block_start = jnp.arange(m_pad // block_rows) * block_rows
    # compare_all, not the default binary search: that is a while loop, which XLA's GPU runtime
    # runs from the host, launching the body's kernels one by one outside the step's CUDA
    # graphs, which it splits (one loop per MoE layer per step)
    block_expert = jnp.where(block_start < end[-1],
                             jnp.searchsorted(end, block_start, side="right", method="compare_all"), -1)
    return dest.astype(jnp.int32), block_expert.astype(jnp.int32), m_pad


class MoePlan(NamedTuple):
    """How ``moe`` runs: the kernels' format and block configs (None: the reference), whether the
    shared expert rides in the routed launches, and the choice in words."""

    fmt: str | None
    cfgs: tuple | None
    fuse_shared: bool
    path: backend.Path


def plan(dtype, p: dict, spec: MoeSpec, n_rows: int) -> MoePlan:
    """The plan for ``n_rows`` (token, expert) rows of activations of ``dtype`` through experts ``p``."""
    n_experts, inter, d = p["w1"].shape
    shared = p.get("shared")
    routed = [p[k] for k in EXPERT_WEIGHTS]
    every = routed + ([shared[k] for k in EXPERT_WEIGHTS] if shared is not None else [])
    both = _format(every)
    fmt = _format(routed) if both is None else both   # None: MXFP4 beside another kind
    why = backend.kernels_off()
    if why is None and jnp.dtype(dtype) != jnp.bfloat16:
        why = f"{jnp.dtype(dtype).name} activations; the kernels take bfloat16"
    if why is None and spec.fp8_activations:   # the W8A8 kernels take fp8 weights only, routed and shared
        fmt = "w8a8" if all(isinstance(w, QuantizedWeight) for w in every) else None
        why = None if fmt else "W8A8 needs fp8 expert weights, routed and shared"
    if why is None and fmt is None:
        why = "the routed experts mix MXFP4 with other formats"
    cfgs = None if why else tiles(n_rows, n_experts, d, inter, fmt)
    if why is None and cfgs is None:
        why = f"expert sizes {d} x {inter} do not divide into the {fmt} kernels' tiles"
    if why:
        return MoePlan(None, None, False, backend.Path.reference(why))
    fuse = (shared is not None and both is not None
            and shared["w1"].shape == (inter, d) and shared["w2"].shape == (d, inter))
    text = f"pallas {fmt}"
    if shared is not None:
        text += (", the shared expert fused" if fuse else
                 f", the shared expert ({_format([shared[k] for k in EXPERT_WEIGHTS])}) on XLA"
                 + (": the MXFP4 kernels take no other format beside it" if both is None else ": another size"))
    return MoePlan(fmt, cfgs, fuse, backend.Path(True, text))


def _experts_pallas(x, tokens, row_w, p, group_sizes, limit, cfgs, fuse_shared=False, fp8_rows=False):
    """Grouped SwiGLU experts through the Pallas kernels, for the rows ``x[tokens]`` grouped
    by expert (``tokens``: each grouped row's token).

    The aligned kernel input is gathered from ``x`` in one pass (each aligned row knows its
    token, padding rows none), so the dispatched rows are written once (W8A8: each token's
    fp8 rows, quantised before the gather). ``row_w`` scales each
    row's SwiGLU activation before the down projection (§3.9), in the gate/up kernel's
    epilogue: nothing runs between the two launches. With ``fuse_shared`` every token also
    runs the shared expert in the same two launches, as expert id E (weight 1): its weight
    tiles stream in the same wave as the routed ones (at decode sizes its CTAs take SMs the
    routed grid leaves idle).
    Returns the block-aligned output rows and the aligned row of each grouped row (routed
    rows, then shared rows), so the combine gathers each row only once. ``fp8_rows``: W8A8,
    the rows and ``h`` go in as ``Fp8Rows``; ``h`` quantised by the gate/up kernel's epilogue
    when its config can (``GemmConfig.quantizes_h``), else by XLA between the launches.
    """
    n_experts = p["w1"].shape[0]
    shared = None
    if fuse_shared:
        t = x.shape[0]
        tokens = jnp.concatenate([tokens, jnp.arange(t, dtype=tokens.dtype)])
        row_w = jnp.concatenate([row_w, jnp.ones(t, row_w.dtype)])
        group_sizes = jnp.concatenate([group_sizes, jnp.array([t], jnp.int32)])
        shared = p["shared"]
    up_cfg, down_cfg = cfgs
    dest, block_expert, m_pad = aligned_layout(group_sizes, tokens.shape[0], up_cfg.rows,
                                               n_experts + (shared is not None))
    src = jnp.full((m_pad,), -1, tokens.dtype).at[dest].set(tokens)   # aligned row → token
    valid, token = src >= 0, jnp.maximum(src, 0)
    if fp8_rows:   # quantised per token, then gathered: top-k (+ 1, shared fused) times fewer rows to quantise
        xq = Fp8Rows.from_float(x)
        x_al = Fp8Rows(jnp.where(valid[:, None], xq.q[token], 0), jnp.where(valid, xq.scale[:, token], 1.0))
    else:
        x_al = jnp.where(valid[:, None], x[token], 0).astype(x.dtype)
    w_al = jnp.zeros((m_pad,), jnp.float32).at[dest].set(row_w)
    interp = backend.interpret_params()
    fp8_out = fp8_rows and up_cfg.quantizes_h
    h = grouped_swiglu(x_al, p["w1"], p["w3"], block_expert, limit=limit, cfg=up_cfg, row_scale=w_al,
                       shared=None if shared is None else (shared["w1"], shared["w3"]),
                       interpret=interp, fp8_out=fp8_out)
    return grouped_matmul(Fp8Rows.from_float(h) if fp8_rows and not fp8_out else h, p["w2"], block_expert,
                          cfg=down_cfg, interpret=interp,
                          shared=None if shared is None else shared["w2"]), dest


def _experts_reference(xs, row_w, w1, w3, w2, group_sizes, limit, fp8_rows=False):
    def grouped(lhs, w):  # w: [E, out, in]
        return jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2), group_sizes, precision=HIGHEST,
                                  preferred_element_type=jnp.float32)
    xs = _rounded(xs, fp8_rows)
    h = swiglu(grouped(xs, w1), grouped(xs, w3), limit) * row_w[:, None]
    return grouped(_rounded(h.astype(xs.dtype), fp8_rows), w2)


@jax.named_scope("mega_moe")  # prefixes its ops' names in HLO dumps and XProf
def moe(x: jnp.ndarray, p: dict, spec: MoeSpec, image_mask: jnp.ndarray | None = None) -> jnp.ndarray:
    weights, ids = route(x, p, spec, image_mask)
    return routed_experts(x, weights, ids, p, spec, with_shared=True).astype(x.dtype)


def routed_experts(x: jnp.ndarray, weights: jnp.ndarray, ids: jnp.ndarray, p: dict, spec: MoeSpec,
                   with_shared: bool = False) -> jnp.ndarray:
    """fp32 ``[T, D]``: each token's rows through its experts ``ids [T, k]`` (indices into
    ``p``'s stacks), scaled by ``weights [T, k]`` and summed; ``with_shared``: plus the shared
    expert (fused into the kernels' launches where the plan allows)."""
    t, d = x.shape
    top_k = ids.shape[1]
    n_experts = p["w1"].shape[0]
    shared = p.get("shared") if with_shared else None
    order = jnp.argsort(ids.reshape(-1), stable=True)  # dispatch: (token, k) pairs by expert
    group_sizes = jnp.bincount(ids.reshape(-1), length=n_experts).astype(jnp.int32)
    tokens, row_w = order // top_k, weights.reshape(-1)[order]
    n = tokens.shape[0]
    how = plan(x.dtype, p, spec, n)
    cfgs, fuse_shared = how.cfgs, how.fuse_shared and shared is not None
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=order.dtype))  # pair → sorted row
    if cfgs is not None:
        out, dest = _experts_pallas(x, tokens, row_w, p, group_sizes, spec.swiglu_limit, cfgs, fuse_shared,
                                    spec.fp8_activations)
        pair_rows = dest[inv]
    else:
        out = _experts_reference(x[tokens], row_w, *(_dense(p[k], x.dtype) for k in EXPERT_WEIGHTS), group_sizes,
                                 spec.swiglu_limit, spec.fp8_activations)
        pair_rows = inv
    # combine: each token gathers and sums its k (already weighted) expert rows
    y = out[pair_rows].reshape(t, top_k, d).astype(jnp.float32).sum(1)
    if fuse_shared:
        y = y + out[dest[n:]].astype(jnp.float32)
    elif shared is not None:
        y = y + shared_expert(x, shared, spec.swiglu_limit, spec.fp8_activations)
    return y
