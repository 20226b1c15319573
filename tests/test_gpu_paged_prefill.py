"""Chunked prefill over a paged KV cache (the fa2 mma.sync kernel reading K/V through the block
table, tiledsl.serving.prefill.paged_prefill) on the GPU, against the float64 reference
tiledsl.reference.serving.paged_attention: page sizes 1, 16, 64, 256; pages in random order and
shared between sequences; kv_lens with q_len <= kv_len at page boundaries +- 1; q_len 17, 64, 300;
causal / none / window (bottom-right aligned); GQA; bf16 / fp16; NaN-poisoned outputs; bad block
tables refused; compute-sanitizer memcheck of a launch whose block table points at the last page.

    python -m pytest -m gpu tests/test_gpu_paged_prefill.py
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.spec import DType, Mask

from .gpu_support import MASKS, TOLERANCE_LSE, TOLERANCE_O, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


@functools.lru_cache(maxsize=None)
def spec_for(dtype: DType, d: int, mask: str, page: int):
    from tiledsl.runtime.device import device_arch
    from tiledsl.serving.prefill import prefill_spec
    kind, left, right = MASKS[mask]
    return prefill_spec(device_arch(), dtype, d, d, Mask(kind), page, (left, right) if kind == "window" else None)


def errors(out, lse, ref_o, ref_lse):
    """(normwise relative O error, max LSE error over finite rows): a NaN left in the outputs, or a
    row -inf on one side only, is inf."""
    out, lse = np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
    err_o = np.inf if not np.isfinite(out).all() else np.linalg.norm(out - ref_o) / (np.linalg.norm(ref_o) or 1.0)
    finite = np.isfinite(ref_lse)
    if np.isnan(lse).any() or (np.isfinite(lse) != finite).any():
        return err_o, np.inf
    return err_o, float(np.abs(lse[finite] - ref_lse[finite]).max()) if finite.any() else 0.0


def check(err):
    assert err[0] < TOLERANCE_O, f"O relative error {err[0]}"
    assert err[1] < TOLERANCE_LSE, f"LSE error {err[1]}"


def paged_inputs(torch, rng, dtype, q_len, heads, kv_heads, d, page, kv_lens, spare_pages=3):
    """q and caches of fresh normal values, and a block table whose pages are a random permutation
    of the cache's, the last sequence reusing the one before's leading pages (prefix sharing);
    unused entries are -1."""
    batch = len(kv_lens)
    need = [-(-n // page) for n in kv_lens]
    num_pages = sum(need) + spare_pages
    order = rng.permutation(num_pages)
    table = np.full((batch, max(max(need), 1) + 1), -1, dtype=np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used:used + n]
        used += n
    if batch > 1:
        shared = min(need[-2], need[-1]) // 2
        table[-1, :shared] = table[-2, :shared]
    tdt = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype.value])
    q = torch.randn(batch, q_len, heads, d, device="cuda", dtype=tdt)
    k_cache = torch.randn(num_pages, page, kv_heads, d, device="cuda", dtype=tdt)
    v_cache = torch.randn(num_pages, page, kv_heads, d, device="cuda", dtype=tdt)
    return (q, k_cache, v_cache, torch.tensor(table, device="cuda"),
            torch.tensor(np.asarray(kv_lens, dtype=np.int32), device="cuda"))


def run_checked(torch, spec, q, k_cache, v_cache, table, lens):
    """Launch into NaN-poisoned O / LSE; (errors vs the float64 paged reference)."""
    from tiledsl.reference.serving import paged_attention as reference
    from tiledsl.dispatch.kernels import kernel_for
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


def lengths(page: int, q_len: int) -> list[int]:
    """kv_lens >= q_len at page boundaries +- 1 (and tile boundaries for small pages), plus a long one."""
    boundary = max(page, 64) * (-(-q_len // max(page, 64)) + 1)
    return [q_len, boundary - 1, boundary, boundary + 1, page * (-(-q_len // page) + 3) + 1, 1000 + q_len]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("q_len", [17, 64, 300])
@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_pages_lengths_causal_gqa(torch, page, q_len):
    rng = np.random.default_rng(page * 1000 + q_len)
    inputs = paged_inputs(torch, rng, DType.BF16, q_len, 8, 2, 128, page, lengths(page, q_len))
    check(run_checked(torch, spec_for(DType.BF16, 128, "causal", page), *inputs))


@pytest.mark.parametrize("mask", ["none", "window"])
@pytest.mark.parametrize("page", [16, 64])
def test_masks(torch, page, mask):
    rng = np.random.default_rng(page + len(mask))
    inputs = paged_inputs(torch, rng, DType.BF16, 300, 4, 4, 128, page, lengths(page, 300))
    check(run_checked(torch, spec_for(DType.BF16, 128, mask, page), *inputs))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_fp16_and_head_dim_64(torch, mask):
    rng = np.random.default_rng(11)
    inputs = paged_inputs(torch, rng, DType.FP16, 64, 8, 1, 64, 16, lengths(16, 64))
    check(run_checked(torch, spec_for(DType.FP16, 64, mask, 16), *inputs))


@pytest.mark.parametrize("page, tile_kv, stages", [(16, 64, 3), (64, 64, 4), (32, 48, 2), (64, 48, 2), (64, 48, 1)])
def test_schedules_ring_and_tiles_across_pages(torch, page, tile_kv, stages):
    """Other schedules than prefill_spec's: a deeper block-table ring (3, 4 stages), and 48-key tiles
    that start mid-page (each row looks its page up; with 1 stage inline from the table)."""
    from dataclasses import replace
    base = spec_for(DType.BF16, 128, "causal", page)
    spec = replace(base, name=f"{base.name}_kv{tile_kv}_s{stages}",
                   schedule=replace(base.schedule, tile_q=64, tile_kv=tile_kv, stages=stages))
    rng = np.random.default_rng(page * 7 + tile_kv + stages)
    inputs = paged_inputs(torch, rng, DType.BF16, 300, 8, 2, 128, page, lengths(page, 300))
    check(run_checked(torch, spec, *inputs))


def test_api_routes_long_chunks_here_and_returns_lse(torch):
    from tiledsl.serving.paged import paged_attention
    from tiledsl.reference.serving import paged_attention as reference
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, table, lens = paged_inputs(torch, rng, DType.BF16, 17, 8, 2, 128, 16, [17, 33, 700])
    out, lse = paged_attention(q, k_cache, v_cache, table, lens, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (3, 17, 8)
    ref_o, ref_lse = reference(q.float().cpu().numpy(), k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(),
                               table.cpu().numpy(), lens.cpu().numpy(), Mask.CAUSAL)
    check(errors(out.float().cpu().numpy(), lse.cpu().numpy(), ref_o, ref_lse))


def test_bad_inputs_are_refused(torch):
    from tiledsl.serving.prefill import paged_prefill
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, table, lens = paged_inputs(torch, rng, DType.BF16, 32, 4, 4, 128, 16, [40, 64])
    bad = table.clone()
    bad[1, 2] = k_cache.shape[0]   # one past the last page, inside sequence 1's 4 pages
    from .gpu_support import refused_on_host_and_by_the_kernel
    refused_on_host_and_by_the_kernel(lambda validate: paged_prefill(q, k_cache, v_cache, bad, lens,
                                                                     validate=validate), r"block_table\[1, 2\]")
    over = lens.clone()
    over[0] = table.shape[1] * 16 + 1
    refused_on_host_and_by_the_kernel(lambda validate: paged_prefill(q, k_cache, v_cache, table, over,
                                                                     validate=validate), r"kv_lens\[0\]")
    with pytest.raises(RuntimeInputError, match="page size"):
        paged_prefill(q, k_cache[:, :12], v_cache[:, :12], table, lens)
    with pytest.raises(RuntimeInputError, match="block_table"):
        paged_prefill(q, k_cache, v_cache, table.long(), lens)


SANITIZED = r"""
import torch
from tiledsl.serving.prefill import paged_prefill
pages, page = 6, 16
q = torch.randn(1, 17, 4, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(pages, page, 2, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
table = torch.tensor([[pages - 1, 0, pages - 1]], device="cuda", dtype=torch.int32)   # the cache's last page
for n in (17, page + 3, 3 * page):
    out = paged_prefill(q, k, v, table, torch.tensor([n], device="cuda", dtype=torch.int32), causal=True)
torch.cuda.synchronize()
print("ran", out.shape)
"""


def test_memcheck_reads_the_last_page_in_bounds(torch, tmp_path):
    sanitizer = os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer")
    script = tmp_path / "paged_prefill_memcheck.py"
    script.write_text(SANITIZED)
    try:
        run = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, str(script)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except FileNotFoundError:
        pytest.skip("compute-sanitizer not on PATH")
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in run.stdout + run.stderr, \
        run.stdout[-3000:] + run.stderr[-3000:]
