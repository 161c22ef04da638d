# Quickstart: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo install bench notebooks clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test,bench]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15

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
	rm -rf $(VENV)
