"""Chunked prefill on a paged KV cache without a GPU: the fa2 (mma.sync) plan's page constants and
walk, the rendered kernel's block-table parameters only when paged, the kernel class, paged specs
refused by the families that can't read them, paged_prefill's spec choice, and ptxas on the paged
renders (no spills)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tiledsl.codegen import nvcc
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.families import compile as compile_kernel, lower, missing_template
from tiledsl.frontend.parse import load_specs, parse_text
from tiledsl.codegen.render import render
from tiledsl.serving.prefill import prefill_spec
from tiledsl.spec import DType, Family, Mask, Mma

BUNDLED = load_specs("specs/fa2_d128_causal.tile")[0]   # mma.sync, tile kv 64


def paged(spec, page: int):
    return replace(spec, problem=replace(spec.problem, kv_page_size=page))


def constant(plan, name):
    return next(c.value for c in plan.constants if c.name == name)


@pytest.mark.parametrize("page, walk", [(1, "rows"), (16, "rows"), (32, "rows"), (64, "slice"), (256, "slice")])
def test_page_walk_and_constants(page, walk):
    plan = lower(paged(BUNDLED, page))
    assert plan.kv_pages == walk
    assert constant(plan, "PAGE_SIZE") == page and 1 << constant(plan, "PAGE_SHIFT") == page
    assert constant(plan, "PAGE_MASK") == page - 1 and constant(plan, "PAGE_PER_TILE") == (walk == "slice")
    source = render(plan)
    assert ("const int* __restrict__ kv_lens, int* __restrict__ index_errors, const int* __restrict__ block_table, "
            "i64 table_stride, int table_pages, int num_pages," in source)
    assert "void load_paged_tile(" in source and source.count("load_paged_tile<") == 4   # prologue, prefetch: K, V
    assert "load_tile_async<C::BC" not in source   # every K/V load goes through the block table
    assert f"{page} keys a page" in source         # the kv_range region says how K/V are found


def test_contiguous_fa2_reads_no_block_table():
    plan = lower(BUNDLED)
    assert not hasattr(plan, "kv_pages") or not plan.kv_pages
    source = render(plan)
    assert "block_table" not in source and "load_paged_tile" not in source
    assert not any(c.name.startswith("PAGE") for c in plan.constants)


def test_paged_kernel_class_and_name():
    kernel = compile_kernel(paged(BUNDLED, 16))
    assert type(kernel).__name__ == "PagedPrefillKernel" and "_paged16_" in kernel.name
    assert type(compile_kernel(BUNDLED)).__name__ == "Kernel"


PAGED_WGMMA = """attention paged_wgmma {
    head_dim = 128
    dtype    = bf16
    mask     = causal
    kv_cache = paged(page = 16)
    schedule {
        order q, kv
        tile q = 128, kv = 128
        warps 8
        pipeline 2 stages via cp.async
        mma wgmma
    }
}
"""


def test_paged_refused_on_fa2_wgmma_at_the_kv_cache_line():
    with pytest.raises(SpecError) as err:   # check refuses it, as lowering does
        parse_text(PAGED_WGMMA, "paged_wgmma.tile")
    text = str(err.value)
    assert "paged_wgmma.tile:5" in text and "mma.sync reads it" in text


def test_paged_refused_on_fa1_and_hopper():
    for path in ("specs/fa1_d64.tile", "specs/hopper_d128.tile"):
        spec = paged(load_specs(path)[0], 16)
        with pytest.raises(SpecError, match="paged KV"):
            lower(spec)


@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL, Mask.WINDOW])
def test_prefill_spec_is_the_paged_mma_sync_pick(mask):
    spec = prefill_spec("sm_90a", DType.BF16, 128, 128, mask, 64, (100, 20) if mask is Mask.WINDOW else None)
    assert spec.family is Family.FA2 and spec.schedule.mma is Mma.SYNC
    assert spec.problem.kv_page_size == 64 and spec.problem.mask is mask
    assert (spec.problem.window_left, spec.problem.window_right) == ((100, 20) if mask is Mask.WINDOW else (0, 0))
    assert lower(spec).kv_pages in ("rows", "slice")


@pytest.mark.parametrize("page", [0, 3, 512])
def test_prefill_spec_refuses_page_sizes(page):
    with pytest.raises(RuntimeInputError, match="page size"):
        prefill_spec("sm_90a", DType.BF16, 128, 128, Mask.NONE, page)


@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("page", [1, 256])
def test_paged_renders_compile_without_spills(page):
    spec = prefill_spec("sm_90a", DType.BF16, 128, 128, Mask.CAUSAL, page)
    res = nvcc.resources(render(lower(spec)), spec.kernel_name)
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res.report


@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("d, page", [(72, 16), (40, 64)])
def test_padded_head_dims_load_only_their_chunks(d, page):
    """Head dims padded on chip (72 -> 80): paged loads copy the HBM row's chunks only (9 of 10, so
    the rows don't split evenly over the threads: one entry per copy), and compile without spills."""
    spec = prefill_spec("sm_90a", DType.BF16, d, d, Mask.CAUSAL, page)
    plan = lower(spec)
    assert constant(plan, "QK_CHUNKS") == d // 8 and constant(plan, "D") > d
    source = render(plan)
    assert source.count("load_paged_tile<C, C::BC, C::QK_CHUNKS,") == 2 and source.count("load_paged_tile<C, C::BC, C::V_CHUNKS,") == 2
    res = nvcc.resources(source, spec.kernel_name)
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res.report
