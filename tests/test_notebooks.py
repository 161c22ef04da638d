"""The notebooks' text forms (jupytext py:percent) run end to end on CPU, on their CPU-sized paths.

Each notebook runs as a script (``runpy``) with matplotlib's non-interactive Agg backend, and its
printed output is checked for the lines that prove the notebook did its job.
"""
import pathlib
import runpy

import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.py"))

# What each notebook must print (other notebooks: just run).
EXPECT = {
    "quickstart": ("max |o_replay - o_conv|", "Mamba2: max |y_replay - y_conv|", "greedy tokens identical"),
    "performance": ("timed rows from", "T=8, f32: replay"),
    "drift": ("data: ", "slope state", "verdict"),
}


@pytest.fixture
def agg_backend(monkeypatch):
  matplotlib = pytest.importorskip("matplotlib")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.delenv("REPLAYSSM_FIG_DIR", raising=False)
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt
  yield
  plt.close("all")


def test_every_notebook_is_listed():
  assert {p.stem for p in NOTEBOOKS} >= set(EXPECT), sorted(p.stem for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, capsys, agg_backend, monkeypatch):
  monkeypatch.chdir(path.parent.parent)
  runpy.run_path(str(path), run_name="__main__")
  out = capsys.readouterr().out
  for needle in EXPECT.get(path.stem, ()):
    assert needle in out, (path.stem, needle)
