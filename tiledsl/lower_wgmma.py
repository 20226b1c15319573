"""Lowering of FA2 onto Hopper's warpgroup MMA (wgmma): KernelSpec -> KernelPlan for
templates/fa2_wgmma.cu.j2.

The algorithm is FA2's (q outer, one block per q tile, O in registers, P kept in registers
between the two GEMMs); only the tensor-core instruction changes. Each warpgroup (4 warps) owns
64 query rows: S = Q K^T is an m64n{tile kv}k16 wgmma with both operands in shared memory, and
O += P V an m64n{dv}k16 wgmma with P from registers and V in shared memory read transposed. Q,
K and V are stored as 64-column panels with the 128-byte swizzle wgmma reads (wgmma.cuh.j2).

Sizes are derived here; the template only names them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .device_limits import H200
from .graph import Op
from .lower import (Constant, KernelPlan, Launch, _require, fa2_loop_body, fa2_regions, kv_buffer_constants, make_plan,
                    mma_instruction, softmax_constants, tile_row_bytes)
from .spec import DType, Family, KernelSpec

WARPGROUP_WARPS = 4
WGMMA_ROWS = 64           # rows of one warpgroup's m64 wgmma
PANEL_COLUMNS = 64        # 16-bit columns per 128-byte swizzled panel
SWIZZLE_ATOM = 1024       # bytes of 8 swizzled 128-byte rows: panels start on this alignment
REGISTER_OVERHEAD = 40


@dataclass(frozen=True)
class WgmmaAsm:
    """One wgmma m64nNk16 as inline asm: a thread's fp32 accumulators are operands %0 .. %(N/2 - 1)
    (64 x N over 128 threads), the remaining operands follow them in `after`."""
    n: int
    registers: int                    # accumulator registers per thread
    accumulators: tuple[int, ...]     # their operand numbers
    after: tuple[int, ...]            # qk: desc_a, desc_b, the accumulate flag; pv: A's 4 registers, desc_b

    @classmethod
    def of(cls, op: Op, operands_after: int) -> "WgmmaAsm":
        _, n, _ = op.mma_shape
        registers = 64 * n // 128
        return cls(n, registers, tuple(range(registers)), tuple(range(registers, registers + operands_after)))


def _align_atom(n: int) -> int:
    return (n + SWIZZLE_ATOM - 1) // SWIZZLE_ATOM * SWIZZLE_ATOM


def lower_fa2_wgmma(spec: KernelSpec) -> KernelPlan:
    p, s = spec.problem, spec.schedule
    _require(p.dtype in (DType.FP16, DType.BF16), spec, "dtype",
             f"wgmma computes in fp16 or bf16 here, not {p.dtype.value}", "dtype = bf16 or fp16")
    _require(s.warps % WARPGROUP_WARPS == 0 and s.tile_q == s.warps // WARPGROUP_WARPS * WGMMA_ROWS, spec, "warps",
             f"wgmma needs whole warpgroups of 4 warps, each owning {WGMMA_ROWS} query rows: tile q = {s.tile_q} "
             f"with {s.warps} warps is not {WGMMA_ROWS} rows per warpgroup", "e.g. tile q = 128 with warps 8 along q")
    _require(p.head_dim_qk % PANEL_COLUMNS == 0 and p.head_dim_v % PANEL_COLUMNS == 0, spec, "head_dim",
             f"the wgmma layout stores 64-column panels: head dims must be multiples of 64, got "
             f"{p.head_dim_qk}/{p.head_dim_v}", "head_dim = 64, 128 or 256")
    _require(s.tile_kv % 16 == 0 and 16 <= s.tile_kv <= 256 and p.head_dim_v <= 256, spec, "tile",
             f"wgmma n must be a multiple of 16 up to 256: tile kv = {s.tile_kv}, head dim v = {p.head_dim_v}")
    warpgroups = s.warps // WARPGROUP_WARPS
    mma_qk, mma_pv = mma_instruction(spec)   # the graph's instruction: m64 n{tile kv} / n{head dim v} k16
    threads = s.warps * 32
    _require(threads % (p.head_dim_qk // 8) == 0 and (threads // (p.head_dim_qk // 8)) % 8 == 0, spec, "warps",
             f"{threads} threads do not copy whole groups of 8 rows of a {p.head_dim_qk}-wide tile per pass")

    q_bytes, k_stage, v_stage = s.tile_q * p.head_dim_qk * 2, s.tile_kv * p.head_dim_qk * 2, s.tile_kv * p.head_dim_v * 2
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    q_offset = 0
    k_offset = _align_atom(q_offset + q_bytes)
    v_offset = _align_atom(k_offset + s.stages * k_stage)
    end = _align_atom(v_offset + s.stages * v_stage)
    # O is staged for coalesced stores in Q's space once every warpgroup is past its last Q K^T.
    o_offset = q_offset if s.tile_q * v_row <= q_bytes else end
    smem = max(end, o_offset + s.tile_q * v_row)
    _require(smem <= H200.max_shared_per_block, spec, "pipeline",
             f"{s.stages} stages of {s.tile_kv}-key K/V tiles need {smem} B of shared memory (limit {H200.max_shared_per_block})",
             "fewer stages or a smaller tile kv")
    acc_o, acc_s = p.head_dim_v // 2, s.tile_kv // 2
    register_estimate = acc_o + acc_s + s.tile_kv // 4 + REGISTER_OVERHEAD

    consts = [
        Constant("BR", "int", s.tile_q, "query rows per block (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("D", "int", p.head_dim_qk, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("WARPS", "int", s.warps, f"{warpgroups} warpgroups along q"),
        Constant("THREADS", "int", threads),
        Constant("ROWS_PER_WARP", "int", 16, "a warp's slice of its warpgroup's 64 rows"),
        Constant("M_TILES", "int", 1),
        Constant("S_TILES", "int", s.tile_kv // 8, "8-column tiles of S in a thread's accumulators"),
        Constant("O_TILES", "int", p.head_dim_v // 8, "8-column tiles of O in a thread's accumulators"),
        Constant("V_ROW_BYTES", "int", v_row, "shared-memory row of the O staging tile"),
        Constant("V_SWIZZLE", "bool", v_swizzle),
        *kv_buffer_constants(s.stages, q_offset, k_offset, k_stage, v_offset, v_stage),
        Constant("O_OFFSET", "u32", o_offset, "O staging for coalesced stores"),
        Constant("SMEM_BYTES", "u32", smem),
        *softmax_constants(p),
    ]
    regions = fa2_regions(spec, q_layout=" into wgmma panels", kv_loop_note="; each warpgroup owns 64 rows")
    return make_plan(spec, Family.FA2, consts, regions, fa2_loop_body(spec, s.stages),
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), 1, register_estimate,
                     mma=mma_qk.mma, wgmma_qk=WgmmaAsm.of(mma_qk, 3), wgmma_pv=WgmmaAsm.of(mma_pv, 5))
