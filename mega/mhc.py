"""Mega-mHC: one step of the manifold-constrained hyper-connections (MODEL_SPEC §3.3, §9).

A step does what DeepGEMM's ``mega_mhc`` fuses on SM100: apply the pending update of the
previous sublayer (``H' = post * y + C^T H``), compute this site's mix coefficients from
the flattened stream (unweighted RMS, one ``[24, 4D]`` projection, sigmoid / 2-sigmoid /
softmax, Sinkhorn), collapse ``H'`` with the *previous* site's ``pre`` (the shifted
pre-mix), and RMS-normalise the result into the next sublayer's input. The pass over the
streams (expansion, statistic, projection, collapse) is ``pallas_kernels.mhc``'s kernel on
GPU, one launch; the coefficients and the final norm, elementwise over ``[T, 24]`` and
``[T, D]``, are XLA's.

``update`` is None for the very first site; ``site`` is None for the final collapse
before the LM head (no new coefficients). All mixing runs in fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mega import backend
from mega.primitives import rms_norm
from pallas_kernels.mhc import expand_reference, fits, mhc_pass, mhc_pass_reference


class HcMix(NamedTuple):
    pre: jnp.ndarray  # [T, hc]
    post: jnp.ndarray  # [T, hc]
    comb: jnp.ndarray  # [T, hc, hc]; rows j (source stream), columns k (target stream)


class Update(NamedTuple):
    """A sublayer output waiting to be placed into the streams."""

    y: jnp.ndarray  # [T, D]
    post: jnp.ndarray
    comb: jnp.ndarray


def kernel_path(dtype, hidden: int, mix_rows: int) -> backend.Path:
    """Which implementation runs a step's pass over streams of ``dtype`` and width ``hidden``
    into a mix of ``mix_rows`` (0: the final collapse), ``pallas_kernels.mhc``'s kernel or XLA."""
    why = backend.kernels_off()
    if why is None and jnp.dtype(dtype) != jnp.bfloat16:
        why = f"{jnp.dtype(dtype).name} streams (the kernel takes bf16)"
    if why is None and not fits(hidden, mix_rows):
        why = f"hidden {hidden} or a mix of {mix_rows} rows does not tile"
    return backend.Path.reference(why) if why else backend.Path(True, "pallas mHC pass")


def _coefficients(m: jnp.ndarray, site: dict, *, hc: int, hc_eps: float, iters: int) -> HcMix:
    """A site's mix coefficients from its projection ``m [T, (2 + hc) hc]``: sigmoid pre, 2-sigmoid post,
    and the Sinkhorn-balanced softmax of the stream-to-stream mix."""
    t = m.shape[0]
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
    return expand_reference(residual, update)


@jax.named_scope("mega_mhc")  # prefixes its ops' names in HLO dumps and XProf
def mhc_step(residual: jnp.ndarray, update: Update | None, site: dict | None, prev_pre: jnp.ndarray,
             norm_weight: jnp.ndarray, *, eps: float, hc_eps: float, iters: int
             ) -> tuple[jnp.ndarray, jnp.ndarray, HcMix | None]:
    """Returns ``(H', x, mix)``: the updated streams, the next sublayer's normalised input
    (collapsed with ``prev_pre``) and this site's coefficients (None when ``site`` is None)."""
    fn = None if site is None else site["fn"].astype(jnp.float32)
    if kernel_path(residual.dtype, residual.shape[-1], 0 if fn is None else fn.shape[0]).kernel:
        residual, collapsed, m = mhc_pass(residual, update, prev_pre, fn, eps=eps, interpret=backend.interpreting())
    else:
        residual, collapsed, m = mhc_pass_reference(residual, update, prev_pre, fn, eps=eps)
    mix = None if site is None else _coefficients(m, site, hc=residual.shape[1], hc_eps=hc_eps, iters=iters)
    return residual, rms_norm(collapsed, norm_weight, eps), mix
