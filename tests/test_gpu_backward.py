"""GPU tests of the backward kernels (tiledsl/dispatch/backward.py, templates/backward.cu.j2): dQ, dK, dV of
fresh random inputs against float64 torch autograd of standard attention, into NaN-poisoned
outputs (the kernels write every element or the NaN shows). Tolerance: the forward GPU tests'
(gpu_support.TOLERANCE_O = 1e-2 normwise relative error against the float64 reference), for bf16
and fp16 alike. O and LSE come from the float64 reference (cast to the dtype / fp32) so these test
the backward alone; one test runs the forward kernel's O and LSE through it (the autograd contract)."""
from __future__ import annotations

import textwrap

import pytest

from tests.gpu_support import TOLERANCE_O, memcheck, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def reference(q, k, v, do, causal=False, window=None, scale=None, kv_lens=None):
    """(o, lse, dq, dk, dv) in float64 by torch autograd; fully masked rows give zeros, never NaN."""
    import torch
    q, k, v, do = (x.double().detach().requires_grad_(True) for x in (q, k, v, do))
    batch, heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = d ** -0.5 if scale is None else scale
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ ke.transpose(-1, -2)
    rows = torch.arange(q_len, device=q.device)[:, None]
    cols = torch.arange(kv_len, device=q.device)[None, :]
    lens = (kv_lens.long() if kv_lens is not None else torch.full((batch,), kv_len, device=q.device))[:, None, None]
    diag = lens - q_len
    visible = cols[None] < lens
    if causal:
        visible = visible & (cols[None] <= rows[None] + diag)
    if window is not None:
        visible = visible & (cols[None] >= rows[None] + diag - window[0]) & (cols[None] <= rows[None] + diag + window[1])
    visible = visible[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * visible
    total = e.sum(-1, keepdim=True)
    p = e / total.clamp_min(1e-300)
    o = p @ ve
    lse = torch.where(total[..., 0] > 0, m[..., 0] + torch.log(total[..., 0]), torch.full_like(m[..., 0], float("-inf")))
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), lse.detach(), dq, dk, dv


def rel(x, ref):
    import torch
    x = x.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / (ref.norm() or 1.0))


def run(dtype="bf16", d=64, batch=1, heads=2, kv_heads=None, q_len=128, kv_len=128, causal=False, window=None,
        kv_lens=None, deterministic=False, from_forward=False, seed=0, mma=None, poison=False, warp_specialized=None,
        kernel=None, dv=None):
    import torch
    from tiledsl.dispatch.backward import attention_backward
    torch.manual_seed(seed)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, q_len, d, device="cuda", dtype=dt)
    k = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=dt)
    v = torch.randn(batch, kv_heads, kv_len, dv or d, device="cuda", dtype=dt)
    do = torch.randn(batch, heads, q_len, dv or d, device="cuda", dtype=dt)
    lens = torch.tensor(kv_lens, device="cuda", dtype=torch.int32) if kv_lens is not None else None
    o_ref, lse_ref, *grads = reference(q, k, v, do, causal, window, kv_lens=lens)
    if from_forward:
        import tiledsl
        o, lse = tiledsl.attention(q, k, v, causal=causal, window=window, kv_lens=lens, return_lse=True)
    else:
        o, lse = o_ref.to(dt), lse_ref.float()
    if poison:   # NaN blocks of dQ's, dK's, dV's sizes freed into torch's caching allocator: the outputs reuse them
        blocks = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        del blocks
    torch.cuda.synchronize()
    if kernel is not None:   # a compiled backward module of its own (tests of schedule variants)
        out = kernel(q, k, v, o, lse, do, lens)
    else:
        out = attention_backward(q, k, v, o, lse, do, causal=causal, window=window, kv_lens=lens,
                                 deterministic=deterministic, mma=mma, warp_specialized=warp_specialized)
    torch.cuda.synchronize()
    for x, like in zip(out, (q, k, v)):
        assert x.shape == like.shape and x.dtype == like.dtype and x.is_contiguous()
    return [rel(x, ref) for x, ref in zip(out, grads)], out


def check(errors):
    assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV relative errors {errors}"


MASKS = {"none": {}, "causal": {"causal": True}, "window": {"window": (100, 20)}}


@pytest.mark.parametrize("dtype,d", [("bf16", 64), ("bf16", 128), ("fp16", 64), ("fp16", 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("seqlen", [1, 17, 1000])
def test_square(dtype, d, mask, seqlen):
    if dtype == "fp16" and mask == "window":
        pytest.skip("fp16 window: covered with GQA below (fewer modules to compile)")
    check(run(dtype, d, q_len=seqlen, kv_len=seqlen, **MASKS[mask])[0])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_long(d, mask):
    check(run("bf16", d, batch=1, heads=1, q_len=4097, kv_len=4097, **MASKS[mask])[0])


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("q_len,kv_len", [(100, 333), (333, 100), (1, 200), (200, 1)])
def test_q_len_differs(mask, q_len, kv_len):
    check(run("bf16", 64, q_len=q_len, kv_len=kv_len, **MASKS[mask])[0])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_gqa(dtype, mask):
    check(run(dtype, 64, batch=2, heads=6, kv_heads=2, q_len=150, kv_len=190, **MASKS[mask])[0])


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_kv_lens_including_zero(mask):
    errors, (dq, dk, dv) = run("bf16", 128, batch=4, heads=2, q_len=130, kv_len=300, kv_lens=[300, 0, 77, 1],
                               **MASKS[mask])
    check(errors)
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()   # no key: zero gradients, not NaN
    assert not dk[2, :, 77:].any() and not dv[3, :, 1:].any()         # keys past kv_lens get none


@pytest.mark.parametrize("dtype,d,mask", [("bf16", 128, "causal"), ("fp16", 64, "window"), ("bf16", 64, "none")])
def test_deterministic_is_correct_and_bit_identical(dtype, d, mask):
    import torch
    errors, first = run(dtype, d, batch=2, heads=4, kv_heads=2, q_len=300, kv_len=257, deterministic=True, **MASKS[mask])
    check(errors)
    for _ in range(3):
        again = run(dtype, d, batch=2, heads=4, kv_heads=2, q_len=300, kv_len=257, deterministic=True, **MASKS[mask])[1]
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_from_the_forward_kernel(mask):
    check(run("bf16", 128, batch=2, heads=4, kv_heads=2, q_len=513, kv_len=513, from_forward=True, **MASKS[mask])[0])


@pytest.mark.parametrize("d,dv", [(40, 40), (72, 72), (72, 40), (64, 24)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_head_dims_of_multiples_of_8_run_zero_padded(d, dv, mask):
    """Head dims the forward serves but the kernels do not (multiples of 8, not of 16): zero-padded to 16 around
    the kernels (dispatch/backward.PaddedBackward), exact against float64 like the others."""
    check(run("bf16", d, dv=dv, batch=2, heads=4, kv_heads=2, q_len=200, kv_len=300, poison=True, **MASKS[mask])[0])


@pytest.mark.parametrize("d", [40, 72])
def test_padded_head_dims_from_the_forward_kernel(d):
    check(run("fp16", d, batch=2, heads=4, q_len=257, kv_len=257, causal=True, from_forward=True,
              deterministic=True)[0])


def test_bad_inputs_name_the_tensor():
    import torch
    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(RuntimeInputError, match="lse"):
        attention_backward(q, q, q, q, lse.half(), q)
    with pytest.raises(RuntimeInputError, match="do"):
        attention_backward(q, q, q, q, lse, q[:, :, :32])
    with pytest.raises(RuntimeInputError, match="o is fp16"):
        attention_backward(q, q, q, q.half(), lse, q)
    with pytest.raises(RuntimeInputError, match="kv_lens"):
        attention_backward(q, q, q, q, lse, q, kv_lens=torch.tensor([65], device="cuda", dtype=torch.int32), validate=True)


def test_memcheck_clean_on_small_shapes(tmp_path):
    script = tmp_path / "small.py"
    script.write_text(textwrap.dedent("""
        from tests.test_gpu_backward import run, check
        for det in (False, True):
            check(run("bf16", 64, batch=2, heads=4, kv_heads=2, q_len=77, kv_len=45, causal=True, kv_lens=[45, 3],
                      deterministic=det)[0])
            check(run("bf16", 64, q_len=45, kv_len=77, window=(30, 5), deterministic=det)[0])
    """))
    memcheck(script)
