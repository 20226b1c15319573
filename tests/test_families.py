"""The family table (tiledsl/families.py): one row per family variant, each naming what exists."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tiledsl
from tiledsl.errors import SpecError
from tiledsl.families import FAMILIES, WITH_TEMPLATE, layout_of, lower, resolve, row_for
from tiledsl.schedule.passes import run_passes
from tiledsl.frontend.parse import parse_file
from tiledsl.codegen.render import TEMPLATE_DIR, render
from tiledsl.spec import Family, Mma

ROOT = Path(__file__).resolve().parent.parent


def _spec(name: str):
    return parse_file(ROOT / "specs" / name)[0]


def test_every_row_names_a_template_that_exists_and_one_row_per_variant():
    keys = [(row.family, row.mma) for row in FAMILIES]   # a row: family and MMA instruction (serving variants inside)
    assert len(keys) == len(set(keys))
    for row in FAMILIES:
        assert (TEMPLATE_DIR / row.template).is_file(), row.template


@pytest.mark.parametrize("name,template,kernel_class", [
    ("fa2_d64.tile", "fa2.cu.j2", "Kernel"), ("fa2_wgmma_d128.tile", "fa2_wgmma.cu.j2", "Kernel"),
    ("fa1_d64.tile", "fa1.cu.j2", "Fa1Kernel"), ("decode_d128.tile", "decode.cu.j2", "DecodeKernel")])
def test_each_bundled_family_goes_to_its_row(name, template, kernel_class):
    spec = _spec(name)
    plan = lower(spec)
    assert plan.template == template and plan.family == spec.family.value
    assert resolve(row_for(spec).kernel_class).__name__ == kernel_class
    kernel = tiledsl.compile(spec)   # no GPU needed until the kernel is launched
    assert type(kernel).__name__ == kernel_class and kernel.source == render(plan)


def test_wgmma_and_mma_sync_rows_differ_only_by_mma():
    spec = _spec("fa2_wgmma_d128.tile")
    assert spec.schedule.mma is Mma.WGMMA and row_for(spec).template == "fa2_wgmma.cu.j2"


def test_family_without_template_is_a_spec_error_listing_those_with_one(monkeypatch):
    # Every family has a template today: take hopper's row out to see what a family without one gets.
    import tiledsl.families as families
    assert Family.HOPPER in WITH_TEMPLATE
    monkeypatch.setattr(families, "FAMILIES", tuple(r for r in families.FAMILIES if r.family is not Family.HOPPER))
    monkeypatch.setattr(families, "WITH_TEMPLATE", tuple(f for f in WITH_TEMPLATE if f is not Family.HOPPER))
    with pytest.raises(SpecError) as err:
        lower(_spec("hopper_d128.tile"))
    assert "the hopper family has no CUDA template yet" in err.value.message
    assert "families with templates: fa2, fa1, decode" in str(err.value)


def test_every_name_a_row_gives_resolves():
    """Rows name their lowerings and kernel classes as "module:attribute" (imported on first use)."""
    for row in FAMILIES:
        assert callable(resolve(row.lowering)) and isinstance(resolve(row.kernel_class), type)
        for variant in row.serving:
            assert isinstance(resolve(variant.kernel_class), type)
            assert not variant.template or (TEMPLATE_DIR / variant.template).is_file()


def test_reading_the_table_imports_no_lowering():
    """The front end and the passes read layouts through families.py: importing it (and asking a spec's
    layout) must not import the lowerings, the runtime or the template engine."""
    code = ("import sys, tiledsl.families as f; from tiledsl.frontend.parse import parse_file; "
            "f.layout_of(parse_file('specs/fa2_d64.tile')[0]); "
            "print(sorted(m for m in sys.modules if m.startswith(('tiledsl.lower', 'tiledsl.runtime', 'jinja2'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_one_layout_and_one_graph_per_compile(monkeypatch):
    """families.lower computes the layout once and builds the scheduler graph once, and the lowering
    reads both: no lowering, pass or kernel class computes them again."""
    import tiledsl.layout.base as base
    import tiledsl.schedule.graph as graph
    counts = {"layouts": 0, "graphs": 0}
    layout_init, graph_init = base.Layout.__init__, graph.ScheduleGraph.__init__

    def counting(key, init):
        def wrapped(self, *args, **kwargs):
            counts[key] += 1
            init(self, *args, **kwargs)
        return wrapped
    monkeypatch.setattr(base.Layout, "__init__", counting("layouts", layout_init))
    monkeypatch.setattr(graph.ScheduleGraph, "__init__", counting("graphs", graph_init))
    names = ["fa2_d64.tile", "fa2_wgmma_d128.tile", "fa1_d64.tile", "decode_d128.tile", "hopper_d128.tile"]
    specs = [_spec(name) for name in names]   # parsing checks each spec: its own layout, before the count
    for spec in specs:
        counts.update(layouts=0, graphs=0)
        tiledsl.compile(spec)
        assert counts == {"layouts": 1, "graphs": 1}, (spec.name, counts)
    counts.update(layouts=0, graphs=0)
    lower(specs[3], stages=3, tile_kv=64)   # a decode variant's layout overrides: still once each
    assert counts == {"layouts": 1, "graphs": 1}


def test_the_plan_is_made_with_its_template():
    spec = _spec("fa2_d64.tile")
    row = row_for(spec)
    layout = layout_of(spec)
    graph = run_passes(spec, layout=layout)
    plan = resolve(row.lowering)(spec, layout, graph, row.template)
    assert plan.template == "fa2.cu.j2" and render(plan) == render(lower(spec))
