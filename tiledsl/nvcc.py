"""Offline compilation with nvcc (present on CPU-only machines too): PTX, cubin, SASS and the
ptxas resource report (registers, spills, shared memory) of a rendered kernel."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    static_shared_bytes: int
    report: str


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def _run(args: list[str]) -> subprocess.CompletedProcess:
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc")
    return subprocess.run([nvcc, *args], capture_output=True, text=True)


def compile_to(source: str, name: str, kind: str, out_dir: Path) -> tuple[Path, str]:
    """Compile `source` to `kind` (ptx or cubin) in out_dir; returns the path and nvcc's output
    (the ptxas report for cubin). Raises RuntimeError with nvcc's message on failure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / f"{name}.cu"
        cu.write_text(source)
        target = out_dir / f"{name}.{kind}"
        flags = ["-Xptxas", "-v"] if kind == "cubin" else []
        result = _run([*ARCH_FLAGS, f"--{kind}", *flags, "-o", str(target), str(cu)])
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed for {name}:\n{result.stderr}")
    return target, result.stdout + result.stderr


def parse_resources(report: str) -> Resources:
    def number(pattern: str) -> int:
        m = re.search(pattern, report)
        return int(m.group(1)) if m else 0
    return Resources(registers=number(r"Used (\d+) registers"), spill_store_bytes=number(r"(\d+) bytes spill stores"),
                     spill_load_bytes=number(r"(\d+) bytes spill loads"), stack_bytes=number(r"(\d+) bytes stack frame"),
                     static_shared_bytes=number(r"(\d+) bytes smem"), report=report)


def resources(source: str, name: str) -> Resources:
    with tempfile.TemporaryDirectory() as tmp:
        _, report = compile_to(source, name, "cubin", Path(tmp))
    return parse_resources(report)


def sass(cubin: Path) -> str:
    """SASS of a cubin through cuobjdump; a clear error where cuobjdump is absent."""
    tool = shutil.which("cuobjdump") or (os.path.join(os.path.dirname(nvcc_path() or ""), "cuobjdump"))
    if not tool or not os.path.exists(tool):
        raise FileNotFoundError("cuobjdump")
    result = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {result.stderr}")
    return result.stdout
