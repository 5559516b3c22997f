"""Quantisers, RoPE tables and Engram hashing against independent host implementations."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import GOLDEN
from model import quant
from pallas_kernels.block_scaled import e2m1_code, e2m1_value, pow2_scale
from model.config import ModelConfig
from model.engram_hash import EngramHashTables, engram_hash
from model.rope import inv_freq
from test_config import flash_config


def test_e2m1_rounds_ties_to_even():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 4.9, 6.0, -0.75, -5.0, -0.0], np.float32)
    want = np.array([0, 1, 1, 2, 2, 4, 4, 0.5, 4, 6, -1, -4, -0.0], np.float32)
    got = np.asarray(e2m1_value(e2m1_code(jnp.asarray(x))))
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[-1])


def test_pow2_scale():
    x = np.array([1.0, 0.5, 3.0, 0.3, 2.0 ** -100, 448.0], np.float32)
    np.testing.assert_array_equal(np.asarray(pow2_scale(jnp.asarray(x), 1.0)),
                                  np.array([1, 0.5, 4, 0.5, 2.0 ** -100, 512], np.float32))


def _pow2ceil_np(t):
    return np.exp2(np.ceil(np.log2(t.astype(np.float64)))).astype(np.float32)


def test_fp8_block32_matches_ml_dtypes():
    x = (np.random.default_rng(0).normal(size=(9, 64)) * np.exp2(np.arange(9))[:, None]).astype(np.float32)
    b = x.reshape(9, 2, 32)
    s = _pow2ceil_np(np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4) / 448)
    want = (np.clip(b / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(quant.fp8_block32(jnp.asarray(x))), want)


def _e2m1_np(v):
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    mag = np.abs(v)[..., None]
    idx = np.abs(mag - grid).argmin(-1)
    # exact midpoints: choose the even code (codes 0,2,4,6 are 0,1,2,4)
    dist = np.abs(mag - grid)
    tie = (np.sort(dist, -1)[..., 1] == np.sort(dist, -1)[..., 0])
    lower = np.where(tie, np.argmin(dist, -1), idx)
    idx = np.where(tie & (lower % 2 == 1), lower + 1, lower)
    return np.where(np.signbit(v), -grid[idx], grid[idx])


def test_fp4_quantisers_match_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    b = x.reshape(5, 2, 32)
    s = _pow2ceil_np(np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0 ** -126) / 6)
    want = (_e2m1_np(np.clip(b / s, -6, 6)) * s).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(quant.fp4_block32(jnp.asarray(x))), want, rtol=0, atol=0)
    b = x.reshape(5, 4, 16)
    s = (np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0 ** -9) / 6).astype(ml_dtypes.float8_e4m3fn)
    s = s.astype(np.float32)
    want = (_e2m1_np(np.clip(b / s, -6, 6)) * s).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(quant.nvfp4_block16(jnp.asarray(x))), want, rtol=0, atol=0)


def test_indivisible_dims_stay_unquantised():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 40)).astype(np.float32))
    for fn in (quant.fp8_block32, quant.fp4_block32, quant.nvfp4_block16):
        np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(x))


@pytest.mark.parametrize("head_dim", [128, 40])   # FP4 quantiser on (bf16 operands) / off (fp32)
def test_index_scores_match_float64(head_dim):
    """Indexer scores against float64: with FP4-quantised q and keys the bf16-operand products
    are exact (only fp32 summation rounds); with the quantiser off the fp32 path must be taken,
    since these unquantised values would lose ~3 digits in bf16."""
    from pallas_kernels.indexer import scores_of_one
    exact = quant.fp4_block32_active(head_dim)   # as model.attention decides it
    index_scores = lambda q, w, k: scores_of_one(q, w, k, head_dim ** -0.5, exact)  # noqa: E731
    rng = np.random.default_rng(3)
    span = np.exp2(rng.integers(-6, 7, size=(1, head_dim)))      # channels of very different scales
    q, k = (quant.fp4_block32(jnp.asarray(rng.normal(size=(n, head_dim)) * span, jnp.float32)) for n in (8, 50))
    w = rng.normal(size=8).astype(np.float32)
    got = np.asarray(index_scores(q, jnp.asarray(w), k))
    dots = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
    want = w.astype(np.float64) @ np.maximum(dots, 0) / np.sqrt(head_dim)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # and the q . k product runs on the operand type the quantiser allows
    hlo = jax.jit(index_scores).lower(q, jnp.asarray(w), k).as_text()
    operand = "bf16" if head_dim % 32 == 0 else "f32"
    assert f"(tensor<8x{head_dim}x{operand}>, tensor<50x{head_dim}x{operand}>) -> tensor<8x50xf32>" in hlo


def test_rope_tables_match_reference():
    cfg = ModelConfig.from_json(GOLDEN / "v41_tiny")
    ref = json.loads((GOLDEN / "v41_tiny" / "cases.json").read_text())["rope"]
    for kind in ("main", "compress"):
        np.testing.assert_allclose(inv_freq(cfg, kind), ref[kind]["inv_freq"], rtol=2e-7)


def test_flash_yarn_ramp():
    """For V4.1-Flash the ramp runs from pair 15 (unscaled) to pair 25 (scaled by 1/16)."""
    cfg = flash_config()
    f = inv_freq(cfg, "compress").astype(np.float64)
    g = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(f[:16], g[:16], rtol=1e-6)
    np.testing.assert_allclose(f[25:], g[25:] / 16, rtol=1e-6)
    assert np.all((f[16:25] < g[16:25]) & (f[16:25] > g[16:25] / 16))


def _hash_np(lookback, cfg):
    out = []
    for layer in range(len(cfg.engram_layer_ids)):
        m = cfg.engram_multipliers[layer]
        rolling = lookback[:, 0].astype(np.int64) * m[0]
        cols = []
        for i in range(1, cfg.engram_max_ngram_size):
            rolling = rolling ^ (lookback[:, i].astype(np.int64) * m[i])
            cols += [rolling % p for p in cfg.engram_primes[layer][i - 1]]
        out.append(np.stack(cols, -1) + cfg.engram_offsets[layer])
    return np.stack(out, 1)


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_device_hash_matches_int64(which):
    cfg = ModelConfig.from_json(GOLDEN / "v41_tiny") if which == "tiny" else flash_config()
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.engram_compressed_vocab_size, size=(257, cfg.engram_max_ngram_size)).astype(np.int32)
    ids[:3] = cfg.engram_compressed_vocab_size - 1  # the largest products
    got = np.asarray(engram_hash(jnp.asarray(ids), EngramHashTables.from_config(cfg)))
    np.testing.assert_array_equal(got, _hash_np(ids, cfg))


def test_flash_hash_constants():
    cfg = flash_config()
    np.testing.assert_array_equal(cfg.engram_multipliers[0], [76632096046245, 4839876093313, 35959672319349,
                                                              73987337458391])
    np.testing.assert_array_equal(cfg.engram_multipliers[1], [67716810739261, 51510806800915, 30921347202721,
                                                              82619226485591])
    assert cfg.engram_primes[0][0][0] == 16000057
    assert [sum(sum(p) for p in layer) for layer in cfg.engram_primes] == [384006168, 384016682]


def test_compressed_vocab_matches_fixture():
    from model.engram_vocab import compressed_token_map

    table = compressed_token_map()
    assert len(table) == 129280 and table.max() + 1 == 99092 and table[2] == 2
    np.testing.assert_array_equal(table[:512], np.load(GOLDEN / "v41_tiny" / "engram_compress_map.npy"))
