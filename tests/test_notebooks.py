"""Every notebook (percent-format .py) in notebooks/ runs to the end on the CPU."""

import pathlib
import runpy

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    printed = capsys.readouterr().out
    assert "False" not in printed, printed
