"""The warp-specialized backward's roles and barriers as graph ops (schedule/backward.py builds the math).

Three roles run the kv-outer main kernel (layout/backward_ws.py):
  producer   arrive kv_full with K_j's and V_j's bytes and copy them (once); per q tile: wait for the ring
             slot's q_empty, arrive q_full with its bytes, copy Q_i, dO_i (TMA boxes), LSE_i and D_i (bulk)
  consumer   wait kv_full; per q tile: wait q_full, S^T and dP^T (async wgmma), wait for S^T only, mask,
             P^T, [stage P^T], wait for dP^T, dS^T, dV and dK [after the barrier when P^T is staged],
             stage dS^T, the consumers' named barrier, dQ_i = dS K, wait for all, free the slot (q_empty),
             then dQ_i out: [wait dq_empty, stage it, arrive dq_full] or red.global.add from registers
  writer     per q tile: wait dq_full, add the staged dQ_i to dQ_accum (TMA reduce-add, or red.global.add,
             or in kv tile order behind a per-tile semaphore), arrive dq_empty

The edges justify the consumer's issue order (insertion order breaks the remaining ties); the lowering
(lower/backward_ws.py) asserts the emission order is the one the layout's split expects. `ws_barriers`
reads the barriers off the arrive and wait ops with the layout's counts and bytes, for explain and the
barrier-balance tests."""
from __future__ import annotations

from .ops import Barrier, EdgeKind, Op, OpKind, Role

SYNC = EdgeKind.SYNC
PIPE, DQ, WG = "backward.pipeline", "backward.dq", "backward.warpgroups"


def add_ws_ops(b, kv: tuple[str, ...], q: tuple[str, ...], have: dict[str, str], out: dict[str, str],
               split: str, staged: bool) -> None:
    """Adds the roles' barrier, wait and staging ops of a kv-outer backward graph (`b`: backward._Backward;
    kv / q: the loops; have: the loads; out: tile_math's results; split, staged: the layout's)."""
    g = b.g
    P, C, W = Role.PRODUCER, Role.CONSUMER, Role.WRITER

    def op(name, kind, loops, role, key, text, deps=(), **kw):
        g.add(name, Op(kind, loops=loops, role=role, key=key, text=text, **kw))
        for dep, value, edge in deps:
            g.connect(dep, name, value, edge)
        return name

    op("arrive_kv_full", OpKind.ARRIVE, kv, P, PIPE, "arrive.expect_tx kv_full (K_j's and V_j's bytes), then copy "
       "them (TMA)", barrier="kv_full")
    for load in ("K", "V"):
        g.connect("arrive_kv_full", have[load], "expect_tx before the copies", SYNC)
    op("wait_kv_full", OpKind.WAIT, kv, C, PIPE, "wait kv_full; keys past kv_len zeroed in shared memory",
       ((have["K"], "K_j", SYNC), (have["V"], "V_j", SYNC)), barrier="kv_full")
    op("wait_q_empty", OpKind.WAIT, q, P, PIPE, "wait q_empty (the ring slot is free; not in its first round)",
       barrier="q_empty")
    op("arrive_q_full", OpKind.ARRIVE, q, P, PIPE, "arrive.expect_tx q_full (Q_i, dO_i, LSE_i, D_i bytes), then copy "
       "them", (("wait_q_empty", "slot free", SYNC),), barrier="q_full")
    for load in ("Q", "dO", "LSE"):
        g.connect("arrive_q_full", have[load], "expect_tx before the copies", SYNC)
    wait = op("wait_q_full", OpKind.WAIT, q, C, PIPE, "wait q_full (the slot's tiles have landed)",
              tuple((have[t], t, SYNC) for t in ("Q", "dO", "LSE")), barrier="q_full")
    for n in (out["S"], out["dP"], out["P"], out["dS"]):
        g.connect(wait, n, "slot landed", SYNC)
    for n in (out["S"], out["dP"]):
        g.connect("wait_kv_full", n, "K_j, V_j landed", SYNC)
    op("wait_s", OpKind.MMA_WAIT, q, C, "backward.tile", "wait for S^T (dP^T's wgmma stays in flight)",
       ((out["S"], "S^T", EdgeKind.DATA), (out["dP"], "issued first", SYNC)), variant="S", pending=1)
    # the score modification (softcap, ALiBi) works on S^T once it has landed, before the mask
    g.connect("wait_s", "score_mod" if "score_mod" in g else out["mask"], "S^T", SYNC)
    staged_p = split == "columns"
    if staged_p:   # P^T's halves go to shared memory: dV's A operand covers both consumers' query columns
        op("stage_p", OpKind.STAGE, q, C, "backward.tile", "P^T (this consumer's query columns) -> shared memory",
           ((out["P"], "P^T", EdgeKind.DATA),), variant="P^T")
    op("wait_dp", OpKind.MMA_WAIT, q, C, "backward.tile", "wait for dP^T",
       ((out["dP"], "dP^T", EdgeKind.DATA),) + ((("stage_p", "P^T stores run under dP^T's wgmma", SYNC),)
                                                if staged_p else ()), variant="dP", pending=0)
    g.connect("wait_dp", out["dS"], "dP^T", SYNC)
    ds = "score_mod_grad" if "score_mod_grad" in g else out["dS"]   # dS^T through the modification, when any
    # dV after dS^T: P^T's fp32 values die as its fragments are packed (layout.backward_wgmma_dv_schedule)
    g.connect(ds, out["dV"], "issued with dK, after dS^T", SYNC)
    op("stage_ds", OpKind.STAGE, q, C, "backward.tile", "dS^T (this consumer's part) -> shared memory",
       ((ds, "dS^T", EdgeKind.DATA),) + (() if staged_p else ((out["dK"], "dV, dK run under the stores",
                                                                     SYNC),)), variant="dS^T")
    op("sync_ds", OpKind.WAIT, q, C, WG, "named barrier of the consumers: " + ("P^T and " if staged_p else "")
       + "dS^T complete", (("stage_ds", "dS^T", SYNC),) + ((("stage_p", "P^T", SYNC),) if staged_p else ()),
       barrier="ds_ready")
    for n in ((out["dV"], out["dK"], out["dQ"]) if staged_p else (out["dQ"],)):
        g.connect("sync_ds", n, "both consumers' part", SYNC)
    op("wait_grads", OpKind.MMA_WAIT, q, C, "backward.tile", "wait for dV, dK and dQ_i",
       tuple((out[t], t, EdgeKind.DATA) for t in ("dV", "dK", "dQ")), variant="grads", pending=0)
    op("arrive_q_empty", OpKind.ARRIVE, q, C, PIPE, "arrive q_empty (one lane per warp: the slot is read)",
       (("wait_grads", "Q_i, dO_i read", SYNC),), barrier="q_empty")
    g.carry(q[-1], "arrive_q_empty", "wait_q_empty", "q_empty", SYNC)
    if not staged:   # red.global.add from the consumers' registers, after the slot is free
        g.update(out["accumulate"], role=C)
        g.connect("wait_grads", out["accumulate"], "dQ_i", SYNC)
        g.connect("arrive_q_empty", out["accumulate"], "the slot is freed first", SYNC)
        return
    op("wait_dq_empty", OpKind.WAIT, q, C, DQ, "wait dq_empty (the staging buffer's last dQ_i is read)",
       barrier="dq_empty")
    op("stage_dq", OpKind.STAGE, q, C, DQ, "dQ_i (fp32) -> the staging buffer's boxes",
       (("wait_grads", "dQ_i", EdgeKind.DATA), ("wait_dq_empty", "buffer free", SYNC),
        ("arrive_q_empty", "the slot is freed first", SYNC)), variant="dQ")
    op("arrive_dq_full", OpKind.ARRIVE, q, C, DQ, "arrive dq_full (every consumer thread)",
       (("stage_dq", "staged", SYNC),), barrier="dq_full")
    op("wait_dq_full", OpKind.WAIT, q, W, DQ, "wait dq_full", (("arrive_dq_full", "dq_full", SYNC),),
       barrier="dq_full")
    g.update(out["accumulate"], role=W)
    g.connect("wait_dq_full", out["accumulate"], "staged dQ_i", SYNC)
    op("arrive_dq_empty", OpKind.ARRIVE, q, W, DQ, "arrive dq_empty (every writer lane, after its reads)",
       ((out["accumulate"], "read", SYNC),), barrier="dq_empty")
    g.carry(q[-1], "arrive_dq_empty", "wait_dq_empty", "dq_empty", SYNC)


def ws_barriers(g, lay) -> dict[str, Barrier]:
    """The graph's barriers with the layout's arrival counts and transaction bytes (layout.barriers)."""
    ops = [n for n in g.names() if g.op(n).kind in (OpKind.ARRIVE, OpKind.WAIT) and g.op(n).barrier]
    out = {}
    for wb in lay.barriers:
        arrive = tuple(n for n in ops if g.op(n).barrier == wb.name and g.op(n).kind is OpKind.ARRIVE)
        wait = tuple(n for n in ops if g.op(n).barrier == wb.name and g.op(n).kind is OpKind.WAIT)
        if wb.kind == "named":   # bar.sync: every consumer thread arrives and waits at once
            arrive = wait
        out[wb.name] = Barrier(wb.name, wb.kind, wb.count, wb.tx_bytes, wb.copies, arrive, wait, wb.arrive_role,
                               wb.wait_role)
        for n in arrive:
            if wb.tx_bytes:
                g.update(n, tx_bytes=wb.tx_bytes)
    return out
