"""Lowering of the warp-specialized backward: a `backward { warpgroups ... }` schedule -> the plan of
templates/backward_ws.cu.j2 (its own preprocess, the main kernel, the mma.sync module's convert).

Sizes, the split and the dQ path come from layout/backward_ws.py; the consumers' q-loop body is the backward
graph's consumer ops (schedule/backward_ws.py) in emission order, one LoopOp each. The producer's copies and
the writer's loop are the template's, with the boxes and counts named here: `copies` lists every TMA box and
bulk copy with the barrier it completes on, so a test can add them up against the barrier's expected bytes."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..device_limits import H200, DeviceLimits, entry_registers
from ..hw import PANEL_COLUMNS, PANEL_ROW_BYTES, WARP_THREADS, WARPGROUP_THREADS, WGMMA_ROWS
from ..layout.backward import BACKWARD_PRE_ROWS, BACKWARD_PRE_THREADS
from ..layout.backward_ws import STAGING_BOX_COLUMNS, STEP_BITS, WRITER_WARPS, WS_CONSUMERS, backward_ws_layout
from ..mods.expr import ONE, depends_on_score, derivative, source
from ..schedule.backward import build_backward_graph
from ..schedule.ops import Role
from ..schedule.passes import emission_order
from ..spec import DqAccumulate, Family, KernelSpec
from .fa2_wgmma import WgmmaAsm
from .expressions import expression_constants, expression_fields
from .score_mods import mod_constants, mod_parameters, score_mod_fields
from .plan import (INDEX_ERRORS, SharedBuffer, BackwardWgmma, Constant, KernelPlan, Launch, LoopOp, Parameter, Region,
                   make_plan)
from .steps import INT32S, OUT16, OUT32, parameters, smem_constants, softmax_constants, spec_line, stride_lines

# The main kernel's typed view of shared memory (base.cu.j2's struct Shared): K, V kept; Q, dO, LSE and D rings
# (one slot per stage); the dQ staging ring (C::STAGING slots); P^T and dS^T, two buffers each (step parity).
WS_SHARED = (SharedBuffer("k", "K_OFFSET"), SharedBuffer("v", "V_OFFSET"),
             SharedBuffer("q", "Q_OFFSET", "Q_STAGE_BYTES"), SharedBuffer("d_o", "DO_OFFSET", "DO_STAGE_BYTES"),
             SharedBuffer("lse", "LSE_OFFSET", "ROW_STAGE_BYTES"),
             SharedBuffer("d_rows", "DROW_OFFSET", "ROW_STAGE_BYTES"),
             SharedBuffer("p_t", "P_OFFSET", "DS_BUFFER_BYTES"), SharedBuffer("ds_t", "DS_OFFSET", "DS_BUFFER_BYTES"),
             SharedBuffer("barriers", "BAR_OFFSET"), SharedBuffer("dq_staging", "STAGE_OFFSET", "STAGE_BYTES"))
STEP_BITS_SHARED = SharedBuffer("step_bits", "STEP_BITS_OFFSET")   # `mask = blocks`: the steps to walk
TEMPLATE = "backward_ws.cu.j2"

# The consumers' q-loop issue order per split (the graph's emission order must be this one).
CONSUMER_ORDER = {
    "keys": ("wait_q_full", "mma_qk", "mma_dp", "wait_s", "mask", "recompute_p", "wait_dp", "softmax_grad", "mma_dv",
             "mma_dk", "stage_ds", "sync_ds", "mma_dq", "wait_grads", "arrive_q_empty"),
    "columns": ("wait_q_full", "mma_qk", "mma_dp", "wait_s", "mask", "recompute_p", "stage_p", "wait_dp",
                "softmax_grad", "stage_ds", "sync_ds", "mma_dv", "mma_dk", "mma_dq", "wait_grads", "arrive_q_empty"),
}
DQ_OUT = {True: ("wait_dq_empty", "stage_dq", "arrive_dq_full"), False: ("accumulate_dq",)}
# The modifications' steps (schedule/modify.py), where the graph has them: after the step named here.
MOD_STEPS = (("score_mod", "wait_s"), ("dropout", "recompute_p"), ("score_mod_grad", "softmax_grad"))
SINK_THREADS = 256   # the sink gradient kernel: one block per query head

_TEXT = {
    "wait_q_full": "wait q_full: Q_i, dO_i, LSE_i, D_i of the ring slot have landed",
    "mma_qk": "S^T = K_j Q_i^T (SS wgmma, issued): this consumer's keys x its query columns",
    "mma_dp": "dP^T = V_j dO_i^T (SS wgmma, issued while P^T is computed)",
    "wait_s": "wait for S^T (wgmma.wait_group 1: dP^T stays in flight)",
    "mask": "mask keys outside the sequence / diagonal / window (only tiles that need it)",
    "recompute_p": "P^T = exp(scale S^T - LSE_i); 0 where LSE = +inf (padded or empty rows)",
    "stage_p": "P^T (this consumer's query columns, 16-bit) -> shared memory: dV's A operand spans both",
    "wait_dp": "wait for dP^T (wgmma.wait_group 0)",
    "softmax_grad": "dS^T = P^T * (dP^T - D_i)",
    "mma_dv": "dV += P^T dO_i (issued)",
    "mma_dk": "dK += dS^T Q_i (issued; scale at the store)",
    "stage_ds": "dS^T (this consumer's part) -> shared memory for dQ_i = dS K_j",
    "sync_ds": "named barrier of the two consumers: their staged parts are complete",
    "mma_dq": "dQ_i = dS K_j (SS wgmma, A = dS^T and B = K_j read MN-major)",
    "wait_grads": "wait for dV, dK and dQ_i (wgmma.wait_group 0): the slot and the fragments are free",
    "arrive_q_empty": "arrive q_empty (lane 0 of each warp): the producer may refill the slot",
    "wait_dq_empty": "wait dq_empty: the writer has read the staging buffer's last dQ_i",
    "stage_dq": "dQ_i (fp32) -> the staging buffer (TMA reduce boxes, 128 B swizzle)",
    "arrive_dq_full": "arrive dq_full (every consumer thread, after fence.proxy.async)",
    "accumulate_dq": "dQ_accum += dQ_i from registers (red.global.add.v4.f32; scale at the convert)",
    "score_mod_grad": "dS^T *= 1 - tanh^2 of the capped score, tanh read back from P^T and LSE_i",
}


# The main kernel's parameters (plan.parameters: the signature and the launch's order): Q, K, V, dO and dQ_accum
# as TMA tensor maps; the error word after kv_lens: the kernel bounds kv_lens (templates/index_bounds.cuh).
_MAPS = parameters("const __grid_constant__ TensorMap", "q_map", "k_map", "v_map", "do_map", "dq_map")
WS_MAIN_PARAMETERS: tuple[tuple[Parameter, ...], ...] = (
    _MAPS[:2], _MAPS[2:4], _MAPS[4:] + parameters("const float* __restrict__", "lse_rows", "d_rows"),
    parameters(OUT32, "dq_accum") + parameters("int* __restrict__", "semaphores") + parameters(OUT16, "dk", "dv"),
    parameters(INT32S, "kv_lens") + (INDEX_ERRORS,)
    + parameters("int", "q_len", "q_rows", "kv_len", "heads", "kv_group", "pairs"),
    *stride_lines("dk", "dv"))


@dataclass(frozen=True)
class Copy:
    """One kind of copy the producer issues per fill of `barrier`: `count` of `bytes` each."""
    barrier: str
    what: str
    count: int
    bytes: int


@dataclass(frozen=True)
class WsBackwardPlan(KernelPlan):
    kernel_names: dict = field(default_factory=dict)   # preprocess, main, convert
    dq_mode: str = "tma_reduce"                         # atomic | tma_reduce | ordered
    pre_rows: int = BACKWARD_PRE_ROWS
    pre_threads: int = BACKWARD_PRE_THREADS
    tile_kv: int = 0
    wgmma_ops: tuple = ()                               # the BackwardWgmma wrappers the template declares
    wgmma: dict = field(default_factory=dict)           # role (s, dv, dk, dq) -> wrapper name
    split: str = "keys"
    dq_path: str = "writer_tma"
    ordered: bool = False
    staging: int = 0
    box_rows: dict = None              # tensor -> rows of its TMA box (the runtime encodes the maps with them)
    copies: tuple[Copy, ...] = ()
    barriers: tuple = ()               # layout.WsBarrier records, in the kernel's barrier order
    # The score modifications (layout.backward_ws.WS_BUILT_MODS; KernelPlan's fields): softcap and ALiBi recomputed
    # as the forward's (templates/score_mods.cuh), softcap's 1 - tanh^2 on dS; sinks: the sink gradient kernel.
    sink_threads: int = SINK_THREADS
    # The mask modifications (templates/backward_mask_mods.cuh; mask_mods: any of them), as the hopper forward's
    # fields: `documents` narrows a block's q tiles to the queries in its keys' documents and tests each key row's
    # document interval; `prefix` keeps every q tile for the prefix's kv tiles.
    mask_mods: bool = False
    documents: str = ""   # "" | mods.model.Documents' value: "ids" | "bounds"
    prefix: bool = False
    # `mask = blocks(...)` (templates/block_mask.cuh): warp 0 marks the steps whose block_mask entry is nonzero in
    # shared bits before the roles split; every role walks the marked steps
    blocks: bool = False
    # the steps every role walks are the marked ones (shared step bits, before the roles split): block_mask's
    # nonzero blocks, or mask_mod's steps whose box can show a key (templates/backward_expressions.cuh)
    marked_steps: bool = False
    ds_factor: bool = False   # dS^T is multiplied by the modification's derivative before it is packed
    kernel_class: str = "runtime.backward_ws:WsBackwardKernel"

    @property
    def loop_bodies(self):
        return (("loop_q", self.loop_body),)


def _wrappers(sc: int, split: str, d: int, dv: int, dq_cols: int) -> tuple[tuple, dict]:
    """(wrappers, role -> name): s (S^T, dP^T: SS, both K-major), dv / dk (keys: RS with B MN-major; columns:
    SS, A K-major from shared memory, B MN-major), dq (SS, A and B MN-major)."""
    regs = split == "keys"
    cols = 1 if regs else 2
    roles = {"s": (sc, False, 0, 0), "dv": (dv // cols, regs, 0, 1), "dk": (d // cols, regs, 0, 1),
             "dq": (dq_cols, False, 1, 1)}
    wrappers, names = {}, {}
    for role, (n, in_regs, ta, tb) in roles.items():
        name = f"wgmma_{'rs' if in_regs else 'ss'}_n{n}" + ("_mn" if ta else "") + ("_bmn" if tb and not in_regs
                                                                                   else "")
        wrappers[name] = BackwardWgmma(name, WgmmaAsm.sized(n, 5 if in_regs else 3), in_regs, ta, tb)
        names[role] = name
    return tuple(wrappers.values()), names


def mask_text(mods) -> str:
    """The consumers' mask step as explain prints it: the spec's mask and the mask modifications it tests."""
    tested = [what for what, on in (("each key's document", mods.document is not None),
                                     (f"the prefix ({mods.prefix} keys)", mods.prefix is not None),
                                     ("mask_mod", mods.mask_mod is not None)) if on]
    if not tested:
        return _TEXT["mask"]
    return ("mask keys outside the sequence / diagonal / window, " + " and ".join(tested)
            + " (only (warp, q tile) pairs not wholly visible)")


def consumer_body(spec: KernelSpec, staged: bool, split: str) -> tuple[LoopOp, ...]:
    """The consumers' q-loop steps: the backward graph's consumer ops of loop_q in emission order."""
    graph = build_backward_graph(spec)
    names = [n for n in emission_order(graph) if graph.op(n).loops[-1:] == ("loop_q",)
             and graph.op(n).role is Role.CONSUMER]
    expected = list(CONSUMER_ORDER[split] + DQ_OUT[staged])
    for step, after in MOD_STEPS:
        if step in graph:
            expected.insert(expected.index(after) + 1, step)
    assert names == expected, f"consumer order {names}, the template's {expected}"
    text = dict(_TEXT, mask=mask_text(spec.problem.mods))
    return tuple(LoopOp(n, spec_line(spec, graph.op(n).key or "backward"), text.get(n, graph.op(n).text),
                        pending=graph.op(n).pending, node=n) for n in names)


def expression_text(mods) -> str:
    """explain's line of the backward's score_mod / mask_mod: dS's factor, and how mask_mod's steps are walked."""
    parts = []
    if mods.score_mod is not None:
        grad = derivative(mods.score_mod)
        if grad == ONE:
            parts.append(f"score_mod = {source(mods.score_mod)}: d/dscore = 1, folded (dS takes no multiply)")
        else:
            when = ("evaluated at score_mod's step from the unmodified score, held as bf16 pairs until dS"
                    if depends_on_score(grad) else "evaluated at dS from the indices")
            parts.append(f"score_mod = {source(mods.score_mod)}: dS *= {source(grad)} ({when})")
    if mods.mask_mod is not None:
        parts.append(f"mask_mod = {source(mods.mask_mod)}: warp 0 marks the (query head, q tile) steps whose box "
                     "can show a key; every role walks only those; a consumer warp tests elements where the box over "
                     "its 16 keys can be false")
    return "; ".join(parts)


def q_range_text(mods) -> str:
    """The q_range_mods region's line: how the mask modifications narrow a block's q tiles."""
    parts = []
    if mods.prefix is not None:
        parts.append(f"prefix({mods.prefix}): a kv tile of prefix keys is seen by every q tile, later ones causally")
    if mods.document is not None:
        source = "document_ids" if mods.document.value == "ids" else "document_bounds"
        parts.append(f"documents: only the queries at positions in the keys' documents (read from the documents "
                     f"kernel's search of {source} by every thread: producer and consumers walk the same q tiles); "
                     "each key row's document interval, once per block")
    return "; ".join(parts)


def lower_backward_ws(spec: KernelSpec, name: str, limits: DeviceLimits = H200, q_empty_arrivals: int | None = None
                      ) -> WsBackwardPlan:
    """The plan of the module `name` (lower.backward.lower_backward names it and calls here).
    `q_empty_arrivals` overrides the arrivals that free a ring slot (tests: a wrong count must hang)."""
    p, b = spec.problem, spec.backward
    mods = p.mods
    lay = backward_ws_layout(spec, limits)
    main = lay.main
    buf = {x.name: x for x in main.buffers}
    d, dv, br, bc, stages = p.head_dim_qk, p.head_dim_v, b.tile_q, b.tile_kv, b.stages
    columns = lay.split == "columns"
    sc = br // 2 if columns else br                      # query columns of a consumer's S^T
    dq_cols = d if lay.dq_split == "m" else d // 2
    staged = lay.dq_path != "consumer_red"
    ordered = b.dq is DqAccumulate.ORDERED
    writer_threads = WARP_THREADS * WRITER_WARPS.get(lay.dq_path, 0)
    bars = {x.name: x for x in lay.barriers}
    copies = (Copy("kv_full", "K_j panel (64 columns x tile kv rows)", d // PANEL_COLUMNS, bc * PANEL_ROW_BYTES),
              Copy("kv_full", "V_j panel", dv // PANEL_COLUMNS, bc * PANEL_ROW_BYTES),
              Copy("q_full", "Q_i panel (64 columns x tile q rows)", d // PANEL_COLUMNS, br * PANEL_ROW_BYTES),
              Copy("q_full", "dO_i panel", dv // PANEL_COLUMNS, br * PANEL_ROW_BYTES),
              Copy("q_full", "LSE_i rows (bulk)", 1, br * 4),
              Copy("q_full", "D_i rows (bulk)", 1, br * 4))
    kv_tx = sum(c.count * c.bytes for c in copies if c.barrier == "kv_full")
    q_tx = sum(c.count * c.bytes for c in copies if c.barrier == "q_full")
    assert (kv_tx, q_tx) == (bars["kv_full"].tx_bytes, bars["q_full"].tx_bytes), (kv_tx, q_tx)
    order = [x.name for x in lay.barriers if x.kind == "mbarrier"]   # kv_full, q_full, q_empty, dq_full, dq_empty
    index, at = {}, 0
    for barrier in order:
        index[barrier], at = at, at + bars[barrier].copies
    panel = lambda rows: rows * PANEL_ROW_BYTES   # noqa: E731  (bytes of one 64-column panel)
    consts = [
        Constant("BR", "int", br, "query rows per q tile (backward tile q)"),
        Constant("BC", "int", bc, "keys per block (backward tile kv)"),
        Constant("D", "int", d, "head dim of q and k"),
        Constant("DV", "int", dv, "head dim of v and o"),
        Constant("THREADS", "int", main.threads, "producer + consumer warpgroups"),
        Constant("CONSUMER_THREADS", "int", WS_CONSUMERS * WARPGROUP_THREADS),
        Constant("PRODUCER_REGS", "int", b.producer_regs, "setmaxnreg.dec: copies and dQ_i adds only"),
        Constant("CONSUMER_REGS", "int", b.consumer_regs, "setmaxnreg.inc: dK, dV, S^T, dP^T, dQ_i accumulators"),
        Constant("ENTRY_REGS", "int", entry_registers(limits, main.threads),
                 "per thread at launch (__launch_bounds__): the block's pool that setmaxnreg shares out"),
        Constant("KV_M_TILES", "int", 1, "16-row accumulator tiles per warp (backward_ops.j2)"),
        Constant("SPLIT_COLUMNS", "bool", columns, f"consumers split the kv tile by {lay.split}"),
        Constant("CONSUMER_KEYS", "int", 0 if columns else WGMMA_ROWS, "consumer 1's first key of the tile"),
        Constant("S_COLS", "int", sc, "query columns of a consumer's S^T, dP^T"),
        Constant("CONSUMER_COLS", "int", sc if columns else 0, "consumer 1's first query column of S^T"),
        Constant("DK_COLS", "int", d // 2 if columns else d, "dK columns per consumer"),
        Constant("DV_COLS", "int", dv // 2 if columns else dv, "dV columns per consumer"),
        Constant("STAGES", "int", stages, "Q_i, dO_i, LSE_i, D_i ring slots"),
        Constant("K_OFFSET", "u32", buf["K"].offset),
        Constant("K_PANEL_BYTES", "u32", panel(bc), "64 columns of every K row: one TMA box"),
        Constant("V_OFFSET", "u32", buf["V"].offset),
        Constant("Q_OFFSET", "u32", buf["Q"].offset),
        Constant("Q_STAGE_BYTES", "u32", buf["Q"].bytes // stages),
        Constant("Q_PANEL_BYTES", "u32", panel(br), "64 columns of every Q_i row: one TMA box"),
        Constant("DO_OFFSET", "u32", buf["dO"].offset),
        Constant("DO_STAGE_BYTES", "u32", buf["dO"].bytes // stages),
        Constant("LSE_OFFSET", "u32", buf["LSE"].offset),
        Constant("DROW_OFFSET", "u32", buf["D"].offset),
        Constant("ROW_STAGE_BYTES", "u32", br * 4, "LSE_i or D_i of one slot: one bulk copy"),
        Constant("P_OFFSET", "u32", buf["P^T"].offset if columns else 0, "P^T (columns split), two buffers"),
        Constant("DS_OFFSET", "u32", buf["dS^T"].offset, "dS^T, two buffers (step parity)"),
        Constant("DS_BUFFER_BYTES", "u32", bc * br * 2),
        Constant("DS_PANEL_BYTES", "u32", panel(bc), "64 query columns of every P^T / dS^T row"),
        Constant("KV_BYTES", "u32", kv_tx, "transaction bytes of kv_full: K_j and V_j panels"),
        Constant("Q_TX_BYTES", "u32", q_tx, "transaction bytes of q_full: Q_i, dO_i panels, LSE_i, D_i"),
        Constant("BAR_OFFSET", "u32", buf["mbarriers"].offset),
        Constant("KV_FULL_BAR", "int", index["kv_full"]),
        Constant("Q_FULL_BAR", "int", index["q_full"]),
        Constant("Q_EMPTY_BAR", "int", index["q_empty"]),
        Constant("Q_EMPTY_ARRIVALS", "int", q_empty_arrivals or bars["q_empty"].count, "one per consumer warp"),
        Constant("DS_BAR", "int", 1, "named barrier of the consumers (0 is __syncthreads)"),
        Constant("STAGING", "int", lay.staging, "staged dQ_i buffers (0: added from registers)"),
        Constant("STAGE_OFFSET", "u32", buf["dQ_i staging"].offset if staged else 0),
        Constant("STAGE_BYTES", "u32", br * d * 4 if staged else 0),
        Constant("STAGE_BOX_BYTES", "u32", br * PANEL_ROW_BYTES, f"one box: {STAGING_BOX_COLUMNS} fp32 columns x BR"),
        Constant("BOXES", "int", d // STAGING_BOX_COLUMNS, "TMA reduce boxes per dQ_i"),
        Constant("DQ_FULL_BAR", "int", index.get("dq_full", 0)),
        Constant("DQ_EMPTY_BAR", "int", index.get("dq_empty", 0)),
        Constant("DQ_FULL_ARRIVALS", "int", bars["dq_full"].count if staged else 0, "every consumer thread"),
        Constant("DQ_EMPTY_ARRIVALS", "int", bars["dq_empty"].count if staged else 0, "every writer thread"),
        Constant("WRITER_THREADS", "int", writer_threads, "the producer warpgroup's warps 1.. that add dQ_i"),
        Constant("WRITER_TMA", "bool", lay.dq_path == "writer_tma", "TMA reduce-add (else red.global.add.v4)"),
        Constant("ORDERED", "bool", ordered, "dQ_i added in kv tile order behind per-tile semaphores"),
        Constant("DQ_M_TILES", "int", 1, "16-row dQ_i tiles per warp (backward_ops.j2)"),
        Constant("DQ_COLS", "int", dq_cols, f"dQ_i columns per consumer (split {lay.dq_split})"),
        Constant("DQ_CONSUMER_ROWS", "int", WGMMA_ROWS if lay.dq_split == "m" else 0, "consumer 1's first dQ_i row"),
        Constant("DQ_CONSUMER_COLS", "int", d // 2 if lay.dq_split == "n" else 0, "consumer 1's first dQ_i column"),
        Constant("DQ_K16", "int", bc // 16, "16-key steps of dQ_i = dS K_j"),
        Constant("DQ_A_CONSUMER_BYTES", "u32", panel(bc) if lay.dq_split == "m" else 0,
                 "consumer 1's dS^T operand: its 64 query columns"),
        Constant("DQ_B_CONSUMER_BYTES", "u32", (d // 2 // PANEL_COLUMNS) * panel(bc) if lay.dq_split == "n" else 0,
                 "consumer 1's K operand: its column panels"),
        Constant("DK_B_CONSUMER_BYTES", "u32", (d // 2 // PANEL_COLUMNS) * panel(br) if columns else 0,
                 "columns split: consumer 1's Q_i panels"),
        Constant("DV_B_CONSUMER_BYTES", "u32", (dv // 2 // PANEL_COLUMNS) * panel(br) if columns else 0,
                 "columns split: consumer 1's dO_i panels"),
        Constant("DQ_VECTOR", "int", 4, "fp32 per dQ atomic from registers (red.global.add.v4)"),
        *smem_constants(main),
        Constant("PRE_ROWS", "int", BACKWARD_PRE_ROWS, "preprocess / convert: q rows per block"),
        Constant("PRE_THREADS", "int", BACKWARD_PRE_THREADS),
        *softmax_constants(p),
        *mod_constants(p, sc // 8),
        *expression_constants(p),
    ]
    if mods.softcap is not None:
        consts.append(Constant("SOFTCAP_TANH_UNITS", "float", math.log(2.0) / mods.softcap,
                               "softcap: ln 2 / cap, from log2 P + LSE log2 (= cap tanh log2 e) back to tanh"))
    if mods.sinks:
        consts.append(Constant("SINK_THREADS", "int", SINK_THREADS, "sink gradient: threads of its one block per head"))
    marked = mods.blocks is not None or mods.mask_mod is not None
    if marked:
        consts += [Constant("STEP_BITS_OFFSET", "u32", buf["step bits"].offset,
                            "mask = blocks: one bit per (query head, q tile) step, set where its block is nonzero"
                            if mods.blocks is not None else
                            "mask_mod: one bit per (query head, q tile) step, set where its box can show a key"),
                   Constant("STEP_BITS", "int", STEP_BITS, "the steps the bits hold (the host refuses more)")]
    ops, wgmma = _wrappers(sc, lay.split, d, dv, dq_cols)
    names = {"preprocess": f"{name}_preprocess", "main": f"{name}_main", "convert": f"{name}_convert"}
    if mods.sinks:
        names["sink_grad"] = f"{name}_sink_grad"
    if mods.document is not None:
        names["documents"] = f"{name}_documents"
    w = lambda key: spec_line(spec, key)   # noqa: E731
    dq_how = {"writer_tma": f"the writer's TMA reduce-add ({'in kv tile order, ' if ordered else ''}"
                            f"{d // STAGING_BOX_COLUMNS} boxes)",
              "writer_red": f"the writer's red.global.add.v4 ({WRITER_WARPS['writer_red']} warps)",
              "consumer_red": "red.global.add.v4 from the consumers' registers"}[lay.dq_path]
    regions = {
        "preprocess": Region(w("backward"), "D = rowsum(dO * O) and LSE into rows padded to whole q tiles (padded: "
                             "LSE +inf, D 0); zero dQ_accum" + (" and the semaphores" if ordered else "")),
        "main": Region(w("backward.order"), "kv outer, warp-specialized: one block per (kv tile, batch * kv head), "
                       "longest first (block x: kv tile x / pairs)"),
        "q_range": Region(w("mask"),
                          "the q tiles that see this kv tile (bottom-right aligned masks; none past kv_lens)"),
        "producer": Region(w("backward.warpgroups"), f"producer warpgroup: {b.producer_regs} registers; warp 0 lane 0 "
                           "issues every copy" + (f", warps 1..{WRITER_WARPS[lay.dq_path]} add dQ_i" if staged
                                                  else "")),
        "load_kv": Region(w("backward.pipeline"), f"K_j, V_j ({bc} rows) once, onto kv_full"),
        "load_q": Region(w("backward.pipeline"), f"Q_i, dO_i (TMA boxes), LSE_i, D_i (bulk) through a {stages}-slot "
                         "ring: wait for the slot's q_empty, then copy onto its q_full"),
        "writer": Region(w("backward.dq"), f"dQ_i -> dQ_accum: {dq_how}"),
        "consumer": Region(w("backward.warpgroups"), f"{WS_CONSUMERS} consumer warpgroups: {b.consumer_regs} "
                           f"registers, split by {lay.split}; dK, dV in wgmma accumulators"),
        "q_loop": Region(w("backward.order"), "for each query head of the GQA group, for each visible q tile (serial)"
                         + ("; only the steps whose block_mask entry is nonzero (the shared step bits)"
                            if mods.blocks is not None else "")),
        "mask_mod_steps": Region(w("mask_mod"), "mask_mod: warp 0 evaluates its box over each (query head, q tile) "
                                 "step of this kv tile (a ballot per 32 steps) and marks those it can show a key of in "
                                 "shared bits, before the roles split; each role walks the marked steps, and a "
                                 "consumer warp tests elements only where the box over its 16 keys can be false"),
        "blocks": Region(w("mask"), "block-sparse: warp 0 reads this kv tile's column of block_mask once (a ballot per "
                         "32 steps) and marks the (query head, q tile) steps to walk in shared bits, before the roles "
                         "split; each role walks the marked steps"),
        "store_dkv": Region(w("backward.tile"), "dK = scale * dK, dV -> global (every kv row < kv_len, zeros "
                            "included; NaN for a bad kv_lens entry)"),
        "convert": Region(w("backward.dq"), "dQ = scale * dQ_accum, fp32 -> dtype (NaN for a bad kv_lens entry)"),
    }
    if mods.mask_mod is None:
        del regions["mask_mod_steps"]
    if mods.masks_positions:
        regions["q_range_mods"] = Region(w("mask"), q_range_text(mods))
    if mods.document is not None:
        regions["documents"] = Region(w("mask"), "per (batch, kv tile) the keys' documents [start, end) and, for "
                                      "ordered dQ, per q tile the first kv tile that sees it (its semaphores start "
                                      "past the mask's first): one warp each, searching 32 positions at a time")
    if mods.sinks:
        regions["sink_grad"] = Region(w("sinks"), "dsink[h] = -sum over (batch, row) of exp(sink_h - LSE) * D: one "
                                      "block per query head, a fixed order (deterministic; no atomics, no zeroing)")
    # score_mods.cuh is pasted where the scores change (sinks alone change only the sink gradient kernel)
    fields = score_mod_fields(mods, consts) | {"score_mods": mods.modifies_scores}
    fields |= expression_fields(mods, gradient=True)
    fields["ds_factor"] = fields["softcap"] or bool(fields.get("score_grad_expression"))
    fields |= dict(mask_mods=mods.masks_positions, documents=mods.document.value if mods.document else "",
                   prefix=mods.prefix is not None)
    # ALiBi's slopes are the main kernel's; the sinks only the sink gradient kernel's
    mod_lines = mod_parameters(replace(mods, sinks=False))
    if mods.document is not None:   # the documents kernel's: read, not searched, by the main kernel
        mod_lines += (parameters("const int2* __restrict__", "key_spans"),)
    return make_plan(spec, Family.FA2, TEMPLATE, consts, regions, consumer_body(spec, staged, lay.split),
                     Launch(threads=main.threads, smem_bytes=main.smem_bytes, tile_q=br), 1, main.register_estimate,
                     kernel_name=name, plan_class=WsBackwardPlan, kernel_names=names, dq_mode=b.dq.value, tile_kv=bc,
                     wgmma_ops=ops, wgmma=wgmma, mma="wgmma", split=lay.split, dq_path=lay.dq_path, ordered=ordered,
                     staging=lay.staging, box_rows={"q": br, "do": br, "k": bc, "v": bc, "dq": br}, copies=copies,
                     barriers=lay.barriers, shared=WS_SHARED + ((STEP_BITS_SHARED,) if marked else ()),
                     parameters=WS_MAIN_PARAMETERS + mod_lines, blocks=mods.blocks is not None, marked_steps=marked,
                     **fields)
