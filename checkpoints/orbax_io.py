"""Save and restore the param pytree with orbax-checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from model.config import ModelConfig
from model.params import abstract_params


def save_params(path: str | Path, params: dict) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(Path(path).absolute(), params)


def restore_params(path: str | Path, cfg: ModelConfig, dtype: Any = jnp.float32) -> dict:
    """Restore into the layout ``cfg`` implies (orbax checks shapes against it)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(Path(path).absolute(), abstract_params(cfg, dtype))
