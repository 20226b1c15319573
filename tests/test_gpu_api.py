"""`tiledsl.attention` on a real GPU (pytest -m gpu; skipped without one): every head dim it serves
(each at least once, dtypes, masks and q_len < / > kv_len spread over them), decode for q_len
1..16, return_lse, kv_lens including 0, launches on the caller's stream, and CUDA-graph capture.

Outputs are NaN-poisoned (an autouse fixture fills what attention allocates before the kernel
runs), so an element a kernel fails to write fails the test. Every kernel is compiled up front, in
parallel threads, into the disk cache: the file stays well under two minutes on an H200."""
from __future__ import annotations

import concurrent.futures

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tiledsl.dispatch import kernels as loaded
from .gpu_support import poison_outputs
from tiledsl.runtime import compile as runtime_compile, device, launch
from tiledsl.dispatch import tuned
from tiledsl import attention
from tiledsl.errors import RuntimeInputError  # noqa: E402
from tiledsl.spec import DType, Family, Mask  # noqa: E402
from tiledsl.runtime.tensors import torch_dtype
from tiledsl.reference.gpu import lse_error, reference_attention, relative_error

TOLERANCE_O, TOLERANCE_LSE = 1e-2, 1e-3
SERVED = list(range(16, 257, 16))
MASKS = ("none", "causal", "window")
WINDOW = (100, 20)
BATCH, HEADS = 2, 4


def prefill_case(i: int) -> dict:
    """Case i of the head-dim sweep: dtype, mask, which of q/kv is longer and GQA rotate with i so
    each dtype meets every mask and both length orders."""
    return dict(d=SERVED[i], dtype=(DType.BF16, DType.FP16)[i % 2], mask=MASKS[i % 3],
                q_len=(300, 517)[(i // 2) % 2], kv_len=(517, 300)[(i // 2) % 2], kv_heads=2 if i % 4 == 3 else HEADS)


def decode_case(q_len: int) -> dict:
    """q_len 1..16, each with its own head dim (16 * q_len; decode serves 64 and 128, prefill the
    rest), dtype and mask."""
    i = q_len - 1
    return dict(d=SERVED[i], dtype=(DType.BF16, DType.FP16)[i % 2], mask=MASKS[i % 3], q_len=q_len,
                kv_len=1000 + 37 * q_len, kv_heads=2 if i % 4 == 3 else HEADS)


PREFILL = [prefill_case(i) for i in range(len(SERVED))]
DECODE = [decode_case(n) for n in range(1, 17)]


def _kwargs(case: dict) -> dict:
    return {"causal": case["mask"] == "causal", "window": WINDOW if case["mask"] == "window" else None}


def _spec(case: dict):
    mask = {"none": Mask.NONE, "causal": Mask.CAUSAL, "window": Mask.WINDOW}[case["mask"]]
    spec, _ = tuned.tuned_spec(device.device_arch(), case["dtype"], case["d"], mask, case["d"],
                               WINDOW if mask is Mask.WINDOW else None, None, case["q_len"])
    return spec


def _inputs(case: dict, batch: int = BATCH, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype, d = torch_dtype(case["dtype"]), case["d"]

    def make(heads, n):
        return torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, generator=gen)
    return make(HEADS, case["q_len"]), make(case["kv_heads"], case["kv_len"]), make(case["kv_heads"], case["kv_len"])


def _errors(case: dict, q, k, v, out, lse, kv_lens=None) -> tuple[float, float]:
    torch.cuda.synchronize()
    problem = _spec(case).problem
    ref_o, ref_lse = reference_attention(problem, q, k, v, kv_lens=kv_lens)
    return relative_error(out, ref_o), lse_error(lse, ref_lse)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Every kernel the file runs, compiled in parallel into the disk cache (NVRTC releases the GIL)."""
    from tiledsl.families import compile
    arch = device.device_arch()
    kernels = {spec: compile(spec) for spec in {_spec(c) for c in PREFILL + DECODE}}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: runtime_compile.compile_cubin(k.source, k.name, arch), kernels.values()))
    for kernel in kernels.values():
        loaded.add(kernel)   # attention() finds them built
    return kernels


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """attention's outputs start as NaN (filled on the launch stream, before the kernel)."""
    poison_outputs(monkeypatch)
    yield
    launch.clear_prepared()


# ---- numerics --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", PREFILL, ids=lambda c: f"d{c['d']}-{c['dtype'].value}-{c['mask']}-q{c['q_len']}kv{c['kv_len']}")
def test_every_served_head_dim(case):
    q, k, v = _inputs(case)
    out, lse = attention(q, k, v, return_lse=True, **_kwargs(case))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    err_o, err_lse = _errors(case, q, k, v, out, lse)
    assert err_o < TOLERANCE_O and err_lse < TOLERANCE_LSE, (_spec(case).kernel_name, err_o, err_lse)


@pytest.mark.parametrize("case", DECODE, ids=lambda c: f"nq{c['q_len']}-d{c['d']}-{c['dtype'].value}-{c['mask']}")
def test_decode_for_few_queries(case):
    from tiledsl.dispatch.autoschedule import DECODE_HEAD_DIMS
    assert (_spec(case).family is Family.DECODE) == (case["d"] in DECODE_HEAD_DIMS)
    q, k, v = _inputs(case)
    out, lse = attention(q, k, v, return_lse=True, **_kwargs(case))
    err_o, err_lse = _errors(case, q, k, v, out, lse)
    assert err_o < TOLERANCE_O and err_lse < TOLERANCE_LSE, (_spec(case).kernel_name, err_o, err_lse)


@pytest.mark.parametrize("d", [4, 12, 100, 264])   # multiples of 8 up to 256: tests/test_gpu_headdims.py
def test_head_dims_not_served_are_refused_by_name(d):
    q = torch.randn(1, 2, 64, d, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeInputError, match=f"head dim {d} is not supported.*8, 16, 24"):
        attention(q, q, q)


def test_return_lse_false_returns_o_alone():
    case = PREFILL[5]
    q, k, v = _inputs(case)
    out = attention(q, k, v, **_kwargs(case))
    again, _ = attention(q, k, v, return_lse=True, **_kwargs(case))
    assert torch.is_tensor(out) and torch.equal(out, again)


@pytest.mark.parametrize("case", [PREFILL[5], DECODE[7]], ids=["prefill", "decode"])
def test_kv_lens_including_zero(case):
    q, k, v = _inputs(case, batch=3)
    lens = torch.tensor([0, case["kv_len"], 3], device="cuda", dtype=torch.int32)
    out, lse = attention(q, k, v, kv_lens=lens, return_lse=True, **_kwargs(case))
    err_o, err_lse = _errors(case, q, k, v, out, lse, kv_lens=lens)
    assert err_o < TOLERANCE_O and err_lse < TOLERANCE_LSE
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())   # no keys: O = 0, LSE = -inf


# ---- the caller's stream ------------------------------------------------------------------------------------

STREAM_CASES = [PREFILL[7], PREFILL[5], DECODE[7]]   # hopper (table, d128), fa2 (d96), decode (d128, split kv)
STREAM_IDS = ["hopper", "fa2", "decode"]


@pytest.mark.parametrize("case", STREAM_CASES, ids=STREAM_IDS)
def test_launch_follows_the_callers_side_stream(case):
    q_final, k, v = _inputs(case)
    attention(q_final, k, v, **_kwargs(case))   # compile and load first: the race below is GPU-side only
    expected = attention(q_final, k, v, **_kwargs(case))
    q = torch.zeros_like(q_final)
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.float16) / 128
    torch.cuda.synchronize()
    side = torch.cuda.Stream()   # non-blocking: the legacy default stream does not wait for it
    with torch.cuda.stream(side):
        acc = big
        for _ in range(40):      # ~100 ms of matmuls, then q is written
            acc = acc @ big
        q.copy_(q_final + 0 * acc[0, 0])
        out = attention(q, k, v, **_kwargs(case))
    side.synchronize()
    assert torch.equal(out, expected)   # launched elsewhere, the kernel would read q's zeros


@pytest.mark.parametrize("case", STREAM_CASES, ids=STREAM_IDS)
def test_cuda_graph_capture_and_replay_match_eager(case):
    q, k, v = _inputs(case, seed=1)
    lens = torch.tensor([case["kv_len"] - 5, 7], device="cuda", dtype=torch.int32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # the eager warm-up torch recommends before capture
        attention(q, k, v, kv_lens=lens, **_kwargs(case))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_o, captured_lse = attention(q, k, v, kv_lens=lens, return_lse=True, **_kwargs(case))
    for seed in (2, 3):   # new inputs in the same memory, then replay
        new_q, new_k, new_v = _inputs(case, seed=seed)
        q.copy_(new_q), k.copy_(new_k), v.copy_(new_v)
        graph.replay()
        eager_o, eager_lse = attention(q, k, v, kv_lens=lens, return_lse=True, **_kwargs(case))
        torch.cuda.synchronize()
        assert torch.equal(captured_o, eager_o) and torch.equal(captured_lse, eager_lse)
        err_o, _ = _errors(case, q, k, v, captured_o, captured_lse, kv_lens=lens)
        assert err_o < TOLERANCE_O


def test_fa1_workspace_under_capture():
    """FA1 allocates its workspace per call: from torch's allocator for torch inputs, so it captures."""
    from pathlib import Path

    from tiledsl import compile
    kernel = compile(Path(__file__).resolve().parent.parent / "specs" / "fa1_d64.tile", name="fa1_d64")
    q, k, v = (torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager_o, _ = kernel(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_o, _ = kernel(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured_o, eager_o)
