"""The C++ build: an interrupted build never blocks the next import, and the cache key is the content."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from _limits import HANG_GUARD_S

from lq import _ext

pytestmark = pytest.mark.skipif(_ext.disabled(), reason="LQ_DISABLE_EXT is set")


def _current_build_dir():
    cpp, cuda = _ext._sources()
    return _ext.cache_root() / _ext._build_name(cpp + cuda, _ext.build_flags())


def test_stale_torch_lock_of_a_killed_build_does_not_block_loading(tmp_path):
    """A build killed mid-way leaves torch's lock file behind; before, every later import waited forever."""
    build_dir = _current_build_dir()
    if not any(build_dir.glob("*.so")):
        pytest.skip("the extension is not built yet (lq-build-ext builds it)")
    with _ext._build_lock(build_dir):  # no live lq process is loading while the fake lock appears
        (build_dir / "lock").write_text("")  # what kill -9 of a building process leaves
    code = "import lq._ops, lq._ext; print('loaded', lq._ext.load())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded True" in p.stdout
    assert not (build_dir / "lock").exists()


def test_build_lock_is_released_when_its_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib; from lq import _ext\n"
        f"with _ext._build_lock(pathlib.Path({str(tmp_path)!r})):\n"
        "    print('holding', flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    waiter = subprocess.Popen([sys.executable, "-c", (
        "import pathlib; from lq import _ext\n"
        f"with _ext._build_lock(pathlib.Path({str(tmp_path)!r})):\n"
        "    print('acquired', flush=True)")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = waiter.stderr.readline()  # a live builder holds the lock: the other one says it waits ...
    assert "waiting for another process that is building the C++ kernels" in said
    time.sleep(0.5)
    assert waiter.poll() is None
    os.kill(holder.pid, signal.SIGKILL)  # ... until the builder dies, like an interrupted build
    holder.wait()
    out, _ = waiter.communicate(timeout=HANG_GUARD_S)
    assert "acquired" in out


def test_cache_key_is_the_sources_content_not_the_clone_path(tmp_path):
    src = _ext.source_dir()
    copy = tmp_path / "clone" / "csrc"
    shutil.copytree(src, copy)
    cpp = sorted(str(p) for p in src.glob("*.cpp"))
    cpp_copy = sorted(str(p) for p in copy.glob("*.cpp"))
    flags = _ext.build_flags()
    assert _ext._build_name(cpp, flags) == _ext._build_name(cpp_copy, flags)
    assert _ext._build_name(cpp, flags) != _ext._build_name(cpp, (flags[0] + ["-DX"],) + flags[1:])


def test_cache_key_is_the_installation_the_build_points_at(monkeypatch):
    """Two venvs with the same torch version shared one cache folder and rewrote its build.ninja with their own
    include paths, so each rebuilt after the other (minutes, every time). Every path the generated build
    commands name outside the cache folder is part of the key, and another torch installation is another key."""
    import re

    build_dir = _current_build_dir()
    ninja = build_dir / "build.ninja"
    if not ninja.exists():
        pytest.skip("the extension is not built yet (lq-build-ext builds it)")
    text = ninja.read_text()
    named = set(re.findall(r"(?:-isystem |-I|-L)(\S+)", text)) | set(re.findall(r"^cxx = (\S+)", text, re.M))
    named = {p for p in named if not p.startswith(str(build_dir))}
    key = _ext.installation()
    assert named and all(any(p == k or p.startswith(k + os.sep) for k in key) for p in named), (named, key)
    cpp, cuda = _ext._sources()
    flags = _ext.build_flags()
    before = _ext._build_name(cpp + cuda, flags)
    import torch

    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert _ext._build_name(cpp + cuda, flags) != before
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    assert _ext._build_name(cpp + cuda, flags) != before


def test_the_suite_builds_in_its_own_cache_not_the_users():
    """The tests (and what they start) build and load the kernels under the checkout's build/ folder."""
    root = _ext.source_dir().parent
    assert _ext.cache_root() == root / "build" / "ext-cache"
    p = subprocess.run([sys.executable, "-c", "from lq import _ext; print(_ext.cache_root())"],
                       capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert p.stdout.strip() == str(root / "build" / "ext-cache")


def test_build_ext_help_prints_usage_and_builds_nothing(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lq-build-ext", "--help"])
    monkeypatch.setattr(_ext, "build", lambda *a, **k: pytest.fail("--help must not build"))
    assert _ext.main() == 0
    assert "usage: lq-build-ext" in capsys.readouterr().out


def test_import_lq_builds_nothing(tmp_path):
    """``import lq`` is light: only a module that runs ops loads (and, once, builds) the kernels."""
    code = ("import os, lq\n"
            "print('loaded', lq._ext.is_loaded())\n"
            "print('cache', os.path.exists(os.environ['LQ_EXT_CACHE']) and os.listdir(os.environ['LQ_EXT_CACHE']))")
    env = dict(os.environ, LQ_EXT_CACHE=str(tmp_path / "empty_cache"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded False" in p.stdout and "cache False" in p.stdout
    assert "building the C++ kernels" not in p.stderr


def test_the_kernels_are_built_for_the_isa_torch_runs_not_the_one_proc_cpuinfo_lists():
    """Under an emulator or a capped torch (``ATEN_CPU_CAPABILITY``) ``/proc/cpuinfo`` can list AVX-512 the code
    may not use; an AVX-512 build then dies of an illegal instruction (it did under qemu's Haswell)."""
    code = ("import torch, lq._ext as e; print(torch.backends.cpu.get_cpu_capability(), e.cpu_capability(), "
            "'-mavx512f' in e.build_flags()[0])")
    for cap, want in (("avx2", "AVX2 AVX2 False"), ("default", "DEFAULT DEFAULT False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S,
                             env=dict(os.environ, ATEN_CPU_CAPABILITY=cap))
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-3:] == want.split(), out.stdout
