import time, numpy as np, jax, jax.numpy as jnp
from serve.sampling import SamplingArrays, SamplingParams, sample
V = 129280
def bench(f, *args, n=30):
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n): r = f(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3
mixes = {"default": {}, "top_k only": {"top_k": 40}, "top_p only": {"top_p": 0.9}, "both": {"top_k": 40, "top_p": 0.9}}
for B in [8, 64, 256]:
    rng = np.random.default_rng(0)
    l = jnp.asarray((rng.normal(size=(B, V)) * 3).astype(np.float32))
    c = jnp.asarray(rng.integers(0, 2, size=(B, V)).astype(np.int32)); pm = jnp.zeros((B, V), bool)
    ps = [SamplingParams(temperature=0.0, top_p=0.9) for i in range(B)]
    a = SamplingArrays.build(ps, list(range(B)), B)
    print(B, "all greedy (top_p=0.9)", f"num_top=0 {bench(sample, l, a, c, pm, 0):.3f} ms")
    for name, kw in mixes.items():
        ps = [SamplingParams(seed=i, temperature=0.0 if i % 3 == 0 else 0.8, **(kw if i % 2 else {})) for i in range(B)]
        a = SamplingArrays.build(ps, list(range(B)), B)
        print(B, name, f"num_top=0 {bench(sample, l, a, c, pm, 0):.3f} ms, num_top=20 {bench(sample, l, a, c, pm, 20):.3f} ms")
