"""FP8 attention (dtype = e4m3, the hopper family) on the CPU: the DSL and its refusals, the layout, the plan and
source, the float64 reference of dequantized inputs, and a NumPy model of the kernel's register and shared-memory
choreography (P's e4m3 A fragments against V^T's permuted keys) that must reproduce P V exactly."""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.codegen.render import render
from tiledsl.errors import SpecError
from tiledsl.families import layout_of, lower
from tiledsl.frontend.parse import parse_text
from tiledsl.reference.forward import naive_attention
from tiledsl.reference.fp8 import decode_e4m3, dequantize_blocks, prefill_attention_fp8
from tiledsl.spec import Descale, DType

HOPPER = """
attention t {{
    head_dim = {d}
    dtype = e4m3
    {extra}
    schedule {{
        order q, kv
        tile q = 128, kv = {kv}
        warpgroups producer 1 regs 40, consumer 2 regs 232
        pipeline 2 stages via tma
        {schedule}
    }}
}}
"""


def hopper(d=128, kv=128, extra="", schedule=""):
    return parse_text(HOPPER.format(d=d, kv=kv, extra=extra, schedule=schedule))[0]


def test_e4m3_spec_defaults_and_name():
    spec = hopper()
    p = spec.problem
    assert p.fp8 and p.dtype is DType.E4M3 and p.output_dtype is DType.BF16 and p.descales is Descale.PER_HEAD
    assert spec.kernel_name == "hopper_d128_e4m3_dsh_q128_kv128_p1r40_c2r232_s2tma"
    # the defaults written out are the same kernel
    assert hopper(extra="out_dtype = bf16\n descale = per_head").kernel_name == spec.kernel_name
    other = hopper(extra="out_dtype = fp16\n descale = per_block")
    assert other.problem.output_dtype is DType.FP16 and "dsb_ofp16" in other.kernel_name
    assert other.config_hash != spec.config_hash


@pytest.mark.parametrize("text, where, message", [
    ("attention a {\n head_dim = 128\n dtype = e4m3\n}", (3, 2), "only for the hopper family"),
    ("attention a {\n head_dim = 128\n out_dtype = fp16\n}", (3, 14), "output type of FP8 attention"),
    ("attention a {\n head_dim = 128\n descale = per_block\n}", (3, 12), "granularity of FP8 attention"),
    ("attention a {\n head_dim = 128\n dtype = e4m3\n out_dtype = fp32\n}", (4, 14), "unknown out_dtype"),
])
def test_fp8_settings_refused_where_written(text, where, message):
    with pytest.raises(SpecError) as err:
        parse_text(text)
    assert message in err.value.message
    assert (err.value.span.line, err.value.span.column) == where


@pytest.mark.parametrize("extra, schedule, key, message", [
    ("", "launch dynamic", "launch", "launch dynamic"),
    ("layout = varlen\n    descale = per_block", "", "descale", "descale = per_block indexes the tiles"),
    ("softcap = 30", "", "softcap", "score and mask modifications"),
])
def test_fp8_refuses_what_its_template_lacks(extra, schedule, key, message):
    with pytest.raises(SpecError) as err:
        lower(hopper(extra=extra, schedule=schedule))
    assert message in err.value.message


@pytest.mark.parametrize("overlap", ["intra", "pingpong", "pingpong, intra"])
def test_fp8_overlaps_lower(overlap):
    """Intra overlap peels the first tile's Q K^T and the last tile's P V, and holds tile j-1's e4m3 P fragments
    (Bc/8 registers) beside S_j; ping-pong passes turns. The kernel reads the descale of the tile each op works on."""
    spec = hopper(schedule=f"overlap {overlap}")
    plan = lower(spec)
    source = render(plan)
    intra = "intra" in overlap
    peeled = (plan.loop_start, bool(plan.prologue), bool(plan.epilogue))
    assert peeled == ((1, True, True) if intra else (0, False, False))
    registers = {r.name: r.amount for r in layout_of(spec).registers}
    assert registers.get("P fragments") == (128 // 8 if intra else None)
    assert "fp8_softmax_update<C>(acc_s, row_max, row_sum, alpha, score_descale<C>(descales, tile));" in source
    if intra:   # O *= alpha_{j-1} in trip j: the V descale ratio of tile j-1's P V
        assert "carry_v_descale<C>(alpha, descales, tile_begin + (it - 1 - it_base), tile_begin);" in source
    assert ("named_barrier_arrive(C::TURN_BAR" in source) == ("pingpong" in overlap)


@pytest.mark.parametrize("d, kv, message", [(96, 128, "head dims 64, 128, 256"), (128, 96, "tile kv = 96")])
def test_fp8_layout_refusals(d, kv, message):
    with pytest.raises(SpecError) as err:
        hopper(d=d, kv=kv)
    assert message in err.value.message


@pytest.mark.parametrize("d, kv, landing", [(64, 128, 2), (128, 128, 2), (256, 64, 2), (64, 256, 2), (128, 256, 1)])
def test_fp8_layout_sizes(d, kv, landing):
    """V lands in a ring as deep as K's where that fits; at d128 with 256-key tiles in one slot (two would take
    245 KB): the transposers copy each tile into V^T's ring as it lands."""
    lay = layout_of(hopper(d=d, kv=kv))
    q, k, v, vt, o = (lay.buffer(n) for n in ("Q", "K", "V", "V^T", "O staging"))
    assert q.bytes == 128 * d and k.stage_bytes == kv * d and v.stage_bytes == kv * d
    assert v.stages == landing and v.bytes == landing * kv * d and k.stages == 2
    assert vt.stage_bytes == d * kv and vt.stages == 2 and o.bytes == 128 * d * 2 and o.reuses == ""
    assert all(b.offset % 1024 == 0 for b in (q, k, v, vt, o))
    assert lay.smem_bytes <= lay.smem_limit
    source = render(lower(hopper(d=d, kv=kv)))
    assert f"static constexpr int V_LANDING_STAGES = {landing};" in source
    assert "transpose_v<C>(shared.v(landing), shared.vt(stage)" in source


def test_fp8_source_spells_e4m3_wgmma_and_the_transpose():
    plan = lower(hopper(extra="descale = per_block"))
    src = render(plan)
    assert "m64n128k32.f32.\" \"e4m3\" \".\" \"e4m3\"" in src
    assert "p, 1, 1;" in src and "p, 1, 1, 0, 0;" not in src   # no transpose immediates on e4m3
    assert "transpose_v<C>(shared.v(landing), shared.vt(stage)" in src
    assert "cvt.rn.satfinite.e4m3x2.f32" in src and "static constexpr int DESCALE = 2;" in src
    assert "#define TILE_DTYPE \"bf16\"" in src   # O's type


def test_16bit_hopper_source_has_no_fp8_spelling():
    spec = parse_text(HOPPER.replace("dtype = e4m3", "dtype = bf16").format(d=128, kv=128, extra="", schedule=""))[0]
    src = render(lower(spec))
    assert "e4m3x2" not in src and "transpose_v" not in src and "k16.f32.\" TILE_DTYPE \".\" TILE_DTYPE" in src and "p, 1, 1, 0, 0;" in src


# -- the kernel's choreography, modelled in NumPy ------------------------------------------------------------
def _pack_p_model(p: np.ndarray) -> dict:
    """templates/hopper_fp8.cuh pack_p for one warpgroup: (thread, kk, register) -> 4 values, from S's fp32
    accumulator layout (thread t of warp w: row 16w + lane/4 (+8), columns 8 n + 2 (lane % 4) + {0, 1})."""
    frags = {}
    for thread in range(128):
        warp, lane = divmod(thread, 32)
        r, q = 16 * warp + lane // 4, lane % 4

        def acc(tile, e):   # accumulator e of n8 tile `tile`
            return p[r + 8 * (e >> 1), 8 * tile + 2 * q + (e & 1)]
        for kk in range(p.shape[1] // 32):
            t0, t1, t2, t3 = 4 * kk, 4 * kk + 1, 4 * kk + 2, 4 * kk + 3
            frags[thread, kk, 0] = [acc(t0, 0), acc(t0, 1), acc(t1, 0), acc(t1, 1)]
            frags[thread, kk, 1] = [acc(t0, 2), acc(t0, 3), acc(t1, 2), acc(t1, 3)]
            frags[thread, kk, 2] = [acc(t2, 0), acc(t2, 1), acc(t3, 0), acc(t3, 1)]
            frags[thread, kk, 3] = [acc(t2, 2), acc(t2, 3), acc(t3, 2), acc(t3, 3)]
    return frags


def _a_operand(frags: dict, rows: int, keys: int) -> np.ndarray:
    """The 64 x keys A matrix wgmma k32 (8-bit) reads from those registers: register i of thread t holds row
    16w + lane/4 + 8 (i % 2), K columns 16 (i // 2) + 4 (lane % 4) + byte."""
    a = np.full((rows, keys), np.nan)
    for (thread, kk, i), values in frags.items():
        warp, lane = divmod(thread, 32)
        row = 16 * warp + lane // 4 + 8 * (i % 2)
        for byte, value in enumerate(values):
            a[row, 32 * kk + 16 * (i // 2) + 4 * (lane % 4) + byte] = value
    return a


def _swizzled(row, byte, rows, width):
    linear = (byte // width) * rows * width + row * width + byte % width
    return linear ^ (((linear >> 7) & (width // 16 - 1)) << 4)


def _transpose_v_model(v: np.ndarray, v_width: int, vt_width: int, transposers: int = 96) -> np.ndarray:
    """transpose_v over shared memory: V (Bc x dv, swizzled rows of v_width) -> V^T (dv x Bc) read back through
    the swizzle the writes used; every V^T byte must be written exactly once."""
    bc, dv = v.shape
    smem_v = np.zeros(bc * dv)
    for key in range(bc):
        for col in range(dv):
            smem_v[_swizzled(key, col, bc, v_width)] = v[key, col]
    smem_vt, writes = np.zeros(dv * bc), np.zeros(dv * bc, dtype=int)
    units = (bc // 4) * (dv // 4)
    for thread in range(transposers):
        for unit in range(thread, units, transposers):
            quad, column = unit % (bc // 4), (unit // (bc // 4)) * 4
            group, q = (quad // 4) * 16, quad % 4
            keys = [group + 2 * q, group + 2 * q + 1, group + 2 * q + 8, group + 2 * q + 9]
            loaded = [[smem_v[_swizzled(k, column + c, bc, v_width)] for c in range(4)] for k in keys]
            for c in range(4):   # the byte transpose: column c's bytes of the four keys
                for e in range(4):
                    at = _swizzled(column + c, group + 4 * q + e, dv, vt_width)
                    smem_vt[at] = loaded[e][c]
                    writes[at] += 1
    assert (writes == 1).all(), "V^T bytes written other than once"
    return np.array([[smem_vt[_swizzled(n, k, dv, vt_width)] for k in range(bc)] for n in range(dv)])


@pytest.mark.parametrize("bc, dv", [(128, 128), (64, 256), (128, 64)])
def test_packed_p_times_transposed_v_is_p_v(bc, dv):
    rng = np.random.default_rng()
    p, v = rng.random((64, bc)), rng.standard_normal((bc, dv))
    a = _a_operand(_pack_p_model(p), 64, bc)
    assert not np.isnan(a).any()
    vt = _transpose_v_model(v, 64 if dv == 64 else 128, 64 if bc == 64 else 128)
    np.testing.assert_allclose(a @ vt.T, p @ v, rtol=1e-12, atol=1e-12)   # B[k, n] = V^T[n, k]


# -- the reference ----------------------------------------------------------------------------------------
def _e4m3_bytes(rng, shape):
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((raw & 0x7F) == 0x7F, raw & 0xF0, raw).astype(np.uint8)   # no NaN bytes


def test_reference_dequantizes_per_head_with_q_shared_by_its_kv_head():
    rng = np.random.default_rng()
    q8, k8, v8 = _e4m3_bytes(rng, (2, 4, 9, 64)), _e4m3_bytes(rng, (2, 2, 11, 64)), _e4m3_bytes(rng, (2, 2, 11, 64))
    qs, ks, vs = (rng.random((2, 2)) + 0.01 for _ in range(3))
    o, lse = prefill_attention_fp8(q8, k8, v8, qs, ks, vs, mask="causal", scale=0.01)
    q = decode_e4m3(q8) * np.repeat(qs, 2, axis=1)[:, :, None, None]
    ref_o, ref_lse = naive_attention(q, decode_e4m3(k8) * ks[:, :, None, None], decode_e4m3(v8) * vs[:, :, None, None],
                                     "causal", scale=0.01)
    np.testing.assert_array_equal(o, ref_o)
    np.testing.assert_array_equal(lse, ref_lse)


def test_block_dequantization_indexes_rows_by_tile():
    rng = np.random.default_rng()
    raw = _e4m3_bytes(rng, (1, 2, 300, 8))
    descale = rng.random((1, 2, 3))
    out = dequantize_blocks(raw, descale, 128)
    for h in range(2):
        for row in range(300):
            np.testing.assert_array_equal(out[0, h, row], decode_e4m3(raw[0, h, row]) * descale[0, h, row // 128])



# -- the kernel's arithmetic: P rounded to e4m3 over the kernel's kv tiles ----------------------------------------
from tiledsl.dispatch.tuned import fp8_spec  # noqa: E402
from tiledsl.reference.fp8 import dequantize_fp8_inputs, fp8_kernel_attention, round_p_e4m3  # noqa: E402
from tiledsl.reference.fp8 import quantize_model as _quantize  # noqa: E402
from tiledsl.spec import Mask  # noqa: E402

KERNEL_CASES = [(64, Mask.CAUSAL, Descale.PER_BLOCK, 300, 300), (128, Mask.NONE, Descale.PER_HEAD, 17, 300),
                (256, Mask.CAUSAL, Descale.PER_TENSOR, 200, 200), (128, Mask.WINDOW, Descale.PER_BLOCK, 300, 300)]


def _fp8_inputs(rng, spec, kind, q_len, kv_len, heads=4, kv_heads=2):
    """(bytes q, k, v, descales q, k, v) of N(0, 1) inputs, quantized as quantize_fp8 does for this spec's tiles."""
    d = spec.problem.head_dim_qk
    per_tensor, blocks = kind is Descale.PER_TENSOR, (spec.schedule.tile_q, spec.schedule.tile_kv)
    per_block = kind is Descale.PER_BLOCK
    x = [rng.standard_normal((2, h, n, d)).astype(np.float32) for h, n in ((heads, q_len), (kv_heads, kv_len),
                                                                           (kv_heads, kv_len))]
    out = [_quantize(x[0], blocks[0] if per_block else None, kv_heads=kv_heads, per_tensor=per_tensor)]
    out += [_quantize(t, blocks[1] if per_block else None, per_tensor=per_tensor) for t in x[1:]]
    return [raw for raw, _ in out] + [descale for _, descale in out]


def _window(mask):
    return (70, 0) if mask is Mask.WINDOW else None


def _relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("d, mask, kind, q_len, kv_len", KERNEL_CASES)
def test_kernel_arithmetic_is_the_plain_reference_until_p_is_rounded(d, mask, kind, q_len, kv_len):
    rng = np.random.default_rng()
    spec = fp8_spec("sm_90a", d, mask, _window(mask), None, kind, DType.BF16)
    args = _fp8_inputs(rng, spec, kind, q_len, kv_len)
    kv_lens = np.array([kv_len, kv_len // 3])
    blocks = {"block_q": spec.schedule.tile_q, "block_kv": spec.schedule.tile_kv} if kind is Descale.PER_BLOCK else {}
    window = {"window_left": 70} if mask is Mask.WINDOW else {}
    plain_o, plain_lse = prefill_attention_fp8(*args, kv_lens=kv_lens, mask=mask.value, **blocks, **window)
    exact_o, exact_lse = fp8_kernel_attention(spec, *args, kv_lens=kv_lens, round_p=False)
    np.testing.assert_allclose(exact_o, plain_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(exact_lse, plain_lse, rtol=0, atol=1e-12)
    o, lse = fp8_kernel_attention(spec, *args, kv_lens=kv_lens)
    # e4m3 keeps 3 mantissa bits: each weight moves by up to 2^-4 of itself, O by ~2e-2 normwise; l is the unrounded
    # sum, so the LSE does not move
    assert 5e-3 < _relative(o, plain_o) < 5e-2
    np.testing.assert_allclose(lse, plain_lse, rtol=0, atol=1e-12)


def test_kernel_arithmetic_rounds_p_against_the_running_max_of_each_kv_tile():
    """An independent loop over d128's kv tiles of 128: the running max m, P = exp(s - m) rounded to e4m3 * 256 for
    P V, l summing P unrounded, O and l rescaled by exp(m_old - m_new). K's tile descales grow tile by tile, so most
    rows' max moves on at every tile."""
    rng = np.random.default_rng()
    spec = fp8_spec("sm_90a", 128, Mask.NONE, None, None, Descale.PER_BLOCK, DType.BF16)
    args = _fp8_inputs(rng, spec, Descale.PER_BLOCK, 40, 520, heads=1, kv_heads=1)
    args[4] = args[4] * np.arange(1, 6)   # K's 5 tiles: descales x1 .. x5
    q, k, v = (x[0, 0] for x in dequantize_fp8_inputs(*args, block_q=128, block_kv=128))
    s = q @ k.T / np.sqrt(128)
    m, l, o = np.full(40, -np.inf), np.zeros(40), np.zeros((40, 128))
    moved = 0
    for t in range(0, 520, 128):
        m_new = np.maximum(m, s[:, t:t + 128].max(axis=1))
        moved += int((np.isfinite(m) & (m_new > m)).sum())
        alpha, p = np.exp(m - m_new), np.exp(s[:, t:t + 128] - m_new[:, None])
        l = l * alpha + p.sum(axis=1)
        o = o * alpha[:, None] + (decode_e4m3(encode_e4m3(p * 256)) / 256) @ v[t:t + 128]
        m = m_new
    assert moved > 40
    got, lse = fp8_kernel_attention(spec, *args)
    np.testing.assert_allclose(got[0, 0], o / l[:, None], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse[0, 0], m + np.log(l), rtol=0, atol=1e-12)


def test_round_p_keeps_the_max_weight_exact_and_moves_others_by_at_most_half_an_ulp():
    p = np.concatenate([[1.0], np.random.default_rng().random(10000) ** 8])
    r = round_p_e4m3(p)
    assert r[0] == 1.0
    normal = p * 256 >= 2.0 ** -6     # e4m3's normals: relative half ulp 2^-4; subnormals: 2^-10 / 256 absolute
    assert (np.abs(r - p)[normal] <= p[normal] / 16).all()
    assert (np.abs(r - p)[~normal] <= 2.0 ** -10 / 256).all()


# -- quantize_fp8's NumPy model ---------------------------------------------------------------------------------
from tiledsl.reference.fp8 import E4M3_MAX, e4m3_values, encode_e4m3, hadamard_signs, quantize_model, rotate_rows  # noqa: E402


@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotation_is_orthogonal_and_its_inverse_exact(d):
    r = rotate_rows(np.eye(d, dtype=np.float32), hadamard_signs(d, seed=3)).astype(np.float64)
    gram = r @ r.T
    if d in (64, 256):   # entries +-1/8, +-1/16: every product and sum is exact
        np.testing.assert_array_equal(gram, np.eye(d))
    else:
        np.testing.assert_allclose(gram, np.eye(d), atol=1e-6)
    rng = np.random.default_rng()
    q, k = rng.standard_normal((5, d)).astype(np.float32), rng.standard_normal((7, d)).astype(np.float32)
    signs = hadamard_signs(d, seed=11)
    np.testing.assert_allclose(rotate_rows(q, signs) @ rotate_rows(k, signs).T, q @ k.T, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(hadamard_signs(d, 1), hadamard_signs(d, 2))


def test_e4m3_encoding_round_trips_and_rounds_to_nearest_even():
    values = e4m3_values()
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(encode_e4m3(values[finite]), np.arange(256)[finite])
    assert list(encode_e4m3(np.array([1e4, -1e4, 2.0 ** -10, 1.5 * 2.0 ** -9]))) == [0x7E, 0xFE, 0x00, 0x02]


@pytest.mark.parametrize("block, per_tensor", [(None, False), (128, False), (None, True)])
def test_quantize_model_scales_and_bytes(block, per_tensor):
    rng = np.random.default_rng()
    x = (rng.standard_normal((2, 4, 300, 64)) * 3).astype(np.float32)
    raw, descale = quantize_model(x, block, kv_heads=2, per_tensor=per_tensor)
    if per_tensor:
        assert descale.shape == (1,) and descale[0] == np.float32(np.abs(x).max() / np.float32(E4M3_MAX))
        back = e4m3_values()[raw] * descale[0]
    elif block is None:
        assert descale.shape == (2, 2)
        back = e4m3_values()[raw] * np.repeat(descale, 2, axis=1)[:, :, None, None]
    else:
        assert descale.shape == (2, 4, 3)
        back = dequantize_blocks(raw, descale, block)
    assert (raw & 0x7F).max() == 0x7E   # every group's largest value lands on 448
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative for normals, 2^-10 descales below them
    err = np.abs(back - x)
    bound = np.maximum(np.abs(x) / 16, 2.0 ** -10 * (descale.max()))
    assert (err <= bound * (1 + 1e-6)).all()


# -- quantize_fp8's kernel: launch shapes and nvcc ----------------------------------------------------------------
from tiledsl.dispatch import quantize_fp8 as quantize  # noqa: E402


@pytest.mark.parametrize("d", quantize.HEAD_DIMS)
def test_quantize_launch_shapes_hold_a_block_in_registers_where_it_fits(d):
    for rows in (16, 64, 100, 128):
        threads, iters, resident = quantize.launch_shape(d, rows)
        covered = quantize.rows_per_thread_block(d, threads, iters)
        assert resident and rows <= covered and iters <= quantize.ITERS
        assert covered - quantize.rows_per_thread_block(d, threads, 1) < rows or threads == quantize.THREADS[0]
    largest = quantize.rows_per_thread_block(d, quantize.THREADS[-1])
    assert quantize.launch_shape(d, largest)[2] and not quantize.launch_shape(d, largest + 1)[2]
    assert not quantize.launch_shape(d, None)[2]


def _nvcc_or_skip():
    from tiledsl.codegen import nvcc
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not on PATH")
    return nvcc


@pytest.mark.parametrize("d", quantize.HEAD_DIMS)
def test_quantize_kernel_compiles_without_spills_at_every_launch_shape(d, tmp_path):
    nvcc = _nvcc_or_skip()
    shapes = {quantize.launch_shape(d, rows)[:2] for rows in (None, 32, 64, 128, 256, 512) if rows is None or
              rows <= quantize.rows_per_thread_block(d, quantize.THREADS[-1])}
    for threads, iters in sorted(shapes):
        for rotate, bf16 in ((True, True), (False, False)):
            _, report = nvcc.compile_to(quantize.module_source(d, threads, iters, rotate, bf16), "quantize_fp8",
                                        "cubin", tmp_path / f"{threads}_{iters}_{rotate}")
            found = nvcc.parse_ptxas(report)
            for name, info in found.items():
                assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, report
                assert info.registers * threads <= 65536, report   # the block fits an SM's register file
