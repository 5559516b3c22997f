"""Per-request sampling: validated parameters on the host, one jitted sampler on the device.

Why it looks like this:

* Parameter names, defaults and semantics follow SGLang's ``sampling_params`` (and vLLM where SGLang is silent),
  so clients can move over unchanged. Validation raises :class:`InvalidSamplingParam`, a ``ValueError`` whose
  ``param`` names the offending field for the OpenAI error envelope.
* The device side is a single pure function over per-row arrays, so one compiled program serves any mix of
  greedy and sampled requests (``num_top`` is the only static argument).
* Randomness comes only from ``fold_in(key(seed), step)`` per row (threefry, named explicitly), so a request's
  tokens do not depend on which other requests share its batch, nor on its row.
* top-k and top-p together keep the tokens at or above one per-row logit threshold; instead of sorting ``[B, V]``
  we find it exactly by a 16-way search over the float bit patterns (``mega.topk``: 8 rounds of fused
  compare-and-reduce).

Order of operations in :func:`sample` (matches vLLM / SGLang):
ban (-> -inf) -> repetition penalty (prompt or output tokens) -> frequency and presence penalties (output tokens)
-> greedy rows: argmax; other rows: / temperature -> top-k and top-p jointly (SGLang; vLLM instead renormalises
after top-k) -> min-p -> Gumbel-max. Logprobs are reported under the raw ``logits`` argument (OpenAI convention).
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mega.topk import largest_threshold, ordered_key, top_k

GREEDY_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_TOP_LOGPROBS = 20
# bounds on one request's fan-out and stop lists, so that no request can cost the others without limit
MAX_N, MAX_STOP, MAX_STOP_LEN, MAX_STOP_IDS = 64, 16, 256, 256


class InvalidSamplingParam(ValueError):
    """A sampling parameter is unknown, of the wrong type, or out of range; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _real(name: str, v: Any) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise InvalidSamplingParam(name, f"must be a finite number, got {v!r}")
    return float(v)


def _int(name: str, v: Any) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise InvalidSamplingParam(name, f"must be an integer, got {v!r}")
    return int(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise InvalidSamplingParam(name, f"must be a boolean, got {v!r}")
    return bool(v)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParam(name, message)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters (SGLang names and defaults). Validated and normalised on construction."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output (serve/grammar.py): at most one of these; json_schema is a JSON string or object.
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        for k in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            set_(k, _real(k, getattr(self, k)))
        for k in ("max_new_tokens", "min_new_tokens", "top_k", "n", "top_logprobs"):
            set_(k, _int(k, getattr(self, k)))
        for k in ("ignore_eos", "logprobs"):
            set_(k, _bool(k, getattr(self, k)))
        if self.seed is not None:
            set_("seed", _int("seed", self.seed))
        stop = self.stop
        stop = (stop,) if isinstance(stop, str) else stop
        _check(isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop),
               "stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        set_("stop", tuple(stop))
        ids = self.stop_token_ids
        _check(isinstance(ids, (list, tuple)), "stop_token_ids", f"must be a list of integers, got {ids!r}")
        ids = tuple(_int("stop_token_ids", i) for i in ids)
        _check(all(i >= 0 for i in ids), "stop_token_ids", "must be non-negative")
        set_("stop_token_ids", ids)

        _check(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be in [0, max_new_tokens]")
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")
        _check(len(self.stop) <= MAX_STOP and all(len(s) <= MAX_STOP_LEN for s in self.stop), "stop",
               f"at most {MAX_STOP} stop strings of at most {MAX_STOP_LEN} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_IDS, "stop_token_ids", f"at most {MAX_STOP_IDS} ids")
        grammars = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        _check(len(grammars) <= 1, grammars[-1] if grammars else "", "give at most one of json_schema, regex, ebnf")
        for k in ("regex", "ebnf"):
            _check(getattr(self, k) is None or isinstance(getattr(self, k), str), k, "must be a string")
        _check(self.json_schema is None or isinstance(self.json_schema, (str, dict)), "json_schema",
               "must be a JSON schema (object or string)")
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """From the JSON form. ``stop`` may be a string or a list; a ``null`` value means the default."""
        if not isinstance(d, dict):
            raise InvalidSamplingParam("sampling_params", f"must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        for k in d:
            if k not in known:
                raise InvalidSamplingParam(str(k), "unknown sampling parameter")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def request_seed(request_id: str) -> int:
    """A stable 32-bit seed for a request that gave none (stable across processes, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


class SamplingArrays(NamedTuple):
    """Per-row parameters, each ``[B]`` (numpy from ``build``, arrays inside the jitted step).
    ``top_k <= 0`` means off; ``temperature < GREEDY_EPS`` means greedy."""

    temperature: jax.Array  # f32
    top_p: jax.Array  # f32
    top_k: jax.Array  # i32
    min_p: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    presence_penalty: jax.Array  # f32
    seed: jax.Array  # u32
    step: jax.Array  # i32: the sampled token's position in its request (see build)

    @classmethod
    def build(cls, params_list: Sequence[SamplingParams], steps: Sequence[int], batch_size: int,
              request_ids: Sequence[str] | None = None) -> SamplingArrays:
        """Rows for ``params_list``, padded to ``batch_size`` with greedy dummy rows.

        ``steps[i]`` must be a function of request ``i`` alone (e.g. the token's absolute position in its
        sequence), never of the batch. A sampled row without ``seed`` takes ``request_seed(request_ids[i])``;
        give each of a request's ``n`` samples its own id (or seed), or they will coincide.
        """
        n = len(params_list)
        if len(steps) != n or (request_ids is not None and len(request_ids) != n):
            raise ValueError("params_list, steps and request_ids must have the same length")
        if n > batch_size:
            raise ValueError(f"{n} rows do not fit batch_size {batch_size}")
        cols: dict[str, list] = {f: [] for f in cls._fields}
        for i, p in enumerate(params_list):
            if p.seed is not None:
                seed = p.seed & 0xFFFFFFFF
            elif p.is_greedy():
                seed = 0
            elif request_ids is not None:
                seed = request_seed(request_ids[i])
            else:
                raise ValueError(f"row {i} samples without a seed: pass request_ids")
            g = p.is_greedy()  # greedy rows drop the filters, so an all-greedy batch skips their cost
            row = dict(temperature=0.0 if g else p.temperature, top_p=1.0 if g else p.top_p,
                       top_k=-1 if g else p.top_k, min_p=0.0 if g else p.min_p,
                       repetition_penalty=p.repetition_penalty,
                       frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                       seed=seed, step=steps[i])
            for k, v in row.items():
                cols[k].append(v)
        pad = dict(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                   frequency_penalty=0.0, presence_penalty=0.0, seed=0, step=0)
        dtypes = dict(top_k=np.int32, seed=np.uint32, step=np.int32)
        # numpy: serve.runner.pack_input sends them with the step's other host arrays in one transfer
        return cls(**{k: np.array(v + [pad[k]] * (batch_size - n), dtypes.get(k, np.float32)) for k, v in cols.items()})


def min_tokens_banned(params: SamplingParams, num_generated: int, eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids a row may not sample yet because of ``min_new_tokens`` (for ``sample``'s ``ban``).

    Below ``min_new_tokens`` a row may not sample its ``stop_token_ids`` nor (unless ``ignore_eos``) an EOS id.
    Stop *strings* cannot be banned per token; the host ignores their matches until the minimum is reached.
    """
    if num_generated >= params.min_new_tokens:
        return []
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32: log-prob of the token under the raw logits
    top_ids: jax.Array  # [B, num_top] i32, most likely first (raw logits)
    top_logprobs: jax.Array  # [B, num_top] f32

    def packed(self) -> jax.Array:
        """The four arrays as one int32 ``[B, 2 + 2 num_top]`` (floats bitcast), so that the host
        fetches a step's samples in one device-to-host copy, not four."""
        def bits(a):
            return lax.bitcast_convert_type(a, jnp.int32)
        return jnp.concatenate([self.tokens[:, None], bits(self.logprobs)[:, None], self.top_ids,
                                bits(self.top_logprobs)], axis=1)

    @staticmethod
    def unpacked(rows: np.ndarray) -> "SampleOutput":
        """``packed()``'s rows, fetched to the host, as numpy arrays."""
        k = (rows.shape[1] - 2) // 2

        def floats(a):
            return np.ascontiguousarray(a).view(np.float32)
        return SampleOutput(rows[:, 0], floats(rows[:, 1]), rows[:, 2:2 + k], floats(rows[:, 2 + k:]))


def apply_penalties(logits: jax.Array, params: SamplingArrays, counts: jax.Array, prompt_mask: jax.Array,
                    ban: jax.Array | None = None) -> jax.Array:
    """Ban (-> -inf), then repetition penalty on prompt|output tokens, then frequency/presence on output tokens."""
    x = logits.astype(jnp.float32)
    if ban is not None:
        x = jnp.where(ban, -jnp.inf, x)
    rp = params.repetition_penalty[:, None]
    x = jnp.where(prompt_mask | (counts > 0), jnp.where(x > 0, x / rp, x * rp), x)
    return (x - params.frequency_penalty[:, None] * counts.astype(jnp.float32)
            - params.presence_penalty[:, None] * (counts > 0).astype(jnp.float32))


def truncation_mask(z: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Tokens that survive top-k, top-p and min-p, all three judged on the distribution softmax(z).

    ``z``: [B, V] temperature-scaled logits. top-k and top-p are applied jointly, without renormalising in
    between (SGLang's ``filter_apply_order="joint"``): a token survives if it is among the k most likely and in
    the smallest most-likely set with probability >= top_p. Ties at either boundary are all kept (as vLLM's top-k
    does); the most likely token always survives.
    """
    vocab = z.shape[-1]
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.int32)

    def search(z: jax.Array, m: jax.Array) -> jax.Array:  # keys and e recomputed here fuse into the reductions
        keys, e = ordered_key(z), jnp.exp(z - m)
        thr_k = largest_threshold(keys, None, k)  # the k-th largest key (k = V: the smallest, keeps all)
        thr_p = jnp.where(top_p < 1.0, largest_threshold(keys, e, top_p * e.sum(-1)), jnp.uint32(0))
        return jnp.maximum(thr_k, thr_p)

    # The searches dominate the cost: skip them when no row of the batch filters (lax.cond, no Python branch).
    # (One fused search for both conditions compiled to something 3x slower on GPU.)
    thr = lax.cond(jnp.any(k < vocab) | jnp.any(top_p < 1.0), search,
                   lambda *_: jnp.zeros(z.shape[:1], jnp.uint32), z, m)
    keys, e = ordered_key(z), jnp.exp(z - m)  # e: unnormalised probs, the max is 1
    return (keys >= thr[:, None]) & (e >= min_p[:, None])


def _gumbel(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    def row(s, t):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(s, impl="threefry2x32"), t), (vocab,),
                                 jnp.float32)
    return jax.vmap(row)(seed.astype(jnp.uint32), step.astype(jnp.int32))


@partial(jax.jit, static_argnames=("num_top",))
def sample(logits: jax.Array, params: SamplingArrays, counts: jax.Array, prompt_mask: jax.Array,
           num_top: int = 0, *, ban: jax.Array | None = None) -> SampleOutput:
    """Sample one token per row. Pure and jitted; ``num_top`` (0..20) is static.

    logits [B, V] f32; params: SamplingArrays; counts [B, V] i32: times each token was generated by the row's
    request (output only); prompt_mask [B, V] bool: token occurs in the prompt; ban [B, V] bool or None
    (keyword): tokens that must not be sampled this step (min_new_tokens, grammar masks). If a row bans every
    token the result is undefined. logprobs and top-logprobs are those of log_softmax(logits), i.e. before ban,
    penalties and temperature. A new ``num_top`` value, or switching ``ban`` between None and an array, recompiles.
    """
    logits = logits.astype(jnp.float32)
    x = apply_penalties(logits, params, counts, prompt_mask, ban)
    greedy = params.temperature < GREEDY_EPS
    z = x / jnp.where(greedy, 1.0, params.temperature)[:, None]
    keep = truncation_mask(z, params.top_k, params.top_p, params.min_p)
    noisy = jnp.where(keep, z + _gumbel(params.seed, params.step, z.shape[-1]), -jnp.inf)
    tokens = jnp.where(greedy, jnp.argmax(x, -1), jnp.argmax(noisy, -1)).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = top_k(logp, num_top)
    return SampleOutput(tokens, jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0], top_ids.astype(jnp.int32),
                        top_lp)
