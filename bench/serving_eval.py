"""Serving evaluation: megajax under fixed arrival rates x prefix-cache hit rates x lengths, measured by SGLang's client.

One worker behind the SGLang model gateway (``serve.fleet.launched``, ``--workers 1``, with
``--enable-metrics``); at each point of
the grid ``python -m sglang.bench_serving`` sends ``--num-prompts`` requests arriving as a Poisson
process at the point's rate, ``--backend`` naming the API (``sglang``: the native ``/generate``;
``sglang-oai-chat``: ``/v1/chat/completions``), EOS ignored. The hit rate sets the dataset:

* 0: ``random-ids``, prompts of ``input`` random tokens;
* h > 0: ``generated-shared-prefix``, groups of ``--prompts-per-group`` prompts sharing a system prompt
  of ``h x input`` tokens, each with its own question of the rest; the first of a group misses, so
  the designed share of prompt tokens served from cache is ``h x (k - 1) / k``. The worker's
  ``sglang:cached_tokens_total`` and ``sglang:prompt_tokens_total`` give the share it served.

Each point has its own seed (no point's prompts are cached by another's). Before the grid an
unmeasured pass of each dataset compiles the programs. Per point: TTFT, ITL and end-to-end latency
(mean, median, p99), request and output throughput, requests lost (sent minus completed: must be 0),
and the gateway's retry and error counters. bench_serving's warm-up request repeats its first prompt, which
the served share counts. Plots: TTFT and ITL (median solid, p99 dashed) against
the arrival rate, one colour per hit rate.

The client runs in its own venv (``bench/pd_serving.py`` says how to make it):

    python bench/serving_eval.py                                    # CPU: a small grid, about 10 minutes
    python bench/serving_eval.py --rates 1,4,16 --lengths 8192:256 --worker-args "--model DIR"   # a GPU
Writes ``bench/results/serving_eval_<device>_<commit>.json`` and its two PNGs (``--out`` to change).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pd_serving import SUMMARY, bench, conditions, shown, tokenizer_dir  # noqa: E402
from serve.fleet import launched  # noqa: E402

ROUTER_COUNTERS = re.compile(r"retr|error|fail|429|reject", re.I)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-python", default="/work/bsvenv/bin/python",
                    help="the interpreter that has sglang (runs python -m sglang.bench_serving)")
    ap.add_argument("--worker-args", default="--no-warmup --max-running 8 --context-length 2048")
    ap.add_argument("--backend", default="sglang", choices=["sglang", "sglang-oai-chat"])
    ap.add_argument("--rates", default="0.5,1,2", help="requests a second (Poisson arrivals)")
    ap.add_argument("--hit-rates", default="0,0.5,0.9", help="shared-prefix share of each prompt")
    ap.add_argument("--lengths", default="512:32", help="input:output tokens, comma-separated pairs")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=100, help="the first point's; each point takes the next")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "bench_out" / "serving_eval")
    ap.add_argument("--out", type=Path, help="the JSON (the PNGs beside it)")
    return ap.parse_args(argv)


def dataset_args(hit: float, input_len: int, output_len: int, args) -> list[str]:
    if hit == 0:
        return ["--dataset-name", "random-ids", "--random-input-len", str(input_len), "--random-output-len",
                str(output_len), "--random-range-ratio", "1.0", "--num-prompts", str(args.num_prompts)]
    shared = round(hit * input_len)
    return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.num_prompts // args.prompts_per_group),
            "--gsp-prompts-per-group", str(args.prompts_per_group), "--gsp-system-prompt-len", str(shared),
            "--gsp-question-len", str(input_len - shared), "--gsp-output-len", str(output_len)]


def client(args, router: str, tokenizer: Path, data: list[str], rate: float, seed: int, out: Path) -> list[str]:
    return [args.bench_python, "-m", "sglang.bench_serving", "--backend", args.backend, "--base-url", router,
            "--tokenizer", str(tokenizer), *data, "--request-rate", str(rate), "--seed", str(seed),
            "--output-file", str(out), "--disable-tqdm"]


def scrape(url: str, keep) -> dict[str, float]:
    """Prometheus samples at ``url`` whose line ``keep`` accepts (name with labels -> value)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    out = {}
    for line in lines:
        if line and not line.startswith("#") and keep(line):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def cache_counters(worker: str) -> tuple[float, float]:
    got = scrape(f"{worker}/metrics", lambda ln: ln.startswith(("sglang:cached_tokens_total", "sglang:prompt_tokens_total")))
    total = lambda prefix: sum(v for k, v in got.items() if k.startswith(prefix))  # noqa: E731
    return total("sglang:cached_tokens_total"), total("sglang:prompt_tokens_total")


def plot(points: list[dict], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, label in (("ttft", "time to first token (ms)"), ("itl", "inter-token latency (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (key, group) in enumerate(_groups(points).items()):
            rates = [p["rate"] for p in group]
            colour = f"C{i}"
            ax.plot(rates, [p["summary"][f"median_{metric}_ms"] for p in group], "o-", color=colour, label=key)
            ax.plot(rates, [p["summary"][f"p99_{metric}_ms"] for p in group], "o--", color=colour, alpha=0.6)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.set_title(f"{label.split(' (')[0]}: median (solid), p99 (dashed)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out.with_name(f"{out.stem}_{metric}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _groups(points: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for p in sorted(points, key=lambda p: p["rate"]):
        groups.setdefault(f"hit {p['hit_rate']:g}, {p['input_len']}:{p['output_len']}", []).append(p)
    return groups


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = conditions(args.bench_python)
    rates = [float(x) for x in args.rates.split(",")]
    hits = [float(x) for x in args.hit_rates.split(",")]
    lengths = [tuple(int(v) for v in pair.split(":")) for pair in args.lengths.split(",")]
    tokenizer = tokenizer_dir(args.log_dir / "tokenizer")
    logs = args.log_dir / "fleet"
    shutil.rmtree(logs, ignore_errors=True)
    points, seed = [], args.seed
    worker_args = [*shlex.split(args.worker_args), "--enable-metrics"]
    with launched(logs, ["--workers", "1"], worker_args, 1) as (router, ports):
        worker = f"http://127.0.0.1:{ports['workers']}"
        metrics = f"http://127.0.0.1:{ports['metrics']}/metrics"
        for hit in sorted({0.0, max(hits)}):   # unmeasured: compiles what the grid runs
            for n_in, n_out in lengths:
                bench(client(args, router, tokenizer, dataset_args(hit, n_in, n_out, args), max(rates), seed,
                             args.log_dir / "prime.jsonl"))
                seed += 1
        for n_in, n_out in lengths:
            for hit in hits:
                for rate in rates:
                    cached0, prompt0 = cache_counters(worker)
                    router0 = scrape(metrics, ROUTER_COUNTERS.search)
                    cmd = client(args, router, tokenizer, dataset_args(hit, n_in, n_out, args), rate, seed,
                                 args.log_dir / "point.jsonl")
                    result = bench(cmd)
                    seed += 1
                    cached1, prompt1 = cache_counters(worker)
                    router1 = scrape(metrics, ROUTER_COUNTERS.search)
                    designed = hit * (args.prompts_per_group - 1) / args.prompts_per_group
                    points.append({
                        "input_len": n_in, "output_len": n_out, "hit_rate": hit, "designed_cached_share": designed,
                        "served_cached_share": (cached1 - cached0) / max(prompt1 - prompt0, 1), "rate": rate,
                        "sent": args.num_prompts, "lost": args.num_prompts - result["completed"],
                        "router_counters": {k: v - router0.get(k, 0) for k, v in router1.items()
                                            if v != router0.get(k, 0)},
                        "command": shown(cmd), "summary": {k: result[k] for k in SUMMARY}})
                    s = points[-1]["summary"]
                    print(f"{n_in}:{n_out} hit {hit:g} (served {points[-1]['served_cached_share']:.2f}) at {rate:g}/s: "
                          f"TTFT p50 {s['median_ttft_ms']:.0f} p99 {s['p99_ttft_ms']:.0f} ms, ITL p50 "
                          f"{s['median_itl_ms']:.0f} p99 {s['p99_itl_ms']:.0f} ms, lost {points[-1]['lost']}", flush=True)
    out = args.out or ROOT / "bench" / "results" / f"serving_eval_cpu_{run['commit']}.json"
    report = {**run, "backend": args.backend, "worker_args": args.worker_args,
              "num_prompts": args.num_prompts, "prompts_per_group": args.prompts_per_group,
              "measurement_window": "each point: bench_serving's run from its first request to its last answer "
                                    "(summary 'duration'), after an unmeasured pass per dataset",
              "points": points}
    out.write_text(json.dumps(report, indent=1) + "\n")
    report["plots"] = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in plot(points, out)]
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", out, *report["plots"])
    return 0 if all(p["lost"] == 0 for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
