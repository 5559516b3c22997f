"""Tokenising HTTP prompts in a worker process, so that a long prompt never stalls the event loop.

The Rust tokenizer holds the GIL while it encodes: on the 2-core CI machine 7.8 MB of text took
17 s, and a thread that ticked every 10 ms waited 16.9 s of them. A thread pool would stall the
server as much, so ``encode`` runs in a spawned process (spawned, not forked: the parent has
JAX's threads) with its own copy of the DeepSeek-V4 tokenizer. Decoding stays in the engine's
process: it is a few tokens a step (serve/detokenizer.py).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

_tokenizer = None


def _load(path: str, parent: int) -> None:
    global _tokenizer
    from tokenizers import Tokenizer

    _tokenizer = Tokenizer.from_file(path)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    """End this worker once the server that spawned it is gone (killed, it could not shut the pool
    down, and the worker would wait on its queue forever)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _encode(text: str) -> list[int]:
    return _tokenizer.encode(text, add_special_tokens=False).ids


class TokenizerProcess:
    """``await encode(text)`` in a worker process (``start`` spawns it; else the first call does)."""

    def __init__(self, tokenizer_file: str, workers: int = 1):
        self.file, self.workers = tokenizer_file, workers
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Spawn the worker now and load its tokenizer (at server start, not at a client's request)."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_load, initargs=(self.file, os.getpid()))
            self._pool.submit(_encode, "").result()

    async def encode(self, text: str) -> list[int]:
        if self._pool is None:
            await asyncio.get_running_loop().run_in_executor(None, self.start)
        return await asyncio.get_running_loop().run_in_executor(self._pool, _encode, text)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
