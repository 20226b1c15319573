"""The Python side of the modifications without a GPU: attention's keywords become the spec `spec_for`
prints (text that parses back to the same kernel), Python callables trace to the trees the DSL text
makes, and what can't be traced or doesn't fit is refused with a message that says why."""
from __future__ import annotations

import math

import numpy as np
import pytest

import tiledsl
from tiledsl.dispatch.modified import modifications
from tiledsl.dispatch.tuned import tuned_spec
from tiledsl.errors import RuntimeInputError
from tiledsl.frontend.parse import load_spec
from tiledsl.mods.model import AlibiSlopes, Documents
from tiledsl.mods.trace import TraceError, trace
from tiledsl.spec import DType, Mask

B, H, N, D = 2, 8, 256, 128


def arrays(n=N, d=D):
    return (np.zeros((B, H, n, d), np.float16),) * 3


def dsl_tree(role, text):
    return getattr(load_spec(f"attention t {{\n    head_dim = 64\n    {role} = {text}\n}}\n").problem.mods, role)


def test_spec_for_prints_a_spec_that_parses_back_to_the_kernel_attention_picks():
    q, k, v = arrays()
    bias = np.zeros((H, 2 * N), np.float32)
    keywords = dict(softcap=30, alibi_slopes="geometric", sinks=np.zeros(H, np.float32),
                    document_ids=np.zeros((B, N), np.int32), score_mod="score + bias[h, q_idx - kv_idx + 255]",
                    mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx == 0), aux={"bias": bias})
    text = tiledsl.spec_for(q, k, v, causal=True, **keywords)
    assert "    mask     = causal & document\n" in text and "    softcap   = 30.0\n" in text
    assert "    mask_mod  = kv_idx <= q_idx | kv_idx == 0\n" in text
    printed = load_spec(text)
    mods, _ = modifications(**keywords)
    expected, _ = tuned_spec("sm_90a", DType.FP16, D, Mask.CAUSAL, D, None, None, N, mods)
    assert printed.problem == expected.problem and printed.schedule == expected.schedule
    assert printed.kernel_name == expected.kernel_name


class _Shaped:
    """An array-like with a framework's dtype text (torch prints "torch.bfloat16")."""
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


@pytest.mark.parametrize("dtype, expected", [("torch.bfloat16", "bf16"), ("bfloat16", "bf16"),
                                             ("torch.float16", "fp16"), ("float16", "fp16"), ("half", "fp16")])
def test_spec_for_reads_the_dtype_by_its_whole_name(dtype, expected):
    q = _Shaped((B, H, N, D), dtype)
    text = tiledsl.spec_for(q, q, q, softcap=30, arch="sm_90a")
    assert f"    dtype    = {expected}\n" in text


def test_spec_for_refuses_a_dtype_it_has_no_kernel_for():
    q = _Shaped((B, H, N, D), "torch.float32")
    with pytest.raises(RuntimeInputError, match="fp16 or bf16"):
        tiledsl.spec_for(q, q, q, arch="sm_90a")


def test_keywords_map_to_the_modifications():
    mods, aux = modifications(alibi_slopes=np.ones(H), document_bounds=np.array([[0, 5, 9]]))
    assert mods.alibi is AlibiSlopes.GIVEN and mods.document is Documents.BOUNDS
    assert sorted(aux) == ["alibi_slopes", "document_bounds"]
    assert modifications()[0].active is False


@pytest.mark.parametrize("fn, text, role", [
    (lambda score, b, h, q_idx, kv_idx: 30 * (score / 30).tanh(), "30 * tanh(score / 30)", "score_mod"),
    (lambda score, b, h, q_idx, kv_idx, bias: score + bias[h, q_idx - kv_idx], "score + bias[h, q_idx - kv_idx]",
     "score_mod"),
    (lambda score, b, h, q, kv: abs(score - 1) * 2 - (q // 64).float(), "abs(score - 1) * 2 - (q_idx // 64 + 0.0)",
     "score_mod"),
    (lambda score, b, h, q, kv: score.clamp(-5, 5), "min(max(score, -5), 5)", "score_mod"),
    (lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < 256) | (kv_idx == 0),
     "kv_idx <= q_idx & q_idx - kv_idx < 256 | kv_idx == 0", "mask_mod"),
    (lambda b, h, q, kv, doc: doc[b, q] == doc[b, kv], "doc[b, q_idx] == doc[b, kv_idx]", "mask_mod"),
    (lambda b, h, q, kv: ~(q % 3 == 1), "~(q_idx % 3 == 1)", "mask_mod"),
])
def test_a_callable_traces_to_the_tree_its_dsl_text_makes(fn, text, role):
    aux = {"bias": np.zeros((H, 1)), "doc": np.zeros((B, N), np.int32)}
    expr, _ = trace(fn, role, aux)
    assert expr == dsl_tree(role, text)


@pytest.mark.parametrize("fn, message", [
    (lambda score, b, h, q, kv: score if score > 0 else 0, "a Python `if`, `and`, `or`, `not`, min()"),
    (lambda score, b, h, q, kv: min(score, 5), "a Python `if`"),
    (lambda score, b, h, q, kv: math.tanh(score), r"float\(\) / math\.\* of a traced value"),
    (lambda score, b, h, q, kv, table: score + table[h], "parameter 'table' names no aux tensor"),
    (lambda score, b: score, "takes 2 positional arguments"),
    (lambda score, b, h, q, kv: q <= kv, r"traces to `q_idx <= kv_idx`: score_mod gives the new score"),
    (lambda score, b, h, q, kv: score + (q <= kv), r"`\+` takes numbers; got a float and a condition"),
    (lambda score, b, h, q, kv: score + [1][q], "indexes an array the tracer can't see"),
])
def test_what_cant_be_traced_is_refused_with_why(fn, message):
    with pytest.raises(TraceError, match=message):
        trace(fn, "score_mod", {})


def test_a_traced_score_mod_needs_a_gradient_when_the_call_does():
    with pytest.raises(TraceError, match="no gradient"):
        trace(lambda score, b, h, q, kv: score.floor(), "score_mod", {}, differentiable=True)
    with pytest.raises(RuntimeInputError, match=r"<score_mod>:3:17: error: `floor` of a value that depends"):
        modifications(score_mod="floor(score)", differentiable=True)


@pytest.mark.parametrize("keywords, message", [
    (dict(softcap=-1), "softcap must be a finite number > 0, got -1"),
    (dict(softcap=True), "softcap must be a finite number > 0"),
    (dict(alibi_slopes="geometrik"), "alibi_slopes is 'geometric' or a float tensor"),
    (dict(document_ids=np.zeros((1, 2)), document_bounds=np.zeros((1, 2))), "not both"),
    (dict(score_mod="score + q_id"), r"<score_mod>:3:25: error: unknown name 'q_id'; did you mean 'q_idx'\?"),
    (dict(score_mod=5), "score_mod is DSL text, a callable or an expression tree, got int"),
])
def test_bad_keywords_are_refused_before_anything_runs(keywords, message):
    q, k, v = arrays()
    with pytest.raises(RuntimeInputError, match=message):
        tiledsl.attention(q, k, v, **keywords)


def test_captured_torch_tensors_become_aux_tensors():
    torch = pytest.importorskip("torch")
    bias = torch.zeros(H, 2 * N)
    expr, aux = trace(lambda score, b, h, q, kv: torch.tanh(score) + bias[h, q - kv + 255], "score_mod", {})
    assert expr == dsl_tree("score_mod", "tanh(score) + captured0[h, q_idx - kv_idx + 255]")
    assert aux["captured0"] is bias
    named, aux = trace(lambda score, b, h, q, kv: torch.where(score > 0, score, bias[h, kv]), "score_mod",
                       {"bias": bias})
    assert named == dsl_tree("score_mod", "where(score > 0, score, bias[h, kv_idx])") and list(aux) == ["bias"]


def test_the_launch_check_reads_shapes_and_is_conservative_about_kv_lens():
    from tiledsl.dispatch.modified import check_launch
    mods, aux = modifications(score_mod="score + bias[kv_len - kv_idx]", aux={"bias": np.zeros(N + 1, np.float32)})
    check_launch(mods, aux, B, H, N, N)
    with pytest.raises(RuntimeInputError, match=r"index 0 \(kv_len - kv_idx\) can reach -255\.\.256"):
        check_launch(mods, aux, B, H, N, N, ragged=True)   # kv_lens unread: kv_len may be anything up to N
