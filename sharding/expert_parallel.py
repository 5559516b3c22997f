"""Expert parallelism: tokens travel to the ranks that own their experts, and back.

``moe`` is the model's MoE site. Outside a mesh with an ``expert`` axis of more than one
device it is ``mega.moe.moe``. Under one (``jax.set_mesh``, ``sharding.mesh``) the step's tokens are routed
once, as on one device, then inside ``shard_map`` each device takes an equal slice of them;
each (token, expert) pair is written into a send buffer by owner rank, one all-to-all along
``expert`` delivers the pairs to the ranks holding their experts (the routed stacks are split
over ``expert``: ``sharding.specs``), which run them through ``mega.moe.routed_experts`` as
one-expert rows weighted by their routing weight; a second all-to-all returns the rows, and
each token sums its own. The shared expert stays local. ``data`` ranks exchange nothing here:
each row of the grid is its own EP group. With redundant experts (``sharding.expert_placement``)
the stacks hold the layer's physical experts and each pair goes to one copy of its expert.

The send buffers hold ``tokens x top_k`` pairs per destination, so no pair is ever dropped
whatever the routing (the exchange is lossless and the outputs equal the one-device MoE's);
that is the padded ``all_to_all`` every backend has. ``lax.ragged_all_to_all`` moves only the
pairs that exist but XLA:CPU does not implement it; it is the GPU path to measure against this.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mega.moe import MoeSpec, moe as local_moe, route, routed_experts, shared_expert
from sharding.expert_placement import physical
from sharding.mesh import DATA, EXPERT


def expert_ranks() -> int:
    """Devices on the ``expert`` axis of the current mesh (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or EXPERT not in mesh.axis_names else mesh.shape[EXPERT]


def moe(x: jnp.ndarray, p: dict, spec: MoeSpec) -> jnp.ndarray:
    if expert_ranks() > 1:
        return exchanged_moe(x, p, spec)
    if "placement" not in p:
        return local_moe(x, p, spec)
    # physical stacks traced outside their mesh (the scorer): each pair to a copy of its expert
    weights, ids = route(x, p, spec)
    return routed_experts(x, weights, physical(ids, p["placement"]), p, spec, with_shared=True).astype(x.dtype)


def exchanged_moe(x: jnp.ndarray, p: dict, spec: MoeSpec) -> jnp.ndarray:
    """``moe`` through the exchange over the current mesh's ``expert`` axis, whatever its size
    (of one device: the machinery's own cost, which ``bench/ep_dispatch_gpu.py`` measures)."""
    ranks = expert_ranks()
    # routed once over the step's tokens, as on one device (a near-tie routes the same way)
    weights, ids = route(x, p, spec)
    if "placement" in p:
        ids = physical(ids, p["placement"])
    lanes = jax.sharding.get_abstract_mesh().shape[DATA] * ranks
    t = x.shape[0]
    pad = ((0, -t % lanes), (0, 0))
    experts = {k: p[k] for k in ("w1", "w3", "w2")}
    lane = P((DATA, EXPERT))
    y = jax.shard_map(partial(_exchange, ranks=ranks, spec=spec), in_specs=(lane, lane, lane, P(EXPERT)), out_specs=lane)(
        jnp.pad(x, pad), jnp.pad(weights, pad), jnp.pad(ids, pad), experts)[:t]
    if "shared" in p:
        y = y + shared_expert(x, p["shared"], spec.swiglu_limit, spec.fp8_activations)
    return y.astype(x.dtype)


def _exchange(x: jnp.ndarray, weights: jnp.ndarray, ids: jnp.ndarray, experts: dict, *, ranks: int,
              spec: MoeSpec) -> jnp.ndarray:
    """One device's lane: its tokens ``x [t, D]``, their routing ``weights``/``ids [t, k]``
    (padding rows weigh 0) and its own slice of the expert stacks."""
    t, d = x.shape
    k = ids.shape[1]
    local = experts["w1"].shape[0]
    owner, expert = (ids // local).reshape(-1), (ids % local).reshape(-1)
    order = jnp.argsort(owner, stable=True)
    # each pair's place in its owner's send buffer: its rank among the pairs for that owner
    first = jnp.searchsorted(owner[order], jnp.arange(ranks), side="left")
    slot = jnp.zeros_like(owner).at[order].set(jnp.arange(t * k) - first[owner[order]])
    token = jnp.arange(t * k) // k
    send_x = jnp.zeros((ranks, t * k, d), x.dtype).at[owner, slot].set(x[token])
    send_e = jnp.zeros((ranks, t * k), jnp.int32).at[owner, slot].set(expert)
    send_w = jnp.zeros((ranks, t * k), jnp.float32).at[owner, slot].set(weights.reshape(-1))

    def swap(a):
        return jax.lax.all_to_all(a, EXPERT, 0, 0)

    rx, re, rw = swap(send_x), swap(send_e), swap(send_w)   # [ranks (source), t*k, ...]: empty slots weigh 0
    out = routed_experts(rx.reshape(-1, d), rw.reshape(-1, 1), re.reshape(-1, 1), experts, spec)
    back = swap(out.reshape(ranks, t * k, d))
    return back[owner, slot].reshape(t, k, d).sum(1)
