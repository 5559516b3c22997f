"""MegaMoE: routing, dispatch, expert GEMMs, clamped SwiGLU and combine, plus the shared expert.

Signature: ``moe(x [T, D], p, cfg) -> y [T, D]`` over a flat ragged batch of tokens. ``p``
holds the router (``gate [E, D]``, ``bias``, ``bias_vl``), the routed experts stacked as
``w1``/``w3 [E, I, D]`` and ``w2 [E, D, I]`` (HF ``[out, in]`` layout) and the ``shared``
expert. The reference path sorts the (token, expert) pairs by expert and runs the grouped
GEMMs with ``lax.ragged_dot``, which is the dispatch shape the Pallas kernel keeps.

Routing (§3.9): ``sqrt(softplus(W x / temp))`` in fp32, top-k on the biased scores, weights
from the unbiased scores normalised over the chosen k (``+1e-20``) and scaled. The routing
weight multiplies the activation before the down projection.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mega.primitives import HIGHEST, linear


@dataclass(frozen=True)
class MoeSpec:
    top_k: int
    routed_scale: float
    swiglu_limit: float
    gate_temp: float = 1.0
    norm_topk: bool = True


def route(x: jnp.ndarray, p: dict, spec: MoeSpec, image_mask: jnp.ndarray | None = None
          ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(weights [T, k] fp32, expert ids [T, k] int32)``."""
    scores = jnp.sqrt(jax.nn.softplus(linear(x.astype(jnp.float32), p["gate"].astype(jnp.float32))
                                      / spec.gate_temp))
    bias = p["bias"].astype(jnp.float32)[None]
    if image_mask is not None:
        bias = jnp.where(image_mask[:, None], p["bias_vl"].astype(jnp.float32)[None], bias)
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


def shared_expert(x: jnp.ndarray, p: dict, limit: float) -> jnp.ndarray:
    h = swiglu(linear(x, p["w1"]), linear(x, p["w3"]), limit)
    return linear(h.astype(x.dtype), p["w2"])


def moe(x: jnp.ndarray, p: dict, spec: MoeSpec, image_mask: jnp.ndarray | None = None) -> jnp.ndarray:
    t, d = x.shape
    n_experts = p["w1"].shape[0]
    weights, ids = route(x, p, spec, image_mask)
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token = order // spec.top_k
    group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
    xs = x[token]

    def grouped(lhs, w):  # w: [E, out, in]
        return jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2), group_sizes, precision=HIGHEST,
                                  preferred_element_type=jnp.float32)

    h = swiglu(grouped(xs, p["w1"]), grouped(xs, p["w3"]), spec.swiglu_limit)
    h = h * weights.reshape(-1)[order][:, None]
    out = grouped(h.astype(x.dtype), p["w2"])
    y = jnp.zeros((t, d), jnp.float32).at[token].add(out)
    if "shared" in p:
        y = y + shared_expert(x, p["shared"], spec.swiglu_limit)
    return y.astype(x.dtype)
