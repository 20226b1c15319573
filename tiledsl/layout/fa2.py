"""FA2's layout (q outer) on mma.sync and on wgmma: Q once, K and V rings, O staging, Q in registers or
not, and a paged cache's block-table walk and ring of entries."""
from __future__ import annotations

from ..device_limits import DeviceLimits
from ..hw import PANEL_COLUMNS, SWIZZLE_ATOM, WARPGROUP_WARPS, WGMMA_ROWS
from ..spec import KernelSpec
from .base import (
    FA2_PAGE_RING_MIN,
    REGISTER_OVERHEAD,
    SMEM_ALIGN,
    Buffer,
    Layout,
    Registers,
    buffers_end,
    finish,
    mma_width,
    qkv_buffers,
    require,
    row_formula,
    row_text,
    split_q_rules,
    stage_o,
    tile_row_bytes,
)


def fa2_layout(spec: KernelSpec, limits: DeviceLimits, min_blocks_per_sm: int | None = None,
         q_in_registers: bool | None = None) -> Layout:
    p, s = spec.problem, spec.schedule
    rows_per_warp = s.tile_q // s.warps
    require(p.head_dim_qk % 8 == 0 and p.head_dim_v % 8 == 0, spec, "head_dim",
             f"head dim qk {p.head_dim_qk} / v {p.head_dim_v}: fa2 needs multiples of 8 (16-byte rows; "
             "padded to 16 on chip for mma m16n8k16)", "use a head dim that is a multiple of 8")
    split_q_rules(spec, "fa2", " (mma m16n8k16)")
    d_mma, dv_mma = mma_width(p.head_dim_qk), mma_width(p.head_dim_v)
    m_tiles, threads = rows_per_warp // 16, s.warps * 32
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    buffers = qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, qk_row, v_row, SMEM_ALIGN)
    end = buffers_end(buffers)
    end = stage_o(spec, buffers, end)
    slots, entries = fa2_page_ring(p.kv_page_size, s.tile_kv, s.stages)
    if slots:
        buffers.append(Buffer("block-table entries", end, slots * entries * 4, SMEM_ALIGN, slots, entries * 4,
                              "int32 page indices, a slot per kv tile", f"{slots}x {entries}x4"))
        end = buffers_end(buffers)

    acc_o, acc_s = m_tiles * dv_mma // 2, m_tiles * s.tile_kv // 2
    q_regs, k_frag = m_tiles * d_mma // 4, s.tile_kv // 4
    base = acc_o + acc_s + k_frag + REGISTER_OVERHEAD
    if q_in_registers is None:
        q_in_registers = base + q_regs <= limits.max_registers_per_thread
    registers = [Registers("O accumulator", acc_o, f"M_TILES*dv/2 = {m_tiles}*{dv_mma}/2", True),
                 Registers("S/P accumulator", acc_s, f"M_TILES*Bc/2 = {m_tiles}*{s.tile_kv}/2", True),
                 Registers("K fragments", k_frag, f"Bc/4 = {s.tile_kv}/4"),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    if q_in_registers:
        registers.append(Registers("Q fragments", q_regs, f"M_TILES*d/4 = {m_tiles}*{d_mma}/4"))
    estimate = sum(r.amount for r in registers)
    if min_blocks_per_sm is None:   # two blocks when half the registers and half the shared memory suffice
        min_blocks_per_sm = 2 if estimate <= 128 - 8 and 2 * end <= limits.max_shared_per_block else 1
    return finish(spec, "fa2", limits, buffers, end, registers, threads, min_blocks_per_sm, stages=s.stages,
                   rows_per_warp=rows_per_warp, keys_per_warp=s.tile_kv, q_in_registers=q_in_registers)


def fa2_wgmma_layout(spec: KernelSpec, limits: DeviceLimits) -> Layout:
    p, s = spec.problem, spec.schedule
    require(s.warps % WARPGROUP_WARPS == 0 and s.tile_q == s.warps // WARPGROUP_WARPS * WGMMA_ROWS, spec, "warps",
             f"wgmma needs whole warpgroups of 4 warps, each owning {WGMMA_ROWS} query rows: tile q = {s.tile_q} "
             f"with {s.warps} warps is not {WGMMA_ROWS} rows per warpgroup", "e.g. tile q = 128 with warps 8 along q")
    require(p.head_dim_qk % PANEL_COLUMNS == 0 and p.head_dim_v % PANEL_COLUMNS == 0, spec, "head_dim",
             f"the wgmma layout stores 64-column panels: head dims must be multiples of 64, got "
             f"{p.head_dim_qk}/{p.head_dim_v}", "head_dim = 64, 128 or 256")
    require(s.tile_kv % 16 == 0 and 16 <= s.tile_kv <= 256 and p.head_dim_v <= 256, spec, "tile",
             f"wgmma n must be a multiple of 16 up to 256: tile kv = {s.tile_kv}, head dim v = {p.head_dim_v}")
    threads = s.warps * 32
    require(threads % (p.head_dim_qk // 8) == 0 and (threads // (p.head_dim_qk // 8)) % 8 == 0, spec, "warps",
             f"{threads} threads do not copy whole groups of 8 rows of a {p.head_dim_qk}-wide tile per pass")
    for what, rows, dim in (("Q", s.tile_q, p.head_dim_qk), ("K", s.tile_kv, p.head_dim_qk),
                            ("V", s.tile_kv, p.head_dim_v)):
        rows_per_pass = threads // (dim // 8)   # load_tile_panels: every thread one 16-byte chunk per pass
        require(threads % (dim // 8) == 0 and rows % rows_per_pass == 0, spec, "tile",
                 f"the {threads} threads copy {what}'s {dim}-wide rows {rows_per_pass} per pass; {rows} rows are not "
                 "whole passes", f"use a tile of a multiple of {rows_per_pass} rows")
    buffers = qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, p.head_dim_qk * 2, p.head_dim_v * 2, SWIZZLE_ATOM,
                           panels=True)
    end = buffers_end(buffers, SWIZZLE_ATOM)
    v_row, _ = tile_row_bytes(p.head_dim_v)
    o_bytes = s.tile_q * v_row
    # O is staged for coalesced stores in Q's space once every warpgroup is past its last Q K^T.
    o_offset = 0 if o_bytes <= buffers[0].bytes else end
    buffers.append(Buffer("O staging", o_offset, o_bytes, SWIZZLE_ATOM, layout=row_text(p.head_dim_v),
                          formula=row_formula("Br", "dv", p.head_dim_v), reuses="Q" if o_offset == 0 else ""))
    smem = max(end, o_offset + o_bytes)
    registers = [Registers("O accumulator", p.head_dim_v // 2, f"dv/2 = {p.head_dim_v}/2", True),
                 Registers("S/P accumulator", s.tile_kv // 2, f"Bc/2 = {s.tile_kv}/2", True),
                 Registers("P fragments", s.tile_kv // 4, f"Bc/4 = {s.tile_kv}/4"),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    return finish(spec, "fa2_wgmma", limits, buffers, smem, registers, threads, 1, stages=s.stages,
                   rows_per_warp=16, keys_per_warp=s.tile_kv)


def fa2_page_walk(page_size: int | None, tile_kv: int) -> str:
    """How an fa2 block finds a kv tile's rows in a paged KV cache: "" contiguous cache; "slice"
    when the page size is a multiple of the tile, so the tile lies in one page (one block-table
    read, then contiguous rows); "rows" when pages are smaller (tiles start on a page; each
    thread reads the entry of every page its rows touch)."""
    if page_size is None:
        return ""
    return "slice" if page_size % tile_kv == 0 else "rows"



def fa2_page_ring(page_size: int | None, tile_kv: int, stages: int) -> tuple[int, int]:
    """(slots, entries per slot) of the shared-memory ring that holds an fa2 block's block-table
    entries ahead of its K/V loads; (0, 0) when the loads read the table themselves (contiguous
    cache; one stage: nothing to overlap the read with; pages under FA2_PAGE_RING_MIN keys). A slot
    holds one kv tile's entries (one per page it touches). The copy of tile j + stages - 1's entries
    rides in tile j's K cp.async group, so the entries are in shared memory a whole pipeline step
    before the loads that use them (a table read in front of the prefetch stalls it). The prologue issues
    stages - 1 tiles and copies the entries of the next stages - 1 with no barrier between, so the
    ring holds 2 (stages - 1) tiles; the loop needs `stages` (reads tile j + stages - 1's slot, writes
    tile j + 2 stages - 2's, after a barrier). Entries: the most pages one tile's keys touch."""
    if page_size is None or stages < 2 or page_size < FA2_PAGE_RING_MIN:
        return 0, 0
    straddles = tile_kv % page_size != 0 and page_size % tile_kv != 0   # a tile may start mid-page
    return max(stages, 2 * (stages - 1)), -(-tile_kv // page_size) + straddles
