"""The paged decode kernel without a GPU: how a warp walks the block table (layout.decode_page_walk),
the plan's page constants, the rendered kernel's block-table parameters only when paged, and the
serving API's spec choice and refusals."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tiledsl.dispatch.autoschedule import DECODE_HEAD_DIMS
from tiledsl.errors import RuntimeInputError
from tiledsl.families import compile as compile_kernel, lower
from tiledsl.layout.decode import decode_page_walk
from tiledsl.runtime.decode import constant
from tiledsl.frontend.parse import load_specs
from tiledsl.codegen.render import render
from tiledsl.serving.paged import paged_spec
from tiledsl.spec import DType, Mask

BUNDLED = load_specs("specs/decode_d128.tile")[0]   # kv 128, 4 warps: 32-key warp slices


def paged(page: int):
    return replace(BUNDLED, problem=replace(BUNDLED.problem, kv_page_size=page))


@pytest.mark.parametrize("page, walk", [(1, "rows"), (8, "rows"), (16, "pages"), (32, "slice"), (64, "slice"), (256, "slice")])
def test_page_walk_and_constants(page, walk):
    assert decode_page_walk(page, 32) == walk
    plan = lower(paged(page))
    assert plan.kv_pages == walk
    assert constant(plan, "PAGE_SIZE") == page and 1 << constant(plan, "PAGE_SHIFT") == page
    assert constant(plan, "PAGE_MASK") == page - 1 and constant(plan, "PAGE_PER_SLICE") == (walk == "slice")
    assert constant(plan, "PAGES_TILE_SLICE") == (walk == "pages")
    source = render(plan)
    assert "const int* __restrict__ block_table, i64 table_stride" in source
    assert "void load_paged_slice(" in source and source.count("load_paged_slice<") == 4   # prologue, refills: K, V


def test_slices_that_straddle_pages_walk_rows():
    assert decode_page_walk(64, 48) == "rows" and decode_page_walk(96 * 2, 48) == "slice"
    assert decode_page_walk(16, 48) == "pages" and decode_page_walk(32, 48) == "rows"
    assert decode_page_walk(None, 32) == ""


def test_contiguous_decode_reads_no_block_table():
    plan = lower(BUNDLED)
    assert plan.kv_pages == "" and "block_table" not in render(plan)
    assert not any(c.name.startswith("PAGE") for c in plan.constants)


def test_paged_kernel_class_and_name():
    kernel = compile_kernel(paged(16))
    assert type(kernel).__name__ == "PagedDecodeKernel" and "_paged16_" in kernel.name
    assert type(compile_kernel(BUNDLED)).__name__ == "DecodeKernel"


def test_serving_spec_follows_the_decode_pick():
    spec = paged_spec(DType.FP16, 64, 64, Mask.CAUSAL, 16, 4)
    assert spec.family.value == "decode" and spec.problem.kv_page_size == 16 and spec.problem.queries_per_seq == 4
    assert spec.problem.dtype is DType.FP16 and spec.problem.mask is Mask.CAUSAL
    assert set(range(16, 257, 16)) == set(DECODE_HEAD_DIMS)
    with pytest.raises(RuntimeInputError, match="head dim 72 is not served"):
        paged_spec(DType.BF16, 72, 72, Mask.NONE, 16, 1)
    with pytest.raises(RuntimeInputError, match="equal for k and v"):
        paged_spec(DType.BF16, 128, 64, Mask.NONE, 16, 1)


@pytest.mark.parametrize("family", ["decode", "fa2"])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_one_paged_header_serves_decode_and_fa2(family, page):
    """Both paged templates paste templates/paged_kv.cuh verbatim and read the block table only through
    its table_entry (one place for the table's reads); contiguous kernels paste none of it."""
    from tiledsl.codegen.render import header
    from tiledsl.serving.prefill import prefill_spec
    spec = paged(page) if family == "decode" else prefill_spec("sm_90a", DType.BF16, 128, 128, Mask.CAUSAL, page)
    source = render(lower(spec))
    assert source.count(header("paged_kv.cuh")) == 1
    assert source.count("table[") == 1 and "return table[index];" in source   # the body of table_entry
    contiguous = render(lower(replace(spec, problem=replace(spec.problem, kv_page_size=None))))
    assert "table_entry" not in contiguous and "block_table" not in contiguous


def test_only_plain_headers_are_pasted_verbatim():
    from tiledsl.codegen.render import header
    with pytest.raises(ValueError, match="only plain .cuh headers"):
        header("fa2.cu.j2")


@pytest.mark.parametrize("page", [1, 16, 64])
def test_a_paged_decode_of_one_warp_walks_the_table_per_warp(page):
    """One warp is a block, but decode walks a block table only per warp slice (load_paged_slice):
    the block-wide walk (load_paged_tile) is fa2's, and a one-warp paged decode used to ask for it."""
    from tiledsl.spec import Axis, Schedule
    spec = replace(paged(page), schedule=Schedule(tile_q=16, tile_kv=64, warps=1, warp_axis=Axis.KV, stages=2))
    (checked,) = load_specs(f"attention k {{\n    head_dim = 128\n    queries = 1\n"
                            f"    kv_cache = paged(page = {page})\n    schedule {{\n        warps 1\n    }}\n}}\n")
    assert checked.schedule.warps == 1
    for one_warp in (spec, checked):
        source = render(lower(one_warp))
        assert "load_paged_tile<" not in source and source.count("load_paged_slice<") == 4
