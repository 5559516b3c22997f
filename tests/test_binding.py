"""Parity in the binding top-k regime (v41_tiny_binding), compared modulo ties.

The reference breaks exact top-k ties arbitrarily (torch ``topk(sorted=False)``), so, as the
fixture's README prescribes: logits must match before the first fragile row; index scores
must match wherever the reference's are finite; a selection must contain every entry
scoring above the reference's k-th score and nothing scoring below it, and equal the
reference's where its gap is clear. A second run forces the reference's selections.

One FP8 window-KV element of b48 (token 7) sits on a rounding boundary: the reference's
own chunked path rounds it one way and its one-shot and decode paths the other, which
moves their logits apart by up to 1.2e-2 from row 7 on. Rows before the first fragile row
must therefore match at least one reference path; under forced selections at least one
path must match on every row, and every path until the reference's paths first disagree.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import REPORT

LAYERS = (2, 4, 5, 7)
SCORE_TOL = 2e-4
CLEAR_GAP = 1e-4
MAX_FLIPS = 2  # indexer q/k elements allowed to sit on an FP4 rounding boundary


def _paths(model, case):
    c = model.cases[case]
    calls = {path: calls for path, (calls, _) in model.paths(c).items()}
    files = {"full": c["full_logits"], "decode": c["decode"]["logits"]}
    if "chunked" in c:
        files["chunked"] = c["chunked"]["logits"]
    return c, calls, files


def _rows(traces, layer, field):
    """Stack a traced per-call field of one layer into [rows, ...]."""
    return np.concatenate([np.asarray(getattr(t.selections[layer], field))[:n] for _, n, t in traces])


def _check_selection(chosen, ref_sel, ref_score, gap, where):
    for row in range(ref_sel.shape[0]):
        picked = {int(e) for e in chosen[row] if e >= 0}
        want = set(np.flatnonzero(ref_sel[row]).tolist())
        assert len(picked) == len(want), f"{where} row {row}: picked {sorted(picked)}, reference {sorted(want)}"
        if not want:
            continue
        kth = ref_score[row, sorted(want)].min()
        above = set(np.flatnonzero(ref_score[row] > kth + SCORE_TOL).tolist())
        assert above <= picked, f"{where} row {row}: missed {sorted(above - picked)}"
        low = [e for e in picked if not ref_score[row, e] >= kth - SCORE_TOL]
        assert not low, f"{where} row {row}: picked {low} below the k-th score"
        if gap[row] > CLEAR_GAP:
            assert picked == want, f"{where} row {row}: clear gap but {sorted(picked)} != {sorted(want)}"


def _check_scores(got, ref, where, compare=None):
    """Scores agree where the reference's are finite, apart from rare FP4 flips of the indexer q/k."""
    finite = np.isfinite(ref) if compare is None else compare
    assert np.isfinite(got[finite]).all(), f"{where}: an entry the reference scores is masked here"
    with np.errstate(invalid="ignore"):
        off = finite & ~(np.abs(np.where(finite, got - ref, 0)) <= SCORE_TOL)
    # A flipped query element moves one row of scores, a flipped key element one column.
    rows, cols = np.flatnonzero(off.any(1)), np.flatnonzero(off.any(0))
    assert min(len(rows), len(cols)) <= MAX_FLIPS, f"{where}: scores differ in rows {rows} / entries {cols}"


def _top_k(scores, k):
    out = np.full((scores.shape[0], k), -1)
    for row, s in enumerate(scores):
        finite = np.flatnonzero(np.isfinite(s))
        best = finite[np.argsort(-s[finite], kind="stable")][:k]
        out[row, :len(best)] = best
    return out


@pytest.mark.parametrize("case", ["b24", "b48"])
def test_strict_rows_and_first_index_source(binding, case):
    c, calls, files = _paths(binding, case)
    refs = np.stack([binding.load(f) for f in files.values()])
    for path, call in calls.items():
        meta = c["selections"][path]
        got, traces = binding.run(c["prompt_ids"], call, trace=True)
        fragile = meta["first_fragile_row"]
        diff = np.abs(got[:fragile] - binding.load(files[path])[:fragile])
        REPORT[f"v41_tiny_binding {case} {path} rows<{fragile}"] = f"{diff.max():.2e} / {np.median(diff):.2e}"
        nearest = np.abs(got[None, :fragile] - refs[:, :fragile]).max(-1).min(0)
        assert nearest.max() <= 1e-3, f"{path}: row {nearest.argmax()} matches no reference path ({nearest.max()})"
        # Layer 2 sees no earlier selection, so its scores and choice are comparable on every row.
        lay = meta["layers"]["2"]
        n = lay["T"]
        ref_score = binding.load(lay["score"])
        _check_scores(_rows(traces, 2, "scores")[:, :n], ref_score, f"{path} L2")
        _check_selection(_rows(traces, 2, "entries"), binding.load(lay["sel"]), ref_score,
                         binding.load(lay["gap"]), f"{path} L2")


@pytest.mark.parametrize("case", ["b24", "b48"])
def test_forced_reference_selection(binding, case):
    c, calls, files = _paths(binding, case)
    cfg = binding.cfg
    refs = np.stack([binding.load(f) for f in files.values()])
    spread = (refs.max(0) - refs.min(0)).max(-1)
    agree_until = int(np.argmax(spread > 1e-3)) if (spread > 1e-3).any() else len(spread)
    exact_paths = []
    for path, call in calls.items():
        meta = c["selections"][path]["layers"]
        sel = {int(k): binding.load(v["sel"]).astype(bool) for k, v in meta.items()}

        def forced(start, width, sel=sel):
            out = {}
            for layer, mask in sel.items():
                cap = 64 // cfg.compress_ratios[layer]
                m = np.zeros((width, cap), bool)
                rows = mask[start:start + width]
                m[:rows.shape[0], :rows.shape[1]] = rows
                out[layer] = m
            return out

        got, traces = binding.run(c["prompt_ids"], call, trace=True, forced=forced)
        ref = binding.load(files[path])
        diff = np.abs(got - ref)
        REPORT[f"v41_tiny_binding {case} {path} forced"] = f"{diff.max():.2e} / {np.median(diff):.2e}"
        row_err = diff.max(-1)
        # every row of a whole path within 5e-3: a last-bit difference upstream (XLA's CPU code
        # sums in another order on another vector width) can flip the fp8 rounding of a KV entry,
        # which moved a few rows of the full path by up to 2.9e-3 on one machine
        if row_err.max() <= 5e-3:
            exact_paths.append(path)
        assert row_err[:agree_until].max() <= 1e-3, f"{path}: forced logits differ at row {row_err.argmax()}"
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9, f"{path}: argmax disagrees too often"
        # Scores are comparable where our hidden states match the reference's.
        checked = row_err <= 1e-3
        for layer in LAYERS:
            lay = meta[str(layer)]
            ref_score = binding.load(lay["score"])[checked]
            mine = _rows(traces, layer, "scores")[checked, :lay["T"]]
            # Past the candidate source we mask outside our own blocks: compare where both score.
            both = np.isfinite(ref_score) & (np.isfinite(mine) if layer > cfg.candidate_source_layer_id else True)
            _check_scores(mine, ref_score, f"{path} L{layer}", both)
            k = min(cfg.index_topk, lay["T"])
            rows = np.ones(len(ref_score), bool)
            if layer > cfg.candidate_source_layer_id:  # a block-level tie changes the candidates it scores in
                rows = binding.load(meta["5"]["block_gap"])[checked] > CLEAR_GAP
            _check_selection(_top_k(mine, k)[rows], sel[layer][checked][rows], ref_score[rows],
                             binding.load(lay["gap"])[checked][rows], f"{path} L{layer}")
        cand, block_gap = binding.load(meta["5"]["cand"]).astype(bool), binding.load(meta["5"]["block_gap"])
        mine = _rows(traces, 5, "candidates")[:, :cand.shape[1]]
        ratio = cfg.compress_ratios[5]
        visible = np.arange(cand.shape[1])[None] < (np.arange(len(cand))[:, None] + 1) // ratio
        clear = (block_gap > CLEAR_GAP) & checked
        np.testing.assert_array_equal((mine & visible)[clear], (cand & visible)[clear],
                                      err_msg=f"{path} candidate blocks")
    assert exact_paths, "no path matches the reference on every row under forced selections"
