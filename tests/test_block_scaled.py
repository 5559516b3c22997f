"""The one power-of-two scale rule of the block-scaled formats (pallas_kernels.block_scaled)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_scaled import FP4_MAX, FP8_MAX, mxfp4_parts, scale_exponent


def _floats(exponents: tuple[int, ...]) -> np.ndarray:
    """Every float32 mantissa at the given biased exponents."""
    m = np.arange(1 << 23, dtype=np.int64)
    return np.concatenate([((e << 23) | m).astype(np.int32).view(np.float32) for e in exponents])


@pytest.mark.parametrize("fmt_max", [FP8_MAX, FP4_MAX, 1.0])
def test_scale_exponent_is_ceil_log2_exactly(fmt_max):
    """Against float64 (exact here: a float32 quotient lies 2^-25 or more from a power of two
    unless it is one), over every mantissa of three binades, their edges included."""
    amax = _floats((1, 127, 200))
    want = np.ceil(np.log2(amax.astype(np.float64) / fmt_max)).astype(np.int64)
    got = np.asarray(scale_exponent(jnp.asarray(amax), fmt_max))
    np.testing.assert_array_equal(got, want)


def test_mxfp4_scale_takes_each_block_within_the_grid():
    """The rule as MXFP4 applies it: each block's amax over its scale lies in (3, 6]."""
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32) * 10.0 ** np.arange(-3, 5)[:, None].repeat(8, 0)
    _, e = mxfp4_parts(jnp.asarray(x))
    ratio = np.abs(x).reshape(64, 8, 32).max(-1) / np.exp2(np.asarray(e, np.float64) - 127)
    assert ((ratio > FP4_MAX / 2) & (ratio <= FP4_MAX)).all()
