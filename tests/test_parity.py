"""Parity with the HF reference on the v41_tiny fixtures (one-shot, chunked, decode)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import REPORT

CASES = ["c5", "c19", "c37", "c64", "c50_chunked"]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(tiny, case):
    c = tiny.cases[case]
    for path, (calls, file) in tiny.paths(c).items():
        ref = tiny.load(file)
        got, _ = tiny.run(c["prompt_ids"], calls)
        diff = np.abs(got - ref)
        REPORT[f"v41_tiny {case} {path}"] = f"{diff.max():.2e} / {np.median(diff):.2e}"
        assert diff.max() <= 1e-3, f"{case} {path}: max |diff| {diff.max()} at row {diff.max(1).argmax()}"
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1), err_msg=f"{case} {path} argmax")


def test_c19_intermediates(tiny):
    c = tiny.cases["c19"]
    _, [(_, n, trace)] = tiny.run(c["prompt_ids"], [c["length"]], trace=True)
    np.testing.assert_array_equal(np.asarray(trace.engram_rows)[:n], tiny.load("c19_engram_hash_ids.npy"))
    streams, premix = tiny.load("c19_layer_streams.npy"), tiny.load("c19_layer_premix.npy")
    for layer in range(streams.shape[0]):
        np.testing.assert_allclose(np.asarray(trace.streams[layer])[:n], streams[layer], atol=1e-4,
                                   err_msg=f"streams after layer {layer}")
        np.testing.assert_allclose(np.asarray(trace.premix[layer])[:n], premix[layer], atol=1e-5,
                                   err_msg=f"pre-mix of layer {layer}")
