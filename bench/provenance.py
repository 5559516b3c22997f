"""What a benchmark's numbers were measured on: the commit and the machine (no JAX import).

``commit``: ``MEGAJAX_COMMIT`` where set (the device machine's copy of the tree may carry a stale
git checkout, or none), else this tree's HEAD. ``host``: the CPU, its cores and Python, and the
GPUs ``nvidia-smi`` names where there are any.
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    if os.environ.get("MEGAJAX_COMMIT"):
        return os.environ["MEGAJAX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def host() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out = f"{os.cpu_count()}-core CPU ({cpu}), {platform.platform()}, Python {platform.python_version()}"
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return out
    names = [g.strip() for g in gpus if g.strip()]
    return f"{len(names)} x {names[0]}, " + out if names else out
