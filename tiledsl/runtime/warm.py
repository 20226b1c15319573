"""Warm first calls: a disk record, beside the cubin cache, of each kernel `tiledsl.attention` has
resolved and compiled, so the first call of a later process loads its cubin without the front end
(Lark, networkx, Jinja2: parsing the tuned spec, building the graph, lowering, rendering) or NVRTC.

A record is derived from the kernel: its spec, its plan's fields (PlanRecord: the same names and
values, plain Python, so reading it back imports none of the lowering modules), its source and
the path of its cubin. It is keyed by the attention call's lookup (arch, dtype, head dims, mask,
window, scale, decode q_len) and a fingerprint of this tiledsl (version, the package's and the
templates' files, CuPy's version): any change to the code or templates misses the old records.
`tiledsl warmup` fills the records of the tuned table; `attention` writes one for each kernel it
compiles. A record that cannot be read, or whose cubin is gone, is ignored (the slow path runs
and writes it again)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
from pathlib import Path

from .kernel import PlanRecord
from .compile import cache_dir

RECORD_DIR = "warm"
FORMAT = 1   # bump when the record's layout changes


def plan_record(value):
    """`value` with every dataclass (the plan, its constants, launch, regions) as a PlanRecord."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return PlanRecord(**{f.name: plan_record(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, (tuple, list)):
        return type(value)(plan_record(v) for v in value)
    if isinstance(value, dict):
        return {k: plan_record(v) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """tiledsl's version, the size and mtime of every file of the package and of the templates and plain
    headers it renders (a source checkout's templates/ beside the package), and CuPy's version."""
    from ..version import __version__
    package = Path(__file__).resolve().parent.parent   # tiledsl/
    files = [p for p in package.rglob("*") if p.suffix in (".py", ".lark", ".j2", ".cuh")]
    beside = package.parent / "templates"
    if beside.is_dir():   # templates and the plain headers pasted into kernels
        files += list(beside.glob("*.j2")) + list(beside.glob("*.cuh"))
    parts = [__version__, _cupy_version()]
    for path in sorted(files):
        st = path.stat()
        parts.append(f"{path.relative_to(package.parent)}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _cupy_version() -> str:
    try:
        import cupy
    except ImportError:
        return "no cupy"
    return cupy.__version__


def record_path(arch: str, lookup: tuple) -> Path:
    key = hashlib.sha256(repr((FORMAT, fingerprint(), arch, lookup)).encode()).hexdigest()
    return cache_dir() / RECORD_DIR / f"{key[:32]}.pickle"


def save(arch: str, lookup: tuple, kernel, found: bool) -> None:
    """Record `kernel` (its function loaded, so its cubin is on disk) for `lookup` on `arch`.
    Best effort: a cache that cannot be written leaves the next process on the slow path."""
    if kernel.cubin_path is None:
        return
    record = {"class": type(kernel), "spec": kernel.spec, "plan": plan_record(kernel.plan), "source": kernel.source,
              "cubin": str(kernel.cubin_path), "found": found}
    path = record_path(arch, lookup)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
        tmp.replace(path)   # atomic: a concurrent reader sees the old record or the whole new one
    except OSError:
        pass


def load(arch: str, lookup: tuple):
    """(kernel, found in the tuned table) from the record of `lookup` on `arch`, or None."""
    path = record_path(arch, lookup)
    try:
        record = pickle.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except Exception:   # truncated, or written by code that no longer unpickles: rebuilt on the slow path
        return None
    cubin = Path(record["cubin"])
    if not cubin.is_file():
        return None
    kernel = record["class"](record["spec"], record["plan"])
    kernel.source, kernel.cubin_path = record["source"], cubin
    return kernel, record["found"]
