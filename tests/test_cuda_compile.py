"""Compile checks of the CUDA sources with nvcc (no GPU needed).

* ``csrc/cuda/compile_check.cu`` explicitly instantiates every kernel of the
  torch-free templates (``csrc/cuda/*.cuh``) for float, __half and
  __nv_bfloat16, and the launching entry points; it is compiled for sm_80 (the
  arithmetic FP8 fallback) and sm_90 (the hardware FP8 conversion) in one nvcc
  call, with the flags torch's extension builder uses (half/bfloat16 implicit
  conversions disabled, no fast math).
* ``csrc/cuda/lq_cuda.cu`` (the torch glue) is compiled too where the installed
  torch ships its c10/cuda headers (CPU wheels do, minus one generated header
  that this test stands in for).

Skipped only where nvcc is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not installed: cannot compile-check csrc/cuda")

# torch.utils.cpp_extension.COMMON_NVCC_FLAGS, plus what lq/_ext.py adds (no --use_fast_math)
TORCH_NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]


def _nvcc(args: list[str], timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([NVCC, *args], capture_output=True, text=True, timeout=timeout, cwd=CUDA_DIR)


def _own_warnings(output: str) -> list[str]:
    """Warnings that point into csrc/cuda (not into CUDA's or torch's headers)."""
    own = ("lq_", "compile_check.cu", "emulation.cu")
    return [line for line in output.splitlines() if "warning" in line and any(o in line for o in own)]


def test_kernel_templates_compile_sm80_sm90(tmp_path):
    out = tmp_path / "compile_check.o"
    threads = ["--threads", str(min(2, os.cpu_count() or 1))]
    res = _nvcc([*TORCH_NVCC_FLAGS, "-DLQ_COMPILE_CHECK", *ARCHS, *threads, "-c", "compile_check.cu", "-o", str(out)])
    assert res.returncode == 0, f"nvcc failed:\n{res.stdout}\n{res.stderr[-20000:]}"
    assert out.stat().st_size > 0
    assert not _own_warnings(res.stdout + res.stderr), "\n".join(_own_warnings(res.stdout + res.stderr))


def test_checks_are_empty_in_the_extension_build():
    """lq/_ext.py compiles every csrc/cuda/*.cu: the check and the emulation must add nothing there."""
    for name, macro in (("compile_check.cu", "LQ_COMPILE_CHECK"), ("emulation.cu", "LQ_HOST_EMULATION")):
        code = [
            line for line in (CUDA_DIR / name).read_text().splitlines()
            if line.strip() and not line.strip().startswith("//")
        ]
        assert code[0].strip() == f"#ifdef {macro}", name
        assert code[-1].strip().startswith("#endif"), name


def test_templates_need_no_torch():
    for p in CUDA_DIR.glob("*.cuh"):
        text = p.read_text()
        assert not re.search(r"#include\s*[<\"](ATen|torch|c10)/", text), f"{p.name} includes a torch header"


def _torch_include_dirs() -> list[str]:
    try:
        from torch.utils.cpp_extension import include_paths
    except Exception:  # noqa: BLE001
        return []
    return [str(p) for p in include_paths()]


def test_torch_glue_compiles(tmp_path):
    includes = _torch_include_dirs()
    if not includes or not any((Path(p) / "c10" / "cuda" / "CUDAStream.h").is_file() for p in includes):
        pytest.skip("the installed torch does not ship c10/cuda headers")
    shim = tmp_path / "shim"
    generated = "c10/cuda/impl/cuda_cmake_macros.h"
    if not any((Path(p) / generated).is_file() for p in includes):
        # generated at torch's build time and left out of CPU wheels
        (shim / generated).parent.mkdir(parents=True)
        (shim / generated).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    args = [*TORCH_NVCC_FLAGS, "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=lq_C", "-I.",
            *[f"-I{p}" for p in includes], f"-I{shim}", "--compiler-options", "-fPIC",
            "-diag-suppress", "3306",  # torch's headers use C++20 bit-field initializers (lq/_ext.py asks for C++17)
            # PTX only: the kernels themselves go through ptxas in the template check above
            "-gencode", "arch=compute_90,code=compute_90", "-c", "lq_cuda.cu", "-o", str(tmp_path / "lq_cuda.o")]
    res = _nvcc(args)
    assert res.returncode == 0, f"nvcc failed:\n{res.stdout}\n{res.stderr[-20000:]}"
    assert not _own_warnings(res.stdout + res.stderr), "\n".join(_own_warnings(res.stdout + res.stderr))
