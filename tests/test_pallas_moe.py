"""MegaMoE's Pallas grouped kernels against their references, in the Mosaic GPU interpreter.

The interpreter starts every buffer as NaN, so an output element the kernel never wrote
fails the finite check: that is the poison. Each case draws fresh random inputs with
ragged, uneven expert loads (empty experts, unused blocks). The real shapes are checked by
lowering for CUDA here (shared-memory budget, layouts) and by ``bench/moe_gpu.py`` on the GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

import mega.moe as moe_module
from mega.moe import MoeSpec, aligned_layout, moe
from pallas_kernels.block_scaled import Fp4Weight, Fp8Rows, QuantizedWeight
from pallas_kernels.grouped_gemm import (GemmConfig, grouped_matmul, grouped_matmul_reference, grouped_swiglu,
                                         grouped_swiglu_reference)

INTERPRET = InterpretGPUParams(detect_races=True)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("cfg", [GemmConfig(64, 64, 64, 2), GemmConfig(64, 64, 64, 2, compute_wgs=2),
                                 GemmConfig(64, 64, 64, 2, compute_wgs=2, split="n"),
                                 GemmConfig(16, 64, 64, 2, swap_ab=True),
                                 GemmConfig(16, 128, 64, 2, compute_wgs=2, split="n", swap_ab=True),
                                 GemmConfig(64, 64, 64, 2, compute_wgs=2, persistent=True),
                                 GemmConfig(64, 256, 64, 2, compute_wgs=2, persistent=True),
                                 GemmConfig(64, 64, 64, 2, group_m=3),
                                 GemmConfig(64, 64, 64, 2, compute_wgs=2, persistent=True, group_m=3)],
                         ids=["one-warpgroup", "warp-specialised", "warp-specialised-split-n", "swap-ab",
                              "warp-specialised-swap-ab", "persistent", "persistent-four-store-pieces", "grouped-order",
                              "persistent-grouped-order"])
def test_grouped_kernels_match_reference(cfg, rng):
    """Three routed experts (one empty) plus the shared expert as expert id 3; the gate/up
    kernel scales each row by its routing weight in the epilogue. (The interpreter runs
    shared-to-global copies synchronously: the order of the piecewise epilogue's waits is
    checked on the GPU only, by bench/moe_tile_probe.py; here, its slicing and slots.)"""
    e, limit = 3, 2.5
    d = inter = max(128, cfg.block_n)
    sizes = jnp.asarray([rng.integers(1, 2 * cfg.rows), 0, rng.integers(1, cfg.rows),
                         rng.integers(1, cfg.rows)], jnp.int32)
    n = int(sizes.sum())
    dest, block_expert, m_pad = aligned_layout(sizes, n, cfg.rows, e + 1)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 7)
    xs = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    x = jnp.zeros((m_pad, d), jnp.bfloat16).at[dest].set(xs)
    w1, w3 = (jax.random.normal(k, (e, inter, d), jnp.bfloat16) * d ** -0.5 for k in keys[1:3])
    w2 = jax.random.normal(keys[3], (e, d, inter), jnp.bfloat16) * inter ** -0.5
    shared_up = tuple(jax.random.normal(k, (inter, d), jnp.bfloat16) * d ** -0.5 for k in keys[4:6])
    shared_down = jax.random.normal(keys[6], (d, inter), jnp.bfloat16) * inter ** -0.5
    assert (np.asarray(block_expert) == -1).any()  # an unused block is skipped
    row_w = jnp.asarray(rng.uniform(0.1, 2.0, m_pad), jnp.float32)

    h = grouped_swiglu(x, w1, w3, block_expert, limit=limit, shared=shared_up, row_scale=row_w, cfg=cfg,
                       interpret=INTERPRET)
    out = grouped_matmul(h, w2, block_expert, shared=shared_down, cfg=cfg, interpret=INTERPRET)
    h_ref = grouped_swiglu_reference(x, w1, w3, block_expert, limit=limit, rows=cfg.rows,
                                     shared=shared_up, row_scale=row_w)
    out_ref = grouped_matmul_reference(h, w2, block_expert, rows=cfg.rows, shared=shared_down)
    rows = np.asarray(dest)
    for got, want in ((h, h_ref), (out, out_ref)):
        got = np.asarray(got, np.float32)[rows]
        assert np.isfinite(got).all(), "a row of the output was never written"
        assert rel(got, np.asarray(want, np.float32)[rows]) < 1e-2


@pytest.mark.parametrize("m_blocks,n_blocks,group_m", [(7, 5, 3), (4, 9, 4), (6, 2, 8), (5, 3, 0)])
def test_grouped_tile_order_visits_every_tile_once(m_blocks, n_blocks, group_m):
    cfg = GemmConfig(group_m=group_m)
    tiles = [tuple(int(v) for v in cfg.tile_of(jnp.int32(i), m_blocks, n_blocks)) for i in range(m_blocks * n_blocks)]
    assert sorted(tiles) == [(r, c) for r in range(m_blocks) for c in range(n_blocks)]
    if group_m:   # the first band's rows come first, row blocks fastest
        assert tiles[:min(group_m, m_blocks)] == [(r, 0) for r in range(min(group_m, m_blocks))]


def fp8(key, shape):
    """Random weights whose 128 x 128 blocks span scales 2^-6 to 2^0 (each block's scale matters)."""
    *lead, n, k = shape
    spread = 2.0 ** jax.random.randint(jax.random.fold_in(key, 1), (*lead, n // 128, 1, k // 128, 1), -6, 1)
    w = jax.random.normal(key, (*lead, n // 128, 128, k // 128, 128)) * spread
    return QuantizedWeight.from_float(w.reshape(shape) * k ** -0.5)


def mxfp4(key, shape):
    """Random weights whose 32-blocks span scales 2^-6 to 2^0 (each block's scale matters)."""
    spread = 2.0 ** jax.random.randint(jax.random.fold_in(key, 1), (*shape[:-1], shape[-1] // 32, 1), -6, 1)
    w = jax.random.normal(key, shape).reshape(spread.shape[:-1] + (32,)) * spread
    return Fp4Weight.from_float(w.reshape(shape) * shape[-1] ** -0.5)


def fp8_rows(key, x):
    """Rows as ``Fp8Rows``, their 128-column blocks first spread over scales 2^-6 to 2^2."""
    m, k = x.shape
    spread = 2.0 ** jax.random.randint(key, (m, k // 128, 1), -6, 3)
    return Fp8Rows.from_float((x.reshape(m, k // 128, 128) * spread).reshape(m, k))


def test_fp8_rows_rounded_matches_the_stored_form(rng):
    """The references' rounding (no fp8 array: XLA on the GPU elides one) equals what the
    kernels get, across e4m3's subnormals, ties and its largest values."""
    x = fp8_rows(jax.random.key(int(rng.integers(1 << 30))),
                 jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (64, 512)) ** 3)
    dense = x.dequantized()
    exact = Fp8Rows.from_float(dense).dequantized()
    np.testing.assert_array_equal(np.asarray(Fp8Rows.rounded(dense)), np.asarray(exact))
    noisy = dense * (1 + jax.random.uniform(jax.random.key(1), dense.shape, minval=-0.07, maxval=0.07))
    np.testing.assert_array_equal(np.asarray(Fp8Rows.rounded(noisy)), np.asarray(Fp8Rows.from_float(noisy).dequantized()))
    assert (np.abs(np.asarray(x.q, np.float32)) < 2 ** -6).any() and (np.abs(np.asarray(x.q, np.float32)) > 256).any()
    # a block whose largest value is 448 * 2^-13 keeps it at 448 (log2 put such scales one power too high)
    edge = Fp8Rows.from_float(jnp.full((1, 128), 448 * 2.0 ** -13))
    assert float(edge.scale[0, 0]) == 2.0 ** -13 and float(edge.q[0, 0].astype(jnp.float32)) == 448


@pytest.mark.parametrize("cfg", [GemmConfig(16, 64, 128, 2, swap_ab=True), GemmConfig(24, 128, 64, 3, swap_ab=True),
                                 GemmConfig(16, 128, 64, 3, compute_wgs=2, split="n", swap_ab=True),
                                 GemmConfig(16, 64, 256, 2, swap_ab=True),
                                 GemmConfig(16, 128, 256, 2, compute_wgs=2, split="n", swap_ab=True)],
                         ids=["128-deep", "64-deep", "warp-specialised", "256-deep", "warp-specialised-256-deep"])
def test_fp8_activations_match_reference(cfg, rng):
    """W8A8: fp8 rows (a scale per row per 128 columns) times fp8 routed and shared experts,
    with routing weights; the references take the dequantised rows, and ``h`` is requantised
    between the launches as ``mega.moe`` does. With 128-wide tiles the gate/up kernel also
    quantises ``h`` in its epilogue (``fp8_out``): bit for bit ``Fp8Rows.from_float`` of the
    bf16 ``h`` it writes otherwise, and that goes into the down kernel."""
    e, d, inter, limit = 2, 256, 256, 3.0
    sizes = jnp.asarray([rng.integers(1, 100), rng.integers(1, 60), rng.integers(1, 40)], jnp.int32)
    n = int(sizes.sum())
    dest, block_expert, m_pad = aligned_layout(sizes, n, cfg.rows, e + 1)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 9)
    x = fp8_rows(keys[7], jnp.zeros((m_pad, d)).at[dest].set(jax.random.normal(keys[0], (n, d))))
    w1, w3, w2 = fp8(keys[1], (e, inter, d)), fp8(keys[2], (e, inter, d)), fp8(keys[3], (e, d, inter))
    shared_up = fp8(keys[4], (inter, d)), fp8(keys[5], (inter, d))
    shared_down = fp8(keys[6], (d, inter))
    row_w = jnp.asarray(rng.uniform(0.1, 2.0, m_pad), jnp.float32)
    h = grouped_swiglu(x, w1, w3, block_expert, limit=limit, shared=shared_up, row_scale=row_w, cfg=cfg,
                       interpret=INTERPRET)
    rows = np.asarray(dest)
    if cfg.quantizes_h:
        h8 = grouped_swiglu(x, w1, w3, block_expert, limit=limit, shared=shared_up, row_scale=row_w, cfg=cfg,
                            interpret=INTERPRET, fp8_out=True)
        want = Fp8Rows.from_float(h)
        np.testing.assert_array_equal(np.asarray(h8.q, np.float32)[rows], np.asarray(want.q, np.float32)[rows])
        np.testing.assert_array_equal(np.asarray(h8.scale)[:, rows], np.asarray(want.scale)[:, rows])
    else:
        h8 = fp8_rows(keys[8], h)
    out = grouped_matmul(h8, w2, block_expert, shared=shared_down, cfg=cfg, interpret=INTERPRET)
    assert h.dtype == out.dtype == jnp.bfloat16
    for got, want in ((h, grouped_swiglu_reference(x.dequantized(), w1, w3, block_expert, limit=limit,
                                                   rows=cfg.rows, shared=shared_up, row_scale=row_w)),
                      (out, grouped_matmul_reference(h8.dequantized(), w2, block_expert, rows=cfg.rows,
                                                     shared=shared_down))):
        got, want = np.asarray(got, np.float32)[rows], np.asarray(want, np.float32)[rows]
        assert np.isfinite(got).all() and np.abs(want).max() > 0
        assert rel(got, want) < 1e-2


@pytest.mark.parametrize("quantized,cfg", [
    (fp8, GemmConfig(64, 64, 64, 2)), (fp8, GemmConfig(64, 128, 64, 2, compute_wgs=2, split="n")),
    (fp8, GemmConfig(24, 128, 64, 2, swap_ab=True)), (fp8, GemmConfig(16, 64, 128, 2, swap_ab=True)),
    (fp8, GemmConfig(24, 128, 64, 2, compute_wgs=2, split="n", swap_ab=True)),
    (mxfp4, GemmConfig(16, 64, 64, 2, swap_ab=True)), (mxfp4, GemmConfig(24, 128, 128, 3, swap_ab=True))],
    ids=["fp8-one-warpgroup", "fp8-warp-specialised-split-n", "fp8-swap-ab", "fp8-swap-ab-128-deep",
         "fp8-warp-specialised-swap-ab", "mxfp4-swap-ab", "mxfp4-swap-ab-128-deep"])
def test_block_scaled_weights_match_reference(quantized, cfg, rng):
    """fp8 (128 x 128 blocks) or MXFP4 (32-blocks) routed and shared experts, dequantised in
    the kernel (fp8: by one warpgroup, or by two, each its half of the tile's columns)."""
    e, d, inter, limit = 2, 128, 256, 3.0
    sizes = jnp.asarray([rng.integers(1, 100), rng.integers(1, 60), rng.integers(1, 40)], jnp.int32)
    n = int(sizes.sum())
    dest, block_expert, m_pad = aligned_layout(sizes, n, cfg.rows, e + 1)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 7)
    x = jnp.zeros((m_pad, d), jnp.bfloat16).at[dest].set(jax.random.normal(keys[0], (n, d), jnp.bfloat16))
    w1, w3 = quantized(keys[1], (e, inter, d)), quantized(keys[2], (e, inter, d))
    w2 = quantized(keys[3], (e, d, inter))
    shared_up = quantized(keys[4], (inter, d)), quantized(keys[5], (inter, d))
    shared_down = quantized(keys[6], (d, inter))
    h = grouped_swiglu(x, w1, w3, block_expert, limit=limit, shared=shared_up, cfg=cfg,
                       interpret=INTERPRET)
    out = grouped_matmul(h, w2, block_expert, shared=shared_down, cfg=cfg, interpret=INTERPRET)
    rows = np.asarray(dest)
    for got, want in ((h, grouped_swiglu_reference(x, w1, w3, block_expert, limit=limit, rows=cfg.rows,
                                                   shared=shared_up)),
                      (out, grouped_matmul_reference(h, w2, block_expert, rows=cfg.rows, shared=shared_down))):
        got, want = np.asarray(got, np.float32)[rows], np.asarray(want, np.float32)[rows]
        assert np.isfinite(got).all() and np.abs(want).max() > 0
        assert rel(got, want) < 1e-2


def test_aligned_layout_places_every_row_in_its_experts_blocks(rng):
    e, rows = 7, 16
    sizes = rng.integers(0, 40, e)
    sizes[rng.integers(e)] = 0
    n = int(sizes.sum())
    dest, block_expert, m_pad = (np.asarray(a) for a in aligned_layout(jnp.asarray(sizes, jnp.int32), n, rows, e))
    assert len(set(dest.tolist())) == n and dest.max() < m_pad
    expert_of_row = np.repeat(np.arange(e), sizes)
    np.testing.assert_array_equal(block_expert[dest // rows], expert_of_row)
    used = -(-sizes // rows)
    assert (block_expert >= 0).sum() == used.sum()
    assert m_pad <= n + min(e, n) * (rows - 1) + rows


def test_aligned_layout_has_no_loop():
    """A while loop in the step (jnp.searchsorted's default) runs from the host on the GPU,
    outside the step's CUDA graphs, which it splits."""
    hlo = jax.jit(aligned_layout, static_argnums=(1, 2, 3)).lower(jnp.zeros(17, jnp.int32), 96, 64, 17).as_text()
    assert "while" not in hlo


# W8A8 as mega.moe runs it above 16 rows per expert: 64-wide gate/up tiles, h requantised by XLA
H_BY_XLA = GemmConfig(16, 64, 128, 3, swap_ab=True), GemmConfig(16, 128, 128, 3, swap_ab=True)


@pytest.mark.parametrize("w8a8,cfgs", [(False, None), (True, None), (True, H_BY_XLA)],
                         ids=["bf16", "w8a8", "w8a8-h-by-xla"])
def test_moe_pallas_path_matches_reference_path(monkeypatch, rng, w8a8, cfgs):
    """The full MegaMoE op (routing, dispatch, kernels, combine, shared expert) through the
    interpreted kernels equals the reference path on the same bf16 inputs; W8A8 (fp8 experts,
    fp8 rows), both paths round the rows alike (``h`` too: at decode sizes in the gate/up
    kernel's epilogue), and that rounding shows. ``cfgs``: the kernels' configs forced."""

    t, d, inter, e = 19, 256, 256, 4
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 8)
    bf = jnp.bfloat16
    p = {"gate": jax.random.normal(keys[0], (e, d)) * d ** -0.5,
         "bias": jnp.array([2.0, 0.0, 0.0, -9.0]), "bias_vl": jnp.zeros(e),
         "w1": jax.random.normal(keys[1], (e, inter, d), bf) * d ** -0.5,
         "w3": jax.random.normal(keys[2], (e, inter, d), bf) * d ** -0.5,
         "w2": jax.random.normal(keys[3], (e, d, inter), bf) * inter ** -0.5,
         "shared": {"w1": jax.random.normal(keys[4], (inter, d), bf) * d ** -0.5,
                    "w3": jax.random.normal(keys[5], (inter, d), bf) * d ** -0.5,
                    "w2": jax.random.normal(keys[6], (d, inter), bf) * inter ** -0.5}}
    x = jax.random.normal(keys[7], (t, d), bf)
    spec = MoeSpec(top_k=2, routed_scale=1.5, swiglu_limit=3.0, fp8_activations=w8a8)
    if w8a8:
        p = moe_module.quantize_experts(p, "fp8")
    monkeypatch.setenv("MEGAJAX_KERNELS", "reference")
    want = moe(x, p, spec)
    if w8a8:   # the rows' fp8 rounding is visible against bf16 rows
        unrounded = moe(x, p, MoeSpec(top_k=2, routed_scale=1.5, swiglu_limit=3.0))
        assert rel(np.asarray(unrounded, np.float32), np.asarray(want, np.float32)) > 5e-3
    monkeypatch.setenv("MEGAJAX_KERNELS", "interpret")
    if cfgs is not None:
        monkeypatch.setattr(moe_module, "tiles", lambda *a: cfgs)
    calls = []
    monkeypatch.setattr(moe_module, "grouped_swiglu", lambda *a, **k: calls.append(k) or grouped_swiglu(*a, **k))
    got = moe(x, p, spec)
    assert calls and calls[0]["shared"] is not None  # the kernels ran, with the shared expert fused
    assert calls[0]["fp8_out"] == (w8a8 and cfgs is None)   # (W8A8 at decode sizes: h quantised in the epilogue)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 1e-2


def fp8_sds(shape):
    """An fp8 ``QuantizedWeight`` of ``shape`` as abstract arrays, for tracing only."""
    sds = jax.ShapeDtypeStruct
    e, n, k = shape
    return QuantizedWeight(sds(shape, jnp.float8_e4m3fn), sds((e, n // 128, k // 128), jnp.float32),
                           sds((e, n // 128, 32 * -(-k // 4096)), jnp.float32), sds((e, n // 128), jnp.float32))


@pytest.mark.parametrize("up,down,fmt", [
    (GemmConfig(64, 64, 64, 4), GemmConfig(64, 128, 64, 4), "bf16"),   # the decode-size default
    (GemmConfig(128, 64, 64, 3, compute_wgs=2), GemmConfig(128, 128, 64, 3, compute_wgs=2), "bf16"),
    (GemmConfig(64, 128, 64, 4, 2, "n"), GemmConfig(64, 256, 64, 4, 2, "n"), "bf16"),
    (GemmConfig(16, 64, 64, 6, swap_ab=True), GemmConfig(16, 256, 64, 4, swap_ab=True), "bf16"),
    (GemmConfig(128, 64, 64, 4, swap_ab=True), GemmConfig(128, 128, 64, 4, swap_ab=True), "bf16"),
    (GemmConfig(128, 64, 64, 3, 2, persistent=True), GemmConfig(128, 128, 64, 3, 2, persistent=True), "bf16"),
    (GemmConfig(64, 128, 64, 4, 2, persistent=True), GemmConfig(64, 256, 64, 4, 2, persistent=True), "bf16"),
    (GemmConfig(64, 128, 64, 4, 2, group_m=8), GemmConfig(64, 256, 64, 3, 2, group_m=8), "bf16"),   # from 128 rows
    # widths no multiple of 64: each warpgroup stores its rows of the tile whole (moe_gpu's LARGE_CONFIGS)
    (GemmConfig(64, 144, 64, 3, 2, persistent=True), GemmConfig(64, 160, 64, 4, 2, persistent=True), "bf16"),
    # fp8: tiles within a 128 x 128 scale block; two warpgroups split its columns
    (GemmConfig(64, 128, 64, 4), GemmConfig(64, 128, 64, 4), "fp8"),
    (GemmConfig(64, 128, 64, 4, 2, "n"), GemmConfig(64, 128, 64, 4, 2, "n"), "fp8"),
    (GemmConfig(16, 128, 64, 4, swap_ab=True), GemmConfig(16, 128, 64, 4, swap_ab=True), "fp8"),
    (GemmConfig(16, 64, 128, 4, swap_ab=True), GemmConfig(16, 128, 128, 3, swap_ab=True), "fp8"),  # 128-deep
    (GemmConfig(32, 64, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 3, swap_ab=True), "fp8"),  # up to 16 rows
    (GemmConfig(128, 64, 64, 4, swap_ab=True), GemmConfig(128, 128, 64, 3, swap_ab=True), "fp8"),  # from 65 rows
    (GemmConfig(32, 128, 64, 6, 2, "n", swap_ab=True), GemmConfig(32, 128, 64, 6, 2, "n", swap_ab=True), "fp8"),
    (GemmConfig(32, 128, 64, 6, 2, "n", swap_ab=True), GemmConfig(32, 128, 64, 6, 2, "n", swap_ab=True), "bf16"),
    # MXFP4: 4-bit loads, the per-32 scale rows, a wgmma per 32-wide slice
    (GemmConfig(16, 64, 128, 4, swap_ab=True), GemmConfig(16, 128, 128, 3, swap_ab=True), "mxfp4"),
    (GemmConfig(64, 64, 256, 3, swap_ab=True), GemmConfig(64, 128, 256, 3, swap_ab=True), "mxfp4"),
    (GemmConfig(128, 64, 64, 4, swap_ab=True), GemmConfig(128, 128, 64, 3, swap_ab=True), "mxfp4"),
    # W8A8: fp8 rows and fp8 weights, both straight from shared memory
    (GemmConfig(32, 64, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 3, swap_ab=True), "w8a8"),
    (GemmConfig(64, 64, 128, 4, swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True), "w8a8"),
    # W8A8 with h quantised in the gate/up epilogue (128-wide tiles: one scale block)
    (GemmConfig(16, 128, 128, 4, swap_ab=True), GemmConfig(16, 128, 128, 4, swap_ab=True), "w8a8"),
    (GemmConfig(32, 128, 128, 4, swap_ab=True), GemmConfig(32, 128, 128, 3, swap_ab=True), "w8a8"),
    # W8A8 warp specialised: each compute warpgroup 64 weight rows, the rows shared (the first:
    # mega.moe's pair from 256 rows per expert, the down projection on one warpgroup)
    (GemmConfig(64, 128, 128, 4, 2, "n", swap_ab=True), GemmConfig(64, 128, 128, 3, swap_ab=True), "w8a8"),
    (GemmConfig(32, 128, 128, 4, 2, "n", swap_ab=True), GemmConfig(32, 128, 128, 4, 2, "n", swap_ab=True), "w8a8"),
    # the benches' down tiles of 128 rows (an fp8 wgmma N of 128) beside 64-row gate/up tiles
    (GemmConfig(64, 128, 128, 4, 2, "n", swap_ab=True), GemmConfig(128, 128, 128, 3, 2, "n", swap_ab=True), "w8a8"),
    # 256-deep steps: two scale blocks, the first promoted while the second's wgmmas run
    (GemmConfig(64, 128, 256, 2, 2, "n", swap_ab=True), GemmConfig(64, 128, 256, 3, swap_ab=True), "w8a8"),
])
def test_kernels_lower_for_cuda_at_v41_shapes(up, down, fmt):
    """Mosaic GPU lowering at V4.1-Flash expert shapes (hidden 5120, intermediate 2304):
    layouts and the 227 KiB shared-memory budget are checked without a GPU."""
    e, d, inter, m = 6, 5120, 2304, max(up.rows, down.rows) * 8
    sds = jax.ShapeDtypeStruct

    def weight(shape):
        if fmt == "mxfp4":
            return Fp4Weight(sds(shape, jnp.int4), sds((shape[0], shape[2] // 32, shape[1]), jnp.float16),
                             sds(shape[:1], jnp.float32))
        return fp8_sds(shape) if fmt in ("fp8", "w8a8") else sds(shape, jnp.bfloat16)

    def rows(k):
        if fmt == "w8a8":
            return Fp8Rows(sds((m, k), jnp.float8_e4m3fn), sds((k // 128, m), jnp.float32))
        return sds((m, k), jnp.bfloat16)
    fp8_out = fmt == "w8a8" and up.quantizes_h
    jax.jit(lambda x, a, b, i, s: grouped_swiglu(x, a, b, i, limit=10.0, row_scale=s, cfg=up, fp8_out=fp8_out)).trace(
        rows(d), weight((e, inter, d)), weight((e, inter, d)), sds((m // up.rows,), jnp.int32), sds((m,), jnp.float32)
    ).lower(lowering_platforms=("cuda",))
    jax.jit(lambda h, w, i: grouped_matmul(h, w, i, cfg=down)).trace(
        rows(inter), weight((e, d, inter)), sds((m // down.rows,), jnp.int32)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("kw", [{"split": "k"}, {"block_n": 96, "compute_wgs": 5, "split": "n"},
                                {"swap_ab": True, "compute_wgs": 2},
                                {"swap_ab": True, "compute_wgs": 2, "split": "n", "block_n": 64},
                                {"swap_ab": True, "block_m": 12}, {"persistent": True}, {"group_m": -1}])
def test_gemm_config_rejects_a_split_it_cannot_do(kw):
    with pytest.raises(ValueError, match="split|swap_ab|persistent|group_m"):
        GemmConfig(**kw)


def test_warp_specialised_tiles_refuse_mixed_weight_kinds():
    """fp8 routed experts beside a bf16 shared expert: one kind of pipeline buffer per launch."""
    sds = jax.ShapeDtypeStruct
    with pytest.raises(NotImplementedError, match="one kind"):
        jax.jit(lambda x, a, s, i: grouped_matmul(x, a, i, shared=s, cfg=GemmConfig(64, 128, 64, 2, 2, "n"))).trace(
            sds((256, 256), jnp.bfloat16), fp8_sds((2, 256, 256)), sds((256, 256), jnp.bfloat16),
            sds((4,), jnp.int32))


def test_fp8_weights_refuse_persistent_ctas():
    sds = jax.ShapeDtypeStruct
    w = fp8_sds((2, 256, 256))
    with pytest.raises(NotImplementedError, match="persistent"):
        jax.jit(lambda x, a, i: grouped_matmul(x, a, i, cfg=GemmConfig(64, 128, 64, 2, 2, "n", persistent=True))).trace(
            sds((256, 256), jnp.bfloat16), w, sds((4,), jnp.int32))
