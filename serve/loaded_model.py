"""A model as the engine and the scorer run it, set up once: the weights in the model dtype,
expert weights quantised as asked, the config the quantisation implies, and the Engram map.

``model_dtype`` is the one place ``--dtype auto`` is decided: bf16 on a GPU (where the Pallas
kernels take it), fp32 elsewhere.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from model.config import ModelConfig
from model.params import cast_params, with_quantized_experts

DTYPES = ("auto", "bfloat16", "float32")
QUANTIZATIONS = ("none", "fp8", "mxfp4", "w8a8")


def model_dtype(name: str) -> jnp.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    if name == "auto":
        from mega.backend import on_gpu

        name = "bfloat16" if on_gpu() else "float32"
    return jnp.dtype(name)


@dataclass(frozen=True)
class LoadedModel:
    params: dict
    cfg: ModelConfig
    engram_map: Any   # [vocab] int32 on the device, or None without Engram layers

    @classmethod
    def prepare(cls, params: dict, cfg: ModelConfig, dtype: str = "auto", quantization: str = "none"
                ) -> "LoadedModel":
        """``params`` cast to ``dtype`` (``model_dtype``), expert weights quantised at load by
        ``quantization`` ("fp8", "mxfp4", or "w8a8": fp8 weights and fp8 rows into each expert GEMM)."""
        from model.engram_vocab import engram_map_for

        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
        if quantization == "w8a8":
            cfg = dataclasses.replace(cfg, expert_activations="fp8")
        elif cfg.expert_activations == "fp8" and quantization != "fp8":
            logging.getLogger("megajax").warning(
                "the model config asks for fp8 expert activations, which the MoE kernels take only with fp8 "
                "expert weights: these experts run the (slower) XLA path; pass --quantization w8a8 or fp8")
        params = cast_params(params, model_dtype(dtype))
        if quantization != "none":
            params = with_quantized_experts(params, "fp8" if quantization == "w8a8" else quantization)
        emap = None
        if cfg.engram_layer_ids:
            emap = jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
        return cls(params, cfg, emap)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: str = "auto", quantization: str = "none",
                       progress: bool = False, placement=None) -> "LoadedModel":
        """The checkpoint in ``model_dir`` (either release format, or plain floats), read in
        ``dtype`` (``progress``: a loading bar on stderr; ``placement``: read by shard, as
        ``checkpoints.hf.load_params`` says)."""
        from checkpoints.hf import load_params

        cfg = ModelConfig.from_json(model_dir)
        return cls.prepare(load_params(model_dir, cfg, model_dtype(dtype), progress, placement), cfg, dtype,
                           quantization)
