"""FA1 (kv outer, O/m/l round-tripping through HBM) on the GPU against the exact float64 reference:
both warp splits, head dims 64 and 128, lengths 1..4097, none / causal / window masks, unequal
lengths with fully masked rows, GQA, per-sequence kv lengths, fp16 and bf16, (b, s, h, d)
memory through a transposed view, outputs poisoned with NaN before every run.

Run: python -m pytest -m gpu tests/test_gpu_fa1.py"""
from __future__ import annotations

import functools

import pytest

from tiledsl.spec import Axis, DType, KernelSpec, LoopOrder, Mask, Problem, Schedule

TOLERANCE_O, TOLERANCE_LSE = 1e-2, 1e-3


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="needs an NVIDIA GPU with CuPy")]

# (tile q, tile kv) per (head dim, warp split), 4 warps: the configs tests/test_fa1_cpu.py compiles.
TILES = {(64, "q"): (64, 64), (128, "q"): (64, 64), (64, "kv"): (64, 128), (128, "kv"): (32, 64)}
MASKS = {"none": (Mask.NONE, 0, 0), "causal": (Mask.CAUSAL, 0, 0), "window": (Mask.WINDOW, 100, 20)}
AXES = ["q", "kv"]


def fa1(d, axis, mask="none", dtype=DType.BF16, stages=2, tiles=None):
    kind, left, right = MASKS[mask]
    tile_q, tile_kv = tiles or TILES[(d, axis)]
    schedule = Schedule(order=LoopOrder.KV_OUTER, tile_q=tile_q, tile_kv=tile_kv, warps=4, warp_axis=Axis(axis),
                        stages=stages)
    return KernelSpec(f"fa1_d{d}_{axis}", Problem(d, d, dtype, kind, left, right), schedule)


@functools.lru_cache(maxsize=None)
def kernel_for(spec):
    from tiledsl import compile
    return compile(spec)


def _has_torch() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def run_case(spec, batch, heads, q_len, kv_len, kv_heads=None, layout="bhsd", kv_lens=None):
    """Fresh normal inputs, NaN-poisoned O and LSE; returns (O relative error, LSE error) against
    the float64 reference. PyTorch tensors where PyTorch is importable, else CuPy (fp16 only).
    layout "bshd" hands in (batch, seqlen, heads, dim) memory as a transposed view."""
    from tiledsl.runtime.tensors import torch_dtype
    from tiledsl.reference.gpu import lse_error, reference_attention, relative_error
    p = spec.problem
    kv_heads = kv_heads or heads
    if _has_torch():
        import torch
        dtype = torch_dtype(p.dtype)

        def make(h, n, d):
            if layout == "bshd":
                return torch.randn(batch, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
            return torch.randn(batch, h, n, d, device="cuda", dtype=dtype)
        out = torch.full((batch, heads, q_len, p.head_dim_v), float("nan"), device="cuda", dtype=dtype)
        lse = torch.full((batch, heads, q_len), float("nan"), device="cuda", dtype=torch.float32)
        lens = torch.tensor(kv_lens, device="cuda", dtype=torch.int32) if kv_lens is not None else None
        sync = torch.cuda.synchronize
    else:
        import cupy
        if p.dtype is not DType.FP16:
            pytest.skip("bf16 without PyTorch: CuPy has no bfloat16")

        def make(h, n, d):
            if layout == "bshd":
                return cupy.random.standard_normal((batch, n, h, d)).astype(cupy.float16).transpose(0, 2, 1, 3)
            return cupy.random.standard_normal((batch, h, n, d)).astype(cupy.float16)
        out = cupy.full((batch, heads, q_len, p.head_dim_v), cupy.nan, dtype=cupy.float16)
        lse = cupy.full((batch, heads, q_len), cupy.nan, dtype=cupy.float32)
        lens = cupy.asarray(kv_lens, dtype=cupy.int32) if kv_lens is not None else None
        sync = cupy.cuda.runtime.deviceSynchronize
    q, k, v = make(heads, q_len, p.head_dim_qk), make(kv_heads, kv_len, p.head_dim_qk), make(kv_heads, kv_len, p.head_dim_v)
    kernel_for(spec)(q, k, v, kv_lens=lens, out=out, lse=lse)
    sync()
    ref_o, ref_lse = reference_attention(p, q, k, v, kv_lens=lens)
    return relative_error(out, ref_o), lse_error(lse, ref_lse)


def check(errors):
    err_o, err_lse = errors
    assert err_o < TOLERANCE_O, f"O relative error {err_o} (inf: NaN in O)"
    assert err_lse < TOLERANCE_LSE, f"LSE error {err_lse} (inf: NaN, or -inf rows differ)"


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("seqlen", [1, 17, 1000, 4097])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("axis", AXES)
def test_lengths_and_masks(axis, d, seqlen, mask):
    # one block per (batch, head) walks all kv tiles: keep batch * heads small at 4097
    batch, heads = (1, 2) if seqlen > 1000 else (2, 3)
    check(run_case(fa1(d, axis, mask), batch=batch, heads=heads, q_len=seqlen, kv_len=seqlen))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("q_len,kv_len", [(300, 1000), (1000, 300), (1, 4097), (129, 64)])
@pytest.mark.parametrize("axis", AXES)
def test_unequal_lengths_incl_fully_masked_rows(axis, q_len, kv_len, mask):
    # q_len > kv_len under a causal mask leaves the first rows with no visible key: O = 0, LSE = -inf;
    # so does a window that ends before key 0.
    check(run_case(fa1(64, axis, mask), batch=2, heads=2, q_len=q_len, kv_len=kv_len))


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("axis", AXES)
def test_dtypes(axis, d, dtype):
    check(run_case(fa1(d, axis, "causal", dtype), batch=2, heads=2, q_len=1000, kv_len=1000))


@pytest.mark.parametrize("axis", AXES)
def test_bshd_layout_through_a_transposed_view(axis):
    check(run_case(fa1(128, axis, "causal"), batch=2, heads=4, q_len=777, kv_len=777, layout="bshd"))


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("axis", AXES)
def test_gqa(axis, group):
    check(run_case(fa1(64, axis, "causal"), batch=2, heads=8, kv_heads=8 // group, q_len=513, kv_len=513))


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("axis", AXES)
def test_per_sequence_kv_lengths_with_an_empty_sequence(axis, mask):
    check(run_case(fa1(64, axis, mask), batch=4, heads=2, q_len=100, kv_len=1000, kv_lens=[1000, 0, 17, 640]))


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("axis", AXES)
def test_pipeline_depths(axis, stages):
    check(run_case(fa1(64, axis, "window", stages=stages), batch=2, heads=2, q_len=1000, kv_len=1000))


def test_split_k_single_pass_and_fp16():
    """Split-K with the whole q tile in one pass (tile q = 32 at d64) and fp16."""
    check(run_case(fa1(64, "kv", "causal", DType.FP16, tiles=(32, 64)), batch=2, heads=2, q_len=333, kv_len=555))


def test_bundled_specs():
    from tiledsl.frontend.parse import load_specs
    from pathlib import Path
    for spec in load_specs(str(Path(__file__).resolve().parent.parent / "specs" / "fa1_d64.tile")):
        check(run_case(spec, batch=2, heads=2, q_len=1000, kv_len=1000))
