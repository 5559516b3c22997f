"""The MXFP4 format (``pallas_kernels.fp4``): checkpoint bytes, quantisation, the f16 bit trick."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_scaled import E2M1, F16_SHIFT, Fp4Weight, mxfp4_parts
from pallas_kernels.fp4 import e2m1_f16


def test_checkpoint_bytes_unpack_low_nibble_first():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(3, 64))
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)
    scale = rng.integers(120, 130, size=(3, 2)).astype(np.uint8)
    w = Fp4Weight.from_packed(packed, scale)
    magnitude = E2M1[codes & 7] * np.where(codes & 8, -1, 1)
    want = magnitude * 2.0 ** (np.repeat(scale, 32, axis=1).astype(np.int32) - 127)
    np.testing.assert_array_equal(np.asarray(w.dequantized()), want.astype(np.float32))


def test_from_float_rounds_each_block_with_its_own_power_of_two():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 96)) * 2.0 ** rng.integers(-8, 8, size=(5, 3)).repeat(32, axis=1)
    _, exponents = mxfp4_parts(jnp.asarray(x, jnp.float32))
    blocks = np.abs(x).reshape(5, 3, 32).max(-1)
    np.testing.assert_array_equal(np.asarray(exponents) - 127, np.ceil(np.log2(blocks / 6)))
    err = np.abs(np.asarray(Fp4Weight.from_float(jnp.asarray(x, jnp.float32)).dequantized()) - x)
    # within half of e2m1's widest gap (2), times the block's scale
    assert (err.reshape(5, 3, 32).max(-1) <= 2.0 ** (np.asarray(exponents) - 127)).all()


def test_kernel_scales_are_relative_to_the_matrix_largest():
    """The kernels' form: f16 block scales over the largest (times 2^14), transposed, and that
    largest as ``top``; a block 2^40 below the largest flushes (beyond f16's subnormals)."""
    exponents = jnp.asarray([[127, 120, 90, 130]], jnp.uint8)   # one row, four 32-blocks
    w = Fp4Weight.from_codes(jnp.ones((1, 128), jnp.int32), exponents)
    assert w.scale.shape == (4, 1) and w.scale.dtype == jnp.float16 and float(w.top) == 8.0
    np.testing.assert_array_equal(np.asarray(w.scale[:, 0], np.float32), [2.0 ** 11, 2.0 ** 4, 0, 2.0 ** 14])


def test_f16_bit_moves_give_every_code_exactly():
    codes = jnp.arange(-8, 8).astype(jnp.int4)   # the 16 bit patterns
    got = np.asarray(e2m1_f16(codes), np.float32) * 2.0 ** F16_SHIFT
    bits = np.arange(-8, 8) & 15
    want = E2M1[bits & 7] * np.where(bits & 8, -1, 1)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[0]) and got[0] == 0   # code 8 is -0
