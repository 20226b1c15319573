"""Flash-decoding on the GPU against the exact float64 reference (tiledsl.reference.gpu): cache lengths
from 1 to 32k, fixed / auto / more-splits-than-tiles, GQA groups packed into one tile, several
queries per sequence with a bottom-right causal mask, per-sequence lengths including 0, both
dtypes, outputs poisoned with NaN before every run.

    python -m pytest -m gpu tests/test_gpu_decode.py
"""
from __future__ import annotations

import functools
import math

import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.spec import AUTO, Axis, DType, KernelSpec, Mask, Problem, Schedule
from tiledsl.runtime.tensors import torch_dtype

from .gpu_support import TOLERANCE_LSE, TOLERANCE_O, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def decode_spec(splits=AUTO, queries=1, dtype=DType.BF16, mask=Mask.NONE, d=128, tile_kv=128, warps=4, stages=2,
                window=(0, 0)) -> KernelSpec:
    problem = Problem(d, d, dtype, mask, window[0], window[1], queries_per_seq=queries)
    schedule = Schedule(tile_q=16, tile_kv=tile_kv, warps=warps, warp_axis=Axis.KV, stages=stages, split_kv=splits)
    return KernelSpec(f"decode_d{d}", problem, schedule)


@functools.lru_cache(maxsize=None)
def kernel_for(spec):
    from tiledsl import compile
    kernel = compile(spec)
    assert type(kernel).__name__ == "DecodeKernel"
    return kernel


def make_inputs(spec, batch, heads, kv_heads, kv_len, kv_lens):
    """Fresh normal q, k, v, NaN-poisoned out / lse, and kv_lens: PyTorch tensors when PyTorch is
    there, else CuPy (fp16 only: CuPy has no bfloat16)."""
    p = spec.problem
    shapes = ((batch, heads, p.queries_per_seq, p.head_dim_qk), (batch, kv_heads, kv_len, p.head_dim_qk),
              (batch, kv_heads, kv_len, p.head_dim_v))
    o_shape = (batch, heads, p.queries_per_seq, p.head_dim_v)
    torch = _torch()
    if torch is not None:
        dtype = torch_dtype(p.dtype)
        q, k, v = (torch.randn(s, device="cuda", dtype=dtype) for s in shapes)
        out = torch.full(o_shape, float("nan"), device="cuda", dtype=dtype)
        lse = torch.full(o_shape[:3], float("nan"), device="cuda", dtype=torch.float32)
        lens = torch.tensor(kv_lens, device="cuda", dtype=torch.int32) if kv_lens is not None else None
        return q, k, v, out, lse, lens
    import cupy
    if p.dtype is not DType.FP16:
        pytest.skip("bf16 without PyTorch: CuPy has no bfloat16")
    q, k, v = (cupy.random.standard_normal(s, dtype=cupy.float32).astype(cupy.float16) for s in shapes)
    out = cupy.full(o_shape, cupy.nan, dtype=cupy.float16)
    lse = cupy.full(o_shape[:3], cupy.nan, dtype=cupy.float32)
    lens = cupy.asarray(kv_lens, dtype=cupy.int32) if kv_lens is not None else None
    return q, k, v, out, lse, lens


def run_decode(spec, batch=2, heads=4, kv_heads=None, kv_len=1000, kv_lens=None):
    """(O error, LSE error, splits used) of one poisoned, validated run."""
    import cupy
    from tiledsl.reference.gpu import lse_error, reference_attention, relative_error
    kv_heads = kv_heads or heads
    q, k, v, out, lse, lens = make_inputs(spec, batch, heads, kv_heads, kv_len, kv_lens)
    kernel = kernel_for(spec)
    kernel(q, k, v, kv_lens=lens, out=out, lse=lse)
    cupy.cuda.Device().synchronize()
    ref_o, ref_lse = reference_attention(spec.problem, q, k, v, kv_lens=lens)
    return relative_error(out, ref_o), lse_error(lse, ref_lse), kernel.last_splits


def check(result):
    err_o, err_lse, _ = result
    assert err_o < TOLERANCE_O, f"O relative error {err_o}"     # inf when any NaN is left
    assert err_lse < TOLERANCE_LSE, f"LSE error {err_lse}"


@pytest.mark.parametrize("splits", [1, 7, 13, AUTO])   # 13: the merge's second load batch is ragged
@pytest.mark.parametrize("kv_len", [1, 17, 1000, 4097, 32768])
def test_cache_lengths_and_splits(kv_len, splits):
    err_o, err_lse, used = run_decode(decode_spec(splits), batch=2, heads=4, kv_len=kv_len)
    check((err_o, err_lse, used))
    if splits != AUTO:
        assert used == splits
    else:
        assert used >= 1


@pytest.mark.parametrize("kv_len,splits", [(1, 5), (17, 64), (1000, 50), (4097, 200)])
def test_more_splits_than_tiles(kv_len, splits):
    # Splits beyond the kv tiles own no key: LSE = -inf, weight 0 in the merge.
    check(run_decode(decode_spec(splits), batch=2, heads=2, kv_len=kv_len))


@pytest.mark.parametrize("splits", [1, 7, AUTO])
@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_groups_and_queries(group, queries, splits):
    # group 8 x 4 queries = 32 packed rows: two row tiles of 16.
    mask = Mask.CAUSAL if queries > 1 else Mask.NONE
    heads = 8 if group > 1 else 4
    check(run_decode(decode_spec(splits, queries=queries, mask=mask), batch=2, heads=heads, kv_heads=heads // group,
                     kv_len=4097))


@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL])
@pytest.mark.parametrize("kv_len", [3, 130, 1000])
def test_several_queries_with_masks(mask, kv_len):
    # 4 queries with kv_len 3 under causal: query 0 sees no key at all (O = 0, LSE = -inf).
    check(run_decode(decode_spec(7, queries=4, mask=mask), batch=2, heads=4, kv_heads=2, kv_len=kv_len))


def test_window_mask():
    check(run_decode(decode_spec(5, queries=4, mask=Mask.WINDOW, window=(300, 0)), batch=2, heads=4, kv_len=4097))


@pytest.mark.parametrize("splits", [1, 7, AUTO])
def test_per_sequence_lengths_with_zero(splits):
    # Sequence 0 is empty: O = 0 and LSE = -inf, never NaN.
    check(run_decode(decode_spec(splits), batch=5, heads=8, kv_heads=2, kv_len=4097, kv_lens=[0, 1, 17, 1000, 4097]))


def test_per_sequence_lengths_causal_queries():
    check(run_decode(decode_spec(AUTO, queries=4, mask=Mask.CAUSAL), batch=4, heads=8, kv_heads=2, kv_len=5000,
                     kv_lens=[0, 2, 4999, 5000]))


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
@pytest.mark.parametrize("splits", [1, AUTO])
def test_dtypes(dtype, splits):
    check(run_decode(decode_spec(splits, dtype=dtype), batch=3, heads=8, kv_heads=2, kv_len=4097))


@pytest.mark.parametrize("tile_kv,warps,stages", [(64, 4, 1), (128, 4, 1), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 2)])
def test_other_schedules(tile_kv, warps, stages):
    check(run_decode(decode_spec(AUTO, tile_kv=tile_kv, warps=warps, stages=stages), batch=2, heads=4, kv_len=4097))


def test_head_dim_64():
    check(run_decode(decode_spec(7, d=64, tile_kv=64), batch=2, heads=4, kv_len=1000))


@pytest.mark.parametrize("batch,heads,kv_heads,kv_len", [(1, 32, 32, 32768), (8, 32, 32, 8192), (4, 32, 8, 65536)])
def test_benchmark_shapes(batch, heads, kv_heads, kv_len):
    err_o, err_lse, used = run_decode(decode_spec(AUTO), batch=batch, heads=heads, kv_heads=kv_heads, kv_len=kv_len)
    check((err_o, err_lse, used))
    assert kernel_for(decode_spec(AUTO)).last_split_reason


def test_repeated_calls_reuse_workspace():
    spec = decode_spec(7)
    for kv_len in (4097, 100, 4097):
        check(run_decode(spec, batch=2, heads=4, kv_len=kv_len))


def test_bad_inputs_are_refused():
    spec = decode_spec(AUTO)
    q, k, v, out, lse, _ = make_inputs(spec, 2, 4, 4, 100, None)
    kernel = kernel_for(spec)
    q4, *_ = make_inputs(decode_spec(AUTO, queries=4), 2, 4, 4, 100, None)
    with pytest.raises(RuntimeInputError, match="queries per sequence"):
        kernel(q4, k, v)
    torch = _torch()
    if torch is not None:
        bad = torch.tensor([5, 101], device="cuda", dtype=torch.int32)
    else:
        import cupy
        bad = cupy.asarray([5, 101], dtype=cupy.int32)
    from .gpu_support import refused_on_host_and_by_the_kernel
    refused_on_host_and_by_the_kernel(lambda validate: kernel(q, k, v, kv_lens=bad, out=out, lse=lse,
                                                              validate=validate), r"kv_lens\[1\] = 101",
                                      r"kv_lens must lie in \[0, 100\]")
    if torch is not None:
        k3 = torch.randn(2, 3, 100, 128, device="cuda", dtype=q.dtype)
        with pytest.raises(RuntimeInputError, match="multiple"):
            kernel(q, k3, k3)


def test_lse_is_natural_log_of_the_scores():
    # One key: LSE = scale * q.k exactly (up to the inputs' rounding), O = v.
    import cupy
    from tiledsl.reference.gpu import as_float64
    from tiledsl.runtime.tensors import view
    spec = decode_spec(3)
    q, k, v, out, lse, _ = make_inputs(spec, 1, 2, 2, 1, None)
    kernel_for(spec)(q, k, v, out=out, lse=lse)
    qd, kd = as_float64(view(q, "q")), as_float64(view(k, "k"))
    expected = (qd[0, :, 0] * kd[0, :, 0]).sum(axis=-1) / math.sqrt(128)
    got = as_float64(view(lse, "lse"))[0, :, 0]
    assert float(cupy.abs(got - expected).max()) < 1e-3
