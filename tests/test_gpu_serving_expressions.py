"""score_mod / mask_mod in decode (contiguous and paged, split-KV) and the varlen forward on the GPU, against the
float64 references that run the same trees (tiledsl.reference.serving: decode's q_idx is a query's position
kv_len - queries + i, varlen's b the sequence and q_idx / kv_idx positions within it): a relative-position bias
table and a sliding window with global tokens, batch 3 with kv_lens of 0, a tile and a half and a few thousand,
GQA, 1, 2 and 4 queries, a paged cache through a shuffled block table (paged_attention and the planned
PagedAttention, no host sync in run), forced split-KV, a two-stage walk with a mask that reads h, varlen
sequences of 1, 17 and 1000 tokens (varlen_attention and the planned VarlenAttention); NaN-poisoned outputs, fresh random inputs; one compute-sanitizer run.
Five distinct kernels (NVRTC takes tens of seconds each).

    python -m pytest -m gpu tests/test_gpu_serving_expressions.py
"""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tiledsl.dispatch.modified import modifications
from tiledsl.spec import Axis, DType, KernelSpec, Mask, Problem, Schedule

from .gpu_support import check, kernel_for, memcheck, no_host_sync, poison_outputs, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

HEADS, KV_HEADS = 8, 2
BIAS = "score + bias[h, q_idx - kv_idx + 4095]"          # bias (heads, 8191): sequences up to 4096 keys
WINDOW_GLOBAL = "q_idx - kv_idx < 700 | kv_idx < 64"      # a 700-key window that also sees the first 64 keys
HEAD_MASK = "(h % 2 == 0 | kv_idx < 64) & q_idx - kv_idx < 900"


def mods_of(**keywords):
    return modifications("test", **keywords)[0]


def bias_table():
    import torch
    return {"bias": torch.randn(HEADS, 8191, device="cuda", dtype=torch.float32)}


def host(aux: dict) -> dict:
    return {n: t.double().cpu().numpy() for n, t in aux.items()}


def paged_inputs(batch, queries, d, page, kv_lens):
    """q (batch, queries, heads, d), bf16 caches whose pages lie in random order (one page spare), the table, lens."""
    import torch
    width = max(-(-max(kv_lens) // page), 1)
    pages = batch * width + 1
    q = torch.randn(batch, queries, HEADS, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(pages, page, KV_HEADS, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[:batch * width].reshape(batch, width)
    return q, k_cache, v_cache, table, torch.tensor(kv_lens, device="cuda", dtype=torch.int32)


def paged_reference(q, k_cache, v_cache, table, lens, mods, aux, mask):
    from tiledsl.reference import serving
    return serving.paged_attention(*(x.double().cpu().numpy() for x in (q, k_cache, v_cache)), table.cpu().numpy(),
                                   lens.cpu().numpy(), mask=mask, mods=mods, aux=host(aux))


def errors(out, lse, ref):
    from .test_gpu_paged import errors as paged_errors
    return paged_errors(out.float().cpu().numpy(), lse.cpu().numpy(), *ref)


@pytest.mark.parametrize("queries, mask, keywords", [
    (4, "causal", dict(score_mod=BIAS)), (1, "none", dict(mask_mod=WINDOW_GLOBAL)),
], ids=["bias-4q-causal", "window-global-1q"])
def test_paged_attention_runs_the_expressions(monkeypatch, queries, mask, keywords):
    import torch

    import tiledsl
    poison_outputs(monkeypatch)
    q, k_cache, v_cache, table, lens = paged_inputs(3, queries, 128, 16, [0, 193, 3000])
    aux = bias_table() if "score_mod" in keywords else {}
    out, lse = tiledsl.paged_attention(q, k_cache, v_cache, table, lens, causal=mask == "causal", return_lse=True,
                                       aux=aux or None, **keywords)
    torch.cuda.synchronize()
    check(errors(out, lse, paged_reference(q, k_cache, v_cache, table, lens, mods_of(**keywords), aux, mask)))


def test_planned_paged_attention_reads_each_layers_bias_without_a_host_sync(monkeypatch):
    import torch

    import tiledsl
    poison_outputs(monkeypatch)
    q, k_cache, v_cache, table, lens = paged_inputs(3, 4, 128, 16, [2500, 0, 130])
    wrapper = tiledsl.PagedAttention(HEADS, KV_HEADS, 128, 16, num_pages=k_cache.shape[0], dtype=torch.bfloat16,
                                     device="cuda", max_batch=4, max_pages=table.shape[1], causal=True,
                                     score_mod=BIAS)
    wrapper.plan(table.cpu(), lens.cpu(), q_len=4)
    layers = [bias_table() for _ in range(2)]
    wrapper.run(q, k_cache, v_cache, aux=layers[0])   # the first run prepares
    outs = []
    with no_host_sync():
        for aux in layers:
            out, lse = wrapper.run(q, k_cache, v_cache, aux=aux, return_lse=True)
            outs.append((out.clone(), lse.clone()))
    torch.cuda.synchronize()
    for (out, lse), aux in zip(outs, layers):
        check(errors(out, lse, paged_reference(q, k_cache, v_cache, table, lens, mods_of(score_mod=BIAS), aux,
                                               "causal")))


def decode_spec(mods, queries, d, splits, stages=1):
    problem = Problem(d, d, DType.BF16, Mask.NONE, queries_per_seq=queries, mods=mods)
    return KernelSpec("decode_expr", problem, Schedule(tile_q=16, tile_kv=128, warps=4, warp_axis=Axis.KV,
                                                       stages=stages, split_kv=splits))


def contiguous_errors(spec, aux, kv_lens, kv_len):
    """(O error, LSE error) of the contiguous decode kernel into NaN-poisoned outputs against the positions
    reference (reference.serving.attend_modified per sequence)."""
    import torch

    from tiledsl.reference import serving
    from tiledsl.reference.gpu import poisoned_outputs
    p = spec.problem
    batch = len(kv_lens)
    q = torch.randn(batch, HEADS, p.queries_per_seq, p.head_dim_qk, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, KV_HEADS, kv_len, p.head_dim_qk, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out, lse = poisoned_outputs(q, tuple(q.shape), tuple(q.shape[:3]))
    kernel_for(spec)(q, k, v, kv_lens=torch.tensor(kv_lens, device="cuda", dtype=torch.int32), out=out, lse=lse,
                     aux=aux)
    torch.cuda.synchronize()
    want_o, want_lse = np.zeros(tuple(q.shape)), np.full(tuple(q.shape[:3]), -np.inf)
    tokens = [x.double().cpu().numpy().transpose(0, 2, 1, 3) for x in (q, k, v)]   # token-major, as serving's
    for b, n in enumerate(kv_lens):
        o, l = serving.attend_modified(tokens[0][b], tokens[1][b][:n], tokens[2][b][:n], p.mods, b, host(aux),
                                       positions=True)
        want_o[b], want_lse[b] = o.transpose(1, 0, 2), l.T
    from .test_gpu_paged import errors as paged_errors
    return paged_errors(out.float().cpu().numpy(), lse.cpu().numpy(), want_o, want_lse)


def test_forced_split_kv_with_a_bias_and_a_window():
    """Seven splits: the window's empty middle splits write LSE = -inf partials, the merge keeps the rest."""
    spec = decode_spec(mods_of(score_mod=BIAS, mask_mod=WINDOW_GLOBAL), 4, 128, 7)
    check(contiguous_errors(spec, bias_table(), [0, 193, 4000], 4000))


def test_a_two_stage_walk_with_a_mask_that_reads_the_head():
    """Two stages: the prefetch `ahead` runs a visible tile before the one multiplied; the tiles are classed over
    each of the block's heads (a 2-query GQA group packs 8 rows of 4 heads)."""
    spec = decode_spec(mods_of(mask_mod=HEAD_MASK), 2, 64, 3, stages=2)
    check(contiguous_errors(spec, {}, [2999, 65, 1], 3000))


def test_varlen_runs_a_mask_mod_and_a_score_mod_over_three_sequences(monkeypatch):
    import torch

    import tiledsl
    from tiledsl.reference import serving
    poison_outputs(monkeypatch)
    lengths = [1, 17, 1000]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device="cuda", dtype=torch.int32)
    total = sum(lengths)
    q = torch.randn(total, HEADS, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, KV_HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    keywords = dict(score_mod="score + seq_bias[b, h] * (kv_idx % 3)", mask_mod="q_idx - kv_idx < 300 | kv_idx < 8")
    aux = {"seq_bias": torch.randn(3, HEADS, device="cuda", dtype=torch.float32)}
    mods = mods_of(**keywords)
    want = serving.varlen_attention(*(x.double().cpu().numpy() for x in (q, k, v)), cu.cpu().numpy(),
                                    cu.cpu().numpy(), mask="causal", mods=mods, aux=host(aux))
    for bounds in ((1000, 1000), (None, None)):   # sync-free (the bounds given) and the host-read path
        out, lse = tiledsl.varlen_attention(q, k, v, cu, cu, *bounds, causal=True, return_lse=True, aux=aux,
                                            **keywords)
        torch.cuda.synchronize()
        from .test_gpu_paged import errors as paged_errors
        check(paged_errors(out.float().cpu().numpy(), lse.cpu().numpy().T, *want))


def test_planned_varlen_reads_each_layers_aux_without_a_host_sync(monkeypatch):
    """VarlenAttention(score_mod=, mask_mod=): plan once, run two layers' seq_bias (no host sync in run); the kernel
    of the test above (the same tree, mask and head dim)."""
    import torch

    import tiledsl
    from tiledsl.reference import serving
    poison_outputs(monkeypatch)
    lengths = [1, 17, 1000]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = sum(lengths)
    q = torch.randn(total, HEADS, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, KV_HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    keywords = dict(score_mod="score + seq_bias[b, h] * (kv_idx % 3)", mask_mod="q_idx - kv_idx < 300 | kv_idx < 8")
    wrapper = tiledsl.VarlenAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, dtype=torch.bfloat16,
                                      device="cuda", max_batch=4, causal=True, **keywords)
    wrapper.plan(cu, cu)
    layers = [{"seq_bias": torch.randn(3, HEADS, device="cuda", dtype=torch.float32)} for _ in range(2)]
    wrapper.run(q, k, v, aux=layers[0], return_lse=True)   # the first run prepares
    outs = []
    with no_host_sync():
        for aux in layers:
            out, lse = wrapper.run(q, k, v, aux=aux, return_lse=True)
            outs.append((out.clone(), lse.clone()))
    torch.cuda.synchronize()
    from .test_gpu_paged import errors as paged_errors
    for (out, lse), aux in zip(outs, layers):
        want = serving.varlen_attention(*(x.double().cpu().numpy() for x in (q, k, v)), cu, cu, mask="causal",
                                        mods=mods_of(**keywords), aux=host(aux))
        check(paged_errors(out.float().cpu().numpy(), lse.cpu().numpy().T, *want))


def test_compute_sanitizer_on_a_small_paged_decode_with_a_bias(tmp_path):
    script = tmp_path / "serving_expressions_memcheck.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        import tiledsl
        q = torch.randn(2, 4, {HEADS}, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(9, 16, {KV_HEADS}, 128, device="cuda", dtype=torch.bfloat16)
        table = torch.tensor([[8, 3, 5, 0], [1, 2, 4, 6]], device="cuda", dtype=torch.int32)
        lens = torch.tensor([64, 5], device="cuda", dtype=torch.int32)
        bias = torch.randn({HEADS}, 8191, device="cuda")
        tiledsl.paged_attention(q, k, k, table, lens, causal=True, score_mod={BIAS!r}, aux={{"bias": bias}})
        torch.cuda.synchronize()
    """))
    memcheck(script)
