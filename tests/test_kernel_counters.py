"""bench/kernel_counters.py's summary of an ncu raw page: metrics per kernel, in bytes and ms."""
from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernel_counters as kc  # noqa: E402


def _raw_page(values: dict[str, tuple[str, str]]) -> str:
    """An ncu ``--page raw --csv`` page: a header row, a units row, one kernel's row."""
    cols = ["Kernel Name", *values]
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(cols)
    w.writerow(["", *(u for u, _ in values.values())])
    w.writerow(["sparse_mqa", *(v for _, v in values.values())])
    return out.getvalue()


def test_summary_scales_bytes_and_durations():
    values = {metric: ("", "1") for metric in kc.METRICS.values()}
    values[kc.METRICS["dram_read_bytes"]] = ("Mbyte", "1,234.5")
    values[kc.METRICS["dram_write_bytes"]] = ("Kbyte", "96")
    values[kc.METRICS["ms"]] = ("usecond", "280.4")
    values["sm__cycles_active.avg"] = ("cycle", "950")
    values["sm__cycles_elapsed.avg"] = ("cycle", "1,000")
    (kernel,) = kc.summarize(_raw_page(values), "")
    assert kernel["name"] == "sparse_mqa"
    assert kernel["dram_read_bytes"] == 1234.5e6
    assert kernel["dram_write_bytes"] == 96e3
    assert abs(kernel["ms"] - 0.2804) < 1e-12
    assert kernel["registers"] == 1.0       # (unitless metrics as ncu printed them)
    assert abs(kernel["sm_active_pct"] - 95.0) < 1e-9
