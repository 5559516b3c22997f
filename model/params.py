"""The parameter pytree of V4.1 and its mapping to the checkpoint's tensor names.

``param_specs(cfg)`` is the single description of every parameter: its path in the
pytree, its shape, its dtype, the checkpoint tensor name(s) it comes from (routed experts
are stacked from one tensor per expert) and its role, which says how a checkpoint may store
it (``checkpoints.formats``). Random initialisation, safetensors loading and writing, and
shape checks all read it, so they cannot drift apart. Names are the release's (``embed.weight``,
``layers.3.attn.wq_a.weight``, ``mtp.0.main_proj.weight``); ``transformers_name`` gives the
names ``transformers``' ``save_pretrained`` writes (``model.`` prefixed, ``lm_head``).

Pytree layout (weights keep HF's ``[out, in]`` layout)::

    {"embed": [V, D], "norm": [D], "lm_head": [V, D],
     "layers": [{"attn_norm", "ffn_norm",
                 "hc_attn": {"fn", "base", "scale"}, "hc_ffn": {...},
                 "attn": {"wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "sink",
                          "compressor": {"wkv", "wgate"?, "norm"}?,          # KV sources
                          "indexer": {"wq_b", "weights_proj", "wk"?, "k_norm"?}?},  # index sources
                 "moe": {"gate", "bias", "bias_vl", "w1", "w3", "w2", "shared": {"w1", "w3", "w2"}?},
                 "engram": {"table", "scale", "wkv", "q_weight", "k_weight"}?}, ...],
     "mtp": {"layers": [...], "main_proj", "main_norm", "norm",      # DSpark draft (``draft=True``)
             "markov_embed", "markov_head", "confidence"}?}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

from mega.moe import quantize_experts
from model.config import ModelConfig

# Tensors the reference keeps in fp32 whatever the model dtype (mHC, sinks, router biases).
FP32_LEAVES = {"fn", "base", "scale", "sink", "bias", "bias_vl"}

# How a checkpoint may store a parameter besides as a float tensor (checkpoints.formats):
# "linear": block-scaled fp8; "expert": a routed expert, MXFP4 or block-scaled fp8; "shared": the
# shared expert, block-scaled fp8; "table": an Engram table, e4m3 rows (its scales are the
# "table_scale" parameter); "plain": floats only.
Role = Literal["plain", "linear", "expert", "shared", "table", "table_scale"]


@dataclass(frozen=True)
class ParamSpec:
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    names: tuple[str, ...]  # one name, or one per routed expert (stacked on axis 0)
    init: str  # "linear", "embed", "norm", "hc_fn", "hc_base", "hc_scale", "normal", "bias", "ones", "gain"
    role: Role = "plain"

    @property
    def stacked(self) -> bool:
        return len(self.names) > 1

    def dtype(self, param_dtype: Any) -> Any:
        return jnp.float32 if self.path[-1] in FP32_LEAVES else param_dtype


def transformers_name(name: str) -> str:
    """A release tensor name as ``transformers`` writes it (``model.`` prefix, ``lm_head``)."""
    return "lm_head.weight" if name == "head.weight" else "model." + name


def param_specs(cfg: ModelConfig, draft: bool = False) -> list[ParamSpec]:
    """Every parameter of the backbone, and with ``draft`` the DSpark draft layers' (``mtp.*``)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [
        ParamSpec(("embed",), (v, d), ("embed.weight",), "embed"),
        ParamSpec(("norm",), (d,), ("norm.weight",), "norm"),
        ParamSpec(("lm_head",), (v, d), ("head.weight",), "head"),
    ]
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, i, ("layers", i), f"layers.{i}.", cfg.n_routed_experts)
    if draft and cfg.num_nextn_predict_layers:
        specs += _draft_specs(cfg)
    return specs


def _draft_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """The DSpark stack (MODEL_SPEC §7): sliding-window layers under ``mtp.k.``, the context
    projection on the first, the final norm and the Markov and confidence heads on the last."""
    d, v, r, n = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.num_nextn_predict_layers
    first, last = "mtp.0.", f"mtp.{n - 1}."
    out = []
    for k in range(n):
        out += _layer_specs(cfg, cfg.num_hidden_layers + k, ("mtp", "layers", k), f"mtp.{k}.",
                            cfg.dspark_n_routed_experts)
    m = ("mtp",)
    out += [
        ParamSpec(m + ("main_proj",), (d, len(cfg.dspark_target_layer_ids) * d), (first + "main_proj.weight",),
                  "linear", "linear"),
        ParamSpec(m + ("main_norm",), (d,), (first + "main_norm.weight",), "norm"),
        ParamSpec(m + ("norm",), (d,), (last + "norm.weight",), "norm"),
        ParamSpec(m + ("markov_embed",), (v, r), (last + "markov_head.embed.weight",), "embed"),
        ParamSpec(m + ("markov_head",), (v, r), (last + "markov_head.head.weight",), "linear"),
        ParamSpec(m + ("confidence",), (1, d + r), (last + "confidence_head.proj.weight",), "linear"),
    ]
    return out


def _layer_specs(cfg: ModelConfig, i: int, root: tuple, pre: str, n_experts: int) -> list[ParamSpec]:
    """Layer ``i``'s parameters (a draft layer when ``i`` >= num_hidden_layers: ratio 0, no
    compressor, indexer or Engram), under pytree path ``root`` and tensor-name prefix ``pre``."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    out: list[ParamSpec] = []

    def add(path, shape, name, init, role="plain"):
        out.append(ParamSpec(root + path, shape, (pre + name,) if isinstance(name, str) else name, init, role))

    add(("attn_norm",), (d,), "attn_norm.weight", "norm")
    add(("ffn_norm",), (d,), "ffn_norm.weight", "norm")
    for site in ("attn", "ffn"):
        add((f"hc_{site}", "fn"), (cfg.hc_mix_dim, cfg.hc_mult * d), f"hc_{site}_fn", "hc_fn")
        add((f"hc_{site}", "base"), (cfg.hc_mix_dim,), f"hc_{site}_base", "hc_base")
        add((f"hc_{site}", "scale"), (3,), f"hc_{site}_scale", "hc_scale")
    a = ("attn",)
    add(a + ("wq_a",), (cfg.q_lora_rank, d), "attn.wq_a.weight", "linear", "linear")
    add(a + ("q_norm",), (cfg.q_lora_rank,), "attn.q_norm.weight", "norm")
    add(a + ("wq_b",), (h * hd, cfg.q_lora_rank), "attn.wq_b.weight", "linear", "linear")
    add(a + ("wkv",), (hd, d), "attn.wkv.weight", "linear", "linear")
    add(a + ("kv_norm",), (hd,), "attn.kv_norm.weight", "norm")
    add(a + ("wo_a",), (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), "attn.wo_a.weight", "linear",
        "linear")
    add(a + ("wo_b",), (d, cfg.o_groups * cfg.o_lora_rank), "attn.wo_b.weight", "linear", "linear")
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
        add(x + ("wq_b",), (ih, cfg.q_lora_rank), "attn.indexer.wq_b.weight", "linear", "linear")
        add(x + ("weights_proj",), (cfg.index_n_heads, d), "attn.indexer.weights_proj.weight", "linear")
        if i in cfg.kv_source_layer_ids:
            add(x + ("wk",), (cfg.index_head_dim, hd), "attn.indexer.wk.weight", "linear")
            add(x + ("k_norm",), (cfg.index_head_dim,), "attn.indexer.k_norm.weight", "norm")
    inter = cfg.moe_intermediate_size
    m = ("moe",)
    add(m + ("gate",), (n_experts, d), "ffn.gate.weight", "linear")
    add(m + ("bias",), (n_experts,), "ffn.gate.bias", "bias")
    add(m + ("bias_vl",), (n_experts,), "ffn.gate.bias_vl", "bias")
    for w, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        add(m + (w,), (n_experts,) + shape, tuple(f"{pre}ffn.experts.{k}.{w}.weight" for k in range(n_experts)),
            "linear", "expert")
        if cfg.n_shared_experts:
            add(m + ("shared", w), shape, f"ffn.shared_experts.{w}.weight", "linear", "shared")
    if i in cfg.engram_layer_ids:
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]
        g = ("engram",)
        add(g + ("table",), (rows, cfg.engram_head_dim), "engram.embed.weight", "embed", "table")
        add(g + ("scale",), (rows, max(1, cfg.engram_head_dim // 32)), "engram.embed.scale", "ones", "table_scale")
        add(g + ("wkv",), (d * (cfg.hc_mult + 1), cfg.engram_n_cols * cfg.engram_head_dim),
            "engram.wkv.weight", "linear", "linear")
        add(g + ("q_weight",), (cfg.hc_mult, d), "engram.q_weight", "gain")
        add(g + ("k_weight",), (cfg.hc_mult, d), "engram.k_weight", "gain")
    return out


def build_tree(cfg: ModelConfig, leaves: dict[tuple, Any]) -> dict:
    """Nest ``{path: leaf}`` into the pytree layout above (an int key indexes a list)."""
    tree: dict = {"layers": [dict() for _ in range(cfg.num_hidden_layers)]}
    for path, leaf in leaves.items():
        node: Any = tree
        for key, nxt in zip(path[:-1], path[1:]):
            if isinstance(key, int):
                node.extend({} for _ in range(key + 1 - len(node)))
                node = node[key]
            else:
                node = node.setdefault(key, [] if isinstance(nxt, int) else {})
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


def cast_params(params: dict, dtype: Any) -> dict:
    """``params`` in model dtype ``dtype``: float leaves cast, except the fp32 ones (FP32_LEAVES);
    quantised weights (fp8, MXFP4, Engram's e4m3 tables) kept as they are."""
    floats = (jnp.float32, jnp.bfloat16, jnp.float16)

    def walk(node, key=None):
        if isinstance(node, dict):
            return {k: walk(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if hasattr(node, "dtype") and node.dtype in floats and key not in FP32_LEAVES:
            return node.astype(dtype)
        return node
    return walk(params)
