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

Over a mesh (``placement``: each parameter's sharding) a process reads only what its own devices
hold: of a routed expert stack, the experts in its devices' slices of the expert axis (each read
once, converted on one of the devices that hold it and copied to the others); every other tensor
whole, sliced per device as its sharding says. Each parameter is then one global array assembled
from the process's pieces, so several processes under ``jax.distributed`` each read their part.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import queue
import re
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from checkpoints.formats import CheckpointError, CheckpointFormat, scale_name
from checkpoints.safetensors_io import SafetensorsError, Shards
from model.config import ModelConfig
from model.params import ParamSpec, build_tree, param_specs, transformers_name

__all__ = ["CheckpointError", "load_params", "load_tensors"]

VISION = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)")
log = logging.getLogger("megajax")


Placement = Callable[[ParamSpec], jax.sharding.Sharding]


def load_params(model_dir: str | Path, cfg: ModelConfig | None = None, dtype: Any = jnp.float32,
                progress: bool = False, placement: Placement | None = None) -> dict:
    """The param pytree of ``model_dir`` (config read from it unless given) in the model dtype
    ``dtype`` (mHC, sinks and router biases stay fp32; quantised experts and Engram tables stay
    quantised). ``progress``: a progress bar of tensors and bytes on stderr. ``placement``: each
    parameter's sharding, read by shard (module docstring); None: whole, on the default device."""
    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_json(model_dir)
    config = model_dir / "config.json"
    fmt = CheckpointFormat.from_config(json.loads(config.read_text()) if config.exists() else {})
    try:
        shards = Shards(model_dir)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    with shards:
        return load_tensors(shards, cfg, fmt, dtype, progress, str(model_dir), placement)


def load_tensors(source, cfg: ModelConfig, fmt: CheckpointFormat, dtype: Any = jnp.float32,
                 progress: bool = False, where: str = "checkpoint", placement: Placement | None = None) -> dict:
    """The param pytree from ``source``: ``tensors`` (name -> ``TensorInfo``) and ``read(name)``
    (a host array), as ``Shards`` has; the exporter's in-memory copy passes its own."""
    from tqdm import tqdm

    plan = _plan(cfg, fmt, source.tensors, where)
    pieces = [(spec, _pieces(spec, tensors, None if placement is None else placement(spec))) for spec, tensors in plan]
    info = source.tensors
    names = [m for _, ps in pieces for p in ps for n, k in p.tensors
             for m in ((n, scale_name(n)) if k in ("fp8", "mxfp4") else (n,))]
    with tqdm(total=sum(info[n].nbytes for n in names), unit="B", unit_scale=True,
              desc=f"loading {sum(len(p.tensors) for _, ps in pieces for p in ps)} tensors",
              disable=not progress, leave=False) as bar:
        arrays = _read_ahead(source, names)
        try:
            leaves = {}
            for spec, ps in pieces:
                local = []
                for piece in ps:
                    parts = []
                    with jax.default_device(piece.devices[0]) if piece.devices else contextlib.nullcontext():
                        for name, kind in piece.tensors:
                            w = jnp.asarray(next(arrays))
                            s = jnp.asarray(next(arrays)) if kind in ("fp8", "mxfp4") else None
                            parts.append(fmt.decode(spec, kind, w, s, dtype))
                            bar.update(w.nbytes + (0 if s is None else s.nbytes))
                    local.append(jax.tree.map(lambda *xs: jnp.stack(xs), *parts) if spec.stacked else parts[0])
                leaves[spec.path] = local[0] if placement is None else _assemble(spec, ps, local, placement(spec))
        finally:
            arrays.close()   # the reader stops before the caller closes the source
    return build_tree(cfg, leaves)


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Tensors of one parameter read together: a slice ``rows`` of an expert stack (all of it
    unstacked), converted on ``devices[0]`` and held by ``devices`` (none: the default device)."""
    tensors: list[tuple[str, str]]
    rows: slice
    devices: tuple = ()


def _pieces(spec: ParamSpec, tensors: list[tuple[str, str]], sharding) -> list[_Piece]:
    """What this process reads of ``spec``: whole, or under ``sharding`` the expert slices its
    devices hold, each once."""
    whole = slice(0, len(tensors))
    if sharding is None:
        return [_Piece(tensors, whole)]
    if not spec.stacked:
        return [_Piece(tensors, whole, tuple(sharding.addressable_devices))]
    held: dict[tuple[int, int], list] = {}
    for device, index in sharding.addressable_devices_indices_map((len(tensors),)).items():
        rows = index[0].indices(len(tensors))[:2]
        held.setdefault(rows, []).append(device)
    return [_Piece(tensors[a:b], slice(a, b), tuple(devs)) for (a, b), devs in sorted(held.items())]


def _assemble(spec: ParamSpec, pieces: list[_Piece], local: list, sharding) -> Any:
    """One global array per leaf from this process's ``local`` pieces (each leaf's first axis is
    the expert axis of a stacked ``spec``): every addressable device gets its index of it."""
    def leaf(*arrays):
        n = len(spec.names)
        shape = (n, *arrays[0].shape[1:]) if spec.stacked else arrays[0].shape
        shards = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            at = next(i for i, p in enumerate(pieces) if device in p.devices)
            if spec.stacked:   # the index's expert rows, relative to the piece's first
                start = pieces[at].rows.start
                first = index[0].indices(n)
                index = (slice(first[0] - start, first[1] - start), *index[1:])
            shards.append(jax.device_put(arrays[at][index], device))
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return jax.tree.map(leaf, *local)


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
