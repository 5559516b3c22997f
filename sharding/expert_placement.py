"""Redundant experts and their placement over the ``expert`` axis (EPLB).

With ``R`` redundant experts (``--ep-num-redundant-experts``) each MoE layer holds ``E + R``
physical experts, split evenly over the ``expert`` ranks, and every logical expert has one
or more physical copies with the same weights. A layer's ``Placement`` maps each logical
expert to its copies (``log2phy [E, R + 1]``, padded with -1, and ``count [E]``);
``physical`` sends the ``j``-th of a step's pairs for an expert to its copy ``j mod count``,
so a hot expert's pairs spread evenly over its copies. Routing is untouched: the copies hold
the same weights, so the outputs are the logical model's whatever the placement (only which
device computes a pair changes).

``trivial`` is the placement a server starts with (physical expert ``p`` holds logical
``p mod E``, as SGLang's ``--init-expert-location trivial``); ``plan`` is the EPLB placement
for one layer's measured load: the extra copies go, one at a time, to the expert with the
most load per copy (one copy a rank at most), then the copies are packed heaviest first onto
the least loaded rank that has room and does not already hold that expert. ``place_layer``
applies a placement to one layer's parameters, gathering each new physical stack from a
device that holds its expert already, so rebalancing a running server moves weights between
devices and never reads a checkpoint. The placement tables are arrays of the parameters, so
a rebalanced server runs the programs it has compiled.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mega.moe import EXPERT_WEIGHTS
from sharding.mesh import EXPERT


@dataclass(frozen=True)
class Placement:
    """One MoE layer's logical-to-physical expert map (replicated on every device)."""
    log2phy: jax.Array  # int32 [E, max copies], -1 past an expert's count
    count: jax.Array  # int32 [E], copies of each logical expert

    @classmethod
    def of(cls, phy2log: np.ndarray, experts: int) -> "Placement":
        """The map of ``phy2log`` (the logical expert of each physical one) over ``experts``."""
        count = np.bincount(phy2log, minlength=experts)
        log2phy = np.full((experts, len(phy2log) - experts + 1), -1, np.int32)
        for e in range(experts):
            at = np.flatnonzero(phy2log == e)
            log2phy[e, :len(at)] = at
        return cls(jnp.asarray(log2phy), jnp.asarray(count, jnp.int32))

    @property
    def phy2log(self) -> np.ndarray:
        log2phy = np.asarray(self.log2phy)
        out = np.empty(int(np.asarray(self.count).sum()), np.int32)
        for e, row in enumerate(log2phy):
            out[row[row >= 0]] = e
        return out


jax.tree_util.register_dataclass(Placement, data_fields=["log2phy", "count"], meta_fields=[])


def physical(ids: jnp.ndarray, placement: Placement) -> jnp.ndarray:
    """The physical expert of each routed pair ``ids [T, k]`` (logical ids): an expert's pairs
    are dealt to its copies in turn, by their order among that expert's pairs (not by their
    top-k slot, which a hot expert mostly holds at 0)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    first = jnp.searchsorted(flat[order], jnp.arange(placement.count.shape[0], dtype=flat.dtype), side="left")
    nth = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.size, dtype=flat.dtype) - first[flat[order]])
    return placement.log2phy[flat, nth % placement.count[flat]].reshape(ids.shape)


def trivial(experts: int, physical_experts: int) -> np.ndarray:
    """``phy2log`` of the start: physical ``p`` holds logical ``p mod experts``."""
    return np.arange(physical_experts, dtype=np.int32) % experts


def plan(load: np.ndarray, ranks: int, physical_experts: int) -> np.ndarray:
    """``phy2log`` balancing one layer's ``load [E]`` (routed pairs per logical expert) over
    ``ranks`` ranks of ``physical_experts / ranks`` experts each."""
    experts = len(load)
    load = np.asarray(load, np.float64) + 1e-9   # an unused expert still gets its one copy
    copies = np.ones(experts, np.int64)
    for _ in range(physical_experts - experts):
        # one copy a rank at most while any expert has fewer: a rank's second copy shares nothing out
        spread = np.where(copies < ranks, load / copies, -1.0) if (copies < ranks).any() else load / copies
        copies[np.argmax(spread)] += 1
    per_copy = load / copies
    order = sorted(((e for e in range(experts) for _ in range(copies[e]))), key=lambda e: (-per_copy[e], e))
    room = physical_experts // ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    rank_load = np.zeros(ranks)
    for e in order:
        open_ranks = [r for r in range(ranks) if len(held[r]) < room]
        apart = [r for r in open_ranks if e not in held[r]] or open_ranks   # a second copy on one rank adds nothing
        r = min(apart, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += per_copy[e]
    return np.concatenate([np.asarray(h, np.int32) for h in held])


def rank_loads(load: np.ndarray, phy2log: np.ndarray, ranks: int) -> np.ndarray:
    """The pairs each rank computes under ``phy2log`` (a hot expert's pairs shared by its copies)."""
    count = np.bincount(phy2log, minlength=len(load))
    return (np.asarray(load, np.float64)[phy2log] / count[phy2log]).reshape(ranks, -1).sum(1)


def place_layer(params: dict, i: int, phy2log: np.ndarray, mesh: Mesh, now: np.ndarray | None = None) -> dict:
    """``params`` with layer ``i``'s routed experts laid out as ``phy2log`` says, split over
    ``mesh``'s ``expert`` axis, and its ``Placement`` (``now``: the layer's current ``phy2log``,
    None while its stacks are the logical ones)."""
    layers = list(params["layers"])
    moe = layers[i]["moe"]
    experts = moe["bias"].shape[0]
    # each new physical expert is copied from one that holds its logical expert now
    source = phy2log if now is None else np.argsort(now, kind="stable")[np.searchsorted(np.sort(now), phy2log)]
    stacks = _gather(mesh)({k: moe[k] for k in EXPERT_WEIGHTS}, jnp.asarray(source))
    placement = jax.device_put(Placement.of(phy2log, experts), NamedSharding(mesh, P()))
    layers[i] = {**layers[i], "moe": {**moe, **stacks, "placement": placement}}
    return {**params, "layers": layers}


@cache
def _gather(mesh: Mesh):
    """``(stacks, source) -> stacks[source]`` (every array of a quantised stack too), split over ``expert``."""
    return jax.jit(lambda stacks, src: jax.tree.map(lambda a: a[src], stacks),
                   out_shardings=NamedSharding(mesh, P(EXPERT)))
