"""Offline compilation with nvcc (present on CPU-only machines too): PTX, cubin, SASS and the
ptxas resource report (registers, spills, stack, shared memory) of a rendered kernel.

The one place that runs nvcc (one set of arch flags) and reads ptxas reports; the CLI, the tests
and the tuner all go through it."""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from ..schedule.cost import Resources
from pathlib import Path

DEFAULT_ARCH = "sm_90a"
TIMEOUT_S = 300
# A warning means nvcc changed what the source says (a constant truncated, a conversion narrowed): an error
# here. Two diagnostics say only that a generated variable goes unused in some configs (a variant's index the
# template declares for every config), which changes nothing: those stay quiet. 177: declared but never
# referenced; 550: set but never used.
WARNING_FLAGS = ("-Werror", "all-warnings", "-diag-suppress", "177,550")


def arch_flags(arch: str = DEFAULT_ARCH) -> tuple[str, ...]:
    """`-gencode=arch=compute_90a,code=sm_90a` for sm_90a: SASS for exactly that architecture."""
    return (f"-gencode=arch=compute_{arch.removeprefix('sm_')},code={arch}",)


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def version(nvcc: str | None = None) -> str:
    """`nvcc --version` (a cache key: reports change with the toolchain)."""
    try:
        return subprocess.run([nvcc or nvcc_path() or "nvcc", "--version"], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def compile_to(source: str, name: str, kind: str, out_dir: Path, arch: str = DEFAULT_ARCH) -> tuple[Path, str]:
    """Compile `source` to `kind` (ptx or cubin) in out_dir; returns the path and nvcc's output
    (the ptxas report for cubin). Raises FileNotFoundError without nvcc, RuntimeError with nvcc's
    message when it fails or runs past TIMEOUT_S."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.{kind}"
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / f"{name}.cu"
        cu.write_text(source)
        flags = [*WARNING_FLAGS] + (["-Xptxas", "-v"] if kind == "cubin" else [])
        try:
            result = subprocess.run([nvcc, *arch_flags(arch), f"--{kind}", *flags, "-o", str(target), str(cu)],
                                    capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"nvcc ran past {TIMEOUT_S} s for {name}") from None
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed for {name}:\n{result.stderr}")
    return target, result.stdout + result.stderr


# A report names each function first ("Compiling entry function 'x'", "Function properties for x");
# the stack/spill and register lines that follow are that function's.
_FUNCTION = re.compile(r"(?:Compiling entry function|Function properties for) '?(?P<name>[A-Za-z_]\w*)'?")
_FRAME = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes "
                    r"spill loads")
_REGISTERS = re.compile(r"Used (?P<registers>\d+) registers")
_SMEM = re.compile(r"(?P<smem>\d+) bytes smem")
# ptxas's numbered advisories ("ptxas info : (C7517) warpgroup.wait is injected ... in function 'x'"),
# printed before the function's own lines: they say where ptxas changed what the source asked for.
_ADVISORY = re.compile(r"ptxas (?:info|warning)\s*: \((?P<code>C\d+)\) (?P<text>.*)")
_ADVISED_FUNCTION = re.compile(r"in function '(?P<name>[A-Za-z_]\w*)'")


def parse_ptxas(report: str) -> dict[str, Resources]:
    """{function: Resources} from `nvcc -Xptxas -v` output; functions without a register line
    (nothing compiled) are left out."""
    found: dict[str, dict] = {}
    advised: dict[str | None, list[str]] = {}   # function -> advisories; None: the report names none
    current = None
    for line in report.splitlines():
        if advisory := _ADVISORY.search(line):
            named = _ADVISED_FUNCTION.search(advisory["text"])
            advised.setdefault(named["name"] if named else None, []).append(f"{advisory['code']} {advisory['text']}")
            continue
        function = _FUNCTION.search(line)
        if function:
            current = found.setdefault(function.group("name"), {})
            continue
        if current is None:
            continue
        if frame := _FRAME.search(line):
            current.update(stack_bytes=int(frame["stack"]), spill_stores=int(frame["stores"]),
                           spill_loads=int(frame["loads"]))
        if registers := _REGISTERS.search(line):
            current["registers"] = int(registers["registers"])
            if smem := _SMEM.search(line):
                current["static_shared_bytes"] = int(smem["smem"])
    return {name: Resources(source="ptxas", report=report,
                            advisories=tuple(advised.get(name, []) + advised.get(None, [])), **fields)
            for name, fields in found.items() if fields.get("registers")}


def resources(source: str, name: str, arch: str = DEFAULT_ARCH) -> Resources:
    """ptxas's resources of kernel `name` in `source`; RuntimeError when nvcc fails or the report
    does not name it."""
    with tempfile.TemporaryDirectory() as tmp:
        _, report = compile_to(source, name, "cubin", Path(tmp), arch)
    found = parse_ptxas(report).get(name)
    if found is None:
        raise RuntimeError(f"the ptxas report has no kernel {name}:\n{report}")
    return found


def sass(cubin: Path) -> str:
    """SASS of a cubin through cuobjdump; a clear error where cuobjdump is absent."""
    tool = shutil.which("cuobjdump") or (os.path.join(os.path.dirname(nvcc_path() or ""), "cuobjdump"))
    if not tool or not os.path.exists(tool):
        raise FileNotFoundError("cuobjdump")
    result = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {result.stderr}")
    return result.stdout
