"""``python -m serve`` as users start it (the embedded default model), and SIGTERM while a stream is open."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from conftest import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_default_server_serves_and_shuts_down_cleanly():
    port = _free_port()
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


def test_fp8_experts_on_the_default_model_exit_with_the_reason():
    """``--quantization fp8`` needs expert sizes divisible by 128; the default model's are 64."""
    r = subprocess.run([sys.executable, "-m", "serve", "--quantization", "fp8", "--no-warmup", "--port",
                        str(_free_port())], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2 and "divisible by 128" in r.stderr, r.stderr[-2000:]
