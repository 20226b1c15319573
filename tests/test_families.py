"""The family table (tiledsl/families.py): one row per family variant, each naming what exists."""
from __future__ import annotations

from pathlib import Path

import pytest

import tiledsl
from tiledsl.errors import SpecError
from tiledsl.families import FAMILIES, WITH_TEMPLATE, lower, row_for
from tiledsl.frontend.parse import parse_file
from tiledsl.codegen.render import TEMPLATE_DIR, render
from tiledsl.spec import Family, Mma

ROOT = Path(__file__).resolve().parent.parent


def _spec(name: str):
    return parse_file(ROOT / "specs" / name)[0]


def test_every_row_names_a_template_that_exists_and_one_row_per_variant():
    keys = [(row.family, row.mma, row.seq_layout) for row in FAMILIES]   # a variant: family, mma, sequence layout
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
    assert row_for(spec).kernel_class.__name__ == kernel_class
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


def test_a_lowering_called_directly_cannot_be_rendered_by_accident():
    plan = row_for(_spec("fa2_d64.tile")).lowering(_spec("fa2_d64.tile"))
    with pytest.raises(ValueError, match="names no template"):
        render(plan)
