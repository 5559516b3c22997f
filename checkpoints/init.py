"""Deterministic random initialisation of the param pytree from a config.

The scheme follows the golden fixtures' recipe, which keeps every sublayer input near
unit scale: linear weights N(0, 1/fan_in), embeddings N(0, 1), norms 1 + 0.1 N, mHC
projections N(0, 1/(4 D)), and O(0.1-1) biases, sinks and gains. Each leaf draws from its
own key folded from the seed and the leaf's position, so the result depends only on
(config, seed).
"""
from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.params import ParamSpec, build_tree, param_specs


def _draw(spec: ParamSpec, key: jax.Array) -> jnp.ndarray:
    shape = spec.shape
    normal = jax.random.normal(key, shape, jnp.float32)
    if spec.init == "linear":
        return normal / jnp.sqrt(shape[-1])
    if spec.init == "head":
        return normal * 2 / jnp.sqrt(shape[-1])
    if spec.init == "embed":
        return normal
    if spec.init == "norm":
        return 1 + 0.1 * normal
    if spec.init == "hc_fn":
        return normal / jnp.sqrt(shape[-1])
    if spec.init == "hc_base":
        return 0.3 * normal
    if spec.init in ("hc_scale", "gain"):
        return 1 + 0.2 * normal
    if spec.init == "bias":
        return 0.1 * normal
    if spec.init == "normal":
        return normal
    if spec.init == "ones":
        return jnp.ones(shape, jnp.float32)
    raise ValueError(f"unknown init {spec.init!r} for {spec.path}")


def random_leaves(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, draft: bool = False
                  ) -> Iterator[tuple[ParamSpec, jnp.ndarray]]:
    """``(spec, leaf)`` of every parameter, each drawn when it is reached (a model larger than
    memory can be written leaf by leaf: ``checkpoints.export.save_random_checkpoint``)."""
    root = jax.random.PRNGKey(seed)
    for i, spec in enumerate(param_specs(cfg, draft)):
        yield spec, _draw(spec, jax.random.fold_in(root, i)).astype(spec.dtype(dtype))


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, draft: bool = False) -> dict:
    """Random parameters of ``cfg`` (with ``draft``, the DSpark draft layers' too)."""
    return build_tree(cfg, {spec.path: leaf for spec, leaf in random_leaves(cfg, seed, dtype, draft)})
