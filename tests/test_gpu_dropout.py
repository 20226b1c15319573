"""GPU tests of dropout (`tiledsl.attention(..., dropout_p=)`, attention_backward(dropout_p=, dropout_rng=)): the
hopper forward's O and LSE and the warp-specialized backward's dQ, dK, dV of fresh random inputs against the float64
reference (tiledsl.reference, which draws the same Philox keep mask from the same (seed, offset): mods/philox.py)
into outputs poisoned with NaN, at p 0.1 and 0.5, no mask and causal, GQA, seqlens 1, 17 and 1000, kv_lens with a 0;
the kernel's mask read back bit for bit (q = 0 and V = I make O the scaled mask) and its keep rate over a large tile
within 4 sigma of 1 - p; the same seed giving bit-identical O and another seed another O; autograd end to end with
the seed from torch's generator. Eight modules (d128: two masks x two p, forward and backward), compiled in parallel
first."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_support import TOLERANCE_LSE, TOLERANCE_O, float64, poison_outputs, rel, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

D = 128
PS = (0.1, 0.5)


def specs(p: float, causal: bool):
    """(forward spec, backward spec) the API picks for d128 bf16 with dropout p."""
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    mods, _ = modifications("attention", dropout_p=p)
    mask = Mask.CAUSAL if causal else Mask.NONE
    forward, _ = tuned_spec(device_arch(), DType.BF16, D, mask, D, None, None, 1000, mods)
    return forward, chosen_backward_spec(device_arch(), DType.BF16, D, mask, D, None, mods=mods)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """The eight modules, compiled by NVRTC in threads (cubins land in the disk cache)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from tiledsl.runtime.backward import compile_backward
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    from tiledsl.families import compile as compile_spec
    sources = {}
    for p in PS:
        for causal in (False, True):
            forward, backward = specs(p, causal)
            for kernel in (compile_spec(forward), compile_backward(backward)):
                sources[kernel.name] = kernel.source
    assert len(sources) == 8, sorted(sources)
    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(compile_cubin, src, name, device_arch()) for name, src in sources.items()]:
            f.result()
    torch.manual_seed(np.random.SeedSequence().entropy % 2 ** 31)   # fresh inputs per run
    yield


@pytest.fixture
def poisoned(monkeypatch):
    from tiledsl.runtime import launch
    poison_outputs(monkeypatch)
    yield
    launch.clear_prepared()


def inputs(batch, heads, kv_heads, q_len, kv_len):
    import torch
    q = torch.randn(batch, heads, q_len, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, kv_len, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def fresh_rng() -> tuple[int, int]:
    rng = np.random.default_rng()
    return int(rng.integers(0, 1 << 63)) * 2 + int(rng.integers(0, 2)), int(rng.integers(0, 1 << 32)) * 4


def lse_error(out, ref) -> float:
    """Max |LSE - ref| over rows that see a key; inf unless the rows that see none are -inf in both."""
    out = float64(out)
    empty = np.isneginf(ref)
    if not np.array_equal(np.isneginf(out), empty) or not np.isfinite(out[~empty]).all():
        return float("inf")
    return float(np.abs(out[~empty] - ref[~empty]).max(initial=0.0))


def forward_case(p, causal, batch=2, heads=4, kv_heads=2, q_len=1000, kv_len=1000, kv_lens=None):
    """(O error, LSE error, O, the reference O) of a forward with a fresh (seed, 0) against the float64 reference."""
    import torch

    import tiledsl
    from tiledsl.reference.forward import reference_attention
    q, k, v = inputs(batch, heads, kv_heads, q_len, kv_len)
    seed = fresh_rng()[0]
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    o, lse = tiledsl.attention(q, k, v, causal=causal, kv_lens=lens, return_lse=True, dropout_p=p, dropout_seed=seed)
    torch.cuda.synchronize()
    forward, _ = specs(p, causal)
    o64, lse64 = reference_attention(forward, float64(q), float64(k), float64(v),
                                     None if kv_lens is None else np.array(kv_lens), aux={"dropout_rng": (seed, 0)})
    return rel(o, o64), lse_error(lse, lse64), o, o64


@pytest.mark.parametrize("seqlen", [1, 17, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("p", PS)
def test_forward(p, causal, seqlen, poisoned):
    err_o, err_lse, *_ = forward_case(p, causal, q_len=seqlen, kv_len=seqlen)
    assert err_o < TOLERANCE_O and err_lse < TOLERANCE_LSE, (err_o, err_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_forward_kv_lens_including_zero(causal, poisoned):
    err_o, err_lse, o, _ = forward_case(0.1, causal, batch=3, q_len=130, kv_len=300, kv_lens=[300, 0, 77])
    assert err_o < TOLERANCE_O and err_lse < TOLERANCE_LSE, (err_o, err_lse)
    assert not o[1].any()   # no key: O = 0


@pytest.mark.parametrize("p", PS)
def test_the_kernels_mask_is_philoxs_and_keeps_1_minus_p(p, poisoned):
    """q = 0 makes every weight 1 / kv_len and V = I makes O[i, j] = Z_ij / ((1 - p) kv_len): the mask read back,
    against mods/philox.keep_mask bit for bit, and its keep rate within 4 sigma of 1 - p."""
    import torch

    import tiledsl
    from tiledsl.mods.philox import keep_mask
    batch, heads, q_len = 2, 8, 2000
    q = torch.zeros(batch, heads, q_len, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, heads, D, D, device="cuda", dtype=torch.bfloat16)
    v = torch.eye(D, device="cuda", dtype=torch.bfloat16).expand(batch, heads, D, D).contiguous()
    seed, offset = fresh_rng()
    o = tiledsl.attention(q, k, v, dropout_p=p, dropout_seed=seed)   # offset 0 with an explicit seed
    kept = float64(o) > 0
    want = keep_mask(p, seed, 0, heads, np.arange(batch)[:, None, None, None], np.arange(heads)[None, :, None, None],
                     np.arange(q_len)[None, None, :, None], np.arange(D)[None, None, None, :])
    assert np.array_equal(kept, want), f"{(kept != want).sum()} of {kept.size} keep bits differ"
    n = kept.size
    assert abs(kept.mean() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n), kept.mean()
    scaled = float64(o)[kept] * (1 - p) * D
    assert np.allclose(scaled, 1.0, rtol=1e-2), (scaled.min(), scaled.max())


def test_the_same_seed_gives_the_same_bits_and_another_seed_another_o():
    import torch

    import tiledsl
    q, k, v = inputs(2, 4, 2, 700, 700)
    first = tiledsl.attention(q, k, v, causal=True, dropout_p=0.1, dropout_seed=11)
    again = tiledsl.attention(q, k, v, causal=True, dropout_p=0.1, dropout_seed=11)
    other = tiledsl.attention(q, k, v, causal=True, dropout_p=0.1, dropout_seed=12)
    assert torch.equal(first, again) and not torch.equal(first, other)
    torch.manual_seed(5)
    drawn = tiledsl.attention(q, k, v, causal=True, dropout_p=0.1)
    torch.manual_seed(5)
    assert torch.equal(drawn, tiledsl.attention(q, k, v, causal=True, dropout_p=0.1))
    assert not torch.equal(drawn, tiledsl.attention(q, k, v, causal=True, dropout_p=0.1))   # the offset moved on


def backward_case(p, causal, batch=2, heads=4, kv_heads=2, q_len=1000, kv_len=1000, kv_lens=None):
    """(errors of dQ, dK, dV, the gradients) with O and the LSE from the float64 reference forward of a fresh
    (seed, offset): the backward alone."""
    import torch

    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    q, k, v = inputs(batch, heads, kv_heads, q_len, kv_len)
    do = torch.randn(batch, heads, q_len, D, device="cuda", dtype=torch.bfloat16)
    rng = fresh_rng()
    forward, backward = specs(p, causal)
    aux = {"dropout_rng": rng}
    lens64 = None if kv_lens is None else np.array(kv_lens)
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(forward, q64, k64, v64, lens64, aux=aux)
    o, lse = torch.tensor(o64, device="cuda").to(torch.bfloat16), torch.tensor(lse64, device="cuda").float()
    ref = reference_backward(backward, q64, k64, v64, do64, float64(o), lse64, kv_lens=lens64, aux=aux)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    out = attention_backward(q, k, v, o, lse, do, causal=causal, kv_lens=lens, dropout_p=p, dropout_rng=rng)
    torch.cuda.synchronize()
    return [rel(x, r) for x, r in zip(out, ref)], out


@pytest.mark.parametrize("seqlen", [17, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("p", PS)
def test_backward(p, causal, seqlen, poisoned):
    errors, _ = backward_case(p, causal, q_len=seqlen, kv_len=seqlen)
    assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV relative errors {errors}"


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_backward_kv_lens_including_zero(causal, poisoned):
    errors, (dq, dk, dv) = backward_case(0.5, causal, batch=3, q_len=130, kv_len=300, kv_lens=[300, 0, 77])
    assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV relative errors {errors}"
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()
    assert not dk[2, :, 77:].any() and not dv[2, :, 77:].any()


def test_autograd_end_to_end_with_torchs_generator():
    """loss.backward() through attention(dropout_p=0.1): the gradients of the mask the generator's (seed, offset)
    drew, against the float64 reference of the same pair."""
    import torch

    import tiledsl
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    q, k, v = (x.requires_grad_() for x in inputs(2, 4, 2, 257, 257))
    do = torch.randn(2, 4, 257, D, device="cuda", dtype=torch.bfloat16)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    rng = (generator.initial_seed(), generator.get_offset())
    o = tiledsl.attention(q, k, v, causal=True, dropout_p=0.1)
    o.backward(do)
    forward, backward = specs(0.1, True)
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(forward, q64, k64, v64, aux={"dropout_rng": rng})
    assert rel(o, o64) < TOLERANCE_O
    ref = reference_backward(backward, q64, k64, v64, do64, o64, lse64, aux={"dropout_rng": rng})
    errors = [rel(x.grad, r) for x, r in zip((q, k, v), ref)]
    assert all(e < TOLERANCE_O for e in errors), errors
