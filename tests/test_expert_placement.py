"""Redundant experts and EPLB: the placement plan, the replica choice, and the load the steps count.

(The engine on a mesh with redundant experts and periodic rebalancing generating the one-device
engine's tokens is in ``test_sharding``, which has the 8 virtual devices.)
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sharding.expert_placement import Placement, physical, plan, rank_loads, trivial


def test_the_plan_copies_hot_experts_and_fills_every_rank_evenly():
    rng = np.random.default_rng(0)
    load = rng.integers(0, 100, size=16).astype(float)
    load[3] = 2000   # one expert takes most of the pairs
    phy2log = plan(load, ranks=4, physical_experts=24)
    assert len(phy2log) == 24 and set(phy2log) == set(range(16))   # every expert placed
    copies = np.bincount(phy2log, minlength=16)
    assert copies[3] == copies.max() >= 4   # the hot one gets the most copies
    assert all(len(set(r)) == len(r) for r in phy2log.reshape(4, 6))   # no rank holds two copies of one
    planned, start = rank_loads(load, phy2log, 4), rank_loads(load, trivial(16, 24), 4)
    assert planned.sum() == pytest.approx(load.sum()) and planned.max() < 0.7 * start.max()
    assert planned.max() / planned.mean() < 1.1


def test_without_redundant_experts_the_plan_only_moves_them():
    load = np.arange(8, dtype=float) ** 2
    phy2log = plan(load, ranks=2, physical_experts=8)
    assert sorted(phy2log) == list(range(8))
    assert rank_loads(load, phy2log, 2).max() < rank_loads(load, trivial(8, 8), 2).max()


def test_pairs_of_an_expert_spread_over_its_copies():
    phy2log = np.array([0, 1, 2, 0, 3, 0], np.int32)   # logical 0 has three copies
    p = Placement.of(phy2log, 4)
    assert np.array_equal(p.phy2log, phy2log) and list(np.asarray(p.count)) == [3, 1, 1, 1]
    ids = jnp.asarray([[0, 1], [0, 2], [0, 3], [1, 0]], jnp.int32)
    got = np.asarray(physical(ids, p))
    assert np.array_equal(phy2log[got], np.asarray(ids))   # each pair reaches a copy of its own expert
    assert set(got[np.asarray(ids) == 0]) == {0, 3, 5}   # and expert 0's four pairs use every copy


def test_a_hot_experts_pairs_split_evenly_whatever_their_top_k_slot():
    """With two copies and top-2, a slot-based choice would send every slot-0 pair to one copy."""
    p = Placement.of(np.array([0, 1, 2, 0], np.int32), 3)   # logical 0 on physical 0 and 3
    ids = jnp.asarray([[0, 1], [0, 2], [0, 1], [0, 2], [1, 0], [0, 1]], jnp.int32)
    got = np.asarray(physical(ids, p))[np.asarray(ids) == 0]
    assert list(np.bincount(got, minlength=4)[[0, 3]]) == [3, 3]   # by slot it would be 5 and 1


def test_the_forward_counts_each_layers_routed_pairs_per_slot():
    import jax

    from model.batch import pack_requests
    from model.engram_vocab import engram_map_for
    from model.forward import forward
    from model.state import init_state
    from serve.default_model import random_config, random_params

    cfg = random_config()
    params = random_params(cfg)
    emap = jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
    batch = pack_requests([(0, list(range(3, 20)), 0), (2, list(range(5, 10)), 0)], pad_to=32)   # 10 padding rows
    step = jax.jit(forward, static_argnames="cfg")
    _, state = step(params, cfg, init_state(cfg, 3, 64, page_size=16, expert_load=True), batch, emap)
    load = np.asarray(state.expert_load)
    k = cfg.num_experts_per_tok
    assert load.shape == (3, cfg.num_hidden_layers, cfg.n_routed_experts)
    assert (load.sum(2)[0] == 17 * k).all() and (load.sum(2)[2] == 5 * k).all() and not load[1].any()
    _, plain = step(params, cfg, init_state(cfg, 3, 64, page_size=16), batch, emap)
    assert plain.expert_load.size == 0   # not counted unless asked


def test_redundant_experts_need_expert_ranks():
    from serve.engine import EngineConfig

    with pytest.raises(ValueError, match="need --ep-size > 1"):
        EngineConfig(ep_num_redundant_experts=4)
    with pytest.raises(ValueError, match="need --ep-size > 1"):
        EngineConfig(enable_eplb=True)
    with pytest.raises(ValueError, match="at least 0"):
        EngineConfig(ep_size=2, ep_num_redundant_experts=-1)
