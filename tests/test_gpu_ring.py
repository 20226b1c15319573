"""tiledsl.distributed on one GPU (pytest -m gpu; skipped without a GPU or torch): the generated merge kernel
against the float64 merge (rows that saw no key, row offsets, strided block outputs, both dtypes, several
head dims), and the whole ring protocol with tiledsl's kernels per block on a ring of threads sharing the GPU
(ring_forward / ring_backward: 2-4 ranks, zigzag and contiguous, causal and not, GQA) against float64
attention of the whole sequence, plus ring_attention through autograd on a one-rank NCCL group.

Bounds (tests/attention_reference.py): O within OUT_TOLERANCE (4 unit roundoffs, max-norm relative), LSE
within gpu_support.TOLERANCE_LSE absolute, gradients within GRAD_TOLERANCE (8 unit roundoffs). The ring
rounds each block's O and gradients to the dtype once before its fp32 sum, one rounding more than
tiledsl.attention's on each term; the bounds leave a factor of 1.6 over that. The merge kernel computes in
fp32 from the block's 16-bit O: MERGE_TOLERANCE is 2^-17 (128 fp32 roundoffs) relative to the max norm."""
from __future__ import annotations

import math
import os

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests import attention_reference as ref  # noqa: E402
from tests.gpu_support import TOLERANCE_LSE  # noqa: E402
from tests.ring_cases import Case, global_inputs  # noqa: E402
from tiledsl.distributed import LocalRing, ring_backward, ring_forward, shard, unshard  # noqa: E402

MERGE_TOLERANCE = 2.0 ** -17
SEED = int.from_bytes(os.urandom(4), "little")


def _relative(x, want) -> float:
    return ref.max_relative_error(x, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv", [64, 128, 40, 256])
def test_the_merge_kernel_matches_the_float64_merge(dtype, dv):
    from tiledsl.distributed.merge import merge_float64, merge_kernel
    from tiledsl.runtime.tensors import view
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    batch, heads, rows, block_rows, start = 2, 3, 300, 170, 77
    o_acc = torch.randn(batch, heads, rows, dv, device="cuda", generator=gen)
    lse_acc = torch.randn(batch, heads, rows, device="cuda", generator=gen) * 4
    wide = torch.randn(batch, heads, block_rows, dv + 16, device="cuda", generator=gen).to(dtype)
    o = wide[..., 8:8 + dv]                     # a strided block output (row stride dv + 16)
    lse = torch.randn(batch, heads, block_rows, device="cuda", generator=gen) * 4
    lse_acc[0, 0, start:start + 5] = -math.inf  # the running side saw no key yet
    lse[0, 1, :7] = -math.inf                   # the block's side saw none
    lse_acc[1, 2, start + 9] = lse[1, 2, 9] = -math.inf   # neither: stays O = 0, LSE = -inf
    o_acc[1, 2, start + 9] = 0.0
    want_o, want_lse = o_acc.double().cpu(), lse_acc.double().cpu()
    merge_float64(want_o, want_lse, o.double().cpu(), lse.double().cpu(), start)
    merge_kernel(view(o, "o").dtype, dv)(o_acc, lse_acc, o, lse, start)
    assert _relative(o_acc.cpu(), want_o) < MERGE_TOLERANCE
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse_acc.cpu()), finite)
    assert float((lse_acc.cpu().double() - want_lse)[finite].abs().max()) < MERGE_TOLERANCE * 16
    assert float(o_acc[1, 2, start + 9].abs().max()) == 0.0


def test_the_merge_kernel_refuses_mismatched_inputs_by_name():
    from tiledsl.distributed.merge import merge_kernel
    from tiledsl.errors import RuntimeInputError
    from tiledsl.spec import DType
    kernel = merge_kernel(DType.BF16, 64)
    acc, lse = torch.zeros(1, 2, 10, 64, device="cuda"), torch.zeros(1, 2, 10, device="cuda")
    o, o_lse = torch.zeros(1, 2, 4, 64, device="cuda", dtype=torch.bfloat16), torch.zeros(1, 2, 4, device="cuda")
    with pytest.raises(RuntimeInputError, match=r"rows \[8, 12\) are not inside o_acc's 10"):
        kernel(acc, lse, o, o_lse, 8)
    with pytest.raises(RuntimeInputError, match="o is fp16, built for bf16"):
        kernel(acc, lse, o.half(), o_lse, 0)
    with pytest.raises(RuntimeInputError, match="o_acc must be a contiguous fp32 tensor"):
        kernel(acc.half(), lse, o, o_lse, 0)


GPU_CASES = [Case(2, "zigzag", True, batch=1, heads=4, kv_heads=2, tokens=2048, head_dim=128, head_dim_v=128),
             Case(4, "zigzag", True, batch=1, heads=4, kv_heads=4, tokens=4096, head_dim=128, head_dim_v=128),
             Case(3, "contiguous", True, batch=2, heads=2, kv_heads=1, tokens=1536, head_dim=64, head_dim_v=64),
             Case(2, "zigzag", False, batch=1, heads=4, kv_heads=1, tokens=2048, head_dim=64, head_dim_v=64),
             Case(4, "contiguous", False, batch=1, heads=2, kv_heads=2, tokens=2048, head_dim=128, head_dim_v=128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=Case.label)
def test_a_ring_of_threads_on_one_gpu_matches_float64_attention(case, dtype):
    q, k, v, do = global_inputs(torch, case, SEED, dtype=dtype, device="cuda")
    o64, lse64, dq64, dk64, dv64 = ref.gradients(q, k, v, do, causal=case.causal)
    kw = dict(causal=case.causal, layout=case.layout, blocks="kernels")
    # compile every kernel the ranks will run on one thread first (else they race to build them)
    from tiledsl.distributed.merge import merge_kernel
    from tiledsl.runtime.tensors import view
    one = LocalRing(1).endpoint(0)
    for causal in {case.causal, False}:
        o_acc, lse = ring_forward(q, k, v, one, **{**kw, "causal": causal})
        ring_backward(q, k, v, o_acc.to(dtype), lse, do, one, **{**kw, "causal": causal})
    merge_kernel(view(q, "q").dtype, case.head_dim_v)

    def rank_body(endpoint):
        mine = [shard(x, endpoint.rank, case.world, case.layout) for x in (q, k, v, do)]
        o_acc, lse = ring_forward(*mine[:3], endpoint, **kw)
        o = o_acc.to(dtype)
        dq, dk, dv = ring_backward(*mine[:3], o, lse, mine[3], endpoint, **kw)
        torch.cuda.synchronize()
        return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    ranks = LocalRing(case.world).run(rank_body, timeout_s=300)
    got = {name: unshard([r[name] for r in ranks], case.layout) for name in ranks[0]}
    label = f"{case.label()} {dtype} seed {SEED}"
    assert got["o"].dtype == dtype and got["dq"].dtype == torch.float32
    assert _relative(got["o"], o64) < ref.OUT_TOLERANCE[str(dtype)[6:]], label
    assert float((got["lse"].double() - lse64).abs().max()) < TOLERANCE_LSE, label
    for name, want in (("dq", dq64), ("dk", dk64), ("dv", dv64)):
        error = _relative(got[name].to(dtype), want)
        assert error < ref.grad_tolerance(dtype), f"{label}: {name} off by {error:.3g}"


def test_ring_attention_through_autograd_on_a_one_rank_nccl_group(tmp_path):
    import torch.distributed as dist

    from tiledsl.distributed import ring_attention
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        case = Case(1, "zigzag", True, batch=1, heads=4, kv_heads=2, tokens=1024, head_dim=128, head_dim_v=128)
        q, k, v, do = global_inputs(torch, case, SEED, dtype=torch.bfloat16, device="cuda")
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o, lse = ring_attention(q, k, v, causal=True, return_lse=True)
        o.backward(do)
        o64, lse64, dq64, dk64, dv64 = ref.gradients(q, k, v, do, causal=True)
        assert _relative(o.detach(), o64) < ref.OUT_TOLERANCE["bfloat16"]
        assert float((lse.double() - lse64).abs().max()) < TOLERANCE_LSE
        for got, want in ((q.grad, dq64), (k.grad, dk64), (v.grad, dv64)):
            assert got.dtype == torch.bfloat16 and _relative(got, want) < ref.grad_tolerance(torch.bfloat16)
    finally:
        dist.destroy_process_group()
