"""Host time of dispatching one engine decode step, and what the step's inputs cost to send.

The engine bench's model (``engine_gpu.config``: V4.1-Flash widths, four layers) and a real
decode step's input (32 rows), captured from a short generate. Each timing is the median
host time of 20 calls, the device idle before each (so no call waits for an earlier one):

* ``step_call``: ``ModelRunner.step`` as the engine calls it (inputs packed into one int32
  buffer by ``serve.runner.pack_input``, then the jitted step launched);
* ``put_each``: ``jax.device_put`` of the step's host arrays one by one (how they travelled
  before ``pack_input``: a jitted call transfers each numpy argument on its own);
* ``put_packed``: ``jax.device_put`` of the one packed buffer;
* ``params_jit``: a jitted no-op taking the parameter pytree (what passing the weights'
  leaves, 123 at these widths, costs a dispatch).

Timed alone with the GPU idle, these host times run higher than inside the engine's loop
(``engine_gpu.py``'s ``host_ms`` per step is the number that counts).

    python3 bench/dispatch_gpu.py            # on the H200, writes $OUT/dispatch_gpu.json
    python3 bench/dispatch_gpu.py --smoke    # CPU: toy widths
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import run_info, write  # noqa: E402


def median_ms(fn, ready, reps: int = 20) -> float:
    import jax

    times = []
    for _ in range(reps):
        jax.block_until_ready(ready())
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return sorted(times)[reps // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("MEGAJAX_KERNELS", "reference" if args.smoke else "pallas")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import engine_gpu
    from checkpoints.init import init_params
    from serve.engine import Engine, EngineConfig
    from serve.runner import pack_input

    cfg = engine_gpu.config(args.smoke)
    params = init_params(cfg, seed=0, dtype=jnp.bfloat16)
    engine = Engine(params, cfg, EngineConfig(max_running=32, max_len=256, prefill_budget=512, prefix_cache=False))
    runner, captured = engine.runner, []
    real_step = runner.step

    def capture(inp, replay):
        if all(inp.batch.tokens[:32] < 0):  # a decode step: every row's token still on the device
            captured.append((inp, replay))
        return real_step(inp, replay)

    runner.step = capture
    prompts = [p[:16] for p in engine_gpu.prompts(args.smoke)]
    engine.generate(prompts, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}, decode_text=False)
    runner.step = real_step
    inp, replay = captured[-1]
    host = [x for x in jax.tree.leaves(inp) if isinstance(x, np.ndarray)]
    buffer = pack_input(inp)[0]
    no_op = jax.jit(lambda p: jnp.int32(0))  # (unused leaves are still checked at dispatch)
    ms = {
        "step_call": median_ms(lambda: real_step(inp, replay), lambda: runner.state),
        "put_each": median_ms(lambda: [jax.device_put(x) for x in host], lambda: runner.state),
        "put_packed": median_ms(lambda: jax.device_put(buffer), lambda: runner.state),
        "params_jit": median_ms(lambda: no_op(params), lambda: runner.state),
    }
    print(ms)
    payload = {**run_info(), "case": {"rows": 32, "host_arrays": len(host), "packed_int32": int(buffer.size),
                                      "param_leaves": len(jax.tree.leaves(params))}, "ms": ms}
    print("wrote", write("dispatch_gpu" + "_smoke" * args.smoke, payload))


if __name__ == "__main__":
    main()
