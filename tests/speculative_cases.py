"""What the speculative-decoding tests share: the fixture model with a random draft, random
prompts, and a run of the engine with and without DSpark."""
from __future__ import annotations

import numpy as np

from checkpoints.init import init_params
from conftest import GOLDEN
from model.config import ModelConfig
from serve.engine import Engine, EngineConfig

DSPARK = dict(speculative_algorithm="DSPARK", speculative_num_draft_tokens=3)


def tiny_with_draft():
    cfg = ModelConfig.from_json(GOLDEN / "v41_tiny")
    return cfg, init_params(cfg, seed=5, draft=True)


def random_prompts(cfg, seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in lengths]


def run(model, prompt_ids, params, **kw):
    cfg, p = model
    base = dict(max_running=4, max_len=160, page_size=16, prefill_budget=40)
    engine = Engine(p, cfg, EngineConfig(**{**base, **kw}))
    return engine.generate(prompt_ids, params, decode_text=False), engine


def outputs(results):
    return [[c["output_ids"] for c in r["choices"]] if "choices" in r else r["output_ids"] for r in results]
