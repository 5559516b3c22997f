"""The device mesh: DP attention over ``data``, expert parallelism over ``expert``.

A ``MeshSpec(dp, ep)`` lays ``dp * ep`` devices out as a ``(data, expert)`` grid (SGLang's
``--dp-size`` and ``--ep-size``). Attention and the request state are split over ``data``:
each data rank owns its request slots and their KV pages, and the ``ep`` devices of a data
rank hold the same state. Routed experts are split over ``expert``: each data rank's tokens
reach every expert within its own row of the grid. So ``dp=1, ep=8`` is one DP group with
the experts over eight devices, ``dp=8, ep=1`` eight replicas of the whole model, and the
grid between them trades attention replication for expert memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

DATA, EXPERT = "data", "expert"


@dataclass(frozen=True)
class MeshSpec:
    dp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.dp < 1 or self.ep < 1:
            raise ValueError(f"--dp-size and --ep-size must be at least 1, not {self.dp} and {self.ep}")

    @property
    def size(self) -> int:
        return self.dp * self.ep

    def build(self, devices=None) -> Mesh:
        """The mesh over ``devices`` (default: every device of every process, in JAX's order)."""
        devices = jax.devices() if devices is None else list(devices)
        if len(devices) != self.size:
            raise ValueError(f"--dp-size {self.dp} x --ep-size {self.ep} needs {self.size} devices; "
                             f"{len(devices)} are visible")
        return Mesh(np.asarray(devices).reshape(self.dp, self.ep), (DATA, EXPERT))
