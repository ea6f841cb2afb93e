"""Shared test setup: flush denormals (this CPU slows down badly on them), fixed seeds."""

import os
from pathlib import Path

# The C++ kernels the suite builds and loads (here and in every process it starts) go to the checkout's own
# cache, never the user's ~/.cache/lq/ext (make setup prebuilds it; `rm -rf build` forgets it).
os.environ.setdefault("LQ_EXT_CACHE", str(Path(__file__).resolve().parents[1] / "build" / "ext-cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# One intra-op thread: the suite's models are tiny, and OpenMP threads spinning against
# each other on a loaded 2-core machine make them up to 100x slower. Benchmarks set their own.
torch.set_num_threads(1)
