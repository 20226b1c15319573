"""The decode kernel on a paged KV cache (and the decode sweep that found the merge bug) on the GPU,
against the float64 references (tiledsl.reference.serving, tiledsl.reference.gpu): page sizes 1..256,
block tables with pages in random order and shared between sequences, kv_lens of 0, 1, a page
boundary +- 1 and long, GQA, 1..16 queries with bottom-right masks, both dtypes, NaN-poisoned
outputs; bad block tables refused; compute-sanitizer memcheck of a launch reading the cache's
last page.

    python -m pytest -m gpu tests/test_gpu_paged.py
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.spec import Axis, DType, KernelSpec, Mask, Problem, Schedule

from .gpu_support import TOLERANCE_LSE, TOLERANCE_O, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

SWEEP_DIMS = tuple(range(16, 257, 16))
SWEEP_QUERIES = (1, 3, 4, 16)
SWEEP_GROUPS = (1, 2, 4, 8)


def sweep_spec(d: int, queries: int, page: int | None, dtype=DType.BF16) -> KernelSpec:
    """The bundled decode schedule (q16, kv128, 4 warps along kv, 1 stage) with 5 fixed splits, so
    every case runs the merge; several queries run causal."""
    mask = Mask.CAUSAL if queries > 1 else Mask.NONE
    problem = Problem(d, d, dtype, mask, queries_per_seq=queries, kv_page_size=page)
    return KernelSpec(f"sweep_d{d}", problem, Schedule(tile_q=16, tile_kv=128, warps=4, warp_axis=Axis.KV, stages=1,
                                                       split_kv=5))


def sweep_specs() -> list[KernelSpec]:
    return [sweep_spec(d, nq, page) for d in SWEEP_DIMS for nq in SWEEP_QUERIES for page in (None, 16)]


@functools.lru_cache(maxsize=None)
def kernel_for(spec):
    from tiledsl import compile
    return compile(spec)


def errors(out, lse, ref_o, ref_lse):
    """(normwise relative O error, max LSE error over finite rows), NumPy, as tiledsl.reference.gpu
    computes them on the GPU: any NaN left in the outputs, or a row -inf on one side only, is inf."""
    out, lse = np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
    err_o = np.inf if not np.isfinite(out).all() else np.linalg.norm(out - ref_o) / (np.linalg.norm(ref_o) or 1.0)
    finite = np.isfinite(ref_lse)
    if np.isnan(lse).any() or (np.isfinite(lse) != finite).any():
        return err_o, np.inf
    return err_o, float(np.abs(lse[finite] - ref_lse[finite]).max()) if finite.any() else 0.0


def check(err):
    assert err[0] < TOLERANCE_O, f"O relative error {err[0]}"
    assert err[1] < TOLERANCE_LSE, f"LSE error {err[1]}"


def paged_inputs(torch, rng, dtype, batch, q_len, heads, kv_heads, d, page, kv_lens, spare_pages=3, share=True):
    """q, caches and a block table whose pages are a random permutation of the cache's, the last
    sequence reusing the one before's leading pages (prefix sharing); unused entries are -1."""
    need = [-(-n // page) for n in kv_lens]
    max_pages = max(max(need), 1)
    num_pages = sum(need) + spare_pages
    order = rng.permutation(num_pages)
    table = np.full((batch, max_pages), -1, dtype=np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used:used + n]
        used += n
    if share and batch > 1:
        shared = min(need[-2], need[-1]) // 2
        table[-1, :shared] = table[-2, :shared]
    tdt = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype.value])
    q = torch.randn(batch, q_len, heads, d, device="cuda", dtype=tdt)
    k_cache = torch.randn(num_pages, page, kv_heads, d, device="cuda", dtype=tdt)
    v_cache = torch.randn(num_pages, page, kv_heads, d, device="cuda", dtype=tdt)
    return (q, k_cache, v_cache, torch.tensor(table, device="cuda"),
            torch.tensor(np.asarray(kv_lens, dtype=np.int32), device="cuda"))


def run_paged_kernel(torch, spec, q, k_cache, v_cache, table, lens):
    """Launch into NaN-poisoned O / LSE; (O errors vs the float64 paged reference)."""
    from tiledsl.reference.serving import paged_attention as reference
    p = spec.problem
    batch, q_len, heads, _ = q.shape
    out = torch.full((batch, q_len, heads, p.head_dim_v), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((batch, heads, q_len), float("nan"), device="cuda", dtype=torch.float32)
    kernel_for(spec)(q, k_cache, v_cache, table, lens, out=out, lse=lse)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference(q.float().cpu().numpy(), k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(),
                               table.cpu().numpy(), lens.cpu().numpy(), p.mask, p.window_left, p.window_right,
                               p.softmax_scale)
    return errors(out.float().cpu().numpy(), lse.transpose(1, 2).cpu().numpy(), ref_o, ref_lse)


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


# ---- item 2: the decode sweep, contiguous and paged --------------------------------------------

@pytest.mark.parametrize("group", SWEEP_GROUPS)
@pytest.mark.parametrize("queries", SWEEP_QUERIES)
@pytest.mark.parametrize("d", SWEEP_DIMS)
def test_decode_sweep_contiguous(torch, d, queries, group):
    from tiledsl.reference.gpu import reference_attention
    spec = sweep_spec(d, queries, None)
    kv_heads, heads = 2, 2 * group
    lens = torch.tensor([300, 129], device="cuda", dtype=torch.int32)
    q = torch.randn(2, heads, queries, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, kv_heads, 300, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.full((2, heads, queries, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((2, heads, queries), float("nan"), device="cuda", dtype=torch.float32)
    kernel_for(spec)(q, k, v, kv_lens=lens, out=out, lse=lse)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference_attention(spec.problem, q, k, v, kv_lens=lens)
    from tiledsl.reference.gpu import lse_error, relative_error
    check((relative_error(out, ref_o), lse_error(lse, ref_lse)))


@pytest.mark.parametrize("group", SWEEP_GROUPS)
@pytest.mark.parametrize("queries", SWEEP_QUERIES)
@pytest.mark.parametrize("d", SWEEP_DIMS)
def test_decode_sweep_paged(torch, d, queries, group):
    rng = np.random.default_rng(d * 1000 + queries * 10 + group)
    inputs = paged_inputs(torch, rng, DType.BF16, 2, queries, 2 * group, 2, d, 16, [300, 129])
    check(run_paged_kernel(torch, sweep_spec(d, queries, 16), *inputs))


# A block of one warp reads a paged cache through the per-warp walk too (it used to take fa2's block-wide
# walk, whose helpers decode's template lacks); two warps for comparison. Several splits, causal queries.
@pytest.mark.parametrize("warps, tile_kv, stages, page", [(1, 64, 2, 16), (1, 16, 1, 1), (1, 128, 2, 64),
                                                          (1, 32, 2, 256), (2, 64, 1, 16)])
def test_paged_decode_of_one_or_two_warps(torch, warps, tile_kv, stages, page):
    rng = np.random.default_rng(warps * 1000 + tile_kv + page)
    problem = Problem(64, 64, DType.BF16, Mask.CAUSAL, queries_per_seq=4, kv_page_size=page)
    spec = KernelSpec(f"few_warps_w{warps}", problem, Schedule(tile_q=16, tile_kv=tile_kv, warps=warps,
                                                               warp_axis=Axis.KV, stages=stages, split_kv=3))
    inputs = paged_inputs(torch, rng, DType.BF16, 3, 4, 8, 2, 64, page, [700, 5, page + 1])
    check(run_paged_kernel(torch, spec, *inputs))


# ---- item 4: the paged kernel through the serving API's spec -----------------------------------

@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("q_len", [1, 4, 16])
@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_paged_lengths_pages_gqa(torch, page, q_len, dtype):
    from tiledsl.serving.paged import paged_spec
    rng = np.random.default_rng(page * 100 + q_len)
    lens = [0, 1, page - 1 or 2, page, page + 1, 2000]
    mask = Mask.CAUSAL if q_len > 1 else Mask.NONE
    spec = paged_spec(dtype, 128, 128, mask, page, q_len)
    inputs = paged_inputs(torch, rng, dtype, len(lens), q_len, 8, 2, 128, page, lens)
    check(run_paged_kernel(torch, spec, *inputs))


@pytest.mark.parametrize("page", [16, 256])
def test_paged_window_and_long_split(torch, page):
    from tiledsl.serving.paged import paged_spec
    rng = np.random.default_rng(7)
    spec = paged_spec(DType.BF16, 64, 64, Mask.WINDOW, page, 4, window=(300, 0))
    inputs = paged_inputs(torch, rng, DType.BF16, 3, 4, 8, 1, 64, page, [5000, 17, 4097])
    check(run_paged_kernel(torch, spec, *inputs))


def test_api_matches_reference_and_returns_lse(torch):
    from tiledsl import paged_attention
    from tiledsl.reference.serving import paged_attention as reference
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, table, lens = paged_inputs(torch, rng, DType.BF16, 4, 4, 16, 4, 128, 16, [33, 0, 16, 1500])
    out, lse = paged_attention(q, k_cache, v_cache, table, lens, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 4, 16)
    ref_o, ref_lse = reference(q.float().cpu().numpy(), k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(),
                               table.cpu().numpy(), lens.cpu().numpy(), Mask.CAUSAL)
    check(errors(out.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse))


def test_bad_block_tables_are_refused(torch):
    from tiledsl import paged_attention
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, table, lens = paged_inputs(torch, rng, DType.BF16, 2, 1, 4, 4, 64, 16, [40, 20])
    bad = table.clone()
    bad[1, 1] = k_cache.shape[0]   # one past the last page, inside sequence 1's 2 pages
    from .gpu_support import refused_on_host_and_by_the_kernel
    refused_on_host_and_by_the_kernel(lambda validate: paged_attention(q, k_cache, v_cache, bad, lens,
                                                                       validate=validate), r"block_table\[1, 1\]")
    over = lens.clone()
    over[0] = table.shape[1] * 16 + 1
    refused_on_host_and_by_the_kernel(lambda validate: paged_attention(q, k_cache, v_cache, table, over,
                                                                       validate=validate), r"kv_lens\[0\]")
    with pytest.raises(RuntimeInputError, match="page size"):
        paged_attention(q, k_cache[:, :12], v_cache[:, :12], table, lens)


SANITIZED = r"""
import sys, torch
from tiledsl import paged_attention
pages, page = 5, 16
q = torch.randn(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(pages, page, 2, 64, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
table = torch.tensor([[pages - 1, 0]], device="cuda", dtype=torch.int32)   # the cache's last page first
for n in (page, page + 3, 7):
    out = paged_attention(q, k, v, table, torch.tensor([n], device="cuda", dtype=torch.int32))
torch.cuda.synchronize()
print("ran", out.shape)
"""


def test_memcheck_reads_the_last_page_in_bounds(torch, tmp_path):
    sanitizer = os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer")
    script = tmp_path / "paged_memcheck.py"
    script.write_text(SANITIZED)
    try:
        run = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, str(script)],
                             capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except FileNotFoundError:
        pytest.skip("compute-sanitizer not on PATH")
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in run.stdout + run.stderr, run.stdout[-3000:] + run.stderr[-3000:]
