"""The notebooks run top to bottom (nbclient, kernel "python3", cwd notebooks/, MPLBACKEND=Agg).

quickstart.ipynb runs on the embedded SmolLM2 (the ``smollm2`` fixture fetches it into the cache
first); tree_hits.ipynb on the tiny random model (RADIXKV_NOTEBOOK_MODEL=tiny). Any cell error
fails the test; the checks below read the cells' printed output. The committed notebooks carry
no outputs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel the notebooks run on; fail, never skip, without it)
import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str, model: str | None) -> list[str]:
    """Run a notebook; returns the text output (stdout + text/plain) of each code cell."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    env_before = {k: os.environ.get(k) for k in ("RADIXKV_NOTEBOOK_MODEL", "MPLBACKEND")}
    os.environ["MPLBACKEND"] = "Agg"
    if model is None:
        os.environ.pop("RADIXKV_NOTEBOOK_MODEL", None)
    else:
        os.environ["RADIXKV_NOTEBOOK_MODEL"] = model
    # the kernel inherits the environment; the notebook finds the checkout from notebooks/
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), pythonpath) if p)
    try:
        client = nbclient.NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        )
        client.execute()  # raises CellExecutionError on any cell error
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for out in cell.outputs:
            assert out.output_type != "error", out
            if out.output_type == "stream":
                parts.append(out.text)
            elif "text/plain" in out.get("data", {}):
                parts.append(out["data"]["text/plain"])
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("name", ["quickstart.ipynb", "tree_hits.ipynb"])
def test_notebooks_are_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert nb.metadata["kernelspec"]["name"] == "python3"


def test_quickstart_on_smollm2(smollm2):
    out = execute("quickstart.ipynb", None)
    assert len(out) == 10
    assert "SmolLM2" in out[1]
    # greedy SmolLM2 knows its capitals
    assert re.search(r"'The capital of France is' -> ' Paris", out[2])
    m = re.search(r"(\d+) of (\d+) prompt tokens cached", out[3])
    assert m and int(m.group(1)) == int(m.group(2)) - 1
    assert "-- finished: length" in out[4]
    assert len(re.findall(r"^\d ", out[5], re.M)) == 3  # three forked samples
    turns = [int(x) for x in re.findall(r"^\s*(\d+)/\s*\d+ cached", out[6], re.M)]
    assert len(turns) == 2 and turns[1] > turns[0]  # the second turn reuses the first
    forks = [int(x) for x in re.findall(r": (\d+)/\d+ cached", out[7])]
    assert len(forks) == 2 and min(forks) > turns[1]  # both branches reuse the history
    assert "tenant-b cached tokens: 0" in out[8]
    rate = float(re.search(r"hit rate ([\d.]+)%", out[9]).group(1))
    assert 0 < rate < 100


def test_tree_hits_on_tiny_model():
    out = execute("tree_hits.ipynb", "tiny")
    text = "\n".join(out)
    # few-shot: after the first prompt of each task, the shared examples hit
    fs = [(int(a), int(b)) for a, b in re.findall(r"task \d: +(\d+)/ *(\d+) prompt", text)]
    assert len(fs) == 8 and sum(c for c, _ in fs[2:]) > 0.5 * sum(n for _, n in fs[2:])
    # agent: pool pressure made the engine evict, and the busiest snapshot had locked pages
    assert int(re.search(r"(\d+) pages evicted", text).group(1)) > 0
    assert int(re.search(r"step \d+: (\d+) pages locked", text).group(1)) > 0
    # the simulator rows: belady is an upper bound of radix; none never hits
    for row in re.findall(r"^(?:few-shot|agent) .*$", text, re.M):
        rates = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)%", row)}
        assert rates["none"] == 0.0 and rates["belady"] >= rates["radix"] - 1.0
    # your prompts: after running them, each is cached up to its last token
    assert "before: 0 cached" in text
    assert "roots: [None, 'tenant-b']" in text
