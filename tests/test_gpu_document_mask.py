"""The hopper forward's document masks (packed sequences: `mask = document` by document_ids or
document_bounds) and prefix-LM (`mask = prefix(n)`) on the GPU against the float64 reference
(tiledsl.reference.forward), into NaN-poisoned outputs: documents with empty ones, a single one, many
1-token ones, padding, document + causal, prefixes of 1, mid-sequence and past the end, query lengths 1,
17, 1000 and 4097, unequal q / kv lengths, per-sequence kv_lens, GQA, bf16 and fp16, the tuned schedules
the API runs (d64, d128, d256); the API's keywords, the host check of the ids' runs, and one
compute-sanitizer run. The device code's logic itself also runs on the host (tests/test_mask_mods_cpu.py)."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tiledsl.mods.model import AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, Documents, Modifications
from tiledsl.spec import DType, KernelSpec, Mask, Problem

from .gpu_support import check, kernel_for, memcheck, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def tuned_spec(head_dim: int, mask: str, mods: Modifications, dtype: DType = DType.BF16) -> KernelSpec:
    from tiledsl.dispatch.tuned import TUNED
    schedule = TUNED[("sm_90", dtype.value, head_dim, mask)]
    return KernelSpec(f"docmask_d{head_dim}", Problem(head_dim, head_dim, dtype, Mask(mask), mods=mods), schedule)


def packed_ids(rng, batch: int, kv_len: int, mean: int, pad_end: int = 0) -> np.ndarray:
    """(batch, kv_len) ids of consecutive documents of random lengths (mean about `mean`), ids rising by 1
    or 2, the last `pad_end` positions padding (-1)."""
    out = np.empty((batch, kv_len), dtype=np.int32)
    for b in range(batch):
        row, doc = [], int(rng.integers(0, 3))
        while len(row) < kv_len:
            row += [doc] * int(rng.integers(1, 2 * mean))
            doc += int(rng.integers(1, 3))
        out[b] = row[:kv_len]
        if pad_end:
            out[b, kv_len - pad_end:] = -1
    return out


def errors(spec, batch, heads, q_len, kv_len, aux: dict, kv_heads=None, kv_lens=None):
    """(O error, LSE error) of one run into NaN-poisoned outputs against the float64 reference; `aux` holds
    NumPy int arrays (moved to the GPU as int32)."""
    import cupy
    import torch

    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import as_float64, lse_error, poisoned_outputs, relative_error
    from tiledsl.runtime.tensors import torch_dtype, view
    d, kv_heads = spec.problem.head_dim_qk, kv_heads or heads
    dtype = torch_dtype(spec.problem.dtype)
    q = torch.randn(batch, heads, q_len, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=dtype)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    on_gpu = {name: torch.tensor(np.asarray(a), device="cuda", dtype=torch.int32) for name, a in aux.items()}
    out, lse = poisoned_outputs(q, (batch, heads, q_len, d), (batch, heads, q_len))
    kernel_for(spec)(q, k, v, kv_lens=lens, out=out, lse=lse, aux=on_gpu)
    torch.cuda.synchronize()
    q64, k64, v64 = (cupy.asnumpy(as_float64(view(x, n))) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    ref_o, ref_lse = reference_attention(spec, q64, k64, v64, None if kv_lens is None else np.array(kv_lens),
                                         aux={n: np.asarray(a) for n, a in aux.items()})
    return relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))


IDS = Modifications(document=Documents.IDS)
BOUNDS = Modifications(document=Documents.BOUNDS)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("q_len, mean", [(1, 1), (17, 4), (1000, 150), (1000, 1)])
def test_document_ids_match_the_reference(head_dim, mask, q_len, mean):
    rng = np.random.default_rng()
    ids = packed_ids(rng, 2, q_len, mean, pad_end=min(3, q_len - 1))
    check(errors(tuned_spec(head_dim, mask, IDS), 2, 3, q_len, q_len, {AUX_DOCUMENT_IDS: ids}))


@pytest.mark.parametrize("mask, dtype", [("none", DType.BF16), ("causal", DType.FP16)])
def test_long_documents_fp16_and_gqa(mask, dtype):
    rng = np.random.default_rng()
    ids = packed_ids(rng, 1, 4097, 1000)
    check(errors(tuned_spec(64, mask, IDS, dtype), 1, 2, 4097, 4097, {AUX_DOCUMENT_IDS: ids}, kv_heads=1))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_one_document_every_token_its_own_and_padding_between(mask):
    n = 700
    spec = tuned_spec(128, mask, IDS)
    for row in (np.zeros(n), np.arange(n), np.r_[np.full(130, -1), np.full(300, 3), np.full(40, -7), np.full(230, 4)],
                np.r_[np.full(128, 9), np.full(128, 2), np.full(444, 5)]):   # ids need not increase
        check(errors(spec, 2, 2, n, n, {AUX_DOCUMENT_IDS: np.tile(row.astype(np.int32), (2, 1))}))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_unequal_lengths_and_kv_lens(mask):
    """300 queries over 777 keys and 777 over 300 (causal: the first rows see no key), kv_lens with 0."""
    rng = np.random.default_rng()
    spec = tuned_spec(128, mask, IDS)
    check(errors(spec, 3, 4, 300, 777, {AUX_DOCUMENT_IDS: packed_ids(rng, 3, 777, 90)}, kv_heads=1))
    check(errors(spec, 3, 4, 777, 300, {AUX_DOCUMENT_IDS: packed_ids(rng, 3, 300, 40)}, kv_heads=2,
                 kv_lens=[300, 0, 137]))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_document_bounds_with_empty_documents(mask):
    rng = np.random.default_rng()
    n = 1000
    cuts = np.sort(rng.integers(0, n, 12))
    bounds = np.array([[0, 0, *cuts, cuts[-1], n], [5, 5, 300, 300, 300, 700, 700, 700, 700, 700, 700, 700, 700,
                                                    700, 700, 700]], dtype=np.int32)
    for head_dim in (64, 128):
        check(errors(tuned_spec(head_dim, mask, BOUNDS), 2, 2, n, n, {AUX_DOCUMENT_BOUNDS: bounds}))
    one_token = np.arange(0, 18, dtype=np.int32)[None]
    check(errors(tuned_spec(128, mask, BOUNDS), 1, 2, 17, 17, {AUX_DOCUMENT_BOUNDS: one_token}))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("prefix", [1, 100, 300, 5000])
@pytest.mark.parametrize("q_len, kv_len", [(1000, 1000), (17, 17), (1, 1), (300, 1000)])
def test_prefix_matches_the_reference(head_dim, prefix, q_len, kv_len):
    check(errors(tuned_spec(head_dim, "none", Modifications(prefix=prefix)), 2, 3, q_len, kv_len, {}))


def test_prefix_and_documents_and_score_modifications_together():
    import torch

    from tiledsl.mods.model import AUX_ALIBI, AUX_SINKS, AlibiSlopes
    rng = np.random.default_rng()
    spec = tuned_spec(128, "none", Modifications(prefix=200, document=Documents.IDS))
    check(errors(spec, 2, 2, 900, 900, {AUX_DOCUMENT_IDS: packed_ids(rng, 2, 900, 300)}))
    spec = tuned_spec(128, "causal", Modifications(softcap=30.0, alibi=AlibiSlopes.GIVEN, sinks=True,
                                                   document=Documents.IDS))
    q = torch.randn(1, 2, 600, 128, device="cuda", dtype=torch.bfloat16)
    ids = packed_ids(rng, 1, 600, 150)
    aux = {AUX_DOCUMENT_IDS: torch.tensor(ids, device="cuda"), AUX_ALIBI: torch.rand(2, device="cuda") * 0.3,
           AUX_SINKS: torch.randn(2, device="cuda")}
    out, lse = kernel_for(spec)(q, q, q, aux=aux)
    import cupy

    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import as_float64, lse_error, relative_error
    from tiledsl.runtime.tensors import view
    q64 = cupy.asnumpy(as_float64(view(q, "q")))
    ref_o, ref_lse = reference_attention(spec, q64, q64, q64, aux={n: t.cpu().numpy() for n, t in aux.items()})
    check((relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))))


def test_api_keywords_and_the_host_check_of_the_runs():
    import cupy
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import as_float64, lse_error, relative_error
    from tiledsl.runtime.tensors import view
    rng = np.random.default_rng()
    q = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16), torch.randn(2, 2, 1000, 128,
                                                                                         device="cuda",
                                                                                         dtype=torch.bfloat16)
    ids = torch.tensor(packed_ids(rng, 2, 1000, 200), device="cuda")
    for keywords in (dict(document_ids=ids), dict(document_bounds=torch.tensor([[0, 10, 10, 600, 1000],
                                                                                 [0, 1, 2, 3, 999]], device="cuda",
                                                                                dtype=torch.int32))):
        out, lse = tiledsl.attention(q, k, v, causal=True, return_lse=True, **keywords)
        spec = tiledsl.parse_text(tiledsl.spec_for(q, k, v, causal=True, **keywords))[0]
        q64, k64, v64 = (cupy.asnumpy(as_float64(view(x, n))) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        aux = {("document_ids" if "document_ids" in keywords else "document_bounds"): next(iter(keywords.values()))
               .cpu().numpy()}
        ref_o, ref_lse = reference_attention(spec, q64, k64, v64, aux=aux)
        check((relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))))
    resumed = ids.clone()
    resumed[1, 900:] = resumed[1, 0]
    with pytest.raises(RuntimeInputError, match=r"document_ids\[1, 900\] = .* resumes document"):
        tiledsl.attention(q, k, v, document_ids=resumed)
    tiledsl.attention(q, k, v, document_ids=resumed, validate=False)   # not read on the host: launched
    with pytest.raises(RuntimeInputError, match="document_ids must be int32"):
        tiledsl.attention(q, k, v, document_ids=ids.long())
    with pytest.raises(RuntimeInputError, match="document_ids"):
        tiledsl.attention(q, k, v, document_ids=ids[:, :999])


def test_compute_sanitizer_on_small_document_cases(tmp_path):
    script = tmp_path / "docmask_memcheck.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import torch
        from tests.test_gpu_document_mask import BOUNDS, IDS, packed_ids, tuned_spec
        from tiledsl import compile
        from tiledsl.mods.model import Modifications
        rng = np.random.default_rng()
        q = torch.randn(2, 2, 77, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1, 150, 128, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor([150, 3], device="cuda", dtype=torch.int32)
        ids = torch.tensor(packed_ids(rng, 2, 150, 20, pad_end=2), device="cuda")
        bounds = torch.tensor([[0, 0, 40, 149], [1, 2, 2, 3]], device="cuda", dtype=torch.int32)
        for mask in ("none", "causal"):
            compile(tuned_spec(128, mask, IDS))(q, k, k, kv_lens=lens, aux={"document_ids": ids})
            compile(tuned_spec(128, mask, BOUNDS))(q, k, k, kv_lens=lens, aux={"document_bounds": bounds})
        compile(tuned_spec(128, "none", Modifications(prefix=100)))(q, k, k, kv_lens=lens)
        torch.cuda.synchronize()
    """))
    memcheck(script)
