# Quickstart: `make demo` and `make test` set everything up on a fresh machine.
# `make test` runs the suite twice: on the pinned versions the kernels are measured with (.venv,
# constraints.txt) and on the newest JAX, Flax and Orbax that pip resolves for pyproject.toml's
# ranges (.venv-jax-latest, resolved when it is made; `make clean` to resolve again).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LATEST := .venv-jax-latest
PY_LATEST    := $(LATEST)/bin/python
STAMP_LATEST := $(LATEST)/.installed
# A test whose worker dies of a native crash runs again, at most twice (pytest-rerunfailures); a
# test that fails any other way is never rerun. The crash seen so far, XLA's CPU compiler out of
# memory mappings, is prevented in tests/conftest.py (bench/NOTES.md, "Harness, CI and interpreter
# hazards").
PYTEST := -m pytest -n 2 --durations=15 --reruns=2 --only-rerun="crashed while running"

.PHONY: test test-pinned test-latest demo install bench notebooks clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test,bench]"
	touch $(STAMP)

$(PY_LATEST):
	$(PYTHON) -m venv $(LATEST)

$(STAMP_LATEST): $(PY_LATEST) pyproject.toml
	$(PY_LATEST) -m pip install -q --upgrade pip
	$(PY_LATEST) -m pip install -q --upgrade --upgrade-strategy eager -e ".[test,bench]"
	touch $(STAMP_LATEST)

install: $(STAMP)

test: test-pinned test-latest

test-pinned: $(STAMP)
	$(PY) $(PYTEST)

test-latest: $(STAMP_LATEST)
	$(PY_LATEST) $(PYTEST)

demo: $(STAMP)
	$(PY) -m replayssm_jax demo

bench: $(STAMP)
	$(PY) -m bench.gdn_decode

# Executed .ipynb copies of the jupytext notebooks/*.py (the tests run the .py forms).
notebooks: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[notebooks]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3"
	cd notebooks && ../$(VENV)/bin/jupytext --to ipynb quickstart.py performance.py drift.py
	cd notebooks && ../$(VENV)/bin/jupyter-execute --inplace quickstart.ipynb performance.ipynb drift.ipynb

clean:
	rm -rf $(VENV) $(LATEST)
