"""The indexer kernel against its reference, in the Pallas interpreter, and lowered for CUDA.

The interpreter starts the output as NaN, so an entry the kernel never wrote fails the check:
that is the poison. Each case draws fresh FP4-quantised queries and keys, a shuffled page
table (a request's entries are not contiguous in the pool), several rows per request and
visible counts at the edges (none, inside a block, a block's end, all).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mega.indexer
from mega import backend
from model import quant
from pallas_kernels.block_scaled import Fp4Keys
from pallas_kernels.indexer import BLOCK_N, CHUNK, group_rows, index_scores, index_scores_listed, index_scores_reference


def case(rng, heads, head_dim, n, slots=3, rows_per_slot=(1, 4, 3), per_page=16, fp4=False):
    """Queries of ``sum(rows_per_slot)`` rows over ``slots`` requests of ``n`` entries each; the
    keys in bf16, or with ``fp4`` as the model stores them (``Fp4Keys``)."""
    pages = n // per_page
    pool_rows = slots * n + 2 * per_page                       # spare pages: rows no request maps
    order = rng.permutation(pool_rows // per_page)[:slots * pages].reshape(slots, pages)
    entries = np.arange(n)
    rows = order[:, entries // per_page] * per_page + entries % per_page
    slot = np.repeat(np.arange(slots), rows_per_slot)
    t = len(slot)
    visible = rng.integers(0, n + 1, t)
    visible[:4] = [0, n, BLOCK_N, BLOCK_N + 5][:t][:4]
    on_grid = lambda shape: quant.fp4_block32(jnp.asarray(rng.normal(size=shape), jnp.float32))  # noqa: E731
    q = on_grid((t, heads, head_dim))
    keys = on_grid((pool_rows, head_dim))
    keys = Fp4Keys.from_float(keys) if fp4 else keys.astype(jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(t, heads)) * heads ** -0.5, jnp.float32)
    return q, w, keys, jnp.asarray(rows, jnp.int32), jnp.asarray(slot, jnp.int32), jnp.asarray(visible, jnp.int32)


@pytest.mark.parametrize("fp4", [True, False], ids=["fp4-keys", "bf16-keys"])
@pytest.mark.parametrize("heads,head_dim,n", [(16, 64, 192), (64, 128, 64 * CHUNK + 128)],
                         ids=["one-chunk-a-group", "two-chunks-a-group"])
def test_kernel_matches_reference(rng, heads, head_dim, n, fp4):
    q, w, keys, rows, slot, visible = case(rng, heads, head_dim, n, fp4=fp4)
    scale = head_dim ** -0.5
    got = np.asarray(index_scores(q.astype(jnp.bfloat16), w, keys, rows, slot, visible, scale=scale, interpret=True))
    want = np.asarray(index_scores_reference(q, w, keys, rows, slot, visible, scale=scale, exact_bf16=True,
                                             pass_bytes=1 << 30))
    assert not np.isnan(got).any(), "an entry of the output was never written"
    seen = np.arange(n)[None] < np.asarray(visible)[:, None]
    np.testing.assert_array_equal(np.isneginf(got), ~seen)
    assert np.abs(want[seen]).max() > 0
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-5 * np.abs(want[seen]).max())


@pytest.mark.parametrize("fp4", [True, False], ids=["fp4-keys", "bf16-keys"])
def test_rows_are_grouped_by_runs_of_one_request(rng, fp4):
    """A program scores up to ``group_rows`` consecutive rows of one request together (64 heads:
    2): runs longer than that, of one row, and a request whose rows come in two runs."""
    n = 192
    q, w, keys, rows, _, visible = case(rng, 64, 64, n, rows_per_slot=(5, 1, 3), fp4=fp4)
    assert group_rows(64) == 2
    slot = jnp.asarray([0, 0, 0, 1, 0, 0, 2, 2, 2], jnp.int32)
    got = np.asarray(index_scores(q.astype(jnp.bfloat16), w, keys, rows, slot, visible, scale=0.125, interpret=True))
    want = np.asarray(index_scores_reference(q, w, keys, rows, slot, visible, scale=0.125, exact_bf16=True,
                                             pass_bytes=1 << 30))
    seen = np.arange(n)[None] < np.asarray(visible)[:, None]
    np.testing.assert_array_equal(np.isneginf(got), ~seen)
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-5 * np.abs(want[seen]).max())


@pytest.mark.parametrize("fp4", [True, False], ids=["fp4-keys", "bf16-keys"])
def test_listed_kernel_scores_only_the_listed_entries(rng, fp4):
    """Past the candidate source a row scores its candidate blocks' entries alone: a list per row
    with -1 padding and entries past its visible ones, in any order; the scores come in list
    order, -inf at -1 and invisible entries, and equal the full scoring's at the others."""
    n, blocks, block = 256, 16, 8
    q, w, keys, rows, slot, visible = case(rng, 16, 64, n, fp4=fp4)
    t = q.shape[0]
    ids = np.stack([rng.permutation(n // block)[:blocks] for _ in range(t)])
    listed = (ids[:, :, None] * block + np.arange(block)).reshape(t, -1)
    listed[rng.random(listed.shape) < 0.1] = -1
    scale = 64 ** -0.5
    got = np.asarray(index_scores_listed(q.astype(jnp.bfloat16), w, keys, rows, slot, visible, jnp.asarray(listed),
                                         scale=scale, interpret=True))
    want = np.asarray(index_scores_reference(q, w, keys, rows, slot, visible, jnp.asarray(listed), scale=scale,
                                             exact_bf16=True, pass_bytes=1 << 30))
    full = np.asarray(index_scores_reference(q, w, keys, rows, slot, visible, scale=scale, exact_bf16=True,
                                             pass_bytes=1 << 30))
    scored = (listed >= 0) & (listed < np.asarray(visible)[:, None])
    assert got.shape == listed.shape and scored.any() and (~scored).any()
    np.testing.assert_array_equal(np.isfinite(got), scored)
    np.testing.assert_array_equal(np.isfinite(want), scored)
    at = np.take_along_axis(full, np.maximum(listed, 0), 1)
    tol = 1e-5 * np.abs(at[scored]).max()
    np.testing.assert_allclose(got[scored], at[scored], rtol=1e-5, atol=tol)
    np.testing.assert_allclose(want[scored], at[scored], rtol=1e-5, atol=tol)


def test_mega_op_takes_the_kernel_where_it_fits(rng, monkeypatch):
    """``mega.indexer.index_scores`` runs the kernel (here interpreted) for FP4 or bf16 keys of FP4
    values and power-of-two heads, and the reference otherwise, with the same results; FP4 keys
    need head_dim in 64s (a code byte holds a channel of each half, in whole 32-channel blocks)."""
    q, w, keys, rows, slot, visible = case(rng, 16, 64, 128, fp4=True)
    calls = []
    kernel = mega.indexer.index_scores_kernel
    monkeypatch.setattr(mega.indexer, "index_scores_kernel", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    monkeypatch.setenv("MEGAJAX_KERNELS", "interpret")
    got = mega.indexer.index_scores(q, w, keys, rows, slot, visible, None, exact_bf16=True)
    assert calls and calls[0]["interpret"] is True
    monkeypatch.setenv("MEGAJAX_KERNELS", "reference")
    want = mega.indexer.index_scores(q, w, keys, rows, slot, visible, None, exact_bf16=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("MEGAJAX_KERNELS", "pallas")
    path = mega.indexer.kernel_path
    assert path(64, 128, 32768, "fp4", True).kernel and path(64, 128, 32768, "bfloat16", True).kernel
    assert path(16, 32, 32768, "bfloat16", True).kernel and "in 64s" in path(16, 32, 32768, "fp4", True).text
    assert "FP4" in path(64, 40, 32768, "bfloat16", False).text
    assert "float32" in path(64, 128, 32768, "float32", True).text
    assert "2 heads" in path(2, 64, 32768, "fp4", True).text and not path(64, 128, 100, "fp4", True).kernel
    assert backend.interpreting() is False


@pytest.mark.parametrize("t_len,n", [(1024, 65664), (4096, 131328)], ids=["decode-256x4-128K", "prefill-4K-128K"])
@pytest.mark.parametrize("listed", [False, True], ids=["all", "candidates"])
@pytest.mark.parametrize("fp4", [True, False], ids=["fp4-keys", "bf16-keys"])
def test_lowers_for_cuda_at_v41_shapes(t_len, n, listed, fp4):
    """V4.1-Flash: 32 index heads x 128, a 128K context at ratio 2 and 1; past the candidate
    source, 2048 candidate blocks of 8 entries."""
    sds = jax.ShapeDtypeStruct
    keys = (Fp4Keys(sds((256 * n, 64), jnp.uint8), sds((256 * n, 4), jnp.uint8)) if fp4
            else sds((256 * n, 128), jnp.bfloat16))
    args = [sds((t_len, 32, 128), jnp.bfloat16), sds((t_len, 32), jnp.float32), keys,
            sds((256, n), jnp.int32), sds((t_len,), jnp.int32), sds((t_len,), jnp.int32)]
    if listed:
        fn = jax.jit(lambda *a: index_scores_listed(*a, scale=128 ** -0.5))
        args.append(sds((t_len, 2048 * 8), jnp.int32))
    else:
        fn = jax.jit(lambda *a: index_scores(*a, scale=128 ** -0.5))
    assert "triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_refuses_shapes_it_cannot_tile():
    z = jnp.zeros
    small = case(np.random.default_rng(0), 16, 32, 64, fp4=True)   # FP4 keys of 32 channels: one block in all
    with pytest.raises(ValueError, match="in 64s"):
        index_scores(small[0].astype(jnp.bfloat16), *small[1:], scale=1.0)
    with pytest.raises(ValueError, match="powers of two"):   # 12 heads
        index_scores(z((2, 12, 64), jnp.bfloat16), z((2, 12)), z((64, 64), jnp.bfloat16), z((1, 64), jnp.int32),
                     z(2, jnp.int32), z(2, jnp.int32), scale=1.0)
