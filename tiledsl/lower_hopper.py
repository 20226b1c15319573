"""Lowering of the Hopper warp-specialized family (FA3-style): KernelSpec -> HopperPlan for
templates/hopper.cu.j2.

Warpgroup 0 is the producer: one thread issues TMA copies (Q once; K and V per ring stage) that
complete on each stage's full barrier. Warpgroups 1..C are consumers, 64 query rows each: S = Q Kᵀ
as an SS wgmma, O += P V as an RS wgmma with P in registers, online softmax in registers; a
consumer frees a stage by arriving on its empty barrier. Two schedule switches reorder the
consumer's loop:

* `overlap intra`: the loop issues tile j's Q Kᵀ and tile j-1's P V together and waits for the
  first with `wgmma.wait_group 1`, so tile j's softmax runs while P V of j-1 is on the tensor
  cores; the O rescale waits for that P V (wait_group 0).
* `overlap pingpong`: consumers take turns issuing their GEMMs (named barriers passed round a
  ring), so one's softmax runs while the tensor cores work on another's GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass

from .device_limits import H200
from .layout import layout_of
from .lower import (Constant, KernelPlan, Launch, LoopOp, Region, _where, make_plan, mma_instruction, smem_constants,
                    softmax_constants)
from .lower_wgmma import WgmmaAsm
from .spec import Family, KernelSpec

PANEL_ROW_BYTES = 128     # a 64-column panel row of 16-bit values: one TMA box row, one swizzle row
WARPGROUP_THREADS = 128


@dataclass(frozen=True)
class HopperPlan(KernelPlan):
    pingpong: bool = False
    o_in_q: bool = False                # O staged in Q's panels (no room for its own buffer)
    loop_start: int = 0                 # 1 under intra overlap: the first tile's Q Kᵀ runs before the loop
    prologue: tuple[LoopOp, ...] = ()   # the first tile's Q Kᵀ and softmax (intra overlap)
    epilogue: tuple[LoopOp, ...] = ()   # the last tile's P V (intra overlap)


def consumer_ops(spec: KernelSpec) -> tuple[tuple[LoopOp, ...], tuple[LoopOp, ...], tuple[LoopOp, ...]]:
    """(prologue, loop body, epilogue) of a consumer warpgroup, in issue order."""
    s = spec.schedule
    pipe, where_overlap = _where(spec, "pipeline"), _where(spec, "overlap")
    tile = _where(spec, "tile")

    def op(kind: str, what: str, where: str = tile, pending: int = 0) -> LoopOp:
        return LoopOp(kind, where, what, pending=pending)

    turn_wait = [op("turn_wait", "ping-pong: wait for this consumer's turn to issue GEMMs", where_overlap)] if s.pingpong else []
    turn_pass = [op("turn_pass", "ping-pong: hand the turn to the next consumer", where_overlap)] if s.pingpong else []
    wait_k = op("wait_k_full", "wait until K_j has landed (TMA, full barrier)", pipe)
    qk = op("mma_qk", "S = Q K_j^T (SS wgmma, issued)")
    release_k = op("release_k", "free K_j's stage for the producer (empty barrier)", pipe)
    mask = op("mask", "mask keys outside the sequence / diagonal / window (only tiles that need it)", _where(spec, "mask"))
    softmax = op("softmax", "m = max(m, rowmax S); P = exp(scale (S - m)); l = alpha l + rowsum P")
    rescale = op("rescale_o", "O *= alpha (skipped when no row's max moved)")
    pack = op("pack_p", "P -> bf16/fp16 A fragments")

    def v_ops(behind: int, tile: str) -> list[LoopOp]:
        return [LoopOp("wait_v_full", pipe, f"wait until V_{tile} has landed (TMA, full barrier)", distance=behind),
                LoopOp("mma_pv", tile, f"O += P_{tile} V_{tile} (RS wgmma, P from registers, issued)", distance=behind)]

    def release_v(behind: int, tile: str) -> LoopOp:
        return LoopOp("release_v", pipe, f"free V_{tile}'s stage for the producer (empty barrier)", distance=behind)

    if not s.intra_overlap:
        body = [wait_k, *turn_wait, qk, *turn_pass, op("wait_qk", "wait for S_j", pending=0), release_k, mask, softmax,
                rescale, pack, *v_ops(0, "j"), op("wait_pv", "wait for O += P_j V_j", pending=0), release_v(0, "j")]
        return (), tuple(body), ()
    # Tile j's Q K^T and tile j-1's P V are issued together; the softmax of S_j runs while P V is on
    # the tensor cores, and the wait for that P V comes only at the top of the next trip: ptxas
    # schedules a wgmma wait as early as its basic block allows, so the loop's back edge is what
    # keeps it behind the softmax. O is rescaled by alpha_{j-1} while S_j is being computed.
    top = [op("wait_pv", "wait for O += P_{j-2} V_{j-2} (issued last trip)", where_overlap, pending=0),
           release_v(2, "{j-2}"), op("pack_p", "P_{j-1} -> bf16/fp16 A fragments")]
    prologue = [wait_k, *turn_wait, qk, *turn_pass, op("wait_qk", "wait for S_0", pending=0), release_k, mask, softmax]
    body = [*top, wait_k, *turn_wait, qk, op("rescale_o", "O *= alpha_{j-1} (skipped when no row's max moved)"),
            *v_ops(1, "{j-1}"), *turn_pass,
            op("wait_qk", "wait for S_j only (P_{j-1} V_{j-1} stays in flight)", where_overlap, pending=1), release_k, mask,
            softmax]
    epilogue = [*top, *turn_wait, rescale, *v_ops(1, "last"), *turn_pass, op("wait_pv", "wait for the last P V", pending=0),
                release_v(1, "last")]
    return tuple(prologue), tuple(body), tuple(epilogue)


def lower_hopper(spec: KernelSpec, empty_arrivals: int | None = None) -> HopperPlan:
    """`empty_arrivals` overrides the arrivals that free a slot (tests: a wrong count must hang, and be caught)."""
    p, s = spec.problem, spec.schedule
    lay = layout_of(spec, H200)   # every size and every resource rule of the family
    consumers, threads, smem = s.consumer_warpgroups, lay.threads, lay.smem_bytes
    q, k, v, o, bars = (lay.buffer(name) for name in ("Q", "K", "V", "O staging", "mbarriers"))
    panel_q, panel_kv = s.tile_q * PANEL_ROW_BYTES, s.tile_kv * PANEL_ROW_BYTES
    o_in_q = o.reuses == "Q"
    consts = [
        Constant("BR", "int", s.tile_q, "query rows per block (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("D", "int", p.head_dim_qk, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("CONSUMERS", "int", consumers, "consumer warpgroups, 64 query rows each"),
        Constant("EMPTY_ARRIVALS", "int", empty_arrivals or 4 * consumers, "arrivals that free Q or a stage: one per consumer warp"),
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
        Constant("Q_BYTES", "u32", q.bytes, "transaction bytes of Q's full barrier"),
        Constant("K_OFFSET", "u32", k.offset),
        Constant("K_PANEL_BYTES", "u32", panel_kv),
        Constant("K_STAGE_BYTES", "u32", k.stage_bytes, "one K tile: transaction bytes of its full barrier"),
        Constant("V_OFFSET", "u32", v.offset),
        Constant("V_PANEL_BYTES", "u32", panel_kv, "also the wgmma leading offset of V read transposed"),
        Constant("V_STAGE_BYTES", "u32", v.stage_bytes, "one V tile: transaction bytes of its full barrier"),
        Constant("O_OFFSET", "u32", o.offset, "O staging: Q's panels" if o_in_q else "O staging, apart from Q"),
        Constant("BAR_OFFSET", "u32", bars.offset, "mbarriers"),
        Constant("Q_FULL_BAR", "int", 0),
        Constant("Q_EMPTY_BAR", "int", 1),
        Constant("K_FULL_BAR", "int", 2),
        Constant("V_FULL_BAR", "int", 2 + s.stages),
        Constant("K_EMPTY_BAR", "int", 2 + 2 * s.stages),
        Constant("V_EMPTY_BAR", "int", 2 + 3 * s.stages),
        *smem_constants(lay),
        Constant("TURN_BAR", "int", 1, "ping-pong: named barrier of consumer c is TURN_BAR + c"),
        Constant("TURN_THREADS", "int", 2 * WARPGROUP_THREADS, "a consumer waits, the one before it arrives"),
        Constant("EPILOGUE_BAR", "int", 1 + consumers, "named barrier of one consumer before it stages O"),
        *softmax_constants(p),
    ]
    prologue, body, epilogue = consumer_ops(spec)
    mma_qk, mma_pv = mma_instruction(spec)   # the graph's instruction: m64 n{tile kv} / n{head dim v} k16
    regions = {
        "kv_range": Region(_where(spec, "mask"), "the kv tiles this query tile can see (tiles past the diagonal or outside the window are never loaded)"),
        "producer": Region(_where(spec, "warpgroups"), f"producer warpgroup: {s.producer_regs} registers, one thread issues TMA copies"),
        "load_q": Region(_where(spec, "tile"), f"Q tile ({s.tile_q} x {p.head_dim_qk}) per work item, as 64-column swizzled panels (one TMA box each)"),
        "load_kv": Region(_where(spec, "pipeline"), f"K, V tiles through a {s.stages}-stage ring: wait for the slot's empty barrier, then copy onto its full barrier"),
        "consumer": Region(_where(spec, "warpgroups"), f"{consumers} consumer warpgroup(s): {s.consumer_regs} registers, 64 query rows each"),
        "kv_loop": Region(_where(spec, "order"), "q outer (one block per q tile), kv inner" + ("; intra-warpgroup overlap" if s.intra_overlap else "")
                          + ("; ping-pong between consumers" if s.pingpong else "")),
        "epilogue": Region(_where(spec, "order"), "O /= l once; LSE = scale m + log l; O staged in this consumer's Q rows, 16-byte stores"),
    }
    return make_plan(spec, Family.HOPPER, consts, regions, body,
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), 1, lay.register_estimate,
                     plan_class=HopperPlan, mma=mma_qk.mma, wgmma_qk=WgmmaAsm.of(mma_qk, 3), wgmma_pv=WgmmaAsm.of(mma_pv, 5),
                     pingpong=s.pingpong, o_in_q=o_in_q,
                     loop_start=1 if s.intra_overlap else 0, prologue=prologue, epilogue=epilogue)

