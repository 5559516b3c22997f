"""Which implementation each mega operator takes in a model's steps, in words, for the start-up log.

The operators choose when they are traced (``mega.backend``); this asks the same functions
they ask (``mega.attention.kernel_path``, ``mega.indexer.kernel_path``, ``mega.mhc.kernel_path``,
``mega.moe.plan``) with the model's own operands, so the report cannot differ from what runs.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from mega import attention, indexer, mhc, moe
from model import quant
from model.attention import candidate_width
from model.config import ModelConfig
from model.forward import moe_spec
from model.state import comp_pool, index_pool, state_dtype, window_ring
from pallas_kernels.block_scaled import stored_kind


def kernel_paths(params: dict, cfg: ModelConfig, step_tokens: Sequence[int], slot_tokens: int,
                 quantized_kv: bool = False) -> dict[str, str]:
    """``{operator: path}`` for steps of each of ``step_tokens`` tokens (the engine's buckets),
    with ``slot_tokens`` tokens of cache a request and the KV state stored as ``quantized_kv`` says
    (``model.state.init_state``)."""
    dtype = state_dtype(params)
    pools = [stored_kind(window_ring(cfg, 1, 1, dtype, quantized_kv)),
             stored_kind(comp_pool(cfg, 1, dtype, quantized_kv))][:1 + bool(cfg.kv_source_layer_ids)]
    out = {"mega.attention": attention.kernel_path(dtype, cfg.num_attention_heads, cfg.head_dim, pools).text}
    exact = quant.fp4_block32_active(cfg.index_head_dim)
    keys = stored_kind(index_pool(cfg, 1, dtype))
    layers: dict[str, list[int]] = {}
    for i in cfg.index_source_layer_ids:   # past the candidate source a row scores its candidates' entries
        n = slot_tokens // cfg.compress_ratios[i]
        src = cfg.candidate_source_layer_id
        width = candidate_width(cfg, n) if src is not None and i > src else n
        layers.setdefault(indexer.kernel_path(cfg.index_n_heads, cfg.index_head_dim, width, keys, exact).text,
                          []).append(i)
    if layers:
        out["mega.indexer"] = _summary(layers, lambda ls: f"layers {ls}")
    spec = moe_spec(cfg)
    out["mega.moe"] = _by_size(step_tokens, lambda t: moe.plan(dtype, params["layers"][0]["moe"], spec,
                                                               t * spec.top_k).path.text)
    out["mega.mhc_step"] = mhc.kernel_path(dtype, cfg.hidden_size, cfg.hc_mix_dim).text
    if cfg.engram_layer_ids:
        table = params["layers"][cfg.engram_layer_ids[0]]["engram"]["table"].dtype
        out["mega.engram"] = f"XLA ({jnp.dtype(table).name} table)"
    out["linears"] = f"XLA dots on {jnp.dtype(dtype).name} weights"
    return out


def _by_size(step_tokens: Sequence[int], path) -> str:
    """``path(tokens)`` of each step size, summarised over the sizes that share one."""
    sizes: dict[str, list[int]] = {}
    for t in sorted(step_tokens):
        sizes.setdefault(path(t), []).append(t)
    return _summary(sizes, lambda ts: f"{ts[0]}-{ts[-1]} tokens")


def _summary(by_path: dict[str, list[int]], where) -> str:
    """The one path, or each path with ``where`` of the layers or sizes that take it."""
    if len(by_path) == 1:
        return next(iter(by_path))
    return "; ".join(f"{path} at {where(values)}" for path, values in by_path.items())
