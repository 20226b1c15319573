"""GPU tests of score_mod / mask_mod expressions and softcap with ALiBi in the warp-specialized backward
(attention_backward(..., score_mod=, mask_mod=, aux=), and through autograd): dQ, dK, dV of fresh random inputs
against the float64 reference's gradients (tiledsl.reference.backward, which runs the same modified graph), with O
and the LSE from the float64 reference forward (so these test the backward alone), into outputs poisoned with NaN;
the error bound is the other backward tests' (gpu_support.TOLERANCE_O, normwise relative). The aux tensors get no
gradient. Cases: a relative-position bias table (causal), tanh softcap written as a score_mod, a sliding window with
global tokens (mask_mod), prefix-LM as a mask_mod, softcap with ALiBi (causal); seqlens 1, 17, 1000, GQA, kv_lens
with a 0, rows with no visible key (q_len > kv_len, causal); deterministic bits on the window's mask_mod; autograd
end to end, torch.compile too. Seven backward modules and one forward, compiled in parallel first."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_support import TOLERANCE_O, float64, rel, requires_gpu
from tiledsl.errors import RuntimeInputError

pytestmark = [pytest.mark.gpu, requires_gpu]

D, WINDOW, GLOBAL, PREFIX, CAP = 128, 300, 16, 200, 2.0
MAX_LEN = 1024   # the bias table's reach: relative positions -(MAX_LEN - 1) .. MAX_LEN - 1
# name -> (causal, attention keywords without aux tensors); the aux tensors are made fresh per run (aux_for)
CASES = {
    "rel_bias": (True, {"score_mod": f"score + bias[h, q_idx - kv_idx + {MAX_LEN - 1}]"}),
    "tanh_softcap": (False, {"score_mod": f"{CAP} * tanh(score / {CAP})"}),
    "window_global": (False, {"mask_mod": f"kv_idx <= q_idx & q_idx - kv_idx < {WINDOW} | kv_idx < {GLOBAL}"}),
    "prefix_lm": (False, {"mask_mod": f"kv_idx <= q_idx | kv_idx < {PREFIX}"}),
    "softcap_alibi": (True, {"softcap": CAP}),
}


def aux_for(name: str, heads: int) -> dict:
    """The case's keywords that carry tensors, fresh."""
    import torch
    if name == "rel_bias":
        return {"aux": {"bias": torch.randn(heads, 2 * MAX_LEN - 1, device="cuda")}}
    if name == "softcap_alibi":
        return {"alibi_slopes": torch.rand(heads, device="cuda") * 0.3}
    return {}


def keywords(name: str, heads: int) -> dict:
    return CASES[name][1] | aux_for(name, heads)


def spec_for(kw: dict, causal: bool, deterministic: bool = False):
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    mods, _ = modifications("attention_backward", differentiable=True, **kw)
    return chosen_backward_spec(device_arch(), DType.BF16, D, Mask.CAUSAL if causal else Mask.NONE, D,
                                deterministic=deterministic, mods=mods)


def reference_aux(kw: dict) -> dict:
    out = {name: float64(t) for name, t in kw.get("aux", {}).items()}
    if "alibi_slopes" in kw:
        out["alibi_slopes"] = float64(kw["alibi_slopes"])
    return out


def run(name, batch=2, heads=4, kv_heads=2, q_len=128, kv_len=128, kv_lens=None, deterministic=False):
    """(errors of dQ, dK, dV, the gradients) of one backward on fresh inputs into NaN-poisoned memory."""
    import torch

    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    causal = CASES[name][0]
    q = torch.randn(batch, heads, q_len, D, device="cuda").to(torch.bfloat16)
    k = torch.randn(batch, kv_heads, kv_len, D, device="cuda").to(torch.bfloat16)
    v = torch.randn(batch, kv_heads, kv_len, D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(batch, heads, q_len, D, device="cuda", dtype=torch.bfloat16)
    kw = keywords(name, heads)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    spec = spec_for(kw, causal, deterministic)
    aux = reference_aux(kw)
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    lens64 = None if kv_lens is None else np.array(kv_lens)
    o64, lse64 = reference_attention(spec, q64, k64, v64, lens64, aux=aux)
    o, lse = torch.tensor(o64, device="cuda").to(torch.bfloat16), torch.tensor(lse64, device="cuda").float()
    ref = reference_backward(spec, q64, k64, v64, do64, float64(o), lse64, kv_lens=lens64, aux=aux)
    blocks = [torch.full_like(x, float("nan")) for x in (q, k, v)]   # freed NaN blocks the outputs reuse
    del blocks
    torch.cuda.synchronize()
    out = attention_backward(q, k, v, o, lse, do, causal=causal, kv_lens=lens, deterministic=deterministic, **kw)
    torch.cuda.synchronize()
    assert len(out) == len(ref) == 3
    for x, like in zip(out, (q, k, v)):
        assert x.shape == like.shape and x.dtype == like.dtype and x.is_contiguous()
    return [rel(x, r) for x, r in zip(out, ref)], out


def check(errors):
    assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV relative errors {errors}"


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every module these tests load (five backwards, the window's deterministic one, the bias table's forward),
    compiled by NVRTC in threads (cubins land in the disk cache)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from tiledsl.dispatch.modified import modifications
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.families import compile as compile_forward
    from tiledsl.runtime.backward import compile_backward
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    sources = {}
    for name, (causal, _) in CASES.items():
        for det in (False, True) if name == "window_global" else (False,):
            kernel = compile_backward(spec_for(keywords(name, 4), causal, det))
            sources[kernel.name] = kernel.source
    mods, _ = modifications("attention", **keywords("rel_bias", 4))
    forward, _ = tuned_spec(device_arch(), DType.BF16, D, Mask.CAUSAL, mods=mods)
    kernel = compile_forward(forward)
    sources[kernel.name] = kernel.source
    assert len(sources) <= 12
    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(compile_cubin, src, name, device_arch()) for name, src in sources.items()]:
            f.result()
    torch.manual_seed(np.random.SeedSequence().entropy % 2 ** 31)   # fresh inputs per run
    yield


@pytest.mark.parametrize("seqlen", [1, 17, 1000])
@pytest.mark.parametrize("name", list(CASES))
def test_gradients(name, seqlen):
    check(run(name, q_len=seqlen, kv_len=seqlen)[0])


@pytest.mark.parametrize("name", list(CASES))
def test_kv_lens_including_zero(name):
    errors, (dq, dk, dv) = run(name, batch=3, q_len=130, kv_len=700, kv_lens=[700, 0, 277])
    check(errors)
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()   # no key: zero gradients, not NaN
    assert not dk[2, :, 277:].any() and not dv[2, :, 277:].any()


@pytest.mark.parametrize("name", ["rel_bias", "softcap_alibi"])
def test_rows_that_see_no_key(name):
    """Causal with q_len > kv_len: the first q_len - kv_len rows see no key (bottom-right alignment)."""
    errors, (dq, _, _) = run(name, q_len=700, kv_len=300)
    check(errors)
    assert not dq[:, :, :400].any()


def test_mask_mod_deterministic_bits_and_values():
    """Deterministic dQ adds kv tiles in order behind per-tile semaphores, counting only the kv tiles mask_mod
    marks for each q tile (those between the window and the global keys are skipped)."""
    import torch

    from tiledsl.dispatch.backward import attention_backward
    check(run("window_global", q_len=1500, kv_len=1500, deterministic=True)[0])
    q, k, v, o, do = (torch.randn(2, 4, 1500, D, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(2, 4, 1500, device="cuda") + 8
    kw = keywords("window_global", 4)
    first = attention_backward(q, k, v, o, lse, do, deterministic=True, **kw)
    for _ in range(3):
        again = attention_backward(q, k, v, o, lse, do, deterministic=True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("compiled_model", [False, True], ids=["eager", "torch.compile"])
def test_autograd_end_to_end_and_no_gradient_for_aux(compiled_model):
    import torch

    import tiledsl
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    q, k, v = (torch.randn(2, 4, 257, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 4, 257, D, device="cuda", dtype=torch.bfloat16)
    kw = keywords("rel_bias", 4)

    def model(q, k, v):
        return tiledsl.attention(q, k, v, causal=True, **kw)
    fn = torch.compile(model, fullgraph=False) if compiled_model else model
    (fn(q, k, v).float() * do.float()).sum().backward()
    assert kw["aux"]["bias"].grad is None   # aux tensors get no gradient
    spec = spec_for(kw, True)
    aux = reference_aux(kw)
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(spec, q64, k64, v64, aux=aux)
    ref = reference_backward(spec, q64, k64, v64, do64, o64, lse64, aux=aux)
    check([rel(x.grad, r) for x, r in zip((q, k, v), ref)])
    learned = kw["aux"]["bias"].clone().requires_grad_(True)
    with pytest.raises(RuntimeInputError, match="aux tensors get no gradient"):
        tiledsl.attention(q, k, v, causal=True, score_mod=kw["score_mod"], aux={"bias": learned})


def test_a_score_mod_without_a_gradient_is_refused_before_launch():
    import torch

    import tiledsl
    q = torch.randn(1, 2, 64, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeInputError, match="floor"):
        tiledsl.attention(q, q, q, score_mod="floor(score)")
