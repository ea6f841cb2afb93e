"""Shared test setup: flush denormals (this CPU slows down badly on them), fixed seeds."""

import pytest
import torch

torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# One intra-op thread: the suite's models are tiny, and OpenMP threads spinning against
# each other on a loaded 2-core machine make them up to 100x slower. Benchmarks set their own.
torch.set_num_threads(1)
