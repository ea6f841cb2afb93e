"""Writing the file: atomically (a reader never sees half a model), and where a file that failed verification goes.

Every stage that can fail after the graph exists saves it for inspection next to ``path`` as
``*.unverified.onnx``; ``path`` itself is written only once the file has passed.
"""

from __future__ import annotations

import os
import tempfile

import onnx


def atomic_save(model: onnx.ModelProto, path: str) -> None:
    """Write ``model`` to ``path`` through a temporary file in the same folder and one rename."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".lq-export-", suffix=".onnx", dir=d)
    os.close(fd)
    try:
        onnx.save_model(model, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the file is for serving, as readable as any other
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def unverified_path(path: str) -> str:
    """Where a file that failed verification is saved: ``model.onnx`` -> ``model.unverified.onnx``."""
    return path[: -len(".onnx")] + ".unverified.onnx"


def save_unverified(model: onnx.ModelProto, path: str) -> None:
    """Save ``model`` for inspection at :func:`unverified_path`; the error being raised matters more than this."""
    try:
        atomic_save(model, unverified_path(path))
    except Exception:  # pragma: no cover
        pass


def short(e: BaseException, n: int = 1500) -> str:
    """An exception's message, cut to ``n`` characters for an error line."""
    s = str(e).strip()
    return s if len(s) <= n else s[:n] + " ..."
