# Two commands on a fresh machine: `make serve` serves the demo model, `make test` tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPENBLAS = $(shell $(PY) -m node.openblas 2>/dev/null)
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONHASHSEED := 0

.PHONY: venv lint test test-fast serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	LD_PRELOAD=$(OPENBLAS) $(PY) -m pytest tests -q

test-fast: $(STAMP)
	LD_PRELOAD=$(OPENBLAS) $(PY) -m pytest tests -q -m "not slow"

serve: $(STAMP)
	$(VENV)/bin/orchard serve $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
