"""Write a param pytree as an HF-format checkpoint directory, in the release's layout.

``save_checkpoint(params, cfg, DIR, V41)`` writes what the released V4.1 checkpoint is made of
(``checkpoints.formats``: fp8 linears with 32 x 32 UE8M0 block scales, MXFP4 routed experts,
e4m3 Engram tables with their per-32 scales, BF16 and F32 for the rest, the release's tensor
names, ``quantization_config`` in ``config.json``); ``BF16`` writes plain bf16 (F32 where the
release keeps F32). The draft layers (``params["mtp"]``) are written when the tree has them.
Tensors are encoded one at a time on the device and streamed into the shards.

``stored_params`` is the tree a load of such a checkpoint gives, made without the disk: the
in-memory quantised model an export must reproduce exactly.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.formats import V41, CheckpointFormat
from checkpoints.hf import load_tensors
from checkpoints.safetensors_io import TensorInfo, dtype_name, write_shards
from model.config import ModelConfig
from model.params import param_specs


def save_checkpoint(params: dict, cfg: ModelConfig, out_dir: str | Path, fmt: CheckpointFormat = V41,
                    max_shard_bytes: int = 5 << 30) -> list[Path]:
    """Write ``config.json`` and the safetensors shards (with an index when there are several)."""
    return _write(stored_tensors(params, cfg, fmt), cfg, out_dir, fmt, max_shard_bytes)


def save_random_checkpoint(cfg: ModelConfig, out_dir: str | Path, fmt: CheckpointFormat = V41, seed: int = 0,
                           draft: bool = False, max_shard_bytes: int = 5 << 30) -> list[Path]:
    """``save_checkpoint(init_params(cfg, seed, draft=draft), cfg, out_dir, fmt)``, each parameter
    drawn, encoded and written before the next is drawn: benchmark models larger than memory."""
    from checkpoints.init import random_leaves

    return _write(_encoded(random_leaves(cfg, seed, draft=draft), fmt, lambda spec: None), cfg, out_dir, fmt,
                  max_shard_bytes)


def _write(tensors, cfg: ModelConfig, out_dir: str | Path, fmt: CheckpointFormat, max_shard_bytes: int) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
              "dtype": fmt.float_dtype, **cfg.to_dict()}
    if (q := fmt.quantization_config()) is not None:
        config["quantization_config"] = q
    files = write_shards(out_dir, tensors, max_shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return files


def stored_tensors(params: dict, cfg: ModelConfig, fmt: CheckpointFormat
                   ) -> Iterator[tuple[str, np.ndarray, str | None]]:
    """Every tensor of the checkpoint of ``params`` in ``fmt``: ``(name, host array, raw dtype)``."""
    leaves = ((spec, _at(params, spec.path)) for spec in param_specs(cfg, draft="mtp" in params))
    return _encoded(leaves, fmt, lambda spec: _at(params, spec.path[:-1] + ("scale",)))


def _encoded(leaves, fmt: CheckpointFormat, table_scale) -> Iterator[tuple[str, np.ndarray, str | None]]:
    """The stored tensors of ``(spec, leaf)`` pairs (``table_scale(spec)``: an Engram table's
    scale leaf, which an fp8 table is stored with)."""
    for spec, leaf in leaves:
        scale = table_scale(spec) if spec.role == "table" else None
        for k, name in enumerate(spec.names):
            w = jax.tree.map(lambda a: a[k], leaf) if spec.stacked else leaf
            yield from fmt.encode(spec, name, w, scale)


class _InMemory:
    """Stored tensors held as host arrays, read as ``Shards`` reads files."""

    def __init__(self, tensors):
        self.arrays = {name: a for name, a, _ in tensors}
        self.tensors = {name: TensorInfo(Path(), dtype_name(a, raw), a.shape, 0, a.nbytes) for name, a, raw in tensors}

    def read(self, name: str) -> np.ndarray:
        return self.arrays[name]


def stored_params(params: dict, cfg: ModelConfig, fmt: CheckpointFormat = V41, dtype: Any = jnp.float32) -> dict:
    """What loading ``save_checkpoint(params, cfg, DIR, fmt)`` with model dtype ``dtype`` gives."""
    return load_tensors(_InMemory(list(stored_tensors(params, cfg, fmt))), cfg, fmt, dtype, where="the stored copy")


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def main(argv: list[str] | None = None) -> int:
    """``python -m checkpoints.export --out DIR``: write a checkpoint in the release's format (or bf16)."""
    import argparse
    import sys

    from checkpoints.formats import BF16, CheckpointError
    from checkpoints.hf import load_params
    from checkpoints.init import init_params
    from model.config import ConfigError

    ap = argparse.ArgumentParser(prog="python -m checkpoints.export", description=main.__doc__)
    ap.add_argument("--out", required=True, type=Path, help="the directory to write")
    ap.add_argument("--format", choices=["v41", "bf16"], default="v41",
                    help="v41: the release's (fp8 linears with 32 x 32 UE8M0 scales, MXFP4 experts, e4m3 Engram "
                         "tables); bf16: plain bf16 (F32 where the release keeps F32)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="re-encode this checkpoint directory")
    src.add_argument("--config", type=Path, help="random weights for this config.json (default: random-tiny's, serve.default_model)")
    ap.add_argument("--seed", type=int, default=0, help="with --config or the default: the random init's seed")
    ap.add_argument("--max-shard-gb", type=float, default=5.0)
    args = ap.parse_args(argv)
    try:
        if args.model:
            cfg = ModelConfig.from_json(args.model)
            params = load_params(args.model, cfg, progress=True)
        else:
            from serve.default_model import random_config

            cfg = ModelConfig.from_json(args.config) if args.config else random_config()
            params = init_params(cfg, seed=args.seed)
        files = save_checkpoint(params, cfg, args.out, V41 if args.format == "v41" else BF16,
                                int(args.max_shard_gb * (1 << 30)))
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} shard(s), {sum(f.stat().st_size for f in files) / 1e9:.2f} GB, to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
