"""Score modifications in the warp-specialized backward on the CPU: the plan's consumer steps (softcap's score_mod
and its 1 - tanh^2 on dS, ALiBi's score_mod alone, nothing for sinks), the sink gradient kernel and its graph op,
the refusals (modifications without a template, softcap with ALiBi, the other backwards, head dims), the launches
of attention_backward and of an autograd step with sinks on tests/host_stubs.py's fake device, the autograd ops'
argument encoding, and with nvcc: no spills in the new kernels."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.ws_backward_specs import ws_spec
from tiledsl.codegen import nvcc
from tiledsl.codegen.render import render
from tiledsl.dispatch.autograd import decode_mods, encode_mods, mod_keywords
from tiledsl.dispatch.backward import chosen_backward_spec, modified_backward_refusal
from tiledsl.dispatch.modified import modifications
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.layout.backward import backward_has_template
from tiledsl.lower.backward import lower_backward
from tiledsl.mods.model import NO_MODS, AlibiSlopes
from tiledsl.reference.backward import reference_backward
from tiledsl.reference.forward import reference_attention
from tiledsl.schedule.backward import build_backward_graph
from tiledsl.spec import DType, Mask

MODS = {"softcap": ["softcap  = 30"], "alibi": ["alibi    = slopes"], "sinks": ["sinks    = per_head"],
        "softcap+sinks": ["softcap  = 30", "sinks    = per_head"],
        "alibi+sinks": ["alibi = geometric", "sinks = per_head"]}


def spec(mods: list[str], d: int = 128, mask: str = "causal", dq: str = "tma_reduce"):
    return ws_spec("bwd_mods", mods, d, mask, dq)


def steps(plan) -> list[str]:
    return [op.kind for op in plan.loop_body]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_recomputes_the_capped_scores_and_takes_ds_through_them(d):
    plan = lower_backward(spec(MODS["softcap"], d))
    body = steps(plan)
    assert body.index("wait_s") + 1 == body.index("score_mod") == body.index("mask") - 1
    assert body.index("softmax_grad") + 1 == body.index("score_mod_grad")
    assert plan.softcap and not plan.alibi and not plan.sinks and "sink_grad" not in plan.kernel_names
    source = render(plan)
    assert "softcap_scores<ScoreC>(acc_s);" in source and "softcap_gradient<SliceC>(acc_s, acc_dp" in source
    # the forward's quotient: the same coefficients, so P matches the forward's LSE
    assert re.search(r"SOFTCAP_Q0 = [0-9.]+f", source) and "softcap_quotient(float w)" in source
    # dS^T is packed once, after the chain rule
    assert source.count("pack_fragments(ds_frag, acc_dp);") == 1
    assert source.index("softcap_gradient<SliceC>(acc_s, acc_dp") < source.index("pack_fragments(ds_frag, acc_dp);")


def test_alibi_adds_its_bias_and_needs_no_chain_rule():
    plan = lower_backward(spec(MODS["alibi"]))
    body = steps(plan)
    assert "score_mod" in body and "score_mod_grad" not in body
    names = [p.name for line in plan.parameters for p in line]
    assert names[-2:] == ["alibi_slopes", "alibi_batch_stride"] and "sinks" not in names
    source = render(plan)
    assert "alibi_scores<ScoreC>(acc_s, alibi_slope, k0 + warp_row - (q0 + col0) - diag, lane);" in source
    # the slope of the step's query head, read before the slot's wait
    assert source.index("const float alibi_slope") < source.index("mbarrier_wait(bar_at(bars, C::Q_FULL_BAR + slot)")


def test_sinks_change_no_consumer_step_and_get_a_kernel_of_their_own():
    plain, sinks = lower_backward(spec([])), lower_backward(spec(MODS["sinks"]))
    assert steps(plain) == steps(sinks)
    assert sinks.kernel_names["sink_grad"].endswith("_sink_grad") and "sink_grad" not in plain.kernel_names
    source = render(sinks)
    assert f"{sinks.kernel_names['sink_grad']}(const float* __restrict__ lse_rows" in source
    kernel = source[source.index("// ---- sink gradient"):source.index("// ---- main")]
    assert "atomicAdd" not in kernel and "red." not in kernel
    g = build_backward_graph(spec(MODS["sinks"]))
    assert g.op("sink_loop_q").kernel == "sink_grad" and g.dag.has_edge("sink_load_lse_d", "sink_grad")
    assert "fixed order" in g.op("sink_grad").text


def test_the_reference_of_the_sink_kernels_graph_is_the_closed_form():
    rng = np.random.default_rng()
    s = spec(MODS["softcap+sinks"], 64, "none")
    q = rng.standard_normal((2, 4, 37, 64))
    k, v = (rng.standard_normal((2, 2, 45, 64)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    aux = {"sinks": rng.standard_normal(4)}
    o, lse = reference_attention(s, q, k, v, aux=aux)
    *_, dsink = reference_backward(s, q, k, v, do, o, lse, aux=aux)
    want = -(np.exp(aux["sinks"][None, :, None] - lse) * (do * o).sum(-1)).sum(axis=(0, 2))
    assert np.allclose(dsink, want, rtol=1e-12, atol=1e-12)


def test_the_graph_gives_the_modification_the_consumers_and_explain_names_it():
    from tiledsl.schedule.ops import Role
    g = build_backward_graph(spec(MODS["softcap"]))
    assert g.op("score_mod").role is Role.CONSUMER and g.op("score_mod_grad").role is Role.CONSUMER
    assert "30 * tanh(S / 30)" in g.op("score_mod").text and "tanh" in g.op("score_mod_grad").text
    assert g.dag.has_edge("wait_s", "score_mod") and g.dag.has_edge("score_mod_grad", "mma_dv")


@pytest.mark.parametrize("mods, why", [
    (["softcap = 30", "score_mod = score * 2"], "softcap or a score_mod, not both"),
    (["dropout = 0.1", "score_mod = score * 2"], "dropout or an expression (score_mod, mask_mod), not both"),
])
def test_modifications_without_a_template_are_refused_at_the_backward(mods, why):
    s = spec([m for m in mods if not m.startswith("mask")], mask="causal") if not mods[0].startswith("mask") else None
    if s is None:
        s = ws_spec("bwd_mods", [], 128, mods[0].split("= ", 1)[1])
    assert why in backward_has_template(s)
    with pytest.raises(SpecError, match=re.escape(why)):
        lower_backward(s)


def test_the_other_backwards_and_head_dims_refuse_modifications_by_name():
    mods, _ = modifications("attention_backward", softcap=30.0)
    for kw in ({"mma": "wgmma"}, {"mma": "mma.sync"}, {"warp_specialized": False}):
        with pytest.raises(RuntimeInputError, match=r"modifications \(softcap\) have a backward only"):
            chosen_backward_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, 128, mods=mods, **kw)
    with pytest.raises(RuntimeInputError, match="head dims"):
        chosen_backward_spec("sm_90a", DType.BF16, 96, Mask.NONE, 96, mods=mods)
    assert "head dims 96/96" in modified_backward_refusal("sm_90a", 96, 96, mods)
    assert "sm_80" in modified_backward_refusal("sm_80", 128, 128, mods)
    assert modified_backward_refusal("sm_90a", 128, 128, mods) == ""
    both, _ = modifications("attention_backward", softcap=30.0, alibi_slopes="geometric")
    assert modified_backward_refusal("sm_90a", 128, 128, both) == ""
    spec_ = chosen_backward_spec("sm_90a", DType.BF16, 64, Mask.CAUSAL, 64, deterministic=True, mods=mods)
    assert spec_.backward.dq.value == "ordered" and spec_.problem.mods.softcap == 30.0
    assert chosen_backward_spec("sm_90a", DType.BF16, 64, Mask.CAUSAL, 64).problem.mods == NO_MODS


def test_the_autograd_ops_arguments_round_trip():
    slopes, sinks = np.ones(4, np.float32), np.zeros(4, np.float32)
    ids, bounds = np.zeros((2, 8), np.int32), np.array([[0, 8], [0, 4]], np.int32)
    for keywords in ({"softcap": 30.0}, {"alibi_slopes": "geometric"}, {"alibi_slopes": slopes, "sinks": sinks},
                     {"softcap": 12.5, "sinks": sinks}, {"document_ids": ids},
                     {"document_bounds": bounds, "sinks": sinks}):
        mods, aux = modifications("attention", **keywords)
        encoded = encode_mods(mods, aux)
        again, aux_again = decode_mods(*encoded)
        assert again == mods and aux_again.keys() == aux.keys()
        assert mod_keywords(*encoded) == {"softcap": None, "alibi_slopes": None, "sinks": None, "document_ids": None,
                                          "document_bounds": None} | keywords
    assert encode_mods(modifications("attention", alibi_slopes="geometric")[0], {})[1] == AlibiSlopes.GEOMETRIC.value


# ---- the launches, on the fake device -----------------------------------------------------------------------

@pytest.fixture
def device(tmp_path):
    from tests.host_stubs import stub_device
    with stub_device(tmp_path, {}) as dev:
        yield dev


def test_attention_backward_launches_the_sink_gradient_and_passes_the_slopes(device):
    import tiledsl
    q, k, v, o, do = (device.tensor((2, 4, 300, 64)) for _ in range(5))
    lse, sinks, slopes = device.tensor((2, 4, 300), "float32"), device.tensor((4,), "float32"), \
        device.tensor((2, 4), "float32")
    dq, dk, dv, dsink = tiledsl.attention_backward(q, k, v, o, lse, do, causal=True, softcap=30.0, sinks=sinks)
    assert tuple(dsink.shape) == (4,)
    (pre, *_, pre_values), (sink, grid, threads, _, _, sink_values), (main, *_), (convert, *_) = (
        device.last(b) for b in (4, 3, 2, 1))
    assert pre.endswith("_preprocess") and sink.endswith("_sink_grad") and main.endswith("_main") \
        and convert.endswith("_convert") and "softcap30_sinks" in main
    assert grid == (4, 1, 1) and threads == 256
    # its LSE and D rows are the preprocess's, then sinks and dsink; q_rows (whole 128-row tiles), batch, heads
    assert sink_values[:2] == pre_values[3:5] and sink_values[2:4] == [sinks.data_ptr(), dsink.data_ptr()]
    assert sink_values[4:] == [384, 2, 4]
    assert len(tiledsl.attention_backward(q, k, v, o, lse, do, alibi_slopes=slopes)) == 3
    *_, main_values = device.last(2)
    assert main_values[-2:] == [slopes.data_ptr(), 4]   # (batch, heads) slopes: batch stride = heads
    with pytest.raises(RuntimeInputError, match="sinks has shape"):
        tiledsl.attention_backward(q, k, v, o, lse, do, sinks=device.tensor((3,), "float32"))
    with pytest.raises(RuntimeInputError, match="sinks must be float32"):
        tiledsl.attention_backward(q, k, v, o, lse, do, sinks=device.tensor((4,)))


def test_an_autograd_step_with_sinks_returns_their_gradient(device):
    import tiledsl
    q, k, v = (device.tensor((2, 4, 300, 128), requires_grad=True) for _ in range(3))
    sinks = device.tensor((4,), "float32", requires_grad=True)
    o, lse = tiledsl.attention(q, k, v, causal=True, softcap=20.0, sinks=sinks, return_lse=True)
    forward = device.last()[0]
    assert "softcap20_sinks" in forward and forward.startswith("hopper")
    do = device.tensor(o.shape)
    dq, dk, dv, no_lens, no_slopes, dsink, no_ids, no_bounds, no_block_mask, no_aux, no_scalars = \
        device.backward(o, do)
    assert (no_lens, no_slopes, no_ids, no_bounds, no_block_mask, no_aux, no_scalars) == (None,) * 7
    assert tuple(dsink.shape) == (4,)
    (sink, *_, sink_values), (main, *_, main_values) = device.last(3), device.last(2)
    assert sink.endswith("_sink_grad") and sink_values[2:4] == [sinks.data_ptr(), dsink.data_ptr()]
    assert "softcap20_sinks" in main and [dk.data_ptr(), dv.data_ptr()] == main_values[9:11]


def test_an_autograd_step_refuses_what_has_no_backward_before_it_runs(device):
    import tiledsl
    q, k, v = (device.tensor((1, 2, 64, 64), requires_grad=True) for _ in range(3))
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match=r"no gradient through the modifications \(softcap, score_mod\)"):
        tiledsl.attention(q, k, v, softcap=30.0, score_mod="score * 2")
    slopes = device.tensor((2,), "float32", requires_grad=True)
    with pytest.raises(RuntimeInputError, match="alibi_slopes get no gradient"):
        tiledsl.attention(q, k, v, alibi_slopes=slopes)
    q96 = device.tensor((1, 2, 64, 96), requires_grad=True)
    with pytest.raises(RuntimeInputError, match="head dims 96/96"):
        tiledsl.attention(q96, q96, q96, softcap=30.0)
    assert len(device.launches) == launches


# ---- nvcc ------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("mods", ["softcap+sinks", "alibi"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_modified_kernels_compile_without_spills(mods, d, tmp_path):
    plan = lower_backward(spec(MODS[mods], d))
    _, report = nvcc.compile_to(render(plan), plan.kernel_name, "cubin", Path(tmp_path))
    found = nvcc.parse_ptxas(report)
    assert set(plan.kernel_names.values()) <= set(found)
    for name in plan.kernel_names.values():
        assert (found[name].spill_stores, found[name].spill_loads, found[name].stack_bytes) == (0, 0, 0), name


@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc is not on PATH")
def test_the_bundled_softcap_backward_spec_builds_both_passes_without_spills(tmp_path):
    from tiledsl.families import lower
    from tiledsl.frontend.parse import load_spec
    s = load_spec(str(Path(__file__).resolve().parent.parent / "specs" / "mods" / "softcap_backward_d128.tile"))
    assert s.problem.mods.softcap == 50.0 and s.backward.warp_specialized
    forward, backward = lower(s), lower_backward(s)
    assert forward.softcap and backward.softcap and "score_mod_grad" in steps(backward)
    _, report = nvcc.compile_to(render(backward), backward.kernel_name, "cubin", Path(tmp_path))
    found = nvcc.parse_ptxas(report)
    assert all((found[n].spill_stores, found[n].spill_loads) == (0, 0) for n in backward.kernel_names.values())
