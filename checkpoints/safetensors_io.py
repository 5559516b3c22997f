"""Safetensors files read one tensor at a time through a memory map, and written shard by shard.

The ``safetensors`` package's numpy loader knows no fp8 dtype, and the V4.1 release is mostly
``F8_E4M3``, ``F8_E8M0`` and ``I8``, so megajax reads the format itself (an 8-byte header length,
a JSON header of ``{name: {dtype, shape, data_offsets}}``, then the bytes). ``Shards`` opens a
checkpoint directory (``model.safetensors``, or the shards ``model.safetensors.index.json``
names) from the headers alone; ``read(name)`` copies one tensor out of its file's map and then
drops those pages, so a load holds about one tensor in host memory, not the model. ``F8_E8M0``
(UE8M0 scale bytes, ``2**(e - 127)``) and ``I8`` (two packed e2m1 codes) are read as uint8: their
bits are what the formats decode.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
# safetensors dtype name -> the numpy dtype a tensor is read as
DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E8M0": np.dtype(np.uint8), "I8": np.dtype(np.uint8),
    "U8": np.dtype(np.uint8), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
}
_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


class SafetensorsError(ValueError):
    """A safetensors file or index that cannot be read (the message names the file or tensor)."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # the safetensors name: "F8_E4M3", "BF16", ...
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise SafetensorsError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: cannot read its safetensors header: {e}") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            info = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), 8 + n + begin, end - begin)
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name} has a malformed header entry {meta}") from None
        if info.dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has dtype {info.dtype}, which megajax does not read")
        want = DTYPES[info.dtype].itemsize * int(np.prod(info.shape, dtype=np.int64))
        if info.nbytes != want or info.start + info.nbytes > size:
            raise SafetensorsError(f"{path}: tensor {name} ({info.dtype} {list(info.shape)}) should take {want} "
                                   f"bytes; its header gives {info.nbytes} at offset {info.start} of {size}")
        out[name] = info
    return out


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its index names, else every one there."""
    index = model_dir / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({model_dir / f for f in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SafetensorsError(f"{index} is not a valid safetensors index: {e!r}") from None
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise SafetensorsError(f"shards named by {index} are missing: {missing}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SafetensorsError(f"no safetensors files in {model_dir}")
    return files


class Shards:
    """Every tensor of a checkpoint directory, by name; ``read`` maps one at a time."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for f in shard_files(self.dir):
            for name, info in read_header(f).items():
                if name in self.tensors:
                    raise SafetensorsError(f"tensor {name} is in both {self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = info
        self._maps: dict[Path, tuple[int, mmap.mmap]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        """A host copy of tensor ``name``; the file's pages it touched are released."""
        info = self.tensors[name]
        if info.file not in self._maps:
            fd = os.open(info.file, os.O_RDONLY)
            self._maps[info.file] = fd, mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        mm = self._maps[info.file][1]
        dtype = DTYPES[info.dtype]
        out = np.frombuffer(mm, dtype, info.nbytes // dtype.itemsize, info.start).reshape(info.shape).copy()
        page = mmap.PAGESIZE
        lo = info.start // page * page
        if hasattr(mm, "madvise") and info.nbytes:
            mm.madvise(mmap.MADV_DONTNEED, lo, info.start + info.nbytes - lo)
        return out

    def close(self) -> None:
        for fd, mm in self._maps.values():
            mm.close()
            os.close(fd)
        self._maps.clear()

    def __enter__(self) -> "Shards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dtype_name(a: np.ndarray, raw: str | None = None) -> str:
    """The safetensors dtype of ``a``; uint8 arrays need ``raw`` ("F8_E8M0", "I8" or "U8")."""
    if a.dtype == np.uint8:
        if raw not in ("F8_E8M0", "I8", "U8"):
            raise ValueError("uint8 tensors are written as F8_E8M0, I8 or U8: say which")
        return raw
    return _NAMES[a.dtype]


def write_shards(out_dir: str | Path, tensors: Iterable[tuple[str, np.ndarray, str | None]],
                 max_shard_bytes: int = 5 << 30) -> list[Path]:
    """Write ``(name, array, raw dtype or None)`` in order into shards of at most
    ``max_shard_bytes`` (a larger tensor gets a shard of its own), with an index when there is
    more than one; returns the files. Each tensor goes to a shard's data file as it comes, so
    the writer holds one tensor at a time."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done: list[_Shard] = []
    shard = _Shard(out_dir / ".shard-0.data")
    seen: set[str] = set()
    for name, array, raw in tensors:
        if name in seen:
            raise ValueError(f"tensor {name} written twice")
        seen.add(name)
        array = np.ascontiguousarray(array)
        if shard.entries and shard.size + array.nbytes > max_shard_bytes:
            done.append(shard)
            shard.data.close()
            shard = _Shard(out_dir / f".shard-{len(done)}.data")
        shard.add(name, array, dtype_name(array, raw))
    shard.data.close()
    done.append(shard)
    n = len(done)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    paths = [s.finish(out_dir / name) for s, name in zip(done, names)]
    if n > 1:
        index = {"metadata": {"total_size": sum(s.size for s in done)},
                 "weight_map": {e: names[k] for k, s in enumerate(done) for e in sorted(s.entries)}}
        (out_dir / INDEX).write_text(json.dumps(index, indent=1))
    return paths


class _Shard:
    """One shard being written: its tensors' bytes in a data file, its header kept aside."""

    def __init__(self, data_path: Path):
        self.data_path = data_path
        self.data = open(data_path, "wb")
        self.entries: dict[str, dict] = {}
        self.size = 0

    def add(self, name: str, array: np.ndarray, dtype: str) -> None:
        self.entries[name] = {"dtype": dtype, "shape": list(array.shape),
                              "data_offsets": [self.size, self.size + array.nbytes]}
        self.data.write(array.reshape(-1).view(np.uint8).data)
        self.size += array.nbytes

    def finish(self, path: Path) -> Path:
        blob = json.dumps({**self.entries, "__metadata__": {"format": "pt"}}, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        with open(path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(len(blob).to_bytes(8, "little"))
            out.write(blob)
            shutil.copyfileobj(data, out, 64 << 20)
        self.data_path.unlink()
        return path
