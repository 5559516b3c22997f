"""mega.topk.top_k_set against lax.top_k: the same entries, ties and -inf included."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mega.topk import top_k_set


@pytest.mark.parametrize("n,k", [(1, 1), (37, 5), (300, 64), (300, 300), (2048, 512)])
def test_top_k_set_picks_what_lax_top_k_picks(n, k):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    print(f"seed={seed}")
    keys = jax.random.split(jax.random.key(seed), 3)
    b = 6
    x = jax.random.normal(keys[0], (b, n))
    x = x.at[1].set(jnp.round(x[1] * 2))        # many ties, the k-th among them
    x = x.at[2].set(jnp.where(jax.random.uniform(keys[1], (n,)) < 0.7, -jnp.inf, x[2]))  # fewer finite than k
    x = x.at[3].set(0.0).at[3, ::2].set(-0.0)   # all tied, both zeros
    x = x.at[4].set(-jnp.inf)                   # nothing finite
    vals, ids = top_k_set(x, k)
    want_vals, want_ids = jax.lax.top_k(x, k)
    for row in range(b):
        assert sorted(np.asarray(ids[row]).tolist()) == sorted(np.asarray(want_ids[row]).tolist()), row
        assert np.all(np.diff(np.asarray(ids[row])) > 0), "indices in increasing order"
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(np.asarray(x), np.asarray(ids), -1))
    np.testing.assert_array_equal(np.sort(np.asarray(vals), -1), np.sort(np.asarray(want_vals), -1))


def test_top_k_set_rejects_a_k_it_cannot_take():
    with pytest.raises(ValueError, match="k must be"):
        top_k_set(jnp.zeros((2, 4)), 5)
