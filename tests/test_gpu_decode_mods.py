"""softcap, ALiBi and sinks in the decode family on the GPU, against the float64 references that run the
same modifications (tiledsl.reference.forward for contiguous caches, tiledsl.reference.serving for paged
ones): 1 and 4 queries, one split and seven (and more splits than tiles, so split 0 that carries the sink
owns no key), d64 and d128, GQA, kv_lens with a 0, window + sinks (gpt-oss); paged caches of 1-, 16- and
64-key pages through a shuffled block table (tiledsl.paged_attention and the planned PagedAttention with a
sink tensor per layer, no host sync in run), an FP8 KV cache; tiledsl.attention's dispatch of a modified
4-query call to a decode kernel; NaN-poisoned outputs, fresh random inputs; one compute-sanitizer run.

    python -m pytest -m gpu -n 14 tests/test_gpu_decode_mods.py
"""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tiledsl.mods.model import AUX_ALIBI, AUX_SINKS, AlibiSlopes, Modifications
from tiledsl.spec import Axis, DType, KernelSpec, Mask, Problem, Schedule

from .gpu_support import check, kernel_for, memcheck, no_host_sync, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

MODS = {"softcap": Modifications(softcap=30.0), "alibi": Modifications(alibi=AlibiSlopes.GIVEN),
        "sinks": Modifications(sinks=True), "all": Modifications(softcap=20.0, alibi=AlibiSlopes.GIVEN, sinks=True)}
KEYWORDS = {"softcap": {"softcap": 30.0}, "alibi": {}, "sinks": {}, "all": {"softcap": 20.0}}


def decode_spec(mod: str, queries: int, d: int, splits, mask: Mask | None = None, window=(0, 0), page=None):
    mask = mask or (Mask.CAUSAL if queries > 1 else Mask.NONE)
    problem = Problem(d, d, DType.BF16, mask, window[0], window[1], queries_per_seq=queries, kv_page_size=page,
                      mods=MODS[mod])
    return KernelSpec(f"decode_{mod}", problem, Schedule(tile_q=16, tile_kv=128, warps=4, warp_axis=Axis.KV,
                                                         stages=1, split_kv=splits))


def aux_for(mods: Modifications, batch: int, heads: int) -> dict:
    import torch
    aux = {}
    if mods.alibi is AlibiSlopes.GIVEN:
        aux[AUX_ALIBI] = torch.rand(batch, heads, device="cuda", dtype=torch.float32) * 0.5
    if mods.sinks:
        aux[AUX_SINKS] = torch.randn(heads, device="cuda", dtype=torch.float32) * 2
    return aux


def host(aux: dict) -> dict:
    return {n: t.double().cpu().numpy() for n, t in aux.items()}


def contiguous_errors(spec, batch, heads, kv_heads, kv_len, kv_lens):
    """(O error, LSE error) of one run into NaN-poisoned outputs against reference_attention of the spec."""
    import cupy
    import torch

    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import lse_error, poisoned_outputs, relative_error
    p = spec.problem
    q = torch.randn(batch, heads, p.queries_per_seq, p.head_dim_qk, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, kv_len, p.head_dim_qk, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    aux = aux_for(p.mods, batch, heads)
    out, lse = poisoned_outputs(q, tuple(q.shape), tuple(q.shape[:3]))
    kernel_for(spec)(q, k, v, kv_lens=lens, out=out, lse=lse, aux=aux)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference_attention(spec, *(x.double().cpu().numpy() for x in (q, k, v)), np.array(kv_lens),
                                         aux=host(aux))
    return relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("splits", [1, 7])
@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("mod", sorted(MODS))
def test_decode_matches_reference(mod, queries, splits, d):
    # GQA 4 (4 queries: 16 packed rows), sequence 0 empty (only the sink, if any), one past a tile, one long
    check(contiguous_errors(decode_spec(mod, queries, d, splits), 3, 8, 2, 1100, [0, 129, 1100]))


@pytest.mark.parametrize("mod", ["sinks", "all"])
def test_more_splits_than_tiles_keep_the_sink_in_split_0(mod):
    # 200 keys are 2 tiles over 13 splits: split 0 owns none, yet carries the sink
    check(contiguous_errors(decode_spec(mod, 4, 128, 13), 2, 4, 4, 200, [200, 3]))


@pytest.mark.parametrize("queries", [1, 4])
def test_window_and_sinks(queries):
    spec = decode_spec("sinks", queries, 64, 7, Mask.WINDOW, (128, 0))
    check(contiguous_errors(spec, 2, 8, 1, 3000, [3000, 90]))


def test_sinks_only_rows_get_the_sink_as_lse():
    import torch
    spec = decode_spec("sinks", 4, 64, 7)
    q = torch.randn(1, 4, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(4, device="cuda", dtype=torch.float32)
    out, lse = kernel_for(spec)(q, k, k.clone(), kv_lens=torch.zeros(1, device="cuda", dtype=torch.int32),
                                aux={AUX_SINKS: sinks})
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, sinks[None, :, None].expand_as(lse), rtol=0, atol=1e-6)


def paged_inputs(batch, heads, kv_heads, queries, d, page, kv_lens, fp8=False):
    """q (batch, queries, heads, d), caches with pages in random order (one page more than needed), the
    block table and kv_lens; with `fp8` float8_e4m3fn caches and per-head scales."""
    import torch
    width = max(-(-max(kv_lens) // page), 1)
    pages = batch * width + 1
    q = torch.randn(batch, queries, heads, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(pages, page, kv_heads, d, device="cuda") for _ in "kv")
    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[:batch * width].reshape(batch, width)
    lens = torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    if not fp8:
        return q, k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16), table, lens, None
    scales = tuple(torch.rand(kv_heads, device="cuda") * 0.1 + 0.05 for _ in "kv")
    k8, v8 = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    return q, k8, v8, table, lens, scales


def paged_reference(q, k_cache, v_cache, table, lens, mods, aux, mask, window=(0, 0), scales=None):
    from tiledsl.reference import serving
    if scales is None:
        kc, vc = (c.double().cpu().numpy() for c in (k_cache, v_cache))
    else:
        kc, vc = ((c.double() * s.double()[None, None, :, None]).cpu().numpy()
                  for c, s in zip((k_cache, v_cache), scales))
    return serving.paged_attention(q.double().cpu().numpy(), kc, vc, table.cpu().numpy(), lens.cpu().numpy(),
                                   mask=mask, window_left=window[0], window_right=window[1], mods=mods, aux=host(aux))


def paged_errors(out, lse, ref):
    from .test_gpu_paged import errors
    return errors(out.float().cpu().numpy(), lse.cpu().numpy(), *ref)


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("mod", ["softcap", "alibi", "sinks", "all"])
def test_paged_attention_runs_the_modifications(mod, queries, page):
    import torch

    import tiledsl
    d = 128 if page == 16 else 64
    q, k_cache, v_cache, table, lens, _ = paged_inputs(3, 8, 2, queries, d, page, [0, 77, 700])
    aux = aux_for(MODS[mod], 3, 8)
    out, lse = tiledsl.paged_attention(q, k_cache, v_cache, table, lens, causal=queries > 1, return_lse=True,
                                       alibi_slopes=aux.get(AUX_ALIBI), sinks=aux.get(AUX_SINKS), **KEYWORDS[mod])
    torch.cuda.synchronize()
    ref = paged_reference(q, k_cache, v_cache, table, lens, MODS[mod], aux, "causal" if queries > 1 else "none")
    check(paged_errors(out, lse, ref))


def test_paged_fp8_cache_with_softcap_and_sinks():
    import torch

    import tiledsl
    mods = Modifications(softcap=30.0, sinks=True)
    q, k_cache, v_cache, table, lens, (ks, vs) = paged_inputs(3, 8, 2, 4, 128, 16, [5, 0, 900], fp8=True)
    sinks = torch.randn(8, device="cuda")
    out, lse = tiledsl.paged_attention(q, k_cache, v_cache, table, lens, causal=True, return_lse=True, k_scale=ks,
                                       v_scale=vs, softcap=30.0, sinks=sinks)
    torch.cuda.synchronize()
    ref = paged_reference(q, k_cache, v_cache, table, lens, mods, {AUX_SINKS: sinks}, "causal", scales=(ks, vs))
    check(paged_errors(out, lse, ref))


def test_planned_paged_attention_reads_each_layer_s_sinks_without_a_host_sync():
    import torch

    import tiledsl
    heads, kv_heads, d, page = 8, 1, 64, 16
    lengths = [300, 0, 1500]
    q, k_cache, v_cache, table, lens, _ = paged_inputs(3, heads, kv_heads, 1, d, page, lengths)
    wrapper = tiledsl.PagedAttention(heads, kv_heads, d, page, num_pages=k_cache.shape[0], dtype=torch.bfloat16,
                                     device="cuda", max_batch=4, max_pages=table.shape[1], window=(128, 0),
                                     sinks=True, softcap=25.0)
    wrapper.plan(table.cpu(), lens.cpu())
    layer_sinks = [torch.randn(heads, device="cuda") for _ in range(2)]
    outs = []
    wrapper.run(q, k_cache, v_cache, sinks=layer_sinks[0])   # the first run prepares
    with no_host_sync():
        for sinks in layer_sinks:
            out, lse = wrapper.run(q, k_cache, v_cache, sinks=sinks, return_lse=True)
            outs.append((out.clone(), lse.clone()))
    torch.cuda.synchronize()
    mods = Modifications(softcap=25.0, sinks=True)
    for (out, lse), sinks in zip(outs, layer_sinks):
        ref = paged_reference(q, k_cache, v_cache, table, lens, mods, {AUX_SINKS: sinks}, "window", (128, 0))
        check(paged_errors(out, lse, ref))
    with pytest.raises(tiledsl.RuntimeInputError, match="reads sinks"):
        wrapper.run(q, k_cache, v_cache)


def test_attention_runs_a_modified_four_query_call_on_a_decode_kernel():
    import cupy
    import torch

    import tiledsl
    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import lse_error, relative_error
    q = torch.randn(2, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 2000, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    sinks = torch.randn(8, device="cuda")
    keywords = dict(softcap=30.0, alibi_slopes="geometric", sinks=sinks)
    spec = tiledsl.parse_text(tiledsl.spec_for(q, k, v, causal=True, **keywords))[0]
    assert spec.family.value == "decode"
    out, lse = tiledsl.attention(q, k, v, causal=True, return_lse=True, **keywords)
    ref_o, ref_lse = reference_attention(spec, *(x.double().cpu().numpy() for x in (q, k, v)),
                                         aux={AUX_SINKS: sinks.double().cpu().numpy()})
    check((relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))))


def test_compute_sanitizer_on_a_small_modified_paged_decode(tmp_path):
    script = tmp_path / "decode_mods_memcheck.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tiledsl
        q = torch.randn(2, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(9, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
        table = torch.tensor([[8, 3, 5, 0], [1, 2, 4, 6]], device="cuda", dtype=torch.int32)
        lens = torch.tensor([64, 5], device="cuda", dtype=torch.int32)
        tiledsl.paged_attention(q, k, k, table, lens, causal=True, softcap=30.0, sinks=torch.randn(8, device="cuda"),
                                alibi_slopes=torch.rand(8, device="cuda"))
        torch.cuda.synchronize()
    """))
    memcheck(script)
