"""What is trained: the small V4.1's shape and each stage's schedule, decided here once.

The model is ``random-tiny``'s architecture (``serve.default_model``: every V4.1
mechanism) at width 64, with a 16-token window and a rank-16 Markov head. Its checkpoint in the
release's format is 44 MB, three quarters of it the bf16 embedding and LM head over the
129,280-token vocabulary: it is tracked in the repo, and the whole tree travels to the GPU
machine on each call (64 MiB at most), which is what sets the width.
"""
from __future__ import annotations

from model.config import ModelConfig
from serve.default_model import random_config
from train.loop import Schedule

SEQ_LEN = 512
BATCH = 16
TARGET = Schedule(steps=6000, lr=3e-3, warmup=200)
DRAFT = Schedule(steps=2000, lr=2e-3, warmup=100)
DRAFT_ANCHORS = 32   # blocks per sequence in a draft batch
PROBE_STEPS = 30     # timed before a stage's length is fitted to its minutes


def small_config() -> ModelConfig:
    return ModelConfig.from_dict({**random_config().to_dict(), "hidden_size": 64, "sliding_window": 16,
                                  "moe_intermediate_size": 128, "dspark_markov_rank": 16,
                                  "dspark_n_routed_experts": 8, "dspark_num_experts_per_tok": 2})
