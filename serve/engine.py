"""The offline engine: continuous batching of V4.1 requests over one device.

``Engine`` ties the host scheduler (serve/scheduler.py) to the device runner
(serve/runner.py). Each iteration plans a ragged batch, pads it to a bucket and
dispatches one jitted step. With overlap scheduling on, the host plans and dispatches
step N+1 before it reads step N's samples: a decode whose previous token is still on
the device is fed a placeholder the step resolves itself, and a request that finished in
step N releases its slot only after the steps in flight for it have landed. Outputs are
identical with overlap on and off (seeds are keyed by position).

The door: ``submit`` validates a request once and returns a ``Handle`` (serve/handle.py) whose
``deltas`` stream it; ``generate`` / ``collect`` run a batch to completion; ``abort`` by exact
id; ``load``, ``flush_cache`` and ``open_streams`` for the server; ``last_logits`` for ``/v1/score``
(serve/batch_scoring.py's ``Scorer`` on the engine's model and programs).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from model.batch import Batch
from model.config import ModelConfig
from model.engram_hash import DEAD
from model.forward import halo_rows
from model.kernel_paths import kernel_paths
from serve.batch_scoring import Scorer
from serve.detokenizer import Detokenizer
from serve.disaggregation.handoff import Prefilled, Reservation
from serve.expert_balancer import ExpertBalancer
from serve.grammar import GrammarError, compile_grammar
from serve.handle import Handle, RequestError
from serve.hicache import HiCache, HiCacheConfig
from serve.kv_pages import model_identity
from serve.loaded_model import QUANTIZATIONS, LoadedModel, model_dtype
from serve.programs import compile_threads
from serve.request import Request
from serve.runner import Buckets, ModelRunner, SlotReset, SpecOptions, StepInput, enable_compilation_cache
from serve.speculative import SpecInput
from serve.sampling import InvalidSamplingParam, SampleOutput, SamplingArrays, SamplingParams, min_tokens_banned
from serve.scheduler import Chunk, Scheduler
from sharding.mesh import MeshSpec
from sharding.specs import param_placement, shard_params

THINK_END_ID = 128822  # `</think>` in the DeepSeek-V4 tokenizer (MODEL_SPEC §10)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 8
    max_len: int = 4096
    page_size: int = 64
    num_pages: int | None = None  # default: enough for max_running full-length requests
    prefill_budget: int | None = None  # tokens per step (chunked prefill); None: 8192 on a GPU, 2048 elsewhere
    decoder_replay: str = "approx"  # "approx" | "exact" | "off"
    overlap: bool = True
    prefix_cache: bool = True
    top_logprobs: int = 20
    # "fp8_e4m3": the KV state in the formats the model quantises it to (FP8 window rings, NVFP4
    # compressed pools: model.state), as SGLang keeps V4's; "auto": their values in the model dtype
    kv_cache_dtype: str = "auto"
    # "fp8" / "mxfp4": expert weights quantised at load (mega.moe.FORMATS); "w8a8": fp8 weights
    # and the rows into each expert GEMM in fp8 (SGLang's block-fp8 MoE)
    quantization: str = "none"
    max_programs: int | None = None  # compiled step programs held at once (None: as many as fit, serve/programs.py)
    dtype: str = "auto"  # the model dtype: "bfloat16", "float32", or "auto" (bf16 on a GPU, fp32 elsewhere)
    # speculative decoding (SGLang's names): "DSPARK" or None; drafts a step (None: the block size);
    # fixed verification (every draft verified, even past max_new_tokens) and a simulated mean
    # accept length, both for benchmarks
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_fixed_verify: bool = False
    speculative_accept_length: float | None = None
    # data and expert parallelism over a (data, expert) mesh of dp x ep devices (sharding.mesh)
    dp_size: int = 1
    ep_size: int = 1
    # a benchmark mode: tokens spread evenly over the experts, not routed (changes outputs)
    balanced_routing: bool = False
    # redundant experts and EPLB over the expert ranks (sharding.expert_placement; outputs unchanged)
    ep_num_redundant_experts: int = 0
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = 1000
    # the Engram tables split over the devices' memory or over the host memory beside them
    engram_placement: str = "device"
    # the hierarchical prefix cache (host and storage tiers under the radix cache: serve/hicache.py); None: off
    hicache: HiCacheConfig | None = None

    def __post_init__(self):
        model_dtype(self.dtype)   # (a bad name: ValueError)
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3, not {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.decoder_replay not in ("approx", "exact", "off"):
            raise ValueError(f"decoder_replay must be approx, exact or off, not {self.decoder_replay!r}")
        if self.page_size <= 0 or self.page_size % 2:
            raise ValueError("page_size must be even (a ratio-2 group must not straddle pages)")
        if min(self.max_running, self.max_len) <= 0:
            raise ValueError("max_running and max_len must be positive")
        if self.speculative_algorithm not in (None, "DSPARK"):
            raise ValueError(f"speculative_algorithm must be DSPARK or None, not {self.speculative_algorithm!r}")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be at least 1")
        if self.speculative_accept_length is not None and self.speculative_accept_length < 1:
            raise ValueError("speculative_accept_length counts the bonus token: at least 1")
        self.mesh_spec   # (a bad size: ValueError)
        if self.ep_num_redundant_experts < 0 or self.eplb_rebalance_num_iterations < 1:
            raise ValueError("--ep-num-redundant-experts must be at least 0 and --eplb-rebalance-num-iterations "
                             "at least 1")
        if (self.ep_num_redundant_experts or self.enable_eplb) and self.ep_size == 1:
            raise ValueError("--ep-num-redundant-experts and --enable-eplb place experts over the expert ranks: "
                             "they need --ep-size > 1")
        if self.max_running % self.dp_size:
            raise ValueError(f"--max-running-requests {self.max_running} must divide over --dp-size {self.dp_size}: "
                             "each DP rank owns an equal share of the request slots")
        if self.hicache is not None and not self.prefix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache (without --disable-radix-cache)")
        if self.prefill_budget is not None and self.prefill_budget <= self.max_running:
            raise ValueError(f"the chunked-prefill size ({self.prefill_budget}) must exceed max_running "
                             f"({self.max_running}): a step's decodes count against it")

    @property
    def step_tokens(self) -> int:
        """The chunked-prefill budget: tokens one step computes, its decodes included."""
        if self.prefill_budget is not None:
            return self.prefill_budget
        from mega.backend import on_gpu

        return max(8192 if on_gpu() else 2048, 2 * self.max_running)

    @property
    def quantized_kv(self) -> bool:
        """Whether the KV state is kept in its stored formats (``kv_cache_dtype``)."""
        return self.kv_cache_dtype == "fp8_e4m3"

    @property
    def model_dtype(self):
        """The dtype of the weights and activations (the kernels take bf16)."""
        return model_dtype(self.dtype)

    @property
    def pages(self) -> int:
        """KV pages in the pool: a multiple of ``dp_size`` (each DP rank holds an equal part)."""
        pages = self.num_pages or self.max_running * -(-self.max_len // self.page_size)
        return -(-pages // self.dp_size) * self.dp_size

    @property
    def mesh_spec(self) -> MeshSpec:
        return MeshSpec(self.dp_size, self.ep_size)

    def mesh(self) -> Mesh | None:
        """The mesh the weights and state are split over: several devices, or with the Engram
        tables in host memory a 1 x 1 mesh; None: one device, arrays as they are."""
        if self.mesh_spec.size == 1 and self.engram_placement == "device":
            return None
        return self.mesh_spec.build(None if self.mesh_spec.size > 1 else jax.devices()[:1])


def _penalised(p: SamplingParams) -> bool:
    """Whether ``p`` has penalties, which count earlier outputs: such a request decodes one token a
    step (the verify rows of a speculative one would each need the counts of the drafts before them)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    host_s: float = 0.0  # planning, padding and output processing
    wait_s: float = 0.0  # host blocked on device results
    verifies: int = 0  # speculative verify steps, summed over requests
    accepted: int = 0  # tokens they produced (accepted drafts and bonus tokens)


class Engine:
    def __init__(self, params: dict, cfg: ModelConfig, config: EngineConfig = EngineConfig(), tokenizer=None):
        enable_compilation_cache()
        self.model = LoadedModel.prepare(params, cfg, config.dtype, config.quantization)
        if config.balanced_routing:
            logging.getLogger("megajax").warning("--enable-balanced-routing: every token's experts are dealt "
                                                 "round-robin, not routed; outputs are not the model's")
            self.model = dataclasses.replace(self.model, cfg=dataclasses.replace(self.model.cfg,
                                                                                 expert_routing="balanced"))
        # over several devices (or with the Engram tables in host memory: a 1 x 1 mesh) the weights
        # are placed once, split by sharding.specs, for the steps and the scorer
        self.mesh = config.mesh()
        if self.mesh is not None:
            self.model = dataclasses.replace(self.model, params=shard_params(self.model.params, self.model.cfg,
                                                                              self.mesh, config.engram_placement))
        self.balancer = None
        if config.ep_num_redundant_experts or config.enable_eplb:
            self.balancer = ExpertBalancer(self.model.cfg, self.mesh, config.ep_num_redundant_experts,
                                           config.eplb_rebalance_num_iterations if config.enable_eplb else None)
            self.balancer.initial(self.model.params,
                                  lambda params: setattr(self, "model", dataclasses.replace(self.model, params=params)))
        cfg, params, emap = self.model.cfg, self.model.params, self.model.engram_map
        self.cfg, self.config = cfg, config
        self.tokenizer = tokenizer
        self._cmap = None if emap is None else np.asarray(emap)
        eos = cfg.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))
        keep = {"approx": cfg.sliding_window, "exact": halo_rows(cfg), "off": None}[config.decoder_replay]
        self.buckets = Buckets.make(config.max_running, config.step_tokens, keep)
        spec = self._spec_options(params, cfg, config)
        b = self.buckets
        self.runner = ModelRunner(params, cfg, emap, config.max_running, config.max_len, config.page_size,
                                  config.pages, keep, self.buckets, config.top_logprobs,
                                  quantized_kv=config.quantized_kv, spec=spec, mesh=self.mesh,
                                  count_experts=config.enable_eplb)
        self.kernel_paths = kernel_paths(params, cfg, b.decode + b.prefill + b.replay,
                                         self.runner.pages_per_request * config.page_size,
                                         config.quantized_kv)
        log = logging.getLogger("megajax")
        log.info("model dtype %s", config.model_dtype.name)
        for op, path in self.kernel_paths.items():
            log.info("%s: %s", op, path)
        # Where programs compile one at a time (the CPU, whose JIT maps every kernel: serve/programs.py),
        # compile the smallest step now: its cost sizes the program budget, and a configuration that
        # cannot fit fails here, not at a later request. A GPU host's programs map little (94 mappings
        # at Flash depth) and take minutes each there: they compile side by side at warmup.
        budget = self.runner.programs.budget
        budget.cap(config.max_programs)
        if compile_threads() == 1:
            self.runner.step(self.runner.empty_input(self.buckets.decode[0]), None)
            budget.check()
        n_programs = len(self.buckets.programs())
        log.info("compiled programs: %s of the %d bucket programs held at once, the rest compiled on demand (%s)",
                 min(budget.capacity() or n_programs, n_programs), n_programs,
                 f"{budget.map_cost} mappings a program measured, under {budget.limits() or 'no known limit'}"
                 if budget.map_cost else "not measured: compiled side by side")
        self.scorer = Scorer(self.model, self.runner.programs)   # whole sequences, no KV pool
        # what must agree for another engine's pages to be valid here (hicache's storage, disaggregation)
        self.page_identity = model_identity(cfg, params, self.runner.page_layout, config.quantization)
        self.hicache = None if config.hicache is None else HiCache(
            config.hicache, self.runner.page_layout, self.page_identity, self.runner, config.pages)
        self.scheduler = Scheduler(config.max_running, config.page_size, config.pages, config.step_tokens,
                                   cfg.sliding_window, config.max_len, config.prefix_cache,
                                   config.speculative_fixed_verify, config.dp_size, self.hicache)
        self.page_table = np.zeros((config.max_running, self.runner.pages_per_request), np.int32)
        self.stats = StepStats()
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._pending: list[tuple[list[Chunk], tuple]] = []  # dispatched steps not yet processed
        self._lock = threading.RLock()  # step() lands in-flight work while holding it
        self.error: str | None = None  # set when the loop died; the server reports unhealthy
        self._max_token_chars: int | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def _spec_options(params: dict, cfg: ModelConfig, config: EngineConfig) -> SpecOptions | None:
        """DSpark's settings for the runner, checked against the model (ValueError saying why not)."""
        if config.speculative_algorithm is None:
            return None
        if "mtp" not in params:
            raise ValueError("--speculative-algorithm DSPARK needs the model's draft layers (the checkpoint's mtp.* "
                             "tensors), which this model does not have")
        n = config.speculative_num_draft_tokens or cfg.dspark_block_size
        if n > cfg.dspark_block_size:
            raise ValueError(f"speculative_num_draft_tokens ({n}) exceeds the draft's block size "
                             f"({cfg.dspark_block_size})")
        if config.step_tokens <= config.max_running * (1 + n):
            raise ValueError(f"the chunked-prefill size ({config.step_tokens}) must exceed max_running x (1 + drafts) "
                             f"({config.max_running * (1 + n)}): a step's verifies count against it")
        return SpecOptions(n, config.speculative_accept_length)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig = EngineConfig(),
                       progress: bool = False) -> "Engine":
        """An engine on the checkpoint in ``model_dir``, loaded in ``config``'s model dtype
        (``progress``: a loading bar on stderr)."""
        mesh = config.mesh()   # (read by shard: each process its devices' part)
        model = LoadedModel.from_model_dir(model_dir, config.dtype, progress=progress,
                                           placement=None if mesh is None else param_placement(mesh))
        return cls(model.params, model.cfg, config)

    # ------------------------------------------------------------------ the door
    def submit(self, prompt: list[int] | str, params: SamplingParams | dict | None = None, *,
               rid: str | None = None, thinking: bool = False, stream: bool = True,
               dp_rank: int | None = None, export=None,
               prefilled: tuple[Reservation, Prefilled] | None = None) -> Handle:
        """Queue one client request: validated (here only), its constraint compiled (under
        ``thinking`` it starts after ``</think>``), fanned out to ``n`` samples (sample i seeded
        ``seed + i``, ids ``rid-i``), which share one turn in the scheduler's fair share and abort
        together. ``RequestError`` says why not. ``stream``: deltas go to ``Handle.deltas``
        (needs the loop running: ``start``); otherwise ``collect`` gathers the results.
        ``dp_rank``: the DP rank to run it on (a router's ``data_parallel_rank``), else the
        scheduler's choice. Disaggregation (one sample only): ``export`` (prefill side) is called
        with the request's ``Prefilled`` state when it ends (None if it ended without it);
        ``prefilled`` (decode side): the state P sent, written into the pages reserved for it
        (``reserve``), from which the request goes on after the first token."""
        try:
            return self._submit(prompt, params, rid, thinking, stream, dp_rank, export, prefilled)
        except BaseException:   # whatever failed, the other side of a pair hears of it at once
            if prefilled is not None and not prefilled[0].adopted:
                self.release(prefilled[0])
            if export is not None:
                export(None)
            raise

    def _submit(self, prompt, params, rid, thinking, stream, dp_rank, export, prefilled) -> Handle:
        if self.error is not None:
            raise RequestError(f"the engine failed: {self.error}", status=503)
        self._check_rank(dp_rank)
        ids, params, grammar = self.validate(prompt, params, thinking)
        if (export or prefilled) is not None:
            self._check_paired(params)
        rid = rid or f"req-{next(self._ids)}"
        subs = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        handle = Handle(rid, subs, self._close)
        with self._lock:
            taken = [s for s in subs if s in self._requests or any(r.group == s for r in self._requests.values())]
            if taken:
                raise RequestError(f"request id {taken[0]!r} is already in use", "rid")
            for i, sub in enumerate(subs):
                p = params if params.n == 1 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)
                req = Request(sub, ids, p, next(self._ids), group=rid, handle=handle if stream else None, index=i,
                              spec=self.runner.spec is not None and not _penalised(p), dp_rank=dp_rank)
                req.grammar = None if grammar is None else (grammar if i == 0 else grammar.copy())
                if stream:
                    req.detok = Detokenizer(self.decode)
                req.export = export
                try:
                    if prefilled is None:
                        self.scheduler.submit(req)
                    else:
                        self._adopt(req, *prefilled)
                except ValueError as e:   # too long for the context, or for one DP rank's pages
                    raise RequestError(str(e), "max_new_tokens") from None
                self._requests[sub] = req
        return handle

    def _check_rank(self, dp_rank) -> None:
        if dp_rank is not None and (type(dp_rank) is not int or not 0 <= dp_rank < self.config.dp_size):
            raise RequestError(f"data_parallel_rank must be an integer in [0, {self.config.dp_size}) "
                               f"(--dp-size {self.config.dp_size}), got {dp_rank!r}", "data_parallel_rank")

    @staticmethod
    def _check_paired(params: SamplingParams) -> None:
        if params.n != 1:
            raise RequestError("a disaggregated request must have n = 1", "n")

    def admissible(self, ids: list[int], params: SamplingParams, dp_rank: int | None = None) -> None:
        """``RequestError`` when ``submit`` would refuse a disaggregated request for its rank, ``n`` or
        size (cheap: no grammar is compiled), so a pair refuses it before either side works on it."""
        self._check_rank(dp_rank)
        self._check_paired(params)
        try:
            self.scheduler.check(Request("", ids, params, 0))
        except ValueError as e:
            raise RequestError(str(e), "max_new_tokens") from None

    def reserve(self, prompt_tokens: int, dp_rank: int | None = None) -> Reservation | None:
        """Set aside the pages for a prompt's whole pages (disaggregated decode, before P prefills
        it); None while no DP rank has them. ``release`` gives them back if its state never comes."""
        with self._lock:
            got = self.scheduler.reserve(prompt_tokens // self.config.page_size, dp_rank)
        return None if got is None else Reservation(*got)

    def release(self, reservation: Reservation) -> None:
        with self._lock:
            self.scheduler.unreserve(reservation.rank, reservation.pages)

    def _adopt(self, req: Request, reservation: Reservation, state: Prefilled) -> None:
        """(Lock held.) Take P's state: the first token as if sampled here, the pages into the reserved
        ones; the request then decodes from there (its admission replays the window)."""
        pages, rest = reservation.pages[:state.n_pages], reservation.pages[state.n_pages:]
        self._accept(req, state.first, state.logprob or 0.0, iter(state.top_logprobs))
        req.cached_tokens = state.cached_tokens
        if req.finished:
            rest = reservation.pages
        else:
            if pages:
                self.runner.write_pages(pages, np.asarray(state.pages)[:len(pages)])
            self.scheduler.adopt(req, reservation.rank, pages)
        reservation.adopted = True   # from here the request owns its pages (submit gives back the rest)
        self.scheduler.unreserve(reservation.rank, rest)
        self._notify(req)

    def validate(self, prompt: list[int] | str, params: SamplingParams | dict | None = None, thinking: bool = False):
        """``(token ids, SamplingParams, compiled grammar or None)`` of a request ``submit`` would
        take; ``RequestError`` says why not. Queues nothing (offline jobs check every line first)."""
        ids, params = self._checked(prompt, params)
        try:
            grammar = compile_grammar(params, self.cfg.vocab_size, self.eos_ids, THINK_END_ID if thinking else None)
        except GrammarError as e:
            raise RequestError(str(e), e.param) from None
        return ids, params, grammar

    def _checked(self, prompt: list[int] | str, params: SamplingParams | dict | None
                 ) -> tuple[list[int], SamplingParams]:
        if not isinstance(params, SamplingParams):
            try:
                params = SamplingParams.from_dict(params or {})
            except InvalidSamplingParam as e:
                raise RequestError(str(e), e.param) from None
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.cfg.vocab_size
                              for t in ids):
            raise RequestError(f"a prompt must be a non-empty list of token ids in [0, {self.cfg.vocab_size})",
                               "prompt")
        if params.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1", "max_new_tokens")
        limit = self.config.max_len
        if len(ids) >= limit:
            raise RequestError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                               f"({limit} tokens).", "prompt")
        if len(ids) + params.max_new_tokens > limit:
            raise RequestError(f"Requested token count exceeds the model's maximum context length of {limit} "
                               f"tokens. You requested a total of {len(ids) + params.max_new_tokens} tokens: "
                               f"{len(ids)} tokens from the input messages and {params.max_new_tokens} tokens "
                               f"for the completion.", "max_new_tokens")
        return ids, params

    def _close(self, handle: Handle) -> None:
        with self._lock:
            for rid in handle.rids:
                req = self._requests.pop(rid, None)
                if req is not None and not req.finished:
                    req.finish_reason = "abort"   # the scheduler reaps it

    def collect(self, handles: list[Handle], decode_text: bool = True, progress=None) -> list[dict]:
        """Step until idle and return each (non-streamed) handle's result: one dict, or
        ``{"choices": [...]}`` for ``n`` > 1 (``progress``: a bar counting samples)."""
        rids, done = [r for h in handles for r in h.rids], 0
        while self.has_work:
            self._step_or_wait()
            if progress is not None:
                finished = sum(self._requests[r].finished for r in rids)
                progress.update(finished - done)
                done = finished
        self._reap()
        results = []
        for h in handles:
            with self._lock:
                outs = [self._result(self._requests[rid], decode_text) for rid in h.rids]
            h.close()
            results.append(outs[0] if len(outs) == 1 else {"choices": outs})
        return results

    def abort(self, rid: str) -> None:
        """Finish request ``rid`` (exactly that id, or the ``n`` samples it fanned out to) now; its
        stream, if any, ends with ``abort``."""
        with self._lock:
            for key, req in self._requests.items():
                if (key == rid or req.group == rid) and not req.finished:
                    req.finish_reason = "abort"
                    self._notify(req)

    def abort_all(self) -> int:
        """Abort every streamed request (shutdown); how many streams are still open."""
        with self._lock:
            for req in self._requests.values():
                if req.handle is not None and not req.finished:
                    req.finish_reason = "abort"
                    self._notify(req)
        return self.open_streams()

    def open_streams(self) -> int:
        with self._lock:
            return len({id(r.handle) for r in self._requests.values() if r.handle is not None})

    def load(self) -> dict:
        """The scheduler's state now, for ``/metrics``, ``/get_load`` and admission control: the
        totals, and under DP attention each rank's (``dp_ranks``)."""
        with self._lock:
            s = self.scheduler
            out = self._load_of(s.ranks, s.running)
            if self.runner.spec is not None:   # tokens a verify step yields, the bonus included
                out["spec_accept_length"] = self.stats.accepted / max(self.stats.verifies, 1)
            if len(s.ranks) > 1:   # the queue is shared until admission: it has no per-rank count
                out["dp_ranks"] = [{"dp_rank": r.index, **self._load_of(
                    [r], [q for q in s.running if q.rank == r.index])} for r in s.ranks]
            out["num_queue_reqs"] = len(s.waiting)
            if self.hicache is not None:
                out["hicache"] = self.hicache.metrics()
            return out

    def rank_loads(self) -> list[dict]:
        """SGLang's ``/get_load``: each DP rank's requests and tokens (its used pages' and its waiting
        requests'). The queue is shared until admission: a request that names no rank is counted on
        the ranks in turn."""
        with self._lock:
            s, n = self.scheduler, len(self.scheduler.ranks)
            waiting = [[] for _ in range(n)]
            for i, req in enumerate(s.waiting):
                waiting[i % n if req.dp_rank is None else req.dp_rank].append(req)
            now, out = time.perf_counter(), []
            for r, queued in zip(s.ranks, waiting):
                running = sum(q.rank == r.index and not q.finished for q in s.running)
                out.append({"dp_rank": r.index, "num_reqs": running + len(queued), "num_waiting_reqs": len(queued),
                            "num_tokens": r.used_pages * self.config.page_size + sum(len(q.ids) for q in queued),
                            "ts_tic": now})
            return out

    def _load_of(self, ranks, running) -> dict:
        used = sum(r.used_pages for r in ranks)
        radixes = [r.radix for r in ranks if r.radix is not None]
        prompt = sum(x.stats["prompt_tokens"] for x in radixes)
        return {"num_running_reqs": len(running), "num_used_tokens": used * self.config.page_size,
                "token_usage": used / sum(r.pool.num_pages for r in ranks),
                "cache_hit_rate": sum(x.stats["cached_tokens"] for x in radixes) / prompt if prompt else 0.0}

    def flush_cache(self) -> str | None:
        """Drop the prefix cache; why it cannot be dropped now (requests in flight), or None."""
        with self._lock:
            if not self.config.prefix_cache:
                return None
            if self.scheduler.running or self.scheduler.waiting:
                return "cannot flush the cache while requests are running"
            for rank in self.scheduler.ranks:
                rank.pool.give(rank.radix.reset())
            if self.hicache is not None:
                self.hicache.flush()
            return None

    def control_tokens(self) -> list[str]:
        """V4's role and task tokens (``<｜User｜>``, ...): added tokens not flagged special."""
        return [t.content for t in self._tok().get_added_tokens_decoder().values()
                if t.content.startswith("<｜") and t.content.endswith("｜>")]

    def max_token_chars(self) -> int:
        """The most characters one token decodes to (a bound on a text's length per token)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tok().get_vocab(with_added_tokens=True)))
        return self._max_token_chars

    def encode(self, text: str) -> list[int]:
        return self._tok().encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok().decode(ids, skip_special_tokens=False)

    def _tok(self):
        if self.tokenizer is None:
            from tokenizers import Tokenizer

            from model.engram_vocab import tokenizer_path

            self.tokenizer = Tokenizer.from_file(str(tokenizer_path()))
        return self.tokenizer

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    # ------------------------------------------------------------------ the loop
    def step(self) -> bool:
        """One iteration: plan and dispatch a step, then process a finished one. False when there was
        nothing to do (every waiting request waits on something else: a prefetch, a transfer)."""
        t0 = time.perf_counter()
        with self._lock:
            if self.balancer is not None and self.balancer.due(self.stats.steps):
                self._rebalance()
            self._reap()
            if self._pending and self.scheduler.waiting_on_flight():
                self._finish_pending(t0)
                t0 = time.perf_counter()
                self._reap()
            chunks = self.scheduler.schedule()
            while chunks is None:  # memory is short: land everything in flight, then retract
                if self._pending:
                    self._finish_pending(t0)
                    t0 = time.perf_counter()
                else:
                    self.scheduler.retract(self.scheduler.victim())
                self._reap()
                chunks = self.scheduler.schedule()
            if chunks:
                self._pending.append((chunks, self._dispatch(chunks)))
        busy = bool(chunks or self._pending)
        if self._pending and (not self.config.overlap or len(self._pending) > 1 or not chunks):
            self._finish_pending(t0)
        else:
            self.stats.host_s += time.perf_counter() - t0
        return busy

    def _step_or_wait(self) -> None:
        """A step, or a millisecond's sleep when there was nothing to do: a loop that spun instead would
        hold the GIL against the threads it waits for (storage reads, transfers)."""
        if not self.step():
            time.sleep(0.001)

    def _rebalance(self) -> None:
        """EPLB: the experts re-placed for the load the steps counted (the same outputs)."""
        state = self.runner.state
        try:
            zeroed = self.balancer.rebalance(self.model.params, state.model.expert_load, self.stats.steps,
                                             self._use_params)
        except Exception:   # serving goes on: every layer keeps a placement, the old or the new
            logging.getLogger("megajax").exception("eplb: the rebalance failed; serving on the placement it left")
            return
        self.runner.state = state._replace(model=state.model.replace(expert_load=zeroed))

    def _use_params(self, params: dict) -> None:
        self.model = dataclasses.replace(self.model, params=params)
        self.runner.params, self.scorer.model = params, self.model

    def _finish_pending(self, t0: float) -> None:
        chunks, (out, rows) = self._pending.pop(0)
        self.stats.host_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        out = np.asarray(out)
        t2 = time.perf_counter()
        self.stats.wait_s += t2 - t1
        with self._lock:
            self._process(chunks, out, rows)
        self.stats.host_s += time.perf_counter() - t2

    def run_until_idle(self) -> None:
        while self.has_work:
            self._step_or_wait()
        self._reap()

    def _reap(self) -> None:
        """Release finished requests whose steps have all landed."""
        for req in [r for r in self.scheduler.running if r.finished and not r.inflight]:
            if req.export is not None:
                self._export(req)
            self.scheduler.release(req, cache=req.finish_reason != "abort")
        for req in [r for r in self.scheduler.waiting if r.finished]:
            if req.export is not None:
                self._export(req)
            self.scheduler.discard(req)

    def _export(self, req: Request) -> None:
        """Hand a prefill-side request's state to its ``export`` (disaggregation), before its pages
        go: its whole prompt pages (read now, after the steps that wrote them) and its first token;
        None when it ended without one (aborted)."""
        export, req.export = req.export, None
        state = None
        if req.output and req.finish_reason != "abort":
            n = min(len(req.prompt) // self.config.page_size, len(req.pages))
            state = Prefilled(n, self.runner.read_pages(req.pages[:n]) if n else None, req.output[0],
                              req.cached_tokens, req.token_logprobs[0] if req.token_logprobs else None,
                              req.top_logprobs[0] if req.top_logprobs else [])
        try:
            export(state)
        except Exception:  # noqa: BLE001 -- the pair's failure, not the engine's
            logging.getLogger("megajax").exception("handing request %s to its decode side failed", req.rid)

    def _dispatch(self, chunks: list[Chunk]) -> tuple[Any, int]:
        """Pad the chunks into a step and dispatch it: ``(its samples on the device, logit rows)``."""
        masks = {}   # chunk -> the grammar's mask at each of its sampled rows
        for c in chunks:
            if c.samples and c.req.grammar is not None:
                masks[id(c)] = self._masks(c.req, c.drafts)
                if c.drafts:   # a draft the grammar refuses is never fed, nor those after it
                    c.drafts = c.drafts[:len(masks[id(c)]) - 1]
                    c.n = 1 + len(c.drafts)
        n_tok = sum(c.n for c in chunks)
        has_prefill = any(c.n > 1 + len(c.drafts) for c in chunks)   # a verify is a decode
        t = self.buckets.tokens(n_tok, has_prefill)
        b, s = self.config.max_running, self.runner.logit_rows(t)
        tokens, seq_ids, pos = np.zeros(t, np.int32), np.full(t, -1, np.int32), np.zeros(t, np.int32)
        is_prompt, recount = np.zeros(t, bool), np.zeros(t, bool)
        rows, slots = np.zeros(s, np.int32), np.full(s, -1, np.int32)
        n_hist = self.runner.state.model.engram_hist.shape[1]
        reset = SlotReset(np.zeros(b, bool), np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32),
                          np.full((b, n_hist), DEAD, np.int32))
        spec = None if self.runner.spec is None else SpecInput(np.full(b, -1, np.int32), np.zeros(b, np.int32),
                                                               np.zeros(b, np.int32))
        ban = None  # [S, V] bool, made only when some row bans a token (a 4 MB host copy a step)
        sampled, steps = [], []
        row, n_spec = 0, 0
        for c in chunks:
            req, slot = c.req, c.req.slot
            known = req.ids[c.start:c.start + c.n - len(c.drafts)]
            tokens[row:row + len(known)] = known
            # after them: the drafts, or the previous sample, still on the device
            tokens[row + len(known):row + c.n] = c.drafts if c.drafts else -(slot + 1)
            seq_ids[row:row + c.n], pos[row:row + c.n] = slot, np.arange(c.start, c.start + c.n)
            at = np.arange(c.start, c.start + c.n)
            is_prompt[row:row + c.n] = at < len(req.prompt)
            recount[row:row + c.n] = (at >= len(req.prompt)) & (at < req.recount_upto)
            self.page_table[slot, :len(req.pages)] = req.pages
            if c.fresh:  # a prefix hit restarts `window` tokens before its end (encoder replay)
                reset.mask[slot], reset.seq_len[slot], reset.window_floor[slot] = True, c.start, c.start
                reset.cached_len[slot] = req.shared_pages * self.config.page_size
                if self._cmap is not None and n_hist:
                    back = [int(self._cmap[x]) for x in req.ids[max(0, c.start - n_hist):c.start]]
                    reset.engram_hist[slot, n_hist - len(back):] = back
            if c.samples:
                if req.spec:
                    spec.slot[n_spec], spec.first[n_spec], spec.count[n_spec] = slot, len(sampled), 1 + len(c.drafts)
                    n_spec += 1
                rows_masks = masks.get(id(c))
                for j in range(1 + len(c.drafts)):   # the last token's row, then each draft's
                    k = len(sampled)
                    rows[k], slots[k] = row + c.n - 1 - len(c.drafts) + j, slot
                    at_pos = c.start + c.n - len(c.drafts) + j   # the sampled token's position
                    banned = min_tokens_banned(req.params, at_pos - len(req.prompt), self.eos_ids)
                    allowed = None if rows_masks is None else rows_masks[j]
                    if banned or allowed is not None:
                        ban = np.zeros((s, self.cfg.vocab_size), bool) if ban is None else ban
                        ban[k, [x for x in banned if x < self.cfg.vocab_size]] = True
                    if allowed is not None:  # a finished grammar may allow only EOS: it wins over min_new_tokens
                        ban[k] = ~allowed if (ban[k] | ~allowed).all() else ban[k] | ~allowed
                    sampled.append(req)
                    steps.append(at_pos)
            row += c.n
            req.computed = c.start + c.n
            req.inflight += 1
        replay = None
        if self.runner.replay_keep is not None and has_prefill:
            keep = sum(min(c.n, self.runner.replay_keep) for c in chunks)
            replay = self.buckets.replay_rows(keep)
        samp = SamplingArrays.build([r.params for r in sampled], steps, s, [r.rid for r in sampled])
        if ban is None:
            ban = self.runner.no_ban(s)
        inp = StepInput(Batch(tokens, seq_ids, pos), is_prompt, recount, rows, slots, samp, ban, self.page_table.copy(),
                        reset, spec)
        self.stats.steps += 1
        self.stats.tokens += n_tok
        return self.runner.step(inp, replay), s

    def _masks(self, req: Request, drafts: tuple[int, ...]) -> list:
        """The grammar's allowed tokens at each sampled row: after the last token, then after each
        draft (a copy of the matcher walks them; None: not active yet). A draft the grammar
        refuses ends the list."""
        v = self.cfg.vocab_size
        masks = [req.grammar.allowed(v)]
        if drafts:
            walk = req.grammar.copy()
            for d in drafts:
                if masks[-1] is not None and not masks[-1][d]:
                    break
                walk.consume(d)
                masks.append(walk.allowed(v))
        return masks

    def _process(self, chunks: list[Chunk], out: np.ndarray, s: int) -> None:
        """Take a step's samples (its first ``s`` rows; then, with speculation, a row per
        speculative request: its accepted count and next drafts)."""
        tokens, logprobs, top_ids, top_lps = SampleOutput.unpacked(out[:s])
        spec_rows = out[s:]
        k, n_spec = 0, 0
        for c in chunks:
            req = c.req
            req.inflight -= 1
            if not c.samples:
                continue
            first, k = k, k + 1 + len(c.drafts)
            take = 1
            if req.spec:
                drafts = spec_rows[n_spec, 1:1 + self.runner.spec.num_drafts]
                accepted, req.drafts = int(spec_rows[n_spec, 0]), [int(x) for x in drafts]
                n_spec += 1
                take = 1 + accepted
                if c.drafts:
                    req.verify_ct += 1
                    req.computed = c.start + c.n - len(c.drafts) + accepted   # the rejected rows roll back
                    self.stats.verifies += 1
                    self.stats.accepted += take
            for j in range(take):
                if req.finished:
                    break  # a step dispatched before the host saw the stop, or a stop inside the block
                i = first + j
                tok = int(tokens[i]) if j == take - 1 or not c.drafts else c.drafts[j]
                self._accept(req, tok, float(logprobs[i]), zip(top_ids[i], top_lps[i]))
            self._notify(req)

    def _accept(self, req: Request, tok: int, logprob: float, top) -> None:
        """Append a token a request sampled (here, or on the prefill side of a disaggregated pair):
        its grammar, logprobs (``top``: (id, logprob) pairs, best first) and stop conditions."""
        req.output.append(tok)
        if req.grammar is not None:
            req.grammar.consume(tok)
        if req.params.logprobs:
            req.token_logprobs.append(logprob)
            req.top_logprobs.append([(int(a), float(b)) for a, b in itertools.islice(top, req.params.top_logprobs)])
        if req.detok is None and req.params.stop:
            req.detok = Detokenizer(self.decode)
        req.check_stop(tok, self.eos_ids, req.detok)

    # ------------------------------------------------------------------ public APIs
    def generate(self, prompts: Iterable[list[int] | str], sampling_params: dict | list | None = None,
                 decode_text: bool = True, progress=None) -> list[dict]:
        """Run a batch to completion; results in input order. Every request is validated before any
        runs (RequestError naming the first bad one, and nothing queued)."""
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        handles = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                try:
                    handles.append(self.submit(p, sp, stream=False))
                except RequestError as e:
                    raise RequestError(f"request {i}: {e}", e.param, e.status) from None
        except RequestError:
            for h in handles:
                h.close()
            raise
        return self.collect(handles, decode_text, progress)

    def _result(self, req: Request, decode_text: bool) -> dict:
        text = req.text
        if decode_text and not text and req.output:
            hidden = req.finish_reason == "stop" and isinstance(req.matched_stop, int)
            text = self.decode(req.output[:-1] if hidden else req.output)
        out = {"output_ids": list(req.output), "text": text, "finish_reason": req.finish_reason,
               "matched_stop": req.matched_stop, "usage": req.usage()}
        if req.spec:
            out["spec_verify_ct"] = req.verify_ct
        if req.params.logprobs:
            out["token_logprobs"], out["top_logprobs"] = req.token_logprobs, req.top_logprobs
        return out

    def _notify(self, req: Request) -> None:
        """Hand a stream what its request gained since the last call (called with the lock held):
        constant work a token, not a copy of the whole output."""
        if req.handle is None or req.notified_end:
            return
        n, stable, finished = len(req.output), req.stable_len(), req.finished
        if n == req.notified and stable <= req.notified_text and not finished:
            return   # nothing new
        delta = {"text": req.text[req.notified_text:stable], "output_ids": req.output[req.notified:],
                 "finish_reason": req.finish_reason, "matched_stop": req.matched_stop}
        if req.params.logprobs:
            delta["token_logprobs"] = req.token_logprobs[req.notified:]
            delta["top_logprobs"] = req.top_logprobs[req.notified:]
        if finished:
            delta["usage"] = req.usage()
            if req.spec:
                delta["spec_verify_ct"] = req.verify_ct
        req.notified, req.notified_text = n, max(req.notified_text, stable)
        req.notified_end = finished
        req.handle.put(req.index, delta)

    def start(self) -> threading.Thread:
        """Run the engine loop in a daemon thread (for streamed handles); a no-op while one runs."""
        if self._thread is not None and self._thread.is_alive():
            return self._thread
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                try:
                    if self.has_work:
                        self._step_or_wait()
                    else:
                        time.sleep(0.001)
                except Exception as e:  # noqa: BLE001 - fail the requests, not silently hang them
                    logging.getLogger("megajax").exception("engine loop failed")
                    self.error = f"{type(e).__name__}: {e}"
                    self._fail_all()
                    return

        self._thread = threading.Thread(target=loop, daemon=True, name="megajax-engine")
        self._thread.start()
        return self._thread

    def _fail_all(self) -> None:
        with self._lock:
            for req in self._requests.values():
                if not req.finished:
                    req.finish_reason = "abort"
                    self._notify(req)
                if req.export is not None:
                    self._export(req)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None
        if self.hicache is not None and self.error is None:
            # requests that finished before the loop stopped commit their pages, and the storage
            # writes land: what a restart finds in storage includes the last answers
            with self._lock:
                while self._pending:
                    self._finish_pending(time.perf_counter())
                self._reap()
        if self.hicache is not None:
            self.hicache.close()

    def last_logits(self, sequences: list[list[int]], batch_size: int = 8) -> np.ndarray:
        """``[len(sequences), V]`` next-token logits after each whole sequence (``/v1/score``)."""
        if self.runner.broadcast is not None:
            raise RequestError("scoring is not served across processes (--nnodes > 1) yet")
        return self.scorer.last_logits(sequences, batch_size)

    # ------------------------------------------------------------------ several processes (serve.multiprocess)
    def lead(self, address: tuple[str, int], followers: int) -> None:
        """Process 0 of several: wait for the followers to connect to ``address``; from then on
        each step's input goes to them before it is dispatched."""
        from serve.multiprocess import StepBroadcast

        self.runner.broadcast = StepBroadcast(address, followers)

    def follow(self, address: tuple[str, int]) -> int:
        """Another process: dispatch process 0's steps until it stops; the steps followed."""
        from serve.multiprocess import follow

        return follow(self.runner, address)

    def program_info(self) -> dict:
        """The compiled-program budget and cache counters (serve/programs.py)."""
        return self.runner.programs.info() | {"programs_in_buckets": len(self.buckets.programs())}

    def warmup_steps(self, steps: list[tuple[int, int | None]] | None = None) -> list[tuple[int, int | None]]:
        """The steps ``warmup`` runs: the buckets' programs in order (or ``steps``), as many as the
        budget holds."""
        capacity = self.runner.programs.budget.capacity()
        kept, programs = [], set()
        for t, r in self.buckets.warmup_steps() if steps is None else steps:
            programs.update(self.buckets.programs_of(t, r))
            if capacity is not None and len(programs) > capacity:
                break
            kept.append((t, r))
        return kept

    def warmup(self, progress=None, workload: list[tuple[int, bool]] | None = None) -> int:
        """Compile the programs of ``warmup_steps`` (or of the steps a ``workload`` of ``(tokens,
        has_prefill)`` runs first, as ``Buckets.step`` maps them) now, several at a time on a GPU
        host (``compile_threads``; one process: the others of a multi-process mesh compile at the
        steps it sends), not at the first request; the rest compile when first needed. Returns
        the steps run."""
        steps = self.warmup_steps(None if workload is None else sorted({self.buckets.step(*w) for w in workload}))
        if self.runner.broadcast is None:
            self.runner.compile_ahead(steps, compile_threads())
        for t, r in steps:
            self.runner.step(self.runner.empty_input(t), r)
            if progress is not None:
                progress.update(1)
        if self.hicache is not None:
            self.hicache.warmup(self.runner.pages_per_request)
        jax.block_until_ready(self.runner.state)
        return len(steps)
