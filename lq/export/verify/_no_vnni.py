"""OpenVINO as a CPU without VNNI runs it: the plugin in a process of its own with its kernels capped at AVX2.

Without VNNI (AVX2-only CPUs, AVX-512 ones before Cascade Lake) OpenVINO's int8 convolutions and matmuls add pairs
of u8 x s8 products in a saturating int16, and its low-precision transformations take other code paths: a file
right on this CPU can be wrong there (8-bit weights: a 16-channel conv 49% off; a U-Net whose concat was quantized
on a signed grid: its score maps 6-8% off in output steps). The plugin reads ``ONEDNN_MAX_CPU_ISA`` when it loads,
so :class:`Session` runs it in a worker process started with ``ONEDNN_MAX_CPU_ISA=AVX2``: the export verifies an
OpenVINO file there too (:data:`PROVIDER`), on a CPU that has VNNI (where it has none, the plugin's own run already
is that run).

The worker reads the model from a file and answers one request per line pair on its standard streams: the inputs as
an ``.npz`` archive in, the outputs as one out (length-prefixed bytes; no pickling).
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

#: the "provider" that stands for this run in lq's providers lists
PROVIDER = "OpenVINO CPU, kernels capped at AVX2 (no VNNI)"
#: the instruction set the worker's kernels are capped at
ISA = "AVX2"


#: ``ONEDNN_MAX_CPU_ISA`` values that leave VNNI in (oneDNN's names; anything else caps below it)
_WITH_VNNI = ("VNNI", "BF16", "AMX", "FP16", "ALL", "DEFAULT")


def needed() -> bool:
    """Whether this process's OpenVINO takes VNNI code paths: the CPU has VNNI (AVX-512 VNNI, AVX-VNNI or AMX) and
    ``ONEDNN_MAX_CPU_ISA`` does not cap the plugin below it (an emulated AVX2 CPU, ``make test-avx2``, sets it).
    Then a CPU without VNNI would run other code than the plugin's own run."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and not any(k in cap for k in _WITH_VNNI):
        return False
    return has_vnni()


#: the CPU flags of VNNI's integer dot products (AVX-512 VNNI, AVX-VNNI, AMX)
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def has_vnni() -> bool:
    """Whether this CPU has VNNI (products accumulated in int32, no saturating int16 pair sums)."""
    from lq._ext import cpu_flags

    return any(f in cpu_flags() for f in VNNI_FLAGS)


def _send(stream, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream) -> bytes:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the OpenVINO worker closed its output")
    (n,) = struct.unpack("<Q", head)
    return stream.read(n)


def _npz(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _arrays(data: bytes) -> dict:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


class Session:
    """The calls of an onnxruntime session the judge makes (``get_inputs``, ``run``), answered by the worker."""

    def __init__(self, path_or_bytes, threads: int | None = None):
        self._tmp = None
        if not isinstance(path_or_bytes, (str, os.PathLike)):
            fd, self._tmp = tempfile.mkstemp(suffix=".onnx", prefix="lq-no-vnni-")
            with os.fdopen(fd, "wb") as f:
                f.write(path_or_bytes)
        path = os.fspath(path_or_bytes) if self._tmp is None else self._tmp
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA=ISA)
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, path, str(threads or 0)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            self._names = _receive(self._proc.stdout).decode().split("\n")
        except EOFError as e:
            raise RuntimeError(f"OpenVINO with its kernels capped at {ISA} could not load the file: "
                               f"{self._proc.stderr.read().decode()[-500:]}") from e

    def get_inputs(self) -> list:
        from lq.export.verify._openvino import _Input

        return [_Input(n) for n in self._names]

    def run(self, output_names, feed: dict) -> list[np.ndarray]:
        if output_names is not None:
            raise ValueError("lq's OpenVINO session returns every output (output_names=None)")
        _send(self._proc.stdin, _npz({k: np.ascontiguousarray(v) for k, v in feed.items()}))
        try:
            out = _arrays(_receive(self._proc.stdout))
        except EOFError as e:
            raise RuntimeError(f"OpenVINO with its kernels capped at {ISA} failed: "
                               f"{self._proc.stderr.read().decode()[-500:]}") from e
        if "error" in out:
            raise RuntimeError(f"OpenVINO with its kernels capped at {ISA}: {out['error'].item()}")
        return [out[f"o{i}"] for i in range(len(out))]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        for s in (self._proc.stdout, self._proc.stderr):
            s.close()
        if self._tmp is not None and os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _serve(path: str, threads: int) -> None:
    """The worker: compile ``path``, say its input names, then answer requests until the input closes."""
    from lq.export.verify import _openvino

    session = _openvino.Session(path, threads=threads or None)
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    _send(out, "\n".join(i.name for i in session.get_inputs()).encode())
    while True:
        try:
            feed = _arrays(_receive(inp))
        except EOFError:
            return
        try:
            result = {f"o{i}": a for i, a in enumerate(session.run(None, feed))}
        except Exception as e:  # noqa: BLE001 - said to the caller, which raises it
            result = {"error": np.array(f"{type(e).__name__}: {e}")}
        _send(out, _npz(result))


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
