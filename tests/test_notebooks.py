"""Every notebook in notebooks/ runs in a Jupyter kernel (nbclient), draws its pictures, and
computes what it claims: each ends by printing its results as JSON, which the tests check."""

import json
import pathlib

import pytest

# The test extra installs both; a machine without them (the GPU machine's image) skips the file.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str) -> tuple[dict, int]:
    """(the results the notebook's last cell prints, the number of pictures it drew)."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    pictures = sum("image/png" in o.get("data", {}) for o in outputs)
    # Its printed lines, not a warning jax may write to stderr after them.
    printed = "".join(o["text"] for o in notebook.cells[-1].outputs if o.get("name") == "stdout")
    return json.loads(printed.strip().splitlines()[-1]), pictures


def test_notebooks_are_stored_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        cells = nbformat.read(path, as_version=4).cells
        assert not any(c.get("outputs") for c in cells if c.cell_type == "code"), path.name


def test_zigzag_and_visibility():
    got, pictures = execute("zigzag_and_visibility.ipynb")
    assert pictures == 2
    assert got["work_per_rank"][0] == got["work_per_rank"][1]  # zigzag balances causal work
    assert got["roundtrip"] and got["padding_queries_see_nothing"]
    assert got["node_sees_ancestors"] == [0, 1, 3]  # node 3: itself, its parent 1, the root 0
    assert got["node_sees_trunk_up_to"] == 15  # its anchor
    for name in ("picture_vs_reference", "blockwise_vs_reference", "ring_vs_reference"):
        assert got[name] < 1e-5, (name, got[name])


def test_speculative_sampling():
    got, pictures = execute("speculative_sampling.ipynb")
    assert pictures == 2
    for name, (theory, counted) in got["acceptance"].items():
        assert counted == pytest.approx(theory, abs=0.015), name
    assert got["acceptance"]["two_children"][1] > got["acceptance"]["one_child"][1]
    tv = got["total_variation"]
    assert tv["one_child"] < 0.02 and tv["two_children"] < 0.02 and tv["draft"] > 0.2, tv


def test_cotraining():
    got, pictures = execute("cotraining.ipynb")
    assert pictures == 1 and got["steps"] == 12
    assert got["accepted_length_min"] > 1.0  # every step's speculation emitted extra tokens
    assert 0 <= got["reward_mean"] <= 1
