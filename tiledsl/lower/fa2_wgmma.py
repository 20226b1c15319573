"""Lowering of FA2 onto Hopper's warpgroup MMA (wgmma): KernelSpec -> KernelPlan for
templates/fa2_wgmma.cu.j2.

The algorithm is FA2's (q outer, one block per q tile, O in registers, P kept in registers
between the two GEMMs); only the tensor-core instruction changes. Each warpgroup (4 warps) owns
64 query rows: S = Q K^T is an m64n{tile kv}k16 wgmma with both operands in shared memory, and
O += P V an m64n{dv}k16 wgmma with P from registers and V in shared memory read transposed. Q,
K and V are stored as 64-column panels with the 128-byte swizzle wgmma reads (wgmma.cuh.j2).

Sizes come from layout/ (its _fa2_wgmma); the template only names them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hw import PANEL_ROW_BYTES, WARPGROUP_WARPS
from ..layout.base import Layout, tile_row_bytes
from ..schedule.graph import ScheduleGraph
from ..schedule.ops import Op
from ..spec import Family, KernelSpec
from .fa2 import ORDER_GROUPS, fa2_loop_body, fa2_regions
from .plan import Constant, KernelPlan, KvLoad, Launch, make_plan
from .steps import (INDEX_BOUNDS_HEADER, KV_SHARED, O_SHARED, attention_parameters, kv_buffer_constants,
                    mma_instruction, smem_constants, softmax_constants)


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
        return cls.sized(n, operands_after)

    @classmethod
    def sized(cls, n: int, operands_after: int) -> "WgmmaAsm":
        registers = 64 * n // 128
        return cls(n, registers, tuple(range(registers)), tuple(range(registers, registers + operands_after)))


def lower_fa2_wgmma(spec: KernelSpec, lay: Layout, graph: ScheduleGraph, template: str) -> KernelPlan:
    p, s = spec.problem, spec.schedule
    warpgroups, threads, smem = s.warps // WARPGROUP_WARPS, lay.threads, lay.smem_bytes
    mma_qk, mma_pv = mma_instruction(graph)   # the graph's instruction: m64 n{tile kv} / n{head dim v} k16
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    q, k, v = lay.buffer("Q"), lay.buffer("K"), lay.buffer("V")

    consts = [
        Constant("BR", "int", s.tile_q, "query rows per block (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("D", "int", p.head_dim_qk, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("WARPS", "int", s.warps, f"{warpgroups} warpgroups along q"),
        Constant("THREADS", "int", threads),
        Constant("ROWS_PER_WARP", "int", lay.rows_per_warp, "a warp's slice of its warpgroup's 64 rows"),
        Constant("M_TILES", "int", 1),
        Constant("S_TILES", "int", s.tile_kv // 8, "8-column tiles of S in a thread's accumulators"),
        Constant("O_TILES", "int", p.head_dim_v // 8, "8-column tiles of O in a thread's accumulators"),
        Constant("V_ROW_BYTES", "int", v_row, "shared-memory row of the O staging tile"),
        Constant("V_SWIZZLE", "bool", v_swizzle),
        *kv_buffer_constants(s.stages, q.offset, k.offset, k.stage_bytes, v.offset, v.stage_bytes),
        Constant("Q_PANEL_BYTES", "u32", s.tile_q * PANEL_ROW_BYTES, "64 columns of every Q row (one panel)"),
        Constant("K_PANEL_BYTES", "u32", s.tile_kv * PANEL_ROW_BYTES),
        Constant("V_PANEL_BYTES", "u32", s.tile_kv * PANEL_ROW_BYTES,
                 "also the wgmma leading offset of V read transposed"),
        Constant("O_OFFSET", "u32", lay.buffer("O staging").offset, "O staging for coalesced stores"),
        *smem_constants(lay),
        *softmax_constants(p),
    ]
    regions = fa2_regions(spec, q_layout=" into wgmma panels", kv_loop_note="; each warpgroup owns 64 rows")
    return make_plan(spec, Family.FA2, template, consts, regions, fa2_loop_body(spec, graph, s.stages),
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), lay.min_blocks_per_sm,
                     lay.register_estimate, kv_load=KvLoad.of(panels=True), shared=KV_SHARED + (O_SHARED,),
                     parameters=attention_parameters(last=ORDER_GROUPS, bounded=True),
                     headers=(INDEX_BOUNDS_HEADER,), mma=mma_qk.mma,
                     wgmma_qk=WgmmaAsm.of(mma_qk, 3),
                     wgmma_pv=WgmmaAsm.of(mma_pv, 5))
