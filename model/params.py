"""The parameter pytree of V4.1 and its mapping to the reference's tensor names.

``param_specs(cfg)`` is the single description of every parameter: its path in the
pytree, its shape, its dtype and the HF tensor name(s) it comes from (routed experts
are stacked from one tensor per expert). Random initialisation, safetensors loading and
shape checks all read it, so they cannot drift apart.

Pytree layout (weights keep HF's ``[out, in]`` layout)::

    {"embed": [V, D], "norm": [D], "lm_head": [V, D],
     "layers": [{"attn_norm", "ffn_norm",
                 "hc_attn": {"fn", "base", "scale"}, "hc_ffn": {...},
                 "attn": {"wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "sink",
                          "compressor": {"wkv", "wgate"?, "norm"}?,          # KV sources
                          "indexer": {"wq_b", "weights_proj", "wk"?, "k_norm"?}?},  # index sources
                 "moe": {"gate", "bias", "bias_vl", "w1", "w3", "w2", "shared": {"w1", "w3", "w2"}?},
                 "engram": {"table", "scale", "wkv", "q_weight", "k_weight"}?}, ...]}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from mega.moe import quantize_experts
from model.config import ModelConfig

# Tensors the reference keeps in fp32 whatever the model dtype (mHC, sinks, router biases).
FP32_LEAVES = {"fn", "base", "scale", "sink", "bias", "bias_vl"}


@dataclass(frozen=True)
class ParamSpec:
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    hf_names: tuple[str, ...]  # one name, or one per routed expert (stacked on axis 0)
    init: str  # "linear", "embed", "norm", "hc_fn", "hc_base", "hc_scale", "normal", "bias", "ones", "gain"

    @property
    def stacked(self) -> bool:
        return len(self.hf_names) > 1

    def dtype(self, param_dtype: Any) -> Any:
        return jnp.float32 if self.path[-1] in FP32_LEAVES else param_dtype


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [
        ParamSpec(("embed",), (v, d), ("model.embed.weight",), "embed"),
        ParamSpec(("norm",), (d,), ("model.norm.weight",), "norm"),
        ParamSpec(("lm_head",), (v, d), ("lm_head.weight",), "head"),
    ]
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, i)
    return specs


def _layer_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    pre = f"model.layers.{i}."
    out: list[ParamSpec] = []

    def add(path, shape, name, init):
        out.append(ParamSpec(("layers", i) + path, shape, (pre + name,) if isinstance(name, str) else name, init))

    add(("attn_norm",), (d,), "attn_norm.weight", "norm")
    add(("ffn_norm",), (d,), "ffn_norm.weight", "norm")
    for site in ("attn", "ffn"):
        add((f"hc_{site}", "fn"), (cfg.hc_mix_dim, cfg.hc_mult * d), f"hc_{site}_fn", "hc_fn")
        add((f"hc_{site}", "base"), (cfg.hc_mix_dim,), f"hc_{site}_base", "hc_base")
        add((f"hc_{site}", "scale"), (3,), f"hc_{site}_scale", "hc_scale")
    a = ("attn",)
    add(a + ("wq_a",), (cfg.q_lora_rank, d), "attn.wq_a.weight", "linear")
    add(a + ("q_norm",), (cfg.q_lora_rank,), "attn.q_norm.weight", "norm")
    add(a + ("wq_b",), (h * hd, cfg.q_lora_rank), "attn.wq_b.weight", "linear")
    add(a + ("wkv",), (hd, d), "attn.wkv.weight", "linear")
    add(a + ("kv_norm",), (hd,), "attn.kv_norm.weight", "norm")
    add(a + ("wo_a",), (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), "attn.wo_a.weight", "linear")
    add(a + ("wo_b",), (d, cfg.o_groups * cfg.o_lora_rank), "attn.wo_b.weight", "linear")
    add(a + ("sink",), (h,), "attn.attn_sink", "normal")
    if i in cfg.kv_source_layer_ids:
        c = a + ("compressor",)
        add(c + ("wkv",), (hd, d), "attn.compressor.wkv.weight", "linear")
        if cfg.compress_ratios[i] > 1:
            add(c + ("wgate",), (hd, d), "attn.compressor.wgate.weight", "linear")
        add(c + ("norm",), (hd,), "attn.compressor.norm.weight", "norm")
    if i in cfg.index_source_layer_ids:
        x = a + ("indexer",)
        ih = cfg.index_n_heads * cfg.index_head_dim
        add(x + ("wq_b",), (ih, cfg.q_lora_rank), "attn.indexer.wq_b.weight", "linear")
        add(x + ("weights_proj",), (cfg.index_n_heads, d), "attn.indexer.weights_proj.weight", "linear")
        if i in cfg.kv_source_layer_ids:
            add(x + ("wk",), (cfg.index_head_dim, hd), "attn.indexer.wk.weight", "linear")
            add(x + ("k_norm",), (cfg.index_head_dim,), "attn.indexer.k_norm.weight", "norm")
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    m = ("moe",)
    add(m + ("gate",), (e, d), "ffn.gate.weight", "linear")
    add(m + ("bias",), (e,), "ffn.gate.bias", "bias")
    add(m + ("bias_vl",), (e,), "ffn.gate.bias_vl", "bias")
    for w, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        add(m + (w,), (e,) + shape, tuple(f"{pre}ffn.experts.{k}.{w}.weight" for k in range(e)), "linear")
        if cfg.n_shared_experts:
            add(m + ("shared", w), shape, f"ffn.shared_experts.{w}.weight", "linear")
    if i in cfg.engram_layer_ids:
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]
        g = ("engram",)
        add(g + ("table",), (rows, cfg.engram_head_dim), "engram.embed.weight", "embed")
        add(g + ("scale",), (rows, max(1, cfg.engram_head_dim // 32)), "engram.embed.scale", "ones")
        add(g + ("wkv",), (d * (cfg.hc_mult + 1), cfg.engram_n_cols * cfg.engram_head_dim),
            "engram.wkv.weight", "linear")
        add(g + ("q_weight",), (cfg.hc_mult, d), "engram.q_weight", "gain")
        add(g + ("k_weight",), (cfg.hc_mult, d), "engram.k_weight", "gain")
    return out


def build_tree(cfg: ModelConfig, leaves: dict[tuple, Any]) -> dict:
    """Nest ``{path: leaf}`` into the pytree layout above."""
    tree: dict = {"layers": [dict() for _ in range(cfg.num_hidden_layers)]}
    for path, leaf in leaves.items():
        node: Any = tree
        for key in path[:-1]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


def abstract_params(cfg: ModelConfig, param_dtype: Any = jnp.float32) -> dict:
    """The pytree of ``jax.ShapeDtypeStruct`` the model expects."""
    return build_tree(cfg, {s.path: jax.ShapeDtypeStruct(s.shape, s.dtype(param_dtype)) for s in param_specs(cfg)})


def with_quantized_experts(params: dict, fmt: str) -> dict:
    """``params`` with every MoE block's routed and shared expert weights quantised
    (``mega.moe.quantize_experts``): ``fmt`` "fp8" (e4m3, one power-of-two scale per 128 x 128
    block) or "mxfp4" (e2m1, one power-of-two scale per 32)."""
    def walk(node):
        if isinstance(node, dict):
            return {k: quantize_experts(v, fmt) if k == "moe" else walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node
    return walk(params)
