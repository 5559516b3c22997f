"""EPLB in a running engine: count, re-place, repeat.

With ``--enable-eplb`` the steps count every layer's routed pairs per logical expert in the
cache state (``ModelState.expert_load``). Every ``--eplb-rebalance-num-iterations`` steps the
balancer reads the counts (the state of the last dispatched step, so every step so far), zeroes
them, plans each layer's placement for that window's load (``sharding.expert_placement.plan``)
and hands back the re-placed parameters. Before that, with ``--ep-num-redundant-experts`` alone,
the placement stays the trivial one a server starts with.

``balance`` records the window's max-over-mean rank load under the placement it ran with and
under the new one (1.0 is perfect), which the log line reports.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from model.config import ModelConfig
from sharding import expert_placement as ep
from sharding.mesh import EXPERT


@dataclass
class Balance:
    window_steps: int
    before: float  # max / mean rank load of the window, under the placement it ran with
    after: float  # the same load under the new placement


class ExpertBalancer:
    def __init__(self, cfg: ModelConfig, mesh: Mesh, redundant: int, interval: int | None):
        """``interval``: steps between rebalances (None: the trivial placement stays)."""
        self.mesh, self.interval = mesh, interval
        self.ranks = mesh.shape[EXPERT]
        self.experts = cfg.n_routed_experts
        self.physical = self.experts + redundant
        if self.physical % self.ranks:
            raise ValueError(f"{self.experts} experts + {redundant} redundant must split evenly over --ep-size "
                             f"{self.ranks}")
        self.layers = cfg.num_hidden_layers
        self.rebalances = 0
        self.balance: Balance | None = None
        self._last = 0   # the step of the last rebalance

    def initial(self, params: dict) -> dict:
        return ep.place(params, [ep.trivial(self.experts, self.physical)] * self.layers, self.mesh)

    def due(self, steps: int) -> bool:
        return self.interval is not None and steps - self._last >= self.interval

    def rebalance(self, params: dict, counts: jax.Array, steps: int) -> tuple[dict, jax.Array]:
        """``(params re-placed for the load in counts [slots, layers, E], the counts zeroed)``."""
        load = np.asarray(counts).sum(0, dtype=np.int64)   # [layers, E]
        old = [p.phy2log for p in ep.placements(params)]
        new = [ep.plan(load[i], self.ranks, self.physical) for i in range(self.layers)]

        def worst(placement):   # the busiest rank of the busiest layer, over the mean
            ranks = np.stack([ep.rank_loads(load[i], placement[i], self.ranks) for i in range(self.layers)])
            return float((ranks.max(1) / np.maximum(ranks.mean(1), 1e-9)).max())

        self.balance = Balance(steps - self._last, worst(old), worst(new))
        self._last, self.rebalances = steps, self.rebalances + 1
        logging.getLogger("megajax").info("eplb: rebalanced after %d steps; busiest rank over the mean %.2f -> %.2f",
                                          self.balance.window_steps, self.balance.before, self.balance.after)
        return ep.place(params, new, self.mesh), jax.device_put(np.zeros(counts.shape, counts.dtype), counts.sharding)
