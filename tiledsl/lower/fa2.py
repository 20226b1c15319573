"""FA2 on mma.sync: KernelSpec -> KernelPlan for templates/fa2.cu.j2 (also the kv loop and regions the
wgmma variant shares). Sizes are the layout's; the loop body is the scheduler graph's emission order."""
from __future__ import annotations

from dataclasses import replace

from ..layout.base import Layout, cp_async_pending, mma_width, tile_row_bytes
from ..layout.fa2 import fa2_page_ring, fa2_page_walk
from ..schedule.graph import ScheduleGraph
from ..schedule.ops import Op
from ..spec import Family, KernelSpec
from .plan import Constant, KernelPlan, KvLoad, Launch, LoopOp, Parameter, Region, SharedBuffer, make_plan
from .steps import (
    KV_SHARED,
    LOOP_TEXT,
    INDEX_BOUNDS_HEADER,
    attention_parameters,
    O_SHARED,
    graph_loop_body,
    kv_buffer_constants,
    page_constants,
    smem_constants,
    softmax_constants,
    spec_line,
    tile_row_constants,
)


# The launch order's group count (runtime/block_order.py): the last parameter of both fa2 kernels.
ORDER_GROUPS = (Parameter("order_groups", "int"),)

# 16-byte chunks of a K and a V row in HBM: the loads copy these (a head dim padded on chip leaves its pad
# chunk alone, zeroed once).
HBM_CHUNKS = ("C::QK_CHUNKS", "C::V_CHUNKS")


def fa2_loop_body(spec: KernelSpec, graph: ScheduleGraph, stages: int) -> tuple[LoopOp, ...]:
    """The kv loop of FA2, in the scheduler graph's emission order (passes.emission_order).

    The graph orders the tile ops by data dependence; lowering places the K/V loads by the
    pipeline depth: with 2+ stages tile j+S-1 is prefetched right after K_j has landed (into the
    buffer freed last step); with one stage the tile is loaded at the top of its own step. K and V
    are separate cp.async groups, so QK^T starts before V has landed."""
    def lower_op(name: str, op: Op) -> list[LoopOp]:
        where = spec_line(spec, op.key or "order")
        kind = op.kind.value
        if kind == "load_k":
            if stages > 1:
                return []
            return [LoopOp("barrier", where, "one stage: every warp is done with the buffer before it is refilled"),
                    LoopOp("prefetch_kv", where, "load K_j, V_j", distance=0)]
        if kind == "load_v":
            return []   # issued with K (own cp.async group) by prefetch_kv
        if kind == "wait" and op.barrier.startswith("k"):
            steps = [LoopOp("wait_k", where, "wait for K_j (V_j and later tiles may still be in flight)",
                            pending=cp_async_pending(Family.FA2, stages, "k"))]
            if stages > 1:
                steps.append(LoopOp("prefetch_kv", where,
                                    f"prefetch K, V of tile j+{stages - 1} into the buffer freed last step",
                                    distance=stages - 1))
            return steps
        if kind == "wait":
            return [LoopOp("wait_v", where, "wait for V_j", pending=cp_async_pending(Family.FA2, stages, "v"))]
        if kind in ("mma_qk", "mask", "online_softmax", "mma_pv"):
            return [LoopOp(kind, where, op.text or LOOP_TEXT[kind])]
        if kind == "rescale_o":
            return []   # folded into online_softmax: O is rescaled by exp(m_old - m_new) there
        if kind == "page_lookup":
            return []   # folded into the K/V loads: each thread reads the entries of the rows it copies
        raise AssertionError(f"fa2 lowering has no CUDA for graph op {name} ({kind})")

    return graph_loop_body(graph, "loop_kv", lower_op)


def fa2_regions(spec: KernelSpec, q_layout: str = "", kv_loop_note: str = "") -> dict:
    """The regions of the fa2 kernels (mma.sync and wgmma templates): `q_layout` and
    `kv_loop_note` name what the wgmma one does differently."""
    s, p = spec.schedule, spec.problem
    return {
        "kv_range": Region(spec_line(spec, "mask"),
                           "the kv tiles this query tile can see (tiles past the diagonal or outside the window are "
                           "never loaded)"),
        "load_q": Region(spec_line(spec, "tile"),
                         f"load the {s.tile_q} x {p.head_dim_qk} Q tile{q_layout} (cp.async, zero-filled past "
                         "the end)"),
        "prologue": Region(spec_line(spec, "pipeline"),
                           f"pipeline prologue: first {s.stages - 1} K/V tiles in flight"),
        "kv_loop": Region(spec_line(spec, "order"), f"q outer (one block per q tile), kv inner{kv_loop_note}"),
        "epilogue": Region(spec_line(spec, "order"), "O /= l once; LSE = scale m + log l; store"),
    }


def lower_fa2(spec: KernelSpec, lay: Layout, graph: ScheduleGraph, template: str) -> KernelPlan:
    """The fa2 plan on mma.sync (`mma wgmma` specs are lower_fa2_wgmma's: families.FAMILIES picks)."""
    p, s = spec.problem, spec.schedule
    rows_per_warp, m_tiles, threads = lay.rows_per_warp, lay.rows_per_warp // 16, lay.threads
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    q_in_registers, smem = lay.q_in_registers, lay.smem_bytes
    q, k, v = lay.buffer("Q"), lay.buffer("K"), lay.buffer("V")

    d_mma, dv_mma = mma_width(p.head_dim_qk), mma_width(p.head_dim_v)
    consts = [
        Constant("BR", "int", s.tile_q, "query rows per block (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("D", "int", d_mma, "head dim of q and k" + _padded(p.head_dim_qk, d_mma)),
        Constant("DV", "int", dv_mma, "head dim of v and o" + _padded(p.head_dim_v, dv_mma)),
        Constant("QK_CHUNKS", "int", p.head_dim_qk // 8, "16-byte chunks of a q / k row in HBM (loads copy these)"),
        Constant("V_CHUNKS", "int", p.head_dim_v // 8, "16-byte chunks of a v / o row in HBM (loads and stores)"),
        Constant("ZERO_PAD", "bool", (d_mma, dv_mma) != (p.head_dim_qk, p.head_dim_v),
                 "shared tiles have pad columns: zeroed once, before the first load"),
        Constant("WARPS", "int", s.warps, "warps, split along q"),
        Constant("THREADS", "int", threads),
        Constant("ROWS_PER_WARP", "int", rows_per_warp),
        Constant("M_TILES", "int", m_tiles, "16-row mma tiles per warp"),
        Constant("S_TILES", "int", s.tile_kv // 8, "8-column mma tiles of S per row block"),
        Constant("O_TILES", "int", dv_mma // 8, "8-column mma tiles of O per row block"),
        *tile_row_constants(qk_row, qk_swizzle, v_row, v_swizzle),
        *kv_buffer_constants(s.stages, q.offset, k.offset, k.stage_bytes, v.offset, v.stage_bytes),
        Constant("O_OFFSET", "u32", lay.buffer("O staging").offset, "O staging for coalesced stores"),
        *smem_constants(lay),
        Constant("Q_PENDING_GROUPS", "int", 2 * (s.stages - 1), "cp.async groups issued after Q's"),
        Constant("Q_IN_REGISTERS", "bool", q_in_registers, "Q fragments held for the whole kv loop"),
        Constant("Q_REG_TILES", "int", m_tiles if q_in_registers else 1),
        *softmax_constants(p),
    ]
    regions = fa2_regions(spec)
    paged = {"kv_load": KvLoad.of("tile", HBM_CHUNKS), "shared": KV_SHARED + (O_SHARED,),
             "headers": (INDEX_BOUNDS_HEADER,), "parameters": attention_parameters(last=ORDER_GROUPS, bounded=True)}
    if p.kv_page_size is not None:
        walk = fa2_page_walk(p.kv_page_size, s.tile_kv)
        slots, entries = fa2_page_ring(p.kv_page_size, s.tile_kv, s.stages)
        consts += fa2_page_constants(p.kv_page_size, walk)
        consts += [Constant("PAGE_RING", "int", slots,
                            "tiles of block-table entries held ahead in shared memory (0: read inline)"),
                   Constant("TILE_PAGES", "int", entries, "block-table entries of one kv tile"),
                   Constant("PAGES_OFFSET", "u32", lay.buffer("block-table entries").offset if slots else 0,
                            "the entries' ring")]
        regions["kv_range"] = replace(regions["kv_range"], what=regions["kv_range"].what + f"; K/V rows through the "
                                      f"block table ({p.kv_page_size} keys a page, " + (
                                          "one entry per kv tile" if walk == "slice"
                                          else "one entry per page of the tile") + (
                                          f", copied to shared memory {s.stages - 1} tile(s) ahead)" if slots
                                          else ", read inline)"))
        paged = {"kv_pages": walk, "kv_load": KvLoad.of("paged_tile", HBM_CHUNKS),
                 "headers": (INDEX_BOUNDS_HEADER, "paged_kv.cuh"),
                 "shared": KV_SHARED + (O_SHARED, SharedBuffer("pages", "PAGES_OFFSET")),
                 "parameters": attention_parameters(paged=True, last=ORDER_GROUPS, bounded=True)}
    return make_plan(spec, Family.FA2, template, consts, regions, fa2_loop_body(spec, graph, s.stages),
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), lay.min_blocks_per_sm,
                     lay.register_estimate, **paged)


def fa2_page_constants(page_size: int, walk: str) -> list[Constant]:
    """A paged cache's addressing and how the block walks it (layout.fa2_page_walk)."""
    return page_constants(page_size) + [Constant("PAGE_PER_TILE", "bool", walk == "slice",
                                                 "a kv tile lies in one page: one block-table read per tile")]


def _padded(dim: int, width: int) -> str:
    return f" ({dim} padded on chip to {width} for the mma k step)" if width != dim else ""
