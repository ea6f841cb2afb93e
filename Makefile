# The README's two commands: `make train` and `make test`. Both set up first (idempotent).
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: setup train test bench
setup:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	$(PYTHON) -m lq._ext

train: setup
	lq-train

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) -m bench.kernels
