"""One ragged forward over several requests equals running each request alone.

Mixed steps (prefill, chunk continuation, decode) share a batch, the pages of the
requests are interleaved in the pools, and padding tokens ride along; every row must
match the single-request logits of the same position.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.batch import pack_requests
from model.forward import forward_jit
from model.state import init_state


def test_ragged_batch_matches_single_requests(tiny):
    prompts = [tiny.cases[n]["prompt_ids"] for n in ("c37", "c19", "c50_chunked")]
    alone = [tiny.run(p, [len(p)])[0] for p in prompts]
    # steps: per request, how many new tokens (0 = idle this step)
    schedule = [(10, 7, 0), (1, 5, 12), (9, 1, 1), (1, 6, 17), (16, 0, 1)]
    state = init_state(tiny.cfg, 3, 64, page_size=16)
    pages = state.page_table.shape[1]
    perm = np.random.default_rng(0).permutation(3 * pages).reshape(3, pages)  # interleave pages
    state = state.replace(page_table=jnp.asarray(perm, jnp.int32))
    done = [0, 0, 0]
    for step in schedule:
        reqs = [(r, prompts[r][done[r]:done[r] + n], done[r]) for r, n in enumerate(step) if n]
        batch = pack_requests(reqs, pad_to=64)
        logits, state = forward_jit(tiny.params, tiny.cfg, state, batch, tiny.emap)
        logits, row = np.asarray(logits), 0
        for r, ids, start in reqs:
            np.testing.assert_allclose(logits[row:row + len(ids)], alone[r][start:start + len(ids)], atol=1e-3,
                                       err_msg=f"request {r} positions {start}..{start + len(ids)}")
            row += len(ids)
            done[r] += len(ids)
    np.testing.assert_array_equal(np.asarray(state.seq_lens), done)
