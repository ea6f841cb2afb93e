"""Build (on first use, cached) and load the C++/CUDA kernels in ``csrc/``.

The extension is compiled with ``torch.utils.cpp_extension.load`` and ninja
into a cache folder keyed by a hash of the sources, the torch version, the
compiler flags and the CPU's vector capability, so a change to any of them
rebuilds and an unchanged tree loads in milliseconds. Loading the shared
library runs its ``TORCH_LIBRARY_IMPL`` blocks, which register the kernels
for the op schemas that :mod:`lq._ops` defined.

Where the build cannot happen (no compiler, no ninja) the ops keep their
pure-PyTorch reference kernels and one warning says why. ``LQ_DISABLE_EXT=1``
skips the extension on purpose (no warning). Prebuild with ``lq-build-ext``
(or ``python -m lq._ext``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

_STATE = {"loaded": False, "error": None, "path": None}


def disabled() -> bool:
    return os.environ.get("LQ_DISABLE_EXT", "").strip() not in ("", "0", "false", "False")


def source_dir() -> Path:
    """``lq/_csrc`` in an installed wheel, ``<repo>/csrc`` in a checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "_csrc", here.parent / "csrc"):
        if cand.is_dir() and any(cand.glob("*.cpp")):
            return cand
    raise FileNotFoundError(f"lq's C++ sources were not found next to {here}")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_capability() -> str:
    """The widest x86 vector ISA this CPU and ATen's ``at::vec`` both support, as torch itself decides it (from
    CPUID, capped by ``ATEN_CPU_CAPABILITY``): ``/proc/cpuinfo`` can name instructions the CPU that runs the code
    does not execute (an emulator such as ``qemu-x86_64 -cpu Haswell``, a migrated virtual machine), and an
    AVX-512 build there dies of an illegal instruction."""
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    return cap if cap in _CAPABILITY_FLAGS else "DEFAULT"


_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}


def cuda_buildable() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and torch.cuda.is_available() and CUDA_HOME is not None


def _sources() -> tuple[list[str], list[str]]:
    src = source_dir()
    cpp = sorted(str(p) for p in src.glob("*.cpp"))
    cuda = sorted(str(p) for p in (src / "cuda").glob("*.cu")) if cuda_buildable() else []
    return cpp, cuda


def build_flags() -> tuple[list[str], list[str], list[str]]:
    cap = cpu_capability()
    # -ffp-contract=off: no fused multiply-add contractions, so the kernels round exactly
    # where the reference (lq/_reference.py) rounds.
    cflags = ["-O3", "-fopenmp", "-ffp-contract=off", "-DNDEBUG", f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]
    cflags += _CAPABILITY_FLAGS[cap]
    cuda_flags = ["-O3"]  # no --use_fast_math: results must match the CPU bit for bit; -std as torch sets it
    ldflags = ["-fopenmp"]
    return cflags, cuda_flags, ldflags


def _build_name(sources: list[str], flags) -> str:
    h = hashlib.sha256()
    src = source_dir()
    suffixes = (".cpp", ".h", ".cu", ".cuh") if any(s.endswith(".cu") for s in sources) else (".cpp", ".h")
    for p in sorted(src.rglob("*")):
        if p.is_file() and p.suffix in suffixes and (p.suffix not in (".cpp", ".h") or p.parent == src):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    h.update(torch.__version__.encode())
    h.update(repr(flags).encode())
    h.update(repr(sorted(os.path.basename(x) for x in sources)).encode())  # content, not where the clone is
    h.update(sys.version.encode())
    h.update(repr(installation()).encode())
    return "lq_C_" + h.hexdigest()[:12]


def installation() -> tuple[str, str, str]:
    """What the build commands point at besides the sources: torch's installation (its headers and the
    libraries the kernels link against), Python's headers, and the compiler.

    Part of the cache key, so that two environments with the same torch version but their own installations
    (two venvs) get a build each: with one key they rewrote one ``build.ninja`` with their own include paths,
    and every process of the other environment rebuilt (and the rest waited on its lock) again and again."""
    import sysconfig

    return (str(Path(torch.__file__).resolve().parent), sysconfig.get_paths()["include"],
            os.environ.get("CXX", "c++"))


def cache_root() -> Path:
    root = os.environ.get("LQ_EXT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lq", "ext"
    )
    return Path(root)


def build(verbose: bool = False) -> str:
    """Compile (if not cached) and load the extension; return the library path."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    cpp, cuda = _sources()
    cflags, cuda_flags, ldflags = build_flags()
    name = _build_name(cpp + cuda, (cflags, cuda_flags, ldflags))
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"{name}.so"
    with _build_lock(build_dir):
        if not lib.exists():
            print(f"lq: building the C++ kernels once (about 2 minutes; cached in {build_dir}; "
                  "LQ_DISABLE_EXT=1 skips them and uses the pure-PyTorch reference) ...", file=sys.stderr, flush=True)
        src = _private_sources(build_dir, cpp + cuda)
        cpp_extension.load(
            name=name,
            sources=[str(src / Path(p).relative_to(source_dir())) for p in cpp + cuda],
            extra_cflags=cflags + (["-DLQ_WITH_CUDA"] if cuda else []),
            extra_cuda_cflags=cuda_flags,
            extra_ldflags=ldflags,
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    return str(lib)


def _private_sources(build_dir: Path, sources: list[str]) -> Path:
    """The sources, copied once into the (content-named) build folder, and built from there.

    The folder's name is a hash of the sources' content, so every clone and every installed copy of the
    same sources shares one build. Building from the clone's own files would put that clone's absolute
    paths into the build commands, and two clones would rebuild over each other.
    """
    src = build_dir / "src"
    if not src.is_dir():
        tmp = build_dir / f"src.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        root = source_dir()
        for p in list(root.glob("*.h")) + [Path(s) for s in sources] + list((root / "cuda").glob("*.cuh")):
            dest = tmp / p.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest)
        os.replace(tmp, src)
    return src


def _try_lock(fh, fcntl, seconds: float) -> bool:
    """Take the exclusive lock within ``seconds`` (polling), without blocking beyond that."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One builder per cache folder, with a lock the OS releases when its holder dies.

    torch's own build lock is a plain file that a killed build (Ctrl-C, ``kill -9``, a CI timeout, OOM)
    leaves behind, and every later build then waits on it forever. Here an ``flock`` on a file of our own
    serializes builders; whoever holds it knows no live lq process is building, so a leftover torch lock
    file is stale and is removed before building.
    """
    import fcntl

    with open(build_dir / ".lq-build.lock", "w") as fh:
        if not _try_lock(fh, fcntl, seconds=2.0):  # a load of the cached build takes well under that
            print(f"lq: waiting for another process that is building the C++ kernels in {build_dir} ...",
                  file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                stale.unlink()
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_LOAD_LOCK = threading.Lock()


def load() -> bool:
    """Load the kernels (building them once); on failure keep the reference kernels and warn once.

    Called by the first op that runs (not by ``import lq``); later calls cost one check, and a failed
    build is not retried in the same process."""
    if _STATE["loaded"]:
        return True
    if disabled() or _STATE["error"] is not None:
        return False
    with _LOAD_LOCK:  # two threads running their first op at once load the library once
        if _STATE["loaded"] or _STATE["error"] is not None:
            return _STATE["loaded"]
        try:
            _STATE["path"] = build()
            _STATE["loaded"] = True
        except Exception as e:  # noqa: BLE001 - any build failure means: use the reference
            _STATE["error"] = f"{type(e).__name__}: {e}"
            warnings.warn(
                "lq: the C++ extension could not be built, so the pure-PyTorch reference kernels are used "
                f"(correct but slower). Reason: {_STATE['error'][:2000]}. Set LQ_DISABLE_EXT=1 to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
    return _STATE["loaded"]


def attempted() -> bool:
    """Whether loading was tried (or is switched off): the reference kernels stop asking after that."""
    return _STATE["loaded"] or _STATE["error"] is not None or disabled()


def is_loaded() -> bool:
    return _STATE["loaded"]


def main() -> int:
    """``lq-build-ext``: prebuild the extension and report where it lives."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print("usage: lq-build-ext [-v]\n\nBuild lq's C++ kernels now (once; cached by content in "
              f"{cache_root()}, or $LQ_EXT_CACHE) and print where the library is.\n  -v  show the compiler "
              "commands\nLQ_DISABLE_EXT=1 makes lq use its pure-PyTorch reference kernels instead.")
        return 0
    if disabled():
        print("LQ_DISABLE_EXT is set: nothing to build")
        return 0
    import lq._ops  # noqa: F401  (defines the schemas the kernels register for)

    path = build(verbose="-v" in sys.argv)
    print(f"lq extension ready: {path} (CPU capability {cpu_capability()}, CUDA {'yes' if _sources()[1] else 'no'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
