"""``/metrics`` under DP attention: one series per rank, engine-wide gauges apart."""
from __future__ import annotations

from serve.metrics import Metrics


def test_gauges_render_per_rank_and_the_shared_queue_apart():
    load = {"num_running_reqs": 3, "num_used_tokens": 64, "token_usage": 0.5, "cache_hit_rate": 0.0,
            "dp_ranks": [{"dp_rank": 0, "num_running_reqs": 1, "num_used_tokens": 16, "token_usage": 0.25,
                          "cache_hit_rate": 0.0},
                         {"dp_rank": 1, "num_running_reqs": 2, "num_used_tokens": 48, "token_usage": 0.75,
                          "cache_hit_rate": 0.0}],
            "num_queue_reqs": 5}
    text = Metrics("m").render(load)
    lines = text.splitlines()
    assert sum(line == "# TYPE sglang:num_running_reqs gauge" for line in lines) == 1
    running = [line for line in lines if line.startswith("sglang:num_running_reqs{")]
    assert [line.split('dp="')[1].split('"')[0] for line in running] == ["0", "1"]
    assert [float(line.split()[-1]) for line in running] == [1, 2]
    assert any(line.startswith("sglang:num_queue_reqs{") and 'dp="all"' in line and line.endswith(" 5")
               for line in lines)
    single = Metrics("m").render({"num_queue_reqs": 2, "num_running_reqs": 1})
    assert 'dp="0"} 2' in single and 'dp="all"' not in single
