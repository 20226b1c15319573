"""The layout pass: every size of a kernel, computed once from its spec and the device limits.

`layout_of(spec)` places each shared-memory buffer (offset, bytes, alignment, swizzle or padding,
ring stages), estimates registers per thread, and picks threads and min blocks per SM; it raises
SpecError, at the spec line, for every resource rule (shared memory, registers, threads) and every
shape rule a family's template needs. Everything else reads it: the checker (so `check` refuses
exactly what lowering refuses), passes.Legality, the lowerings (their plan constants), explain's
on-chip budget and the tuner. One function per family variant, in LAYOUTS.

Dtypes without a CUDA template (fp32) get `_graph_model`: the scheduler
graph's dense-tile model, so `explain` can still show a budget; lowering refuses them anyway.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .device_limits import H200, SMEM_RESERVED_PER_BLOCK, DeviceLimits, resident_blocks
from .errors import SpecError
from .spec import DTYPE_BYTES, Axis, DType, Family, KernelSpec, LoopOrder, Mma

SMEM_ALIGN = 128           # every buffer of the mma.sync kernels starts on a 128-byte line
SWIZZLE_ATOM = 1024        # wgmma panels: 8 swizzled 128-byte rows; panels start on this alignment
PANEL_COLUMNS = 64         # 16-bit columns of one 128-byte swizzled wgmma panel
WARPGROUP_WARPS = 4
WGMMA_ROWS = 64            # rows of one warpgroup's m64 wgmma
# Addresses, indices, loop state and the softmax bounds: a ballpark measured from ptxas reports.
REGISTER_OVERHEAD = 40
ACCUMULATOR_BUDGET = 128   # FA1 split-K: O + S registers per thread that leave room (measured) for the rest
FA1_COMBINE_PAD_FLOATS = 8     # float2 stores of a half-warp cover rows r..r+3 at 8-word offsets: 32 banks
DECODE_COMBINE_PAD_FLOATS = 4  # the quads' float2 stores of a staged O row spread over the banks
MBARRIER_BYTES = 8
MMA_K = 16                 # mma.sync m16n8k16: head-dim columns per k step (and per ldmatrix.x4 row pair)


@dataclass(frozen=True)
class Buffer:
    name: str
    offset: int
    bytes: int
    align: int
    stages: int = 1
    stage_bytes: int = 0
    layout: str = ""           # e.g. "xor-swizzled 256 B rows", "padded 144 B rows", "wgmma 64-col panels"
    formula: str = ""          # how `bytes` is counted, with the numbers
    reuses: str = ""           # the buffer whose bytes this one reuses (not counted twice)


@dataclass(frozen=True)
class Registers:
    """One line of the per-thread register estimate."""
    name: str
    amount: int
    formula: str
    accumulator: bool = False  # lives across the whole kv loop (the legality rule counts these)


@dataclass(frozen=True)
class Layout:
    family: str                # layout function that made it: fa2, fa2_wgmma, fa1, decode, graph model
    arch: str
    buffers: tuple[Buffer, ...]
    smem_bytes: int            # dynamic shared memory the kernel declares (SMEM_BYTES) and launches with
    smem_limit: int
    registers: tuple[Registers, ...]
    register_estimate: int     # feeds __launch_bounds__ (min blocks) and the Q-in-registers choice
    register_limit: int
    threads: int
    min_blocks_per_sm: int     # what __launch_bounds__ promises ptxas
    resident_blocks: int       # device_limits.resident_blocks from the estimate, threads and shared memory
    limit_reason: str          # what limits resident_blocks: registers | shared | threads | blocks
    blocks_by_shared: int      # blocks per SM that shared memory alone allows
    stages: int = 1
    rows_per_warp: int = 0
    keys_per_warp: int = 0
    q_in_registers: bool = False
    generated: bool = True     # False: the graph model of a family or dtype with no template

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    @property
    def accumulator_registers(self) -> int:
        return sum(r.amount for r in self.registers if r.accumulator)


def align(n: int, to: int = SMEM_ALIGN) -> int:
    return -(-n // to) * to


def mma_width(dim: int) -> int:
    """Columns a head dim occupies on chip for mma.sync (m16n8k16 steps and ldmatrix.x4 read 16
    columns at a time): `dim` rounded up to 16. A head dim that is a multiple of 8 but not of 16
    gets one zero 8-column chunk per shared-memory row; HBM is never padded."""
    return -(-dim // MMA_K) * MMA_K


def tile_row_bytes(dim: int) -> tuple[int, bool]:
    """Bytes per shared-memory row of a 16-bit tile with `dim` columns (padded to mma_width), and
    whether it is swizzled. Rows of a multiple of 64 elements are XOR-swizzled; others get one
    16-byte pad (an odd number of 16-byte chunks per row: ldmatrix's 8 rows hit 8 bank groups)."""
    width = mma_width(dim)
    if width % 64 == 0:
        return width * 2, True
    return (width + 8) * 2, False


def _row_text(dim: int) -> str:
    row, swizzled = tile_row_bytes(dim)
    return f"xor-swizzled {row} B rows" if swizzled else f"padded {row} B rows"


def _row_formula(rows: str, dim: str, width: int) -> str:
    row, _ = tile_row_bytes(width)
    pad = row // 2 - width
    return f"{rows}*({dim}+{pad})*2" if pad else f"{rows}*{dim}*2"


def _refuse(spec: KernelSpec, key: str, message: str, hint: str = ""):
    raise SpecError(message, spec.span_of(key), spec.source_text, hint)


def _require(ok: bool, spec: KernelSpec, key: str, message: str, hint: str = "") -> None:
    if not ok:
        _refuse(spec, key, message, hint)


def cp_async_pending(family: Family, stages: int, tile: str, prefetch_first: bool = True) -> int:
    """cp.async groups a kernel leaves in flight when it waits for `tile` ("k", "v", or "kv" for
    FA1's joint wait) of step j; the lowering emits it and explain prints it."""
    if family is Family.FA1:
        return 0 if stages == 1 else stages - 2
    if family is Family.DECODE:
        if stages == 1:
            return 1   # K and V refilled half a step apart: the other one is in flight
        return (2 * stages - 1 if prefetch_first else 2 * stages - 3) if tile == "k" else 2 * stages - 2
    if stages == 1:
        return 1 if tile == "k" else 0
    return 2 * stages - 3 if tile == "k" else 2 * stages - 2


# ---- the pieces every family shares -------------------------------------------------------------

def _qkv_buffers(spec: KernelSpec, tile_q: int, tile_kv: int, stages: int, q_row: int, v_row: int,
                 round_to: int, panels: bool = False) -> list[Buffer]:
    """Q once, then the K and V rings, each buffer starting on `round_to`."""
    p = spec.problem
    if panels:
        qk_text = v_text = f"wgmma {PANEL_COLUMNS}-col panels, 128 B swizzle"
        qk_f = v_f = "{r}*{d}*2"
    else:
        qk_text, v_text = _row_text(p.head_dim_qk), _row_text(p.head_dim_v)
        qk_f = _row_formula("{r}", "{d}", p.head_dim_qk)
        v_f = _row_formula("{r}", "{d}", p.head_dim_v)
    q_bytes, k_stage, v_stage = tile_q * q_row, tile_kv * q_row, tile_kv * v_row
    k_offset = align(q_bytes, round_to)
    v_offset = align(k_offset + stages * k_stage, round_to)
    return [
        Buffer("Q", 0, q_bytes, round_to, layout=qk_text,
               formula=qk_f.format(r="Br", d="d") + " = " + qk_f.format(r=tile_q, d=p.head_dim_qk)),
        Buffer("K", k_offset, stages * k_stage, round_to, stages, k_stage, qk_text,
               f"{stages}x " + qk_f.format(r="Bc", d="d") + f" = {stages}x " + qk_f.format(r=tile_kv, d=p.head_dim_qk)),
        Buffer("V", v_offset, stages * v_stage, round_to, stages, v_stage, v_text,
               f"{stages}x " + v_f.format(r="Bc", d="dv") + f" = {stages}x " + v_f.format(r=tile_kv, d=p.head_dim_v)),
    ]


def _end(buffers: list[Buffer], round_to: int = SMEM_ALIGN) -> int:
    return align(max(b.offset + b.bytes for b in buffers), round_to)


def _register_limit(threads: int, limits: DeviceLimits) -> int:
    return min(limits.max_registers_per_thread, limits.registers_per_sm // max(threads, 1))


def _finish(spec: KernelSpec, family: str, limits: DeviceLimits, buffers: list[Buffer], smem: int,
            registers: list[Registers], threads: int, min_blocks: int, register_limit: int | None = None,
            launch_registers: int | None = None, **extra) -> Layout:
    """The resource rules every family shares (threads, shared memory, accumulator registers), then
    the Layout with resident blocks (`launch_registers`: what a thread holds at launch, where that
    is not the estimate: a warp-specialized kernel's warpgroups re-balance theirs afterwards)."""
    estimate = sum(r.amount for r in registers)
    layout = Layout(family, limits.arch, tuple(buffers), smem, limits.max_shared_per_block, tuple(registers), estimate,
                    register_limit or _register_limit(threads, limits), threads, min_blocks,
                    *resident_blocks(limits, launch_registers or estimate, threads, smem),
                    limits.shared_per_sm // (smem + SMEM_RESERVED_PER_BLOCK), **extra)
    hopper = spec.family is Family.HOPPER
    if threads > limits.max_threads_per_block:
        _refuse(spec, "warpgroups" if hopper else "warps",
                f"{threads} threads per block > {limits.max_threads_per_block}")
    if smem > layout.smem_limit:
        _refuse_shared(spec, layout)
    accumulators = layout.accumulator_registers
    if accumulators > layout.register_limit:
        parts = " + ".join(f"{r.name} {r.amount}" for r in registers if r.accumulator)
        _refuse(spec, "warpgroups" if hopper else "tile",
                f"registers: ~{accumulators} per thread estimated ({parts}) > {layout.register_limit} available",
                "use smaller tiles or more warps")
    return layout


def _refuse_shared(spec: KernelSpec, layout: Layout):
    counted = [b for b in layout.buffers if not b.reuses]
    parts = " + ".join(f"{b.name} {b.stages}x{b.stage_bytes}" if b.stages > 1 else f"{b.name} {b.bytes}"
                       for b in counted)
    padding = layout.smem_bytes - sum(b.bytes for b in counted)
    if padding > 0:
        parts += f" + alignment {padding}"
    stages = layout.stages
    per_stage = sum(b.stage_bytes for b in counted)
    fit = (layout.smem_limit - (layout.smem_bytes - per_stage * stages)) // per_stage if per_stage else 0
    key = "pipeline" if stages > 1 and fit >= 1 else "tile"
    hint = f"at most {fit} stages fit with these tiles" if fit >= 1 else "use smaller tiles (or a smaller head dim)"
    _refuse(spec, key, f"shared memory: {layout.smem_bytes} bytes needed ({parts}) > {layout.smem_limit} available "
            f"on {layout.arch}", hint)


# ---- fa2 on mma.sync ----------------------------------------------------------------------------

def _fa2(spec: KernelSpec, limits: DeviceLimits, min_blocks_per_sm: int | None = None,
         q_in_registers: bool | None = None) -> Layout:
    p, s = spec.problem, spec.schedule
    rows_per_warp = s.tile_q // s.warps
    _require(p.head_dim_qk % 8 == 0 and p.head_dim_v % 8 == 0, spec, "head_dim",
             f"head dim qk {p.head_dim_qk} / v {p.head_dim_v}: fa2 needs multiples of 8 (16-byte rows; "
             "padded to 16 on chip for mma m16n8k16)", "use a head dim that is a multiple of 8")
    _split_q_rules(spec, "fa2", " (mma m16n8k16)")
    d_mma, dv_mma = mma_width(p.head_dim_qk), mma_width(p.head_dim_v)
    m_tiles, threads = rows_per_warp // 16, s.warps * 32
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    buffers = _qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, qk_row, v_row, SMEM_ALIGN)
    end = _end(buffers)
    end = _stage_o(spec, buffers, end)
    slots, entries = fa2_page_ring(p.kv_page_size, s.tile_kv, s.stages)
    if slots:
        buffers.append(Buffer("block-table entries", end, slots * entries * 4, SMEM_ALIGN, slots, entries * 4,
                              "int32 page indices, a slot per kv tile", f"{slots}x {entries}x4"))
        end = _end(buffers)

    acc_o, acc_s = m_tiles * dv_mma // 2, m_tiles * s.tile_kv // 2
    q_regs, k_frag = m_tiles * d_mma // 4, s.tile_kv // 4
    base = acc_o + acc_s + k_frag + REGISTER_OVERHEAD
    if q_in_registers is None:
        q_in_registers = base + q_regs <= limits.max_registers_per_thread
    registers = [Registers("O accumulator", acc_o, f"M_TILES*dv/2 = {m_tiles}*{dv_mma}/2", True),
                 Registers("S/P accumulator", acc_s, f"M_TILES*Bc/2 = {m_tiles}*{s.tile_kv}/2", True),
                 Registers("K fragments", k_frag, f"Bc/4 = {s.tile_kv}/4"),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    if q_in_registers:
        registers.append(Registers("Q fragments", q_regs, f"M_TILES*d/4 = {m_tiles}*{d_mma}/4"))
    estimate = sum(r.amount for r in registers)
    if min_blocks_per_sm is None:   # two blocks when half the registers and half the shared memory suffice
        min_blocks_per_sm = 2 if estimate <= 128 - 8 and 2 * end <= limits.max_shared_per_block else 1
    return _finish(spec, "fa2", limits, buffers, end, registers, threads, min_blocks_per_sm, stages=s.stages,
                   rows_per_warp=rows_per_warp, keys_per_warp=s.tile_kv, q_in_registers=q_in_registers)


def _stage_o(spec: KernelSpec, buffers: list[Buffer], end: int) -> int:
    """mma.sync kernels stage the final O for coalesced stores: in Q's rows when the row layouts
    match (each warp reuses only its own rows), else after `end`. Returns the new end."""
    p, s = spec.problem, spec.schedule
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    if (v_row, v_swizzle) == (qk_row, qk_swizzle):
        buffers.append(Buffer("O staging", 0, s.tile_q * v_row, SMEM_ALIGN, layout=_row_text(p.head_dim_v),
                              formula="in Q's rows after the kv loop", reuses="Q"))
        return end
    buffers.append(Buffer("O staging", end, s.tile_q * v_row, SMEM_ALIGN, layout=_row_text(p.head_dim_v),
                          formula=_row_formula("Br", "dv", p.head_dim_v)))
    return align(end + s.tile_q * v_row)


def _split_q_rules(spec: KernelSpec, family: str, why: str = "") -> None:
    """Warps along q (fa1 split-Q, fa2): whole 16-row mma tiles per warp, kv tiles in 16-key steps."""
    s = spec.schedule
    _require(s.tile_q % s.warps == 0 and s.tile_q // s.warps % 16 == 0 and s.tile_q >= s.warps, spec, "warps",
             f"{s.warps} warps along q give {s.tile_q / s.warps:g} rows each; {family} needs a multiple of 16",
             f"use tile q = {16 * s.warps} or a multiple")
    _require(s.tile_kv % 16 == 0, spec, "tile", f"tile kv = {s.tile_kv} is not a multiple of 16{why}",
             "use tile kv = 32, 64 or 128")


# ---- fa2 on wgmma -------------------------------------------------------------------------------

def _fa2_wgmma(spec: KernelSpec, limits: DeviceLimits) -> Layout:
    p, s = spec.problem, spec.schedule
    _require(s.warps % WARPGROUP_WARPS == 0 and s.tile_q == s.warps // WARPGROUP_WARPS * WGMMA_ROWS, spec, "warps",
             f"wgmma needs whole warpgroups of 4 warps, each owning {WGMMA_ROWS} query rows: tile q = {s.tile_q} "
             f"with {s.warps} warps is not {WGMMA_ROWS} rows per warpgroup", "e.g. tile q = 128 with warps 8 along q")
    _require(p.head_dim_qk % PANEL_COLUMNS == 0 and p.head_dim_v % PANEL_COLUMNS == 0, spec, "head_dim",
             f"the wgmma layout stores 64-column panels: head dims must be multiples of 64, got "
             f"{p.head_dim_qk}/{p.head_dim_v}", "head_dim = 64, 128 or 256")
    _require(s.tile_kv % 16 == 0 and 16 <= s.tile_kv <= 256 and p.head_dim_v <= 256, spec, "tile",
             f"wgmma n must be a multiple of 16 up to 256: tile kv = {s.tile_kv}, head dim v = {p.head_dim_v}")
    threads = s.warps * 32
    _require(threads % (p.head_dim_qk // 8) == 0 and (threads // (p.head_dim_qk // 8)) % 8 == 0, spec, "warps",
             f"{threads} threads do not copy whole groups of 8 rows of a {p.head_dim_qk}-wide tile per pass")
    buffers = _qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, p.head_dim_qk * 2, p.head_dim_v * 2, SWIZZLE_ATOM,
                           panels=True)
    end = _end(buffers, SWIZZLE_ATOM)
    v_row, _ = tile_row_bytes(p.head_dim_v)
    o_bytes = s.tile_q * v_row
    # O is staged for coalesced stores in Q's space once every warpgroup is past its last Q K^T.
    o_offset = 0 if o_bytes <= buffers[0].bytes else end
    buffers.append(Buffer("O staging", o_offset, o_bytes, SWIZZLE_ATOM, layout=_row_text(p.head_dim_v),
                          formula=_row_formula("Br", "dv", p.head_dim_v), reuses="Q" if o_offset == 0 else ""))
    smem = max(end, o_offset + o_bytes)
    registers = [Registers("O accumulator", p.head_dim_v // 2, f"dv/2 = {p.head_dim_v}/2", True),
                 Registers("S/P accumulator", s.tile_kv // 2, f"Bc/2 = {s.tile_kv}/2", True),
                 Registers("P fragments", s.tile_kv // 4, f"Bc/4 = {s.tile_kv}/4"),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    return _finish(spec, "fa2_wgmma", limits, buffers, smem, registers, threads, 1, stages=s.stages,
                   rows_per_warp=16, keys_per_warp=s.tile_kv)


# ---- hopper: warp-specialized producer / consumers ------------------------------------------------

TMA_BOX_MAX = 256          # rows of one TMA box
WARPGROUP_THREADS = 128
HOPPER_CONSUMER_OVERHEAD = 16   # a consumer keeps loop state and barrier addresses; the producer computes the copies


def hopper_barriers(stages: int) -> int:
    """mbarriers of the hopper kernel: Q full and empty, then K and V full and empty per stage."""
    return 2 + 4 * stages


def _hopper(spec: KernelSpec, limits: DeviceLimits) -> Layout:
    p, s = spec.problem, spec.schedule
    consumers = s.consumer_warpgroups
    _require(p.head_dim_qk % PANEL_COLUMNS == 0 and p.head_dim_v % PANEL_COLUMNS == 0 and p.head_dim_v <= p.head_dim_qk,
             spec, "head_dim", f"the hopper family loads 64-column TMA panels and stages O in Q's: head dims must be "
             f"multiples of 64 with head_dim_v <= head_dim, got {p.head_dim_qk}/{p.head_dim_v}",
             "head_dim = 64, 128 or 256; other head dims: the fa2 family")
    _require(16 <= s.tile_kv <= TMA_BOX_MAX and s.tile_kv % 16 == 0, spec, "tile",
             f"tile kv = {s.tile_kv}: a TMA box and a wgmma n hold at most {TMA_BOX_MAX} keys, in steps of 16",
             "tile kv = 64, 128 or 176")
    _require(s.tile_q == WGMMA_ROWS * consumers and s.tile_q <= TMA_BOX_MAX, spec, "tile",
             f"tile q = {s.tile_q}: each of the {consumers} consumer warpgroups owns {WGMMA_ROWS} query rows, and Q's "
             f"TMA box holds at most {TMA_BOX_MAX}", f"use tile q = {WGMMA_ROWS * consumers}")
    total = WARPGROUP_THREADS * (s.producer_warpgroups * s.producer_regs + consumers * s.consumer_regs)
    _require(total <= limits.registers_per_sm, spec, "warpgroups",
             f"registers: {total} per block ({WARPGROUP_THREADS} x ({s.producer_warpgroups}x{s.producer_regs} + "
             f"{consumers}x{s.consumer_regs})) > {limits.registers_per_sm} per SM")
    threads = WARPGROUP_THREADS * (s.producer_warpgroups + consumers)
    buffers = _qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, p.head_dim_qk * 2, p.head_dim_v * 2, SWIZZLE_ATOM,
                           panels=True)
    kv_end = _end(buffers, SWIZZLE_ATOM)
    barriers = hopper_barriers(s.stages)
    barrier_bytes = MBARRIER_BYTES * barriers
    o_bytes = s.tile_q * p.head_dim_v * 2
    # O gets its own panels when they fit, so the producer can load the next item's Q while the
    # consumers store this one's O (persistent launch); else O is staged in Q's (dv <= d).
    o_in_q = kv_end + o_bytes + barrier_bytes > limits.max_shared_per_block
    o_offset = 0 if o_in_q else kv_end
    buffers.append(Buffer("O staging", o_offset, o_bytes, SWIZZLE_ATOM, layout=f"wgmma {PANEL_COLUMNS}-col panels",
                          formula=f"Br*dv*2 = {s.tile_q}*{p.head_dim_v}*2", reuses="Q" if o_in_q else ""))
    bar_offset = kv_end if o_in_q else kv_end + o_bytes
    buffers.append(Buffer("mbarriers", bar_offset, barrier_bytes, MBARRIER_BYTES,
                          formula=f"{barriers} x {MBARRIER_BYTES} (Q full/empty; K, V full/empty x {s.stages})"))
    smem = bar_offset + barrier_bytes
    # A consumer holds O and S (and, while P V of the previous tile is in flight, its P fragments).
    registers = [Registers("O accumulator", p.head_dim_v // 2, f"dv/2 = {p.head_dim_v}/2", True),
                 Registers("S/P accumulator", s.tile_kv // 2, f"Bc/2 = {s.tile_kv}/2", True),
                 Registers("P fragments", s.tile_kv // 4, f"Bc/4 = {s.tile_kv}/4", True),
                 Registers("loop state, barriers", HOPPER_CONSUMER_OVERHEAD, "allowance (consumer)", True)]
    entry = limits.registers_per_sm // threads // 8 * 8   # __launch_bounds__(threads, 1) before setmaxnreg
    return _finish(spec, "hopper", limits, buffers, smem, registers, threads, 1, s.consumer_regs, launch_registers=entry,
                   stages=s.stages, rows_per_warp=16, keys_per_warp=s.tile_kv)


# ---- fa1 ----------------------------------------------------------------------------------------

def rows_per_pass(spec: KernelSpec) -> int:
    """FA1 split-K: how many of the q tile's rows a warp holds at a time. Every warp keeps a partial
    O of all the rows it works on, so a 64-row tile at d64 would need 128 accumulator registers for
    O alone; the tile is walked in passes of the most rows whose O and S fit ACCUMULATOR_BUDGET."""
    p, s = spec.problem, spec.schedule
    keys_per_warp = s.tile_kv // s.warps
    m_tiles = s.tile_q // 16
    while m_tiles > 1 and ((s.tile_q // 16) % m_tiles or m_tiles * (p.head_dim_v + keys_per_warp) // 2 > ACCUMULATOR_BUDGET):
        m_tiles -= 1
    return 16 * m_tiles


def _fa1(spec: KernelSpec, limits: DeviceLimits, min_blocks_per_sm: int | None = None,
         pass_rows: int | None = None) -> Layout:
    p, s = spec.problem, spec.schedule
    _require(p.head_dim_qk % 16 == 0 and p.head_dim_v % 16 == 0, spec, "head_dim",
             f"fa1 needs head dims that are multiples of 16 (mma m16n8k16, ldmatrix.x4), got {p.head_dim_qk}/{p.head_dim_v}")
    split_k = s.warp_axis is Axis.KV
    if split_k:
        keys_per_warp = s.tile_kv // s.warps
        _require(s.tile_q % 16 == 0, spec, "tile", f"tile q = {s.tile_q} is not a multiple of 16 (mma rows)",
                 "use tile q = 16, 32 or 64")
        _require(s.tile_kv % s.warps == 0 and keys_per_warp % 16 == 0, spec, "warps",
                 f"{s.warps} warps along kv give {s.tile_kv / s.warps:g} keys each, not a multiple of 16 "
                 "(fa1 split-K multiplies whole m16n8k16 steps)", f"use tile kv = {16 * s.warps} or a multiple")
        rows_per_warp = pass_rows or rows_per_pass(spec)
        _require(rows_per_warp % 16 == 0 and s.tile_q % rows_per_warp == 0, spec, "tile",
                 f"split-K passes of {rows_per_warp} rows must be a multiple of 16 that divides tile q = {s.tile_q}")
    else:
        rows_per_warp, keys_per_warp = s.tile_q // s.warps, s.tile_kv
        _split_q_rules(spec, "fa1")
    m_tiles, threads = rows_per_warp // 16, s.warps * 32
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    buffers = _qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, qk_row, v_row, SMEM_ALIGN)
    end = _end(buffers)
    combine_row = p.head_dim_v + FA1_COMBINE_PAD_FLOATS
    if split_k:
        # o[rows][DV + pad], m per warp [WARPS][rows], combined m [rows], l [rows] (combine.cuh's layout)
        combine_bytes = 4 * rows_per_warp * (combine_row + s.warps + 2)
        buffers.append(Buffer("O staging", 0, s.tile_q * v_row, SMEM_ALIGN, layout=_row_text(p.head_dim_v),
                              formula="in Q's rows", reuses="Q"))
        buffers.append(Buffer("warp partials", end, combine_bytes, SMEM_ALIGN, layout=f"fp32 rows of {combine_row} floats",
                              formula=f"4*rows*(dv+{FA1_COMBINE_PAD_FLOATS}+warps+2) = 4*{rows_per_warp}*"
                              f"({combine_row}+{s.warps}+2)"))
        end = align(end + combine_bytes)
    else:
        end = _stage_o(spec, buffers, end)
    # O and S accumulators, one k-slice of Q fragments, a K fragment pair.
    registers = [Registers("O accumulator", m_tiles * p.head_dim_v // 2, f"M_TILES*dv/2 = {m_tiles}*{p.head_dim_v}/2", True),
                 Registers("S/P accumulator", m_tiles * keys_per_warp // 2, f"M_TILES*keys/2 = {m_tiles}*{keys_per_warp}/2",
                           True),
                 Registers("Q, K fragments", 4 * m_tiles + 4, f"4*M_TILES + 4 = 4*{m_tiles} + 4"),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    # One block per (batch, head): rarely more blocks than SMs, so no occupancy promise.
    return _finish(spec, "fa1", limits, buffers, end, registers, threads, min_blocks_per_sm or 1, stages=s.stages,
                   rows_per_warp=rows_per_warp, keys_per_warp=keys_per_warp)


# ---- decode -------------------------------------------------------------------------------------

def _decode(spec: KernelSpec, limits: DeviceLimits, stages: int | None = None, tile_kv: int | None = None) -> Layout:
    p, s = spec.problem, spec.schedule
    stages = s.stages if stages is None else stages
    tile_kv = s.tile_kv if tile_kv is None else tile_kv
    # Two 16-row tiles (O alone 128 registers a thread) spill at 255 registers; groups of more
    # than 16 packed rows run as several row tiles instead, each in its own block.
    _require(s.tile_q == 16, spec, "tile",
             f"decode packs query rows into one 16-row MMA tile; tile q = {s.tile_q} is not 16 (larger "
             "kv groups are split into several row tiles at launch)", "tile q = 16")
    _require(tile_kv % (16 * s.warps) == 0 and tile_kv > 0, spec, "warps",
             f"{s.warps} warps along kv give tile kv = {tile_kv} / {s.warps} keys per warp; decode needs a multiple of 16")
    _require(p.head_dim_qk % 16 == 0 and p.head_dim_v % 16 == 0, spec, "head_dim",
             "decode needs head dims that are multiples of 16 (mma m16n8k16)")
    _require(stages >= 1, spec, "pipeline", "decode needs at least one pipeline stage")
    _require(not p.kv_fp8 or (p.head_dim_qk % 32 == 0 and p.head_dim_v % 32 == 0), spec, "kv_dtype",
             f"an FP8 KV cache needs head dims that are multiples of 32 (whole 16-byte chunks, two per row: a warp's "
             f"16-key slice is one cp.async pass); head dims are {p.head_dim_qk} / {p.head_dim_v}",
             "remove `kv_dtype`, or use head dims 32, 64, 96, 128, ...")
    convert = fp8_convert_of(spec)
    threads, m_tiles, keys_per_warp = s.warps * 32, s.tile_q // 16, tile_kv // s.warps
    qk_row, _ = tile_row_bytes(p.head_dim_qk)
    v_row, _ = tile_row_bytes(p.head_dim_v)
    if p.kv_fp8:
        buffers = _fp8_kv_buffers(spec, s.tile_q, tile_kv, stages, qk_row, v_row, convert)
    else:
        buffers = _qkv_buffers(spec, s.tile_q, tile_kv, stages, qk_row, v_row, SMEM_ALIGN)
    end = _end(buffers)
    # After the kv loop the same bytes hold the warps' states for the combine (Q is no longer read,
    # the pipeline is drained): combine.cuh's o[rows][DV + pad], m per warp, m, l.
    combine_row = p.head_dim_v + DECODE_COMBINE_PAD_FLOATS
    combine_bytes = 4 * (s.tile_q * combine_row + (s.warps + 2) * s.tile_q)
    buffers.append(Buffer("warp partials", 0, combine_bytes, SMEM_ALIGN, layout=f"fp32 rows of {combine_row} floats",
                          formula=f"4*(rows*(dv+{DECODE_COMBINE_PAD_FLOATS}) + (warps+2)*rows)", reuses="Q, K, V"))
    smem = max(end, align(combine_bytes))
    # Q stays in registers when that fits (one 16-row tile: yes); else mma_qk reads it from shared.
    registers = [Registers("O accumulator", m_tiles * p.head_dim_v // 2, f"M_TILES*dv/2 = {m_tiles}*{p.head_dim_v}/2", True),
                 Registers("S/P accumulator", m_tiles * keys_per_warp // 2, f"M_TILES*keys/2 = {m_tiles}*{keys_per_warp}/2",
                           True),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    if convert == "fragments":
        registers.append(Registers("e4m3 conversion", FP8_FRAGMENT_REGISTERS, "allowance (ptxas ballpark)"))
    q_regs = m_tiles * p.head_dim_qk // 4
    q_in_registers = sum(r.amount for r in registers) + q_regs <= limits.max_registers_per_thread
    if q_in_registers:
        registers.append(Registers("Q fragments", q_regs, f"M_TILES*d/4 = {m_tiles}*{p.head_dim_qk}/4"))
    # Never ask ptxas for more than 2 blocks' worth of registers: 2 x 128 threads still allow 255.
    by_shared = max(1, limits.shared_per_sm // (smem + SMEM_RESERVED_PER_BLOCK))   # = Layout.blocks_by_shared, >= 1
    min_blocks = min(by_shared, 2)
    if s.min_blocks is not None:   # the schedule's promise (benchmarks try 3-4 where shared memory allows)
        _require(1 <= s.min_blocks <= by_shared, spec, "warps",
                 f"min blocks {s.min_blocks} per SM: shared memory ({smem} B a block) allows 1..{by_shared}")
        min_blocks = s.min_blocks
    return _finish(spec, "decode", limits, buffers, smem, registers, threads, min_blocks, stages=stages,
                   rows_per_warp=s.tile_q, keys_per_warp=keys_per_warp, q_in_registers=q_in_registers)


# How decode turns an FP8 (e4m3) KV cache into MMA operands; the first is the default.
#   shared:    each warp converts its slice of the e4m3 ring into a 16-bit tile in shared memory,
#              which ldmatrix then reads (one more shared-memory pass and tile per K and V).
#   fragments: ldmatrix reads the e4m3 ring itself (each lane gets the bytes of its m16n8k16
#              fragment), and the lanes convert in registers; no 16-bit tile.
FP8_CONVERTS = ("shared", "fragments")
FP8_CONVERT_DEFAULT = FP8_CONVERTS[0]
# Registers the fragments path's ldmatrix words and converted pairs hold beyond the shared path's,
# a ballpark from ptxas (sm_90a, 2026-12-01): with it Q leaves the registers (mma_qk_fp8 reads its
# fragments from shared memory per k step) from head dim 192 at 128-key tiles and 224 at 64, where
# ptxas spilled 8-288 bytes with Q in registers; at 128 and 160 Q stays, spill-free.
FP8_FRAGMENT_REGISTERS = 56


def fp8_convert_of(spec: KernelSpec) -> str:
    """The FP8 conversion path of a decode spec (FP8_CONVERTS), SpecError for an unknown value or
    one set without an FP8 KV cache; "" for a 16-bit cache."""
    p, value = spec.problem, spec.schedule.fp8_convert
    _require(value is None or value in FP8_CONVERTS, spec, "kv_dtype",
             f"unknown fp8_convert {value!r}", "one of " + ", ".join(FP8_CONVERTS))
    _require(value is None or p.kv_fp8, spec, "kv_dtype", "fp8_convert needs `kv_dtype = e4m3`")
    if not p.kv_fp8:
        return ""
    return value or FP8_CONVERT_DEFAULT


def kv_stage_row_bytes(dim: int, kv_dtype: DType, convert: str = FP8_CONVERT_DEFAULT) -> int:
    """Bytes per shared-memory row of an FP8 K/V staging tile: the HBM row as it is (dim elements
    of kv_dtype, dim a multiple of 16: whole 16-byte chunks). For `shared` unswizzled: only the
    converting pass reads it, each lane one 16-byte chunk of consecutive chunks (no bank
    conflicts). For `fragments` ldmatrix reads 8 rows' 16-byte chunks at once; rows whose chunk
    count kv_stage_swizzled accepts are XOR-swizzled, others padded to an odd number of chunks."""
    row = dim * DTYPE_BYTES[kv_dtype]
    if convert == "fragments" and not kv_stage_swizzled(row):
        row += 16 if (row // 16) % 2 == 0 else 0
    return row


def kv_stage_swizzled(row_bytes: int) -> bool:
    """Whether a `fragments` e4m3 row of row_bytes is XOR-swizzled (common.cuh's chunk_offset):
    2 or 4 chunks (several rows share a 128-byte line: the XOR takes the row bits above them) or a
    multiple of 8 chunks (the 16-bit tiles' swizzle)."""
    chunks = row_bytes // 16
    return row_bytes % 16 == 0 and (chunks in (2, 4) or chunks % 8 == 0)


def _fp8_kv_buffers(spec: KernelSpec, tile_q: int, tile_kv: int, stages: int, q_row: int, v_row: int,
                    convert: str) -> list[Buffer]:
    """Decode with an FP8 KV cache: Q, the K and V rings hold the e4m3 bytes as loaded (half a
    16-bit row); with `shared` also one dequantized K and V tile (16-bit mma.sync layout) that
    each warp refills from its slice of the ring just before its MMA reads it."""
    p = spec.problem
    k8, v8 = (kv_stage_row_bytes(d, p.kv_dtype, convert) for d in (p.head_dim_qk, p.head_dim_v))
    q_bytes, k_stage, v_stage = tile_q * q_row, tile_kv * k8, tile_kv * v8
    k_offset = align(q_bytes, SMEM_ALIGN)
    v_offset = align(k_offset + stages * k_stage, SMEM_ALIGN)
    e8 = p.kv_dtype.value

    def ring_text(row: int) -> str:
        if convert == "shared":
            return f"{e8} rows of {row} B"
        return f"{e8} rows of {row} B, " + ("xor-swizzled" if kv_stage_swizzled(row) else "padded")
    buffers = [
        Buffer("Q", 0, q_bytes, SMEM_ALIGN, layout=_row_text(p.head_dim_qk), formula=f"Br*row = {tile_q}*{q_row}"),
        Buffer("K", k_offset, stages * k_stage, SMEM_ALIGN, stages, k_stage, ring_text(k8),
               f"{stages}x Bc*{'d' if k8 == p.head_dim_qk else 'row'} = {stages}x {tile_kv}*{k8}"),
        Buffer("V", v_offset, stages * v_stage, SMEM_ALIGN, stages, v_stage, ring_text(v8),
               f"{stages}x Bc*{'dv' if v8 == p.head_dim_v else 'row'} = {stages}x {tile_kv}*{v8}"),
    ]
    if convert == "fragments":
        return buffers
    kd_offset = align(v_offset + stages * v_stage, SMEM_ALIGN)
    vd_offset = align(kd_offset + tile_kv * q_row, SMEM_ALIGN)
    return buffers + [
        Buffer("K dequantized", kd_offset, tile_kv * q_row, SMEM_ALIGN, layout=_row_text(p.head_dim_qk),
               formula=f"Bc*row = {tile_kv}*{q_row}"),
        Buffer("V dequantized", vd_offset, tile_kv * v_row, SMEM_ALIGN, layout=_row_text(p.head_dim_v),
               formula=f"Bc*row = {tile_kv}*{v_row}"),
    ]


DECODE_PAGE_ROWS_MIN = 16   # a page this long fills a warp's cp.async pass at any head dim (16 rows x 2+ chunks)


def fa2_page_walk(page_size: int | None, tile_kv: int) -> str:
    """How an fa2 block finds a kv tile's rows in a paged KV cache: "" contiguous cache; "slice"
    when the page size is a multiple of the tile, so the tile lies in one page (one block-table
    read, then contiguous rows); "rows" when pages are smaller (tiles start on a page; each
    thread reads the entry of every page its rows touch)."""
    if page_size is None:
        return ""
    return "slice" if page_size % tile_kv == 0 else "rows"


FA2_PAGE_RING_MIN = 16   # smaller pages give a row or two per entry: a shared read per row cost registers (ptxas
                         # spilled 60 B at d=128, page 1), so those read the table inline


def fa2_page_ring(page_size: int | None, tile_kv: int, stages: int) -> tuple[int, int]:
    """(slots, entries per slot) of the shared-memory ring that holds an fa2 block's block-table
    entries ahead of its K/V loads; (0, 0) when the loads read the table themselves (contiguous
    cache; one stage: nothing to overlap the read with; pages under FA2_PAGE_RING_MIN keys). A slot holds one kv tile's entries (one
    per page it touches). The copy of tile j + stages - 1's entries rides in tile j's K cp.async
    group, so the entries are in shared memory a whole pipeline step before the loads that use
    them (a table read in front of the prefetch cost 8-11%: paged-prefill-3). The prologue issues
    stages - 1 tiles and copies the entries of the next stages - 1 with no barrier between, so the
    ring holds 2 (stages - 1) tiles; the loop needs `stages` (reads tile j + stages - 1's slot, writes
    tile j + 2 stages - 2's, after a barrier). Entries: the most pages one tile's keys touch."""
    if page_size is None or stages < 2 or page_size < FA2_PAGE_RING_MIN:
        return 0, 0
    straddles = tile_kv % page_size != 0 and page_size % tile_kv != 0   # a tile may start mid-page
    return max(stages, 2 * (stages - 1)), -(-tile_kv // page_size) + straddles


def decode_page_walk(page_size: int | None, keys_per_warp: int) -> str:
    """How a decode warp finds its key slice (keys_per_warp keys starting at a multiple of
    keys_per_warp) in a paged KV cache: "" contiguous cache; "slice" when the page size is a
    multiple of the slice, so every slice lies in one page (one block-table read per slice, then
    the rows are contiguous); "pages" when pages of at least DECODE_PAGE_ROWS_MIN keys tile the
    slice (one read per page, its rows contiguous); "rows" otherwise (small pages, or pages that
    straddle slices: each key row reads its own block-table entry, once per tile)."""
    if page_size is None:
        return ""
    if page_size % keys_per_warp == 0:
        return "slice"
    if page_size >= DECODE_PAGE_ROWS_MIN and keys_per_warp % page_size == 0:
        return "pages"
    return "rows"


# ---- the graph's model: families and dtypes without a template ------------------------------------

def _graph_model(spec: KernelSpec, limits: DeviceLimits) -> Layout:
    """Dense tiles, no alignment, fp32 accumulators: the model `explain` shows for a family (or
    dtype) that has no CUDA template yet; lowering refuses such specs by name."""
    p, s = spec.problem, spec.schedule
    hopper = spec.family is Family.HOPPER
    _mma_divisibility(spec)
    e, S = DTYPE_BYTES[p.dtype], s.stages
    Br, Bc, d, dv = s.tile_q, s.tile_kv, p.head_dim_qk, p.head_dim_v
    buffers = [Buffer("Q", 0, Br * d * e, e, formula=f"Br*d*{e} = {Br}*{d}*{e}"),
               Buffer("K", Br * d * e, S * Bc * d * e, e, S, Bc * d * e, formula=f"{S}x Bc*d*{e} = {S}x {Bc}*{d}*{e}"),
               Buffer("V", (Br + S * Bc) * d * e, S * Bc * dv * e, e, S, Bc * dv * e,
                      formula=f"{S}x Bc*dv*{e} = {S}x {Bc}*{dv}*{e}")]
    if hopper:
        count = 4 * S + 1   # full and empty per K and V slot, plus Q's
        buffers.append(Buffer("mbarriers", buffers[-1].offset + buffers[-1].bytes, MBARRIER_BYTES * count,
                              MBARRIER_BYTES, formula=f"{count} x {MBARRIER_BYTES}"))
        threads = 128 * (s.producer_warpgroups + s.consumer_warpgroups)
        mma_threads, rows = 128 * s.consumer_warpgroups, Br / max(4 * s.consumer_warpgroups, 1)
    else:
        threads = mma_threads = 32 * s.warps
        rows = Br if s.warp_axis is Axis.KV else Br / max(s.warps, 1)
    o_threads = 32 if s.warp_axis is Axis.KV and not hopper and s.warps > 1 else mma_threads
    registers = [Registers("O accumulator", math.ceil(Br * dv / o_threads), f"Br*dv/{o_threads} = {Br}*{dv}/{o_threads}", True),
                 Registers("S/P accumulator", math.ceil(Br * Bc / mma_threads), f"Br*Bc/{mma_threads} = {Br}*{Bc}/{mma_threads}",
                           True),
                 Registers("m, l", 4 * math.ceil(rows / 16), f"2 x 2 rows x ceil({rows:g}/16)", True),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    smem = sum(b.bytes for b in buffers)
    reg_limit = (s.consumer_regs or limits.max_registers_per_thread) if hopper else None
    layout = _finish(spec, "graph model (no template)", limits, buffers, smem, registers, threads, 1, reg_limit,
                     stages=S, generated=False)
    if hopper and s.producer_regs and s.consumer_regs:
        total = 128 * (s.producer_warpgroups * s.producer_regs + s.consumer_warpgroups * s.consumer_regs)
        _require(total <= limits.registers_per_sm, spec, "warpgroups",
                 f"registers: {total} per block (128 x ({s.producer_warpgroups}x{s.producer_regs} + "
                 f"{s.consumer_warpgroups}x{s.consumer_regs})) > {limits.registers_per_sm} per SM")
    return layout


def _mma_divisibility(spec: KernelSpec) -> None:
    """The graph model's MMA shape rules: m16n8k16 (k8 for tf32) in whole steps; wgmma 64 rows
    per consumer warpgroup."""
    p, s = spec.problem, spec.schedule
    k = 8 if p.dtype is DType.FP32 else 16
    if p.head_dim_qk % k or p.head_dim_v % 8:
        _refuse(spec, "head_dim", f"head dim qk {p.head_dim_qk} / v {p.head_dim_v} is not a whole number of MMA "
                f"steps (qk must divide by {k}, v by 8)", f"use a head dim that is a multiple of {k}")
    if spec.family is Family.HOPPER:
        rows = WGMMA_ROWS * max(s.consumer_warpgroups, 1)
        _require(s.tile_q % rows == 0, spec, "tile", f"tile q = {s.tile_q} is not a multiple of {rows} "
                 f"({WGMMA_ROWS} rows per consumer warpgroup for wgmma)", f"use tile q = {rows} or a multiple")
        cols, key = s.tile_kv, "tile"
    elif s.warp_axis is Axis.Q:
        _require(s.tile_q % s.warps == 0 and (s.tile_q // s.warps) % 16 == 0, spec, "warps",
                 f"{s.warps} warps along q give {s.tile_q / s.warps:g} rows each; mma.sync needs a multiple of 16",
                 f"use tile q = {16 * s.warps} or a multiple")
        cols, key = s.tile_kv, "tile"
    else:
        _require(s.tile_q % 16 == 0, spec, "tile", f"tile q = {s.tile_q} is not a multiple of 16 (mma.sync rows)",
                 "use a multiple of 16")
        _require(s.tile_kv % s.warps == 0, spec, "warps", f"{s.warps} warps along kv do not divide tile kv = {s.tile_kv}")
        cols, key = s.tile_kv // s.warps, "warps"
    _require(cols % k == 0, spec, key, f"each warp's kv columns ({cols}) are not a multiple of {k} "
             "(the k step of the P V MMA)", f"use tile kv = a multiple of {k * (s.warps if s.warp_axis is Axis.KV else 1)}")


# ---- the backward (issue 14): kv outer on mma.sync ------------------------------------------------

BACKWARD_PRE_ROWS = 64         # preprocess / convert: q rows per block
BACKWARD_PRE_THREADS = 256
BACKWARD_DQ_TILE_KV = 64       # `dq accumulate separate`: keys per kv tile of the q-outer dQ kernel
BACKWARD_MAX_DIM = 256         # preprocess: a warp's lanes take 2 columns per 64 (u32 loads)
BACKWARD_DQ_VECTORS = (2, 4)   # atomic dQ: fp32 per red.global.add (v4: lane pairs swap halves); the first is the default (v2: the measured one, backward-bench-1; v4 validated on the H200, untimed)


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
    if b.mma is Mma.WGMMA and b.dq.value != "atomic":
        return "the wgmma backward sums dQ with fp32 atomics only (`dq accumulate atomic`)"
    if b.dq.value == "ordered":
        return "`dq accumulate ordered` has no template yet (`separate` is deterministic)"
    return ""


def backward_layout(spec: KernelSpec, limits: DeviceLimits = H200) -> BackwardLayout:
    """Shared memory, registers and warps of the backward kernels (templates/backward.cu.j2); SpecError
    at the backward block's line when they do not fit."""
    b, p = spec.backward, spec.problem
    if b.mma is Mma.WGMMA:
        return _backward_wgmma(spec, limits)
    d, dv, Br, Bc, S = p.head_dim_qk, p.head_dim_v, b.tile_q, b.tile_kv, b.stages
    tile_key = "backward.tile" if spec.span_of("backward.tile") else "backward"
    _require(d % 16 == 0 and dv % 16 == 0 and max(d, dv) <= BACKWARD_MAX_DIM, spec, "head_dim",
             f"head dim qk {d} / v {dv}: the backward needs multiples of 16 up to {BACKWARD_MAX_DIM}")
    _require(Br % 16 == 0 and Bc % (16 * b.warps) == 0, spec, tile_key,
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
        _require(dq_cols and dq_cols % 16 == 0 and dq_cols * (d // max(dq_cols, 1)) == d, spec, tile_key,
                 f"dQ_i ({Br} x {d}) does not split into 16-column blocks over {b.warps} warps",
                 "use warps that divide tile q / 16, or a multiple of it that divides head_dim / 16")
    qk_row, qk_sw = tile_row_bytes(d)
    v_row, v_sw = tile_row_bytes(dv)
    ds_row, ds_sw = tile_row_bytes(Br)
    buffers, end = [], 0

    def add(name, nbytes, stages=1, layout="", formula=""):
        nonlocal end
        buffers.append(Buffer(name, end, nbytes * stages, SMEM_ALIGN, stages, nbytes if stages > 1 else 0, layout, formula))
        end = align(end + nbytes * stages)
    add("K", Bc * qk_row, 1, _row_text(d), _row_formula("Bc", "d", d) + " (kept for the whole q loop)")
    add("V", Bc * v_row, 1, _row_text(dv), _row_formula("Bc", "dv", dv) + " (kept for the whole q loop)")
    add("Q", Br * qk_row, S, _row_text(d), f"{S}x " + _row_formula("Br", "d", d))
    add("dO", Br * v_row, S, _row_text(dv), f"{S}x " + _row_formula("Br", "dv", dv))
    add("LSE", Br * 4, S, "fp32", f"{S}x Br*4")
    add("D", Br * 4, S, "fp32", f"{S}x Br*4")
    if atomic:
        add("dS^T", Bc * ds_row, 1, _row_text(Br), _row_formula("Bc", "Br", Br) + " (A operand of dQ_i = dS K_j)")
    acc = [Registers("dK accumulator", kv_m_tiles * d // 2, f"KV_M_TILES*d/2 = {kv_m_tiles}*{d}/2", True),
           Registers("dV accumulator", kv_m_tiles * dv // 2, f"KV_M_TILES*dv/2 = {kv_m_tiles}*{dv}/2", True),
           Registers("S^T/P^T", kv_m_tiles * Br // 2, f"KV_M_TILES*Br/2 = {kv_m_tiles}*{Br}/2", True),
           Registers("dP^T/dS^T", kv_m_tiles * Br // 2, f"KV_M_TILES*Br/2 = {kv_m_tiles}*{Br}/2", True),
           Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    estimate = sum(r.amount for r in acc)
    _require(estimate <= _register_limit(threads, limits), spec, tile_key,
             f"registers: ~{estimate} per thread estimated (" + " + ".join(f"{r.name} {r.amount}" for r in acc)
             + f") > {_register_limit(threads, limits)} available", "use a smaller tile q, or more warps")
    main = _finish(spec, "backward", limits, buffers, end, acc, threads, 1, stages=S, rows_per_warp=16 * kv_m_tiles)
    dq_buffers, dq_end, dq_threads = [], 0, 0
    if not atomic:
        Bk = BACKWARD_DQ_TILE_KV
        dq_threads = 32 * row_tiles
        for name, nbytes, stages in (("Q", Br * qk_row, 1), ("dO", Br * v_row, 1), ("K", Bk * qk_row, S),
                                     ("V", Bk * v_row, S)):
            dq_buffers.append(Buffer(name, dq_end, nbytes * stages, SMEM_ALIGN, stages, nbytes if stages > 1 else 0))
            dq_end = align(dq_end + nbytes * stages)
        _require(dq_end <= limits.max_shared_per_block, spec, tile_key,
                 f"shared memory of the dQ kernel: {dq_end} bytes > {limits.max_shared_per_block}", "use a smaller tile q")
        dq_regs = d // 2 + Bk + REGISTER_OVERHEAD   # dQ, S and dP accumulators of 16 rows
        _require(dq_regs <= limits.max_registers_per_thread, spec, tile_key,
                 f"registers of the dQ kernel: ~{dq_regs} per thread > {limits.max_registers_per_thread}")
    return BackwardLayout(main, kv_m_tiles, dq_m_tiles, dq_row_groups, dq_cols, tuple(dq_buffers), dq_end, dq_threads)


# ---- the backward on wgmma (templates/backward_wgmma.cu.j2) -----------------------------------------

BACKWARD_WGMMA_TILE_Q = (64, 128)   # q rows per step: one or two 64-column panels of dS^T (wgmma m64 reads one)


def backward_wgmma_dq_split(tile_q: int, head_dim: int) -> str:
    """How the two warpgroups share dQ_i = dS K_j (tile q x head dim): "m" each its 64 query rows
    (tile q 128); "n" each half the columns (tile q 64, head dim a multiple of 128: whole panels of
    K); "k" each its own 64 keys over every column (tile q 64, head dim 64: twice the atomics, but no
    block barrier)."""
    if tile_q == 2 * WGMMA_ROWS:
        return "m"
    return "n" if head_dim % (2 * PANEL_COLUMNS) == 0 else "k"


BACKWARD_WGMMA_DQ_STAGE_PAD = 32   # bytes after each fp32 dQ_i staging row: a half-warp's float2 stores (4 rows) hit distinct banks


def backward_wgmma_dq_stage_row_bytes(head_dim: int) -> int:
    return head_dim * 4 + BACKWARD_WGMMA_DQ_STAGE_PAD


def backward_wgmma_dv_schedule(tile_q: int, head_dim: int) -> tuple[str, bool]:
    """(order, waited) of dV's wgmma in the q loop (lower_backward's _WGMMA_ORDERS). "late" (dV and dK
    issued together after dS^T) was the fastest at every shape of bench/results/2026-12-01-backward-ab-2.json
    (d64 q128 +3-5%, d128 q64 +1-3% over "early") and the lightest on registers; "early" overlaps dV with
    dS^T's arithmetic but keeps P^T's fragments alive over it (at tile q 128 it spills unless dS^T waits
    for dV: ("early", True))."""
    return ("late", False)


def _backward_wgmma(spec: KernelSpec, limits: DeviceLimits) -> BackwardLayout:
    """The wgmma backward's main kernel: 2 warpgroups, each owning 64 kv rows of the 128-row kv tile
    (check_backward's rule); K, V, Q, dO as 128-byte-swizzled 64-column panels (wgmma.cuh.j2)."""
    b, p = spec.backward, spec.problem
    d, dv, Br, Bc, S = p.head_dim_qk, p.head_dim_v, b.tile_q, b.tile_kv, b.stages
    tile_key = "backward.tile" if spec.span_of("backward.tile") else "backward"
    _require(Br in BACKWARD_WGMMA_TILE_Q, spec, tile_key,
             f"tile q = {Br}: the wgmma backward steps 64 or 128 query rows (dS^T's 64-column panels)",
             "use tile q = 64 or 128")
    threads = 32 * b.warps
    for dim in (d, dv):
        _require(threads % (dim // 8) == 0 and (threads // (dim // 8)) % 8 == 0, spec, "head_dim",
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
    _require(estimate <= _register_limit(threads, limits), spec, tile_key,
             f"registers: ~{estimate} per thread estimated (" + " + ".join(f"{r.name} {r.amount}" for r in live)
             + f") > {_register_limit(threads, limits)} available", "use tile q = 64")
    _require(end <= limits.max_shared_per_block, spec, tile_key if S == 1 else "backward.pipeline",
             f"shared memory: {end} bytes needed (" + " + ".join(f"{b.name} {b.bytes}" for b in buffers)
             + f") > {limits.max_shared_per_block} available", "use fewer stages or a smaller tile q")
    main = _finish(spec, "backward_wgmma", limits, buffers, end, acc, threads, 1, stages=S, rows_per_warp=16,
                   launch_registers=estimate)   # the peak live set, not the sum of lifetimes that never overlap
    return BackwardLayout(main, 1, 1, 2 if split == "m" else 1, dq_cols, dq_split=split)


LAYOUTS = {
    (Family.FA2, Mma.SYNC): _fa2,
    (Family.FA2, Mma.WGMMA): _fa2_wgmma,
    (Family.FA1, Mma.SYNC): _fa1,
    (Family.DECODE, Mma.SYNC): _decode,
    (Family.HOPPER, Mma.WGMMA): _hopper,
}
TEMPLATE_DTYPES = (DType.FP16, DType.BF16)


def layout_of(spec: KernelSpec, limits: DeviceLimits = H200, **overrides) -> Layout:
    """The layout of `spec` on `limits`; SpecError at the spec line when it does not fit. The
    overrides are the lowerings' (e.g. decode's stages / tile_kv, fa2's min_blocks_per_sm)."""
    if spec.family is Family.FA1 and spec.schedule.split_kv != 1:
        _refuse(spec, "split", "split kv needs the q-outer order (FA1 already walks kv tiles outermost)",
                "use `order q, kv` or drop `split`")
    if spec.family is Family.HOPPER and spec.schedule.order is LoopOrder.KV_OUTER:
        _refuse(spec, "order", "warp-specialized kernels are built for the q-outer order", "use `order q, kv` with warpgroups")
    build = LAYOUTS.get((spec.family, spec.schedule.mma))
    if build is None or spec.problem.dtype not in TEMPLATE_DTYPES:
        return _graph_model(spec, limits)
    return build(spec, limits, **overrides)
