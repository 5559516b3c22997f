"""Offline jobs (``serve.generate``, ``serve.score``) as grain pipelines: sharded by process,
resumable after a crash, written in input order.

The input is validated whole first, so a job is a list of items. Each process takes its
share, items ``rank, rank + ranks, ...`` (a grain ``MapDataset`` over the item indices,
sliced by ``jax.process_index()``), in chunks of ``chunk`` items. After each chunk it appends
the chunk's output lines to ``OUT.rank-R.partial``, then atomically rewrites
``OUT.rank-R.state``: the grain iterator's state and the number of lines appended. A rerun
with the same arguments truncates the partial file to that number (a crash between the two
writes) and restores the iterator, so a finished line is neither recomputed nor written
twice. A state written by another job (other input, chunking or process count) is refused,
not mixed in.

When its share is done a process marks its state done; process 0 waits for every mark (the
files are the barrier: an offline job's output directory is shared by its processes, and no
collective is needed), interleaves the shards back into input order, writes ``OUT``
atomically and removes the partial and state files.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from serve.jsonl import InputError, write_jsonl

POLL_S = 0.5


def fingerprint(items: list, chunk: int, ranks: int) -> str:
    """What a saved state must match to be resumed: the items, the chunking, the process count."""
    h = hashlib.sha256(json.dumps(items, sort_keys=True).encode())
    h.update(f"{chunk}/{ranks}".encode())
    return h.hexdigest()[:16]


@dataclass
class OfflineJob:
    output: Path
    items: list
    chunk: int = 64
    rank: int = 0
    ranks: int = 1

    @classmethod
    def for_this_process(cls, output: Path, items: list, chunk: int) -> "OfflineJob":
        import jax

        return cls(output, items, chunk, jax.process_index(), jax.process_count())

    def __post_init__(self):
        if self.chunk <= 0:
            raise ValueError("the chunk of an offline job must be positive")
        self.key = fingerprint(self.items, self.chunk, self.ranks)
        self.done_lines = 0
        self.resumed_from = 0
        self._iter = self._dataset().to_iter_dataset().__iter__()
        self._restore()

    def _file(self, rank: int, kind: str) -> Path:
        return self.output.with_name(f"{self.output.name}.rank-{rank}.{kind}")

    def _dataset(self):
        import grain.python as grain

        return grain.MapDataset.range(len(self.items))[self.rank::self.ranks].batch(self.chunk)

    def _restore(self) -> None:
        state_file = self._file(self.rank, "state")
        if not state_file.exists():
            self._file(self.rank, "partial").write_text("")
            return
        saved = json.loads(state_file.read_text())
        if saved["key"] != self.key:
            raise InputError(f"{state_file} belongs to another job (other input, --chunk or process count); "
                             "remove it and its .partial file to start over")
        self._iter.set_state(saved["iterator"])
        self.done_lines = self.resumed_from = saved["lines"]
        print(f"resuming after {saved['lines']} of this process's {self.share} lines", file=sys.stderr, flush=True)
        with open(self._file(self.rank, "partial"), "r+") as fh:   # drop lines the state never recorded
            lines = fh.read().splitlines(keepends=True)[:saved["lines"]]
            fh.seek(0)
            fh.writelines(lines)
            fh.truncate()

    @property
    def share(self) -> int:
        return len(range(self.rank, len(self.items), self.ranks))

    def pending(self) -> Iterator[list[int]]:
        """The indices (into ``items``) of each chunk still to run, in order; ``record`` each."""
        for indices in self._iter:
            yield [int(i) for i in indices]

    def record(self, rows: list[dict]) -> None:
        with open(self._file(self.rank, "partial"), "a") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
            fh.flush()
            os.fsync(fh.fileno())
        self.done_lines += len(rows)
        self._save(done=False)

    def _save(self, done: bool) -> None:
        state = {"key": self.key, "iterator": self._iter.get_state(), "lines": self.done_lines, "done": done}
        tmp = self._file(self.rank, "state.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self._file(self.rank, "state"))

    def finish(self, timeout_s: float | None = None) -> bool:
        """Mark this share done; on process 0, wait for the others and write ``output`` in input
        order. True where ``output`` was written here."""
        self._save(done=True)
        if self.rank != 0:
            return False
        t0, told = time.monotonic(), False
        while not all(self._done(r) for r in range(self.ranks)):
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"processes {[r for r in range(self.ranks) if not self._done(r)]} did not finish")
            if not told:
                print("waiting for the other processes' shards", file=sys.stderr, flush=True)
                told = True
            time.sleep(POLL_S)
        shards = [self._file(r, "partial").read_text().splitlines() for r in range(self.ranks)]
        write_jsonl(self.output, [json.loads(shards[i % self.ranks][i // self.ranks]) for i in range(len(self.items))])
        for r in range(self.ranks):
            for kind in ("partial", "state"):
                self._file(r, kind).unlink(missing_ok=True)
        return True

    def _done(self, rank: int) -> bool:
        f = self._file(rank, "state")
        try:
            saved = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):   # absent, or being replaced
            return False
        return saved["key"] == self.key and saved["done"]
