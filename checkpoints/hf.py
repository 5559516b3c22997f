"""Load an HF-format V4.1 checkpoint (``config.json`` + safetensors) into the param pytree.

Accepts a single ``model.safetensors`` or a sharded set with ``model.safetensors.index.json``,
named as the release names its tensors (``embed.weight``, ``layers.0.attn.wq_a.weight``) or as
``transformers`` saves them (``model.embed.weight``, ``lm_head.weight``). Every tensor named by
``model.params.param_specs`` must be present with the expected shape and a dtype its role may
have in the format ``config.json`` declares (``checkpoints.formats``); the DSpark draft tensors
(``mtp.*``) are loaded when present, all or none; the vision tower is skipped with one log line;
any other tensor is an error. Every problem is checked before anything is read, and the error
lists each offending tensor by name.

Tensors are read one at a time from the shards' memory maps (``checkpoints.safetensors_io``),
placed on the device and converted there (fp8 linears dequantised to the model dtype, MXFP4
experts into the kernels' ``Fp4Weight``), so host memory holds about one tensor, not the model.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import queue
import re
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.formats import CheckpointError, CheckpointFormat, scale_name
from checkpoints.safetensors_io import SafetensorsError, Shards
from model.config import ModelConfig
from model.params import ParamSpec, build_tree, param_specs, transformers_name

__all__ = ["CheckpointError", "load_params", "load_tensors"]

VISION = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)")
log = logging.getLogger("megajax")


def load_params(model_dir: str | Path, cfg: ModelConfig | None = None, dtype: Any = jnp.float32,
                progress: bool = False) -> dict:
    """The param pytree of ``model_dir`` (config read from it unless given) in the model dtype
    ``dtype`` (mHC, sinks and router biases stay fp32; quantised experts and Engram tables stay
    quantised). ``progress``: a progress bar of tensors and bytes on stderr."""
    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_json(model_dir)
    config = model_dir / "config.json"
    fmt = CheckpointFormat.from_config(json.loads(config.read_text()) if config.exists() else {})
    try:
        shards = Shards(model_dir)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    with shards:
        return load_tensors(shards, cfg, fmt, dtype, progress, str(model_dir))


def load_tensors(source, cfg: ModelConfig, fmt: CheckpointFormat, dtype: Any = jnp.float32,
                 progress: bool = False, where: str = "checkpoint") -> dict:
    """The param pytree from ``source``: ``tensors`` (name -> ``TensorInfo``) and ``read(name)``
    (a host array), as ``Shards`` has; the exporter's in-memory copy passes its own."""
    from tqdm import tqdm

    plan = _plan(cfg, fmt, source.tensors, where)
    info = source.tensors
    total = sum(info[n].nbytes + (info[scale_name(n)].nbytes if k in ("fp8", "mxfp4") else 0)
                for _, tensors in plan for n, k in tensors)
    leaves = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {sum(len(t) for _, t in plan)} tensors",
              disable=not progress, leave=False) as bar:
        names = [m for _, tensors in plan for n, k in tensors
                 for m in ((n, scale_name(n)) if k in ("fp8", "mxfp4") else (n,))]
        arrays = _read_ahead(source, names)
        try:
            for spec, tensors in plan:
                parts = []
                for name, kind in tensors:
                    w = jnp.asarray(next(arrays))
                    s = jnp.asarray(next(arrays)) if kind in ("fp8", "mxfp4") else None
                    parts.append(fmt.decode(spec, kind, w, s, dtype))
                    bar.update(w.nbytes + (0 if s is None else s.nbytes))
                leaves[spec.path] = jax.tree.map(lambda *xs: jnp.stack(xs), *parts) if spec.stacked else parts[0]
        finally:
            arrays.close()   # the reader stops before the caller closes the source
    return build_tree(cfg, leaves)


def _read_ahead(source, names: list[str]):
    """``source.read`` of each name in order, read by a thread one tensor ahead of the caller, so
    that the disk works while the device converts (host memory: about two tensors)."""
    ready: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def read_all():
        try:
            for name in names:
                item = source.read(name)
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
        except BaseException as e:   # handed to the caller, raised there
            ready.put(e)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    try:
        for _ in names:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join()


def _plan(cfg: ModelConfig, fmt: CheckpointFormat, available: dict, where: str
          ) -> list[tuple[ParamSpec, list[tuple[str, str]]]]:
    """Per parameter, its tensors and how each is stored; CheckpointError listing every problem."""
    hf_naming = "model.embed.weight" in available
    draft = any(n.startswith("mtp.") for n in available)
    specs = param_specs(cfg, draft=draft)
    specs = [dataclasses.replace(s, names=tuple(map(transformers_name, s.names)))
             if hf_naming and s.path[0] != "mtp" else s for s in specs]
    problems, plan, claimed = [], [], set()
    missing = [n for s in specs for n in s.names if n not in available]
    if missing:
        problems.append(f"missing tensors: {_summary(missing)}")
    for spec in specs:
        tensors = []
        for name in spec.names:
            if name not in available:
                continue
            scale = available.get(scale_name(name)) if spec.role != "table" else None
            try:
                kind = fmt.stored_kind(spec, name, available[name], scale)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            claimed.add(name)
            if kind in ("fp8", "mxfp4"):
                claimed.add(scale_name(name))
            tensors.append((name, kind))
        if len({k for _, k in tensors}) > 1:
            problems.append(f"{spec.names[0]} ...: its tensors mix formats {sorted({k for _, k in tensors})}")
        plan.append((spec, tensors))
    vision = [n for n in available if VISION.match(n)]
    expected = {n for s in specs for n in s.names}
    unexpected = sorted(n for n in set(available) - claimed - set(vision) - expected   # (bad ones: said above)
                        if not (n.endswith(".scale") and n.removesuffix(".scale") + ".weight" in expected))
    if unexpected:
        problems.append(f"unexpected tensors: {_summary(unexpected)}")
    if problems:
        raise CheckpointError(f"{where} does not match its config:\n  " + "\n  ".join(problems))
    if vision:
        log.info("skipped %d vision tensors (vision.*, aligner.*, image_*): megajax serves the text model", len(vision))
    if draft:
        log.info("loaded the DSpark draft stack (mtp.0-%d)", cfg.num_nextn_predict_layers - 1)
    return plan


def _summary(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
