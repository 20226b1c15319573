"""The backward pass's scheduler graph: dQ, dK, dV by recomputation (keep O and LSE, never P).

Kernels, each a top-level grid loop (`Op.kernel`):
  preprocess   per q tile: D = rowsum(dO * O), stored for the main kernel
  backward     the spec's backward order:
                 kv, q (FA2's): one block per kv tile keeps dK, dV on chip over a serial q loop;
                   each q tile's share of dQ leaves the block: into an fp32 workspace by atomics
                   (`dq accumulate atomic`) or in kv tile order (`ordered`), or not at all
                   (`separate`: a second, q-outer kernel recomputes dS and sums dQ on chip);
                 q, kv: one block per q tile keeps dQ on chip; dK, dV go to workspaces by atomics
  backward_dq  `separate` only: q outer, dQ on chip
  convert_*    the fp32 workspace to the gradient (dQ, or dK and dV)
Per (q tile, kv tile): S = scale Q K^T, the forward's mask, P = exp(S - LSE), dV += P^T dO,
dP = dO V^T, dS = P * (dP - D), dK += scale dS^T Q, dQ += scale dS K. Tiles no query sees are
skipped as in the forward. GQA: blocks run per query head; dK, dV of a kv head sum its group's.

Ops name the backward's DSL statements as `backward.<key>` for their source tags. A warp-specialized
backward (`warpgroups` in the block) gives the main kernel's ops roles -- the producer loads, the consumers
compute -- and adds the roles' barriers and staging ops (schedule/backward_ws.py).
"""
from __future__ import annotations

from .backward_ws import add_ws_ops, ws_barriers
from .graph import ScheduleGraph
from .modify import add_dropout, add_score_mod, add_score_mod_grad, add_sink_grad, mask_key, mask_text, q_loop_text
from .ops import Access, Op, OpKind, Role, Space
from .passes import emission_order
from ..errors import SpecError
from ..layout.backward import backward_wgmma_dv_schedule
from ..layout.backward_ws import backward_ws_layout, ws_split
from ..spec import DqAccumulate, KernelSpec, LoopOrder, Mma

ORDER, TILE, PIPE, DQ = "backward.order", "backward.tile", "backward.pipeline", "backward.dq"
_PRODUCED = (OpKind.LOAD_Q, OpKind.LOAD_DO, OpKind.LOAD_LSE_D, OpKind.LOAD_K, OpKind.LOAD_V)
# tile_math's ops of the main kernel, by what they compute (the warp-specialized ops link to them)
_MATH = {"S": "mma_qk", "dP": "mma_dp", "mask": "mask", "P": "recompute_p", "dS": "softmax_grad", "dV": "mma_dv",
         "dK": "mma_dk", "dQ": "mma_dq", "accumulate": "accumulate_dq"}


class _Backward:
    def __init__(self, g: ScheduleGraph):
        self.g, self.b = g, g.spec.backward
        self.ws = self.b.warp_specialized

    def op(self, name: str, kind: OpKind, loops, key: str, text: str, space=Space.REGISTERS, shape=(), deps=(),
           **kw) -> str:
        if self.ws and loops and loops[0] == "loop_kv":   # the warp-specialized main kernel: who runs it
            kw.setdefault("role", Role.PRODUCER if kind in _PRODUCED else Role.CONSUMER)
            if kind in _PRODUCED:
                kw.setdefault("via", "tma")
        self.g.add(name, Op(kind, space, shape, loops, key=key, text=text, **kw))
        for dep in deps:
            self.g.connect(dep, name)
        return name

    def loop(self, name, loops, var, key, text, kernel="", init=()):
        extent = "ceil(Nq/Br)" if var == "q" else "ceil(Nk/Bc)"
        self.g.add(name, Op(OpKind.LOOP, loops=loops, var=var, extent=extent, key=key, text=text,
                            grid=not loops, kernel=kernel, init=init, init_space=Space.REGISTERS if init
                            else Space.NONE))
        return loops + (name,)

    def load_q_side(self, p: str, loops) -> dict[str, str]:
        """Q_i, dO_i, LSE_i and D_i of the current q tile."""
        return {"Q": self.op(f"{p}load_q", OpKind.LOAD_Q, loops, PIPE, "Q_i -> shared", Space.SHARED, ("Br", "d"),
                             hbm=(Access("Q", "read", "q", "d"),)),
                "dO": self.op(f"{p}load_do", OpKind.LOAD_DO, loops, PIPE, "dO_i -> shared", Space.SHARED, ("Br", "dv"),
                              hbm=(Access("dO", "read", "q", "dv"),)),
                "LSE": self.op(f"{p}load_lse_d", OpKind.LOAD_LSE_D, loops, PIPE, "LSE_i, D_i -> registers",
                               shape=("Br",), hbm=(Access("lse", "read", "q", "1"), Access("D", "read", "q", "1")))}

    def load_kv_side(self, p: str, loops) -> dict[str, str]:
        return {"K": self.op(f"{p}load_k", OpKind.LOAD_K, loops, PIPE, "K_j -> shared", Space.SHARED, ("Bc", "d"),
                             hbm=(Access("K", "read", "kv", "d"),)),
                "V": self.op(f"{p}load_v", OpKind.LOAD_V, loops, PIPE, "V_j -> shared", Space.SHARED, ("Bc", "dv"),
                             hbm=(Access("V", "read", "kv", "dv"),))}

    def tile_math(self, p: str, loops, have: dict[str, str], dq: str, dkv: str) -> dict[str, str]:
        """One (q tile, kv tile) step. dq / dkv: "accumulate" (on chip, over the serial loop), "partial"
        (this tile's share, for a workspace) or "" (not computed in this kernel)."""
        mask = self.g.spec.problem.mask
        # Ties in the emission order go to the op made first. wgmma issues dP's MMA right after S's (it
        # runs while P is recomputed), and by default dV's after dS (layout.backward_wgmma_dv_schedule).
        wgmma = self.b.mma is Mma.WGMMA
        dv_late = wgmma and backward_wgmma_dv_schedule(self.b.tile_q, self.g.spec.problem.head_dim_qk)[0] == "late"
        s = self.op(f"{p}mma_qk", OpKind.MMA_QK, loops, TILE, "S = scale * Q_i K_j^T", shape=("Br", "Bc"),
                    deps=(have["Q"], have["K"]))

        def mma_dp():
            return self.op(f"{p}mma_dp", OpKind.MMA_DP, loops, TILE, "dP = dO_i V_j^T", shape=("Br", "Bc"),
                           deps=(have["dO"], have["V"]))

        def mma_dv():
            out["dV"] = self.op(f"{p}mma_dv", OpKind.MMA_DV, loops, TILE, ("dV += P^T dO_i" if dkv == "accumulate"
                                else "dV_j = P^T dO_i"), shape=("Bc", "dv"), deps=(P, have["dO"]), variant=dkv)
        if wgmma:
            dp = mma_dp()
        role = Role.CONSUMER if self.ws and loops[0] == "loop_kv" else Role.ALL   # who runs the elementwise steps
        s = add_score_mod(self.g, f"{p}score_mod", loops, role, TILE, s)
        m = self.op(f"{p}mask", OpKind.MASK, loops, mask_key(self.g), mask_text(self.g.spec.problem),
                    shape=("Br", "Bc"), deps=(s,), variant=mask.value)
        P = self.op(f"{p}recompute_p", OpKind.RECOMPUTE_P, loops, "backward", "P = exp(S - LSE)   (0 where LSE = -inf: "
                    "a row that sees no key)", shape=("Br", "Bc"), deps=(m, have["LSE"]))
        P = add_dropout(self.g, f"{p}dropout", loops, role, P)   # dV and dS read the dropped P's mask
        out = {}
        if dkv and not dv_late:
            mma_dv()
        if not wgmma:
            dp = mma_dp()
        dropped = "dS = P * (dP * Z / (1 - p) - D_i)" if self.g.spec.problem.mods.dropout else "dS = P * (dP - D_i)"
        ds = self.op(f"{p}softmax_grad", OpKind.SOFTMAX_GRAD, loops, "backward", dropped,
                     shape=("Br", "Bc"), deps=(P, dp, have["LSE"]))
        ds = add_score_mod_grad(self.g, f"{p}score_mod_grad", loops, role, TILE, ds)
        if dkv and dv_late:
            mma_dv()
        if dkv:
            out["dK"] = self.op(f"{p}mma_dk", OpKind.MMA_DK, loops, TILE,
                                ("dK += scale * dS^T Q_i" if dkv == "accumulate"
                                else "dK_j = scale * dS^T Q_i"), shape=("Bc", "d"), deps=(ds, have["Q"]), variant=dkv)
        if dq:
            out["dQ"] = self.op(f"{p}mma_dq", OpKind.MMA_DQ, loops, TILE, ("dQ += scale * dS K_j" if dq == "accumulate"
                                else "dQ_i = scale * dS K_j   (this kv tile's share)"), shape=("Br", "d"),
                                deps=(ds, have["K"]), variant=dq)
        return out

    def store(self, name, loops, tensor: str, rows: str, cols: str, text: str, deps=(), key="backward"):
        return self.op(name, OpKind.STORE_GRAD, loops, key, text, Space.HBM, deps=deps,
                       hbm=(Access(tensor, "write", rows, cols),))

    def preprocess(self) -> None:
        loops = self.loop("pre_loop_q", (), "q", "backward", "for i in q tiles (one block each)", kernel="preprocess")
        o = self.op("pre_load_o", OpKind.LOAD_O, loops, "backward", "O_i -> registers", shape=("Br", "dv"),
                    hbm=(Access("O", "read", "q", "dv"),))
        do = self.op("pre_load_do", OpKind.LOAD_DO, loops, "backward", "dO_i -> registers", shape=("Br", "dv"),
                     hbm=(Access("dO", "read", "q", "dv"),))
        d = self.op("rowsum_d", OpKind.ROWSUM_D, loops, "backward", "D_i = rowsum(dO_i * O_i)", shape=("Br",),
                    deps=(o, do))
        self.store("store_d", loops, "D", "q", "1", "D[i*Br : (i+1)*Br] = D_i", deps=(d,))

    def sink_gradient(self) -> None:
        """With sinks: dsink by a kernel of its own after the preprocess, one block per query head summing its
        rows' terms in a fixed order (deterministic, no atomics, nothing to zero first)."""
        if not self.g.spec.problem.mods.sinks:
            return
        loops = self.loop("sink_loop_q", (), "q", "sinks", "for i in q tiles of every batch entry (serial in one "
                          "block per query head)", kernel="sink_grad")
        rows = self.op("sink_load_lse_d", OpKind.LOAD_LSE_D, loops, "sinks", "LSE_i, D_i -> registers",
                       shape=("Br",), hbm=(Access("lse", "read", "q", "1"), Access("D", "read", "q", "1")))
        add_sink_grad(self.g, "sink_grad", loops, rows)

    def kv_outer(self) -> None:
        b, g = self.b, self.g
        separate = b.dq is DqAccumulate.SEPARATE
        kv = self.loop("loop_kv", (), "kv", ORDER, "for j in kv tiles (one block each; dK, dV on chip)",
                       kernel="backward", init=(("dK", "0"), ("dV", "0")))
        have = self.load_kv_side("", kv)
        q = self.loop("loop_q", kv, "q", ORDER, "for i in q tiles (serial; tiles that see no key of K_j are skipped"
                      + q_loop_text(self.g.spec.problem.mods) + ")")
        have |= self.load_q_side("", q)
        out = self.tile_math("", q, have, "" if separate else "partial", "accumulate")
        for t in ("dK", "dV"):
            g.carry("loop_q", out[t], out[t], t)
        if not separate:
            how = {DqAccumulate.ATOMIC: "atomicAdd, in any order",
                   DqAccumulate.TMA_REDUCE: "TMA reduce-add of the staged tile, in any order"}.get(
                b.dq, "in kv tile order, block j after block j-1: deterministic")
            self.op("accumulate_dq", OpKind.ACCUMULATE, q, DQ, f"dQ_accum[i*Br : (i+1)*Br] += dQ_i   (fp32, {how})",
                    Space.HBM, deps=(out["dQ"],), variant=b.dq.value, hbm=(Access("dQ_accum", "write", "q", "d"),))
            if self.ws:
                self.warp_specialized(kv, q, have)
        for t, cols in (("dK", "d"), ("dV", "dv")):
            self.store(f"store_{t.lower()}", kv, t, "kv", cols, f"{t}[j*Bc : (j+1)*Bc] += {t}   (summed over the "
                       "query heads of a GQA group)", deps=(out[t],), key="backward.tile")
        if separate:
            qo = self.loop("dq_loop_q", (), "q", DQ, "for i in q tiles (one block each; dQ on chip)",
                           kernel="backward_dq", init=(("dQ", "0"),))
            have = self.load_q_side("dq_", qo)
            ki = self.loop("dq_loop_kv", qo, "kv", DQ, "for j in kv tiles (serial; tiles no query sees are skipped)")
            have |= self.load_kv_side("dq_", ki)
            out = self.tile_math("dq_", ki, have, "accumulate", "")
            g.carry("dq_loop_kv", out["dQ"], out["dQ"], "dQ")
            self.store("store_dq", qo, "dQ", "q", "d", "dQ[i*Br : (i+1)*Br] = dQ", deps=(out["dQ"],), key=DQ)
        else:
            loops = self.loop("convert_loop_q", (), "q", DQ, "for i in q tiles (one block each)", kernel="convert_dq")
            self.op("convert_dq", OpKind.CONVERT_GRAD, loops, DQ, "dQ[i*Br : (i+1)*Br] = dQ_accum (fp32 -> dtype)",
                    Space.HBM, hbm=(Access("dQ_accum", "read", "q", "d"), Access("dQ", "write", "q", "d")))

    def warp_specialized(self, kv, q, have) -> None:
        """The roles' ops and barriers (schedule/backward_ws.py), with the layout's dQ path and counts; a spec
        the layout refuses keeps its math ops (explain and the float64 reference still take it)."""
        try:
            lay = backward_ws_layout(self.g.spec)
        except SpecError:
            return
        add_ws_ops(self, kv, q, have, dict(_MATH), ws_split(self.b.tile_kv), lay.dq_path != "consumer_red")
        self.g.barriers = ws_barriers(self.g, lay)
        self.g.roles = dict(lay.roles)

    def q_outer(self) -> None:
        g = self.g
        q = self.loop("loop_q", (), "q", ORDER, "for i in q tiles (one block each; dQ on chip)", kernel="backward",
                      init=(("dQ", "0"),))
        have = self.load_q_side("", q)
        kv = self.loop("loop_kv", q, "kv", ORDER, "for j in kv tiles (serial; tiles no query sees are skipped)")
        have |= self.load_kv_side("", kv)
        out = self.tile_math("", kv, have, "accumulate", "partial")
        g.carry("loop_kv", out["dQ"], out["dQ"], "dQ")
        self.op("accumulate_dkv", OpKind.ACCUMULATE, kv, ORDER, "dK_accum, dV_accum[j*Bc : (j+1)*Bc] += dK_j, dV_j   "
                "(fp32 atomicAdd, in any order; GQA: the group's query heads into one kv head)", Space.HBM,
                deps=(out["dK"], out["dV"]), variant=DqAccumulate.ATOMIC.value,
                hbm=(Access("dK_accum", "write", "kv", "d"), Access("dV_accum", "write", "kv", "dv")))
        self.store("store_dq", q, "dQ", "q", "d", "dQ[i*Br : (i+1)*Br] = dQ", deps=(out["dQ"],), key=TILE)
        loops = self.loop("convert_loop_kv", (), "kv", ORDER, "for j in kv tiles (one block each)",
                          kernel="convert_dkv")
        self.op("convert_dkv", OpKind.CONVERT_GRAD, loops, ORDER, "dK, dV[j*Bc : (j+1)*Bc] = dK_accum, dV_accum "
                "(fp32 -> dtype)", Space.HBM, hbm=(Access("dK_accum", "read", "kv", "d"),
                                                   Access("dV_accum", "read", "kv", "dv"),
                                                   Access("dK", "write", "kv", "d"), Access("dV", "write", "kv", "dv")))


def build_backward_graph(spec: KernelSpec) -> ScheduleGraph:
    """The backward graph of `spec`'s `backward { }` schedule (ValueError when it has none)."""
    if spec.backward is None:
        raise ValueError(f"{spec.name} has no backward schedule: add `backward {{ }}` to its spec")
    g = ScheduleGraph(spec)
    builder = _Backward(g)
    builder.preprocess()
    builder.sink_gradient()
    if spec.backward.order is LoopOrder.KV_OUTER:
        builder.kv_outer()
    else:
        builder.q_outer()
    g.facts.add("graph")
    g.sizes.update(Br=spec.backward.tile_q, Bc=spec.backward.tile_kv)
    if g.barriers:   # warp-specialized: explain walks the roles' ops in the order they are issued
        g.order = tuple(emission_order(g))
    return g

