"""The wgmma backward on the CPU: layout (buffers on swizzle atoms, the dQ split, register and
tile refusals at the backward line), the plan of templates/backward_wgmma.cu.j2 (its q-loop order,
the wgmma wrappers and their transpose bits), attention_backward's choice and refusals, and the
bundled wgmma backward specs (generated/ and, with nvcc, a spill-free main kernel)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tiledsl.codegen import nvcc
from tiledsl.codegen.render import render
from tiledsl.dispatch import backward
from tiledsl.dispatch.backward import BACKWARD_WGMMA_TUNED, backward_spec, wgmma_refusal
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.frontend.parse import load_spec
from tiledsl.hw import SWIZZLE_ATOM
from tiledsl.layout.backward import backward_has_template, backward_layout, backward_wgmma_dq_split
from tiledsl.lower.backward import WGMMA_TEMPLATE, lower_backward
from tiledsl.runtime.backward import compile_backward
from tiledsl.spec import DType, Mask, Mma

from .test_backward_kernel_cpu import BACKWARD_SPECS, kernel

WGMMA_SPECS = [s for s in BACKWARD_SPECS if s.backward.mma is Mma.WGMMA and not s.backward.warp_specialized]


def wgmma(tile_q=64, head_dim=128, extra=""):
    return load_spec(kernel(f"tile q = {tile_q}, kv = 128; warps 8; mma wgmma{extra}", head_dim))


def test_bundled_wgmma_specs_exist_for_d64_and_d128():
    assert sorted(s.problem.head_dim_qk for s in WGMMA_SPECS) == [64, 128]


@pytest.mark.parametrize("tile_q,head_dim,split", [(64, 128, "n"), (64, 64, "k"), (128, 64, "m")])
def test_layout_buffers_and_dq_split(tile_q, head_dim, split):
    spec = wgmma(tile_q, head_dim)
    assert not backward_has_template(spec)
    lay = backward_layout(spec)
    assert lay.dq_split == backward_wgmma_dq_split(tile_q, head_dim) == split
    assert lay.main.threads == 256
    for b in lay.main.buffers:
        assert b.offset % SWIZZLE_ATOM == 0 and (b.stage_bytes or b.bytes) % 128 == 0, b
    names = [b.name for b in lay.main.buffers]
    assert names == ["K", "V", "Q", "dO", "dS^T", "LSE", "D"] + (["dQ_i staging"] if split != "k" else [])
    assert lay.main.smem_bytes <= lay.main.smem_limit


def test_refusals_name_the_backward_line():
    with pytest.raises(SpecError, match="registers"):   # S^T, dP^T 64 each + dK, dV 64 each at d128
        wgmma(128, 128)
    with pytest.raises(SpecError, match="tile q = 32"):
        wgmma(32, 128)
    spec = wgmma(64, 128, "; dq accumulate separate")
    assert "atomics" in backward_has_template(spec)
    with pytest.raises(SpecError, match="atomics"):
        lower_backward(spec)


def test_plan_order_and_wrappers():
    plan = lower_backward(wgmma(64, 128))
    assert plan.template == WGMMA_TEMPLATE and plan.mma == "wgmma"
    assert [op.kind for op in plan.loop_body] == ["mma_qk", "mma_dp", "mask", "recompute_p", "softmax_grad", "mma_dv",
                                                  "mma_dk", "stage_ds", "mma_dq", "accumulate_dq"]
    ops = {w.name: w for w in plan.wgmma_ops}
    s, dv, dq = ops[plan.wgmma["s"]], ops[plan.wgmma["dv"]], ops[plan.wgmma["dq"]]
    assert (s.asm.n, s.a_in_registers, s.trans_a, s.trans_b) == (64, False, 0, 0)      # S^T = K Q^T: both K-major
    assert (dv.asm.n, dv.a_in_registers, dv.trans_b) == (128, True, 1)                # dV += P^T dO: dO MN-major
    assert (dq.asm.n, dq.trans_a, dq.trans_b) == (64, 1, 1)                           # dQ = dS K: dS^T, K MN-major
    consts = {c.name: c.value for c in plan.constants}
    assert consts["DQ_BLOCK_BARRIER"] and consts["DQ_COLS"] == 64 and consts["DQ_K16"] == 8


def test_source_uses_the_transpose_bits_and_no_mma_sync():
    source = render(lower_backward(wgmma(64, 64)))
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in source and "p, 1, 1, 1, 1;" in source
    main = source.split("// ---- main")[1]
    assert "mma_16816" not in main and "ldmatrix" not in main


def test_spec_table_and_switch():
    for d in (64, 128):
        spec = backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL, mma=Mma.WGMMA)
        b = spec.backward
        assert b.mma is Mma.WGMMA and replace(b, dq=BACKWARD_WGMMA_TUNED[d].dq) == BACKWARD_WGMMA_TUNED[d]
        assert compile_backward(spec).source
    assert backward.BACKWARD_WGMMA in (False, True)
    assert "sm_90a" in wgmma_refusal("sm_80", 64, None, False)
    assert "head dims" in wgmma_refusal("sm_90a", 96, None, False)
    assert "deterministic" in wgmma_refusal("sm_90a", 128, None, True)
    with pytest.raises(RuntimeInputError, match="head dims"):
        backward_spec("sm_90a", DType.BF16, 256, Mask.NONE, mma=Mma.WGMMA)


@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("spec", WGMMA_SPECS, ids=lambda s: s.kernel_name)
def test_bundled_wgmma_main_kernel_is_spill_free(spec):
    plan = lower_backward(spec)
    res = nvcc.resources(render(plan), plan.kernel_names["main"])
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res.report


def test_dq_staging_and_dv_schedule_options():
    from tiledsl.layout.backward import backward_wgmma_dv_schedule
    consts = lambda plan: {c.name: c.value for c in plan.constants}   # noqa: E731
    staged = consts(lower_backward(wgmma(64, 128)))
    assert staged["DQ_STAGED"] and staged["DQ_STAGE_ROW_BYTES"] == 128 * 4 + 32 and staged["DP_WAIT_PENDING"] == 0
    assert not consts(lower_backward(wgmma(64, 128), dq_staged=False))["DQ_STAGED"]
    assert not consts(lower_backward(wgmma(64, 64)))["DQ_STAGED"]   # split k: no staging buffer
    with pytest.raises(ValueError, match="staging"):
        lower_backward(wgmma(64, 64), dq_staged=True)
    assert backward_wgmma_dv_schedule(128, 64) == backward_wgmma_dv_schedule(64, 128) == ("late", False)
    early = lower_backward(wgmma(64, 128), dv_order="early")
    assert [op.kind for op in early.loop_body][4:6] == ["mma_dv", "softmax_grad"] and consts(early)["DP_WAIT_PENDING"] == 1
    assert consts(lower_backward(wgmma(128, 64), dv_order="early", dv_waited=True))["DP_WAIT_PENDING"] == 0


@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL, Mask.WINDOW])
def test_graph_order_is_the_kernels_and_the_reference_runs_it_exactly(mask):
    """The backward graph of a wgmma spec emits the kernel's q-loop order (dP^T's MMA before the mask,
    dV's after dS^T), and the float64 reference executor, which runs that graph, stays exact."""
    import numpy as np

    from tiledsl.spec import BackwardSchedule, KernelSpec, LoopOrder, Problem, Schedule

    from .test_backward_reference import analytic_grads, assert_close
    plan = lower_backward(wgmma(64, 128))
    assert [op.kind for op in plan.loop_body][:6] == ["mma_qk", "mma_dp", "mask", "recompute_p", "softmax_grad", "mma_dv"]
    spec = KernelSpec("bwd", Problem(8, 8, mask=mask, window_left=3, window_right=1) if mask is Mask.WINDOW
                      else Problem(8, 8, mask=mask), Schedule(),
                      backward=BackwardSchedule(LoopOrder.KV_OUTER, 64, 128, 8, 2, mma=Mma.WGMMA))
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.normal(size=s) for s in ((2, 4, 150, 8), (2, 2, 190, 8), (2, 2, 190, 8), (2, 4, 150, 8)))
    from tiledsl.reference.backward import reference_backward
    p = spec.problem
    assert_close(reference_backward(spec, q, k, v, do),
                 analytic_grads(q, k, v, do, p.mask, p.window_left, p.window_right, p.scale))
