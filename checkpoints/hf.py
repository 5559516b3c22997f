"""Load an HF-format V4.1 checkpoint (``config.json`` + safetensors) into the param pytree.

Accepts a single ``model.safetensors`` or a sharded set with ``model.safetensors.index.json``.
Every tensor named by ``model.params.param_specs`` must be present with the expected
shape and a floating dtype; unknown tensors are an error, except the parts of the
release the model does not run yet (DSpark ``mtp.*``, the vision tower), which are
skipped like the reference skips them. Errors list every offending name.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.params import build_tree, param_specs

IGNORED = re.compile(r"^(mtp\.|vision\.|aligner\.|markov_head\.|confidence_head\.|image_(start|end|newline)$)")
_FLOAT_DTYPES = {"F32", "F16", "BF16"}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (names, shapes or dtypes)."""


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {model_dir}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"shards named by the index are missing: {missing}")
    return files


def _open_all(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """name -> (file, dtype string, shape), read from the safetensors headers only."""
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (f, meta["dtype"], tuple(meta["shape"]))
    return out


def load_params(model_dir: str | Path, cfg: ModelConfig | None = None, dtype: Any = jnp.float32) -> dict:
    """The param pytree of ``model_dir`` (config read from it unless given), cast to ``dtype``
    (mHC, sinks and router biases stay fp32)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_json(model_dir)
    available = _open_all(shard_files(model_dir))
    specs = param_specs(cfg)
    expected = {name: (spec, k) for spec in specs for k, name in enumerate(spec.hf_names)}
    problems = []
    missing = sorted(set(expected) - set(available))
    if missing:
        problems.append(f"missing tensors: {_summary(missing)}")
    unexpected = sorted(n for n in set(available) - set(expected) if not IGNORED.match(n))
    if unexpected:
        problems.append(f"unexpected tensors: {_summary(unexpected)}")
    for name, (spec, _) in expected.items():
        if name not in available:
            continue
        _, dt, shape = available[name]
        want = spec.shape[1:] if spec.stacked else spec.shape
        if shape != want:
            problems.append(f"{name}: shape {list(shape)}, expected {list(want)}")
        if dt not in _FLOAT_DTYPES:
            problems.append(f"{name}: dtype {dt} is not supported (expected one of {sorted(_FLOAT_DTYPES)})")
    if problems:
        raise CheckpointError(f"checkpoint {model_dir} does not match its config:\n  " + "\n  ".join(problems))

    handles = {f: safe_open(str(f), framework="numpy") for f in {v[0] for v in available.values()}}

    def read(name: str) -> np.ndarray:
        return handles[available[name][0]].get_tensor(name)

    leaves = {}
    for spec in specs:
        arrays = [read(n) for n in spec.hf_names]
        value = np.stack(arrays) if spec.stacked else arrays[0]
        leaves[spec.path] = jnp.asarray(value, dtype=spec.dtype(dtype))
    return build_tree(cfg, leaves)


def _summary(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
