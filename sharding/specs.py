"""Partition specs for the parameters and the cache state, derived, not listed.

Parameters: ``model.params.param_specs`` says what every parameter is; a routed expert stack
(role ``expert``, one slice per expert on axis 0) is split over ``expert``, whatever format
holds it (a quantised stack's every array keeps the expert axis first); the Engram tables are
split by rows over the whole grid (``sharding.engram_tables``); everything else is replicated. State: every array of ``model.state.ModelState`` is per request on its first
axis (slots, or the pages the slots own: ``init_state`` gives each slot contiguous pages), so
it is split over ``data``.

Plain ``PartitionSpec``s rather than Flax's logical-axis metadata: the rule is one line per
role here, and the param tree is a plain dict that ``param_specs`` already describes.
"""
from __future__ import annotations

from typing import TypeVar

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.config import ModelConfig
from model.params import ParamSpec, build_tree, param_specs
from sharding import engram_tables
from sharding.mesh import DATA, EXPERT

S = TypeVar("S")


def param_spec_partition(spec: ParamSpec) -> P:
    """The rule: a routed expert stack split over ``expert``, every other parameter whole."""
    return P(EXPERT) if spec.role == "expert" else P()


def param_placement(mesh: Mesh):
    """Each parameter's sharding on ``mesh``, as ``checkpoints.hf.load_params`` reads by it (the
    Engram tables whole: ``shard_params`` splits them)."""
    return lambda spec: NamedSharding(mesh, param_spec_partition(spec))


def param_partition(cfg: ModelConfig, params: dict) -> dict:
    """A ``PartitionSpec`` for every array leaf of ``params`` (the tree ``param_specs`` describes,
    with or without the draft, quantised or not)."""
    by_path = build_tree(cfg, {s.path: param_spec_partition(s) for s in param_specs(cfg, draft="mtp" in params)})
    # a leaf of ``by_path`` may stand for a subtree of ``params`` (a quantised weight's arrays)
    return jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub), by_path, params)


def state_partition(state: S) -> S:
    """``P(data)`` for every array of a tree of per-request state: a ``ModelState``, or the
    engine's state around one (sampling counts by slot); an empty array (a ratio-1 source's
    pending tail) has nothing to split, and XLA places it whole."""
    return jax.tree.map(lambda x: P(DATA) if x.size else P(), state)


def constrain_state(state: S) -> S:
    """In a step traced under a mesh with a ``data`` axis, the step's new state split as its input
    was, so that a compiled step's outputs feed its next call as they are; elsewhere ``state``."""
    return _constrain(state, state_partition(state))


def constrain_replicated(tree: S) -> S:
    """As ``constrain_state``, for what one program hands the next whole (every device a copy):
    whichever program made it, the next takes it as compiled."""
    return _constrain(tree, jax.tree.map(lambda _: P(), tree))


def _constrain(tree, specs):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names:
        return tree
    return jax.lax.with_sharding_constraint(tree, specs)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, engram_placement: str = "device") -> dict:
    """``params`` placed on ``mesh``: as ``param_partition`` says, the Engram tables split by
    rows over every device, in device or host memory (``sharding.engram_tables``)."""
    split = engram_tables.split(params, cfg, mesh, engram_placement)
    return jax.tree.map(lambda spec, x: x if isinstance(x, engram_tables.SplitRows) else
                        jax.device_put(x, NamedSharding(mesh, spec)), param_partition(cfg, params), split)


def shard_state(state: S, mesh: Mesh) -> S:
    return _put(state, state_partition(state), mesh)


def _put(tree, specs, mesh: Mesh):
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
