"""Which implementation a mega operator runs: the Pallas kernel or the pure-jnp reference.

``MEGAJAX_KERNELS`` chooses: ``auto`` (default: kernels on GPU, references elsewhere),
``pallas`` (kernels wherever lowering is possible, CPU included), ``reference``, or ``interpret`` (the
kernels through their interpreters on CPU, Mosaic GPU's or Pallas' own for the Triton-backend
ones: slow, for tests). Kernels also need
bf16 activations and tile-divisible shapes; each operator falls back to its reference
otherwise, so tiny fp32 test models keep the exact reference numerics. The choice is made
when an operator is traced: jitted callers keep the choice of their first trace.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import jax

MODES = ("auto", "pallas", "reference", "interpret")


def on_gpu() -> bool:
    """Whether programs traced now run on a GPU. There XLA runs a while loop from the host, one
    launch at a time outside the step's CUDA graphs, so the model unrolls its loops."""
    return jax.default_backend() == "gpu"


def mode() -> str:
    m = os.environ.get("MEGAJAX_KERNELS", "auto")
    if m not in MODES:
        raise ValueError(f"MEGAJAX_KERNELS={m!r}; expected one of {MODES}")
    if m == "auto":
        return "pallas" if on_gpu() else "reference"
    return m


class Path(NamedTuple):
    """Which implementation an operator runs for its operands, and in words (the start-up log)."""

    kernel: bool
    text: str

    @classmethod
    def reference(cls, why: str) -> "Path":
        return cls(False, f"reference ({why})")


def kernels_off() -> str | None:
    """Why the mega operators run their references whatever the inputs, or None (kernels allowed)."""
    m = mode()
    if m in ("pallas", "interpret"):
        return None
    return "no GPU" if os.environ.get("MEGAJAX_KERNELS", "auto") == "auto" else f"MEGAJAX_KERNELS={m}"


def interpreting() -> bool:
    """``interpret=`` argument for the Triton-backend kernels: whether to run them interpreted."""
    return mode() == "interpret"


def interpret_params():
    """``interpret=`` argument for Mosaic GPU kernels: interpreter params or ``None``."""
    if mode() != "interpret":
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
