"""The cubin disk cache (runtime/compile.py) without a GPU: NVRTC replaced by a slow fake that counts its compiles,
so that threads and processes asking for one key at once are seen to compile it once and all read the same cubin."""
from __future__ import annotations

import multiprocessing
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiledsl.errors import LaunchError
from tiledsl.runtime import compile as runtime_compile


def fake_nvrtc(log_dir, fail: bool = False):
    """A module with NVRTC's calls as cached_cubin makes them: each compile sleeps, then leaves a file in log_dir."""
    nvrtc = types.SimpleNamespace()
    nvrtc.getVersion = lambda: (13, 0)
    nvrtc.createProgram = lambda source, name, headers, includes: {"source": source}

    def compile_program(program, options):
        time.sleep(0.2)
        (log_dir / f"compile-{time.monotonic_ns()}-{threading.get_ident()}").write_text("")
        if fail:
            raise RuntimeError("NVRTC_ERROR_COMPILATION")
        program["cubin"] = ("cubin of " + program["source"]).encode()
    nvrtc.compileProgram = compile_program
    nvrtc.getProgramLog = lambda program: "kernel.cu(3): error: expected a ';'"
    nvrtc.getCUBIN = lambda program: program["cubin"]
    nvrtc.destroyProgram = lambda program: None
    return nvrtc


@pytest.fixture
def nvrtc(tmp_path, monkeypatch):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    module = fake_nvrtc(log_dir)
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = module
    for name, value in (("cupy_backends", types.ModuleType("cupy_backends")),
                        ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                        ("cupy_backends.cuda.libs", libs), ("cupy_backends.cuda.libs.nvrtc", module)):
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path / "cache"))
    return log_dir


def compiles(log_dir) -> int:
    return len(list(log_dir.iterdir()))


def test_threads_asking_for_one_kernel_compile_it_once(nvrtc):
    with ThreadPoolExecutor(6) as pool:
        cubins = list(pool.map(lambda _: runtime_compile.compile_cubin("source A", "k", "sm_90a"), range(6)))
    assert cubins == [b"cubin of source A"] * 6
    assert compiles(nvrtc) == 1


def test_different_kernels_compile_side_by_side(nvrtc):
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        cubins = list(pool.map(lambda i: runtime_compile.compile_cubin(f"source {i}", f"k{i}", "sm_90a"), range(4)))
    assert cubins == [f"cubin of source {i}".encode() for i in range(4)]
    assert compiles(nvrtc) == 4
    assert time.perf_counter() - start < 0.7   # four 0.2 s compiles, not one after another


def _compile_in_child(source):
    return runtime_compile.compile_cubin(source, "k", "sm_90a")


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (the fake NVRTC)")
def test_processes_sharing_the_cache_compile_a_kernel_once(nvrtc):
    with multiprocessing.get_context("fork").Pool(4) as pool:
        cubins = pool.map(_compile_in_child, ["source B"] * 4)
    assert cubins == [b"cubin of source B"] * 4
    assert compiles(nvrtc) == 1


def test_a_failed_compile_releases_its_lock_and_names_the_kernel(nvrtc, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", fake_nvrtc(nvrtc, fail=True))
    monkeypatch.setattr(sys.modules["cupy_backends.cuda.libs"], "nvrtc", sys.modules["cupy_backends.cuda.libs.nvrtc"])
    for _ in range(2):   # the second call takes the lock again: the first released it
        with pytest.raises(LaunchError, match=r"bad_kernel: NVRTC failed for sm_90a:\n.*expected a ';'"):
            runtime_compile.compile_cubin("broken", "bad_kernel", "sm_90a")
    assert compiles(nvrtc) == 2
    assert not list((runtime_compile.cache_dir() / "cubin").glob("*.cubin"))
