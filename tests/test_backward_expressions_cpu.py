"""score_mod / mask_mod and softcap with ALiBi in the warp-specialized backward, on the CPU: the plan's steps and
sources (the forward's expression functions pasted once; a pure bias's derivative folded away; a derivative that
reads the score evaluated at score_mod's step; mask_mod's marked steps in every role and its ordered dQ count),
kernel names keyed on the tree, explain's line, the refusals (softcap with a score_mod, a mask_mod beside
documents / prefix / blocks, a score_mod without a gradient), the launches of attention_backward and of an
autograd step on tests/host_stubs.py's fake device (aux tensors passed by name, none of them given a gradient),
and with nvcc: the new kernels compile for sm_90a without spills."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.ws_backward_specs import spec_text, ws_spec
from tiledsl.codegen import nvcc
from tiledsl.codegen.render import render
from tiledsl.dispatch.backward import chosen_backward_spec, modified_backward_refusal
from tiledsl.dispatch.modified import modifications
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.frontend.parse import parse_text
from tiledsl.lower.backward import lower_backward
from tiledsl.spec import DType, Mask

ROOT = Path(__file__).resolve().parent.parent
BIAS = "score_mod = score + bias[h, q_idx - kv_idx + 4095]"
TANH = "score_mod = 30 * tanh(score / 30)"
SCALED = "score_mod = score * gain[h]"
WINDOW = "mask_mod  = kv_idx <= q_idx & q_idx - kv_idx < 1024 | kv_idx < 64"


def spec(mods: list[str], d: int = 128, mask: str = "causal", dq: str = "tma_reduce"):
    return ws_spec("bwd_expr", mods, d, mask, dq)


def steps(plan) -> list[str]:
    return [op.kind for op in plan.loop_body]


def test_a_pure_bias_recomputes_the_scores_and_folds_its_derivative_away():
    plan = lower_backward(spec([BIAS]))
    body = steps(plan)
    assert body.index("wait_s") + 1 == body.index("score_mod") and "score_mod_grad" not in body
    assert plan.expressions and plan.score_expression and not plan.score_grad_expression and not plan.ds_factor
    source = render(plan)
    # the forward's spelling, pasted once by macros.j2's expression_functions
    assert source.count("__device__ __forceinline__ float score_mod_of(") == 1
    assert "return (score + __ldg(aux.t_bias + ((h) * aux.t_bias_s0 + (((q_idx - kv_idx) + 4095)) * aux.t_bias_s1)));" \
        in source
    assert "expression_scores_t<SliceC>(acc_s, expr_item, k0 + warp_row, q0 + col0, lane);" in source
    # no dS multiply at all: dS^T is packed right after the softmax gradient
    for absent in ("score_grad_of", "apply_factors(", "expression_gradient_t<", "expression_factors_t<"):
        assert absent not in source.split("// ---- preprocess")[1], absent
    assert source.count("pack_fragments(ds_frag, acc_dp);") == 1
    assert "aux_bias_stride1" in source and "mark_mask_mod_steps<C>(" not in source


def test_a_derivative_that_reads_the_score_is_taken_at_score_mods_step():
    plan = lower_backward(spec([TANH], mask="none"))
    body = steps(plan)
    assert body.index("softmax_grad") + 1 == body.index("score_mod_grad")
    assert plan.score_grad_reads_score and plan.ds_factor
    source = render(plan)
    assert f"return {plan.score_grad_expression};" in source and "tanhf(" in plan.score_grad_expression
    factors = source.index("expression_factors_t<SliceC>(ds_factors, acc_s")
    scores = source.index("expression_scores_t<SliceC>(acc_s, expr_item")
    assert factors < scores   # from the scores before score_mod
    apply = source.index("apply_factors<SliceC>(acc_dp, ds_factors);")
    assert apply < source.index("pack_fragments(ds_frag, acc_dp);", apply)
    assert "u32 ds_factors[C::S_COLS / 8][2];" in source


def test_a_derivative_of_the_indices_alone_is_evaluated_at_ds():
    plan = lower_backward(spec([SCALED], mask="none"))
    assert plan.score_grad_expression and not plan.score_grad_reads_score
    source = render(plan)
    assert "expression_gradient_t<SliceC>(acc_dp, expr_item, k0 + warp_row, q0 + col0, lane);" in source
    assert "ds_factors" not in source


@pytest.mark.parametrize("dq", ["tma_reduce", "ordered"])
def test_mask_mod_marks_its_steps_for_every_role(dq):
    plan = lower_backward(spec([WINDOW], mask="none", dq=dq))
    assert plan.marked_steps and not plan.blocks and plan.mask_expression and "score_mod" not in steps(plan)
    source = render(plan)
    main = source.split("// ---- preprocess")[1]
    assert main.count("mark_mask_mod_steps<C>(batch, kv_head * kv_group, kv_group, tile_begin, tiles, k0") == 1
    assert "mark_visible_steps" not in main   # block_mask's marking is not pasted into the kernel's body
    assert main.count("step = next_marked_step(shared.step_bits(), step + 1);") == 2   # producer and writer
    assert "const int step = published_step(shared.step_bits(), slot);" in main        # the consumers
    assert "steps = marked_step_count(shared.step_bits());" in main
    assert "mask_mod_scores_t<SliceC>(acc_s, expr_item, k0 + warp_row, q0 + col0, lane);" in main
    assert "mask_mod_tiles_before<C>(batch, head, q0, q_len, seq_kv" in main   # under `if constexpr (C::ORDERED)`
    assert plan.ordered == (dq == "ordered")


def test_softcap_with_alibi_takes_alibis_bias_out_of_the_tanh_read_back():
    plan = lower_backward(spec(["softcap  = 30", "alibi    = slopes"]))
    body = steps(plan)
    assert body.index("softmax_grad") + 1 == body.index("score_mod_grad") and plan.softcap and plan.alibi
    source = render(plan)
    assert source.index("softcap_scores<ScoreC>(acc_s);") < source.index("alibi_scores<ScoreC>(acc_s, alibi_slope")
    assert "softcap_gradient<SliceC>(acc_s, acc_dp, lse_tile + col0 * 4, lane,\n" in source
    assert "slopes[batch * alibi_batch_stride + head] * (C::ALIBI_UNITS * C::SCALE_LOG2)," in source
    assert "u32 lse_tile, int lane, float slope_log2, int position0) {" in source
    alone = render(lower_backward(spec(["softcap  = 30"])))
    assert "slope_log2" not in alone   # softcap alone: its kernel as before


def test_kernel_names_and_sources_key_on_the_tree():
    a = lower_backward(spec([BIAS]))
    b = lower_backward(spec(["score_mod = score + bias[h, q_idx - kv_idx + 4094]"]))
    assert a.kernel_name != b.kernel_name and "_smod" in a.kernel_name and render(a) != render(b)
    c = lower_backward(spec([WINDOW], mask="none"))
    assert "_mmod" in c.kernel_name
    mods, _ = modifications("attention", score_mod="score + bias[h, q_idx - kv_idx + 4095]")
    chosen = chosen_backward_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, 128, mods=mods)
    assert chosen.backward.warp_specialized and chosen.problem.mods.score_mod == mods.score_mod


def test_explain_shows_the_expressions_in_the_backward(capsys):
    from tiledsl.cli.main import main
    main(["explain", str(ROOT / "specs" / "mods" / "expressions_backward_d128.tile")])
    out = capsys.readouterr().out
    assert "expressions in the backward: score_mod = score + bias[h, q_idx - kv_idx + 4095]: d/dscore = 1, folded" \
        in out
    assert "mask_mod = kv_idx <= q_idx & q_idx - kv_idx < 1024 | kv_idx < 64: warp 0 marks" in out
    assert re.search(r"score_mod = 30 \* tanh\(score / 30\): dS \*= .*tanh.*held as bf16 pairs", out)
    assert "consumer: dS *= d(modified S)/dS" in out


@pytest.mark.parametrize("mods, why", [
    (["softcap  = 30", TANH], "softcap or a score_mod, not both"),
    ([WINDOW, "mask = prefix(64)"], "a mask_mod without prefix"),
])
def test_what_stays_refused(mods, why):
    text = spec_text("bwd_expr", [m for m in mods if not m.startswith("mask =")], 128, "none")
    if any(m.startswith("mask =") for m in mods):
        text = text.replace("mask     = none", "    ".join(m for m in mods if m.startswith("mask =")))
    try:
        (s,) = parse_text(text, "<expr>")
    except SpecError as err:   # the DSL's own check may refuse it first, by the same rule
        assert why in err.message
        return
    with pytest.raises(SpecError, match=re.escape(why)):
        lower_backward(s)


def test_a_score_mod_without_a_gradient_is_refused_at_the_api():
    with pytest.raises(RuntimeInputError, match="floor"):
        modifications("attention_backward", score_mod="floor(score)", differentiable=True)
    mods, _ = modifications("attention", score_mod="floor(score)")
    assert mods.score_mod is not None   # the forward alone takes it
    block, _ = modifications("attention", mask_mod="kv_idx <= q_idx", block_mask=None)
    assert modified_backward_refusal("sm_90a", 128, 128, block) == ""


# ---- the launches, on the fake device -----------------------------------------------------------------------

@pytest.fixture
def device(tmp_path):
    from tests.host_stubs import stub_device
    with stub_device(tmp_path, {}) as dev:
        yield dev


def test_attention_backward_passes_the_aux_tensors_by_name(device):
    import tiledsl
    q, k, v, o, do = (device.tensor((2, 4, 300, 128)) for _ in range(5))
    lse, bias = device.tensor((2, 4, 300), "float32"), device.tensor((4, 8191), "float32")
    grads = tiledsl.attention_backward(q, k, v, o, lse, do, causal=True, score_mod=BIAS.split("= ", 1)[1],
                                       aux={"bias": bias})
    assert len(grads) == 3 and tuple(grads[1].shape) == (2, 4, 300, 128)
    main, *_, values = device.last(2)
    assert main.endswith("_main") and "_smod" in main
    assert values[-3:] == [bias.data_ptr(), 8191, 1]   # the pointer, then its strides in elements
    with pytest.raises(RuntimeInputError, match="bias"):
        tiledsl.attention_backward(q, k, v, o, lse, do, causal=True, score_mod=BIAS.split("= ", 1)[1],
                                   aux={"bias": device.tensor((4, 100), "float32")})   # too short for 300 keys
    with pytest.raises(RuntimeInputError, match="floor"):
        tiledsl.attention_backward(q, k, v, o, lse, do, score_mod="floor(score)")


def test_mask_mods_steps_must_fit_the_step_bits(device):
    import tiledsl
    q, o, do = (device.tensor((1, 32, 64 * 129, 128)) for _ in range(3))   # 32 query heads x 129 q tiles
    k, v = (device.tensor((1, 1, 64 * 129, 128)) for _ in range(2))
    lse = device.tensor((1, 32, 64 * 129), "float32")
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match="mask_mod: a kv tile walks 4128 .* marks at most 4096"):
        tiledsl.attention_backward(q, k, v, o, lse, do, mask_mod=WINDOW.split("= ", 1)[1])
    assert len(device.launches) == launches


def test_an_autograd_step_with_a_score_mod_gives_the_aux_tensor_no_gradient(device):
    import tiledsl
    q, k, v = (device.tensor((2, 4, 300, 128), requires_grad=True) for _ in range(3))
    bias = device.tensor((4, 8191), "float32")
    o = tiledsl.attention(q, k, v, causal=True, score_mod=BIAS.split("= ", 1)[1], aux={"bias": bias})
    assert device.last()[0].startswith("hopper") and "_smod" in device.last()[0]
    grads = device.backward(o, device.tensor(o.shape))
    assert len(grads) == 11 and all(g is not None for g in grads[:3]) and grads[9] is None   # aux: no gradient
    names = [device.last(back)[0] for back in range(1, 4)]
    assert any(name.endswith("_main") and "_smod" in name for name in names), names
    launches = len(device.launches)
    learned = device.tensor((4, 8191), "float32", requires_grad=True)
    with pytest.raises(RuntimeInputError, match="aux tensors get no gradient"):
        tiledsl.attention(q, k, v, causal=True, score_mod=BIAS.split("= ", 1)[1], aux={"bias": learned})
    with pytest.raises(RuntimeInputError, match="floor"):
        tiledsl.attention(q, k, v, score_mod="floor(score)")
    assert len(device.launches) == launches   # refused before any launch


# ---- nvcc ------------------------------------------------------------------------------------------------------

# Known spills, listed exactly (strict: a fix or a new spill fails the test): d64's only schedule (tile q 128: S^T
# and dP^T hold 64 registers each per consumer thread) spills with a score_mod (ptxas: 8 bytes for the bias table's
# reads, 194 with tanh's held factors) and with softcap and ALiBi together (22 bytes). The kernels are correct; the
# spills cost speed.
D64_SPILLS = pytest.mark.xfail(strict=True, reason="d64's tile q 128 consumers spill with these modifications")
CASES = [([BIAS], "causal", "tma_reduce"), ([TANH], "none", "tma_reduce"), ([WINDOW], "none", "ordered"),
         (["softcap  = 30", "alibi    = geometric"], "causal", "tma_reduce")]


@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("mods, mask, dq, d", [case + (d,) for d in (128, 256) for case in CASES]
                         + [pytest.param(*case, 64, marks=[] if case[0] == [WINDOW] else [D64_SPILLS])
                            for case in CASES])
def test_the_expression_kernels_compile_without_spills(mods, mask, dq, d, tmp_path):
    plan = lower_backward(spec(mods, d, mask=mask, dq=dq))
    _, report = nvcc.compile_to(render(plan), plan.kernel_name, "cubin", Path(tmp_path))
    found = nvcc.parse_ptxas(report)
    assert set(plan.kernel_names.values()) <= set(found)
    for name in plan.kernel_names.values():
        assert (found[name].spill_stores, found[name].spill_loads, found[name].stack_bytes) == (0, 0, 0), name


@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc is not on PATH")
def test_the_bundled_expression_backward_specs_build_without_spills(tmp_path):
    from tiledsl.frontend.parse import load_specs
    specs = load_specs(str(ROOT / "specs" / "mods" / "expressions_backward_d128.tile"))
    assert [s.name for s in specs] == ["relative_bias_backward_d128", "window_global_backward_d128",
                                       "tanh_softcap_backward_d128"]
    for s in specs:
        assert s.backward.warp_specialized
        plan = lower_backward(s)
        _, report = nvcc.compile_to(render(plan), plan.kernel_name, "cubin", Path(tmp_path))
        found = nvcc.parse_ptxas(report)
        for name in plan.kernel_names.values():
            assert (found[name].spill_stores, found[name].spill_loads, found[name].stack_bytes) == (0, 0, 0), name
