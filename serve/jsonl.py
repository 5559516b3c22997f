"""JSONL input and output for the offline CLIs: line-numbered errors, atomic writes."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterator


class InputError(ValueError):
    """A bad input file or line; the message names the file and line."""


def read_objects(path: Path) -> Iterator[tuple[str, dict]]:
    """``(location "path:line", object)`` for every non-blank line; InputError on the first bad one."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{n}: expected a JSON object")
        yield f"{path}:{n}", obj


def write_jsonl(path: Path, rows: list) -> None:
    """Write ``rows`` atomically: a temporary file renamed only once complete."""
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
