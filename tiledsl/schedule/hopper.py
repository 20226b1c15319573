"""The Hopper family's consumer loop as graph ops (schedule/graph.py builds the rest of its graph).

One trip of the kv loop issues, in this insertion (= emission) order, the consumer's steps on kv
tiles: wait for K_j's full barrier, [take the ping-pong turn], S = Q K^T (async wgmma), [pass the
turn], wait for S, free K_j's slot, mask, online softmax, O *= alpha, pack P into A fragments,
wait for V's full barrier, O += P V (async wgmma), wait for it, free V's slot.

Each op has a `lag`: how many tiles behind the loop's tile it works. Without intra overlap every lag
is 0. With it, P V of tile j-1 is issued right after Q K^T of tile j (lag 1 for pack_p, rescale_o,
the V wait and mma_pv) and waited for at the top of the next trip (lag 2 for that wait and V's
release), so the softmax of S_j runs while P V is on the tensor cores. `_link` turns a dependency
into a DAG edge when both ends run in the same trip and into a loop-carried one otherwise, so the
emission-order pass checks the trip's order against every same-trip dependency. The lowering peels
the prologue and epilogue from the lags (lower/hopper.py).
"""
from __future__ import annotations

from .modify import add_dropout, add_score_mod, mask_key, mask_text
from .ops import Carry, EdgeKind, GraphError, Op, OpKind, Role, Space

# Issue order of one trip (insertion order; the edges below justify it).
_ORDER = ("wait_k_full", "turn_wait", "mma_qk", "turn_pass", "wait_s", "arrive_k_empty", "score_mod", "mask",
          "online_softmax", "dropout", "rescale_o", "pack_p", "wait_v_full", "mma_pv", "wait_pv", "arrive_v_empty")
_ORDER_INTRA = ("wait_pv", "arrive_v_empty", "pack_p", "wait_k_full", "turn_wait", "mma_qk", "rescale_o", "wait_v_full",
                "mma_pv", "turn_pass", "wait_s", "arrive_k_empty", "score_mod", "mask", "online_softmax", "dropout")


def consumer_tile_math(b, loops: tuple[str, ...], q_ready: str) -> dict[str, str]:
    """Adds the consumer's kv-loop ops of a Hopper graph (`b`: graph._Builder); returns the node that
    last produced each of O, m, l."""
    g, spec = b.g, b.spec
    s, p = spec.schedule, spec.problem
    kv_loop = loops[-1]
    intra, pingpong = s.intra_overlap, s.pingpong
    pv_lag, done_lag = (1, 2) if intra else (0, 0)
    ov = "overlap"
    behind = {1: "_{j-1}", 2: "_{j-2}"}
    tile = {n: behind.get(lag, "_j") for n, lag in (("pv", pv_lag), ("done", done_lag))}

    def op(kind, lag=0, **kw) -> Op:
        return Op(kind, loops=loops, role=Role.CONSUMER, lag=lag, **kw)

    ops = {
        "wait_k_full": op(OpKind.WAIT, key="pipeline", barrier="k_full", text="wait k_full (K_j has landed)"),
        "turn_wait": op(OpKind.WAIT, key=ov, barrier="turn",
                        text="ping-pong: wait for this consumer's turn to issue its GEMMs (named barrier)"),
        "mma_qk": op(OpKind.MMA_QK, space=Space.REGISTERS, shape=("Br", "Bc"), key="tile",
                     text="S = scale * Q_i K_j^T (SS wgmma, issued)", **b.mma_instruction(s.tile_kv)),
        "turn_pass": op(OpKind.ARRIVE, key=ov, barrier="turn",
                        text="ping-pong: pass the turn to the next consumer (named barrier)"),
        "wait_s": op(OpKind.MMA_WAIT, key=ov if intra else "tile", variant="S", pending=1 if intra else 0,
                     text="wait for S_j" + (" only (P_{j-1} V_{j-1} stays in flight)" if intra else "")),
        "arrive_k_empty": op(OpKind.ARRIVE, key="pipeline", barrier="k_empty", text="arrive k_empty (K_j's slot free)"),
        "mask": op(OpKind.MASK, space=Space.REGISTERS, shape=("Br", "Bc"), key=mask_key(g), text=mask_text(p),
                   variant=p.mask.value),
        "online_softmax": op(OpKind.ONLINE_SOFTMAX, space=Space.REGISTERS, shape=("Br", "Bc"), key="order",
                             variant="running", text="m_new = max(m, rowmax S); alpha = exp(m - m_new); "
                                                     "P = exp(S - m_new); l = alpha*l + rowsum P; m = m_new"),
        "rescale_o": op(OpKind.RESCALE_O, pv_lag, space=Space.REGISTERS, shape=("Br", "dv"), key="order",
                        variant="before_pv", text=f"O *= alpha{tile['pv']} (skipped when no row's max moved)"),
        "pack_p": op(OpKind.PACK_P, pv_lag, space=Space.REGISTERS, shape=("Br", "Bc"), key="tile",
                     text=f"P{tile['pv']} -> " + ("e4m3 A fragments (256 P, rounded)" if p.fp8 else "bf16/fp16 A "
                                                  "fragments") + " of the P V wgmma"),
        "wait_v_full": op(OpKind.WAIT, pv_lag, key="pipeline", barrier="vt_full" if p.fp8 else "v_full",
                          text=f"wait vt_full (V^T{tile['pv']} written by the transposers)" if p.fp8
                          else f"wait v_full (V{tile['pv']} has landed)"),
        "mma_pv": op(OpKind.MMA_PV, pv_lag, space=Space.REGISTERS, shape=("Br", "dv"), key="tile", variant="accumulate",
                     text=f"O += P{tile['pv']} V{tile['pv']} (RS wgmma, P from registers, issued)",
                     **b.mma_instruction(p.head_dim_v)),
        "wait_pv": op(OpKind.MMA_WAIT, done_lag, key=ov if intra else "tile", variant="PV", pending=0,
                      text=f"wait for O += P{tile['done']} V{tile['done']}" + (" (issued last trip)" if intra else "")),
        "arrive_v_empty": op(OpKind.ARRIVE, done_lag, key="pipeline", barrier="v_empty",
                             text=f"arrive v_empty ({'V^T' if p.fp8 else 'V'}{tile['done']}'s slot free)"),
    }
    for name in _ORDER_INTRA if intra else _ORDER:
        if name == "score_mod":   # the modifications' ops (schedule/modify.py), when the spec has them
            scores = add_score_mod(g, name, loops, Role.CONSUMER, "tile", "wait_s")
        elif name == "dropout":
            probabilities = add_dropout(g, name, loops, Role.CONSUMER, "online_softmax")
        elif pingpong or not name.startswith("turn_"):
            g.add(name, ops[name])

    def link(src: str, dst: str, value: str = "", kind: EdgeKind = EdgeKind.DATA, later: int = 0) -> None:
        _link(g, kv_loop, src, dst, value, kind, later)

    sync = EdgeKind.SYNC
    link("arrive_k_full", "wait_k_full", "k_full", sync)
    link("wait_k_full", "mma_qk", "", sync)
    g.connect(q_ready, "mma_qk", "Q_i")
    link("load_k", "mma_qk", "K_j")
    link("mma_qk", "wait_s", "S")
    link("wait_s", "arrive_k_empty", "K_j read", sync)
    if scores == "wait_s":   # else add_score_mod linked wait_s -> score_mod
        link("wait_s", "mask", "S")
    else:
        link(scores, "mask", "S")
    link("mask", "online_softmax", "S")
    link("online_softmax", "online_softmax", "m, l", later=1)
    link("online_softmax", "rescale_o", "alpha")
    link(probabilities, "pack_p", "P")
    if p.fp8:   # P V reads V^T, written by the producer's transposing warps (graph._Builder.transpose_v)
        link("arrive_vt_full", "wait_v_full", "vt_full", sync)
        link("transpose_v", "mma_pv", "V^T_j")
    else:
        link("arrive_v_full", "wait_v_full", "v_full", sync)
        link("load_v", "mma_pv", "V_j")
    link("wait_v_full", "mma_pv", "", sync)
    link("pack_p", "mma_pv", "P fragments")
    link("rescale_o", "mma_pv", "O")
    link("mma_pv", "wait_pv", "O")
    link("wait_pv", "arrive_v_empty", "V_j read", sync)
    link("wait_pv", "rescale_o", "O", later=1)
    link("wait_pv", "pack_p", "P fragments free", sync, later=1)   # the RS wgmma reads them from registers
    if intra:   # the software pipeline: tile j's Q K^T goes first, tile j-1's P V rides along
        link("mma_qk", "mma_pv", "issued after Q K^T of the next tile", sync, later=-1)
        link("mma_pv", "wait_s", "left in flight (wait_group 1)", sync, later=1)
    if pingpong:   # a turn covers every GEMM the trip issues
        link("turn_wait", "mma_qk", "turn", sync)
        link("mma_qk", "turn_pass", "", sync)
        if intra:
            link("mma_pv", "turn_pass", "", sync, later=1)
        g.carry(kv_loop, "turn_pass", "turn_wait", "turn (round the consumers)", sync)
    g.carry(kv_loop, "arrive_k_empty", "wait_k_empty", "k_empty", sync)   # the consumer frees K's slot
    if p.fp8:   # V^T's slot goes back to the transposers; V's landing slot to the producer once transposed
        g.carry(kv_loop, "arrive_v_empty", "wait_vt_empty", "v_empty", sync)
        g.carry(kv_loop, "arrive_vt_full", "wait_v_slot", "vt_full (V's landing slot)", sync)
    else:
        g.carry(kv_loop, "arrive_v_empty", "wait_v_empty", "v_empty", sync)
    return {"O": "wait_pv", "m": "online_softmax", "l": "online_softmax"}


def _link(g, loop: str, src: str, dst: str, value: str, kind: EdgeKind, later: int) -> None:
    """A dependency of `dst`, on a tile `later` tiles after `src`'s, on `src`: a DAG edge when both run
    in the same trip of `loop` (trip = tile + lag), loop-carried when `dst` runs in a later trip."""
    trips = later + g.op(dst).lag - g.op(src).lag
    if trips < 0:
        raise GraphError(f"{src} -> {dst}: the dependency runs backwards in time ({trips} trips)")
    if trips == 0:
        g.connect(src, dst, value, kind)
    else:
        for n in (src, dst):
            if n not in g.dag:
                raise GraphError(f"carry {src} -> {dst}: unknown node {n!r}")
        g.carried.append(Carry(loop, src, dst, value, kind))
