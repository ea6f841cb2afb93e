"""The CPU output-buffer cache of lq's kernels (``csrc/host_cache.cpp``).

lq's CPU kernels allocate the tensors they return from a small cache, so that
the activation-sized outputs a training step creates and frees every step
reuse memory instead of faulting in fresh pages (glibc hands large freed
blocks back to the kernel; a quantized training step would otherwise spend
about a tenth of its time in page faults). Only buffers of 256 KiB or more are
cached, and at most ``LQ_CPU_CACHE_MB`` MiB (default 1024; 0 turns the cache
off) are kept idle. This module reads and controls that cache, like
``torch.cuda.empty_cache`` / ``torch.cuda.memory_stats`` do for CUDA memory.
Without the C++ extension there is no cache and these functions report zeros.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

from lq import _ext

_STAT_KEYS = ("idle_bytes", "live_bytes", "hits", "misses", "limit_bytes")


@lru_cache(maxsize=1)
def _lib():
    from lq import _ops  # noqa: F401  (the op schemas the kernels register for)

    if not _ext.load() or not _ext._STATE.get("path"):
        return None
    lib = ctypes.CDLL(_ext._STATE["path"])
    lib.lq_cpu_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.lq_cpu_cache_stats.restype = None
    lib.lq_cpu_cache_clear.argtypes = []
    lib.lq_cpu_cache_clear.restype = ctypes.c_int64
    lib.lq_cpu_cache_set_limit.argtypes = [ctypes.c_int64]
    lib.lq_cpu_cache_set_limit.restype = None
    return lib


def cpu_cache_stats() -> dict[str, int]:
    """``idle_bytes`` kept for reuse, ``live_bytes`` handed out and still alive,
    the ``hits``/``misses`` of allocation requests so far, and ``limit_bytes``."""
    lib = _lib()
    if lib is None:
        return dict.fromkeys(_STAT_KEYS, 0)
    buf = (ctypes.c_int64 * len(_STAT_KEYS))()
    lib.lq_cpu_cache_stats(buf)
    return dict(zip(_STAT_KEYS, (int(v) for v in buf)))


def empty_cpu_cache() -> int:
    """Free every idle cached buffer; returns the number of bytes freed."""
    lib = _lib()
    return 0 if lib is None else int(lib.lq_cpu_cache_clear())


def set_cpu_cache_limit(mib: int) -> None:
    """Keep at most ``mib`` MiB idle (0 turns the cache off); frees what is idle now."""
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
        raise ValueError(f"the cache limit is a whole number of MiB >= 0 (0 turns the cache off), got {mib!r}")
    lib = _lib()
    if lib is not None:
        lib.lq_cpu_cache_set_limit(mib << 20)
