"""FP8 attention's API side on the CPU: packed sequences (dtype = e4m3 with layout = varlen, the hopper family) --
legality (per block refused at its line), the lowering and its source (the transposing warps and the consumers'
descales read the packed work item), nvcc's ptxas report of the API's kernels (no spills), the per-sequence float64
reference -- and the refusals of attention / varlen_attention and the spec checks that say which FP8 kernels lack a
setting, before any GPU work."""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.codegen.render import render
from tiledsl.dispatch.tuned import fp8_spec
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.families import feature_refusal, lower
from tiledsl.frontend.parse import parse_text
from tiledsl.reference.fp8 import (
    fp8_kernel_attention,
    prefill_attention_fp8,
    quantize_model,
    varlen_fp8_kernel_attention,
)
from tiledsl.serving.varlen import fp8_varlen_spec
from tiledsl.spec import Descale, DType, Mask, SeqLayout

SPEC = """attention t {{
    head_dim = {d}
    dtype = e4m3
    layout = varlen
    mask = causal
    {extra}
    schedule {{
        tile q = 128, kv = {kv}
        warpgroups producer 1 regs 32, consumer 2 regs 232
        pipeline 2 stages via tma
    }}
}}
"""


def varlen_fp8(d=128, kv=128, extra=""):
    return parse_text(SPEC.format(d=d, kv=kv, extra=extra))[0]


def test_varlen_fp8_checks_and_lowers_to_the_packed_template():
    spec = varlen_fp8()
    assert spec.problem.fp8 and spec.problem.seq_layout is SeqLayout.VARLEN and feature_refusal(spec) is None
    plan = lower(spec)
    assert plan.template == "hopper_varlen.cu.j2" and plan.fp8_inputs
    names = [p.name for line in plan.parameters for p in line]
    assert names[-3:] == ["q_descale", "k_descale", "v_descale"] and "cu_seqlens_q" in names and "q_len" not in names
    assert "varlen" in spec.kernel_name and "e4m3" in spec.kernel_name


def test_per_block_descales_are_refused_for_packed_sequences_at_their_line():
    with pytest.raises(SpecError) as err:
        lower(varlen_fp8(extra="descale = per_block"))
    assert "descale = per_block indexes the tiles of equal-length sequences" in err.value.message
    assert (err.value.span.line, err.value.span.column) == (6, 5)
    assert "per_head" in err.value.hint
    for kind in ("per_tensor", "per_head"):
        assert feature_refusal(varlen_fp8(extra=f"descale = {kind}")) is None


@pytest.mark.parametrize("d, kv", [(64, 128), (128, 128), (256, 64)])
def test_the_source_walks_packed_items_in_every_role(d, kv):
    source = render(lower(varlen_fp8(d, kv)))
    body = source.split('extern "C"')[1]
    # the copying thread, the transposing warps and the consumers all take the packed work item
    assert body.count("work_item<C>(item, heads, kv_group, cu_seqlens_q, cu_seqlens_k, work, total_q,") == 3
    # the descales' row is the item's sequence
    assert "descale_row{w.sequence, w.head, w.kv_head, w.q0};" in body
    assert "fp8_descales<C>(q_descale, k_descale, v_descale, descale_row, w.seq_q, w.seq_kv," in body
    assert "transpose_v<C>(shared.v(landing), shared.vt(stage), threadIdx.x - 32);" in body
    panel = 64 if d == 64 else 128   # FP8 boxes: rows of up to 128 bytes
    assert f"k_map, p * {panel}, w.k_row + tile * C::BC, w.kv_head, 0," in body
    assert "static constexpr int DESCALE = 1;" in source


def test_16bit_varlen_keeps_its_work_item():
    spec = parse_text(SPEC.replace("dtype = e4m3", "dtype = bf16").format(d=128, kv=128, extra="").replace(
        "regs 32, consumer 2 regs 232", "regs 24, consumer 2 regs 240"))[0]
    source = render(lower(spec))
    assert "w.batch" not in source and "descale" not in source and "transpose_v" not in source


@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL, Mask.WINDOW])
def test_the_api_spec_is_the_fp8_schedule_with_packed_sequences(mask):
    window = (100, 20) if mask is Mask.WINDOW else None
    for kind in (Descale.PER_TENSOR, Descale.PER_HEAD):
        spec = fp8_varlen_spec("sm_90a", 128, mask, window, None, kind, DType.FP16)
        batched = fp8_spec("sm_90a", 128, mask, window, None, kind, DType.FP16)
        assert spec.schedule == batched.schedule and spec.problem.seq_layout is SeqLayout.VARLEN
        assert spec.problem.descales is kind and spec.problem.output_dtype is DType.FP16
        assert lower(spec).template == "hopper_varlen.cu.j2"
    with pytest.raises(RuntimeInputError, match="varlen_attention: FP8 .* head dims 64, 128, 256; got head dim 96"):
        fp8_varlen_spec("sm_90a", 96, mask, window, None, Descale.PER_HEAD, DType.BF16)


def _nvcc_or_skip():
    from tiledsl.codegen import nvcc
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not on PATH")
    return nvcc


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_api_kernels_compile_without_spills(d, tmp_path):
    nvcc = _nvcc_or_skip()
    spec = fp8_varlen_spec("sm_90a", d, Mask.CAUSAL, None, None, Descale.PER_HEAD, DType.BF16)
    plan = lower(spec)
    _, report = nvcc.compile_to(render(plan), plan.kernel_name, "cubin", tmp_path)
    (info,) = nvcc.parse_ptxas(report).values()
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, report


# -- the per-sequence reference --------------------------------------------------------------------------------
def _packed(rng, lens, heads, d):
    return rng.standard_normal((sum(lens), heads, d)).astype(np.float32)


def _quantized_per_sequence(x, cu, kv_heads):
    """(packed e4m3 bytes, (sequences, kv_heads) descales): each sequence quantized as quantize_fp8(block=None)."""
    raw, descales = np.zeros(x.shape, dtype=np.uint8), []
    for b in range(len(cu) - 1):
        part = x[cu[b]:cu[b + 1]].transpose(1, 0, 2)[None]   # (1, heads, n, d)
        got, descale = quantize_model(part, None, kv_heads=kv_heads)
        raw[cu[b]:cu[b + 1]] = got[0].transpose(1, 0, 2)
        descales.append(descale[0])
    return raw, np.array(descales, dtype=np.float32)


def test_packed_reference_of_equal_lengths_is_the_batched_kernel_arithmetic():
    rng = np.random.default_rng()
    spec = fp8_spec("sm_90a", 64, Mask.CAUSAL, None, None, Descale.PER_HEAD, DType.BF16)
    batch, n, heads, kv_heads = 3, 200, 4, 2
    cu = np.arange(batch + 1) * n
    args = []
    for h in (heads, kv_heads, kv_heads):
        args.append(_quantized_per_sequence(_packed(rng, [n] * batch, h, 64), cu, kv_heads if h == heads else h))
    (q8, qs), (k8, ks), (v8, vs) = args
    o, lse = varlen_fp8_kernel_attention(spec, q8, k8, v8, cu, cu, qs, ks, vs)

    def batched(x):
        return x.reshape(batch, n, x.shape[1], x.shape[2]).transpose(0, 2, 1, 3)
    ref_o, ref_lse = fp8_kernel_attention(spec, batched(q8), batched(k8), batched(v8), qs, ks, vs)
    np.testing.assert_array_equal(o, ref_o.transpose(0, 2, 1, 3).reshape(o.shape))
    np.testing.assert_array_equal(lse, ref_lse.transpose(0, 2, 1).reshape(lse.shape))


def test_packed_reference_reads_each_sequences_descales_and_its_own_tiles():
    """Mixed lengths (an empty sequence, a query past its keys): with P unrounded, each sequence is plain float64
    attention of its own dequantized rows (sequence b's descales), masked bottom-right on its own lengths."""
    rng = np.random.default_rng()
    spec = fp8_spec("sm_90a", 128, Mask.CAUSAL, None, None, Descale.PER_HEAD, DType.BF16)
    q_lens, k_lens, heads, kv_heads = [1, 0, 300, 17, 5], [1, 9, 130, 40, 0], 4, 1
    cu_q, cu_k = np.concatenate([[0], np.cumsum(q_lens)]), np.concatenate([[0], np.cumsum(k_lens)])
    q8, qs = _quantized_per_sequence(_packed(rng, q_lens, heads, 128), cu_q, kv_heads)
    k8, ks = _quantized_per_sequence(_packed(rng, k_lens, kv_heads, 128), cu_k, kv_heads)
    v8, vs = _quantized_per_sequence(_packed(rng, k_lens, kv_heads, 128), cu_k, kv_heads)
    assert len(set(ks[:, 0].tolist())) > 2   # the sequences' descales differ
    o, lse = varlen_fp8_kernel_attention(spec, q8, k8, v8, cu_q, cu_k, qs, ks, vs, round_p=False)
    for b in range(len(q_lens)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_o, ref_lse = prefill_attention_fp8(*(x[None, part].transpose(0, 2, 1, 3) for x, part in
                                                 ((q8, rows), (k8, keys), (v8, keys))),
                                               qs[b:b + 1], ks[b:b + 1], vs[b:b + 1], mask="causal")
        np.testing.assert_allclose(o[rows], ref_o[0].transpose(1, 0, 2), rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[rows], ref_lse[0].T, rtol=0, atol=1e-12)
    assert np.isneginf(lse[cu_q[4]:cu_q[5]]).all() and not o[cu_q[4]:cu_q[5]].any()   # no keys: O = 0, LSE = -inf
    third = lse[cu_q[2]:cu_q[3]]   # 300 queries over 130 keys, bottom-right: rows 0..169 see none
    assert np.isneginf(third[:170]).all() and np.isfinite(third[170:]).all()
    rounded, _ = varlen_fp8_kernel_attention(spec, q8, k8, v8, cu_q, cu_k, qs, ks, vs)
    assert 5e-3 < np.linalg.norm(rounded - o) / np.linalg.norm(o) < 5e-2   # P's e4m3 rounding moves O


# -- the API's refusals, before any GPU work ----------------------------------------------------------------------
class _Packed:
    """Shape and dtype of a packed tensor (the refusals below read nothing else)."""
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


@pytest.mark.parametrize("dtype, keywords, match", [
    ("torch.float8_e4m3fn", {"q_descale": np.ones((2, 2, 3), np.float32)}, "per-block \\(3-d\\) descales"),
    ("torch.float8_e4m3fn", {"softcap": 30.0}, "FP8 .* no kernel with score or mask modifications"),
    ("torch.float8_e4m3fn", {"out_dtype": "float32"}, "out_dtype of FP8 attention is bf16 or fp16, got float32"),
    ("torch.bfloat16", {"k_descale": np.ones(1, np.float32)}, "are for FP8 attention"),
    ("torch.bfloat16", {"out_dtype": "fp16"}, "are for FP8 attention"),
])
def test_varlen_attention_refuses_fp8_misuse_before_launching(dtype, keywords, match):
    from tiledsl import varlen_attention
    q = _Packed((10, 2, 128), dtype)
    with pytest.raises(RuntimeInputError, match=match):
        varlen_attention(q, q, q, None, None, **keywords)


def test_descale_shape_errors_name_the_sequences_axis():
    from tiledsl.runtime.fp8_descales import check_descale
    from tiledsl.runtime.tensors import TensorView
    t = TensorView("k_descale", 0, (2, 2), (2, 1), DType.FP32, 0, None)
    with pytest.raises(RuntimeInputError, match=r"k_descale must have shape \(sequences, kv_heads\) = \(3, 2\)"):
        check_descale(t, "k_descale", Descale.PER_HEAD, (3, 2), 0, "kernel", "sequences")


@pytest.mark.parametrize("keywords, match", [
    ({"softcap": 30.0}, r"FP8 .* no kernel with score or mask modifications \(softcap\)"),
    ({"mask_mod": "kv_idx <= q_idx"}, r"modifications \(mask_mod\)"),
    ({"k_scale": 1.0}, "k_scale / v_scale dequantize an FP8 KV cache read by fp16 / bf16 q"),
])
def test_attention_refuses_what_fp8_does_not_take_before_launching(keywords, match):
    import tiledsl
    q = _Packed((1, 2, 100, 128), "torch.float8_e4m3fn")
    with pytest.raises(RuntimeInputError, match=match):
        tiledsl.attention(q, q, q, **keywords)


@pytest.mark.parametrize("extra, which", [
    ("mask = causal & document", "the hopper family's e4m3 (FP8) kernels"),
    ("layout = varlen\n    softcap = 30", "the hopper family's e4m3 (FP8) and varlen kernels"),
])
def test_modification_refusals_name_the_fp8_kernels(extra, which):
    from tiledsl.families import missing_template
    batched = SPEC.replace("    layout = varlen\n", "").replace("    mask = causal\n", "")
    spec = parse_text(batched.format(d=128, kv=128, extra=extra))[0]
    assert missing_template(spec).endswith(f"have no CUDA template yet for {which}")
    with pytest.raises(SpecError) as err:
        lower(spec)
    assert err.value.message.endswith(f"have no CUDA template yet for {which}")


@pytest.mark.parametrize("d, kv, block_kv", [(64, 256, 128), (128, 256, 128), (256, 128, 128)])
def test_per_block_descales_keep_the_tiles_quantize_fp8_names(d, kv, block_kv):
    """Per tensor and per head take the fastest tiles; per block keeps 128-key tiles, the tiles
    quantize_fp8(block=128) makes one descale for."""
    from tiledsl.dispatch.tuned import fp8_spec
    from tiledsl.spec import Descale, DType, Mask
    for descale in (Descale.PER_TENSOR, Descale.PER_HEAD):
        assert fp8_spec("sm_90a", d, Mask.CAUSAL, None, None, descale, DType.BF16).schedule.tile_kv == kv
    block = fp8_spec("sm_90a", d, Mask.CAUSAL, None, None, Descale.PER_BLOCK, DType.BF16).schedule
    assert (block.tile_q, block.tile_kv) == (128, block_kv)
