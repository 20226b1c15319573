"""NVRTC compilation for the GPU in hand, through CuPy's bindings, with a disk cache of cubins (under
~/.cache/tiledsl, TILEDSL_CACHE_DIR overrides) keyed by a sha256 of source, options, architecture and NVRTC
version. TILEDSL_LINEINFO=1 compiles with line info, so that Nsight Compute and compute-sanitizer name the
generated source's lines (`<kernel>.cu:LINE`)."""
from __future__ import annotations

import hashlib
import os
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
    program = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        nvrtc.compileProgram(program, list(options))
    except Exception as err:
        log = nvrtc.getProgramLog(program)
        raise LaunchError(f"{name}: NVRTC failed for {arch}:\n{log or err}") from None
    cubin = nvrtc.getCUBIN(program)
    nvrtc.destroyProgram(program)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cubin)
    tmp.replace(path)   # atomic: a concurrent reader sees the old file or the whole new one
    return path
