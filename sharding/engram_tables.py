"""Engram tables over the mesh: rows split over every device, looked up where they live.

On one device an Engram layer's table (``[rows, head_dim]``, e4m3 or float) and its per-32
scales are plain arrays. Under a mesh (``shard_params``) each is split by rows into equal
contiguous blocks, one per device of the (data, expert) grid, padded with zero rows to a
multiple of the grid (no hash reaches the padding), and held as ``SplitRows``: no device holds
a whole table (V4.1-Flash's 188.8 GiB of tables are 23.6 GiB a GPU over 8).

``lookup`` then gathers a step's hashed rows inside ``shard_map``: every device reads the ids
that fall in its block and writes zeros for the rest, and one ``psum`` over the grid hands
every device the whole rows. It is exact (each row comes from one device, the others add
zeros), and a step moves ``tokens x cols x head_dim`` floats over the grid, not the table.
The rows stay e4m3 with their scales until the device that holds them dequantises them.

``--engram-placement host`` keeps the same blocks in host memory (``pinned_host``), one block a
device, so the host holds one copy of the tables and the devices none: the device sends its ids
to the host, the host gathers its block's rows (and scales) with XLA's host compute
(``compute_on("device_host")``), and the rows, still e4m3, come back to be dequantised and
summed. Only the step's rows cross PCIe. The lookups depend on nothing but the step's hashed
ids, which the step computes first, so XLA may run them beside the layers before the first
Engram layer. One device is a 1 x 1 mesh here.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax.experimental import compute_on as _compute_on

from mega.engram import dequantised, lookup_rows
from model.config import ModelConfig
from sharding.mesh import DATA, EXPERT

GRID = (DATA, EXPERT)
PARTS = ("table", "scale")   # an Engram layer's row-indexed parameters
PLACEMENTS = ("device", "host")


@dataclass(frozen=True)
class SplitRows:
    """A row-indexed array split in equal blocks over every device of ``mesh`` (row-major), in
    device memory or, ``host``, in the host memory beside each device."""
    rows: jax.Array
    mesh: Mesh
    host: bool = False

    @property
    def dtype(self):   # what the ops and the kernel report read of a table
        return self.rows.dtype


jax.tree_util.register_dataclass(SplitRows, data_fields=["rows"], meta_fields=["mesh", "host"])


def split(params: dict, cfg: ModelConfig, mesh: Mesh, placement: str = "device") -> dict:
    """``params`` with every Engram layer's table and scales split over ``mesh``, in device or
    host memory (``placement``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"--engram-placement must be device or host, not {placement!r}")
    host = placement == "host"
    where = NamedSharding(mesh, P(GRID), memory_kind="pinned_host" if host else None)
    layers = list(params["layers"])
    for i in cfg.engram_layer_ids:
        g = dict(layers[i]["engram"])
        for k in PARTS:
            a = g[k]   # padded on the host (this process's copy of it whole): each device receives only its block
            a = np.asarray(a.addressable_data(0) if isinstance(a, jax.Array) and a.is_fully_replicated else a)
            a = np.pad(a, ((0, -a.shape[0] % mesh.size),) + ((0, 0),) * (a.ndim - 1))
            g[k] = SplitRows(jax.device_put(a, where), mesh, host)
        layers[i] = {**layers[i], "engram": g}
    return {**params, "layers": layers}


# host compute as a function: ``compute_on2`` in JAX 0.10, named ``compute_on`` from 0.11 (whose
# context-manager form is gone)
_host_compute = getattr(_compute_on, "compute_on2", _compute_on.compute_on)


def lookup(p: dict, hash_ids: jnp.ndarray) -> jnp.ndarray:
    """``[T, cols * head_dim]`` float32 rows of an Engram layer ``p`` for ``hash_ids [T, cols]``,
    wherever its table lives."""
    table, scale = p["table"], p["scale"]
    if not isinstance(table, SplitRows):
        return lookup_rows(table, scale, hash_ids)

    def local(tab, sc, ids):
        block = tab.shape[0]
        at = ids - jax.lax.axis_index(GRID) * block
        mine = (at >= 0) & (at < block)
        at = jnp.where(mine, at, 0)
        if table.host:   # gathered where the block lives, dequantised on the device
            at = jax.device_put(at, jax.memory.Space.Host)
            got = _host_compute(lambda t, s, i: (t[i], s[i]), compute_type="device_host",
                                out_memory_spaces=jax.memory.Space.Host)(tab, sc, at)
            rows = dequantised(*jax.device_put(got, jax.memory.Space.Device))
        else:
            rows = lookup_rows(tab, sc, at)
        rows = jnp.where(jnp.repeat(mine, tab.shape[1], axis=1), rows, 0.0)
        return jax.lax.psum(rows, GRID)
    return jax.shard_map(local, mesh=table.mesh, in_specs=(P(GRID), P(GRID), P()), out_specs=P())(
        table.rows, scale.rows, hash_ids)
