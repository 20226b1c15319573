"""Templates that only spell ops: the KV-tile load strategy is chosen in Python, plan fields all have
defaults (no `is defined` in Jinja), headers without Jinja are plain .cuh files pasted verbatim, and no
template splices raw blocks."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import replace

import pytest

from tiledsl.codegen.render import TEMPLATE_DIR, header, render
from tiledsl.families import lower
from tiledsl.frontend.parse import parse_file
from tiledsl.lower.plan import KV_WALKS, KernelPlan, KvLoad
from tiledsl.serving.prefill import prefill_spec
from tiledsl.spec import DType, KvScale, Mask

from .conftest import ROOT

JINJA = re.compile(r"\{%|\{\{")


def _spec(name: str):
    return parse_file(ROOT / "specs" / name)[0]


def _jinja_templates():
    return sorted(TEMPLATE_DIR.glob("*.j2"))


def test_no_template_asks_whether_a_plan_field_exists():
    for path in _jinja_templates():
        assert " is defined" not in path.read_text(), path.name


def test_plan_fields_beyond_the_shared_ones_have_defaults():
    """A field a subclass adds (or the base offers to some families) has a default, so a template reads
    it from any plan."""
    required = {f.name for f in dataclasses.fields(KernelPlan) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    assert required == {"kernel_name", "family", "template", "tiledsl_version", "source_file", "config_hash",
                        "spec_lines", "config_lines", "dtype_ptx", "constants", "regions", "loop_body",
                        "min_blocks_per_sm", "launch", "register_estimate"}


def test_no_raw_block_splicing():
    for path in _jinja_templates():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not ("{% endraw %}" in line and "{% raw %}" in line), f"{path.name}:{number}"


def test_every_j2_file_holds_jinja_and_every_cuh_file_is_pasted():
    """A header with no Jinja is a plain .cuh file, pasted verbatim (render.header), never parsed."""
    for path in _jinja_templates():
        text = re.sub(r"\{#.*?#\}", "", path.read_text(), flags=re.S)
        text = re.sub(r"\{% raw %\}.*?\{% endraw %\}", "", text, flags=re.S)
        assert JINJA.search(text), f"{path.name} holds no Jinja: make it a plain .cuh"
    sources = "".join(p.read_text() for p in _jinja_templates()) + "".join(
        p.read_text() for p in (ROOT / "tiledsl" / "lower").glob("*.py"))
    for path in sorted(TEMPLATE_DIR.glob("*.cuh")):
        assert f'"{path.name}"' in sources, f"{path.name} is pasted by no template or plan"
        assert f'include "{path.name}"' not in sources, f"{path.name} must be pasted verbatim, not included"


def test_a_pasted_header_is_its_file_verbatim():
    source = render(lower(_spec("fa2_d64.tile")))
    for name in ("common.cuh", "attention.cuh", "launch_order.cuh"):
        assert header(name) in source and header(name) == (TEMPLATE_DIR / name).read_text().removesuffix("\n")


def _decode(page=None, fp8=None):
    spec = _spec("decode_d128.tile")
    problem = replace(spec.problem, kv_page_size=page, kv_dtype=DType.E4M3 if fp8 else None,
                      kv_scale=KvScale.PER_HEAD if fp8 else None)
    return replace(spec, problem=problem, schedule=replace(spec.schedule, fp8_convert=fp8))


@pytest.mark.parametrize("what, spec, walk, loader", [
    ("fa2", lambda: _spec("fa2_d64.tile"), "tile", "load_tile_async<C::BC, C::QK_CHUNKS,"),
    ("fa2 paged", lambda: prefill_spec("sm_90a", DType.BF16, 128, 128, Mask.CAUSAL, 16), "paged_tile",
     "load_paged_tile<C, C::BC, C::QK_CHUNKS,"),
    ("fa2 wgmma", lambda: _spec("fa2_wgmma_d128.tile"), "tile", "load_tile_panels<C::BC, C::D / 8, C::THREADS>"),
    ("fa1", lambda: _spec("fa1_d64.tile"), "tile", "load_tile_async<C::BC, C::D / 8,"),
    ("decode", lambda: _decode(), "slice", "load_tile_async<C::KEYS_PER_WARP, C::D / 8, C::QK_ROW_BYTES"),
    ("decode paged", lambda: _decode(16), "paged_slice", "load_paged_slice<C, C::KEYS_PER_WARP, C::D / 8,"),
    ("decode fp8", lambda: _decode(None, "fragments"), "slice",
     "load_tile_async<C::KEYS_PER_WARP, C::K8_CHUNKS, C::K8_ROW_BYTES, C::K8_SWIZZLE, 32>"),
    ("decode paged fp8 shared", lambda: _decode(16, "shared"), "paged_slice",
     "load_paged_slice<C, C::KEYS_PER_WARP, C::K8_CHUNKS, C::K8_ROW_BYTES, false>"),
])
def test_the_kv_tile_load_is_chosen_in_lowering(what, spec, walk, loader):
    plan = lower(spec())
    assert plan.kv_load.walk == walk and plan.kv_load.k.loader.startswith(loader), (what, plan.kv_load.k.loader)
    assert plan.kv_load.scope == ("warp" if walk.endswith("slice") else "block")
    assert plan.kv_load.commit_each == (what != "fa1")   # FA1 commits K and V as one group
    source = render(plan)
    assert source.count(plan.kv_load.k.loader + "(") >= 2 and source.count(plan.kv_load.v.loader + "(") >= 2


def test_issue_kv_tile_reads_only_the_load_strategy():
    macros = (TEMPLATE_DIR / "macros.j2").read_text()
    body = macros[macros.index("{% macro issue_kv_tile"):macros.index("{% set KV_TILE_LOADERS")]
    assert set(re.findall(r"plan\.(\w+)", body)) == {"kv_load"}
    assert "{% if" not in body.replace("{% if load.commit_each %}", "").replace(
        "{% if ring.copies_entries_ahead %}", "")
    with pytest.raises(ValueError, match="unknown kv walk"):
        KvLoad.of("rows")
    assert set(KV_WALKS) == {"tile", "paged_tile", "slice", "paged_slice"}


def test_every_fp8_conversion_path_has_its_header():
    from tiledsl.layout.decode import FP8_CONVERTS
    from tiledsl.lower.decode import FP8_CONVERT_HEADERS, FP8_HEADER
    assert set(FP8_CONVERT_HEADERS) == set(FP8_CONVERTS)
    for convert in FP8_CONVERTS:
        plan = lower(_decode(16, convert))
        assert plan.headers == ("paged_kv.cuh", FP8_HEADER, FP8_CONVERT_HEADERS[convert])
        assert all((TEMPLATE_DIR / name).is_file() for name in plan.headers)
