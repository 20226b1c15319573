"""GPU tests of documents and prefix(n) in the warp-specialized backward: dQ, dK, dV of fresh random inputs against
the float64 reference's gradients (tiledsl.reference.backward, the same mask), O and the LSE from the float64
reference forward, outputs poisoned with NaN; the error bound is the other backward tests' (TOLERANCE_O).
Documents by ids and by bounds crossing tile boundaries, one-token and empty documents, padding ids, q_len != kv_len,
GQA, kv_lens with a 0, causal and none, a window, with softcap / ALiBi / sinks, d64 / d128 / d256, fp16 and bf16;
prefix(n) at 0 keys' worth (n = 1), mid-tile and past kv_len (through a spec: the API has no prefix keyword);
deterministic bits; a training step through tiledsl.attention with requires_grad."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_support import TOLERANCE_O, float64, rel, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def packed(rng, batch, kv_len, mean, pad=True):
    """(ids (batch, kv_len) int32, bounds (batch, documents + 1) int32): random document lengths (one-token ones
    among them), an empty document in bounds, padding (-1) at the end of the ids."""
    ids, bounds = np.full((batch, kv_len), -1, np.int32), []
    for b in range(batch):
        cuts, at = [0], 0
        while at < kv_len:
            at = min(kv_len, at + int(rng.integers(1, 2 * mean)))
            cuts.append(at)
        cuts.insert(2, cuts[1])   # an empty document
        for d in range(len(cuts) - 1):
            ids[b, cuts[d]:cuts[d + 1]] = d
        if pad:
            ids[b, kv_len - int(rng.integers(0, 5)):] = -1
        bounds.append(cuts)
    width = max(map(len, bounds))
    return ids, np.array([c + [c[-1]] * (width - len(c)) for c in bounds], np.int32)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """The document backward modules these tests load, compiled by NVRTC in threads (cubins land in the disk
    cache); fresh inputs per run."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.runtime.backward import compile_backward
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    ids, bounds = np.zeros((1, 8), np.int32), np.array([[0, 8]], np.int32)
    sources = {}
    for kw in ({"document_ids": ids}, {"document_bounds": bounds}, {"document_ids": ids, "softcap": 2.0}):
        mods, _ = modifications("attention_backward", differentiable=True, **kw)
        for d in (64, 128, 256):
            for mask in (Mask.NONE, Mask.CAUSAL):
                for det in (False, True):
                    kernel = compile_backward(chosen_backward_spec(device_arch(), DType.BF16, d, mask, d,
                                                                   deterministic=det, mods=mods))
                    sources[kernel.name] = kernel.source
    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(compile_cubin, src, name, device_arch()) for name, src in sources.items()]:
            f.result()
    torch.manual_seed(np.random.SeedSequence().entropy % 2 ** 31)
    yield


def run(d=128, causal=True, form="ids", q_len=300, kv_len=300, batch=2, heads=4, kv_heads=2, mean=70,
        kv_lens=None, dtype="bfloat16", window=None, deterministic=False, extra=None):
    import torch

    from tiledsl.dispatch.backward import attention_backward, chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    rng = np.random.default_rng()
    tdt = getattr(torch, dtype)
    q = torch.randn(batch, heads, q_len, d, device="cuda").to(tdt)
    k = torch.randn(batch, kv_heads, kv_len, d, device="cuda").to(tdt)
    v = torch.randn(batch, kv_heads, kv_len, d, device="cuda").to(tdt)
    do = torch.randn(batch, heads, q_len, d, device="cuda").to(tdt)
    ids, bounds = packed(rng, batch, kv_len, mean, pad=form == "ids")
    kw = {"document_ids": torch.tensor(ids, device="cuda")} if form == "ids" else \
        {"document_bounds": torch.tensor(bounds, device="cuda")}
    kw |= extra or {}
    mods, _ = modifications("attention_backward", differentiable=True, **kw)
    mask = Mask.WINDOW if window else Mask.CAUSAL if causal else Mask.NONE
    spec = chosen_backward_spec(device_arch(), DType.BF16 if dtype == "bfloat16" else DType.FP16, d, mask, d, window,
                                deterministic=deterministic, mods=mods)
    aux = {name: float64(t) if t.is_floating_point() else t.cpu().numpy() for name, t in kw.items()
           if not isinstance(t, (str, float))}
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    lens64 = None if kv_lens is None else np.array(kv_lens)
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(spec, q64, k64, v64, lens64, aux=aux)
    o, lse = torch.tensor(o64, device="cuda").to(tdt), torch.tensor(lse64, device="cuda").float()
    ref = reference_backward(spec, q64, k64, v64, do64, float64(o), lse64, kv_lens=lens64, aux=aux)
    blocks = [torch.full_like(x, float("nan")) for x in (q, k, v)]   # freed NaN blocks the outputs reuse
    del blocks
    out = attention_backward(q, k, v, o, lse, do, causal=causal, window=window, kv_lens=lens,
                             deterministic=deterministic, **kw)
    torch.cuda.synchronize()
    errors = [rel(x, r) for x, r in zip(out, ref)]
    assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV[, dsink] relative errors {errors} ({spec.name})"
    return out


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("form", ["ids", "bounds"])
def test_documents(d, causal, form):
    run(d, causal, form, q_len=1000, kv_len=1000, mean=150)


@pytest.mark.parametrize("mean", [1, 3, 700])   # one-token documents, short ones, few crossing many tiles
def test_document_lengths(mean):
    run(128, True, "ids", q_len=777, kv_len=777, mean=mean)


@pytest.mark.parametrize("q_len,kv_len", [(100, 333), (333, 100)])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_q_len_differs(q_len, kv_len, causal):
    run(64, causal, "ids", q_len=q_len, kv_len=kv_len, mean=40)


def test_kv_lens_including_zero_and_gqa():
    dq, dk, dv = run(128, True, "ids", batch=3, heads=8, kv_heads=2, q_len=130, kv_len=300, kv_lens=[300, 0, 77])
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()
    assert not dk[2, :, 77:].any() and not dv[2, :, 77:].any()


def test_fp16_and_a_window():
    run(128, True, "bounds", dtype="float16")
    run(64, False, "ids", q_len=600, kv_len=600, window=(100, 20))


@pytest.mark.parametrize("mod", ["softcap", "alibi", "sinks"])
def test_with_score_modifications(mod):
    import torch
    extra = {"softcap": {"softcap": 2.0}, "alibi": {"alibi_slopes": torch.rand(4, device="cuda") * 0.3},
             "sinks": {"sinks": torch.randn(4, device="cuda") * 2}}[mod]
    run(128, True, "ids", q_len=500, kv_len=500, extra=extra)


@pytest.mark.parametrize("dq", ["tma_reduce", "ordered", "atomic"])
@pytest.mark.parametrize("prefix", [1, 100, 333, 5000])
def test_prefix(prefix, dq):
    import torch

    from tiledsl.frontend.parse import parse_text
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    from tiledsl.runtime.backward import compile_backward
    (spec,) = parse_text(f"""attention prefix_bwd {{
    head_dim = 64
    dtype    = bf16
    mask     = prefix({prefix})
    backward {{
        order      kv, q
        tile       q = 128, kv = 128
        warpgroups producer 1 regs 24, consumer 2 regs 240
        pipeline   2 stages via tma
        dq accumulate {dq}
    }}
}}
""", "<prefix>")
    q, do = (torch.randn(2, 4, 400, 64, device="cuda").to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 333, 64, device="cuda").to(torch.bfloat16) for _ in range(2))
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(spec, q64, k64, v64)
    o, lse = torch.tensor(o64, device="cuda").to(torch.bfloat16), torch.tensor(lse64, device="cuda").float()
    ref = reference_backward(spec, q64, k64, v64, do64, float64(o), lse64)
    out = compile_backward(spec)(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    errors = [rel(x, r) for x, r in zip(out, ref)]
    assert all(e < TOLERANCE_O for e in errors), errors


def test_deterministic_bits():
    import torch

    from tiledsl.dispatch.backward import attention_backward
    ids, _ = packed(np.random.default_rng(), 2, 1500, 200)
    ids = torch.tensor(ids, device="cuda")
    q, k, v, o, do = (torch.randn(2, 4, 1500, 128, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(2, 4, 1500, device="cuda") + 8
    first = attention_backward(q, k, v, o, lse, do, causal=True, deterministic=True, document_ids=ids)
    for _ in range(3):
        again = attention_backward(q, k, v, o, lse, do, causal=True, deterministic=True, document_ids=ids)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    run(128, True, "ids", q_len=700, kv_len=700, deterministic=True)


def test_a_training_step_through_attention():
    import torch

    import tiledsl
    ids, _ = packed(np.random.default_rng(), 2, 640, 100)
    ids = torch.tensor(ids, device="cuda")
    q, k, v = (torch.randn(2, 4, 640, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = tiledsl.attention(q, k, v, causal=True, document_ids=ids, deterministic=True)
    do = torch.randn_like(o)
    o.backward(do)
    from tiledsl.dispatch.backward import attention_backward
    o2, lse = tiledsl.attention(q.detach(), k.detach(), v.detach(), causal=True, document_ids=ids, return_lse=True)
    want = attention_backward(q.detach(), k.detach(), v.detach(), o2, lse, do, causal=True, document_ids=ids,
                              deterministic=True)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert torch.equal(got, w)
