"""The notebooks' text forms run end to end on CPU (tiny shapes)."""
import pathlib
import runpy

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, capsys):
  runpy.run_path(str(path), run_name="__main__")
  assert "max |o_replay - o_conv|" in capsys.readouterr().out or path.stem != "quickstart"
