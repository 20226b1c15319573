"""Passes over the scheduler graph, and the tiny manager that runs them.

Each pass states the facts it `requires` and the facts it `ensures` (CUTLASS EVT style). The
manager orders passes by those facts, runs each, then checks its promise with the pass's own
`verify` before recording the facts: a pass that breaks its promise is a compiler bug
(PassError); a schedule that cannot be built is the user's (SpecError, at the DSL line).

    shapes   ShapeInference   concrete Br, Bc, d, dv, element sizes on every op
    stages   Pipelining       ring depth and slot of every K/V load, barrier and reader
    roles    WarpRoles        warps, threads and register budget of each role
    legal    Legality         the kernel's Layout (layout/): sizes, MMA shapes, resources vs the GPU
    order    EmissionOrder    a deterministic topological order, loop bodies contiguous
    barriers Barriers         warp-specialized kernels: each barrier's arrivals, TMA transaction bytes, who
                              arrives and who waits (the full barriers' bytes from the layout)
"""
from __future__ import annotations

import math

import networkx as nx

from ..device_limits import H200, DeviceLimits
from .ops import Barrier, EdgeKind, OpKind, Role, Space
from .graph import ScheduleGraph, build_graph, kv_groups
from ..layout.base import Layout, cp_async_pending
from ..layout.hopper import FP8_TRANSPOSERS
from ..families import layout_of
from ..spec import AUTO, DTYPE_BYTES, Family, KernelSpec


class PassError(RuntimeError):
    """A pass broke its promise or a requirement has no provider: a bug in tiledsl."""


class Pass:
    name = "pass"
    requires: frozenset[str] = frozenset()
    ensures: frozenset[str] = frozenset()

    def run(self, graph: ScheduleGraph, limits: DeviceLimits) -> None:
        raise NotImplementedError

    def verify(self, graph: ScheduleGraph) -> None:
        """Raise PassError unless `ensures` now holds."""


def _promise(ok: bool, pass_: Pass, what: str) -> None:
    if not ok:
        raise PassError(f"{pass_.name}: broke its promise: {what}")


class ShapeInference(Pass):
    name = "shape_inference"
    requires = frozenset({"graph"})
    ensures = frozenset({"shapes"})

    def run(self, graph, limits):
        spec = graph.spec
        p, s = spec.problem, spec.schedule
        graph.sizes.update({"Br": s.tile_q, "Bc": s.tile_kv, "d": p.head_dim_qk, "dv": p.head_dim_v,
                            "warps": s.warps, "kv_groups": kv_groups(spec), "stages": s.stages,
                            "splits": None if s.split_kv == AUTO else int(s.split_kv),
                            "elem_bytes": DTYPE_BYTES[p.dtype]})
        if p.kv_page_size is not None:   # a kv tile starts on a page boundary: whole pages, or inside one
            graph.sizes.update(page=p.kv_page_size, pages=max(1, s.tile_kv // p.kv_page_size))
        for name in graph.names():
            op = graph.op(name)
            if op.kind is OpKind.LOOP or not op.shape:
                continue
            sizes = tuple(graph.sizes[sym] for sym in op.shape)
            # Tiles in shared memory and HBM hold the input dtype; registers hold fp32 accumulators.
            elem = 4 if op.space is Space.REGISTERS or op.kind is OpKind.COMBINE_WARPS else graph.sizes["elem_bytes"]
            graph.update(name, sizes=sizes, bytes=math.prod(sizes) * elem)

    def verify(self, graph):
        for name in graph.names():
            op = graph.op(name)
            _promise(not op.shape or len(op.sizes) == len(op.shape) and op.bytes > 0, self, f"{name} has no sizes")


class Pipelining(Pass):
    """K/V tiles go through a ring of `stages` shared buffers: trip j uses slot j % stages, and the
    load for trip j + stages - 1 is in flight while trip j computes."""
    name = "pipelining"
    requires = frozenset({"shapes"})
    ensures = frozenset({"stages"})

    def run(self, graph, limits):
        depth = graph.sizes["stages"]
        ring = f"j % {depth}"
        for name in graph.names():
            op = graph.op(name)
            tensors, _, state = op.barrier.partition("_")
            uses_kv = op.kind in (OpKind.LOAD_K, OpKind.LOAD_V, OpKind.MMA_QK, OpKind.MMA_PV, OpKind.TRANSPOSE_V) or \
                tensors in ("k", "v", "kv", "vt")
            if uses_kv:
                graph.update(name, stages=depth, buffer=ring)
            elif op.kind is OpKind.LOAD_Q or tensors == "q":
                graph.update(name, stages=1, buffer="0")
            if op.kind is OpKind.WAIT and state == "ready":   # cp.async tiles (TMA's full/empty are mbarriers)
                # the number of groups the lowering's wait leaves in flight (layout.cp_async_pending)
                pending = cp_async_pending(graph.family, depth, op.barrier.split("_")[0])
                sync = "__syncwarp" if op.scope == "warp" else "__syncthreads"
                graph.update(name, text=f"{op.text} (cp.async.wait_group {pending}; {sync})")
            elif op.kind is OpKind.WAIT and state == "free":   # a buffer the previous trip read
                graph.update(name, text=f"{op.text} (__syncthreads)")

    def verify(self, graph):
        for name in graph.names(OpKind.LOAD_K) + graph.names(OpKind.LOAD_V):
            op = graph.op(name)
            _promise(op.stages >= 1 and bool(op.buffer), self, f"{name} has no ring slot")


class WarpRoles(Pass):
    """Who runs what: every warp (FA1/FA2/decode) or producer and consumer warpgroups (Hopper)."""
    name = "warp_roles"
    requires = frozenset({"shapes"})   # it adds threads to the sizes shape inference sets up
    ensures = frozenset({"roles"})

    def run(self, graph, limits):
        s = graph.spec.schedule
        if graph.family is Family.HOPPER:
            graph.roles = {
                "producer": {"warpgroups": s.producer_warpgroups, "threads": 128 * s.producer_warpgroups,
                             "registers": s.producer_regs or None},
                "consumer": {"warpgroups": s.consumer_warpgroups, "threads": 128 * s.consumer_warpgroups,
                             "registers": s.consumer_regs or None},
            }
            if graph.spec.problem.fp8:   # warps of the producer warpgroup (no warpgroup of their own)
                graph.roles["transposer"] = {"warpgroups": 0, "threads": 32 * FP8_TRANSPOSERS,
                                             "registers": s.producer_regs or None}
        else:
            graph.roles = {"all": {"warps": s.warps, "threads": 32 * s.warps, "axis": s.warp_axis.value,
                                   "registers": None}}
        graph.sizes["threads"] = sum(r["threads"] for r in graph.roles.values() if r.get("warpgroups", 1))
        graph.sizes["mma_threads"] = graph.roles["consumer" if "consumer" in graph.roles else "all"]["threads"]

    def verify(self, graph):
        specialized = graph.family is Family.HOPPER
        for name in graph.names():
            op = graph.op(name)
            if op.kind is OpKind.LOOP:
                continue
            if not specialized:
                _promise(op.role is Role.ALL, self, f"{name} has role {op.role.value} without warp specialization")
            elif op.kind in (OpKind.LOAD_Q, OpKind.LOAD_K, OpKind.LOAD_V):
                _promise(op.role is Role.PRODUCER, self, f"{name} must be a producer op")
            elif op.kind in (OpKind.MMA_QK, OpKind.MMA_PV, OpKind.ONLINE_SOFTMAX, OpKind.RESCALE_O):
                _promise(op.role is Role.CONSUMER, self, f"{name} must be a consumer op")
            elif op.kind is OpKind.TRANSPOSE_V:
                _promise(op.role is Role.TRANSPOSER, self, f"{name} must be a transposer op")
        for u, v, _ in graph.edges(EdgeKind.SYNC):
            a, b = graph.op(u), graph.op(v)
            if a.kind is OpKind.ARRIVE and b.kind is OpKind.WAIT:
                _promise(a.barrier == b.barrier, self, f"{u} -> {v} joins different barriers")


class Legality(Pass):
    """Every size and resource rule lives in layout/ (the lowerings and the checker read the same
    Layout, through families.layout_of); this pass attaches the kernel's layout to the graph -- the
    one handed to run_passes (families.lower computes it once), else the spec's."""
    name = "legality"
    requires = frozenset({"shapes", "stages", "roles"})
    ensures = frozenset({"legal"})

    def run(self, graph, limits):
        if graph.layout is None:
            graph.layout = layout_of(graph.spec, limits)

    def verify(self, graph):
        b = graph.layout
        _promise(b is not None and b.smem_bytes <= b.smem_limit and b.accumulator_registers <= b.register_limit,
                 self, "layout over the limits")


class EmissionOrder(Pass):
    """Topological order, ties broken by insertion order (lexicographical_topological_sort), so the
    same spec always emits the same sequence. Sorted one loop body at a time, with each nested
    loop standing for its whole body, so every loop body comes out contiguous."""
    name = "emission_order"
    requires = frozenset({"graph"})
    ensures = frozenset({"order"})

    def run(self, graph, limits):
        graph.order = tuple(_scope_order(graph, None))

    def verify(self, graph):
        order = graph.order or ()
        pos = {n: i for i, n in enumerate(order)}
        _promise(len(pos) == len(graph) == len(order), self, "order is not a permutation of the nodes")
        for u, v, _ in graph.edges():
            _promise(pos[u] < pos[v], self, f"{u} -> {v} emitted out of order")
        for loop in graph.names(OpKind.LOOP):
            inside = [pos[n] for n in graph.names() if loop in graph.op(n).loops]
            contiguous = not inside or (min(inside) > pos[loop] and max(inside) - pos[loop] == len(inside))
            _promise(contiguous, self, f"{loop} body not contiguous")


class Barriers(Pass):
    """The barriers of a warp-specialized kernel, read off its arrive and wait ops: a TMA full barrier
    completes on the producer's one arrive.expect_tx plus the bytes of the tile its copies load (the
    layout's), an empty barrier on one arrival per consumer warp, a ping-pong turn (a named barrier
    per consumer) when the waiting consumer's and the passing consumer's threads have arrived."""
    name = "barriers"
    requires = frozenset({"roles", "legal"})
    ensures = frozenset({"barriers"})
    TILE = {"q": "Q", "k": "K", "v": "V"}

    def run(self, graph, limits):
        ops = [n for n in graph.names() if graph.op(n).kind in (OpKind.ARRIVE, OpKind.WAIT)
               and graph.op(n).role is not Role.ALL]
        if not ops:
            return
        consumer = graph.roles["consumer"]
        warpgroup_threads = consumer["threads"] // consumer["warpgroups"]
        lay = graph.layout
        for name in sorted({graph.op(n).barrier for n in ops},
                           key=lambda b: min(graph.seq(n) for n in ops if graph.op(n).barrier == b)):
            arrive = tuple(n for n in ops if graph.op(n).barrier == name and graph.op(n).kind is OpKind.ARRIVE)
            wait = tuple(n for n in ops if graph.op(n).barrier == name and graph.op(n).kind is OpKind.WAIT)
            tensor, _, state = name.partition("_")
            tx, stages = 0, 1 if tensor == "q" else graph.sizes["stages"]
            if name == "turn":
                kind, count, stages = "named", 2 * warpgroup_threads, consumer["warpgroups"]
            elif all(graph.op(n).role is Role.TRANSPOSER for n in arrive):   # FP8's V^T: every transposing thread
                kind, count = "mbarrier", graph.roles["transposer"]["threads"]
            elif state == "full":
                buffer = lay.buffer(self.TILE[tensor])
                kind, count, tx = "mbarrier", 1, buffer.bytes if tensor == "q" else buffer.stage_bytes
                if tensor == "v" and buffer.stages != stages:   # FP8: V lands in a shallower ring than V^T's
                    for n in (*arrive, *wait, "load_v"):
                        graph.update(n, stages=buffer.stages, buffer=f"j % {buffer.stages}")
                    # the producer waits for the transpose of the tile that landed in the slot last
                    graph.update("wait_v_slot", buffer=f"(j - {buffer.stages}) % {stages}")
                    stages = buffer.stages
                for n in arrive:
                    graph.update(n, tx_bytes=tx)
            else:
                kind, count = "mbarrier", consumer["threads"] // 32
            roles = [{graph.op(n).role.value for n in side} for side in (arrive, wait)]
            graph.barriers[name] = Barrier(name, kind, count, tx, stages, arrive, wait,
                                           *("/".join(sorted(r)) for r in roles))

    def verify(self, graph):
        for b in graph.barriers.values():
            _promise(bool(b.arrive) and bool(b.wait), self, f"barrier {b.name} lacks an arrive or a wait")
            _promise(b.tx_bytes > 0 or not b.name.endswith("_full") or b.arrive_role == Role.TRANSPOSER.value, self,
                     f"{b.name} completes no bytes")


def _scope_order(graph: ScheduleGraph, loop: str | None) -> list[str]:
    depth = 0 if loop is None else len(graph.op(loop).loops) + 1

    def representative(n: str) -> str | None:
        chain = graph.op(n).loops + (n,)
        if loop is not None and (len(chain) <= depth or chain[depth - 1] != loop):
            return None   # not inside this scope
        return chain[depth]

    members = {n: representative(n) for n in graph.names()}
    condensed = nx.DiGraph()
    condensed.add_nodes_from({r for r in members.values() if r is not None})
    for u, v in graph.dag.edges:
        ru, rv = members[u], members[v]
        if ru is not None and rv is not None and ru != rv:
            condensed.add_edge(ru, rv)
    order: list[str] = []
    for n in nx.lexicographical_topological_sort(condensed, key=graph.seq):
        order.append(n)
        if graph.op(n).kind is OpKind.LOOP:
            order += _scope_order(graph, n)
    return order


DEFAULT_PASSES = (ShapeInference, Pipelining, WarpRoles, Legality, EmissionOrder, Barriers)


class PassManager:
    def __init__(self, passes):
        self.passes = [p() if isinstance(p, type) else p for p in passes]

    def schedule(self, have: set[str]) -> list[Pass]:
        """The passes in dependency order (ties: the order given)."""
        deps = nx.DiGraph()
        index = {p.name: i for i, p in enumerate(self.passes)}
        deps.add_nodes_from(index)
        for p in self.passes:
            for need in p.requires - have:
                providers = [q for q in self.passes if need in q.ensures]
                if not providers:
                    raise PassError(f"{p.name} requires {need!r}, which no pass ensures")
                deps.add_edges_from((q.name, p.name) for q in providers)
        if not nx.is_directed_acyclic_graph(deps):
            raise PassError("pass requirements form a cycle")
        by_name = {p.name: p for p in self.passes}
        return [by_name[n] for n in nx.lexicographical_topological_sort(deps, key=index.get)]

    def run(self, graph: ScheduleGraph, limits: DeviceLimits = H200) -> ScheduleGraph:
        for p in self.schedule(set(graph.facts)):
            missing = p.requires - graph.facts
            if missing:
                raise PassError(f"{p.name} runs without {sorted(missing)}")
            p.run(graph, limits)
            p.verify(graph)
            graph.facts |= p.ensures
        return graph


def run_passes(spec: KernelSpec, limits: DeviceLimits = H200, check_legality: bool = True,
               layout: Layout | None = None) -> ScheduleGraph:
    """Build `spec`'s graph and run every pass; `layout` is the kernel's layout when the caller has it
    (families.lower), so the legality pass attaches it instead of computing it again. Legality can be
    left out (the float64 reference executes any tiling, legal on a GPU or not)."""
    passes = [p for p in DEFAULT_PASSES if check_legality or "legal" not in p.requires | p.ensures]
    graph = build_graph(spec)
    graph.layout = layout
    return PassManager(passes).run(graph, limits)


def emission_order(graph: ScheduleGraph) -> list[str]:
    """Node names in emission order (computed when the pass has not run)."""
    if graph.order is None:
        return _scope_order(graph, None)
    return list(graph.order)
