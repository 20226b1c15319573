"""Lowering: KernelSpec -> KernelPlan, the plain data a template renders.

Sizes come from the layout pass (layout.py: shared-memory buffers, register estimates, launch
bounds); lowering names them as the plan's constants, and templates only loop and branch over the
plan's fields.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from .device_limits import H200
from .version import __version__
from .errors import SpecError
from .graph import Op, ScheduleGraph, build_graph
from .layout import Layout, cp_async_pending, fa2_page_ring, fa2_page_walk, layout_of, mma_width, tile_row_bytes  # noqa: F401  (tile_row_bytes: re-exported)
from .passes import emission_order, run_passes
from .spec import DTYPE_PTX, DType, Family, KernelSpec, Mask

MASK_KIND = {Mask.NONE: "MASK_NONE", Mask.CAUSAL: "MASK_CAUSAL", Mask.WINDOW: "MASK_WINDOW"}


@dataclass(frozen=True)
class Constant:
    name: str
    type: str        # int | bool | float | u32 | MaskKind
    value: object
    why: str = ""


@dataclass(frozen=True)
class Region:
    """A step of the kernel and the DSL line it came from, for `// [file.tile:LINE] what`."""
    where: str
    what: str


@dataclass(frozen=True)
class LoopOp:
    kind: str                 # barrier | prefetch_kv | wait_k | wait_v | mma_qk | mask | online_softmax | mma_pv
    where: str
    what: str
    pending: int = 0          # wait_*: cp.async groups allowed to stay in flight
    distance: int = 0         # prefetch_kv: how many tiles ahead
    node: str = ""            # the scheduler-graph op this step lowers
    tile: str = ""            # prefetch_*: the kv tile it loads and the ring slot it fills (CUDA expressions)
    stage: str = ""


@dataclass(frozen=True)
class KvRange:
    """Query rows q0 .. q0 + rows - 1 whose visible kv tiles [begin, end) macros.j2's kv_range
    declares (CUDA expressions and names). The default: a block's own query tile."""
    q0: str = "q0"
    rows: str = "C::BR"
    begin: str = "tile_begin"
    end: str = "tile_end"


@dataclass(frozen=True)
class Launch:
    threads: int
    smem_bytes: int
    tile_q: int


@dataclass(frozen=True)
class KernelPlan:
    kernel_name: str
    family: str
    template: str
    tiledsl_version: str
    source_file: str
    config_hash: str
    spec_lines: tuple[str, ...]
    config_lines: tuple[str, ...]
    dtype_ptx: str
    constants: tuple[Constant, ...]
    regions: dict
    loop_body: tuple[LoopOp, ...]
    min_blocks_per_sm: int
    launch: Launch
    register_estimate: int
    notes: tuple[str, ...] = field(default=())
    mma: str = "mma.sync"     # the graph's MMA instruction: "mma.sync" | "wgmma"
    wgmma_qk: object = None   # wgmma only: lower_wgmma.WgmmaAsm of S = Q K^T (its n = the kv tile)
    wgmma_pv: object = None   # wgmma only: lower_wgmma.WgmmaAsm of O += P V (its n = head dim of v)
    kv_load_scope: str = "block"   # "warp": each warp loads (and waits for) only its key slice of a kv tile
    kv_groups_per_tile: int = 2    # cp.async groups per K/V tile: 2 (K, then V: QK^T starts before V lands) | 1
    mma_traits: str = "C"          # the constants struct attention.cuh's MMA / softmax helpers take ("W": one warp's key slice)
    mask_rows: str = "tile"        # "tile": rows are the block's query rows | "packed": decode's (head, query) rows
    kv_range: KvRange = KvRange()  # the rows whose kv tiles the kernel walks (kv_range region)
    hbm_chunks: tuple[str, str] = ("C::D / 8", "C::DV / 8")   # 16-byte chunks of a K and a V row in HBM (CUDA)


    @property
    def loop_bodies(self) -> tuple[tuple[str, tuple[LoopOp, ...]], ...]:
        """(graph loop, the CUDA steps of its body), outer loop first."""
        return (("loop_kv", self.loop_body),)


@dataclass(frozen=True)
class PagedFa2Plan(KernelPlan):
    """An fa2 plan whose kernel reads K and V through a block table (`kv_cache = paged(page = N)`)."""
    kv_pages: str = ""   # layout.fa2_page_walk: "slice" the tile lies in one page | "rows" an entry per key


def _where(spec: KernelSpec, key: str) -> str:
    span = spec.span_of(key)
    if span is None:
        return f"{Path(spec.source_file).name}"
    return f"{Path(span.file).name}:{span.line}"


def _spec_lines(spec: KernelSpec) -> tuple[str, ...]:
    if spec.span is None or not spec.source_text:
        return (f"(built in Python: {spec.name})",)
    lines = spec.source_text.splitlines()[spec.span.line - 1: spec.span.end_line]
    return tuple(line.rstrip() for line in lines)


def _require(cond: bool, spec: KernelSpec, key: str, message: str, hint: str = "") -> None:
    if not cond:
        raise SpecError(message, spec.span_of(key), spec.source_text, hint)


def make_plan(spec: KernelSpec, family: Family, constants, regions: dict, loop_body, launch: Launch,
              min_blocks_per_sm: int, register_estimate: int, kernel_name: str | None = None,
              plan_class: type = None, **extra) -> KernelPlan:
    """A KernelPlan (or the family's subclass, `plan_class`) with the fields every family fills
    the same way (names, hashes, the spec's lines and full config for the generated file's header).
    The template is left empty: families.lower fills it in from the family's row."""
    return (plan_class or KernelPlan)(
        kernel_name=kernel_name or spec.kernel_name, family=family.value, template="",
        tiledsl_version=__version__, source_file=Path(spec.source_file).name,
        config_hash=spec.config_hash, spec_lines=_spec_lines(spec),
        config_lines=tuple(json.dumps(spec.config(), indent=1, sort_keys=True).splitlines()),
        dtype_ptx=DTYPE_PTX[spec.problem.dtype], constants=tuple(constants), regions=regions,
        loop_body=tuple(loop_body), min_blocks_per_sm=min_blocks_per_sm, launch=launch,
        register_estimate=register_estimate, **extra,
    )


def softmax_constants(p) -> list[Constant]:
    """The mask and softmax-scale constexprs every family's attention.cuh functions read."""
    return [
        Constant("MASK", "MaskKind", MASK_KIND[p.mask]),
        Constant("WINDOW_LEFT", "int", p.window_left),
        Constant("WINDOW_RIGHT", "int", p.window_right),
        Constant("SCALE", "float", p.scale, "softmax scale"),
        Constant("SCALE_LOG2", "float", p.scale * math.log2(math.e), "scale * log2(e): softmax through exp2"),
    ]


def tile_row_constants(qk_row: int, qk_swizzle: bool, v_row: int, v_swizzle: bool) -> list[Constant]:
    """The shared-memory row layout of Q/K and V tiles (tile_row_bytes) that common.cuh's loads and
    attention.cuh's ldmatrix addressing read."""
    return [
        Constant("QK_ROW_BYTES", "int", qk_row, "shared-memory row of Q and K tiles"),
        Constant("QK_SWIZZLE", "bool", qk_swizzle, "XOR swizzle (else padded rows)"),
        Constant("V_ROW_BYTES", "int", v_row, "shared-memory row of V (and O) tiles"),
        Constant("V_SWIZZLE", "bool", v_swizzle),
    ]


def smem_constants(lay: Layout) -> list[Constant]:
    """The kernel's shared-memory total and the limit its static_assert checks it against (both
    from the layout)."""
    return [
        Constant("SMEM_BYTES", "u32", lay.smem_bytes),
        Constant("SMEM_LIMIT", "u32", lay.smem_limit, f"opt-in shared memory per block on {lay.arch}"),
    ]


def kv_buffer_constants(stages: int, q_offset: int, k_offset: int, k_stage: int, v_offset: int,
                        v_stage: int) -> list[Constant]:
    """Where Q and the STAGES K and V buffers sit in shared memory (every family lays them out so)."""
    return [
        Constant("STAGES", "int", stages, "K/V buffers (pipeline stages)"),
        Constant("Q_OFFSET", "u32", q_offset),
        Constant("K_OFFSET", "u32", k_offset),
        Constant("K_STAGE_BYTES", "u32", k_stage),
        Constant("V_OFFSET", "u32", v_offset),
        Constant("V_STAGE_BYTES", "u32", v_stage),
    ]


def graph_loop_body(graph: ScheduleGraph, loop: str, lower_op) -> tuple[LoopOp, ...]:
    """The ops directly inside `loop`, in the graph's emission order, each lowered by
    `lower_op(name, op) -> [LoopOp, ...]` (nothing for ops a neighbour's CUDA covers, and for
    nested loops, which the template opens itself). Every LoopOp records the node it lowers."""
    body: list[LoopOp] = []
    for name in emission_order(graph):
        op = graph.op(name)
        if op.loops and op.loops[-1] == loop:
            body += [replace(step, node=name, **_prefetch_target(step)) for step in lower_op(name, op)]
    return tuple(body)


def _prefetch_target(step: LoopOp) -> dict:
    """A prefetch's tile and ring slot, `distance` tiles ahead of the loop's `tile` and `stage`."""
    if not step.kind.startswith("prefetch"):
        return {}
    return {"tile": f"tile + {step.distance}", "stage": f"(stage + {step.distance}) % C::STAGES"}


def mma_instruction(spec: KernelSpec) -> tuple[Op, Op]:
    """The graph's two MMA ops (mma_qk, mma_pv), which carry the tensor-core instruction."""
    graph = build_graph(spec)
    return graph.op("mma_qk"), graph.op("mma_pv")


def fa2_loop_body(spec: KernelSpec, stages: int) -> tuple[LoopOp, ...]:
    """The kv loop of FA2, in the scheduler graph's emission order (passes.emission_order).

    The graph orders the tile ops by data dependence; lowering places the K/V loads by the
    pipeline depth: with 2+ stages tile j+S-1 is prefetched right after K_j has landed (into the
    buffer freed last step); with one stage the tile is loaded at the top of its own step. K and V
    are separate cp.async groups, so QK^T starts before V has landed."""
    def lower_op(name: str, op: Op) -> list[LoopOp]:
        where = _where(spec, op.key or "order")
        kind = op.kind.value
        if kind == "load_k":
            if stages > 1:
                return []
            return [LoopOp("barrier", where, "one stage: every warp is done with the buffer before it is refilled"),
                    LoopOp("prefetch_kv", where, "load K_j, V_j", distance=0)]
        if kind == "load_v":
            return []   # issued with K (own cp.async group) by prefetch_kv
        if kind == "wait" and op.barrier.startswith("k"):
            steps = [LoopOp("wait_k", where, "wait for K_j (V_j and later tiles may still be in flight)",
                            pending=cp_async_pending(Family.FA2, stages, "k"))]
            if stages > 1:
                steps.append(LoopOp("prefetch_kv", where, f"prefetch K, V of tile j+{stages - 1} into the buffer freed last step",
                                    distance=stages - 1))
            return steps
        if kind == "wait":
            return [LoopOp("wait_v", where, "wait for V_j", pending=cp_async_pending(Family.FA2, stages, "v"))]
        if kind in ("mma_qk", "mask", "online_softmax", "mma_pv"):
            return [LoopOp(kind, where, op.text or LOOP_TEXT[kind])]
        if kind == "rescale_o":
            return []   # folded into online_softmax: O is rescaled by exp(m_old - m_new) there
        if kind == "page_lookup":
            return []   # folded into the K/V loads: each thread reads the entries of the rows it copies
        raise AssertionError(f"fa2 lowering has no CUDA for graph op {name} ({kind})")

    return graph_loop_body(run_passes(spec), "loop_kv", lower_op)


LOOP_TEXT = {
    "mma_qk": "S = Q K_j^T (mma.sync m16n8k16, fp32 accumulate)",
    "mask": "mask keys outside the sequence / diagonal / window (only tiles that need it)",
    "online_softmax": "m = max(m, rowmax S); P = exp(scale (S - m)); rescale l and O",
    "mma_pv": "O += P V_j (P from registers, V via ldmatrix.trans)",
}


def fa2_regions(spec: KernelSpec, q_layout: str = "", kv_loop_note: str = "") -> dict:
    """The regions of the fa2 kernels (mma.sync and wgmma templates): `q_layout` and
    `kv_loop_note` name what the wgmma one does differently."""
    s, p = spec.schedule, spec.problem
    return {
        "kv_range": Region(_where(spec, "mask"), "the kv tiles this query tile can see (tiles past the diagonal or outside the window are never loaded)"),
        "load_q": Region(_where(spec, "tile"), f"load the {s.tile_q} x {p.head_dim_qk} Q tile{q_layout} (cp.async, zero-filled past the end)"),
        "prologue": Region(_where(spec, "pipeline"), f"pipeline prologue: first {s.stages - 1} K/V tiles in flight"),
        "kv_loop": Region(_where(spec, "order"), f"q outer (one block per q tile), kv inner{kv_loop_note}"),
        "epilogue": Region(_where(spec, "order"), "O /= l once; LSE = scale m + log l; store"),
    }


def lower_fa2(spec: KernelSpec, min_blocks_per_sm: int | None = None, q_in_registers: bool | None = None) -> KernelPlan:
    """The fa2 plan on mma.sync (`mma wgmma` specs are lower_wgmma's: families.FAMILIES picks)."""
    p, s = spec.problem, spec.schedule
    _require(p.dtype in (DType.FP16, DType.BF16), spec, "dtype",
             f"the fa2 template computes in fp16 or bf16 tensor cores, not {p.dtype.value}", "dtype = bf16 or fp16")
    lay = layout_of(spec, H200, min_blocks_per_sm=min_blocks_per_sm, q_in_registers=q_in_registers)
    rows_per_warp, m_tiles, threads = lay.rows_per_warp, lay.rows_per_warp // 16, lay.threads
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    q_in_registers, smem = lay.q_in_registers, lay.smem_bytes
    q, k, v = lay.buffer("Q"), lay.buffer("K"), lay.buffer("V")

    d_mma, dv_mma = mma_width(p.head_dim_qk), mma_width(p.head_dim_v)
    consts = [
        Constant("BR", "int", s.tile_q, "query rows per block (tile q)"),
        Constant("BC", "int", s.tile_kv, "keys per kv tile (tile kv)"),
        Constant("D", "int", d_mma, "head dim of q and k" + _padded(p.head_dim_qk, d_mma)),
        Constant("DV", "int", dv_mma, "head dim of v and o" + _padded(p.head_dim_v, dv_mma)),
        Constant("QK_CHUNKS", "int", p.head_dim_qk // 8, "16-byte chunks of a q / k row in HBM (loads copy these)"),
        Constant("V_CHUNKS", "int", p.head_dim_v // 8, "16-byte chunks of a v / o row in HBM (loads and stores)"),
        Constant("ZERO_PAD", "bool", (d_mma, dv_mma) != (p.head_dim_qk, p.head_dim_v),
                 "shared tiles have pad columns: zeroed once, before the first load"),
        Constant("WARPS", "int", s.warps, "warps, split along q"),
        Constant("THREADS", "int", threads),
        Constant("ROWS_PER_WARP", "int", rows_per_warp),
        Constant("M_TILES", "int", m_tiles, "16-row mma tiles per warp"),
        Constant("S_TILES", "int", s.tile_kv // 8, "8-column mma tiles of S per row block"),
        Constant("O_TILES", "int", dv_mma // 8, "8-column mma tiles of O per row block"),
        *tile_row_constants(qk_row, qk_swizzle, v_row, v_swizzle),
        *kv_buffer_constants(s.stages, q.offset, k.offset, k.stage_bytes, v.offset, v.stage_bytes),
        Constant("O_OFFSET", "u32", lay.buffer("O staging").offset, "O staging for coalesced stores"),
        *smem_constants(lay),
        Constant("Q_PENDING_GROUPS", "int", 2 * (s.stages - 1), "cp.async groups issued after Q's"),
        Constant("Q_IN_REGISTERS", "bool", q_in_registers, "Q fragments held for the whole kv loop"),
        Constant("Q_REG_TILES", "int", m_tiles if q_in_registers else 1),
        *softmax_constants(p),
    ]
    regions = fa2_regions(spec)
    paged = {}
    if p.kv_page_size is not None:
        walk = fa2_page_walk(p.kv_page_size, s.tile_kv)
        slots, entries = fa2_page_ring(p.kv_page_size, s.tile_kv, s.stages)
        consts += fa2_page_constants(p.kv_page_size, walk)
        consts += [Constant("PAGE_RING", "int", slots, "tiles of block-table entries held ahead in shared memory (0: read inline)"),
                   Constant("TILE_PAGES", "int", entries, "block-table entries of one kv tile"),
                   Constant("PAGES_OFFSET", "u32", lay.buffer("block-table entries").offset if slots else 0,
                            "the entries' ring")]
        regions["kv_range"] = replace(regions["kv_range"], what=regions["kv_range"].what + f"; K/V rows through the "
                                      f"block table ({p.kv_page_size} keys a page, " + (
                                          "one entry per kv tile" if walk == "slice" else "one entry per page of the tile") + (
                                          f", copied to shared memory {s.stages - 1} tile(s) ahead)" if slots else ", read inline)"))
        paged = {"plan_class": PagedFa2Plan, "kv_pages": walk}
    return make_plan(spec, Family.FA2, consts, regions, fa2_loop_body(spec, s.stages),
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), lay.min_blocks_per_sm,
                     lay.register_estimate, hbm_chunks=("C::QK_CHUNKS", "C::V_CHUNKS"), **paged)


def fa2_page_constants(page_size: int, walk: str) -> list[Constant]:
    """A paged cache's addressing: key t lies in page block_table[b, t >> PAGE_SHIFT] at slot
    t & PAGE_MASK (page sizes are powers of two)."""
    return [Constant("PAGE_SIZE", "int", page_size, "keys per page of the KV cache"),
            Constant("PAGE_SHIFT", "int", page_size.bit_length() - 1, "key -> block-table entry: key >> PAGE_SHIFT"),
            Constant("PAGE_MASK", "int", page_size - 1, "key -> slot in its page: key & PAGE_MASK"),
            Constant("PAGE_PER_TILE", "bool", walk == "slice", "a kv tile lies in one page: one block-table read per tile")]


def _padded(dim: int, width: int) -> str:
    return f" ({dim} padded on chip to {width} for the mma k step)" if width != dim else ""
