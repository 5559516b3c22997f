"""A bf16 model of kernel-sized attention served by the engine reaches the kernels.

Its KV rings and pools take the model's dtype, so every attention call of a prefill and a
decode step (window and compressed pools, bf16 or the stored FP8 window) is one the
MegaAttention kernel accepts, the index source scores through the indexer kernel, and the MoE
calls the grouped kernels (with fp8 or MXFP4 expert
weights under ``quantization="fp8"`` or ``"mxfp4"``, and fp8 rows as well under ``"w8a8"``). The kernels' numerics
are tested against their references in ``test_pallas_*``; here each kernel is stood in for by
its reference behind a recorder (interpreted, the attention kernel takes minutes per step at
64 heads, and engine steps full of interpreter callbacks are better kept out of the suite's
long-lived process).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import mega.attention
import mega.indexer
import mega.mhc
import mega.moe
from checkpoints.init import init_params
from pallas_kernels.block_scaled import Fp4Weight, Fp8Rows, QuantizedWeight
from pallas_kernels.grouped_gemm import grouped_matmul_reference, grouped_swiglu_reference
from pallas_kernels.indexer import index_scores_reference
from pallas_kernels.mhc import mhc_pass_reference
from pallas_kernels.sparse_attention import pool_kind
from model.config import ModelConfig
from serve.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def kernel_sized():
    cfg = ModelConfig.from_dict({
        "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 64,
        "head_dim": 256, "q_lora_rank": 64, "qk_rope_head_dim": 64, "sliding_window": 8,
        "compress_ratios": [0, 1], "kv_source_layer_ids": [1], "index_source_layer_ids": [1],
        "candidate_topk_blocks": 64, "candidate_block_size": 2, "index_n_heads": 16, "index_head_dim": 64,
        "index_topk": 16, "o_groups": 2, "o_lora_rank": 64, "moe_intermediate_size": 128,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "num_nextn_predict_layers": 1})
    return cfg, init_params(cfg, seed=0, dtype=jnp.bfloat16)


@pytest.mark.parametrize("kv_cache_dtype,quantization", [("auto", "none"), ("fp8_e4m3", "none"), ("auto", "fp8"),
                                                         ("auto", "mxfp4"), ("auto", "w8a8")])
def test_bf16_engine_calls_the_kernels(kernel_sized, kv_cache_dtype, quantization, monkeypatch):
    cfg, params = kernel_sized
    seen = {"attention": [], "moe": 0, "expert_weights": set(), "indexer": 0, "mhc": 0}

    def mhc_kernel(streams, update, pre, fn, *, eps, interpret=False):
        seen["mhc"] += 1
        return mhc_pass_reference(streams, update, pre, fn, eps=eps)

    def indexer_kernel(q, w, keys, rows, slot, visible, *, scale, interpret=False):
        seen["indexer"] += 1
        return index_scores_reference(q, w, keys, rows, slot, visible, scale=scale, exact_bf16=True, pass_bytes=1 << 30)

    def attention_kernel(q, pools, sink, scale, interpret=None):
        kinds = [pool_kind(p) for p in pools]
        seen["attention"].append((kinds, mega.attention.kernel_path(q.dtype, q.shape[1], q.shape[2], kinds).kernel))
        return mega.attention.sparse_mqa_reference(q, pools, sink, scale)

    def swiglu_kernel(x, w1, w3, block_expert, *, limit, cfg, shared=None, row_scale=None, interpret=None,
                      fp8_out=False):
        seen["moe"] += 1
        seen["expert_weights"] |= {"w8a8" if isinstance(x, Fp8Rows) else "fp8" if isinstance(w, QuantizedWeight)
                                   else "mxfp4" if isinstance(w, Fp4Weight) else "none" for w in (w1, w3, *(shared or ()))}
        h = grouped_swiglu_reference(rows(x), w1, w3, block_expert, limit=limit, rows=cfg.rows, shared=shared,
                                     row_scale=row_scale)
        return Fp8Rows.from_float(h) if fp8_out else h


    def matmul_kernel(h, w2, block_expert, *, cfg, shared=None, interpret=None):
        return grouped_matmul_reference(rows(h), w2, block_expert, rows=cfg.rows, shared=shared)

    def rows(x):
        return x.dequantized(jnp.bfloat16) if isinstance(x, Fp8Rows) else x

    monkeypatch.setenv("MEGAJAX_KERNELS", "pallas")   # the stand-ins below lower nothing for the GPU
    monkeypatch.setattr(mega.attention, "sparse_mqa", attention_kernel)
    monkeypatch.setattr(mega.moe, "grouped_swiglu", swiglu_kernel)
    monkeypatch.setattr(mega.moe, "grouped_matmul", matmul_kernel)
    monkeypatch.setattr(mega.indexer, "index_scores_kernel", indexer_kernel)
    monkeypatch.setattr(mega.mhc, "mhc_pass", mhc_kernel)
    engine = Engine(params, cfg, EngineConfig(max_running=2, max_len=64, page_size=16, prefill_budget=64,
                                              kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                                              dtype="bfloat16"))
    paths = engine.kernel_paths   # what the start-up log says is what runs
    assert paths["mega.attention"].startswith("pallas") and paths["mega.moe"].startswith("pallas")
    assert paths["mega.indexer"] == "pallas indexer (fp4 keys)" and paths["mega.mhc_step"] == "pallas mHC pass"
    stored = kv_cache_dtype == "fp8_e4m3"
    assert ("fp8 window, NVFP4 compressed pools" in paths["mega.attention"]) == stored
    assert paths["mega.moe"].split(",")[0] == "pallas " + ("bf16" if quantization == "none" else quantization)
    out = engine.generate([list(range(3, 16)), list(range(20, 42))],
                          {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": True},
                          decode_text=False)
    window, compressed = ("fp8", "nvfp4") if stored else ("bfloat16", "bfloat16")
    # both layers' attention and MoE, in every bucket traced (prefill chunks and decode)
    assert len(seen["attention"]) == seen["moe"] >= 4
    assert seen["indexer"] * 2 == seen["moe"]   # the one index source's scoring, in every bucket traced
    assert seen["mhc"] >= 5 * seen["indexer"]   # every site's pass: two a layer and the final collapse
    # --quantization fp8 / mxfp4 / w8a8: every routed and shared expert stack reaches the kernels so
    assert seen["expert_weights"] == {quantization}
    for kinds, fits in seen["attention"]:
        assert fits and kinds[0] == window and all(k == compressed for k in kinds[1:])
    assert any(len(kinds) == 2 for kinds, _ in seen["attention"])   # the KV source's compressed pool
    assert all(len(o["output_ids"]) == 2 and np.isfinite(o["token_logprobs"]).all() for o in out)
