"""onnxruntime on an AVX2-only CPU, from any x86 machine: this Python under ``qemu-x86_64 -cpu Haswell-noTSX``.

onnxruntime picks its u8 x s8 kernels by CPUID. With VNNI the products accumulate in int32; with AVX2 alone,
``vpmaddubsw`` first adds each pair of adjacent products in a saturating int16, so a file can compute other
numbers there. qemu's user-mode emulator answers CPUID as a Haswell (AVX2 and FMA, no AVX-512, no VNNI), and
onnxruntime inside it runs its AVX2 kernels: what an AVX2-only machine computes, slowly (its times mean
nothing), on a machine of either kind. Used by ``bench.ordinary`` (accuracy on AVX2) and the tests.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np

#: qemu's model of an AVX2 CPU without AVX-512 or VNNI (plain "Haswell" asks for TSX, which qemu cannot emulate)
CPU = "Haswell-noTSX"
#: set in the emulated process (a test there must not start another emulator)
EMULATED_ENV = "LQ_EMULATED_CPU"


def qemu() -> str | None:
    """qemu's x86-64 user-mode emulator, where this is an x86-64 machine that has it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return shutil.which("qemu-x86_64")


def emulated() -> bool:
    """Whether this process already runs inside the emulator."""
    return bool(os.environ.get(EMULATED_ENV))


def available() -> bool:
    return qemu() is not None and not emulated()


def native() -> bool:
    """Whether this CPU is itself AVX2-only (AVX2, no AVX-512, no VNNI, no AMX): onnxruntime then picks here the
    kernels it picks in the emulator, so a bench's run here already is the AVX2 run (qemu on a 2-core Zen took
    over 30 minutes for MiniLM's files alone)."""
    from lq._ext import cpu_flags
    from lq.export.verify._no_vnni import has_vnni

    flags = cpu_flags()
    return "avx2" in flags and not has_vnni() and not any(f.startswith(("avx512", "amx")) for f in flags)


def _env() -> dict:
    """The emulated process's environment: this process's import path (a venv's too), one thread, and torch's
    oneDNN at SSE4.1 (its AVX2 JIT code miscomputes under qemu 7.2: nn.LSTM was 0.34 off; onnxruntime's kernels
    are MLAS, not oneDNN, and keep their AVX2 paths)."""
    path = os.pathsep.join(p for p in sys.path if p)
    return dict(os.environ, **{EMULATED_ENV: CPU}, PYTHONPATH=path, OMP_NUM_THREADS="1", ONEDNN_MAX_CPU_ISA="SSE41")


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    """This interpreter with ``args`` on the emulated CPU; stderr without qemu's notes on CPUID bits it ignores."""
    proc = subprocess.run([qemu(), "-cpu", CPU, sys.executable, *args], stderr=subprocess.PIPE, text=True,
                          env=_env(), **kw)
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if "TCG doesn't support" not in line)
    return proc


def run_on_avx2(code: str, timeout: float = 1800) -> str:
    """Run Python ``code`` on the emulated AVX2 CPU; its stdout."""
    proc = _run(["-c", code], stdout=subprocess.PIPE, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"the emulated AVX2 run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


_RUN_FILES = """
import json, numpy as np
from bench._avx2 import _session
for c in json.load(open({spec!r})):
    np.save(c["out"], _session(c["file"]).run(None, {{k: np.load(f) for k, f in c["feeds"].items()}})[0])
print("ran", len(json.load(open({spec!r}))))
"""


def _session(path: str):
    """The onnxruntime session both sides run a file in: all optimizations, one thread, CPU."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def first_outputs_here(cases: list[tuple[str, dict | list]]) -> list[np.ndarray]:
    """What :func:`first_outputs_on_avx2` computes, on this CPU."""
    return [_session(path).run(None, _by_name(path, feeds))[0] for path, feeds in cases]


def first_outputs_on_avx2(cases: list[tuple[str, dict | list]]) -> list[np.ndarray]:
    """onnxruntime's first output (all optimizations on, one thread) for each ``(file, feeds)`` (by input name,
    or a list in the graph's input order), computed on the emulated AVX2 CPU in one process."""
    with tempfile.TemporaryDirectory() as d:
        spec = []
        for k, (path, feeds) in enumerate(cases):
            feeds = _by_name(path, feeds)
            names = {}
            for j, (name, a) in enumerate(feeds.items()):
                names[name] = os.path.join(d, f"in{k}_{j}.npy")
                np.save(names[name], np.ascontiguousarray(a))
            spec.append({"file": os.path.abspath(path), "feeds": names, "out": os.path.join(d, f"out{k}.npy")})
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        out = run_on_avx2(_RUN_FILES.format(spec=os.path.join(d, "spec.json"))).strip()
        if out != f"ran {len(cases)}":
            raise RuntimeError(f"the emulated AVX2 run printed {out!r}")
        return [np.load(s["out"]) for s in spec]


def _by_name(path: str, feeds: dict | list) -> dict:
    """``feeds`` by input name (a list is in the graph's input order)."""
    if isinstance(feeds, dict):
        return feeds
    import onnx

    g = onnx.load(path, load_external_data=False).graph
    inits = {i.name for i in g.initializer}
    return dict(zip([i.name for i in g.input if i.name not in inits], feeds))


def main(argv=None) -> int:
    """``python -m bench._avx2 [pytest arguments]``: pytest on the emulated CPU (``make test-avx2``)."""
    if not available():
        print("needs qemu-x86_64 on an x86-64 machine (Debian/Ubuntu: apt-get install qemu-user)", file=sys.stderr)
        return 2
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *(sys.argv[1:] if argv is None else argv)])
    print(proc.stderr, file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
