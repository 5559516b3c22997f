"""Fake-quantisers as training differentiates them: straight through.

A quantise-dequantise in the forward pass rounds its input; its derivative is zero almost
everywhere (round, integer codes) or rounds the cotangent itself (a cast to fp8 carries the
tangent in fp8, which flushes small gradients to zero). Quantisation-aware training instead
passes the gradient through unchanged, which ``straight_through`` gives any quantiser while its
forward values stay exactly the same.
"""
from __future__ import annotations

from typing import Callable

import jax


def straight_through(quantiser: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``quantiser`` with the identity as its derivative (its output has its input's dtype)."""
    f = jax.custom_jvp(quantiser)
    f.defjvp(lambda primals, tangents: (quantiser(*primals), tangents[0]))
    return f
