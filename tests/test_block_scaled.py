"""The one power-of-two scale rule of the block-scaled formats (pallas_kernels.block_scaled)."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model import quant

from pallas_kernels.block_scaled import (FP4_MAX, FP8_MAX, Fp4Keys, Nvfp4Rows, e2m1_scaled, e2m1_value, e4m3_from_bits,
                                         mxfp4_parts, pack_halves, scale_exponent, stored_kind, unpack_halves)


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


def test_fp4_keys_store_grid_values_losslessly():
    """The indexer keys' stored form gives back the fake-quantiser's values bit for bit, over
    blocks of very different magnitudes (subnormal-sized ones and zero blocks included), whether
    stored from the values on the grid or from the raw ones; 68 bytes a 128-channel row."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((300, 128)).astype(np.float32) * np.exp2(rng.integers(-140, 60, (300, 4))).repeat(32, 1)
    x[:5] = 0.0
    on_grid = quant.fp4_block32(jnp.asarray(x))
    for stored in (Fp4Keys.from_float(on_grid), Fp4Keys.from_float(jnp.asarray(x))):
        np.testing.assert_array_equal(np.asarray(stored.dequantized()), np.asarray(on_grid))
    assert stored.codes.nbytes // 300 + stored.scale.nbytes // 300 == 68


def test_e2m1_scaled_builds_every_code_at_every_exponent_exactly():
    code, exponent = np.meshgrid(np.arange(16, dtype=np.int32), np.arange(2, 253, dtype=np.int32))
    got = np.asarray(e2m1_scaled(jnp.asarray(code), jnp.asarray(exponent)))
    want = np.asarray(e2m1_value(jnp.asarray(code))) * np.exp2(exponent - 127.0)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert np.signbit(got[:, 8]).all()   # -0 stays signed


def test_nvfp4_rows_store_the_quantiser_s_values_bit_for_bit():
    """The compressed KV's stored form gives back ``quant.nvfp4_block16``'s values bit for bit,
    over blocks from e4m3's subnormal scales (where re-quantising the values would not be exact)
    up to its largest, zero blocks included; 288 bytes a 512-channel row, two halves packed apart."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((300, 512)).astype(np.float32) * np.exp2(rng.integers(-14, 10, (300, 32))).repeat(16, 1)
    x[:5] = 0.0
    stored = Nvfp4Rows.from_float(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(stored.dequantized()), np.asarray(quant.nvfp4_block16(jnp.asarray(x))))
    assert stored.shape == (300, 512) and stored_kind(stored) == "nvfp4"
    assert stored.codes.nbytes // 300 + stored.scale.nbytes // 300 == 288
    half = np.asarray(Nvfp4Rows.from_float(jnp.asarray(np.where(np.arange(512) < 256, x, 0.0))).codes)
    assert (half[:, :128] == np.asarray(stored.codes)[:, :128]).all() and (half[:, 128:] == 0).all()
    with pytest.raises(ValueError, match="32s"):
        Nvfp4Rows.from_float(jnp.zeros((2, 48)))


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_pack_halves_round_trips(parts):
    codes = np.random.default_rng(parts).integers(0, 16, (3, 64)).astype(np.int32)
    packed = np.asarray(pack_halves(jnp.asarray(codes), parts))
    np.testing.assert_array_equal(np.asarray(unpack_halves(jnp.asarray(packed), parts)), codes)
    width = 64 // parts   # slice p's bytes hold its channels j (low) and j + width / 2 (high)
    np.testing.assert_array_equal(packed[:, :width // 2] & 15, codes[:, :width // 2])
    np.testing.assert_array_equal(packed[:, :width // 2] >> 4, codes[:, width // 2:width])


def test_e4m3_from_bits_decodes_every_byte():
    b = np.array([i for i in range(256) if i & 127 != 127], np.int32)   # all but NaN
    want = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e4m3_from_bits(jnp.asarray(b))), want)
