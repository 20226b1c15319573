"""Passes over the scheduler graph, and the tiny manager that runs them.

Each pass states the facts it `requires` and the facts it `ensures` (CUTLASS EVT style). The
manager orders passes by those facts, runs each, then checks its promise with the pass's own
`verify` before recording the facts: a pass that breaks its promise is a compiler bug
(PassError); a schedule that cannot be built is the user's (SpecError, at the DSL line).

    shapes   ShapeInference   concrete Br, Bc, d, dv, element sizes on every op
    stages   Pipelining       ring depth and slot of every K/V load, barrier and reader
    roles    WarpRoles        warps, threads and register budget of each role
    legal    Legality         MMA divisibility, shared memory and register estimates vs the GPU
    order    EmissionOrder    a deterministic topological order, loop bodies contiguous
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from .device_limits import H200, DeviceLimits
from .errors import SpecError
from .graph import EdgeKind, OpKind, Role, ScheduleGraph, Space, build_graph, kv_groups
from .spec import AUTO, Axis, DTYPE_BYTES, DType, Family, KernelSpec, LoopOrder


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
            uses_kv = op.kind in (OpKind.LOAD_K, OpKind.LOAD_V, OpKind.MMA_QK, OpKind.MMA_PV) or tensors in ("k", "v", "kv")
            if uses_kv:
                graph.update(name, stages=depth, buffer=ring)
            elif op.kind is OpKind.LOAD_Q or tensors == "q":
                graph.update(name, stages=1, buffer="0")
            if op.kind is OpKind.WAIT and state == "ready":   # cp.async tiles (TMA's full/empty are mbarriers)
                sync = "__syncwarp" if op.scope == "warp" else "__syncthreads"
                graph.update(name, text=f"{op.text} (cp.async.wait_group; {sync})")
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
        else:
            graph.roles = {"all": {"warps": s.warps, "threads": 32 * s.warps, "axis": s.warp_axis.value,
                                   "registers": None}}
        graph.sizes["threads"] = sum(r["threads"] for r in graph.roles.values())
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
        for u, v, _ in graph.edges(EdgeKind.SYNC):
            a, b = graph.op(u), graph.op(v)
            if a.kind is OpKind.ARRIVE and b.kind is OpKind.WAIT:
                _promise(a.barrier == b.barrier, self, f"{u} -> {v} joins different barriers")


@dataclass(frozen=True)
class Item:
    """One line of a budget: a shared buffer in bytes, or a register group per thread."""
    name: str
    amount: int
    formula: str


@dataclass(frozen=True)
class Budget:
    arch: str
    shared: tuple[Item, ...]
    shared_total: int
    shared_limit: int
    registers: tuple[Item, ...]
    register_total: int
    register_limit: int
    threads: int


def shared_items(graph: ScheduleGraph) -> list[Item]:
    """Shared memory per buffer: Q, the K and V rings, split-K warp partials, mbarriers."""
    z = graph.sizes
    e, S, G = z["elem_bytes"], z["stages"], z["kv_groups"]
    items = [Item("Q", z["Br"] * z["d"] * e, f"Br*d*{e} = {z['Br']}*{z['d']}*{e}"),
             Item("K", S * z["Bc"] * z["d"] * e, f"{S}x Bc*d*{e} = {S}x {z['Bc']}*{z['d']}*{e}"),
             Item("V", S * z["Bc"] * z["dv"] * e, f"{S}x Bc*dv*{e} = {S}x {z['Bc']}*{z['dv']}*{e}")]
    if graph.has(OpKind.COMBINE_WARPS):
        items.append(Item("warp partials", G * z["Br"] * (z["dv"] + 2) * 4,
                          f"{G} warps x Br*(dv+2)*4 = {G}x {z['Br']}*{z['dv'] + 2}*4 (fp32 O, m, l)"))
    if graph.family is Family.HOPPER:
        count = 4 * S + 1   # full and empty per K and V slot, plus Q's
        items.append(Item("mbarriers", 8 * count, f"{count} x 8"))
    return items


# Pointers, loop counters, the softmax scale and mask bounds: a rough allowance, not a count.
ADDRESS_REGISTERS = 16


def register_items(graph: ScheduleGraph) -> list[Item]:
    """Per-thread 32-bit registers of the math warps' accumulators (an estimate; ptxas decides)."""
    z, s = graph.sizes, graph.spec.schedule
    T, G = z["mma_threads"], z["kv_groups"]
    Br, Bc, dv = z["Br"], z["Bc"], z["dv"]
    if graph.family is Family.HOPPER:
        rows_per_warp = Br / max(4 * s.consumer_warpgroups, 1)
    else:
        rows_per_warp = Br if s.warp_axis is Axis.KV else Br / max(s.warps, 1)
    # split-K: every warp keeps a whole Br x dv partial; split-Q: the threads share it.
    o_threads = 32 if G > 1 else T
    stats = 2 * 2 * math.ceil(rows_per_warp / 16)   # m and l; an mma thread holds 2 rows per 16
    # P is not counted apart: it is converted from S in place (S dies as P is formed), which is
    # how FA2's 128 x 128 x d64 / 4-warp config fits 255 registers.
    return [Item("O accumulator", math.ceil(Br * dv / o_threads), f"Br*dv/{o_threads} = {Br}*{dv}/{o_threads}"),
            Item("S/P accumulator", math.ceil(Br * Bc / T), f"Br*Bc/{T} = {Br}*{Bc}/{T}"),
            Item("m, l", stats, f"2 x 2 rows x ceil({rows_per_warp:g}/16)"),
            Item("addresses, indices", ADDRESS_REGISTERS, "allowance")]


class Legality(Pass):
    name = "legality"
    requires = frozenset({"shapes", "stages", "roles"})
    ensures = frozenset({"legal"})

    def run(self, graph, limits):
        spec = graph.spec
        self._structure(spec)
        self._divisibility(graph)
        shared, regs = shared_items(graph), register_items(graph)
        threads = graph.sizes["threads"]
        if graph.family is Family.HOPPER:
            reg_limit = spec.schedule.consumer_regs or limits.max_registers_per_thread
        else:
            reg_limit = min(limits.max_registers_per_thread, limits.registers_per_sm // max(threads, 1))
        graph.budget = Budget(limits.arch, tuple(shared), sum(i.amount for i in shared), limits.max_shared_per_block,
                              tuple(regs), sum(i.amount for i in regs), reg_limit, threads)
        self._threads(graph, limits)
        self._shared(graph, limits)
        self._registers(graph, limits)

    def verify(self, graph):
        b = graph.budget
        _promise(b is not None and b.shared_total <= b.shared_limit and b.register_total <= b.register_limit,
                 self, "budget over the limits")

    @staticmethod
    def _refuse(spec: KernelSpec, key: str, message: str, hint: str = ""):
        raise SpecError(message, spec.span_of(key), spec.source_text, hint)

    def _structure(self, spec):
        if spec.family is Family.FA1 and spec.schedule.split_kv != 1:
            self._refuse(spec, "split", "split kv needs the q-outer order (FA1 already walks kv tiles outermost)",
                         "use `order q, kv` or drop `split`")
        if spec.family is Family.HOPPER and spec.schedule.order is LoopOrder.KV_OUTER:
            self._refuse(spec, "order", "warp-specialized kernels are built for the q-outer order",
                         "use `order q, kv` with warpgroups")

    def _divisibility(self, graph):
        """mma.sync m16n8k16 (k8 for tf32): rows per warp, kv columns and head dims in whole MMAs;
        Hopper's wgmma takes 64 rows per consumer warpgroup."""
        spec, z, s = graph.spec, graph.sizes, graph.spec.schedule
        k = 8 if spec.problem.dtype is DType.FP32 else 16
        if z["d"] % k or z["dv"] % 8:
            self._refuse(spec, "head_dim", f"head dim qk {z['d']} / v {z['dv']} is not a whole number of MMA "
                         f"steps (qk must divide by {k}, v by 8)", f"use a head dim that is a multiple of {k}")
        if graph.family is Family.HOPPER:
            rows = 64 * max(s.consumer_warpgroups, 1)
            if z["Br"] % rows:
                self._refuse(spec, "tile", f"tile q = {z['Br']} is not a multiple of {rows} "
                             f"(64 rows per consumer warpgroup for wgmma)", f"use tile q = {rows} or a multiple")
            cols, key = z["Bc"], "tile"
        elif s.warp_axis is Axis.Q:
            if z["Br"] % s.warps or (z["Br"] // s.warps) % 16:
                self._refuse(spec, "warps", f"{s.warps} warps along q give {z['Br'] / s.warps:g} rows each; "
                             "mma.sync needs a multiple of 16", f"use tile q = {16 * s.warps} or a multiple")
            cols, key = z["Bc"], "tile"
        else:
            if z["Br"] % 16:
                self._refuse(spec, "tile", f"tile q = {z['Br']} is not a multiple of 16 (mma.sync rows)",
                             "use a multiple of 16")
            if z["Bc"] % s.warps:
                self._refuse(spec, "warps", f"{s.warps} warps along kv do not divide tile kv = {z['Bc']}")
            cols, key = z["Bc"] // s.warps, "warps"
        if cols % k:
            self._refuse(spec, key, f"each warp's kv columns ({cols}) are not a multiple of {k} "
                         "(the k step of the P V MMA)", f"use tile kv = a multiple of {k * kv_groups(spec)}")

    def _threads(self, graph, limits):
        if graph.budget.threads > limits.max_threads_per_block:
            self._refuse(graph.spec, "warpgroups" if graph.family is Family.HOPPER else "warps",
                         f"{graph.budget.threads} threads per block > {limits.max_threads_per_block}")

    def _shared(self, graph, limits):
        b = graph.budget
        if b.shared_total <= b.shared_limit:
            return
        parts = " + ".join(f"{i.name} {_amount(i, graph.sizes['stages'])}" for i in b.shared)
        per_stage = sum(i.amount for i in b.shared if i.name in ("K", "V")) // graph.sizes["stages"]
        fixed = b.shared_total - per_stage * graph.sizes["stages"]
        fit = (b.shared_limit - fixed) // per_stage if per_stage else 0
        key = "pipeline" if graph.sizes["stages"] > 1 and fit >= 1 else "tile"
        hint = f"at most {fit} stages fit with these tiles" if fit >= 1 else "use smaller tiles (or a smaller head dim)"
        self._refuse(graph.spec, key, f"shared memory: {b.shared_total} bytes needed ({parts}) > "
                     f"{b.shared_limit} available on {b.arch}", hint)

    def _registers(self, graph, limits):
        b, spec, s = graph.budget, graph.spec, graph.spec.schedule
        parts = " + ".join(f"{i.name} {i.amount}" for i in b.registers)
        key = "warpgroups" if graph.family is Family.HOPPER else "tile"
        if b.register_total > b.register_limit:
            self._refuse(spec, key, f"registers: ~{b.register_total} per thread estimated ({parts}) > "
                         f"{b.register_limit} available", "use smaller tiles or more warps")
        if graph.family is Family.HOPPER and s.producer_regs and s.consumer_regs:
            total = 128 * (s.producer_warpgroups * s.producer_regs + s.consumer_warpgroups * s.consumer_regs)
            if total > limits.registers_per_sm:
                self._refuse(spec, "warpgroups", f"registers: {total} per block (128 x ({s.producer_warpgroups}x"
                             f"{s.producer_regs} + {s.consumer_warpgroups}x{s.consumer_regs})) > "
                             f"{limits.registers_per_sm} per SM")


def _amount(item: Item, stages: int) -> str:
    if item.name in ("K", "V") and stages > 1:
        return f"{stages}x{item.amount // stages}"
    return str(item.amount)


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


DEFAULT_PASSES = (ShapeInference, Pipelining, WarpRoles, Legality, EmissionOrder)


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


def run_passes(spec: KernelSpec, limits: DeviceLimits = H200, check_legality: bool = True) -> ScheduleGraph:
    """Build `spec`'s graph and run every pass. Legality can be left out (the float64 reference
    executes any tiling, legal on a GPU or not)."""
    passes = [p for p in DEFAULT_PASSES if check_legality or p is not Legality]
    return PassManager(passes).run(build_graph(spec), limits)


def emission_order(graph: ScheduleGraph) -> list[str]:
    """Node names in emission order (computed when the pass has not run)."""
    if graph.order is None:
        return _scope_order(graph, None)
    return list(graph.order)
