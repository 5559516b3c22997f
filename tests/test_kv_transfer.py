"""The disaggregation transfer backend on its own (serve/disaggregation/transfer.py): what P offers is
what D fetches, and an offer nobody fetches is dropped when it expires (a D that died mid-pull)."""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from serve.disaggregation.transfer import make_transfer


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_fetch_returns_the_offered_pages():
    t = make_transfer("jax-transfer")
    x = jax.random.normal(jax.random.key(1), (3, 1000), jnp.float32).astype(jnp.bfloat16)
    t.offer(11, x, ttl=60)
    y = t.fetch(t.address(), 11, (3, 1000), "bfloat16")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_an_unfetched_offer_frees_its_copy_when_it_expires():
    t = make_transfer("jax-transfer")
    freed = []
    for room, ttl in ((1, 3600.0), (2, 0.2)):   # the first stays: the control
        x = jnp.full((64, 1024, 1024), room, jnp.float32).block_until_ready()   # 256 MiB
        with_it = _rss_mib()
        t.offer(room, x, ttl=ttl)
        del x
        time.sleep(0.5)
        t.offer(100 + room, jnp.ones(8), ttl=0.1)   # the server drops expired offers at its next one
        time.sleep(0.2)
        freed.append(with_it - _rss_mib())
    assert freed[0] < 50, f"the live offer let {freed[0]:.0f} of its 256 MiB go"
    assert freed[1] > 200, f"the expired offer freed only {freed[1]:.0f} of its 256 MiB"
