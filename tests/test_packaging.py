"""A non-editable install works: build the wheel, install it (no dependencies) into a fresh virtual
environment that borrows this interpreter's jinja2/lark/numpy/networkx, and compile a bundled spec
from another directory. Offline; needs `wheel` (the test extra) or setuptools >= 70.1 to build."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import jinja2
import lark
import networkx
import numpy

from tiledsl.families import lower
from tiledsl.frontend.parse import parse_file
from tiledsl.codegen.render import render

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "fa2_d64.tile"

pytestmark = pytest.mark.packaging


def _can_build_wheels() -> bool:
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
        return True
    except ImportError:
        return importlib.util.find_spec("wheel") is not None


def _run(args, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh venv with the wheel of this checkout installed."""
    if not _can_build_wheels():
        if os.environ.get("CI"):
            pytest.fail("CI: building a wheel needs the `wheel` package (pip install -e '.[test]')")
        pytest.skip("building a wheel needs `wheel` or setuptools >= 70.1 (pip install -e '.[test]')")
    tmp = tmp_path_factory.mktemp("packaging")
    # Built from a copy of what the wheel needs: setuptools reuses a build/ folder left in the
    # tree, which could hide a file missing from the package data (and litter the checkout).
    source = tmp / "source"
    for name in ("tiledsl", "templates"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist"), str(source)])
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    (wheel,) = (tmp / "dist").glob("tiledsl-*.whl")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])
    # The dependencies come from this interpreter's site-packages (appended: the wheel's tiledsl wins).
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = {str(Path(m.__file__).resolve().parent.parent) for m in (jinja2, lark, networkx, numpy)}
    (site / "borrowed_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return python


def test_wheel_ships_templates_and_grammar(installed):
    (wheel,) = (installed.parent.parent.parent / "dist").glob("tiledsl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "tiledsl/frontend/grammar.lark" in names
    shipped = [p for pattern in ("*.j2", "*.cuh") for p in (ROOT / "templates").glob(pattern)]
    assert any(p.suffix == ".cuh" for p in shipped)
    assert {f"tiledsl/templates/{p.name}" for p in shipped} <= names


def test_installed_package_compiles_a_bundled_spec(installed, tmp_path):
    where = _run([str(installed), "-c", "import tiledsl.codegen.render as r; print(r.__file__); print(r.TEMPLATE_DIR)"],
                 cwd=tmp_path).stdout.split()
    assert all(str(installed.parent.parent) in path for path in where), where   # not this checkout
    _run([str(installed), "-m", "tiledsl.cli", "compile", str(SPEC), "-o", "out"], cwd=tmp_path)
    spec = parse_file(SPEC)[0]
    cu = tmp_path / "out" / f"{spec.kernel_name}.cu"
    assert cu.read_text() == render(lower(spec))
