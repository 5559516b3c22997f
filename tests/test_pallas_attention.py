"""The Mosaic GPU sparse sink MQA kernel on CPU: interpret mode against the jnp reference,
``mega.attention`` dispatching to it, and cross-lowering for CUDA at V4.1 shapes.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mega.attention import attention
from pallas_kernels.sparse_attention import sparse_mqa, sparse_mqa_reference

_seeds = itertools.count(1000)


def _key():
    return jax.random.key(next(_seeds))  # fresh inputs for every case


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _case(t_len, heads, d, pools):
    """Random q, sink and pools [(N, S)], with ragged masks, duplicates and a fully masked row."""
    ks = jax.random.split(_key(), 2 + 2 * len(pools))
    q = jax.random.normal(ks[0], (t_len, heads, d), jnp.bfloat16)
    sink = jax.random.normal(ks[1], (heads,), jnp.float32)
    out = []
    for i, (n, s) in enumerate(pools):
        kv = (2 * jax.random.normal(ks[2 + 2 * i], (n, d))).astype(jnp.bfloat16)
        idx = np.array(jax.random.randint(ks[3 + 2 * i], (t_len, s), -1, n, jnp.int32))
        idx[0, : s // 2] = idx[0, 0]            # duplicate rows count once per slot, like the reference
        idx[min(1, t_len - 1)] = -1             # a query with no visible key in any pool
        idx[-1, ::3] = -1                       # ragged: some empty slots
        out.append((kv, jnp.asarray(idx)))
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


@pytest.mark.parametrize("t_len,heads,d,pools", [
    (3, 64, 128, [(300, 64), (200, 100)]),    # window + compressed pool, S=100 pads to 128
    (2, 128, 256, [(150, 70)]),               # two head groups, one pool
])
def test_kernel_matches_reference(gpu_interpret, t_len, heads, d, pools):
    q, pools, sink, masked = _case(t_len, heads, d, pools)
    scale = d ** -0.5
    out = jax.jit(lambda q, p, s: sparse_mqa(q, p, s, scale))(q, pools, sink)
    ref = sparse_mqa_reference(q, pools, sink, scale)
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any(), "kernel left output elements unwritten (NaN poison)"
    assert _rel_err(out, ref) < 1e-2
    assert np.all(out[masked] == 0.0)                       # sink only: zero output, no NaN
    assert np.abs(out).max() > 0.1                          # and the other rows are not trivial


def test_model_attention_dispatches_to_the_kernel(monkeypatch):
    """``mega.attention`` (q RoPE, kernel, inverse RoPE) through the interpreted kernel equals
    its reference path on the same bf16 inputs with a real rotation."""
    t_len, heads, d, half = 3, 64, 128, 32
    q, (win, comp), sink, masked = _case(t_len, heads, d, [(40, 16), (30, 24)])
    angles = jax.random.uniform(_key(), (t_len, half), minval=0, maxval=6.28)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    run = lambda: attention(q, cos, sin, win[0], win[1], comp[0], comp[1], sink, d ** -0.5)  # noqa: E731
    monkeypatch.setenv("MEGAJAX_KERNELS", "reference")
    ref = np.asarray(run(), np.float32)
    monkeypatch.setenv("MEGAJAX_KERNELS", "interpret")
    got = np.asarray(run(), np.float32)
    assert np.isfinite(got).all() and np.all(got[masked] == 0)
    assert _rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("t_len", [4 * 64, 4096])   # a decode step (64 requests x 4) and a prefill chunk
def test_cross_lowering_v41_shapes(t_len):
    """Lowering for CUDA runs Mosaic GPU's layout, transfer and shared-memory checks at H=64, D=512."""
    heads, d = 64, 512
    q = jax.ShapeDtypeStruct((t_len, heads, d), jnp.bfloat16)
    pools = [(jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((t_len, s), jnp.int32))
             for n, s in [(128 * 256, 128), (32768 * 64, 512)]]
    sink = jax.ShapeDtypeStruct((heads,), jnp.float32)
    fn = jax.jit(lambda q, p, s: sparse_mqa(q, p, s, d ** -0.5))
    text = fn.trace(q, pools, sink).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_rejects_unsupported_shapes():
    q = jnp.zeros((2, 48, 128), jnp.bfloat16)
    with pytest.raises(ValueError):
        sparse_mqa(q, [(jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32))],
                   jnp.zeros((48,), jnp.float32), 1.0)
