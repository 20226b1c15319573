"""Lowering of the FA1 family (kv outer, q inner): KernelSpec -> KernelPlan for templates/fa1.cu.j2.

The algorithm is the first FlashAttention paper's: one thread block per (batch, head) walks every
kv tile j once (K_j, V_j land in shared memory once) and, for each j, every query tile i that can
see a key of it: Q_i and the running state O_i (fp32, kept normalised), m_i, l_i come in from HBM,
S = Q_i K_j^T, the online-softmax update folds the tile in, and the state goes back to HBM. On a
query tile's last kv tile the output is written in the input dtype with LSE = scale m + log l.

Two warp splits:
  warps along q  (split-Q): each warp owns ROWS_PER_WARP rows of the q tile and all keys of K_j;
                 its state round-trips to HBM straight from the mma accumulators.
  warps along kv (split-K): each warp takes KEYS_PER_WARP = BC / WARPS keys of K_j for all rows of the q tile;
                 the partial (m, l, O) of the warps are combined through shared memory
                 (combine.cuh: combine_warp_states) and the block stores the rows from there.

All sizes come from layout/ (its _fa1); the template only names them (STYLE.md 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedule.graph import ScheduleGraph
from ..schedule.ops import Op, OpKind
from ..layout.fa1 import FA1_COMBINE_PAD_FLOATS
from ..layout.base import Buffer, Layout, cp_async_pending, tile_row_bytes
from .plan import Constant, KernelPlan, KvLoad, KvRange, Launch, LoopOp, Region, make_plan
from .steps import (INDEX_BOUNDS_HEADER, KV_SHARED, O_SHARED, OUT32, attention_parameters, graph_loop_body,
                    kv_buffer_constants, parameters, smem_constants, softmax_constants, spec_line, tile_row_constants)
from ..spec import Axis, Family, KernelSpec


@dataclass(frozen=True)
class Fa1Plan(KernelPlan):
    """A KernelPlan with FA1's loops: `kv_step` runs once per kv tile (outer loop), before the q
    loop whose body is `loop_body` followed by the row-pass loop whose body is `pass_body`."""
    kv_step: tuple[LoopOp, ...] = ()
    pass_body: tuple[LoopOp, ...] = ()
    split_k: bool = False
    kv_range_q_tile: KvRange = KvRange(rows="rows_valid")   # one q tile of the q loop (visible_tiles)

    @property
    def loop_bodies(self):
        return (("loop_kv", self.kv_step), ("loop_q", self.loop_body), ("loop_rows", self.pass_body))


def fa1_loop_bodies(spec: KernelSpec, graph: ScheduleGraph, stages: int) -> tuple[tuple[LoopOp, ...], ...]:
    """FA1's three loop bodies in the scheduler graph's emission order: the kv step (make K_j, V_j
    resident), the q loop (Q_i in) and the row pass (the paper's Algorithm 1 lines 8-13).

    K_j and V_j are one cp.async group, waited for once. With 2+ stages tile j+S-1 is prefetched
    right after tile j has landed, into the buffer tile j-1 used, and overlaps the whole q loop of
    tile j; with one stage the tile is loaded at the top of its own step."""
    split_k = graph.has(OpKind.COMBINE_WARPS)

    def lower_op(name: str, op: Op) -> list[LoopOp]:
        where = spec_line(spec, op.key or "order")
        kind = op.kind.value
        if kind == "loop" or kind == "load_v" or kind == "rescale_o":
            # nested loops are the template's; V is issued with K; O is rescaled inside online_softmax
            return []
        if kind == "load_k":
            if stages > 1:
                return []
            return [LoopOp("barrier", where, "one stage: every warp is done with K, V before they are refilled"),
                    LoopOp("prefetch_kv", where, "load K_j, V_j", distance=0)]
        if kind == "wait" and op.barrier == "kv_ready":
            if stages == 1:
                return [LoopOp("wait_kv", where, "wait for K_j, V_j", pending=cp_async_pending(Family.FA1, 1, "kv"))]
            return [LoopOp("wait_kv", where, f"wait for K_j, V_j (up to {stages - 2} later tiles stay in flight)",
                           pending=cp_async_pending(Family.FA1, stages, "kv")),
                    LoopOp("prefetch_kv", where, f"prefetch K, V of tile j+{stages - 1} into the buffer tile j-1 used",
                           distance=stages - 1)]
        if kind == "wait":   # q_free, scratch_free: a buffer the previous trip still reads
            return [LoopOp("barrier", where, op.text.removesuffix(" (__syncthreads)"))]
        if kind == "load_q":
            return [LoopOp("load_q", where, "Q_i -> shared memory (rows past q_len read as zero)")]
        if kind == "mma_qk":
            return [LoopOp("mma_qk", where, "S = Q_i K_j^T" + (" over this warp's keys" if split_k else "")
                           + " (mma.sync m16n8k16, fp32 accumulate)")]
        if kind == "mask":
            return [LoopOp("mask", where,
                           "mask keys outside the sequence / diagonal / window (only tiles that need it)")]
        if kind == "load_o_state":
            return [LoopOp("load_state", where,
                           "O_i (fp32, normalised), m_i, l_i <- HBM; O_i *= l_i (first visit: O = 0, m = -inf, l = 0)"
                           + ("; warp 0 carries the old state, the others start empty" if split_k else ""))]
        if kind == "online_softmax":
            return [LoopOp("online_softmax", where,
                           "m_new = max(m, rowmax S); P = exp(scale (S - m_new)); l, O *= exp(scale (m - m_new))")]
        if kind == "mma_pv":
            return [LoopOp("mma_pv", where, "O += P V_j (P from registers, V via ldmatrix.trans)")]
        if kind == "combine_warps":
            return [LoopOp("combine", where, "split-K: combine the warps' partial (m, l, O) through shared memory")]
        if kind == "store_o_state":
            return [LoopOp("store_state", where,
                           "last kv tile of Q_i: O / l -> out (input dtype), LSE = scale m + log l; "
                           "else O / l, m, l -> HBM")]
        raise AssertionError(f"fa1 lowering has no CUDA for graph op {name} ({kind})")

    return tuple(graph_loop_body(graph, loop, lower_op) for loop in ("loop_kv", "loop_q", "loop_rows"))


def lower_fa1(spec: KernelSpec, lay: Layout, graph: ScheduleGraph, template: str) -> KernelPlan:
    p, s = spec.problem, spec.schedule
    split_k = s.warp_axis is Axis.KV
    rows_per_warp, keys_per_warp, threads, smem = lay.rows_per_warp, lay.keys_per_warp, lay.threads, lay.smem_bytes
    m_tiles = rows_per_warp // 16
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    q, k, v = lay.buffer("Q"), lay.buffer("K"), lay.buffer("V")
    combine = lay.buffer("warp partials") if split_k else Buffer("warp partials", 0, 0, 0)

    consts = [
        Constant("BR", "int", s.tile_q, "query rows per q tile (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("KEYS_PER_WARP", "int", keys_per_warp,
                 "keys of a kv tile one warp multiplies (tile kv / warps when split along kv)"),
        Constant("D", "int", p.head_dim_qk, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("WARPS", "int", s.warps, f"warps, split along {s.warp_axis.value}"),
        Constant("THREADS", "int", threads),
        Constant("SPLIT_K", "bool", split_k, "warps share rows and split keys; partials combined on chip"),
        Constant("ROWS_PER_WARP", "int", rows_per_warp, "query rows whose state one warp holds at a time"),
        Constant("ROW_PASSES", "int", s.tile_q // rows_per_warp if split_k else 1,
                 "split-K walks the q tile in passes of ROWS_PER_WARP rows (O of all of them would not fit registers)"),
        Constant("M_TILES", "int", m_tiles, "16-row mma tiles per warp"),
        Constant("S_TILES", "int", keys_per_warp // 8, "8-column mma tiles of S per row block"),
        Constant("O_TILES", "int", p.head_dim_v // 8, "8-column mma tiles of O per row block"),
        *tile_row_constants(qk_row, qk_swizzle, v_row, v_swizzle),
        *kv_buffer_constants(s.stages, q.offset, k.offset, k.stage_bytes, v.offset, v.stage_bytes),
        Constant("O_OFFSET", "u32", lay.buffer("O staging").offset, "O staging for coalesced stores (split-Q)"),
        Constant("COMBINE_OFFSET", "u32", combine.offset, "fp32 combine tile (split-K)"),
        Constant("COMBINE_ROW_FLOATS", "int", p.head_dim_v + FA1_COMBINE_PAD_FLOATS,
                 "row of the combine tile, padded against bank conflicts"),
        Constant("COMBINE_BYTES", "u32", combine.bytes),
        *smem_constants(lay),
        Constant("Q_IN_REGISTERS", "bool", False, "Q changes every inner step: fragments come from shared memory"),
        Constant("Q_REG_TILES", "int", 1),
        *softmax_constants(p),
    ]
    order = spec_line(spec, "order")
    kv_step, per_tile, per_pass = fa1_loop_bodies(spec, graph, s.stages)
    regions = {
        "kv_range": Region(spec_line(spec, "mask"),
                           "the kv tiles each q tile can see; tiles no q tile sees are never loaded"),
        "empty_rows": Region(spec_line(spec, "mask"), "q tiles that see no key at all: O = 0, LSE = -inf "
                             "(NaN for a bad kv_lens entry)"),
        "prologue": Region(spec_line(spec, "pipeline"), f"pipeline prologue: first {s.stages - 1} K/V tiles in flight"),
        "kv_loop": Region(order, "kv outer: one block per (batch, head) walks every kv tile once"),
        "q_loop": Region(order, "q inner: every q tile that sees a key of K_j (others are skipped)"),
        "row_pass": Region(spec_line(spec, "warps"), "split-K: the q tile's rows in passes of ROWS_PER_WARP"
                           if split_k else "split-Q: one pass, each warp over its own ROWS_PER_WARP rows"),
    }
    notes = (f"workspace: O fp32 (batch, heads, q_len, {p.head_dim_v}), m and l fp32 (batch, heads, q_len); "
             "allocated by the runtime per call, never initialised (a q tile's first kv tile starts from empty)",)
    return make_plan(spec, Family.FA1, template, consts, regions, per_tile,
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), lay.min_blocks_per_sm,
                     lay.register_estimate,
                     plan_class=Fa1Plan, notes=notes, pass_body=per_pass, kv_step=kv_step, split_k=split_k,
                     kv_load=KvLoad.of(commit_each=False), shared=KV_SHARED + (O_SHARED,),
                     parameters=attention_parameters(more=(parameters(OUT32, "o_state", "m_state", "l_state"),),
                                                     bounded=True),
                     headers=(INDEX_BOUNDS_HEADER,),
                     kv_range=KvRange(q0="0", rows="q_len", begin="kv_begin", end="kv_end"))
