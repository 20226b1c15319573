"""FP8 (e4m3) KV cache decode on the GPU, against the float64 reference that dequantizes the same
bytes (tiledsl.reference.fp8): contiguous and paged (page 16) caches, per-head and per-tensor
scales, 1/4/16 queries, GQA 1/4/8, head dims 64/128 (and 32/96/256 for the fragments path's other
row layouts), bf16 and fp16 q, kv_lens of 0, a page boundary +- 1 and long; both conversion paths
(layout.FP8_CONVERTS: through a shared 16-bit tile, straight into MMA fragments); NaN-poisoned
outputs; the same tolerances as the bf16 decode tests; a compute-sanitizer memcheck.
The API (tiledsl.attention / tiledsl.paged_attention with k_scale / v_scale) and its refusals.

    python -m pytest -m gpu tests/test_gpu_fp8_decode.py
"""
from __future__ import annotations

from dataclasses import replace

import functools
import textwrap

import numpy as np
import pytest

from tiledsl.dispatch.autoschedule import FP8_DECODE_SCHEDULE, fp8_decode_schedule
from tiledsl.errors import RuntimeInputError
from tiledsl.layout.decode import FP8_CONVERTS
from tiledsl.spec import Axis, DType, KernelSpec, KvScale, Mask, Problem, Schedule

from .gpu_support import TOLERANCE_LSE, TOLERANCE_O, memcheck, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

LENS = (0, 15, 16, 17, 300)   # empty, a page of 16 +- 1, long (several tiles and splits)


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


BUNDLED = (128, 1)   # specs/decode_d128.tile's (tile kv, stages)
# The schedule the API runs for FP8 (autoschedule.fp8_decode_schedule), when it is another one.
API_PICKS = [fp8_decode_schedule()] if FP8_DECODE_SCHEDULE is not None else []


def spec_of(d, queries, page, dtype, kv_scale, split=5, schedule=BUNDLED, convert=None):
    """`schedule`: (tile kv, stages) or autoschedule's FP8 schedule (a Schedule); `convert`:
    layout.FP8_CONVERTS (None: the default, or the Schedule's)."""
    mask = Mask.CAUSAL if queries > 1 else Mask.NONE
    problem = Problem(d, d, dtype, mask, queries_per_seq=queries, kv_page_size=page, kv_dtype=DType.E4M3,
                      kv_scale=kv_scale)
    if isinstance(schedule, Schedule):
        sch = replace(schedule, split_kv=split)
    else:
        tile_kv, stages = schedule
        sch = Schedule(tile_q=16, tile_kv=tile_kv, warps=4, warp_axis=Axis.KV, stages=stages, split_kv=split)
    if convert is not None:
        sch = replace(sch, fp8_convert=convert)
    return KernelSpec(f"fp8_d{d}", problem, sch)


@functools.lru_cache(maxsize=None)
def kernel_for(spec):
    from tiledsl import compile
    return compile(spec)


def errors(out, lse, ref_o, ref_lse):
    out, lse = np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
    err_o = np.inf if not np.isfinite(out).all() else np.linalg.norm(out - ref_o) / (np.linalg.norm(ref_o) or 1.0)
    finite = np.isfinite(ref_lse)
    if np.isnan(lse).any() or (np.isfinite(lse) != finite).any():
        return err_o, np.inf
    return err_o, float(np.abs(lse[finite] - ref_lse[finite]).max()) if finite.any() else 0.0


def check(err):
    assert err[0] < TOLERANCE_O, f"O relative error {err[0]}"
    assert err[1] < TOLERANCE_LSE, f"LSE error {err[1]}"


def fp8_tensor(torch, shape, scale_range=4.0):
    """Random e4m3 values over a wide range (incl. subnormals), as float8_e4m3fn."""
    x = torch.randn(*shape, device="cuda") * scale_range
    return x.to(torch.float8_e4m3fn)


def scales(torch, kind, kv_heads):
    if kind is KvScale.PER_HEAD:
        return (torch.rand(kv_heads, device="cuda") * 0.5 + 0.05, torch.rand(kv_heads, device="cuda") * 0.5 + 0.05)
    return 0.3, torch.tensor([0.7], device="cuda")


def host_bytes(t):
    import torch
    return t.view(torch.uint8).cpu().numpy()


def host_scale(s):
    return np.asarray(s.cpu().numpy() if hasattr(s, "cpu") else s, dtype=np.float64)


@pytest.mark.parametrize("kind", [KvScale.PER_HEAD, KvScale.PER_TENSOR])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("queries", [1, 4, 16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("convert", FP8_CONVERTS)
def test_fp8_contiguous(torch, convert, d, queries, group, dtype, kind, schedule=BUNDLED):
    from tiledsl.reference.fp8 import attention_fp8
    spec = spec_of(d, queries, None, dtype, kind, schedule=schedule, convert=convert)
    batch, kv_heads = len(LENS), 2
    heads, n = kv_heads * group, max(LENS)
    tdt = getattr(torch, DTYPES_TORCH[dtype])
    q = torch.randn(batch, heads, queries, d, device="cuda", dtype=tdt)
    k, v = fp8_tensor(torch, (batch, kv_heads, n, d)), fp8_tensor(torch, (batch, kv_heads, n, d))
    lens = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    ks, vs = scales(torch, kind, kv_heads)
    out = torch.full((batch, heads, queries, d), float("nan"), device="cuda", dtype=tdt)
    lse = torch.full((batch, heads, queries), float("nan"), device="cuda", dtype=torch.float32)
    kernel_for(spec)(q, k, v, kv_lens=lens, out=out, lse=lse, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    ref_o, ref_lse = attention_fp8(q.double().cpu().numpy(), host_bytes(k), host_bytes(v), host_scale(ks),
                                   host_scale(vs), np.asarray(LENS), mask=spec.problem.mask)
    check(errors(out.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse))


DTYPES_TORCH = {DType.BF16: "bfloat16", DType.FP16: "float16"}


@pytest.mark.parametrize("kind", [KvScale.PER_HEAD, KvScale.PER_TENSOR])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("queries", [1, 4, 16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("convert", FP8_CONVERTS)
def test_fp8_paged(torch, convert, d, queries, group, dtype, kind, schedule=BUNDLED):
    from tiledsl.reference.fp8 import paged_attention_fp8
    page, kv_heads = 16, 2
    spec = spec_of(d, queries, page, dtype, kind, schedule=schedule, convert=convert)
    batch, heads = len(LENS), kv_heads * group
    rng = np.random.default_rng()
    need = [-(-n // page) for n in LENS]
    num_pages = sum(need) + 3
    order = rng.permutation(num_pages)
    table = np.full((batch, max(need)), -1, dtype=np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used:used + n]
        used += n
    tdt = getattr(torch, DTYPES_TORCH[dtype])
    q = torch.randn(batch, queries, heads, d, device="cuda", dtype=tdt)
    kc, vc = fp8_tensor(torch, (num_pages, page, kv_heads, d)), fp8_tensor(torch, (num_pages, page, kv_heads, d))
    tt, lens = torch.tensor(table, device="cuda"), torch.tensor(LENS, device="cuda", dtype=torch.int32)
    ks, vs = scales(torch, kind, kv_heads)
    out = torch.full((batch, queries, heads, d), float("nan"), device="cuda", dtype=tdt)
    lse = torch.full((batch, heads, queries), float("nan"), device="cuda", dtype=torch.float32)
    kernel_for(spec)(q, kc, vc, tt, lens, out=out, lse=lse, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    ref_o, ref_lse = paged_attention_fp8(q.double().cpu().numpy(), host_bytes(kc), host_bytes(vc), host_scale(ks),
                                         host_scale(vs), table, np.asarray(LENS, dtype=np.int32), mask=spec.problem.mask)
    check(errors(out.float().cpu().numpy(), lse.transpose(1, 2).cpu().numpy(), ref_o, ref_lse))


# The API's FP8 schedule (a smaller sweep: per-head scales, 1 and 16 queries).
@pytest.mark.parametrize("schedule", API_PICKS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("queries", [1, 16])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_api_schedule(torch, d, queries, group, dtype, paged, schedule):
    test = test_fp8_paged if paged else test_fp8_contiguous
    test(torch, None, d, queries, group, dtype, KvScale.PER_HEAD, schedule=schedule)


# The fragments path's other e4m3 row layouts: 32-byte rows (swizzled across 4 rows of a line),
# 96, 160, 192, 224 (padded to an odd number of chunks), 256 (swizzled like 128); from 192 Q's
# fragments come from shared memory (layout.FP8_FRAGMENT_REGISTERS); the API's tile kv
# (autoschedule.fp8_decode_schedule: 64 above 192); GQA 4, both scale kinds.
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("kind", [KvScale.PER_HEAD, KvScale.PER_TENSOR])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("queries", [1, 16])
@pytest.mark.parametrize("d", [32, 96, 160, 192, 224, 256])
def test_fp8_fragments_head_dims(torch, d, queries, dtype, kind, paged):
    test = test_fp8_paged if paged else test_fp8_contiguous
    test(torch, "fragments", d, queries, 4, dtype, kind, schedule=(fp8_decode_schedule(d).tile_kv, 1))


# The fragments path with 2 stages and a 64-key tile (16 keys a warp: one ldmatrix per k pair),
# and with a min-blocks-per-SM promise of 3.
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("schedule", [(64, 2), (64, 4), (128, 2)])
def test_fp8_fragments_schedules(torch, schedule, dtype, paged):
    test = test_fp8_paged if paged else test_fp8_contiguous
    test(torch, "fragments", 128, 4, 4, dtype, KvScale.PER_HEAD, schedule=schedule)


def test_fp8_fragments_min_blocks(torch):
    sch = Schedule(tile_q=16, tile_kv=64, warps=4, warp_axis=Axis.KV, stages=2, split_kv=5, min_blocks=3)
    test_fp8_contiguous(torch, "fragments", 128, 4, 4, DType.BF16, KvScale.PER_HEAD, schedule=sch)
    test_fp8_paged(torch, "fragments", 128, 4, 4, DType.FP16, KvScale.PER_TENSOR, schedule=sch)


def test_fp8_memcheck_clean(tmp_path):
    """compute-sanitizer memcheck over both conversion paths, contiguous and paged, ragged kv_lens."""
    script = tmp_path / "small.py"
    script.write_text(textwrap.dedent("""
        import torch
        from tests import test_gpu_fp8_decode as t
        from tiledsl.spec import DType, KvScale
        for convert in ("shared", "fragments"):
            for d in (64, 128):
                t.test_fp8_contiguous(torch, convert, d, 4, 4, DType.BF16, KvScale.PER_HEAD)
                t.test_fp8_paged(torch, convert, d, 1, 8, DType.FP16, KvScale.PER_TENSOR)
    """))
    memcheck(script)


def test_api_contiguous_and_paged(torch):
    import tiledsl
    from tiledsl.reference.fp8 import attention_fp8, paged_attention_fp8
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = fp8_tensor(torch, (2, 2, 200, 128)), fp8_tensor(torch, (2, 2, 200, 128))
    ks = torch.tensor([0.1, 0.2], device="cuda")
    out, lse = tiledsl.attention(q, k, v, k_scale=ks, v_scale=0.5, return_lse=True)
    ref_o, ref_lse = attention_fp8(q.double().cpu().numpy(), host_bytes(k), host_bytes(v), host_scale(ks), 0.5)
    check(errors(out.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse))
    # paged: page 16, sequence b in pages [b*13, b*13+13)
    kc = k.permute(0, 2, 1, 3).reshape(2 * 200, 2, 128)[:2 * 13 * 16 - 16].contiguous()
    kc = torch.cat([kc, kc[:16]]).reshape(26, 16, 2, 128)
    vc = fp8_tensor(torch, (26, 16, 2, 128))
    table = torch.arange(26, device="cuda", dtype=torch.int32).reshape(2, 13)
    lens = torch.tensor([200, 17], device="cuda", dtype=torch.int32)
    qp = q.permute(0, 2, 1, 3).contiguous()
    o = tiledsl.paged_attention(qp, kc, vc, table, lens, k_scale=0.25, v_scale=ks)
    ref_o, _ = paged_attention_fp8(qp.double().cpu().numpy(), host_bytes(kc), host_bytes(vc), 0.25, host_scale(ks),
                                   table.cpu().numpy(), lens.cpu().numpy())
    check(errors(o.float().cpu().numpy(), np.zeros(1), ref_o, np.zeros(1)))


def test_api_refusals(torch):
    import tiledsl
    q = torch.randn(1, 4, 17, 128, device="cuda", dtype=torch.bfloat16)
    k = fp8_tensor(torch, (1, 2, 64, 128))
    with pytest.raises(RuntimeInputError, match="decode kernel"):
        tiledsl.attention(q, k, k)                       # q_len 17: prefill over FP8 is refused
    qd = q[:, :, :1]
    with pytest.raises(RuntimeInputError, match="float8_e4m3fn"):
        tiledsl.attention(qd, k, torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(RuntimeInputError, match="k_scale"):
        tiledsl.attention(qd, k, k, k_scale=torch.ones(3, device="cuda"))   # 3 values for 2 kv heads
    with pytest.raises(RuntimeInputError, match="k_scale"):
        tiledsl.attention(qd, k, k, k_scale=torch.ones(2, device="cuda", dtype=torch.float64))
    kb = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeInputError, match="FP8"):
        tiledsl.attention(qd, kb, kb, k_scale=0.5)
