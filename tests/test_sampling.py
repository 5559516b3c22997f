"""serve.sampling: parameter validation, penalties and truncation against numpy, and the sampler's statistics."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve.sampling import (InvalidSamplingParam, SampleOutput, SamplingArrays, SamplingParams, apply_penalties,
                            min_tokens_banned, request_seed, sample, truncation_mask)

P4 = np.array([0.5, 0.25, 0.15, 0.1])  # a tiny vocabulary with a known distribution
L4 = np.log(P4).astype(np.float32)


def run(logits, params, steps=None, counts=None, prompt=None, num_top=0, ban=None, ids=None):
    logits = np.asarray(logits, np.float32)
    b, v = logits.shape
    steps = [0] * len(params) if steps is None else steps
    arrays = SamplingArrays.build(params, steps, b, request_ids=ids)
    counts = np.zeros((b, v), np.int32) if counts is None else counts
    prompt = np.zeros((b, v), bool) if prompt is None else prompt
    out = sample(jnp.asarray(logits), arrays, jnp.asarray(counts), jnp.asarray(prompt), num_top,
                 ban=None if ban is None else jnp.asarray(ban))
    return jax.tree.map(np.asarray, out)


def support(logits_row, n=2000, step=0, **kw):
    """Tokens drawn for one logits row by n different seeds."""
    toks = run(np.tile(logits_row, (n, 1)), [SamplingParams(seed=s, **kw) for s in range(n)], [step] * n).tokens
    return toks


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---------------------------------------------------------------- SamplingParams


def test_defaults_and_from_dict_forms():
    assert SamplingParams.from_dict({}) == SamplingParams()
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.n) == \
        (128, 1.0, 1.0, -1, 0.0, 1.0, 1)
    assert SamplingParams.from_dict({"stop": "END"}).stop == ("END",)
    assert SamplingParams.from_dict({"stop": ["a", "b"], "stop_token_ids": [3, 4]}).stop_token_ids == (3, 4)
    assert SamplingParams.from_dict({"top_p": None, "seed": None}) == SamplingParams()
    q = SamplingParams.from_dict({"temperature": 0, "top_k": 5, "seed": 7})
    assert q.temperature == 0.0 and isinstance(q.temperature, float) and q.top_k == 5 and q.seed == 7
    assert q.is_greedy() and not SamplingParams(temperature=0.2).is_greedy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("d, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"max_new_tokens": "10"}, "max_new_tokens"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"), ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"n": 0}, "n"), ({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs"),
    ({"stop": 5}, "stop"), ({"stop": ["a", 3]}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": "7"}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"logprobs": 1}, "logprobs"), ({"seed": 1.5}, "seed"),
    ({"temprature": 0.5}, "temprature"),
])
def test_from_dict_errors_name_the_field(d, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams.from_dict(d)
    assert isinstance(exc.value, InvalidSamplingParam) and exc.value.param == field
    assert field in str(exc.value)


def test_build_pads_with_greedy_rows_and_needs_seeds():
    a = SamplingArrays.build([SamplingParams(seed=-1, top_k=3, temperature=0.7)], [9], 3)
    assert np.asarray(a.temperature).tolist() == pytest.approx([0.7, 0.0, 0.0])
    assert np.asarray(a.top_k).tolist() == [3, -1, -1] and np.asarray(a.step).tolist() == [9, 0, 0]
    assert np.asarray(a.seed).tolist() == [0xFFFFFFFF, 0, 0] and a.seed.dtype == jnp.uint32
    g = SamplingArrays.build([SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)], [0], 1)
    assert (int(g.top_k[0]), float(g.top_p[0]), float(g.min_p[0])) == (-1, 1.0, 0.0)  # filters mean nothing greedy
    with pytest.raises(ValueError, match="seed"):
        SamplingArrays.build([SamplingParams()], [0], 2)
    with pytest.raises(ValueError, match="batch_size"):
        SamplingArrays.build([SamplingParams(seed=1)] * 3, [0] * 3, 2)
    b = SamplingArrays.build([SamplingParams(), SamplingParams()], [0, 0], 2, request_ids=["r1", "r2"])
    assert np.asarray(b.seed).tolist() == [request_seed("r1"), request_seed("r2")]
    assert request_seed("r1") != request_seed("r2") and 0 <= request_seed("r1") < 2**32


def test_request_seed_is_stable_across_processes():
    # blake2b, not hash(): a fixed value that must not change between releases either
    import hashlib
    assert request_seed("abc") == int.from_bytes(hashlib.blake2b(b"abc", digest_size=4).digest(), "little")


def test_min_tokens_banned():
    p = SamplingParams(min_new_tokens=2, stop_token_ids=(5,))
    assert min_tokens_banned(p, 1, [1]) == [5, 1] and min_tokens_banned(p, 2, [1]) == []
    q = SamplingParams(min_new_tokens=2, ignore_eos=True, stop_token_ids=(6,))
    assert min_tokens_banned(q, 0, [1]) == [6]


# ---------------------------------------------------------------- penalties


def penalties_np(logits, rep, freq, pres, counts, prompt):
    x = logits.astype(np.float64).copy()
    seen = prompt | (counts > 0)
    r = rep[:, None]
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - freq[:, None] * counts - pres[:, None] * (counts > 0)


def test_penalties_match_numpy():
    rng = np.random.default_rng(0)
    b, v = 6, 40
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    counts = (rng.integers(0, 4, size=(b, v)) * (rng.random((b, v)) < 0.3)).astype(np.int32)
    prompt = rng.random((b, v)) < 0.2
    rep = np.array([1.0, 1.3, 0.7, 2.0, 1.1, 0.5])
    freq = np.array([0.0, 0.5, -1.0, 2.0, -2.0, 0.3])
    pres = np.array([0.0, -0.4, 1.5, 0.0, 2.0, -2.0])
    ps = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=q, seed=0)
          for r, f, q in zip(rep, freq, pres)]
    arrays = SamplingArrays.build(ps, [0] * b, b)
    got = np.asarray(apply_penalties(jnp.asarray(logits), arrays, jnp.asarray(counts), jnp.asarray(prompt)))
    want = penalties_np(logits, rep, freq, pres, counts, prompt)
    assert np.abs(want - logits).max() > 1  # the penalties do something
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    ban = rng.random((b, v)) < 0.1
    got_b = np.asarray(apply_penalties(jnp.asarray(logits), arrays, jnp.asarray(counts), jnp.asarray(prompt),
                                       jnp.asarray(ban)))
    assert np.all(got_b[ban] == -np.inf)
    np.testing.assert_allclose(got_b[~ban], want[~ban], rtol=1e-6, atol=1e-6)


def test_greedy_uses_penalised_logits():
    logits = np.array([[4.0, 3.0, 1.0, 0.0],    # prompt token 0, repetition 1.5: 4 -> 2.67 < 3
                       [-1.0, -1.2, -5.0, -6.0],  # output token 0, repetition 1.5: -1 -> -1.5 < -1.2
                       [2.0, 1.5, 0.0, 0.0],      # token 0 generated twice, frequency 0.3: 2 -> 1.4
                       [2.0, 1.5, 0.0, 0.0]],     # token 0 generated, presence 0.6: 2 -> 1.4
                      np.float32)
    counts = np.zeros((4, 4), np.int32)
    counts[1, 0], counts[2, 0], counts[3, 0] = 1, 2, 1
    prompt = np.zeros((4, 4), bool)
    prompt[0, 0] = True
    ps = [SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(temperature=0, repetition_penalty=1.5),
          SamplingParams(temperature=0, frequency_penalty=0.3), SamplingParams(temperature=0, presence_penalty=0.6)]
    assert run(logits, ps, counts=counts, prompt=prompt).tokens.tolist() == [1, 1, 1, 1]
    neutral = [SamplingParams(temperature=0)] * 4
    assert run(logits, neutral, counts=counts, prompt=prompt).tokens.tolist() == [0, 0, 0, 0]


# ---------------------------------------------------------------- greedy, top-k, top-p, min-p


def test_greedy_is_argmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 300)).astype(np.float32)
    out = run(logits, [SamplingParams(temperature=0, seed=s) for s in range(16)], steps=list(range(16)))
    assert out.tokens.dtype == np.int32
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.3, 5.0])
def test_top_k_1_is_greedy(temperature):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(32, 100)).astype(np.float32)
    out = run(logits, [SamplingParams(temperature=temperature, top_k=1, seed=s) for s in range(32)])
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


@pytest.mark.parametrize("kw, expected", [
    ({}, {0, 1, 2, 3}),
    ({"top_k": 3}, {0, 1, 2}),
    ({"top_p": 0.3}, {0}),
    ({"top_p": 0.7}, {0, 1}),          # 0.5 + 0.25 >= 0.7
    ({"top_p": 0.8}, {0, 1, 2}),
    ({"top_k": 2, "top_p": 0.6}, {0, 1}),  # joint (SGLang): no renormalising after top-k (vLLM would give {0})
    ({"top_k": 3, "top_p": 0.7}, {0, 1}),
    ({"top_k": 1, "top_p": 0.9}, {0}),
    ({"min_p": 0.4}, {0, 1}),           # keep p >= 0.2
    ({"min_p": 0.25}, {0, 1, 2}),       # keep p >= 0.125
    ({"min_p": 0.5, "temperature": 2.0}, {0, 1, 2}),  # after temperature: p ~ sqrt(P4)
    ({"top_p": 0.7, "temperature": 3.0}, {0, 1, 2}),
])
def test_support(kw, expected):
    assert set(support(L4, **kw).tolist()) == expected


def truncation_np(z, k, p, min_p):
    """Reference: sort once; keep the top k, and the shortest prefix with mass >= p, and p_i >= min_p * p_max."""
    v = z.shape[0]
    probs = np.exp(log_softmax(z))
    order = np.argsort(-z, kind="stable")
    cum = np.cumsum(probs[order])
    n = v if k <= 0 else min(k, v)
    if p < 1:
        n = min(n, int(np.searchsorted(cum, p)) + 1)
    keep = np.zeros(v, bool)
    keep[order[:n]] = True
    near = (p < 1 and np.abs(cum - p).min() < 1e-4) or \
        (min_p > 0 and np.abs(probs / probs.max() - min_p).min() < 1e-4)
    return keep & (probs >= min_p * probs.max()), near


def test_truncation_mask_matches_sorting_reference():
    rng = np.random.default_rng(3)
    b, v = 96, 257
    z = (rng.normal(size=(b, v)) * rng.uniform(0.5, 4, size=(b, 1))).astype(np.float32)
    top_k = rng.choice([-1, 1, 2, 7, 40, 256, 257, 1000], size=b).astype(np.int32)
    top_p = np.where(rng.random(b) < 0.2, 1.0, rng.uniform(0.05, 1.0, size=b)).astype(np.float32)
    min_p = np.where(rng.random(b) < 0.5, 0.0, rng.uniform(0, 0.3, size=b)).astype(np.float32)
    got = np.asarray(jax.jit(truncation_mask)(z, top_k, top_p, min_p))
    checked = 0
    for i in range(b):
        want, near = truncation_np(z[i], top_k[i], top_p[i], min_p[i])
        if near:
            continue
        checked += 1
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}: k={top_k[i]} p={top_p[i]} min_p={min_p[i]}")
    assert checked > 80 and 1 < got.sum(-1).mean() < v  # the rows really truncate, and differently


def test_top_k_keeps_ties_and_splits_one_ulp():
    z = jnp.asarray([[3.0, 2.0, 2.0, 1.0, -jnp.inf]])
    got = truncation_mask(z, jnp.asarray([2]), jnp.asarray([1.0]), jnp.asarray([0.0]))
    assert np.asarray(got)[0].tolist() == [True, True, True, False, False]
    # the threshold is exact: values one ulp apart are told apart, -0.0 and 0.0 tie
    below = np.nextafter(np.float32(-1.0), np.float32(-2.0))
    z = jnp.asarray([[-1.0, below, -0.0, 0.0, 5.0]], jnp.float32)
    got = np.asarray(truncation_mask(z, jnp.asarray([2]), jnp.asarray([1.0]), jnp.asarray([0.0])))
    assert got[0].tolist() == [False, False, True, True, True]
    z = jnp.asarray([[-1.0, below, 5.0]], jnp.float32)
    got = np.asarray(truncation_mask(z, jnp.asarray([2]), jnp.asarray([1.0]), jnp.asarray([0.0])))
    assert got[0].tolist() == [True, False, True]


# ---------------------------------------------------------------- randomness


def chi_square(tokens, probs):
    n = len(tokens)
    obs = np.bincount(tokens, minlength=len(probs))
    exp = n * np.asarray(probs)
    assert np.all(obs[exp == 0] == 0)
    return float((((obs - exp) ** 2)[exp > 0] / exp[exp > 0]).sum())


LOGITS6 = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], np.float32)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 3}])
def test_distribution_over_seeds_matches_softmax(kw):
    n = 20000
    toks = support(LOGITS6, n=n, step=7, **kw)
    z = LOGITS6 / kw.get("temperature", 1.0)
    if "top_k" in kw:
        z = np.where(z >= np.sort(z)[-kw["top_k"]], z, -np.inf)
    # df = 5 (top-k: 2); the 99.9% quantiles are 20.5 and 13.8
    assert chi_square(toks, np.exp(log_softmax(z))) < 20


def test_distribution_over_steps_matches_softmax():
    n = 20000
    toks = run(np.tile(LOGITS6, (n, 1)), [SamplingParams(seed=123)] * n, steps=list(range(n))).tokens
    assert chi_square(toks, np.exp(log_softmax(LOGITS6))) < 20


def test_seed_and_step_reproduce_and_vary():
    v = 1000
    flat = np.zeros((1, v), np.float32)
    one = lambda seed, step: int(run(flat, [SamplingParams(seed=seed)], [step]).tokens[0])  # noqa: E731
    assert one(5, 3) == one(5, 3)
    assert len({one(5, t) for t in range(24)}) > 18
    assert len({one(s, 3) for s in range(24)}) > 18
    ids = run(np.zeros((2, v), np.float32), [SamplingParams(), SamplingParams()], ids=["a", "b"]).tokens
    assert ids[0] != ids[1] and ids.tolist() == run(np.zeros((2, v), np.float32), [SamplingParams()] * 2,
                                                     ids=["a", "b"]).tokens.tolist()


def test_rows_do_not_depend_on_batch_or_row_index():
    rng = np.random.default_rng(4)
    k, v = 12, 64
    logits = rng.normal(size=(k, v)).astype(np.float32)
    ps = [SamplingParams(seed=100 + i, temperature=0.9, top_p=0.95, min_p=0.01) for i in range(k)]
    steps = list(range(30, 30 + k))
    alone = run(logits, ps, steps)
    # the same rows, shuffled among other rows in a bigger batch
    big = 20
    perm = rng.permutation(big)[:k]
    all_logits = rng.normal(size=(big, v)).astype(np.float32)
    all_ps = [SamplingParams(seed=999 - i, top_k=5) for i in range(big)]
    all_steps = [0] * big
    for i, row in enumerate(perm):
        all_logits[row], all_ps[row], all_steps[row] = logits[i], ps[i], steps[i]
    mixed = run(all_logits, all_ps, all_steps)
    np.testing.assert_array_equal(mixed.tokens[perm], alone.tokens)
    np.testing.assert_array_equal(mixed.logprobs[perm], alone.logprobs)
    assert len(set(alone.tokens.tolist())) > 3


# ---------------------------------------------------------------- logprobs and ban


@pytest.mark.parametrize("num_top", [0, 5])
def test_logprobs_are_raw_log_softmax(num_top):
    rng = np.random.default_rng(5)
    b, v = 8, 50
    logits = (rng.normal(size=(b, v)) * 2).astype(np.float32)
    counts = rng.integers(0, 2, size=(b, v)).astype(np.int32)
    ban = np.zeros((b, v), bool)
    ban[np.arange(b), logits.argmax(-1)] = True  # the raw top token is banned but still reported
    ps = [SamplingParams(seed=i, temperature=0.5 if i % 2 else 0.0, top_p=0.9, repetition_penalty=1.2,
                         frequency_penalty=0.5) for i in range(b)]
    out = run(logits, ps, counts=counts, num_top=num_top, ban=ban)
    ref = log_softmax(logits)
    assert not np.any(ban[np.arange(b), out.tokens])
    np.testing.assert_allclose(out.logprobs, ref[np.arange(b), out.tokens], rtol=1e-5, atol=1e-5)
    assert out.top_ids.shape == (b, num_top) and out.top_logprobs.shape == (b, num_top)
    want_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :num_top]
    np.testing.assert_array_equal(out.top_ids, want_ids)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, want_ids, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_top", [0, 3])
def test_packed_samples_round_trip_bit_for_bit(num_top):
    """The step returns its samples as one int32 array; the host's unpacking gives back the same bits."""
    rng = np.random.default_rng(num_top)
    b = 5
    lp = rng.normal(size=(b, 1 + num_top)).astype(np.float32)
    lp.flat[[0, -1]] = [-np.inf, np.nan]   # a banned token's log-prob, and a NaN's bits
    out = SampleOutput(jnp.asarray(rng.integers(0, 129280, b), jnp.int32), jnp.asarray(lp[:, 0]),
                       jnp.asarray(rng.integers(0, 129280, (b, num_top)), jnp.int32), jnp.asarray(lp[:, 1:]))
    rows = np.asarray(jax.jit(SampleOutput.packed)(out))
    assert rows.dtype == np.int32 and rows.shape == (b, 2 + 2 * num_top)
    back = SampleOutput.unpacked(rows)
    for got, want in zip(back, out):
        want = np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def test_ban_is_respected():
    logits = np.tile(L4, (3, 1))
    ban = np.zeros((3, 4), bool)
    ban[:, 0] = True
    ps = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=1), SamplingParams(seed=2, top_p=0.01)]
    assert run(logits, ps, ban=ban).tokens.tolist() == [1, 1, 1]  # ban comes before greedy, top-k, top-p
    n = 1000
    ban = np.ones((n, 4), bool)
    ban[:, [2, 3]] = False
    toks = run(np.tile(L4, (n, 1)), [SamplingParams(seed=s) for s in range(n)], ban=ban).tokens
    assert set(toks.tolist()) == {2, 3}
