"""The Mega-mHC pass kernel against its reference, in the Pallas interpreter, and lowered for CUDA.

The interpreter starts outputs as NaN, so a row or channel the kernel never wrote fails the check:
that is the poison. Each case draws fresh bf16 streams, an update with Sinkhorn-like mixing and a
row count that leaves the last block of rows partial.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mega.backend
import mega.mhc
from pallas_kernels.mhc import TILES, Tiles, mhc_pass, mhc_pass_reference, parts_for

BLOCK_T, BLOCK_D = TILES.block_t, TILES.block_d

EPS = 1e-6


def case(rng, t, hc=4, d=2 * BLOCK_D, mix_rows=24, update=True, site=True):
    streams = jnp.asarray(rng.normal(size=(t, hc, d)), jnp.bfloat16)
    comb = rng.random((t, hc, hc)) + 0.1
    upd = (jnp.asarray(rng.normal(size=(t, d)), jnp.bfloat16), jnp.asarray(2 * rng.random((t, hc)), jnp.float32),
           jnp.asarray(comb / comb.sum(1, keepdims=True), jnp.float32)) if update else None
    pre = jnp.asarray(rng.random((t, hc)) + 1e-6, jnp.float32)
    fn = jnp.asarray(rng.normal(size=(mix_rows, hc * d)) * (hc * d) ** -0.5, jnp.float32) if site else None
    return streams, upd, pre, fn


def close(got, want, what, rtol):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol,
                               atol=rtol, err_msg=what)


@pytest.mark.parametrize("t", [BLOCK_T + 5, 3], ids=["partial-second-block", "one-partial-block"])
@pytest.mark.parametrize("update,site", [(True, True), (False, True), (True, False)],
                         ids=["update-and-mix", "first-site", "final-collapse"])
def test_kernel_matches_reference(rng, t, update, site):
    check(rng, t, update, site)


@pytest.mark.parametrize("t,tiles", [(1030, TILES), (260, Tiles(block_t=16, block_d=64))], ids=["default", "16x64"])
def test_programs_walk_several_chunks(rng, t, tiles):
    """17 row blocks of 16 chunks: 8 parts a row block, each walking two chunks; V4.1's decode and
    prefill sizes split as the docstring says."""
    assert parts_for(t, 16, tiles) == 8
    assert parts_for(32, 160) == 160 and parts_for(1024, 160) == 16 and parts_for(16384, 160) == 1
    check(rng, t, True, True, d=16 * tiles.block_d, tiles=tiles)


def check(rng, t, update, site, d=2 * BLOCK_D, tiles=TILES):
    args = case(rng, t, d=d, update=update, site=site)
    got = mhc_pass(*args, eps=EPS, interpret=True, tiles=tiles)
    want = mhc_pass_reference(*args, eps=EPS)
    close(got[0], want[0], "streams", 1e-2)   # bf16: an fp32 sum in another order may round the other way
    close(got[1], want[1], "collapse", 1e-2)
    assert (got[2] is None) == (not site)
    if site:   # the projection of the kernel's own streams (a rounding flip in H' moves it by ~1e-4)
        close(got[2], mhc_pass_reference(got[0], None, *args[2:], eps=EPS)[2], "projection", 1e-5)


def test_reference_matches_fp32_dots(rng):
    """The reference's own shortcuts (broadcast products for the mixing and the collapse, the bf16
    streams projected through fn's three bf16 parts) against fp32 ``HIGHEST`` einsums of the spec's
    formulas: what the kernel is checked against is itself checked."""
    streams, upd, pre, fn = case(rng, 37, d=256)
    got = mhc_pass_reference(streams, upd, pre, fn, eps=EPS)
    hi = jax.lax.Precision.HIGHEST
    y, post, comb = upd
    h = post[..., None] * y.astype(jnp.float32)[:, None] + jnp.einsum("tjk,tjd->tkd", comb, streams.astype(jnp.float32),
                                                                        precision=hi)
    close(got[0], h, "streams", 1e-2)
    h = got[0].astype(jnp.float32)   # the stored H', as both project it
    close(got[1], jnp.einsum("tk,tkd->td", pre, h, precision=hi), "collapse", 1e-2)
    flat = h.reshape(h.shape[0], -1)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + EPS)
    close(got[2], jnp.einsum("ti,oi->to", flat, fn, precision=hi), "projection", 1e-5)


def test_mhc_step_takes_the_kernel_for_bf16_streams(rng, monkeypatch):
    """``mega.mhc.mhc_step`` runs the kernel (here interpreted) where kernels are on, and the
    reference where they are off, with the same coefficients and normalised input; bf16 streams
    of a width in 64s take the kernel."""
    streams, upd, pre, fn = case(rng, 7)
    site = {"fn": fn, "base": jnp.asarray(rng.normal(size=24), jnp.float32),
            "scale": jnp.asarray(rng.random(3) + 0.5, jnp.float32)}
    norm = jnp.asarray(rng.random(streams.shape[-1]) + 0.5, jnp.float32)
    calls = []
    kernel = mega.mhc.mhc_pass
    monkeypatch.setattr(mega.mhc, "mhc_pass", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    def step():
        return mega.mhc.mhc_step(streams, mega.mhc.Update(*upd), site, pre, norm, eps=EPS, hc_eps=1e-6, iters=20)
    monkeypatch.setenv("MEGAJAX_KERNELS", "interpret")
    got = step()
    assert calls and calls[0]["interpret"] is True
    monkeypatch.setenv("MEGAJAX_KERNELS", "reference")
    want = step()
    close(got[0], want[0], "streams", 1e-2)
    close(got[1], want[1], "input", 2e-2)
    for name, g, w in zip(want[2]._fields, got[2], want[2]):
        close(g, w, name, 2e-3)
    monkeypatch.setenv("MEGAJAX_KERNELS", "pallas")
    path = mega.mhc.kernel_path
    assert path(jnp.bfloat16, 5120, 24).kernel and path(jnp.bfloat16, 5120, 0).kernel
    assert "float32" in path(jnp.float32, 5120, 24).text
    assert "does not tile" in path(jnp.bfloat16, BLOCK_D + 8, 24).text
    monkeypatch.setenv("MEGAJAX_KERNELS", "auto")
    assert "no GPU" in path(jnp.bfloat16, 5120, 24).text
    monkeypatch.setattr(mega.backend, "on_gpu", lambda: True)
    assert path(jnp.bfloat16, 5120, 24).kernel


@pytest.mark.parametrize("t", [32, 16384], ids=["decode-8x4", "prefill-16K"])
def test_lowers_for_cuda_at_v41_shapes(t):
    """V4.1-Flash: 4 streams of 5,120, a 24-row mix."""
    sds = jax.ShapeDtypeStruct
    args = (sds((t, 4, 5120), jnp.bfloat16),
            (sds((t, 5120), jnp.bfloat16), sds((t, 4), jnp.float32), sds((t, 4, 4), jnp.float32)),
            sds((t, 4), jnp.float32), sds((24, 4 * 5120), jnp.float32))
    fn = jax.jit(lambda *a: mhc_pass(*a, eps=EPS))
    assert "triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_refuses_a_hidden_size_it_cannot_tile(rng):
    with pytest.raises(ValueError, match="multiple of"):
        mhc_pass(*case(rng, 4, d=BLOCK_D + 8), eps=EPS)
