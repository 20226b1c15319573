"""FP8 (e4m3) KV cache for decode, on the CPU: the e4m3 decoder against known values, the DSL
settings (kv_dtype, kv_scale) and their refusals, names/hashes unchanged when unset, the layout's
rings and the rendered CUDA, the float64 reference's dequantization."""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.errors import SpecError
from tiledsl.reference.fp8 import attention_fp8, decode_e4m3, dequantize, e4m3_values, paged_attention_fp8
from tiledsl.frontend.parse import parse_text
from tiledsl.reference.serving import paged_attention
from tiledsl.spec import DType, KvScale

KNOWN = {0x00: 0.0, 0x80: -0.0, 0x38: 1.0, 0xB8: -1.0, 0x7E: 448.0, 0xFE: -448.0, 0x01: 2.0 ** -9,
         0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x40: 2.0, 0x30: 0.5, 0x3C: 1.5, 0x77: 240.0, 0x48: 4.0}


@pytest.mark.parametrize("byte,value", sorted(KNOWN.items()))
def test_e4m3_known_values(byte, value):
    got = decode_e4m3(np.array([byte], dtype=np.uint8))[0]
    assert got == value and np.signbit(got) == np.signbit(value)


def test_e4m3_nan_and_no_infinity():
    values = e4m3_values()
    assert np.isnan(values[0x7F]) and np.isnan(values[0xFF])
    assert np.isnan(values).sum() == 2 and not np.isinf(values).any()
    finite = values[np.isfinite(values)]
    assert finite.max() == 448.0 and finite.min() == -448.0
    positive = np.sort(values[:0x7F])
    assert (np.diff(positive) > 0).all()   # bytes 0..0x7e are increasing: no duplicates, no gaps in order


def test_decode_refuses_non_bytes():
    with pytest.raises(TypeError):
        decode_e4m3(np.zeros(3, dtype=np.int32))


def test_dequantize_per_head_and_per_tensor():
    raw = np.full((2, 3, 4, 16), 0x38, dtype=np.uint8)   # 1.0
    per_head = dequantize(raw, np.array([1.0, 2.0, 0.5]), head_axis=1)
    assert (per_head[:, 1] == 2.0).all() and (per_head[:, 2] == 0.5).all()
    assert (dequantize(raw, 3.0, head_axis=1) == 3.0).all()


def test_paged_reference_equals_dequantized_16bit_reference():
    rng = np.random.default_rng()
    pages, page, kv_heads, d, batch, nq, heads = 6, 4, 2, 32, 2, 3, 4
    k8 = rng.integers(0, 0x7E, (pages, page, kv_heads, d)).astype(np.uint8) | rng.choice([0, 0x80], (pages, page, kv_heads, d)).astype(np.uint8)
    v8 = rng.integers(0, 0x7E, (pages, page, kv_heads, d)).astype(np.uint8)
    ks, vs = rng.uniform(0.01, 0.1, kv_heads), rng.uniform(0.01, 0.1, kv_heads)
    q = rng.standard_normal((batch, nq, heads, d))
    table = np.array([[3, 1, 0], [5, 2, 4]], dtype=np.int32)
    lens = np.array([9, 0], dtype=np.int32)
    o, lse = paged_attention_fp8(q, k8, v8, ks, vs, table, lens, mask="causal")
    ref_o, ref_lse = paged_attention(q, e4m3_values()[k8] * ks[None, None, :, None],
                                     e4m3_values()[v8] * vs[None, None, :, None], table, lens, mask="causal")
    np.testing.assert_array_equal(o, ref_o)
    np.testing.assert_array_equal(lse, ref_lse)
    assert (o[1] == 0).all() and np.isneginf(lse[1]).all()


def test_contiguous_reference_matches_paged():
    rng = np.random.default_rng()
    batch, kv_heads, n, d, heads, nq = 2, 2, 8, 32, 4, 2
    k8 = rng.integers(0, 0x7E, (batch, kv_heads, n, d)).astype(np.uint8)
    v8 = rng.integers(0, 0x7E, (batch, kv_heads, n, d)).astype(np.uint8)
    q = rng.standard_normal((batch, heads, nq, d))
    lens = np.array([8, 5], dtype=np.int32)
    o, lse = attention_fp8(q, k8, v8, 0.05, np.array([0.1, 0.2]), lens)
    # the same bytes as a paged cache of page 8: sequence b in page b
    kp, vp = k8.transpose(0, 2, 1, 3), v8.transpose(0, 2, 1, 3)
    po, plse = paged_attention_fp8(q.transpose(0, 2, 1, 3), kp, vp, 0.05, np.array([0.1, 0.2]),
                                   np.array([[0], [1]], dtype=np.int32), lens)
    np.testing.assert_allclose(o, po.transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, plse.transpose(0, 2, 1), rtol=1e-12)


SPEC = """attention dec8 {{
    head_dim = {d}
    dtype = {dtype}
    queries = {nq}
{extra}
    schedule {{
        tile q = 16, kv = 128
        warps 4 along kv
        pipeline 1 stages via cp.async
        split kv = auto
{statements}
    }}
}}
"""


def spec_of(extra="", d=128, dtype="bf16", nq=1, statements=""):
    return parse_text(SPEC.format(d=d, dtype=dtype, nq=nq, extra=extra, statements=statements))[0]


def test_dequant_statement_picks_the_conversion_path():
    from tiledsl.layout.decode import FP8_CONVERT_DEFAULT
    from tiledsl.families import lower as lower_decode
    default = spec_of("    kv_dtype = e4m3")
    frag = spec_of("    kv_dtype = e4m3", statements="        dequant fragments")
    shared = spec_of("    kv_dtype = e4m3", statements="        dequant shared")
    assert default.schedule.fp8_convert is None and lower_decode(default).fp8_convert == FP8_CONVERT_DEFAULT
    assert frag.schedule.fp8_convert == "fragments" and lower_decode(frag).fp8_convert == "fragments"
    assert "_cvfragments" in frag.kernel_name and shared.schedule.fp8_convert == "shared"
    assert frag.span_of("dequant").line == 11   # errors and explain point at the statement


def test_dequant_space_and_refusals():
    from tiledsl.frontend.space import SpecSpace
    (space,) = parse_text(SPEC.format(d=128, dtype="bf16", nq=1, extra="    kv_dtype = e4m3",
                                      statements="        dequant in {shared, fragments}"))
    assert isinstance(space, SpecSpace) and [s.schedule.fp8_convert for s in space.expand()[0]] == ["shared", "fragments"]
    with pytest.raises(SpecError) as err:
        spec_of("    kv_dtype = e4m3", statements="        dequant registers")
    assert "unknown dequant 'registers'" in str(err.value) and "shared, fragments" in str(err.value)
    with pytest.raises(SpecError) as err:
        spec_of(statements="        dequant fragments")
    assert "`dequant` says where an FP8 KV cache becomes 16-bit" in str(err.value) and "kv_dtype = e4m3" in str(err.value)
    assert ":11:" in str(err.value)   # at the `dequant` line


def test_kv_dtype_sets_fields_and_name_only_when_set():
    plain = spec_of()
    same = spec_of("    kv_dtype = bf16")
    assert same == plain and same.kernel_name == plain.kernel_name and same.config_hash == plain.config_hash
    assert "kv_dtype" not in plain.config()["problem"]
    fp8 = spec_of("    kv_dtype = e4m3")
    assert fp8.problem.kv_dtype is DType.E4M3 and fp8.problem.kv_scale is KvScale.PER_HEAD
    assert fp8.kernel_name == plain.kernel_name.replace("_nq1_", "_nq1_kve4m3h_")
    tensor = spec_of("    kv_dtype = e4m3\n    kv_scale = per_tensor")
    assert tensor.problem.kv_scale is KvScale.PER_TENSOR and "kve4m3t" in tensor.kernel_name
    assert len({plain.config_hash, fp8.config_hash, tensor.config_hash}) == 3


@pytest.mark.parametrize("extra,words", [
    ("    kv_dtype = fp16", "unknown kv_dtype"),
    ("    kv_dtype = e5m2", "unknown kv_dtype"),
    ("    kv_scale = per_head", "kv_scale scales an FP8 KV cache"),
    ("    kv_dtype = e4m3\n    kv_scale = per_row", "unknown kv_scale"),
])
def test_bad_kv_settings_are_refused_at_the_line(extra, words):
    with pytest.raises(SpecError) as err:
        spec_of(extra)
    assert words in str(err.value) and "kv_" in str(err.value)


def test_e4m3_dtype_is_only_for_the_hopper_family():   # decode reads an FP8 cache through kv_dtype
    with pytest.raises(SpecError, match="only for the hopper family; this kernel is decode"):
        spec_of(dtype="e4m3")


def test_kv_dtype_only_for_decode():
    text = """attention pre {
    head_dim = 128
    kv_dtype = e4m3
}
"""
    with pytest.raises(SpecError, match="only for the decode family"):
        parse_text(text)


def test_fp8_head_dims_multiple_of_32():
    with pytest.raises(SpecError, match="multiples of 32"):
        spec_of("    kv_dtype = e4m3", d=48)


@pytest.mark.parametrize("page", [None, 1, 16, 32])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp8_renders_and_halves_the_ring(page, dtype):
    from tiledsl.families import layout_of
    from tiledsl.families import lower as lower_decode
    from tiledsl.runtime.decode import constant
    from tiledsl.codegen.render import render
    extra = "    kv_dtype = e4m3" + (f"\n    kv_cache = paged(page = {page})" if page else "")
    spec, plain = spec_of(extra, dtype=dtype), spec_of(f"    kv_cache = paged(page = {page})" if page else "", dtype=dtype)
    lay, base = layout_of(spec), layout_of(plain)
    assert lay.buffer("K").stage_bytes * 2 <= base.buffer("K").stage_bytes   # e4m3 rows: half the bytes
    plan = lower_decode(spec)
    assert plan.kv_fp8 and constant(plan, "K8_ROW_BYTES") == 128 and constant(plan, "DEQUANT_VIA_F32") == (dtype == "bf16")
    cuda = render(plan)
    assert "cvt.rn.f16x2.e4m3x2" in cuda and "scale_scores(acc_s, k_dequant)" in cuda and "v_dequant / l" in cuda
    assert "dequant_slice" not in render(lower_decode(plain))


@pytest.mark.parametrize("d", [64, 128, 192, 224, 256])
def test_api_picks_fp8_schedule(d):
    """attention / paged_attention over an FP8 cache run autoschedule.FP8_DECODE_SCHEDULE (the
    bundled bf16 schedule when it is None); 16-bit caches keep the bundled one."""
    from tiledsl.dispatch.autoschedule import fp8_decode_schedule, pick_decode
    from tiledsl.spec import Mask, Problem
    fp8 = Problem(d, d, DType.BF16, Mask.NONE, kv_dtype=DType.E4M3, kv_scale=KvScale.PER_HEAD)
    s = pick_decode(fp8, 1).schedule
    assert s == fp8_decode_schedule(d) and s.fp8_convert == "fragments" and s.tile_kv == (64 if d > 192 else 128)
    s = pick_decode(Problem(d, d, DType.BF16, Mask.NONE), 1).schedule
    assert (s.tile_kv, s.stages) == (128, 1)


def test_traffic_counts_kv_bytes_in_the_cache_dtype():
    """explain's HBM traffic: an e4m3 cache reads one byte per K, V element, Q and O keep two."""
    from tiledsl.schedule.passes import run_passes
    from tiledsl.schedule.traffic import hbm_traffic
    fp8, plain = (hbm_traffic(run_passes(s), 2, 8, 1, 4096) for s in (spec_of("    kv_dtype = e4m3"), spec_of()))
    by = lambda t: {(o.tensor, o.mode): o.bytes for o in t.ops}   # noqa: E731
    for tensor in ("K", "V"):
        assert by(fp8)[(tensor, "read")] * 2 == by(plain)[(tensor, "read")] == 2 * 8 * 4096 * 128 * 2
    assert by(fp8)[("Q", "read")] == by(plain)[("Q", "read")] and by(fp8)[("O", "write")] == by(plain)[("O", "write")]
