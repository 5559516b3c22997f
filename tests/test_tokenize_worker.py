"""The server's tokenizer process (serve/tokenize_worker.py): it encodes as the tokenizer does, and
it does not outlive a server that was killed (SIGKILL leaves no chance to shut its pool down)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from model.engram_vocab import tokenizer_path
from serve.tokenize_worker import TokenizerProcess

ROOT = Path(__file__).resolve().parents[1]


def test_encodes_as_the_tokenizer_does():
    from tokenizers import Tokenizer

    text = "def f(x):\n    return x * 2  # Ünïcode"
    worker = TokenizerProcess(str(tokenizer_path()))
    try:
        got = asyncio.run(worker.encode(text))
    finally:
        worker.close()
    assert got == Tokenizer.from_file(str(tokenizer_path())).encode(text, add_special_tokens=False).ids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))   # a zombie is gone


def test_the_worker_exits_when_its_server_is_killed(tmp_path):
    script = ("import multiprocessing, os, signal\n"
              "from model.engram_vocab import tokenizer_path\n"
              "from serve.tokenize_worker import TokenizerProcess\n"
              "t = TokenizerProcess(str(tokenizer_path())); t.start()\n"
              "print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    printed = tmp_path / "pids"   # a file, not a pipe: a surviving worker would hold a pipe open
    with open(printed, "w") as out:
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    workers = [int(x) for x in printed.read_text().split()[-1:] if x.isdigit()]
    assert workers, printed.read_text()
    deadline = time.time() + 10
    while any(_alive(p) for p in workers):
        assert time.time() < deadline, f"tokenizer worker(s) {workers} outlived the killed server"
        time.sleep(0.2)
