"""Rendering: KernelPlan -> CUDA C source through one Jinja2 environment.

StrictUndefined turns a missing plan field into an error instead of silently empty code;
trim_blocks/lstrip_blocks keep the emitted CUDA indented as written."""
from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

import jinja2

from ..lower.plan import KernelPlan


def template_dir() -> Path:
    """templates/ beside this tiledsl/ in a source checkout, else the installed package
    tiledsl.templates (a wheel). The checkout goes first: an editable install elsewhere maps
    tiledsl.templates to its own tree, which would pair this code with another tree's templates."""
    beside = Path(__file__).resolve().parents[2] / "templates"
    if (beside / "__init__.py").is_file():
        return beside
    return Path(str(importlib.resources.files("tiledsl.templates")))


TEMPLATE_DIR = template_dir()


def cuda_literal(value) -> str:
    """A Python value as a CUDA literal: bools lowercase, floats with enough digits and an f."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value!r}f"
    if isinstance(value, int):
        return f"{value}u" if value >= 2**31 else str(value)
    return str(value)


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["cuda_literal"] = cuda_literal
    env.globals["header"] = header
    return env


@functools.lru_cache(maxsize=None)
def header(name: str) -> str:
    """A plain CUDA header under templates/ (`.cuh`, no Jinja), pasted into a kernel verbatim: its lines
    without the last newline, so `{{ header(name) }}` on a line of its own is replaced by them."""
    if not name.endswith(".cuh"):
        raise ValueError(f"{name}: only plain .cuh headers are pasted verbatim")
    return (TEMPLATE_DIR / name).read_text().removesuffix("\n")


def render(plan: KernelPlan) -> str:
    if not plan.template:   # families.lower hands every lowering its row's template
        raise ValueError(f"{plan.kernel_name}: the plan names no template (lower it with tiledsl.families.lower)")
    return environment().get_template(plan.template).render(plan=plan)


def write_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` only when it differs, so timestamps and caches stay put."""
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True
