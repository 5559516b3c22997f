"""The KV state in its stored forms (``init_state(quantized_kv=True)``: FP8 window rings, NVFP4
compressed pools) serves the same KV as the plain state: the model fake-quantises both anyway,
so the logits and the stored rows, dequantised, must match the default state's bit for bit."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from model.batch import pack_requests
from model.forward import forward_jit
from model.state import Fp8Ring, init_state
from pallas_kernels.block_scaled import Nvfp4Rows, dequantize_fp8


def _run(tiny, state, ids, calls):
    logits, pos = [], 0
    for n in calls:   # a prefill, a chunk that wraps the ring, then decode steps
        batch = pack_requests([(0, ids[pos:pos + n], pos)], pad_to=64 if n > 1 else 1)
        out, state = forward_jit(tiny.params, tiny.cfg, state, batch, tiny.emap)
        logits.append(np.asarray(out)[:n])
        pos += n
    return np.concatenate(logits), state


def test_stored_kv_matches_the_plain_state(tiny):
    ids = tiny.cases["c50_chunked"]["prompt_ids"]
    calls = [20, len(ids) - 23, 1, 1, 1]
    want, plain = _run(tiny, init_state(tiny.cfg, 1, 64, page_size=16), ids, calls)
    got, stored = _run(tiny, init_state(tiny.cfg, 1, 64, page_size=16, quantized_kv=True), ids, calls)
    np.testing.assert_array_equal(got, want)
    for ring, ref in zip(stored.window, plain.window):
        assert isinstance(ring, Fp8Ring) and ring.values.dtype == jnp.float8_e4m3fn and ring.scale.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(dequantize_fp8(ring.values, ring.scale)), np.asarray(ref))
    assert stored.comp_kv
    for pool, ref in zip(stored.comp_kv, plain.comp_kv):
        assert isinstance(pool, Nvfp4Rows) and pool.codes.shape == (ref.shape[0], ref.shape[1] // 2)
        np.testing.assert_array_equal(np.asarray(pool.dequantized()), np.asarray(ref))
        assert np.abs(np.asarray(ref)).max() > 0   # entries were written


def test_stored_kv_needs_whole_scale_blocks(tiny):
    with pytest.raises(ValueError, match="quantized_kv needs head_dim"):
        init_state(dataclasses.replace(tiny.cfg, head_dim=48), 1, 64, quantized_kv=True)
