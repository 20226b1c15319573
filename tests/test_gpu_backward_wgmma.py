"""GPU tests of the wgmma backward (templates/backward_wgmma.cu.j2, attention_backward(mma="wgmma")):
dQ, dK, dV of fresh random inputs against float64 torch autograd of standard attention, as
test_gpu_backward.py does for the mma.sync kernel (its `run` and tolerance), into outputs poisoned
with NaN (blocks of their sizes freed into torch's caching allocator just before the call)."""
from __future__ import annotations

import textwrap

import pytest

from tests.gpu_support import memcheck, requires_gpu
from tests.test_gpu_backward import MASKS, check, run

pytestmark = [pytest.mark.gpu, requires_gpu]


def run_wgmma(*args, **kwargs):
    return run(*args, mma="wgmma", poison=True, **kwargs)


@pytest.mark.parametrize("dtype,d", [("bf16", 64), ("bf16", 128), ("fp16", 64), ("fp16", 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("seqlen", [1, 17, 1000])
def test_square(dtype, d, mask, seqlen):
    check(run_wgmma(dtype, d, q_len=seqlen, kv_len=seqlen, **MASKS[mask])[0])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_long(d, mask):
    check(run_wgmma("bf16", d, batch=1, heads=1, q_len=4097, kv_len=4097, **MASKS[mask])[0])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("q_len,kv_len", [(100, 333), (333, 100), (1, 200), (200, 1)])
def test_q_len_differs(d, mask, q_len, kv_len):
    check(run_wgmma("bf16", d, q_len=q_len, kv_len=kv_len, **MASKS[mask])[0])


@pytest.mark.parametrize("dtype,d", [("bf16", 64), ("fp16", 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_gqa(dtype, d, mask):
    check(run_wgmma(dtype, d, batch=2, heads=6, kv_heads=2, q_len=150, kv_len=190, **MASKS[mask])[0])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_kv_lens_including_zero(d, mask):
    errors, (dq, dk, dv) = run_wgmma("bf16", d, batch=4, heads=2, q_len=130, kv_len=300, kv_lens=[300, 0, 77, 1],
                                     **MASKS[mask])
    check(errors)
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()   # no key: zero gradients, not NaN
    assert not dk[2, :, 77:].any() and not dv[3, :, 1:].any()         # keys past kv_lens get none


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_from_the_forward_kernel(mask):
    check(run_wgmma("bf16", 128, batch=2, heads=4, kv_heads=2, q_len=513, kv_len=513, from_forward=True,
                    **MASKS[mask])[0])


def test_fresh_inputs_agree_with_mma_sync():
    """Two seeds, both kernels: the same function of the inputs (errors of the same size)."""
    for seed in (1, 2):
        for mma in ("wgmma", "mma.sync"):
            check(run("bf16", 128, batch=2, heads=2, q_len=700, kv_len=700, causal=True, seed=seed, mma=mma,
                      poison=True)[0])


def test_refusals_are_clear():
    import torch
    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(RuntimeInputError, match="head dims"):
        attention_backward(q, q, q, q, lse, q, mma="wgmma")
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeInputError, match="deterministic"):
        attention_backward(q, q, q, q, lse, q, mma="wgmma", deterministic=True)


def test_memcheck_clean_on_small_shapes(tmp_path):
    script = tmp_path / "small.py"
    script.write_text(textwrap.dedent("""
        from tests.test_gpu_backward import run, check
        for d in (64, 128):
            check(run("bf16", d, batch=2, heads=4, kv_heads=2, q_len=77, kv_len=45, causal=True, kv_lens=[45, 3],
                      mma="wgmma")[0])
            check(run("fp16", d, q_len=45, kv_len=177, window=(30, 5), mma="wgmma")[0])
    """))
    memcheck(script)
