"""mega.topk.top_k against lax.top_k: the same values and indices in the same order, ties included."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mega.topk import top_k


@pytest.mark.parametrize("shape,k", [((6, 37), 5), ((6, 5000), 1), ((6, 5000), 16), ((6, 129280 // 8), 20),
                                     ((6, 50 * 128), 20), ((2, 3, 4099), 7), ((6, 300), 0)])
def test_top_k_is_lax_top_k(shape, k):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    print(f"seed={seed}")
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], shape).reshape(-1, shape[-1])
    x = x.at[1].set(jnp.round(x[1] * 2))        # many ties, the k-th among them
    x = x.at[2].set(jnp.where(jax.random.uniform(keys[1], x.shape[1:]) < 0.999, -jnp.inf, x[2]))  # few finite
    x = x.at[3].set(0.0).at[3, ::3].set(-0.0)   # all tied, both zeros
    x = x.at[4].set(-jnp.inf)                   # nothing finite
    x = x.reshape(shape)
    vals, ids = jax.jit(top_k, static_argnums=(1, 2))(x, k, True)
    want_vals, want_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
    np.testing.assert_array_equal(np.signbit(vals), np.signbit(want_vals))
    assert ids.dtype == jnp.int32


@pytest.mark.parametrize("n,dtype", [(131328, jnp.float32), (65664, jnp.float32), (16384, jnp.float32),
                                     (100003, jnp.bfloat16)])
def test_top_k_over_a_threshold_is_lax_top_k(n, dtype):
    """k above GROUP (the indexer's 512 of a 128K context's entries) selects by a threshold:
    lax.top_k's answer for rows spread, tied at the threshold, with fewer than k finite, of
    zeros of both signs, with the top entries crowded into the last groups, and all -inf; rows
    not a multiple of the groups, leading dims."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"seed={seed}")
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (6, n))
    x = x.at[1].set(jnp.round(x[1] * 2))
    x = x.at[2].set(jnp.where(jax.random.uniform(keys[1], (n,)) < 0.995, -jnp.inf, x[2]))
    x = x.at[3].set(0.0).at[3, ::3].set(-0.0)
    x = x.at[4].set(jnp.arange(n, dtype=jnp.float32))
    x = x.at[5].set(-jnp.inf).astype(dtype).reshape(2, 3, n)
    got = jax.jit(top_k, static_argnums=(1, 2))(x, 512, True)
    for g, w in zip(got, jax.lax.top_k(x, 512)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("x", [jnp.zeros((0, 5000)), jnp.arange(5000, dtype=jnp.int32)[None] % 977])
def test_top_k_falls_back_where_the_keys_do_not_apply(x):
    for got, want in zip(top_k(x, 3, True), jax.lax.top_k(x, 3)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_top_k_rejects_a_k_it_cannot_take():
    with pytest.raises(ValueError, match="k must be"):
        top_k(jnp.zeros((2, 4)), 5, True)
