"""softcap, ALiBi and sinks in the decode family without a GPU: the plan and source a modified decode
kernel gets (contiguous, paged, FP8 KV cache), the aux tensors its call takes, the dispatch of a
modified 1..16-query call to decode kernels, and the refusals of what no decode template spells
(documents, expressions, paged chunked prefill with modifications). nvcc compiles of the new kernels
(no spills) run where nvcc is on PATH."""
from __future__ import annotations

import pytest

from tiledsl import families
from tiledsl.codegen.render import render
from tiledsl.dispatch.tuned import tuned_spec
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.mods.model import AlibiSlopes, Documents, Modifications
from tiledsl.runtime.decode import constant
from tiledsl.runtime.tensors import TensorView
from tiledsl.serving.paged import paged_kernel, paged_spec
from tiledsl.spec import AUTO, Axis, DType, KernelSpec, KvScale, Mask, Problem, Schedule

from .test_decode_cpu import _require_nvcc

SOFTCAP, ALIBI, SINKS = (Modifications(softcap=30.0), Modifications(alibi=AlibiSlopes.GIVEN),
                         Modifications(sinks=True))
ALL = Modifications(softcap=30.0, alibi=AlibiSlopes.GIVEN, sinks=True)


def decode_spec(mods, d=128, mask=Mask.CAUSAL, queries=4, stages=1):
    return KernelSpec(f"decode_d{d}", Problem(d, d, DType.BF16, mask, 64 if mask is Mask.WINDOW else 0, 0,
                                              queries_per_seq=queries, mods=mods),
                      Schedule(tile_q=16, tile_kv=128, warps=4, warp_axis=Axis.KV, stages=stages, split_kv=AUTO))


def names(plan):
    return [p.name for line in plan.parameters for p in line]


@pytest.mark.parametrize("mods, takes", [(SOFTCAP, ()), (ALIBI, ("alibi_slopes", "alibi_batch_stride")),
                                         (SINKS, ("sinks",)), (ALL, ("alibi_slopes", "alibi_batch_stride", "sinks"))])
def test_a_modified_decode_plan_spells_its_modifications(mods, takes):
    plan = families.lower(decode_spec(mods))
    plain = families.lower(decode_spec(Modifications()))
    assert names(plan) == names(plain) + list(takes)   # the aux tensors follow every unmodified parameter
    assert (plan.softcap, plan.alibi, plan.sinks) == (mods.softcap is not None, mods.alibi is not None, mods.sinks)
    ops = [op.kind for op in plan.loop_body]
    assert ("score_mod" in ops) == mods.modifies_scores
    if mods.modifies_scores:
        assert ops.index("mma_qk") < ops.index("score_mod") < ops.index("mask")
    source = render(plan)
    assert ("softcap_scores<W>(acc_s);" in source) == (mods.softcap is not None)
    assert ("alibi_scores_rows<W>(acc_s, alibi_slope, alibi_position, key0, lane);" in source) == (
        mods.alibi is not None)
    assert ("if (split == 0 && warp == 0) sink_packed_rows(" in source) == mods.sinks
    for word in ("softcap_scores", "alibi_scores_rows", "sink_packed_rows", "score_mods.cuh"):
        assert word not in render(plain)


def test_softcap_reads_the_forward_s_polynomial_over_one_warp_s_key_slice():
    plan = families.lower(decode_spec(SOFTCAP))
    from tiledsl.lower.score_mods import mod_constants
    want = {c.name: c.value for c in mod_constants(decode_spec(SOFTCAP).problem, constant(plan, "WARP_S_TILES"))}
    assert {name: constant(plan, name) for name in want} == want
    assert constant(plan, "SOFTCAP_MUFU_TILES") == constant(plan, "WARP_S_TILES")   # ex2 (the default) takes all


def test_documents_and_expressions_are_refused_in_decode():
    for mods, what in ((Modifications(document=Documents.IDS), "document"),
                       (Modifications(softcap=30.0, prefix=64), "prefix")):
        with pytest.raises(SpecError, match=f"score and mask modifications \\({what}\\) have no CUDA template yet "
                                            "for the decode family"):
            families.lower(decode_spec(mods))


@pytest.mark.parametrize("q_len", [1, 4, 16])
@pytest.mark.parametrize("mods", [SOFTCAP, ALIBI, SINKS, ALL], ids=["softcap", "alibi", "sinks", "all"])
def test_a_modified_call_of_a_few_queries_runs_a_decode_kernel(q_len, mods):
    spec, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, None, None, None, q_len, mods)
    assert spec.family.value == "decode" and spec.problem.mods == mods and spec.problem.queries_per_seq == q_len
    longer, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, None, None, None, 17, mods)
    assert longer.family.value == "hopper"


def test_a_call_with_documents_keeps_the_prefill_kernel_that_spells_them():
    spec, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, None, None, None, 4,
                         Modifications(document=Documents.IDS))
    assert spec.family.value == "hopper"


def _views(q_len, kv_dtype=DType.BF16, d=128):
    q = TensorView("q", 0, (2, q_len, 8, d), (0, 0, 0, 1), DType.BF16, 0, None)
    kv = TensorView("k_cache", 0, (64, 16, 2, d), (0, 0, 0, 1), kv_dtype, 0, None)
    return q, kv


@pytest.mark.parametrize("kv_dtype", [DType.BF16, DType.E4M3])
def test_the_paged_decode_kernel_takes_the_aux_tensors_after_the_scales(kv_dtype):
    spec = paged_spec(DType.BF16, 128, 128, Mask.CAUSAL, 16, 4, kv_dtype=None if kv_dtype is DType.BF16 else kv_dtype,
                      kv_scale=None if kv_dtype is DType.BF16 else KvScale.PER_HEAD, mods=ALL)
    kernel = families.compile(spec)
    assert type(kernel).__name__ == "PagedDecodeKernel" and kernel.spec.problem.mods == ALL
    assert kernel.CALL[-4:] == ("k_scale", "v_scale", "alibi_slopes", "sinks")
    assert kernel.aux_names == ("alibi_slopes", "sinks")
    with pytest.raises(RuntimeInputError, match="aux tensors missing sinks"):
        kernel.aux_tensors({"alibi_slopes": object()})
    geometric = families.compile(paged_spec(DType.BF16, 64, 64, Mask.NONE, 1, 1, mods=Modifications(
        alibi=AlibiSlopes.GEOMETRIC)))
    assert geometric.aux_names == () and "alibi_slopes" in names(geometric.plan)   # the host's slopes


def test_paged_chunked_prefill_with_modifications_is_refused():
    q, kv = _views(17)
    with pytest.raises(RuntimeInputError, match="chunked prefill \\(q_len > 16\\) with modifications has no CUDA "
                                                "template yet \\(softcap; q has 17 queries"):
        paged_kernel("paged_attention", q, kv, kv, Mask.CAUSAL, None, None, mods=SOFTCAP)


def test_an_unmodified_decode_kernel_takes_no_aux():
    kernel = families.compile(decode_spec(Modifications()))
    assert kernel.aux_names == () and kernel.aux_tensors(None) == ()
    with pytest.raises(RuntimeInputError, match="not read by this kernel: sinks"):
        kernel.aux_tensors({"sinks": object()})


MOD_VARIANTS = {
    "all_d128_nq4": dict(mods=ALL),
    "softcap_d64_nq1_window": dict(mods=SOFTCAP, d=64, queries=1, mask=Mask.WINDOW),
    "sinks_alibi_d128_nq16_s2": dict(mods=Modifications(alibi=AlibiSlopes.GEOMETRIC, sinks=True), queries=16,
                                     stages=2),
}


@pytest.mark.parametrize("variant", list(MOD_VARIANTS))
def test_modified_decode_kernels_compile_without_spills(variant, tmp_path):
    from tiledsl.codegen import nvcc
    _require_nvcc()
    plan = families.lower(decode_spec(**MOD_VARIANTS[variant]))
    _, report = nvcc.compile_to(render(plan), plan.kernel_name, "cubin", tmp_path)
    found = nvcc.parse_ptxas(report)
    assert set(found) == {plan.kernel_name}, report
    info = found[plan.kernel_name]
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, report
