"""The scheduler graph: a networkx DiGraph of tile-level ops built from a KernelSpec.

Nodes are keyed by stable names ("load_q", "mma_qk", "loop_kv", ...) and carry an `Op` (plain
frozen data). Edges carry data dependencies within one loop trip ("data": the value that flows)
and producer/consumer synchronisation ("sync"); dependencies that cross loop trips (the running
m, l, O of the online softmax; a pipeline stage released for the next load) would make cycles,
so they are recorded beside the DAG in `ScheduleGraph.carried`.

Loop structure is explicit: every loop is a node of kind "loop", and every op lists its
enclosing loops outer -> inner in `Op.loops`. So FA1 (kv outer; Q, O, m, l loaded and stored
at every kv step) and FA2 (q outer; O on chip, normalised once) are different graphs, as are
split-KV decode (a split loop, partials to HBM, a merge kernel) and Hopper's producer/consumer
warpgroups (TMA loads and mbarrier arrive/wait between them).

The graph decides what runs where and in which order; schedule/passes.py annotates it (sizes, budgets,
pipeline buffers, roles, emission order) and later stages only read it.
"""
from __future__ import annotations

from dataclasses import replace

import networkx as nx

from .modify import SINK_INIT, add_dropout, add_score_mod, kv_loop_text, mask_key, mask_text, query_index
from .ops import Access, Barrier, Carry, EdgeKind, GraphError, Op, OpKind, Role, Space
from .hopper import consumer_tile_math
from ..layout.fa2 import fa2_page_ring
from ..spec import AUTO, Axis, DType, Family, KernelSpec, Mma


class ScheduleGraph:
    """A DAG of tile ops plus loop structure, built from one KernelSpec."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.dag = nx.DiGraph()
        self.carried: list[Carry] = []
        self.facts: set[str] = set()            # what passes have established ("shapes", ...)
        self.sizes: dict[str, int | None] = {}  # Br, Bc, d, dv, ... (shape inference)
        self.layout = None                      # every size of the kernel (legality: layout/)
        self.roles: dict[str, dict] = {}        # role -> warps, threads, registers (warp roles)
        self.barriers: dict[str, Barrier] = {}  # name -> Barrier (barriers pass; warp-specialized only)
        self.order: tuple[str, ...] | None = None   # emission order (emission order pass)

    # -- building
    def add(self, name: str, op: Op) -> str:
        if name in self.dag:
            raise GraphError(f"node {name!r} defined twice")
        for loop in op.loops:
            if loop not in self.dag or self.op(loop).kind is not OpKind.LOOP:
                raise GraphError(f"node {name!r}: enclosing loop {loop!r} is not a loop node")
        self.dag.add_node(name, op=op, seq=len(self.dag))
        return name

    def connect(self, src: str, dst: str, value: str = "", kind: EdgeKind = EdgeKind.DATA) -> None:
        for n in (src, dst):
            if n not in self.dag:
                raise GraphError(f"edge {src} -> {dst}: unknown node {n!r}")
        self.dag.add_edge(src, dst, value=value, kind=kind)

    def carry(self, loop: str, src: str, dst: str, value: str, kind: EdgeKind = EdgeKind.DATA) -> None:
        self.carried.append(Carry(loop, src, dst, value, kind))

    def update(self, name: str, **changes) -> None:
        self.dag.nodes[name]["op"] = replace(self.op(name), **changes)

    # -- reading
    def op(self, name: str) -> Op:
        return self.dag.nodes[name]["op"]

    def seq(self, name: str) -> int:
        """Insertion index: the stable tie-break of the emission order."""
        return self.dag.nodes[name]["seq"]

    def names(self, kind: OpKind | None = None) -> list[str]:
        """Node names in insertion order, optionally of one kind."""
        found = sorted(self.dag.nodes, key=self.seq)
        return [n for n in found if kind is None or self.op(n).kind is kind]

    def has(self, kind: OpKind) -> bool:
        return any(self.op(n).kind is kind for n in self.dag.nodes)

    def edges(self, kind: EdgeKind | None = None) -> list[tuple[str, str, dict]]:
        return [(u, v, d) for u, v, d in self.dag.edges(data=True) if kind is None or d["kind"] is kind]

    def loop_vars(self, name: str) -> tuple[str, ...]:
        """Tile indices of the loops around `name`, outer -> inner."""
        return tuple(self.op(loop).var for loop in self.op(name).loops)

    def children(self, loop: str | None) -> list[str]:
        """Ops and loops directly inside `loop` (None: the top level), in emission order."""
        order = self.order if self.order is not None else tuple(self.names())
        return [n for n in order if (self.op(n).loops[-1] if self.op(n).loops else None) == loop]

    @property
    def family(self) -> Family:
        return self.spec.family

    def __contains__(self, name: str) -> bool:
        return name in self.dag

    def __len__(self) -> int:
        return len(self.dag)


# ----------------------------------------------------------------------------------------------
# Building


def build_graph(spec: KernelSpec) -> ScheduleGraph:
    """The graph of `spec`'s schedule: FA1 (kv outer) or q outer (FA2, Hopper, decode)."""
    g = ScheduleGraph(spec)
    if spec.family is Family.FA1:
        _build_kv_outer(g)
    else:
        _build_q_outer(g)
    g.facts.add("graph")
    return g


def kv_groups(spec: KernelSpec) -> int:
    """Warps that split each kv tile's columns (FA1-style split-K); 1 when warps split rows."""
    s = spec.schedule
    if spec.family is Family.HOPPER or s.warp_axis is not Axis.KV:
        return 1
    return max(s.warps, 1)


def has_split_loop(spec: KernelSpec) -> bool:
    return spec.schedule.split_kv != 1 and spec.family is not Family.FA1


class _Builder:
    """Shared pieces of every family: the kv-tile loads and the per-tile math."""

    def __init__(self, g: ScheduleGraph):
        self.g = g
        self.spec = g.spec
        self.specialized = g.spec.family is Family.HOPPER
        self.via = g.spec.schedule.copy.value
        self.groups = kv_groups(g.spec)
        # Decode's warps each load, wait for and multiply only their own key slice of a tile
        # (warp-level cp.async pipelines); FA1's split-K warps share the block's loads. A paged decode
        # block of one warp loads through the warp path too: decode's template walks a block table only
        # per warp slice (the block-wide walk is fa2's).
        decode = g.spec.family is Family.DECODE
        paged = g.spec.problem.kv_page_size is not None
        self.kv_scope = "warp" if decode and (self.groups > 1 or paged) else "block"

    def role(self, producer: bool) -> Role:
        if not self.specialized:
            return Role.ALL
        return Role.PRODUCER if producer else Role.CONSUMER

    def loop(self, name: str, loops: tuple[str, ...], var: str, extent: str, key: str, text: str, **kw) -> tuple[str,
                                                                                                                 ...]:
        self.g.add(name, Op(OpKind.LOOP, loops=loops, var=var, extent=extent, key=key, text=text, **kw))
        return loops + (name,)

    def barrier(self, name: str, loops: tuple[str, ...], key: str, text: str) -> str:
        """A block-wide barrier that protects a buffer the previous trip still reads (no data moves)."""
        self.g.add(name, Op(OpKind.WAIT, loops=loops, key=key, barrier=name.removeprefix("wait_"), text=text))
        return name

    def load_q(self, loops: tuple[str, ...]) -> str:
        """Q tile -> shared memory; returns the node that makes it visible to the MMA."""
        g = self.g
        if self.specialized:
            g.add("wait_q_empty", Op(OpKind.WAIT, loops=loops, role=Role.PRODUCER, key="pipeline", barrier="q_empty",
                                     text="wait q_empty (the previous q tile's consumers are done with Q)"))
        g.add("load_q", Op(OpKind.LOAD_Q, Space.SHARED, ("Br", "d"), loops, self.role(True), "tile",
                           "Q_i = Q[i*Br : (i+1)*Br] -> shared", hbm=(Access("Q", "read", "q", "d"),), via=self.via))
        if not self.specialized:
            return "load_q"
        g.connect("wait_q_empty", "load_q", "q_empty", EdgeKind.SYNC)
        g.add("arrive_q_full", Op(OpKind.ARRIVE, loops=loops, role=Role.PRODUCER, key="pipeline",
                                  barrier="q_full", text="arrive q_full (TMA transaction bytes of Q_i)"))
        g.add("wait_q_full", Op(OpKind.WAIT, loops=loops, role=Role.CONSUMER, key="pipeline",
                                barrier="q_full", text="wait q_full"))
        g.connect("load_q", "arrive_q_full", "Q_i", EdgeKind.SYNC)
        g.connect("arrive_q_full", "wait_q_full", "q_full", EdgeKind.SYNC)
        return "wait_q_full"

    def page_lookup(self, loops: tuple[str, ...]) -> str | None:
        """Paged KV: the kv tile's page indices from the block table (None when K/V are contiguous).
        Both loads read them: the tile's keys live in pages_j[key / page], at slot key % page."""
        page = self.spec.problem.kv_page_size
        if page is None:
            return None
        s = self.spec.schedule
        ahead = self.kv_scope == "block" and self.spec.family is Family.FA2 and fa2_page_ring(page, s.tile_kv,
                                                                                              s.stages)[0]
        where = (f"   -> shared ring, copied with K_(j-{s.stages - 1})'s cp.async group" if ahead else "")
        self.g.add("page_lookup", Op(OpKind.PAGE_LOOKUP, Space.SHARED if ahead else Space.REGISTERS, ("pages",), loops,
                                     self.role(True), "kv_cache",
                                     f"pages_j = block_table[b, j*Bc/{page} : (j+1)*Bc/{page}]   ({page} keys a page; "
                                     "only the pages kv_len needs)" + where,
                                     hbm=(Access("block_table", "read", "pages", "1"),)))
        return "page_lookup"

    def load_kv(self, loops: tuple[str, ...]) -> None:
        """K and V tiles -> shared memory (with the producer's barriers when specialized), gathered
        through the block table when the KV cache is paged."""
        g = self.g
        pages = self.page_lookup(loops)
        slice_text = f"   (each warp its own Bc/{self.groups} keys)" if self.kv_scope == "warp" else ""
        transposed = self.specialized and self.spec.problem.fp8   # V lands, the transposers write V^T
        for t, kind, dim in (("k", OpKind.LOAD_K, "d"), ("v", OpKind.LOAD_V, "dv")):
            name = f"load_{t}"
            if self.specialized and t == "v" and transposed:
                g.add("wait_v_slot", Op(OpKind.WAIT, loops=loops, role=Role.PRODUCER, key="pipeline",
                                        barrier="vt_full", text="wait vt_full of the tile V's landing slot held "
                                                                "last (the transposers have copied it)"))
            elif self.specialized:
                g.add(f"wait_{t}_empty", Op(OpKind.WAIT, loops=loops, role=Role.PRODUCER, key="pipeline",
                                            barrier=f"{t}_empty", text=f"wait {t}_empty (slot free)"))
            rows = f"{t.upper()}_cache[pages_j[key / page], key % page]" if pages else f"{t.upper()}[j*Bc : (j+1)*Bc]"
            g.add(name, Op(kind, Space.SHARED, ("Bc", dim), loops, self.role(True), "pipeline",
                           f"{t.upper()}_j = {rows} -> shared{slice_text}",
                           hbm=(Access(t.upper(), "read", "kv", dim),), via=self.via, scope=self.kv_scope))
            if pages:
                g.connect(pages, name, "pages_j")
            if self.specialized:
                g.add(f"arrive_{t}_full", Op(OpKind.ARRIVE, loops=loops, role=Role.PRODUCER, key="pipeline",
                                             barrier=f"{t}_full", text=f"arrive {t}_full (TMA transaction bytes)"))
                free = "wait_v_slot" if t == "v" and transposed else f"wait_{t}_empty"
                g.connect(free, name, g.op(free).barrier, EdgeKind.SYNC)
                g.connect(name, f"arrive_{t}_full", f"{t.upper()}_j", EdgeKind.SYNC)
        if transposed:
            self.transpose_v(loops)

    def transpose_v(self, loops: tuple[str, ...]) -> None:
        """FP8: the producer warpgroup's warps 1.. copy each V tile, as it lands, into V^T's ring (FP8 wgmma reads
        P V's B operand K-major); the consumers' P V reads V^T."""
        g = self.g

        def op(kind, name, **kw):
            g.add(name, Op(kind, loops=loops, role=Role.TRANSPOSER, key="pipeline", **kw))
        op(OpKind.WAIT, "wait_v_landed", barrier="v_full", text="wait v_full (V_j has landed)")
        op(OpKind.WAIT, "wait_vt_empty", barrier="v_empty",
           text="wait v_empty (V^T's slot: the consumers' P V of the tile it held is done)")
        op(OpKind.TRANSPOSE_V, "transpose_v", space=Space.SHARED, shape=("dv", "Bc"),
           text="V^T_j = V_j^T -> shared (ldmatrix.trans, byte permutes, stmatrix; keys in P's fragment order)")
        op(OpKind.ARRIVE, "arrive_vt_full", barrier="vt_full",
           text="arrive vt_full (every transposing thread, its stores fenced for the async proxy)")
        g.connect("arrive_v_full", "wait_v_landed", "v_full", EdgeKind.SYNC)
        g.connect("load_v", "transpose_v", "V_j")
        g.connect("wait_v_landed", "transpose_v", "", EdgeKind.SYNC)
        g.connect("wait_vt_empty", "transpose_v", "", EdgeKind.SYNC)
        g.connect("transpose_v", "arrive_vt_full", "V^T_j", EdgeKind.SYNC)

    def wait_for(self, t: str, loops: tuple[str, ...]) -> str:
        """The consumer's wait until the K or V tile (t = "k" | "v") or both ("kv") has landed."""
        g = self.g
        name = f"wait_{t}"
        tiles = " and ".join(f"{x.upper()}_j" for x in t)
        whose = "the warp's slice of " if self.kv_scope == "warp" else ""
        g.add(name, Op(OpKind.WAIT, loops=loops, key="pipeline", barrier=f"{t}_ready", scope=self.kv_scope,
                       text=f"wait until {whose}{tiles} {'has' if len(t) == 1 else 'have'} landed in shared memory"))
        for x in t:
            g.connect(f"load_{x}", name, f"{x.upper()}_j", EdgeKind.SYNC)
        return name

    def mma_instruction(self, n: int) -> dict:
        """The tensor-core instruction of the two GEMMs, from the spec: warpgroup wgmma m64nNk16
        (n = the GEMM's whole width) or warp-level mma.sync m16n8k16 (k8 for tf32)."""
        s = self.spec.schedule
        if self.specialized or s.mma is Mma.WGMMA:
            return {"mma": Mma.WGMMA.value, "mma_shape": (64, n, 16)}
        return {"mma": Mma.SYNC.value, "mma_shape": (16, 8, 8 if self.spec.problem.dtype is DType.FP32 else 16)}

    def tile_math(self, loops, q_ready: str, waits: tuple[str, str] | None = None,
                  state: str | None = None) -> dict[str, str]:
        """One (q tile, kv tile) step: S = QK^T, mask, online softmax, PV, rescale O. The running
        m, l, O are held per warp when warps split the keys (`groups` > 1; merged by combine_warps).
        `waits`: the nodes that make K_j and V_j visible, when the caller made them (else made here).
        `state`: FA1 only, the op that brings O, m, l in from HBM; it is made here, after the mask.
        Returns the node that last produced each of O, m, l. Hopper's consumer: schedule/hopper.py."""
        if self.specialized:
            return consumer_tile_math(self, loops, q_ready)
        g, spec, role = self.g, self.spec, self.role(False)
        kv_loop = next(l for l in loops if g.op(l).var == "kv")
        p = spec.problem
        wait_k = waits[0] if waits else self.wait_for("k", loops)
        where = f"   (per warp: its own Bc/{self.groups} keys)" if self.groups > 1 else ""
        g.add("mma_qk", Op(OpKind.MMA_QK, Space.REGISTERS, ("Br", "Bc"), loops, role, "tile",
                           "S = scale * Q_i K_j^T" + where, **self.mma_instruction(spec.schedule.tile_kv)))
        g.connect(q_ready, "mma_qk", "Q_i")
        g.connect("load_k", "mma_qk", "K_j")
        g.connect(wait_k, "mma_qk", "", EdgeKind.SYNC)
        scores = add_score_mod(g, "score_mod", loops, role, "tile", "mma_qk")
        g.add("mask", Op(OpKind.MASK, Space.REGISTERS, ("Br", "Bc"), loops, role, mask_key(g),
                         mask_text(p, query_index(spec)), variant=p.mask.value))
        g.connect(scores, "mask", "S")
        if state is not None:
            state_text = "O_i, m_i, l_i <- HBM; O_i *= l_i   (a q tile's first kv tile starts empty)"
            if self.groups > 1:
                state_text += "; warp 0 carries it, the other warps start empty"
            g.add(state, Op(OpKind.LOAD_O_STATE, Space.REGISTERS, ("Br", "dv"), loops, role, "order", state_text,
                            hbm=(Access("O_state", "read", "q", "dv"), Access("m", "read", "q", "1"),
                                 Access("l", "read", "q", "1"))))
        g.add("online_softmax", Op(OpKind.ONLINE_SOFTMAX, Space.REGISTERS, ("Br", "Bc"), loops, role, "order",
                                   "m_new = max(m, rowmax S); alpha = exp(m - m_new); P = exp(S - m_new); "
                                   "l = alpha*l + rowsum P; m = m_new" + where, variant="running"))
        g.connect("mask", "online_softmax", "S")
        if state is not None:
            g.connect(state, "online_softmax", "m, l")
        wait_v = waits[1] if waits else self.wait_for("v", loops)
        g.add("mma_pv", Op(OpKind.MMA_PV, Space.REGISTERS, ("Br", "dv"), loops, role, "tile", "PV = P V_j" + where,
                           **self.mma_instruction(p.head_dim_v)))
        g.connect(add_dropout(g, "dropout", loops, role, "online_softmax"), "mma_pv", "P")
        g.connect("load_v", "mma_pv", "V_j")
        g.connect(wait_v, "mma_pv", "", EdgeKind.SYNC)
        g.add("rescale_o", Op(OpKind.RESCALE_O, Space.REGISTERS, ("Br", "dv"), loops, role, "order",
                              "O = alpha*O + PV" + where, variant="unnormalized"))
        g.connect("mma_pv", "rescale_o", "PV")
        g.connect("online_softmax", "rescale_o", "alpha")
        if state is not None:
            g.connect(state, "rescale_o", "O")
            return {"O": "rescale_o", "m": "online_softmax", "l": "online_softmax"}
        g.carry(kv_loop, "online_softmax", "online_softmax", "m, l")
        g.carry(kv_loop, "rescale_o", "rescale_o", "O")
        return {"O": "rescale_o", "m": "online_softmax", "l": "online_softmax"}

    def combine(self, loops: tuple[str, ...], produced: dict[str, str]) -> dict[str, str]:
        """Split-K warps: merge the warps' (m, l, O) through shared memory (when they split keys)."""
        if self.groups == 1:
            return produced
        g = self.g
        g.add("combine_warps", Op(OpKind.COMBINE_WARPS, Space.SHARED, ("Br", "dv"), loops, self.role(False), "warps",
                                  f"merge the {self.groups} warps' (m, l, O) through shared memory: m = max m_w, "
                                  "l = sum exp(m_w - m) l_w, O = sum exp(m_w - m) O_w"))
        for src in sorted(set(produced.values()), key=g.seq):
            g.connect(src, "combine_warps", ", ".join(v for v in ("O", "m", "l") if produced[v] == src) + " per warp")
        return {"O": "combine_warps", "m": "combine_warps", "l": "combine_warps"}

    def epilogue(self, loops: tuple[str, ...], produced: dict[str, str], split: bool) -> None:
        """O / l and lse = m + log l, then the stores (partials when the kv axis is split)."""
        g, role = self.g, self.role(False)
        g.add("normalize_o", Op(OpKind.NORMALIZE_O, Space.REGISTERS, ("Br", "dv"), loops, role, "order",
                                "O = O / l; lse = m + log l   (O = 0, lse = -inf where l = 0)"))
        for value in ("O", "m", "l"):
            if not g.dag.has_edge(produced[value], "normalize_o"):
                g.connect(produced[value], "normalize_o", value)
            else:
                g.dag.edges[produced[value], "normalize_o"]["value"] += f", {value}"
        o, lse, where = ("O_part", "lse_part", "[s, i*Br : (i+1)*Br]") if split else ("O", "lse", "[i*Br : (i+1)*Br]")
        suffix = "_part" if split else ""
        g.add(f"store_o{suffix}", Op(OpKind.STORE_O, Space.HBM, ("Br", "dv"), loops, role, "tile",
                                     f"{o}{where} = O", hbm=(Access(o, "write", "q", "dv"),)))
        g.add(f"store_lse{suffix}", Op(OpKind.STORE_LSE, Space.HBM, ("Br",), loops, role, "order",
                                       f"{lse}{where} = lse", hbm=(Access(lse, "write", "q", "1"),)))
        g.connect("normalize_o", f"store_o{suffix}", "O")
        g.connect("normalize_o", f"store_lse{suffix}", "lse")


def _build_q_outer(g: ScheduleGraph) -> None:
    """FA2 order (also Hopper and decode): one block per q tile (and split), kv tiles streamed.
    Split-K warps (decode) keep their own running state over their key slices of every tile and
    are merged once, after the kv loop. With split kv, the last split's block of each q tile to
    finish merges the splits' partials (an atomic ticket), in the same launch."""
    b = _Builder(g)
    split = has_split_loop(g.spec)
    loops = b.loop("loop_q", (), "q", "ceil(Nq/Br)", "order", "for i in q tiles (one block each)",
                   grid=True, kernel="attention")
    q_loops = loops
    if split:
        splits = "auto" if g.spec.schedule.split_kv == AUTO else str(g.spec.schedule.split_kv)
        loops = b.loop("loop_split", loops, "split", "splits", "split",
                       f"for s in splits ({splits}; one block each; balanced ranges of kv tiles)", grid=True)
    q_ready = b.load_q(loops)
    init = (SINK_INIT if g.spec.problem.mods.sinks else (("m", "-inf"), ("l", "0"))) + (("O", "0"),)
    kv_loops = b.loop("loop_kv", loops, "kv", "ceil(Nk/Bc)" + (" / splits" if split else ""), "order",
                      "for j in kv tiles" + (" of split s" if split else "")
                      + " (serial; tiles no query sees are skipped" + kv_loop_text(g.spec.problem.mods) + ")",
                      init=init, init_space=Space.REGISTERS)
    b.load_kv(kv_loops)
    produced = b.tile_math(kv_loops, q_ready)
    if b.specialized:   # Q is free once every consumer's last Q K^T has read it
        g.add("arrive_q_empty", Op(OpKind.ARRIVE, loops=loops, role=Role.CONSUMER, key="pipeline", barrier="q_empty",
                                   text="arrive q_empty (Q read; after O's staging when O reuses Q's space)"))
        g.connect("wait_s", "arrive_q_empty", "Q_i read", EdgeKind.SYNC)
        g.carry("loop_q", "arrive_q_empty", "wait_q_empty", "q_empty", EdgeKind.SYNC)
    produced = b.combine(loops, produced)
    b.epilogue(loops, produced, split)
    if not split:
        return
    g.add("merge_splits", Op(OpKind.MERGE_SPLITS, Space.REGISTERS, ("Br", "dv"), q_loops, Role.ALL, "split",
                             "the last split's block to finish (atomic ticket): lse = log sum_s exp(lse_s); "
                             "O = sum_s exp(lse_s - lse) * O_s   (-inf partials weigh 0)",
                             hbm=(Access("O_part", "read", "q", "dv", "splits"),
                                  Access("lse_part", "read", "q", "1", "splits"))))
    g.connect("store_o_part", "merge_splits", "O_part")
    g.connect("store_lse_part", "merge_splits", "lse_part")
    g.add("store_o", Op(OpKind.STORE_O, Space.HBM, ("Br", "dv"), q_loops, Role.ALL, "tile",
                        "O[i*Br : (i+1)*Br] = O", hbm=(Access("O", "write", "q", "dv"),)))
    g.add("store_lse", Op(OpKind.STORE_LSE, Space.HBM, ("Br",), q_loops, Role.ALL, "order",
                          "lse[i*Br : (i+1)*Br] = lse", hbm=(Access("lse", "write", "q", "1"),)))
    g.connect("merge_splits", "store_o", "O")
    g.connect("merge_splits", "store_lse", "lse")


def _build_kv_outer(g: ScheduleGraph) -> None:
    """FA1 order: kv tiles outer, q tiles inner. The running O (kept normalised in HBM), m and l
    make a round trip at every kv step; the kernel returns O, m, l (lse = m + log l). K_j and V_j
    are one cp.async group, waited for once. The q tile's rows go in passes (split-K warps hold a
    partial O of every row of a pass, so a pass holds as many rows as fit their registers)."""
    b = _Builder(g)
    kv_loops = b.loop("loop_kv", (), "kv", "ceil(Nk/Bc)", "order", "for j in kv tiles (serial, one block per head)",
                      kernel="attention", init=(("O_state", "0"),) + (SINK_INIT if g.spec.problem.mods.sinks
                                                                       else (("m", "-inf"), ("l", "0"))),
                      init_space=Space.HBM)
    b.load_kv(kv_loops)
    wait_kv = b.wait_for("kv", kv_loops)
    loops = b.loop("loop_q", kv_loops, "q", "ceil(Nq/Br)", "order",
                   "for i in q tiles (serial; tiles that see no key of K_j are skipped)")
    free = b.barrier("wait_q_free", loops, "order", "every warp is done with the previous q tile's Q and O staging")
    q_ready = b.load_q(loops)
    g.connect(free, "load_q", "", EdgeKind.SYNC)
    pass_loops = b.loop("loop_rows", loops, "rows", "ceil(Br/rows per pass)", "warps",
                        "for each pass over the q tile's rows" + (" (split-K: all warps on the same rows)"
                                                                 if b.groups > 1
                                                                 else " (split-Q: one pass, each warp its own rows)"))
    scratch = b.barrier("wait_scratch_free", pass_loops, "warps",
                        "the previous pass's combine scratch has been stored") if b.groups > 1 else None
    produced = b.tile_math(pass_loops, q_ready, waits=(wait_kv, wait_kv), state="load_o_state")
    produced = b.combine(pass_loops, produced)
    if scratch:
        g.connect(scratch, "combine_warps", "", EdgeKind.SYNC)
    g.add("store_o_state", Op(OpKind.STORE_O_STATE, Space.HBM, ("Br", "dv"), pass_loops, b.role(False), "order",
                              "HBM <- O_i, m_i, l_i   (O_i / l_i, kept normalised; on the q tile's last kv tile "
                              "O / l and lse = m + log l go straight to the output)", variant="normalized",
                              hbm=(Access("O_state", "write", "q", "dv"), Access("m", "write", "q", "1"),
                                   Access("l", "write", "q", "1"))))
    for value in ("O", "m", "l"):
        if not g.dag.has_edge(produced[value], "store_o_state"):
            g.connect(produced[value], "store_o_state", value)
    g.carry("loop_q", "store_o_state", "wait_q_free", "Q and O staging free", EdgeKind.SYNC)
    if scratch:
        g.carry("loop_rows", "store_o_state", scratch, "combine scratch free", EdgeKind.SYNC)
