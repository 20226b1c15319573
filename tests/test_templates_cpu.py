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
    """The CUDA templates (the explain page's HTML template renders no KernelPlan)."""
    return sorted(p for p in TEMPLATE_DIR.glob("*.j2") if not p.name.endswith(".html.j2"))


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
    from tiledsl.lower.steps import INDEX_BOUNDS_HEADER
    assert set(FP8_CONVERT_HEADERS) == set(FP8_CONVERTS)
    for convert in FP8_CONVERTS:
        plan = lower(_decode(16, convert))
        assert plan.headers == (INDEX_BOUNDS_HEADER, "paged_kv.cuh", FP8_HEADER, FP8_CONVERT_HEADERS[convert])
        assert all((TEMPLATE_DIR / name).is_file() for name in plan.headers)


def _template_texts():
    return {p.name: p.read_text() for p in sorted(TEMPLATE_DIR.iterdir()) if p.suffix in (".j2", ".cuh")}


def test_shared_memory_is_addressed_through_the_typed_view():
    """No template adds a buffer's offset to the block's base by hand: struct Shared (base.cu.j2, from
    plan.shared) is the one spelling of every buffer's address."""
    for name, text in _template_texts().items():
        code = "\n".join(line for line in text.splitlines() if "static_assert" not in line)
        assert "smem_base" not in code, name
        if name != "base.cu.j2":
            assert not re.search(r"C::\w+_OFFSET \+", code), name


def test_the_pipeline_slot_and_phase_are_spelled_once():
    for name, text in _template_texts().items():
        if name != "macros.j2":
            assert "% C::STAGES" not in text and "/ C::STAGES" not in text, name


@pytest.mark.parametrize("name", ["fa2_d64.tile", "fa2_wgmma_d128.tile", "fa1_d64.tile", "decode_d128.tile",
                                  "hopper_d128.tile"])
def test_every_view_buffer_names_the_layouts_constants(name):
    plan = lower(_spec(name))
    constants = {c.name for c in plan.constants}
    assert plan.shared and {"q", "k", "v"} <= {b.name for b in plan.shared}
    source = render(plan)
    for b in plan.shared:
        assert b.offset in constants and (not b.stage_bytes or b.stage_bytes in constants), b
        assert f"u32 {b.name}({'int stage' if b.stage_bytes else ''}) const" in source


@pytest.mark.parametrize("what, spec, includes", [
    ("fa2", lambda: _spec("fa2_d64.tile"), ("kv_lens", "order_groups")),
    ("fa2 paged", lambda: prefill_spec("sm_90a", DType.BF16, 128, 128, Mask.CAUSAL, 16), ("block_table", "table_stride")),
    ("fa1", lambda: _spec("fa1_d64.tile"), ("o_state", "m_state", "l_state")),
    ("decode paged fp8", lambda: _decode(16, "fragments"), ("block_table", "k_scale", "v_scale", "num_splits")),
    ("hopper", lambda: _spec("hopper_d128.tile"), ("q_map", "items")),
])
def test_one_parameter_list_is_the_kernel_signature(what, spec, includes):
    """plan.parameters spells the signature (macros.j2 parameters) and is the order the host passes
    arguments in (runtime/kernel.py kernel_arguments): one list, no inline ifs in the templates."""
    plan = lower(spec())
    flat = [p for line in plan.parameters for p in line]
    names = [p.name for p in flat]
    assert len(names) == len(set(names)) and set(includes) <= set(names), what
    assert {p.kind for p in flat} <= {"pointer", "i32", "i64", "map"}
    source = render(plan)
    signature = source[source.index(plan.kernel_name + "("):]
    signature = " ".join(signature[len(plan.kernel_name) + 1:signature.index(") {")].split())
    assert signature == ", ".join(f"{p.type} {p.name}" for p in flat)
    if what == "fa2":
        assert "block_table" not in source and "k_scale" not in source


def test_the_host_passes_arguments_in_the_parameter_lists_order(monkeypatch):
    """runtime/kernel.py builds a prefill kernel's launch arguments from plan.parameters by name: the
    order and kinds follow the signature, and a missing or unknown name is refused."""
    from types import SimpleNamespace
    from tiledsl.families import compile as compile_kernel
    from tiledsl.runtime.inputs import Shapes
    from tiledsl.runtime.kernel import kernel_arguments
    spec = prefill_spec("sm_90a", DType.BF16, 128, 128, Mask.CAUSAL, 16)
    kernel = compile_kernel(spec)   # renders; nothing is compiled or launched
    from tiledsl.runtime import device_errors
    monkeypatch.setattr(device_errors, "error_pointer", lambda device_id, like=None: 5000 + device_id)
    tensors = {name: SimpleNamespace(pointer=1000 * (i + 1), strides=(9000 + i, 900 + i, 90 + i, 1), slot=i,
                                     device_id=3)
               for i, name in enumerate(("q", "k", "v", "o", "lse", "kv_lens"))}
    table = SimpleNamespace(pointer=77, strides=(5, 1), slot=6)
    args = kernel.attention_args(*tensors.values(), Shapes(2, 8, 4, 100, 300), block_table=table, table_stride=5,
                                 table_pages=19, num_pages=40, order_groups=3)
    flat = [p for line in kernel.plan.parameters for p in line]
    assert len(args) == len(flat)
    by_name = dict(zip((p.name for p in flat), args))
    assert by_name["block_table"].value == 77 and by_name["block_table"].slot == 6
    assert by_name["table_stride"].value == 5 and by_name["order_groups"].value == 3
    assert by_name["table_pages"].value == 19 and by_name["num_pages"].value == 40
    assert by_name["index_errors"].value == 5003   # q's device's error word
    assert by_name["kv_lens"].value == 6000 and by_name["kv_group"].value == 2 and by_name["v_row_stride"].value == 92
    assert all(a.kind == {"pointer": "u64", "i32": "i32", "i64": "i64"}[p.kind] for p, a in zip(flat, args))
    with pytest.raises(RuntimeError, match=r"missing \['block_table', 'table_stride', 'table_pages', 'num_pages'\]"):
        kernel.attention_args(*tensors.values(), Shapes(2, 8, 4, 100, 300), order_groups=3)
    with pytest.raises(RuntimeError, match=r"not parameters \['typo'\]"):
        kernel_arguments(kernel.plan, {**by_name, "typo": 1})
