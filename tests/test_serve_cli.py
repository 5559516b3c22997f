"""``python -m serve`` as users start it (the embedded default model), and SIGTERM while a stream is open."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

from conftest import ROOT, free_port


def test_default_server_serves_and_shuts_down_cleanly():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--port", str(port), "--no-warmup", "--context-length",
                             "512", "--page-size", "16", "--max-running-requests", "4", "--chunked-prefill-size",
                             "32", "--decoder-replay", "off"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError("the server did not become healthy")
        body = json.dumps({"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=240) as resp:
            first = resp.readline()
            assert first.startswith(b"data: {")
            proc.send_signal(signal.SIGTERM)  # mid-stream
            rest = resp.read().decode()
        frames = [json.loads(x.strip()[6:]) for x in rest.split("\n\n") if x.strip().startswith("data: {")]
        assert rest.rstrip().endswith("data: [DONE]"), rest[-200:]
        assert frames[-1]["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
    assert "Traceback" not in out, out[-2000:]


def test_fp8_experts_exit_with_the_reason():
    """``--quantization fp8`` converts float experts with sizes divisible by 128: the default model's
    are MXFP4 already (the release format), random-tiny's are 64 wide."""
    for model, reason in ((), "mxfp4 already"), (("--model", "random-tiny"), "divisible by 128"):
        r = subprocess.run([sys.executable, "-m", "serve", *model, "--quantization", "fp8", "--no-warmup", "--port",
                            str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert r.returncode == 2 and reason in r.stderr, r.stderr[-2000:]


def test_readme_server_starts_within_its_program_budget():
    """``python -m serve`` exactly as the README runs it (warm-up on, port 30000): healthy, one
    chat through the official client, and the process's mappings and RSS within the budget
    all along (it used to pass vm.max_map_count during warm-up and die: issue 42)."""
    import openai

    from serve.programs import MAP_SHARE, PeakMaps

    with open("/proc/sys/vm/max_map_count") as f:
        ceiling = int(int(f.read()) * MAP_SHARE)
    proc = subprocess.Popen([sys.executable, "-m", "serve"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = PeakMaps(proc.pid)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            try:
                if urllib.request.urlopen("http://127.0.0.1:30000/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        else:
            raise AssertionError(f"not healthy (exit code {proc.poll()})")
        client = openai.OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                               max_tokens=16)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
        with open(f"/proc/{proc.pid}/status") as f:
            hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        maps = peak.stop()
        assert 0 < maps < ceiling, (maps, ceiling)
        assert hwm_kb < 3 << 20, f"peak RSS {hwm_kb >> 10} MB"
    finally:
        peak.stop()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
    assert "Traceback" not in out, out[-2000:]
