"""`tiledsl explain`: a schedule as text (and as Graphviz DOT).

Four sections, all read from the annotated graph: the loop nest as pseudo-code with the DSL
line each piece comes from, the ops in emission order, the on-chip budget against the GPU's
limits, and the HBM traffic and FLOPs next to standard attention's; FP8 kernels add their
quantization (cli/quantization.py).
"""
from __future__ import annotations

import os

from ..device_limits import H200, DeviceLimits
from ..schedule.ops import EdgeKind, OpKind, Role, Space
from ..schedule.graph import ScheduleGraph
from ..schedule.passes import emission_order, run_passes
from ..spec import AUTO, Family, KernelSpec
from ..schedule.traffic import Traffic, hbm_traffic, traffic_by_tensor
from .quantization import quantization, quantization_lines, summary_line, tensor_rows

WIDTH = 92   # the source tags start at this column (or after the text, when it is longer)


def source_tag(spec: KernelSpec, key: str) -> str:
    """`[file.tile:LINE]` of the DSL setting `key` (the block's line when it was not written)."""
    span = spec.span_of(key)
    if span is None:
        return f"[{spec.name}]"
    return f"[{os.path.basename(span.file)}:{span.line}]"


def _tagged(text: str, tag: str) -> str:
    return f"{text:<{WIDTH}} {tag}" if len(text) < WIDTH else f"{text}  {tag}"


def human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:.0f} {prefix}{unit}" if prefix == "" else f"{n:.2f} {prefix}{unit}"
        n /= 1000
    return f"{n} {unit}"


def loop_nest(graph: ScheduleGraph) -> list[str]:
    """The schedule as indented pseudo-code, one op or loop per line, each with its DSL source."""
    lines: list[str] = []
    specialized = graph.family is Family.HOPPER or bool(graph.barriers)   # a warp-specialized backward too

    def walk(loop: str | None, depth: int) -> None:
        for name in graph.children(loop):
            op = graph.op(name)
            pad = "    " * depth
            if op.kind is OpKind.LOOP:
                if op.init:   # state the loop carries, set before its first trip
                    where = "in HBM, before the kernel" if op.init_space is Space.HBM else "on chip"
                    state = ", ".join(f"{n} = {v}" for n, v in op.init)
                    lines.append(_tagged(f"{pad}{state}   ({where})", source_tag(graph.spec, op.key)))
                kernel = f"kernel {op.kernel}: " if op.kernel else ""
                lines.append(_tagged(f"{pad}{kernel}{op.text}", source_tag(graph.spec, op.key)))
                walk(name, depth + 1)
                continue
            text = op.text
            if op.kind in (OpKind.LOAD_K, OpKind.LOAD_V) and op.buffer:
                text += f"[{op.buffer}] via {op.via}"
            if op.kind is OpKind.MMA_WAIT:
                text += f"   (wgmma.wait_group {op.pending})"
            if op.tx_bytes:
                text += f"   (+{op.tx_bytes} B)"
            if specialized and op.role is not Role.ALL:
                text = f"{op.role.value}{f' (tile j-{op.lag})' if op.lag else ''}: {text}"
            lines.append(_tagged(pad + text, source_tag(graph.spec, op.key)))

    walk(None, 0)
    if graph.has(OpKind.STORE_O_STATE):
        lines.append(_tagged("O = O_state; lse = m + log l   (from the state FA1 leaves in HBM)",
                             source_tag(graph.spec, "order")))
    return lines


def role_and_barrier_lines(graph: ScheduleGraph) -> list[str]:
    """A warp-specialized kernel's roles (warpgroups, threads, setmaxnreg budget) and its barriers:
    arrivals per phase, TMA transaction bytes, and the ops that arrive and wait."""
    if not graph.barriers:
        return []
    lines = ["roles:"]
    for role, info in graph.roles.items():
        who = (f"{info['warpgroups']} warpgroup(s)" if info["warpgroups"]
               else f"{info['threads'] // 32} warp(s) of the producer warpgroup")
        lines.append(f"  {role:<9} {who}, {info['threads']} threads, setmaxnreg {info['registers']} registers per "
                     "thread")
    lines.append("barriers (count: arrivals per phase; tx: TMA bytes that must land too):")
    lines.append(f"  {'name':<8} {'kind':<9} {'count':>5} {'tx bytes':>9}   arrive -> wait")
    for b in graph.barriers.values():
        copies = "per consumer" if b.kind == "named" else "per stage"
        lines.append(f"  {b.name:<8} {b.kind:<9} {b.count:>5} {b.tx_bytes:>9}   "
                     f"{', '.join(b.arrive)} ({b.arrive_role}) -> {', '.join(b.wait)} ({b.wait_role})"
                     + (f"   [{b.stages} {copies}]" if b.stages > 1 else ""))
    return lines


def op_table(graph: ScheduleGraph) -> list[str]:
    lines = []
    for i, name in enumerate(emission_order(graph), 1):
        op = graph.op(name)
        if op.kind is OpKind.LOOP:
            detail = f"var {op.var}, {op.extent} trips, {'grid' if op.grid else 'serial'}"
        else:
            dims = "x".join(str(s) for s in op.sizes) if op.sizes else "-"
            detail = f"{op.space.value:<9} {'(' + ','.join(op.shape) + ')' if op.shape else '':<9} {dims:<9}"
            if op.barrier:
                detail += f" {op.barrier}"
            if op.buffer:
                detail += f"[{op.buffer}]" if op.barrier else f" slot {op.buffer}"
        lines.append(f"{i:>3}. {name:<16} {op.kind.value:<15} {op.role.value:<10} {detail:<50} "
                     f"{source_tag(graph.spec, op.key)}")
    return lines


def budget_lines(graph: ScheduleGraph) -> list[str]:
    """The kernel's layout (layout/): the same numbers the lowering writes into the kernel."""
    return layout_budget_lines(graph.layout, graph.roles)


def layout_budget_lines(lay, roles: dict | None = None) -> list[str]:
    """Shared memory, registers and resident blocks of one kernel's Layout."""
    lines = [f"shared memory per block (limit {lay.smem_limit} B on {lay.arch}"
             + ("" if lay.generated else "; the graph's dense-tile model, no template") + "):"]
    for b in lay.buffers:
        where = f"reuses {b.reuses}'s bytes" if b.reuses else f"at {b.offset}"
        detail = ", ".join(x for x in (where, b.layout) if x)
        lines.append(f"    {b.name:<20} {b.bytes:>8} B   {b.formula}   ({detail})")
    lines.append(f"    {'total':<20} {lay.smem_bytes:>8} B   {100 * lay.smem_bytes / lay.smem_limit:.0f}% of "
                 f"{lay.smem_limit}")
    lines.append(f"registers per thread (estimate, limit {lay.register_limit}; {lay.threads} threads per block):")
    for r in lay.registers:
        lines.append(f"    {r.name:<20} {r.amount:>8}     {r.formula}")
    lines.append(f"    {'total':<20} {lay.register_estimate:>8}     of {lay.register_limit} (accumulators and "
                 f"allowance {lay.accumulator_registers} must fit)")
    lines.append(f"    {lay.register_text}")
    for role, info in (roles or {}).items():
        regs = f", {info['registers']} registers (setmaxnreg)" if info.get("registers") else ""
        lines.append(f"    role {role}: {info['threads']} threads{regs}")
    lines.append(f"    {lay.resident_blocks} block(s) resident per SM (limited by {lay.limit_reason}); "
                 f"launch bounds promise {lay.min_blocks_per_sm}")
    return lines


def traffic_lines(graph: ScheduleGraph, t: Traffic, limits: DeviceLimits) -> list[str]:
    lines = [f"HBM traffic, no cache (batch {t.batch} x heads {t.heads}, seqlen q {t.seqlen_q}, kv {t.seqlen_kv}):"]
    for (tensor, mode), nbytes in traffic_by_tensor(t).items():
        lines.append(f"    {mode:<5} {tensor:<9} {human(nbytes):>12}")
    lines.append(f"    {'total':<15} {human(t.bytes):>12}   ({t.elements} elements)")
    lines.append(f"    {'standard':<15} {human(t.standard_bytes):>12}   ({t.standard_elements} elements: "
                 "S and P written and read back)")
    lines.append(f"    ratio standard / this schedule: {t.ratio:.2f}x")
    lines.append(f"FLOPs: {human(t.flops, 'FLOP')} useful (visible pairs), {human(t.flops_executed, 'FLOP')} "
                 f"executed (whole tiles); {t.flops_executed / max(t.bytes, 1):.1f} FLOP/byte")
    if limits.hbm_bytes_per_s and limits.dense_flops_per_s:
        memory_s, compute_s = t.bytes / limits.hbm_bytes_per_s, t.flops_executed / limits.dense_flops_per_s
        bound = "memory" if memory_s > compute_s else "compute"
        lines.append(f"    lower bounds on {limits.name}: memory {memory_s * 1e6:.1f} us, compute "
                     f"{compute_s * 1e6:.1f} us ({bound}-bound without cache)")
    return lines


def explained_shape(spec: KernelSpec, seqlen_q: int | None, seqlen_kv: int | None) -> tuple[int, int]:
    """(queries, keys) explain models: seqlen q defaults to the decode kernel's queries per sequence,
    else 4096; seqlen kv to seqlen q (4096 for decode)."""
    nq = seqlen_q or spec.problem.queries_per_seq or 4096
    return nq, seqlen_kv or (4096 if spec.problem.queries_per_seq is not None else nq)


def explained(spec: KernelSpec, batch: int, heads: int, seqlen_q: int | None, seqlen_kv: int | None,
              kv_heads: int | None, limits: DeviceLimits):
    """(graph, plan, why no plan, traffic, (queries, keys)) of `spec` at one shape: what explain and --json read."""
    graph = run_passes(spec, limits)
    plan, no_plan = lowered(spec, limits, graph)
    nq, nk = explained_shape(spec, seqlen_q, seqlen_kv)
    t = hbm_traffic(graph, batch, heads, nq, nk, kv_heads, limits.sm_count, blocks_per_sm(spec, plan, limits))
    return graph, plan, no_plan, t, (nq, nk)


def explain(spec: KernelSpec, batch: int = 1, heads: int = 16, seqlen_q: int | None = None,
            seqlen_kv: int | None = None, kv_heads: int | None = None, limits: DeviceLimits = H200,
            summary: bool = False) -> str:
    """The full explanation of `spec` for one problem shape (SpecError when it is illegal), or with
    `summary` its headline numbers in a few lines. seqlen q defaults to the decode kernel's queries per
    sequence, else 4096; seqlen kv to seqlen q (4096 for decode)."""
    graph, plan, no_plan, t, (nq, nk) = explained(spec, batch, heads, seqlen_q, seqlen_kv, kv_heads, limits)
    fp8 = quantization(spec, graph.layout, batch, heads, kv_heads or heads, nq, nk)
    rows = tensor_rows(t, spec.problem) if fp8 else []
    p, s = spec.problem, spec.schedule
    out = [f"{spec.name}: {spec.kernel_name}",
           f"family {spec.family.value}, {p.dtype.value}, head dim {p.head_dim_qk}/{p.head_dim_v}, mask "
           f"{p.mask.value}, "
           f"tiles Br={s.tile_q} Bc={s.tile_kv}, {graph.op('mma_qk').mma} tensor cores, "
           f"target {limits.name} ({limits.arch})", ""]
    if summary:
        lines = summary_lines(graph, plan, no_plan, t, limits)
        if fp8:
            lines.insert(-1, summary_line(fp8, rows, human))
        return "\n".join(out[:2] + lines) + "\n"
    if t.splits is not None:
        chosen = "chosen for this shape" if s.split_kv == AUTO else "fixed by the spec"
        out += [f"split kv = {s.split_kv}: {t.splits} splits ({chosen})"
                + (f": {t.split_reason}" if t.split_reason else ""),
                ""]
    if spec.family is Family.FA2 and plan is not None:
        out += [_launch_order_line(spec, graph.layout, batch * heads, -(-nq // s.tile_q), limits), ""]
    if spec.family is Family.HOPPER and plan is not None:
        out += [_tile_scheduler_line(spec, batch * heads, -(-nq // s.tile_q), -(-nk // s.tile_kv), limits),
                _launch_order_line(spec, graph.layout, batch * heads, -(-nq // s.tile_q), limits), ""]
    out += ["loop nest:"] + ["  " + line for line in loop_nest(graph)] + [""]
    if graph.barriers:
        out += role_and_barrier_lines(graph) + [""]
    out += ["ops in emission order:"] + ["  " + line for line in op_table(graph)] + [""]
    out += ["on-chip budget:"] + ["  " + line for line in budget_lines(graph)] + [""]
    out += generated_kernel_lines(plan, no_plan) + [""]
    out += traffic_lines(graph, t, limits)
    out += quantization_lines(fp8, rows, human) if fp8 else []
    out += modification_lines(spec, batch, heads, nq, nk)
    out += backward_lines(spec, batch, heads, nq, nk)
    return "\n".join(out) + "\n"


def modification_lines(spec: KernelSpec, batch: int, heads: int, nq: int, nk: int) -> list[str]:
    """The score and mask modifications: what they are, the aux tensors a launch passes, and how the
    masks classify this shape's (q tile, kv tile) pairs (schedule/tiles.py; terms that read aux data
    are partial here: a kernel decides them per tile at run time)."""
    mods = spec.problem.mods
    if not mods.active:
        return []
    from ..schedule.tiles import Tiling, classify, counts, data_dependent
    lines = ["", "score and mask modifications:"]
    lines += [f"    {key} = {value}" for key, value in mods.config().items()]
    for aux in mods.user_aux():   # what a launch passes (geometric ALiBi slopes are computed for its heads)
        kind = "float32" if aux.dtype.value == "float" else "int32"
        lines.append(f"    aux {aux.name}: {aux.rank}-d {kind}{', ' + aux.what if aux.what else ''}")
    s = spec.schedule
    found = counts(classify(spec.problem, Tiling(nq, nk, s.tile_q, s.tile_kv), batch, heads))
    total = sum(found.values())
    lines.append(f"    tiles (batch {batch} x heads {heads} x q tiles x kv tiles = {total}, Br={s.tile_q} "
                 f"Bc={s.tile_kv}): "
                 + ", ".join(f"{n} {found[n]} ({100 * found[n] / max(total, 1):.1f}%)" for n in ("empty", "full",
                                                                                                "partial"))
                 + "; empty ones are skipped, full ones run without per-element masking (the HBM traffic above "
                 "skips the empty ones; its useful FLOPs count the none / causal / window mask's pairs only)")
    runtime = data_dependent(mods)
    if runtime:
        lines.append(f"    decided per tile at run time from the aux data (partial above): {', '.join(runtime)}")
    return lines


def summary_lines(graph: ScheduleGraph, plan, no_plan: str | None, t: Traffic, limits: DeviceLimits) -> list[str]:
    """The explanation's headline numbers: the on-chip budget, the generated kernel, the traffic."""
    lay = graph.layout
    share = 100 * lay.smem_bytes / lay.smem_limit
    lines = [f"on chip: {lay.smem_bytes} B shared memory of {lay.smem_limit} ({share:.0f}%),"
             f" {lay.register_text} (limit {lay.register_limit}),"
             f" {lay.resident_blocks} block(s) per SM (limited by {lay.limit_reason})",
             (f"kernel: {plan.template}, {plan.launch.threads} threads" if plan is not None
              else f"kernel: none ({no_plan})"),
             f"HBM: {human(t.bytes)} ({t.ratio:.2f}x less than standard attention's {human(t.standard_bytes)}); "
             f"{human(t.flops, 'FLOP')} useful"]
    if limits.hbm_bytes_per_s and limits.dense_flops_per_s:
        memory_s, compute_s = t.bytes / limits.hbm_bytes_per_s, t.flops_executed / limits.dense_flops_per_s
        lines[-1] += f"; lower bounds {memory_s * 1e6:.1f} us memory, {compute_s * 1e6:.1f} us compute"
    if t.splits is not None:
        lines.append(f"split kv = {graph.spec.schedule.split_kv}: {t.splits} splits for this shape")
    return lines + ["(without --summary: the loop nest, the graph's ops, every buffer and register, the generated "
                    "kernel's steps, the traffic per tensor)"]


def backward_lines(spec: KernelSpec, batch: int = 1, heads: int = 16, seqlen_q: int = 4096,
                   seqlen_kv: int = 4096) -> list[str]:
    """The backward schedule's loop nest and ops, its HBM traffic (the forward's model on the backward graph),
    and its main kernel's budget (layout.backward_layout: the numbers the backward lowering writes) or why no
    template builds it (the float64 reference still runs the graph)."""
    if spec.backward is None:
        return []
    from ..schedule.backward import build_backward_graph
    from ..layout.backward import backward_has_template, backward_layout
    from ..spec import backward_name_parts
    b, graph = spec.backward, build_backward_graph(spec)
    t = hbm_traffic(graph, batch, heads, seqlen_q, seqlen_kv)
    lines = ["", f"backward ({'_'.join(backward_name_parts(b))}): order {b.order.value}, tiles Br={b.tile_q} "
             f"Bc={b.tile_kv}, {b.warps} warps, {b.stages} stages, {b.mma.value}; P recomputed from O and LSE",
             "backward loop nest:"] + ["  " + line for line in loop_nest(graph)] + [
             "", "backward ops in emission order:"] + ["  " + line for line in op_table(graph)]
    lines += ["", f"backward HBM traffic, no cache (batch {batch} x heads {heads}, seqlen q {seqlen_q}, kv "
              f"{seqlen_kv}; every kernel of the module):"]
    lines += [f"    {mode:<5} {tensor:<9} {human(nbytes):>12}"
              for (tensor, mode), nbytes in traffic_by_tensor(t).items()]
    lines.append(f"    {'total':<15} {human(t.bytes):>12}   (read {t.read_bytes} B, written {t.write_bytes} B)")
    why = backward_has_template(spec)
    if why:
        return lines + ["", f"backward kernels: none generated ({why})"]
    lay = backward_layout(spec)
    lines += ["", "backward main kernel:"] + ["  " + line for line in layout_budget_lines(lay.main)]
    if graph.barriers:   # the warp-specialized backward: its roles, barriers and per-role registers
        lines += ["", *ws_lines(lay), *role_and_barrier_lines(graph)]
        if spec.problem.mods.masks_positions:   # how documents / prefix(n) narrow each block's q tiles
            from ..lower.backward_ws import mask_text, q_range_text
            lines += ["mask modifications (each block's q tiles): " + q_range_text(spec.problem.mods),
                      "    consumers' mask step: " + mask_text(spec.problem.mods)]
        if spec.problem.mods.score_mod is not None or spec.problem.mods.mask_mod is not None:
            from ..lower.backward_ws import expression_text
            lines.append("expressions in the backward: " + expression_text(spec.problem.mods))
    if lay.dq_kernel:
        lines.append(f"  dQ kernel (`dq accumulate separate`): {lay.dq_kernel_smem} B shared memory, "
                     f"{lay.dq_kernel_threads} threads")
    return lines


def ws_lines(lay) -> list[str]:
    """How the warp-specialized backward shares its kv tile, adds dQ and launches, and each role's registers."""
    dq = {"writer_tma": "staged in fp32 shared memory, added by the writer's TMA reduce-add "
                        "(cp.reduce.async.bulk.tensor)",
          "writer_red": "staged in fp32 shared memory, added by the writer's red.global.add.v4",
          "consumer_red": "added from the consumers' registers (red.global.add.v4): no staging buffer fits",
          }[lay.dq_path]
    lines = [f"warp-specialized: consumers split the kv tile by {lay.split}; dQ_i split {lay.dq_split}, {dq}"
             + (f" ({lay.staging} staging buffers)" if lay.staging else ""),
             "launch: one block per (kv tile, batch * kv head), every (batch, kv head)'s first kv tile first (under a "
             "causal mask the longest: it sees every q tile)",
             "registers per role (estimate; the peak live set must fit setmaxnreg):"]
    for role, registers in lay.role_registers.items():
        parts = ", ".join(f"{r.name} {r.amount}" for r in registers)
        budget = lay.roles[role]["registers"]
        lines.append(f"    {role:<9} peak {lay.role_peaks[role]} of setmaxnreg {budget}   ({parts})")
    return lines


def lowered(spec: KernelSpec, limits: DeviceLimits, graph):
    """(the plan lowered from `graph`, None), or (None, why not) for a family without a CUDA template."""
    from ..errors import SpecError
    from ..families import lower
    try:
        return lower(spec, limits, graph=graph), None
    except SpecError as err:
        return None, str(err).splitlines()[0]


def generated_kernel_lines(plan, no_plan: str | None) -> list[str]:
    """The same schedule as the loop nest above, as the lowering spells it: each loop body's graph
    ops in emission order and the CUDA steps each becomes (an op another step covers, such as V's
    load issued with K's, becomes none), then the lowering's notes (buffers, resident blocks)."""
    if plan is None:
        return [f"generated kernel: none ({no_plan})"]
    lines = [f"generated kernel ({plan.template}): {plan.kernel_name}, {plan.launch.threads} threads, "
             f"{plan.launch.smem_bytes} B shared memory"]
    lines += ["    " + note for note in plan.notes]
    lines.append("    steps of each loop body, in the emission order above (graph op -> CUDA step):")
    for loop, body in plan.loop_bodies:
        lines.append(f"      {loop}:")
        width = max((len(op.kind) for op in body), default=0)
        for op in body:
            detail = (f" (cp.async groups left in flight: {op.pending})" if op.kind.startswith("wait") else
                      f" (tile j+{op.distance})" if op.kind.startswith("prefetch") else "")
            lines.append(f"        {op.node:<18} -> {op.kind:<{width}}  {op.what}{detail}   [{op.where}]")
    return lines


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_ROLE_COLOR = {Role.ALL: "white", Role.PRODUCER: "lightblue", Role.CONSUMER: "lightyellow"}


def to_dot(graph: ScheduleGraph) -> str:
    """Graphviz DOT text: loops as nested clusters, data edges solid, sync edges dashed, loop-carried
    dependencies dotted. Written by hand (no pydot dependency); the same graph gives the same text."""
    lines = [f"digraph {_dot_quote(graph.spec.name)} {{", "  rankdir=TB;",
             '  node [shape=box, fontname="monospace", fontsize=10, style=filled];']

    def walk(loop: str | None, depth: int) -> None:
        pad = "  " * (depth + 1)
        for name in graph.children(loop):
            op = graph.op(name)
            if op.kind is OpKind.LOOP:
                lines.append(f"{pad}subgraph {_dot_quote('cluster_' + name)} {{")
                lines.append(f"{pad}  label={_dot_quote(op.text)};")
                walk(name, depth + 1)
                lines.append(f"{pad}}}")
                continue
            dims = "x".join(map(str, op.sizes))
            label = "\\n".join(x for x in (name, f"{op.space.value} {dims}".strip(), op.buffer and f"slot {op.buffer}",
                                           op.lag and f"tile j-{op.lag}", op.tx_bytes and f"+{op.tx_bytes} B tx")
                               if x and x != "none")
            lines.append(f"{pad}{_dot_quote(name)} [label=\"{label}\", fillcolor={_ROLE_COLOR[op.role]}];")

    walk(None, 0)
    for u, v, data in sorted(graph.edges(), key=lambda e: (graph.seq(e[0]), graph.seq(e[1]))):
        style = "dashed" if data["kind"] is EdgeKind.SYNC else "solid"
        lines.append(f"  {_dot_quote(u)} -> {_dot_quote(v)} [label={_dot_quote(data['value'])}, style={style}];")
    for c in graph.carried:
        lines.append(f"  {_dot_quote(c.src)} -> {_dot_quote(c.dst)} [label={_dot_quote(c.value + ' (next trip)')}, "
                     "style=dotted, constraint=false];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def blocks_per_sm(spec, plan, limits: DeviceLimits) -> int:
    """Resident blocks per SM of the lowered decode kernel (the estimate before compiling)."""
    if spec.family is not Family.DECODE or plan is None:
        return 1
    from ..lower.decode import decode_blocks_per_sm
    return decode_blocks_per_sm(plan, limits)


def _tile_scheduler_line(spec, pairs: int, q_tiles: int, kv_tiles: int, limits: DeviceLimits) -> str:
    """How a hopper kernel's blocks take its work items at this shape (`launch`, else the runtime's rule)."""
    from ..runtime.hopper import launch_rule
    from ..spec import LaunchKind
    s, items = spec.schedule, pairs * q_tiles
    launch = s.launch
    why = "written in the spec" if launch is not None else "the runtime's choice"
    if launch is None:
        walk, reason = launch_rule(spec.problem, kv_tiles)
        launch = LaunchKind.PERSISTENT if walk else LaunchKind.GRID
        why += ": " + reason
    how = {LaunchKind.GRID: "one block per item, each started on the SM that frees first",
           LaunchKind.PERSISTENT: f"one block per SM ({limits.sm_count}), block b walking items b, b + grid, ...",
           LaunchKind.DYNAMIC: f"one block per SM ({limits.sm_count}), each producer taking its next item from a "
                               "global counter"}[launch]
    return f"tile scheduler: launch {launch.value} ({why}): {items} work items; {how}"


def _launch_order_line(spec, layout, pairs: int, q_tiles: int, limits: DeviceLimits) -> str:
    """runtime/block_order.py's choice for this shape, with resident blocks from the layout."""
    from ..runtime.block_order import describe
    from ..spec import ItemOrder
    if spec.schedule.item_order is ItemOrder.PAIR_BY_PAIR:
        return (f"launch order: {pairs} (batch, head) pairs x {q_tiles} q tiles, one pair after another "
                f"(`order pair_by_pair`), longest q tiles first in each")
    return describe(spec.problem.mask, pairs, q_tiles, limits.sm_count * max(layout.resident_blocks, 1))
