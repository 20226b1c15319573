"""Shared test fixtures: where the repository and its specs are, and a reader for rendered
SpecErrors (so tests can assert on file:line:col and on the text the carets underline)."""
from __future__ import annotations

import os
import re
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One BLAS / OpenMP thread per test worker: with a pool per worker, `-n 15` on 16 cores runs hundreds of spinning
    # threads, and the float64 references (NumPy matmuls) crawl. Read when NumPy and torch load, which is after this.
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC_FILES = sorted((ROOT / "specs").glob("*.tile"))


def pytest_runtest_logreport(report):
    """TILEDSL_TEST_TIMES=FILE: one line per test call as it ends (seconds, outcome, test id), written by the process
    that reports (xdist's controller), so a run stopped at its time limit still says what took the time."""
    path = os.environ.get("TILEDSL_TEST_TIMES")
    if path and report.when == "call" and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as times:
            times.write(f"{report.duration:.1f} {report.outcome} {report.nodeid}\n")


@pytest.fixture
def spec_files() -> list[Path]:
    """Every bundled spec file, sorted."""
    return SPEC_FILES


@pytest.fixture
def write_spec(tmp_path):
    """write_spec(text, name="spec.tile") -> Path of a spec file holding `text`."""
    def write(text: str, name: str = "spec.tile") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


def read_error(rendered: str) -> dict:
    """Split a rendered SpecError into file, line, column, message, the underlined text and hint."""
    lines = rendered.splitlines()
    head = re.match(r"(?P<file>.*?):(?P<line>\d+):(?P<column>\d+): error: (?P<message>.*)", lines[0])
    assert head, f"no file:line:col header in:\n{rendered}"
    out = {"file": head["file"], "line": int(head["line"]), "column": int(head["column"]),
           "message": head["message"], "underlined": None, "hint": None}
    for i, line in enumerate(lines[1:-1], start=1):
        gutter = re.match(r"\s*\d+ \| ", line)
        if gutter and set(lines[i + 1].strip()) == {"^"}:
            source = line[gutter.end():]
            start = lines[i + 1].index("^") - gutter.end()
            out["underlined"] = source[start:start + lines[i + 1].count("^")]
    hints = [line for line in lines if line.startswith("  hint: ")]
    out["hint"] = hints[0][len("  hint: "):] if hints else None
    return out


@pytest.fixture
def error_parts():
    """The read_error function, for tests that check rendered errors."""
    return read_error


@pytest.fixture(autouse=True)
def no_device_error_left_behind(request):
    """A GPU test that makes a kernel report a bad index must take the report (tiledsl.check_errors() under
    pytest.raises); one left behind would be raised by a later, unrelated call in the same process. The report
    is cleared either way, and the test that left it fails here."""
    yield
    if request.node.get_closest_marker("gpu") is None:
        return
    import sys
    errors = sys.modules.get("tiledsl.runtime.device_errors")
    if errors is None:   # no kernel call made a report buffer
        return
    from tiledsl.runtime.availability import gpu_missing
    if gpu_missing():   # a skipped GPU test on a machine without one (a stubbed device may have left words)
        return
    from tiledsl.errors import RuntimeInputError
    try:
        errors.check_errors()
    except RuntimeInputError as err:
        pytest.fail(f"the test left a device error report nobody took: {err}")

