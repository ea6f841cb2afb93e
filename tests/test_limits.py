"""No test fails because the machine is busy: processes a test starts are waited for up to the hang guard only."""

from __future__ import annotations

import re
from pathlib import Path

from _limits import HANG_GUARD_S


def test_no_test_limits_a_process_by_the_clock():
    """Under load (a second job on the 2 cores) five bench smoke tests errored with `bench.accuracy --fast did not
    finish in 420 s`. A number of seconds in a test is now only the shared hang guard, far beyond any run."""
    here = Path(__file__).resolve().parent
    limits = []
    for p in sorted(here.glob("test_*.py")):
        if p.name == "test_cuda_compile.py":  # nvcc's own guard (30 min), compile-only, never on a busy GPU box
            continue
        for m in re.finditer(r"\b(?:timeout|communicate\(timeout)\s*=\s*(\d+(?:\.\d+)?)", p.read_text()):
            limits.append(f"{p.name}: timeout={m.group(1)}")
    assert not limits, limits
    assert HANG_GUARD_S >= 1800
