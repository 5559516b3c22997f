"""The embedded models ``python -m serve`` runs without a checkpoint of the user's.

``deepseek-v4.1-small`` (``megajax/deepseek-v4.1-small``), the default: ``random-tiny``'s
architecture at width 64, trained here on Python's own sources with its DSpark draft
(``train/``), stored in the release's format in ``models/`` with its model card.

``random-tiny`` (``megajax/deepseek-v4.1-tiny-random``): every V4.1 mechanism (mHC, Engram,
ratio-2 and ratio-1 KV sources, indexer, candidate blocks, Reindex, MoE) at width 256 with the
real vocabulary, initialised deterministically, so that ``python -m serve`` answers in one
command without downloading weights. Its words are random: it exercises the machinery (tests,
benchmarks of programs), and the small model of ``train/`` derives its config from it.
"""
from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig

SMALL_NAME = "megajax/deepseek-v4.1-small"
SMALL_DIR = Path(__file__).resolve().parents[1] / "models" / "deepseek-v4.1-small"
RANDOM = "random-tiny"
RANDOM_NAME = "megajax/deepseek-v4.1-tiny-random"
SEED = 0


def random_config() -> ModelConfig:
    return ModelConfig.from_dict({
        "vocab_size": 129280, "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
        "head_dim": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1], "kv_source_layer_ids": [2, 4, 5],
        "index_source_layer_ids": [2, 4, 5, 7], "candidate_source_layer_id": 5, "candidate_topk_blocks": 64,
        "candidate_block_size": 2, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 64, "o_groups": 2,
        "o_lora_rank": 64, "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "swiglu_limit": 10.0, "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                               "original_max_position_embeddings": 65536},
        "engram_layer_ids": [1, 4], "engram_vocab_size": 50, "engram_num_embeddings": [240, 306],
        "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32, "dspark_noise_token_id": 128799,
    })


def served_engine(model: str | None, config, progress: bool = False):
    """``(Engine, served model name)`` for ``--model`` as ``python -m serve`` reads it: None (the
    default small model), ``random-tiny``, or a checkpoint directory."""
    from serve.engine import Engine

    if model == RANDOM:
        cfg = random_config()
        return Engine(random_params(cfg, draft=config.speculative_algorithm is not None), cfg, config), RANDOM_NAME
    if model is None:
        return Engine.from_model_dir(SMALL_DIR, config), SMALL_NAME
    return Engine.from_model_dir(model, config, progress=progress), Path(model).resolve().name


def random_params(cfg: ModelConfig, draft: bool = False):
    """``random-tiny``'s weights (``draft``: with the DSpark draft layers, for ``--speculative-algorithm``)."""
    from checkpoints.init import init_params

    return init_params(cfg, seed=SEED, draft=draft)
