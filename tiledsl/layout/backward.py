"""The backward module's layout: the kv-outer main kernel on mma.sync or wgmma (K, V kept, Q, dO, LSE, D
in a ring, dS^T and dQ staging), its dQ split between warps, and the q-outer dQ kernel of
`dq accumulate separate`."""
from __future__ import annotations

from dataclasses import dataclass

from ..device_limits import H200, DeviceLimits
from ..hw import PANEL_COLUMNS, SWIZZLE_ATOM, WGMMA_ROWS
from ..spec import KernelSpec, LoopOrder, Mma
from .base import (
    REGISTER_OVERHEAD,
    SMEM_ALIGN,
    TEMPLATE_DTYPES,
    Buffer,
    Layout,
    Registers,
    align,
    finish,
    require,
    row_formula,
    row_text,
    thread_register_limit,
    tile_row_bytes,
)
from .backward_ws import BackwardWsLayout, backward_ws_layout, ws_has_template

BACKWARD_PRE_ROWS = 64         # preprocess / convert: q rows per block

BACKWARD_PRE_THREADS = 256

BACKWARD_DQ_TILE_KV = 64       # `dq accumulate separate`: keys per kv tile of the q-outer dQ kernel

BACKWARD_MAX_DIM = 256         # preprocess: a warp's lanes take 2 columns per 64 (u32 loads)
BACKWARD_DIM_MULTIPLE = 16     # head dims: mma m16n8k16's k and n steps (attention_backward pads others to it)

# atomic dQ: fp32 per red.global.add (v4: lane pairs swap halves); the first is the default (v2, the one
# timed; v4 is validated but untimed: bench/NOTES.md)
BACKWARD_DQ_VECTORS = (2, 4)


@dataclass(frozen=True)
class BackwardLayout:
    """The backward module's sizes: the main kernel's Layout plus its dQ split and, for
    `dq accumulate separate`, the q-outer dQ kernel's buffers."""
    main: Layout
    kv_m_tiles: int            # 16-row mma tiles of the kv tile per warp
    dq_m_tiles: int            # dQ_i = dS K_j: 16-row tiles per warp
    dq_row_groups: int         # warps along dQ_i's rows (the rest split its columns)
    dq_cols: int               # dQ_i columns per warp
    dq_kernel: tuple[Buffer, ...] = ()
    dq_kernel_smem: int = 0
    dq_kernel_threads: int = 0
    dq_split: str = ""         # wgmma: how the warpgroups share dQ_i (backward_wgmma_dq_split)


def backward_has_template(spec: KernelSpec) -> str:
    """Why the backward template can't build `spec`'s backward ("" when it can): the mma.sync kv-outer
    kernel with dq atomic or separate, fp16/bf16."""
    b, p = spec.backward, spec.problem
    if b is None:
        return "the spec has no `backward { }` block"
    if p.dtype not in TEMPLATE_DTYPES:
        return f"the backward template computes in fp16 or bf16, not {p.dtype.value}"
    if b.order is not LoopOrder.KV_OUTER:
        return "the backward template is kv outer (`order kv, q`)"
    if b.warp_specialized:
        return ws_has_template(spec)
    if p.mods.active:   # the forward kernels take some; the backward's dS through them is not spelled yet
        return "the backward template has no score and mask modifications yet (their kernels are forward-only)"
    if b.mma is Mma.WGMMA and b.dq.value != "atomic":
        return "the wgmma backward sums dQ with fp32 atomics only (`dq accumulate atomic`)"
    if b.dq.value == "ordered":
        return "`dq accumulate ordered` has no template yet (`separate` is deterministic)"
    return ""


def backward_layout(spec: KernelSpec, limits: DeviceLimits = H200) -> BackwardLayout | BackwardWsLayout:
    """Shared memory, registers and warps of the backward kernels (templates/backward.cu.j2); SpecError
    at the backward block's line when they do not fit."""
    b, p = spec.backward, spec.problem
    if b.warp_specialized:
        return backward_ws_layout(spec, limits)
    if b.mma is Mma.WGMMA:
        return backward_wgmma_layout(spec, limits)
    d, dv, Br, Bc, S = p.head_dim_qk, p.head_dim_v, b.tile_q, b.tile_kv, b.stages
    tile_key = "backward.tile" if spec.span_of("backward.tile") else "backward"
    require(d % BACKWARD_DIM_MULTIPLE == 0 and dv % BACKWARD_DIM_MULTIPLE == 0 and max(d, dv) <= BACKWARD_MAX_DIM,
            spec, "head_dim", f"head dim qk {d} / v {dv}: the backward needs multiples of {BACKWARD_DIM_MULTIPLE} up "
            f"to {BACKWARD_MAX_DIM}")
    require(Br % 16 == 0 and Bc % (16 * b.warps) == 0, spec, tile_key,
             f"tile q = {Br}, kv = {Bc} with {b.warps} warps: tile q must be a multiple of 16 and each warp "
             "a multiple of 16 kv rows", f"use tile kv = {16 * b.warps}")
    kv_m_tiles, threads = Bc // (16 * b.warps), 32 * b.warps
    row_tiles = Br // 16
    if b.warps % row_tiles == 0:
        dq_m_tiles, dq_row_groups, dq_cols = 1, row_tiles, d // (b.warps // row_tiles)
    elif row_tiles % b.warps == 0:
        dq_m_tiles, dq_row_groups, dq_cols = row_tiles // b.warps, b.warps, d
    else:
        dq_m_tiles = dq_row_groups = dq_cols = 0
    atomic = b.dq.value == "atomic"
    if atomic:
        require(dq_cols and dq_cols % 16 == 0 and dq_cols * (d // max(dq_cols, 1)) == d, spec, tile_key,
                 f"dQ_i ({Br} x {d}) does not split into 16-column blocks over {b.warps} warps",
                 "use warps that divide tile q / 16, or a multiple of it that divides head_dim / 16")
    qk_row, qk_sw = tile_row_bytes(d)
    v_row, v_sw = tile_row_bytes(dv)
    ds_row, ds_sw = tile_row_bytes(Br)
    buffers, end = [], 0

    def add(name, nbytes, stages=1, layout="", formula=""):
        nonlocal end
        buffers.append(Buffer(name, end, nbytes * stages, SMEM_ALIGN, stages, nbytes if stages > 1 else 0, layout,
                              formula))
        end = align(end + nbytes * stages)
    add("K", Bc * qk_row, 1, row_text(d), row_formula("Bc", "d", d) + " (kept for the whole q loop)")
    add("V", Bc * v_row, 1, row_text(dv), row_formula("Bc", "dv", dv) + " (kept for the whole q loop)")
    add("Q", Br * qk_row, S, row_text(d), f"{S}x " + row_formula("Br", "d", d))
    add("dO", Br * v_row, S, row_text(dv), f"{S}x " + row_formula("Br", "dv", dv))
    add("LSE", Br * 4, S, "fp32", f"{S}x Br*4")
    add("D", Br * 4, S, "fp32", f"{S}x Br*4")
    if atomic:
        add("dS^T", Bc * ds_row, 1, row_text(Br), row_formula("Bc", "Br", Br) + " (A operand of dQ_i = dS K_j)")
    acc = [Registers("dK accumulator", kv_m_tiles * d // 2, f"KV_M_TILES*d/2 = {kv_m_tiles}*{d}/2", True),
           Registers("dV accumulator", kv_m_tiles * dv // 2, f"KV_M_TILES*dv/2 = {kv_m_tiles}*{dv}/2", True),
           Registers("S^T/P^T", kv_m_tiles * Br // 2, f"KV_M_TILES*Br/2 = {kv_m_tiles}*{Br}/2", True),
           Registers("dP^T/dS^T", kv_m_tiles * Br // 2, f"KV_M_TILES*Br/2 = {kv_m_tiles}*{Br}/2", True),
           Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    estimate = sum(r.amount for r in acc)
    require(estimate <= thread_register_limit(threads, limits), spec, tile_key,
             f"registers: ~{estimate} per thread estimated (" + " + ".join(f"{r.name} {r.amount}" for r in acc)
             + f") > {thread_register_limit(threads, limits)} available", "use a smaller tile q, or more warps")
    main = finish(spec, "backward", limits, buffers, end, acc, threads, 1, stages=S, rows_per_warp=16 * kv_m_tiles)
    dq_buffers, dq_end, dq_threads = [], 0, 0
    if not atomic:
        Bk = BACKWARD_DQ_TILE_KV
        dq_threads = 32 * row_tiles
        for name, nbytes, stages in (("Q", Br * qk_row, 1), ("dO", Br * v_row, 1), ("K", Bk * qk_row, S),
                                     ("V", Bk * v_row, S)):
            dq_buffers.append(Buffer(name, dq_end, nbytes * stages, SMEM_ALIGN, stages, nbytes if stages > 1 else 0))
            dq_end = align(dq_end + nbytes * stages)
        require(dq_end <= limits.max_shared_per_block, spec, tile_key,
                 f"shared memory of the dQ kernel: {dq_end} bytes > {limits.max_shared_per_block}",
                 "use a smaller tile q")
        dq_regs = d // 2 + Bk + REGISTER_OVERHEAD   # dQ, S and dP accumulators of 16 rows
        require(dq_regs <= limits.max_registers_per_thread, spec, tile_key,
                 f"registers of the dQ kernel: ~{dq_regs} per thread > {limits.max_registers_per_thread}")
    return BackwardLayout(main, kv_m_tiles, dq_m_tiles, dq_row_groups, dq_cols, tuple(dq_buffers), dq_end, dq_threads)


BACKWARD_WGMMA_TILE_Q = (64, 128)   # q rows per step: one or two 64-column panels of dS^T (wgmma m64 reads one)


def backward_wgmma_dq_split(tile_q: int, head_dim: int) -> str:
    """How the two warpgroups share dQ_i = dS K_j (tile q x head dim): "m" each its 64 query rows
    (tile q 128); "n" each half the columns (tile q 64, head dim a multiple of 128: whole panels of
    K); "k" each its own 64 keys over every column (tile q 64, head dim 64: twice the atomics, but no
    block barrier)."""
    if tile_q == 2 * WGMMA_ROWS:
        return "m"
    return "n" if head_dim % (2 * PANEL_COLUMNS) == 0 else "k"


# bytes after each fp32 dQ_i staging row: a half-warp's float2 stores (4 rows) hit distinct banks
BACKWARD_WGMMA_DQ_STAGE_PAD = 32


def backward_wgmma_dq_stage_row_bytes(head_dim: int) -> int:
    return head_dim * 4 + BACKWARD_WGMMA_DQ_STAGE_PAD


def backward_wgmma_dv_schedule(tile_q: int, head_dim: int) -> tuple[str, bool]:
    """(order, waited) of dV's wgmma in the q loop (lower_backward's _WGMMA_ORDERS). "late" (dV and dK
    issued together after dS^T) was the faster at every shape measured (bench/NOTES.md) and the
    lightest on registers; "early" overlaps dV with
    dS^T's arithmetic but keeps P^T's fragments alive over it (at tile q 128 it spills unless dS^T waits
    for dV: ("early", True))."""
    return ("late", False)


def backward_wgmma_layout(spec: KernelSpec, limits: DeviceLimits) -> BackwardLayout:
    """The wgmma backward's main kernel: 2 warpgroups, each owning 64 kv rows of the 128-row kv tile
    (check_backward's rule); K, V, Q, dO as 128-byte-swizzled 64-column panels (wgmma.cuh.j2)."""
    b, p = spec.backward, spec.problem
    d, dv, Br, Bc, S = p.head_dim_qk, p.head_dim_v, b.tile_q, b.tile_kv, b.stages
    tile_key = "backward.tile" if spec.span_of("backward.tile") else "backward"
    require(Br in BACKWARD_WGMMA_TILE_Q, spec, tile_key,
             f"tile q = {Br}: the wgmma backward steps 64 or 128 query rows (dS^T's 64-column panels)",
             "use tile q = 64 or 128")
    threads = 32 * b.warps
    for dim in (d, dv):
        require(threads % (dim // 8) == 0 and (threads // (dim // 8)) % 8 == 0, spec, "head_dim",
                 f"{threads} threads do not copy whole groups of 8 rows of a {dim}-wide tile per pass")
    split = backward_wgmma_dq_split(Br, d)
    buffers, end = [], 0

    def add(name, nbytes, stages=1, formula=""):
        nonlocal end
        buffers.append(Buffer(name, end, nbytes * stages, SWIZZLE_ATOM, stages, nbytes if stages > 1 else 0,
                              "wgmma 64-col panels" if name not in ("LSE", "D") else "fp32", formula))
        end = align(end + nbytes * stages, SWIZZLE_ATOM)
    add("K", Bc * d * 2, 1, f"Bc*d*2 = {Bc}*{d}*2 (kept for the whole q loop)")
    add("V", Bc * dv * 2, 1, f"Bc*dv*2 = {Bc}*{dv}*2 (kept for the whole q loop)")
    add("Q", Br * d * 2, S, f"{S}x Br*d*2 = {S}x {Br}*{d}*2")
    add("dO", Br * dv * 2, S, f"{S}x Br*dv*2 = {S}x {Br}*{dv}*2")
    add("dS^T", Bc * Br * 2, 1, f"Bc*Br*2 = {Bc}*{Br}*2 (A operand, MN-major, of dQ_i = dS K_j)")
    add("LSE", Br * 4, S, f"{S}x Br*4")
    add("D", Br * 4, S, f"{S}x Br*4")
    if split != "k":   # dQ_i in fp32, flushed to dQ_accum by coalesced atomics while the next step's wgmmas run
        add("dQ_i staging", Br * backward_wgmma_dq_stage_row_bytes(d), 1,
            f"Br*(d*4+{BACKWARD_WGMMA_DQ_STAGE_PAD}) = {Br}*({d}*4+{BACKWARD_WGMMA_DQ_STAGE_PAD})")
    dq_cols = d // 2 if split == "n" else d
    acc = [Registers("dK accumulator", d // 2, f"d/2 = {d}/2 (64 x d over a warpgroup)", True),
           Registers("dV accumulator", dv // 2, f"dv/2 = {dv}/2", True),
           Registers("S^T/P^T", Br // 2, f"Br/2 = {Br}/2", True),
           Registers("dP^T/dS^T", Br // 2, f"Br/2 = {Br}/2", True),
           Registers("P^T, dS^T fragments", Br // 2, f"2 x Br/4 = 2 x {Br}/4"),
           Registers("dQ_i accumulator", dq_cols // 2, f"{dq_cols}/2 (dQ split {split}; after S^T, dP^T die)"),
           Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    live = [r for r in acc if r.accumulator]
    estimate = sum(r.amount for r in live)
    require(estimate <= thread_register_limit(threads, limits), spec, tile_key,
             f"registers: ~{estimate} per thread estimated (" + " + ".join(f"{r.name} {r.amount}" for r in live)
             + f") > {thread_register_limit(threads, limits)} available", "use tile q = 64")
    require(end <= limits.max_shared_per_block, spec, tile_key if S == 1 else "backward.pipeline",
             f"shared memory: {end} bytes needed (" + " + ".join(f"{b.name} {b.bytes}" for b in buffers)
             + f") > {limits.max_shared_per_block} available", "use fewer stages or a smaller tile q")
    main = finish(spec, "backward_wgmma", limits, buffers, end, acc, threads, 1, stages=S, rows_per_warp=16,
                   launch_registers=estimate)   # the peak live set, not the sum of lifetimes that never overlap
    return BackwardLayout(main, 1, 1, 2 if split == "m" else 1, dq_cols, dq_split=split)
