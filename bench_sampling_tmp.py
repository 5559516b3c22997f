import time, numpy as np, jax, jax.numpy as jnp
from jax import lax
from serve.sampling import _ordered_key
V = 129280
def thr(keys, weights, target, bits, minor):
    t = jnp.zeros(keys.shape[:1], jnp.uint32)
    nd = (1 << bits) - 1
    digits = jnp.arange(1, nd + 1, dtype=jnp.uint32)
    shifts = list(range(32 - bits, -1, -bits))
    if shifts[-1] != 0: shifts.append(0)  # not used for bits dividing 32
    for shift in shifts:
        cand = t[:, None] | (digits << shift)[None, :]
        if minor:
            ge = keys[:, :, None] >= cand[:, None, :]
            mass = ge.sum(1) if weights is None else jnp.where(ge, weights[:, :, None], 0.0).sum(1)
        else:
            ge = keys[:, None, :] >= cand[:, :, None]
            mass = ge.sum(2) if weights is None else jnp.where(ge, weights[:, None, :], 0.0).sum(2)
        t = t | ((mass >= target[:, None]).sum(1).astype(jnp.uint32) << shift)
    return t
def bench(f, *args, n=20):
    r0 = jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n): r = f(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3, r0
for B in [8, 64, 256]:
    rng = np.random.default_rng(0)
    z = jnp.asarray((rng.normal(size=(B, V)) * 3).astype(np.float32))
    keys = _ordered_key(z); w = jnp.exp(z - z.max(-1, keepdims=True)); tgt = 0.9 * w.sum(-1); k = jnp.full((B,), 50, jnp.int32)
    ref = None
    for bits in [1, 2, 4]:
        for minor in [True, False]:
            f = jax.jit(lambda keys, w, tgt, k, bits=bits, minor=minor: (thr(keys, None, k, bits, minor), thr(keys, w, tgt, bits, minor)))
            ms, r = bench(f, keys, w, tgt, k)
            r = np.asarray(r)
            ok = True if ref is None else bool((r == ref).all()); ref = r if ref is None else ref
            print(f"B={B} bits={bits} minor={minor}: {ms:.3f} ms (top-k + top-p searches) same={ok}")
