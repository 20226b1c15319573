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

All sizes are derived here; the template only names them (STYLE.md 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from .device_limits import H200
from .graph import Op, OpKind
from .lower import (REGISTER_OVERHEAD, Constant, KernelPlan, Launch, LoopOp, Region, _align, _require, _where,
                    graph_loop_body, kv_buffer_constants, make_plan, softmax_constants, tile_row_bytes,
                    tile_row_constants)
from .passes import run_passes
from .spec import Axis, DType, Family, KernelSpec

SHARED_LIMIT = H200.max_shared_per_block   # sm_90 opt-in shared memory per block (227 KB)
MAX_REGISTERS = 255
ACCUMULATOR_BUDGET = 128       # O + S accumulator registers per thread that leave room (measured with ptxas) for
                               # fragments, addresses and the combine without spills
COMBINE_PAD_FLOATS = 8         # pad rows of the fp32 combine tile: float2 fragment stores of a half-warp
                               # then cover rows r..r+3 at 8-word offsets, 32 distinct banks


@dataclass(frozen=True)
class Fa1Plan(KernelPlan):
    """A KernelPlan with FA1's loops: `kv_step` runs once per kv tile (outer loop), before the q
    loop whose body is `loop_body` followed by the row-pass loop whose body is `pass_body`."""
    kv_step: tuple[LoopOp, ...] = ()
    pass_body: tuple[LoopOp, ...] = ()
    split_k: bool = False

    @property
    def loop_bodies(self):
        return (("loop_kv", self.kv_step), ("loop_q", self.loop_body), ("loop_rows", self.pass_body))


def fa1_loop_bodies(spec: KernelSpec, stages: int) -> tuple[tuple[LoopOp, ...], ...]:
    """FA1's three loop bodies in the scheduler graph's emission order: the kv step (make K_j, V_j
    resident), the q loop (Q_i in) and the row pass (the paper's Algorithm 1 lines 8-13).

    K_j and V_j are one cp.async group, waited for once. With 2+ stages tile j+S-1 is prefetched
    right after tile j has landed, into the buffer tile j-1 used, and overlaps the whole q loop of
    tile j; with one stage the tile is loaded at the top of its own step."""
    graph = run_passes(spec, check_legality=False)   # lower_fa1 checks what its template needs
    split_k = graph.has(OpKind.COMBINE_WARPS)

    def lower_op(name: str, op: Op) -> list[LoopOp]:
        where = _where(spec, op.key or "order")
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
                return [LoopOp("wait_kv", where, "wait for K_j, V_j", pending=0)]
            return [LoopOp("wait_kv", where, f"wait for K_j, V_j (up to {stages - 2} later tiles stay in flight)",
                           pending=stages - 2),
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
            return [LoopOp("mask", where, "mask keys outside the sequence / diagonal / window (only tiles that need it)")]
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
            return [LoopOp("store_state", where, "last kv tile of Q_i: O / l -> out (input dtype), LSE = scale m + log l; "
                           "else O / l, m, l -> HBM")]
        raise AssertionError(f"fa1 lowering has no CUDA for graph op {name} ({kind})")

    return tuple(graph_loop_body(graph, loop, lower_op) for loop in ("loop_kv", "loop_q", "loop_rows"))


def rows_per_pass(spec: KernelSpec) -> int:
    """Split-K: how many of the q tile's rows a warp holds at a time. Every warp keeps a partial O
    of all the rows it works on, so a 64-row tile at d64 would need 128 accumulator registers for
    O alone; the tile is walked in passes of the most rows whose O and S fit ACCUMULATOR_BUDGET."""
    p, s = spec.problem, spec.schedule
    keys_per_warp = s.tile_kv // s.warps
    m_tiles = s.tile_q // 16
    while m_tiles > 1 and ((s.tile_q // 16) % m_tiles or m_tiles * (p.head_dim_v + keys_per_warp) // 2 > ACCUMULATOR_BUDGET):
        m_tiles -= 1
    return 16 * m_tiles


def lower_fa1(spec: KernelSpec, min_blocks_per_sm: int | None = None, pass_rows: int | None = None) -> KernelPlan:
    p, s = spec.problem, spec.schedule
    _require(p.dtype in (DType.FP16, DType.BF16), spec, "dtype",
             f"the fa1 template computes with fp16 or bf16 tensor cores, not {p.dtype.value}", "dtype = bf16 or fp16")
    _require(p.head_dim_qk % 16 == 0 and p.head_dim_v % 16 == 0, spec, "head_dim",
             f"fa1 needs head dims that are multiples of 16 (mma m16n8k16, ldmatrix.x4), got {p.head_dim_qk}/{p.head_dim_v}")
    split_k = s.warp_axis is Axis.KV
    if split_k:
        keys_per_warp = s.tile_kv // s.warps
        _require(s.tile_q % 16 == 0, spec, "tile", f"tile q = {s.tile_q} is not a multiple of 16 (mma rows)",
                 "use tile q = 16, 32 or 64")
        rows_per_warp = pass_rows or rows_per_pass(spec)
        _require(rows_per_warp % 16 == 0 and s.tile_q % rows_per_warp == 0, spec, "tile",
                 f"split-K passes of {rows_per_warp} rows must be a multiple of 16 that divides tile q = {s.tile_q}")
        _require(s.tile_kv % s.warps == 0 and keys_per_warp % 16 == 0, spec, "warps",
                 f"{s.warps} warps along kv give {s.tile_kv}/{s.warps} keys each; fa1 split-K needs a multiple of 16",
                 f"use tile kv = {16 * s.warps} or a multiple")
    else:
        rows_per_warp = s.tile_q // s.warps
        keys_per_warp = s.tile_kv
        _require(s.tile_q % s.warps == 0 and rows_per_warp % 16 == 0, spec, "warps",
                 f"{s.warps} warps along q give {s.tile_q}/{s.warps} rows each; fa1 needs a multiple of 16",
                 f"use tile q = {16 * s.warps} or a multiple")
        _require(s.tile_kv % 16 == 0, spec, "tile", f"tile kv = {s.tile_kv} is not a multiple of 16",
                 "use tile kv = 32, 64 or 128")
    m_tiles = rows_per_warp // 16
    threads = s.warps * 32

    # Registers per thread: O and S accumulators, one k-slice of Q fragments, a K fragment pair.
    acc_o, acc_s = m_tiles * p.head_dim_v // 2, m_tiles * keys_per_warp // 2
    register_estimate = acc_o + acc_s + 4 * m_tiles + 4 + REGISTER_OVERHEAD
    _require(register_estimate <= MAX_REGISTERS, spec, "tile",
             f"each thread would hold about {register_estimate} registers ({acc_o} of O, {acc_s} of S): over {MAX_REGISTERS}",
             "use a smaller tile q" + (" (split-K warps each keep all tile-q rows of O)" if split_k else " or more warps"))

    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    q_offset = 0
    k_offset = _align(q_offset + s.tile_q * qk_row)
    k_stage, v_stage = s.tile_kv * qk_row, s.tile_kv * v_row
    v_offset = _align(k_offset + s.stages * k_stage)
    end = _align(v_offset + s.stages * v_stage)
    combine_row = p.head_dim_v + COMBINE_PAD_FLOATS
    combine_bytes = 4 * rows_per_warp * (combine_row + s.warps + 2)
    if split_k:
        # o[rows][DV + pad], m per warp [WARPS][rows], combined m [rows], l [rows] (combine.cuh's layout)
        o_offset, combine_offset = q_offset, end
        end = _align(end + combine_bytes)
    else:
        combine_offset = 0
        combine_bytes = 0
        # The final O is staged through Q's rows when the layouts match (each warp its own rows).
        if (v_row, v_swizzle) == (qk_row, qk_swizzle):
            o_offset = q_offset
        else:
            o_offset, end = end, _align(end + s.tile_q * v_row)
    smem = end
    _require(smem <= SHARED_LIMIT, spec, "tile",
             f"fa1 needs {smem} bytes of shared memory per block, over the {SHARED_LIMIT} of sm_90",
             "use smaller tiles or fewer pipeline stages")
    if min_blocks_per_sm is None:
        min_blocks_per_sm = 1   # one block per (batch, head): rarely more blocks than SMs

    consts = [
        Constant("BR", "int", s.tile_q, "query rows per q tile (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("KEYS_PER_WARP", "int", keys_per_warp, "keys of a kv tile one warp multiplies (tile kv / warps when split along kv)"),
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
        *kv_buffer_constants(s.stages, q_offset, k_offset, k_stage, v_offset, v_stage),
        Constant("O_OFFSET", "u32", o_offset, "O staging for coalesced stores (split-Q)"),
        Constant("COMBINE_OFFSET", "u32", combine_offset, "fp32 combine tile (split-K)"),
        Constant("COMBINE_ROW_FLOATS", "int", combine_row, "row of the combine tile, padded against bank conflicts"),
        Constant("COMBINE_BYTES", "u32", combine_bytes),
        Constant("SMEM_BYTES", "u32", smem),
        Constant("Q_IN_REGISTERS", "bool", False, "Q changes every inner step: fragments come from shared memory"),
        Constant("Q_REG_TILES", "int", 1),
        *softmax_constants(p),
    ]
    order = _where(spec, "order")
    kv_step, per_tile, per_pass = fa1_loop_bodies(spec, s.stages)
    regions = {
        "kv_range": Region(_where(spec, "mask"), "the kv tiles each q tile can see; tiles no q tile sees are never loaded"),
        "empty_rows": Region(_where(spec, "mask"), "q tiles that see no key at all: O = 0, LSE = -inf"),
        "prologue": Region(_where(spec, "pipeline"), f"pipeline prologue: first {s.stages - 1} K/V tiles in flight"),
        "kv_loop": Region(order, "kv outer: one block per (batch, head) walks every kv tile once"),
        "q_loop": Region(order, "q inner: every q tile that sees a key of K_j (others are skipped)"),
        "row_pass": Region(_where(spec, "warps"), "split-K: the q tile's rows in passes of ROWS_PER_WARP"
                           if split_k else "split-Q: one pass, each warp over its own ROWS_PER_WARP rows"),
    }
    notes = (f"workspace: O fp32 (batch, heads, q_len, {p.head_dim_v}), m and l fp32 (batch, heads, q_len); "
             "allocated by the runtime per call, never initialised (a q tile's first kv tile starts from empty)",)
    return make_plan(spec, Family.FA1, consts, regions, per_tile,
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), min_blocks_per_sm, register_estimate,
                     plan_class=Fa1Plan, notes=notes, pass_body=per_pass, kv_step=kv_step, split_k=split_k,
                     kv_groups_per_tile=1)
