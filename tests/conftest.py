"""Shared test setup: flush denormals (this CPU slows down badly on them), fixed seeds."""

import pytest
import torch

torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
