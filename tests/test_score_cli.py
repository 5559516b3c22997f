"""The offline scoring CLI end to end on the fixture model, and its input errors."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from conftest import GOLDEN, ROOT
from serve import score

TINY = GOLDEN / "v41_tiny"


def _expected_logprobs(case, n):
    """Log-probs of tokens 1..n-1 of ``case``'s first ``n`` (causal: its full logits' rows)."""
    logits = np.load(TINY / case["full_logits"]).astype(np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    ids = case["prompt_ids"]
    return [logits[t, ids[t + 1]] - lse[t] for t in range(n - 1)]


def test_scores_agree_with_golden_logits(tmp_path, tiny):
    # cases the fixture found no quantisation-fragile element in (test_parity's note), and c19's
    # first 17 tokens: a batch of two lengths in one bucket, padded
    seqs = [(tiny.cases["c19"], 19), (tiny.cases["c5"], 5), (tiny.cases["c19"], 17)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": c["prompt_ids"][:n]}) + "\n"
                                               for c, n in seqs))
    rc = score.main(["--model", str(TINY), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(tmp_path / "out.jsonl"), "--batch-size", "2"])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == len(seqs)
    for row, (case, n) in zip(rows, seqs):
        lp = row["token_logprobs"]
        assert lp[0] is None and len(lp) == n
        np.testing.assert_allclose(lp[1:], _expected_logprobs(case, n), atol=1e-4)


def _cli(tmp_path, lines, *extra):
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, "-m", "serve.score", "--model", str(TINY), "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bad_lines_fail_with_line_number_and_no_output(tmp_path):
    for bad, why in (("{nope", "not valid JSON"), ('{"input_ids": [1, 99999]}', "input_ids must be integers"),
                     ('{"input_ids": []}', "expected an object"), ('{"ids": [1]}', "expected an object")):
        r = _cli(tmp_path, ['{"input_ids": [5, 6, 7]}', bad])
        assert r.returncode != 0 and f"in.jsonl:2: {why}" in r.stderr, r.stderr
        assert not (tmp_path / "out.jsonl").exists()
        assert not list(tmp_path.glob(".out.jsonl*"))


def test_bad_model_dir_fails_cleanly(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2]}\n')
    r = subprocess.run([sys.executable, "-m", "serve.score", "--model", str(tmp_path), "--input",
                        str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no config.json" in r.stderr
