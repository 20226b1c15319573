"""Decode (flash-decoding) without a GPU: the lowering's plan invariants, its refusals, the split
count for `split kv = auto`, deterministic rendering, and nvcc compiles of rendered decode kernels
(one kernel; its last split merges) with ptxas reporting zero spills. Skipped without nvcc unless
TILEDSL_REQUIRE_NVCC=1, which turns a missing nvcc into a failure."""
from __future__ import annotations

import os
import re

import pytest

from tiledsl.codegen import nvcc
from tiledsl.errors import SpecError
from tiledsl.families import lower, row_for
from tiledsl.device_limits import H200, SMEM_RESERVED_PER_BLOCK
from tiledsl.runtime.decode import constant
from tiledsl.lower.decode import decode_blocks_per_sm
from tiledsl.frontend.parse import load_specs
from tiledsl.codegen.render import render
from tiledsl.schedule.splits import choose_splits
from tiledsl.spec import AUTO, Axis, DType, KernelSpec, Mask, Problem, Schedule

from .conftest import ROOT

SHARED_LIMIT = 232448


def bundled():
    return load_specs(str(ROOT / "specs" / "decode_d128.tile"))[0]


def spec(d=128, dtype=DType.BF16, mask=Mask.NONE, queries=1, tile_q=16, tile_kv=128, warps=4, stages=2, splits=AUTO):
    return KernelSpec(f"decode_d{d}", Problem(d, d, dtype, mask, 64 if mask is Mask.WINDOW else 0, 0,
                                              queries_per_seq=queries),
                      Schedule(tile_q=tile_q, tile_kv=tile_kv, warps=warps, warp_axis=Axis.KV, stages=stages,
                               split_kv=splits))


def test_decode_is_registered():
    assert row_for(bundled()).lowering == "lower.decode:lower_decode"
    plan = lower(bundled())
    assert plan.family == "decode" and plan.template == "decode.cu.j2"


@pytest.mark.parametrize("tile_kv,warps,stages", [(128, 4, 2), (64, 4, 3), (64, 4, 1), (128, 8, 3), (64, 2, 4)])
def test_plan_invariants(tile_kv, warps, stages):
    plan = lower(spec(tile_kv=tile_kv, warps=warps, stages=stages))
    c = lambda name: constant(plan, name)  # noqa: E731
    assert c("BC") == c("WARPS") * c("KEYS_PER_WARP") and c("KEYS_PER_WARP") % 16 == 0
    assert c("WARP_S_TILES") * 8 == c("KEYS_PER_WARP")
    assert c("ROWS") == 16 * c("M_TILES")
    assert plan.launch.threads == 32 * warps
    # Buffers do not overlap and fit; the combine scratch fits in the same bytes.
    assert c("K_OFFSET") >= c("Q_OFFSET") + c("ROWS") * c("QK_ROW_BYTES")
    assert c("V_OFFSET") >= c("K_OFFSET") + stages * c("K_STAGE_BYTES")
    assert c("SMEM_BYTES") >= c("V_OFFSET") + stages * c("V_STAGE_BYTES")
    assert c("SMEM_BYTES") >= c("COMBINE_BYTES") and c("SMEM_BYTES") <= SHARED_LIMIT
    assert c("COMBINE_ROW_FLOATS") % 4 == 0 and c("COMBINE_ROW_FLOATS") >= c("DV")
    assert c("Q_PENDING_GROUPS") == 2 * max(stages - 1, 1)   # one stage: K and V of the first tile
    assert decode_blocks_per_sm(plan) >= plan.min_blocks_per_sm >= 1


SMEM_PER_SM = H200.shared_per_sm


def test_resident_blocks_follow_the_launch_bounds():
    # kv64 with 2 stages needs 68 KB: shared memory alone would fit 3 blocks, but the launch bounds
    # promise ptxas 2 (so it may use 255 registers), and 3 x 128 threads at 184 do not fit 64K.
    plan = lower(spec(tile_kv=64, stages=2))
    assert SMEM_PER_SM // (plan.launch.smem_bytes + SMEM_RESERVED_PER_BLOCK) == 3 and plan.min_blocks_per_sm == 2
    assert decode_blocks_per_sm(plan) == 2
    assert "shared memory alone would allow 3" in " ".join(plan.notes)
    big = lower(spec(tile_kv=128, stages=3))   # 196 KB: one block by shared memory
    assert decode_blocks_per_sm(big) == 1


def test_runtime_splits_count_the_compiled_kernels_resident_blocks():
    # The runtime asks choose_splits with the slots Kernel.slots found from the compiled kernel's
    # registers (set by hand here: no GPU), not with the lowering's estimate.
    from tiledsl import compile
    from tiledsl.runtime.inputs import Shapes
    kernel = compile(bundled())
    shapes = Shapes(batch=1, heads=32, kv_heads=32, q_len=1, kv_len=32768)
    tile_kv = constant(kernel.plan, "BC")
    for per_sm in (1, 2, 3):
        kernel._slots[0] = H200.sm_count * per_sm
        assert kernel.splits_for(shapes, 0) == choose_splits(1, 32, 32768, tile_kv, H200.sm_count, per_sm)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_loop_body_pipeline_accounting(stages):
    body = lower(spec(tile_kv=64, stages=stages)).loop_body
    kinds = [op.kind for op in body]
    assert kinds.index("mma_qk") < kinds.index("mask") < kinds.index("online_softmax") < kinds.index("mma_pv")
    assert kinds.index("wait_k") < kinds.index("mma_qk") and kinds.index("wait_v") < kinds.index("mma_pv")
    wait_k = next(op for op in body if op.kind == "wait_k")
    wait_v = next(op for op in body if op.kind == "wait_v")
    prefetch = next(op for op in body if op.kind.startswith("prefetch"))
    if stages == 1:
        # One K and one V buffer, each refilled with tile j+1 as soon as the warp has read it.
        assert kinds == ["wait_k", "mma_qk", "barrier", "prefetch_k", "mask", "online_softmax", "wait_v", "mma_pv",
                         "barrier", "prefetch_v"]
        assert (wait_k.pending, wait_v.pending) == (1, 1)
        assert all(op.distance == 1 for op in body if op.kind.startswith("prefetch"))
    else:
        # The warp refills the buffer of tile j-1 with tile j+S-1 first, then waits: two cp.async
        # groups (K, V) per tile, so K_j is complete when at most 2S-1 groups are pending (V_j and
        # the S-1 tiles after it), V_j when 2S-2.
        assert kinds[:3] == ["barrier", "prefetch_kv", "wait_k"] and prefetch.distance == stages - 1
        assert (wait_k.pending, wait_v.pending) == (2 * stages - 1, 2 * stages - 2)
        # Waiting first (the block-barrier order) keeps one tile fewer in flight.
        late = {op.kind: op for op in lower(spec(tile_kv=64, stages=stages), prefetch_first=False).loop_body}
        assert (late["wait_k"].pending, late["wait_v"].pending) == (2 * stages - 3, 2 * stages - 2)


def test_override_renames_the_kernel():
    s = bundled()
    assert lower(s).kernel_name == s.kernel_name
    stages, tile_kv = (2, 128) if s.schedule.tile_kv != 128 else (3, 64)   # differ from the bundled spec
    other = lower(s, stages=stages, tile_kv=tile_kv)   # layout overrides: the layout function takes them
    assert other.kernel_name != s.kernel_name
    assert constant(other, "STAGES") == stages and constant(other, "BC") == tile_kv


@pytest.mark.parametrize("bad,match", [
    (dict(dtype=DType.FP32), "fp16 or bf16"),
    (dict(tile_kv=96, warps=4), "keys per warp"),
    (dict(tile_q=24), "is not 16"),
    (dict(tile_q=32), "is not 16"),
    (dict(tile_kv=256, stages=4), "shared memory"),
])
def test_refusals_name_the_problem(bad, match):
    with pytest.raises(SpecError, match=match):
        lower(spec(**bad))


def test_rendering_is_deterministic_and_names_the_spec():
    s = bundled()
    a, b = render(lower(s)), render(lower(s))
    assert a == b
    assert f"{s.kernel_name}(" in a and "merge_row(" in a and "atomic_add_acq_rel(counter, 1)" in a   # last split merges
    assert re.search(r"// \[decode_d128\.tile:\d+\]", a)
    assert "combine_warp_states<C>" in a


def test_loop_body_is_spelled_by_the_shared_macro():
    """decode's kv loop goes through macros.j2's loop_op: the warp-view traits and the packed-rows
    mask come from plan fields, and decode.cu.j2 dispatches no op kinds of its own."""
    plan = lower(spec(mask=Mask.CAUSAL, queries=4))
    assert (plan.mma_traits, plan.mask_rows) == ("W", "packed")
    body = render(plan).split("for (int tile = tile_begin;")[1]
    for call in ("mma_qk<W>(", "online_softmax<W>(", "mma_pv<W>(", "mask_packed_rows(acc_s, row0, q_len, key0"):
        assert call in body, call
    assert "apply_mask<" not in body and "<C>(acc_s" not in body
    assert "op.kind" not in (ROOT / "templates" / "decode.cu.j2").read_text()


def test_generated_file_is_current():
    s = bundled()
    path = ROOT / "generated" / f"{s.kernel_name}.cu"
    assert path.exists() and path.read_text() == render(lower(s)), "run: make generated (tiledsl compile specs/*.tile -o generated)"


# -- split count for `split kv = auto` ---------------------------------------------------------

@pytest.mark.parametrize("batch,kv_heads,kv_len", [(1, 32, 32768), (8, 32, 8192), (4, 8, 65536), (1, 32, 131072),
                                                   (1, 1, 17), (64, 32, 4096), (1, 8, 100)])
@pytest.mark.parametrize("blocks_per_sm", [1, 2])
def test_auto_splits_are_sane(batch, kv_heads, kv_len, blocks_per_sm):
    tiles = -(-kv_len // 128)
    splits, reason = choose_splits(batch, kv_heads, kv_len, 128, 132, blocks_per_sm)
    assert 1 <= splits <= max(tiles, 1) and reason
    if batch * kv_heads * 2 > 132 * blocks_per_sm:
        assert splits == 1


def test_auto_splits_fill_one_resident_wave():
    # The 2026-11-30 split sweep: one wave of resident blocks beat two or more (fewer partials to
    # write and merge, no ragged tail). Blocks never exceed the resident slots.
    for blocks_per_sm in (1, 2):
        splits, _ = choose_splits(1, 32, 32768, 128, 132, blocks_per_sm)
        slots = 132 * blocks_per_sm
        assert 32 * splits <= slots < 32 * (splits + 1)


# -- nvcc: every decode variant compiles for sm_90a without spills -----------------------------

def _require_nvcc():
    if nvcc.nvcc_path() is None:
        if os.environ.get("TILEDSL_REQUIRE_NVCC") == "1":
            pytest.fail("TILEDSL_REQUIRE_NVCC=1 but nvcc is not on PATH")
        pytest.skip("nvcc not on PATH")


VARIANTS = {
    "bundled": dict(),
    "fp16": dict(dtype=DType.FP16),
    "causal_nq4": dict(mask=Mask.CAUSAL, queries=4),
    "window_nq4": dict(mask=Mask.WINDOW, queries=4),
    "kv64_s3": dict(tile_kv=64, stages=3),
    "kv64_s4": dict(tile_kv=64, stages=4),
    "kv128_s3": dict(stages=3),
    "kv128_w8": dict(warps=8),
    "d64": dict(d=64, tile_kv=64),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nvcc_compiles_without_spills(variant, tmp_path):
    _require_nvcc()
    s = bundled() if variant == "bundled" else spec(**VARIANTS[variant])
    plan = lower(s)
    _, report = nvcc.compile_to(render(plan), plan.kernel_name, "cubin", tmp_path)
    found = nvcc.parse_ptxas(report)
    assert set(found) == {plan.kernel_name}, report   # one kernel: the last split merges
    for name, info in found.items():
        assert info.spill_stores == 0 and info.spill_loads == 0, f"{name} spills:\n{report}"
        assert info.stack_bytes == 0, f"{name} has a stack frame:\n{report}"
        assert 0 < info.registers <= 255
