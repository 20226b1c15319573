"""GPU tests of score modifications in the warp-specialized backward (attention_backward(..., softcap=,
alibi_slopes=, sinks=)): dQ, dK, dV (and dsink) of fresh random inputs against the float64 reference's gradients
(tiledsl.reference.backward, which runs the same modified graph), with O and the LSE from the float64 reference
forward (so these test the backward alone), into outputs poisoned with NaN; the error bound is the other backward
tests' (gpu_support.TOLERANCE_O, normwise relative). softcap (a small cap, so tanh bends the scores), ALiBi (given
slopes, per-batch slopes, geometric) and sinks, each with no mask and causal, head dims 64 and 128, seqlens 17
and 1000, GQA; a window at d64; kv_lens with a 0; q_len != kv_len; deterministic bits; autograd end to end
(loss.backward() gives dsink), torch.compile(fullgraph=True) too; one compute-sanitizer memcheck case. The
modules are compiled in parallel first."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests.gpu_support import TOLERANCE_O, float64, memcheck, rel, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

CAP = 2.0        # |scaled scores| reach a few units: tanh is far from linear and 1 - tanh^2 far from 1
MODS = ("softcap", "alibi", "sinks")
HEAD_DIMS = (64, 128)


def keywords(mod: str, batch: int, heads: int, per_batch: bool = False) -> dict:
    """attention's keywords for `mod`, with fresh random aux tensors."""
    import torch
    if mod == "softcap":
        return {"softcap": CAP}
    if mod == "alibi":
        return {"alibi_slopes": torch.rand((batch, heads) if per_batch else (heads,), device="cuda") * 0.3}
    if mod == "alibi_geometric":
        return {"alibi_slopes": "geometric"}
    if mod == "softcap_sinks":
        return {"softcap": CAP, "sinks": torch.randn(heads, device="cuda") * 2}
    return {"sinks": torch.randn(heads, device="cuda") * 2}


WINDOW = (100, 20)


def spec_for(kw: dict, d: int, causal: bool, deterministic: bool = False, window=None):
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    mods, _ = modifications("attention_backward", differentiable=True, **kw)
    mask = Mask.WINDOW if window else Mask.CAUSAL if causal else Mask.NONE
    return chosen_backward_spec(device_arch(), DType.BF16, d, mask, d, window, deterministic=deterministic, mods=mods)


def aux_of(kw: dict, heads: int) -> dict:
    out = {}
    if "sinks" in kw:
        out["sinks"] = float64(kw["sinks"])
    if "alibi_slopes" in kw and not isinstance(kw["alibi_slopes"], str):   # geometric: the spec's own slopes
        out["alibi_slopes"] = float64(kw["alibi_slopes"])
    return out


def run(mod, d, causal, batch=2, heads=4, kv_heads=2, q_len=128, kv_len=128, kv_lens=None, per_batch=False,
        deterministic=False, spread=1.0, window=None):
    """(errors of dQ, dK, dV[, dsink], the gradients) of one backward on fresh inputs into NaN-poisoned memory."""
    import torch

    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    q = (torch.randn(batch, heads, q_len, d, device="cuda") * spread).to(torch.bfloat16)
    k = (torch.randn(batch, kv_heads, kv_len, d, device="cuda") * spread).to(torch.bfloat16)
    v = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(batch, heads, q_len, d, device="cuda", dtype=torch.bfloat16)
    kw = keywords(mod, batch, heads, per_batch)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    spec = spec_for(kw, d, causal, deterministic, window)
    aux = aux_of(kw, heads)
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    lens64 = None if kv_lens is None else np.array(kv_lens)
    o64, lse64 = reference_attention(spec, q64, k64, v64, lens64, aux=aux)
    o, lse = torch.tensor(o64, device="cuda").to(torch.bfloat16), torch.tensor(lse64, device="cuda").float()
    # the reference backward of the O the kernel is given (bf16): dsink sums exp(sink - LSE) D over the rows,
    # D = rowsum(dO O), and with few rows its terms cancel, so O's rounding alone would move it by ~1%
    ref = reference_backward(spec, q64, k64, v64, do64, float64(o), lse64, kv_lens=lens64, aux=aux)
    blocks = [torch.full_like(x, float("nan")) for x in (q, k, v)]   # freed NaN blocks the outputs reuse
    del blocks
    torch.cuda.synchronize()
    out = attention_backward(q, k, v, o, lse, do, causal=causal, window=window, kv_lens=lens,
                             deterministic=deterministic, **kw)
    torch.cuda.synchronize()
    assert len(out) == len(ref) == (4 if "sinks" in kw else 3)
    for x, like in zip(out, (q, k, v)):
        assert x.shape == like.shape and x.dtype == like.dtype and x.is_contiguous()
    return [rel(x, r) for x, r in zip(out, ref)], out


def check(errors):
    assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV[, dsink] relative errors {errors}"


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every module these tests load, compiled by NVRTC in threads (cubins land in the disk cache)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from tiledsl.runtime.backward import compile_backward
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    sources = {}
    for mod in MODS + ("alibi_geometric", "softcap_sinks"):
        for d in HEAD_DIMS:
            for causal in (False, True):
                for det in (False, True):
                    kernel = compile_backward(spec_for(keywords(mod, 2, 4), d, causal, det))
                    sources[kernel.name] = kernel.source
        kernel = compile_backward(spec_for(keywords(mod, 2, 4), 64, False, window=WINDOW))
        sources[kernel.name] = kernel.source
    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(compile_cubin, src, name, device_arch()) for name, src in sources.items()]:
            f.result()
    torch.manual_seed(np.random.SeedSequence().entropy % 2 ** 31)   # fresh inputs per run
    yield


@pytest.mark.parametrize("seqlen", [17, 1000])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("mod", MODS)
def test_gradients(mod, causal, d, seqlen):
    check(run(mod, d, causal, q_len=seqlen, kv_len=seqlen)[0])


@pytest.mark.parametrize("mod", MODS)
def test_window(mod):
    check(run(mod, 64, False, q_len=1000, kv_len=1000, window=WINDOW)[0])


@pytest.mark.parametrize("mod", ["alibi_geometric", "softcap_sinks"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_geometric_slopes_and_softcap_with_sinks(mod, causal):
    check(run(mod, 128, causal, q_len=300, kv_len=300)[0])


def test_per_batch_slopes_and_scores_past_a_large_cap():
    check(run("alibi", 64, True, q_len=200, kv_len=260, per_batch=True)[0])
    check(run("softcap", 128, True, q_len=200, kv_len=200, spread=3.0)[0])   # scores well past the cap


@pytest.mark.parametrize("mod", MODS)
@pytest.mark.parametrize("q_len,kv_len", [(100, 333), (333, 100)])
def test_q_len_differs(mod, q_len, kv_len):
    check(run(mod, 64, True, q_len=q_len, kv_len=kv_len)[0])


@pytest.mark.parametrize("mod", MODS)
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_kv_lens_including_zero(mod, causal):
    errors, (dq, dk, dv, *_) = run(mod, 128, causal, batch=3, q_len=130, kv_len=300, kv_lens=[300, 0, 77])
    check(errors)
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()   # no key: zero gradients, not NaN
    assert not dk[2, :, 77:].any() and not dv[2, :, 77:].any()


@pytest.mark.parametrize("mod", MODS)
def test_deterministic_bits(mod):
    import torch

    from tiledsl.dispatch.backward import attention_backward
    q, k, v, o, do = (torch.randn(2, 4, 700, 64, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(2, 4, 700, device="cuda") + 8
    kw = keywords(mod, 2, 4)
    first = attention_backward(q, k, v, o, lse, do, causal=True, deterministic=True, **kw)
    for _ in range(3):
        again = attention_backward(q, k, v, o, lse, do, causal=True, deterministic=True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def reference_grads(mod_kw, q, k, v, do, causal):
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    spec = spec_for(mod_kw, q.shape[-1], causal)
    aux = aux_of(mod_kw, q.shape[1])
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(spec, q64, k64, v64, aux=aux)
    return reference_backward(spec, q64, k64, v64, do64, o64, lse64, aux=aux)


@pytest.mark.parametrize("compiled_model", [False, True], ids=["eager", "torch.compile"])
@pytest.mark.parametrize("mod", ["softcap_sinks", "alibi"])
def test_autograd_end_to_end(mod, compiled_model):
    import torch

    import tiledsl
    q, k, v = (torch.randn(2, 4, 257, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(2, 4, 257, 128, device="cuda", dtype=torch.bfloat16)
    kw = keywords(mod, 2, 4)
    if "sinks" in kw:
        kw["sinks"].requires_grad_(True)

    def loss(q, k, v):
        return (tiledsl.attention(q, k, v, causal=True, **kw).float() * do.float()).sum()

    step = torch.compile(loss, fullgraph=True) if compiled_model else loss
    step(q, k, v).backward()
    ref = reference_grads(kw, q, k, v, do, True)
    got = [q.grad, k.grad, v.grad] + ([kw["sinks"].grad] if "sinks" in kw else [])
    assert all(g is not None for g in got)
    check([rel(g, r) for g, r in zip(got, ref)])


def test_compute_sanitizer_memcheck(tmp_path):
    script = tmp_path / "backward_mods_memcheck.py"
    script.write_text(textwrap.dedent("""
        import torch
        from tiledsl.dispatch.backward import attention_backward
        q, k, v, o, do = (torch.randn(2, 2, 77, 64, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        lse = torch.randn(2, 2, 77, device="cuda") + 6
        lens = torch.tensor([77, 30], device="cuda", dtype=torch.int32)
        sinks = torch.randn(2, device="cuda")
        for kw in ({"softcap": 2.0, "sinks": sinks}, {"alibi_slopes": torch.rand(2, device="cuda")}):
            attention_backward(q, k, v, o, lse, do, causal=True, kv_lens=lens, **kw)
        torch.cuda.synchronize()
    """))
    memcheck(script)
