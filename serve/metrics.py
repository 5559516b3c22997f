"""Prometheus metrics under the ``sglang:`` names users' dashboards expect (SERVING_CONVENTIONS §4)."""
from __future__ import annotations

import bisect
import threading

_ACCEPT_BUCKETS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5, 6, float("inf"))
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))


class Histogram:
    def __init__(self, name: str, doc: str, buckets=_LATENCY_BUCKETS):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{self.name}_bucket{{{labels},le="{le}"}} {running}')
        out += [f"{self.name}_sum{{{labels}}} {self.sum}", f"{self.name}_count{{{labels}}} {self.count}"]
        return out


class Metrics:
    COUNTERS = {"prompt_tokens_total": "Prompt tokens processed", "generation_tokens_total": "Tokens generated",
                "num_requests_total": "Requests finished", "cached_tokens_total": "Prompt tokens served from cache"}

    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token")
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Time between streamed tokens")
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency")
        self.accept = Histogram("sglang:spec_accept_length_per_request",
                                "Tokens a speculative verify step yielded, per request", _ACCEPT_BUCKETS)
        self._lock = threading.Lock()

    def finished(self, usage: dict, e2e: float, verify_ct: int | None = None) -> None:
        with self._lock:
            if verify_ct:
                self.accept.observe(usage["completion_tokens"] / verify_ct)
            self.counters["prompt_tokens_total"] += usage["prompt_tokens"]
            self.counters["generation_tokens_total"] += usage["completion_tokens"]
            self.counters["cached_tokens_total"] += usage["prompt_tokens_details"]["cached_tokens"]
            self.counters["num_requests_total"] += 1
            self.e2e.observe(e2e)

    def render(self, gauges: dict[str, float]) -> str:
        lines = []
        with self._lock:
            for name, value in self.counters.items():
                lines += [f"# HELP sglang:{name} {self.COUNTERS[name]}", f"# TYPE sglang:{name} counter",
                          f"sglang:{name}{{{self.labels}}} {value}"]
            for h in (self.ttft, self.itl, self.e2e, self.accept):
                lines += h.render(self.labels)
        # one series per DP rank (``Engine.load``'s ``dp_ranks``); engine-wide ones (the shared
        # queue, the accept length) as dp="all" when there are several ranks
        ranks = gauges.get("dp_ranks") or [{"dp_rank": 0}]
        whole = "all" if "dp_ranks" in gauges else 0
        if "hicache" in gauges:
            lines += self._hicache(gauges["hicache"])
        for name, value in gauges.items():
            if name in ("dp_ranks", "hicache"):
                continue
            lines.append(f"# TYPE sglang:{name} gauge")
            per_rank = [(r["dp_rank"], r[name]) for r in ranks if name in r] or [(whole, value)]
            lines += [f'sglang:{name}{{{self.labels},dp="{i}"}} {v}' for i, v in per_rank]
        return "\n".join(lines) + "\n"

    def _hicache(self, h: dict) -> list[str]:
        """The hierarchical cache's counters (``HiCache.metrics``): prompt tokens a hit took from each
        tier, and bytes moved between tiers (engine-wide)."""
        out = ["# HELP sglang:hicache_hit_tokens_total Prompt tokens of adopted prefix hits, by their tier",
               "# TYPE sglang:hicache_hit_tokens_total counter"]
        out += [f'sglang:hicache_hit_tokens_total{{{self.labels},tier="{t}"}} {n}' for t, n in h["hit_tokens"].items()]
        out += ["# HELP sglang:hicache_bytes_moved_total Bytes copied between cache tiers",
                "# TYPE sglang:hicache_bytes_moved_total counter"]
        out += [f'sglang:hicache_bytes_moved_total{{{self.labels},direction="{d}"}} {n}'
                for d, n in h["bytes_moved"].items()]
        out += ["# TYPE sglang:hicache_host_used_pages gauge", f"sglang:hicache_host_used_pages{{{self.labels}}} "
                f"{h['host_pages']}"]
        return out
