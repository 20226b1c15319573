"""FA1's layout (kv outer): Q, K, V tiles, O staging or the split-K warps' partials, and the rows a warp
walks per pass when its partial O would not fit the accumulator budget."""
from __future__ import annotations

from ..device_limits import DeviceLimits
from ..spec import Axis, KernelSpec
from .base import (
    REGISTER_OVERHEAD,
    SMEM_ALIGN,
    Buffer,
    Layout,
    Registers,
    align,
    buffers_end,
    finish,
    qkv_buffers,
    require,
    row_text,
    split_q_rules,
    stage_o,
    tile_row_bytes,
)

ACCUMULATOR_BUDGET = 128   # FA1 split-K: O + S registers per thread that leave room (measured) for the rest

FA1_COMBINE_PAD_FLOATS = 8     # float2 stores of a half-warp cover rows r..r+3 at 8-word offsets: 32 banks


def rows_per_pass(spec: KernelSpec) -> int:
    """FA1 split-K: how many of the q tile's rows a warp holds at a time. Every warp keeps a partial
    O of all the rows it works on, so a 64-row tile at d64 would need 128 accumulator registers for
    O alone; the tile is walked in passes of the most rows whose O and S fit ACCUMULATOR_BUDGET."""
    p, s = spec.problem, spec.schedule
    keys_per_warp = s.tile_kv // s.warps
    m_tiles = s.tile_q // 16
    while m_tiles > 1 and ((s.tile_q // 16) % m_tiles
                           or m_tiles * (p.head_dim_v + keys_per_warp) // 2 > ACCUMULATOR_BUDGET):
        m_tiles -= 1
    return 16 * m_tiles


def fa1_layout(spec: KernelSpec, limits: DeviceLimits, min_blocks_per_sm: int | None = None,
         pass_rows: int | None = None) -> Layout:
    p, s = spec.problem, spec.schedule
    require(p.head_dim_qk % 16 == 0 and p.head_dim_v % 16 == 0, spec, "head_dim",
             f"fa1 needs head dims that are multiples of 16 (mma m16n8k16, ldmatrix.x4), got "
             f"{p.head_dim_qk}/{p.head_dim_v}")
    split_k = s.warp_axis is Axis.KV
    if split_k:
        keys_per_warp = s.tile_kv // s.warps
        require(s.tile_q % 16 == 0, spec, "tile", f"tile q = {s.tile_q} is not a multiple of 16 (mma rows)",
                 "use tile q = 16, 32 or 64")
        require(s.tile_kv % s.warps == 0 and keys_per_warp % 16 == 0, spec, "warps",
                 f"{s.warps} warps along kv give {s.tile_kv / s.warps:g} keys each, not a multiple of 16 "
                 "(fa1 split-K multiplies whole m16n8k16 steps)", f"use tile kv = {16 * s.warps} or a multiple")
        rows_per_warp = pass_rows or rows_per_pass(spec)
        require(rows_per_warp % 16 == 0 and s.tile_q % rows_per_warp == 0, spec, "tile",
                 f"split-K passes of {rows_per_warp} rows must be a multiple of 16 that divides tile q = {s.tile_q}")
    else:
        rows_per_warp, keys_per_warp = s.tile_q // s.warps, s.tile_kv
        split_q_rules(spec, "fa1")
    m_tiles, threads = rows_per_warp // 16, s.warps * 32
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    buffers = qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, qk_row, v_row, SMEM_ALIGN)
    end = buffers_end(buffers)
    combine_row = p.head_dim_v + FA1_COMBINE_PAD_FLOATS
    if split_k:
        # o[rows][DV + pad], m per warp [WARPS][rows], combined m [rows], l [rows] (combine.cuh's layout)
        combine_bytes = 4 * rows_per_warp * (combine_row + s.warps + 2)
        buffers.append(Buffer("O staging", 0, s.tile_q * v_row, SMEM_ALIGN, layout=row_text(p.head_dim_v),
                              formula="in Q's rows", reuses="Q"))
        buffers.append(Buffer("warp partials", end, combine_bytes, SMEM_ALIGN,
                              layout=f"fp32 rows of {combine_row} floats",
                              formula=f"4*rows*(dv+{FA1_COMBINE_PAD_FLOATS}+warps+2) = 4*{rows_per_warp}*"
                              f"({combine_row}+{s.warps}+2)"))
        end = align(end + combine_bytes)
    else:
        end = stage_o(spec, buffers, end)
    # O and S accumulators, one k-slice of Q fragments, a K fragment pair.
    registers = [Registers("O accumulator", m_tiles * p.head_dim_v // 2, f"M_TILES*dv/2 = {m_tiles}*{p.head_dim_v}/2",
                           True),
                 Registers("S/P accumulator", m_tiles * keys_per_warp // 2,
                           f"M_TILES*keys/2 = {m_tiles}*{keys_per_warp}/2",
                           True),
                 Registers("Q, K fragments", 4 * m_tiles + 4, f"4*M_TILES + 4 = 4*{m_tiles} + 4"),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    # One block per (batch, head): rarely more blocks than SMs, so no occupancy promise.
    return finish(spec, "fa1", limits, buffers, end, registers, threads, min_blocks_per_sm or 1, stages=s.stages,
                   rows_per_warp=rows_per_warp, keys_per_warp=keys_per_warp)
