"""EPLB in a running engine: count, re-place, repeat.

With ``--enable-eplb`` the steps count every layer's routed pairs per logical expert in the
cache state (``ModelState.expert_load``). Every ``--eplb-rebalance-num-iterations`` steps the
balancer reads the counts (the state of the last dispatched step, so every step so far), zeroes
them, plans each layer's placement for that window's load (``sharding.expert_placement.plan``)
and re-places the experts a layer at a time. Before that, with ``--ep-num-redundant-experts`` alone,
the placement stays the trivial one a server starts with.

``balance`` records the window's max-over-mean rank load under the placement it ran with and
under the new one (1.0 is perfect; pairs dealt evenly over an expert's copies), which the log
line reports. A rebalance that fails leaves the layers it has not reached as they were.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

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
        self.placement: list[np.ndarray | None] = [None] * self.layers   # each layer's phy2log, on the host
        self.rebalances = 0
        self.balance: Balance | None = None
        self._last = 0   # the step of the last rebalance

    def place(self, params: dict, phy2logs: list[np.ndarray], install: Callable[[dict], None]) -> None:
        """Re-place the experts layer by layer, handing each step's parameters to ``install`` so
        that a layer's old stacks are dropped before the next layer's new ones exist."""
        for i, phy2log in enumerate(phy2logs):
            params = ep.place_layer(params, i, phy2log, self.mesh, self.placement[i])
            self.placement[i] = phy2log
            install(params)

    def initial(self, params: dict, install: Callable[[dict], None]) -> None:
        self.place(params, [ep.trivial(self.experts, self.physical)] * self.layers, install)

    def due(self, steps: int) -> bool:
        return self.interval is not None and steps - self._last >= self.interval

    def rebalance(self, params: dict, counts: jax.Array, steps: int, install: Callable[[dict], None]) -> jax.Array:
        """Re-place the experts for the load in ``counts [slots, layers, E]``; the counts zeroed."""
        load = np.asarray(counts).sum(0, dtype=np.int64)   # [layers, E]
        new = [ep.plan(load[i], self.ranks, self.physical) for i in range(self.layers)]

        def worst(placement):   # the busiest rank of the busiest layer, over the mean
            ranks = np.stack([ep.rank_loads(load[i], placement[i], self.ranks) for i in range(self.layers)])
            return float((ranks.max(1) / np.maximum(ranks.mean(1), 1e-9)).max())

        balance = Balance(steps - self._last, worst(self.placement), worst(new))
        self._last = steps
        self.place(params, new, install)
        self.balance, self.rebalances = balance, self.rebalances + 1
        logging.getLogger("megajax").info("eplb: rebalanced after %d steps; busiest rank over the mean %.2f -> %.2f",
                                          balance.window_steps, balance.before, balance.after)
        return jax.device_put(np.zeros(counts.shape, counts.dtype), counts.sharding)
