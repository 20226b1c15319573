"""The launch path on the GPU: no host sync in any warm call, the prepared launches right on fresh tensors of
one signature (pointers and TMA map addresses rewritten per call), the launch backends agreeing bit for
bit, and the plan/run serving API (planned decode, chunked prefill and varlen; a planned run captured
in a CUDA graph and replayed after a new plan).

Every numeric check is against a float64 reference on fresh random inputs.

    python -m pytest -m gpu tests/test_gpu_door.py
"""
from __future__ import annotations


import numpy as np
import pytest

from .gpu_support import TOLERANCE_O, no_host_sync, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch")

import tiledsl  # noqa: E402
from tests import attention_reference as ref  # noqa: E402

BF16 = torch.bfloat16


def randn(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def o_error(o, ref_o) -> float:
    o, ref_o = o.double(), ref_o.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float(torch.linalg.norm(o - ref_o) / (torch.linalg.norm(ref_o) or 1.0))


def check_attention(o, q, k, v, **mask):
    ref_o, _ = ref.attention(q.double(), k.double(), v.double(), **mask)
    assert o_error(o, ref_o) < TOLERANCE_O


def warm_then_sync_free(call, fresh, runs: int = 2):
    """One cold call (builds and loads the kernel, prepares its launch), then `runs` calls on fresh
    inputs with host syncs made errors; returns the last call's inputs and result."""
    call(*fresh())
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(runs):
            inputs = fresh()
            result = call(*inputs)
    torch.cuda.synchronize()
    return inputs, result


# ---- no host sync -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d, heads, kv_heads, q_len, kv_len, causal", [
    (128, 8, 8, 300, 300, True),     # hopper
    (64, 8, 2, 200, 333, False),     # hopper, GQA
    (96, 4, 4, 257, 300, True),      # fa2 mma.sync (no tuned entry)
    (128, 32, 8, 1, 1000, False),    # decode, split-KV
    (64, 16, 16, 4, 700, True),      # decode, 4 queries
])
@pytest.mark.parametrize("with_lens", [False, True], ids=["", "kv_lens"])
def test_attention_makes_no_host_sync(d, heads, kv_heads, q_len, kv_len, causal, with_lens):
    lens = torch.tensor([kv_len, kv_len // 3], device="cuda", dtype=torch.int32) if with_lens else None
    options = dict(causal=causal, kv_lens=lens)

    def fresh():
        return randn(2, heads, q_len, d), randn(2, kv_heads, kv_len, d), randn(2, kv_heads, kv_len, d)
    (q, k, v), o = warm_then_sync_free(lambda *t: tiledsl.attention(*t, **options), fresh)
    check_attention(o, q, k, v, causal=causal, kv_lens=lens)


def test_attention_over_an_fp8_kv_cache_makes_no_host_sync():
    from tiledsl.reference.fp8 import attention_fp8
    lens = torch.tensor([900, 17], device="cuda", dtype=torch.int32)
    k_scale = torch.rand(8, device="cuda") * 0.5 + 0.05

    def fresh():
        k8, v8 = ((torch.randn(2, 8, 900, 128, device="cuda") * 4).to(torch.float8_e4m3fn) for _ in range(2))
        return randn(2, 32, 1, 128), k8, v8
    (q, k, v), o = warm_then_sync_free(
        lambda *t: tiledsl.attention(*t, kv_lens=lens, k_scale=k_scale, v_scale=0.25), fresh)
    ref_o, _ = attention_fp8(q.double().cpu().numpy(), k.view(torch.uint8).cpu().numpy(),
                             v.view(torch.uint8).cpu().numpy(), k_scale.double().cpu().numpy(), np.asarray(0.25),
                             lens.cpu().numpy())
    assert o_error(o, torch.from_numpy(ref_o).cuda()) < TOLERANCE_O


@pytest.mark.parametrize("with_lens", [False, True], ids=["", "kv_lens"])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_and_backward_through_autograd_make_no_host_sync(d, with_lens):
    """kv_lens too: the forward's and the backward's kernels bound it on the device (no host check)."""
    lens = torch.tensor([256, 131], device="cuda", dtype=torch.int32) if with_lens else None

    def fresh():
        q, k, v = (randn(2, 4, 256, d).requires_grad_() for _ in range(3))
        return q, k, v, randn(2, 4, 256, d)

    def step(q, k, v, do):
        o = tiledsl.attention(q, k, v, causal=True, kv_lens=lens)
        o.backward(do)
        return o
    (q, k, v, do), o = warm_then_sync_free(step, fresh)
    ref_o, _, *ref_grads = ref.gradients(q, k, v, do, causal=True, kv_lens=lens)
    tolerance = ref.grad_tolerance(BF16)
    assert ref.max_relative_error(o, ref_o) < tolerance
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        assert ref.max_relative_error(got, want) < tolerance


def paged_inputs(batch=3, q_len=1, heads=32, kv_heads=8, d=128, page=16, lens=(1000, 17, 513), seed=0, width=None):
    """q, caches, and a host block table (pages in random order; unused entries -1, `width` entries
    per row, default the longest sequence's pages) with host kv_lens."""
    rng = np.random.default_rng(seed)
    need = [-(-n // page) for n in lens]
    width, pages = width or max(need), sum(need) + 2
    order = rng.permutation(pages)
    table = np.full((batch, width), -1, np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used:used + n]
        used += n
    caches = [randn(pages, page, kv_heads, d) for _ in range(2)]
    return (randn(batch, q_len, heads, d), *caches, table, np.asarray(lens, np.int32))


def paged_reference(q, k_cache, v_cache, table, lens, causal):
    from tiledsl.reference.serving import paged_attention as reference
    o, _ = reference(q.float().cpu().numpy(), k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(), table,
                     lens, "causal" if causal else "none")
    return torch.from_numpy(o).cuda()


@pytest.mark.parametrize("q_len", [1, 8, 64], ids=["decode", "decode-8", "chunked-prefill"])
def test_paged_attention_makes_no_host_sync(q_len):
    q, k_cache, v_cache, table, lens = paged_inputs(q_len=q_len)
    table_d, lens_d = torch.from_numpy(table).cuda(), torch.from_numpy(lens).cuda()
    (q,), o = warm_then_sync_free(
        lambda q: tiledsl.paged_attention(q, k_cache, v_cache, table_d, lens_d, causal=q_len > 1),
        lambda: (randn(*q.shape),))
    assert o_error(o, paged_reference(q, k_cache, v_cache, table, lens, q_len > 1)) < TOLERANCE_O


def test_varlen_attention_with_max_seqlens_makes_no_host_sync():
    from tiledsl.reference.serving import varlen_attention as reference
    lengths = [300, 17, 1000, 129]
    cu_host = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu = torch.from_numpy(cu_host).cuda()
    total = int(cu_host[-1])

    def fresh():
        return randn(total, 16, 128), randn(total, 4, 128), randn(total, 4, 128)
    (q, k, v), o = warm_then_sync_free(
        lambda q, k, v: tiledsl.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True), fresh)
    ref_o, _ = reference(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(), cu_host, cu_host,
                         mask="causal")
    assert o_error(o, torch.from_numpy(ref_o).cuda()) < TOLERANCE_O


# ---- the prepared launch on fresh tensors; the backends ------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128, 96])
def test_each_call_of_a_signature_reads_its_own_tensors(d):
    """Pointers (fa2) and TMA map addresses (hopper: one word rewritten per call) follow the tensors."""
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = randn(1, 4, 333, d), randn(1, 4, 333, d), randn(1, 4, 333, d)
        check_attention(tiledsl.attention(q, k, v, causal=True), q, k, v, causal=True)


def test_tma_map_address_field_is_found_and_patching_matches_encoding():
    from tiledsl.runtime import tensor_maps
    from tiledsl.runtime.tensors import view
    x = randn(2, 8, 256, 128)
    t = view(x, "q")
    words = tensor_maps.encode(t, 64)
    field = tensor_maps.address_field(t, 64, words)
    assert field is not None, "the address of an encoded map was not in one word: every call re-encodes"
    word, base, shift = field
    other = randn(2, 8, 256, 128)
    patched = list(words)
    patched[word] = (base + (other.data_ptr() >> shift)) & ((1 << 64) - 1)
    assert tuple(patched) == tensor_maps.encode(view(other, "q"), 64)


@pytest.mark.parametrize("backend", ["cupy", "cuda-bindings"])
def test_launch_backends_agree_bit_for_bit(backend, monkeypatch):
    from tiledsl.runtime import launch
    qp, k_cache, v_cache, table, lens = paged_inputs()
    q, k, v = randn(2, 8, 300, 128), randn(2, 8, 300, 128), randn(2, 8, 300, 128)
    qd, kd, vd = randn(4, 32, 1, 128), randn(4, 8, 2000, 128), randn(4, 8, 2000, 128)
    calls = (lambda: tiledsl.attention(q, k, v, causal=True), lambda: tiledsl.attention(qd, kd, vd),
             lambda: tiledsl.paged_attention(qp, k_cache, v_cache, torch.from_numpy(table).cuda(),
                                             torch.from_numpy(lens).cuda()))
    launch.clear_prepared()
    expected = [call().clone() for call in calls]
    monkeypatch.setenv("TILEDSL_LAUNCH", backend)
    launch.clear_prepared()
    try:
        assert launch.backend_name() == backend or backend == "cuda-bindings"
        for call, want in zip(calls, expected):
            assert torch.equal(call(), want)
    finally:
        monkeypatch.delenv("TILEDSL_LAUNCH")
        launch.clear_prepared()


# ---- plan / run ----------------------------------------------------------------------------------------------

def planned_decode(q_len=1, lens=(1000, 17, 513), causal=False, **options):
    q, k_cache, v_cache, table, lens = paged_inputs(q_len=q_len, lens=lens)
    decode = tiledsl.PagedAttention(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                    num_pages=k_cache.shape[0], dtype=BF16, device="cuda", max_batch=8, max_pages=128,
                                    causal=causal, **options)
    return decode, q, k_cache, v_cache, table, lens


@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "chunked-prefill"])
def test_planned_runs_of_32_layers_make_no_host_sync_and_are_exact(q_len):
    decode, q, k_cache, v_cache, table, lens = planned_decode(q_len=q_len, causal=q_len > 1)
    layers = [(randn(*q.shape), randn(*k_cache.shape), randn(*v_cache.shape)) for _ in range(32)]
    outs = [torch.empty_like(q) for _ in layers]
    decode.plan(table, lens, q_len=q_len)
    decode.run(*layers[0], out=outs[0])   # the first run prepares
    torch.cuda.synchronize()
    with no_host_sync():
        decode.plan(table, lens, q_len=q_len)   # host arrays in, one non-blocking copy out
        for (ql, kl, vl), out in zip(layers, outs):
            assert decode.run(ql, kl, vl, out=out) is out
    torch.cuda.synchronize()
    for (ql, kl, vl), out in list(zip(layers, outs))[::8]:
        assert o_error(out, paged_reference(ql, kl, vl, table, lens, q_len > 1)) < TOLERANCE_O


def test_a_captured_planned_run_replays_a_new_plan():
    decode, q, k_cache, v_cache, _, _ = planned_decode()
    _, _, _, table, lens = paged_inputs(width=96)   # a fixed table width and key bound keep the graph valid
    out = torch.empty_like(q)
    decode.plan(table, lens, max_kv_len=2048)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # the eager warm-up before capture
        decode.run(q, k_cache, v_cache, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.run(q, k_cache, v_cache, out=out)
    for seed, new_lens in ((1, (999, 18, 512)), (2, (1, 100, 1024))):
        _, _, _, new_table, new_lens = paged_inputs(lens=new_lens, seed=seed, width=96)
        decode.plan(new_table, new_lens, max_kv_len=2048)
        q.copy_(randn(*q.shape))
        graph.replay()
        torch.cuda.synchronize()
        assert o_error(out, paged_reference(q, k_cache, v_cache, new_table, new_lens, False)) < TOLERANCE_O


def test_planned_varlen_runs_are_exact_and_make_no_host_sync():
    from tiledsl.reference.serving import varlen_attention as reference
    lengths = [300, 17, 1000, 129, 2048]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    varlen = tiledsl.VarlenAttention(num_heads=16, num_kv_heads=4, head_dim=128, dtype=BF16, device="cuda",
                                     max_batch=8, causal=True)
    varlen.plan(cu, cu)
    q, k, v = randn(total, 16, 128), randn(total, 4, 128), randn(total, 4, 128)
    out = torch.empty_like(q)
    varlen.run(q, k, v, out=out)
    torch.cuda.synchronize()
    with no_host_sync():
        q, k, v = randn(total, 16, 128), randn(total, 4, 128), randn(total, 4, 128)
        varlen.run(q, k, v, out=out)
    torch.cuda.synchronize()
    ref_o, _ = reference(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(), cu, cu,
                         mask="causal")
    assert o_error(out, torch.from_numpy(ref_o).cuda()) < TOLERANCE_O
