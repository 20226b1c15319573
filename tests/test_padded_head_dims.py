"""Head dims that are multiples of 8 but not of 16 on fa2 mma.sync: the layout pads them on chip to
the mma width (layout.mma_width), the plan names the padded MMA widths and the real HBM chunks, and
nvcc compiles the kernels without spills. The GPU side is tests/test_gpu_headdims.py."""
from __future__ import annotations

import re

import pytest

from tiledsl.codegen import nvcc
from tiledsl.errors import SpecError
from tiledsl.families import lower
from tiledsl.families import layout_of
from tiledsl.layout.base import mma_width, tile_row_bytes
from tiledsl.frontend.parse import load_spec
from tiledsl.codegen.render import render

SPEC = """attention padded {{
    head_dim = {d}
    head_dim_v = {dv}
    dtype    = bf16
    mask     = causal
    schedule {{
        order    q, kv
        tile     q = 128, kv = 64
        warps    {warps} along q
        pipeline 2 stages via cp.async{mma}
    }}
}}
"""


def _spec(d: int, dv: int | None = None, mma: str = "", warps: int = 4):
    return load_spec(SPEC.format(d=d, dv=dv or d, warps=warps, mma=f"\n        mma {mma}" if mma else ""))


def _constants(plan) -> dict:
    return {c.name: c.value for c in plan.constants}


def test_mma_width_rounds_up_to_16_and_leaves_multiples_of_16_alone():
    assert [mma_width(d) for d in (8, 16, 24, 40, 56, 64, 72, 248, 256)] == [16, 16, 32, 48, 64, 64, 80, 256, 256]
    # Rows: an odd number of 16-byte chunks (padded) or a multiple of 64 columns (swizzled).
    assert tile_row_bytes(40) == tile_row_bytes(48) == (112, False)
    assert tile_row_bytes(56) == tile_row_bytes(64) == (128, True)
    assert tile_row_bytes(72) == tile_row_bytes(80) == (176, False)
    assert tile_row_bytes(248) == (512, True)


@pytest.mark.parametrize("d, dv", [(40, 40), (72, 72), (8, 8), (56, 56), (248, 248), (40, 64), (64, 24)])
def test_layout_and_plan_pad_on_chip_only(d, dv):
    spec = _spec(d, dv, warps=8)   # 16 rows (one mma tile) per warp: d 248 fits the registers
    lay = layout_of(spec)
    qk_row, _ = tile_row_bytes(d)
    v_row, _ = tile_row_bytes(dv)
    assert lay.buffer("Q").bytes == 128 * qk_row and lay.buffer("K").stage_bytes == 64 * qk_row
    assert lay.buffer("V").stage_bytes == 64 * v_row
    assert lay.buffer("O staging").bytes == 128 * v_row
    acc = {r.name: r.amount for r in lay.registers}
    assert acc["O accumulator"] == mma_width(dv) // 2
    c = _constants(lower(spec))
    assert (c["D"], c["DV"]) == (mma_width(d), mma_width(dv))
    assert (c["QK_CHUNKS"], c["V_CHUNKS"]) == (d // 8, dv // 8)
    assert c["O_TILES"] == mma_width(dv) // 8
    assert c["ZERO_PAD"] == (d % 16 != 0 or dv % 16 != 0)


def test_padded_source_copies_real_chunks_and_zeroes_the_pad():
    source = render(lower(_spec(40)))
    assert "zero_pad_chunks<C::BR" in source and "ZERO_PAD = true" in source
    assert re.search(r"load_tile_async<C::BC, C::QK_CHUNKS,", source)
    assert re.search(r"load_tile_async<C::BC, C::V_CHUNKS,", source)
    assert "store_output<C, C::V_CHUNKS>" in source


def test_wgmma_still_needs_multiples_of_64():
    with pytest.raises(SpecError, match="multiples of 64"):
        lower(_spec(72, mma="wgmma", warps=8))


def test_not_a_multiple_of_8_is_refused_at_the_head_dim_line():
    with pytest.raises(SpecError) as err:
        load_spec(SPEC.format(d=36, dv=36, warps=4, mma=""))
    assert "multiple of 8" in str(err.value) and ":2:" in str(err.value)


needs_nvcc = pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not on PATH")


@needs_nvcc
@pytest.mark.parametrize("d", [40, 72])
def test_padded_kernels_compile_without_spills(d):
    spec = _spec(d)
    plan = lower(spec)
    res = nvcc.resources(render(plan), spec.kernel_name)
    assert res.spill_stores == 0 and res.spill_loads == 0, res.report
    assert res.stack_bytes == 0 and 0 < res.registers <= 255, res.report
