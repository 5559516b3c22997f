"""Prefill/decode disaggregation against a colocated server on CPU, measured by SGLang's own client.

Each mode is a ``python -m serve.fleet`` behind the SGLang model gateway (sglang_router):
colocated, one worker (``--workers 1``); disaggregated, a prefill and a decode worker
(``--prefill 1 --decode 1``, the gateway's PD mode). ``python -m sglang.bench_serving`` sends the
same load to the gateway in both: random prompts of ``--input-len`` tokens, ``--output-len``
tokens out (EOS ignored), ``--num-prompts`` arriving as a Poisson process at ``--request-rate``,
streamed from SGLang's native ``/generate``. Its summary (request throughput, TTFT, ITL, E2E
latency, completed requests) goes to ``bench/results/pd_serving_cpu_<commit>.json``.

The workers start with ``--no-warmup`` (programs compile on first use), so each mode first runs an
unmeasured pass of the same load with another seed: the measured pass then runs compiled programs.

The client runs in its own venv, sglang installed without its dependencies (they would pull torch)
beside what bench_serving imports; ``client_python`` makes it (about 100 s, 0.7 GB):

    python -c "import sys; sys.path.insert(0, 'bench'); import pd_serving; pd_serving.client_python('/work/bsvenv')"

Then, from the repo root in megajax's venv (about 2 minutes a mode):

    python bench/pd_serving.py --bench-python /work/bsvenv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.engram_vocab import tokenizer_path  # noqa: E402
from provenance import commit, host  # noqa: E402
from serve.fleet import launched  # noqa: E402

CLIENT_ENV = {"HF_HUB_OFFLINE": "1"}   # bench_serving would look the served model's name up on the hub
CLIENT = "sglang==0.5.8"
CLIENT_IMPORTS = ["transformers==4.57.1", "aiohttp", "numpy", "requests", "tqdm", "pybase64", "datasets", "pillow",
                  "huggingface_hub", "IPython", "pydantic"]
MODES = {"colocated": (["--workers", "1"], 1), "pd": (["--prefill", "1", "--decode", "1"], 2)}
SUMMARY = ("completed", "duration", "request_throughput", "output_throughput", "concurrency",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
           "mean_e2e_latency_ms", "p99_e2e_latency_ms")
NOTES = [
    "PD runs two worker processes (prefill, decode) on the same 2 cores where colocated runs one; the "
    "gateway and the client share them too. So PD here pays for the handoff (bootstrap, page transfer, "
    "the extra hop) and the two processes' contention, without the separate devices that make PD pay off.",
    "Workers start with --no-warmup; each mode's measured pass follows an unmeasured priming pass of the "
    "same load with another seed, so compiling stays out of the numbers.",
    "Dataset random-ids: bench_serving's 'random' dataset samples ShareGPT text, which it downloads. "
    "random-ids decodes random token ids to text, which the server tokenizes again: the served prompts "
    "are 1-4% longer than --random-input-len (517-533 tokens for 512, checked with this tokenizer), "
    "while bench_serving counts --random-input-len. "
    "(--tokenize-prompt, which would send the ids, takes the list prompts for multi-turn in sglang 0.5.8.)",
    "bench_serving's warm-up request is the measured run's first prompt, so that one is a prefix-cache hit.",
    "The fleet is serve.fleet.launched's: the gateway's default policy (cache_aware) and health checks every second "
    "with a 5 s timeout; HF_HUB_OFFLINE=1 keeps the client from looking the model name up on the hub.",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-python", default="/work/bsvenv/bin/python",
                    help="the interpreter that has sglang (runs python -m sglang.bench_serving)")
    ap.add_argument("--worker-args", default="--no-warmup --max-running 8 --context-length 2048",
                    help="python -m serve arguments for every worker")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=0.5, help="requests a second (Poisson arrivals)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1, help="the measured pass's; the priming pass uses seed + 1")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "bench_out" / "pd_serving",
                    help="fleet logs, bench_serving's JSONL and the tokenizer directory")
    ap.add_argument("--out", type=Path, help="default: bench/results/pd_serving_cpu_<commit>.json")
    return ap.parse_args(argv)


def tokenizer_dir(where: Path) -> Path:
    """An HF tokenizer directory (AutoTokenizer) with the DeepSeek-V4 tokenizer megajax serves."""
    where.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_path().parent / name, where / name)
    return where


def bench_cmd(args, router: str, tokenizer: Path, seed: int, out: Path) -> list[str]:
    return [args.bench_python, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", router,
            "--tokenizer", str(tokenizer), "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
            "--seed", str(seed), "--output-file", str(out), "--disable-tqdm"]


def bench(cmd: list[str]) -> dict:
    """Run bench_serving and return the summary it appended to its output file."""
    out = Path(cmd[cmd.index("--output-file") + 1])
    out.unlink(missing_ok=True)
    subprocess.run(cmd, check=True, env={**os.environ, **CLIENT_ENV})
    return json.loads(out.read_text().splitlines()[-1])


def shown(cmd: list[str]) -> str:
    """The command line as a shell runs it, its environment included."""
    return shlex.join([f"{k}={v}" for k, v in CLIENT_ENV.items()] + cmd)


def run_mode(args, mode: str, tokenizer: Path) -> dict:
    fleet_args, workers = MODES[mode]
    logs = args.log_dir / mode
    shutil.rmtree(logs, ignore_errors=True)   # the fleet appends to its logs
    with launched(logs, fleet_args, shlex.split(args.worker_args), workers) as (router, _):
        prime = bench_cmd(args, router, tokenizer, args.seed + 1, logs / "prime.jsonl")
        primed = bench(prime)
        measured = bench_cmd(args, router, tokenizer, args.seed, logs / "bench.jsonl")
        result = bench(measured)
    return {"fleet_args": fleet_args, "priming_command": shown(prime), "priming_completed": primed["completed"],
            "command": shown(measured), "summary": {k: result[k] for k in SUMMARY}}


def client_python(venv: str | Path) -> str:
    """The interpreter of ``venv``, made with SGLang's ``bench_serving`` unless it has it."""
    python = Path(venv) / "bin" / "python"
    ready = python.exists() and subprocess.run([str(python), "-c", "import sglang.bench_serving"],
                                               capture_output=True).returncode == 0
    if not ready:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--no-deps", CLIENT], check=True)
        subprocess.run([*pip, *CLIENT_IMPORTS], check=True)
    return str(python)


def conditions(bench_python: str) -> dict:
    """The commit, the machine and the versions of the client, the gateway and JAX."""
    client = subprocess.run([bench_python, "-c", "from importlib.metadata import version; print(version('sglang'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    return {"commit": commit(), "device": host(),
            "versions": {"sglang (client)": client, "sglang-router": version("sglang-router"), "jax": version("jax")}}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = conditions(args.bench_python)
    tokenizer = tokenizer_dir(args.log_dir / "tokenizer")
    modes = {mode: run_mode(args, mode, tokenizer) for mode in MODES}
    report = {**run, "worker_args": args.worker_args, "notes": NOTES, "modes": modes}
    out = args.out or ROOT / "bench" / "results" / f"pd_serving_cpu_{run['commit']}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    for mode, r in modes.items():
        print(mode, json.dumps(r["summary"]))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
