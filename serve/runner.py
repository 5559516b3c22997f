"""The device side of the engine: model state, sampling state and the compiled step programs.

One step applies the slot resets of newly admitted requests, resolves token placeholders
(overlap scheduling feeds a request's previous sample as ``-(slot+1)`` before the host has
seen it), runs the forward over the ragged batch, samples one token for each requested
logit row, and updates the penalty counters and the per-slot last token. Inputs are padded
to a small fixed set of shapes (``Buckets``); each shape's program is compiled once and held
in the process's ``ProgramCache`` (serve/programs.py), which bounds how many are alive.

A step is one program (``plain_step``), except a prefill step under decoder replay: it is
``trunk_step`` (the layers up to the last KV source's attention on every row, keyed by the
token bucket) then ``tail_step`` (the rest on the kept rows, keyed by the replay bucket),
joined by a ``Handoff`` that stays on the device. Split so, the replay buckets add programs
(``T + R``) instead of multiplying them (``T x R``).

The host's per-step arrays travel as one int32 buffer (``pack_input``), unpacked inside the
step: each host array passed to a jitted call is its own host→device transfer, and with 22
of them the host's time per decode step (1.66 ms) held the GPU idle between steps; one
buffer brought it to 0.77 ms (H200, bench/RESULTS.md). The samples come back the same way,
as one array (``SampleOutput.packed``): one device-to-host copy a step instead of four.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mega import backend
from model.batch import Batch
from model.config import ModelConfig
from model.dspark import write_context
from model.forward import Cut, forward, forward_trunk, forward_tail
from model.state import ModelState, init_state, state_dtype
from serve.kv_pages import PageLayout, read_pages, write_pages
from serve.programs import ProgramCache, shared_programs
from serve.sampling import SampleOutput, SamplingArrays, sample
from serve.speculative import SpecInput, speculate
from sharding.specs import constrain_replicated, constrain_state, shard_state


def _dense(lo: int, hi: int, step: int) -> tuple[int, ...]:
    """Powers of two from ``lo`` up to ``step``, then every multiple of ``step``, then ``hi``."""
    out, n = [], lo
    while n < min(step, hi):
        out.append(n)
        n *= 2
    n = step
    while n < hi:
        out.append(n)
        n += step
    return tuple(out) + (hi,)


def _pow2(lo: int, hi: int) -> tuple[int, ...]:
    return _dense(lo, hi, hi)


@dataclass(frozen=True)
class Buckets:
    """Token-count buckets of prefill and decode steps and the row buckets of the replay layers.

    Mirrors SGLang's split: decode batches (one token per request) up to ``max_running``
    (1, 2, 4, 8, then every 8, like its CUDA-graph batch sizes); prefill steps up to the
    chunk budget (powers of two to 512, then every 512: padding wastes at most 512 tokens);
    replay layers up to ``window x max_running`` rows (powers of two of ``window``), within
    the largest prefill bucket. ``programs`` lists the programs they make.
    """

    decode: tuple[int, ...]
    prefill: tuple[int, ...]
    replay: tuple[int, ...]

    @classmethod
    def make(cls, max_running: int, prefill_budget: int, replay_keep: int | None) -> "Buckets":
        decode = _dense(1, max_running, 8)
        prefill = tuple(b for b in _dense(16, prefill_budget, 512) if b > decode[-1])
        replay = () if replay_keep is None else tuple(
            sorted({min(replay_keep * k, prefill[-1]) for k in _pow2(1, max_running)}))
        return cls(decode, prefill, replay)

    def tokens(self, n: int, has_prefill: bool) -> int:
        pool = self.prefill if has_prefill else self.decode + self.prefill
        for b in pool:
            if b >= n:
                return b
        raise ValueError(f"{n} tokens exceed the largest bucket {pool[-1]}")

    def replay_rows(self, n: int) -> int:
        return next(b for b in self.replay if b >= n)

    def programs(self) -> list[tuple[str, int]]:
        """Every program a step can run, as ``(kind, bucket)``: decode first, then the
        replay tails, then prefill, each smallest first (the order warm-up compiles them)."""
        prefill = "trunk" if self.replay else "step"
        return ([("step", t) for t in self.decode] + [("tail", r) for r in self.replay]
                + [(prefill, t) for t in self.prefill])

    def step(self, tokens: int, has_prefill: bool) -> tuple[int, int | None]:
        """A step of ``tokens`` tokens as the engine dispatches it, ``(bucket, replay rows)``, with
        the smallest replay tail where a prefill step replays (its rows vary with the chunks)."""
        return self.tokens(tokens, has_prefill), (self.replay[0] if self.replay and has_prefill else None)

    def programs_of(self, tokens: int, replay_rows: int | None) -> list[tuple[str, int]]:
        """The programs a step of this shape runs."""
        return [("step", tokens)] if replay_rows is None else [("trunk", tokens), ("tail", replay_rows)]

    def warmup_steps(self) -> list[tuple[int, int | None]]:
        """``(tokens, replay rows)`` of steps that run ``programs()`` in their order."""
        out = [(t, None) for t in self.decode]
        if not self.replay:
            return out + [(t, None) for t in self.prefill]
        out += [(next(t for t in self.prefill if t >= r), r) for r in self.replay]
        return out + [(t, self.replay[0]) for t in self.prefill if (t, self.replay[0]) not in out]


class SlotReset(NamedTuple):
    """Per-slot fields written before the forward, where ``mask`` is set (newly admitted requests)."""

    mask: jnp.ndarray  # bool [B]
    seq_len: jnp.ndarray  # int32 [B]
    window_floor: jnp.ndarray  # int32 [B]
    cached_len: jnp.ndarray  # int32 [B]
    engram_hist: jnp.ndarray  # int32 [B, n-1]


class StepInput(NamedTuple):
    batch: Batch  # tokens may be -(slot+1): "the slot's previous sample"
    is_prompt: jnp.ndarray  # bool [T]: prompt tokens (for the repetition penalty)
    recount: jnp.ndarray  # bool [T]: earlier outputs recomputed after a retraction (penalty counts)
    logit_rows: jnp.ndarray  # int32 [S]: batch rows to sample from
    logit_slots: jnp.ndarray  # int32 [S]: their slots (-1: padding)
    sampling: SamplingArrays  # [S]
    ban: jnp.ndarray  # bool [S, V]
    page_table: jnp.ndarray  # int32 [B, P]
    reset: SlotReset
    spec: SpecInput | None = None  # speculative requests (serve/speculative.py), with DSpark on


class SpecOptions(NamedTuple):
    """A runner's speculative decoding (static in its programs)."""

    num_drafts: int  # drafts proposed and verified a step
    simulate: float | None = None  # benchmark: a simulated mean accept length instead of the real one


class DeviceState(NamedTuple):
    model: ModelState
    counts: jnp.ndarray  # int32 [B, V]: output tokens per slot (frequency/presence penalties)
    prompt_mask: jnp.ndarray  # bool [B, V]
    last_token: jnp.ndarray  # int32 [B]


def enable_compilation_cache(path: str | None = None) -> None:
    """Turn on JAX's persistent compilation cache (restarts reuse compiled buckets)."""
    import os

    path = path or os.environ.get("MEGAJAX_JAX_CACHE", os.path.expanduser("~/.cache/megajax/jax"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pack_input(inp: StepInput) -> tuple[np.ndarray, object, tuple]:
    """``(buffer, ban, layout)``: every host array of ``inp`` but the ban mask (a device constant
    unless some row bans tokens) bitcast or widened to int32 and concatenated; ``layout``
    (hashable, static) is what ``unpack_input`` needs to rebuild ``inp``."""
    leaves, tree = jax.tree.flatten(inp._replace(ban=None))
    if not all(isinstance(x, np.ndarray) for x in leaves):  # a device array would be waited for here
        raise TypeError("step inputs other than the ban mask must be numpy arrays")
    wide = [x.dtype.name for x in leaves if x.dtype != bool and x.dtype.itemsize != 4]
    if wide:
        raise TypeError(f"step inputs must be bool or 4-byte arrays, got {wide}")
    parts = [x.astype(np.int32) if x.dtype == bool else np.ascontiguousarray(x).view(np.int32) for x in leaves]
    layout = (tree, tuple((x.shape, x.dtype.name) for x in leaves))
    return np.concatenate([x.ravel() for x in parts]), inp.ban, layout


def unpack_input(buffer: jax.Array, ban: jax.Array, layout: tuple) -> StepInput:
    tree, specs = layout
    leaves, at = [], 0
    for shape, dtype in specs:
        n = int(np.prod(shape))
        x = buffer[at:at + n].reshape(shape)
        leaves.append(x != 0 if dtype == "bool" else jax.lax.bitcast_convert_type(x, jnp.dtype(dtype)))
        at += n
    return jax.tree.unflatten(tree, leaves)._replace(ban=ban)


class Handoff(NamedTuple):
    """What a replay step's trunk hands its tail, on the device."""

    cut: Cut
    rows: jnp.ndarray  # int32 [S]: the sampled rows among the cut's
    slots: jnp.ndarray  # int32 [S]: their slots (-1: padding)
    sampling: SamplingArrays
    verify: "Verify | None" = None


class Verify(NamedTuple):
    """What speculation needs of a step besides its samples (serve/speculative.py)."""

    spec: SpecInput
    fed: jnp.ndarray  # int32 [S]: the token fed at each logit row
    positions: jnp.ndarray  # int32 [S]: its position
    old_hist: jnp.ndarray  # int32 [B, n-1]: the Engram look-back before the step

    @classmethod
    def of(cls, inp: StepInput, batch: Batch, state: "DeviceState") -> "Verify":
        return cls(inp.spec, batch.tokens[inp.logit_rows], batch.positions[inp.logit_rows],
                   state.model.engram_hist)


class Signature:
    """What a runner's programs are compiled for beyond their keys: the kernel mode, the
    config and the shapes of the params, state and Engram map; hashed once, not every step."""

    def __init__(self, *parts):
        self.parts, self._hash = parts, hash(parts)

    @classmethod
    def of(cls, cfg: ModelConfig, num_top: int, *trees, spec: "SpecOptions | None" = None) -> "Signature":
        def avals(tree):
            leaves, treedef = jax.tree.flatten(tree)
            return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)

        return cls(backend.mode(), cfg, num_top, spec, *map(avals, trees))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Signature) and self.parts == other.parts)


def _admit(state: DeviceState, inp: StepInput) -> tuple[DeviceState, Batch]:
    """The slot resets applied, the placeholders resolved and the prompt tokens counted."""
    r = inp.reset
    m = state.model
    keep = ~r.mask
    m = m.replace(
        seq_lens=jnp.where(keep, m.seq_lens, r.seq_len), window_floor=jnp.where(keep, m.window_floor, r.window_floor),
        cached_len=jnp.where(keep, m.cached_len, r.cached_len),
        engram_hist=jnp.where(keep[:, None], m.engram_hist, r.engram_hist), page_table=inp.page_table)
    counts = jnp.where(keep[:, None], state.counts, 0)
    prompt_mask = state.prompt_mask & keep[:, None]
    b = inp.batch
    tokens = jnp.where(b.tokens < 0, state.last_token[jnp.maximum(-b.tokens - 1, 0)], b.tokens)
    slot_of = jnp.where((b.seq_ids >= 0) & inp.is_prompt, b.seq_ids, m.batch_size)
    prompt_mask = prompt_mask.at[slot_of, tokens].set(True, mode="drop")
    counts = counts.at[jnp.where((b.seq_ids >= 0) & inp.recount, b.seq_ids, m.batch_size), tokens].add(1, mode="drop")
    return DeviceState(m, counts, prompt_mask, state.last_token), Batch(tokens, b.seq_ids, b.positions)


def _sample(state: DeviceState, logits, slots_in, sampling: SamplingArrays, ban, num_top: int):
    """One token per logit row, counted into its slot: ``(state, packed samples)``."""
    slots = jnp.maximum(slots_in, 0)
    out: SampleOutput = sample(logits, sampling, state.counts[slots], state.prompt_mask[slots], num_top, ban=ban)
    live = jnp.where(slots_in >= 0, slots_in, state.model.batch_size)
    counts = state.counts.at[live, out.tokens].add(1, mode="drop")
    last = state.last_token.at[live].set(out.tokens, mode="drop")
    # the samples whole on every device: each process can read them (several processes: process 0 does)
    return constrain_state(state._replace(counts=counts, last_token=last)), constrain_replicated(out.packed())


def _finish(params, state: DeviceState, out, slots, sampling, ban, engram_map, verify: Verify | None, *,
            cfg: ModelConfig, num_top: int, spec: SpecOptions | None):
    """Sample the step's logit rows; with speculation, write the draft's context, accept, roll
    back and propose (``out``: the forward's logits, state and taps). The packed samples, then
    with speculation one row a speculative request: its accepted count and next drafts."""
    if spec is None:
        logits, m = out
        return _sample(state._replace(model=m), logits, slots, sampling, ban, num_top)
    logits, m, taps = out
    m = m.replace(draft_window=write_context(params["mtp"], cfg, m.draft_window, taps.aux, taps.info))
    state, packed = _sample(state._replace(model=m), logits, slots, sampling, ban, num_top)
    m, bonus, rows = speculate(params, cfg, state.model, verify.old_hist, verify.fed, verify.positions, packed[:, 0],
                               verify.spec, sampling, engram_map, spec.num_drafts, spec.simulate)
    live = jnp.where(verify.spec.slot >= 0, verify.spec.slot, m.batch_size)
    state = constrain_state(state._replace(model=m, last_token=state.last_token.at[live].set(bonus, mode="drop")))
    rows = jnp.pad(rows, ((0, 0), (0, packed.shape[1] - rows.shape[1])))
    return state, jnp.concatenate([packed, rows])


def plain_step(params, state: DeviceState, buffer: jax.Array, ban: jax.Array, engram_map, *, layout: tuple,
               cfg: ModelConfig, num_top: int, spec: SpecOptions | None = None):
    """A whole step on a ``pack_input`` buffer: ``(state, packed samples)``."""
    inp = unpack_input(buffer, ban, layout)
    state, batch = _admit(state, inp)
    verify = None if spec is None else Verify.of(inp, batch, state)
    out = forward(params, cfg, state.model, batch, engram_map, logit_rows=inp.logit_rows, taps=spec is not None)
    return _finish(params, state, out, inp.logit_slots, inp.sampling, inp.ban, engram_map, verify, cfg=cfg,
                   num_top=num_top, spec=spec)


def trunk_step(params, state: DeviceState, buffer: jax.Array, engram_map, *, layout: tuple, cfg: ModelConfig,
               keep: int, rows: int, spec: SpecOptions | None = None):
    """A replay step's trunk (the module docstring): ``(state, Handoff)`` of ``rows`` kept rows."""
    inp = unpack_input(buffer, None, layout)
    state, batch = _admit(state, inp)
    verify = None if spec is None else Verify.of(inp, batch, state)
    cut, m = forward_trunk(params, cfg, state.model, batch, engram_map, keep, rows, taps=spec is not None)
    return (constrain_state(state._replace(model=m)),
            constrain_replicated(Handoff(cut, cut.rows_of(inp.logit_rows), inp.logit_slots, inp.sampling, verify)))


def tail_step(params, state: DeviceState, handoff: Handoff, ban: jax.Array, engram_map, *, cfg: ModelConfig,
              num_top: int, rows: int, spec: SpecOptions | None = None):
    """A replay step's tail on the first ``rows`` rows of its cut: ``(state, packed samples)``."""
    out = forward_tail(params, cfg, state.model, handoff.cut.take(rows), handoff.rows)
    return _finish(params, state, out, handoff.slots, handoff.sampling, ban, engram_map, handoff.verify, cfg=cfg,
                   num_top=num_top, spec=spec)


class ModelRunner:
    def __init__(self, params: dict, cfg: ModelConfig, engram_map, max_running: int, max_len: int, page_size: int,
                 num_pages: int, replay_keep: int | None, buckets: Buckets, num_top: int = 20,
                 quantized_kv: bool = False, programs: ProgramCache | None = None, spec: SpecOptions | None = None,
                 mesh: Mesh | None = None, count_experts: bool = False):
        """``mesh``: a (data, expert) mesh the ``params`` are already split over; the state is then
        split over ``data`` (``sharding.specs``) and the steps trace under it, so the MoE sites
        dispatch expert-parallel. ``count_experts``: the steps count the experts' routed pairs (EPLB)."""
        self.params, self.cfg, self.engram_map, self.mesh = params, cfg, engram_map, mesh
        self.buckets, self.replay_keep, self.num_top, self.spec = buckets, replay_keep, num_top, spec
        self.broadcast = None   # process 0 of several: its steps' inputs go to the others first
        self.max_running = max_running
        self.pages_per_request = -(-max_len // page_size)
        # the engine owns the page pool: the compressed pools are sized by num_pages, not per slot
        model = init_state(cfg, max_running, max_len, page_size, state_dtype(params), quantized_kv=quantized_kv,
                           spec_tokens=0 if spec is None else spec.num_drafts, expert_load=count_experts,
                           num_pages=num_pages)
        v = cfg.vocab_size
        self.state = DeviceState(model, jnp.zeros((max_running, v), jnp.int32),
                                 jnp.zeros((max_running, v), bool), jnp.zeros((max_running,), jnp.int32))
        if mesh is not None:   # every state array is per slot or per page on its first axis
            self.state = shard_state(self.state, mesh)
        self._no_ban: dict[int, jax.Array] = {}
        self.programs = programs or shared_programs()
        self.handoff_rows = buckets.replay[-1] if buckets.replay else 0
        self.signature = Signature.of(cfg, num_top, params, self.state, engram_map, spec=spec)
        self.page_layout = PageLayout.of(cfg, page_size, state_dtype(params), quantized_kv)
        self._compiles_at_start = self.programs.compiles

    def step(self, inp: StepInput, replay_rows: int | None) -> jax.Array:
        """Dispatch one step; returns its samples as ``SampleOutput.packed`` rows on the device,
        without waiting for them."""
        if self.broadcast is not None:   # the other processes of the mesh dispatch it too (serve.multiprocess)
            self.broadcast.send(self, inp, replay_rows)
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            return self._step(inp, replay_rows)

    def _first(self, inp: StepInput, replay_rows: int | None) -> tuple:
        """The program a step runs first, as ``ProgramCache.run`` takes it: ``(key, fn, args,
        statics)`` of the whole step, or of the trunk before the replay tail."""
        buffer, ban, layout = pack_input(inp)
        sig, cfg = self.signature, self.cfg
        if replay_rows is None:
            return (("step", sig, layout), plain_step, (self.params, self.state, buffer, ban, self.engram_map),
                    dict(layout=layout, cfg=cfg, num_top=self.num_top, spec=self.spec))
        h = self.handoff_rows
        return (("trunk", sig, layout, self.replay_keep, h), trunk_step, (self.params, self.state, buffer, self.engram_map),
                dict(layout=layout, cfg=cfg, keep=self.replay_keep, rows=h, spec=self.spec))

    def _step(self, inp: StepInput, replay_rows: int | None) -> jax.Array:
        self.state, out = self.programs.run(*self._first(inp, replay_rows), donate=(1,))
        if replay_rows is None:
            return out
        handoff = out
        self.state, out = self.programs.run(
            ("tail", self.signature, self.handoff_rows, replay_rows, handoff.rows.shape[0]), tail_step,
            (self.params, self.state, handoff, inp.ban, self.engram_map),
            dict(cfg=self.cfg, num_top=self.num_top, rows=replay_rows, spec=self.spec), donate=(1,))
        return out

    def compile_ahead(self, steps: list[tuple[int, int | None]], threads: int) -> None:
        """The programs ``steps`` (``(tokens, replay rows)``) run first, compiled now, ``threads``
        at a time (``ProgramCache.compile_ahead``); a replay tail, whose input is its trunk's
        output, compiles at its first run."""
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            jobs = [(*self._first(self.empty_input(t), r), (1,)) for t, r in steps]
            self.programs.compile_ahead(jobs, threads)

    def read_pages(self, pages) -> jax.Array:
        """Whole pages of the compressed pools (``kv_pages.read_pages``: row i is ``pages[i]``, padded
        to a power of two of rows), read after the steps dispatched so far, not waited for."""
        m = self.state.model
        return read_pages(m.comp_kv, m.index_k, pages, self.page_layout)

    def write_pages(self, pages, data: np.ndarray) -> None:
        """Write whole pages into the compressed pools, before the next step (kept split as they were)."""
        m = self.state.model
        shardings = jax.tree.map(lambda x: x.sharding, (m.comp_kv, m.index_k))
        comp_kv, index_k = write_pages(m.comp_kv, m.index_k, pages, data, self.page_layout)
        if self.mesh is not None:
            comp_kv, index_k = jax.device_put((comp_kv, index_k), shardings)
        self.state = self.state._replace(model=m.replace(comp_kv=comp_kv, index_k=index_k))

    @property
    def compile_count(self) -> int:
        """Programs compiled since this runner was built (by any runner: they share the cache)."""
        return self.programs.compiles - self._compiles_at_start
    def logit_rows(self, tokens: int) -> int:
        """Logit rows a step of ``tokens`` tokens samples: a row a request, or with speculation
        one per token it verifies (at most the step's tokens)."""
        if self.spec is None:
            return self.max_running
        return min(tokens, self.max_running * (1 + self.spec.num_drafts))

    def no_ban(self, rows: int) -> jax.Array:
        """The usual step's ban for ``rows`` logit rows: nothing banned, on the device once."""
        if rows not in self._no_ban:
            self._no_ban[rows] = jnp.zeros((rows, self.cfg.vocab_size), bool)
        return self._no_ban[rows]

    def empty_input(self, tokens: int) -> StepInput:
        """An all-padding input of ``tokens`` rows (warm-up)."""
        b, s = self.max_running, self.logit_rows(tokens)
        n_hist = self.state.model.engram_hist.shape[1]
        spec = None if self.spec is None else SpecInput(np.full(b, -1, np.int32), np.zeros(b, np.int32),
                                                        np.zeros(b, np.int32))
        return StepInput(
            Batch(np.zeros(tokens, np.int32), np.full(tokens, -1, np.int32), np.zeros(tokens, np.int32)),
            np.zeros(tokens, bool), np.zeros(tokens, bool), np.zeros(s, np.int32), np.full(s, -1, np.int32),
            SamplingArrays.build([], [], s), self.no_ban(s),
            np.zeros(self.state.model.page_table.shape, np.int32),   # (an empty engine's page table)
            SlotReset(np.zeros(b, bool), np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32),
                      np.zeros((b, n_hist), np.int32)), spec)
