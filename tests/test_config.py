"""Config parsing, derivation and the errors for missing or inconsistent fields."""
from __future__ import annotations

import json

import pytest

from conftest import GOLDEN
from model.config import ConfigError, ModelConfig


def tiny_raw() -> dict:
    return json.loads((GOLDEN / "v41_tiny" / "config.json").read_text())


def flash_config() -> ModelConfig:
    """The released V4.1-Flash text config (MODEL_SPEC §1), with derived fields left to derive."""
    return ModelConfig.from_dict({
        "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
        "head_dim": 512, "q_lora_rank": 1280, "qk_rope_head_dim": 64, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20, "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_n_heads": 32, "index_head_dim": 128,
        "index_topk": 512, "o_groups": 8, "o_lora_rank": 1024, "moe_intermediate_size": 2304,
        "n_routed_experts": 384, "num_experts_per_tok": 6, "swiglu_limit": 10.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
    })


def test_fixture_config_round_trips():
    raw = tiny_raw()
    cfg = ModelConfig.from_dict(raw)
    assert cfg.compress_ratios == tuple(raw["compress_ratios"])
    assert cfg.layer_types == tuple(raw["layer_types"])
    assert cfg.rope_parameters == raw["rope_parameters"]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert [cfg.kv_source_of(i) for i in range(8)] == [None, None, 2, 2, 4, 5, 5, 5]
    assert [cfg.index_source_of(i) for i in range(8)] == [None, None, 2, 2, 4, 5, 5, 7]


def test_flash_derived_fields():
    cfg = flash_config()
    assert len(cfg.compress_ratios) == 43 and cfg.compress_ratios[40:] == (0, 0, 0)
    assert cfg.candidate_source_layer_id == 20 and cfg.last_kv_source == 20
    assert cfg.dspark_target_layer_ids == (37, 38, 39)
    assert cfg.rope_parameters["compress"]["attention_factor"] == 1.0
    assert cfg.layer_types[20] == "shared_compressed_attention" and cfg.layer_types[21] == "sliding_attention"


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.pop("hidden_size"), "hidden_size"),
    (lambda r: r.update(hidden_size="256"), "hidden_size"),
    (lambda r: r.update(compress_ratios="2,2"), "compress_ratios"),
    (lambda r: r.update(kv_source_layer_ids=[2, 4, 5], index_source_layer_ids=[2, 5, 7]), "kv_source_layer_ids"),
    (lambda r: r.update(kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 5], layer_types=None,
                        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1]), "compress_ratios"),
    (lambda r: r.update(compress_ratios=[0, 0, 2, 2, 2, 1, 1, 2]), "compress_ratios"),
    (lambda r: r.update(engram_num_embeddings=[240, 300]), "engram_num_embeddings"),
    (lambda r: r.update(candidate_source_layer_id=3), "candidate_source_layer_id"),
    (lambda r: r.update(o_groups=3), "o_groups"),
    (lambda r: r.update(layer_types=["sliding_attention"] * 8), "layer_types"),
    (lambda r: r.update(scoring_func="softmax"), "scoring_func"),
    (lambda r: r.update(expert_activations="int8"), "expert_activations"),
])
def test_bad_fields_are_named(edit, field):
    raw = tiny_raw()
    edit(raw)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        ModelConfig.from_dict(raw)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
