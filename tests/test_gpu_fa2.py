"""FA2 on the GPU against the exact float64 reference: every claimed head dim, masks, ragged and
unequal lengths, GQA, per-sequence lengths, both dtypes, (b, s, h, d) memory, poisoned outputs."""
from __future__ import annotations

import textwrap

import pytest

from tiledsl.spec import DType, KernelSpec, Mask, Mma, Problem, Schedule

from .gpu_support import MASKS, check, memcheck, requires_gpu, run_case

pytestmark = [pytest.mark.gpu, requires_gpu]

SCHEDULES = {64: Schedule(tile_q=128, tile_kv=64, warps=4), 96: Schedule(tile_q=128, tile_kv=64, warps=8),
             128: Schedule(tile_q=128, tile_kv=128, warps=8), 256: Schedule(tile_q=64, tile_kv=64, warps=4)}


def fa2(d, mask="none", dtype=DType.BF16, schedule=None):
    kind, left, right = MASKS[mask]
    kind = Mask(kind)
    return KernelSpec(f"fa2_d{d}", Problem(d, d, dtype, kind, left, right), schedule or SCHEDULES[d])


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("seqlen", [1, 17, 1000, 4097])
def test_lengths_and_masks(d, mask, seqlen):
    check(run_case(fa2(d, mask), batch=2, heads=3, q_len=seqlen, kv_len=seqlen))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_long_sequence(d, mask):
    check(run_case(fa2(d, mask), batch=1, heads=2, q_len=8192, kv_len=8192))


@pytest.mark.parametrize("d", [96, 256])
@pytest.mark.parametrize("mask", list(MASKS))
def test_other_head_dims(d, mask):
    check(run_case(fa2(d, mask), batch=2, heads=2, q_len=1000, kv_len=777))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("q_len,kv_len", [(300, 1000), (1000, 300), (1, 4097), (129, 64)])
def test_unequal_lengths_incl_fully_masked_rows(mask, q_len, kv_len):
    # q_len > kv_len under a causal mask leaves the first rows with no visible key: O = 0, LSE = -inf.
    check(run_case(fa2(64, mask), batch=2, heads=2, q_len=q_len, kv_len=kv_len))


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
@pytest.mark.parametrize("d", [64, 128])
def test_dtypes(dtype, d):
    check(run_case(fa2(d, "causal", dtype), batch=2, heads=2, q_len=1000, kv_len=1000))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_strided_layouts(layout):
    check(run_case(fa2(128, "causal"), batch=2, heads=4, q_len=1000, kv_len=1000, layout=layout))


@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("groups", [None, 1, 2, 5, 13, 30])
def test_launch_orders(mask, groups):
    # 30 pairs of 9 query tiles cut into equal groups (5, 13: sizes differ), one global list (1),
    # one group per pair (30), and the automatic choice: each must cover every tile once.
    check(run_case(fa2(128, mask, schedule=Schedule(tile_q=128, tile_kv=64, warps=4)), batch=3, heads=10,
                   q_len=1100, kv_len=1100, order_groups=groups))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa(group):
    check(run_case(fa2(128, "causal"), batch=2, heads=8, kv_heads=8 // group, q_len=513, kv_len=513))


def test_per_sequence_kv_lengths_with_an_empty_sequence():
    check(run_case(fa2(64, "causal"), batch=4, heads=2, q_len=100, kv_len=1000, kv_lens=[1000, 0, 17, 640]))


@pytest.mark.parametrize("stages,tiles", [(1, (64, 32, 4)), (3, (128, 64, 8)), (4, (64, 64, 4))])
def test_pipeline_depths(stages, tiles):
    tq, tkv, warps = tiles
    spec = fa2(64, "window", schedule=Schedule(tile_q=tq, tile_kv=tkv, warps=warps, stages=stages))
    check(run_case(spec, batch=2, heads=2, q_len=1000, kv_len=1000))


WGMMA = {64: Schedule(tile_q=128, tile_kv=64, warps=8, stages=3, mma=Mma.WGMMA),
         128: Schedule(tile_q=128, tile_kv=128, warps=8, stages=2, mma=Mma.WGMMA),
         256: Schedule(tile_q=128, tile_kv=64, warps=8, stages=2, mma=Mma.WGMMA)}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seqlen", [1, 17, 1000, 4097])
def test_wgmma_lengths_masks_head_dims(d, mask, seqlen):
    check(run_case(fa2(d, mask, schedule=WGMMA[d]), batch=2, heads=3, q_len=seqlen, kv_len=seqlen))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("q_len,kv_len", [(300, 1000), (1000, 300), (1, 4097), (129, 64)])
def test_wgmma_unequal_lengths_incl_fully_masked_rows(mask, q_len, kv_len):
    check(run_case(fa2(128, mask, schedule=WGMMA[128]), batch=2, heads=2, q_len=q_len, kv_len=kv_len))


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_wgmma_dtypes_and_layouts(dtype, layout):
    check(run_case(fa2(128, "causal", dtype, schedule=WGMMA[128]), batch=2, heads=4, q_len=1000, kv_len=1000, layout=layout))


def test_wgmma_gqa_kv_lens_long_and_one_warpgroup():
    check(run_case(fa2(64, "causal", schedule=WGMMA[64]), batch=2, heads=8, kv_heads=2, q_len=513, kv_len=513))
    check(run_case(fa2(128, "causal", schedule=WGMMA[128]), batch=4, heads=2, q_len=100, kv_len=1000,
                   kv_lens=[1000, 0, 17, 640]))
    check(run_case(fa2(128, "none", schedule=WGMMA[128]), batch=1, heads=2, q_len=8192, kv_len=8192))
    one = Schedule(tile_q=64, tile_kv=128, warps=4, stages=2, mma=Mma.WGMMA)
    check(run_case(fa2(128, "window", schedule=one), batch=2, heads=3, q_len=1000, kv_len=1000))
    for stages in (1, 3):   # the tuner's spaces hold 1 to 3 stages
        deep = Schedule(tile_q=128, tile_kv=32, warps=8, stages=stages, mma=Mma.WGMMA)
        check(run_case(fa2(64, "causal", schedule=deep), batch=2, heads=3, q_len=1000, kv_len=1000))


def test_bad_inputs_are_refused_before_launch():
    import torch
    from tiledsl.errors import RuntimeInputError
    from tiledsl import compile
    kernel = compile(fa2(64))
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeInputError, match="head_dim 64"):
        kernel(q, torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16), q)
    with pytest.raises(RuntimeInputError, match="fp16"):
        kernel(q.half(), q, q)
    with pytest.raises(RuntimeInputError, match="host"):
        kernel(q.cpu(), q, q)
    with pytest.raises(RuntimeInputError, match="unit stride"):
        kernel(q.transpose(2, 3), q, q)
    from .gpu_support import refused_on_host_and_by_the_kernel
    refused_on_host_and_by_the_kernel(
        lambda validate: kernel(q, q, q, kv_lens=torch.tensor([65], device="cuda", dtype=torch.int32),
                                validate=validate), r"kv_lens\[0\] = 65", r"kv_lens must lie in \[0, 64\]")


def test_memcheck_clean_on_small_shapes(tmp_path):
    """compute-sanitizer memcheck over a ragged causal and windowed run, mma.sync and wgmma."""
    script = tmp_path / "small.py"
    script.write_text(textwrap.dedent("""
        from tiledsl.spec import DType, KernelSpec, Mask, Mma, Problem, Schedule
        from tests.gpu_support import run_case
        from tiledsl.spec import Mma
        schedules = (Schedule(tile_q=64, tile_kv=32, warps=4), Schedule(tile_q=128, tile_kv=64, warps=8, mma=Mma.WGMMA))
        for schedule in schedules:
            for mask, left, right in ((Mask.CAUSAL, 0, 0), (Mask.WINDOW, 30, 5)):
                spec = KernelSpec("m", Problem(64, 64, DType.BF16, mask, left, right), schedule)
                err = run_case(spec, batch=1, heads=2, q_len=77, kv_len=45)
                assert err[0] < 1e-2 and err[1] < 1e-3, err
    """))
    memcheck(script)
