"""FA1 without a GPU: plan invariants of lower_fa1, the rendered CUDA, and nvcc for sm_90a with no
spills for both warp splits at head dims 64 and 128 (skipped without nvcc unless
TILEDSL_REQUIRE_NVCC=1)."""
from __future__ import annotations

import os
import re

import pytest

from tiledsl.errors import SpecError
from tiledsl.families import lower
from tiledsl.device_limits import H200
from tiledsl.lower.fa1 import Fa1Plan
from tiledsl.frontend.parse import load_specs
from tiledsl.codegen.render import render
from tiledsl.spec import Axis, DType, Family, KernelSpec, LoopOrder, Mask, Problem, Schedule

from .conftest import ROOT

BUNDLED = ROOT / "specs" / "fa1_d64.tile"
# Configs the GPU tests run too (tests/test_gpu_fa1.py): per head dim and warp split.
SCHEDULES = {(64, "q"): (64, 64), (128, "q"): (64, 64), (64, "kv"): (64, 128), (128, "kv"): (32, 64)}


def fa1(d=64, axis="q", mask=Mask.NONE, dtype=DType.BF16, tiles=None, warps=4, stages=2, left=0, right=0):
    tile_q, tile_kv = tiles or SCHEDULES[(d, axis)]
    schedule = Schedule(order=LoopOrder.KV_OUTER, tile_q=tile_q, tile_kv=tile_kv, warps=warps,
                        warp_axis=Axis(axis), stages=stages)
    return KernelSpec(f"fa1_d{d}", Problem(d, d, dtype, mask, left, right), schedule)


def constants(plan) -> dict:
    return {c.name: c.value for c in plan.constants}


def all_specs():
    specs = list(load_specs(str(BUNDLED)))
    for (d, axis) in SCHEDULES:
        specs.append(fa1(d, axis))
        specs.append(fa1(d, axis, Mask.WINDOW, DType.FP16, left=100, right=3, stages=1))
    specs.append(fa1(64, "q", Mask.CAUSAL, stages=3))
    return specs


SPECS = all_specs()
IDS = [f"{s.kernel_name}" for s in SPECS]


# ---- plan invariants ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_plan_invariants(spec):
    plan = lower(spec)
    c = constants(plan)
    s = spec.schedule
    assert isinstance(plan, Fa1Plan) and plan.family == "fa1" and plan.template == "fa1.cu.j2"
    assert spec.family is Family.FA1
    assert plan.launch.threads == 32 * s.warps == c["THREADS"]
    assert plan.launch.smem_bytes == c["SMEM_BYTES"] <= H200.max_shared_per_block
    assert c["M_TILES"] * 16 == c["ROWS_PER_WARP"]
    assert c["S_TILES"] * 8 == c["KEYS_PER_WARP"] and c["KEYS_PER_WARP"] % 16 == 0
    if plan.split_k:
        assert c["BC"] == s.warps * c["KEYS_PER_WARP"], "split-K: the warps' key slices tile the kv tile"
        assert c["ROW_PASSES"] * c["ROWS_PER_WARP"] == s.tile_q
        assert c["COMBINE_BYTES"] >= 4 * c["ROWS_PER_WARP"] * (c["COMBINE_ROW_FLOATS"] + s.warps + 2)
        assert c["COMBINE_ROW_FLOATS"] % 4 == 0 and c["COMBINE_ROW_FLOATS"] >= c["DV"]
    else:
        assert c["KEYS_PER_WARP"] == c["BC"] and c["ROW_PASSES"] == 1
        assert s.warps * c["ROWS_PER_WARP"] == s.tile_q
    # O and S accumulators leave room for fragments and addresses (what ptxas needs without spills)
    assert c["M_TILES"] * (c["DV"] + c["KEYS_PER_WARP"]) // 2 <= 128 or not plan.split_k
    # shared-memory regions: aligned, in bounds, no overlap (O staging may reuse Q's rows)
    regions = [("Q", c["Q_OFFSET"], s.tile_q * c["QK_ROW_BYTES"]),
               ("K", c["K_OFFSET"], s.stages * c["K_STAGE_BYTES"]),
               ("V", c["V_OFFSET"], s.stages * c["V_STAGE_BYTES"])]
    if plan.split_k:
        regions.append(("combine", c["COMBINE_OFFSET"], c["COMBINE_BYTES"]))
    elif c["O_OFFSET"] != c["Q_OFFSET"]:
        regions.append(("O", c["O_OFFSET"], s.tile_q * c["V_ROW_BYTES"]))
    for name, offset, size in regions:
        assert offset % 128 == 0 and offset + size <= c["SMEM_BYTES"], name
    spans = sorted((offset, offset + size) for _, offset, size in regions)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_loop_structure(spec):
    plan = lower(spec)
    kv_kinds = [op.kind for op in plan.kv_step]
    if spec.schedule.stages == 1:
        assert kv_kinds == ["barrier", "prefetch_kv", "wait_kv"]
    else:
        assert kv_kinds == ["wait_kv", "prefetch_kv"]
        assert plan.kv_step[0].pending == spec.schedule.stages - 2
        assert plan.kv_step[1].distance == spec.schedule.stages - 1
    assert [op.kind for op in plan.loop_body] == ["barrier", "load_q"]
    kinds = [op.kind for op in plan.pass_body]
    expected = ["mma_qk", "mask", "load_state", "online_softmax", "mma_pv", "store_state"]
    if plan.split_k:
        expected = ["barrier"] + expected[:-1] + ["combine", "store_state"]
    assert kinds == expected


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_rendered_source(spec):
    plan = lower(spec)
    source = render(plan)
    assert source == render(lower(spec)), "rendering is deterministic"
    assert f"extern \"C\" __global__ void __launch_bounds__(C::THREADS, 1)\n{plan.kernel_name}(" in source
    assert "float* __restrict__ o_state, float* __restrict__ m_state, float* __restrict__ l_state" in source
    assert ("combine_warp_states<C>" in source) == plan.split_k
    assert ("store_output<C>" in source) != plan.split_k
    assert "{{ " not in source and "{% " not in source, "no unrendered Jinja"


def test_visible_range_is_the_shared_kv_range():
    """FA1's visible kv tiles come from macros.j2's kv_range: all q tiles' range (q0 0, q_len rows)
    spelled in place, one q tile's (rows_valid rows) as visible_tiles' body."""
    plan = lower(fa1(64, "q", Mask.WINDOW, left=100, right=3))
    source = render(plan)
    assert (plan.kv_range.q0, plan.kv_range.rows, plan.kv_range_q_tile.rows) == ("0", "q_len", "rows_valid")
    assert "kv_hi = min(kv_hi, 0 + q_len + diag + C::WINDOW_RIGHT);" in source
    assert "const int kv_end = kv_hi > kv_lo ? (kv_hi + C::BC - 1) / C::BC : kv_begin;" in source
    helper = source.split("void visible_tiles(")[1].split("\n}")[0]
    assert "kv_hi = min(kv_hi, q0 + rows_valid + diag + C::WINDOW_RIGHT);" in helper
    assert "kv_lo = max(kv_lo, q0 + diag - C::WINDOW_LEFT);" in helper
    assert "visible_keys" not in source


def test_bundled_spec_names_its_lines():
    source = render(lower(load_specs(str(BUNDLED))[0]))
    for line in (7, 9, 10, 11, 12):   # mask, order, tile, warps, pipeline of fa1_d64
        assert f"// [fa1_d64.tile:{line}]" in source


def test_runtime_picks_the_fa1_kernel():
    from tiledsl import compile
    from tiledsl.runtime.fa1 import Fa1Kernel
    kernel = compile(fa1(64, "kv"))
    assert isinstance(kernel, Fa1Kernel) and isinstance(compile(fa1(64, "q")), Fa1Kernel)
    from tiledsl.runtime.inputs import Shapes
    assert kernel.grid(Shapes(batch=3, heads=5, kv_heads=5, q_len=1000, kv_len=10)) == (15, 1, 1)


def test_split_k_passes_keep_accumulators_small():
    c = constants(lower(fa1(64, "kv", tiles=(64, 128))))
    assert (c["ROWS_PER_WARP"], c["ROW_PASSES"]) == (32, 2)
    c = constants(lower(fa1(128, "kv", tiles=(64, 64))))
    assert (c["ROWS_PER_WARP"], c["ROW_PASSES"]) == (16, 4)
    c = constants(lower(fa1(64, "kv", tiles=(64, 128)), pass_rows=64))
    assert (c["ROWS_PER_WARP"], c["ROW_PASSES"]) == (64, 1)


@pytest.mark.parametrize("spec,match", [
    (fa1(64, "kv", tiles=(64, 32)), "keys each"),          # 8 keys per warp: no whole m16n8k16 step
    (fa1(64, "q", tiles=(32, 64)), "rows each"),           # 8 rows per warp
    (fa1(64, "q", dtype=DType.FP32), "fp16 or bf16"),
    (fa1(128, "q", tiles=(64, 128), stages=8), "shared memory"),
])
def test_refusals_name_the_reason(spec, match):
    with pytest.raises(SpecError, match=match):
        lower(spec)


# ---- nvcc for sm_90a ----------------------------------------------------------------------------

def _nvcc_or_skip():
    from tiledsl.codegen.nvcc import nvcc_path
    if nvcc_path() is None:
        if os.environ.get("TILEDSL_REQUIRE_NVCC") == "1":
            pytest.fail("nvcc not found and TILEDSL_REQUIRE_NVCC=1")
        pytest.skip("nvcc not on PATH")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_nvcc_compiles_without_spills(spec):
    _nvcc_or_skip()
    from tiledsl.codegen.nvcc import resources
    plan = lower(spec)
    r = resources(render(plan), plan.kernel_name)
    assert re.search(r"Compiling entry function '" + plan.kernel_name, r.report), r.report
    assert r.spill_stores == 0 and r.spill_loads == 0, r.report
    assert r.stack_bytes == 0, r.report
    assert 0 < r.registers <= 255
