"""score_mod / mask_mod expressions compiled into the hopper forward, on the GPU against the float64 reference
(tiledsl.reference.forward, which evaluates the same trees with mods/numeric.py): a relative-position bias table,
tanh softcap written as a score_mod, a sliding window with a global token, prefix-LM and a document mask over an
aux id tensor (with an empty document) as mask_mods, rows that see no key; causal and none, d64 and d128 on the
tuned schedules (intra overlap, ping-pong), query lengths 1, 17 and 1000, GQA, kv_lens with 0; fresh random
inputs, NaN-poisoned outputs. Then the API (DSL text and traced callables, the kernel cache keyed on the tree),
the refusals before launch, and one compute-sanitizer run over a gather at ragged lengths."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tiledsl.dispatch.modified import expression
from tiledsl.mods.model import Modifications
from tiledsl.spec import DType, KernelSpec, Mask, Problem

from .gpu_support import check, kernel_for, memcheck, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

WINDOW = 100   # the sliding window's keys (small, so 1000-row cases have empty tiles between the global key's)


def tuned(head_dim: int, mask: str):
    from tiledsl.dispatch.tuned import TUNED
    return TUNED[("sm_90", "bf16", head_dim, mask)]


def spec_of(role_texts: dict, mask: str, head_dim: int) -> KernelSpec:
    mods = Modifications(**{role: expression("test", role, text, {})[0] for role, text in role_texts.items()})
    return KernelSpec(f"expr_{mask}_d{head_dim}", Problem(head_dim, head_dim, DType.BF16, Mask(mask), mods=mods),
                      tuned(head_dim, mask))


BIAS_RANGE = 1000   # the bias table's distances: every (query, key) of up to 1000 of each (one kernel for all)


def bias_case(batch, heads, q_len, kv_len):
    """score + bias[h, q_idx - kv_idx + 999]: a relative-position table, one entry per distance."""
    import torch
    text = f"score + bias[h, q_idx - kv_idx + {BIAS_RANGE - 1}]"
    return {"score_mod": text}, {"bias": torch.randn(heads, 2 * BIAS_RANGE - 1, device="cuda") * 2}


def document_case(batch, heads, q_len, kv_len):
    """doc[b, q_idx] == doc[b, kv_idx] over runs of random lengths; id 2 is skipped (an empty document)."""
    import torch
    n = max(q_len, kv_len)
    rng = np.random.default_rng()
    ids = np.empty((batch, n), dtype=np.int32)
    for b in range(batch):
        lengths = rng.integers(1, max(n // 3, 2), size=n)
        row = np.repeat(np.arange(len(lengths)), lengths)[:n]
        ids[b] = np.where(row >= 2, row + 1, row)   # ids 0, 1, 3, 4, ...: document 2 has no position
    return {"mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"}, {"doc": torch.tensor(ids, device="cuda")}


CASES = {
    "bias": bias_case,
    "softcap": lambda *shape: ({"score_mod": "30.0 * tanh(score / 30.0)"}, {}),
    "window_global": lambda *shape: ({"mask_mod": f"kv_idx == 0 | q_idx - kv_idx < {WINDOW}"}, {}),
    "prefix_lm": lambda *shape: ({"mask_mod": "kv_idx <= q_idx | kv_idx < 300"}, {}),
    "documents": document_case,
    "bias_and_window": lambda *shape: ({**bias_case(*shape)[0], "mask_mod": f"q_idx - kv_idx < {WINDOW}"},
                                       bias_case(*shape)[1]),
}


def errors(spec, aux, batch, heads, q_len, kv_len, kv_heads=None, kv_lens=None, out_rows=None):
    """(O error, LSE error) of one run into NaN-poisoned outputs against the float64 reference; `out_rows`
    (a callback) also gets the outputs and the reference's."""
    import cupy
    import torch

    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import (
        as_float64,
        lse_error,
        poisoned_outputs,
        relative_error,
    )
    from tiledsl.runtime.tensors import view
    d, kv_heads = spec.problem.head_dim_qk, kv_heads or heads
    q = torch.randn(batch, heads, q_len, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=torch.bfloat16)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    out, lse = poisoned_outputs(q, (batch, heads, q_len, d), (batch, heads, q_len))
    kernel_for(spec)(q, k, v, kv_lens=lens, out=out, lse=lse, aux=aux)
    torch.cuda.synchronize()
    q64, k64, v64 = (cupy.asnumpy(as_float64(view(x, n))) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    ref_o, ref_lse = reference_attention(spec, q64, k64, v64, None if kv_lens is None else np.array(kv_lens),
                                         aux={n: t.cpu().numpy() for n, t in aux.items()})
    if out_rows is not None:
        out_rows(out, lse, ref_o, ref_lse)
    return relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("q_len", [1, 17, 1000])
def test_expression_kernel_matches_reference(case, mask, head_dim, q_len):
    texts, aux = CASES[case](2, 3, q_len, q_len)
    check(errors(spec_of(texts, mask, head_dim), aux, 2, 3, q_len, q_len))


@pytest.mark.parametrize("case", sorted(CASES))
def test_gqa_unequal_lengths_and_kv_lens_with_zero(case):
    # 300 queries over 650 keys, per-sequence lengths 0, 1 and 637 (the expression's kv_len is the entry's)
    texts, aux = CASES[case](3, 8, 300, 650)
    check(errors(spec_of(texts, "causal", 128), aux, 3, 8, 300, 650, kv_heads=2, kv_lens=[0, 1, 637]))
    check(errors(spec_of(texts, "none", 64), aux, 3, 8, 300, 650, kv_heads=4, kv_lens=[650, 0, 64]))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rows_that_see_no_key_give_zero(head_dim):
    """mask_mod hides every key of the rows q_idx % 3 == 0 (O = 0, LSE = -inf) and, in the second call, of
    every row (no tile visited at all)."""
    import torch

    def zero_rows(out, lse, ref_o, ref_lse):
        hidden = np.arange(out.shape[2]) % 3 == 0
        assert torch.equal(out[:, :, hidden], torch.zeros_like(out[:, :, hidden]))
        assert bool(torch.isneginf(lse[:, :, hidden]).all())
    spec = spec_of({"mask_mod": "q_idx % 3 != 0 & kv_idx <= q_idx + 40"}, "none", head_dim)
    check(errors(spec, {}, 2, 2, 500, 700, out_rows=zero_rows))

    def all_zero(out, lse, ref_o, ref_lse):
        assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    spec = spec_of({"mask_mod": "kv_idx > q_idx + kv_len"}, "none", head_dim)
    check(errors(spec, {}, 1, 2, 300, 300, out_rows=all_zero))


def test_window_with_a_global_token_at_4k_rows():
    """Long rows: the producer and the consumers step over the same ~30 empty tiles of an item."""
    texts, aux = CASES["window_global"](1, 2, 4096, 4096)
    check(errors(spec_of(texts, "causal", 128), aux, 1, 2, 4096, 4096))
    check(errors(spec_of(texts, "none", 64), aux, 1, 2, 4096, 4096))


def test_api_runs_dsl_text_and_traced_callables():
    """tiledsl.attention with score_mod / mask_mod as text and as callables (a captured tensor becomes an aux
    tensor), each against the reference of the spec spec_for prints; a different captured number is a different
    kernel (the call cache keys on the tree)."""
    import cupy
    import torch

    import tiledsl
    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import as_float64, lse_error, relative_error
    from tiledsl.runtime.tensors import view
    heads, n = 4, 700
    bias = torch.randn(heads, 2 * n - 1, device="cuda")
    q = torch.randn(2, heads, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, n, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q64, k64, v64 = (cupy.asnumpy(as_float64(view(x, name))) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    calls = [dict(score_mod=f"score + bias[h, q_idx - kv_idx + {n - 1}]", aux={"bias": bias}),
             dict(score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[h, q_idx - kv_idx + n - 1]),
             dict(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx == 0) | (q_idx - kv_idx < 64)),
             dict(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx == 0) | (q_idx - kv_idx < 128)),
             dict(softcap=20.0, mask_mod="kv_idx <= q_idx | kv_idx < 200")]
    for keywords in calls:
        out, lse = tiledsl.attention(q, k, v, causal=True, return_lse=True, **keywords)
        spec = tiledsl.parse_text(tiledsl.spec_for(q, k, v, causal=True, **keywords))[0]
        aux = {a.name: bias.cpu().numpy() for a in spec.problem.mods.user_aux()}   # the only tensor: bias
        ref_o, ref_lse = reference_attention(spec, q64, k64, v64, aux=aux)
        check((relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))))


def test_aux_tensors_are_refused_before_launch():
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    text = "score + bias[h, q_idx - kv_idx + 63]"
    good = torch.randn(4, 127, device="cuda")
    for aux, words in (({}, "missing"), ({"bias": good[:, :100].contiguous()}, "can reach"),
                       ({"bias": good[:3].contiguous()}, "can reach"), ({"bias": good.half()}, "float"),
                       ({"bias": good, "other": good}, "not read"), ({"bias": good[:, ::2]}, "can reach|contiguous")):
        with pytest.raises(RuntimeInputError, match=words):
            tiledsl.attention(q, q, q, score_mod=text, aux=aux)
    with pytest.raises(RuntimeInputError, match="as int or bool"):
        tiledsl.attention(q, q, q, mask_mod="doc[b, q_idx] == doc[b, kv_idx]",
                          aux={"doc": torch.zeros(1, 64, device="cuda")})
    kernel = kernel_for(spec_of({"score_mod": text}, "none", 64))   # the kernel's own call checks the same
    with pytest.raises(RuntimeInputError, match="can reach"):
        kernel(q, q, q, aux={"bias": good[:, :100].contiguous()})
    with pytest.raises(RuntimeInputError, match="contiguous"):
        kernel(q, q, q, aux={"bias": torch.randn(4, 254, device="cuda")[:, ::2]})
    tiledsl.attention(q, q, q, score_mod=text, aux={"bias": good})


def test_gradients_through_an_expression_are_refused_with_why():
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeInputError, match="no gradient through the modifications .score_mod.*score_mod"):
        tiledsl.attention(q, q, q, score_mod="score * 0.5")
    with pytest.raises(RuntimeInputError, match="no gradient through the modifications .mask_mod"):
        tiledsl.attention(q, q, q, mask_mod="kv_idx != 3")
    with torch.no_grad():
        tiledsl.attention(q, q, q, mask_mod="kv_idx != 3")


def test_compute_sanitizer_on_a_gather_at_ragged_lengths(tmp_path):
    """The partial tiles' elements past q_len and kv_len read the bias at the clamped last index: no read leaves
    the table (the check sized it for the launch exactly)."""
    script = tmp_path / "expr_memcheck.py"
    script.write_text(textwrap.dedent("""
        import torch
        from tiledsl import compile
        from tests.test_gpu_expressions import spec_of
        spec = spec_of({"score_mod": "score + bias[h, q_idx - kv_idx + 149]",
                        "mask_mod": "doc[b, kv_idx] >= 0 | kv_idx == 0"}, "causal", 64)
        kernel = compile(spec)
        q = torch.randn(2, 2, 77, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1, 150, 64, device="cuda", dtype=torch.bfloat16)
        aux = {"bias": torch.randn(2, 77 + 150 - 1, device="cuda"),
               "doc": torch.zeros(2, 150, device="cuda", dtype=torch.int32)}
        kernel(q, k, k, kv_lens=torch.tensor([150, 3], device="cuda", dtype=torch.int32), aux=aux)
        torch.cuda.synchronize()
    """))
    memcheck(script)
