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


# The benches' --fast smoke runs (tests/_bench_runs.py): started in the background as soon as a test that reads
# them is collected, read by those tests, which run last (they wait for the runs; the rest of the suite runs
# meanwhile).
import _bench_runs  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(session, config, items):
    """The tests that read the bench runs last (stable: the order is kept otherwise), in one group; under
    pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) every other test file is a group of its own, so a
    module's fixtures are made once."""
    for item in items:
        bench = _bench_runs.FIXTURE in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group("bench_fast" if bench else item.nodeid.split("::")[0]))
    items.sort(key=lambda item: _bench_runs.FIXTURE in getattr(item, "fixturenames", ()))


def pytest_collection_finish(session):
    if not session.config.option.collectonly and any(
            _bench_runs.FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        _bench_runs.start(session.config)


def pytest_sessionfinish(session, exitstatus):
    _bench_runs.finish(stop=bool(session.shouldstop or session.shouldfail) or exitstatus == pytest.ExitCode.INTERRUPTED)


@pytest.fixture(scope="session")
def bench_runs(request) -> dict:
    """Every bench's smoke run (``_bench_runs.Run``, or why it was not run), once all have ended."""
    return _bench_runs.results(request.config)
