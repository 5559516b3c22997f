"""Offline jobs: sharded by process, resumed after a crash without recomputing or duplicating a
line, written in input order; and ``python -m serve.score`` killed midway, then resumed."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import GOLDEN, ROOT, free_port
from serve.jsonl import InputError
from serve.offline_job import OfflineJob

TINY = GOLDEN / "v41_tiny"


def _run(job: OfflineJob, seen: list, stop_after: int | None = None) -> None:
    for n, chunk in enumerate(job.pending()):
        if stop_after is not None and n == stop_after:
            return
        seen.extend(chunk)
        job.record([{"item": job.items[i]} for i in chunk])


def test_two_processes_crash_resume_and_merge_in_input_order(tmp_path):
    out, items = tmp_path / "out.jsonl", [f"line {i}" for i in range(23)]
    seen: list[int] = []
    rank1 = OfflineJob(out, items, chunk=3, rank=1, ranks=2)
    _run(rank1, seen, stop_after=2)   # crashes after two chunks ...
    with open(out.with_name("out.jsonl.rank-1.partial"), "a") as fh:
        fh.write('{"item": "appended, never recorded"}\n')   # ... between an append and its state
    resumed = OfflineJob(out, items, chunk=3, rank=1, ranks=2)
    assert resumed.resumed_from == 6
    _run(resumed, seen)
    assert not resumed.finish(), "only process 0 writes the output"
    assert not out.exists()
    rank0 = OfflineJob(out, items, chunk=3, rank=0, ranks=2)
    _run(rank0, seen)
    assert rank0.finish(timeout_s=5)
    assert sorted(seen) == list(range(23)), "every line computed exactly once"
    assert [json.loads(x)["item"] for x in out.read_text().splitlines()] == items
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_state_from_another_job_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    _run(OfflineJob(out, [1, 2, 3], chunk=1), [], stop_after=1)
    with pytest.raises(InputError, match="belongs to another job"):
        OfflineJob(out, [1, 2, 4], chunk=1)
    with pytest.raises(InputError, match="belongs to another job"):
        OfflineJob(out, [1, 2, 3], chunk=2)


def test_process_zero_says_which_shards_are_missing(tmp_path):
    job = OfflineJob(tmp_path / "out.jsonl", list(range(4)), chunk=2, rank=0, ranks=2)
    _run(job, [])
    with pytest.raises(TimeoutError, match=r"processes \[1\]"):
        job.finish(timeout_s=0.2)


def _score(d, out_name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "serve.score", "--model", str(TINY), "--input", str(d / "in.jsonl"),
            "--output", str(d / out_name), "--chunk", "2", "--batch-size", "2", *extra]


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A 160-line scoring input and its output from one uninterrupted process."""
    d = tmp_path_factory.mktemp("scored")
    rng = np.random.default_rng(0)
    lines = [{"input_ids": rng.integers(0, 512, size=int(rng.integers(2, 60))).tolist()} for _ in range(160)]
    (d / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    whole = subprocess.run(_score(d, "whole.jsonl"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    return d, len(lines)


def test_score_cli_killed_midway_resumes_to_the_uninterrupted_output(scored, tmp_path):
    d, n = scored
    (tmp_path / "in.jsonl").write_text((d / "in.jsonl").read_text())
    state = tmp_path / "out.jsonl.rank-0.state"
    job = subprocess.Popen(_score(tmp_path, "out.jsonl"), cwd=ROOT, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while not (state.exists() and json.loads(state.read_text())["lines"] >= 4):
        assert job.poll() is None and time.monotonic() - t0 < 600, "the job ended before it could be killed"
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert not (tmp_path / "out.jsonl").exists()
    done = json.loads(state.read_text())["lines"]
    assert 4 <= done < n

    resumed = subprocess.run(_score(tmp_path, "out.jsonl"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after {done} of this process's {n} lines" in resumed.stderr
    assert (tmp_path / "out.jsonl").read_text() == (d / "whole.jsonl").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_two_jax_processes_split_the_job_and_write_it_whole(scored, tmp_path):
    """``--nnodes 2``: two processes under ``jax.distributed`` (localhost), each its half of the
    lines; process 0's output is the one process's, line for line."""
    d, n = scored
    (tmp_path / "in.jsonl").write_text((d / "in.jsonl").read_text())
    addr = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(_score(tmp_path, "out.jsonl", "--nnodes", "2", "--node-rank", str(r),
                                     "--dist-init-addr", addr), cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert all(f"{n // 2}/{n // 2}" in e for e in errs), "each process scored its half (the progress bars)"
    assert (tmp_path / "out.jsonl").read_text() == (d / "whole.jsonl").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_distributed_flags_are_checked(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2]}\n')
    for extra, why in ((["--nnodes", "2"], "needs --dist-init-addr"), (["--node-rank", "1"], "is not in 0 .. --nnodes")):
        r = subprocess.run(_score(tmp_path, "out.jsonl", *extra), cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and why in r.stderr, r.stderr
