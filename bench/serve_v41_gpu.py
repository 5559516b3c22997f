"""``python -m serve --model DIR`` on a release-format checkpoint: the kernel paths it logs, and its
greedy tokens against the same checkpoint served in float32.

Model: a small V4.1 whose shapes the kernels take (hidden 1024, 64 heads x 128, 16 experts 512
wide, top-4 + shared, four layers with ratios 0, 2, 1, 1, Engram on layer 1, the real vocabulary),
random weights, written by ``checkpoints.export`` in the release's format (fp8 linears with
32 x 32 UE8M0 scales, MXFP4 experts, e4m3 Engram rows). Two servers in turn, as a user starts
them: ``python -m serve --model DIR`` (``--dtype auto``: bf16 on a GPU, so the kernels), then
``--dtype float32`` (the reference paths). Each gets the same 8 greedy requests (64-token random
prompts, 32 new tokens, top-20 log-probs) through ``/generate``, one after another (so that each
server compiles two step shapes, not the dozen that arrivals in every order make). For each request:
the tokens equal up to the first difference, and there the float32 server's log-prob gap between
its token and the bf16 server's (a near-tie when small).

    python3 bench/serve_v41_gpu.py            # on the H200, writes $OUT/serve_v41_gpu.json
    python3 bench/serve_v41_gpu.py --smoke    # CPU: the same, both servers in float32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, run_info, write  # noqa: E402
from serve.fleet import stop_process  # noqa: E402

CHECKPOINT = Path(os.environ.get("MEGAJAX_BENCH_CKPT", "/tmp/megajax_serve_v41"))
PORT = 30123


def config():
    from model.config import ModelConfig

    return ModelConfig.from_dict({
        "vocab_size": 129280, "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 64,
        "head_dim": 128, "q_lora_rank": 256, "qk_rope_head_dim": 64, "sliding_window": 16,
        "compress_ratios": [0, 2, 1, 1], "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2, 3],
        "candidate_source_layer_id": 2, "candidate_topk_blocks": 64, "candidate_block_size": 2, "index_n_heads": 4,
        "index_head_dim": 64, "index_topk": 32, "o_groups": 8, "o_lora_rank": 128, "moe_intermediate_size": 512,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "num_nextn_predict_layers": 0,
        "engram_layer_ids": [1], "engram_vocab_size": 50, "engram_num_embeddings": [240],
        "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 64})


def export() -> dict:
    """Random params written in the release format (in a child: this process keeps no GPU memory)."""
    code = ("import sys; sys.path.insert(0, '.'); from bench.serve_v41_gpu import config; "
            "from checkpoints.init import init_params; from checkpoints.export import save_checkpoint; "
            "from checkpoints.formats import V41; cfg = config(); "
            f"save_checkpoint(init_params(cfg, seed=0), cfg, '{CHECKPOINT}', V41)")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    return {"write_s": time.perf_counter() - t0,
            "bytes": sum(f.stat().st_size for f in CHECKPOINT.glob("*.safetensors"))}


def post(path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def get(path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=10) as r:
        return r.status, json.loads(r.read() or b"null")


def serve(dtype: str, prompts: list[list[int]], log_path: Path, start_timeout: float) -> dict:
    """Start ``python -m serve`` as a user does, send the requests, stop it; its log lines and outputs."""
    cmd = [sys.executable, "-m", "serve", "--model", str(CHECKPOINT), "--port", str(PORT), "--dtype", dtype,
           "--no-warmup", "--max-running-requests", "4", "--context-length", "512", "--chunked-prefill-size", "256"]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > start_timeout:
                raise RuntimeError(f"the server did not come up: {log_path.read_text()[-3000:]}")
            time.sleep(1)
        ready_s = time.perf_counter() - t0
        info = get("/get_server_info")[1]
        t0 = time.perf_counter()
        body = {"sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
                "return_logprob": True, "top_logprobs_num": 20}
        outs = [post("/generate", {**body, "input_ids": ids}) for ids in prompts]
        requests_s = time.perf_counter() - t0
    finally:
        stop_process(proc, 60)
    lines = [ln for ln in log_path.read_text().splitlines()
             if any(k in ln for k in ("mega.", "linears:", "model dtype", "compiled programs", "loaded", "skipped"))]
    return {"ready_s": ready_s, "requests_s": requests_s, "log": lines, "kernel_paths": info["kernel_paths"],
            "model_dtype": info["engine_config"]["model_dtype"],
            "outputs": [{"ids": o["output_ids"], "top": o["meta_info"]["output_top_logprobs"]} for o in outs]}


def compare(truth: dict, got: dict) -> list[dict]:
    """Per request: the tokens' common prefix; the bf16 server's log-prob error there (its top
    token's against the float32 server's: the noise of bf16 in this model); and where they part,
    the float32 server's gap between its token and the bf16 server's, a near-tie when it is within
    that noise."""
    out = []
    for r, g in zip(truth["outputs"], got["outputs"]):
        n = next((i for i, (a, b) in enumerate(zip(r["ids"], g["ids"])) if a != b), len(r["ids"]))
        noise = max(abs(r["top"][i][0][0] - g["top"][i][0][0]) for i in range(min(n + 1, len(r["ids"]))))
        row = {"equal_prefix": n, "of": len(r["ids"]), "prefix_logprob_error_max": noise}
        if n < len(r["ids"]):
            top = {t: lp for lp, t, _ in r["top"][n]}
            gap = top[r["ids"][n]] - top[g["ids"][n]] if g["ids"][n] in top else None
            row.update(fp32_top2=r["top"][n], fp32_gap_to_bf16_token=gap, near_tie=gap is not None and gap <= noise)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--start-timeout", type=float, default=300)
    args = ap.parse_args()
    import numpy as np

    payload = {**run_info(), "export": export()}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128000, size=64).tolist() for _ in range(8)]
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    runs = {}
    for name, dtype in (("auto", "float32" if args.smoke else "auto"), ("float32", "float32")):
        runs[name] = serve(dtype, prompts, out_dir / f"serve_v41_{name}.log", args.start_timeout)
        print(name, json.dumps({k: v for k, v in runs[name].items() if k != "outputs"}, indent=1), flush=True)
    payload["runs"] = runs
    payload["auto_vs_float32"] = compare(runs["float32"], runs["auto"])
    print(json.dumps(payload["auto_vs_float32"], indent=1))
    print("wrote", write("serve_v41_gpu" + "_smoke" * args.smoke, payload))


if __name__ == "__main__":
    main()   # (an exception exits non-zero with its traceback)
