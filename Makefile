# Two commands on a fresh machine: `make serve` serves the demo model, `make test` tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CPU_KERNEL := orchard/kernels/cpu/.built
OPENBLAS = $(shell $(PY) -m orchard.node.openblas 2>/dev/null)
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONHASHSEED := 0

.PHONY: venv lint test test-fast serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,cpu-kernel]'
	touch $(STAMP)

# The CPU attention extension; without a compiler the CPU attends on the reference backend.
$(CPU_KERNEL): $(STAMP) orchard/kernels/cpu/CMakeLists.txt $(wildcard orchard/kernels/cpu/*.cpp orchard/kernels/cpu/*.h)
	$(PY) -m orchard.kernels.cpu.build && touch $@ || echo "CPU attention extension not built"

venv: $(STAMP) $(CPU_KERNEL)

lint: venv
	$(PY) -m ruff check .

test: lint
	LD_PRELOAD=$(OPENBLAS) $(PY) -m pytest tests -q

test-fast: venv
	LD_PRELOAD=$(OPENBLAS) $(PY) -m pytest tests -q -m "not slow"

serve: venv
	$(VENV)/bin/orchard serve $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info $(CPU_KERNEL) orchard/kernels/cpu/_paged_cpu*
