"""softcap, ALiBi (per head, per (sequence, head), geometric) and sinks in the hopper varlen kernel on the GPU,
against the float64 serving reference that runs the same modifications per sequence
(tiledsl.reference.serving.varlen_attention(..., mods=, aux=)): each modification alone and all three together, no
mask and causal, d64 and d128, uneven packed sequences with an empty one and a 1-token one, q lengths != k
lengths (rows that see no key but the sink), GQA; the kernel with max_seqlen (a work list without host reads)
into NaN-poisoned slices of larger buffers, then tiledsl.varlen_attention's host path, which must give the same
bits; a warm max_seqlen call without any host sync; the planned VarlenAttention with a sink tensor per layer;
one compute-sanitizer run. Bounds: tests/test_gpu_varlen.py's (O relative error per tensor and per sequence,
LSE absolute error, the guard rows around the outputs still NaN).

    python -m pytest -m gpu -n 14 tests/test_gpu_varlen_mods.py
"""
from __future__ import annotations

import textwrap

import pytest

from tiledsl.mods.model import AUX_ALIBI, AUX_SINKS, AlibiSlopes, Modifications
from tiledsl.spec import DType, Mask

from .gpu_support import memcheck, no_host_sync, requires_gpu
from .test_gpu_varlen import _case, _check, _poisoned, torch_equal

pytestmark = [pytest.mark.gpu, requires_gpu]

MODS = {"softcap": Modifications(softcap=30.0), "alibi": Modifications(alibi=AlibiSlopes.GIVEN),
        "alibi_geometric": Modifications(alibi=AlibiSlopes.GEOMETRIC), "sinks": Modifications(sinks=True),
        "all": Modifications(softcap=20.0, alibi=AlibiSlopes.GIVEN, sinks=True)}
UNEVEN = [1, 17, 0, 700, 300, 129]   # a 1-token sequence, an empty one, one over several query tiles


def aux_for(mods: Modifications, sequences: int, heads: int, per_sequence: bool) -> dict:
    """Fresh aux tensors: ALiBi slopes (heads,) or (sequences, heads), sinks (heads,) of about N(0, 4)."""
    import torch
    aux = {}
    if mods.alibi is AlibiSlopes.GIVEN:
        shape = (sequences, heads) if per_sequence else (heads,)
        aux[AUX_ALIBI] = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.5
    if mods.sinks:
        aux[AUX_SINKS] = torch.randn(heads, device="cuda", dtype=torch.float32) * 2
    return aux


def keywords_for(mods: Modifications, aux: dict) -> dict:
    """varlen_attention's keywords for `mods` and its aux tensors."""
    out = {} if mods.softcap is None else {"softcap": mods.softcap}
    if mods.alibi is AlibiSlopes.GEOMETRIC:
        out["alibi_slopes"] = "geometric"
    elif mods.alibi is AlibiSlopes.GIVEN:
        out["alibi_slopes"] = aux[AUX_ALIBI]
    if mods.sinks:
        out["sinks"] = aux[AUX_SINKS]
    return out


def check_against_reference(q, k, v, cu_q, cu_k, mask: str, mods, aux, out, lse, out_buf=None, lse_buf=None):
    """tests/test_gpu_varlen._check with the modifications: the reference gets the aux tensors (geometric ALiBi:
    none, the spec's own slopes); without the buffers (fresh outputs) no guard rows are checked."""
    host_aux = {n: t.double().cpu().numpy() for n, t in aux.items()}
    _check(q, k, v, cu_q, cu_k, mask, 0, 0, out, lse, out_buf, lse_buf, mods=mods, aux=host_aux)


def run_modified(q_lens, k_lens, mod: str, mask: str = "causal", d: int = 128, heads: int = 4, kv_heads: int = 2,
                 per_sequence: bool = False, seed: int = 0):
    """The varlen kernel with `mod` through max_seqlen (no host read) into poisoned outputs, checked against the
    reference; then varlen_attention's host path (cu_seqlens read and ordered there) gives the same bits."""
    import torch

    from tiledsl import varlen_attention
    from tiledsl.dispatch.kernels import kernel_for
    from tiledsl.runtime.device import device_arch
    from tiledsl.serving.varlen import varlen_spec
    mods = MODS[mod]
    torch.manual_seed(seed)
    q, k, v, cu_q, cu_k = _case(q_lens, k_lens, heads, kv_heads, d, DType.BF16, seed)
    aux = aux_for(mods, len(q_lens), heads, per_sequence)
    kernel = kernel_for(varlen_spec(device_arch(), DType.BF16, d, Mask(mask), d, None, None, mods))
    out, lse, out_buf, lse_buf = _poisoned(q.shape[0], heads, d, q.dtype)
    kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), out=out, lse=lse, aux=aux)
    check_against_reference(q, k, v, cu_q, cu_k, mask, mods, aux, out, lse, out_buf, lse_buf)
    o2, lse2 = varlen_attention(q, k, v, cu_q, cu_k, causal=mask == "causal", return_lse=True,
                                **keywords_for(mods, aux))
    assert torch_equal(o2, out) and torch_equal(lse2, lse, nan_ok=True)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("mod", sorted(MODS))
def test_modified_varlen_matches_reference(mod, mask, d):
    run_modified(UNEVEN, UNEVEN, mod, mask, d, seed=d + len(mod) + len(mask))


@pytest.mark.parametrize("mod", ["alibi", "all"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_per_sequence_slopes_gqa_and_q_lengths_unlike_k_lengths(mod, mask):
    # q > k under causal leaves a sequence's first rows with no key (the sink alone: O = 0, LSE = sink);
    # q = 5, k = 0 sees no key at all; q = 0, k = 64 gives no work item; 8 query heads share 1 kv head.
    run_modified([300, 1, 5, 129, 0, 1000], [1000, 2049, 0, 64, 64, 300], mod, mask, 64 if mask == "none" else 128,
                 heads=8, kv_heads=1, per_sequence=True, seed=11)


def test_sinks_rows_without_keys_get_the_sink_as_lse():
    """Sequences without keys (all but the last): every row sees only the sink, so O = 0 and LSE = sink_h exactly."""
    import torch

    from tiledsl import varlen_attention
    q, k, v, cu_q, cu_k = _case([33, 1, 200, 10], [0, 0, 0, 50], 4, 4, 64, DType.BF16, 5)
    sinks = torch.randn(4, device="cuda", dtype=torch.float32)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, 200, 50, sinks=sinks, return_lse=True)
    keyless = 234   # the first three sequences' rows
    assert torch.equal(out[:keyless], torch.zeros_like(out[:keyless]))
    assert torch.allclose(lse[:, :keyless], sinks[:, None].expand(4, keyless), rtol=0, atol=1e-6)


def test_a_warm_bounded_call_needs_no_host_sync():
    """With max_seqlen the first call of a signature prepares the launch; later ones (new sinks and slopes of the
    same signature among them) read pointers and launch without any host sync, and match the reference."""
    from tiledsl import varlen_attention
    mods = MODS["all"]
    q, k, v, cu_q, cu_k = _case(UNEVEN, UNEVEN, 4, 2, 128, DType.BF16, 21)
    layers = [aux_for(mods, len(UNEVEN), 4, per_sequence=True) for _ in range(2)]
    varlen_attention(q, k, v, cu_q, cu_k, max(UNEVEN), max(UNEVEN), causal=True, **keywords_for(mods, layers[0]))
    results = []
    with no_host_sync():
        for aux in layers:
            out, lse = varlen_attention(q, k, v, cu_q, cu_k, max(UNEVEN), max(UNEVEN), causal=True, return_lse=True,
                                        **keywords_for(mods, aux))
            results.append((out.clone(), lse.clone()))
    for (out, lse), aux in zip(results, layers):
        check_against_reference(q, k, v, cu_q, cu_k, "causal", mods, aux, out, lse)


def test_planned_varlen_runs_each_layers_sinks():
    """VarlenAttention(softcap=, alibi_slopes=per (sequence, head), sinks=True): plan once, run a layer's sinks
    each (no host sync in run), into NaN-poisoned outputs."""
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    mods = MODS["all"]
    heads, kv_heads, d = 8, 2, 128
    q, k, v, cu_q, cu_k = _case(UNEVEN, UNEVEN, heads, kv_heads, d, DType.BF16, 31)
    slopes = aux_for(Modifications(alibi=AlibiSlopes.GIVEN), len(UNEVEN), heads, per_sequence=True)[AUX_ALIBI]
    wrapper = tiledsl.VarlenAttention(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, dtype=torch.bfloat16,
                                      device="cuda", max_batch=8, causal=True, softcap=mods.softcap,
                                      alibi_slopes=slopes, sinks=True)
    wrapper.plan(cu_q.cpu(), cu_k.cpu())
    layer_sinks = [torch.randn(heads, device="cuda") * 2 for _ in range(2)]
    buffers = [_poisoned(q.shape[0], heads, d, q.dtype) for _ in layer_sinks]
    wrapper.run(q, k, v, out=buffers[0][0], lse=buffers[0][1], sinks=layer_sinks[0])   # the first run prepares
    with no_host_sync():
        for (out, lse, _, _), sinks in zip(buffers, layer_sinks):
            assert wrapper.run(q, k, v, out=out, lse=lse, sinks=sinks) is out
    for (out, lse, out_buf, lse_buf), sinks in zip(buffers, layer_sinks):
        check_against_reference(q, k, v, cu_q, cu_k, "causal", mods, {AUX_ALIBI: slopes, AUX_SINKS: sinks}, out, lse,
                                out_buf, lse_buf)
    with pytest.raises(RuntimeInputError, match="reads sinks"):
        wrapper.run(q, k, v)


def test_compute_sanitizer_on_a_small_modified_varlen_launch(tmp_path):
    script = tmp_path / "varlen_mods_memcheck.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tiledsl
        cu = torch.tensor([0, 1, 18, 18, 218, 223], device="cuda", dtype=torch.int32)
        q = torch.randn(223, 4, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(223, 2, 64, device="cuda", dtype=torch.bfloat16)
        mods = dict(softcap=20.0, alibi_slopes=torch.rand(5, 4, device="cuda"), sinks=torch.randn(4, device="cuda"))
        for causal in (False, True):
            tiledsl.varlen_attention(q, k, k, cu, cu, 200, 200, causal=causal, **mods)
            tiledsl.varlen_attention(q, k, k, cu, cu, causal=causal, **mods)
        torch.cuda.synchronize()
    """))
    memcheck(script)
