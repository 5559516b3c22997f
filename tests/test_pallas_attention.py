"""The Mosaic GPU sparse sink MQA kernel on CPU: interpret mode against the jnp reference,
``mega.attention`` dispatching to it, and cross-lowering for CUDA at V4.1 shapes.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mega.attention as mega_attention
from mega.attention import attention
from model.quant import fp8_block32_parts
from pallas_kernels.block_scaled import Fp8Pool, Nvfp4Pool, Nvfp4Rows, dequantize_fp8, ue8m0
from pallas_kernels.sparse_attention import sparse_mqa, sparse_mqa_reference

_seeds = itertools.count(1000)


def _key():
    return jax.random.key(next(_seeds))  # fresh inputs for every case


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _fp8_quantise(x):
    """MODEL_SPEC §3.5 FP8 block 32 UE8M0, written out independently of the kernel module:
    s = 2^ceil(log2(max(amax, 1e-4) / 448)) per 32 channels, values e4m3-rounded (RNE)."""
    x = np.asarray(x, np.float32)
    n, d = x.shape
    blocks = x.reshape(n, d // 32, 32)
    amax = np.maximum(np.abs(blocks).max(-1), 1e-4)
    scale = np.exp2(np.ceil(np.log2(amax / np.float32(448)))).astype(np.float32)
    vals = np.clip(blocks / scale[..., None], -448, 448).reshape(n, d)
    exponent = (np.round(np.log2(scale)) + 127).astype(np.uint8)          # the UE8M0 byte
    return jnp.asarray(vals).astype(jnp.float8_e4m3fn), jnp.asarray(scale), jnp.asarray(exponent)


def _spread(key, n, d, block):
    """Random [n, d] rows with a spread of magnitudes across rows and ``block``-channel blocks, so
    the per-block scales differ (one block all but zero: the scale rule's floor)."""
    ka, kb = jax.random.split(key)
    mag = np.exp2(np.asarray(jax.random.randint(kb, (n, d // block), -8, 5))).astype(np.float32)
    mag[0, 0] = 1e-7
    return np.asarray(jax.random.normal(ka, (n, d))) * np.repeat(mag, block, 1)


def _case(t_len, heads, d, pools):
    """Random q, sink and pools [(N, S)], [(N, S, "fp8")] or [(N, S, "nvfp4")], with ragged masks,
    duplicates and a fully masked row; the stored kinds over rows of spread magnitudes."""
    ks = jax.random.split(_key(), 2 + 2 * len(pools))
    q = jax.random.normal(ks[0], (t_len, heads, d), jnp.bfloat16)
    sink = jax.random.normal(ks[1], (heads,), jnp.float32)
    out = []
    for i, (n, s, *kind) in enumerate(pools):
        idx = np.array(jax.random.randint(ks[3 + 2 * i], (t_len, s), -1, n, jnp.int32))
        idx[0, : s // 2] = idx[0, 0]            # duplicate rows count once per slot, like the reference
        idx[min(1, t_len - 1)] = -1             # a query with no visible key in any pool
        idx[-1, ::3] = -1                       # ragged: some empty slots
        idx = jnp.asarray(idx)
        if kind == ["fp8"]:
            kv8, _, exponent = _fp8_quantise(_spread(ks[2 + 2 * i], n, d, 32))
            out.append(Fp8Pool(kv8, exponent, idx))
        elif kind == ["nvfp4"]:
            out.append(Nvfp4Pool(*Nvfp4Rows.from_float(jnp.asarray(_spread(ks[2 + 2 * i], n, d, 16))), idx))
        else:
            out.append(((2 * jax.random.normal(ks[2 + 2 * i], (n, d))).astype(jnp.bfloat16), idx))
    return q, out, sink, min(1, t_len - 1)


@pytest.fixture
def gpu_interpret():
    from jax._src.pallas.mosaic_gpu.interpret import params as ip
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
    try:
        # Uninitialised memory reads as NaN, so any output element the kernel never wrote shows up.
        with ip.force_gpu_interpret_mode(ip.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")):
            yield
    finally:
        reset_gpu_interpret_mode_state()


KERNEL_CASES = [   # (t_len, heads, d, pools, splits, ctas)
    (3, 64, 128, [(300, 64), (200, 100)], 1, None),    # window + compressed pool, S=100 pads to 128
    (2, 128, 256, [(150, 70)], 1, None),               # two head groups, one pool
    (3, 64, 128, [(301, 64, "fp8"), (200, 100)], 1, None),   # V4.1 layout: fp8 window + bf16 compressed
    (2, 64, 256, [(150, 70, "fp8")], 1, None),         # fp8 only (N=150: the scale lines need a pad row)
    (3, 64, 128, [(300, 64), (200, 100)], 3, None),    # flash-decoding: one chunk per split
    (2, 128, 128, [(301, 64, "fp8"), (200, 130)], 2, None),  # splits of 2 chunks crossing the pools
    # persistent CTAs: 10 items (5 tokens x 2 head groups) over 3 CTAs (4, 3, 3), 3 chunks each
    (5, 128, 128, [(300, 64), (200, 100)], 1, 3),
    (3, 64, 128, [(301, 64, "fp8"), (200, 100)], 1, 2),      # fp8 window, 2 CTAs
    (4, 64, 128, [(300, 50)], 1, 2),                         # one chunk per item
    (3, 64, 256, [(150, 64, "fp8"), (120, 100, "nvfp4")], 1, None),   # V4.1 stored: fp8 window + NVFP4 compressed
    (2, 128, 512, [(130, 70, "nvfp4")], 2, None),            # NVFP4 only, at V4.1's D, two head groups, splits
    (5, 64, 256, [(120, 64), (100, 130, "nvfp4")], 1, 2),    # bf16 window + NVFP4, persistent
]


@pytest.mark.parametrize("t_len,heads,d,pools,splits,ctas", KERNEL_CASES)
def test_kernel_matches_reference(gpu_interpret, t_len, heads, d, pools, splits, ctas):
    _check_kernel(t_len, heads, d, pools, splits, ctas)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a Hopper GPU")
@pytest.mark.parametrize("t_len,heads,d,pools,splits,ctas", KERNEL_CASES)
def test_compiled_kernel_matches_reference(t_len, heads, d, pools, splits, ctas):
    """The same cases compiled: the interpreter runs no inline Mosaic GPU code, so only here do
    the cp.async gathers run at D = 128 and 256 (their thread layouts depend on D; the benches
    check D = 512), beside splits and the persistent loop."""
    _check_kernel(t_len, heads, d, pools, splits, ctas)


def _check_kernel(t_len, heads, d, pools, splits, ctas):
    q, pools, sink, masked = _case(t_len, heads, d, pools)
    scale = d ** -0.5
    out = jax.jit(lambda q, p, s: sparse_mqa(q, p, s, scale, splits=splits, ctas=ctas))(q, pools, sink)
    ref = sparse_mqa_reference(q, pools, sink, scale)
    # a stored pool reads as the bf16 pool of its values (they are exact in bf16)
    as_bf16 = [(_dequantized(p).astype(jnp.bfloat16), p[-1]) for p in pools]
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(sparse_mqa_reference(q, as_bf16, sink, scale)))
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any(), "kernel left output elements unwritten (NaN poison)"
    assert _rel_err(out, ref) < 1e-2
    assert np.all(out[masked] == 0.0)                       # sink only: zero output, no NaN
    assert np.abs(out).max() > 0.1                          # and the other rows are not trivial


def _dequantized(pool):
    if isinstance(pool, Nvfp4Pool):
        return Nvfp4Rows(pool.codes, pool.scale).dequantized()
    return dequantize_fp8(pool.kv, pool.scale) if isinstance(pool, Fp8Pool) else pool[0].astype(jnp.float32)


@pytest.mark.parametrize("stored", [False, True])
def test_model_attention_dispatches_to_the_kernel(monkeypatch, stored):
    """``mega.attention`` (q RoPE, kernel, inverse RoPE) through the interpreted kernel equals
    its reference path on the same inputs with a real rotation; the pools in bf16 or in their
    stored forms (an FP8 window: values, UE8M0 bytes; NVFP4 compressed rows)."""
    t_len, heads, d, half = 3, 64, 256, 32
    q, (win, comp), sink, masked = _case(t_len, heads, d, [(40, 16, "fp8"), (30, 24, "nvfp4")] if stored
                                         else [(40, 16), (30, 24)])
    window_kv = (win.kv, win.scale) if stored else win[0]
    comp_kv = Nvfp4Rows(comp.codes, comp.scale) if stored else comp[0]
    angles = jax.random.uniform(_key(), (t_len, half), minval=0, maxval=6.28)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    run = lambda: attention(q, cos, sin, window_kv, win[-1], comp_kv, comp[-1], sink, d ** -0.5)  # noqa: E731
    monkeypatch.setenv("MEGAJAX_KERNELS", "reference")
    ref = np.asarray(run(), np.float32)
    monkeypatch.setenv("MEGAJAX_KERNELS", "interpret")
    calls = []
    monkeypatch.setattr(mega_attention, "sparse_mqa", lambda *a, **k: calls.append(1) or sparse_mqa(*a, **k))
    got = np.asarray(run(), np.float32)
    assert calls  # the kernel ran
    assert np.isfinite(got).all() and np.all(got[masked] == 0)
    assert _rel_err(got, ref) < 1e-2


def test_fp8_quantiser_matches_the_spec():
    x = np.asarray(jax.random.normal(_key(), (64, 512))) * np.exp2(np.asarray(jax.random.randint(_key(), (64, 512), -20, 20)))
    x[3, 32:64] = 0.0                                                 # amax floor
    kv8, scale = fp8_block32_parts(jnp.asarray(x))
    want8, want_scale, want_exponent = _fp8_quantise(x)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(kv8, np.float32), np.asarray(want8, np.float32))
    s = np.asarray(scale)
    assert np.all(np.exp2(np.round(np.log2(s))) == s)                 # powers of two
    np.testing.assert_array_equal(np.asarray(ue8m0(scale)), np.asarray(want_exponent))
    deq = np.asarray(dequantize_fp8(kv8, ue8m0(scale)))
    assert np.all(np.abs(deq - x) <= np.abs(x) / 16 + np.repeat(s, 32, 1) * 2 ** -9)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("kinds", ["bf16", "fp8+bf16", "fp8", "fp8+nvfp4"])   # window + compressed pool kinds
# decode with 64 requests, prefill on a persistent grid, decode with 8 requests (key splits)
@pytest.mark.parametrize("t_len,splits,ctas", [(4 * 64, 1, None), (4096, 1, 132), (4 * 8, 4, None)])
def test_cross_lowering_v41_shapes(t_len, splits, ctas, kinds):
    """Lowering for CUDA runs Mosaic GPU's layout, transfer and shared-memory checks at H=64, D=512
    (226 KB of 227 for every mix of pool kinds: the fp8 view lies inside the bf16 slots), and the inline cp.async
    gather that the interpreter does not run."""
    heads, d = 64, 512
    q = jax.ShapeDtypeStruct((t_len, heads, d), jnp.bfloat16)

    def pool(n, s, kind):
        idx = jax.ShapeDtypeStruct((t_len, s), jnp.int32)
        if kind == "fp8":
            return Fp8Pool(jax.ShapeDtypeStruct((n, d), jnp.float8_e4m3fn),
                           jax.ShapeDtypeStruct((n, d // 32), jnp.uint8), idx)
        if kind == "nvfp4":
            return Nvfp4Pool(jax.ShapeDtypeStruct((n, d // 2), jnp.uint8),
                             jax.ShapeDtypeStruct((n, d // 16), jnp.float8_e4m3fn), idx)
        return jax.ShapeDtypeStruct((n, d), jnp.bfloat16), idx

    names = {"bf16": ("bf16", "bf16"), "fp8+bf16": ("fp8", "bf16"), "fp8": ("fp8", "fp8"),
             "fp8+nvfp4": ("fp8", "nvfp4")}[kinds]
    pools = [pool(n, s, k) for (n, s), k in zip([(128 * 256, 128), (32768 * 64, 512)], names)]
    sink = jax.ShapeDtypeStruct((heads,), jnp.float32)
    fn = jax.jit(lambda q, p, s: sparse_mqa(q, p, s, d ** -0.5, splits=splits, ctas=ctas))
    text = fn.trace(q, pools, sink).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_rejects_unsupported_shapes():
    q = jnp.zeros((2, 48, 128), jnp.bfloat16)
    with pytest.raises(ValueError):
        sparse_mqa(q, [(jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32))],
                   jnp.zeros((48,), jnp.float32), 1.0)
    with pytest.raises(ValueError, match="empty"):   # no row 0 for the masked slots to read
        sparse_mqa(jnp.zeros((2, 64, 128), jnp.bfloat16), [(jnp.zeros((0, 128), jnp.bfloat16),
                   jnp.full((2, 8), -1, jnp.int32))], jnp.zeros((64,), jnp.float32), 1.0)


@pytest.mark.parametrize("kw,what", [({"splits": 0}, "splits"),
                                     ({"splits": 3}, "splits"),   # 2 chunks: 3 splits would leave one empty
                                     ({"skip_stages": ("relayout",)}, "skip_stages"),
                                     ({"ctas": 0}, "ctas"), ({"ctas": 3}, "ctas"),   # 2 items
                                     ({"splits": 2, "ctas": 2}, "ctas")])             # 4 items: all needed
def test_rejects_bad_splits_and_stages(kw, what):
    q = jnp.zeros((2, 64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=what):
        sparse_mqa(q, [(jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((2, 128), jnp.int32))],
                   jnp.zeros((64,), jnp.float32), 1.0, **kw)


def test_no_key_chunks_and_no_tokens(gpu_interpret):
    """Every slot masked with no key chunk at all: the sink alone, so zeros (one CTA per item;
    a persistent grid would load a later item's q only after its first chunk); no tokens: an
    empty output."""
    q = jax.random.normal(_key(), (4, 64, 128), jnp.bfloat16)
    pools = [(jnp.ones((4, 128), jnp.bfloat16), jnp.zeros((4, 0), jnp.int32))]
    sink = jnp.zeros((64,), jnp.float32)
    assert np.all(np.asarray(sparse_mqa(q, pools, sink, 1.0), np.float32) == 0.0)
    with pytest.raises(ValueError, match="no key chunk"):
        sparse_mqa(q, pools, sink, 1.0, ctas=2)
    assert sparse_mqa(q[:0], [(pools[0][0], pools[0][1][:0])], sink, 1.0).shape == (0, 64, 128)


def test_launch_splits_keys_at_small_batch_only_and_is_persistent_otherwise():
    from pallas_kernels.sparse_attention_tiles import Launch, launch
    chunks = 128 // 64 + 512 // 64                         # a window of 128 and 512 compressed rows
    assert launch(32, 64, chunks, 132) == Launch(4, 128)   # 10 chunks as 3+3+3+1 over 4 CTAs per token
    assert launch(8, 64, chunks, 132) == Launch(10, 80)    # one chunk each
    assert launch(128, 64, chunks, 132) == Launch(1, 128)  # the tokens alone fill the GPU
    assert launch(4096, 64, chunks, 132) == Launch(1, 132)  # persistent: one CTA per SM
    assert launch(32, 128, chunks, 132) == Launch(2, 128)  # two head groups per token count too
    assert launch(32, 64, chunks, 0) == Launch(1, 32)      # no SM count (interpreted): no split, a CTA an item
    assert launch(32, 64, 0, 132) == Launch(1, 32)         # no key chunk: a CTA an item
    assert launch(32, 64, chunks, 132, splits=2) == Launch(2, 64)
