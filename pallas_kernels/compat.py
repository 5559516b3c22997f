"""Mosaic GPU API differences between the JAX versions megajax runs on (0.10 CPU, 0.11 GPU)."""
from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def transposed(ref):
    """A 2-D shared-memory ref viewed transposed (``plgpu.transpose_ref`` until 0.11, then
    ``ref.transpose``; 0.11 deprecates the former)."""
    if jax.__version_info__ < (0, 11):
        return plgpu.transpose_ref(ref, (1, 0))
    return ref.transpose((1, 0))
