"""The FP8 `fragments` conversion path of decode (layout.FP8_CONVERTS), on the CPU: a lane model of
what templates/decode.cu.j2's load_q_fragments_fp8 / mma_qk_fp8 / mma_pv_fp8 / fp8_o_quad_columns
and combine.cuh's QUAD_COLUMNS do, in Python transcriptions of their index arithmetic, run on
labels (which key and dim each byte holds) through models of ldmatrix (plain and .trans), prmt
and the m16n8k16 fragment layouts:
  - every B fragment element of Q K^T pairs the dim of Q's A fragment element it multiplies, and
    its key is the score column's key; every B element of P V is the key of its P column and the
    dim of its O column; every O value lands in the combine column of its dim;
  - each 8-row matrix an ldmatrix reads hits 8 different 16-byte bank groups (no conflicts);
  - the layout / plan / rendered source of the path, and the `shared` path left as it was;
  - every one of the 256 e4m3 codes converts exactly to fp16 and (through f32) to bf16, NaN to NaN.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tiledsl.reference.fp8 import e4m3_values
from tiledsl.layout.decode import FP8_CONVERT_DEFAULT, FP8_CONVERTS, kv_stage_row_bytes, kv_stage_swizzled
from tiledsl.families import layout_of
from tiledsl.layout.base import tile_row_bytes
from tiledsl.spec import Axis, DType, KernelSpec, KvScale, Mask, Problem, Schedule

LANES = range(32)


# ---- transcriptions of common.cuh ----------------------------------------------------------------

def swizzle_xor(row_bytes: int, row: int) -> int:
    shift = 0 if row_bytes >= 128 else 1 if row_bytes == 64 else 2
    mask = 7 if row_bytes >= 128 else row_bytes // 16 - 1
    return (row >> shift) & mask


def chunk_offset(row_bytes: int, swizzle: bool, row: int, chunk: int) -> int:
    return row * row_bytes + ((chunk ^ swizzle_xor(row_bytes, row)) if swizzle else chunk) * 16


# ---- hardware models ----------------------------------------------------------------------------

def ldmatrix_x4(mem: np.ndarray, addresses: list[int], trans: bool) -> list[list[np.ndarray]]:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l names row l % 8 of matrix l // 8;
    lane (g, t) = (l // 4, l % 4) gets, in register m, b16 elements (g, 2t), (g, 2t+1) of matrix
    m, or with .trans (2t, g), (2t+1, g); low element in the low half. Returns, per lane, four
    registers as 4-element arrays of `mem`'s entries (byte 0 first)."""
    assert all(a % 16 == 0 for a in addresses), "ldmatrix rows are 16-byte aligned"
    regs = []
    for lane in LANES:
        g, t = lane // 4, lane % 4
        lane_regs = []
        for m in range(4):
            rows = addresses[8 * m: 8 * m + 8]
            if trans:
                word = np.concatenate([mem[rows[2 * t] + 2 * g: rows[2 * t] + 2 * g + 2],
                                       mem[rows[2 * t + 1] + 2 * g: rows[2 * t + 1] + 2 * g + 2]])
            else:
                word = mem[rows[g] + 4 * t: rows[g] + 4 * t + 4]
            lane_regs.append(word)
        regs.append(lane_regs)
    return regs


def conflict_free(addresses: list[int]) -> bool:
    """Each 8-address matrix of an ldmatrix reads one 16-byte row per address: conflict-free when
    the 8 rows sit in 8 different 16-byte bank groups of the 128-byte bank line."""
    return all(len({(a // 16) % 8 for a in addresses[8 * m: 8 * m + 8]}) == 8 for m in range(4))


def byte_perm(word: np.ndarray, selector: int) -> np.ndarray:
    """prmt.b32 / __byte_perm(x, 0, selector) for selectors that pick bytes of x only."""
    return np.array([word[(selector >> (4 * i)) & 0xF] for i in range(4)], dtype=word.dtype)


def a_fragment(lane: int, regs) -> dict[tuple[int, int], object]:
    """m16n8k16 A fragment -> {(row, k): element}: a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)."""
    g, t = lane // 4, lane % 4
    spots = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
    return {(r, k + j): regs[i][j] for i, (r, k) in enumerate(spots) for j in range(2)}


def b_fragment(lane: int, b0, b1) -> dict[tuple[int, int], object]:
    """m16n8k16 B fragment -> {(k, n): element}: b0 (2t, 2t+1; g), b1 (2t+8, 2t+9; g); each a pair."""
    g, t = lane // 4, lane % 4
    return {(2 * t + j, g): b0[j] for j in range(2)} | {(2 * t + 8 + j, g): b1[j] for j in range(2)}


def acc_spot(lane: int, e: int) -> tuple[int, int]:
    return lane // 4 + 8 * (e >> 1), 2 * (lane % 4) + (e & 1)


# ---- the tiles, filled as the cp.async loads fill them -----------------------------------------

def e4m3_tile(keys: int, dim: int) -> tuple[np.ndarray, int, bool]:
    """A warp's key slice of an e4m3 ring as labels key * 1000 + dim per byte (-1: padding)."""
    row = kv_stage_row_bytes(dim, DType.E4M3, "fragments")
    swizzle = kv_stage_swizzled(row)
    mem = np.full(keys * row, -1, dtype=np.int64)
    for key in range(keys):
        for chunk in range(dim // 16):
            base = chunk_offset(row, swizzle, key, chunk)
            mem[base: base + 16] = [key * 1000 + chunk * 16 + i for i in range(16)]
    return mem, row, swizzle


def q_tile(dim: int) -> tuple[np.ndarray, int, bool]:
    """The 16-bit Q tile (16 rows) as labels row * 1000 + dim per 16-bit element (index = byte / 2)."""
    row_bytes, swizzle = tile_row_bytes(dim)
    mem = np.full(16 * row_bytes // 2, -1, dtype=np.int64)
    for r in range(16):
        for d in range(dim):
            mem[(chunk_offset(row_bytes, swizzle, r, d // 8) + (d % 8) * 2) // 2] = r * 1000 + d
    return mem, row_bytes, swizzle


DIMS = [32, 64, 96, 128, 256]


@pytest.mark.parametrize("dim", DIMS)
def test_q_k_fragments_pair_the_same_dims(dim):
    """Q K^T: load_q_fragments_fp8 and mma_qk_fp8's ldmatrix + byte halves give, for every k of
    every MMA, Q and K elements of the same head dim, and K's key is the score column's."""
    keys = 32
    qmem, q_row, q_swizzle = q_tile(dim)
    kmem, k_row, k_swizzle = e4m3_tile(keys, dim)
    seen = set()
    for ks in range(dim // 16):
        a = {}
        for lane in LANES:   # load_q_fragments_fp8: two 8-byte loads (rows g, g+8)
            regs = [None] * 4
            for h in range(2):
                address = chunk_offset(q_row, q_swizzle, lane // 4 + 8 * h, 2 * ks + ((lane & 3) >> 1)) + (lane & 1) * 8
                elems = qmem[address // 2: address // 2 + 4]
                regs[h], regs[2 + h] = elems[:2], elems[2:]
            a[lane] = a_fragment(lane, regs)
        kp, i_k = divmod(ks, 2)
        for np_ in range(keys // 16):
            addresses = [chunk_offset(k_row, k_swizzle, np_ * 16 + (lane & 8) + (lane & 7), 2 * kp + (lane >> 4))
                         for lane in LANES]
            assert conflict_free(addresses)
            k8 = ldmatrix_x4(kmem, addresses, trans=False)
            for i in (2 * i_k, 2 * i_k + 1):   # the two registers of this k step: n tiles 2np, 2np+1
                nt = 2 * np_ + (i & 1)
                b = {}
                for lane in LANES:
                    b |= b_fragment(lane, k8[lane][i][:2], k8[lane][i][2:])   # dequant(w), dequant(w >> 16)
                a_all = {}
                for lane in LANES:
                    a_all |= a[lane]
                for (k, n), label in b.items():
                    key, kdim = divmod(int(label), 1000)
                    assert key == nt * 8 + n, "the score column's key"
                    for m in range(16):
                        qrow, qdim = divmod(int(a_all[(m, k)]), 1000)
                        assert qrow == m and qdim == kdim, (ks, k, n, m)
                    seen.add((key, kdim))
    assert seen == {(key, d) for key in range(keys) for d in range(dim)}, "every K byte multiplied once"


@pytest.mark.parametrize("dim", DIMS)
def test_p_v_fragments_and_o_columns(dim):
    """P V: mma_pv_fp8's transposed ldmatrix + prmt give B elements whose key is the P column's and
    whose dim is the O tile column's (tiles 2c / 2c+1: even / odd dims of chunk c); after
    fp8_o_quad_columns every value sits where combine<C, true> stores it: its dim's column."""
    keys = 32
    vmem, v_row, v_swizzle = e4m3_tile(keys, dim)
    seen = set()
    for kk in range(keys // 16):
        for cp in range(dim // 32):
            addresses = [chunk_offset(v_row, v_swizzle, kk * 16 + (lane & 8) + (lane & 7), 2 * cp + (lane >> 4))
                         for lane in LANES]
            assert conflict_free(addresses)
            v8 = ldmatrix_x4(vmem, addresses, trans=True)
            for i in range(2):
                chunk = 2 * cp + i
                for parity in range(2):
                    nd = 4 * cp + 2 * i + parity
                    b = {}
                    for lane in LANES:
                        low, high = byte_perm(v8[lane][2 * i], 0x3120), byte_perm(v8[lane][2 * i + 1], 0x3120)
                        b |= b_fragment(lane, low[2 * parity: 2 * parity + 2], high[2 * parity: 2 * parity + 2])
                    for (k, n), label in b.items():
                        key, vdim = divmod(int(label), 1000)
                        assert key == kk * 16 + k, "the P column's key"
                        assert vdim == 16 * chunk + 2 * n + parity == 16 * (nd // 2) + 2 * n + nd % 2
                        seen.add((key, vdim))
    assert seen == {(key, d) for key in range(keys) for d in range(dim)}
    # fp8_o_quad_columns, then combine_warp_states<C, true>'s column of each (tile, element)
    o_tiles = dim // 8
    for lane in LANES:
        dims = [[16 * (nd // 2) + 2 * acc_spot(lane, e)[1] + nd % 2 for e in range(4)] for nd in range(o_tiles)]
        for c in range(o_tiles // 2):
            for h in range(2):
                dims[2 * c][2 * h + 1], dims[2 * c + 1][2 * h] = dims[2 * c + 1][2 * h], dims[2 * c][2 * h + 1]
        for nd in range(o_tiles):
            for h in range(2):
                col = (nd >> 1) * 16 + 4 * (lane & 3) + 2 * (nd & 1)
                assert dims[nd][2 * h: 2 * h + 2] == [col, col + 1]


@pytest.mark.parametrize("dim,row,swizzled", [(32, 32, True), (64, 64, True), (96, 112, False), (128, 128, True),
                                              (160, 176, False), (192, 208, False), (256, 256, True)])
def test_ring_rows(dim, row, swizzled):
    assert kv_stage_row_bytes(dim, DType.E4M3, "fragments") == row and kv_stage_swizzled(row) == swizzled
    assert kv_stage_row_bytes(dim, DType.E4M3, "shared") == dim
    if not swizzled:   # an odd number of 16-byte chunks: 8 consecutive rows, 8 bank groups
        assert (row // 16) % 2 == 1 and len({(r * row // 16) % 8 for r in range(8)}) == 8


def test_all_256_codes_convert_exactly():
    """cvt.rn.f16x2.e4m3x2 is exact (every e4m3 value is an fp16 value); the bf16 path widens the
    fp16 halves to f32 and rounds to bf16 (cvt.rn.bf16x2.f32), exact as every value has at most 4
    significant bits and an exponent in bf16's range; the two NaN codes stay NaN."""
    values = e4m3_values()
    assert values.shape == (256,)
    nan = np.isnan(values)
    assert sorted(np.flatnonzero(nan)) == [0x7F, 0xFF]
    as_f16 = values.astype(np.float16)
    assert np.isnan(as_f16[nan]).all()
    assert (as_f16[~nan].astype(np.float64) == values[~nan]).all()
    f32 = as_f16.astype(np.float32)
    bits = f32.view(np.uint32)
    assert ((bits[~nan] & 0xFFFF) == 0).all(), "bf16 keeps the upper 16 bits of f32: nothing rounded"
    assert np.isnan(f32[nan]).all()
    # subnormals (exponent field 0) included, and the signed zeros
    subnormal = [c for c in range(256) if (c & 0x78) == 0 and c & 7]
    assert len(subnormal) == 14 and (as_f16[subnormal].astype(np.float64) == values[subnormal]).all()
    # prmt 0x3120 sorts a transposed word's bytes (k0 d0, k0 d1, k1 d0, k1 d1) into (k0 d0, k1 d0 | k0 d1, k1 d1)
    assert list(byte_perm(np.array([10, 11, 20, 21]), 0x3120)) == [10, 20, 11, 21]


# ---- layout, plan, source ---------------------------------------------------------------------------

def spec(d=128, convert="fragments", page=None, tile_kv=128, stages=1, min_blocks=None, dtype=DType.BF16):
    p = Problem(d, d, dtype, Mask.NONE, queries_per_seq=1, kv_page_size=page, kv_dtype=DType.E4M3,
                kv_scale=KvScale.PER_HEAD)
    return KernelSpec("f", p, Schedule(tile_q=16, tile_kv=tile_kv, warps=4, warp_axis=Axis.KV, stages=stages,
                                       split_kv="auto", fp8_convert=convert, min_blocks=min_blocks))


def test_values_and_default_have_one_home():
    assert FP8_CONVERTS == ("shared", "fragments") and FP8_CONVERT_DEFAULT == "shared"
    base = spec(convert=None)
    assert base.kernel_name == replace(base, schedule=replace(base.schedule, fp8_convert=None)).kernel_name
    assert "cv" not in base.kernel_name and "_cvfragments" in spec().kernel_name
    assert "_mb3" in spec(min_blocks=3).kernel_name
    # unset fields stay out of the config, so every kernel written before keeps its hash
    assert "fp8_convert" not in base.config()["schedule"] and "min_blocks" not in base.config()["schedule"]
    assert len({base.config_hash, spec().config_hash, spec(convert="shared").config_hash}) == 3


def test_fragments_layout_drops_the_16bit_tiles():
    from tiledsl.device_limits import H200
    shared, frag = layout_of(spec(convert=None), H200), layout_of(spec(), H200)
    assert {b.name for b in shared.buffers} - {b.name for b in frag.buffers} == {"K dequantized", "V dequantized"}
    assert frag.smem_bytes == 16 * 256 + 128 * 128 * 2 == 36864 < shared.smem_bytes == 102400
    assert "xor-swizzled" in frag.buffer("K").layout and frag.min_blocks_per_sm == 2
    assert layout_of(spec(min_blocks=3), H200).min_blocks_per_sm == 3


def test_refusals():
    from tiledsl.device_limits import H200
    from tiledsl.errors import SpecError
    with pytest.raises(SpecError, match="unknown fp8_convert"):
        layout_of(spec(convert="registers"), H200)
    plain = KernelSpec("p", Problem(128, 128, DType.BF16, Mask.NONE, queries_per_seq=1),
                       Schedule(tile_q=16, tile_kv=128, warps=4, warp_axis=Axis.KV, stages=1, fp8_convert="fragments"))
    with pytest.raises(SpecError, match="needs `kv_dtype = e4m3`"):
        layout_of(plain, H200)
    with pytest.raises(SpecError, match="min blocks 9"):
        layout_of(spec(min_blocks=9), H200)


@pytest.mark.parametrize("page", [None, 16, 1])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_fragments_plan_and_source(page, dtype):
    from tiledsl.families import lower
    from tiledsl.runtime.decode import constant
    from tiledsl.codegen.render import render
    plan = lower(spec(page=page, dtype=dtype))
    assert plan.fp8_convert == "fragments" and constant(plan, "K8_SWIZZLE") and constant(plan, "K8_ROW_BYTES") == 128
    cuda = render(plan)
    for piece in ("mma_qk_fp8(acc_s, q_regs, q_tile, k_ring, lane)", "mma_pv_fp8(acc_o, acc_s, v_ring, lane)",
                  "load_q_fragments_fp8(q_regs, q_tile, lane)", "combine_warp_states<C, true>", "fp8_o_quad_columns(acc_o)",
                  "scale_scores(acc_s, k_dequant)", "v_dequant / l", "C::K8_SWIZZLE"):
        assert piece in cuda, piece
    assert "dequant_slice" not in cuda and "KD_OFFSET" not in cuda
    shared = render(lower(spec(page=page, dtype=dtype, convert=None)))
    assert "dequant_slice<" in shared and "mma_qk_fp8" not in shared and "QUAD_COLUMNS ? " in shared
