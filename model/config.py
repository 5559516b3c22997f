"""Typed DeepSeek-V4.1 configuration, read from an HF-style ``config.json``.

The dataclass mirrors ``DeepseekV41TextConfig``: every field of the reference's
``config.json`` has a typed counterpart here. Fields that fix tensor shapes or
the layer schedule are required; scalar hyper-parameters fall back to the
reference defaults. Derived fields (``compress_ratios`` padded with the draft
layers, ``layer_types``, ``rope_parameters``, ``candidate_source_layer_id``) are
computed the way the reference's ``__post_init__`` computes them, and
``validate`` rejects the schedules the reference silently gets wrong (a KV
source that is not an index source, a reader whose compress ratio differs from
its KV source's, ...). Every error names the offending field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A missing, mistyped or inconsistent config field (the message names it)."""


_REQUIRED = object()


def _req():
    return field(default=_REQUIRED)  # type: ignore[return-value]


@dataclass(frozen=True)
class ModelConfig:
    # sizes
    vocab_size: int = _req()
    hidden_size: int = _req()
    num_hidden_layers: int = _req()
    num_attention_heads: int = _req()
    head_dim: int = _req()
    q_lora_rank: int = _req()
    qk_rope_head_dim: int = _req()
    num_key_value_heads: int = 1
    # rope
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 1048576
    # sliding window + compressed sparse attention
    sliding_window: int = _req()
    compress_ratios: tuple[int, ...] = _req()
    kv_source_layer_ids: tuple[int, ...] = _req()
    index_source_layer_ids: tuple[int, ...] = _req()
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = _req()
    index_head_dim: int = _req()
    index_topk: int = _req()
    o_groups: int = _req()
    o_lora_rank: int = _req()
    # MoE
    moe_intermediate_size: int = _req()
    n_routed_experts: int = _req()
    n_shared_experts: int = 1
    num_experts_per_tok: int = _req()
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    topk_method: str = "noaux_tc"
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    # "fp8": rows quantised to e4m3 (a power-of-two scale per 128 columns) before each expert
    # GEMM, as block-fp8 checkpoints' dynamic activation scheme (W8A8) does
    expert_activations: str = "bf16"
    # "balanced": each token's experts dealt round-robin by its position instead of chosen by the
    # router (the seed's balanced-routing benchmark mode, --enable-balanced-routing): changes outputs
    expert_routing: str = "model"
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # misc
    rms_norm_eps: float = 1e-20
    tie_word_embeddings: bool = False
    eos_token_id: int | tuple[int, ...] | None = 1
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    layer_types: tuple[str, ...] | None = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError("config must be a JSON object")
        if "text_config" in raw:  # composite DeepseekV41Config
            raw = raw["text_config"]
        if "engram_pad_token_id" in raw and "engram_pad_id" not in raw:  # the name vLLM's loader reads
            raw = {**raw, "engram_pad_id": raw["engram_pad_token_id"]}
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in raw and raw[f.name] is not None:
                kwargs[f.name] = _coerce(f.name, raw[f.name], f.type)
            elif f.default is _REQUIRED:
                raise ConfigError(f"config field '{f.name}' is missing")
        cfg = cls(**kwargs)
        return cfg._derive()

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    def __hash__(self) -> int:  # dict fields: hash the canonical JSON (configs are jit static args)
        return self._json_hash

    @cached_property
    def _json_hash(self) -> int:  # once per config, not once per jitted call
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    # ------------------------------------------------------------------ derivation
    def _derive(self) -> "ModelConfig":
        if self.expert_activations not in ("bf16", "fp8"):
            raise ConfigError(f"config field 'expert_activations' must be bf16 or fp8, not {self.expert_activations!r}")
        if self.expert_routing not in ("model", "balanced"):
            raise ConfigError(f"config field 'expert_routing' must be model or balanced, not {self.expert_routing!r}")
        n, n_draft = self.num_hidden_layers, self.num_nextn_predict_layers
        ratios = list(self.compress_ratios)
        if not n <= len(ratios) <= n + n_draft:
            raise ConfigError(
                f"config field 'compress_ratios' has {len(ratios)} entries; expected between "
                f"num_hidden_layers ({n}) and num_hidden_layers + num_nextn_predict_layers ({n + n_draft})"
            )
        ratios = ratios + [0] * (n + n_draft - len(ratios))
        if any(r != 0 for r in ratios[n:]):
            raise ConfigError("config field 'compress_ratios': draft layers must have ratio 0")
        kv = tuple(self.kv_source_layer_ids)
        cand = self.candidate_source_layer_id
        if cand is None:
            cand = kv[-1] if kv else -1
        layer_types = tuple("shared_compressed_attention" if i in kv else "sliding_attention" for i in range(n))
        if self.layer_types is not None and tuple(self.layer_types) != layer_types:
            raise ConfigError("config field 'layer_types' does not match 'kv_source_layer_ids'")
        targets = self.dspark_target_layer_ids
        if targets is None:
            targets = tuple(sorted([i for i in range(n) if i not in kv][-3:]))
        cfg = dataclasses.replace(
            self,
            compress_ratios=tuple(ratios),
            candidate_source_layer_id=cand,
            layer_types=layer_types,
            rope_parameters=self._rope_parameters(),
            dspark_target_layer_ids=tuple(targets),
        )
        cfg.validate()
        return cfg

    def _rope_parameters(self) -> dict:
        rp = self.rope_parameters or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            return {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
        partial = self.qk_rope_head_dim / self.head_dim
        yarn = {k: v for k, v in (self.rope_scaling or {}).items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": partial}
        compress = {"rope_type": "default", **yarn, "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": partial}
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        return {"main": main, "compress": compress}

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        n = self.num_hidden_layers
        ratios = self.compress_ratios[:n]
        kv, idx = self.kv_source_layer_ids, self.index_source_layer_ids

        def bad(name, why):
            raise ConfigError(f"config field '{name}': {why}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                     "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
                     "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "candidate_block_size",
                     "candidate_topk_blocks"):
            if getattr(self, name) <= 0:
                bad(name, f"must be positive, got {getattr(self, name)}")
        if self.num_key_value_heads != 1:
            bad("num_key_value_heads", "V4.1 attention has one shared K=V latent; must be 1")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            bad("qk_rope_head_dim", "must be even and at most head_dim and index_head_dim")
        if self.num_attention_heads % self.o_groups:
            bad("o_groups", f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok", "exceeds n_routed_experts")
        if self.n_shared_experts not in (0, 1):
            bad("n_shared_experts", "only 0 or 1 shared expert is supported")
        for name, want in (("scoring_func", "sqrtsoftplus"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
            if getattr(self, name) != want:
                bad(name, f"only '{want}' is supported, got '{getattr(self, name)}'")
        if any(r < 0 for r in ratios):
            bad("compress_ratios", "ratios must be >= 0")
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx),
                          ("engram_layer_ids", self.engram_layer_ids)):
            if any(not 0 <= i < n for i in ids) or list(ids) != sorted(set(ids)):
                bad(name, f"must be strictly increasing layer ids in [0, {n}), got {list(ids)}")
        for i in kv:
            if ratios[i] == 0:
                bad("kv_source_layer_ids", f"layer {i} has compress ratio 0")
            if i not in idx:
                bad("kv_source_layer_ids", f"KV-source layer {i} is not in index_source_layer_ids")
        for i in range(n):
            if ratios[i] == 0:
                if i in idx:
                    bad("index_source_layer_ids", f"layer {i} has compress ratio 0")
                continue
            src = self.kv_source_of(i)
            if src is None:
                bad("compress_ratios", f"layer {i} has ratio {ratios[i]} but no KV source at or before it")
            if ratios[i] != ratios[src]:
                bad("compress_ratios", f"layer {i} has ratio {ratios[i]} but reads KV source {src} "
                                       f"of ratio {ratios[src]}")
        cand = self.candidate_source_layer_id
        if cand is not None and cand >= 0 and cand not in idx:
            bad("candidate_source_layer_id", f"layer {cand} is not in index_source_layer_ids")
        if self.candidate_block_size <= 0:
            bad("candidate_block_size", "must be positive")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            bad("engram_num_embeddings", "must have one entry per engram layer")
        if self.engram_layer_ids:
            if self.engram_max_ngram_size < 2:
                bad("engram_max_ngram_size", "must be at least 2")
            for lid, rows, primes in zip(self.engram_layer_ids, self.engram_num_embeddings, self.engram_primes):
                if rows != sum(sum(p) for p in primes):
                    bad("engram_num_embeddings", f"layer {lid} has {rows} rows but its derived primes "
                                                 f"sum to {sum(sum(p) for p in primes)}")
        if any(not 0 <= t < n for t in self.dspark_target_layer_ids or ()):
            bad("dspark_target_layer_ids", "must be backbone layer ids")

    # ------------------------------------------------------------------ layer roles
    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose compressed KV ``layer`` reads (None for ratio-0 layers)."""
        if self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return srcs[-1] if srcs else None

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose top-k mask ``layer`` uses."""
        if self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.index_source_layer_ids if s <= layer]
        return srcs[-1] if srcs else None

    @property
    def last_kv_source(self) -> int:
        return self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else -1

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_n_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @cached_property
    def engram_primes(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per engram layer, per n-gram size 2..N, ``n_heads`` distinct primes (MODEL_SPEC §3.10)."""
        seen: set[int] = set()
        out = []
        for _ in self.engram_layer_ids:
            per_ngram = []
            for _ in range(self.engram_max_ngram_size - 1):
                cur, sizes = self.engram_vocab_size - 1, []
                for _ in range(self.engram_n_heads):
                    cur += 1
                    while not _is_prime(cur) or cur in seen:
                        cur += 1
                    seen.add(cur)
                    sizes.append(cur)
                per_ngram.append(tuple(sizes))
            out.append(tuple(per_ngram))
        return tuple(out)

    @cached_property
    def engram_offsets(self) -> np.ndarray:
        """``[n_engram_layers, n_cols]``: row offset of each (n-gram, head) column in its table."""
        rows = []
        for primes in self.engram_primes:
            flat = [p for per in primes for p in per]
            rows.append(np.concatenate([[0], np.cumsum(flat)[:-1]]))
        return np.asarray(rows, dtype=np.int64).reshape(len(self.engram_primes), self.engram_n_cols)

    @cached_property
    def engram_multipliers(self) -> np.ndarray:
        """``[n_engram_layers, max_ngram]`` odd int64 multipliers; ``id * M`` cannot overflow int64."""
        bound = max(1, (np.iinfo(np.int64).max // self.engram_compressed_vocab_size) // 2)
        rows = [np.random.default_rng(10007 * lid).integers(0, bound, size=self.engram_max_ngram_size,
                                                             dtype=np.int64) * 2 + 1
                for lid in self.engram_layer_ids]
        return np.asarray(rows, dtype=np.int64).reshape(len(rows), self.engram_max_ngram_size)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _coerce(name: str, value: Any, type_str: Any) -> Any:
    t = str(type_str)
    try:
        if t.startswith("tuple[str"):
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise TypeError
            return tuple(value)
        if t.startswith("tuple"):
            if not isinstance(value, (list, tuple)):
                raise TypeError
            return tuple(int(v) for v in value)
        if t.startswith("int | tuple"):
            return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else int(value)
        if t.startswith("int"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
                raise TypeError
            return int(value)
        if t.startswith("float"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError
            return float(value)
        if t == "bool":
            if not isinstance(value, bool):
                raise TypeError
            return value
        if t == "str":
            if not isinstance(value, str):
                raise TypeError
            return value
        if t.startswith("dict"):
            if not isinstance(value, dict):
                raise TypeError
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"config field '{name}' has the wrong type: {value!r} (expected {t})") from None
    return value
