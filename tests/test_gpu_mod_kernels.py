"""The hopper forward kernels with score modifications (softcap by each of its ways, ALiBi given and geometric,
sinks; softcap also with scores spread past its cap) on the GPU
against the float64 reference that runs the same modifications (tiledsl.reference.forward): causal and no
mask, d64 and d128, query lengths 1, 17 and 1000 (rows that see no key among them), GQA, per-sequence
kv_lens including 0, NaN-poisoned outputs; the API's keywords on the tuned path, its refusal of gradients without a backward,
and one compute-sanitizer run."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tiledsl.mods.model import AUX_ALIBI, AUX_SINKS, AlibiSlopes, Modifications
from tiledsl.mods.softcap import TanhVia
from tiledsl.spec import CopyVia, DType, KernelSpec, Mask, Mma, Problem, Schedule

from .gpu_support import check, kernel_for, memcheck, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

MODS = {"softcap": Modifications(softcap=30.0), "alibi": Modifications(alibi=AlibiSlopes.GIVEN),
        "softcap_fma": Modifications(softcap=30.0, softcap_via=TanhVia.FMA),
        "softcap_split": Modifications(softcap=30.0, softcap_via=TanhVia.SPLIT),
        "softcap_tanh_approx": Modifications(softcap=0.5, softcap_via=TanhVia.TANH_APPROX),
        "alibi_geometric": Modifications(alibi=AlibiSlopes.GEOMETRIC), "sinks": Modifications(sinks=True),
        "all": Modifications(softcap=20.0, alibi=AlibiSlopes.GIVEN, sinks=True)}


def schedule(head_dim: int) -> Schedule:
    consumers, regs = (3, (32, 160)) if head_dim == 64 else (2, (24, 240))
    return Schedule(tile_q=64 * consumers, tile_kv=128, stages=2, copy=CopyVia.TMA, mma=Mma.WGMMA,
                    producer_warpgroups=1, producer_regs=regs[0], consumer_warpgroups=consumers,
                    consumer_regs=regs[1], intra_overlap=True)


def spec_of(mod: str, mask: str, head_dim: int) -> KernelSpec:
    problem = Problem(head_dim, head_dim, DType.BF16, Mask(mask), mods=MODS[mod])
    return KernelSpec(f"mod_{mod}_{mask}_d{head_dim}", problem, schedule(head_dim))


def aux_for(mods: Modifications, batch: int, heads: int, per_batch: bool = False) -> dict:
    import torch
    aux = {}
    if mods.alibi is AlibiSlopes.GIVEN:
        shape = (batch, heads) if per_batch else (heads,)
        aux[AUX_ALIBI] = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.5
    if mods.sinks:
        aux[AUX_SINKS] = torch.randn(heads, device="cuda", dtype=torch.float32) * 2
    return aux


def errors(spec, batch, heads, q_len, kv_len, kv_heads=None, kv_lens=None, per_batch=False, spread=1.0):
    """(O error, LSE error) of one run into NaN-poisoned outputs against the float64 reference."""
    import cupy
    import torch

    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import (
        as_float64,
        lse_error,
        poisoned_outputs,
        relative_error,
    )
    from tiledsl.runtime.tensors import view
    d, kv_heads = spec.problem.head_dim_qk, kv_heads or heads
    q = (torch.randn(batch, heads, q_len, d, device="cuda") * spread).to(torch.bfloat16)
    k = (torch.randn(batch, kv_heads, kv_len, d, device="cuda") * spread).to(torch.bfloat16)
    v = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=torch.bfloat16)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    aux = aux_for(spec.problem.mods, batch, heads, per_batch)
    out, lse = poisoned_outputs(q, (batch, heads, q_len, d), (batch, heads, q_len))
    kernel_for(spec)(q, k, v, kv_lens=lens, out=out, lse=lse, aux=aux)
    torch.cuda.synchronize()
    q64, k64, v64 = (cupy.asnumpy(as_float64(view(x, n))) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    lens64 = None if kv_lens is None else np.array(kv_lens)
    ref_o, ref_lse = reference_attention(spec, q64, k64, v64, lens64, aux={n: t.cpu().numpy() for n, t in aux.items()})
    return relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("mod", sorted(MODS))
@pytest.mark.parametrize("q_len", [1, 17, 1000])
def test_modified_kernel_matches_reference(mod, mask, head_dim, q_len):
    check(errors(spec_of(mod, mask, head_dim), 2, 3, q_len, q_len))


@pytest.mark.parametrize("mod", ["softcap", "alibi", "sinks", "all"])
def test_gqa_unequal_lengths_and_kv_lens_with_zero(mod):
    # 300 queries over 200 keys (causal: the first rows see no key), per-sequence lengths 0, 1 and 137
    check(errors(spec_of(mod, "causal", 128), 3, 8, 300, 200, kv_heads=2, kv_lens=[0, 1, 137]))
    check(errors(spec_of(mod, "none", 64), 3, 4, 130, 257, kv_heads=1, kv_lens=[257, 0, 64]))


@pytest.mark.parametrize("via", [TanhVia.EX2, TanhVia.FMA, TanhVia.SPLIT])
@pytest.mark.parametrize("cap", [15.0, 30.0, 50.0])
def test_softcap_ways_where_scores_saturate(via, cap):
    """q and k spread 3x: scaled scores of about N(0, 81), many past the cap, so tanh's whole range is used."""
    mods = Modifications(softcap=cap, softcap_via=via)
    spec = KernelSpec(f"softcap_{via.value}", Problem(128, 128, DType.BF16, Mask.CAUSAL, mods=mods), schedule(128))
    check(errors(spec, 2, 3, 700, 700, spread=3.0))


def test_alibi_slopes_per_batch_entry():
    check(errors(spec_of("alibi", "causal", 128), 2, 4, 200, 300, per_batch=True))


def test_sinks_rows_without_keys_get_the_sink_as_lse():
    """kv_lens 0: every row sees only the sink, so O = 0 and LSE = sink_h exactly."""
    import torch
    spec = spec_of("sinks", "none", 64)
    q = torch.randn(1, 4, 33, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 50, 64, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(4, device="cuda", dtype=torch.float32)
    out, lse = kernel_for(spec)(q, k, k.clone(), kv_lens=torch.zeros(1, device="cuda", dtype=torch.int32),
                                aux={AUX_SINKS: sinks})
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, sinks[None, :, None].expand_as(lse), rtol=0, atol=1e-6)


def test_aux_tensors_are_checked_before_launch():
    import torch

    from tiledsl.errors import RuntimeInputError
    kernel = kernel_for(spec_of("sinks", "causal", 64))
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    for aux, words in (({}, "missing sinks"), ({AUX_SINKS: torch.zeros(4, device="cuda")}, None),
                       ({AUX_SINKS: torch.zeros(3, device="cuda")}, "shape"),
                       ({AUX_SINKS: torch.zeros(4, device="cuda", dtype=torch.float16)}, "float32"),
                       ({AUX_SINKS: torch.zeros(4, device="cuda"), "bias": q}, "not read")):
        if words is None:
            kernel(q, q, q, aux=aux)
            continue
        with pytest.raises(RuntimeInputError, match=words):
            kernel(q, q, q, aux=aux)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_api_keywords_run_the_modified_kernels(head_dim):
    """tiledsl.attention(..., softcap=, alibi_slopes=, sinks=) on the tuned path, decode-length queries too."""
    import cupy
    import torch

    import tiledsl
    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import as_float64, lse_error, relative_error
    from tiledsl.runtime.tensors import view
    for q_len, causal in ((1, False), (700, True)):
        q = torch.randn(2, 4, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 2, 700, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sinks = torch.randn(4, device="cuda", dtype=torch.float32)
        out, lse = tiledsl.attention(q, k, v, causal=causal, softcap=25.0, alibi_slopes="geometric", sinks=sinks,
                                     return_lse=True)
        spec = tiledsl.parse_text(tiledsl.spec_for(q, k, v, causal=causal, softcap=25.0, alibi_slopes="geometric",
                                                   sinks=sinks))[0]
        q64, k64, v64 = (cupy.asnumpy(as_float64(view(x, n))) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        ref_o, ref_lse = reference_attention(spec, q64, k64, v64, aux={AUX_SINKS: sinks.cpu().numpy()})
        check((relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))))


def test_api_refuses_gradients_through_a_modification_without_a_backward():
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.zeros(1, 64, device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeInputError, match="no gradient through the modifications .document"):
        tiledsl.attention(q, q, q, document_ids=ids)
    with torch.no_grad():
        tiledsl.attention(q, q, q, document_ids=ids)


def test_other_families_and_modifications_refuse_clearly():
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    packed = q[0].transpose(0, 1).contiguous()   # (64 tokens, 2 heads, 64)
    cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeInputError, match="no CUDA template"):
        tiledsl.varlen_attention(packed, packed, packed, cu, cu, 64, 64, mask_mod="kv_idx != 3")


def test_compute_sanitizer_on_a_small_modified_case(tmp_path):
    script = tmp_path / "mods_memcheck.py"
    script.write_text(textwrap.dedent("""
        import torch
        from tiledsl import compile
        from tiledsl.mods.model import AlibiSlopes, Modifications
        from tests.test_gpu_mod_kernels import schedule
        from tiledsl.spec import DType, KernelSpec, Mask, Problem
        mods = Modifications(softcap=30.0, alibi=AlibiSlopes.GIVEN, sinks=True)
        kernel = compile(KernelSpec("memcheck", Problem(64, 64, DType.BF16, Mask.CAUSAL, mods=mods), schedule(64)))
        q = torch.randn(2, 2, 77, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1, 150, 64, device="cuda", dtype=torch.bfloat16)
        aux = {"alibi_slopes": torch.rand(2, 2, device="cuda"), "sinks": torch.randn(2, device="cuda")}
        kernel(q, k, k, kv_lens=torch.tensor([150, 3], device="cuda", dtype=torch.int32), aux=aux)
        torch.cuda.synchronize()
    """))
    memcheck(script)
