"""The notebooks run as a reader runs them: each executed top to bottom by a Jupyter kernel
(nbclient), its plots drawn. The jupytext percent script (``notebooks/*.py``) is what is edited
and reviewed; its ``.ipynb`` pairing must hold the same cells (``jupytext --sync``)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import REPORT

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.py"))


@pytest.mark.parametrize("script", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_plots(script):
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(script.with_suffix(".ipynb"), as_version=4)
    assert [c.source for c in nb.cells] == [c.source for c in jupytext.read(script).cells], \
        f"{script.name} and its .ipynb differ: run jupytext --sync {script}"
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(script.parent)}}
                   ).execute()
    REPORT[f"notebook {script.stem}"] = f"{time.perf_counter() - t0:.0f} s"
    plots = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if "image/png" in o.get("data", {})]
    assert plots, f"{script.name} drew no plot"
