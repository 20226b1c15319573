"""NVRTC compilation for the GPU in hand, through CuPy's bindings, with a disk cache of cubins (under
~/.cache/tiledsl, TILEDSL_CACHE_DIR overrides) keyed by a sha256 of source, options, architecture and NVRTC
version. TILEDSL_LINEINFO=1 compiles with line info, so that Nsight Compute and compute-sanitizer name the
generated source's lines (`<kernel>.cu:LINE`). Processes sharing the cache (the ranks of one job, test workers)
compile each key once: the others wait on the key's lock file for its cubin."""
from __future__ import annotations

import fcntl
import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LaunchError

if TYPE_CHECKING:
    pass


NVRTC_OPTIONS = ("--std=c++17",)


def cache_dir() -> Path:
    root = os.environ.get("TILEDSL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tiledsl")
    return Path(root)


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """The cubin of `source` for `arch`, from the disk cache or NVRTC."""
    return cached_cubin(source, name, arch).read_bytes()


def cached_cubin(source: str, name: str, arch: str) -> Path:
    """The disk-cache file of `source`'s cubin for `arch`, compiled by NVRTC first if missing."""
    from cupy_backends.cuda.libs import nvrtc
    line_info = ("--generate-line-info",) if os.environ.get("TILEDSL_LINEINFO") == "1" else ()
    options = NVRTC_OPTIONS + line_info + (f"--gpu-architecture={arch}",)
    key = hashlib.sha256("\0".join([source, *options, arch, repr(nvrtc.getVersion())]).encode()).hexdigest()
    path = cache_dir() / "cubin" / f"{name}-{key[:16]}.cubin"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _compiling(path):
        if path.exists():   # compiled by whoever held the lock before us
            return path
        program = nvrtc.createProgram(source, f"{name}.cu", (), ())
        try:
            nvrtc.compileProgram(program, list(options))
        except Exception as err:
            log = nvrtc.getProgramLog(program)
            raise LaunchError(f"{name}: NVRTC failed for {arch}:\n{log or err}") from None
        cubin = nvrtc.getCUBIN(program)
        nvrtc.destroyProgram(program)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        tmp.replace(path)   # atomic: a reader that takes no lock sees no file or the whole one
    return path


@contextmanager
def _compiling(path: Path):
    """Holds `path`'s lock file (flock: per open file, so threads of one process exclude each other too). The lock
    files stay: removing one would let a waiter lock a file that a newcomer no longer sees."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
