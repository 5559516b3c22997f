"""Mega-mHC: one step of the manifold-constrained hyper-connections (MODEL_SPEC §3.3, §9).

A step does what DeepGEMM's ``mega_mhc`` fuses on SM100: apply the pending update of the
previous sublayer (``H' = post * y + C^T H``), compute this site's mix coefficients from
the flattened stream (unweighted RMS, one ``[24, 4D]`` projection, sigmoid / 2-sigmoid /
softmax, Sinkhorn), collapse ``H'`` with the *previous* site's ``pre`` (the shifted
pre-mix), and RMS-normalise the result into the next sublayer's input.

``update`` is None for the very first site; ``site`` is None for the final collapse
before the LM head (no new coefficients). All mixing runs in fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mega import backend
from mega.primitives import HIGHEST, linear, rms_norm


class HcMix(NamedTuple):
    pre: jnp.ndarray  # [T, hc]
    post: jnp.ndarray  # [T, hc]
    comb: jnp.ndarray  # [T, hc, hc]; rows j (source stream), columns k (target stream)


class Update(NamedTuple):
    """A sublayer output waiting to be placed into the streams."""

    y: jnp.ndarray  # [T, D]
    post: jnp.ndarray
    comb: jnp.ndarray


def hc_mix(residual: jnp.ndarray, site: dict, *, eps: float, hc_eps: float, iters: int) -> HcMix:
    """Mix coefficients of one site from the streams ``[T, hc, D]``."""
    t, hc, d = residual.shape
    flat = rms_norm(residual.reshape(t, hc * d).astype(jnp.float32), None, eps)
    m = linear(flat, site["fn"].astype(jnp.float32))
    base, scale = site["base"].astype(jnp.float32), site["scale"].astype(jnp.float32)
    pre = jax.nn.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(t, hc, hc)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)

    def sinkhorn(_, c):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        return c / (c.sum(-2, keepdims=True) + hc_eps)
    if backend.on_gpu():   # unrolled: no loops in the GPU's programs (``backend.on_gpu``)
        for i in range(iters - 1):
            comb = sinkhorn(i, comb)
    else:   # a loop: unrolled, the iterations were a third of a small model's CPU compile time
        comb = jax.lax.fori_loop(0, iters - 1, sinkhorn, comb)
    return HcMix(pre, post, comb)


def hc_expand(residual: jnp.ndarray, update: Update | None) -> jnp.ndarray:
    """``H'_k = post_k * y + sum_j C[j, k] * H_j`` (identity when there is no update)."""
    if update is None:
        return residual
    mixed = jnp.einsum("tjk,tjd->tkd", update.comb, residual.astype(jnp.float32),
                       precision=HIGHEST)
    out = update.post[..., None] * update.y.astype(jnp.float32)[:, None, :] + mixed
    return out.astype(residual.dtype)


def collapse(residual: jnp.ndarray, pre: jnp.ndarray) -> jnp.ndarray:
    return jnp.einsum("tk,tkd->td", pre, residual.astype(jnp.float32),
                      precision=HIGHEST).astype(residual.dtype)


@jax.named_scope("mega_mhc")  # prefixes its ops' names in HLO dumps and XProf
def mhc_step(residual: jnp.ndarray, update: Update | None, site: dict | None, prev_pre: jnp.ndarray,
             norm_weight: jnp.ndarray, *, eps: float, hc_eps: float, iters: int
             ) -> tuple[jnp.ndarray, jnp.ndarray, HcMix | None]:
    """Returns ``(H', x, mix)``: the updated streams, the next sublayer's normalised input
    (collapsed with ``prev_pre``) and this site's coefficients (None when ``site`` is None)."""
    residual = hc_expand(residual, update)
    mix = None if site is None else hc_mix(residual, site, eps=eps, hc_eps=hc_eps, iters=iters)
    x = rms_norm(collapse(residual, prev_pre), norm_weight, eps)
    return residual, x, mix
