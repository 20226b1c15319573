"""Lowering of the Hopper warp-specialized family (FA3-style): KernelSpec -> HopperPlan for
templates/hopper.cu.j2.

Warpgroup 0 is the producer: one thread issues TMA copies (Q per work item; K and V per ring
stage) that complete on full barriers. Warpgroups 1..C are consumers, 64 query rows each: S = Q Kᵀ
as an SS wgmma, O += P V as an RS wgmma with P in registers, online softmax in registers; a
consumer frees a stage (and Q) by arriving on its empty barrier. Every size comes from the layout
pass; the consumer's loop is the scheduler graph's emission order (schedule/hopper.py). Two schedule
switches reorder it:

* `overlap intra`: the loop issues tile j's Q Kᵀ and tile j-1's P V together and waits for the
  first with `wgmma.wait_group 1`, so tile j's softmax runs while P V of j-1 is on the tensor
  cores; that P V is waited for at the top of the next trip (ptxas hoists a wgmma wait to the top
  of its basic block: the back edge keeps it behind the softmax), and O is rescaled by alpha_{j-1}
  while Q K_jᵀ runs.
* `overlap pingpong`: consumers take turns issuing their GEMMs (named barriers passed round a
  ring), so one's softmax runs while the tensor cores work on another's GEMMs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..hw import PANEL_ROW_BYTES, WARP_THREADS, WARPGROUP_THREADS
from ..layout.base import Layout
from ..layout.hopper import FP8_K_BYTES, FP8_TRANSPOSERS, fp8_swizzle
from ..schedule.graph import ScheduleGraph
from ..schedule.ops import OpKind, Role
from ..schedule.passes import emission_order
from ..spec import DTYPE_PTX, Descale, Family, KernelSpec, LaunchKind, SeqLayout
from .fa2_wgmma import WgmmaAsm
from .plan import INDEX_ERRORS, Constant, KernelPlan, Launch, LoopOp, Parameter, Region, SharedBuffer, make_plan
from .expressions import expression_constants, expression_fields
from .score_mods import mod_constants, mod_parameters, score_mod_fields
from .steps import (INDEX_BOUNDS_HEADER, INT32S, KV_SHARED, O_SHARED, OUT16, OUT32, mma_instruction, parameters,
                    smem_constants, softmax_constants, spec_line, stride_lines)


@dataclass(frozen=True)
class HopperPlan(KernelPlan):
    pingpong: bool = False
    o_in_q: bool = False                # O staged in Q's panels (no room for its own buffer)
    o_in_k: bool = False                # FP8, one item a block: O staged in K's ring once both consumers are past it
    loop_start: int = 0                 # 1 under intra overlap: the first tile's Q Kᵀ runs before the loop
    prologue: tuple[LoopOp, ...] = ()   # the first tile's Q Kᵀ and softmax (intra overlap)
    epilogue: tuple[LoopOp, ...] = ()   # the last tile's P V (intra overlap)
    # The tile scheduler (`launch`, spec.LaunchKind / ItemOrder values): "dynamic" kernels take items from
    # a global counter (templates/tile_scheduler.cuh); "" leaves the launch to the runtime's choice.
    launch_kind: str = ""
    item_order: str = ""
    # where a consumer waits for its item's Q: "item" (a dynamic launch: where it reads the item's index), "span"
    # (a document or block mask: before it reads the item's document span or kv tile list), else "loop" (before its
    # kv loop)
    q_wait: str = "loop"
    # FP8 inputs (dtype = e4m3; templates/hopper_fp8.cuh): the producer's warps 1.. transpose each V tile into
    # V^T; the consumers read the descales (q_descale, k_descale, v_descale) per item or per tile.
    p_fragments: str = "C::BC / 16"     # A fragments of P: one per k16 (16-bit) or k32 (e4m3) step of the tile
    qk_panel_columns: int = 64          # elements of one row of a Q / K TMA box (a swizzled panel row)
    v_panel_columns: int = 64
    v_ready: str = "v_full"             # the barrier a consumer waits on before O += P V reads the stage
    pv_operand: str = "v"               # the Shared buffer P V's B operand is read from (FP8: V^T)
    q_row_bytes: int = PANEL_ROW_BYTES  # bytes of one swizzled Q row: a consumer's 64 rows start 64 of them in
    # Mask modifications (templates/mask_mods.cuh is pasted; mask_mods: any of them): `documents` bounds each
    # item's kv tiles by its rows' documents (the producer searches document_ids and hands the span to the
    # consumers in shared memory) and tests each row's document interval; `prefix` keeps the prefix's tiles.
    mask_mods: bool = False
    documents: str = ""   # "" | mods.model.Documents' value: "ids" (document_ids) | "bounds" (document_bounds)
    prefix: bool = False
    # `mask = blocks(...)` (templates/block_mask.cuh): the producer lists each item's kv tiles whose block_mask
    # entry is nonzero; the producer and the consumers walk the list
    blocks: bool = False


# Q's panels, the K and V rings, O's staging and the mbarriers in the Shared view.
HOPPER_SHARED = KV_SHARED + (O_SHARED, SharedBuffer("barriers", "BAR_OFFSET"))
FP8_SHARED = HOPPER_SHARED + (SharedBuffer("vt", "VT_OFFSET", "VT_STAGE_BYTES"),)   # FP8: V^T's ring
# P's largest weight after the softmax is 1; scaled by P_SCALE before its e4m3 conversion it uses e4m3's range
# down to 2^-17 instead of flushing weights under 2^-9 to zero (448 is e4m3's largest value). The softmax makes
# it P_SCALE times larger by an exponent offset; l is summed the same, so O / l divides it out.
FP8_P_SCALE = 256.0
DESCALE_KIND = {Descale.PER_TENSOR: 0, Descale.PER_HEAD: 1, Descale.PER_BLOCK: 2}   # C::DESCALE (hopper_fp8.cuh)
WORK_ITEM_SHARED = SharedBuffer("work_item", "ITEM_OFFSET")            # `launch dynamic`: the item slot
DOCUMENT_SPAN_SHARED = SharedBuffer("document_span", "SPAN_OFFSET")    # `mask = document`: the item's keys
TILE_LISTS_SHARED = SharedBuffer("tile_lists", "TILE_LIST_OFFSET", "TILE_LIST_BYTES")   # `mask = blocks`: by round

# Each consumer op of the graph's kv loop -> the CUDA step templates/hopper_ops.j2 spells.
_STEP = {(OpKind.WAIT, "k_full"): "wait_k_full", (OpKind.WAIT, "v_full"): "wait_v_full",
         (OpKind.WAIT, "vt_full"): "wait_v_full",   # FP8: V^T written (plan.v_ready names the barrier)
         (OpKind.WAIT, "turn"): "turn_wait",
         (OpKind.ARRIVE, "turn"): "turn_pass", (OpKind.ARRIVE, "k_empty"): "release_k",
         (OpKind.ARRIVE, "v_empty"): "release_v",
         (OpKind.MMA_WAIT, "S"): "wait_qk", (OpKind.MMA_WAIT, "PV"): "wait_pv", (OpKind.MMA_QK, ""): "mma_qk",
         (OpKind.MMA_PV, ""): "mma_pv", (OpKind.MASK, ""): "mask", (OpKind.ONLINE_SOFTMAX, ""): "softmax",
         (OpKind.RESCALE_O, ""): "rescale_o", (OpKind.PACK_P, ""): "pack_p", (OpKind.SCORE_MOD, ""): "score_mod",
         (OpKind.DROPOUT, ""): "dropout"}
_WAITED = {"S": OpKind.MMA_QK, "PV": OpKind.MMA_PV}


def consumer_ops(spec: KernelSpec, graph: ScheduleGraph) -> tuple[tuple[LoopOp, ...], tuple[LoopOp, ...],
                                                                  tuple[LoopOp, ...], int]:
    """(prologue, loop body, epilogue, loop start) of a consumer warpgroup: the graph's consumer ops
    of the kv loop in emission order, peeled by their lags. An op `lag` tiles behind runs in trip
    tile + lag; the loop starts at tile 1 when any op lags (the prologue is tile 0's lag-0 ops), and
    the epilogue runs the trips past the last tile, each op whose tile exists (`distance` counts back
    from one past the last). In the loop's first trips the ops more than one tile behind reach before
    the first tile: the template guards a release (`local >= distance`), and a wgmma wait with
    nothing in flight returns at once. Ping-pong turns go with the trips that issue a GEMM."""
    ops = [n for n in emission_order(graph) if graph.op(n).loops[-1:] == ("loop_kv",)
           and graph.op(n).role is Role.CONSUMER]
    lags = {n: graph.op(n).lag for n in ops}
    start = 1 if any(lags.values()) else 0
    bad = [n for n in ops if lags[n] > start and graph.op(n).kind not in (OpKind.ARRIVE, OpKind.MMA_WAIT)]
    assert not bad, f"ops that reach before the first tile in the loop's first trip: {bad}"

    def trip(keep) -> list[tuple[str, int]]:
        """(op, distance) of one trip: the ops `keep(lag)` gives a distance, and turns if it issues a GEMM."""
        turn = {n for n in ops if graph.op(n).barrier == "turn"}
        kept = {n: keep(lags[n]) for n in ops if n not in turn and keep(lags[n]) is not None}
        gemm = any(graph.op(n).kind in (OpKind.MMA_QK, OpKind.MMA_PV) for n in kept)
        return [(n, kept.get(n, 0)) for n in ops if n in kept or (n in turn and gemm)]

    prologue = [s for t in range(start) for s in trip(lambda lag, t=t: lag if lag <= t else None)]
    body = trip(lambda lag: lag)
    epilogue = [s for e in range(max(lags.values())) for s in trip(lambda lag, e=e: lag - e if lag > e else None)]
    steps = [tuple(_step(spec, graph, seq, i, context) for i in range(len(seq)))
             for seq, context in ((prologue, []), (body, body), (epilogue, body))]
    for (name, _), step in zip(body, steps[1]):
        assert step.pending == graph.op(name).pending, \
            f"{name}: the graph's wait_group {graph.op(name).pending}, issued {step.pending}"
    return steps[0], steps[1], steps[2], start


def _step(spec: KernelSpec, graph: ScheduleGraph, seq: list[tuple[str, int]], i: int, before: list) -> LoopOp:
    """The CUDA step of seq[i]; a wgmma wait leaves in flight the GEMMs issued after the one it waits
    for (looked for back through `before`, the trips that ran earlier)."""
    name, distance = seq[i]
    op = graph.op(name)
    kind = _STEP[(op.kind, op.barrier or (op.variant if op.kind is OpKind.MMA_WAIT else ""))]
    pending = 0
    if op.kind is OpKind.MMA_WAIT:
        for earlier, _ in reversed(before + seq[:i]):
            if graph.op(earlier).kind is _WAITED[op.variant]:
                break
            pending += graph.op(earlier).kind in (OpKind.MMA_QK, OpKind.MMA_PV)
    return LoopOp(kind, spec_line(spec, op.key), op.text, pending=pending, distance=distance, node=name)


# FP8 inputs: the float32 descales of Q, K and V (C::DESCALE says how the kernel indexes them).
FP8_PARAMETERS = (parameters("const float* __restrict__", "q_descale", "k_descale", "v_descale"),)


def fp8_plan_fields(spec: KernelSpec) -> dict:
    """HopperPlan's fields for FP8 inputs: e4m3 wgmma (k32, no transpose bits: both operands K-major), the O type
    as the kernel's 16-bit TILE_DTYPE, P's fragments per k32 step, boxes of bytes, P V reading V^T."""
    p, s = spec.problem, spec.schedule
    return {"fp8_inputs": True, "dtype_ptx": DTYPE_PTX[p.output_dtype], "wgmma_k": 32,
            "wgmma_inputs": f'"{DTYPE_PTX[p.dtype]}"', "wgmma_qk_tail": "", "wgmma_pv_tail": "",
            "p_fragments": "C::BC / 32", "qk_panel_columns": fp8_swizzle(p.head_dim_qk),
            "v_panel_columns": fp8_swizzle(p.head_dim_v), "v_ready": "vt_full",
            "pv_operand": "vt", "q_row_bytes": fp8_swizzle(p.head_dim_qk)}


FP8_HEADERS = ("hopper_fp8.cuh",)   # the e4m3 path's device helpers (V's transpose, P's packing)
DROPOUT_HEADERS = ("philox.cuh", "dropout.cuh")   # Philox4x32-10 and the keep bits of P's fragments


def hopper_parameters(varlen: bool, dynamic: bool = False) -> tuple[tuple[Parameter, ...], ...]:
    """hopper.cu.j2's parameters: the TMA maps of Q, K, V (by value), O, LSE and the rest; packed
    sequences (hopper_varlen.cu.j2) read cu_seqlens (bounded by the packed tensors' rows and the work
    list's max_seqlen_q) and the host's work list instead of kv_lens and batched strides; `launch
    dynamic` takes its work items from a global counter pair."""
    maps = parameters("const __grid_constant__ TensorMap", "q_map", "k_map", "v_map")
    if varlen:
        return (maps[:2], maps[2:] + parameters(OUT16, "o") + parameters(OUT32, "lse"),
                parameters(INT32S, "cu_seqlens_q", "cu_seqlens_k") + parameters("const int2* __restrict__", "work")
                + (INDEX_ERRORS,),
                parameters("int", "heads", "kv_group", "total_q", "total_k", "max_seqlen_q")
                + parameters("i64", "o_head_stride", "o_row_stride") + parameters("int", "items"))
    return (maps[:2], maps[2:] + parameters(OUT16, "o") + parameters(OUT32, "lse") + parameters(INT32S, "kv_lens")
            + (INDEX_ERRORS,),
            parameters("int", "q_len", "kv_len", "heads", "kv_group") + stride_lines("o")[0],
            parameters("int", "order_groups", "items")
            + (parameters("int* __restrict__", "item_counter") if dynamic else ()))


def fp8_constants(spec: KernelSpec, lay: Layout) -> list[Constant]:
    """The sizes of FP8 inputs: swizzled rows of bytes for Q, K, V and V^T, V^T's ring and barrier, the transposing
    threads, P's scale and the descales' granularity."""
    p, s = spec.problem, spec.schedule
    d, dv, bc = p.head_dim_qk, p.head_dim_v, s.tile_kv
    vt = lay.buffer("V^T")
    return [
        Constant("QK_SWIZZLE", "int", fp8_swizzle(d), "bytes of one swizzled Q / K row (a TMA box row)"),
        Constant("V_SWIZZLE", "int", fp8_swizzle(dv), "bytes of one swizzled V row as TMA lands it"),
        Constant("VT_SWIZZLE", "int", fp8_swizzle(bc), "bytes of one swizzled V^T row: keys along K"),
        Constant("K_BYTES", "int", FP8_K_BYTES, "bytes of K one e4m3 wgmma (k32) reads"),
        Constant("VT_OFFSET", "u32", vt.offset, "V^T ring: dv rows of Bc key bytes per stage"),
        Constant("VT_STAGE_BYTES", "u32", vt.stage_bytes),
        Constant("VT_PANEL_BYTES", "u32", dv * fp8_swizzle(bc), "VT_SWIZZLE bytes of every V^T row"),
        Constant("VT_FULL_BAR", "int", 2 + 4 * s.stages, "V^T of a stage written (the transposers' arrivals)"),
        Constant("V_LANDING_STAGES", "int", lay.buffer("V").stages, "slots V lands in by TMA (the transposers read "
                 "each tile as it lands)"),
        Constant("TRANSPOSERS", "int", FP8_TRANSPOSERS * WARP_THREADS, "producer threads that transpose V"),
        Constant("P_LOG2", "float", math.log2(FP8_P_SCALE), "log2(P_SCALE): the softmax's exponent offset, P = "
                 "P_SCALE x its weights, in e4m3's range before conversion"),
        Constant("P_SCALE_UNITS", "float", math.log(FP8_P_SCALE) / p.scale, "log(P_SCALE) / scale: P_SCALE's share "
                 "of l in m's units (LSE = scale m + log l)"),
        Constant("DESCALE", "int", DESCALE_KIND[p.descales], "descales: 0 per tensor, 1 per (batch, kv head), 2 per "
                 "Q tile of (batch, head) and per K / V tile of (batch, kv head)"),
    ]


def lower_hopper(spec: KernelSpec, lay: Layout, graph: ScheduleGraph, template: str,
                 empty_arrivals: int | None = None) -> HopperPlan:
    """`empty_arrivals` overrides the arrivals that free a slot (tests: a wrong count must hang, and be caught)."""
    p, s = spec.problem, spec.schedule
    varlen = p.seq_layout is SeqLayout.VARLEN
    bars = graph.barriers
    consumers, threads, smem = s.consumer_warpgroups, lay.threads, lay.smem_bytes
    q, k, v, o, mbarriers = (lay.buffer(name) for name in ("Q", "K", "V", "O staging", "mbarriers"))
    fp8 = p.fp8
    qk_row, v_row = (fp8_swizzle(p.head_dim_qk), fp8_swizzle(p.head_dim_v)) if fp8 else (PANEL_ROW_BYTES,) * 2
    panel_q, panel_kv, panel_v = s.tile_q * qk_row, s.tile_kv * qk_row, s.tile_kv * v_row
    o_in_q, o_in_k = o.reuses == "Q", o.reuses == "K"
    consts = [
        Constant("BR", "int", s.tile_q, "query rows per block (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("D", "int", p.head_dim_qk, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("CONSUMERS", "int", consumers, "consumer warpgroups, 64 query rows each"),
        Constant("EMPTY_ARRIVALS", "int", empty_arrivals or bars["k_empty"].count,
                 "arrivals that free Q or a stage: one per consumer warp"),
        Constant("THREADS", "int", threads, "producer + consumer warpgroups"),
        Constant("PRODUCER_REGS", "int", s.producer_regs, "setmaxnreg.dec: the producer only issues copies"),
        Constant("CONSUMER_REGS", "int", s.consumer_regs, "setmaxnreg.inc: accumulators of S, O and P"),
        Constant("M_TILES", "int", 1),
        Constant("ROWS_PER_WARP", "int", 16, "a warp's slice of its consumer's 64 rows"),
        Constant("S_TILES", "int", s.tile_kv // 8, "8-column tiles of S in a thread's accumulators"),
        Constant("O_TILES", "int", p.head_dim_v // 8, "8-column tiles of O in a thread's accumulators"),
        Constant("STAGES", "int", s.stages, "K/V ring stages"),
        Constant("Q_OFFSET", "u32", q.offset),
        Constant("Q_PANEL_BYTES", "u32", panel_q, "64 columns of every Q row: one TMA box"),
        Constant("Q_BYTES", "u32", bars["q_full"].tx_bytes, "transaction bytes of Q's full barrier"),
        Constant("K_OFFSET", "u32", k.offset),
        Constant("K_PANEL_BYTES", "u32", panel_kv),
        Constant("K_STAGE_BYTES", "u32", bars["k_full"].tx_bytes, "one K tile: transaction bytes of its full barrier"),
        Constant("V_OFFSET", "u32", v.offset),
        Constant("V_PANEL_BYTES", "u32", panel_v, "V^T's source panels" if fp8
                 else "also the wgmma leading offset of V read transposed"),
        Constant("V_STAGE_BYTES", "u32", bars["v_full"].tx_bytes, "one V tile: transaction bytes of its full barrier"),
        Constant("O_OFFSET", "u32", o.offset, "O staging: Q's panels" if o_in_q else
                 "O staging: K's ring, after the last Q K^T" if o_in_k else "O staging, apart from Q"),
        Constant("BAR_OFFSET", "u32", mbarriers.offset, "mbarriers"),
        Constant("Q_FULL_BAR", "int", 0),
        Constant("Q_EMPTY_BAR", "int", 1),
        Constant("K_FULL_BAR", "int", 2),
        Constant("V_FULL_BAR", "int", 2 + s.stages),
        Constant("K_EMPTY_BAR", "int", 2 + 2 * s.stages),
        Constant("V_EMPTY_BAR", "int", 2 + 3 * s.stages),
        *smem_constants(lay),
        Constant("TURN_BAR", "int", 1, "ping-pong: named barrier of consumer c is TURN_BAR + c"),
        Constant("TURN_THREADS", "int", bars["turn"].count if "turn" in bars else 2 * WARPGROUP_THREADS,
                 "a consumer waits, the one before it arrives"),
        Constant("EPILOGUE_BAR", "int", 1 + consumers, "named barrier of one consumer before it stages O"),
        *softmax_constants(p),
        *mod_constants(p, s.tile_kv // 8),
        *expression_constants(p),
        *(fp8_constants(spec, lay) if fp8 else ()),
    ]
    if s.launch is LaunchKind.DYNAMIC:
        consts.append(Constant("ITEM_OFFSET", "u32", lay.buffer("work item").offset,
                               "launch dynamic: the producer names each work item to the consumers here"))
    if p.mods.document is not None:
        consts.append(Constant("SPAN_OFFSET", "u32", lay.buffer("document span").offset,
                               "mask = document: the producer hands each item's keys to the consumers here"))
    if p.mods.blocks is not None:
        lists = lay.buffer("kv tile lists")
        consts += [Constant("TILE_LIST_OFFSET", "u32", lists.offset,
                            "mask = blocks: the producer lists each item's visible kv tiles here (two, by round)"),
                   Constant("TILE_LIST_BYTES", "u32", lists.stage_bytes, "one list: its count, then 2-byte tiles")]
    prologue, body, epilogue, loop_start = consumer_ops(spec, graph)
    mma_qk, mma_pv = mma_instruction(graph)   # the graph's instruction: m64 n{tile kv} / n{head dim v} k16
    regions = {
        "kv_range": Region(spec_line(spec, "mask"),
                           "the kv tiles this query tile can see (tiles past the diagonal or outside the window are "
                           "never loaded)"),
        "producer": Region(spec_line(spec, "warpgroups"),
                           f"producer warpgroup: {s.producer_regs} registers, one thread issues TMA copies"),
        "load_q": Region(spec_line(spec, "tile"),
                         f"Q tile ({s.tile_q} x {p.head_dim_qk}) per work item, as 64-column swizzled panels (one TMA "
                         f"box each)"),
        "load_kv": Region(spec_line(spec, "pipeline"),
                          f"K, V tiles through a {s.stages}-stage ring: wait for the slot's empty barrier, then copy "
                          f"onto its full barrier"),
        "consumer": Region(spec_line(spec, "warpgroups"),
                           f"{consumers} consumer warpgroup(s): {s.consumer_regs} registers, 64 query rows each"),
        "launch": Region(spec_line(spec, "launch"), {
            "dynamic": "tile scheduler: the producer takes each next work item from a global counter",
            "persistent": "tile scheduler: one block per resident slot, items at a stride of the grid",
            "grid": "tile scheduler: one block per work item"}.get(
            s.launch.value if s.launch else "", "tile scheduler: the runtime's (by mask and length)")),
        "documents": Region(spec_line(spec, "mask"),
                            "documents: the keys of the first row's document to the end of the last row's (a binary "
                            "search of document_ids by the producer, shared with the consumers through Q's barrier); "
                            "each row's own document from the tile's ids"),
        "blocks": Region(spec_line(spec, "mask"),
                         "block-sparse: the producer reads the q tile's row of block_mask once and lists the kv tiles "
                         "whose block is nonzero (shared memory, published by Q's barrier); producer and consumers "
                         "walk the list"),
        "mask_mod_tiles": Region(spec_line(spec, "mask_mod"),
                                 "mask_mod's tiles: the item's kv tiles narrowed to those its interval test over the "
                                 "item's rows does not find empty; the walk steps over the empty ones between"),
        "kv_loop": Region(spec_line(spec, "order"), "q outer (one block per q tile), kv inner"
                          + ("; intra-warpgroup overlap" if s.intra_overlap else "")
                          + ("; ping-pong between consumers" if s.pingpong else "")),
        "epilogue": Region(spec_line(spec, "order"),
                           "O /= l once; LSE = scale m + log l; O staged in this consumer's Q rows, 16-byte stores"),
    }
    if fp8:
        regions["transpose_v"] = Region(spec_line(spec, "dtype"), "FP8: producer warps 1..3 transpose each V tile into "
                                        "V^T (K-major bytes, keys in the order of P's e4m3 A fragments) for P V")
    return make_plan(spec, Family.HOPPER, template, consts, regions, body,
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), 1, lay.register_estimate,
                     plan_class=HopperPlan, mma=mma_qk.mma, wgmma_qk=WgmmaAsm.of(mma_qk, 3),
                     wgmma_pv=WgmmaAsm.of(mma_pv, 5),
                     pingpong=s.pingpong, o_in_q=o_in_q, o_in_k=o_in_k,
                     shared=(FP8_SHARED if fp8 else HOPPER_SHARED)
                     + ((WORK_ITEM_SHARED,) if s.launch is LaunchKind.DYNAMIC else ())
                     + ((DOCUMENT_SPAN_SHARED,) if p.mods.document is not None else ())
                     + ((TILE_LISTS_SHARED,) if p.mods.blocks is not None else ()),
                     parameters=hopper_parameters(p.seq_layout is SeqLayout.VARLEN, s.launch is LaunchKind.DYNAMIC)
                     + mod_parameters(p.mods) + (FP8_PARAMETERS if fp8 else ()),
                     **(fp8_plan_fields(spec) if fp8 else {}),
                     headers=(INDEX_BOUNDS_HEADER,) + (FP8_HEADERS if fp8 else ())
                     + (DROPOUT_HEADERS if p.mods.dropout is not None else ()),
                     blocks=p.mods.blocks is not None,
                     **score_mod_fields(p.mods, consts),
                     mask_mods=any(x is not None for x in (p.mods.document, p.mods.prefix, p.mods.mask_mod)),
                     **expression_fields(p.mods),
                     documents=p.mods.document.value if p.mods.document else "", prefix=p.mods.prefix is not None,
                     launch_kind=s.launch.value if s.launch else "",
                     q_wait="item" if s.launch is LaunchKind.DYNAMIC
                     else ("span" if p.mods.document is not None or p.mods.blocks is not None else "loop"),
                     item_order=s.item_order.value if s.item_order else "",
                     loop_start=loop_start, prologue=prologue, epilogue=epilogue)

